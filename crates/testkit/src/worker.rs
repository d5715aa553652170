//! A simulated vLLM worker on NATS, and the fixtures tests build with it.

use kvrouted_core::hashing::block_keys;
use kvrouted_core::input::LifecycleOp;
use kvrouted_core::wire::{encode_lifecycle, encode_load, encode_vllm_batch, VllmEvent};

use crate::daemon::Daemon;
use crate::poll::eventually;

/// A vLLM `BlockStored` event of 16-token blocks in GPU memory, chained from the start of the
/// prompt: `token_ids` holds every block's tokens, one engine hash per block.
pub fn gpu_blocks_stored(block_hashes: Vec<u64>, token_ids: Vec<u32>) -> VllmEvent {
    VllmEvent::BlockStored {
        block_hashes,
        parent_block_hash: None,
        token_ids,
        block_size: 16,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
    }
}

/// Tokens of a prompt of `blocks` full 16-token blocks, distinct per `seed`.
pub fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..blocks as u32 * 16)
        .map(|i| seed * 1_000_000 + i)
        .collect()
}

/// A simulated vLLM worker publishing on NATS exactly what vLLM's publisher would.
pub struct Worker {
    pub id: String,
    client: async_nats::Client,
    pub seq: u64,
    /// Engine hash of each stored block key (engine hashes are opaque: derived, not equal).
    next_engine: u64,
    chain: std::collections::HashMap<u64, u64>,
}

impl Worker {
    pub async fn connect(nats_url: &str, id: &str) -> Worker {
        Worker::connect_with(async_nats::ConnectOptions::new(), nats_url, id).await
    }

    /// Connects with these options (credentials, TLS) as worker `id`.
    pub async fn connect_with(
        options: async_nats::ConnectOptions,
        nats_url: &str,
        id: &str,
    ) -> Worker {
        let client = options.connect(nats_url).await.expect("connect to nats");
        Worker {
            id: id.into(),
            client,
            seq: 0,
            next_engine: 1,
            chain: Default::default(),
        }
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// Publishes a batch on `kv.events.<id>` with the next `Kv-Seq`, through JetStream (waits
    /// for the stream's ack so ordering with later messages is certain).
    pub async fn publish_events(&mut self, events: &[VllmEvent]) {
        self.seq += 1;
        let payload = encode_vllm_batch(1.0, events, None);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Kv-Seq", self.seq.to_string().as_str());
        let js = async_nats::jetstream::new(self.client.clone());
        js.publish_with_headers(format!("kv.events.{}", self.id), headers, payload.into())
            .await
            .expect("publish")
            .await
            .expect("stream ack");
    }

    /// Stores every full block of `tokens` (as one BlockStored event chained from the start).
    /// Returns the engine hashes used.
    pub async fn store(&mut self, tokens: &[u32]) -> Vec<u64> {
        let n = tokens.len() / 16;
        let hashes: Vec<u64> = (0..n as u64)
            .map(|i| self.engine_hash(tokens, i as usize))
            .collect();
        self.publish_events(&[gpu_blocks_stored(hashes.clone(), tokens[..n * 16].to_vec())])
            .await;
        hashes
    }

    /// A stable engine hash per (worker, block key): what a real engine's hash would be.
    fn engine_hash(&mut self, tokens: &[u32], block: usize) -> u64 {
        let key = block_keys(&tokens[..(block + 1) * 16], 16)[block];
        let next = &mut self.next_engine;
        *self.chain.entry(key).or_insert_with(|| {
            *next += 1;
            *next * 7919
        })
    }

    pub async fn remove(&mut self, hashes: Vec<u64>) {
        self.publish_events(&[VllmEvent::BlockRemoved {
            block_hashes: hashes,
            medium: Some("GPU".into()),
        }])
        .await;
    }

    /// The pressure the daemon derives from a [`Worker::load`] sample: one running request of
    /// 64 counts as 1/64 of queue pressure.
    pub fn pressure_of(kv_usage: f64) -> f64 {
        kv_usage.max(1.0 / 64.0)
    }

    /// Publishes raw bytes on core NATS (flushed): for load subjects, or anything a broken
    /// publisher might send.
    pub async fn publish_core(&self, subject: &str, payload: Vec<u8>) {
        self.client
            .publish(subject.to_string(), payload.into())
            .await
            .unwrap();
        self.client.flush().await.unwrap();
    }

    /// Publishes raw bytes (and headers) through JetStream and waits for the stream's ack: for
    /// the event and lifecycle subjects the stream captures.
    pub async fn publish_js(
        &self,
        subject: &str,
        headers: async_nats::HeaderMap,
        payload: Vec<u8>,
    ) {
        let js = async_nats::jetstream::new(self.client.clone());
        js.publish_with_headers(subject.to_string(), headers, payload.into())
            .await
            .expect("publish")
            .await
            .expect("stream ack");
    }

    /// Waits until this worker's connection to the broker is up (after a broker restart).
    pub async fn wait_connected(&self) {
        eventually(
            &format!("worker {} reconnects to NATS", self.id),
            || async {
                (self.client.connection_state() == async_nats::connection::State::Connected)
                    .then_some(())
            },
        )
        .await
    }

    /// Publishes a load sample on core NATS (`kv.load.<id>`).
    pub async fn load(&self, kv_usage: f64) {
        let payload = encode_load(kv_usage, 1, 0, Some(64), 0.0, None);
        self.client
            .publish(format!("kv.load.{}", self.id), payload.into())
            .await
            .unwrap();
        self.client.flush().await.unwrap();
    }

    pub async fn lifecycle(&self, op: LifecycleOp) {
        let payload = encode_lifecycle(op, None, Some(16), None);
        let js = async_nats::jetstream::new(self.client.clone());
        js.publish(format!("kv.workers.{}", self.id), payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
}

/// Whether the daemon's durable consumer has delivered everything in the stream and every
/// delivered message is acked: all published events are applied and journaled durably.
pub async fn consumer_settled(client: &async_nats::Client) -> Option<()> {
    let js = async_nats::jetstream::new(client.clone());
    let stream = js.get_stream("KVROUTED").await.ok()?;
    let info = stream.consumer_info("kvrouted").await.ok()?;
    (info.num_pending == 0 && info.num_ack_pending == 0).then_some(())
}

/// An `owner` holding the 8 blocks of [`prompt`]`(1, 8)` and an `other` worker, both with a
/// load sample the daemon has applied: the fleet most daemon tests start from.
pub struct OwnerAndOther {
    pub owner: Worker,
    pub other: Worker,
    pub tokens: Vec<u32>,
}

impl OwnerAndOther {
    /// Connects both workers, publishes the owner's blocks and both load samples (`kv_usage`
    /// `owner_usage` and `other_usage`), and waits until the daemon shows all of it.
    pub async fn publish(
        daemon: &Daemon,
        nats_url: &str,
        owner_usage: f64,
        other_usage: f64,
    ) -> OwnerAndOther {
        let mut owner = Worker::connect(nats_url, "owner").await;
        let other = Worker::connect(nats_url, "other").await;
        let tokens = prompt(1, 8);
        owner.store(&tokens).await;
        owner.load(owner_usage).await;
        other.load(other_usage).await;
        daemon.wait_blocks("owner", 8).await;
        daemon.wait_load("owner", owner_usage).await;
        daemon.wait_load("other", other_usage).await;
        OwnerAndOther {
            owner,
            other,
            tokens,
        }
    }
}
