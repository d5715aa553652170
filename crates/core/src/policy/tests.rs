//! The policy's rules on views built by hand: one rule per test.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::baselines::dynamo_cost_of;
use super::*;
use crate::input::WorkerId;

/// A worker as the policy sees it: a candidate with fresh telemetry and nothing reserved.
struct W {
    id: WorkerId,
    depth: u32,
    pressure: Option<f64>,
    reserved_work: u64,
    host_depth: u32,
    disk_depth: u32,
    prefill_backlog_tokens: u64,
}

fn w(name: &str, depth: u32, pressure: f64) -> W {
    W {
        id: WorkerId::new(name).unwrap(),
        depth,
        pressure: Some(pressure),
        reserved_work: 0,
        host_depth: 0,
        disk_depth: 0,
        prefill_backlog_tokens: 0,
    }
}

impl W {
    fn host(mut self, blocks: u32) -> W {
        self.host_depth = blocks;
        self
    }
    fn disk(mut self, blocks: u32) -> W {
        self.disk_depth = blocks;
        self
    }
    fn reserved(mut self, work: u64, prefill: u64) -> W {
        self.reserved_work = work;
        self.prefill_backlog_tokens = prefill;
        self
    }
}

/// Views of `workers`, each numbered by its id's place among theirs, as the router numbers ids.
fn views(workers: &[W]) -> Vec<WorkerView> {
    let id_order = |id: &WorkerId| workers.iter().filter(|other| other.id < *id).count() as u32;
    workers
        .iter()
        .enumerate()
        .map(|(i, w)| WorkerView {
            slot: i as Slot,
            id_order: id_order(&w.id),
            candidate: true,
            depth: w.depth,
            pressure: w.pressure,
            waiting: 0,
            reserved_work: w.reserved_work,
            reserved_requests: 0,
            host_depth: w.host_depth,
            disk_depth: w.disk_depth,
            prefill_backlog_tokens: w.prefill_backlog_tokens,
        })
        .collect()
}

const BLOCK: u32 = 16;

fn keys(blocks: u64) -> Vec<u64> {
    (1..=blocks).collect()
}

/// Decides on `workers` for a prompt of `prompt_blocks` full blocks, with `provisional` as the
/// provisional owner of every prefix, and returns the choice with the chosen worker's name.
fn decide_with(
    config: &PolicyConfig,
    workers: &[W],
    prompt_blocks: u64,
    provisional: Option<ProvisionalOwner>,
    seed: u64,
) -> (String, Choice) {
    let choice = decide_on(config, &views(workers), prompt_blocks, provisional, seed);
    (workers[choice.slot as usize].id.to_string(), choice)
}

