//! Routing policies: the pressure-first longest-prefix policy of docs/architecture.md, "Policy"
//! ([`pressure_first`]) and the baselines it is compared with ([`baselines`]).
//!
//! A policy is a pure function of a [`RouteView`] (what the router knows about each worker for
//! this request) and a seeded RNG. It returns a [`Choice`]; the router applies the choice's
//! effects (reservation, approximate ownership, provisional owner) in the same transition.

pub mod baselines;
pub mod pressure_first;
#[cfg(test)]
mod tests;

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use rand::Rng;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::index::Slot;

/// Which policy decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// docs/architecture.md, "Policy": longest-prefix ownership first, replicate only under
    /// pressure.
    PressureFirst,
    /// Imbalance-first: any fleet imbalance routes to the globally least-loaded worker.
    Legacy,
    RoundRobin,
    /// Size-aware power-of-two choices, cache-blind.
    P2c,
    /// Always the deepest owner, pressure-blind.
    LongestPrefix,
    /// NVIDIA Dynamo's default worker selector on the router's own predicted load: the lowest
    /// cost of prefill not covered by the worker's cache plus the decode blocks it would hold.
    DynamoCost,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 6] = [
        PolicyKind::PressureFirst,
        PolicyKind::Legacy,
        PolicyKind::RoundRobin,
        PolicyKind::P2c,
        PolicyKind::LongestPrefix,
        PolicyKind::DynamoCost,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::PressureFirst => "pressure_first",
            PolicyKind::Legacy => "legacy",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::P2c => "p2c",
            PolicyKind::LongestPrefix => "longest_prefix",
            PolicyKind::DynamoCost => "dynamo_cost",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<_> = PolicyKind::ALL.iter().map(|k| k.as_str()).collect();
                format!("unknown policy {s:?}; expected one of {}", names.join(", "))
            })
    }
}

/// The label of a routing decision. The set is closed (docs/architecture.md, "Decision labels"):
/// metrics and the journal use these names verbatim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionLabel {
    OwnerHold,
    PressureSpill,
    SpillCooldownHold,
    NoSafeHomeHold,
    CeilingHold,
    ColdMiss,
    OwnerUnavailable,
    /// A spill past the ceiling: every known owner was above `ceiling_overflow_pressure`.
    OverloadSpill,
}

impl DecisionLabel {
    pub const ALL: [DecisionLabel; 8] = [
        DecisionLabel::OwnerHold,
        DecisionLabel::PressureSpill,
        DecisionLabel::SpillCooldownHold,
        DecisionLabel::NoSafeHomeHold,
        DecisionLabel::CeilingHold,
        DecisionLabel::ColdMiss,
        DecisionLabel::OwnerUnavailable,
        DecisionLabel::OverloadSpill,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DecisionLabel::OwnerHold => "owner_hold",
            DecisionLabel::PressureSpill => "pressure_spill",
            DecisionLabel::SpillCooldownHold => "spill_cooldown_hold",
            DecisionLabel::NoSafeHomeHold => "no_safe_home_hold",
            DecisionLabel::CeilingHold => "ceiling_hold",
            DecisionLabel::ColdMiss => "cold_miss",
            DecisionLabel::OwnerUnavailable => "owner_unavailable",
            DecisionLabel::OverloadSpill => "overload_spill",
        }
    }
}

impl fmt::Display for DecisionLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Policy settings (docs/architecture.md, "Policy" and "Command line and configuration"). Durations
/// are in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyConfig {
    pub kind: PolicyKind,
    /// The router creates no new owner of a prefix once this many are known.
    pub max_owners_per_prefix: usize,
    /// After a spill for a prefix, no further owner is created for it within this window.
    pub spill_cooldown_ms: u64,
    /// Pressure above this is never "safe", whatever the other owners look like.
    pub high_water: f64,
    /// How far above the best owner's pressure an owner may be before it counts as pressured.
    pub pressure_slack: f64,
    /// Telemetry older than this is stale: it neither pressures an owner nor makes a safe home.
    pub telemetry_max_age_ms: u64,
    /// Shallower matches than this are cold misses.
    pub min_match_blocks: u32,
    /// `legacy`: a request-count spread above this (and above `legacy_balance_rel`) is imbalance.
    pub legacy_balance_abs: u32,
    /// `legacy`: max/min request-count ratio above this (and above `legacy_balance_abs`) is
    /// imbalance.
    pub legacy_balance_rel: f64,
    /// A match must also cover this fraction of the prompt's blocks (rounded up) to make
    /// owners: a short prefix every request shares (a system prompt) does not own a long prompt.
    #[serde(default)]
    pub min_match_ratio: f64,
    /// At the ceiling, a spill still happens (once per cooldown) when every known owner's
    /// pressure is above this; `None` = never.
    #[serde(default)]
    pub ceiling_overflow_pressure: Option<f64>,
    /// Unfinished prefill tokens the router has reserved on a worker that count as one unit of
    /// pressure on top of its load sample (0 = not folded in). The sample cannot see work routed
    /// since it was taken, nor a prefill queue when the worker reports no `max_running`.
    #[serde(default)]
    pub backlog_pressure_tokens: u64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            kind: PolicyKind::PressureFirst,
            max_owners_per_prefix: 4,
            spill_cooldown_ms: 5_000,
            high_water: 0.90,
            pressure_slack: 0.10,
            telemetry_max_age_ms: 30_000,
            min_match_blocks: 1,
            legacy_balance_abs: 2,
            legacy_balance_rel: 1.5,
            min_match_ratio: DEFAULT_MIN_MATCH_RATIO,
            ceiling_overflow_pressure: None,
            backlog_pressure_tokens: DEFAULT_BACKLOG_PRESSURE_TOKENS,
        }
    }
}

