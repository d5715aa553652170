//! The router: one deterministic state machine (docs/architecture.md, "The picture").
//!
//! [`Router::apply`] folds one [`Stamped`] input into the state and returns what happened. There
//! is no I/O, no wall clock and no ambient randomness in here: time comes with the input, and the
//! power-of-two choices draw from an RNG seeded with the input's sequence number. Applying the
//! same inputs in the same order therefore always yields the same state and the same decisions,
//! which is what makes the journal an audit log that can be replayed.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;

use rustc_hash::{FxHashMap, FxHashSet};
use serde::{Deserialize, Serialize};

use crate::index::{ApproxIndex, IndexStats, LowerTiers, Namespaces, NsId, OwnerIndex, Slot};
use crate::input::{
    Input, KvEvent, KvEventBatch, Lifecycle, LifecycleOp, LoadSample, Medium, RejectReason,
    Rejection, RouteRequest, Stamped, WorkerId, MAX_SEQ_JUMP,
};
use crate::policy::{
    self, DecisionLabel, PolicyConfig, PolicyState, ProvisionalOwner, RouteView, WorkerView,
};
use crate::reservations::Reservations;
use crate::workers::{SeqCheck, WorkerState, Workers};

/// Largest `dp_size` a join may declare: a larger one is rejected as a bad field.
pub const MAX_DP_SIZE: u32 = 1024;

/// Router settings besides the policy's (docs/architecture.md, "Command line and configuration"). Durations are in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouterConfig {
    pub policy: PolicyConfig,
    /// Tokens per block of a model with no size of its own; KV events with another block size
    /// are rejected, never re-chunked.
    pub block_size: u32,
    /// Block sizes fixed per model (`--model-block-size NAME=SIZE`): a join cannot change them.
    #[serde(default)]
    pub model_block_sizes: BTreeMap<String, u32>,
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
            model_block_sizes: BTreeMap::new(),
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
    /// The data-parallel rank chosen, when the worker has more than one (a gateway pins it, e.g.
    /// with vLLM's `X-data-parallel-rank` header).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub dp_rank: Option<u32>,
    pub decision: DecisionLabel,
    /// Leading blocks of the prompt the chosen worker rank holds: 0 for a spill to a non-owner,
    /// so reuse is never overstated.
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
    /// The rank of this row, when the worker has more than one.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub dp_rank: Option<u32>,
    pub candidate: bool,
    pub state: WorkerState,
    pub depth: u32,
    /// Leading blocks held in host memory and on disk (lower tiers).
    pub host_depth: u32,
    pub disk_depth: u32,
    pub pressure: Option<f64>,
    pub telemetry_age_ms: Option<u64>,
    pub reserved_work: u64,
    /// Its load sample's pressure (`pressure` is what the policy ranked by).
    #[serde(default)]
    pub sample_pressure: Option<f64>,
    /// Reserved prompt tokens whose prefill it has not finished.
    #[serde(default)]
    pub prefill_backlog_tokens: u64,
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
    /// The batch's `Kv-Seq` was at or below the last applied one, or its `Kv-Epoch` is one the
    /// rank already left: skipped.
    pub duplicate: bool,
    /// Batches missed before this one, by `Kv-Seq`.
    pub seq_gap: u64,
    /// The batch started a new epoch (the engine restarted): the rank was cleared first.
    pub new_epoch: bool,
    /// The input came from a worker that left (sticky leave): ignored.
    pub departed: bool,
    /// Device blocks stored and removed (ownership ended).
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    /// Blocks stored and removed on a lower tier (host memory, disk).
    pub lower_tier_stored: u64,
    pub lower_tier_removed: u64,
    /// Blocks of stores whose parent engine hash was unknown: keyed as the start of a chain.
    pub orphan_blocks: u64,
    pub cleared: u64,
    /// Blocks of a group other than full attention (sliding window, mamba): counted, not indexed.
    pub ignored_blocks: u64,
    /// Device blocks a `join` (or a new epoch) cleared.
    pub cleared_blocks: u64,
    /// Workers removed (leave).
    pub removed_workers: Vec<WorkerId>,
    pub rejections: Vec<Rejection>,
}

/// Tokens per block for each model: what the HTTP adapter cuts a route's tokens with, so a
/// prompt is keyed exactly as its model's KV events are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockSizes {
    /// `--block-size`: models without a size of their own.
    pub default: u32,
    /// Sizes declared by joins, overridden by `--model-block-size`.
    pub models: BTreeMap<String, u32>,
}

