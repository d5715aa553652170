//! Readiness: what the daemon reports on `/readyz`. Written by recovery and NATS ingest, read by
//! the HTTP API; neither imports the other for it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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
    /// Ingest reads from a JetStream consumer (not `--no-jetstream`).
    pub jetstream: AtomicBool,
    /// The stream and our durable consumer exist and are being read since the last (re)connect.
    /// Cleared when the connection drops: a broker may come back without them (restarted
    /// empty), and until they exist again events published meanwhile would not be captured.
    pub consumer_live: AtomicBool,
    /// Woken on every (re)connect, so that ingest checks the stream and consumer at once
    /// rather than after the missed heartbeats of a consumer that is gone.
    pub reconnected: tokio::sync::Notify,
}

impl Status {
    /// To call on every NATS connection event of the daemon's client.
    pub fn on_nats_connected(&self, connected: bool) {
        self.nats_connected.store(connected, Ordering::Release);
        if connected {
            self.reconnected.notify_one();
        } else {
            self.consumer_live.store(false, Ordering::Release);
        }
    }
}
