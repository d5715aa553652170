//! One dp rank: the SUB subscription to the engine's PUB socket, gap repair from its replay
//! socket, and forwarding to JetStream with pipelined acks, in the engine's order.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::context::{PublishAckFuture, PublishError};
use async_nats::jetstream::publish::PublishAck;
use bytes::Bytes;
use metrics::{counter, gauge, Counter, Gauge};
use tokio::sync::{mpsc, watch};
use zeromq::{Socket, SocketRecv, SubSocket};

use super::cursor::{Epochs, RankCursor, Step};
use super::forward::Forwarder;
use super::frames::{parse_live, topic_name, Numbered};
use super::replay;

/// What `/healthz` shows of a rank.
#[derive(Debug)]
pub struct RankStatus {
    pub rank: u32,
    pub engine_connected: AtomicBool,
    /// The last sequence acknowledged by the stream; `u64::MAX` when none yet.
    pub last_acked: AtomicU64,
    pub epoch: Mutex<String>,
}

impl RankStatus {
    pub fn new(rank: u32, epoch: String) -> RankStatus {
        RankStatus {
            rank,
            engine_connected: AtomicBool::new(false),
            last_acked: AtomicU64::new(u64::MAX),
            epoch: Mutex::new(epoch),
        }
    }
}

#[derive(Debug, Clone)]
pub struct RankConfig {
    pub rank: u32,
    pub pub_endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// How long one replay reply may take.
    pub replay_timeout: Duration,
    /// Batches handed to NATS whose acks are still awaited.
    pub ack_window: usize,
    /// With no live batch for this long, ask the replay socket whether anything was missed.
    pub idle_check: Duration,
}

/// A batch on its way to the stream.
struct InFlight {
    seq: u64,
    epoch: Arc<str>,
    payload: Bytes,
    received: Instant,
    ack: AckFuture,
}

type AckFuture = std::pin::Pin<Box<dyn std::future::Future<Output = AckResult> + Send>>;
type AckResult = Result<PublishAck, PublishError>;

/// The rank's series, registered once: a lookup per batch would cost more than the forwarding.
struct RankMetrics {
    forwarded: Counter,
    replayed: Counter,
    lost: Counter,
    duplicates: Counter,
    restarts: Counter,
    retries: Counter,
    lag: Gauge,
}

impl RankMetrics {
    fn new(rank: &str) -> RankMetrics {
        let c = |name: &'static str| {
            let c = counter!(name, "rank" => rank.to_string());
            c.absolute(0);
            c
        };
        let lag = gauge!("kvrouted_bridge_lag_seconds", "rank" => rank.to_string());
        lag.set(0.0);
        RankMetrics {
            forwarded: c("kvrouted_bridge_forwarded_total"),
            replayed: c("kvrouted_bridge_replayed_total"),
            lost: c("kvrouted_bridge_lost_total"),
            duplicates: c("kvrouted_bridge_duplicates_total"),
            restarts: c("kvrouted_bridge_engine_restarts_total"),
            retries: c("kvrouted_bridge_publish_retries_total"),
            lag,
        }
    }
}

struct Rank {
    cfg: RankConfig,
    metrics: RankMetrics,
    cursor: RankCursor,
    epoch: Arc<str>,
    forwarder: Forwarder,
    epochs: Arc<Epochs>,
    status: Arc<RankStatus>,
    inflight: VecDeque<InFlight>,
    /// The payload of the last forwarded batch.
    last_payload: Option<Bytes>,
}

