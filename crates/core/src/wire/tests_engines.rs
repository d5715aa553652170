//! Tests for what the engines send today (vLLM 0.33.0, SGLang 0.5.23, TensorRT-LLM): every block
//! hash form, the tiers, the KV cache group kinds, the newer fields, the batch forms, the
//! `Kv-Epoch` header, lifecycle fields that are rejected without dropping the op, and the caps.
//! Both decoding paths (the single-pass one for vLLM's array layout and the tolerant one) are
//! checked to agree wherever the single-pass one applies.

use proptest::prelude::*;
use rmpv::Value;
use serde_json::json;

use super::fast::decode_vllm_array;
use super::kv::decode_tolerant;
use super::*;
use crate::hashing::local_hash;
use crate::input::{
    KvEvent, KvEventBatch, LifecycleOp, Medium, RejectReason, Rejection, StoredBlock, WorkerId,
};

fn worker() -> WorkerId {
    WorkerId::new("worker-1").expect("valid worker id")
}

fn mp(v: serde_json::Value) -> Vec<u8> {
    rmp_serde::to_vec(&v).expect("JSON values always encode")
}

fn mpv(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("encoding into a Vec");
    out
}

/// Decodes with no headers, and checks that the single-pass path, when it takes the payload,
/// decodes exactly as the tolerant one.
fn decode(payload: &[u8]) -> Result<KvEventBatch, Rejection> {
    if let Some(fast) = decode_vllm_array(payload) {
        assert_eq!(
            decode_tolerant(payload).ok(),
            Some(fast),
            "the single-pass decoder agrees with the tolerant one"
        );
    }
    decode_kv_batch(payload, worker(), KvHeaders::default())
}

fn decode_ok(payload: &[u8]) -> KvEventBatch {
    decode(payload).unwrap_or_else(|r| panic!("expected the batch to decode, got {r:?}"))
}

fn rejection(payload: &[u8]) -> Rejection {
    match decode(payload) {
        Ok(batch) => panic!("expected a rejection, decoded {batch:?}"),
        Err(r) => r,
    }
}

/// `[ts, [event], nil]`: vLLM's array batch of one event.
fn batch_of(event: Value) -> Vec<u8> {
    mpv(&Value::Array(vec![
        Value::F64(1.5),
        Value::Array(vec![event]),
        Value::Nil,
    ]))
}

fn only_event(batch: KvEventBatch) -> KvEvent {
    assert_eq!(batch.events.len(), 1, "the batch holds exactly one event");
    batch.events.into_iter().next().unwrap()
}

/// A positional `BlockStored` of one block of tokens `[1, 2]` (block size 2) with `hash`, then
/// `rest` from `lora_id` on.
fn stored_array(hash: Value, rest: Vec<Value>) -> Value {
    let mut items = vec![
        Value::from("BlockStored"),
        Value::Array(vec![hash]),
        Value::Nil,
        Value::Array(vec![Value::from(1), Value::from(2)]),
        Value::from(2),
    ];
    items.extend(rest);
    Value::Array(items)
}

fn engine_hash_of(payload: &[u8]) -> u64 {
    match only_event(decode_ok(payload)) {
        KvEvent::Stored { blocks, .. } => blocks[0].engine_hash,
        KvEvent::Removed { engine_hashes, .. } => engine_hashes[0],
        other => panic!("expected a store or removal, got {other:?}"),
    }
}

/// vLLM's integer mode: `int.from_bytes(digest, "big") & (2**64 - 1)`.
fn vllm_int_mode(digest: &[u8]) -> u64 {
    digest
        .iter()
        .fold(0u128, |acc, &b| ((acc << 8) | b as u128) & u64::MAX as u128) as u64
}

// ------------------------------------------------------------------------------------------
// block hashes
// ------------------------------------------------------------------------------------------

#[test]
fn a_16_byte_xxhash_digest_is_read_as_vllms_integer_mode_would_send_it() {
    let digest: Vec<u8> = (0x10..0x20).collect();
    let payload = batch_of(stored_array(Value::Binary(digest.clone()), vec![]));
    assert_eq!(
        engine_hash_of(&payload),
        0x1819_1a1b_1c1d_1e1f,
        "a 16-byte digest (--prefix-caching-hash-algo xxhash, integer hashes off) is its last 8 \
         bytes, big-endian"
    );
    assert_eq!(
        engine_hash_of(&payload),
        vllm_int_mode(&digest),
        "which is what vLLM sends for the same block in integer mode"
    );
    assert!(
        decode_vllm_array(&payload).is_some(),
        "vLLM's array layout with a 16-byte digest takes the single-pass decoder"
    );
}