/// Default of [`PolicyConfig::min_match_ratio`], chosen from the simulator sweep in
/// `docs/quality.md`.
pub const DEFAULT_MIN_MATCH_RATIO: f64 = 0.2;

/// Default of [`PolicyConfig::backlog_pressure_tokens`], chosen from the simulator sweep in
/// `docs/quality.md`.
pub const DEFAULT_BACKLOG_PRESSURE_TOKENS: u64 = 65_536;

impl PolicyConfig {
    /// Blocks a match must reach to make owners for a prompt of `prompt_blocks` blocks: at
    /// least one, `min_match_blocks`, and (pressure-first only: baselines keep their own rule)
    /// `min_match_ratio` of the prompt rounded up.
    pub fn match_threshold(&self, prompt_blocks: usize) -> u32 {
        let ratio = match self.kind {
            PolicyKind::PressureFirst => self.min_match_ratio,
            _ => 0.0,
        };
        let by_ratio = (ratio * prompt_blocks as f64 - 1e-9).ceil().max(0.0) as u32;
        self.min_match_blocks.max(by_ratio).max(1)
    }

    /// The pressure the policy ranks a worker by: its fresh sample, plus its unfinished
    /// reserved prefill when `backlog_pressure_tokens` folds it in. Missing or stale telemetry
    /// stays missing (telemetry gaps fail open), and baselines see the sample as it is.
    pub fn ranked_pressure(&self, sample: Option<f64>, prefill_backlog_tokens: u64) -> Option<f64> {
        match (self.kind, self.backlog_pressure_tokens) {
            (PolicyKind::PressureFirst, tokens) if tokens > 0 => {
                // No backlog adds +0.0, as the division would, without converting and
                // dividing (a wide decision ranks hundreds of owners, most with none).
                let backlog = match prefill_backlog_tokens {
                    0 => 0.0,
                    b => b as f64 / tokens as f64,
                };
                sample.map(|p| p + backlog)
            }
            _ => sample,
        }
    }
}

/// What the policy knows about one known worker for one request.
///
/// Aligned to its 64 bytes, so each view is one cache line: from a buffer not starting on a line
/// (the allocator aligns to 16 bytes) every view lay across two, and a decision's writes and
/// passes touched both (up to 12% on the median decision at 256 workers, docs/performance.md).
#[derive(Debug, Clone, Default)]
#[repr(align(64))]
pub struct WorkerView {
    /// One candidate is one worker rank: a worker with several data-parallel ranks has a view
    /// per rank, each with its own ownership, load and reserved work. The slot names the rank
    /// (its id and rank number are the worker table's), which keeps a view in one 64-byte line:
    /// a wide decision writes and passes over hundreds of views.
    pub slot: Slot,
    /// The worker's place in id order: ties between workers break by id, and these numbers
    /// compare as the ids do (the ranks of one worker share it). A number, not the id, so a
    /// view borrows nothing and a route keeps its views' buffer from one route to the next.
    pub id_order: u32,
    /// A candidate: not draining, not excluded, serving the request's model.
    pub candidate: bool,
    /// Leading blocks of the request it holds consecutively (authoritative or fresh approximate,
    /// whichever is deeper).
    pub depth: u32,
    /// Leading blocks of the request it holds consecutively in host memory, and on disk or
    /// remote storage (each lower tier on its own, never part of `depth`: reloading beats
    /// prefill, but it is not device ownership).
    pub host_depth: u32,
    pub disk_depth: u32,
    /// Pressure the policy ranks by: [`PolicyConfig::ranked_pressure`] of fresh telemetry;
    /// `None` when missing or stale.
    pub pressure: Option<f64>,
    pub waiting: u32,
    pub reserved_work: u64,
    pub reserved_requests: u32,
    /// Prompt tokens of open reservations whose prefill the worker has not finished (not yet
    /// released with phase `prefill`).
    pub prefill_backlog_tokens: u64,
}

