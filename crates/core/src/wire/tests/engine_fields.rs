//! What the engines send today: the newer fields and batch forms, the `Kv-Epoch` header,
//! lifecycle fields rejected without dropping the op, and the caps on names.

use super::*;

// ------------------------------------------------------------------------------------------
// the engines' newer fields and batch forms
// ------------------------------------------------------------------------------------------

#[test]
fn sglangs_metadata_map_where_vllm_has_lora_name_is_ignored() {
    // SGLang's BlockStoredWithMetadata: [tag, hashes, parent, tokens, bs, lora_id, medium, {..}]
    let payload = array_batch_of(stored_array(
        Value::from(1),
        vec![
            Value::from(5),
            Value::from("GPU"),
            Value::Map(vec![(Value::from("cache_salt"), Value::from("tenant-a"))]),
        ],
    ));
    match only_event(decode_ok(&payload)) {
        KvEvent::Stored { lora, medium, .. } => assert_eq!(
            (lora.as_deref(), medium),
            (Some("5"), Medium::Gpu),
            "the metadata map is no LoRA name: lora_id stays the namespace"
        ),
        other => panic!("a store, got {other:?}"),
    }
}

#[test]
fn every_newer_engine_field_decodes_and_unknown_ones_are_ignored() {
    let map = mp(json!([1.5, [{
        "type": "BlockStored", "block_hashes": [9], "parent_block_hash": 8,
        "token_ids": [1, 2], "block_size": 2, "lora_id": 4, "medium": "GPU",
        "lora_name": "adapter", "extra_keys": [["salt", ["mm", 0]]], "group_idx": 0,
        "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": null,
        "locality": "REMOTE", "ownership": "kvcr", "session_id": "s",
        "lookahead_token_ids": [[3, 4]], "cache_salt": "salt", "mm_keys": [[[1, 2], 0]],
        "from_the_future": {"nested": [1, {"deeper": true}]}
    }], 3]));
    let batch = decode_ok(&map);
    assert_eq!(batch.dp_rank, 3, "the batch's rank");
    assert_eq!(
        only_event(batch),
        KvEvent::Stored {
            parent: Some(8),
            blocks: vec![StoredBlock {
                engine_hash: 9,
                local: local_hash(&[1, 2])
            }],
            block_size: 2,
            lora: Some("adapter".into()),
            medium: Medium::Gpu,
            full_attention: true,
        },
        "the newer fields neither reject the store nor change it"
    );
    let removed = mp(json!([1.5, [{
        "type": "BlockRemoved", "block_hashes": [9], "medium": "GPU", "group_idx": 2,
        "locality": "LOCAL", "ownership": "x", "future": 1
    }]]));
    assert_eq!(
        only_event(decode_ok(&removed)),
        KvEvent::Removed {
            engine_hashes: vec![9],
            medium: Medium::Gpu
        },
        "a removal's newer fields are ignored"
    );
}

#[test]
fn the_current_engines_tagged_map_events_take_the_single_pass_decoder() {
    let payload = mp(json!([1.5, [
        {"type": "BlockStored", "block_hashes": [9, -2], "parent_block_hash": 8,
         "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": 4, "medium": "CPU_PINNED",
         "lora_name": "adapter", "extra_keys": [["s"], null], "group_idx": 1,
         "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 128,
         "session_id": "s", "cache_salt": "x", "mm_keys": [[[0, 1], 0]]},
        {"type": "BlockRemoved", "block_hashes": [9], "medium": "DISK", "group_idx": 1},
        {"type": "AllBlocksCleared"}
    ], 2]));
    let fast = decode_vllm_array(&payload).expect("tagged-map events take the fast path");
    assert_eq!(
        fast,
        (
            Some(2),
            vec![
                KvEvent::Stored {
                    parent: Some(8),
                    blocks: vec![
                        StoredBlock {
                            engine_hash: 9,
                            local: local_hash(&[1, 2])
                        },
                        StoredBlock {
                            engine_hash: -2i64 as u64,
                            local: local_hash(&[3, 4])
                        },
                    ],
                    block_size: 2,
                    lora: Some("adapter".into()),
                    medium: Medium::Host,
                    full_attention: false,
                },
                KvEvent::Removed {
                    engine_hashes: vec![9],
                    medium: Medium::Disk
                },
                KvEvent::Cleared,
            ]
        ),
        "every field read as the tolerant decoder reads it"
    );
    assert_eq!(
        decode_tolerant(&payload).ok(),
        Some(fast),
        "both paths agree"
    );
    // [1.5, [{"type": "Oops", "type": "AllBlocksCleared"}]]
    let mut twice = vec![0x92, 0xcb];
    twice.extend(1.5f64.to_be_bytes());
    twice.extend([0x91, 0x82, 0xa4]);
    twice.extend(b"type");
    twice.extend([0xa4]);
    twice.extend(b"Oops");
    twice.extend([0xa4]);
    twice.extend(b"type");
    twice.extend([0xb0]);
    twice.extend(b"AllBlocksCleared");
    assert!(
        decode_vllm_array(&twice).is_none(),
        "a repeated key is left to the tolerant decoder"
    );
    assert_eq!(
        decode(&twice).map(|b| b.events),
        Ok(vec![KvEvent::Cleared]),
        "which takes the last value"
    );
}

