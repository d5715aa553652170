//! Bounded state: `max_workers`, `max_models`, dp ranks, and slots that are freed and reused
//! when workers leave or age out.

use super::*;

impl Fleet {
    fn load_report(&mut self, worker: &str, dp_rank: u32, model: Option<&str>) -> IngestReport {
        match self.apply(Input::Load(LoadSample {
            worker: id(worker),
            kv_usage: 0.1,
            running: 1,
            waiting: 0,
            max_running: None,
            model: model.map(str::to_owned),
            dp_rank,
        })) {
            Output::Ingested(report) => report,
            other => panic!("expected an ingest report, got {other:?}"),
        }
    }

    fn known(&self, worker: &str) -> bool {
        self.router.state.workers.is_known(&id(worker))
    }

    fn snapshot_bytes(&self) -> usize {
        rmp_serde::to_vec(self.router.state()).unwrap().len()
    }
}

fn reasons(report: &IngestReport) -> Vec<RejectReason> {
    report.rejections.iter().map(|r| r.reason).collect()
}

#[test]
fn a_new_worker_beyond_max_workers_is_rejected_and_known_workers_are_unaffected() {
    let mut fleet = Fleet::with(|c| c.max_workers = 2);
    fleet.load("w0", 0.1);
    fleet.load("w1", 0.1);
    let report = fleet.load_report("w2", 0, None);
    assert_eq!(
        reasons(&report),
        [RejectReason::WorkerLimit],
        "a load sample from a third worker is rejected"
    );
    let report = fleet.ingest("w3", None, 0, vec![chain_event(&PROMPT, Medium::Gpu)]);
    assert_eq!(
        reasons(&report),
        [RejectReason::WorkerLimit],
        "so is a KV batch"
    );
    let report = fleet.join(lifecycle("w4", LifecycleOp::Join));
    assert_eq!(reasons(&report), [RejectReason::WorkerLimit], "and a join");
    for w in ["w2", "w3", "w4"] {
        assert!(!fleet.known(w), "{w} was not created");
    }
    assert!(
        fleet.router.ownerships().is_empty(),
        "the rejected batch stored nothing"
    );
    // Known workers keep working: events, a second rank, routes.
    fleet.store("w0", &PROMPT);
    assert!(
        fleet.load_report("w1", 1, None).rejections.is_empty(),
        "a new rank of a known worker is not a new worker"
    );
    assert_eq!(
        decided(&fleet.route(&PROMPT)),
        ("w0", DecisionLabel::OwnerHold),
        "the known owner still gets its prefix"
    );
}

#[test]
fn a_worker_that_leaves_or_ages_out_frees_its_place_under_max_workers() {
    let mut fleet = Fleet::with(|c| c.max_workers = 1);
    fleet.load("w0", 0.1);
    fleet.lifecycle("w0", LifecycleOp::Leave);
    assert!(
        fleet.load_report("w1", 0, None).rejections.is_empty(),
        "a left worker's place is free"
    );
    let ttl = fleet.router.config().worker_ttl_ms;
    fleet.advance(ttl + 1);
    fleet.apply(Input::Tick);
    assert!(!fleet.known("w1"), "w1 aged out");
    assert!(
        fleet.load_report("w2", 0, None).rejections.is_empty(),
        "an aged-out worker's place is free"
    );
}

#[test]
fn slots_are_reused_and_the_state_shrinks_back_after_a_churn_of_workers() {
    let mut fleet = Fleet::new();
    fleet.load("keeper", 0.1);
    fleet.store("keeper", &PROMPT);
    let one_worker = fleet.snapshot_bytes();
    for i in 0..2_000 {
        fleet.load(&format!("churn-{i}"), 0.5);
    }
    assert_eq!(fleet.router.state.workers.slot_count(), 2_001);
    let ttl = fleet.router.config().worker_ttl_ms;
    fleet.advance(ttl + 1);
    fleet.load("keeper", 0.1);
    fleet.apply(Input::Tick);
    assert_eq!(
        fleet.router.state.workers.slot_count(),
        1,
        "the slots of aged-out workers are cut off the table"
    );
    let after = fleet.snapshot_bytes();
    assert!(
        after <= one_worker + 64,
        "a snapshot after the churn ({after} bytes) is the size of one with one live worker \
         ({one_worker} bytes)"
    );
    fleet.load("late", 0.1);
    assert_eq!(
        fleet.router.state.workers.slot_of(&id("late"), 0),
        Some(1),
        "a new worker takes the lowest free slot"
    );
}

