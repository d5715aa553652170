//! Readiness: what the daemon reports on `/readyz`. Written by recovery and NATS ingest, read by
//! the HTTP API; neither imports the other for it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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
    events: ConsumerStatus,
    decisions: ConsumerStatus,
}

impl Status {
    pub fn consumer(&self, feed: Feed) -> &ConsumerStatus {
        match feed {
            Feed::Events => &self.events,
            Feed::Decisions => &self.decisions,
        }
    }

    /// Every feed has caught up with what its stream held at start.
    pub fn caught_up(&self) -> bool {
        Feed::ALL
            .iter()
            .all(|&f| self.consumer(f).caught_up.load(Ordering::Acquire))
    }

    /// Marks every feed caught up (core NATS has no backlog to catch up with).
    pub fn set_caught_up(&self) {
        for feed in Feed::ALL {
            self.consumer(feed).caught_up.store(true, Ordering::Release);
        }
    }

    /// Some JetStream consumer is not back since the last reconnect.
    pub fn consumer_missing(&self) -> bool {
        self.jetstream.load(Ordering::Acquire)
            && Feed::ALL
                .iter()
                .any(|&f| !self.consumer(f).live.load(Ordering::Acquire))
    }

    /// To call on every NATS connection event of the daemon's client.
    pub fn on_nats_connected(&self, connected: bool) {
        self.nats_connected.store(connected, Ordering::Release);
        for feed in Feed::ALL {
            let consumer = self.consumer(feed);
            if connected {
                consumer.reconnected.notify_one();
            } else {
                consumer.live.store(false, Ordering::Release);
            }
        }
    }
}
