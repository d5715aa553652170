//! Behaviour of the state machine and the pressure-first policy (docs/architecture.md, "Policy"), one sentence
//! per test.

use super::*;
use crate::hashing::chain_locals;
use crate::input::{LoadSample, StoredBlock};
use crate::policy::PolicyKind;
use crate::reservations::ReleasePhase;

const BLOCK: u32 = 4;

/// A router driven by hand: a clock in milliseconds and a journal sequence.
struct Fleet {
    router: Router,
    seq: u64,
    now: u64,
}

fn id(s: &str) -> WorkerId {
    WorkerId::new(s).unwrap()
}

/// A `BlockStored` event of one block (engine hash = local).
fn one_block(local: u64, block_size: u32, medium: Medium) -> KvEvent {
    KvEvent::Stored {
        parent: None,
        blocks: vec![StoredBlock {
            engine_hash: local,
            local,
        }],
        block_size,
        lora: None,
        medium,
        full_attention: true,
    }
}

/// Engine hashes in tests are the keys themselves, xored so they differ from keys.
fn engine(key: u64) -> u64 {
    key ^ 0xE1
}

impl Fleet {
    fn new() -> Self {
        Fleet::with(|_| {})
    }

    fn with(configure: impl FnOnce(&mut RouterConfig)) -> Self {
        let mut config = RouterConfig {
            block_size: BLOCK,
            ..RouterConfig::default()
        };
        configure(&mut config);
        Fleet {
            router: Router::new(config),
            seq: 0,
            now: 1_000_000,
        }
    }

    fn apply(&mut self, input: Input) -> Output {
        self.seq += 1;
        self.router.apply(&Stamped {
            seq: self.seq,
            at_ms: self.now,
            input,
        })
    }

    fn advance(&mut self, ms: u64) {
        self.now += ms;
    }

    /// `worker` reports storing the prompt made of these block locals (a fresh chain).
    fn store(&mut self, worker: &str, locals: &[u64]) {
        let keys = chain_locals(locals.iter().copied());
        let blocks = keys
            .iter()
            .zip(locals)
            .map(|(&k, &local)| StoredBlock {
                engine_hash: engine(k),
                local,
            })
            .collect();
        let out = self.apply(Input::KvEvents(KvEventBatch::stored(
            id(worker),
            None,
            blocks,
            BLOCK,
        )));
        let Output::Ingested(report) = out else {
            panic!("{out:?}")
        };
        assert!(report.rejections.is_empty(), "{:?}", report.rejections);
    }

    /// Applies a KV event batch and returns what it did.
    fn ingest(
        &mut self,
        worker: &str,
        seq: Option<u64>,
        dp_rank: u32,
        events: Vec<KvEvent>,
    ) -> IngestReport {
        let out = self.apply(Input::KvEvents(KvEventBatch {
            worker: id(worker),
            model: None,
            dp_rank,
            seq,
            epoch: None,
            events,
        }));
        match out {
            Output::Ingested(report) => report,
            other => panic!("expected an ingest report, got {other:?}"),
        }
    }

    fn load(&mut self, worker: &str, pressure: f64) {
        self.apply(Input::Load(LoadSample {
            worker: id(worker),
            kv_usage: pressure,
            running: 1,
            waiting: 0,
            max_running: None,
            model: None,
            dp_rank: 0,
        }));
    }

    fn lifecycle(&mut self, worker: &str, op: LifecycleOp) {
        self.apply(Input::Lifecycle(Lifecycle {
            worker: id(worker),
            op,
            model: None,
            block_size: None,
            capacity_blocks: None,
            dp_size: None,
            epoch: None,
        }));
    }

    fn request(locals: &[u64]) -> RouteRequest {
        RouteRequest {
            model: None,
            lora: None,
            keys: chain_locals(locals.iter().copied()),
            prompt_tokens: locals.len() as u64 * BLOCK as u64,
            max_output_tokens: Some(100),
            exclude: vec![],
            request_id: None,
            explain: false,
        }
    }

    fn route_req(&mut self, req: RouteRequest) -> Decision {
        match self.apply(Input::Route(req)) {
            Output::Routed(d) => d,
            other => panic!("expected a decision, got {other:?}"),
        }
    }

    fn route(&mut self, locals: &[u64]) -> Decision {
        self.route_req(Fleet::request(locals))
    }

    fn route_excluding(&mut self, locals: &[u64], exclude: &[&str]) -> Decision {
        let mut req = Fleet::request(locals);
        req.exclude = exclude.iter().map(|w| id(w)).collect();
        self.route_req(req)
    }

    fn reserved(&self, worker: &str) -> u64 {
        let slot = self.router.state.workers.slot_of(&id(worker), 0).unwrap();
        self.router.state.workers.get(slot).unwrap().reserved_work
    }
}

const PROMPT: [u64; 4] = [11, 12, 13, 14];

