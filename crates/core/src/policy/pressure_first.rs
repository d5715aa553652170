//! The pressure-first longest-prefix policy, docs/architecture.md, "Policy", step by step.
//!
//! The invariant it protects: **a request stays on a worker that already holds its longest
//! prefix unless every such owner is under pressure.** Load anywhere else in the fleet never
//! moves a request off a usable owner, and a prefix is only replicated (a new owner created)
//! when all of its owners are pressured, at most once per `spill_cooldown` and never beyond
//! `max_owners_per_prefix` known owners (unless `ceiling_overflow_pressure` is set and every
//! known owner is above it).

use rand::Rng;

use super::{
    best_by, by_pressure, by_reserved_work, deepest_lower_tier, longest_match, no_owner_label,
    positions, power_of_two, Choice, DecisionLabel, PolicyConfig, RouteView,
};

pub fn decide(config: &PolicyConfig, view: &RouteView, rng: &mut impl Rng) -> Option<Choice> {
    // 1. Candidates: known workers that are not draining, removed or excluded. None → 503.
    let candidates = positions(view, |w| w.candidate);
    if candidates.is_empty() {
        return None;
    }

    // 2. Longest match: the owners are the candidates at the maximum depth, if that depth
    //    reaches min_match_blocks and min_match_ratio of the prompt. The prefix key P is the key
    //    at that depth.
    let Some((mut known_owners, depth)) = longest_match(config, view) else {
        // 7. No owner: a cold miss, or owners that exist but are all unavailable.
        return Some(no_owner(config, view, &candidates, rng));
    };
    let prefix = view.keys[depth as usize - 1];

    // 3. Known owners = owners ∪ the provisional owner recorded for P, if it is inside the
    //    cooldown and a candidate.
    let provisional = (view.provisional)(prefix)
        .filter(|p| view.now_ms.saturating_sub(p.spilled_ms) < config.spill_cooldown_ms);
    if let Some(p) = provisional {
        if let Some(pos) = view
            .workers
            .iter()
            .position(|w| w.slot == p.slot && w.candidate)
        {
            if !known_owners.contains(&pos) {
                known_owners.push(pos);
            }
        }
    }
    // matched_blocks is the chosen worker's own depth, so a spill never claims reuse.
    let choice = |worker: usize, label, spilled_prefix| Choice {
        worker,
        label,
        matched_blocks: view.workers[worker].depth,
        known_owners: known_owners.clone(),
        spilled_prefix,
    };

    // 4. Hold on a suitable owner. An owner is pressured when its fresh pressure is above
    //    min(best owner pressure + slack, high_water); missing or stale telemetry is never
    //    pressure (telemetry gaps fail open to known owners). Pressure is ranked only within the
    //    owner set.
    let best = known_owners
        .iter()
        .filter_map(|&i| view.workers[i].pressure)
        .min_by(f64::total_cmp);
    let limit = best.map(|best| (best + config.pressure_slack).min(config.high_water));
    let pressured = |i: usize| match (view.workers[i].pressure, limit) {
        (Some(pressure), Some(limit)) => pressure > limit,
        _ => false,
    };
    let unpressured: Vec<usize> = known_owners
        .iter()
        .copied()
        .filter(|&i| !pressured(i))
        .collect();
    if !unpressured.is_empty() {
        let worker = best_by(view, &unpressured, by_reserved_work);
        return Some(choice(worker, DecisionLabel::OwnerHold, None));
    }
    let least_pressured_owner = best_by(view, &known_owners, by_pressure);

    // A safe home: a candidate that is not a known owner, with fresh telemetry at or below
    // high_water; those with the deepest lower-tier match of the prefix come first.
    let safe_homes = || {
        let safe = positions(view, |w| {
            w.candidate && w.pressure.is_some_and(|p| p <= config.high_water)
        });
        let safe: Vec<usize> = safe
            .into_iter()
            .filter(|i| !known_owners.contains(i))
            .collect();
        deepest_lower_tier(view, &safe)
    };

    // 6. At the ceiling the router creates no new owner. (Authoritative owners beyond it are
    //    never pruned: they are all still in `known_owners`.) The one escape: every known owner
    //    above ceiling_overflow_pressure, and no spill of P inside the cooldown.
    if known_owners.len() >= config.max_owners_per_prefix {
        let overloaded = config.ceiling_overflow_pressure.is_some_and(|x| {
            known_owners
                .iter()
                .all(|&i| view.workers[i].pressure.is_some_and(|p| p > x))
        });
        if overloaded && provisional.is_none() {
            let homes = safe_homes();
            if !homes.is_empty() {
                let home = power_of_two(view, &homes, rng);
                return Some(choice(home, DecisionLabel::OverloadSpill, Some(prefix)));
            }
        }
        return Some(choice(
            least_pressured_owner,
            DecisionLabel::CeilingHold,
            None,
        ));
    }

    // 5. Every owner is pressured and the ceiling is not reached: spill, at most once per
    //    cooldown, and only to a safe home.
    if provisional.is_some() {
        // Concurrent spills coalesce on the one provisional owner already created.
        return Some(choice(
            least_pressured_owner,
            DecisionLabel::SpillCooldownHold,
            None,
        ));
    }
    let safe_homes = safe_homes();
    if safe_homes.is_empty() {
        return Some(choice(
            least_pressured_owner,
            DecisionLabel::NoSafeHomeHold,
            None,
        ));
    }
    let home = power_of_two(view, &safe_homes, rng);
    Some(choice(home, DecisionLabel::PressureSpill, Some(prefix)))
}

/// Step 7: size-aware power-of-two choices over candidates, preferring those not above
/// high_water, and among the safe ones (fresh telemetry at or below high_water) those with the
/// deepest lower-tier match; `owner_unavailable` when owners exist but none is a candidate.
pub(crate) fn no_owner(
    config: &PolicyConfig,
    view: &RouteView,
    candidates: &[usize],
    rng: &mut impl Rng,
) -> Choice {
    let cool: Vec<usize> = candidates
        .iter()
        .copied()
        .filter(|&i| {
            view.workers[i]
                .pressure
                .is_none_or(|p| p <= config.high_water)
        })
        .collect();
    let pool = if cool.is_empty() { candidates } else { &cool };
    let safe: Vec<usize> = pool
        .iter()
        .copied()
        .filter(|&i| {
            view.workers[i]
                .pressure
                .is_some_and(|p| p <= config.high_water)
        })
        .collect();
    let reloaders = if safe.iter().any(|&i| view.workers[i].lower_tier_depth() > 0) {
        deepest_lower_tier(view, &safe)
    } else {
        Vec::new()
    };
    let pool = if reloaders.is_empty() {
        pool
    } else {
        &reloaders
    };
    let worker = power_of_two(view, pool, rng);
    Choice {
        worker,
        label: no_owner_label(config, view),
        matched_blocks: view.workers[worker].depth,
        known_owners: Vec::new(),
        spilled_prefix: None,
    }
}
