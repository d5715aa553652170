//! NATS ingest (docs/architecture.md, "Wire contract"): KV events and lifecycle messages from a JetStream durable
//! consumer (or core NATS with `--no-jetstream`), load samples from core NATS. Each message is
//! decoded here, outside the single writer, and handed over as a finished input.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use async_nats::HeaderMap;
use futures::{FutureExt, StreamExt};

use crate::decisions;
use crate::input::{Input, RejectReason, Rejection, WorkerId};
use crate::prom::reject;
use crate::status::{Feed, Status};
use crate::wire;
use crate::writer::{Ack, AckFuture, Acknowledge, WriterGone, WriterHandle};

pub struct IngestSettings {
    pub subject_prefix: String,
    pub stream: String,
    pub consumer: String,
    pub jetstream: bool,
    pub max_payload_bytes: usize,
    /// JetStream replicas of the streams this daemon creates (or raises).
    pub stream_replicas: usize,
    /// This replica's name when it shares decisions: its own come back on
    /// `<prefix>.decisions.<replica_id>` and are skipped. None: it runs alone and reads none.
    pub replica_id: Option<String>,
    /// The stream of every replica's decisions, its retention, and this replica's durable
    /// consumer of it (when it shares decisions).
    pub decisions_stream: String,
    pub decisions_max_age: Duration,
    pub decisions_consumer: Option<String>,
}

impl IngestSettings {
    /// The stream and durable consumer a feed reads.
    fn feed(&self, feed: Feed) -> (stream::Config, &str) {
        let prefix = &self.subject_prefix;
        match feed {
            Feed::Events => (
                stream::Config {
                    num_replicas: self.stream_replicas,
                    ..stream_config(&self.stream, prefix)
                },
                &self.consumer,
            ),
            Feed::Decisions => (
                stream::Config {
                    num_replicas: self.stream_replicas,
                    ..decisions_stream_config(
                        &self.decisions_stream,
                        prefix,
                        self.decisions_max_age,
                    )
                },
                self.decisions_consumer
                    .as_deref()
                    .expect("the decisions feed is read only by a replica sharing decisions"),
            ),
        }
    }
}

/// The kind of a subject under the prefix, and its worker token (a replica's name for
/// decisions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Events,
    Load,
    Workers,
    Decisions,
}

fn parse_subject<'a>(prefix: &str, subject: &'a str) -> Result<(Kind, &'a str), Rejection> {
    let rest = subject
        .strip_prefix(prefix)
        .and_then(|r| r.strip_prefix('.'))
        .ok_or_else(|| {
            Rejection::new(
                RejectReason::MalformedPayload,
                format!("unexpected subject {subject}"),
            )
        })?;
    let (kind, worker) = rest.split_once('.').ok_or_else(|| {
        Rejection::new(
            RejectReason::InvalidWorkerId,
            format!("subject {subject} names no worker"),
        )
    })?;
    let kind = match kind {
        "events" => Kind::Events,
        "load" => Kind::Load,
        "workers" => Kind::Workers,
        "decisions" => Kind::Decisions,
        _ => {
            return Err(Rejection::new(
                RejectReason::MalformedPayload,
                format!("unexpected subject {subject}"),
            ))
        }
    };
    Ok((kind, worker))
}

