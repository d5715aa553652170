//! Shared decisions between replicas (docs/architecture.md, "Scale"): every route and release a
//! replica applies yields a peer event, which this module publishes on
//! `<prefix>.decisions.<replica>` (a JetStream stream with a short max age); the other replicas
//! consume it through ingest and apply it as a journaled input, like a KV event.
//!
//! Publishing is off the route's path: the handler offers the event to a bounded queue and
//! returns; a publisher task sends it and waits for the stream's ack. A full queue drops the
//! event (counted: `kvrouted_decisions_dropped_total{reason}`), never a route. A publish that
//! fails (no ack, e.g. while the client moves to another server of the cluster) is tried again
//! with the same `Nats-Msg-Id`, so the stream stores it once; one that still fails after
//! [`RETRY_FOR`] is counted and given up: peers then lack that one decision, which only costs
//! coalescing (a spill or a reservation they do not see), never their own consistency.

use std::time::Duration;

use async_nats::jetstream::{self, context::Publish};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use metrics::counter;
use tokio::sync::mpsc::{self, error::TrySendError};

use crate::input::{Input, RejectReason, Rejection};
use crate::replicas::PeerEvent;

/// Decisions waiting to be published. A burst of routes beyond it while NATS is slow or away
/// is dropped (counted) rather than held in memory.
const QUEUE: usize = 65_536;

/// Publishes awaiting the stream's ack at once.
const IN_FLIGHT: usize = 1_024;

/// How long one decision is tried before it is given up: longer than a client's move to
/// another server of the cluster, far shorter than the decisions' max age.
const RETRY_FOR: Duration = Duration::from_secs(30);

/// Where routes and releases hand their peer events; cheap to clone.
#[derive(Clone)]
pub struct DecisionSink {
    tx: mpsc::Sender<Box<PeerEvent>>,
}

impl DecisionSink {
    /// Queues a peer event for publishing, without waiting.
    pub fn offer(&self, event: Box<PeerEvent>) {
        let reason = match self.tx.try_send(event) {
            Ok(()) => return,
            Err(TrySendError::Full(_)) => "queue_full",
            Err(TrySendError::Closed(_)) => "stopped",
        };
        counter!("kvrouted_decisions_dropped_total", "reason" => reason).increment(1);
    }
}

/// Pre-registers the decision counters, so dashboards see zeros rather than missing series.
pub fn register_metrics() {
    for reason in ["queue_full", "stopped", "publish_failed"] {
        counter!("kvrouted_decisions_dropped_total", "reason" => reason).absolute(0);
    }
    counter!("kvrouted_decisions_published_total").absolute(0);
    counter!("kvrouted_decisions_publish_retries_total").absolute(0);
}

/// MessagePack (with field names) of a peer event, as it travels on
/// `<prefix>.decisions.<replica>`.
pub fn encode(event: &PeerEvent) -> Vec<u8> {
    rmp_serde::to_vec_named(event).expect("peer events always serialize")
}

/// Decodes a peer's decision from `<prefix>.decisions.<replica>` into the input that applies it.
/// A payload that does not decode, or that names another replica than its subject (a publisher
/// speaking for a replica it is not), is rejected.
pub fn decode(replica: &str, payload: &[u8]) -> Result<Input, Rejection> {
    let event: PeerEvent = rmp_serde::from_slice(payload).map_err(|e| {
        Rejection::new(
            RejectReason::MalformedPayload,
            format!("decision from replica {replica}: {e}"),
        )
    })?;
    if event.replica != replica {
        return Err(Rejection::new(
            RejectReason::InvalidField,
            format!(
                "a decision on the subject of replica {replica} names replica {}",
                event.replica
            ),
        ));
    }
    Ok(Input::Peer(Box::new(event)))
}

/// Starts the publisher of this replica's decisions on `subject`: through JetStream (acked,
/// retried, deduplicated by message id), or on core NATS with `--no-jetstream`.
pub fn spawn_publisher(
    client: async_nats::Client,
    subject: String,
    jetstream: bool,
) -> DecisionSink {
    let (tx, rx) = mpsc::channel(QUEUE);
    tokio::spawn(publish(client, subject, jetstream, rx));
    DecisionSink { tx }
}

async fn publish(
    client: async_nats::Client,
    subject: String,
    jetstream: bool,
    mut rx: mpsc::Receiver<Box<PeerEvent>>,
) {
    let js = jetstream::new(client.clone());
    let mut in_flight = FuturesUnordered::new();
    loop {
        tokio::select! {
            next = rx.recv(), if in_flight.len() < IN_FLIGHT => {
                let Some(event) = next else { break };
                let payload = bytes::Bytes::from(encode(&event));
                if jetstream {
                    // The replica id names the data dir's incarnation, so (replica, sequence)
                    // never repeats: the stream stores a retried decision once.
                    let id = format!("{}-{}", event.replica, event.seq);
                    in_flight.push(publish_acked(js.clone(), subject.clone(), id, payload));
                } else if client.publish(subject.clone(), payload).await.is_ok() {
                    counter!("kvrouted_decisions_published_total").increment(1);
                } else {
                    counter!("kvrouted_decisions_dropped_total", "reason" => "publish_failed")
                        .increment(1);
                }
            }
            Some(published) = in_flight.next(), if !in_flight.is_empty() => {
                if published {
                    counter!("kvrouted_decisions_published_total").increment(1);
                } else {
                    counter!("kvrouted_decisions_dropped_total", "reason" => "publish_failed")
                        .increment(1);
                }
            }
        }
    }
    // The routes are gone (shutdown): let what is under way finish.
    while in_flight.next().await.is_some() {}
}

/// Publishes one decision and waits for the stream's ack, trying again with the same message
/// id (the stream keeps one copy) for up to [`RETRY_FOR`]. Whether it was stored.
async fn publish_acked(
    js: jetstream::Context,
    subject: String,
    id: String,
    payload: bytes::Bytes,
) -> bool {
    let started = tokio::time::Instant::now();
    let mut backoff = Duration::from_millis(50);
    loop {
        let publish = Publish::build().payload(payload.clone()).message_id(&id);
        let error = match js.send_publish(subject.clone(), publish).await {
            Ok(ack) => match ack.await {
                Ok(_) => return true,
                Err(e) => e.to_string(),
            },
            Err(e) => e.to_string(),
        };
        if started.elapsed() + backoff > RETRY_FOR {
            tracing::warn!(
                subject,
                "a decision could not be published within {RETRY_FOR:?}; peers will not see it: {error}"
            );
            return false;
        }
        counter!("kvrouted_decisions_publish_retries_total").increment(1);
        tracing::debug!(subject, "publishing a decision failed, retrying: {error}");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}
