//! The baseline policies, each by its own rule.

use super::*;

#[test]
fn legacy_sends_the_next_turn_to_an_uncached_worker_when_an_unrelated_worker_is_hot() {
    let mut fleet = Fleet::with(|c| c.policy.kind = PolicyKind::Legacy);
    fleet.load("owner", 0.3);
    fleet.load("idle", 0.3);
    fleet.load("hot", 0.99);
    fleet.store("owner", &PROMPT);
    fleet.route_excluding(&[99], &["idle", "hot"]); // the owner has one request in flight
    let d = fleet.route(&[11, 12, 13, 14, 15]);
    assert_eq!(
        decided(&d),
        ("idle", DecisionLabel::PressureSpill),
        "legacy: a hot unrelated worker breaks affinity (the churn pressure_first removes)"
    );
    let mut pf = Fleet::new();
    pf.load("owner", 0.3);
    pf.load("idle", 0.3);
    pf.load("hot", 0.99);
    pf.store("owner", &PROMPT);
    pf.route_excluding(&[99], &["idle", "hot"]);
    assert_eq!(
        decided(&pf.route(&[11, 12, 13, 14, 15])).0,
        "owner",
        "pressure_first holds"
    );
}

#[test]
fn legacy_sends_the_next_turn_to_an_uncached_worker_on_a_request_count_spread() {
    let mut fleet = Fleet::with(|c| c.policy.kind = PolicyKind::Legacy);
    fleet.load("owner", 0.3);
    fleet.load("idle", 0.3);
    fleet.store("owner", &PROMPT);
    for i in 0..4 {
        fleet.route_excluding(&[500 + i], &["idle"]);
    }
    let d = fleet.route(&[11, 12, 13, 14, 15]);
    assert_eq!(
        decided(&d),
        ("idle", DecisionLabel::PressureSpill),
        "legacy: a request-count spread beyond balance_abs/balance_rel breaks affinity"
    );
}

#[test]
fn baselines_route_by_their_own_rule() {
    let mut rr = Fleet::with(|c| c.policy.kind = PolicyKind::RoundRobin);
    for w in ["a", "b", "c"] {
        rr.load(w, 0.1);
    }
    rr.store("c", &PROMPT);
    let picks = rr.chosen(&PROMPT, 4);
    assert_eq!(picks, ["a", "b", "c", "a"], "round robin ignores the cache");

    let mut lp = Fleet::with(|c| c.policy.kind = PolicyKind::LongestPrefix);
    lp.store("owner", &PROMPT);
    lp.load("owner", 0.99);
    lp.load("cool", 0.0);
    for _ in 0..3 {
        assert_eq!(
            decided(&lp.route(&PROMPT)),
            ("owner", DecisionLabel::OwnerHold),
            "pressure-blind"
        );
    }

    let mut p2c = Fleet::with(|c| c.policy.kind = PolicyKind::P2c);
    p2c.store("owner", &PROMPT);
    p2c.load("owner", 0.1);
    p2c.load("other", 0.1);
    let picks = p2c.chosen(&PROMPT, 4);
    assert!(
        picks.iter().any(|w| w == "other"),
        "p2c balances reserved work, cache-blind: {picks:?}"
    );
}