/// Decodes one message into an input, with the rejections of the parts of it that were left
/// out (a lifecycle message's bad optional fields): those are counted, the input still applied.
/// `None` for this replica's own decisions: they were applied when it made them.
fn decode(
    settings: &IngestSettings,
    subject: &str,
    headers: Option<&HeaderMap>,
    payload: &[u8],
) -> Result<Option<(Input, Vec<Rejection>)>, Rejection> {
    let (kind, token) = parse_subject(&settings.subject_prefix, subject)?;
    if kind == Kind::Decisions && Some(token) == settings.replica_id.as_deref() {
        return Ok(None);
    }
    if payload.len() > settings.max_payload_bytes {
        return Err(Rejection::new(
            RejectReason::OversizePayload,
            format!(
                "{subject}: {} bytes exceeds the {}-byte limit",
                payload.len(),
                settings.max_payload_bytes
            ),
        ));
    }
    if kind == Kind::Decisions {
        let input = decisions::decode(token, payload)?;
        return Ok(Some((input, Vec::new())));
    }
    let worker = WorkerId::new(token)
        .map_err(|e| Rejection::new(RejectReason::InvalidWorkerId, e.to_string()))?;
    let header = |name: &str| headers.and_then(|h| h.get(name)).map(|v| v.as_str());
    let decoded = match kind {
        Kind::Events => {
            let headers = wire::parse_kv_headers(
                header("Kv-Seq"),
                header("Kv-Model"),
                header("Kv-Dp-Rank"),
                header("Kv-Epoch"),
            )?;
            let batch = wire::decode_kv_batch(payload, worker, headers)?;
            (Input::KvEvents(batch), Vec::new())
        }
        Kind::Load => {
            let headers =
                wire::parse_kv_headers(None, header("Kv-Model"), header("Kv-Dp-Rank"), None)?;
            let mut sample = wire::decode_load(payload, worker)?;
            if sample.model.is_none() {
                sample.model = headers.model;
            }
            sample.dp_rank = headers.dp_rank.unwrap_or(0);
            (Input::Load(sample), Vec::new())
        }
        Kind::Workers => {
            let (lifecycle, rejected) = wire::decode_lifecycle(payload, worker)?;
            (Input::Lifecycle(lifecycle), rejected)
        }
        Kind::Decisions => unreachable!("decisions are decoded above"),
    };
    Ok(Some(decoded))
}

