//! Reserved work with a prefill part: released by phase, expired by its own deadline, folded
//! into pressure, shown in explain.

use super::*;

fn reserved_prefill(fleet: &Fleet, worker: &str) -> u64 {
    let slot = fleet.router.state.workers.slot_of(&id(worker), 0).unwrap();
    fleet
        .router
        .state
        .workers
        .get(slot)
        .unwrap()
        .reserved_prefill
}

#[test]
fn a_reservations_prefill_part_is_the_prompt_the_worker_does_not_hold_and_is_released_at_the_first_token(
) {
    let mut fleet = Fleet::new();
    fleet.store("a", &PROMPT[..3]);
    fleet.load("a", 0.1);
    let d = fleet.route(&PROMPT);
    assert_eq!((d.worker.as_str(), d.matched_blocks), ("a", 3));
    assert_eq!(fleet.reserved("a"), 16 + 100, "work = prompt + output");
    assert_eq!(
        reserved_prefill(&fleet, "a"),
        4,
        "a holds 3 of the 4 blocks: one block (4 tokens) to prefill"
    );
    let first_token = fleet.apply(Input::Release {
        reservation: d.reservation,
        phase: Some(ReleasePhase::Prefill),
    });
    assert_eq!(first_token, Output::released(true));
    assert_eq!(
        (fleet.reserved("a"), reserved_prefill(&fleet, "a")),
        (12 + 100, 0),
        "the first token gives back the prefill part only"
    );
    let done = fleet.apply(Input::Release {
        reservation: d.reservation,
        phase: None,
    });
    assert_eq!(done, Output::released(true));
    assert_eq!(fleet.reserved("a"), 0, "completion gives back the rest");
}

#[test]
fn a_reservation_expires_whole_at_its_own_deadline_even_after_a_shorter_ttl_is_configured() {
    let mut fleet = Fleet::with(|c| c.reservation_ttl_ms = 600_000);
    fleet.load("a", 0.1);
    fleet.route(&PROMPT);
    // A restart with a shorter TTL: reservations made now expire before the older one.
    let mut config = fleet.router.config().clone();
    config.reservation_ttl_ms = 10_000;
    fleet.apply(Input::Configure(Box::new(config)));
    let short = fleet.route(&PROMPT);
    assert_eq!(fleet.reserved("a"), 2 * (16 + 100));
    fleet.advance(10_000);
    fleet.apply(Input::Tick);
    assert_eq!(
        fleet.reserved("a"),
        16 + 100,
        "the 10 s reservation expired although the 600 s one was made first"
    );
    assert_eq!(
        reserved_prefill(&fleet, "a"),
        16,
        "its prefill part went with it"
    );
    assert_eq!(
        fleet.apply(Input::Release {
            reservation: short.reservation,
            phase: None
        }),
        Output::released(false)
    );
    fleet.advance(589_999);
    fleet.load("a", 0.1);
    assert_eq!(fleet.reserved("a"), 16 + 100, "not before its own deadline");
    fleet.advance(1);
    fleet.load("a", 0.1);
    assert_eq!(fleet.reserved("a"), 0, "the 600 s one at its own deadline");
}

#[test]
fn folded_prefill_backlog_pressures_an_owner_its_load_sample_shows_idle() {
    let mut fleet = Fleet::with(|c| c.policy.backlog_pressure_tokens = 8);
    fleet.store("owner", &PROMPT);
    fleet.load("owner", 0.1);
    fleet.load("idle", 0.1);
    // Three cold prompts of 16 tokens routed to the owner after its last sample: 48 tokens of
    // prefill it has not finished, which no sample shows yet.
    let cold = |i: u64| {
        let mut req = Fleet::request(&[i, i + 1, i + 2, i + 3]);
        req.exclude = vec![id("idle")];
        req
    };
    for i in [20, 30, 40] {
        fleet.route_req(cold(i));
    }
    let mut req = Fleet::request(&PROMPT);
    req.explain = true;
    let d = fleet.route_req(req);
    assert_eq!(
        decided(&d),
        ("idle", DecisionLabel::PressureSpill),
        "the owner's backlog (48 tokens / 8 = +6.0) pressures it"
    );
    let rows = d.explain.unwrap();
    let owner = rows.iter().find(|r| r.worker.as_str() == "owner").unwrap();
    assert_eq!(owner.sample_pressure, Some(0.1));
    assert_eq!(owner.prefill_backlog_tokens, 48);
    assert_eq!(
        owner.pressure,
        Some(0.1 + 6.0),
        "explain shows the folded pressure"
    );

    let mut unfolded = Fleet::with(|c| c.policy.backlog_pressure_tokens = 0);
    unfolded.store("owner", &PROMPT);
    unfolded.load("owner", 0.1);
    unfolded.load("idle", 0.1);
    for i in [20, 30, 40] {
        unfolded.route_req(cold(i));
    }
    assert_eq!(
        decided(&unfolded.route(&PROMPT)),
        ("owner", DecisionLabel::OwnerHold),
        "not folded (0), the sample alone decides"
    );
}

#[test]
fn explain_shows_the_match_threshold_lower_tier_depths_and_dynamo_cost() {
    let mut fleet = Fleet::with(|c| c.policy.min_match_ratio = 0.5);
    fleet.store("owner", &PROMPT[..1]);
    fleet.load("owner", 0.5);
    fleet.load("other", 0.2);
    let mut req = Fleet::request(&PROMPT);
    req.explain = true;
    let d = fleet.route_req(req);
    assert_eq!(
        d.decision,
        DecisionLabel::ColdMiss,
        "1 block of 4 is below ratio 0.5"
    );
    let rows = d.explain.unwrap();
    let owner = rows.iter().find(|r| r.worker.as_str() == "owner").unwrap();
    let other = rows.iter().find(|r| r.worker.as_str() == "other").unwrap();
    assert_eq!(owner.match_threshold, 2, "ceil(0.5 x 4) blocks");
    assert_eq!((owner.host_depth, owner.disk_depth), (0, 0));
    // 16 prompt tokens = 4 blocks; owner: max(4 - 1, 0) + 0 + 4 = 7; other: 4 + 4 = 8.
    assert_eq!(
        (owner.dynamo_cost, other.dynamo_cost),
        (Some(7.0), Some(8.0))
    );
}

#[test]
fn a_journaled_release_from_before_phases_decodes_as_a_whole_release() {
    // The journal's encoding of the input as it was before the phase field existed.
    #[derive(serde::Serialize)]
    #[allow(dead_code)]
    enum OldInput {
        KvEvents(()),
        Load(()),
        Lifecycle(()),
        Route(()),
        Release { reservation: u64 },
    }
    let bytes = rmp_serde::to_vec(&OldInput::Release { reservation: 42 }).unwrap();
    let input: Input = rmp_serde::from_slice(&bytes).expect("old journals stay decodable");
    assert_eq!(
        input,
        Input::Release {
            reservation: 42,
            phase: None
        }
    );
}
