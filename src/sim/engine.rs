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

use super::timeline::Timeline;
use super::trace::{ratio, Trace};
use super::worker::{Need, SimWorker};
use crate::input::{
    Input, KvEvent, KvEventBatch, Lifecycle, LifecycleOp, LoadSample, Medium, RouteRequest,
    Stamped, WorkerId,
};
use crate::policy::{DecisionLabel, PolicyKind};
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
    routed: bool,
    finished: bool,
    /// Blocks the worker caches for it, and its private blocks.
    stored: usize,
    private: u64,
    ttft_us: u64,
}

/// Progress callback: (policy, completed requests, total requests).
pub type Progress<'a> = &'a (dyn Fn(PolicyKind, u64, u64) + Sync);

struct Sim<'a> {
    trace: &'a Trace,
    keys: &'a [Vec<u64>],
    cfg: &'a SimConfig,
    policy: PolicyKind,
    router: Router,
    seq: u64,
    now_us: u64,
    timeline: Timeline<Ev>,
    /// Arrivals, completions and deliveries still in the heap.
    pending: u64,
    workers: Vec<SimWorker>,
    worker_of: FxHashMap<WorkerId, usize>,
    /// Block key → how many workers hold it.
    residency: FxHashMap<u64, u32>,
    reqs: Vec<ReqState>,
    /// Request → the follow-up it releases.
    follow_up: Vec<Option<usize>>,
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
    progress: Option<Progress<'a>>,
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
        router: Router::new(router_config),
        seq,
        now_us: 0,
        timeline: Timeline::default(),
        pending: 0,
        workers,
        worker_of,
        residency: FxHashMap::default(),
        reqs: vec![ReqState::default(); trace.requests.len()],
        follow_up,
        completed: 0,
        cached_tokens: 0,
        duplicate_copies: 0,
        rejections: 0,
        decisions: [0; DecisionLabel::ALL.len()],
        follow_ups: 0,
        follow_up_moves: 0,
        first_token_releases: 0,
        first_arrival_us: None,
        last_finish_us: 0,
        progress,
        next_progress: 1,
    };
    sim.start(&mut rng);
    sim.run()?;
    Ok(sim.report())
}

