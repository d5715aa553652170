//! The discrete-event loop: simulated workers around the real routing core.
//!
//! Every input reaches the core as a [`Stamped`] input with the simulated clock and an
//! increasing sequence number, exactly as the daemon journals them: lifecycle joins, KV event
//! batches (after the configured delay), load samples (at the configured interval), route
//! requests, releases (the prefill part at the first token, the rest at completion) and ticks.
//! Nothing here reads the wall clock, and ties between events at the same simulated instant are
//! broken by the order they were scheduled in, so a run is a pure function of the trace, the
//! configuration and the seed.

use std::collections::BTreeMap;

use anyhow::{anyhow, bail};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rustc_hash::FxHashMap;

use super::replicas::Routers;
use super::timeline::Timeline;
use super::trace::{ratio, Trace};
use super::worker::{Need, SimWorker};
use crate::input::{
    Input, KvEvent, KvEventBatch, Lifecycle, LifecycleOp, LoadSample, Medium, RouteRequest,
    WorkerId,
};
use crate::policy::{DecisionLabel, PolicyKind};
use crate::replicas::PeerEvent;
use crate::reservations::ReleasePhase;
use crate::router::{Output, Router, RouterConfig};

/// The daemon clock (ms) at simulated time zero. Any value works; a nonzero one keeps
/// `saturating_sub` edge cases at zero out of the picture.
const EPOCH_MS: u64 = 1_000_000;

/// The simulated fleet and how it talks to the router.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    pub workers: usize,
    /// KV capacity of each worker, in blocks.
    pub capacity_blocks: u64,
    /// Batch limit: requests running at once on a worker.
    pub max_running: u32,
    /// Prefill time per uncached prompt token, seconds.
    pub prefill_s_per_token: f64,
    /// Decode time per output token, seconds.
    pub decode_s_per_token: f64,
    /// Delay between a cache change on a worker and its KV event reaching the router.
    pub kv_event_delay_ms: u64,
    /// Interval between two load samples of a worker.
    pub load_interval_ms: u64,
    /// Interval between two `Tick` inputs.
    pub tick_interval_ms: u64,
    /// Router and policy settings; `block_size` is set to the trace's block tokens and
    /// `policy.kind` to the policy being simulated.
    pub router: RouterConfig,
    /// Seeds the load-sample phases and the journal sequence the router draws its random
    /// choices from.
    pub seed: u64,
    /// Routers behind a round-robin gateway (1: one router).
    pub replicas: usize,
    /// Delay of a replica's decisions and releases to the other replicas; none: replicas do
    /// not share them (each decides on its own records only).
    pub decision_delay_ms: Option<u64>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            workers: 8,
            capacity_blocks: 2048,
            max_running: 16,
            prefill_s_per_token: 1e-4,
            decode_s_per_token: 0.02,
            kv_event_delay_ms: 50,
            load_interval_ms: 1000,
            tick_interval_ms: 1000,
            router: RouterConfig::default(),
            seed: 0,
            replicas: 1,
            decision_delay_ms: Some(5),
        }
    }
}

impl SimConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.workers >= 1, "at least one worker is needed");
        anyhow::ensure!(self.workers <= 10_000, "at most 10000 workers");
        anyhow::ensure!(
            self.capacity_blocks >= 1,
            "capacity must be at least one block"
        );
        anyhow::ensure!(self.max_running >= 1, "the batch limit must be at least 1");
        for (name, v) in [
            ("prefill seconds per token", self.prefill_s_per_token),
            ("decode seconds per token", self.decode_s_per_token),
        ] {
            anyhow::ensure!(
                v.is_finite() && v >= 0.0,
                "{name} must be a non-negative number"
            );
        }
        anyhow::ensure!(self.load_interval_ms >= 1, "load interval must be positive");
        anyhow::ensure!(self.tick_interval_ms >= 1, "tick interval must be positive");
        anyhow::ensure!(
            (1..=64).contains(&self.replicas),
            "replicas must be between 1 and 64"
        );
        anyhow::ensure!(
            self.load_interval_ms < self.router.worker_ttl_ms,
            "load interval must be shorter than the worker TTL, or workers age out"
        );
        Ok(())
    }
}