#[test]
fn every_batch_form_decodes_with_its_rank() {
    let cleared = json!([{"type": "AllBlocksCleared"}]);
    let cases = [
        (json!([1.5, cleared]), 0),
        (json!([1.5, cleared, 2]), 2),
        (json!([1.5, cleared, null]), 0),
        (json!([1.5, cleared, 2, "a future element"]), 2),
        (
            json!({"ts": 1.5, "events": cleared, "data_parallel_rank": 3}),
            3,
        ),
        (json!({"ts": 1.5, "events": cleared, "attn_dp_rank": 4}), 4),
        (json!({"events": cleared}), 0),
    ];
    for (batch, rank) in cases {
        let decoded = decode_ok(&mp(batch.clone()));
        assert_eq!(
            (decoded.dp_rank, decoded.events),
            (rank, vec![KvEvent::Cleared]),
            "{batch} decodes with rank {rank}"
        );
    }
}

#[test]
fn a_batch_ts_that_is_not_finite_is_invalid_field() {
    for ts in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        for payload in [
            mpv(&Value::Array(vec![
                Value::F64(ts),
                Value::Array(vec![]),
                Value::Nil,
            ])),
            mpv(&Value::Array(vec![
                Value::F32(ts as f32),
                Value::Array(vec![]),
            ])),
            mpv(&Value::Map(vec![
                (Value::from("ts"), Value::F64(ts)),
                (Value::from("events"), Value::Array(vec![])),
            ])),
        ] {
            let r = reject_reason(&payload);
            assert_eq!(r.reason, RejectReason::InvalidField, "ts {ts} is no time");
            assert!(r.detail.contains("ts"), "the detail names ts: {}", r.detail);
        }
    }
}

// ------------------------------------------------------------------------------------------
// Kv-Epoch
// ------------------------------------------------------------------------------------------

#[test]
fn kv_epoch_header_is_parsed_and_carried_into_the_batch() {
    let headers = parse_kv_headers(Some("7"), None, None, Some(" 3f2a-9c:restart#2 ")).unwrap();
    assert_eq!(
        headers.epoch.as_deref(),
        Some("3f2a-9c:restart#2"),
        "the epoch, trimmed"
    );
    let long = "e".repeat(MAX_EPOCH_LEN);
    assert_eq!(
        parse_kv_headers(None, None, None, Some(&long))
            .unwrap()
            .epoch
            .as_deref(),
        Some(long.as_str()),
        "64 characters are accepted"
    );
    let batch = decode_kv_batch(&mp(json!([1.5, []])), worker(), headers).unwrap();
    assert_eq!(
        (batch.epoch.as_deref(), batch.seq),
        (Some("3f2a-9c:restart#2"), Some(7)),
        "the batch carries its epoch and sequence"
    );
    assert_eq!(
        parse_kv_headers(None, None, None, None).unwrap().epoch,
        None,
        "no header, no epoch"
    );
}

#[test]
fn an_unreadable_kv_epoch_is_invalid_header() {
    let too_long = "e".repeat(MAX_EPOCH_LEN + 1);
    for bad in [
        "",
        "   ",
        "engine 2",
        "tab\there",
        "é",
        "nul\0",
        too_long.as_str(),
    ] {
        let r = parse_kv_headers(None, None, None, Some(bad)).unwrap_err();
        assert_eq!(
            r.reason,
            RejectReason::InvalidHeader,
            "Kv-Epoch {bad:?} is not 1 to 64 printable ASCII characters without spaces"
        );
        assert!(r.detail.starts_with("Kv-Epoch"), "{}", r.detail);
    }
}

// ------------------------------------------------------------------------------------------
// lifecycle
// ------------------------------------------------------------------------------------------

#[test]
fn a_drain_with_a_wrong_typed_block_size_still_drains() {
    let (l, rejected) = decode_lifecycle(
        &mp(json!({"op": "drain", "block_size": "16", "model": "m"})),
        worker(),
    )
    .expect("a bad field does not drop the op");
    assert_eq!(
        (l.op, l.block_size, l.model.as_deref()),
        (LifecycleOp::Drain, None, Some("m")),
        "the op and the good fields are kept, the bad field left out"
    );
    assert_eq!(rejected.len(), 1, "the bad field is rejected: {rejected:?}");
    assert_eq!(rejected[0].reason, RejectReason::InvalidField);
    assert!(
        rejected[0].detail.contains("Lifecycle.block_size"),
        "the rejection names the field: {}",
        rejected[0].detail
    );
}

