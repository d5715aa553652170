//! kvrouted: routes LLM inference requests to the worker whose KV cache already holds the
//! longest prefix of the prompt.
//!
//! This crate is the daemon: thin adapters around the pure routing core (`kvrouted-core`,
//! re-exported below under the same module names, so `kvrouted::router::Router` is the core's).
//!
//! # Layout
//!
//! - Core (re-exported): [`router`] the state machine, [`policy`] the policy step by step,
//!   [`input`], [`index`], [`workers`], [`reservations`], [`replicas`] (what replicas tell each
//!   other), [`hashing`], [`wire`].
//! - [`daemon`]: `kvrouted serve` — recovery, then starts the writer, the flusher, ingest and
//!   the HTTP API.
//! - [`writer`]: the single writer that journals and applies inputs in one order; acks after
//!   the flush; snapshots. The typed API the HTTP handlers call.
//! - [`status`]: readiness, written by recovery and ingest, read by `/readyz`.
//! - [`ingest`]: NATS subscriptions and the JetStream consumers; decodes payloads into inputs.
//! - [`decisions`]: publishing this replica's decisions for its peers (theirs arrive through
//!   ingest).
//! - [`http`]: the gateway API (routes, releases, workers, health, metrics).
//! - [`journal`]: the sled journal and snapshots; export for audits.
//! - [`replay`]: re-applies a journal through the core (audit and counterfactuals).
//! - [`sim`]: the simulator, driving the same core with simulated workers.
//! - [`bridge`]: `kvrouted bridge`, the sidecar that makes a vLLM / SGLang / TensorRT-LLM
//!   engine a worker (ZeroMQ KV events to JetStream, load scraped from its metrics endpoint).
//! - [`demo`]: `kvrouted demo`, a live simulated fleet against a running daemon over NATS and
//!   HTTP (first-run demo, staging smoke test, load generator).
//! - [`prom`]: Prometheus metric names and recording, the rate-limited rejection log.
//! - [`config`]: command-line and file configuration.
//! - [`nats_options`]: NATS url, credentials and TLS, shared by every command that connects.

pub use kvrouted_core::{
    hashing, index, input, policy, prefetch, replicas, reservations, router, wire, workers,
};

pub mod bridge;
pub mod config;
pub mod daemon;
pub mod decisions;
pub mod demo;
pub mod http;
pub mod ingest;
pub mod journal;
pub mod nats_options;
pub mod prom;
pub mod replay;
pub mod sim;
pub mod status;
pub mod writer;
