//! Readiness: what the daemon reports on `/readyz`. Written by recovery and NATS ingest, read by
//! the HTTP API; neither imports the other for it.

use std::sync::atomic::{AtomicBool, AtomicUsize};

#[derive(Debug, Default)]
pub struct Status {
    /// Snapshot loaded and journal replayed.
    pub recovered: AtomicBool,
    /// The JetStream backlog present at start has been consumed.
    pub caught_up: AtomicBool,
    /// Core-NATS subscriptions the server has confirmed, and how many ingest needs.
    pub core_subscribed: AtomicUsize,
    pub core_expected: AtomicUsize,
    pub nats_connected: AtomicBool,
}