fn decided(d: &Decision) -> (&str, DecisionLabel) {
    (d.worker.as_str(), d.decision)
}

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
    let picks: Vec<String> = (0..6)
        .map(|_| fleet.route(&PROMPT).worker.to_string())
        .collect();
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
fn release_returns_reserved_work_and_unknown_reservations_are_not_found() {
    let mut fleet = Fleet::new();
    fleet.load("a", 0.1);
    let d = fleet.route(&PROMPT);
    assert_eq!(fleet.reserved("a"), 16 + 100);
    let out = fleet.apply(Input::Release {
        reservation: d.reservation,
        phase: None,
    });
    assert_eq!(out, Output::Released { found: true });
    assert_eq!(fleet.reserved("a"), 0, "release gives the work back");
    let again = fleet.apply(Input::Release {
        reservation: d.reservation,
        phase: None,
    });
    assert_eq!(
        again,
        Output::Released { found: false },
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
    let picks: Vec<String> = (0..4)
        .map(|_| fleet.route(&PROMPT).worker.to_string())
        .collect();
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
fn kv_events_with_another_block_size_are_rejected_not_rechunked() {
    let mut fleet = Fleet::new();
    let report = fleet.ingest("w", None, 0, vec![one_block(2, 16, Medium::Gpu)]);
    assert_eq!(report.rejections.len(), 1);
    assert_eq!(report.rejections[0].reason, RejectReason::BlockSizeMismatch);
    assert!(
        fleet.router.ownerships().is_empty(),
        "nothing of a rejected event is indexed"
    );
}

#[test]
fn non_gpu_blocks_are_lower_tier_ownership_never_device_ownership() {
    let mut fleet = Fleet::new();
    let report = fleet.ingest("w", None, 0, vec![one_block(2, BLOCK, Medium::Host)]);
    assert_eq!(report.lower_tier_stored, 1);
    assert!(
        fleet.router.ownerships().is_empty(),
        "CPU-tier blocks never count as GPU ownership"
    );
}

#[test]
fn duplicate_sequences_are_skipped_and_gaps_counted_per_dp_rank() {
    let mut fleet = Fleet::new();
    let mut batch = |seq: u64, rank: u32, local: u64| {
        fleet.ingest(
            "w",
            Some(seq),
            rank,
            vec![one_block(local, BLOCK, Medium::Gpu)],
        )
    };
    assert_eq!(batch(1, 0, 1).stored_blocks, 1);
    let dup = batch(1, 0, 2);
    assert!(
        dup.duplicate && dup.stored_blocks == 0,
        "a redelivered sequence is skipped"
    );
    assert_eq!(batch(1, 1, 3).stored_blocks, 1, "ranks are independent");
    let gap = batch(5, 0, 4);
    assert_eq!(
        (gap.seq_gap, gap.stored_blocks),
        (3, 1),
        "a gap is counted and the batch applied"
    );
    fleet.lifecycle("w", LifecycleOp::Join);
    assert_eq!(
        fleet
            .ingest("w", Some(1), 0, vec![one_block(5, BLOCK, Medium::Gpu)])
            .stored_blocks,
        1,
        "a join starts the publisher sequence over"
    );
}

#[test]
fn namespaces_keep_models_and_loras_apart() {
    let mut fleet = Fleet::new();
    let out = fleet.apply(Input::KvEvents(KvEventBatch {
        worker: id("w"),
        model: Some("llama".into()),
        dp_rank: 0,
        seq: None,
        epoch: None,
        events: vec![KvEvent::Stored {
            parent: None,
            blocks: vec![StoredBlock {
                engine_hash: 1,
                local: 11,
            }],
            block_size: BLOCK,
            lora: Some("sql".into()),
            medium: Medium::Gpu,
            full_attention: true,
        }],
    }));
    assert!(matches!(out, Output::Ingested(_)));
    fleet.load("other", 0.0);
    let mut req = Fleet::request(&[11]);
    assert_eq!(
        fleet.route_req(req.clone()).decision,
        DecisionLabel::ColdMiss,
        "no model"
    );
    req.model = Some("llama".into());
    req.lora = Some("sql".into());
    let d = fleet.route_req(req);
    assert_eq!(
        decided(&d),
        ("w", DecisionLabel::OwnerHold),
        "same (model, lora)"
    );
    let rows = fleet.router.worker_rows(fleet.now);
    assert_eq!(rows[0].models.get("llama"), Some(&1));
}

#[test]
fn explain_lists_every_known_worker() {
    let mut fleet = Fleet::new();
    fleet.store("owner", &PROMPT);
    fleet.load("owner", 0.5);
    fleet.load("other", 0.2);
    let mut req = Fleet::request(&PROMPT);
    req.explain = true;
    let d = fleet.route_req(req);
    let rows = d.explain.expect("explain requested");
    let owner = rows.iter().find(|r| r.worker.as_str() == "owner").unwrap();
    assert_eq!(
        (owner.depth, owner.pressure, owner.telemetry_age_ms),
        (4, Some(0.5), Some(0))
    );
    assert_eq!(rows.len(), 2);
}

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
    let picks: Vec<String> = (0..4)
        .map(|_| rr.route(&PROMPT).worker.to_string())
        .collect();
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
    let picks: Vec<String> = (0..4)
        .map(|_| p2c.route(&PROMPT).worker.to_string())
        .collect();
    assert!(
        picks.iter().any(|w| w == "other"),
        "p2c balances reserved work, cache-blind: {picks:?}"
    );
}

/// A mixed input sequence exercising every kind of input.
fn scripted_inputs() -> Vec<Stamped> {
    let mut inputs = Vec::new();
    let mut seq = 0;
    let mut push = |at_ms: u64, input: Input| {
        seq += 1;
        inputs.push(Stamped { seq, at_ms, input });
    };
    let workers = ["w0", "w1", "w2", "w3", "w4"];
    for step in 0..400u64 {
        let t = 1_000 + step * 137;
        let w = workers[(step * 7 % 5) as usize];
        match step % 6 {
            0 => push(
                t,
                Input::Load(LoadSample {
                    worker: id(w),
                    kv_usage: ((step * 37) % 100) as f64 / 100.0,
                    running: (step % 9) as u32,
                    waiting: (step % 4) as u32,
                    max_running: Some(8),
                    model: None,
                    dp_rank: 0,
                }),
            ),
            1 | 2 => {
                let locals: Vec<u64> = (0..(step % 7 + 1)).map(|i| (step / 12) * 10 + i).collect();
                push(t, Input::Route(Fleet::request(&locals)));
            }
            3 => {
                let locals: Vec<u64> = (0..(step % 5 + 1)).map(|i| (step / 18) * 10 + i).collect();
                let keys = chain_locals(locals.iter().copied());
                push(
                    t,
                    Input::KvEvents(KvEventBatch::stored(
                        id(w),
                        None,
                        keys.iter()
                            .zip(&locals)
                            .map(|(&k, &local)| StoredBlock {
                                engine_hash: engine(k),
                                local,
                            })
                            .collect(),
                        BLOCK,
                    )),
                );
            }
            4 => push(
                t,
                Input::Release {
                    reservation: step.saturating_sub(5),
                    phase: None,
                },
            ),
            _ => push(t, Input::Tick),
        }
    }
    inputs
}

#[test]
fn applying_the_same_inputs_twice_yields_the_same_decisions_and_state() {
    let run = || {
        let mut router = Router::new(RouterConfig {
            block_size: BLOCK,
            ..RouterConfig::default()
        });
        let outputs: Vec<Output> = scripted_inputs().iter().map(|s| router.apply(s)).collect();
        let state = rmp_serde::to_vec(router.state()).unwrap();
        (outputs, state, router.ownerships())
    };
    let (out_a, state_a, own_a) = run();
    let (out_b, state_b, own_b) = run();
    let decisions = out_a
        .iter()
        .filter(|o| matches!(o, Output::Routed(_)))
        .count();
    assert!(decisions > 50, "the script makes decisions ({decisions})");
    assert_eq!(out_a, out_b, "same inputs, same outputs");
    assert_eq!(own_a, own_b, "same inputs, same ownership");
    assert_eq!(state_a, state_b, "same inputs, byte-identical state");
}

#[test]
fn state_survives_a_serialization_round_trip() {
    let inputs = scripted_inputs();
    let (head, tail) = inputs.split_at(200);
    let config = RouterConfig {
        block_size: BLOCK,
        ..RouterConfig::default()
    };
    let mut straight = Router::new(config.clone());
    let mut restored = Router::new(config.clone());
    for s in head {
        straight.apply(s);
        restored.apply(s);
    }
    let bytes = rmp_serde::to_vec(restored.state()).unwrap();
    let mut restored = Router::from_state(config, rmp_serde::from_slice(&bytes).unwrap());
    for s in tail {
        assert_eq!(
            straight.apply(s),
            restored.apply(s),
            "input {} after a snapshot",
            s.seq
        );
    }
}

// ------------------------------------------------------------------------------------------
// Fleet semantics of real engines: epochs, ranks, store counts, tiers, sticky leave, models
// ------------------------------------------------------------------------------------------

/// A `BlockStored` of the prompt made of `locals` (a fresh chain) on `medium`, engine hashes as
/// [`Fleet::store`] makes them.
fn chain_event(locals: &[u64], medium: Medium) -> KvEvent {
    let keys = chain_locals(locals.iter().copied());
    KvEvent::Stored {
        parent: None,
        blocks: keys
            .iter()
            .zip(locals)
            .map(|(&k, &local)| StoredBlock {
                engine_hash: engine(k),
                local,
            })
            .collect(),
        block_size: BLOCK,
        lora: None,
        medium,
        full_attention: true,
    }
}

/// A `BlockRemoved` of the blocks of the prompt made of `locals`.
fn removal(locals: &[u64], medium: Medium) -> KvEvent {
    KvEvent::Removed {
        engine_hashes: chain_locals(locals.iter().copied())
            .into_iter()
            .map(engine)
            .collect(),
        medium,
    }
}

/// Headers of a batch: (dp rank, Kv-Epoch, Kv-Seq).
type Headers<'a> = (u32, Option<&'a str>, Option<u64>);

