//! Fleet semantics of real engines: epochs, ranks, store counts, tiers, ignored groups, the
//! router's records, sticky leave, lifecycle fields, undeclared models, block sizes.

use super::*;

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
fn owners_are_listed_in_id_order_once_per_worker_whatever_order_they_joined_in() {
    // Joined in an order unlike the ids' (slots follow joins); "m" holds the prompt on two
    // ranks; "a-late" joins last but sorts first, and a leave in between reuses a slot.
    let mut fleet = Fleet::new();
    for worker in ["z", "m", "gone", "b"] {
        fleet.store(worker, &PROMPT);
    }
    fleet.batch(
        "m",
        (1, None, None),
        vec![chain_event(&PROMPT, Medium::Gpu)],
    );
    fleet.lifecycle("gone", LifecycleOp::Leave);
    fleet.store("a-late", &PROMPT);
    let d = fleet.route(&PROMPT);
    assert_eq!(
        d.owners,
        vec![id("a-late"), id("b"), id("m"), id("z")],
        "owners are listed in id order, a worker with two owning ranks once"
    );
}

#[test]
fn hundreds_of_owners_are_listed_in_id_order_once_per_worker() {
    // 300 workers joining in a scrambled order, every third with a second owning rank: the
    // wide path of a decision (entries asked for ahead, owners sorted by a counting pass).
    let mut fleet = Fleet::new();
    let names: Vec<String> = (0..300u32)
        .map(|i| format!("w{}", (i * 7919) % 300))
        .collect();
    for (i, name) in names.iter().enumerate() {
        fleet.store(name, &PROMPT);
        if i % 3 == 0 {
            fleet.batch(
                name,
                (1, None, None),
                vec![chain_event(&PROMPT, Medium::Gpu)],
            );
        }
    }
    let mut expected: Vec<WorkerId> = names.iter().map(|n| id(n)).collect();
    expected.sort();
    let d = fleet.route(&PROMPT);
    assert_eq!(
        d.owners, expected,
        "300 owners are listed in id order, a worker with two owning ranks once"
    );
}

#[test]
fn wide_owner_lists_stay_in_id_order_as_ranks_join_leave_and_are_relabelled() {
    // Every rank holds the prompt, so every decision's owners are more than a 64th of the slots
    // and come out of the places in id order once those are built (after sixteen fleets' worth
    // of sorted owners). Between decisions, ranks join and leave, workers gain a second rank, and
    // ids crowd between two neighbours until every id is labelled afresh.
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let mut fleet = Fleet::new();
    let mut live: Vec<String> = Vec::new();
    let mut used = std::collections::HashSet::new();
    let fresh_id = |rng: &mut rand_chacha::ChaCha8Rng, used: &mut std::collections::HashSet<_>| loop {
        let name = format!("w{}", rng.random_range(0..100_000u32));
        if used.insert(name.clone()) {
            return name;
        }
    };
    for _ in 0..120 {
        let name = fresh_id(&mut rng, &mut used);
        fleet.store(&name, &PROMPT);
        live.push(name);
    }
    let (mut crowded, mut placed) = (String::from("w5"), 0);
    for round in 0..80 {
        match round % 4 {
            0 => {
                let name = live.swap_remove(rng.random_range(0..live.len()));
                fleet.lifecycle(&name, LifecycleOp::Leave);
            }
            1 => {
                let name = fresh_id(&mut rng, &mut used);
                fleet.store(&name, &PROMPT);
                live.push(name);
            }
            2 => {
                // "w5", "w50", "w500", ...: each sorts just above the one before it, halving
                // the gap to its upper neighbour.
                for _ in 0..4 {
                    crowded.push('0');
                    if used.insert(crowded.clone()) {
                        fleet.store(&crowded, &PROMPT);
                        live.push(crowded.clone());
                    }
                }
            }
            _ => {
                let name = &live[rng.random_range(0..live.len())];
                fleet.batch(
                    name,
                    (1, None, None),
                    vec![chain_event(&PROMPT, Medium::Gpu)],
                );
            }
        }
        // Enough decisions after each change for the places to be rebuilt.
        for _ in 0..20 {
            let d = fleet.route(&PROMPT);
            let mut expected: Vec<WorkerId> = live.iter().map(|n| id(n)).collect();
            expected.sort();
            assert_eq!(
                d.owners, expected,
                "round {round}: every live worker is listed once, in id order"
            );
            fleet.router.assert_route_rows_follow_workers();
            placed += usize::from(fleet.router.scratch.owner_places_current());
        }
    }
    assert!(
        placed > 100,
        "decisions put their owners in order by their places once rebuilt ({placed} of 1,600)"
    );
}