#[test]
fn bin_hashes_of_8_bytes_or_any_multiple_of_16_equal_the_integer_mode() {
    for len in [8usize, 16, 32, 48, 64, 96, 128, 256, 1024] {
        let digest: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
        for event in [
            stored_array(Value::Binary(digest.clone()), vec![]),
            Value::Array(vec![
                Value::from("BlockRemoved"),
                Value::Array(vec![Value::Binary(digest.clone())]),
            ]),
        ] {
            assert_eq!(
                engine_hash_of(&batch_of(event)),
                vllm_int_mode(&digest),
                "a {len}-byte digest is its last 8 bytes, big-endian"
            );
        }
        let parent = Value::Array(vec![
            Value::from("BlockStored"),
            Value::Array(vec![Value::from(1)]),
            Value::Binary(digest.clone()),
            Value::Array(vec![Value::from(1)]),
            Value::from(1),
        ]);
        let KvEvent::Stored { parent, .. } = only_event(decode_ok(&batch_of(parent))) else {
            panic!("a store")
        };
        assert_eq!(
            parent,
            Some(vllm_int_mode(&digest)),
            "a {len}-byte parent hash reads the same way"
        );
    }
}

#[test]
fn bin_hashes_of_other_lengths_are_invalid_field() {
    for len in [0usize, 1, 4, 7, 9, 12, 15, 20, 24, 33, 36, 40] {
        let r = rejection(&batch_of(stored_array(Value::Binary(vec![7; len]), vec![])));
        assert_eq!(
            r.reason,
            RejectReason::InvalidField,
            "a {len}-byte hash is no digest we know"
        );
        assert!(
            r.detail.contains("block_hashes[0]"),
            "the detail names the hash: {}",
            r.detail
        );
    }
}

#[test]
fn integer_hashes_of_every_width_and_sign_are_read_as_u64() {
    let cases: Vec<(Vec<u8>, u64)> = {
        let mut v = Vec::new();
        let mut w = |f: &dyn Fn(&mut Vec<u8>), expected: u64| {
            let mut buf = Vec::new();
            f(&mut buf);
            v.push((buf, expected));
        };
        w(&|b| rmp::encode::write_pfix(b, 7).unwrap(), 7);
        w(&|b| rmp::encode::write_u8(b, 200).unwrap(), 200);
        w(&|b| rmp::encode::write_u16(b, 60_000).unwrap(), 60_000);
        w(
            &|b| rmp::encode::write_u32(b, 4_000_000_000).unwrap(),
            4_000_000_000,
        );
        w(&|b| rmp::encode::write_u64(b, u64::MAX).unwrap(), u64::MAX);
        w(&|b| rmp::encode::write_u64(b, 5).unwrap(), 5);
        w(&|b| rmp::encode::write_nfix(b, -3).unwrap(), -3i64 as u64);
        w(&|b| rmp::encode::write_i8(b, -100).unwrap(), -100i64 as u64);
        w(&|b| rmp::encode::write_i8(b, 100).unwrap(), 100);
        w(
            &|b| rmp::encode::write_i16(b, -30_000).unwrap(),
            -30_000i64 as u64,
        );
        w(
            &|b| rmp::encode::write_i32(b, -2_000_000_000).unwrap(),
            -2_000_000_000i64 as u64,
        );
        w(
            &|b| rmp::encode::write_i64(b, i64::MIN).unwrap(),
            i64::MIN as u64,
        );
        w(&|b| rmp::encode::write_i64(b, 42).unwrap(), 42);
        v
    };
    for (hash_bytes, expected) in cases {
        // [1.5, [["BlockRemoved", [<hash>]]]]
        let mut payload = vec![0x92, 0xcb];
        payload.extend(1.5f64.to_be_bytes());
        payload.extend([0x91, 0x92, 0xac]);
        payload.extend(b"BlockRemoved");
        payload.push(0x91);
        payload.extend(&hash_bytes);
        assert_eq!(
            engine_hash_of(&payload),
            expected,
            "{hash_bytes:02x?} is the u64 {expected}"
        );
    }
}

// ------------------------------------------------------------------------------------------
// tiers and KV cache groups
// ------------------------------------------------------------------------------------------

