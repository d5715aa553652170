//! The live fleet: the simulator's workers (KV cache with LRU eviction, batch limit, one
//! prefill engine) driven by the wall clock, publishing what their caches do over NATS, with
//! gateways asking the daemon where each request goes and then executing it on that worker.
//!
//! The loop mirrors the simulator's event loop: a heap of timed events (arrivals, end of
//! prefill, completions, load samples) in microseconds since the start, fired when the wall
//! clock reaches them, plus the daemon's HTTP replies as they come back.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::gateway::{Gateway, RouteBody, RouteReply};
use super::publish::Publisher;
use super::summary::Summary;
use super::workload::Workload;
use crate::hashing::{block_keys, local_hashes};
use crate::input::{LifecycleOp, WorkerId};
use crate::sim::timeline::Timeline;
use crate::sim::worker::{engine_hash, Need, SimWorker};
use crate::wire::VllmEvent;

/// The simulated fleet's shape and speed.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    pub workers: usize,
    pub capacity_blocks: u64,
    pub max_running: u32,
    pub prefill_s_per_token: f64,
    pub decode_s_per_token: f64,
    pub block_size: u32,
    pub model: Option<String>,
    pub load_interval: Duration,
    pub seed: u64,
}

impl FleetConfig {
    /// The demo's worker ids: `demo-w00`, `demo-w01`, ...
    pub fn worker_ids(&self) -> Vec<String> {
        let width = self.workers.saturating_sub(1).to_string().len().max(2);
        (0..self.workers)
            .map(|i| format!("demo-w{i:0width$}"))
            .collect()
    }
}

#[derive(Debug)]
enum Ev {
    /// The `pos`-th open arrival of the workload's pass `pass`.
    Open {
        pos: usize,
        pass: u64,
    },
    /// A follow-up turn arrives.
    Arrive(usize),
    /// A running request's prefill ends: its blocks are announced, its first token is out.
    PrefillDone(usize),
    Finish(usize),
    Load(usize),
}

/// A request from its route to its completion.
#[derive(Debug)]
struct Request {
    /// Index in the workload's trace.
    req: usize,
    arrival_us: u64,
    tokens: Vec<u32>,
    keys: Vec<u64>,
    locals: Vec<u64>,
    /// Blocks the worker caches for it, and its private blocks (tail and output).
    stored: usize,
    private: u64,
    /// Set once the daemon answered.
    worker: Option<usize>,
    reservation: u64,
    /// Its `BlockStored` event, published at the end of prefill.
    pending_store: Option<PendingStore>,
    prefill_end_us: u64,
}

/// A `BlockStored` event waiting for the end of prefill, and how many blocks it stores.
#[derive(Debug)]
struct PendingStore {
    event: VllmEvent,
    blocks: u64,
}

/// What the gateways' HTTP calls came back with.
enum Reply {
    Routed(usize, Result<RouteReply, String>),
    Released(Result<(), String>),
}

pub struct Fleet {
    cfg: FleetConfig,
    workload: Workload,
    workers: Vec<SimWorker>,
    worker_of: HashMap<String, usize>,
    publisher: Publisher,
    gateway: Gateway,
    start: Instant,
    timeline: Timeline<Ev>,
    requests: HashMap<usize, Request>,
    next_request: usize,
    replies_tx: mpsc::UnboundedSender<Reply>,
    replies: mpsc::UnboundedReceiver<Reply>,
    /// HTTP calls not answered yet.
    in_flight: u64,
    pub summary: Summary,
    /// A prefix a worker holds, for the ready-to-paste route command.
    pub held_prefix: Option<Vec<u32>>,
    /// Winding down: answered routes are released, not executed.
    stopping: bool,
}

