//! The pressure-first policy step by step (docs/architecture.md, "Policy"): holds, spills,
//! the cooldown, the ceiling, telemetry gaps, cold misses.

use super::*;

#[test]
fn exact_owner_holds_when_another_worker_is_cooler_and_an_unrelated_worker_is_overloaded() {
    let mut fleet = Fleet::new();
    fleet.store("owner", &PROMPT);
    fleet.load("owner", 0.70);
    fleet.load("cool", 0.05);
    fleet.load("hot", 0.99);
    let d = fleet.route(&PROMPT);
    assert_eq!(
        decided(&d),
        ("owner", DecisionLabel::OwnerHold),
        "a hot unrelated worker and a cooler non-owner never move a request off a usable owner"
    );
    assert_eq!(d.matched_blocks, 4);
    assert_eq!(d.prompt_blocks, 4);
    assert_eq!(d.owners, vec![id("owner")]);
}

#[test]
fn pressured_only_owner_spills_once_and_the_next_request_reuses_the_provisional_owner() {
    let mut fleet = Fleet::new();
    fleet.store("owner", &PROMPT);
    fleet.load("owner", 0.95);
    for w in ["a", "b", "c"] {
        fleet.load(w, 0.20);
    }
    let first = fleet.route(&PROMPT);
    assert_eq!(
        first.decision,
        DecisionLabel::PressureSpill,
        "every owner is pressured"
    );
    assert_ne!(first.worker.as_str(), "owner");
    // No KV event from the new owner yet: the next request must still find it.
    fleet.advance(100);
    let second = fleet.route(&PROMPT);
    assert_eq!(
        decided(&second),
        (first.worker.as_str(), DecisionLabel::OwnerHold),
        "the second request reuses the one provisional owner instead of creating another"
    );
    assert_eq!(
        second.owners.len(),
        2,
        "owner and provisional owner are both known owners"
    );
}

#[test]
fn sequential_prefix_extensions_stay_on_one_owner_despite_request_count_and_reserved_work_imbalance(
) {
    let mut fleet = Fleet::new();
    for w in ["w1", "w2", "w3"] {
        fleet.load(w, 0.30);
    }
    let mut context: Vec<u64> = vec![1, 2];
    let first = fleet.route(&context);
    assert_eq!(first.decision, DecisionLabel::ColdMiss);
    let owner = first.worker.clone();
    for turn in 0..20u64 {
        // Each turn re-sends the whole context plus new blocks; nothing is released, so the
        // owner's request count and reserved work grow far beyond everyone else's.
        context.extend([100 + 2 * turn, 101 + 2 * turn]);
        fleet.advance(500);
        let d = fleet.route(&context);
        assert_eq!(
            (&d.worker, d.decision),
            (&owner, DecisionLabel::OwnerHold),
            "turn {turn}: a trajectory stays on its owner before KV events arrive"
        );
        assert_eq!(d.matched_blocks as usize, context.len() - 2);
    }
    assert!(
        fleet.reserved(owner.as_str()) > 20 * 100,
        "the owner carries all the reserved work"
    );
}

#[test]
fn cached_owners_share_load_by_least_reserved_work_reserved_atomically() {
    let mut fleet = Fleet::new();
    for w in ["a", "b", "c"] {
        fleet.store(w, &PROMPT);
        fleet.load(w, 0.40);
    }
    fleet.load("idle", 0.0);
    let picks = fleet.chosen(&PROMPT, 6);
    // Each decision reserves its work before the next is decided, so back-to-back requests
    // rotate over the owners instead of piling onto one.
    assert_eq!(
        picks,
        ["a", "b", "c", "a", "b", "c"],
        "owners share load by reserved work"
    );
    for w in ["a", "b", "c"] {
        assert_eq!(
            fleet.reserved(w),
            2 * (16 + 100),
            "two requests reserved on {w}"
        );
    }
    assert_eq!(
        fleet.reserved("idle"),
        0,
        "a non-owner gets nothing while owners are usable"
    );
}

#[test]
fn owners_alike_in_work_pressure_and_queue_are_taken_in_id_order_not_join_order() {
    // Joined "c" first and "a" last, so slot order is c, b, a; everything else is equal, so
    // only the last tie-break of step 4 (then id) tells the owners apart.
    let mut fleet = Fleet::new();
    for w in ["c", "b", "a"] {
        fleet.store(w, &PROMPT);
        fleet.load(w, 0.40);
    }
    let picks = fleet.chosen(&PROMPT, 3);
    assert_eq!(
        picks,
        ["a", "b", "c"],
        "ties between owners break by id, whatever order the workers joined in"
    );
}

