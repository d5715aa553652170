//! Baseline policies, for the simulator and for comparisons (docs/architecture.md, "Baseline
//! policies").
//!
//! Baselines use the same decision labels: the chosen worker is an owner → `owner_hold`; owners
//! exist but another worker was chosen → `pressure_spill` (a new copy of the prefix); no usable
//! owner → `cold_miss` or `owner_unavailable`.

use rand::Rng;

use super::{
    best_by, by_reserved_work, longest_match, no_owner_label, positions, power_of_two, Choice,
    DecisionLabel, Draw, PolicyConfig, PolicyState, RouteView, WorkerView,
};

/// Labels a baseline's pick (a position in the view's workers, which baselines always see in
/// full) with the label pressure-first would give the same situation.
fn labelled(config: &PolicyConfig, view: &RouteView, worker: usize) -> Choice {
    let owners = longest_match(config, view).unwrap_or_default();
    let label = if owners.contains(view.workers, worker) {
        DecisionLabel::OwnerHold
    } else if !owners.is_empty(view.workers) {
        DecisionLabel::PressureSpill
    } else {
        no_owner_label(config, view)
    };
    Choice {
        slot: view.workers[worker].slot,
        label,
        matched_blocks: view.workers[worker].depth,
        known_owners: owners,
        spilled_prefix: None,
    }
}

/// Power-of-two choices among listed candidates, as a position in the view's workers.
fn drawn(
    config: &PolicyConfig,
    view: &RouteView,
    candidates: &[usize],
    rng: &mut impl Rng,
) -> usize {
    let (slot, _) = power_of_two(config, view, Draw::Listed(candidates), rng);
    candidates
        .iter()
        .copied()
        .find(|&i| view.workers[i].slot == slot)
        .expect("the drawn worker is a candidate")
}

/// Fewest outstanding requests, then least reserved work, then id.
fn by_request_count(a: &WorkerView, b: &WorkerView) -> std::cmp::Ordering {
    a.reserved_requests
        .cmp(&b.reserved_requests)
        .then_with(|| by_reserved_work(a, b))
}

/// Imbalance-first, the behaviour kvrouted replaces: any fleet imbalance (a request-count spread
/// beyond `legacy_balance_abs` and `legacy_balance_rel`, or any worker above high_water) routes
/// to the globally least-loaded worker; owners are used only when the fleet is balanced, and the
/// owner budget is a replication *target*: while a prefix has fewer owners than
/// `max_owners_per_prefix`, a less-loaded non-owner gets a new copy.
pub fn legacy(config: &PolicyConfig, view: &RouteView) -> Option<Choice> {
    let candidates = positions(view, |w| w.candidate);
    if candidates.is_empty() {
        return None;
    }
    let least_loaded = best_by(view, candidates.iter().copied(), by_request_count);
    let counts = candidates
        .iter()
        .map(|&i| view.workers[i].reserved_requests);
    let (min, max) = counts.fold((u32::MAX, 0), |(lo, hi), c| (lo.min(c), hi.max(c)));
    let spread = max - min > config.legacy_balance_abs
        && max as f64 > min as f64 * config.legacy_balance_rel;
    let overloaded = candidates.iter().any(|&i| {
        view.workers[i]
            .pressure
            .is_some_and(|p| p > config.high_water)
    });
    if spread || overloaded {
        return Some(labelled(config, view, least_loaded));
    }
    let Some(owners) = longest_match(config, view) else {
        return Some(labelled(config, view, least_loaded));
    };
    let best_owner = best_by(view, owners.positions(view.workers), by_request_count);
    let below_target = owners.positions(view.workers).count() < config.max_owners_per_prefix;
    let replicate = below_target
        && view.workers[least_loaded].reserved_requests
            < view.workers[best_owner].reserved_requests;
    let worker = if replicate { least_loaded } else { best_owner };
    Some(labelled(config, view, worker))
}