#[test]
fn lifecycle_dp_size_and_epoch_decode() {
    let (l, rejected) = decode_lifecycle(
        &mp(
            json!({"op": "join", "model": "m", "block_size": 16, "dp_size": 4,
                   "epoch": "a1b2c3", "capacity_blocks": 1000}),
        ),
        worker(),
    )
    .unwrap();
    assert!(rejected.is_empty(), "nothing rejected: {rejected:?}");
    assert_eq!(
        (l.dp_size, l.epoch.as_deref()),
        (Some(4), Some("a1b2c3")),
        "dp_size and epoch"
    );
    let (l, _) = decode_lifecycle(&mp(json!({"op": "leave"})), worker()).unwrap();
    assert_eq!((l.dp_size, l.epoch), (None, None), "both are optional");
}

#[test]
fn an_encoded_lifecycle_message_round_trips_every_field() {
    let message = LifecycleMessage {
        op: LifecycleOp::Join,
        model: Some("m"),
        block_size: Some(16),
        capacity_blocks: Some(4096),
        dp_size: Some(2),
        epoch: Some("boot-7"),
    };
    let (l, rejected) = decode_lifecycle(&encode_lifecycle_message(&message), worker()).unwrap();
    assert!(rejected.is_empty(), "nothing rejected: {rejected:?}");
    assert_eq!(
        (
            l.op,
            l.model.as_deref(),
            l.block_size,
            l.capacity_blocks,
            l.dp_size,
            l.epoch.as_deref()
        ),
        (
            LifecycleOp::Join,
            Some("m"),
            Some(16),
            Some(4096),
            Some(2),
            Some("boot-7")
        ),
        "every field round-trips"
    );
    assert_eq!(
        encode_lifecycle(LifecycleOp::Leave, None, Some(16), None),
        encode_lifecycle_message(&LifecycleMessage {
            block_size: Some(16),
            ..LifecycleMessage::new(LifecycleOp::Leave)
        }),
        "the short form writes the same bytes"
    );
}

#[test]
fn every_bad_lifecycle_field_is_rejected_on_its_own_and_the_op_kept() {
    let too_long = "m".repeat(257);
    let bad = json!({
        "op": "leave",
        "model": too_long,
        "block_size": 0,
        "capacity_blocks": -5,
        "dp_size": "two",
        "epoch": "has space",
    });
    let (l, rejected) = decode_lifecycle(&mp(bad), worker()).unwrap();
    assert_eq!(l.op, LifecycleOp::Leave, "the leave is kept");
    assert_eq!(
        (l.model, l.block_size, l.capacity_blocks, l.dp_size, l.epoch),
        (None, None, None, None, None),
        "every bad field is left out"
    );
    let mut fields: Vec<&str> = rejected
        .iter()
        .inspect(|r| assert_eq!(r.reason, RejectReason::InvalidField, "{}", r.detail))
        .map(|r| {
            r.detail
                .trim_start_matches("Lifecycle.")
                .split(':')
                .next()
                .unwrap()
        })
        .collect();
    fields.sort();
    assert_eq!(
        fields,
        ["block_size", "capacity_blocks", "dp_size", "epoch", "model"],
        "one rejection per bad field"
    );
    for whole in [
        json!({"op": "drain", "dp_size": 0}),
        json!({"op": "join", "epoch": ""}),
    ] {
        let (_, rejected) = decode_lifecycle(&mp(whole.clone()), worker()).unwrap();
        assert_eq!(rejected.len(), 1, "{whole}: the field is out of range");
    }
}

// ------------------------------------------------------------------------------------------
// caps
// ------------------------------------------------------------------------------------------

#[test]
fn names_the_core_keeps_are_capped_at_256_bytes() {
    let name = |len: usize| "n".repeat(len);
    let store = |lora: &str| {
        array_batch_of(stored_array(
            Value::from(1),
            vec![Value::Nil, Value::Nil, Value::from(lora)],
        ))
    };
    match only_event(decode_ok(&store(&name(256)))) {
        KvEvent::Stored { lora, .. } => assert_eq!(lora, Some(name(256)), "256 bytes is fine"),
        other => panic!("a store, got {other:?}"),
    }
    let r = reject_reason(&store(&name(257)));
    assert_eq!(
        (r.reason, r.detail.contains("lora_name")),
        (RejectReason::InvalidField, true),
        "a 257-byte LoRA name is rejected: {}",
        r.detail
    );
    assert_eq!(
        parse_kv_headers(None, Some(&name(257)), None, None)
            .unwrap_err()
            .reason,
        RejectReason::InvalidHeader,
        "a 257-byte Kv-Model is rejected"
    );
    let sample =
        |model: String| mp(json!({"kv_usage": 0.5, "running": 1, "waiting": 0, "model": model}));
    assert_eq!(
        decode_load(&sample(name(256)), worker()).unwrap().model,
        Some(name(256)),
        "a 256-byte load-sample model is fine"
    );
    assert_eq!(
        decode_load(&sample(name(257)), worker())
            .unwrap_err()
            .reason,
        RejectReason::InvalidField,
        "a 257-byte load-sample model is rejected"
    );
}