fn medium_and_group(payload: &[u8]) -> (Medium, bool) {
    match only_event(decode_ok(payload)) {
        KvEvent::Stored {
            medium,
            full_attention,
            ..
        } => (medium, full_attention),
        other => panic!("expected a store, got {other:?}"),
    }
}

#[test]
fn medium_strings_map_to_the_device_host_and_disk_tiers() {
    let cases = [
        ("GPU", Medium::Gpu),
        ("gpu", Medium::Gpu),
        ("CPU", Medium::Host),
        ("cpu", Medium::Host),
        ("CPU_PINNED", Medium::Host),
        ("DISK", Medium::Disk),
        ("STORAGE", Medium::Disk),
        ("FS", Medium::Disk),
        ("OBJ", Medium::Disk),
        ("EXTERNAL", Medium::Disk),
        ("a-tier-from-next-year", Medium::Disk),
        ("", Medium::Disk),
    ];
    for (m, expected) in cases {
        let array = batch_of(stored_array(
            Value::from(1),
            vec![Value::Nil, Value::from(m)],
        ));
        assert_eq!(
            medium_and_group(&array).0,
            expected,
            "medium {m:?} in a positional store"
        );
        let map = mp(json!([1.5, [{
            "type": "BlockRemoved", "block_hashes": [1], "medium": m
        }]]));
        let KvEvent::Removed { medium, .. } = only_event(decode_ok(&map)) else {
            panic!("a removal")
        };
        assert_eq!(medium, expected, "medium {m:?} in a tagged-map removal");
    }
    let absent = mp(json!([1.5, [{"type": "BlockRemoved", "block_hashes": [1]}]]));
    let KvEvent::Removed { medium, .. } = only_event(decode_ok(&absent)) else {
        panic!("a removal")
    };
    assert_eq!(
        medium,
        Medium::Gpu,
        "SGLang omits a GPU medium: absent is GPU"
    );
}

/// A positional vLLM 0.33.0 store with `kind` as `kv_cache_spec_kind`.
fn store_of_kind(kind: Value) -> Vec<u8> {
    batch_of(stored_array(
        Value::from(1),
        vec![
            Value::Nil,                                             // lora_id
            Value::from("GPU"),                                     // medium
            Value::Nil,                                             // lora_name
            Value::Nil,                                             // extra_keys
            Value::from(1),                                         // group_idx
            kind,                                                   // kv_cache_spec_kind
            Value::from(4096),                                      // kv_cache_spec_sliding_window
            Value::from("LOCAL"),                                   // locality
            Value::Nil,                                             // ownership
            Value::from("session"),                                 // session_id
            Value::Array(vec![Value::Array(vec![Value::from(3)])]), // lookahead_token_ids
        ],
    ))
}

#[test]
fn stores_of_a_group_other_than_full_attention_are_not_full_attention() {
    for kind in [
        "sliding_window",
        "sliding_window_mla",
        "chunked_local_attention",
        "mamba",
        "encoder_only_attention",
        "cross_attention",
        "unknown",
        "",
    ] {
        let array = store_of_kind(Value::from(kind));
        assert_eq!(
            medium_and_group(&array),
            (Medium::Gpu, false),
            "a {kind:?} store is accepted and is no prefix ownership"
        );
        assert!(
            decode_vllm_array(&array).is_some(),
            "vLLM's array layout with a kind takes the single-pass decoder"
        );
        let map = mp(json!([1.5, [{
            "type": "BlockStored", "block_hashes": [1], "parent_block_hash": null,
            "token_ids": [1, 2], "block_size": 2, "lora_id": null, "medium": "GPU",
            "lora_name": null, "group_idx": 1, "kv_cache_spec_kind": kind,
            "kv_cache_spec_sliding_window": 4096
        }]]));
        assert_eq!(
            medium_and_group(&map),
            (Medium::Gpu, false),
            "a {kind:?} tagged-map store is no prefix ownership"
        );
    }
}

#[test]
fn full_attention_kinds_and_stores_without_a_kind_are_full_attention() {
    for kind in [
        Value::from("full_attention"),
        Value::from("FULL_ATTENTION"),
        Value::from("mla_attention"),
        Value::from("sink_full_attention"),
        Value::Nil,
        // Not a kind at all (another engine's field at that position): no statement.
        Value::from(3),
    ] {
        assert_eq!(
            medium_and_group(&store_of_kind(kind.clone())),
            (Medium::Gpu, true),
            "a store of kind {kind} is full attention"
        );
    }
    let older = batch_of(stored_array(
        Value::from(1),
        vec![Value::Nil, Value::from("GPU")],
    ));
    assert!(
        medium_and_group(&older).1,
        "a release that sends no kind has one group: full attention"
    );
}

