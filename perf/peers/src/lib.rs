//! Benchmarks only: see benches/peers.rs.
