//! Replicas sharing their decisions: a peer's route or release applied as effects only makes
//! the replicas agree on owners, spill cooldowns and reserved work, without echo, and replay
//! stays exact.

use super::*;
use crate::replicas::{PeerEvent, PeerEventKind, ReservationSecret};
use crate::router::peers::PEER_REORDER_WINDOW_MS;

const WORKERS: [&str; 4] = ["w0", "w1", "w2", "w3"];

impl Fleet {
    /// A router that shares decisions as replica `name`.
    fn replica(name: &str) -> Fleet {
        let secret = ReservationSecret::from_bytes([7; 32]);
        Fleet::with(|c| {
            c.replica_id = name.to_owned();
            c.reservation_secret = Some(secret);
        })
    }

    fn peer(&mut self, event: &PeerEvent) -> PeerReport {
        match self.apply(Input::Peer(Box::new(event.clone()))) {
            Output::Peer(report) => report,
            other => panic!("expected a peer report, got {other:?}"),
        }
    }

    fn release(&mut self, reservation: u64, phase: Option<ReleasePhase>) -> Output {
        self.apply(Input::Release { reservation, phase })
    }

    fn provisional_of(&self, locals: &[u64]) -> Option<WorkerId> {
        let keys = chain_locals(locals.iter().copied());
        let ns = self.router.state.namespaces.get(None, None)?;
        let p = self.router.state.provisional.get(&(ns, *keys.last()?))?;
        self.router.state.workers.get(p.slot).map(|w| w.id.clone())
    }
}

/// Replicas `a` and `b` that see the same fleet: every worker at `pressure`, `owner` (if any)
/// holding [`PROMPT`] at 0.95.
fn two_replicas(owner: Option<&str>, pressure: f64) -> (Fleet, Fleet) {
    let mut pair = (Fleet::replica("a"), Fleet::replica("b"));
    for fleet in [&mut pair.0, &mut pair.1] {
        for w in WORKERS {
            fleet.load(w, pressure);
        }
        if let Some(owner) = owner {
            fleet.store(owner, &PROMPT);
            fleet.load(owner, 0.95);
        }
    }
    pair
}

fn event_of(decision: &Decision) -> PeerEvent {
    (**decision
        .peer_event
        .as_ref()
        .expect("a replica's route gives an event for its peers"))
    .clone()
}

#[test]
fn a_peers_decision_makes_the_same_owner_preferred_on_the_other_replica() {
    let (mut a, mut b) = two_replicas(None, 0.2);
    let first = a.route(&PROMPT);
    assert_eq!(first.decision, DecisionLabel::ColdMiss);
    let report = b.peer(&event_of(&first));
    assert_eq!(report, PeerReport::default(), "applied cleanly");
    b.advance(10);
    let next_turn = b.route(&[11, 12, 13, 14, 15, 16]);
    assert_eq!(
        (decided(&next_turn), next_turn.matched_blocks),
        ((first.worker.as_str(), DecisionLabel::OwnerHold), 4),
        "the next turn, on the replica that never saw the first, holds on the worker the peer chose"
    );
    assert_eq!(
        b.reserved(first.worker.as_str()),
        a.reserved(first.worker.as_str()) + next_turn_work(&next_turn, &b),
        "the peer's reserved work counts on this replica too"
    );
}

/// Work the router reserved for `decision` (still fully open).
fn next_turn_work(decision: &Decision, fleet: &Fleet) -> u64 {
    fleet
        .router
        .state
        .reservations
        .get(decision.reservation)
        .expect("open")
        .work
}

#[test]
fn a_peers_spill_inside_the_cooldown_counts_as_one_and_is_followed() {
    let (mut a, mut b) = two_replicas(Some("w0"), 0.1);
    let spill = a.route(&PROMPT);
    assert_eq!(spill.decision, DecisionLabel::PressureSpill);
    b.peer(&event_of(&spill));
    b.advance(50);
    let followed = b.route(&PROMPT);
    assert_eq!(
        decided(&followed),
        (spill.worker.as_str(), DecisionLabel::OwnerHold),
        "the other replica follows the peer's provisional owner instead of spilling again"
    );
    // The provisional owner is pressured too: inside the cooldown nobody spills again.
    for fleet in [&mut a, &mut b] {
        fleet.load(spill.worker.as_str(), 0.96);
        fleet.advance(100);
        let d = fleet.route(&PROMPT);
        assert_eq!(
            d.decision,
            DecisionLabel::SpillCooldownHold,
            "within the cooldown of a spill on any replica, no replica creates another owner"
        );
    }
}