impl Fleet {
    fn batch(&mut self, worker: &str, headers: Headers, events: Vec<KvEvent>) -> IngestReport {
        let (dp_rank, epoch, seq) = headers;
        match self.apply(Input::KvEvents(KvEventBatch {
            worker: id(worker),
            model: None,
            dp_rank,
            seq,
            epoch: epoch.map(str::to_owned),
            events,
        })) {
            Output::Ingested(report) => report,
            other => panic!("expected an ingest report, got {other:?}"),
        }
    }

    fn join(&mut self, msg: Lifecycle) -> IngestReport {
        match self.apply(Input::Lifecycle(msg)) {
            Output::Ingested(report) => report,
            other => panic!("expected an ingest report, got {other:?}"),
        }
    }

    fn load_rank(&mut self, worker: &str, dp_rank: u32, pressure: f64, model: Option<&str>) {
        self.apply(Input::Load(LoadSample {
            worker: id(worker),
            kv_usage: pressure,
            running: 1,
            waiting: 0,
            max_running: None,
            model: model.map(str::to_owned),
            dp_rank,
        }));
    }

    /// Whether `worker` (rank `dp_rank`) owns every block of the prompt made of `locals`.
    fn owns_prompt(&self, worker: &str, dp_rank: u32, locals: &[u64]) -> bool {
        chain_locals(locals.iter().copied())
            .into_iter()
            .all(|k| self.router.rank_owns(&id(worker), dp_rank, None, None, k))
    }
}