/// Everything measured for one policy on one trace.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyReport {
    pub policy: PolicyKind,
    pub requests: u64,
    /// Requests that finished (conservation: equals `requests`).
    pub completed: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens found in the chosen worker's cache when the request started prefill.
    pub cached_tokens: u64,
    pub prefix_hit_ratio: f64,
    pub ideal_hit_ratio: f64,
    /// Blocks stored on a worker while already resident on another worker.
    pub duplicate_copies: u64,
    pub evictions: u64,
    /// TTFT of every request (queueing + prefill), seconds, sorted ascending.
    pub ttft_s: Vec<f64>,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    /// Completed requests per second of simulated time (first arrival to last completion).
    pub throughput_rps: f64,
    /// Simulated seconds from the first arrival to the last completion.
    pub makespan_s: f64,
    /// Requests that are a later turn of a session (closed-loop follow-ups).
    pub follow_ups: u64,
    /// Follow-ups routed to another worker than their previous turn: trajectory churn.
    pub follow_up_moves: u64,
    /// Route decisions per label; every label is present.
    pub decisions: BTreeMap<String, u64>,
    /// Requests served per worker, in worker order.
    pub served_per_worker: Vec<u64>,
    /// Coefficient of variation (population std / mean) of requests served per worker.
    pub load_spread: f64,
    /// Max / mean of requests served per worker.
    pub load_max_over_mean: f64,
    pub capacity_blocks: u64,
    /// Highest number of blocks (cached + private) each worker ever held.
    pub peak_blocks: Vec<u64>,
    /// KV event parts the router rejected, batches it skipped as duplicates and batches it
    /// counted as missing (all should be 0).
    pub router_rejections: u64,
    /// After the last event, the router's authoritative index equals the workers' caches.
    pub index_in_sync: bool,
    /// Prefill parts the gateways released at a request's first token that the router found.
    pub first_token_releases: u64,
    /// Reserved work the router still holds after the last event (every request finished and
    /// released its reservation: 0).
    pub reserved_work_at_end: u64,
}

#[derive(Debug)]
enum Ev {
    Arrive(usize),
    /// The gateway sees the request's first token and releases the prefill part.
    FirstToken(usize),
    Finish(usize),
    Deliver(Input),
    /// A replica's decision or release reaches another replica.
    Peer(usize, Box<PeerEvent>),
    Load(usize),
    Tick,
}

impl Ev {
    fn periodic(&self) -> bool {
        matches!(self, Ev::Load(_) | Ev::Tick)
    }
}

#[derive(Debug, Clone, Default)]
struct ReqState {
    arrival_us: u64,
    worker: usize,
    reservation: u64,
    /// The replica that routed it: the gateway releases there.
    replica: usize,
    routed: bool,
    finished: bool,
    /// Blocks the worker caches for it, and its private blocks.
    stored: usize,
    private: u64,
    ttft_us: u64,
}

/// Progress callback: (policy, completed requests, total requests).
pub type Progress<'a> = &'a (dyn Fn(PolicyKind, u64, u64) + Sync);

/// The simulation: the workload, the routers, the clock, the simulated fleet and what is
/// measured, each its own part.
struct Sim<'a> {
    trace: &'a Trace,
    keys: &'a [Vec<u64>],
    cfg: &'a SimConfig,
    policy: PolicyKind,
    routers: Routers,
    clock: Clock,
    fleet: Fleet,
    stats: Stats,
    progress: Option<Progress<'a>>,
}

