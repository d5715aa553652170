//! The fleet's voice on NATS: KV event batches and lifecycle messages through JetStream (with
//! `Kv-Seq` and `Kv-Model`), load samples on core NATS, on the subjects a real fleet uses and
//! encoded by the same encoders the bridge uses.
//!
//! JetStream acks are awaited off the fleet's loop (a publication only queues them), so a slow
//! broker never stalls the simulated workers; messages of one connection keep their order in
//! the stream, which is what `Kv-Seq` needs.

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};

use crate::input::LifecycleOp;
use crate::wire::{encode_lifecycle, encode_load, encode_vllm_batch, VllmEvent};

/// Beyond this many unacknowledged publications the publisher waits for acks first.
const MAX_PENDING_ACKS: usize = 4096;

pub struct Publisher {
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
    prefix: String,
    model: Option<String>,
    pending: FuturesUnordered<BoxFuture<'static, anyhow::Result<()>>>,
}

impl Publisher {
    pub fn new(client: async_nats::Client, prefix: &str, model: Option<String>) -> Publisher {
        Publisher {
            js: async_nats::jetstream::new(client.clone()),
            client,
            prefix: prefix.to_string(),
            model,
            pending: FuturesUnordered::new(),
        }
    }

    /// A KV event batch on `<prefix>.events.<worker>` with `Kv-Seq: seq`.
    pub async fn events(
        &mut self,
        worker: &str,
        seq: u64,
        ts: f64,
        events: &[VllmEvent],
    ) -> anyhow::Result<()> {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Kv-Seq", seq.to_string().as_str());
        if let Some(model) = &self.model {
            headers.insert("Kv-Model", model.as_str());
        }
        let subject = format!("{}.events.{worker}", self.prefix);
        let payload = encode_vllm_batch(ts, events, None);
        self.jetstream(subject, headers, payload).await
    }

    /// A lifecycle message on `<prefix>.workers.<worker>`.
    pub async fn lifecycle(
        &mut self,
        worker: &str,
        op: LifecycleOp,
        block_size: u32,
        capacity_blocks: u64,
    ) -> anyhow::Result<()> {
        let payload = match op {
            LifecycleOp::Join => encode_lifecycle(
                op,
                self.model.as_deref(),
                Some(block_size),
                Some(capacity_blocks),
            ),
            _ => encode_lifecycle(op, None, None, None),
        };
        let subject = format!("{}.workers.{worker}", self.prefix);
        self.jetstream(subject, async_nats::HeaderMap::new(), payload)
            .await
    }

    /// A load sample on `<prefix>.load.<worker>` (core NATS).
    pub async fn load(
        &mut self,
        worker: &str,
        kv_usage: f64,
        running: u32,
        waiting: u32,
        max_running: u32,
        ts: f64,
    ) -> anyhow::Result<()> {
        let payload = encode_load(
            kv_usage,
            running,
            waiting,
            Some(max_running),
            ts,
            self.model.as_deref(),
        );
        let mut headers = async_nats::HeaderMap::new();
        if let Some(model) = &self.model {
            headers.insert("Kv-Model", model.as_str());
        }
        self.client
            .publish_with_headers(
                format!("{}.load.{worker}", self.prefix),
                headers,
                payload.into(),
            )
            .await
            .map_err(|e| anyhow::anyhow!("publishing a load sample: {e}"))
    }

    async fn jetstream(
        &mut self,
        subject: String,
        headers: async_nats::HeaderMap,
        payload: Vec<u8>,
    ) -> anyhow::Result<()> {
        while self.pending.len() >= MAX_PENDING_ACKS {
            self.next_ack().await?;
        }
        let ack = self
            .js
            .publish_with_headers(subject.clone(), headers, payload.into())
            .await
            .map_err(|e| publish_error(&subject, &self.prefix, &e))?;
        let prefix = self.prefix.clone();
        self.pending.push(Box::pin(async move {
            ack.await
                .map(|_| ())
                .map_err(|e| publish_error(&subject, &prefix, &e))
        }));
        Ok(())
    }

    /// Whether publications wait for their ack.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The next ack (pending forever when none is outstanding, so it can sit in a `select!`).
    pub async fn next_ack(&mut self) -> anyhow::Result<()> {
        match self.pending.next().await {
            Some(result) => result,
            None => std::future::pending().await,
        }
    }

    /// Waits for every outstanding ack and flushes core NATS.
    pub async fn settle(&mut self) -> anyhow::Result<()> {
        while let Some(result) = self.pending.next().await {
            result?;
        }
        self.client
            .flush()
            .await
            .map_err(|e| anyhow::anyhow!("flushing NATS: {e}"))
    }
}

fn publish_error(
    subject: &str,
    prefix: &str,
    e: &async_nats::jetstream::context::PublishError,
) -> anyhow::Error {
    use async_nats::jetstream::context::PublishErrorKind;
    match e.kind() {
        PublishErrorKind::StreamNotFound => anyhow::anyhow!(
            "publishing {subject}: no JetStream stream captures it; is a kvrouted daemon with \
             --subject-prefix {prefix} running on this NATS server?"
        ),
        _ => anyhow::anyhow!("publishing {subject}: {e}"),
    }
}