fn lifecycle(worker: &str, op: LifecycleOp) -> Lifecycle {
    Lifecycle {
        worker: id(worker),
        op,
        model: None,
        block_size: None,
        capacity_blocks: None,
        dp_size: None,
        epoch: None,
    }
}

#[test]
fn a_new_epoch_restarts_the_sequence_and_drops_the_ranks_old_blocks() {
    let mut fleet = Fleet::new();
    for seq in 1..=5 {
        fleet.batch("w", (0, Some("a"), Some(seq)), vec![]);
    }
    fleet.batch(
        "w",
        (0, Some("a"), Some(6)),
        vec![chain_event(&PROMPT, Medium::Gpu)],
    );
    assert!(fleet.owns_prompt("w", 0, &PROMPT));
    // The engine restarted: its sequence is back at 0 under a new epoch.
    let report = fleet.batch(
        "w",
        (0, Some("b"), Some(0)),
        vec![chain_event(&[7, 8], Medium::Gpu)],
    );
    assert!(
        report.new_epoch && !report.duplicate && report.stored_blocks == 2,
        "a restarted engine's first batch is applied, not skipped as a duplicate: {report:?}"
    );
    assert!(
        !fleet.owns_prompt("w", 0, &PROMPT[..1]),
        "the restarted (empty) engine no longer owns what it held before"
    );
    assert!(fleet.owns_prompt("w", 0, &[7, 8]));
    assert!(
        fleet.batch("w", (0, Some("b"), Some(0)), vec![]).duplicate,
        "within the new epoch, sequences de-duplicate again"
    );
    let late = fleet.batch(
        "w",
        (0, Some("a"), Some(7)),
        vec![chain_event(&[9], Medium::Gpu)],
    );
    assert!(
        late.duplicate && !late.new_epoch && fleet.owns_prompt("w", 0, &[7, 8]),
        "a late batch of the retired epoch is skipped, never taken for another restart"
    );
}

#[test]
fn a_join_clears_the_worker_unless_it_carries_the_epoch_its_ranks_already_have() {
    let mut fleet = Fleet::new();
    fleet.batch(
        "w",
        (0, Some("e1"), Some(3)),
        vec![chain_event(&PROMPT, Medium::Gpu)],
    );
    let mut again = lifecycle("w", LifecycleOp::Join);
    again.epoch = Some("e1".into());
    let report = fleet.join(again);
    assert_eq!(report.cleared_blocks, 0);
    assert!(
        fleet.owns_prompt("w", 0, &PROMPT),
        "a re-announcement with the running epoch clears nothing"
    );
    assert!(
        fleet.batch("w", (0, Some("e1"), Some(3)), vec![]).duplicate,
        "a re-announcement keeps the rank's sequence: a redelivered batch stays a duplicate"
    );
    fleet.join(lifecycle("w", LifecycleOp::Join));
    assert!(
        !fleet.owns_prompt("w", 0, &PROMPT[..1]),
        "a join without an epoch is a new process: the old blocks are no longer owned"
    );
    fleet.store("v", &PROMPT);
    let mut new_epoch = lifecycle("v", LifecycleOp::Join);
    new_epoch.epoch = Some("e9".into());
    fleet.join(new_epoch);
    assert!(
        !fleet.owns_prompt("v", 0, &PROMPT[..1]),
        "a join with another epoch clears the worker"
    );
}

