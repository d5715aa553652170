//! Fuzz target `lifecycle`: see `kvrouted_core::wire::fuzz::lifecycle` for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvrouted_core::wire::fuzz::lifecycle(data));
