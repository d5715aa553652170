//! kvrouted: routes LLM inference requests to the worker whose KV cache already holds the
//! longest prefix of the prompt.
//!
//! The crate is one pure, deterministic state machine ([`router::Router`]) and thin adapters
//! around it. Start reading at [`router`], then [`policy`] for DESIGN.md §5.

pub mod bridge;
pub mod config;
pub mod daemon;
pub mod hashing;
pub mod http;
pub mod index;
pub mod ingest;
pub mod input;
pub mod journal;
pub mod metrics;
pub mod nats_connect;
pub mod policy;
pub mod replay;
pub mod reservations;
pub mod router;
pub mod sim;
pub mod wire;
pub mod workers;