#[test]
fn a_sequence_jump_beyond_the_bound_is_rejected_and_does_not_advance_across_a_restart() {
    let mut fleet = Fleet::new();
    fleet.batch("w", (0, None, Some(10)), vec![]);
    let poisoned = fleet.batch(
        "w",
        (0, None, Some(u64::MAX)),
        vec![chain_event(&[1], Medium::Gpu)],
    );
    assert_eq!(
        poisoned
            .rejections
            .iter()
            .map(|r| r.reason)
            .collect::<Vec<_>>(),
        vec![RejectReason::SeqJump],
        "a jump of more than {MAX_SEQ_JUMP} is rejected and counted"
    );
    assert!(
        !fleet.owns_prompt("w", 0, &[1]),
        "the poisoned batch is not applied"
    );
    assert!(
        fleet
            .batch("w", (0, None, Some(10 + MAX_SEQ_JUMP + 1)), vec![])
            .rejections
            .len()
            == 1,
        "one past the bound is rejected too"
    );
    // A snapshot and restart in between: the sequence is still the real one.
    let bytes = rmp_serde::to_vec(fleet.router.state()).unwrap();
    fleet.router = Router::from_state(
        fleet.router.config().clone(),
        rmp_serde::from_slice(&bytes).unwrap(),
    );
    let real = fleet.batch(
        "w",
        (0, None, Some(11)),
        vec![chain_event(&[2], Medium::Gpu)],
    );
    assert!(
        !real.duplicate && real.rejections.is_empty() && real.stored_blocks == 1,
        "the next real batch is applied after a restart: {real:?}"
    );
    assert!(
        fleet
            .batch("w", (0, None, Some(11 + MAX_SEQ_JUMP)), vec![])
            .rejections
            .is_empty(),
        "a jump of exactly the bound is believed"
    );
}

#[test]
fn ranks_are_candidates_of_their_own_and_one_ranks_clear_leaves_the_others_blocks() {
    let mut fleet = Fleet::new();
    fleet.batch(
        "w",
        (0, None, None),
        vec![chain_event(&[1, 2], Medium::Gpu)],
    );
    fleet.batch(
        "w",
        (1, None, None),
        vec![chain_event(&PROMPT, Medium::Gpu)],
    );
    fleet.load_rank("w", 0, 0.1, None);
    fleet.load_rank("w", 1, 0.2, None);
    let d = fleet.route(&PROMPT);
    assert_eq!(
        (d.worker.as_str(), d.dp_rank, d.decision, d.matched_blocks),
        ("w", Some(1), DecisionLabel::OwnerHold, 4),
        "the rank that holds the prompt is chosen and named"
    );
    assert_eq!(d.owners, vec![id("w")], "owners are listed by worker");
    let report = fleet.batch("w", (0, None, None), vec![KvEvent::Cleared]);
    assert_eq!(report.cleared, 1);
    assert!(
        fleet.owns_prompt("w", 1, &PROMPT),
        "AllBlocksCleared of rank 0 leaves rank 1's blocks"
    );
    assert!(!fleet.owns_prompt("w", 0, &[1]), "rank 0 is cleared");
    let rows = fleet.router.worker_rows(fleet.now);
    assert_eq!(rows.len(), 1, "one row per worker, whatever its ranks");
    assert_eq!(rows[0].blocks, 4, "blocks summed over ranks");
    assert!(
        rows[0].reserved_work > 0 && rows[0].pressure == Some(0.2),
        "reserved work summed, pressure the highest rank's: {:?}",
        rows[0]
    );
    let mut join = lifecycle("w", LifecycleOp::Join);
    join.dp_size = Some(3);
    fleet.join(join.clone());
    let ranks = |fleet: &Fleet| {
        let w = id("w");
        let workers = &fleet.router.state.workers;
        let mut r: Vec<u32> = workers
            .slots_of(&w)
            .map(|s| workers.get(s).unwrap().dp_rank)
            .collect();
        r.sort();
        r
    };
    assert_eq!(
        ranks(&fleet),
        [0, 1, 2],
        "a join declares every rank a candidate"
    );
    join.dp_size = Some(1);
    fleet.join(join);
    assert_eq!(
        ranks(&fleet),
        [0],
        "a join with fewer ranks drops the others"
    );
    fleet.store("single", &[5, 6]);
    let d = fleet.route(&[5, 6]);
    assert_eq!(
        (d.worker.as_str(), d.dp_rank),
        ("single", None),
        "a worker with one rank is not named by rank"
    );
}