impl Sim<'_> {
    fn apply(&mut self, input: Input) -> Output {
        self.seq += 1;
        let out = self.router.apply(&Stamped {
            seq: self.seq,
            at_ms: EPOCH_MS + self.now_us / 1000,
            input,
        });
        if let Output::Ingested(report) = &out {
            self.rejections +=
                report.rejections.len() as u64 + report.duplicate as u64 + report.seq_gap;
        }
        out
    }

    fn schedule(&mut self, at_us: u64, ev: Ev) {
        if !ev.periodic() {
            self.pending += 1;
        }
        self.timeline.schedule(at_us, ev);
    }

    fn start(&mut self, rng: &mut ChaCha8Rng) {
        for w in 0..self.workers.len() {
            self.apply(Input::Lifecycle(Lifecycle {
                worker: self.workers[w].id.clone(),
                op: LifecycleOp::Join,
                model: None,
                block_size: Some(self.trace.block_tokens),
                capacity_blocks: Some(self.cfg.capacity_blocks),
                dp_size: None,
                epoch: None,
            }));
            self.send_load(w);
        }
        for w in 0..self.workers.len() {
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
        while let Some((at_us, ev)) = self.timeline.pop() {
            debug_assert!(at_us >= self.now_us, "time never runs backwards");
            self.now_us = at_us;
            if !ev.periodic() {
                self.pending -= 1;
            }
            match ev {
                Ev::Arrive(r) => self.arrive(r)?,
                Ev::FirstToken(r) => {
                    let reservation = self.reqs[r].reservation;
                    let out = self.apply(Input::Release {
                        reservation,
                        phase: Some(ReleasePhase::Prefill),
                    });
                    if matches!(out, Output::Released { found: true, .. }) {
                        self.first_token_releases += 1;
                    }
                }
                Ev::Finish(r) => self.finish(r),
                Ev::Deliver(mut input) => {
                    // The publisher numbers batches as it sends them; with one delay for all
                    // batches, sending order is delivery order.
                    if let Input::KvEvents(batch) = &mut input {
                        let w = self.worker_of[&batch.worker];
                        self.workers[w].kv_seq += 1;
                        batch.seq = Some(self.workers[w].kv_seq);
                    }
                    self.apply(input);
                }
                Ev::Load(w) => {
                    self.send_load(w);
                    if self.completed < total {
                        self.stuck_check()?;
                        let next = self.now_us + self.cfg.load_interval_ms * 1000;
                        self.schedule(next, Ev::Load(w));
                    }
                }
                Ev::Tick => {
                    self.apply(Input::Tick);
                    if self.completed < total {
                        self.stuck_check()?;
                        let next = self.now_us + self.cfg.tick_interval_ms * 1000;
                        self.schedule(next, Ev::Tick);
                    }
                }
            }
        }
        if self.completed != total {
            bail!(
                "{}: {} of {} requests completed",
                self.policy,
                self.completed,
                total
            );
        }
        Ok(())
    }

    /// With nothing left to happen but periodic events, unfinished requests would never finish.
    fn stuck_check(&self) -> anyhow::Result<()> {
        if self.pending == 0 && self.workers.iter().all(|w| w.running == 0) {
            bail!(
                "{}: simulation stalled with {} of {} requests completed",
                self.policy,
                self.completed,
                self.trace.requests.len()
            );
        }
        Ok(())
    }

    fn send_load(&mut self, w: usize) {
        let worker = &self.workers[w];
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
        let decision = match self.apply(Input::Route(route)) {
            Output::Routed(d) => d,
            other => {
                return Err(anyhow!(
                    "{}: request {r} was not routed: {other:?}",
                    self.policy
                ))
            }
        };
        let w = *self
            .worker_of
            .get(&decision.worker)
            .ok_or_else(|| anyhow!("router chose unknown worker {}", decision.worker))?;
        let label = DecisionLabel::ALL
            .iter()
            .position(|l| *l == decision.decision)
            .expect("every label is in ALL");
        self.decisions[label] += 1;
        if let Some(f) = req.follows {
            self.follow_ups += 1;
            if self.reqs[f.previous].worker != w {
                self.follow_up_moves += 1;
            }
        }
        self.first_arrival_us.get_or_insert(self.now_us);

        // What the worker will cache: the keyed blocks, clamped so that one request alone
        // always fits in an empty cache; the rest of its tokens are private blocks.
        let cap = self.cfg.capacity_blocks;
        let bt = self.trace.block_tokens as u64;
        let stored = (self.keys[r].len() as u64).min(cap);
        let total_blocks = (req.input_tokens + req.output_tokens).div_ceil(bt);
        let private = total_blocks.saturating_sub(stored).min(cap - stored);
        let state = &mut self.reqs[r];
        assert!(!state.routed, "request {r} arrived twice");
        *state = ReqState {
            arrival_us: self.now_us,
            worker: w,
            reservation: decision.reservation,
            routed: true,
            finished: false,
            stored: stored as usize,
            private,
            ttft_us: 0,
        };
        self.workers[w].waiting.push_back(r);
        self.admit_waiting(w);
        Ok(())
    }

    /// Admits waiting requests in order while the head fits (head-of-line blocking, FCFS).
    fn admit_waiting(&mut self, w: usize) {
        while let Some(&r) = self.workers[w].waiting.front() {
            let state = &self.reqs[r];
            let stored = state.stored;
            let need = Need {
                keys: &self.keys[r][..stored],
                locals: &self.trace.requests[r].hash_ids[..stored],
                private: state.private,
            };
            let Some(admission) = self.workers[w].admit(need) else {
                return;
            };
            self.workers[w].waiting.pop_front();
            let req = &self.trace.requests[r];
            let bt = self.trace.block_tokens as u64;
            let cached_tokens = admission.cached as u64 * bt;
            self.cached_tokens += cached_tokens;
            let uncached = req.input_tokens.saturating_sub(cached_tokens).max(1);
            let worker = &mut self.workers[w];
            let prefill_start = self.now_us.max(worker.prefill_free_us);
            let prefill_end =
                prefill_start + secs_to_us(uncached as f64 * self.cfg.prefill_s_per_token);
            worker.prefill_free_us = prefill_end;
            let finish =
                prefill_end + secs_to_us(req.output_tokens as f64 * self.cfg.decode_s_per_token);
            self.reqs[r].ttft_us = prefill_end - self.reqs[r].arrival_us;

            for key in &admission.evicted_keys {
                let n = self
                    .residency
                    .get_mut(key)
                    .expect("evicted block was resident");
                *n -= 1;
                if *n == 0 {
                    self.residency.remove(key);
                }
            }
            for key in &admission.stored_keys {
                let n = self.residency.entry(*key).or_insert(0);
                if *n > 0 {
                    self.duplicate_copies += 1;
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
                self.schedule(self.now_us + delay, Ev::Deliver(batch));
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
        Input::KvEvents(KvEventBatch::of(self.workers[w].id.clone(), vec![event]))
    }

    fn finish(&mut self, r: usize) {
        let state = &mut self.reqs[r];
        assert!(
            state.routed && !state.finished,
            "request {r} finished twice"
        );
        state.finished = true;
        let (w, stored, private, reservation) =
            (state.worker, state.stored, state.private, state.reservation);
        self.workers[w].release(&self.keys[r][..stored], private);
        self.apply(Input::Release {
            reservation,
            phase: None,
        });
        self.completed += 1;
        self.last_finish_us = self.now_us;
        if let Some(next) = self.follow_up[r] {
            let think = self.trace.requests[next]
                .follows
                .expect("a follow-up has a previous request")
                .think_us;
            self.schedule(self.now_us + think, Ev::Arrive(next));
        }
        self.admit_waiting(w);
        self.report_progress();
    }

    fn report_progress(&mut self) {
        let Some(progress) = self.progress else {
            return;
        };
        let total = self.trace.requests.len() as u64;
        if self.completed * 10 >= self.next_progress * total {
            progress(self.policy, self.completed, total);
            self.next_progress = self.completed * 10 / total.max(1) + 1;
        }
    }

    /// The router's authoritative index holds exactly the blocks resident on the workers.
    fn index_in_sync(&self) -> bool {
        let resident: u64 = self
            .workers
            .iter()
            .map(|w| w.resident_keys().len() as u64)
            .sum();
        resident == self.router.index_stats().entries
            && self.workers.iter().all(|w| {
                w.resident_keys()
                    .into_iter()
                    .all(|key| self.router.owns(&w.id, None, None, key))
            })
    }

    fn report(&self) -> PolicyReport {
        let mut ttft: Vec<f64> = self.reqs.iter().map(|r| r.ttft_us as f64 / 1e6).collect();
        ttft.sort_by(f64::total_cmp);
        let served: Vec<u64> = self.workers.iter().map(|w| w.served).collect();
        let mean = served.iter().sum::<u64>() as f64 / served.len() as f64;
        let var = served
            .iter()
            .map(|&s| (s as f64 - mean).powi(2))
            .sum::<f64>()
            / served.len() as f64;
        let max = served.iter().copied().max().unwrap_or(0) as f64;
        let makespan_s = self.first_arrival_us.map_or(0.0, |first| {
            self.last_finish_us.saturating_sub(first) as f64 / 1e6
        });
        let prompt_tokens = self.trace.prompt_tokens();
        PolicyReport {
            policy: self.policy,
            requests: self.trace.requests.len() as u64,
            completed: self.completed,
            prompt_tokens,
            cached_tokens: self.cached_tokens,
            prefix_hit_ratio: ratio(self.cached_tokens, prompt_tokens),
            ideal_hit_ratio: self.trace.ideal_hit_ratio(),
            duplicate_copies: self.duplicate_copies,
            evictions: self.workers.iter().map(|w| w.evictions).sum(),
            ttft_p50_s: percentile(&ttft, 0.50),
            ttft_p90_s: percentile(&ttft, 0.90),
            ttft_p99_s: percentile(&ttft, 0.99),
            ttft_s: ttft,
            throughput_rps: if makespan_s > 0.0 {
                self.completed as f64 / makespan_s
            } else {
                0.0
            },
            makespan_s,
            follow_ups: self.follow_ups,
            follow_up_moves: self.follow_up_moves,
            decisions: DecisionLabel::ALL
                .iter()
                .zip(self.decisions)
                .map(|(l, n)| (l.as_str().to_string(), n))
                .collect(),
            load_spread: if mean > 0.0 { var.sqrt() / mean } else { 0.0 },
            load_max_over_mean: if mean > 0.0 { max / mean } else { 0.0 },
            served_per_worker: served,
            capacity_blocks: self.cfg.capacity_blocks,
            peak_blocks: self.workers.iter().map(|w| w.peak_used).collect(),
            router_rejections: self.rejections,
            index_in_sync: self.index_in_sync(),
            first_token_releases: self.first_token_releases,
            reserved_work_at_end: self
                .router
                .worker_rows(EPOCH_MS + self.now_us / 1000)
                .iter()
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
