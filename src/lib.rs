//! kvrouted: routes LLM inference requests to the worker whose KV cache already holds the
//! longest prefix of the prompt.
//!
//! This crate is the daemon: thin adapters around the pure routing core (`kvrouted-core`,
//! re-exported below under the same module names, so `kvrouted::router::Router` is the core's).
//!
//! # Layout
//!
//! - Core (re-exported): [`router`] the state machine, [`policy`] the policy step by step,
//!   [`input`], [`index`], [`workers`], [`reservations`], [`hashing`], [`wire`].
//! - [`daemon`]: `kvrouted serve` — starts everything, owns the writer that applies inputs in
//!   journal order.
//! - [`ingest`]: NATS subscriptions and the JetStream consumer; decodes payloads into inputs.
//! - [`http`]: the gateway API (routes, releases, workers, health, metrics).
//! - [`journal`]: the sled journal and snapshots; export for audits.
//! - [`replay`]: re-applies a journal through the core (audit and counterfactuals).
//! - [`sim`]: the simulator, driving the same core with simulated workers.
//! - [`metrics`]: Prometheus metric names and recording.
//! - [`config`]: command-line and file configuration.
//! - [`nats_options`]: NATS url, credentials and TLS, shared by every command that connects.

pub use kvrouted_core::{hashing, index, input, policy, reservations, router, wire, workers};

pub mod config;
pub mod daemon;
pub mod http;
pub mod ingest;
pub mod journal;
pub mod metrics;
pub mod nats_options;
pub mod replay;
pub mod sim;