#[test]
fn a_ranks_own_load_and_reserved_work_decide_between_ranks() {
    let mut fleet = Fleet::new();
    for rank in 0..2 {
        fleet.batch(
            "w",
            (rank, None, None),
            vec![chain_event(&PROMPT, Medium::Gpu)],
        );
    }
    fleet.load_rank("w", 0, 0.95, None);
    fleet.load_rank("w", 1, 0.30, None);
    let d = fleet.route(&PROMPT);
    assert_eq!(
        (d.dp_rank, d.decision),
        (Some(1), DecisionLabel::OwnerHold),
        "the unpressured rank holds"
    );
    let slot = |rank| fleet.router.state.workers.slot_of(&id("w"), rank).unwrap();
    let reserved = |rank| {
        fleet
            .router
            .state
            .workers
            .get(slot(rank))
            .unwrap()
            .reserved_work
    };
    assert!(
        reserved(1) > 0 && reserved(0) == 0,
        "work is reserved on the chosen rank only"
    );
}

#[test]
fn a_block_stored_twice_needs_two_removals_before_routes_stop_holding_on_it() {
    let mut fleet = Fleet::new();
    fleet.batch(
        "w",
        (0, None, None),
        vec![chain_event(&PROMPT, Medium::Gpu)],
    );
    fleet.batch(
        "w",
        (0, None, None),
        vec![chain_event(&PROMPT, Medium::Gpu)],
    );
    let first = fleet.batch("w", (0, None, None), vec![removal(&PROMPT, Medium::Gpu)]);
    assert_eq!(first.removed_blocks, 0, "one copy is still stored");
    assert!(fleet.owns_prompt("w", 0, &PROMPT));
    let second = fleet.batch("w", (0, None, None), vec![removal(&PROMPT, Medium::Gpu)]);
    assert_eq!(second.removed_blocks, 4);
    assert!(!fleet.owns_prompt("w", 0, &PROMPT[..1]));
}

#[test]
fn a_store_with_an_unknown_parent_is_counted_and_keyed_as_a_chain_start() {
    let mut fleet = Fleet::new();
    let mut event = chain_event(&[3, 4], Medium::Gpu);
    if let KvEvent::Stored { parent, .. } = &mut event {
        *parent = Some(0xDEAD);
    }
    let report = fleet.batch("w", (0, None, None), vec![event]);
    assert_eq!(
        report.orphan_blocks, 2,
        "both blocks of the orphan store are counted"
    );
    assert!(
        fleet.owns_prompt("w", 0, &[3, 4]),
        "the blocks are keyed from the start of a chain"
    );
    let known = fleet.batch("w", (0, None, None), vec![chain_event(&[5], Medium::Gpu)]);
    assert_eq!(
        known.orphan_blocks, 0,
        "a store without a parent is no orphan"
    );
}

#[test]
fn lower_tier_blocks_are_tracked_apart_and_cleared_with_the_rank() {
    let mut fleet = Fleet::new();
    let keys = chain_locals(PROMPT);
    let depth = |fleet: &Fleet| {
        fleet
            .router
            .lower_tier_depth(&id("w"), 0, None, None, &keys)
    };
    fleet.batch(
        "w",
        (0, None, None),
        vec![chain_event(&PROMPT, Medium::Host)],
    );
    fleet.batch(
        "w",
        (0, None, None),
        vec![chain_event(&PROMPT[..2], Medium::Disk)],
    );
    assert_eq!(depth(&fleet), TierDepths { host: 4, disk: 2 });
    assert!(
        !fleet.owns_prompt("w", 0, &PROMPT[..1]),
        "a lower tier is never device ownership"
    );
    fleet.load("other", 0.1);
    let d = fleet.route(&PROMPT);
    assert_ne!(
        d.decision,
        DecisionLabel::OwnerHold,
        "lower-tier blocks make no device owner"
    );
    let removed = fleet.batch(
        "w",
        (0, None, None),
        vec![removal(&PROMPT[..2], Medium::Disk)],
    );
    assert_eq!(removed.lower_tier_removed, 2);
    assert_eq!(depth(&fleet), TierDepths { host: 4, disk: 0 });
    fleet.batch("w", (0, None, None), vec![KvEvent::Cleared]);
    assert_eq!(
        depth(&fleet),
        TierDepths::default(),
        "a clear drops the lower tiers"
    );
    fleet.batch(
        "w",
        (0, Some("a"), None),
        vec![chain_event(&PROMPT, Medium::Host)],
    );
    fleet.batch("w", (0, Some("b"), None), vec![]);
    assert_eq!(
        depth(&fleet),
        TierDepths::default(),
        "a new epoch drops the lower tiers"
    );
}

