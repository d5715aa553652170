//! Fuzz target `load_sample`: see `kvrouted_core::wire::fuzz::load_sample` for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvrouted_core::wire::fuzz::load_sample(data));
