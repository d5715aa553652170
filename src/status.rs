//! Readiness: what the daemon reports on `/readyz`. Written by recovery and NATS ingest, read by
//! the HTTP API; neither imports the other for it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::prom;

/// Which JetStream feed a consumer reads: the workers' KV events and lifecycle messages, or the
/// peer replicas' decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feed {
    Events,
    Decisions,
}

impl Feed {
    pub const ALL: [Feed; 2] = [Feed::Events, Feed::Decisions];

    /// The feed's name in logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Feed::Events => "events",
            Feed::Decisions => "decisions",
        }
    }
}

/// The readiness of one JetStream consumer.
#[derive(Debug, Default)]
pub struct ConsumerStatus {
    /// Everything the stream held when this process started has been journaled and flushed
    /// (a replica that was away has caught up before it answers routes).
    pub caught_up: AtomicBool,
    /// The stream and our durable consumer exist and are being read since the last (re)connect.
    /// Cleared when the connection drops: a broker may come back without them (restarted
    /// empty), and until they exist again messages published meanwhile would not be captured.
    pub live: AtomicBool,
    /// Woken on every (re)connect, so that the consumer checks its stream at once rather than
    /// after the missed heartbeats of a consumer that is gone.
    pub reconnected: tokio::sync::Notify,
}

#[derive(Debug, Default)]
pub struct Status {
    /// Snapshot loaded and journal replayed.
    pub recovered: AtomicBool,
    /// Core-NATS subscriptions the server has confirmed, and how many ingest needs.
    pub core_subscribed: AtomicUsize,
    pub core_expected: AtomicUsize,
    pub nats_connected: AtomicBool,
    /// Ingest reads from JetStream consumers (not `--no-jetstream`).
    pub jetstream: AtomicBool,
    /// Decisions are shared with peer replicas (`--replica-id`): the decisions feed is read too.
    pub shares_decisions: AtomicBool,
    events: ConsumerStatus,
    decisions: ConsumerStatus,
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
    /// The feeds this daemon reads: the KV events, and the peers' decisions when it shares them.
    pub fn feeds(&self) -> &'static [Feed] {
        if self.shares_decisions.load(Ordering::Acquire) {
            &Feed::ALL
        } else {
            &Feed::ALL[..1]
        }
    }

    pub fn consumer(&self, feed: Feed) -> &ConsumerStatus {
        match feed {
            Feed::Events => &self.events,
            Feed::Decisions => &self.decisions,
        }
    }

    /// Every feed has caught up with what its stream held at start.
    pub fn caught_up(&self) -> bool {
        self.feeds()
            .iter()
            .all(|&f| self.consumer(f).caught_up.load(Ordering::Acquire))
    }

    /// Marks every feed caught up (core NATS has no backlog to catch up with).
    pub fn set_caught_up(&self) {
        for &feed in self.feeds() {
            self.consumer(feed).caught_up.store(true, Ordering::Release);
        }
    }

    /// Some JetStream consumer is not back since the last reconnect.
    pub fn consumer_missing(&self) -> bool {
        self.jetstream.load(Ordering::Acquire)
            && self
                .feeds()
                .iter()
                .any(|&f| !self.consumer(f).live.load(Ordering::Acquire))
    }

    /// To call on every NATS connection event of the daemon's client.
    pub fn on_nats_connected(&self, connected: bool) {
        self.nats_connected.store(connected, Ordering::Release);
        for &feed in self.feeds() {
            let consumer = self.consumer(feed);
            if connected {
                consumer.reconnected.notify_one();
            } else {
                consumer.live.store(false, Ordering::Release);
            }
        }
    }
}
