//! KV events, namespaces and explain rows as the policy sees them.

use super::*;

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