#[test]
fn a_reused_slot_inherits_nothing_from_the_worker_that_held_it() {
    let mut fleet = Fleet::new();
    fleet.load("keeper", 0.1);
    fleet.load("old", 0.1);
    fleet.store("old", &PROMPT);
    fleet.ingest("old", None, 0, vec![chain_event(&[21, 22], Medium::Host)]);
    let d = fleet.route_excluding(&PROMPT, &["keeper"]);
    assert_eq!(decided(&d), ("old", DecisionLabel::OwnerHold));
    let old_slot = fleet.router.state.workers.slot_of(&id("old"), 0);
    fleet.lifecycle("old", LifecycleOp::Leave);
    fleet.load("new", 0.1);
    assert_eq!(
        fleet.router.state.workers.slot_of(&id("new"), 0),
        old_slot,
        "the new worker took the old one's slot"
    );
    assert_eq!(fleet.reserved("new"), 0, "no reserved work carried over");
    assert!(
        !fleet.owns_prompt("new", 0, &PROMPT),
        "no device ownership carried over"
    );
    let mut req = Fleet::request(&PROMPT);
    req.explain = true;
    let d = fleet.route_req(req);
    let row = d
        .explain
        .unwrap()
        .into_iter()
        .find(|r| r.worker.as_str() == "new")
        .unwrap();
    assert_eq!(
        (row.depth, row.host_depth),
        (0, 0),
        "no routing records or lower-tier blocks carried over"
    );
    assert_eq!(
        fleet
            .router
            .lower_tier_depth(&id("new"), 0, None, None, &chain_locals([21, 22])),
        TierDepths::default(),
        "no host-tier blocks carried over"
    );
}

#[test]
fn a_restored_router_allocates_freed_slots_like_the_one_that_wrote_it() {
    let mut fleet = Fleet::new();
    for w in ["w0", "w1", "w2", "w3"] {
        fleet.load(w, 0.1);
    }
    fleet.lifecycle("w1", LifecycleOp::Leave);
    fleet.lifecycle("w3", LifecycleOp::Leave);
    let bytes = rmp_serde::to_vec(fleet.router.state()).unwrap();
    let mut restored = Router::from_state(
        fleet.router.config().clone(),
        rmp_serde::from_slice(&bytes).unwrap(),
    );
    for w in ["w4", "w5", "w6"] {
        fleet.load(w, 0.2);
        let out = restored.apply(&Stamped {
            seq: fleet.seq,
            at_ms: fleet.now,
            input: Input::Load(LoadSample {
                worker: id(w),
                kv_usage: 0.2,
                running: 1,
                waiting: 0,
                max_running: None,
                model: None,
                dp_rank: 0,
            }),
        });
        assert!(matches!(out, Output::Ingested(_)));
        assert_eq!(
            restored.state.workers.slot_of(&id(w), 0),
            fleet.router.state.workers.slot_of(&id(w), 0),
            "{w} gets the same slot after a restore"
        );
    }
    assert_eq!(
        rmp_serde::to_vec(restored.state()).unwrap(),
        rmp_serde::to_vec(fleet.router.state()).unwrap(),
        "the same state, byte for byte"
    );
}

#[test]
fn a_dp_rank_beyond_the_rank_limit_is_rejected() {
    let mut fleet = Fleet::new();
    let report = fleet.load_report("w0", MAX_DP_SIZE, None);
    assert_eq!(reasons(&report), [RejectReason::InvalidField]);
    let report = fleet.ingest(
        "w0",
        None,
        u32::MAX,
        vec![chain_event(&PROMPT, Medium::Gpu)],
    );
    assert_eq!(reasons(&report), [RejectReason::InvalidField]);
    assert_eq!(
        fleet.router.state.workers.slot_count(),
        0,
        "no slot was created for an impossible rank"
    );
}

#[test]
fn a_new_namespace_beyond_max_models_is_rejected_and_known_models_keep_working() {
    let mut fleet = Fleet::with(|c| c.max_models = 2);
    let batch = |model: &str| KvEventBatch {
        worker: id("w0"),
        model: Some(model.to_owned()),
        dp_rank: 0,
        seq: None,
        epoch: None,
        events: vec![chain_event(&PROMPT, Medium::Gpu)],
    };
    for model in ["a", "b"] {
        let Output::Ingested(r) = fleet.apply(Input::KvEvents(batch(model))) else {
            panic!()
        };
        assert!(r.rejections.is_empty(), "model {model} fits");
    }
    let Output::Ingested(r) = fleet.apply(Input::KvEvents(batch("c"))) else {
        panic!()
    };
    assert_eq!(
        reasons(&r),
        [RejectReason::ModelLimit],
        "a third model is rejected"
    );
    assert_eq!(r.stored_blocks, 0, "and stores nothing");
    assert_eq!(fleet.router.state.namespaces.len(), 2);
    let key = *chain_locals(PROMPT).last().unwrap();
    assert!(
        fleet.router.owns(&id("w0"), Some("a"), None, key),
        "model a still holds its blocks"
    );
    let r = fleet.join(Lifecycle {
        model: Some("d".into()),
        block_size: Some(BLOCK),
        ..lifecycle("w1", LifecycleOp::Join)
    });
    assert!(
        r.rejections.is_empty(),
        "a join declaring a new model moves nothing, so needs no namespace: {r:?}"
    );
}