/// Simulated time and what is scheduled.
#[derive(Default)]
struct Clock {
    now_us: u64,
    timeline: Timeline<Ev>,
    /// Arrivals, completions and deliveries still in the heap.
    pending: u64,
}

/// The simulated workers and the requests they serve.
struct Fleet {
    workers: Vec<SimWorker>,
    worker_of: FxHashMap<WorkerId, usize>,
    /// Block key → how many workers hold it.
    residency: FxHashMap<u64, u32>,
    reqs: Vec<ReqState>,
    /// Request → the follow-up it releases.
    follow_up: Vec<Option<usize>>,
}

/// What is counted along the way.
#[derive(Default)]
struct Stats {
    completed: u64,
    cached_tokens: u64,
    duplicate_copies: u64,
    rejections: u64,
    decisions: [u64; DecisionLabel::ALL.len()],
    follow_ups: u64,
    follow_up_moves: u64,
    first_token_releases: u64,
    first_arrival_us: Option<u64>,
    last_finish_us: u64,
    next_progress: u64,
}

/// Block keys of every request of `trace` (what [`simulate`] needs besides the trace);
/// compute once and share between policies.
pub fn trace_keys(trace: &Trace) -> Vec<Vec<u64>> {
    (0..trace.requests.len()).map(|i| trace.keys(i)).collect()
}

/// Runs `trace` against `config.workers` simulated workers routed by `policy`.
/// `keys` is [`trace_keys`] of the trace.
pub fn simulate(
    trace: &Trace,
    keys: &[Vec<u64>],
    config: &SimConfig,
    policy: PolicyKind,
    progress: Option<Progress>,
) -> anyhow::Result<PolicyReport> {
    config.validate()?;
    anyhow::ensure!(
        keys.len() == trace.requests.len(),
        "keys do not match the trace"
    );
    let mut router_config = config.router.clone();
    router_config.block_size = trace.block_tokens;
    router_config.policy.kind = policy;
    let width = config.workers.saturating_sub(1).to_string().len().max(2);
    let workers: Vec<SimWorker> = (0..config.workers)
        .map(|i| {
            let id = WorkerId::new(&format!("w{i:0width$}")).expect("valid worker id");
            SimWorker::new(id, config.capacity_blocks, config.max_running)
        })
        .collect();
    let worker_of = workers
        .iter()
        .enumerate()
        .map(|(i, w)| (w.id.clone(), i))
        .collect();
    let mut follow_up = vec![None; trace.requests.len()];
    for (i, r) in trace.requests.iter().enumerate() {
        if let Some(f) = r.follows {
            follow_up[f.previous] = Some(i);
        }
    }
    // The journal sequence seeds the router's random choices; the seed picks where it starts.
    let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
    let seq = rng.random::<u64>() >> 24;
    let mut sim = Sim {
        trace,
        keys,
        cfg: config,
        policy,
        routers: Routers::new(
            router_config,
            config.replicas,
            config.decision_delay_ms,
            seq,
            config.seed,
        ),
        clock: Clock::default(),
        fleet: Fleet {
            workers,
            worker_of,
            residency: FxHashMap::default(),
            reqs: vec![ReqState::default(); trace.requests.len()],
            follow_up,
        },
        stats: Stats {
            next_progress: 1,
            ..Stats::default()
        },
        progress,
    };
    sim.start(&mut rng);
    sim.run()?;
    Ok(sim.report())
}