#[test]
fn release_returns_reserved_work_and_unknown_reservations_are_not_found() {
    let mut fleet = Fleet::new();
    fleet.load("a", 0.1);
    let d = fleet.route(&PROMPT);
    assert_eq!(fleet.reserved("a"), 16 + 100);
    let out = fleet.apply(Input::Release {
        reservation: d.reservation,
        phase: None,
    });
    assert_eq!(out, Output::released(true));
    assert_eq!(fleet.reserved("a"), 0, "release gives the work back");
    let again = fleet.apply(Input::Release {
        reservation: d.reservation,
        phase: None,
    });
    assert_eq!(
        again,
        Output::released(false),
        "a second release finds nothing"
    );
}

#[test]
fn reservations_expire_after_their_ttl() {
    let mut fleet = Fleet::with(|c| c.reservation_ttl_ms = 10_000);
    fleet.load("a", 0.1);
    fleet.route(&PROMPT);
    fleet.advance(9_999);
    fleet.apply(Input::Tick);
    assert_eq!(fleet.reserved("a"), 16 + 100, "not yet expired");
    fleet.advance(1);
    fleet.load("a", 0.1);
    assert_eq!(
        fleet.reserved("a"),
        0,
        "expired reservations give their work back"
    );
}

#[test]
fn reserved_work_counts_the_output_estimate_when_no_smaller_maximum_is_given() {
    let mut fleet = Fleet::with(|c| c.output_estimate = 500);
    fleet.load("a", 0.1);
    let mut req = Fleet::request(&PROMPT);
    req.max_output_tokens = None;
    fleet.route_req(req.clone());
    assert_eq!(fleet.reserved("a"), 16 + 500);
    req.max_output_tokens = Some(10_000);
    fleet.route_req(req);
    assert_eq!(
        fleet.reserved("a"),
        2 * (16 + 500),
        "work is capped by the estimate"
    );
}

#[test]
fn the_ceiling_stops_pressure_driven_expansion() {
    let mut fleet = Fleet::with(|c| {
        c.policy.max_owners_per_prefix = 2;
        c.policy.spill_cooldown_ms = 1_000;
    });
    fleet.store("o1", &PROMPT);
    fleet.load("o1", 0.95);
    for w in ["a", "b", "c"] {
        fleet.load(w, 0.10);
    }
    let spill = fleet.route(&PROMPT);
    assert_eq!(spill.decision, DecisionLabel::PressureSpill);
    // The new owner gets hot too; after the cooldown the prefix is at its ceiling of 2.
    fleet.load(spill.worker.as_str(), 0.97);
    fleet.advance(2_000);
    fleet.load("o1", 0.95);
    for w in ["a", "b", "c"] {
        if w != spill.worker.as_str() {
            fleet.load(w, 0.10);
        }
    }
    let d = fleet.route(&PROMPT);
    assert_eq!(
        decided(&d),
        ("o1", DecisionLabel::CeilingHold),
        "at the ceiling the router holds on the least-pressured owner instead of spilling"
    );
}

#[test]
fn authoritative_owners_beyond_the_ceiling_are_never_pruned_and_stay_candidates() {
    let mut fleet = Fleet::with(|c| c.policy.max_owners_per_prefix = 2);
    let owners = ["o1", "o2", "o3", "o4"];
    for (i, w) in owners.iter().enumerate() {
        fleet.store(w, &PROMPT);
        fleet.load(w, 0.50 + i as f64 * 0.01);
    }
    fleet.load("spare", 0.0);
    let picks = fleet.chosen(&PROMPT, 4);
    let mut sorted = picks.clone();
    sorted.sort();
    assert_eq!(
        sorted, owners,
        "all four authoritative owners stay in use above a ceiling of 2"
    );
    let d = fleet.route(&PROMPT);
    assert_eq!(
        d.owners.len(),
        4,
        "no authoritative owner is pruned to enforce the ceiling"
    );
    assert_eq!(fleet.router.index_stats().entries, 16);
}

#[test]
fn concurrent_pressure_spills_within_the_cooldown_coalesce() {
    let mut fleet = Fleet::new();
    fleet.store("owner", &PROMPT);
    fleet.load("owner", 0.95);
    for w in ["a", "b", "c", "d"] {
        fleet.load(w, 0.10);
    }
    let spill = fleet.route(&PROMPT);
    assert_eq!(spill.decision, DecisionLabel::PressureSpill);
    // Before the spill target reports anything useful, it is pressured as well: a burst of
    // requests must not fan out over the rest of the fleet.
    fleet.load(spill.worker.as_str(), 0.96);
    for _ in 0..5 {
        fleet.advance(200);
        let d = fleet.route(&PROMPT);
        assert_eq!(
            decided(&d),
            ("owner", DecisionLabel::SpillCooldownHold),
            "within the cooldown no further owner is created; hold on the least-pressured owner"
        );
    }
    fleet.advance(5_000);
    for w in ["owner", "a", "b", "c", "d"] {
        let p = if w == "owner" { 0.95 } else { 0.10 };
        fleet.load(w, p);
    }
    fleet.load(spill.worker.as_str(), 0.96);
    let after = fleet.route(&PROMPT);
    assert_eq!(
        after.decision,
        DecisionLabel::PressureSpill,
        "after the cooldown a spill may happen"
    );
}