/// Why the fleet stopped.
pub enum Stop {
    Signal(&'static str),
    Duration,
}

impl Fleet {
    pub fn new(
        cfg: FleetConfig,
        workload: Workload,
        publisher: Publisher,
        gateway: Gateway,
    ) -> Fleet {
        let workers: Vec<SimWorker> = cfg
            .worker_ids()
            .into_iter()
            .map(|id| {
                SimWorker::new(
                    WorkerId::new(&id).expect("demo worker ids are valid"),
                    cfg.capacity_blocks,
                    cfg.max_running,
                )
            })
            .collect();
        let worker_of = workers
            .iter()
            .enumerate()
            .map(|(i, w)| (w.id.to_string(), i))
            .collect();
        let (replies_tx, replies) = mpsc::unbounded_channel();
        Fleet {
            cfg,
            workload,
            workers,
            worker_of,
            publisher,
            gateway,
            start: Instant::now(),
            timeline: Timeline::default(),
            requests: HashMap::new(),
            next_request: 0,
            replies_tx,
            replies,
            in_flight: 0,
            summary: Summary::new(),
            held_prefix: None,
            stopping: false,
        }
    }

    pub fn worker_ids(&self) -> Vec<String> {
        self.workers.iter().map(|w| w.id.to_string()).collect()
    }

    pub fn elapsed_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    fn ts(&self) -> f64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    }

    fn schedule(&mut self, at_us: u64, ev: Ev) {
        self.timeline.schedule(at_us, ev);
    }

    /// Announces the workers (`join`, then a first load sample each).
    pub async fn join(&mut self) -> anyhow::Result<()> {
        for w in 0..self.workers.len() {
            let id = self.workers[w].id.to_string();
            self.publisher
                .lifecycle(
                    &id,
                    LifecycleOp::Join,
                    self.cfg.block_size,
                    self.cfg.capacity_blocks,
                )
                .await?;
            self.send_load(w).await?;
        }
        self.publisher.settle().await
    }

    /// Sends `leave` for every worker and waits for the broker to take them.
    pub async fn leave(&mut self) -> anyhow::Result<()> {
        for w in 0..self.workers.len() {
            let id = self.workers[w].id.to_string();
            self.publisher
                .lifecycle(&id, LifecycleOp::Leave, self.cfg.block_size, 0)
                .await?;
        }
        self.publisher.settle().await
    }

    /// Runs the fleet until `stop` resolves, calling `print` every `print_every` (with the
    /// route count at the previous call and the seconds since it). The caller then stops the
    /// fleet cleanly with [`Fleet::wind_down`].
    pub async fn run(
        &mut self,
        stop: impl std::future::Future<Output = Stop>,
        print_every: Duration,
        print: &mut dyn FnMut(&Fleet, u64, f64),
    ) -> anyhow::Result<Stop> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(self.cfg.seed);
        self.start = Instant::now();
        let interval_ms = self.cfg.load_interval.as_millis().max(1) as u64;
        for w in 0..self.workers.len() {
            // Workers sample load on their own clocks: a seeded phase per worker.
            let phase_ms = rng.random_range(0..interval_ms);
            self.schedule(phase_ms * 1000, Ev::Load(w));
        }
        self.schedule(0, Ev::Open { pos: 0, pass: 0 });

