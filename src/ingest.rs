//! NATS ingest (DESIGN.md §3): KV events and lifecycle messages from a JetStream durable
//! consumer (or core NATS with `--no-jetstream`), load samples from core NATS. Each message is
//! decoded here, outside the single writer, and handed over as a finished input.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use async_nats::HeaderMap;
use futures::StreamExt;

use crate::daemon::writer::{Ack, WriterHandle};
use crate::input::{Input, RejectReason, Rejection, WorkerId};
use crate::metrics::reject;
use crate::wire;

/// What the daemon reports on `/readyz`.
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

pub struct IngestSettings {
    pub subject_prefix: String,
    pub stream: String,
    pub consumer: String,
    pub jetstream: bool,
    pub max_payload_bytes: usize,
}

/// The kind of a subject under the prefix, and its worker token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Events,
    Load,
    Workers,
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
        _ => {
            return Err(Rejection::new(
                RejectReason::MalformedPayload,
                format!("unexpected subject {subject}"),
            ))
        }
    };
    Ok((kind, worker))
}

/// Decodes one message into an input.
fn decode(
    settings: &IngestSettings,
    subject: &str,
    headers: Option<&HeaderMap>,
    payload: &[u8],
) -> Result<Input, Rejection> {
    let (kind, worker) = parse_subject(&settings.subject_prefix, subject)?;
    let worker = WorkerId::new(worker)
        .map_err(|e| Rejection::new(RejectReason::InvalidWorkerId, e.to_string()))?;
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
    let header = |name: &str| headers.and_then(|h| h.get(name)).map(|v| v.as_str());
    match kind {
        Kind::Events => {
            let headers =
                wire::parse_kv_headers(header("Kv-Seq"), header("Kv-Model"), header("Kv-Dp-Rank"))?;
            wire::decode_kv_batch(payload, worker, headers).map(Input::KvEvents)
        }
        Kind::Load => {
            let mut sample = wire::decode_load(payload, worker)?;
            if sample.model.is_none() {
                sample.model = header("Kv-Model")
                    .filter(|m| !m.is_empty())
                    .map(str::to_owned);
            }
            Ok(Input::Load(sample))
        }
        Kind::Workers => wire::decode_lifecycle(payload, worker).map(Input::Lifecycle),
    }
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
                        Ok(input) => {
                            if writer.submit(input, "nats", None).await.is_err() {
                                return;
                            }
                        }
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

/// JetStream consumer loop: creates the stream and durable consumer if missing, recreates the
/// message stream with backoff whenever it breaks (broker restart, network).
async fn run_jetstream(
    client: async_nats::Client,
    settings: Arc<IngestSettings>,
    writer: WriterHandle,
    status: Arc<Status>,
) {
    let js = jetstream::new(client);
    let prefix = &settings.subject_prefix;
    let mut backoff = Duration::from_millis(100);
    loop {
        let result: Result<(), String> = async {
            let stream = js
                .get_or_create_stream(stream_config(&settings.stream, prefix))
                .await
                .map_err(|e| format!("stream {}: {e}", settings.stream))?;
            let consumer: jetstream::consumer::Consumer<pull::Config> = stream
                .get_or_create_consumer(
                    &settings.consumer,
                    pull::Config {
                        durable_name: Some(settings.consumer.clone()),
                        // Cumulative: one ack per journal flush covers every message before it.
                        ack_policy: jetstream::consumer::AckPolicy::All,
                        ack_wait: Duration::from_secs(30),
                        max_ack_pending: 100_000,
                        ..Default::default()
                    },
                )
                .await
                .map_err(|e| format!("consumer {}: {e}", settings.consumer))?;
            let mut consumer = consumer;
            // A durable created by an earlier version acks explicitly; its policy cannot change
            // in place, so follow whatever it has.
            let cumulative =
                consumer.cached_info().config.ack_policy == jetstream::consumer::AckPolicy::All;
            let pending = consumer.info().await.map(|i| i.num_pending).unwrap_or(1);
            if pending == 0 {
                status.caught_up.store(true, Ordering::Release);
            }
            tracing::info!(
                stream = settings.stream,
                consumer = settings.consumer,
                backlog = pending,
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
            while let Some(msg) = messages.next().await {
                let msg = msg.map_err(|e| format!("message stream: {e}"))?;
                if let Ok(info) = msg.info() {
                    let lag = (time::OffsetDateTime::now_utc() - info.published).as_seconds_f64();
                    ::metrics::gauge!("kvrouted_ingest_lag_seconds").set(lag.max(0.0));
                    ::metrics::gauge!("kvrouted_ingest_pending_messages").set(info.pending as f64);
                    if info.pending == 0 {
                        status.caught_up.store(true, Ordering::Release);
                    }
                }
                let (msg, acker) = msg.split();
                let ack = Ack { acker, cumulative };
                match decode(&settings, &msg.subject, msg.headers.as_ref(), &msg.payload) {
                    Ok(input) => {
                        if writer.submit(input, "jetstream", Some(ack)).await.is_err() {
                            return Ok(());
                        }
                    }
                    Err(r) => {
                        reject(&r, "jetstream");
                        // Nothing to journal: acknowledge (after the messages before it) so a bad
                        // message is not redelivered forever.
                        if writer.ack_in_order(ack).await.is_err() {
                            return Ok(());
                        }
                    }
                }
            }
            Err("message stream ended".to_string())
        }
        .await;
        match result {
            Ok(()) => return,
            Err(e) => {
                tracing::warn!("JetStream ingest interrupted, retrying in {backoff:?}: {e}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
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
    let expected = if settings.jetstream { 1 } else { 3 };
    status.core_expected.store(expected, Ordering::Release);
    tasks.spawn(run_core(
        client.clone(),
        format!("{prefix}.load.>"),
        settings.clone(),
        writer.clone(),
        status.clone(),
    ));
    if settings.jetstream {
        tasks.spawn(run_jetstream(client, settings.clone(), writer, status));
    } else {
        status.caught_up.store(true, Ordering::Release);
        for kind in ["events", "workers"] {
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
}