/// Runs the rank until `shutdown` turns true, then waits (up to 5s) for the acks in flight.
/// `last_payload` is the payload of the last batch forwarded before (read back from the
/// stream), which tells whether the engine behind the replay socket is still the same process.
pub async fn run(
    cfg: RankConfig,
    cursor: RankCursor,
    last_payload: Option<Bytes>,
    forwarder: Forwarder,
    epochs: Arc<Epochs>,
    status: Arc<RankStatus>,
    mut shutdown: watch::Receiver<bool>,
) {
    let (tx, mut live) = mpsc::channel::<(Numbered, Instant)>(65_536);
    let subscription = tokio::spawn(subscribe(
        cfg.pub_endpoint.clone(),
        cfg.topic.clone(),
        tx,
        status.clone(),
        cfg.rank,
    ));
    let label = cfg.rank.to_string();
    let metrics = RankMetrics::new(&label);
    let mut rank = Rank {
        epoch: Arc::from(cursor.epoch.as_str()),
        cfg,
        metrics,
        cursor,
        forwarder,
        epochs,
        status,
        inflight: VecDeque::new(),
        last_payload,
    };

    // Catch up with what the engine buffered while nobody forwarded it. The subscription goes
    // first so that nothing published after the replay's snapshot is missed; an idle check
    // repairs what lands between the two.
    let connected_by = Instant::now() + rank.cfg.replay_timeout;
    while !rank.status.engine_connected.load(Ordering::Acquire) && Instant::now() < connected_by {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    rank.catch_up().await;

    let mut idle = tokio::time::interval(rank.cfg.idle_check);
    idle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut heard_since_tick = true;
    loop {
        tokio::select! {
            biased;
            _ = shutdown.changed() => break,
            // The oldest ack, as soon as it is in: keeps /metrics and the lag current.
            result = std::future::poll_fn(|cx| match rank.inflight.front_mut() {
                Some(f) => f.ack.as_mut().poll(cx),
                None => std::task::Poll::Pending,
            }) => {
                let first = rank.inflight.pop_front().expect("a front ack resolved");
                rank.settle(first, result).await;
            }
            Some((batch, received)) = live.recv() => {
                heard_since_tick = true;
                rank.live(batch, received).await;
            }
            _ = idle.tick() => {
                rank.reap_ready().await;
                if rank.inflight.is_empty() {
                    rank.metrics.lag.set(0.0);
                }
                if !heard_since_tick {
                    rank.catch_up().await;
                }
                heard_since_tick = false;
            }
        }
    }
    subscription.abort();
    let _ = tokio::time::timeout(Duration::from_secs(5), rank.drain()).await;
}

impl Rank {
    /// A batch from the PUB socket.
    async fn live(&mut self, batch: Numbered, received: Instant) {
        let mut step = self.cursor.live(batch.seq);
        if step == Step::Restart {
            let epoch = self.epochs.after(&self.cursor.epoch);
            tracing::warn!(
                rank = self.cfg.rank,
                seq = batch.seq,
                after = ?self.cursor.last_forwarded(),
                epoch,
                "engine restarted (its sequence went back): new epoch"
            );
            self.metrics.restarts.increment(1);
            self.set_epoch(epoch);
            step = self.cursor.live(batch.seq);
        }
        match step {
            Step::Forward => {
                self.forward(batch.seq, batch.payload, received, false)
                    .await
            }
            Step::Duplicate => {
                self.metrics.duplicates.increment(1);
            }
            Step::Gap { from } => {
                tracing::info!(
                    rank = self.cfg.rank,
                    from,
                    to = batch.seq - 1,
                    "sequence gap: asking the replay socket"
                );
                self.replay_from(from).await;
                // The replay normally included this batch; if not, what lies before it is gone.
                match self.cursor.replayed(batch.seq) {
                    Step::Duplicate => {}
                    Step::Forward => {
                        self.forward(batch.seq, batch.payload, received, false)
                            .await
                    }
                    Step::Gap { .. } | Step::Restart => {
                        self.lose_up_to(batch.seq);
                        self.forward(batch.seq, batch.payload, received, false)
                            .await;
                    }
                }
            }
            Step::Restart => unreachable!("a fresh cursor does not see a restart"),
        }
    }

    fn set_epoch(&mut self, epoch: String) {
        self.cursor.restart(epoch.clone());
        *self.status.epoch.lock().unwrap_or_else(|e| e.into_inner()) = epoch.clone();
        self.epoch = Arc::from(epoch);
    }

    fn lose_up_to(&mut self, seq: u64) {
        let from = self.cursor.next();
        let lost = self.cursor.skip_to(seq);
        if lost > 0 {
            self.metrics.lost.increment(lost);
            tracing::warn!(
                rank = self.cfg.rank,
                from,
                to = seq - 1,
                lost,
                "KV event batches lost: the engine no longer buffers them"
            );
        }
    }

    /// Asks the replay socket for what followed the last forwarded batch, starting at that
    /// batch itself: an engine that restarted no longer has it (an empty reply) or has another
    /// batch under its number (a different payload), and then everything it buffers is replayed
    /// under a new epoch. Called at start and whenever the rank has been quiet for a while.
    async fn catch_up(&mut self) {
        let Some(endpoint) = self.cfg.replay_endpoint.clone() else {
            return;
        };
        let Some(last) = self.cursor.last_forwarded() else {
            return self.replay_from(0).await;
        };
        let replayed = match replay::request(&endpoint, last, self.cfg.replay_timeout).await {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(rank = self.cfg.rank, "catch-up replay failed: {e}");
                return;
            }
        };
        self.count_rejected(&replayed.rejected);
        let same_engine = match replayed.batches.first() {
            None => false,
            Some(first) if first.seq == last => self
                .last_payload
                .as_ref()
                .is_none_or(|p| *p == first.payload),
            // The engine moved on past its buffer: same process, the rest is a gap.
            Some(_) => true,
        };
        if !same_engine {
            let epoch = self.epochs.after(&self.cursor.epoch);
            tracing::warn!(
                rank = self.cfg.rank,
                after = last,
                epoch,
                "engine restarted (it no longer has the last forwarded batch): new epoch"
            );
            self.metrics.restarts.increment(1);
            self.set_epoch(epoch);
            return self.replay_from(0).await;
        }
        self.forward_replayed(replayed.batches).await;
    }

    fn count_rejected(&self, rejected: &[super::frames::FrameError]) {
        for e in rejected {
            counter!("kvrouted_bridge_rejected_total", "reason" => e.reason()).increment(1);
            tracing::warn!(rank = self.cfg.rank, "bad replay reply: {e}");
        }
    }

    /// Forwards what the replay socket still buffers from `from` on. What it no longer has
    /// before its first batch is counted as lost.
    async fn replay_from(&mut self, from: u64) {
        let Some(endpoint) = self.cfg.replay_endpoint.clone() else {
            return;
        };
        let replayed = match replay::request(&endpoint, from, self.cfg.replay_timeout).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(rank = self.cfg.rank, from, "replay failed: {e}");
                return;
            }
        };
        self.count_rejected(&replayed.rejected);
        self.forward_replayed(replayed.batches).await;
    }

    async fn forward_replayed(&mut self, batches: Vec<Numbered>) {
        let now = Instant::now();
        for batch in batches {
            match self.cursor.replayed(batch.seq) {
                Step::Duplicate => {}
                Step::Forward => self.forward(batch.seq, batch.payload, now, true).await,
                Step::Gap { .. } | Step::Restart => {
                    self.lose_up_to(batch.seq);
                    self.forward(batch.seq, batch.payload, now, true).await;
                }
            }
        }
    }

    async fn forward(&mut self, seq: u64, payload: Bytes, received: Instant, replayed: bool) {
        while self.inflight.len() >= self.cfg.ack_window {
            self.reap_one().await;
        }
        let ack = publish(
            &self.forwarder,
            self.cfg.rank,
            seq,
            &self.epoch,
            payload.clone(),
        )
        .await;
        self.inflight.push_back(InFlight {
            seq,
            epoch: self.epoch.clone(),
            payload,
            received,
            ack: std::future::IntoFuture::into_future(ack),
        });
        self.cursor.forwarded(seq);
        self.last_payload = Some(self.inflight.back().expect("just pushed").payload.clone());
        if replayed {
            self.metrics.replayed.increment(1);
        }
    }

    /// Awaits the oldest ack.
    async fn reap_one(&mut self) {
        let Some(mut first) = self.inflight.pop_front() else {
            return;
        };
        let result = (&mut first.ack).await;
        self.settle(first, result).await;
    }

    /// Collects the acks that have already arrived, oldest first, without waiting.
    async fn reap_ready(&mut self) {
        use futures::FutureExt;
        while let Some(front) = self.inflight.front_mut() {
            let Some(result) = (&mut front.ack).now_or_never() else {
                break;
            };
            let first = self.inflight.pop_front().expect("front exists");
            self.settle(first, result).await;
        }
    }

    /// An ack came back. A failed one is published again (synchronously, with backoff) after
    /// every later batch in flight has had its answer, so the retry cannot overtake them.
    async fn settle(&mut self, first: InFlight, result: AckResult) {
        let e = match result {
            Ok(_) => return self.acked(first.seq, first.received),
            Err(e) => e,
        };
        tracing::warn!(
            rank = self.cfg.rank,
            seq = first.seq,
            "no stream ack ({e}); publishing again"
        );
        let mut failed = vec![first];
        while let Some(mut f) = self.inflight.pop_front() {
            match (&mut f.ack).await {
                Ok(_) => self.acked(f.seq, f.received),
                Err(_) => failed.push(f),
            }
        }
        for f in failed {
            let mut backoff = Duration::from_millis(100);
            loop {
                self.metrics.retries.increment(1);
                match publish(
                    &self.forwarder,
                    self.cfg.rank,
                    f.seq,
                    &f.epoch,
                    f.payload.clone(),
                )
                .await
                .await
                {
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!(
                            rank = self.cfg.rank,
                            seq = f.seq,
                            "stream ack failed again: {e}"
                        );
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                    }
                }
            }
            self.acked(f.seq, f.received);
        }
    }

    fn acked(&self, seq: u64, received: Instant) {
        self.metrics.forwarded.increment(1);
        self.metrics.lag.set(received.elapsed().as_secs_f64());
        self.status.last_acked.store(seq, Ordering::Release);
    }

    async fn drain(&mut self) {
        while !self.inflight.is_empty() {
            self.reap_one().await;
        }
    }
}