// ------------------------------------------------------------------------------------------
// the engines' newer fields and batch forms
// ------------------------------------------------------------------------------------------

#[test]
fn sglangs_metadata_map_where_vllm_has_lora_name_is_ignored() {
    // SGLang's BlockStoredWithMetadata: [tag, hashes, parent, tokens, bs, lora_id, medium, {..}]
    let payload = batch_of(stored_array(
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
            let r = rejection(&payload);
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
        batch_of(stored_array(
            Value::from(1),
            vec![Value::Nil, Value::Nil, Value::from(lora)],
        ))
    };
    match only_event(decode_ok(&store(&name(256)))) {
        KvEvent::Stored { lora, .. } => assert_eq!(lora, Some(name(256)), "256 bytes is fine"),
        other => panic!("a store, got {other:?}"),
    }
    let r = rejection(&store(&name(257)));
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

// ------------------------------------------------------------------------------------------
// schemas/examples of the engines' current layouts
// ------------------------------------------------------------------------------------------

fn example(name: &str) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../schemas/examples")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    mp(serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}")))
}

#[test]
fn the_engine_layout_examples_decode_to_what_the_docs_say() {
    let vllm = decode_ok(&example("kv-batch-vllm-0-33.json"));
    let kinds: Vec<(Medium, bool)> = vllm
        .events
        .iter()
        .filter_map(|e| match e {
            KvEvent::Stored {
                medium,
                full_attention,
                ..
            } => Some((*medium, *full_attention)),
            _ => None,
        })
        .collect();
    assert_eq!(
        (vllm.dp_rank, vllm.events.len(), kinds),
        (
            0,
            5,
            vec![
                (Medium::Gpu, true),
                (Medium::Gpu, false),
                (Medium::Host, true)
            ]
        ),
        "vLLM 0.33: a full-attention store, a sliding-window store, a CPU-tier store"
    );
    let sglang = decode_ok(&example("kv-batch-sglang-0-5-23.json"));
    match &sglang.events[0] {
        KvEvent::Stored { blocks, lora, .. } => assert_eq!(
            (blocks[0].engine_hash, lora.as_deref()),
            ((-4611686018427400249i64) as u64, Some("support-bot")),
            "SGLang 0.5.23: a signed hash and the LoRA name"
        ),
        other => panic!("a store, got {other:?}"),
    }
    assert_eq!(sglang.dp_rank, 1, "SGLang's attn_dp_rank");
    let (join, rejected) = decode_lifecycle(&example("lifecycle-join-bridge.json"), worker())
        .expect("the bridge's join decodes");
    assert_eq!(
        (join.op, join.dp_size, join.epoch.as_deref(), rejected.len()),
        (LifecycleOp::Join, Some(2), Some("7f3c9a1e-boot-1"), 0),
        "the bridge's join carries dp_size and epoch"
    );
}

#[test]
fn nesting_beyond_the_limit_is_malformed_not_a_stack_overflow() {
    let mut deep = vec![0x91u8; 100_000];
    deep.push(0xc0);
    for payload in [deep.clone(), [&[0x92, 0x00][..], &deep[..]].concat()] {
        assert_eq!(
            decode_kv_batch(&payload, worker(), KvHeaders::default())
                .unwrap_err()
                .reason,
            RejectReason::MalformedPayload,
            "100,000 nested arrays are refused"
        );
        assert!(decode_vllm_array(&payload).is_none());
        assert!(decode_lifecycle(&payload, worker()).is_err());
        assert!(decode_load(&payload, worker()).is_err());
    }
}

#[test]
fn lengths_that_the_payload_cannot_hold_allocate_nothing_and_are_malformed() {
    // array32 of 2^32-1 events, map32 of 2^32-1 entries, a bin32 hash of 4 GiB: 5 bytes each.
    for lie in [
        vec![0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff],
        vec![0xdf, 0xff, 0xff, 0xff, 0xff],
        vec![
            0x92, 0x00, 0x91, 0x92, 0xac, b'B', b'l', b'o', b'c', b'k', b'R', b'e', b'm', b'o',
            b'v', b'e', b'd', 0x91, 0xc6, 0xff, 0xff, 0xff, 0xff,
        ],
    ] {
        assert_eq!(
            decode_kv_batch(&lie, worker(), KvHeaders::default())
                .unwrap_err()
                .reason,
            RejectReason::MalformedPayload,
            "{lie:02x?}: a declared length beyond the payload is refused"
        );
        assert!(decode_vllm_array(&lie).is_none());
    }
}

