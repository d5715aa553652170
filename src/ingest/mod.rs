//! NATS ingest (docs/architecture.md, "Wire contract"): KV events and lifecycle messages from a
//! JetStream durable consumer (or core NATS with `--no-jetstream`), load samples from core NATS.
//! Each message is decoded here, outside the single writer, and handed over as a finished input.
//!
//! Layout:
//! - this file: the subjects, decoding a message into an input, the core-NATS loop, and
//!   [`run`], which starts every loop;
//! - `jetstream`: the consumer loop of one JetStream feed (KV events, peers' decisions), its
//!   acknowledgements and caught-up marker;
//! - `delivery`: the order of a consumer's deliveries, which tells a lost delivery from the next
//!   one and from one handed over before;
//! - `streams`: the streams' settings and the broker-side calls (create or raise a stream,
//!   rewind a durable consumer to its ack floor, delete one an earlier data dir left).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::stream;
use async_nats::HeaderMap;
use futures::StreamExt;

use crate::decisions;
use crate::input::{Input, RejectReason, Rejection, WorkerId};
use crate::prom::reject;
use crate::status::{Feed, Status};
use crate::wire;
use crate::writer::WriterHandle;

mod delivery;
mod jetstream;
mod streams;

pub use streams::{decisions_stream_config, stream_config, DECISIONS_MAX_BYTES};

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
    /// Nothing is journaled yet (a new replica, or one whose data dir was lost): a durable
    /// consumer an earlier data dir left would resume after messages this journal never held,
    /// so each feed deletes it before it first reads, and reads its stream from the start.
    pub fresh_data_dir: bool,
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
            tasks.spawn(jetstream::run(
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
            fresh_data_dir: false,
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, *v);
        }
        h
    }

    /// Why `decode` refuses `payload` on `subject` with headers `h`.
    fn rejection(subject: &str, h: &HeaderMap, payload: &[u8]) -> RejectReason {
        decode(&settings(), subject, Some(h), payload)
            .expect_err("the message is refused")
            .reason
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
            rejection("kv.events.w", &h, &payload),
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
            rejection("kv.load.w", &h, &payload),
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