#[test]
fn concurrent_spills_on_two_replicas_coalesce_on_the_earlier_one_on_both() {
    let (mut a, mut b) = two_replicas(Some("w0"), 0.1);
    let spill_a = a.route(&PROMPT);
    b.advance(3);
    let spill_b = b.route(&PROMPT);
    assert_eq!(
        (spill_a.decision, spill_b.decision),
        (DecisionLabel::PressureSpill, DecisionLabel::PressureSpill),
        "before hearing of each other, both replicas spill"
    );
    a.advance(5);
    let on_a = a.peer(&event_of(&spill_b));
    let on_b = b.peer(&event_of(&spill_a));
    assert!(
        on_a.coalesced_spill && on_b.coalesced_spill,
        "each sees the other's spill inside its own cooldown: {on_a:?} {on_b:?}"
    );
    assert_eq!(
        (a.provisional_of(&PROMPT), b.provisional_of(&PROMPT)),
        (Some(spill_a.worker.clone()), Some(spill_a.worker.clone())),
        "both replicas keep the earlier spill as the one provisional owner"
    );
    for fleet in [&mut a, &mut b] {
        for w in WORKERS {
            fleet.load(w, if w == "w0" { 0.95 } else { 0.96 });
        }
        fleet.load(spill_a.worker.as_str(), 0.96);
        fleet.load(spill_b.worker.as_str(), 0.96);
        fleet.advance(100);
        assert_eq!(
            fleet.route(&PROMPT).decision,
            DecisionLabel::SpillCooldownHold,
            "the two spills count as one: no third owner inside the cooldown"
        );
    }
}

#[test]
fn a_release_of_a_peers_reservation_frees_the_work_on_both_replicas() {
    let (mut a, mut b) = two_replicas(None, 0.2);
    let d = a.route(&PROMPT);
    let worker = d.worker.as_str();
    b.peer(&event_of(&d));
    assert!(b.reserved(worker) > 0, "the peer's work is reserved here");
    assert_eq!(b.reserved(worker), a.reserved(worker));
    let released = b.release(d.reservation, None);
    assert!(
        matches!(released, Output::Released { found: true, .. }),
        "a replica releases a peer's reservation: {released:?}"
    );
    let event = released
        .peer_event()
        .expect("a found release is told to peers");
    assert_eq!(
        event.kind,
        PeerEventKind::Released {
            reservation: d.reservation,
            phase: None
        }
    );
    let report = a.peer(event);
    assert!(
        report.released,
        "the origin gives the work back: {report:?}"
    );
    assert_eq!(
        (a.reserved(worker), b.reserved(worker)),
        (0, 0),
        "released on both replicas"
    );
}

#[test]
fn a_release_heard_before_its_route_applies_when_the_route_arrives() {
    let (mut a, mut b) = two_replicas(None, 0.2);
    let mut c = Fleet::replica("c");
    for w in WORKERS {
        c.load(w, 0.2);
    }
    let d = a.route(&PROMPT);
    b.peer(&event_of(&d));
    let released = b.release(d.reservation, None);
    // C hears B's release before A's route (they travel on different streams).
    let early = c.peer(released.peer_event().unwrap());
    assert!(early.early_release && !early.released, "{early:?}");
    let late = c.peer(&event_of(&d));
    assert!(late.early_release, "{late:?}");
    assert_eq!(
        c.reserved(d.worker.as_str()),
        0,
        "a release that overtook its route still frees the work"
    );
}