// ------------------------------------------------------------------------------------------
// the two decoding paths agree on the newer forms
// ------------------------------------------------------------------------------------------

fn arb_hash() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0usize..6, any::<u8>()).prop_map(|(k, seed)| {
            let len = [0, 8, 16, 32, 64, 20][k];
            Value::Binary((0..len).map(|i| seed.wrapping_add(i as u8)).collect())
        }),
    ]
}

fn arb_tail() -> impl Strategy<Value = Vec<Value>> {
    let kind = prop_oneof![
        Just(Value::Nil),
        Just(Value::from("full_attention")),
        Just(Value::from("sliding_window")),
        Just(Value::from(7)),
    ];
    let lora_name = prop_oneof![
        Just(Value::Nil),
        Just(Value::from("x")),
        Just(Value::Map(vec![(
            Value::from("cache_salt"),
            Value::from("s")
        )])),
    ];
    let medium = prop_oneof![
        Just(Value::Nil),
        Just(Value::from("GPU")),
        Just(Value::from("CPU_PINNED")),
        Just(Value::from("STORAGE")),
    ];
    (medium, lora_name, kind, 0usize..13).prop_map(|(medium, lora_name, kind, len)| {
        let full = vec![
            Value::Nil, // lora_id
            medium,
            lora_name,
            Value::Array(vec![Value::Nil]), // extra_keys
            Value::from(0),                 // group_idx
            kind,
            Value::from(4096),
            Value::from("LOCAL"),
            Value::Nil,
            Value::from("s"),
            Value::Array(vec![Value::Array(vec![Value::from(1)])]),
            Value::from("future"),
        ];
        full.into_iter().take(len).collect()
    })
}

/// A tagged-map event: a tag and a random selection, in random order, of field names with
/// values that are sometimes right and sometimes not, and sometimes a repeated key.
fn arb_map_event() -> impl Strategy<Value = Value> {
    let tag = prop_oneof![
        Just(Value::from("BlockStored")),
        Just(Value::from("BlockRemoved")),
        Just(Value::from("AllBlocksCleared")),
        Just(Value::from(1)),
    ];
    let field = prop_oneof![
        arb_hash().prop_map(|h| ("block_hashes", Value::Array(vec![h]))),
        Just(("block_hashes", Value::Array(vec![]))),
        Just(("block_hashes", Value::Nil)),
        arb_hash().prop_map(|h| ("parent_block_hash", h)),
        Just(("parent_block_hash", Value::Nil)),
        Just((
            "token_ids",
            Value::Array(vec![Value::from(1), Value::from(2)])
        )),
        Just(("token_ids", Value::Array(vec![]))),
        Just((
            "token_ids",
            Value::Array(vec![Value::Array(vec![Value::from(1), Value::from(2)])])
        )),
        Just(("block_size", Value::from(2))),
        Just(("block_size", Value::from(0))),
        Just(("lora_id", Value::from(-3))),
        Just(("lora_id", Value::from("x"))),
        Just(("medium", Value::from("CPU"))),
        Just(("medium", Value::from(1))),
        Just(("lora_name", Value::from("a"))),
        Just(("lora_name", Value::from(""))),
        Just(("lora_name", Value::Map(vec![]))),
        Just(("kv_cache_spec_kind", Value::from("mamba"))),
        Just(("kv_cache_spec_kind", Value::from(2))),
        Just((
            "mm_keys",
            Value::Array(vec![Value::Array(vec![Value::Binary(vec![0; 32])])])
        )),
        Just(("session_id", Value::Nil)),
    ];
    (tag, proptest::collection::vec(field, 0..9), any::<bool>()).prop_map(
        |(tag, fields, tag_last)| {
            let mut entries: Vec<(Value, Value)> = fields
                .into_iter()
                .map(|(k, v)| (Value::from(k), v))
                .collect();
            let tag = (Value::from("type"), tag);
            if tag_last {
                entries.push(tag);
            } else {
                entries.insert(0, tag);
            }
            Value::Map(entries)
        },
    )
}