/// Core-NATS subscription loop (load samples; everything with `--no-jetstream`).
async fn run_core(
    client: async_nats::Client,
    subject: String,
    settings: Arc<IngestSettings>,
    writer: WriterHandle,
    status: Arc<Status>,
) {
    let mut counted = false;
    loop {
        match client.subscribe(subject.clone()).await {
            Ok(mut sub) => {
                // The flush round-trips to the server, so once it returns the subscription is
                // live there: readiness then means samples published from now on arrive.
                if client.flush().await.is_ok() && !counted {
                    status.core_subscribed.fetch_add(1, Ordering::AcqRel);
                    counted = true;
                }
                tracing::info!(subject, "subscribed");
                while let Some(msg) = sub.next().await {
                    match decode(&settings, &msg.subject, msg.headers.as_ref(), &msg.payload) {
                        Ok(Some((input, rejected))) => {
                            rejected.iter().for_each(|r| reject(r, "nats"));
                            if writer.submit(input, "nats", None).await.is_err() {
                                return;
                            }
                        }
                        Ok(None) => {}
                        Err(r) => reject(&r, "nats"),
                    }
                }
                tracing::warn!(subject, "subscription ended; resubscribing");
            }
            Err(e) => tracing::warn!(subject, "subscribe failed: {e}"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Why a consumer loop starts over at once: the connection came back, and the broker may have
/// come back without the stream or the consumer.
struct Reconnected;

impl std::fmt::Display for Reconnected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("reconnected")
    }
}

/// The JetStream stream that captures KV events and lifecycle messages. The daemon and the
/// engine bridge both create it when missing, with the same settings.
pub fn stream_config(name: &str, prefix: &str) -> stream::Config {
    stream::Config {
        name: name.to_string(),
        subjects: vec![format!("{prefix}.events.>"), format!("{prefix}.workers.>")],
        storage: stream::StorageType::File,
        ..Default::default()
    }
}

/// Bytes the decisions stream keeps at most (the oldest go first): a route's decision carries
/// its prompt's block keys, so a busy fleet's decisions can outgrow the max age's worth of disk.
pub const DECISIONS_MAX_BYTES: i64 = 1 << 30;

/// The JetStream stream of every replica's decisions (`<prefix>.decisions.<replica>`). Short
/// lived on purpose: a decision matters for the spill cooldown, the routing records' TTL and a
/// reservation's TTL; a replica away for longer rebuilds ownership from the KV events alone.
/// Bounded by [`DECISIONS_MAX_BYTES`] too.
pub fn decisions_stream_config(name: &str, prefix: &str, max_age: Duration) -> stream::Config {
    stream::Config {
        name: name.to_string(),
        subjects: vec![format!("{prefix}.decisions.>")],
        storage: stream::StorageType::File,
        max_age,
        max_bytes: DECISIONS_MAX_BYTES,
        ..Default::default()
    }
}

/// Gets the stream, creating it as `wanted` if missing. An existing stream with fewer replicas
/// than asked (e.g. created by a bridge, or before the cluster grew) is raised to them, and a
/// decisions stream takes the asked max age, so `--stream-replicas` and the decisions' max age
/// hold whoever created the stream first. A failed update is logged; the stream is used as it
/// is.
async fn ensure_stream(
    js: &jetstream::Context,
    wanted: stream::Config,
) -> Result<stream::Stream, String> {
    let stream = js
        .get_or_create_stream(wanted.clone())
        .await
        .map_err(|e| format!("stream {}: {e}", wanted.name))?;
    let current = stream.cached_info().config.clone();
    let raise_replicas = current.num_replicas < wanted.num_replicas;
    let set_max_age = !wanted.max_age.is_zero() && current.max_age != wanted.max_age;
    if raise_replicas || set_max_age {
        let updated = stream::Config {
            num_replicas: current.num_replicas.max(wanted.num_replicas),
            max_age: if set_max_age {
                wanted.max_age
            } else {
                current.max_age
            },
            ..current.clone()
        };
        match js.update_stream(&updated).await {
            Ok(_) => tracing::info!(
                stream = wanted.name,
                replicas = updated.num_replicas,
                max_age = ?updated.max_age,
                "updated the JetStream stream's replicas and max age"
            ),
            Err(e) => tracing::warn!(
                stream = wanted.name,
                replicas = current.num_replicas,
                wanted_replicas = wanted.num_replicas,
                "could not update the JetStream stream (used as it is): {e}"
            ),
        }
    }
    Ok(stream)
}

/// Acknowledged once every entry journaled before it is durable: marks a feed caught up with
/// the backlog its stream held when the consumer started.
struct CaughtUp {
    status: Arc<Status>,
    feed: Feed,
}

impl Acknowledge for CaughtUp {
    fn ack(&self) -> AckFuture<'_> {
        Box::pin(async move {
            let consumer = self.status.consumer(self.feed);
            if !consumer.caught_up.swap(true, Ordering::AcqRel) {
                tracing::info!(
                    feed = self.feed.name(),
                    "caught up with the stream's backlog"
                );
            }
            Ok(())
        })
    }
}

/// JetStream consumer loop of one feed: creates the stream and durable consumer if missing,
/// recreates the message stream with backoff whenever it breaks (broker restart, network).
/// After every reconnect it checks at once that the stream and consumer still exist, and
/// recreates them if the broker came back without them (restarted empty): waiting for the
/// missed heartbeats would take seconds, and events published meanwhile would be lost.
///
/// The feed is caught up once every message up to the stream's last sequence at start (or up
/// to the end, whichever comes first) is journaled and flushed: a replica that was away answers
/// routes only with what it missed applied.
async fn run_jetstream(
    client: async_nats::Client,
    settings: Arc<IngestSettings>,
    feed: Feed,
    writer: WriterHandle,
    status: Arc<Status>,
) {
    let js = jetstream::new(client.clone());
    let (stream_config, consumer_name) = settings.feed(feed);
    let consumer_name = consumer_name.to_string();
    let consumer_status = status.consumer(feed);
    let source = match feed {
        Feed::Events => "jetstream",
        Feed::Decisions => "decisions",
    };
    let mut backoff = Duration::from_millis(100);
    // Sent once: the in-order marker that sets `caught_up` after the backlog's flush.
    let mut marker_sent = false;
    // What this process has handed over from the durable consumer.
    let mut order = DeliveryOrder::default();
    loop {
        let result: Result<(), String> = async {
            let stream = ensure_stream(&js, stream_config.clone()).await?;
            // The backlog to catch up with: everything the stream holds now.
            let target = stream.cached_info().state.last_sequence;
            if target < order.last_stream_seq {
                // The broker came back with a new, shorter stream: its sequences start over.
                order = DeliveryOrder::default();
            }
            let mut consumer: jetstream::consumer::Consumer<pull::Config> = stream
                .get_or_create_consumer(
                    &consumer_name,
                    pull::Config {
                        durable_name: Some(consumer_name.clone()),
                        // Cumulative: one ack per journal flush covers every message before it.
                        ack_policy: jetstream::consumer::AckPolicy::All,
                        ack_wait: Duration::from_secs(30),
                        max_ack_pending: 100_000,
                        ..Default::default()
                    },
                )
                .await
                .map_err(|e| format!("consumer {consumer_name}: {e}"))?;
            // Whatever the consumer delivered and never got acknowledged for (received by a
            // process that died, or lost in transit when a server went away) comes first.
            consumer =
                rewind_consumer(&client, &stream, consumer, &writer, feed, &mut order).await?;
            // A durable created by an earlier version acks explicitly; its policy cannot change
            // in place, so follow whatever it has.
            let cumulative =
                consumer.cached_info().config.ack_policy == jetstream::consumer::AckPolicy::All;
            let pending = consumer.info().await.map(|i| i.num_pending).unwrap_or(1);
            if pending == 0
                && mark_caught_up(&writer, &status, feed, &mut marker_sent)
                    .await
                    .is_err()
            {
                return Ok(());
            }
            tracing::info!(
                stream = stream_config.name,
                consumer = consumer_name,
                backlog = pending,
                up_to_stream_seq = target,
                "consuming"
            );
            let mut messages = consumer
                .stream()
                .max_messages_per_batch(1024)
                .heartbeat(Duration::from_secs(5))
                .messages()
                .await
                .map_err(|e| format!("messages: {e}"))?;
            backoff = Duration::from_millis(100);
            consumer_status.live.store(true, Ordering::Release);
            // Set when the broker came back without the stream or the consumer: what is still
            // buffered here was delivered before and is handed over, then both are recreated.
            let mut draining = false;
            loop {
                let msg = if draining {
                    match messages.next().now_or_never() {
                        Some(Some(Ok(msg))) => msg,
                        _ => return Err(Reconnected.to_string()),
                    }
                } else {
                    let msg = tokio::select! {
                        msg = messages.next() => msg,
                        () = consumer_status.reconnected.notified() => {
                            if consumer_status.live.load(Ordering::Acquire) {
                                continue; // the connect this consumer was set up after
                            }
                            if consumer_exists(&js, &stream_config.name, &consumer_name).await {
                                // The broker kept its state: this message stream carries on.
                                consumer_status.live.store(true, Ordering::Release);
                            } else {
                                draining = true;
                                // The broker lost its state: the stream starts over too.
                                order = DeliveryOrder::default();
                            }
                            continue;
                        }
                    };
                    let Some(msg) = msg else { break };
                    msg.map_err(|e| format!("message stream: {e}"))?
                };
                let mut backlog_done = false;
                let mut handed_before = false;
                if let Ok(info) = msg.info() {
                    match order.check(info.consumer_sequence, info.stream_sequence) {
                        Delivery::Next => {}
                        Delivery::Handed => handed_before = true,
                        Delivery::Lost { missing } => {
                            // Applying this one and acknowledging it (cumulatively) would
                            // drop the lost ones for good, and apply events out of order.
                            metrics::counter!("kvrouted_ingest_lost_deliveries_total", "feed" => feed.name())
                                .increment(missing);
                            tracing::warn!(
                                feed = feed.name(),
                                missing,
                                stream_seq = info.stream_sequence,
                                "deliveries from the consumer were lost in transit (a server \
                                 went away): delivering again from the ack floor"
                            );
                            return Err(LOST_DELIVERIES.to_string());
                        }
                    }
                    if feed == Feed::Events {
                        let lag =
                            (time::OffsetDateTime::now_utc() - info.published).as_seconds_f64();
                        metrics::gauge!("kvrouted_ingest_lag_seconds").set(lag.max(0.0));
                        metrics::gauge!("kvrouted_ingest_pending_messages")
                            .set(info.pending as f64);
                    }
                    backlog_done = info.pending == 0 || info.stream_sequence >= target;
                }
                let (msg, acker) = msg.split();
                let ack = Ack {
                    acker: Box::new(JetStreamAck(acker)),
                    cumulative,
                };
                let handed = if handed_before {
                    // Delivered again after the consumer was rewound: applied already.
                    writer.ack_in_order(ack).await
                } else {
                    match decode(&settings, &msg.subject, msg.headers.as_ref(), &msg.payload) {
                        Ok(Some((input, rejected))) => {
                            rejected.iter().for_each(|r| reject(r, source));
                            writer.submit(input, source, Some(ack)).await
                        }
                        // This replica's own decision, already applied when it was made.
                        Ok(None) => writer.ack_in_order(ack).await,
                        Err(r) => {
                            reject(&r, source);
                            // Nothing to journal: acknowledge (after the messages before it) so a bad
                            // message is not redelivered forever.
                            writer.ack_in_order(ack).await
                        }
                    }
                };
                if handed.is_err() {
                    return Ok(());
                }
                if backlog_done
                    && mark_caught_up(&writer, &status, feed, &mut marker_sent)
                        .await
                        .is_err()
                {
                    return Ok(());
                }
            }
            Err("message stream ended".to_string())
        }
        .await;
        match result {
            Ok(()) => return,
            Err(e) if e == LOST_DELIVERIES => {}
            Err(e) if e == Reconnected.to_string() => {
                tracing::info!(
                    feed = feed.name(),
                    "NATS reconnected: checking the JetStream stream and consumer"
                );
            }
            Err(e) => {
                tracing::warn!(
                    feed = feed.name(),
                    "JetStream ingest interrupted, retrying in {backoff:?}: {e}"
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Why a consumer loop starts over at once: deliveries were lost; starting over rewinds the
/// consumer.
const LOST_DELIVERIES: &str = "lost deliveries";

/// Where a delivery stands against what this process handed over from the same consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Delivery {
    /// The next message: hand it over.
    Next,
    /// A message handed over before (delivered again after a rewind): skip it.
    Handed,
    /// Deliveries before this one never arrived (a server of the cluster went away with them).
    Lost { missing: u64 },
}

/// The order of one durable consumer's deliveries in this process. A consumer numbers every
/// delivery (`consumer_sequence`, redeliveries included), so a skipped number is a delivery
/// that was lost in transit. It must not be stepped over: acknowledging a later message
/// cumulatively would acknowledge the lost one, and a KV event applied out of order is applied
/// wrong. The consumer is rewound instead (see [`rewind_consumer`]).
#[derive(Debug, Default)]
struct DeliveryOrder {
    last_consumer_seq: Option<u64>,
    /// Every message of the stream up to here was handed over (or deliberately skipped).
    last_stream_seq: u64,
}

impl DeliveryOrder {
    fn check(&mut self, consumer_seq: u64, stream_seq: u64) -> Delivery {
        if let Some(last) = self.last_consumer_seq {
            if consumer_seq > last + 1 {
                return Delivery::Lost {
                    missing: consumer_seq - last - 1,
                };
            }
        }
        // A number at or below the last one: a new consumer leader numbering again; follow it.
        self.last_consumer_seq = Some(consumer_seq);
        if stream_seq <= self.last_stream_seq {
            return Delivery::Handed;
        }
        self.last_stream_seq = stream_seq;
        Delivery::Next
    }

    /// The consumer was created again: its numbering starts over; the stream's does not.
    fn consumer_recreated(&mut self) {
        self.last_consumer_seq = None;
    }
}

/// Makes the durable consumer deliver again, in stream order, what it delivered but was never
/// acknowledged for, before anything newer: at start (a previous process died with them) and
/// whenever deliveries were lost. JetStream alone would redeliver those only after `ack_wait`,
/// behind newer messages whose cumulative ack would cover them, and a replica would call itself
/// caught up without them. First everything handed over is journaled and acknowledged, so no
/// ack meant for the old consumer reaches the new one past its start; then the consumer is
/// rewound to its ack floor ([`rewind_to_ack_floor`]), and this process's delivery order
/// follows the new consumer's numbering.
async fn rewind_consumer(
    client: &async_nats::Client,
    stream: &stream::Stream,
    consumer: jetstream::consumer::Consumer<pull::Config>,
    writer: &WriterHandle,
    feed: Feed,
    order: &mut DeliveryOrder,
) -> Result<jetstream::consumer::Consumer<pull::Config>, String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    writer
        .ack_in_order(Ack {
            acker: Box::new(Drained(std::sync::Mutex::new(Some(tx)))),
            cumulative: false,
        })
        .await
        .map_err(|e| e.to_string())?;
    rx.await
        .map_err(|_| "the journal stopped before the handed-over messages were acknowledged")?;
    client.flush().await.map_err(|e| format!("flush: {e}"))?;
    let name = consumer
        .cached_info()
        .config
        .durable_name
        .clone()
        .unwrap_or_default();
    match rewind_to_ack_floor(stream, &name).await? {
        None => Ok(consumer),
        Some((from, unacked)) => {
            tracing::warn!(
                feed = feed.name(),
                consumer = name,
                unacked,
                from_stream_seq = from,
                "rewound the consumer: its unacknowledged messages are delivered again, in order"
            );
            metrics::counter!("kvrouted_ingest_rewinds_total", "feed" => feed.name()).increment(1);
            order.consumer_recreated();
            stream
                .get_consumer(&name)
                .await
                .map_err(|e| format!("consumer {name}: {e}"))
        }
    }
}

/// Recreates durable consumer `name` of `stream` with its settings, starting after its ack
/// floor, when it delivered messages that were never acknowledged: they are delivered again at
/// once and in order. Each replica owns its durable consumers, so nobody else reads from them.
/// A stream whose retention is not `limits` (interest or work queue) could drop messages while
/// the consumer is gone, so it is left alone. `Some((first stream sequence delivered again,
/// how many were unacknowledged))` when it rewound.
pub async fn rewind_to_ack_floor(
    stream: &stream::Stream,
    name: &str,
) -> Result<Option<(u64, usize)>, String> {
    let retention = stream
        .get_info()
        .await
        .map_err(|e| e.to_string())?
        .config
        .retention;
    let info = stream
        .consumer_info(name)
        .await
        .map_err(|e| format!("consumer {name}: {e}"))?;
    if info.num_ack_pending == 0 || retention != stream::RetentionPolicy::Limits {
        return Ok(None);
    }
    let from = info.ack_floor.stream_sequence + 1;
    let mut config = info.config.clone();
    config.deliver_policy = jetstream::consumer::DeliverPolicy::ByStartSequence {
        start_sequence: from,
    };
    stream
        .delete_consumer(name)
        .await
        .map_err(|e| format!("delete: {e}"))?;
    stream
        .create_consumer(config)
        .await
        .map_err(|e| format!("recreate: {e}"))?;
    Ok(Some((from, info.num_ack_pending)))
}

/// Acknowledged once everything handed over before it is journaled, flushed and acknowledged.
struct Drained(std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>);

impl Acknowledge for Drained {
    fn ack(&self) -> AckFuture<'_> {
        Box::pin(async move {
            if let Some(tx) = self.0.lock().unwrap().take() {
                let _ = tx.send(());
            }
            Ok(())
        })
    }
}

/// Queues the caught-up marker once (`sent` remembers it): the feed counts as caught up when
/// the writer reaches it, after everything handed over before it is journaled and flushed.
async fn mark_caught_up(
    writer: &WriterHandle,
    status: &Arc<Status>,
    feed: Feed,
    sent: &mut bool,
) -> Result<(), WriterGone> {
    if *sent {
        return Ok(());
    }
    *sent = true;
    writer.ack_in_order(caught_up_marker(status, feed)).await
}

fn caught_up_marker(status: &Arc<Status>, feed: Feed) -> Ack {
    Ack {
        acker: Box::new(CaughtUp {
            status: status.clone(),
            feed,
        }),
        cumulative: false,
    }
}

/// A JetStream message's acknowledgement, as the writer acks it after the journal flush.
struct JetStreamAck(jetstream::message::Acker);

impl Acknowledge for JetStreamAck {
    fn ack(&self) -> AckFuture<'_> {
        Box::pin(async move { self.0.ack().await.map_err(|e| e.to_string()) })
    }
}

/// Whether the broker has our stream and durable consumer (after a reconnect: a broker
/// restarted without its storage has neither). An unanswered check counts as missing: they are
/// then created if missing, or the message stream is set up again.
async fn consumer_exists(js: &jetstream::Context, stream: &str, consumer: &str) -> bool {
    let check = async {
        let stream = js.get_stream(stream).await.ok()?;
        stream.consumer_info(consumer).await.ok()
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), check).await,
        Ok(Some(_))
    )
}