#[test]
fn declared_block_sizes_are_bounded_by_max_models() {
    let mut fleet = Fleet::with(|c| c.max_models = 2);
    for (i, model) in ["a", "b", "c"].into_iter().enumerate() {
        let r = fleet.join(Lifecycle {
            model: Some(model.into()),
            block_size: Some(8),
            ..lifecycle(&format!("w{i}"), LifecycleOp::Join)
        });
        let expected: &[RejectReason] = match model {
            "c" => &[RejectReason::ModelLimit],
            _ => &[],
        };
        assert_eq!(reasons(&r), expected, "model {model}");
    }
    assert_eq!(fleet.router.block_size_of(Some("b")), 8);
    assert_eq!(
        fleet.router.block_size_of(Some("c")),
        BLOCK,
        "the third model's size was not recorded"
    );
}

#[test]
fn routes_never_create_a_namespace_for_a_name_no_worker_announced() {
    let mut fleet = Fleet::new();
    fleet.load("w0", 0.1);
    for i in 0..100 {
        let mut req = Fleet::request(&PROMPT);
        req.model = Some(format!("typo-{i}"));
        fleet.route_req(req);
        let mut req = Fleet::request(&PROMPT);
        req.lora = Some(format!("adapter-{i}"));
        fleet.route_req(req);
    }
    assert_eq!(
        fleet.router.state.namespaces.len(),
        0,
        "200 routes naming unannounced models and LoRAs created no namespace"
    );
    // A model a worker declared is announced: its routes keep records for the next turn.
    fleet.load_rank("w1", 0, 0.1, Some("m"));
    let mut req = Fleet::request(&PROMPT);
    req.model = Some("m".into());
    req.exclude = vec![id("w0")];
    assert_eq!(fleet.route_req(req.clone()).worker.as_str(), "w1");
    assert_eq!(fleet.router.state.namespaces.len(), 1);
    assert_eq!(
        decided(&fleet.route_req(req)),
        ("w1", DecisionLabel::OwnerHold),
        "the announced model's route was recorded, so its next turn holds"
    );
}

fn value_of(bytes: &[u8]) -> rmpv::Value {
    rmpv::decode::read_value(&mut &bytes[..]).unwrap()
}

#[test]
fn settings_and_snapshots_written_before_the_caps_existed_still_decode() {
    // A journaled configuration of before: the same array without the two caps at its end.
    let config = RouterConfig::default();
    let rmpv::Value::Array(mut fields) = value_of(&rmp_serde::to_vec(&config).unwrap()) else {
        panic!("a configuration encodes as an array")
    };
    fields.truncate(fields.len() - 2);
    let mut old = Vec::new();
    rmpv::encode::write_value(&mut old, &rmpv::Value::Array(fields)).unwrap();
    let decoded: RouterConfig = rmp_serde::from_slice(&old).unwrap();
    assert_eq!(
        (decoded.max_workers, decoded.max_models),
        (DEFAULT_MAX_WORKERS, DEFAULT_MAX_MODELS),
        "an old configuration takes the default caps"
    );

    // A worker table of before lists the key of every slot ever allocated, removed ones too.
    let mut fleet = Fleet::new();
    fleet.load("w0", 0.1);
    fleet.load("w1", 0.1);
    fleet.lifecycle("w0", LifecycleOp::Leave);
    let rmpv::Value::Array(mut state) = value_of(&rmp_serde::to_vec(fleet.router.state()).unwrap())
    else {
        panic!("the state encodes as an array")
    };
    let rmpv::Value::Array(workers) = &mut state[0] else {
        panic!("the worker table encodes as an array")
    };
    let key = |w: &str| rmpv::Value::Array(vec![w.into(), 0.into()]);
    workers[1] = rmpv::Value::Array(vec![key("w0"), key("w1")]);
    let mut old = Vec::new();
    rmpv::encode::write_value(&mut old, &rmpv::Value::Array(state)).unwrap();
    let mut restored = Router::from_state(
        fleet.router.config().clone(),
        rmp_serde::from_slice(&old).unwrap(),
    );
    assert_eq!(restored.state.workers.slot_of(&id("w1"), 0), Some(1));
    assert_eq!(
        restored.state.workers.slot_of(&id("w0"), 0),
        None,
        "the removed worker stays removed"
    );
    restored.apply(&Stamped {
        seq: 100,
        at_ms: fleet.now,
        input: Input::Lifecycle(lifecycle("w2", LifecycleOp::Join)),
    });
    assert_eq!(
        restored.state.workers.slot_of(&id("w2"), 0),
        Some(0),
        "the removed worker's slot is free for a new one"
    );
}