#[test]
fn stores_of_groups_other_than_full_attention_are_counted_and_never_owned() {
    let mut fleet = Fleet::new();
    let mut event = chain_event(&PROMPT, Medium::Gpu);
    if let KvEvent::Stored {
        full_attention,
        block_size,
        ..
    } = &mut event
    {
        *full_attention = false;
        *block_size = BLOCK * 2; // a sliding-window group may have its own block size
    }
    let report = fleet.batch("w", (0, None, None), vec![event]);
    assert_eq!(
        (
            report.ignored_blocks,
            report.stored_blocks,
            report.rejections.len()
        ),
        (4, 0, 0),
        "accepted, counted as ignored"
    );
    assert!(fleet.router.ownerships().is_empty());
}

#[test]
fn removals_and_clears_drop_the_routers_own_records_of_the_worker() {
    let mut fleet = Fleet::new();
    fleet.load("w", 0.1);
    fleet.load("x", 0.1);
    // `w` is routed the prompt: the router records that it will hold it.
    let routed = fleet.route_excluding(&PROMPT, &["x"]);
    assert_eq!(routed.worker.as_str(), "w");
    assert_eq!(
        fleet.route_excluding(&PROMPT, &["x"]).decision,
        DecisionLabel::OwnerHold,
        "the router's own record makes w the owner"
    );
    fleet.batch(
        "w",
        (0, None, None),
        vec![chain_event(&PROMPT, Medium::Gpu)],
    );
    fleet.batch("w", (0, None, None), vec![removal(&PROMPT, Medium::Gpu)]);
    let d = fleet.route_excluding(&PROMPT, &["x"]);
    assert_eq!(
        (d.worker.as_str(), d.decision, d.matched_blocks),
        ("w", DecisionLabel::ColdMiss, 0),
        "after the worker removed the blocks, the router's own record of them is gone"
    );
    // The cold miss recorded the prompt again.
    fleet.batch("w", (0, None, None), vec![KvEvent::Cleared]);
    let d = fleet.route_excluding(&PROMPT, &["x"]);
    assert_eq!(
        d.decision,
        DecisionLabel::ColdMiss,
        "after AllBlocksCleared, no record of the worker remains"
    );
    fleet.join(lifecycle("w", LifecycleOp::Join));
    assert_eq!(
        fleet.route_excluding(&PROMPT, &["x"]).decision,
        DecisionLabel::ColdMiss,
        "a join drops the router's records of the worker"
    );
}

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
    assert_eq!(first_token, Output::Released { found: true });
    assert_eq!(
        (fleet.reserved("a"), reserved_prefill(&fleet, "a")),
        (12 + 100, 0),
        "the first token gives back the prefill part only"
    );
    let done = fleet.apply(Input::Release {
        reservation: d.reservation,
        phase: None,
    });
    assert_eq!(done, Output::Released { found: true });
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
        Output::Released { found: false }
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
fn a_leave_is_sticky_until_the_next_join_or_worker_ttl() {
    let mut fleet = Fleet::with(|c| c.worker_ttl_ms = 60_000);
    fleet.store("w", &PROMPT);
    fleet.join(lifecycle("w", LifecycleOp::Leave));
    fleet.load("w", 0.1);
    let report = fleet.batch(
        "w",
        (0, None, None),
        vec![chain_event(&PROMPT, Medium::Gpu)],
    );
    assert!(
        report.departed,
        "a late event of a departed worker is marked as such"
    );
    fleet.join(lifecycle("w", LifecycleOp::Drain));
    assert!(
        fleet.router.worker_rows(fleet.now).is_empty(),
        "late load samples, events or drains do not bring a departed worker back"
    );
    assert!(fleet.router.ownerships().is_empty());
    fleet.join(lifecycle("w", LifecycleOp::Join));
    assert_eq!(
        fleet.router.worker_rows(fleet.now).len(),
        1,
        "a join brings it back"
    );
    fleet.join(lifecycle("w", LifecycleOp::Leave));
    fleet.advance(60_000);
    fleet.apply(Input::Tick);
    fleet.load("w", 0.1);
    assert_eq!(
        fleet.router.worker_rows(fleet.now).len(),
        1,
        "after worker_ttl a departed id may come back"
    );
}

#[test]
fn departed_ids_are_remembered_within_a_bound() {
    let mut workers = crate::workers::Workers::default();
    for i in 0..crate::workers::MAX_DEPARTED + 10 {
        workers.depart(&id(&format!("w{i}")), 1);
    }
    assert_eq!(workers.departed_len(), crate::workers::MAX_DEPARTED);
    assert!(
        !workers.is_departed(&id("w0"), 2, 60_000),
        "the oldest departure is forgotten first"
    );
    assert!(workers.is_departed(&id("w20"), 2, 60_000));
}

#[test]
fn a_lifecycle_with_a_bad_block_size_has_the_field_rejected_and_its_op_applied() {
    let mut fleet = Fleet::new();
    fleet.store("w", &PROMPT);
    let mut drain = lifecycle("w", LifecycleOp::Drain);
    drain.block_size = Some(BLOCK + 1);
    let report = fleet.join(drain);
    assert_eq!(
        report
            .rejections
            .iter()
            .map(|r| r.reason)
            .collect::<Vec<_>>(),
        vec![RejectReason::BlockSizeMismatch]
    );
    assert_eq!(
        fleet.router.worker_rows(fleet.now)[0].state,
        WorkerState::Draining,
        "the drain is applied despite the bad field"
    );
}

