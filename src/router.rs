//! The router: one deterministic state machine (DESIGN.md §2).
//!
//! [`Router::apply`] folds one [`Stamped`] input into the state and returns what happened. There
//! is no I/O, no wall clock and no ambient randomness in here: time comes with the input, and the
//! power-of-two choices draw from an RNG seeded with the input's sequence number. Applying the
//! same inputs in the same order therefore always yields the same state and the same decisions,
//! which is what makes the journal an audit log that can be replayed.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::index::{ApproxIndex, IndexStats, Namespaces, NsId, OwnerIndex, Slot};
use crate::input::{
    Input, KvEvent, KvEventBatch, Lifecycle, LifecycleOp, Medium, RejectReason, Rejection,
    RouteRequest, Stamped, WorkerId,
};
use crate::policy::{
    self, DecisionLabel, PolicyConfig, PolicyState, ProvisionalOwner, RouteView, WorkerView,
};
use crate::reservations::Reservations;
use crate::workers::{SeqCheck, WorkerState, Workers};

/// Router settings besides the policy's (DESIGN.md §13). Durations are in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouterConfig {
    pub policy: PolicyConfig,
    /// Tokens per block; KV events with another block size are rejected, never re-chunked.
    pub block_size: u32,
    /// How long the router's own routing records count as ownership.
    pub approx_ttl_ms: u64,
    /// Bound on approximate-ownership records (one per routed block), oldest dropped first.
    pub approx_max_records: usize,
    pub reservation_ttl_ms: u64,
    /// Output tokens assumed for reserved work when the request gives no smaller maximum.
    pub output_estimate: u64,
    /// A worker not heard from for this long is removed like a `leave`.
    pub worker_ttl_ms: u64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            policy: PolicyConfig::default(),
            block_size: 16,
            approx_ttl_ms: 120_000,
            approx_max_records: 4_000_000,
            reservation_ttl_ms: 600_000,
            output_estimate: 4096,
            worker_ttl_ms: 60_000,
        }
    }
}

/// A routing decision, as the HTTP API returns it and the journal records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub worker: WorkerId,
    pub decision: DecisionLabel,
    pub matched_blocks: u32,
    pub prompt_blocks: u32,
    /// Known owners of the matched prefix, by id.
    pub owners: Vec<WorkerId>,
    /// Reservation id to pass to `/v1/release`.
    pub reservation: u64,
    pub request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub explain: Option<Vec<ExplainRow>>,
}

/// Why a decision came out as it did: one row per known worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExplainRow {
    pub worker: WorkerId,
    pub candidate: bool,
    pub state: WorkerState,
    pub depth: u32,
    pub pressure: Option<f64>,
    pub telemetry_age_ms: Option<u64>,
    pub reserved_work: u64,
    /// Its load sample's pressure (`pressure` is what the policy ranked by).
    #[serde(default)]
    pub sample_pressure: Option<f64>,
    /// Reserved prompt tokens whose prefill it has not finished.
    #[serde(default)]
    pub prefill_backlog_tokens: u64,
    /// Leading blocks of the request it holds in host memory and on disk.
    #[serde(default)]
    pub host_depth: u32,
    #[serde(default)]
    pub disk_depth: u32,
    /// Blocks a match needed to make owners (min_match_blocks and min_match_ratio of the prompt).
    #[serde(default)]
    pub match_threshold: u32,
    /// The `dynamo_cost` baseline's cost of this worker for the request (candidates only).
    #[serde(default)]
    pub dynamo_cost: Option<f64>,
}

/// What applying a KV event batch, load sample or lifecycle message did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IngestReport {
    /// The worker was not known before this input.
    pub new_worker: bool,
    /// The batch's `Kv-Seq` was at or below the last applied one: skipped.
    pub duplicate: bool,
    /// Batches missed before this one, by `Kv-Seq`.
    pub seq_gap: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub cleared: u64,
    /// Blocks on a non-GPU medium: counted, not indexed.
    pub ignored_blocks: u64,
    /// Workers removed (leave).
    pub removed_workers: Vec<WorkerId>,
    pub rejections: Vec<Rejection>,
}

/// What housekeeping did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TickReport {
    pub aged_out: Vec<WorkerId>,
    pub reservations_expired: u64,
}

