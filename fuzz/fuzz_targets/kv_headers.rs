//! Fuzz target `kv_headers`: see `kvrouted_core::wire::fuzz::kv_headers` for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvrouted_core::wire::fuzz::kv_headers(data));