impl WorkerView {
    /// Its deepest lower-tier (host or disk) match.
    pub fn lower_tier_depth(&self) -> u32 {
        self.host_depth.max(self.disk_depth)
    }
}

/// The provisional owner recorded for a prefix by an earlier spill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProvisionalOwner {
    pub slot: Slot,
    pub spilled_ms: u64,
}

/// Everything a policy decides on.
pub struct RouteView<'a> {
    pub now_ms: u64,
    /// The request's block keys.
    pub keys: &'a [u64],
    /// The request's prompt size in tokens.
    pub prompt_tokens: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// Known workers, in slot order: every one of them when `fleet` is `None`; otherwise at
    /// least every candidate at the deepest candidate match reaching
    /// [`PolicyConfig::match_threshold`] and every worker deeper than it (every worker reaching
    /// the threshold when no candidate does), every worker with a lower-tier (host, disk)
    /// match, and the provisional owner of the longest match's prefix. A worker left out
    /// matters to the policy only as a member of a [`Pool`].
    pub workers: &'a [WorkerView],
    /// The provisional owner recorded for a prefix key, if any.
    pub provisional: &'a dyn Fn(u64) -> Option<ProvisionalOwner>,
    /// The whole fleet's pools, when `workers` does not list every worker: the router keeps
    /// them current as workers change, so a decision costs the matched owners and the sampled
    /// candidates, not the size of the fleet.
    pub fleet: Option<&'a dyn Fleet>,
}

/// A set of candidates a policy draws from, in slot order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    Candidates,
    /// Candidates not above high_water; missing or stale telemetry counts as not above.
    Cool,
    /// Candidates with fresh telemetry at or below high_water.
    Safe,
}

impl Pool {
    /// Whether `w` belongs to the pool: the one definition both the listed and the fleet form
    /// follow.
    pub fn admits(self, config: &PolicyConfig, w: &WorkerView) -> bool {
        w.candidate
            && match self {
                Pool::Candidates => true,
                Pool::Cool => w.pressure.is_none_or(|p| p <= config.high_water),
                Pool::Safe => w.pressure.is_some_and(|p| p <= config.high_water),
            }
    }
}

/// The fleet behind a [`RouteView`] that lists only the workers that matched. Members are
/// counted and drawn in slot order, exactly as a scan of every worker would list them, so a
/// draw picks the same worker either way.
pub trait Fleet {
    /// Members of `pool` other than the slots in `minus` (ascending; slots that are not
    /// members are ignored).
    fn count(&self, pool: Pool, minus: &[Slot]) -> usize;
    /// The `k`-th (from 0) member of `pool` other than the slots in `minus`, in slot order.
    fn nth(&self, pool: Pool, k: usize, minus: &[Slot]) -> Slot;
    /// What the policy knows about one worker rank, as it would appear in `workers`.
    fn view(&self, slot: Slot) -> WorkerView;
}

/// Who a power-of-two draw picks from: listed workers (positions in [`RouteView::workers`]),
/// or a pool of the whole fleet less some slots.
pub(crate) enum Draw<'p> {
    Listed(&'p [usize]),
    Pool { pool: Pool, minus: &'p [Slot] },
}

impl RouteView<'_> {
    /// Members of `pool` other than the slots in `minus`: from the fleet, or by scanning every
    /// listed worker when the view lists them all.
    pub(crate) fn pool_count(&self, config: &PolicyConfig, pool: Pool, minus: &[Slot]) -> usize {
        match self.fleet {
            Some(fleet) => fleet.count(pool, minus),
            None => self
                .workers
                .iter()
                .filter(|w| pool.admits(config, w) && !minus.contains(&w.slot))
                .count(),
        }
    }

    fn pool_nth<'v>(
        &'v self,
        config: &PolicyConfig,
        pool: Pool,
        k: usize,
        minus: &[Slot],
    ) -> std::borrow::Cow<'v, WorkerView> {
        match self.fleet {
            Some(fleet) => std::borrow::Cow::Owned(fleet.view(fleet.nth(pool, k, minus))),
            None => std::borrow::Cow::Borrowed(
                self.workers
                    .iter()
                    .filter(|w| pool.admits(config, w) && !minus.contains(&w.slot))
                    .nth(k)
                    .expect("k is below the pool's count"),
            ),
        }
    }
}