impl Sim<'_> {
    fn at_ms(&self) -> u64 {
        EPOCH_MS + self.clock.now_us / 1000
    }

    /// Applies an input every router consumes (worker events, load samples, lifecycle, ticks).
    fn apply(&mut self, input: Input) {
        for out in self.routers.apply_all(self.at_ms(), &input) {
            if let Output::Ingested(report) = &out {
                self.stats.rejections +=
                    report.rejections.len() as u64 + report.duplicate as u64 + report.seq_gap;
            }
        }
    }

    /// Applies a gateway's input (a route or a release) on one replica, and sends what it
    /// decided or released on to the others.
    fn apply_on(&mut self, replica: usize, input: Input) -> Output {
        let out = self.routers.apply(replica, self.at_ms(), input);
        for (at_us, to, event) in self.routers.deliveries(replica, self.clock.now_us, &out) {
            self.schedule(at_us, Ev::Peer(to, event));
        }
        out
    }

    fn schedule(&mut self, at_us: u64, ev: Ev) {
        if !ev.periodic() {
            self.clock.pending += 1;
        }
        self.clock.timeline.schedule(at_us, ev);
    }

    fn start(&mut self, rng: &mut ChaCha8Rng) {
        for w in 0..self.fleet.workers.len() {
            self.apply(Input::Lifecycle(Lifecycle {
                worker: self.fleet.workers[w].id.clone(),
                op: LifecycleOp::Join,
                model: None,
                block_size: Some(self.trace.block_tokens),
                capacity_blocks: Some(self.cfg.capacity_blocks),
                dp_size: None,
                epoch: None,
            }));
            self.send_load(w);
        }
        for w in 0..self.fleet.workers.len() {
            // Workers sample load on their own clocks: a seeded phase per worker.
            let phase_ms = rng.random_range(0..self.cfg.load_interval_ms);
            self.schedule((phase_ms + 1) * 1000, Ev::Load(w));
        }
        self.schedule(self.cfg.tick_interval_ms * 1000, Ev::Tick);
        for (i, r) in self.trace.requests.iter().enumerate() {
            if r.follows.is_none() {
                self.schedule(r.arrival_us, Ev::Arrive(i));
            }
        }
    }

    fn run(&mut self) -> anyhow::Result<()> {
        let total = self.trace.requests.len() as u64;
        while let Some((at_us, ev)) = self.clock.timeline.pop() {
            debug_assert!(at_us >= self.clock.now_us, "time never runs backwards");
            self.clock.now_us = at_us;
            if !ev.periodic() {
                self.clock.pending -= 1;
            }
            match ev {
                Ev::Arrive(r) => self.arrive(r)?,
                Ev::FirstToken(r) => {
                    let ReqState {
                        reservation,
                        replica,
                        ..
                    } = self.fleet.reqs[r];
                    let release = Input::Release {
                        reservation,
                        phase: Some(ReleasePhase::Prefill),
                    };
                    let out = self.apply_on(replica, release);
                    if matches!(out, Output::Released { found: true, .. }) {
                        self.stats.first_token_releases += 1;
                    }
                }
                Ev::Finish(r) => self.finish(r),
                Ev::Deliver(mut input) => {
                    // The publisher numbers batches as it sends them; with one delay for all
                    // batches, sending order is delivery order.
                    if let Input::KvEvents(batch) = &mut input {
                        let w = self.fleet.worker_of[&batch.worker];
                        self.fleet.workers[w].kv_seq += 1;
                        batch.seq = Some(self.fleet.workers[w].kv_seq);
                    }
                    self.apply(input);
                }
                Ev::Peer(to, event) => {
                    let at_ms = self.at_ms();
                    self.routers.apply(to, at_ms, Input::Peer(event));
                }
                Ev::Load(w) => {
                    self.send_load(w);
                    if self.stats.completed < total {
                        self.stuck_check()?;
                        let next = self.clock.now_us + self.cfg.load_interval_ms * 1000;
                        self.schedule(next, Ev::Load(w));
                    }
                }
                Ev::Tick => {
                    self.apply(Input::Tick);
                    if self.stats.completed < total {
                        self.stuck_check()?;
                        let next = self.clock.now_us + self.cfg.tick_interval_ms * 1000;
                        self.schedule(next, Ev::Tick);
                    }
                }
            }
        }
        if self.stats.completed != total {
            bail!(
                "{}: {} of {} requests completed",
                self.policy,
                self.stats.completed,
                total
            );
        }
        Ok(())
    }

    /// With nothing left to happen but periodic events, unfinished requests would never finish.
    fn stuck_check(&self) -> anyhow::Result<()> {
        if self.clock.pending == 0 && self.fleet.workers.iter().all(|w| w.running == 0) {
            bail!(
                "{}: simulation stalled with {} of {} requests completed",
                self.policy,
                self.stats.completed,
                self.trace.requests.len()
            );
        }
        Ok(())
    }

    fn send_load(&mut self, w: usize) {
        let worker = &self.fleet.workers[w];
        let sample = LoadSample {
            worker: worker.id.clone(),
            kv_usage: worker.kv_usage(),
            running: worker.running,
            waiting: worker.waiting.len() as u32,
            max_running: Some(worker.max_running),
            model: None,
            dp_rank: 0,
        };
        self.apply(Input::Load(sample));
    }

    fn arrive(&mut self, r: usize) -> anyhow::Result<()> {
        let req = &self.trace.requests[r];
        let route = RouteRequest {
            model: None,
            lora: None,
            keys: self.keys[r].clone(),
            prompt_tokens: req.input_tokens,
            // A gateway passes the request's max_tokens; the trace's output length stands in.
            max_output_tokens: Some(req.output_tokens),
            exclude: Vec::new(),
            request_id: None,
            explain: false,
        };
        let replica = self.routers.next_for_route();
        let decision = match self.apply_on(replica, Input::Route(route)) {
            Output::Routed(d) => d,
            other => {
                return Err(anyhow!(
                    "{}: request {r} was not routed: {other:?}",
                    self.policy
                ))
            }
        };
        let w = *self
            .fleet
            .worker_of
            .get(&decision.worker)
            .ok_or_else(|| anyhow!("router chose unknown worker {}", decision.worker))?;
        let label = DecisionLabel::ALL
            .iter()
            .position(|l| *l == decision.decision)
            .expect("every label is in ALL");
        self.stats.decisions[label] += 1;
        if let Some(f) = req.follows {
            self.stats.follow_ups += 1;
            if self.fleet.reqs[f.previous].worker != w {
                self.stats.follow_up_moves += 1;
            }
        }
        self.stats.first_arrival_us.get_or_insert(self.clock.now_us);

        // What the worker will cache: the keyed blocks, clamped so that one request alone
        // always fits in an empty cache; the rest of its tokens are private blocks.
        let cap = self.cfg.capacity_blocks;
        let bt = self.trace.block_tokens as u64;
        let stored = (self.keys[r].len() as u64).min(cap);
        let total_blocks = (req.input_tokens + req.output_tokens).div_ceil(bt);
        let private = total_blocks.saturating_sub(stored).min(cap - stored);
        let state = &mut self.fleet.reqs[r];
        assert!(!state.routed, "request {r} arrived twice");
        *state = ReqState {
            arrival_us: self.clock.now_us,
            worker: w,
            reservation: decision.reservation,
            replica,
            routed: true,
            finished: false,
            stored: stored as usize,
            private,
            ttft_us: 0,
        };
        self.fleet.workers[w].waiting.push_back(r);
        self.admit_waiting(w);
        Ok(())
    }

    /// Admits waiting requests in order while the head fits (head-of-line blocking, FCFS).
    fn admit_waiting(&mut self, w: usize) {
        while let Some(&r) = self.fleet.workers[w].waiting.front() {
            let state = &self.fleet.reqs[r];
            let stored = state.stored;
            let need = Need {
                keys: &self.keys[r][..stored],
                locals: &self.trace.requests[r].hash_ids[..stored],
                private: state.private,
            };
            let Some(admission) = self.fleet.workers[w].admit(need) else {
                return;
            };
            self.fleet.workers[w].waiting.pop_front();
            let req = &self.trace.requests[r];
            let bt = self.trace.block_tokens as u64;
            let cached_tokens = admission.cached as u64 * bt;
            self.stats.cached_tokens += cached_tokens;
            let uncached = req.input_tokens.saturating_sub(cached_tokens).max(1);
            let worker = &mut self.fleet.workers[w];
            let prefill_start = self.clock.now_us.max(worker.prefill_free_us);
            let prefill_end =
                prefill_start + secs_to_us(uncached as f64 * self.cfg.prefill_s_per_token);
            worker.prefill_free_us = prefill_end;
            let finish =
                prefill_end + secs_to_us(req.output_tokens as f64 * self.cfg.decode_s_per_token);
            self.fleet.reqs[r].ttft_us = prefill_end - self.fleet.reqs[r].arrival_us;

            for key in &admission.evicted_keys {
                let n = self
                    .fleet
                    .residency
                    .get_mut(key)
                    .expect("evicted block was resident");
                *n -= 1;
                if *n == 0 {
                    self.fleet.residency.remove(key);
                }
            }
            for key in &admission.stored_keys {
                let n = self.fleet.residency.entry(*key).or_insert(0);
                if *n > 0 {
                    self.stats.duplicate_copies += 1;
                }
                *n += 1;
            }
            let delay = self.cfg.kv_event_delay_ms * 1000;
            if !admission.evicted_keys.is_empty() {
                let hashes = admission
                    .evicted_keys
                    .iter()
                    .map(|&k| super::worker::engine_hash(k))
                    .collect();
                let batch = self.kv_batch(
                    w,
                    KvEvent::Removed {
                        engine_hashes: hashes,
                        medium: Medium::Gpu,
                    },
                );
                self.schedule(self.clock.now_us + delay, Ev::Deliver(batch));
            }
            if !admission.stored.is_empty() {
                // Blocks are announced once computed, at the end of prefill.
                let batch = self.kv_batch(
                    w,
                    KvEvent::Stored {
                        parent: admission.parent,
                        blocks: admission.stored,
                        block_size: self.trace.block_tokens,
                        lora: None,
                        medium: Medium::Gpu,
                        full_attention: true,
                    },
                );
                self.schedule(prefill_end + delay, Ev::Deliver(batch));
            }
            self.schedule(prefill_end, Ev::FirstToken(r));
            self.schedule(finish, Ev::Finish(r));
        }
    }

    /// A batch of one event; its `Kv-Seq` is set when it is delivered.
    fn kv_batch(&self, w: usize, event: KvEvent) -> Input {
        Input::KvEvents(KvEventBatch::of(
            self.fleet.workers[w].id.clone(),
            vec![event],
        ))
    }

    fn finish(&mut self, r: usize) {
        let state = &mut self.fleet.reqs[r];
        assert!(
            state.routed && !state.finished,
            "request {r} finished twice"
        );
        state.finished = true;
        let (w, stored, private, reservation, replica) = (
            state.worker,
            state.stored,
            state.private,
            state.reservation,
            state.replica,
        );
        self.fleet.workers[w].release(&self.keys[r][..stored], private);
        self.apply_on(
            replica,
            Input::Release {
                reservation,
                phase: None,
            },
        );
        self.stats.completed += 1;
        self.stats.last_finish_us = self.clock.now_us;
        if let Some(next) = self.fleet.follow_up[r] {
            let think = self.trace.requests[next]
                .follows
                .expect("a follow-up has a previous request")
                .think_us;
            self.schedule(self.clock.now_us + think, Ev::Arrive(next));
        }
        self.admit_waiting(w);
        self.report_progress();
    }

    fn report_progress(&mut self) {
        let Some(progress) = self.progress else {
            return;
        };
        let total = self.trace.requests.len() as u64;
        if self.stats.completed * 10 >= self.stats.next_progress * total {
            progress(self.policy, self.stats.completed, total);
            self.stats.next_progress = self.stats.completed * 10 / total.max(1) + 1;
        }
    }

    /// Every router's authoritative index holds exactly the blocks resident on the workers.
    fn index_in_sync(&self) -> bool {
        (0..self.routers.len()).all(|r| self.router_in_sync(self.routers.router(r)))
    }

    fn router_in_sync(&self, router: &Router) -> bool {
        let resident: u64 = self
            .fleet
            .workers
            .iter()
            .map(|w| w.resident_keys().len() as u64)
            .sum();
        resident == router.index_stats().entries
            && self.fleet.workers.iter().all(|w| {
                w.resident_keys()
                    .into_iter()
                    .all(|key| router.owns(&w.id, None, None, key))
            })
    }

    fn report(&self) -> PolicyReport {
        let mut ttft: Vec<f64> = self
            .fleet
            .reqs
            .iter()
            .map(|r| r.ttft_us as f64 / 1e6)
            .collect();
        ttft.sort_by(f64::total_cmp);
        let served: Vec<u64> = self.fleet.workers.iter().map(|w| w.served).collect();
        let mean = served.iter().sum::<u64>() as f64 / served.len() as f64;
        let var = served
            .iter()
            .map(|&s| (s as f64 - mean).powi(2))
            .sum::<f64>()
            / served.len() as f64;
        let max = served.iter().copied().max().unwrap_or(0) as f64;
        let makespan_s = self.stats.first_arrival_us.map_or(0.0, |first| {
            self.stats.last_finish_us.saturating_sub(first) as f64 / 1e6
        });
        let prompt_tokens = self.trace.prompt_tokens();
        PolicyReport {
            policy: self.policy,
            requests: self.trace.requests.len() as u64,
            completed: self.stats.completed,
            prompt_tokens,
            cached_tokens: self.stats.cached_tokens,
            prefix_hit_ratio: ratio(self.stats.cached_tokens, prompt_tokens),
            ideal_hit_ratio: self.trace.ideal_hit_ratio(),
            duplicate_copies: self.stats.duplicate_copies,
            evictions: self.fleet.workers.iter().map(|w| w.evictions).sum(),
            ttft_p50_s: percentile(&ttft, 0.50),
            ttft_p90_s: percentile(&ttft, 0.90),
            ttft_p99_s: percentile(&ttft, 0.99),
            ttft_s: ttft,
            throughput_rps: if makespan_s > 0.0 {
                self.stats.completed as f64 / makespan_s
            } else {
                0.0
            },
            makespan_s,
            follow_ups: self.stats.follow_ups,
            follow_up_moves: self.stats.follow_up_moves,
            decisions: DecisionLabel::ALL
                .iter()
                .zip(self.stats.decisions)
                .map(|(l, n)| (l.as_str().to_string(), n))
                .collect(),
            load_spread: if mean > 0.0 { var.sqrt() / mean } else { 0.0 },
            load_max_over_mean: if mean > 0.0 { max / mean } else { 0.0 },
            served_per_worker: served,
            capacity_blocks: self.cfg.capacity_blocks,
            peak_blocks: self.fleet.workers.iter().map(|w| w.peak_used).collect(),
            router_rejections: self.stats.rejections,
            index_in_sync: self.index_in_sync(),
            first_token_releases: self.stats.first_token_releases,
            reserved_work_at_end: (0..self.routers.len())
                .flat_map(|r| self.routers.router(r).worker_rows(self.at_ms()))
                .map(|w| w.reserved_work)
                .sum(),
        }
    }
}

fn secs_to_us(s: f64) -> u64 {
    (s * 1e6).round() as u64
}

/// Nearest-rank percentile of sorted values (the default, zero, for none). The one percentile
/// of the project: the simulator, the demo and the benchmarks report with it.
pub fn percentile<T: Copy + Default>(sorted: &[T], p: f64) -> T {
    if sorted.is_empty() {
        return T::default();
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}
