//! Fuzz target `route_body`: see `kvrouted::http::route_body::fuzz` for what it checks. The
//! parser's two source files are compiled in directly: they need serde alone, and depending on
//! the daemon crate would build its runtime, storage and HTTP stack with the fuzzer's
//! instrumentation.
#![no_main]

#[path = "../../src/http/token_list.rs"]
mod token_list;

#[path = "../../src/http/route_body.rs"]
mod route_body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| route_body::fuzz(data));