/// Positions in [`RouteView::workers`]: a handful of owners or candidates in the normal case,
/// kept off the heap so a decision allocates nothing for them.
pub type Positions = SmallVec<[usize; 4]>;

/// The known owners of a decision's prefix (steps 2 and 3 of the policy), named rather than
/// listed: the candidates at the longest match's depth, then the provisional owner step 3 adds.
/// A decision with dozens of owners thus keeps no list of them (one spilled past a few inline
/// positions was an allocation per decision).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KnownOwners {
    /// The depth of the longest match the owners hold; 0 when there is none.
    pub depth: u32,
    /// The provisional owner's position in [`RouteView::workers`], when it is not already an
    /// owner by depth.
    pub provisional: Option<usize>,
}

impl KnownOwners {
    /// The candidates at the longest match `depth` (at least 1).
    fn at_depth(depth: u32) -> Self {
        KnownOwners {
            depth,
            provisional: None,
        }
    }

    /// Whether `w` owns by depth (the provisional owner aside).
    fn owns_by_depth(&self, w: &WorkerView) -> bool {
        self.depth > 0 && w.candidate && w.depth == self.depth
    }

    /// Whether the worker at position `i` of `workers` is a known owner.
    pub fn contains(&self, workers: &[WorkerView], i: usize) -> bool {
        self.provisional == Some(i) || self.owns_by_depth(&workers[i])
    }

    /// Positions of the known owners: the owners by depth in listing order, then the
    /// provisional owner.
    pub fn positions<'v>(
        &self,
        workers: &'v [WorkerView],
    ) -> impl Iterator<Item = usize> + Clone + 'v {
        let owners = *self;
        (0..workers.len())
            .filter(move |&i| owners.owns_by_depth(&workers[i]))
            .chain(owners.provisional)
    }

    /// Calls `f` with each known owner, position and view, in the order of [`Self::positions`]
    /// (the owners by depth in listing order, then the provisional owner). One plain loop over
    /// the views: the passes a wide decision makes over hundreds of owners cost about half the
    /// instructions per owner of the same pass through [`Self::positions`]' filter and chain.
    pub fn for_each<'v>(
        &self,
        workers: &'v [WorkerView],
        mut f: impl FnMut(usize, &'v WorkerView),
    ) {
        for (i, w) in workers.iter().enumerate() {
            if self.owns_by_depth(w) {
                f(i, w);
            }
        }
        if let Some(i) = self.provisional {
            f(i, &workers[i]);
        }
    }

    /// Whether there is no known owner (a decision without a longest match).
    pub fn is_empty(&self, workers: &[WorkerView]) -> bool {
        self.positions(workers).next().is_none()
    }
}

/// A policy's decision. Owner positions index [`RouteView::workers`].
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// The chosen worker rank (it may be one drawn from [`RouteView::fleet`], not listed).
    pub slot: Slot,
    pub label: DecisionLabel,
    pub matched_blocks: u32,
    pub known_owners: KnownOwners,
    /// Set on `pressure_spill`: record the chosen worker as provisional owner of this prefix.
    pub spilled_prefix: Option<u64>,
}

/// Mutable policy state that is not ownership: the round-robin cursor.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct PolicyState {
    pub round_robin_cursor: u64,
}

/// Decides a route with the configured policy. `None` when there is no candidate.
pub fn decide(
    config: &PolicyConfig,
    state: &mut PolicyState,
    view: &RouteView,
    rng: &mut impl Rng,
) -> Option<Choice> {
    match config.kind {
        PolicyKind::PressureFirst => pressure_first::decide(config, view, rng),
        PolicyKind::Legacy => baselines::legacy(config, view),
        PolicyKind::RoundRobin => baselines::round_robin(config, state, view),
        PolicyKind::P2c => baselines::p2c(config, view, rng),
        PolicyKind::LongestPrefix => baselines::longest_prefix(config, view, rng),
        PolicyKind::DynamoCost => baselines::dynamo_cost(config, view, rng),
    }
}

/// The deepest match among candidates: its owners (the candidates at that depth), if the depth
/// reaches [`PolicyConfig::match_threshold`] (step 2 of the policy).
pub(crate) fn longest_match(config: &PolicyConfig, view: &RouteView) -> Option<KnownOwners> {
    let depth = view
        .workers
        .iter()
        .filter(|w| w.candidate)
        .map(|w| w.depth)
        .max()?;
    if depth < config.match_threshold(view.keys.len()) {
        return None;
    }
    Some(KnownOwners::at_depth(depth))
}

