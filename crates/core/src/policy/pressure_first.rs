//! The pressure-first longest-prefix policy, docs/architecture.md, "Policy", step by step.
//!
//! The invariant it protects: **a request stays on a worker that already holds its longest
//! prefix unless every such owner is under pressure.** Load anywhere else in the fleet never
//! moves a request off a usable owner, and a prefix is only replicated (a new owner created)
//! when all of its owners are pressured, at most once per `spill_cooldown` and never beyond
//! `max_owners_per_prefix` known owners (unless `ceiling_overflow_pressure` is set and every
//! known owner is above it).

use rand::Rng;
use smallvec::SmallVec;

use crate::index::Slot;

use super::{
    best_by, by_pressure, by_reserved_work, deepest_lower_tier, longest_match, no_owner_label,
    positions, power_of_two, Choice, DecisionLabel, Draw, KnownOwners, PolicyConfig, Pool,
    Positions, RouteView, WorkerView,
};

pub fn decide(config: &PolicyConfig, view: &RouteView, rng: &mut impl Rng) -> Option<Choice> {
    // 1. Candidates: known workers that are not draining, removed or excluded. None → 503.
    if view.pool_count(config, Pool::Candidates, &[]) == 0 {
        return None;
    }

    // 2. Longest match: the owners are the candidates at the maximum depth, if that depth
    //    reaches min_match_blocks and min_match_ratio of the prompt. The prefix key P is the key
    //    at that depth.
    let Some(mut known_owners) = longest_match(config, view) else {
        // 7. No owner: a cold miss, or owners that exist but are all unavailable.
        return Some(no_owner(config, view, rng));
    };
    let prefix = view.keys[known_owners.depth as usize - 1];

    // 3. Known owners = owners ∪ the provisional owner recorded for P, if it is inside the
    //    cooldown and a candidate.
    let provisional = (view.provisional)(prefix)
        .filter(|p| view.now_ms.saturating_sub(p.spilled_ms) < config.spill_cooldown_ms);
    if let Some(p) = provisional {
        known_owners.provisional = view
            .workers
            .iter()
            .position(|w| w.slot == p.slot && w.candidate)
            .filter(|&pos| !known_owners.contains(view.workers, pos));
    }
    let ((slot, matched_blocks), label, spilled_prefix) = hold_or_spill(
        config,
        view,
        known_owners,
        prefix,
        provisional.is_some(),
        rng,
    );
    // matched_blocks is the chosen worker's own depth, so a spill never claims reuse.
    Some(Choice {
        slot,
        label,
        matched_blocks,
        known_owners,
        spilled_prefix,
    })
}

