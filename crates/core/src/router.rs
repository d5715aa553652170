//! The router: one deterministic state machine (docs/architecture.md, "The picture").
//!
//! [`Router::apply`] folds one [`Stamped`] input into the state and returns what happened. There
//! is no I/O, no wall clock and no ambient randomness in here: time comes with the input, and the
//! power-of-two choices draw from an RNG seeded with the input's sequence number. Applying the
//! same inputs in the same order therefore always yields the same state and the same decisions,
//! which is what makes the journal an audit log that can be replayed.

use rand::SeedableRng;
use std::collections::BTreeMap;

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::index::{ApproxIndex, IndexStats, LowerTiers, Namespaces, NsId, OwnerIndex, Slot};
use crate::input::{
    Input, KvEvent, KvEventBatch, Lifecycle, LifecycleOp, LoadSample, Medium, RejectReason,
    Rejection, RouteRequest, Stamped, WorkerId, MAX_SEQ_JUMP,
};
use crate::policy::{
    self, PolicyConfig, PolicyKind, PolicyState, ProvisionalOwner, RouteView, WorkerView,
};
use crate::reservations::Reservations;
use crate::workers::{SeqCheck, WorkerState, Workers};

/// Largest `dp_size` a join may declare: a larger one is rejected as a bad field.
pub const MAX_DP_SIZE: u32 = 1024;

/// Router settings besides the policy's (docs/architecture.md, "Command line and configuration").
/// Durations are in milliseconds.
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
    /// This replica's id among routers sharing decisions: 1 to 128 characters from
    /// `A-Z a-z 0-9 _ - :`, unique among the replicas and stable across restarts (it names the
    /// replica's decision stream and keys its reservation ids). Empty for a router that runs
    /// alone. Fields from here on are last and defaulted, so journals written before them still
    /// decode (the journal writes structs as arrays).
    #[serde(default)]
    pub replica_id: String,
    /// Keys reservation ids ([`crate::replicas::reservation_id`]): with it, ids are unique
    /// across replicas and unguessable; without it they are the journal sequence (as in
    /// journals written before it existed). The daemon generates it once, keeps it with its
    /// data, and passes the same value at every start; replicas need not share it.
    #[serde(default)]
    pub reservation_secret: Option<crate::replicas::ReservationSecret>,
    /// Most workers (ids) known at once: a message from a new worker beyond it is rejected
    /// (`worker_limit`), so a publisher inventing ids cannot grow the state without bound.
    #[serde(default = "default_max_workers")]
    pub max_workers: usize,
    /// Most (model, LoRA) namespaces: a KV event, declaration or route needing a new one beyond
    /// it is rejected (`model_limit`), and so are block sizes declared for new models.
    #[serde(default = "default_max_models")]
    pub max_models: usize,
}

/// `--max-workers` by default.
pub const DEFAULT_MAX_WORKERS: usize = 10_000;
/// `--max-models` by default.
pub const DEFAULT_MAX_MODELS: usize = 256;

// Journals written before the caps existed configure them by default.
fn default_max_workers() -> usize {
    DEFAULT_MAX_WORKERS
}

fn default_max_models() -> usize {
    DEFAULT_MAX_MODELS
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
            replica_id: String::new(),
            reservation_secret: None,
            max_workers: DEFAULT_MAX_WORKERS,
            max_models: DEFAULT_MAX_MODELS,
        }
    }
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

/// Everything the router knows; what a snapshot holds.
#[derive(Debug, Serialize, Deserialize)]
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
    /// What this router knows of its peer replicas (last, and defaulted: snapshots written
    /// before replicas existed still decode).
    #[serde(default)]
    peers: PeerState,
}

// The writer keeps the last snapshot's copy of the state and makes the next one in it
// (docs/architecture.md, "Snapshots").
clone_in_place!(RouterState {
    workers,
    namespaces,
    index,
    lower,
    approx,
    declared_block_sizes,
    provisional,
    reservations,
    policy,
    last_seq,
    peers,
});

pub struct Router {
    config: RouterConfig,
    state: RouterState,
    /// Route scratch and the fleet's candidate pools: derived from `state`, never saved.
    scratch: pools::RouteScratch,
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
                peers: PeerState::default(),
            },
            scratch: Default::default(),
        }
    }

    /// Rebuilds a router from a snapshot's state.
    pub fn from_state(config: RouterConfig, mut state: RouterState) -> Self {
        state.workers.rebuild();
        state.namespaces.rebuild();
        Router {
            config,
            state,
            scratch: Default::default(),
        }
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
        // The pools count by the policy's settings (high_water, telemetry age, backlog).
        self.scratch.pools.invalidate();
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
            Input::Release { reservation, phase } => {
                self.release(*reservation, *phase, stamped.seq, now)
            }
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
            Input::Peer(event) => Output::Peer(self.apply_peer(event, now)),
        }
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

    /// Rows for `GET /v1/workers`: one per worker (over all its ranks), in the order of their
    /// first slot. Pressure is the highest fresh pressure of its ranks, telemetry age the
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

    /// Asserts that the route rows and names copy the worker table as of the last route's sync,
    /// for every rank that has not changed since.
    #[cfg(test)]
    pub(crate) fn assert_route_rows_follow_workers(&self) {
        self.scratch
            .assert_rows_follow(&self.state.workers, &self.config.policy);
    }
}

mod ingest;
mod output;
mod owner_order;
mod peers;
mod pools;
mod route;
#[cfg(test)]
mod tests;

pub use output::{
    Decision, ExplainRow, IngestReport, Output, PeerReport, TickReport, TierDepths, WorkerRow,
};
pub use peers::PeerState;