#[test]
fn peer_events_do_not_echo_and_redelivery_applies_once() {
    let (mut a, mut b) = two_replicas(None, 0.2);
    let d = a.route(&PROMPT);
    let event = event_of(&d);
    let out = b.apply(Input::Peer(Box::new(event.clone())));
    assert_eq!(
        out.peer_event(),
        None,
        "a peer's event is not published again"
    );
    let reserved = b.reserved(d.worker.as_str());
    let again = b.peer(&event);
    assert!(again.duplicate, "{again:?}");
    assert_eq!(
        b.reserved(d.worker.as_str()),
        reserved,
        "a redelivered event does not reserve the work twice"
    );
    let own = a.peer(&event);
    assert!(
        own.own,
        "a replica ignores its own events read back: {own:?}"
    );
    assert_eq!(a.reserved(d.worker.as_str()), reserved);
    let released = b.release(d.reservation, None);
    let out = a.apply(Input::Peer(Box::new(
        released.peer_event().unwrap().clone(),
    )));
    assert_eq!(
        out.peer_event(),
        None,
        "a peer's release is not published again"
    );
}

#[test]
fn a_peers_events_stored_out_of_order_apply_each_once() {
    // A publisher retries a decision while later ones are stored: the stream holds them out of
    // order, and every one must still count on the other replicas.
    let (mut a, mut b) = two_replicas(None, 0.2);
    let events: Vec<PeerEvent> = (0..3)
        .map(|i| {
            a.advance(10);
            event_of(&a.route(&[100 + i, 2, 3, 4]))
        })
        .collect();
    for i in [2, 0, 1] {
        let report = b.peer(&events[i]);
        assert_eq!(
            report,
            PeerReport::default(),
            "an event stored behind a later one of its peer still applies"
        );
    }
    for event in &events {
        assert!(
            b.peer(event).duplicate,
            "each redelivered event is skipped, whatever order they came in"
        );
    }
    for w in WORKERS {
        assert_eq!(
            b.reserved(w),
            a.reserved(w),
            "the replicas agree on reserved work once every event arrived"
        );
    }
}

#[test]
fn a_peers_event_far_behind_its_later_ones_is_taken_for_a_redelivery() {
    let (mut a, mut b) = two_replicas(None, 0.2);
    let late = event_of(&a.route(&PROMPT));
    a.advance(PEER_REORDER_WINDOW_MS + 1_000);
    let later = event_of(&a.route(&[50, 51, 52, 53]));
    a.advance(1_000);
    let latest = event_of(&a.route(&[60, 61, 62, 63]));
    b.peer(&later);
    b.peer(&latest);
    assert!(
        b.peer(&late).duplicate,
        "an event that arrives more than the reorder window behind later ones of its peer is \
         skipped: the peer's memory of what it applied is bounded"
    );
    assert!(
        b.peer(&latest).duplicate,
        "events inside the window are still recognised"
    );
}

#[test]
fn a_router_running_alone_publishes_nothing() {
    let mut alone = Fleet::new();
    for w in WORKERS {
        alone.load(w, 0.2);
    }
    let d = alone.route(&PROMPT);
    assert!(d.peer_event.is_none());
    assert_eq!(
        d.reservation, alone.seq,
        "without a secret the id is the journal sequence"
    );
    assert_eq!(alone.release(d.reservation, None).peer_event(), None);
}