/// Steps 4 to 6 for a request with known owners: the chosen rank and its depth, the label, and
/// the prefix to record a provisional owner for (a spill's). `spill_in_cooldown`: a provisional
/// owner of `prefix` was recorded inside the cooldown (step 3 found it).
fn hold_or_spill(
    config: &PolicyConfig,
    view: &RouteView,
    known_owners: KnownOwners,
    prefix: u64,
    spill_in_cooldown: bool,
    rng: &mut impl Rng,
) -> ((Slot, u32), DecisionLabel, Option<u64>) {
    let listed = |i: usize| (view.workers[i].slot, view.workers[i].depth);
    let owners = known_owners.positions(view.workers);

    // 4. Hold on a suitable owner. An owner is pressured when its fresh pressure is above
    //    min(best owner pressure + slack, high_water); missing or stale telemetry is never
    //    pressure (telemetry gaps fail open to known owners). Pressure is ranked only within the
    //    owner set.
    //    (Two plain passes over the owners, each keeping the first of equals, as `min_by`
    //    does: a wide decision makes them over hundreds.)
    let mut best: Option<f64> = None;
    known_owners.for_each(view.workers, |_, w| {
        if let Some(p) = w.pressure {
            if best.is_none_or(|b| p.total_cmp(&b).is_lt()) {
                best = Some(p);
            }
        }
    });
    let limit = best.map(|best| (best + config.pressure_slack).min(config.high_water));
    let pressured = |w: &WorkerView| match (w.pressure, limit) {
        (Some(pressure), Some(limit)) => pressure > limit,
        _ => false,
    };
    let mut hold: Option<(usize, &WorkerView)> = None;
    known_owners.for_each(view.workers, |i, w| {
        let better = || hold.is_none_or(|(_, h)| by_reserved_work(w, h).is_lt());
        if !pressured(w) && better() {
            hold = Some((i, w));
        }
    });
    if let Some((worker, _)) = hold {
        return (listed(worker), DecisionLabel::OwnerHold, None);
    }
    let least_pressured_owner = listed(best_by(view, owners.clone(), by_pressure));

    // A safe home: a candidate that is not a known owner, with fresh telemetry at or below
    // high_water; those with the deepest lower-tier match of the prefix come first. Only listed
    // workers have a lower-tier match; without one, every safe non-owner of the fleet is a home.
    // One slot per known owner (each is one rank).
    let mut owner_slots: SmallVec<[Slot; 4]> =
        owners.clone().map(|i| view.workers[i].slot).collect();
    owner_slots.sort_unstable();
    // Some(reloaders) if there is a home; no reloaders means the whole pool of safe non-owners.
    let safe_homes = || -> Option<Positions> {
        let reloaders: Positions = (0..view.workers.len())
            .filter(|&i| {
                Pool::Safe.admits(config, &view.workers[i])
                    && view.workers[i].lower_tier_depth() > 0
                    && !known_owners.contains(view.workers, i)
            })
            .collect();
        if !reloaders.is_empty() {
            return Some(deepest_lower_tier(view, &reloaders));
        }
        (view.pool_count(config, Pool::Safe, &owner_slots) > 0).then(Positions::new)
    };
    let home_of = |reloaders: Positions, rng: &mut _| {
        if reloaders.is_empty() {
            let pool = Draw::Pool {
                pool: Pool::Safe,
                minus: &owner_slots,
            };
            power_of_two(config, view, pool, rng)
        } else {
            power_of_two(config, view, Draw::Listed(&reloaders), rng)
        }
    };

    // 6. At the ceiling the router creates no new owner. (Authoritative owners beyond it are
    //    never pruned: they are all still known owners.) The one escape: every known owner
    //    above ceiling_overflow_pressure, and no spill of P inside the cooldown.
    if owner_slots.len() >= config.max_owners_per_prefix {
        let overloaded = config.ceiling_overflow_pressure.is_some_and(|x| {
            owners
                .clone()
                .all(|i| view.workers[i].pressure.is_some_and(|p| p > x))
        });
        if overloaded && !spill_in_cooldown {
            if let Some(homes) = safe_homes() {
                let home = home_of(homes, rng);
                return (home, DecisionLabel::OverloadSpill, Some(prefix));
            }
        }
        return (least_pressured_owner, DecisionLabel::CeilingHold, None);
    }

    // 5. Every owner is pressured and the ceiling is not reached: spill, at most once per
    //    cooldown, and only to a safe home.
    if spill_in_cooldown {
        // Concurrent spills coalesce on the one provisional owner already created.
        return (
            least_pressured_owner,
            DecisionLabel::SpillCooldownHold,
            None,
        );
    }
    let Some(homes) = safe_homes() else {
        return (least_pressured_owner, DecisionLabel::NoSafeHomeHold, None);
    };
    let home = home_of(homes, rng);
    (home, DecisionLabel::PressureSpill, Some(prefix))
}

/// Step 7: size-aware power-of-two choices over candidates, preferring those not above
/// high_water, and among the safe ones (fresh telemetry at or below high_water) those with the
/// deepest lower-tier match; `owner_unavailable` when owners exist but none is a candidate.
pub(crate) fn no_owner(config: &PolicyConfig, view: &RouteView, rng: &mut impl Rng) -> Choice {
    let pool = if view.pool_count(config, Pool::Cool, &[]) > 0 {
        Pool::Cool
    } else {
        Pool::Candidates
    };
    // Safe members of the pool with a lower-tier match; only listed workers have one. (When no
    // candidate is cool, none is safe either.)
    let reloaders = positions(view, |w| {
        pool.admits(config, w) && Pool::Safe.admits(config, w) && w.lower_tier_depth() > 0
    });
    let (slot, matched_blocks) = if reloaders.is_empty() {
        power_of_two(config, view, Draw::Pool { pool, minus: &[] }, rng)
    } else {
        let deepest = deepest_lower_tier(view, &reloaders);
        power_of_two(config, view, Draw::Listed(&deepest), rng)
    };
    Choice {
        slot,
        label: no_owner_label(config, view),
        matched_blocks,
        known_owners: KnownOwners::default(),
        spilled_prefix: None,
    }
}