/// The result of applying one input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Output {
    Ingested(IngestReport),
    Routed(Decision),
    /// No candidate worker: HTTP 503.
    NoCandidate,
    Released {
        found: bool,
    },
    Tick(TickReport),
    Resumed {
        workers: usize,
    },
    Configured,
}

/// Everything the router knows; what a snapshot holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouterState {
    workers: Workers,
    namespaces: Namespaces,
    index: OwnerIndex,
    approx: ApproxIndex,
    /// (namespace, prefix key) → the owner a spill created and when.
    provisional: FxHashMap<(NsId, u64), ProvisionalOwner>,
    reservations: Reservations,
    policy: PolicyState,
    /// Sequence number of the last input applied.
    last_seq: u64,
}

/// One row of `GET /v1/workers`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerRow {
    pub id: WorkerId,
    pub state: WorkerState,
    pub pressure: Option<f64>,
    pub telemetry_age_ms: Option<u64>,
    pub reserved_work: u64,
    pub blocks: u64,
    pub models: std::collections::BTreeMap<String, u64>,
}

pub struct Router {
    config: RouterConfig,
    state: RouterState,
}

impl Router {
    pub fn new(config: RouterConfig) -> Self {
        let approx = ApproxIndex::new(config.approx_max_records);
        Router {
            config,
            state: RouterState {
                workers: Workers::default(),
                namespaces: Namespaces::default(),
                index: OwnerIndex::default(),
                approx,
                provisional: FxHashMap::default(),
                reservations: Reservations::default(),
                policy: PolicyState::default(),
                last_seq: 0,
            },
        }
    }

    /// Rebuilds a router from a snapshot's state.
    pub fn from_state(config: RouterConfig, mut state: RouterState) -> Self {
        state.workers.rebuild();
        state.namespaces.rebuild();
        Router { config, state }
    }

