//! Readiness: what the daemon reports on `/readyz`. Written by recovery and NATS ingest, read by
//! the HTTP API; neither imports the other for it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::prom;

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
    /// Set by the writer or the flusher when a journal write fails: shared with both.
    pub journal_fault: Arc<JournalFault>,
}

/// A failed journal write, once there has been one. From then on the live state may hold an
/// input the journal does not (an input is applied, then appended), and what the journal holds
/// may not all be durable. The daemon must not answer from that state nor snapshot it: it
/// refuses every input (routes get a 503), `/readyz` says why, and the daemon exits with
/// [`EXIT_STORAGE_FAULT`] so that a supervisor restarts it from the journal. The inputs lost
/// that way are safe: JetStream messages are acked only after their entry is flushed, so it
/// delivers them again; routes and releases refused or unanswered are retried by gateways.
#[derive(Debug, Default)]
pub struct JournalFault {
    reason: OnceLock<String>,
    occurred: tokio::sync::Notify,
}

/// The exit code of a daemon stopped by a storage fault (a journal write failed while serving,
/// or the final snapshot did not finish within the shutdown deadline): `EX_IOERR` of
/// sysexits(3). Non-zero, so `Restart=on-failure` and orchestrators restart it.
pub const EXIT_STORAGE_FAULT: u8 = 74;

impl JournalFault {
    /// Records a failed journal write (`what`: "append" or "flush"). The first one is the
    /// reason reported; every one is counted, and logged at most once per second.
    pub fn record(&self, what: &'static str, error: &str) {
        metrics::counter!("kvrouted_journal_errors_total").increment(1);
        let first = self
            .reason
            .set(format!("journal {what} failed: {error}"))
            .is_ok();
        if first {
            tracing::error!(
                "journal {what} failed: {error}; refusing every input from now on and exiting \
                 for a restart from the journal (JetStream redelivers what was not flushed)"
            );
            self.occurred.notify_waiters();
        } else if let Some(suppressed) = prom::log_allowed("journal_fault") {
            tracing::error!(suppressed, "journal {what} failed again: {error}");
        }
    }

    /// Counts an input refused because of the fault, and logs it at a bounded rate.
    pub fn refuse(&self, source: &str) {
        metrics::counter!("kvrouted_journal_fault_refusals_total").increment(1);
        if let Some(suppressed) = prom::log_allowed("journal_fault_refusal") {
            tracing::warn!(
                source,
                suppressed,
                "input refused: the journal cannot be written"
            );
        }
    }

    /// Why the journal failed, once it has.
    pub fn reason(&self) -> Option<&str> {
        self.reason.get().map(String::as_str)
    }

    pub fn failed(&self) -> bool {
        self.reason.get().is_some()
    }

    /// Completes once a journal write has failed.
    pub async fn occurred(&self) {
        let notified = self.occurred.notified();
        if self.failed() {
            return;
        }
        notified.await;
    }
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
