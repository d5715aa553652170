//! The routing core of kvrouted: one pure, deterministic state machine.
//!
//! [`router::Router::apply`] folds one journaled input into the state and returns what it did.
//! Nothing in this crate does I/O, reads a clock or draws ambient randomness: time comes with
//! each input and random choices come from an RNG seeded by the input's journal sequence, so the
//! same journal always rebuilds the same state and the same decisions. The daemon crate wraps
//! it with adapters (NATS, HTTP, the journal, the simulator).
//!
//! # Layout
//!
//! - [`input`]: what goes in (KV event batches, load samples, lifecycle messages, routes,
//!   releases, ticks, peer replicas' decisions), already validated and hashed by an adapter.
//! - [`router`]: the state machine and what comes out ([`router::Output`], decisions).
//! - [`policy`]: the pressure-first longest-prefix policy, step by step, and the baselines.
//! - [`index`]: who owns which block (KV events) and the router's own recent records.
//! - [`workers`]: the worker table (state, telemetry, reserved work, sequence numbers).
//! - [`reservations`]: reserved work opened by routes, given back by releases or expiry.
//! - [`replicas`]: what replicas tell each other ([`replicas::PeerEvent`]) and reservation ids
//!   unique across them.
//! - [`hashing`]: block keys from token ids.
//! - [`wire`]: pure decoders and encoders of the NATS payloads.
//! - `prefetch`: the one cache-line hint the index and the route path share.

pub mod hashing;
pub mod index;
pub mod input;
pub mod policy;
mod prefetch;
pub mod replicas;
pub mod reservations;
pub mod router;
pub mod wire;
pub mod workers;
