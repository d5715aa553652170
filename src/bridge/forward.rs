//! JetStream side of the bridge: publishing batches with their headers, and reading back where
//! the bridge left off.
//!
//! Each batch goes to `<prefix>.events.<worker>` with `Kv-Seq` (the engine's sequence),
//! `Kv-Epoch`, `Kv-Model` (when known), `Kv-Dp-Rank`, and `Nats-Msg-Id`
//! (`<worker>:<rank>:<epoch>:<seq>`, so the stream itself drops a batch published twice within
//! its duplicate window, e.g. by a bridge that crashed between publish and ack).

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, context::PublishAckFuture, stream};
use async_nats::HeaderMap;
use bytes::Bytes;
use futures::StreamExt;

/// Where a rank's forwarding stands in the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    /// The engine sequence (`Kv-Seq`) of the last batch forwarded for the rank.
    pub seq: u64,
    pub epoch: String,
    /// The stream sequence of that message: the newest position across ranks wins the epoch.
    pub stream_seq: u64,
    /// Its payload: if the engine's batch with this sequence differs, the engine restarted.
    pub payload: Bytes,
}

#[derive(Clone)]
pub struct Forwarder {
    js: jetstream::Context,
    pub subject: String,
    worker: String,
    model: Option<String>,
    stream: String,
    prefix: String,
}

impl Forwarder {
    pub fn new(
        client: async_nats::Client,
        prefix: &str,
        stream: &str,
        worker: &str,
        model: Option<String>,
    ) -> Forwarder {
        Forwarder {
            js: jetstream::new(client),
            subject: format!("{prefix}.events.{worker}"),
            worker: worker.to_string(),
            model,
            stream: stream.to_string(),
            prefix: prefix.to_string(),
        }
    }

    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// Creates the stream when it is missing (the bridge may start before the daemon), with the
    /// daemon's settings.
    pub async fn ensure_stream(&self) -> Result<stream::Stream, String> {
        self.js
            .get_or_create_stream(crate::ingest::stream_config(&self.stream, &self.prefix))
            .await
            .map_err(|e| format!("stream {}: {e}", self.stream))
    }

    /// Hands one batch to the client. The returned future resolves with the stream's ack;
    /// publishes leave in call order on one connection, so the stream stores them in order.
    pub async fn publish(
        &self,
        rank: u32,
        seq: u64,
        epoch: &str,
        payload: Bytes,
    ) -> Result<PublishAckFuture, async_nats::jetstream::context::PublishError> {
        let mut headers = HeaderMap::new();
        headers.insert("Kv-Seq", seq.to_string().as_str());
        headers.insert("Kv-Epoch", epoch);
        headers.insert("Kv-Dp-Rank", rank.to_string().as_str());
        if let Some(model) = &self.model {
            headers.insert("Kv-Model", model.as_str());
        }
        headers.insert(
            "Nats-Msg-Id",
            format!("{}:{rank}:{epoch}:{seq}", self.worker).as_str(),
        );
        self.js
            .publish_with_headers(self.subject.clone(), headers, payload)
            .await
    }

    /// The last batch forwarded for each of the ranks `0..dp_size`, read back from the stream.
    ///
    /// All ranks share the worker's subject, so the newest message may belong to another rank:
    /// the bridge reads the subject's tail in a growing window until it has seen every rank or
    /// reached the start of the stream. Messages without a readable `Kv-Seq` (someone else
    /// publishing on the subject) are passed over.
    pub async fn last_forwarded(&self, dp_size: u32) -> Result<BTreeMap<u32, Position>, String> {
        let mut stream = self.ensure_stream().await?;
        let last = match stream.get_last_raw_message_by_subject(&self.subject).await {
            Ok(m) => m,
            Err(e)
                if e.kind()
                    == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
            {
                return Ok(BTreeMap::new())
            }
            Err(e) => return Err(format!("last message on {}: {e}", self.subject)),
        };
        let mut found = BTreeMap::new();
        note(&mut found, &last.headers, last.sequence, &last.payload);
        if found.len() as u32 >= dp_size {
            return Ok(found);
        }
        let first = stream
            .info()
            .await
            .map_err(|e| format!("stream info: {e}"))?
            .state
            .first_sequence;
        let mut window = 64 * u64::from(dp_size);
        loop {
            let start = last.sequence.saturating_sub(window - 1).max(first).max(1);
            found.clear();
            let consumer = stream
                .create_consumer(consumer::pull::OrderedConfig {
                    filter_subject: self.subject.clone(),
                    deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                        start_sequence: start,
                    },
                    ..Default::default()
                })
                .await
                .map_err(|e| format!("reading {}: {e}", self.subject))?;
            let mut messages = consumer
                .messages()
                .await
                .map_err(|e| format!("reading {}: {e}", self.subject))?;
            loop {
                let next = tokio::time::timeout(Duration::from_secs(10), messages.next())
                    .await
                    .map_err(|_| format!("reading {}: timed out", self.subject))?;
                let Some(message) = next else { break };
                let message = message.map_err(|e| format!("reading {}: {e}", self.subject))?;
                let stream_seq = message
                    .info()
                    .map_err(|e| format!("message info: {e}"))?
                    .stream_sequence;
                if let Some(headers) = &message.headers {
                    note(&mut found, headers, stream_seq, &message.payload);
                }
                if stream_seq >= last.sequence {
                    break;
                }
            }
            if found.len() as u32 >= dp_size || start <= first.max(1) {
                return Ok(found);
            }
            window = window.saturating_mul(8);
        }
    }
}

fn note(
    found: &mut BTreeMap<u32, Position>,
    headers: &HeaderMap,
    stream_seq: u64,
    payload: &Bytes,
) {
    let get = |name: &str| headers.get(name).map(|v| v.as_str().trim().to_string());
    let Some(seq) = get("Kv-Seq").and_then(|s| s.parse::<u64>().ok()) else {
        return;
    };
    let rank = get("Kv-Dp-Rank")
        .and_then(|s| s.parse::<u32>().ok())
        .unwrap_or(0);
    let epoch = get("Kv-Epoch").unwrap_or_default();
    found.insert(
        rank,
        Position {
            seq,
            epoch,
            stream_seq,
            payload: payload.clone(),
        },
    );
}