#[test]
fn no_safe_spill_destination_holds_on_the_least_pressured_owner() {
    let mut fleet = Fleet::new();
    fleet.store("o1", &PROMPT);
    fleet.store("o2", &PROMPT);
    fleet.load("o1", 0.97);
    fleet.load("o2", 0.93);
    fleet.load("hot", 0.99);
    fleet.lifecycle("silent", LifecycleOp::Join); // no telemetry: not a safe home
    let d = fleet.route(&PROMPT);
    assert_eq!(
        decided(&d),
        ("o2", DecisionLabel::NoSafeHomeHold),
        "with no fresh worker at or below high water, hold on the least-pressured owner"
    );
}

#[test]
fn missing_or_stale_telemetry_fails_open_to_known_owners() {
    let mut fleet = Fleet::new();
    fleet.store("owner", &PROMPT);
    fleet.load("other", 0.0);
    let d = fleet.route(&PROMPT);
    assert_eq!(
        decided(&d),
        ("owner", DecisionLabel::OwnerHold),
        "an owner without telemetry is never pressured"
    );
    fleet.load("owner", 0.99);
    fleet.advance(30_001);
    fleet.load("other", 0.0);
    let d = fleet.route(&PROMPT);
    assert_eq!(
        decided(&d),
        ("owner", DecisionLabel::OwnerHold),
        "telemetry older than telemetry_max_age does not pressure an owner"
    );
}

#[test]
fn excluded_or_draining_owners_fall_back_as_owner_unavailable() {
    let mut fleet = Fleet::new();
    fleet.store("owner", &PROMPT);
    fleet.load("owner", 0.1);
    fleet.load("other", 0.1);
    let d = fleet.route_excluding(&PROMPT, &["owner"]);
    assert_eq!(
        decided(&d),
        ("other", DecisionLabel::OwnerUnavailable),
        "excluded owner"
    );
    fleet.lifecycle("owner", LifecycleOp::Drain);
    let d = fleet.route(&[11, 12, 13, 14, 15]);
    assert_eq!(
        decided(&d),
        ("other", DecisionLabel::OwnerHold),
        "the drained owner is skipped; the earlier fallback's records make `other` an owner"
    );
    let d = fleet.route(&[11, 99]);
    assert_eq!(decided(&d).0, "other");
    let mut fleet = Fleet::new();
    fleet.store("owner", &PROMPT);
    fleet.load("other", 0.1);
    fleet.lifecycle("owner", LifecycleOp::Drain);
    let d = fleet.route(&PROMPT);
    assert_eq!(
        decided(&d),
        ("other", DecisionLabel::OwnerUnavailable),
        "draining owner"
    );
}

#[test]
fn removed_owners_lose_their_ownership_and_silent_workers_age_out() {
    let mut fleet = Fleet::with(|c| c.worker_ttl_ms = 60_000);
    fleet.store("leaver", &PROMPT);
    fleet.store("silent", &[1, 2]);
    fleet.load("other", 0.1);
    fleet.lifecycle("leaver", LifecycleOp::Leave);
    let d = fleet.route(&PROMPT);
    assert_eq!(
        decided(&d),
        ("other", DecisionLabel::ColdMiss),
        "a leave drops all ownership"
    );
    for _ in 0..61 {
        fleet.advance(1_000);
        fleet.load("other", 0.1);
        fleet.apply(Input::Tick);
    }
    let rows: Vec<String> = fleet
        .router
        .worker_rows(fleet.now)
        .iter()
        .map(|r| r.id.to_string())
        .collect();
    assert_eq!(
        rows,
        ["other"],
        "a worker silent for worker_ttl ages out like a leave"
    );
    assert!(
        fleet.router.ownerships().is_empty(),
        "aged-out workers own nothing"
    );
}

#[test]
fn a_restart_gives_every_worker_a_fresh_ttl() {
    let mut fleet = Fleet::with(|c| c.worker_ttl_ms = 60_000);
    fleet.store("w", &PROMPT);
    fleet.advance(3_600_000); // the daemon was down for an hour
    fleet.apply(Input::Resume);
    fleet.apply(Input::Tick);
    assert_eq!(
        fleet.router.worker_rows(fleet.now).len(),
        1,
        "downtime does not age workers out"
    );
    fleet.advance(60_001);
    fleet.apply(Input::Tick);
    assert!(
        fleet.router.worker_rows(fleet.now).is_empty(),
        "but silence after the restart does"
    );
}