/// Candidates in turn, cache- and load-blind.
pub fn round_robin(
    config: &PolicyConfig,
    state: &mut PolicyState,
    view: &RouteView,
) -> Option<Choice> {
    let candidates = positions(view, |w| w.candidate);
    if candidates.is_empty() {
        return None;
    }
    let worker = candidates[(state.round_robin_cursor % candidates.len() as u64) as usize];
    state.round_robin_cursor = state.round_robin_cursor.wrapping_add(1);
    Some(labelled(config, view, worker))
}

/// Size-aware power-of-two choices over all candidates, cache-blind.
pub fn p2c(config: &PolicyConfig, view: &RouteView, rng: &mut impl Rng) -> Option<Choice> {
    let candidates = positions(view, |w| w.candidate);
    if candidates.is_empty() {
        return None;
    }
    let worker = drawn(config, view, &candidates, rng);
    Some(labelled(config, view, worker))
}

/// Always the deepest owner (least reserved work among equals), pressure-blind; cold misses
/// go to power-of-two choices.
pub fn longest_prefix(
    config: &PolicyConfig,
    view: &RouteView,
    rng: &mut impl Rng,
) -> Option<Choice> {
    let candidates = positions(view, |w| w.candidate);
    if candidates.is_empty() {
        return None;
    }
    let worker = match longest_match(config, view) {
        Some(owners) => best_by(view, owners.positions(view.workers), by_reserved_work),
        None => drawn(config, view, &candidates, rng),
    };
    Some(labelled(config, view, worker))
}

/// `dynamo_cost`'s weight of prefill blocks against decode blocks (Dynamo's default).
pub const PREFILL_LOAD_SCALE: f64 = 1.0;
/// Overlap credit per block held in host memory, against 1 for a block on the device.
pub const HOST_OVERLAP_WEIGHT: f64 = 0.75;
/// Overlap credit per block held on disk or remote storage.
pub const DISK_OVERLAP_WEIGHT: f64 = 0.25;

/// Dynamo's cost of sending this request to `w`, on the router's own predicted load:
/// `PREFILL_LOAD_SCALE × max(prefill_blocks − overlap_credit, 0) + decode_blocks`, where
/// prefill_blocks = (the worker's unfinished reserved prefill tokens + this prompt's tokens) /
/// block size, overlap_credit = device depth + 0.75 × host depth + 0.25 × disk depth, and
/// decode_blocks = the worker's reserved work in blocks + this request's prompt blocks.
pub fn dynamo_cost_of(view: &RouteView, w: &WorkerView) -> f64 {
    let block = view.block_size.max(1) as f64;
    let prefill_blocks = (w.prefill_backlog_tokens as f64 + view.prompt_tokens as f64) / block;
    let overlap = w.depth as f64
        + HOST_OVERLAP_WEIGHT * w.host_depth as f64
        + DISK_OVERLAP_WEIGHT * w.disk_depth as f64;
    let decode_blocks = w.reserved_work as f64 / block + (view.prompt_tokens as f64 / block).ceil();
    PREFILL_LOAD_SCALE * (prefill_blocks - overlap).max(0.0) + decode_blocks
}

/// NVIDIA Dynamo's default worker selector: the candidate of lowest [`dynamo_cost_of`], ties
/// broken by the seeded RNG.
pub fn dynamo_cost(config: &PolicyConfig, view: &RouteView, rng: &mut impl Rng) -> Option<Choice> {
    let candidates = positions(view, |w| w.candidate);
    let costs: Vec<f64> = candidates
        .iter()
        .map(|&i| dynamo_cost_of(view, &view.workers[i]))
        .collect();
    let lowest = costs.iter().copied().min_by(f64::total_cmp)?;
    let tied: Vec<usize> = candidates
        .iter()
        .zip(&costs)
        .filter(|(_, &c)| c == lowest)
        .map(|(&i, _)| i)
        .collect();
    let worker = tied[rng.random_range(0..tied.len())];
    Some(labelled(config, view, worker))
}