    pub fn state(&self) -> &RouterState {
        &self.state
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Takes new settings. A smaller approximate-record bound applies as records are written.
    pub fn configure(&mut self, config: RouterConfig) {
        self.state.approx.set_max_records(config.approx_max_records);
        self.config = config;
    }

    /// Sequence number of the last input applied (0 before any).
    pub fn last_seq(&self) -> u64 {
        self.state.last_seq
    }

    /// Folds one input into the state.
    pub fn apply(&mut self, stamped: &Stamped) -> Output {
        let now = stamped.at_ms;
        self.state.last_seq = stamped.seq;
        // Expiry queues are FIFO, so this costs nothing when nothing is due.
        self.state.approx.expire(now);
        let expired = self.state.reservations.expire(&mut self.state.workers, now);
        match &stamped.input {
            Input::KvEvents(batch) => Output::Ingested(self.apply_kv_events(batch, now)),
            Input::Load(sample) => {
                let (slot, new_worker) = self.state.workers.touch(&sample.worker, now);
                self.state.workers.apply_load(slot, sample, now);
                Output::Ingested(IngestReport {
                    new_worker,
                    ..Default::default()
                })
            }
            Input::Lifecycle(msg) => Output::Ingested(self.apply_lifecycle(msg, now)),
            Input::Route(req) => match self.route(req, stamped.seq, now) {
                Some(decision) => Output::Routed(decision),
                None => Output::NoCandidate,
            },
            Input::Release { reservation, phase } => Output::Released {
                found: self.state.reservations.release(
                    &mut self.state.workers,
                    *reservation,
                    *phase,
                ),
            },
            Input::Tick => Output::Tick(self.tick(now, expired as u64)),
            Input::Resume => {
                let mut workers = 0;
                for (_, w) in self.state.workers.iter_mut() {
                    w.last_heard_ms = now;
                    workers += 1;
                }
                Output::Resumed { workers }
            }
            Input::Configure(config) => {
                self.configure((**config).clone());
                Output::Configured
            }
        }
    }

    fn apply_kv_events(&mut self, batch: &KvEventBatch, now: u64) -> IngestReport {
        let (slot, new_worker) = self.state.workers.touch(&batch.worker, now);
        let mut report = IngestReport {
            new_worker,
            ..Default::default()
        };
        match self.state.workers.check_seq(slot, batch.dp_rank, batch.seq) {
            SeqCheck::Duplicate => {
                report.duplicate = true;
                return report;
            }
            SeqCheck::Apply { gap } => report.seq_gap = gap,
        }
        let declared_model = self.state.workers.get(slot).and_then(|w| w.model.clone());
        let model = batch.model.as_deref().or(declared_model.as_deref());
        for event in &batch.events {
            match event {
                KvEvent::Stored {
                    parent,
                    blocks,
                    block_size,
                    lora,
                    medium,
                } => {
                    if *block_size != self.config.block_size {
                        report.rejections.push(Rejection::new(
                            RejectReason::BlockSizeMismatch,
                            format!(
                                "worker {}: BlockStored with block_size {block_size}, model is \
                                 configured for {}",
                                batch.worker, self.config.block_size
                            ),
                        ));
                        continue;
                    }
                    if *medium != Medium::Gpu {
                        report.ignored_blocks += blocks.len() as u64;
                        continue;
                    }
                    let ns = self.state.namespaces.intern(model, lora.as_deref());
                    self.state.index.store(slot, ns, *parent, blocks);
                    report.stored_blocks += blocks.len() as u64;
                }
                KvEvent::Removed {
                    engine_hashes,
                    medium,
                } => {
                    if *medium != Medium::Gpu {
                        report.ignored_blocks += engine_hashes.len() as u64;
                        continue;
                    }
                    report.removed_blocks += self.state.index.remove(slot, engine_hashes) as u64;
                }
                KvEvent::Cleared => {
                    self.state.index.clear_worker(slot);
                    report.cleared += 1;
                }
            }
        }
        report
    }

    fn apply_lifecycle(&mut self, msg: &Lifecycle, now: u64) -> IngestReport {
        let mut report = IngestReport::default();
        if let Some(size) = msg.block_size.filter(|&s| s != self.config.block_size) {
            report.rejections.push(Rejection::new(
                RejectReason::BlockSizeMismatch,
                format!(
                    "worker {}: joined with block_size {size}, model is configured for {}",
                    msg.worker, self.config.block_size
                ),
            ));
            return report;
        }
        if msg.op == LifecycleOp::Leave {
            if let Some(slot) = self.state.workers.slot_of(&msg.worker) {
                self.remove_worker(slot);
                report.removed_workers.push(msg.worker.clone());
            }
            return report;
        }
        let (slot, new_worker) = self.state.workers.touch(&msg.worker, now);
        report.new_worker = new_worker;
        let worker = self
            .state
            .workers
            .get_mut(slot)
            .expect("touched worker exists");
        match msg.op {
            LifecycleOp::Join => {
                worker.state = WorkerState::Active;
                // A join is a new engine process: its publisher sequence starts over.
                worker.last_seq.clear();
            }
            LifecycleOp::Drain => worker.state = WorkerState::Draining,
            LifecycleOp::Leave => unreachable!("handled above"),
        }
        if msg.model.is_some() {
            worker.model = msg.model.clone();
        }
        if msg.capacity_blocks.is_some() {
            worker.capacity_blocks = msg.capacity_blocks;
        }
        report
    }

    /// Removes a worker and all of its ownership, records and reservations.
    fn remove_worker(&mut self, slot: Slot) {
        let state = &mut self.state;
        state.index.clear_worker(slot);
        state.approx.forget_worker(slot);
        state.reservations.forget_worker(slot);
        state.provisional.retain(|_, p| p.slot != slot);
        state.workers.remove(slot);
    }

    fn tick(&mut self, now: u64, reservations_expired: u64) -> TickReport {
        let ttl = self.config.worker_ttl_ms;
        let silent: Vec<(Slot, WorkerId)> = self
            .state
            .workers
            .iter()
            .filter(|(_, w)| now.saturating_sub(w.last_heard_ms) > ttl)
            .map(|(slot, w)| (slot, w.id.clone()))
            .collect();
        for &(slot, _) in &silent {
            self.remove_worker(slot);
        }
        let cooldown = self.config.policy.spill_cooldown_ms;
        self.state
            .provisional
            .retain(|_, p| now.saturating_sub(p.spilled_ms) < cooldown);
        TickReport {
            aged_out: silent.into_iter().map(|(_, id)| id).collect(),
            reservations_expired,
        }
    }

    /// Longest consecutive match of `keys` per worker slot: authoritative or fresh approximate,
    /// whichever is deeper.
    fn depths(&self, ns: Option<NsId>, keys: &[u64], now: u64) -> Vec<u32> {
        let slots = self.state.workers.slot_count();
        let mut depth = vec![0u32; slots];
        let Some(ns) = ns else {
            return depth;
        };
        self.state.index.walk(ns, keys, |i, owners| {
            extend_depths(&mut depth, i, owners.iter().copied())
        });
        let mut approx = vec![0u32; slots];
        self.state.approx.walk(ns, keys, now, |i, owners| {
            extend_depths(&mut approx, i, owners)
        });
        for (d, a) in depth.iter_mut().zip(approx) {
            *d = (*d).max(a);
        }
        depth
    }

    fn route(&mut self, req: &RouteRequest, seq: u64, now: u64) -> Option<Decision> {
        let ns = self
            .state
            .namespaces
            .get(req.model.as_deref(), req.lora.as_deref());
        let depths = self.depths(ns, &req.keys, now);
        let max_age = self.config.policy.telemetry_max_age_ms;
        let policy_config = &self.config.policy;
        let views: Vec<WorkerView> = self
            .state
            .workers
            .iter()
            .map(|(slot, w)| WorkerView {
                slot,
                id: &w.id,
                candidate: w.state == WorkerState::Active
                    && !req.exclude.contains(&w.id)
                    && serves_model(w.model.as_deref(), req.model.as_deref()),
                depth: depths[slot as usize],
                pressure: policy_config
                    .ranked_pressure(w.fresh_pressure(now, max_age), w.reserved_prefill),
                waiting: w.waiting(),
                reserved_work: w.reserved_work,
                reserved_requests: w.reserved_requests,
                // Lower tiers are not indexed yet: no candidate holds a prefix there.
                host_depth: 0,
                disk_depth: 0,
                prefill_backlog_tokens: w.reserved_prefill,
            })
            .collect();
        let provisional =
            |prefix: u64| ns.and_then(|ns| self.state.provisional.get(&(ns, prefix)).copied());
        let view = RouteView {
            now_ms: now,
            keys: &req.keys,
            prompt_tokens: req.prompt_tokens,
            block_size: self.config.block_size,
            workers: &views,
            provisional: &provisional,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(seq);
        let mut policy_state = std::mem::take(&mut self.state.policy);
        let choice = policy::decide(&self.config.policy, &mut policy_state, &view, &mut rng);
        let Some(choice) = choice else {
            self.state.policy = policy_state;
            return None;
        };
        let chosen = &views[choice.worker];
        let slot = chosen.slot;
        let held_tokens = u64::from(chosen.depth).saturating_mul(u64::from(self.config.block_size));
        let worker_id = chosen.id.clone();
        let mut owners: Vec<WorkerId> = choice
            .known_owners
            .iter()
            .map(|&i| views[i].id.clone())
            .collect();
        owners.sort();
        let match_threshold = self.config.policy.match_threshold(req.keys.len());
        let explain = req.explain.then(|| {
            views
                .iter()
                .map(|v| {
                    let w = self
                        .state
                        .workers
                        .get(v.slot)
                        .expect("viewed worker exists");
                    ExplainRow {
                        worker: v.id.clone(),
                        candidate: v.candidate,
                        state: w.state,
                        depth: v.depth,
                        pressure: v.pressure,
                        telemetry_age_ms: w.telemetry_age_ms(now),
                        reserved_work: v.reserved_work,
                        sample_pressure: w.fresh_pressure(now, max_age),
                        prefill_backlog_tokens: v.prefill_backlog_tokens,
                        host_depth: v.host_depth,
                        disk_depth: v.disk_depth,
                        match_threshold,
                        dynamo_cost: v
                            .candidate
                            .then(|| policy::baselines::dynamo_cost_of(&view, v)),
                    }
                })
                .collect()
        });
        drop(views);
        self.state.policy = policy_state;

        // Effects, inside the same transition that chose the worker.
        let output = req
            .max_output_tokens
            .unwrap_or(self.config.output_estimate)
            .min(self.config.output_estimate);
        let work = req.prompt_tokens.saturating_add(output);
        // The prefill part: the prompt tokens the chosen worker does not already hold.
        let prefill = req.prompt_tokens.saturating_sub(held_tokens);
        self.state.reservations.open(
            &mut self.state.workers,
            seq,
            slot,
            work,
            prefill,
            now.saturating_add(self.config.reservation_ttl_ms),
        );
        let ns = ns.unwrap_or_else(|| {
            self.state
                .namespaces
                .intern(req.model.as_deref(), req.lora.as_deref())
        });
        // Every decision records approximate ownership of K for the chosen worker, so the next
        // turn of a trajectory stays on it before its KV events arrive.
        self.state
            .approx
            .record(ns, &req.keys, slot, now + self.config.approx_ttl_ms);
        if let Some(prefix) = choice.spilled_prefix {
            self.state.provisional.insert(
                (ns, prefix),
                ProvisionalOwner {
                    slot,
                    spilled_ms: now,
                },
            );
        }
        Some(Decision {
            worker: worker_id,
            decision: choice.label,
            matched_blocks: choice.matched_blocks,
            prompt_blocks: req.keys.len() as u32,
            owners,
            reservation: seq,
            request_id: req.request_id.clone(),
            explain,
        })
    }

    /// Rows for `GET /v1/workers`, in slot order.
    pub fn worker_rows(&self, now: u64) -> Vec<WorkerRow> {
        let max_age = self.config.policy.telemetry_max_age_ms;
        self.state
            .workers
            .iter()
            .map(|(slot, w)| {
                let mut models = std::collections::BTreeMap::new();
                for (ns, blocks) in self.state.index.worker_blocks(slot) {
                    let model = self.state.namespaces.name(ns).model.clone();
                    *models.entry(model.unwrap_or_default()).or_insert(0) += blocks as u64;
                }
                WorkerRow {
                    id: w.id.clone(),
                    state: w.state,
                    pressure: w.fresh_pressure(now, max_age),
                    telemetry_age_ms: w.telemetry_age_ms(now),
                    reserved_work: w.reserved_work,
                    blocks: models.values().sum(),
                    models,
                }
            })
            .collect()
    }

    pub fn index_stats(&self) -> IndexStats {
        self.state.index.stats()
    }

    /// Whether worker `id` owns the block `key` of (model, lora) by KV events.
    pub fn owns(&self, id: &WorkerId, model: Option<&str>, lora: Option<&str>, key: u64) -> bool {
        let (Some(slot), Some(ns)) = (
            self.state.workers.slot_of(id),
            self.state.namespaces.get(model, lora),
        ) else {
            return false;
        };
        self.state.index.owns(ns, key, slot)
    }

    /// Every (worker, model, lora, key) ownership by KV events, sorted; for tests and audits.
    pub fn ownerships(&self) -> Vec<(WorkerId, Option<String>, Option<String>, u64)> {
        let mut all: Vec<_> = self
            .state
            .index
            .ownerships()
            .filter_map(|(slot, ns, key)| {
                let w = self.state.workers.get(slot)?;
                let name = self.state.namespaces.name(ns);
                Some((w.id.clone(), name.model.clone(), name.lora.clone(), key))
            })
            .collect();
        all.sort();
        all
    }
}

#[cfg(test)]
mod tests;

/// Extends each owner's consecutive match from position `i` to `i + 1`: a depth only grows if
/// it already covers every earlier key. Returns whether any worker still matches, so the walk
/// stops at the first key nobody continues.
fn extend_depths(depth: &mut [u32], i: usize, owners: impl Iterator<Item = Slot>) -> bool {
    let mut any = false;
    for slot in owners {
        let d = &mut depth[slot as usize];
        if *d as usize == i {
            *d += 1;
        }
        // A slot can appear twice for one key (two engine hashes); it still counts once.
        any |= *d as usize == i + 1;
    }
    any
}

/// A worker without a declared model serves any model; a request without a model fits any worker.
fn serves_model(worker_model: Option<&str>, requested: Option<&str>) -> bool {
    match (worker_model, requested) {
        (Some(w), Some(r)) => w == r,
        _ => true,
    }
}