impl BlockSizes {
    pub fn of(&self, model: Option<&str>) -> u32 {
        model
            .and_then(|m| self.models.get(m))
            .copied()
            .unwrap_or(self.default)
    }
}

/// Leading blocks of a prompt a worker rank holds on each lower tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierDepths {
    pub host: u32,
    pub disk: u32,
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
    /// Device ownership.
    index: OwnerIndex,
    /// Host-memory and disk ownership, apart from the device's.
    lower: LowerTiers,
    approx: ApproxIndex,
    /// Block sizes models declared in `join`s (a `--model-block-size` setting wins).
    declared_block_sizes: BTreeMap<String, u32>,
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
    pub models: BTreeMap<String, u64>,
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
                lower: LowerTiers::default(),
                approx,
                declared_block_sizes: BTreeMap::new(),
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
            Input::Load(sample) => Output::Ingested(self.apply_load(sample, now)),
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

    fn apply_load(&mut self, sample: &LoadSample, now: u64) -> IngestReport {
        if self.is_departed(&sample.worker, now) {
            return IngestReport {
                departed: true,
                ..Default::default()
            };
        }
        let (slot, new_worker) = self
            .state
            .workers
            .touch(&sample.worker, sample.dp_rank, now);
        self.state.workers.apply_load(slot, sample, now);
        if let Some(model) = &sample.model {
            self.declare_model(&sample.worker, model);
        }
        IngestReport {
            new_worker,
            ..Default::default()
        }
    }

    /// Whether `id` left (sticky leave) and has neither joined again nor been gone for
    /// `worker_ttl`.
    fn is_departed(&self, id: &WorkerId, now: u64) -> bool {
        self.state
            .workers
            .is_departed(id, now, self.config.worker_ttl_ms)
    }

    /// The block size of a model: `--model-block-size`, else what a join declared, else
    /// `--block-size`.
    pub fn block_size_of(&self, model: Option<&str>) -> u32 {
        model
            .and_then(|m| {
                self.config
                    .model_block_sizes
                    .get(m)
                    .or_else(|| self.state.declared_block_sizes.get(m))
            })
            .copied()
            .unwrap_or(self.config.block_size)
    }

    /// Every model's block size as routes must use it.
    pub fn block_sizes(&self) -> BlockSizes {
        let mut models = self.state.declared_block_sizes.clone();
        models.extend(
            self.config
                .model_block_sizes
                .iter()
                .map(|(m, &s)| (m.clone(), s)),
        );
        BlockSizes {
            default: self.config.block_size,
            models,
        }
    }

    /// Records the model a worker declared (join or load sample) on each of its ranks.
    ///
    /// Events that arrived before the declaration, with no `Kv-Model` header, were filed under
    /// no model: the rule is that a worker's blocks belong to the model it declares, so they
    /// move to that model's namespace (same LoRA) the moment it first declares one, and routes
    /// naming the model see them. Blocks filed under an explicit `Kv-Model` never move.
    fn declare_model(&mut self, id: &WorkerId, model: &str) {
        let slots: Vec<Slot> = self.state.workers.slots_of(id).collect();
        for slot in slots {
            let w = self.state.workers.get_mut(slot).expect("live slot");
            if w.model.as_deref() == Some(model) {
                continue;
            }
            let undeclared = w.model.is_none();
            w.model = Some(model.to_owned());
            if !undeclared {
                continue;
            }
            let from: Vec<NsId> = self
                .state
                .index
                .worker_blocks(slot)
                .map(|(ns, _)| ns)
                .chain(self.state.lower.host.worker_blocks(slot).map(|(ns, _)| ns))
                .chain(self.state.lower.disk.worker_blocks(slot).map(|(ns, _)| ns))
                .filter(|&ns| self.state.namespaces.name(ns).model.is_none())
                .collect();
            for ns in from {
                let lora = self.state.namespaces.name(ns).lora.clone();
                let to = self.state.namespaces.intern(Some(model), lora.as_deref());
                self.state.index.move_namespace(slot, ns, to);
                self.state.lower.move_namespace(slot, ns, to);
            }
        }
    }

    /// Drops everything a worker rank is believed to hold: device and lower-tier ownership and
    /// the router's own approximate records. Returns the device blocks dropped.
    fn clear_rank(&mut self, slot: Slot) -> u64 {
        let state = &mut self.state;
        state.lower.clear_worker(slot);
        state.approx.forget_worker(slot);
        state.index.clear_worker(slot) as u64
    }

    /// The key of a stored block's parent, looked up among the rank's blocks on the store's own
    /// tier first, then the device, host and disk tiers (an offloaded block names a parent that
    /// may live on another tier).
    fn parent_key(&self, slot: Slot, ns: NsId, medium: Medium, parent: u64) -> Option<u64> {
        let lower = &self.state.lower;
        let own = match lower.tier(medium) {
            Some(tier) => tier.key_of(slot, ns, parent),
            None => self.state.index.key_of(slot, ns, parent),
        };
        own.or_else(|| self.state.index.key_of(slot, ns, parent))
            .or_else(|| lower.host.key_of(slot, ns, parent))
            .or_else(|| lower.disk.key_of(slot, ns, parent))
    }

    fn apply_kv_events(&mut self, batch: &KvEventBatch, now: u64) -> IngestReport {
        let mut report = IngestReport::default();
        if self.is_departed(&batch.worker, now) {
            report.departed = true;
            return report;
        }
        let (slot, new_worker) = self.state.workers.touch(&batch.worker, batch.dp_rank, now);
        report.new_worker = new_worker;
        match self
            .state
            .workers
            .check_seq(slot, batch.epoch.as_deref(), batch.seq)
        {
            SeqCheck::Duplicate | SeqCheck::StaleEpoch => {
                report.duplicate = true;
                return report;
            }
            SeqCheck::Jump { last } => {
                report.rejections.push(Rejection::new(
                    RejectReason::SeqJump,
                    format!(
                        "worker {} dp rank {}: Kv-Seq {} is more than {MAX_SEQ_JUMP} ahead of \
                         the last applied {last}; batch not applied",
                        batch.worker,
                        batch.dp_rank,
                        batch.seq.unwrap_or_default()
                    ),
                ));
                return report;
            }
            SeqCheck::Apply { gap, new_epoch } => {
                report.seq_gap = gap;
                if new_epoch {
                    report.new_epoch = true;
                    report.cleared_blocks += self.clear_rank(slot);
                }
            }
        }
        let declared_model = self.state.workers.get(slot).and_then(|w| w.model.clone());
        let model = batch.model.as_deref().or(declared_model.as_deref());
        let model_block_size = self.block_size_of(model);
        for event in &batch.events {
            match event {
                KvEvent::Stored {
                    parent,
                    blocks,
                    block_size,
                    lora,
                    medium,
                    full_attention,
                } => {
                    let n = blocks.len() as u64;
                    if !full_attention {
                        report.ignored_blocks += n;
                        continue;
                    }
                    if *block_size != model_block_size {
                        report.rejections.push(Rejection::new(
                            RejectReason::BlockSizeMismatch,
                            format!(
                                "worker {}: BlockStored with block_size {block_size}, model {} \
                                 has block size {model_block_size}",
                                batch.worker,
                                model.unwrap_or("(none)")
                            ),
                        ));
                        continue;
                    }
                    let ns = self.state.namespaces.intern(model, lora.as_deref());
                    let parent_key = parent.and_then(|p| self.parent_key(slot, ns, *medium, p));
                    if parent.is_some() && parent_key.is_none() {
                        report.orphan_blocks += n;
                    }
                    match self.state.lower.tier_mut(*medium) {
                        None => {
                            self.state.index.store(slot, ns, parent_key, blocks);
                            report.stored_blocks += n;
                        }
                        Some(tier) => {
                            tier.store(slot, ns, parent_key, blocks);
                            report.lower_tier_stored += n;
                        }
                    }
                }
                KvEvent::Removed {
                    engine_hashes,
                    medium,
                } => match self.state.lower.tier_mut(*medium) {
                    None => {
                        let dropped = self.state.index.remove(slot, engine_hashes);
                        report.removed_blocks += dropped.len() as u64;
                        // What the worker no longer holds, the router stops believing from its
                        // own records too.
                        for (ns, key) in dropped {
                            self.state.approx.forget_blocks(ns, [key], slot);
                        }
                    }
                    Some(tier) => {
                        report.lower_tier_removed += tier.remove(slot, engine_hashes).len() as u64
                    }
                },
                KvEvent::Cleared => {
                    self.clear_rank(slot);
                    report.cleared += 1;
                }
            }
        }
        report
    }

    /// Checks a block size a worker declared in its join for `model`. A size fixed by
    /// `--model-block-size`, or declared by another live worker of the model, cannot be changed;
    /// a worker without a model must use `--block-size`.
    fn check_declared_block_size(
        &self,
        id: &WorkerId,
        model: Option<&str>,
        size: u32,
    ) -> Result<(), Rejection> {
        let mismatch = |have: u32, why: &str| {
            Rejection::new(
                RejectReason::BlockSizeMismatch,
                format!(
                    "worker {id}: joined with block_size {size}, model {} has block size {have} \
                     ({why}); the field is ignored",
                    model.unwrap_or("(none)")
                ),
            )
        };
        let Some(model) = model else {
            return match size == self.config.block_size {
                true => Ok(()),
                false => Err(mismatch(self.config.block_size, "--block-size")),
            };
        };
        if let Some(&fixed) = self.config.model_block_sizes.get(model) {
            return match size == fixed {
                true => Ok(()),
                false => Err(mismatch(fixed, "--model-block-size")),
            };
        }
        match self.state.declared_block_sizes.get(model) {
            Some(&declared) if declared != size => {
                let held = self.state.workers.iter().any(|(_, w)| {
                    &w.id != id
                        && w.model.as_deref() == Some(model)
                        && w.block_size == Some(declared)
                });
                match held {
                    true => Err(mismatch(declared, "declared by another live worker")),
                    false => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }

    fn apply_lifecycle(&mut self, msg: &Lifecycle, now: u64) -> IngestReport {
        let mut report = IngestReport::default();
        let id = &msg.worker;
        match msg.op {
            LifecycleOp::Leave => {
                let slots: Vec<Slot> = self.state.workers.slots_of(id).collect();
                if !slots.is_empty() {
                    report.removed_workers.push(id.clone());
                }
                for slot in slots {
                    self.remove_slot(slot);
                }
                // Sticky: late load samples or events do not bring it back.
                self.state.workers.depart(id, now);
                return report;
            }
            LifecycleOp::Join => self.state.workers.readmit(id),
            LifecycleOp::Drain => {
                if self.is_departed(id, now) {
                    report.departed = true;
                    return report;
                }
            }
        }
        // A bad field is rejected (counted) and the op still applied.
        let dp_size = match msg.dp_size {
            Some(n) if n == 0 || n > MAX_DP_SIZE => {
                report.rejections.push(Rejection::new(
                    RejectReason::InvalidField,
                    format!("worker {id}: dp_size {n} is outside 1..={MAX_DP_SIZE}; ignored"),
                ));
                None
            }
            other => other,
        };
        let known_model = self
            .state
            .workers
            .slots_of(id)
            .next()
            .and_then(|s| self.state.workers.get(s))
            .and_then(|w| w.model.clone());
        let model = msg.model.clone().or(known_model);
        let block_size = match msg.block_size {
            Some(size) => match self.check_declared_block_size(id, model.as_deref(), size) {
                Ok(()) => Some(size),
                Err(rejection) => {
                    report.rejections.push(rejection);
                    None
                }
            },
            None => None,
        };
        if let (LifecycleOp::Join, Some(n)) = (msg.op, dp_size) {
            // The new process has exactly `n` ranks: ranks beyond them are gone.
            let gone: Vec<Slot> = self
                .state
                .workers
                .slots_of(id)
                .filter(|&s| self.state.workers.get(s).is_some_and(|w| w.dp_rank >= n))
                .collect();
            for slot in gone {
                self.remove_slot(slot);
            }
        }
        let mut ranks: Vec<u32> = self
            .state
            .workers
            .slots_of(id)
            .filter_map(|s| self.state.workers.get(s).map(|w| w.dp_rank))
            .collect();
        ranks.extend(0..dp_size.unwrap_or(1));
        ranks.sort_unstable();
        ranks.dedup();
        for rank in ranks {
            report.new_worker |= self.state.workers.touch(id, rank, now).1;
        }
        let slots: Vec<Slot> = self.state.workers.slots_of(id).collect();
        for &slot in &slots {
            let w = self.state.workers.get_mut(slot).expect("live slot");
            match msg.op {
                LifecycleOp::Join => {
                    w.state = WorkerState::Active;
                    // A join announces a new engine process and clears what its ranks held,
                    // unless it carries the epoch a rank already runs: a re-announcement (a
                    // restarted sidecar in front of a running engine) clears nothing and keeps
                    // the rank's sequence.
                    let reannounced = msg.epoch.is_some() && w.epoch == msg.epoch;
                    if !reannounced {
                        self.state.workers.enter_epoch(slot, msg.epoch.clone());
                        report.cleared_blocks += self.clear_rank(slot);
                    }
                }
                LifecycleOp::Drain => w.state = WorkerState::Draining,
                LifecycleOp::Leave => unreachable!("handled above"),
            }
            let w = self.state.workers.get_mut(slot).expect("live slot");
            if msg.capacity_blocks.is_some() {
                w.capacity_blocks = msg.capacity_blocks;
            }
            if dp_size.is_some() {
                w.dp_size = dp_size;
            }
            if block_size.is_some() {
                w.block_size = block_size;
            }
        }
        if let (Some(model), Some(size)) = (&model, block_size) {
            if !self.config.model_block_sizes.contains_key(model) {
                self.state.declared_block_sizes.insert(model.clone(), size);
            }
        }
        if let Some(model) = &msg.model {
            self.declare_model(id, model);
        }
        report
    }

    /// Removes a worker rank and all of its ownership, records and reservations.
    fn remove_slot(&mut self, slot: Slot) {
        self.clear_rank(slot);
        let state = &mut self.state;
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
        let mut aged_out: Vec<WorkerId> = Vec::new();
        for (slot, id) in silent {
            self.remove_slot(slot);
            if !aged_out.contains(&id) {
                aged_out.push(id);
            }
        }
        // An age-out is not sticky: a worker heard again after a long silence is back at once.
        self.state.workers.expire_departed(now, ttl);
        let cooldown = self.config.policy.spill_cooldown_ms;
        self.state
            .provisional
            .retain(|_, p| now.saturating_sub(p.spilled_ms) < cooldown);
        TickReport {
            aged_out,
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

    /// Longest consecutive match of `keys` per worker slot on one lower tier.
    fn tier_depths(&self, tier: &OwnerIndex, ns: Option<NsId>, keys: &[u64]) -> Vec<u32> {
        let mut depth = vec![0u32; self.state.workers.slot_count()];
        if let Some(ns) = ns {
            tier.walk(ns, keys, |i, owners| {
                extend_depths(&mut depth, i, owners.iter().copied())
            });
        }
        depth
    }

    /// The lower-tier depth of one worker rank for a prompt's block keys: how many leading
    /// blocks it holds consecutively in host memory and on disk (each tier on its own). The
    /// router fills the same figures into every [`WorkerView`] of a route.
    pub fn lower_tier_depth(
        &self,
        id: &WorkerId,
        dp_rank: u32,
        model: Option<&str>,
        lora: Option<&str>,
        keys: &[u64],
    ) -> TierDepths {
        let (Some(slot), ns) = (
            self.state.workers.slot_of(id, dp_rank),
            self.state.namespaces.get(model, lora),
        ) else {
            return TierDepths::default();
        };
        TierDepths {
            host: self.tier_depths(&self.state.lower.host, ns, keys)[slot as usize],
            disk: self.tier_depths(&self.state.lower.disk, ns, keys)[slot as usize],
        }
    }

    fn route(&mut self, req: &RouteRequest, seq: u64, now: u64) -> Option<Decision> {
        let ns = self
            .state
            .namespaces
            .get(req.model.as_deref(), req.lora.as_deref());
        let depths = self.depths(ns, &req.keys, now);
        let host_depths = self.tier_depths(&self.state.lower.host, ns, &req.keys);
        let disk_depths = self.tier_depths(&self.state.lower.disk, ns, &req.keys);
        let max_age = self.config.policy.telemetry_max_age_ms;
        let policy_config = &self.config.policy;
        let block_size = self.block_size_of(req.model.as_deref());
        // Looked up once per worker rank: a set, so the cost of a route does not grow with the
        // product of the fleet and the exclude list.
        let excluded: FxHashSet<&WorkerId> = req.exclude.iter().collect();
        // One candidate per worker rank, each with its own ownership, load and reserved work.
        let views: Vec<WorkerView> = self
            .state
            .workers
            .iter()
            .map(|(slot, w)| WorkerView {
                slot,
                id: &w.id,
                dp_rank: w.dp_rank,
                candidate: w.state == WorkerState::Active
                    && !excluded.contains(&w.id)
                    && serves_model(w.model.as_deref(), req.model.as_deref()),
                depth: depths[slot as usize],
                host_depth: host_depths[slot as usize],
                disk_depth: disk_depths[slot as usize],
                pressure: policy_config
                    .ranked_pressure(w.fresh_pressure(now, max_age), w.reserved_prefill),
                waiting: w.waiting(),
                reserved_work: w.reserved_work,
                reserved_requests: w.reserved_requests,
                prefill_backlog_tokens: w.reserved_prefill,
            })
            .collect();
        let provisional =
            |prefix: u64| ns.and_then(|ns| self.state.provisional.get(&(ns, prefix)).copied());
        let view = RouteView {
            now_ms: now,
            keys: &req.keys,
            prompt_tokens: req.prompt_tokens,
            block_size,
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
        let worker_id = chosen.id.clone();
        let dp_rank = self
            .state
            .workers
            .multi_rank(slot)
            .then_some(chosen.dp_rank);
        // The chosen rank's own depth: a spill to a non-owner reuses nothing.
        let matched_blocks = chosen.depth;
        let held_tokens = u64::from(chosen.depth).saturating_mul(u64::from(block_size));
        let mut owners: Vec<WorkerId> = choice
            .known_owners
            .iter()
            .map(|&i| views[i].id.clone())
            .collect();
        owners.sort();
        owners.dedup();
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
                        dp_rank: self.state.workers.multi_rank(v.slot).then_some(v.dp_rank),
                        candidate: v.candidate,
                        state: w.state,
                        depth: v.depth,
                        host_depth: v.host_depth,
                        disk_depth: v.disk_depth,
                        pressure: v.pressure,
                        telemetry_age_ms: w.telemetry_age_ms(now),
                        reserved_work: v.reserved_work,
                        sample_pressure: w.fresh_pressure(now, max_age),
                        prefill_backlog_tokens: v.prefill_backlog_tokens,
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
            dp_rank,
            decision: choice.label,
            matched_blocks,
            prompt_blocks: req.keys.len() as u32,
            owners,
            reservation: seq,
            request_id: req.request_id.clone(),
            explain,
        })
    }

    /// Rows for `GET /v1/workers`: one per worker (over all its ranks), in the order workers
    /// were first seen. Pressure is the highest fresh pressure of its ranks, telemetry age the
    /// youngest, reserved work and blocks the sums.
    pub fn worker_rows(&self, now: u64) -> Vec<WorkerRow> {
        let max_age = self.config.policy.telemetry_max_age_ms;
        let mut rows: Vec<WorkerRow> = Vec::new();
        let mut row_of: FxHashMap<&WorkerId, usize> = FxHashMap::default();
        for (slot, w) in self.state.workers.iter() {
            let i = *row_of.entry(&w.id).or_insert_with(|| {
                rows.push(WorkerRow {
                    id: w.id.clone(),
                    state: w.state,
                    pressure: None,
                    telemetry_age_ms: None,
                    reserved_work: 0,
                    blocks: 0,
                    models: BTreeMap::new(),
                });
                rows.len() - 1
            });
            let row = &mut rows[i];
            if let Some(p) = w.fresh_pressure(now, max_age) {
                row.pressure = Some(row.pressure.map_or(p, |q: f64| q.max(p)));
            }
            if let Some(age) = w.telemetry_age_ms(now) {
                row.telemetry_age_ms = Some(row.telemetry_age_ms.map_or(age, |a| a.min(age)));
            }
            row.reserved_work = row.reserved_work.saturating_add(w.reserved_work);
            for (ns, blocks) in self.state.index.worker_blocks(slot) {
                let model = self.state.namespaces.name(ns).model.clone();
                *row.models.entry(model.unwrap_or_default()).or_insert(0) += blocks as u64;
                row.blocks += blocks as u64;
            }
        }
        rows
    }

    pub fn index_stats(&self) -> IndexStats {
        self.state.index.stats()
    }

    /// Whether worker `id` (any rank) owns the block `key` of (model, lora) by KV events.
    pub fn owns(&self, id: &WorkerId, model: Option<&str>, lora: Option<&str>, key: u64) -> bool {
        let Some(ns) = self.state.namespaces.get(model, lora) else {
            return false;
        };
        self.state
            .workers
            .slots_of(id)
            .any(|slot| self.state.index.owns(ns, key, slot))
    }

    /// Whether rank `dp_rank` of worker `id` owns the block `key` of (model, lora) on the device.
    pub fn rank_owns(
        &self,
        id: &WorkerId,
        dp_rank: u32,
        model: Option<&str>,
        lora: Option<&str>,
        key: u64,
    ) -> bool {
        let (Some(slot), Some(ns)) = (
            self.state.workers.slot_of(id, dp_rank),
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
        all.dedup();
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