        tokio::pin!(stop);
        let mut ticker = tokio::time::interval(print_every);
        ticker.tick().await;
        let (mut routes_before, mut printed_at) = (0, Instant::now());
        let why = loop {
            let next = self
                .timeline
                .next_at_us()
                .map(|at_us| self.start + Duration::from_micros(at_us));
            tokio::select! {
                why = &mut stop => break why,
                reply = self.replies.recv() => {
                    let reply = reply.expect("the fleet holds a sender");
                    self.on_reply(reply).await?;
                }
                ack = self.publisher.next_ack(), if self.publisher.has_pending() => ack?,
                _ = tokio::time::sleep_until(next.unwrap_or_else(Instant::now).into()), if next.is_some() => {
                    self.fire_due().await?;
                }
                _ = ticker.tick() => {
                    let window = printed_at.elapsed().as_secs_f64();
                    print(self, routes_before, window);
                    routes_before = self.summary.routes;
                    printed_at = Instant::now();
                }
            }
        };
        Ok(why)
    }

    async fn fire_due(&mut self) -> anyhow::Result<()> {
        let now = self.now_us();
        while let Some((at_us, ev)) = self.timeline.pop_due(now) {
            match ev {
                Ev::Open { pos, pass } => {
                    let (next_pos, next_pass) = if pos + 1 < self.workload.open.len() {
                        (pos + 1, pass)
                    } else {
                        (0, pass + 1)
                    };
                    let next_at = self.workload.open_at_us(next_pos, next_pass);
                    self.schedule(
                        next_at,
                        Ev::Open {
                            pos: next_pos,
                            pass: next_pass,
                        },
                    );
                    self.arrive(self.workload.open[pos], at_us);
                }
                Ev::Arrive(req) => self.arrive(req, at_us),
                Ev::PrefillDone(id) => self.prefill_done(id).await?,
                Ev::Finish(id) => self.finish(id, at_us).await?,
                Ev::Load(w) => {
                    self.send_load(w).await?;
                    let next = at_us + self.cfg.load_interval.as_micros() as u64;
                    self.schedule(next, Ev::Load(w));
                }
            }
        }
        Ok(())
    }

    /// A request arrives at a gateway, which asks the daemon where to send it.
    fn arrive(&mut self, req: usize, at_us: u64) {
        let tokens = self.workload.tokens(req);
        let bs = self.cfg.block_size as usize;
        let keys = block_keys(&tokens, bs);
        let locals = local_hashes(&tokens, bs);
        let r = &self.workload.trace.requests[req];
        // What the worker caches: the prompt's full blocks, clamped so that one request alone
        // fits an empty cache; the tail and the output are private blocks (as the simulator).
        let cap = self.cfg.capacity_blocks;
        let stored = (keys.len() as u64).min(cap);
        let total_blocks = (r.input_tokens + r.output_tokens).div_ceil(bs as u64);
        let private = total_blocks.saturating_sub(stored).min(cap - stored);
        let id = self.next_request;
        self.next_request += 1;
        let body_tokens = tokens.clone();
        let max_output_tokens = r.output_tokens;
        self.requests.insert(
            id,
            Request {
                req,
                arrival_us: at_us,
                tokens,
                keys,
                locals,
                stored: stored as usize,
                private,
                worker: None,
                reservation: 0,
                pending_store: None,
                prefill_end_us: 0,
            },
        );
        let gateway = self.gateway.clone();
        let model = self.cfg.model.clone();
        let tx = self.replies_tx.clone();
        self.in_flight += 1;
        tokio::spawn(async move {
            let body = RouteBody {
                model: model.as_deref(),
                tokens: &body_tokens,
                max_output_tokens,
                request_id: format!("demo-{id}"),
            };
            let result = gateway.route(&body).await;
            let _ = tx.send(Reply::Routed(id, result));
        });
    }

    fn release(&mut self, reservation: u64) {
        let gateway = self.gateway.clone();
        let tx = self.replies_tx.clone();
        self.in_flight += 1;
        tokio::spawn(async move {
            let _ = tx.send(Reply::Released(gateway.release(reservation).await));
        });
    }

    async fn on_reply(&mut self, reply: Reply) -> anyhow::Result<()> {
        self.in_flight -= 1;
        match reply {
            Reply::Released(Ok(())) => self.summary.releases += 1,
            Reply::Released(Err(e)) => self.summary.record_release_failure(e),
            Reply::Routed(id, Err(e)) => {
                self.requests.remove(&id);
                self.summary.record_route_failure(|| e);
            }
            Reply::Routed(id, Ok(decision)) => {
                let Some(&w) = self.worker_of.get(&decision.worker) else {
                    // Another fleet shares the daemon and got this request: give it back.
                    self.requests.remove(&id);
                    self.summary.foreign_routes += 1;
                    self.release(decision.reservation);
                    return Ok(());
                };
                self.summary.record_decision(&decision.decision);
                if self.stopping {
                    self.requests.remove(&id);
                    self.release(decision.reservation);
                    return Ok(());
                }
                let request = self.requests.get_mut(&id).expect("routed request is known");
                request.worker = Some(w);
                request.reservation = decision.reservation;
                self.workers[w].waiting.push_back(id);
                self.admit_waiting(w).await?;
            }
        }
        Ok(())
    }

    /// Starts waiting requests in order while the first fits (first come, first served).
    async fn admit_waiting(&mut self, w: usize) -> anyhow::Result<()> {
        let bs = self.cfg.block_size as u64;
        while let Some(&id) = self.workers[w].waiting.front() {
            let request = &self.requests[&id];
            let need = Need {
                keys: &request.keys[..request.stored],
                locals: &request.locals[..request.stored],
                private: request.private,
            };
            let Some(admission) = self.workers[w].admit(need) else {
                return Ok(());
            };
            self.workers[w].waiting.pop_front();
            let now = self.now_us();
            let r = &self.workload.trace.requests[request.req];
            let cached_tokens = (admission.cached as u64 * bs).min(r.input_tokens);
            self.summary.record_start(r.input_tokens, cached_tokens);
            let uncached = r.input_tokens.saturating_sub(cached_tokens).max(1);
            let worker = &mut self.workers[w];
            let prefill_start = now.max(worker.prefill_free_us);
            let prefill_end =
                prefill_start + secs_to_us(uncached as f64 * self.cfg.prefill_s_per_token);
            worker.prefill_free_us = prefill_end;
            let finish =
                prefill_end + secs_to_us(r.output_tokens as f64 * self.cfg.decode_s_per_token);

            if !admission.evicted_keys.is_empty() {
                let hashes = admission
                    .evicted_keys
                    .iter()
                    .map(|&k| engine_hash(k))
                    .collect();
                let removed = admission.evicted_keys.len() as u64;
                self.publish(
                    w,
                    VllmEvent::BlockRemoved {
                        block_hashes: hashes,
                        medium: Some("GPU".into()),
                    },
                )
                .await?;
                self.summary.removed_blocks += removed;
            }
            let request = self
                .requests
                .get_mut(&id)
                .expect("admitted request is known");
            if !admission.stored.is_empty() {
                let from = admission.cached * bs as usize;
                let to = (admission.cached + admission.stored.len()) * bs as usize;
                request.pending_store = Some(PendingStore {
                    event: VllmEvent::BlockStored {
                        block_hashes: admission.stored.iter().map(|b| b.engine_hash).collect(),
                        parent_block_hash: admission.parent,
                        token_ids: request.tokens[from..to].to_vec(),
                        block_size: self.cfg.block_size,
                        lora_id: None,
                        medium: Some("GPU".into()),
                        lora_name: None,
                    },
                    blocks: admission.stored.len() as u64,
                });
            }
            request.prefill_end_us = prefill_end;
            self.schedule(prefill_end, Ev::PrefillDone(id));
            self.schedule(finish, Ev::Finish(id));
        }
        Ok(())
    }

    /// One event as one batch with the worker's next `Kv-Seq`.
    async fn publish(&mut self, w: usize, event: VllmEvent) -> anyhow::Result<()> {
        self.workers[w].kv_seq += 1;
        let seq = self.workers[w].kv_seq;
        let id = self.workers[w].id.to_string();
        let ts = self.ts();
        self.publisher
            .events(&id, seq, ts, std::slice::from_ref(&event))
            .await?;
        self.summary.kv_batches += 1;
        Ok(())
    }

    async fn prefill_done(&mut self, id: usize) -> anyhow::Result<()> {
        let Some(request) = self.requests.get_mut(&id) else {
            return Ok(());
        };
        let ttft_us = request.prefill_end_us.saturating_sub(request.arrival_us);
        let w = request.worker.expect("a started request has a worker");
        let store = request.pending_store.take();
        if self.held_prefix.is_none() && request.stored >= 4 {
            self.held_prefix = Some(request.tokens[..4 * self.cfg.block_size as usize].to_vec());
        }
        self.summary.record_ttft(ttft_us as f64 / 1e6);
        match store {
            Some(store) => self.announce_store(w, store).await,
            None => Ok(()),
        }
    }

    /// Publishes a request's newly cached blocks.
    async fn announce_store(&mut self, w: usize, store: PendingStore) -> anyhow::Result<()> {
        self.publish(w, store.event).await?;
        self.summary.stored_blocks += store.blocks;
        Ok(())
    }

    async fn finish(&mut self, id: usize, at_us: u64) -> anyhow::Result<()> {
        let Some(request) = self.requests.remove(&id) else {
            return Ok(());
        };
        let w = request.worker.expect("a finished request has a worker");
        self.workers[w].release(&request.keys[..request.stored], request.private);
        self.release(request.reservation);
        self.summary.completed += 1;
        if let Some(next) = self.workload.follow_up[request.req] {
            let think = self.workload.trace.requests[next]
                .follows
                .expect("a follow-up has a previous request")
                .think_us;
            self.schedule(at_us + think, Ev::Arrive(next));
        }
        // Freed blocks and a free batch slot may let waiting requests start.
        self.admit_waiting(w).await
    }

    /// Stops the fleet cleanly: no new arrivals; routes still in flight come back and are
    /// released unexecuted; the blocks of requests still in prefill are announced now, so the
    /// daemon's view ends equal to the workers' caches; every reservation is released; then it
    /// waits (up to `deadline`) for the daemon's replies and the broker's acks.
    pub async fn wind_down(&mut self, deadline: Duration) -> anyhow::Result<()> {
        self.timeline.clear();
        self.stopping = true;
        let until = tokio::time::Instant::now() + deadline;
        let mut ids: Vec<usize> = self.requests.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let started = self.requests[&id].worker.is_some();
            if !started {
                continue; // its route is in flight: released when the reply comes
            }
            let request = self.requests.remove(&id).expect("listed");
            let w = request.worker.expect("started");
            if let Some(store) = request.pending_store {
                self.announce_store(w, store).await?;
            }
            self.release(request.reservation);
        }
        for w in &mut self.workers {
            w.waiting.clear();
        }
        while self.in_flight > 0 {
            match tokio::time::timeout_at(until, self.replies.recv()).await {
                Ok(Some(reply)) => self.on_reply(reply).await?,
                Ok(None) => unreachable!("the fleet holds a sender"),
                Err(_) => anyhow::bail!(
                    "the daemon at {} did not answer {} requests within {deadline:?}",
                    self.gateway.base(),
                    self.in_flight
                ),
            }
        }
        match tokio::time::timeout_at(until, self.publisher.settle()).await {
            Ok(result) => result,
            Err(_) => {
                anyhow::bail!("NATS did not acknowledge the demo's events within {deadline:?}")
            }
        }
    }

    /// The blocks each worker's cache holds now.
    pub fn resident_blocks(&self) -> Vec<(String, u64)> {
        self.workers
            .iter()
            .map(|w| (w.id.to_string(), w.resident_keys().len() as u64))
            .collect()
    }

    async fn send_load(&mut self, w: usize) -> anyhow::Result<()> {
        let worker = &self.workers[w];
        let id = worker.id.to_string();
        let (usage, running, waiting, max) = (
            worker.kv_usage(),
            worker.running,
            worker.waiting.len() as u32,
            worker.max_running,
        );
        let ts = self.ts();
        self.publisher
            .load(&id, usage, running, waiting, max, ts)
            .await?;
        self.summary.load_samples += 1;
        Ok(())
    }
}

fn secs_to_us(s: f64) -> u64 {
    (s * 1e6).round() as u64
}
