//! The consumer loop of one JetStream feed: KV events and lifecycle messages, or the peers'
//! decisions.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use futures::{FutureExt, StreamExt};

use super::delivery::{Delivery, DeliveryOrder, Quiet, QuietWatch};
use super::streams::{consumer_exists, ensure_stream, forget_consumer, rewind_to_ack_floor};
use super::{decode, IngestSettings};
use crate::prom::reject;
use crate::status::{Feed, Status};
use crate::writer::{Ack, AckFuture, Acknowledge, WriterGone, WriterHandle};

/// JetStream consumer loop of one feed: creates the stream and durable consumer if missing,
/// recreates the message stream with backoff whenever it breaks (broker restart, network).
/// After every reconnect it checks at once that the stream and consumer still exist, and
/// recreates them if the broker came back without them (restarted empty): waiting for the
/// missed heartbeats would take seconds, and events published meanwhile would be lost.
///
/// The feed is caught up once every message up to the stream's last sequence at start is
/// journaled and flushed (or, when the last of them left the stream before they were read, once
/// the consumer has nothing pending and the feed is quiet): a replica that was away answers
/// routes only with what it missed applied.
pub(super) async fn run(
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
    // Until done once: a new data dir reads the stream from its start.
    let mut forget_earlier_consumer = settings.fresh_data_dir;
    loop {
        let result: Result<(), Interrupt> = async {
            let stream = ensure_stream(&js, stream_config.clone()).await?;
            // The backlog to catch up with: everything the stream holds now.
            let target = stream.cached_info().state.last_sequence;
            if target < order.last_stream_seq {
                // The broker came back with a new, shorter stream: its sequences start over.
                order = DeliveryOrder::default();
            }
            if forget_earlier_consumer {
                if forget_consumer(&stream, &consumer_name).await? {
                    tracing::info!(
                        consumer = consumer_name,
                        "the data dir is new: deleted the durable consumer an earlier data dir \
                         left, so the stream is read from its start"
                    );
                }
                forget_earlier_consumer = false;
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
            let (pending, delivered_to) = match consumer.info().await {
                Ok(info) => {
                    order.expect_after(info.delivered.consumer_sequence);
                    (info.num_pending, info.delivered.stream_sequence)
                }
                Err(_) => (1, 0),
            };
            if pending == 0
                && delivered_to >= target
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
            let mut watch = QuietWatch::default();
            let mut quiet =
                tokio::time::interval_at(tokio::time::Instant::now() + QUIET_CHECK, QUIET_CHECK);
            quiet.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let msg = if draining {
                    match messages.next().now_or_never() {
                        Some(Some(Ok(msg))) => msg,
                        _ => return Err(Interrupt::Reconnected),
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
                        _ = quiet.tick() => {
                            match quiet_check(&mut consumer, &order, &mut watch).await {
                                Quiet::Lost { missing } => {
                                    return Err(lost_deliveries(
                                        feed,
                                        missing,
                                        "the consumer delivered messages that never arrived, \
                                         and none came after them",
                                    ));
                                }
                                // The backlog's last messages are gone from the stream
                                // (limits), so no delivery reaches `target`.
                                Quiet::NothingLeft => {
                                    if mark_caught_up(&writer, &status, feed, &mut marker_sent)
                                        .await
                                        .is_err()
                                    {
                                        return Ok(());
                                    }
                                }
                                Quiet::Wait => {}
                            }
                            continue;
                        }
                    };
                    watch.arrived();
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
                            return Err(lost_deliveries(
                                feed,
                                missing,
                                &format!(
                                    "deliveries before stream sequence {} were lost in transit \
                                     (a server went away)",
                                    info.stream_sequence
                                ),
                            ));
                        }
                    }
                    if feed == Feed::Events {
                        let lag =
                            (time::OffsetDateTime::now_utc() - info.published).as_seconds_f64();
                        metrics::gauge!("kvrouted_ingest_lag_seconds").set(lag.max(0.0));
                        metrics::gauge!("kvrouted_ingest_pending_messages")
                            .set(info.pending as f64);
                    }
                    // Measured in the stream's sequence, as `target` is, not by the delivery's
                    // `pending`: that is the consumer's own count, and a consumer recreated
                    // while a server of the cluster was away and coming back has been seen to
                    // count a backlog wrong (19 where 100 were to come).
                    backlog_done = info.stream_sequence >= target;
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
                            // Nothing to journal: acknowledge (after the messages before it) so a
                            // bad message is not redelivered forever.
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
            Err(Interrupt::Broken("message stream ended".to_string()))
        }
        .await;
        match result {
            Ok(()) => return,
            Err(Interrupt::LostDeliveries) => {}
            Err(Interrupt::Reconnected) => {
                tracing::info!(
                    feed = feed.name(),
                    "NATS reconnected: checking the JetStream stream and consumer"
                );
            }
            Err(Interrupt::Broken(e)) => {
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
        .ack_in_order(OnAcked::marker(move || {
            let _ = tx.send(());
        }))
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
    let status = status.clone();
    writer
        .ack_in_order(OnAcked::marker(move || {
            if !status.consumer(feed).caught_up.swap(true, Ordering::AcqRel) {
                tracing::info!(feed = feed.name(), "caught up with the stream's backlog");
            }
        }))
        .await
}

/// A JetStream message's acknowledgement, as the writer acks it after the journal flush.
struct JetStreamAck(jetstream::message::Acker);

impl Acknowledge for JetStreamAck {
    fn ack(&self) -> AckFuture<'_> {
        Box::pin(async move { self.0.ack().await.map_err(|e| e.to_string()) })
    }
}

/// Counts and logs `missing` deliveries that never arrived (`what` says how that was found);
/// the feed then starts over, which rewinds the consumer to its ack floor.
fn lost_deliveries(feed: Feed, missing: u64, what: &str) -> Interrupt {
    metrics::counter!("kvrouted_ingest_lost_deliveries_total", "feed" => feed.name())
        .increment(missing);
    tracing::warn!(
        feed = feed.name(),
        missing,
        "{what}: delivering again from the ack floor"
    );
    Interrupt::LostDeliveries
}

/// At the end of a quiet-check period: when no delivery arrived during it, asks the consumer
/// for its counts and judges them ([`QuietWatch`]); otherwise, or when the consumer does not
/// answer, finds nothing.
async fn quiet_check(
    consumer: &mut jetstream::consumer::Consumer<pull::Config>,
    order: &DeliveryOrder,
    watch: &mut QuietWatch,
) -> Quiet {
    if !watch.quiet() {
        return Quiet::Wait;
    }
    match consumer.info().await {
        Ok(info) => watch.judge(
            order.unseen(info.delivered.consumer_sequence),
            info.num_pending,
        ),
        Err(_) => watch.judge(0, 1),
    }
}

/// How long a feed is quiet before it asks its consumer whether deliveries went missing.
/// Two quiet checks in a row must find them: a loss is then noticed within three periods
/// instead of JetStream's redelivery after `ack_wait` (30s).
const QUIET_CHECK: Duration = Duration::from_secs(2);

/// Why a consumer loop starts over.
enum Interrupt {
    /// The connection came back, and the broker may have come back without the stream or the
    /// consumer: start over at once.
    Reconnected,
    /// Deliveries were lost: start over at once, which rewinds the consumer.
    LostDeliveries,
    /// The stream, the consumer or the message stream failed: start over after a backoff.
    Broken(String),
}

impl From<String> for Interrupt {
    fn from(e: String) -> Self {
        Interrupt::Broken(e)
    }
}

/// An in-order marker: acknowledged once everything handed over before it is journaled,
/// flushed and acknowledged, when it runs its action (the caught-up flag, the end of a drain).
struct OnAcked(Mutex<Option<Box<dyn FnOnce() + Send>>>);

impl OnAcked {
    fn marker(action: impl FnOnce() + Send + 'static) -> Ack {
        Ack {
            acker: Box::new(OnAcked(Mutex::new(Some(Box::new(action))))),
            cumulative: false,
        }
    }
}

impl Acknowledge for OnAcked {
    fn ack(&self) -> AckFuture<'_> {
        let action = self.0.lock().unwrap().take();
        Box::pin(async move {
            if let Some(action) = action {
                action();
            }
            Ok(())
        })
    }
}