/// Hands a batch to NATS, retrying with backoff while the client refuses it.
async fn publish(
    forwarder: &Forwarder,
    rank: u32,
    seq: u64,
    epoch: &str,
    payload: Bytes,
) -> PublishAckFuture {
    let mut backoff = Duration::from_millis(50);
    loop {
        match forwarder.publish(rank, seq, epoch, payload.clone()).await {
            Ok(ack) => return ack,
            Err(e) => {
                tracing::warn!(rank, seq, "publish failed, retrying: {e}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Keeps a SUB connection to the engine's PUB socket and passes every batch on, reconnecting
/// with backoff when the engine goes away.
async fn subscribe(
    endpoint: String,
    topic: String,
    tx: mpsc::Sender<(Numbered, Instant)>,
    status: Arc<RankStatus>,
    rank: u32,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut socket = SubSocket::new();
        let connected = async {
            socket.connect(&endpoint).await?;
            socket.subscribe(&topic).await
        }
        .await;
        if let Err(e) = connected {
            tracing::warn!(rank, endpoint, "cannot subscribe to the engine: {e}");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
            continue;
        }
        tracing::info!(rank, endpoint, "subscribed to the engine's KV events");
        status.engine_connected.store(true, Ordering::Release);
        backoff = Duration::from_millis(100);
        loop {
            match socket.recv().await {
                Ok(message) => {
                    let received = Instant::now();
                    let frames = message.into_vec();
                    // The subscription matches by prefix; the topic must be exactly ours (a
                    // suffix after NUL aside).
                    if frames
                        .first()
                        .is_some_and(|t| topic_name(t) != topic.as_bytes())
                    {
                        continue;
                    }
                    match parse_live(&frames) {
                        Ok(batch) => {
                            if tx.send((batch, received)).await.is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            counter!("kvrouted_bridge_rejected_total", "reason" => e.reason())
                                .increment(1);
                            tracing::warn!(rank, "bad KV event message from the engine: {e}");
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(rank, endpoint, "engine connection lost: {e}; reconnecting");
                    break;
                }
            }
        }
        status.engine_connected.store(false, Ordering::Release);
        tokio::time::sleep(backoff).await;
    }
}