#[test]
fn reservation_ids_differ_across_replicas_and_are_unguessable_but_replay_gives_identical_ids() {
    let (mut a, mut b) = two_replicas(None, 0.2);
    let mut journal = Vec::new();
    let mut ids_a = Vec::new();
    let mut ids_b = Vec::new();
    for i in 0..50u64 {
        let req = Fleet::request(&[i, i + 1]);
        a.seq += 1;
        let stamped = Stamped {
            seq: a.seq,
            at_ms: a.now,
            input: Input::Route(req.clone()),
        };
        let Output::Routed(d) = a.router.apply(&stamped) else {
            panic!("routed")
        };
        journal.push(stamped);
        ids_a.push(d.reservation);
        ids_b.push(b.route_req(req).reservation);
    }
    assert!(
        ids_a.iter().zip(&ids_b).all(|(x, y)| x != y),
        "two replicas at the same sequence give different ids"
    );
    assert!(
        ids_a.windows(2).all(|w| w[0].abs_diff(w[1]) > 1 << 20),
        "consecutive ids are far apart: one's own id does not reveal the next"
    );
    assert!(
        ids_a.iter().all(|&id| id > 1 << 20),
        "ids are not journal sequences"
    );
    let mut replayed = Fleet::replica("a");
    for w in WORKERS {
        replayed.load(w, 0.2);
    }
    let replay_ids: Vec<u64> = journal
        .iter()
        .map(|s| match replayed.router.apply(s) {
            Output::Routed(d) => d.reservation,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(replay_ids, ids_a, "replay gives the same ids");
}

#[test]
fn replaying_a_journal_with_peer_inputs_is_exact() {
    let (mut a, mut b) = two_replicas(Some("w0"), 0.1);
    let mut journal_b: Vec<Stamped> = Vec::new();
    let mut outputs_b: Vec<Output> = Vec::new();
    let mut record = |b: &mut Fleet, input: Input| {
        b.seq += 1;
        let s = Stamped {
            seq: b.seq,
            at_ms: b.now,
            input,
        };
        outputs_b.push(b.router.apply(&s));
        journal_b.push(s);
    };
    for i in 0..30u64 {
        let locals = [11, 12, 13, 14, 20 + i % 4];
        let d = a.route(&locals);
        record(&mut b, Input::Peer(Box::new(event_of(&d))));
        record(&mut b, Input::Route(Fleet::request(&locals)));
        if i % 3 == 0 {
            a.release(d.reservation, Some(ReleasePhase::Prefill));
            record(
                &mut b,
                Input::Release {
                    reservation: d.reservation,
                    phase: None,
                },
            );
        }
        a.advance(40);
        b.advance(40);
    }
    assert!(
        outputs_b
            .iter()
            .any(|o| matches!(o, Output::Peer(r) if r == &PeerReport::default())),
        "the journal holds applied peer inputs"
    );
    // The same setup (loads and stores) is the head of the replayed journal.
    let mut replay = Fleet::replica("b");
    for w in WORKERS {
        replay.load(w, 0.1);
    }
    replay.store("w0", &PROMPT);
    replay.load("w0", 0.95);
    assert_eq!(
        replay.seq + 1,
        journal_b[0].seq,
        "setup replays the same head"
    );
    let replayed: Vec<Output> = journal_b.iter().map(|s| replay.router.apply(s)).collect();
    assert_eq!(
        replayed, outputs_b,
        "replaying routes, releases and peer inputs gives the same outputs, events included"
    );
    assert_eq!(
        rmp_serde::to_vec(replay.router.state()).unwrap(),
        rmp_serde::to_vec(b.router.state()).unwrap(),
        "and byte-identical state"
    );
}

#[test]
fn journals_and_snapshots_from_before_replicas_still_decode() {
    // The journal and snapshots write structs as arrays: an old config or state is the new one
    // without its last fields.
    let drop_last = |bytes: Vec<u8>, n: usize| {
        let mut value = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
        let rmpv::Value::Array(fields) = &mut value else {
            panic!("an array")
        };
        fields.truncate(fields.len() - n);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &value).unwrap();
        out
    };
    let old_config = drop_last(rmp_serde::to_vec(&RouterConfig::default()).unwrap(), 2);
    let config: RouterConfig = rmp_serde::from_slice(&old_config).expect("old config decodes");
    assert_eq!(
        (config.replica_id.as_str(), config.reservation_secret),
        ("", None),
        "an old config runs alone, with sequence ids"
    );
    let (a, _) = two_replicas(None, 0.2);
    let old_state = drop_last(rmp_serde::to_vec(a.router.state()).unwrap(), 1);
    let state: RouterState = rmp_serde::from_slice(&old_state).expect("old snapshot decodes");
    assert_eq!(state.workers.iter().count(), WORKERS.len());
}

#[test]
fn peer_events_from_invalid_replica_ids_are_rejected() {
    let (mut a, mut b) = two_replicas(None, 0.2);
    let mut event = event_of(&a.route(&PROMPT));
    event.replica = "a.b".to_owned();
    let report = b.peer(&event);
    assert_eq!(
        report.rejection.map(|r| r.reason),
        Some(RejectReason::InvalidField),
        "a replica id is one subject token"
    );
    assert_eq!(b.reserved(event_worker(&event)), 0, "nothing applied");
}

fn event_worker(event: &PeerEvent) -> &str {
    match &event.kind {
        PeerEventKind::Routed(r) => r.worker.as_str(),
        PeerEventKind::Released { .. } => panic!("a route"),
    }
}