proptest! {
    #[test]
    fn both_paths_agree_on_tagged_map_events(events in proptest::collection::vec(arb_map_event(), 1..4)) {
        let payload = mpv(&Value::Array(vec![
            Value::F64(1.5),
            Value::Array(events),
            Value::from(0),
        ]));
        if let Some(fast) = decode_vllm_array(&payload) {
            prop_assert_eq!(Some(fast), decode_tolerant(&payload).ok(), "the single-pass decoder agrees");
        }
    }

    #[test]
    fn both_paths_agree_on_the_engines_newer_array_layouts(
        hash in arb_hash(),
        tail in arb_tail(),
        ts in prop_oneof![Just(1.5), Just(f64::NAN), Just(f64::INFINITY)],
        rank in proptest::option::of(0u32..4),
    ) {
        let payload = mpv(&Value::Array(vec![
            Value::F64(ts),
            Value::Array(vec![stored_array(hash, tail)]),
            rank.map(Value::from).unwrap_or(Value::Nil),
        ]));
        let fast = decode_vllm_array(&payload);
        let tolerant = decode_tolerant(&payload);
        if let Some(fast) = fast {
            prop_assert_eq!(Some(fast), tolerant.ok(), "the single-pass decoder agrees");
        }
    }
}

// ------------------------------------------------------------------------------------------
// journal compatibility of the changed input types
// ------------------------------------------------------------------------------------------

/// The journal stores inputs with `rmp_serde::to_vec` (structs as arrays). Entries written
/// before this round's type changes must still read.
#[test]
fn inputs_journaled_before_the_type_changes_still_decode() {
    #[derive(serde::Serialize)]
    enum OldMedium {
        Gpu,
        Other,
    }
    #[derive(serde::Serialize)]
    enum OldKvEvent {
        Stored {
            parent: Option<u64>,
            blocks: Vec<StoredBlock>,
            block_size: u32,
            lora: Option<String>,
            medium: OldMedium,
        },
    }
    let old = rmp_serde::to_vec(&OldKvEvent::Stored {
        parent: None,
        blocks: vec![],
        block_size: 16,
        lora: None,
        medium: OldMedium::Other,
    })
    .unwrap();
    let event: KvEvent = rmp_serde::from_slice(&old).expect("an old Stored event decodes");
    assert_eq!(
        event,
        KvEvent::Stored {
            parent: None,
            blocks: vec![],
            block_size: 16,
            lora: None,
            medium: Medium::Disk,
            full_attention: true,
        },
        "an old Other medium reads as Disk and an old store as full attention"
    );
    let _ = OldMedium::Gpu;

    #[derive(serde::Serialize)]
    struct OldLoadSample {
        worker: WorkerId,
        kv_usage: f64,
        running: u32,
        waiting: u32,
        max_running: Option<u32>,
        model: Option<String>,
    }
    let old = rmp_serde::to_vec(&OldLoadSample {
        worker: worker(),
        kv_usage: 0.5,
        running: 1,
        waiting: 2,
        max_running: None,
        model: None,
    })
    .unwrap();
    let sample: crate::input::LoadSample =
        rmp_serde::from_slice(&old).expect("an old load sample decodes");
    assert_eq!(sample.dp_rank, 0, "an old sample is rank 0");

    #[derive(serde::Serialize)]
    struct OldLifecycle {
        worker: WorkerId,
        op: LifecycleOp,
        model: Option<String>,
        block_size: Option<u32>,
        capacity_blocks: Option<u64>,
    }
    let old = rmp_serde::to_vec(&OldLifecycle {
        worker: worker(),
        op: LifecycleOp::Drain,
        model: None,
        block_size: Some(16),
        capacity_blocks: None,
    })
    .unwrap();
    let l: crate::input::Lifecycle =
        rmp_serde::from_slice(&old).expect("an old lifecycle message decodes");
    assert_eq!((l.op, l.dp_size, l.epoch), (LifecycleOp::Drain, None, None));

    #[derive(serde::Serialize)]
    struct OldKvEventBatch {
        worker: WorkerId,
        model: Option<String>,
        dp_rank: u32,
        seq: Option<u64>,
        events: Vec<KvEvent>,
    }
    let old = rmp_serde::to_vec(&OldKvEventBatch {
        worker: worker(),
        model: None,
        dp_rank: 1,
        seq: Some(4),
        events: vec![KvEvent::Cleared],
    })
    .unwrap();
    let batch: KvEventBatch = rmp_serde::from_slice(&old).expect("an old KV batch decodes");
    assert_eq!(
        (batch.dp_rank, batch.seq, batch.epoch, batch.events),
        (1, Some(4), None, vec![KvEvent::Cleared]),
        "an old batch reads with no epoch"
    );
}