#[test]
fn no_candidate_is_reported_as_such() {
    let mut fleet = Fleet::new();
    assert_eq!(
        fleet.apply(Input::Route(Fleet::request(&PROMPT))),
        Output::NoCandidate
    );
    fleet.load("only", 0.1);
    fleet.lifecycle("only", LifecycleOp::Drain);
    assert_eq!(
        fleet.apply(Input::Route(Fleet::request(&PROMPT))),
        Output::NoCandidate,
        "a fleet of draining workers has no candidate"
    );
}

#[test]
fn cold_misses_prefer_workers_below_high_water() {
    let mut fleet = Fleet::new();
    fleet.load("hot1", 0.95);
    fleet.load("hot2", 0.99);
    fleet.load("cool", 0.50);
    for i in 0..10 {
        let d = fleet.route(&[1000 + i]);
        assert_eq!(
            decided(&d),
            ("cool", DecisionLabel::ColdMiss),
            "cold misses avoid hot workers"
        );
    }
}

#[test]
fn matches_shorter_than_min_match_blocks_are_cold_misses() {
    let mut fleet = Fleet::with(|c| c.policy.min_match_blocks = 3);
    fleet.store("owner", &[1, 2]);
    fleet.load("owner", 0.1);
    let d = fleet.route(&[1, 2, 3, 4]);
    assert_eq!(
        d.decision,
        DecisionLabel::ColdMiss,
        "2 blocks < min_match_blocks 3"
    );
}

#[test]
fn the_deepest_owner_wins_over_shallower_ones() {
    let mut fleet = Fleet::new();
    fleet.store("shallow", &PROMPT[..2]);
    fleet.store("deep", &PROMPT);
    fleet.load("shallow", 0.0);
    fleet.load("deep", 0.8);
    let d = fleet.route(&PROMPT);
    assert_eq!(decided(&d), ("deep", DecisionLabel::OwnerHold));
    assert_eq!(
        d.owners,
        vec![id("deep")],
        "only candidates at the maximum depth are owners"
    );
}

#[test]
fn pressure_is_ranked_only_within_the_owner_set() {
    // Two owners: one at 0.50, one at 0.65 (within slack 0.10 of best? no: 0.65 > 0.60).
    let mut fleet = Fleet::new();
    fleet.store("busy", &PROMPT);
    fleet.store("calm", &PROMPT);
    fleet.load("busy", 0.65);
    fleet.load("calm", 0.50);
    // Make "calm" carry more reserved work, so only pressure can exclude "busy".
    for _ in 0..3 {
        fleet.route_excluding(&PROMPT, &["busy"]);
    }
    let d = fleet.route(&PROMPT);
    assert_eq!(
        decided(&d),
        ("calm", DecisionLabel::OwnerHold),
        "an owner more than pressure_slack above the best owner is pressured"
    );
    fleet.load("busy", 0.59);
    let d = fleet.route(&PROMPT);
    assert_eq!(
        decided(&d),
        ("busy", DecisionLabel::OwnerHold),
        "within the slack, the owner with less reserved work wins"
    );
}

#[test]
fn spills_only_choose_fresh_safe_homes() {
    for i in 0..8 {
        let mut f = Fleet::new();
        f.seq = i * 7; // different random draws
        f.store("owner", &PROMPT);
        f.load("owner", 0.95);
        f.load("safe", 0.30);
        f.load("hot", 0.95);
        f.lifecycle("unknown-load", LifecycleOp::Join);
        let d = f.route(&PROMPT);
        assert_eq!(
            decided(&d),
            ("safe", DecisionLabel::PressureSpill),
            "only a fresh, cool worker is a safe home"
        );
    }
}

#[test]
fn a_routed_prompt_is_owned_by_its_worker_until_its_events_arrive_unless_approx_ttl_is_zero() {
    for (ttl_ms, recorded) in [(120_000, true), (0, false)] {
        let mut fleet = Fleet::with(|c| c.approx_ttl_ms = ttl_ms);
        for w in ["a", "b", "c", "d"] {
            fleet.load(w, 0.20);
        }
        let first = fleet.route(&PROMPT);
        assert_eq!(first.decision, DecisionLabel::ColdMiss);
        fleet.advance(100);
        let second = fleet.route(&PROMPT);
        if recorded {
            assert_eq!(
                decided(&second),
                (first.worker.as_str(), DecisionLabel::OwnerHold),
                "the next turn finds the worker the first was routed to before its KV events arrive"
            );
        } else {
            assert_eq!(
                second.decision,
                DecisionLabel::ColdMiss,
                "with approx_ttl 0 a route makes no owner"
            );
        }
        assert_eq!(
            fleet.router.state.approx.is_empty(),
            !recorded,
            "approximate records are written only when approx_ttl is above zero"
        );
    }
}
