//! Fuzz target `kv_batch`: see `kvrouted_core::wire::fuzz::kv_batch` for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvrouted_core::wire::fuzz::kv_batch(data));