#[test]
fn events_before_the_worker_declares_its_model_count_for_that_model() {
    let mut fleet = Fleet::new();
    fleet.store("w", &PROMPT);
    fleet.load("x", 0.1);
    fleet.load_rank("w", 0, 0.1, Some("llama"));
    let mut req = Fleet::request(&PROMPT);
    req.model = Some("llama".into());
    let d = fleet.route_req(req);
    assert_eq!(
        (d.worker.as_str(), d.decision, d.matched_blocks),
        ("w", DecisionLabel::OwnerHold, 4),
        "blocks filed before the model was declared are found by routes naming it"
    );
    assert!(fleet
        .router
        .owns(&id("w"), Some("llama"), None, chain_locals(PROMPT)[3]));
    assert_eq!(
        fleet.router.worker_rows(fleet.now)[0]
            .models
            .keys()
            .collect::<Vec<_>>(),
        ["llama"]
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

#[test]
fn a_spill_reports_the_chosen_workers_depth_not_the_owners() {
    let mut fleet = Fleet::new();
    fleet.store("owner", &PROMPT);
    fleet.load("owner", 0.95);
    fleet.load("cool", 0.10);
    let d = fleet.route(&PROMPT);
    assert_eq!(
        (d.worker.as_str(), d.decision, d.matched_blocks),
        ("cool", DecisionLabel::PressureSpill, 0),
        "a spill to a non-owner reuses nothing"
    );
    assert_eq!(d.owners, vec![id("owner")], "owners still names the owner");
}

#[test]
fn block_sizes_are_per_model_fixed_by_flag_or_declared_by_a_join() {
    let mut fleet = Fleet::with(|c| {
        c.model_block_sizes.insert("fixed".into(), BLOCK * 2);
    });
    let sized = |model: &str, size: u32| {
        let mut event = chain_event(&[1], Medium::Gpu);
        if let KvEvent::Stored { block_size, .. } = &mut event {
            *block_size = size;
        }
        Input::KvEvents(KvEventBatch {
            worker: id("w"),
            model: Some(model.into()),
            dp_rank: 0,
            seq: None,
            epoch: None,
            events: vec![event],
        })
    };
    let rejected = |out: Output| match out {
        Output::Ingested(r) => r.rejections.iter().map(|r| r.reason).collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        rejected(fleet.apply(sized("fixed", BLOCK))),
        vec![RejectReason::BlockSizeMismatch],
        "the default size is wrong for a model with a fixed size"
    );
    assert!(rejected(fleet.apply(sized("fixed", BLOCK * 2))).is_empty());
    assert!(
        rejected(fleet.apply(sized("plain", BLOCK))).is_empty(),
        "--block-size is the default"
    );
    let mut join = lifecycle("a", LifecycleOp::Join);
    join.model = Some("declared".into());
    join.block_size = Some(BLOCK * 4);
    assert!(fleet.join(join.clone()).rejections.is_empty());
    assert!(
        rejected(fleet.apply(sized("declared", BLOCK * 4))).is_empty(),
        "a join declares its model's block size"
    );
    assert_eq!(
        rejected(fleet.apply(sized("declared", BLOCK))),
        vec![RejectReason::BlockSizeMismatch]
    );
    let mut other = join.clone();
    other.worker = id("b");
    other.block_size = Some(BLOCK);
    assert_eq!(
        fleet
            .join(other)
            .rejections
            .iter()
            .map(|r| r.reason)
            .collect::<Vec<_>>(),
        vec![RejectReason::BlockSizeMismatch],
        "a live worker's declaration is not overridden by another's"
    );
    let mut fixed = lifecycle("c", LifecycleOp::Join);
    fixed.model = Some("fixed".into());
    fixed.block_size = Some(BLOCK);
    assert_eq!(
        fleet.join(fixed).rejections.len(),
        1,
        "a flag-fixed size cannot be changed"
    );
    assert_eq!(fleet.router.block_size_of(Some("fixed")), BLOCK * 2);
}

#[test]
fn matched_blocks_is_the_chosen_workers_own_depth_so_a_spill_claims_no_reuse() {
    let mut fleet = Fleet::new();
    fleet.store("owner", &PROMPT);
    fleet.load("owner", 0.95);
    fleet.load("home", 0.1);
    let d = fleet.route(&PROMPT);
    assert_eq!(decided(&d), ("home", DecisionLabel::PressureSpill));
    assert_eq!(d.matched_blocks, 0, "home holds none of the prompt");
    assert_eq!(
        d.owners,
        vec![id("owner")],
        "owners still name the deep owner"
    );
}
