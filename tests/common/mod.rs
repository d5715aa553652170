//! Test harness of the integration tests: the shared test kit (real nats-server processes on
//! free loopback ports with their own storage, the real `kvrouted` binary, real HTTP; see
//! `crates/testkit`), re-exported so every test keeps `mod common; use common::*;`.
#![allow(dead_code, unused_imports)]

pub use kvrouted_testkit::*;
