//! Test kit of kvrouted (dev-only, never published): the real processes and helpers that the
//! integration tests and the benchmarks share.
//!
//! Everything started here is killed on drop and every temp dir removed. Waiting is always
//! polling against a deadline, never a bare sleep.
//!
//! # Layout
//!
//! - [`ports`]: free loopback ports for the servers a test starts, drawn below the kernel's
//!   ephemeral range.
//! - [`processes`]: waiting for a port, finding `nats-server`, the CPU time and memory a
//!   process has used.
//! - [`nats`]: [`Nats`], a nats-server with JetStream and its own storage; [`NatsCluster`], 3
//!   of them clustered, each killable and restartable.
//! - [`daemon`]: [`Daemon`], the `kvrouted` binary under test, and its HTTP helpers;
//!   [`run_to_exit`] for commands that must exit; [`replay_verify`], the audit of a journal.
//! - [`worker`]: [`Worker`], a simulated vLLM worker publishing on NATS; [`prompt`];
//!   [`OwnerAndOther`], the two-worker fleet most daemon tests start from.
//! - [`poll`]: [`eventually`], its blocking twin [`poll_until`], and the [`DEADLINE`] every
//!   wait shares unless it says why not ([`eventually_within`]; [`eventually_within_explained`]
//!   also says why a wait ran out).
//! - [`watchdog`]: a benchmark's time limit, which kills every [`Watched`] process and exits.
//! - [`engine`]: [`engine::TestEngine`], a ZeroMQ publisher that frames, numbers, buffers and
//!   replays KV events exactly as vLLM's and SGLang's `ZmqEventPublisher` do (feature `engine`).
//! - [`counting_alloc`]: a global allocator that counts live heap bytes and allocations, for
//!   memory figures and for checking that a path allocates only what it hands back.
//!   With [`ports`], the only parts without the `processes` feature (the peer benchmark uses
//!   the allocator alone).

pub mod counting_alloc;
#[cfg(feature = "processes")]
pub mod daemon;
#[cfg(feature = "engine")]
pub mod engine;
#[cfg(feature = "processes")]
pub mod nats;
#[cfg(feature = "processes")]
pub mod poll;
pub mod ports;
#[cfg(feature = "processes")]
pub mod processes;
#[cfg(feature = "processes")]
pub mod watchdog;
#[cfg(feature = "processes")]
pub mod worker;

#[cfg(feature = "processes")]
pub use daemon::{
    kvrouted, kvrouted_bin, kvrouted_command, metric_at, plain, replay_verify, run_to_exit,
    series_value, wait_ready_at, Daemon,
};
#[cfg(feature = "processes")]
pub use nats::{Nats, NatsCluster};
#[cfg(feature = "processes")]
pub use poll::{eventually, eventually_within, eventually_within_explained, poll_until, DEADLINE};
pub use ports::free_port;
#[cfg(feature = "processes")]
pub use processes::{
    clk_tck, cpu_ticks, nats_server_bin, read_log, resident_mib, wait_for_port, Process,
};
#[cfg(feature = "processes")]
pub use watchdog::{start_watchdog, ProcessHandle, Watched};
#[cfg(feature = "processes")]
pub use worker::{consumer_settled, gpu_blocks_stored, prompt, OwnerAndOther, Worker};