/// The label of a decision that found no usable owner (docs/architecture.md, "Step 7: no
/// owner"): `owner_unavailable` when a worker that is not a candidate (draining, excluded) holds
/// a usable match, else `cold_miss`.
pub(crate) fn no_owner_label(config: &PolicyConfig, view: &RouteView) -> DecisionLabel {
    let min = config.match_threshold(view.keys.len());
    if view.workers.iter().any(|w| !w.candidate && w.depth >= min) {
        DecisionLabel::OwnerUnavailable
    } else {
        DecisionLabel::ColdMiss
    }
}

/// The positions of the listed workers `keep` accepts. Counted first, so a set past the inline
/// room (the owners of a shared prefix) is allocated once rather than grown step by step.
pub(crate) fn positions(view: &RouteView, keep: impl Fn(&WorkerView) -> bool) -> Positions {
    let count = view.workers.iter().filter(|w| keep(w)).count();
    let mut kept = Positions::with_capacity(count);
    kept.extend((0..view.workers.len()).filter(|&i| keep(&view.workers[i])));
    kept
}

/// Orders missing pressure after every known one.
fn pressure_order(a: Option<f64>, b: Option<f64>) -> Ordering {
    match (a, b) {
        (Some(a), Some(b)) => a.total_cmp(&b),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    }
}

/// Least reserved work, then lower pressure, then fewer waiting, then id.
pub(crate) fn by_reserved_work(a: &WorkerView, b: &WorkerView) -> Ordering {
    a.reserved_work
        .cmp(&b.reserved_work)
        .then_with(|| pressure_order(a.pressure, b.pressure))
        .then_with(|| a.waiting.cmp(&b.waiting))
        .then_with(|| a.id_order.cmp(&b.id_order))
}

/// Lowest pressure, then least reserved work, then id.
pub(crate) fn by_pressure(a: &WorkerView, b: &WorkerView) -> Ordering {
    pressure_order(a.pressure, b.pressure)
        .then_with(|| a.reserved_work.cmp(&b.reserved_work))
        .then_with(|| a.id_order.cmp(&b.id_order))
}

/// The best of `pool` (positions) by `order`, the first of equals. `pool` must not be empty.
pub(crate) fn best_by(
    view: &RouteView,
    pool: impl IntoIterator<Item = usize>,
    order: impl Fn(&WorkerView, &WorkerView) -> Ordering,
) -> usize {
    pool.into_iter()
        .min_by(|&a, &b| order(&view.workers[a], &view.workers[b]))
        .expect("best_by needs a non-empty pool")
}

/// The members of `pool` with the deepest lower-tier match, if any has one; otherwise `pool`.
/// Reloading a prefix from host memory or disk beats computing it again.
pub(crate) fn deepest_lower_tier(view: &RouteView, pool: &[usize]) -> Positions {
    let deepest = pool
        .iter()
        .map(|&i| view.workers[i].lower_tier_depth())
        .max()
        .unwrap_or(0);
    if deepest == 0 {
        return Positions::from_slice(pool);
    }
    pool.iter()
        .copied()
        .filter(|&i| view.workers[i].lower_tier_depth() == deepest)
        .collect()
}

/// Size-aware power-of-two choices: two distinct random members of `pool`, the one with less
/// reserved work wins (the first drawn on a tie). Returns the chosen worker's slot and depth.
/// `pool` must not be empty.
pub(crate) fn power_of_two(
    config: &PolicyConfig,
    view: &RouteView,
    pool: Draw,
    rng: &mut impl Rng,
) -> (Slot, u32) {
    let n = match pool {
        Draw::Listed(listed) => listed.len(),
        Draw::Pool { pool, minus } => view.pool_count(config, pool, minus),
    };
    let member = |k: usize| match pool {
        Draw::Listed(listed) => std::borrow::Cow::Borrowed(&view.workers[listed[k]]),
        Draw::Pool { pool, minus } => view.pool_nth(config, pool, k, minus),
    };
    let chosen = match n {
        0 => panic!("power_of_two needs a non-empty pool"),
        1 => member(0),
        n => {
            let a = rng.random_range(0..n);
            let mut b = rng.random_range(0..n - 1);
            if b >= a {
                b += 1;
            }
            let (a, b) = (member(a), member(b));
            if by_reserved_work(&a, &b) == Ordering::Greater {
                b
            } else {
                a
            }
        }
    };
    (chosen.slot, chosen.depth)
}