/// As [`decide_with`], on views given as they are (listed in their order, whatever their slots).
fn decide_on(
    config: &PolicyConfig,
    vs: &[WorkerView],
    prompt_blocks: u64,
    provisional: Option<ProvisionalOwner>,
    seed: u64,
) -> Choice {
    let ks = keys(prompt_blocks);
    let lookup = move |_: u64| provisional;
    let view = RouteView {
        now_ms: 10_000,
        keys: &ks,
        prompt_tokens: prompt_blocks * BLOCK as u64,
        block_size: BLOCK,
        workers: vs,
        provisional: &lookup,
        fleet: None,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    decide(config, &mut PolicyState::default(), &view, &mut rng).expect("a choice")
}

fn decided(config: &PolicyConfig, workers: &[W], prompt_blocks: u64) -> (String, DecisionLabel) {
    let (name, choice) = decide_with(config, workers, prompt_blocks, None, 0);
    (name, choice.label)
}

#[test]
fn a_shared_prefix_shorter_than_min_match_ratio_of_the_prompt_is_not_ownership() {
    // One block of a 20-block prompt (a system prompt) is 5% of it.
    let fleet = [w("owner", 1, 0.5), w("idle", 0, 0.0)];
    let seed_rule = PolicyConfig {
        min_match_ratio: 0.0,
        ..PolicyConfig::default()
    };
    assert_eq!(
        decided(&seed_rule, &fleet, 20),
        ("owner".into(), DecisionLabel::OwnerHold),
        "ratio 0 is the seed's rule: any match owns"
    );
    let ratio = PolicyConfig {
        min_match_ratio: 0.1,
        ..PolicyConfig::default()
    };
    let (_, label) = decided(&ratio, &fleet, 20);
    assert_eq!(
        label,
        DecisionLabel::ColdMiss,
        "1 block < ceil(0.1 x 20) = 2: a cold miss"
    );
    let deeper = [w("owner", 2, 0.5), w("idle", 0, 0.0)];
    assert_eq!(
        decided(&ratio, &deeper, 20),
        ("owner".into(), DecisionLabel::OwnerHold),
        "2 blocks reach ceil(0.1 x 20) = 2: ownership"
    );
}

#[test]
fn the_match_threshold_is_the_larger_of_min_match_blocks_and_the_ratio_rounded_up() {
    let config = PolicyConfig {
        min_match_blocks: 3,
        min_match_ratio: 0.25,
        ..PolicyConfig::default()
    };
    assert_eq!(config.match_threshold(4), 3, "min_match_blocks binds");
    assert_eq!(config.match_threshold(20), 5, "0.25 x 20 = 5 exactly");
    assert_eq!(
        config.match_threshold(21),
        6,
        "0.25 x 21 = 5.25, rounded up"
    );
    let zero = PolicyConfig {
        min_match_blocks: 0,
        min_match_ratio: 0.0,
        ..PolicyConfig::default()
    };
    assert_eq!(zero.match_threshold(0), 1, "a match is at least one block");
    let baseline = PolicyConfig {
        kind: PolicyKind::LongestPrefix,
        ..config
    };
    assert_eq!(
        baseline.match_threshold(20),
        3,
        "baselines keep their own rule: min_match_blocks only"
    );
}

#[test]
fn a_cold_miss_prefers_the_safe_worker_with_the_deepest_lower_tier_match() {
    let config = PolicyConfig::default();
    for seed in 0..32 {
        let fleet = [
            w("a", 0, 0.1),
            w("host", 0, 0.5).host(6),
            w("disk", 0, 0.1).disk(4),
            w("d", 0, 0.1),
        ];
        let (name, choice) = decide_with(&config, &fleet, 8, None, seed);
        assert_eq!(
            (name.as_str(), choice.label),
            ("host", DecisionLabel::ColdMiss),
            "seed {seed}: reloading 6 blocks from host memory beats cooler workers"
        );
        assert_eq!(choice.matched_blocks, 0, "nothing is on its device");
    }
}

#[test]
fn a_lower_tier_match_above_high_water_is_not_preferred() {
    let config = PolicyConfig::default();
    for seed in 0..32 {
        let fleet = [w("hot", 0, 0.95).host(6), w("a", 0, 0.1), w("b", 0, 0.2)];
        let (name, _) = decide_with(&config, &fleet, 8, None, seed);
        assert_ne!(
            name, "hot",
            "seed {seed}: a worker above high water is not safe"
        );
    }
}

#[test]
fn a_spill_prefers_the_safe_home_with_the_deepest_lower_tier_match() {
    let config = PolicyConfig::default();
    for seed in 0..32 {
        let fleet = [
            w("owner", 8, 0.95),
            w("a", 0, 0.1),
            w("host", 0, 0.6).host(3),
            w("disk", 0, 0.1).disk(5),
            w("b", 0, 0.1),
        ];
        let (name, choice) = decide_with(&config, &fleet, 8, None, seed);
        assert_eq!(
            (name.as_str(), choice.label),
            ("disk", DecisionLabel::PressureSpill),
            "seed {seed}: the deepest lower-tier match (5 on disk) among safe homes"
        );
        assert_eq!(
            choice.matched_blocks, 0,
            "a spill to a non-owner matched nothing on its device"
        );
    }
}

fn at_ceiling(overflow: Option<f64>) -> PolicyConfig {
    PolicyConfig {
        max_owners_per_prefix: 2,
        ceiling_overflow_pressure: overflow,
        ..PolicyConfig::default()
    }
}

#[test]
fn past_the_ceiling_a_spill_happens_only_when_every_owner_is_above_the_overflow_pressure() {
    let overloaded = [w("o1", 8, 1.6), w("o2", 8, 1.9), w("home", 0, 0.1)];
    assert_eq!(
        decided(&at_ceiling(None), &overloaded, 8),
        ("o1".into(), DecisionLabel::CeilingHold),
        "without the setting the ceiling is a ceiling"
    );
    let (name, choice) = decide_with(&at_ceiling(Some(1.5)), &overloaded, 8, None, 0);
    assert_eq!(
        (name.as_str(), choice.label),
        ("home", DecisionLabel::OverloadSpill),
        "every owner above 1.5: one spill past the ceiling"
    );
    assert_eq!(
        choice.spilled_prefix,
        Some(8),
        "it records a provisional owner"
    );
    let one_below = [w("o1", 8, 1.2), w("o2", 8, 1.9), w("home", 0, 0.1)];
    assert_eq!(
        decided(&at_ceiling(Some(1.5)), &one_below, 8).1,
        DecisionLabel::CeilingHold,
        "an owner at or below the overflow pressure keeps the ceiling"
    );
}

#[test]
fn an_overload_spill_happens_at_most_once_per_cooldown() {
    let overloaded = [w("o1", 8, 1.6), w("o2", 8, 1.9), w("home", 0, 0.1)];
    let recent = ProvisionalOwner {
        slot: 2,
        spilled_ms: 9_000,
    };
    let (name, choice) = decide_with(&at_ceiling(Some(1.5)), &overloaded, 8, Some(recent), 0);
    assert_ne!(
        choice.label,
        DecisionLabel::OverloadSpill,
        "a spill of the prefix 1 s ago (cooldown 5 s) coalesces"
    );
    assert_eq!(
        name, "home",
        "the provisional owner is now the least pressured owner"
    );
}

#[test]
fn a_provisional_owner_that_owns_by_depth_counts_once_toward_the_ceiling() {
    // Step 3 is a union: the one owner, pressured above high_water, is also the provisional
    // owner of the prefix (spilled 1 s ago, cooldown 5 s). Known owners are 1, below the
    // ceiling of 2, so the spill coalesces rather than meeting the ceiling.
    let fleet = [w("owner", 8, 0.95), w("home", 0, 0.1)];
    let recent = ProvisionalOwner {
        slot: 0,
        spilled_ms: 9_000,
    };
    let (name, choice) = decide_with(&at_ceiling(None), &fleet, 8, Some(recent), 0);
    assert_eq!(
        (name.as_str(), choice.label),
        ("owner", DecisionLabel::SpillCooldownHold),
        "an owner that is also the provisional owner is one known owner, not two"
    );
    assert_eq!(
        choice.known_owners.provisional, None,
        "the provisional owner is named only when it does not already own by depth"
    );
}

#[test]
fn folded_backlog_raises_pressure_only_for_pressure_first_and_never_invents_telemetry() {
    let fold = PolicyConfig {
        backlog_pressure_tokens: 10_000,
        ..PolicyConfig::default()
    };
    assert_eq!(fold.ranked_pressure(Some(0.2), 5_000), Some(0.7));
    assert_eq!(
        fold.ranked_pressure(None, 50_000),
        None,
        "telemetry gaps still fail open"
    );
    let off = PolicyConfig {
        backlog_pressure_tokens: 0,
        ..PolicyConfig::default()
    };
    assert_eq!(off.ranked_pressure(Some(0.2), 5_000), Some(0.2));
    let baseline = PolicyConfig {
        kind: PolicyKind::P2c,
        ..fold
    };
    assert_eq!(
        baseline.ranked_pressure(Some(0.2), 5_000),
        Some(0.2),
        "baselines keep their own rule"
    );
}

#[test]
fn dynamo_cost_is_uncached_prefill_blocks_plus_decode_blocks_with_tiered_overlap_credit() {
    let workers = [
        // Prefill (0 + 160) / 16 = 10 blocks, overlap 4 + 0.75 x 4 + 0.25 x 4 = 8: 2; decode 0 +
        // 10.
        w("tiered", 4, 0.0).host(4).disk(4),
        // Backlog 320 tokens = 20 more prefill blocks, 6 cached: 24; decode 480/16 = 30 + 10.
        w("busy", 6, 0.0).reserved(480, 320),
    ];
    let ks = keys(10);
    let vs = views(&workers);
    let none = |_: u64| None;
    let view = RouteView {
        now_ms: 0,
        keys: &ks,
        prompt_tokens: 160,
        block_size: BLOCK,
        workers: &vs,
        provisional: &none,
        fleet: None,
    };
    assert_eq!(dynamo_cost_of(&view, &vs[0]), 2.0 + 10.0);
    assert_eq!(dynamo_cost_of(&view, &vs[1]), 24.0 + 40.0);
    let config = PolicyConfig {
        kind: PolicyKind::DynamoCost,
        ..PolicyConfig::default()
    };
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let choice = decide(&config, &mut PolicyState::default(), &view, &mut rng).unwrap();
    assert_eq!(choice.slot, 0, "the lowest cost wins");
}

#[test]
fn dynamo_cost_breaks_ties_with_the_seeded_rng() {
    let config = PolicyConfig {
        kind: PolicyKind::DynamoCost,
        ..PolicyConfig::default()
    };
    let fleet = [w("a", 0, 0.0), w("b", 0, 0.0), w("c", 2, 0.0)];
    let chosen: std::collections::BTreeSet<String> = (0..32)
        .map(|seed| decide_with(&config, &fleet[..2], 8, None, seed).0)
        .collect();
    assert_eq!(
        chosen.len(),
        2,
        "equal costs: either worker, by seed ({chosen:?})"
    );
    for seed in 0..8 {
        assert_eq!(
            decide_with(&config, &fleet, 8, None, seed).0,
            "c",
            "two cached blocks make c the cheapest"
        );
    }
    assert_eq!(
        decide_with(&config, &fleet[..2], 8, None, 5).0,
        decide_with(&config, &fleet[..2], 8, None, 5).0,
        "the same seed, the same pick"
    );
}

#[test]
fn known_owners_are_visited_once_each_in_listing_order_with_the_provisional_owner_last() {
    // The owners by depth are the candidates at depth 3 (one at that depth is not a
    // candidate); a shallower candidate is the provisional owner.
    let fleet = [
        w("a", 3, 0.5),
        w("b", 2, 0.5),
        w("c", 3, 0.5),
        w("d", 3, 0.5),
        w("e", 1, 0.5),
    ];
    let mut vs = views(&fleet);
    vs[2].candidate = false;
    let owners = KnownOwners {
        depth: 3,
        provisional: Some(1),
    };
    let mut visited = Vec::new();
    owners.for_each(&vs, |i, w| {
        assert_eq!(w.slot, vs[i].slot, "each owner comes with its own view");
        visited.push(i);
    });
    assert_eq!(
        visited,
        [0, 3, 1],
        "candidates at the owners' depth, then the provisional"
    );
    assert_eq!(
        visited,
        owners.positions(&vs).collect::<Vec<_>>(),
        "the loop visits what positions lists, in the same order"
    );
}

#[test]
fn an_owner_hold_between_equal_ranks_of_one_worker_takes_the_first_listed() {
    // Two ranks of one worker share its place in id order; with equal reserved work,
    // pressure and queue, the one listed first is held (the policy's last tie rule is the
    // listing order, which the router makes the slot order). Here slot 2 is listed first.
    let fleet = [w("x", 4, 0.5), w("y", 4, 0.5), w("z", 4, 0.5)];
    let mut vs = views(&fleet);
    vs[2].id_order = vs[0].id_order;
    vs.swap(0, 2);
    let choice = decide_on(&PolicyConfig::default(), &vs, 4, None, 0);
    assert_eq!(choice.label, DecisionLabel::OwnerHold);
    assert_eq!(
        choice.slot, 2,
        "of two equal ranks of the lowest id, the one listed first is held"
    );
}

#[test]
fn a_worker_view_fits_one_cache_line() {
    assert_eq!(
        (
            std::mem::size_of::<WorkerView>(),
            std::mem::align_of::<WorkerView>()
        ),
        (64, 64),
        "a view is one 64-byte line, aligned to it (size, alignment): a wide decision writes and \
         passes over hundreds of them, and a view across two lines costs both"
    );
}