/// Runs every ingest loop until the writer goes away.
pub async fn run(
    client: async_nats::Client,
    settings: IngestSettings,
    writer: WriterHandle,
    status: Arc<Status>,
) {
    let settings = Arc::new(settings);
    let prefix = settings.subject_prefix.clone();
    let mut tasks = tokio::task::JoinSet::new();
    status
        .jetstream
        .store(settings.jetstream, Ordering::Release);
    let kinds: &[&str] = if settings.replica_id.is_some() {
        &["events", "workers", "decisions"]
    } else {
        &["events", "workers"]
    };
    let expected = if settings.jetstream {
        1
    } else {
        1 + kinds.len()
    };
    status.core_expected.store(expected, Ordering::Release);
    tasks.spawn(run_core(
        client.clone(),
        format!("{prefix}.load.>"),
        settings.clone(),
        writer.clone(),
        status.clone(),
    ));
    if settings.jetstream {
        for &feed in status.feeds() {
            tasks.spawn(run_jetstream(
                client.clone(),
                settings.clone(),
                feed,
                writer.clone(),
                status.clone(),
            ));
        }
    } else {
        // Core NATS keeps no backlog: there is nothing to catch up with, and what is published
        // while this daemon is down (events and peers' decisions alike) is lost.
        status.set_caught_up();
        for kind in kinds {
            tasks.spawn(run_core(
                client.clone(),
                format!("{prefix}.{kind}.>"),
                settings.clone(),
                writer.clone(),
                status.clone(),
            ));
        }
    }
    while tasks.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_name_kind_and_worker() {
        assert_eq!(
            parse_subject("kv", "kv.events.w-1").unwrap(),
            (Kind::Events, "w-1")
        );
        assert_eq!(
            parse_subject("kv", "kv.load.a:b").unwrap(),
            (Kind::Load, "a:b")
        );
        assert_eq!(
            parse_subject("kv", "kv.events.a.b").unwrap().1,
            "a.b",
            "a dotted worker token is passed on to be rejected by the id rule"
        );
        assert!(parse_subject("kv", "other.events.w").is_err());
    }

    #[test]
    fn a_skipped_delivery_number_is_a_lost_delivery_and_nothing_after_it_is_handed_over() {
        let mut order = DeliveryOrder::default();
        assert_eq!(order.check(1, 10), Delivery::Next);
        assert_eq!(order.check(2, 11), Delivery::Next);
        assert_eq!(
            order.check(5, 14),
            Delivery::Lost { missing: 2 },
            "deliveries 3 and 4 never arrived: 5 must wait for them"
        );
        assert_eq!(
            order.check(5, 14),
            Delivery::Lost { missing: 2 },
            "a lost delivery does not advance the order"
        );
    }

    #[test]
    fn after_a_rewind_messages_handed_over_before_are_skipped_and_the_rest_follow_in_order() {
        let mut order = DeliveryOrder::default();
        for (cseq, sseq) in [(1, 10), (2, 11), (3, 12)] {
            assert_eq!(order.check(cseq, sseq), Delivery::Next);
        }
        order.consumer_recreated();
        assert_eq!(
            order.check(1, 11),
            Delivery::Handed,
            "the recreated consumer starts at the ack floor: handed over already"
        );
        assert_eq!(order.check(2, 12), Delivery::Handed);
        assert_eq!(order.check(3, 13), Delivery::Next, "then the first new one");
        assert_eq!(
            order.check(4, 12),
            Delivery::Handed,
            "a redelivery after ack_wait (a new delivery number, an old message) is skipped"
        );
    }

    fn settings() -> IngestSettings {
        IngestSettings {
            subject_prefix: "kv".into(),
            stream: "KVROUTED".into(),
            consumer: "kvrouted".into(),
            jetstream: true,
            max_payload_bytes: 1 << 20,
            stream_replicas: 1,
            replica_id: Some("r1".into()),
            decisions_stream: "KVROUTED_DECISIONS".into(),
            decisions_max_age: Duration::from_secs(600),
            decisions_consumer: Some("kvrouted-decisions-r1".into()),
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, *v);
        }
        h
    }

    #[test]
    fn kv_epoch_header_reaches_the_batch_and_a_bad_one_rejects_it() {
        let payload = wire::encode_vllm_batch(1.0, &[wire::VllmEvent::AllBlocksCleared], None);
        let h = headers(&[("Kv-Epoch", "boot-2"), ("Kv-Seq", "3")]);
        match decode(&settings(), "kv.events.w", Some(&h), &payload) {
            Ok(Some((Input::KvEvents(batch), rejected))) => {
                assert_eq!(
                    (batch.epoch.as_deref(), batch.seq, rejected.len()),
                    (Some("boot-2"), Some(3), 0),
                    "the batch carries Kv-Epoch and Kv-Seq"
                );
            }
            other => panic!("expected a KV batch, got {other:?}"),
        }
        let h = headers(&[("Kv-Epoch", "boot 2")]);
        assert_eq!(
            decode(&settings(), "kv.events.w", Some(&h), &payload)
                .unwrap_err()
                .reason,
            RejectReason::InvalidHeader,
            "an unreadable Kv-Epoch rejects the batch"
        );
    }

    #[test]
    fn a_load_sample_takes_its_dp_rank_from_the_header() {
        let payload = wire::encode_load(0.5, 1, 0, None, 0.0, None);
        let h = headers(&[("Kv-Dp-Rank", "3"), ("Kv-Model", "m")]);
        match decode(&settings(), "kv.load.w", Some(&h), &payload) {
            Ok(Some((Input::Load(sample), _))) => assert_eq!(
                (sample.dp_rank, sample.model.as_deref()),
                (3, Some("m")),
                "Kv-Dp-Rank and Kv-Model fill the sample"
            ),
            other => panic!("expected a load sample, got {other:?}"),
        }
        match decode(&settings(), "kv.load.w", None, &payload) {
            Ok(Some((Input::Load(sample), _))) => {
                assert_eq!(sample.dp_rank, 0, "no header: rank 0")
            }
            other => panic!("expected a load sample, got {other:?}"),
        }
        let h = headers(&[("Kv-Dp-Rank", "-1")]);
        assert_eq!(
            decode(&settings(), "kv.load.w", Some(&h), &payload)
                .unwrap_err()
                .reason,
            RejectReason::InvalidHeader,
            "an unreadable Kv-Dp-Rank rejects the sample"
        );
    }

    #[test]
    fn a_lifecycle_message_with_a_bad_field_is_handed_on_with_its_rejection() {
        let payload = rmp_serde::to_vec(&serde_json::json!({"op": "drain", "block_size": "16"}))
            .expect("encodes");
        match decode(&settings(), "kv.workers.w", None, &payload) {
            Ok(Some((Input::Lifecycle(l), rejected))) => {
                assert_eq!(l.op, crate::input::LifecycleOp::Drain, "the drain is kept");
                assert_eq!(
                    rejected.iter().map(|r| r.reason).collect::<Vec<_>>(),
                    vec![RejectReason::InvalidField],
                    "the bad field is returned to be counted"
                );
            }
            other => panic!("expected a lifecycle message, got {other:?}"),
        }
    }
}
