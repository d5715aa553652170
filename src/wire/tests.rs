//! Tests for the wire decoders and encoders: behaviour by behaviour, then the msgspec byte
//! fixtures (`tests/fixtures/kv_events/`), the schema examples and block-key vectors
//! (`schemas/`), and property tests that no input makes a decoder panic.

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use rmpv::Value;
use serde_json::json;

use super::*;
use crate::hashing::{block_keys, local_hash};
use crate::input::{
    KvEvent, KvEventBatch, LifecycleOp, Medium, RejectReason, Rejection, StoredBlock, WorkerId,
};

// ------------------------------------------------------------------------------------------
// helpers
// ------------------------------------------------------------------------------------------

fn worker() -> WorkerId {
    WorkerId::new("worker-1").expect("valid worker id")
}

/// MessagePack bytes of a JSON value (ints stay ints, floats become float64).
fn mp(v: serde_json::Value) -> Vec<u8> {
    rmp_serde::to_vec(&v).expect("JSON values always encode")
}

/// MessagePack bytes of an rmpv value (for what JSON cannot express: bin, ext, f32).
fn mpv(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("encoding into a Vec");
    out
}

fn decode(payload: &[u8]) -> Result<KvEventBatch, Rejection> {
    decode_kv_batch(payload, worker(), KvHeaders::default())
}

fn decode_ok(payload: &[u8]) -> KvEventBatch {
    decode(payload).unwrap_or_else(|r| panic!("expected the batch to decode, got {r:?}"))
}

fn reject_reason(payload: &[u8]) -> Rejection {
    match decode(payload) {
        Ok(batch) => panic!("expected a rejection, decoded {batch:?}"),
        Err(r) => r,
    }
}

/// Asserts that `payload` is rejected for `reason` with a detail naming `fragment`; `why` states
/// the invariant.
fn assert_rejected(
    payload: &[u8],
    reason: RejectReason,
    fragment: &str,
    why: std::fmt::Arguments<'_>,
) {
    let r = reject_reason(payload);
    assert_eq!(r.reason, reason, "{why}");
    assert!(
        r.detail.contains(fragment),
        "{why}: the detail names {fragment:?}: {}",
        r.detail
    );
}

/// The single event of a one-event batch.
fn only_event(batch: KvEventBatch) -> KvEvent {
    assert_eq!(batch.events.len(), 1, "the batch holds exactly one event");
    batch.events.into_iter().next().unwrap()
}

fn stored_parts(event: KvEvent) -> (Option<u64>, Vec<StoredBlock>, u32, Option<String>, Medium) {
    match event {
        KvEvent::Stored {
            parent,
            blocks,
            block_size,
            lora,
            medium,
            ..
        } => (parent, blocks, block_size, lora, medium),
        other => panic!("expected a Stored event, got {other:?}"),
    }
}

/// A one-event array batch `[ts, [event]]`.
fn batch_of(event: serde_json::Value) -> Vec<u8> {
    mp(json!([1.5, [event]]))
}

fn manifest_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

// ------------------------------------------------------------------------------------------
// headers
// ------------------------------------------------------------------------------------------

#[test]
fn headers_parse_decimal_values_and_trim_whitespace() {
    let h = parse_kv_headers(Some(" 42 "), Some("llama"), Some("3"), None).unwrap();
    assert_eq!(
        h,
        KvHeaders {
            seq: Some(42),
            model: Some("llama".into()),
            dp_rank: Some(3),
            epoch: None,
        },
        "decimal headers parse to their values"
    );
    assert_eq!(
        parse_kv_headers(Some("18446744073709551615"), None, None, None)
            .unwrap()
            .seq,
        Some(u64::MAX),
        "Kv-Seq covers the whole u64 range"
    );
    assert_eq!(
        parse_kv_headers(None, None, None, None).unwrap(),
        KvHeaders::default(),
        "absent headers are None"
    );
}

#[test]
fn non_decimal_seq_or_dp_rank_is_invalid_header() {
    for bad in [
        "",
        " ",
        "abc",
        "+5",
        "-1",
        "1.0",
        "0x10",
        "18446744073709551616",
        "1 2",
    ] {
        let err = parse_kv_headers(Some(bad), None, None, None).unwrap_err();
        assert_eq!(
            err.reason,
            RejectReason::InvalidHeader,
            "Kv-Seq {bad:?} is not a decimal u64 and must be rejected"
        );
        assert!(
            err.detail.contains("Kv-Seq"),
            "the detail names the header: {}",
            err.detail
        );
    }
    for bad in ["x", "-3", "4294967296"] {
        let err = parse_kv_headers(None, None, Some(bad), None).unwrap_err();
        assert_eq!(
            err.reason,
            RejectReason::InvalidHeader,
            "Kv-Dp-Rank {bad:?} is not a decimal u32 and must be rejected"
        );
    }
}

#[test]
fn empty_model_header_means_no_model() {
    for empty in ["", "   "] {
        assert_eq!(
            parse_kv_headers(None, Some(empty), None, None)
                .unwrap()
                .model,
            None,
            "an empty Kv-Model header carries no model"
        );
    }
}

#[test]
fn headers_are_carried_into_the_batch() {
    let payload = batch_of(json!(["AllBlocksCleared"]));
    let headers = parse_kv_headers(Some("7"), Some("m"), Some("2"), None).unwrap();
    let batch = decode_kv_batch(&payload, worker(), headers).unwrap();
    assert_eq!(batch.seq, Some(7), "Kv-Seq becomes the batch sequence");
    assert_eq!(
        batch.model.as_deref(),
        Some("m"),
        "Kv-Model becomes the batch model"
    );
    assert_eq!(batch.dp_rank, 2, "Kv-Dp-Rank becomes the batch rank");
    assert_eq!(batch.worker, worker(), "the worker comes from the subject");
}

// ------------------------------------------------------------------------------------------
// batch shapes and dp rank
// ------------------------------------------------------------------------------------------

#[test]
fn legacy_two_element_batch_decodes_with_rank_zero() {
    let batch = decode_ok(&mp(json!([1.0, [["AllBlocksCleared"]]])));
    assert_eq!(batch.dp_rank, 0, "no rank anywhere means rank 0");
    assert_eq!(batch.events, vec![KvEvent::Cleared], "the event is decoded");
}

#[test]
fn batch_dp_rank_is_used_when_no_header_is_given() {
    let array = decode_ok(&mp(json!([1.0, [], 5])));
    assert_eq!(array.dp_rank, 5, "the third array element is the rank");
    let map = decode_ok(&mp(
        json!({"ts": 1.0, "events": [], "data_parallel_rank": 6}),
    ));
    assert_eq!(
        map.dp_rank, 6,
        "data_parallel_rank is the rank of a map batch"
    );
    let nil = decode_ok(&mp(json!([1.0, [], null])));
    assert_eq!(nil.dp_rank, 0, "a nil rank (msgspec's None) means rank 0");
}

#[test]
fn header_dp_rank_wins_over_batch_field() {
    let payload = mp(json!([1.0, [], 5]));
    let headers = parse_kv_headers(None, None, Some("1"), None).unwrap();
    let batch = decode_kv_batch(&payload, worker(), headers).unwrap();
    assert_eq!(
        batch.dp_rank, 1,
        "Kv-Dp-Rank overrides the batch's own rank"
    );
}

#[test]
fn invalid_batch_dp_rank_is_invalid_field() {
    for bad in [json!(-1), json!("1"), json!(4294967296u64), json!(1.0)] {
        assert_rejected(
            &mp(json!([1.0, [], bad])),
            RejectReason::InvalidField,
            "data_parallel_rank",
            format_args!("dp rank {bad} is rejected"),
        );
    }
}

#[test]
fn ts_must_be_a_number_if_present() {
    decode_ok(&mp(json!([17, []])));
    decode_ok(&mp(json!([null, []])));
    decode_ok(&mp(json!({"events": []})));
    assert_rejected(
        &mp(json!(["yesterday", []])),
        RejectReason::InvalidField,
        "EventBatch.ts",
        format_args!("a string ts is rejected"),
    );
}

#[test]
fn wrong_top_level_shape_is_malformed_payload() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (mp(json!(42)), "an integer"),
        (mp(json!("batch")), "a string"),
        (mp(json!([1.0])), "a one-element array"),
        (mp(json!([])), "an empty array"),
        (mp(json!({"ts": 1.0})), "a map without events"),
        (vec![], "no bytes at all"),
        (vec![0xc1], "the reserved marker 0xc1"),
        (vec![0x92, 0xcb], "a truncated array"),
    ];
    for (payload, what) in cases {
        assert_eq!(
            reject_reason(&payload).reason,
            RejectReason::MalformedPayload,
            "{what} is not a KV event batch"
        );
    }
}

#[test]
fn trailing_bytes_after_the_batch_are_malformed_payload() {
    let mut payload = mp(json!([1.0, []]));
    payload.push(0xc0);
    assert_eq!(
        reject_reason(&payload).reason,
        RejectReason::MalformedPayload,
        "a payload is exactly one MessagePack value"
    );
}

#[test]
fn events_that_are_not_an_array_are_invalid_field() {
    assert_rejected(
        &mp(json!([1.0, {"a": 1}])),
        RejectReason::InvalidField,
        "EventBatch.events",
        format_args!("events must be an array"),
    );
}

#[test]
fn an_empty_events_array_is_an_empty_batch() {
    assert!(
        decode_ok(&mp(json!([1.0, [], 0]))).events.is_empty(),
        "a batch without events is valid"
    );
}

#[test]
fn unknown_trailing_batch_elements_and_map_keys_are_ignored() {
    let batch = decode_ok(&mp(
        json!([1.0, [["AllBlocksCleared"]], 2, "future", {"x": 1}]),
    ));
    assert_eq!(batch.dp_rank, 2, "the known prefix is still read");
    let batch = decode_ok(&mp(
        json!({"ts": 1.0, "events": [], "data_parallel_rank": 1, "publisher": "x"}),
    ));
    assert_eq!(
        batch.dp_rank, 1,
        "unknown batch keys do not disturb known ones"
    );
}

// ------------------------------------------------------------------------------------------
// event layout and tags
// ------------------------------------------------------------------------------------------

#[test]
fn unknown_tag_is_unknown_event_tag() {
    for event in [json!(["BlockMoved", [1]]), json!({"type": "Teleported"})] {
        let r = reject_reason(&batch_of(event));
        assert_eq!(
            r.reason,
            RejectReason::UnknownEventTag,
            "unknown tags have their own reason"
        );
    }
}

#[test]
fn malformed_events_are_invalid_field() {
    let cases = [
        (json!([]), "an empty event array has no tag"),
        (json!([7, [1]]), "a tag must be a string"),
        (json!({"block_hashes": [1]}), "a map event needs a type"),
        (json!(12), "an event must be an array or a map"),
        (json!(null), "a nil event is not an event"),
    ];
    for (event, why) in cases {
        assert_eq!(
            reject_reason(&batch_of(event)).reason,
            RejectReason::InvalidField,
            "{why}"
        );
    }
}

#[test]
fn one_bad_event_rejects_the_whole_batch() {
    let payload = mp(json!([
        1.0,
        [["AllBlocksCleared"], ["BlockRemoved", "nope"]]
    ]));
    assert_rejected(
        &payload,
        RejectReason::InvalidField,
        "(event 1)",
        format_args!("the batch is applied all or nothing"),
    );
}

#[test]
fn all_blocks_cleared_ignores_trailing_elements() {
    let event = only_event(decode_ok(&batch_of(json!(["AllBlocksCleared", 1, "x"]))));
    assert_eq!(
        event,
        KvEvent::Cleared,
        "AllBlocksCleared has no fields to read"
    );
}

// ------------------------------------------------------------------------------------------
// BlockStored
// ------------------------------------------------------------------------------------------

#[test]
fn stored_event_hashes_each_block_of_tokens() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored",
        [10, 11],
        9,
        [1, 2, 3, 4, 5, 6, 7, 8],
        4,
        null,
        "GPU",
        null,
        null,
        null
    ]))));
    let (parent, blocks, block_size, lora, medium) = stored_parts(event);
    assert_eq!(parent, Some(9), "the parent hash is kept");
    assert_eq!(block_size, 4, "the block size is kept");
    assert_eq!(lora, None, "no LoRA");
    assert_eq!(medium, Medium::Gpu, "GPU medium");
    assert_eq!(
        blocks,
        vec![
            StoredBlock {
                engine_hash: 10,
                local: local_hash(&[1, 2, 3, 4])
            },
            StoredBlock {
                engine_hash: 11,
                local: local_hash(&[5, 6, 7, 8])
            },
        ],
        "block i's local is the hash of tokens[i*bs..(i+1)*bs]"
    );
    assert_eq!(
        blocks[0].local, 14643705804678351452,
        "DESIGN.md §4 test vector"
    );
}

#[test]
fn negative_int64_hash_is_cast_to_u64() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored",
        [-1, i64::MIN],
        -42,
        [1, 2],
        1,
        null,
        null
    ]))));
    let (parent, blocks, ..) = stored_parts(event);
    assert_eq!(
        parent,
        Some(-42i64 as u64),
        "a negative parent is reinterpreted as u64"
    );
    let hashes: Vec<u64> = blocks.iter().map(|b| b.engine_hash).collect();
    assert_eq!(
        hashes,
        vec![u64::MAX, 1u64 << 63],
        "negative hashes are reinterpreted as u64"
    );
}

#[test]
fn uint64_hash_above_i64_max_is_kept() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockRemoved",
        [u64::MAX, (1u64 << 63) + 1]
    ]))));
    assert_eq!(
        event,
        KvEvent::Removed {
            engine_hashes: vec![u64::MAX, (1u64 << 63) + 1],
            medium: Medium::Gpu
        },
        "uint64 hashes are taken as they are"
    );
}

#[test]
fn bytes_hash_uses_its_last_eight_bytes_big_endian() {
    let mut digest = vec![0xAAu8; 24];
    digest.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
    let event = Value::Array(vec![
        Value::from("BlockRemoved"),
        Value::Array(vec![Value::Binary(digest)]),
    ]);
    let payload = mpv(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![event]),
    ]));
    assert_eq!(
        only_event(decode_ok(&payload)),
        KvEvent::Removed {
            engine_hashes: vec![0x0102030405060708],
            medium: Medium::Gpu
        },
        "a 32-byte hash is its last 8 bytes read big-endian"
    );
}

#[test]
fn hashes_of_other_kinds_are_invalid_field() {
    let bad_hashes = [
        Value::Binary(vec![]),
        Value::Binary(vec![1; 7]),
        Value::Binary(vec![1; 12]),
        Value::Binary(vec![1; 20]),
        Value::Binary(vec![1; 36]),
        Value::from("0xabc"),
        Value::F64(1.0),
        Value::Nil,
    ];
    for bad in bad_hashes {
        let event = Value::Array(vec![
            Value::from("BlockRemoved"),
            Value::Array(vec![bad.clone()]),
        ]);
        let payload = mpv(&Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![event]),
        ]));
        assert_rejected(
            &payload,
            RejectReason::InvalidField,
            "BlockRemoved.block_hashes[0]",
            format_args!("{bad:?} is not a block hash"),
        );
    }
}

#[test]
fn block_size_must_be_a_positive_integer() {
    for bad in [
        json!("4"),
        json!(0),
        json!(-4),
        json!(4.0),
        json!(null),
        json!(4294967296u64),
    ] {
        let r = reject_reason(&batch_of(json!([
            "BlockStored",
            [1],
            null,
            [1, 2, 3, 4],
            bad
        ])));
        assert_eq!(
            r.reason,
            RejectReason::InvalidField,
            "block_size {bad} is rejected"
        );
        assert!(
            r.detail
                .starts_with("BlockStored.block_size: expected a positive integer, got"),
            "detail names the event type and field: {}",
            r.detail
        );
    }
    let r = reject_reason(&batch_of(json!([
        "BlockStored",
        [1],
        null,
        [1, 2, 3, 4],
        "4"
    ])));
    assert_eq!(
        r.detail, "BlockStored.block_size: expected a positive integer, got string (event 0)",
        "the detail has the documented wording"
    );
}

#[test]
fn missing_required_stored_fields_are_invalid_field() {
    let cases = [
        (json!(["BlockStored"]), "block_hashes"),
        (json!(["BlockStored", [1], null]), "token_ids"),
        (json!(["BlockStored", [1], null, [1]]), "block_size"),
        (
            json!({"type": "BlockStored", "token_ids": [1], "block_size": 1}),
            "block_hashes",
        ),
        (
            json!({"type": "BlockStored", "block_hashes": [1], "block_size": 1}),
            "token_ids",
        ),
        (json!({"type": "BlockRemoved"}), "block_hashes"),
    ];
    for (event, field) in cases {
        assert_rejected(
            &batch_of(event.clone()),
            RejectReason::InvalidField,
            field,
            format_args!("{event} lacks {field}"),
        );
    }
}

#[test]
fn token_count_must_equal_blocks_times_block_size() {
    for tokens in [
        json!([1, 2, 3, 4, 5, 6, 7]),
        json!([1, 2, 3, 4, 5, 6, 7, 8, 9]),
        json!([]),
    ] {
        let r = reject_reason(&batch_of(json!(["BlockStored", [1, 2], null, tokens, 4])));
        assert_eq!(
            r.reason,
            RejectReason::TokenCountMismatch,
            "{tokens} is not 2 blocks × 4 tokens"
        );
    }
}

#[test]
fn token_ids_must_be_u32() {
    for bad in [json!(-1), json!(4294967296u64), json!("1"), json!(1.0)] {
        assert_rejected(
            &batch_of(json!(["BlockStored", [1], null, [1, bad], 2])),
            RejectReason::InvalidField,
            "token_ids[1]",
            format_args!("token {bad} is rejected"),
        );
    }
    let r = reject_reason(&batch_of(json!(["BlockStored", [1], null, "abcd", 4])));
    assert_eq!(
        r.reason,
        RejectReason::InvalidField,
        "token_ids must be an array"
    );
}

#[test]
fn bigram_token_ids_take_the_first_element_of_each_pair() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored",
        [1, 2],
        null,
        [[10, 11], [11, 12], [12, 13], [13, 14]],
        2,
        null,
        "GPU"
    ]))));
    let (_, blocks, ..) = stored_parts(event);
    assert_eq!(
        blocks.iter().map(|b| b.local).collect::<Vec<_>>(),
        vec![local_hash(&[10, 11]), local_hash(&[12, 13])],
        "bigram pairs [t_i, t_i+1] contribute t_i"
    );
}

#[test]
fn malformed_bigrams_are_invalid_field() {
    for pairs in [
        json!([[1, 2], [2]]),
        json!([[1, 2], [2, 3, 4]]),
        json!([[1, 2], 3]),
        json!([[1, -2], [2, 3]]),
        json!([[1, 2], ["2", 3]]),
    ] {
        let r = reject_reason(&batch_of(json!(["BlockStored", [1], null, pairs, 2])));
        assert_eq!(
            r.reason,
            RejectReason::InvalidField,
            "{pairs} is not a list of u32 pairs"
        );
    }
}

#[test]
fn medium_gpu_in_any_case_or_nil_is_gpu_and_other_strings_are_lower_tiers() {
    let medium_of = |m: serde_json::Value| {
        stored_parts(only_event(decode_ok(&batch_of(json!([
            "BlockStored",
            [1],
            null,
            [1],
            1,
            null,
            m
        ])))))
        .4
    };
    assert_eq!(medium_of(json!("GPU")), Medium::Gpu, "GPU is the GPU tier");
    assert_eq!(
        medium_of(json!("gpu")),
        Medium::Gpu,
        "the comparison ignores case"
    );
    assert_eq!(medium_of(json!(null)), Medium::Gpu, "nil means GPU");
    assert_eq!(
        medium_of(json!("CPU")),
        Medium::Host,
        "CPU offload is the host tier"
    );
    assert_eq!(
        medium_of(json!("DISK")),
        Medium::Disk,
        "disk is the disk tier"
    );
    let absent = stored_parts(only_event(decode_ok(&batch_of(json!([
        "BlockStored",
        [1],
        null,
        [1],
        1
    ])))));
    assert_eq!(absent.4, Medium::Gpu, "an absent medium means GPU");
    let r = reject_reason(&batch_of(json!(["BlockRemoved", [1], 3])));
    assert_eq!(
        r.reason,
        RejectReason::InvalidField,
        "a non-string medium is rejected"
    );
}

#[test]
fn lora_name_wins_and_lora_id_is_the_fallback() {
    let lora_of = |id: serde_json::Value, name: serde_json::Value| {
        stored_parts(only_event(decode_ok(&batch_of(json!([
            "BlockStored",
            [1],
            null,
            [1],
            1,
            id,
            null,
            name
        ])))))
        .3
    };
    assert_eq!(
        lora_of(json!(7), json!("sql")).as_deref(),
        Some("sql"),
        "the name wins"
    );
    assert_eq!(
        lora_of(json!(7), json!(null)).as_deref(),
        Some("7"),
        "the id as decimal"
    );
    assert_eq!(
        lora_of(json!(7), json!("")).as_deref(),
        Some("7"),
        "an empty name is no name"
    );
    assert_eq!(
        lora_of(json!(-3), json!(null)).as_deref(),
        Some("-3"),
        "any int id"
    );
    assert_eq!(
        lora_of(json!(null), json!("sql")).as_deref(),
        Some("sql"),
        "name alone"
    );
    assert_eq!(lora_of(json!(null), json!(null)), None, "no LoRA");
    for (id, name) in [(json!("7"), json!(null)), (json!(null), json!(7))] {
        let r = reject_reason(&batch_of(json!([
            "BlockStored",
            [1],
            null,
            [1],
            1,
            id,
            null,
            name
        ])));
        assert_eq!(
            r.reason,
            RejectReason::InvalidField,
            "lora_id {id} / lora_name {name}"
        );
    }
}

#[test]
fn extra_keys_and_group_idx_are_accepted_and_ignored() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored", [1], null, [1], 1, null, "GPU", null,
        [["mm-hash", 0], null, {"anything": true}], "not-even-an-int"
    ]))));
    assert_eq!(
        stored_parts(event).1.len(),
        1,
        "extra_keys/group_idx do not affect decoding"
    );
}

#[test]
fn unknown_trailing_fields_are_ignored() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored", [1], null, [1], 1, null, "GPU", null, null, 0, "future", [1, 2], {"k": 1}
    ]))));
    assert_eq!(
        stored_parts(event).1.len(),
        1,
        "elements past group_idx are ignored"
    );
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockRemoved",
        [1],
        "GPU",
        0,
        "future"
    ]))));
    assert_eq!(
        event,
        KvEvent::Removed {
            engine_hashes: vec![1],
            medium: Medium::Gpu
        },
        "elements past BlockRemoved.group_idx are ignored"
    );
}

#[test]
fn map_events_read_fields_by_name_and_ignore_unknown_keys() {
    let event = only_event(decode_ok(&batch_of(json!({
        "block_size": 2,
        "token_ids": [5, 6],
        "type": "BlockStored",
        "block_hashes": [77],
        "lora_name": "x",
        "weird": [1, 2, 3],
    }))));
    assert_eq!(
        event,
        KvEvent::Stored {
            parent: None,
            blocks: vec![StoredBlock {
                engine_hash: 77,
                local: local_hash(&[5, 6])
            }],
            block_size: 2,
            lora: Some("x".into()),
            medium: Medium::Gpu,
            full_attention: true,
        },
        "key order does not matter and an absent parent is none"
    );
}

#[test]
fn stored_event_with_no_blocks_is_accepted() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored",
        [],
        null,
        [],
        16
    ]))));
    assert!(
        stored_parts(event).1.is_empty(),
        "zero blocks and zero tokens are consistent"
    );
}

#[test]
fn blocks_longer_than_the_stack_buffer_hash_correctly() {
    let tokens: Vec<u32> = (0..256).collect();
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored",
        [1, 2],
        null,
        tokens,
        128
    ]))));
    let locals: Vec<u64> = stored_parts(event).1.iter().map(|b| b.local).collect();
    assert_eq!(
        locals,
        vec![local_hash(&tokens[..128]), local_hash(&tokens[128..])],
        "block sizes above 64 use the same hashing"
    );
}

// ------------------------------------------------------------------------------------------
// load samples
// ------------------------------------------------------------------------------------------

fn load(v: serde_json::Value) -> Result<crate::input::LoadSample, Rejection> {
    decode_load(&mp(v), worker())
}

#[test]
fn load_sample_decodes_every_field() {
    let s = load(json!({
        "kv_usage": 0.5, "running": 3, "waiting": 2, "max_running": 8, "ts": 12.5, "model": "m"
    }))
    .unwrap();
    assert_eq!(s.worker, worker(), "the worker comes from the subject");
    assert_eq!(
        (s.kv_usage, s.running, s.waiting),
        (0.5, 3, 2),
        "required fields"
    );
    assert_eq!(s.max_running, Some(8), "max_running");
    assert_eq!(s.model.as_deref(), Some("m"), "model");
}

#[test]
fn load_sample_accepts_integer_kv_usage_and_nil_optionals() {
    for usage in [0, 1] {
        let s = load(json!({"kv_usage": usage, "running": 0, "waiting": 0})).unwrap();
        assert_eq!(s.kv_usage, usage as f64, "an integer kv_usage is a number");
    }
    let s = load(json!({
        "kv_usage": 0.1, "running": 0, "waiting": 0, "max_running": null, "ts": null,
        "model": null, "extra": "ignored"
    }))
    .unwrap();
    assert_eq!(
        (s.max_running, s.model),
        (None, None),
        "nil optionals are absent"
    );
    let s = load(json!({"kv_usage": 0.1, "running": 0, "waiting": 0, "model": ""})).unwrap();
    assert_eq!(s.model, None, "an empty model is no model");
    let f32_usage = Value::Map(vec![
        (Value::from("kv_usage"), Value::F32(0.25)),
        (Value::from("running"), Value::from(1)),
        (Value::from("waiting"), Value::from(1)),
    ]);
    assert_eq!(
        decode_load(&mpv(&f32_usage), worker()).unwrap().kv_usage,
        0.25,
        "float32 ok"
    );
}

#[test]
fn non_finite_or_out_of_range_load_values_are_invalid_load_value() {
    let nan_usage = Value::Map(vec![
        (Value::from("kv_usage"), Value::F64(f64::NAN)),
        (Value::from("running"), Value::from(1)),
        (Value::from("waiting"), Value::from(1)),
    ]);
    assert_eq!(
        decode_load(&mpv(&nan_usage), worker()).unwrap_err().reason,
        RejectReason::InvalidLoadValue,
        "NaN kv_usage is rejected"
    );
    let inf_ts = Value::Map(vec![
        (Value::from("kv_usage"), Value::F64(0.5)),
        (Value::from("running"), Value::from(1)),
        (Value::from("waiting"), Value::from(1)),
        (Value::from("ts"), Value::F64(f64::INFINITY)),
    ]);
    assert_eq!(
        decode_load(&mpv(&inf_ts), worker()).unwrap_err().reason,
        RejectReason::InvalidLoadValue,
        "an infinite ts is rejected"
    );
    let cases = [
        json!({"kv_usage": 1.5, "running": 0, "waiting": 0}),
        json!({"kv_usage": -0.1, "running": 0, "waiting": 0}),
        json!({"kv_usage": 2, "running": 0, "waiting": 0}),
        json!({"kv_usage": 0.5, "running": -1, "waiting": 0}),
        json!({"kv_usage": 0.5, "running": 0, "waiting": 4294967296u64}),
        json!({"kv_usage": 0.5, "running": 0, "waiting": 0, "max_running": -8}),
    ];
    for case in cases {
        assert_eq!(
            load(case.clone()).unwrap_err().reason,
            RejectReason::InvalidLoadValue,
            "{case} has an out-of-range value"
        );
    }
}

#[test]
fn wrong_types_or_missing_load_fields_are_invalid_field() {
    let cases = [
        json!({"running": 0, "waiting": 0}),
        json!({"kv_usage": 0.5, "waiting": 0}),
        json!({"kv_usage": 0.5, "running": 0}),
        json!({"kv_usage": "0.5", "running": 0, "waiting": 0}),
        json!({"kv_usage": 0.5, "running": 1.0, "waiting": 0}),
        json!({"kv_usage": 0.5, "running": 0, "waiting": "0"}),
        json!({"kv_usage": 0.5, "running": 0, "waiting": 0, "ts": "now"}),
        json!({"kv_usage": 0.5, "running": 0, "waiting": 0, "model": 3}),
        json!({"kv_usage": null, "running": 0, "waiting": 0}),
    ];
    for case in cases {
        let r = load(case.clone()).unwrap_err();
        assert_eq!(
            r.reason,
            RejectReason::InvalidField,
            "{case} has a wrong type or hole"
        );
        assert!(
            r.detail.starts_with("LoadSample."),
            "detail names the field: {}",
            r.detail
        );
    }
    for (payload, what) in [
        (mp(json!([0.5, 1, 1])), "an array"),
        (vec![0xc1], "garbage"),
    ] {
        assert_eq!(
            decode_load(&payload, worker()).unwrap_err().reason,
            RejectReason::MalformedPayload,
            "{what} is not a load sample"
        );
    }
}

// ------------------------------------------------------------------------------------------
// lifecycle
// ------------------------------------------------------------------------------------------

/// A lifecycle message that decodes with no field rejected.
fn lifecycle(v: serde_json::Value) -> Result<crate::input::Lifecycle, Rejection> {
    decode_lifecycle(&mp(v), worker()).map(|(l, rejected)| {
        assert_eq!(rejected, vec![], "no field is rejected");
        l
    })
}

#[test]
fn lifecycle_decodes_each_op_and_optional_fields() {
    for (op, expected) in [
        ("join", LifecycleOp::Join),
        ("drain", LifecycleOp::Drain),
        ("leave", LifecycleOp::Leave),
    ] {
        assert_eq!(
            lifecycle(json!({"op": op})).unwrap().op,
            expected,
            "op {op}"
        );
    }
    let l = lifecycle(json!({
        "op": "join", "model": "m", "block_size": 16, "capacity_blocks": 1u64 << 40, "x": 1
    }))
    .unwrap();
    assert_eq!(l.model.as_deref(), Some("m"), "model");
    assert_eq!(l.block_size, Some(16), "block_size");
    assert_eq!(l.capacity_blocks, Some(1 << 40), "capacity_blocks");
    let l = lifecycle(json!({"op": "join", "model": "", "block_size": null})).unwrap();
    assert_eq!(
        (l.model, l.block_size),
        (None, None),
        "empty model and nil are absent"
    );
}

#[test]
fn unknown_lifecycle_op_is_unknown_lifecycle_op() {
    for op in ["Join", "quit", ""] {
        assert_eq!(
            lifecycle(json!({"op": op})).unwrap_err().reason,
            RejectReason::UnknownLifecycleOp,
            "op {op:?} is not join, drain or leave"
        );
    }
}

#[test]
fn invalid_lifecycle_fields_are_invalid_field() {
    for case in [json!({}), json!({"op": null}), json!({"op": 1})] {
        let r = lifecycle(case.clone()).unwrap_err();
        assert_eq!(
            r.reason,
            RejectReason::InvalidField,
            "{case} has no usable op"
        );
        assert!(
            r.detail.starts_with("Lifecycle.op"),
            "detail names the field: {}",
            r.detail
        );
    }
    let cases = [
        json!({"op": "join", "block_size": 0}),
        json!({"op": "join", "block_size": -16}),
        json!({"op": "join", "block_size": "16"}),
        json!({"op": "join", "block_size": 4294967296u64}),
        json!({"op": "join", "capacity_blocks": -1}),
        json!({"op": "join", "capacity_blocks": 1.5}),
        json!({"op": "join", "model": ["m"]}),
    ];
    for case in cases {
        let (l, rejected) = decode_lifecycle(&mp(case.clone()), worker())
            .unwrap_or_else(|r| panic!("{case}: the op survives a bad field, got {r:?}"));
        assert_eq!(
            (l.model, l.block_size, l.capacity_blocks),
            (None, None, None),
            "{case}: the bad field is left out"
        );
        assert_eq!(rejected.len(), 1, "{case}: the bad field is rejected");
        assert_eq!(rejected[0].reason, RejectReason::InvalidField, "{case}");
        assert!(
            rejected[0].detail.starts_with("Lifecycle."),
            "detail names the field: {}",
            rejected[0].detail
        );
    }
    assert_eq!(
        decode_lifecycle(&mp(json!("join")), worker())
            .unwrap_err()
            .reason,
        RejectReason::MalformedPayload,
        "a bare string is not a lifecycle message"
    );
}

// ------------------------------------------------------------------------------------------
// encoders: round trips
// ------------------------------------------------------------------------------------------

#[test]
fn encoded_vllm_batch_round_trips_to_core_events() {
    let events = vec![
        VllmEvent::BlockStored {
            block_hashes: vec![u64::MAX, 5],
            parent_block_hash: Some(4),
            token_ids: vec![1, 2, 3, 4, 5, 6],
            block_size: 3,
            lora_id: Some(2),
            medium: Some("GPU".into()),
            lora_name: None,
        },
        VllmEvent::BlockRemoved {
            block_hashes: vec![5],
            medium: Some("CPU".into()),
        },
        VllmEvent::AllBlocksCleared,
    ];
    let batch = decode_ok(&encode_vllm_batch(3.5, &events, Some(4)));
    assert_eq!(batch.dp_rank, 4, "the rank round-trips");
    assert_eq!(
        batch.events,
        vec![
            KvEvent::Stored {
                parent: Some(4),
                blocks: vec![
                    StoredBlock {
                        engine_hash: u64::MAX,
                        local: local_hash(&[1, 2, 3])
                    },
                    StoredBlock {
                        engine_hash: 5,
                        local: local_hash(&[4, 5, 6])
                    },
                ],
                block_size: 3,
                lora: Some("2".into()),
                medium: Medium::Gpu,
                full_attention: true,
            },
            KvEvent::Removed {
                engine_hashes: vec![5],
                medium: Medium::Host
            },
            KvEvent::Cleared,
        ],
        "what the encoder writes, the decoder reads back"
    );
    assert_eq!(
        decode_ok(&encode_vllm_batch(0.0, &[], None)).dp_rank,
        0,
        "no rank → 0"
    );
}

#[test]
fn encoded_load_and_lifecycle_round_trip() {
    let s = decode_load(
        &encode_load(0.75, 9, 4, Some(32), 100.5, Some("m")),
        worker(),
    )
    .unwrap();
    assert_eq!(
        (
            s.kv_usage,
            s.running,
            s.waiting,
            s.max_running,
            s.model.as_deref()
        ),
        (0.75, 9, 4, Some(32), Some("m")),
        "every load field round-trips"
    );
    let s = decode_load(&encode_load(0.0, 0, 0, None, 0.0, None), worker()).unwrap();
    assert_eq!(
        (s.max_running, s.model),
        (None, None),
        "absent optionals stay absent"
    );
    for op in [LifecycleOp::Join, LifecycleOp::Drain, LifecycleOp::Leave] {
        let (l, _) = decode_lifecycle(
            &encode_lifecycle(op, Some("m"), Some(16), Some(1024)),
            worker(),
        )
        .unwrap();
        assert_eq!(
            (l.op, l.model.as_deref(), l.block_size, l.capacity_blocks),
            (op, Some("m"), Some(16), Some(1024)),
            "every lifecycle field round-trips"
        );
    }
    let (l, _) = decode_lifecycle(
        &encode_lifecycle(LifecycleOp::Leave, None, None, None),
        worker(),
    )
    .unwrap();
    assert_eq!(
        (l.model, l.block_size, l.capacity_blocks),
        (None, None, None),
        "bare op"
    );
}

// ------------------------------------------------------------------------------------------
// msgspec fixtures
// ------------------------------------------------------------------------------------------

fn fixture_dir() -> PathBuf {
    manifest_path("tests/fixtures/kv_events")
}

fn read_fixture(file: &str) -> Vec<u8> {
    let path = fixture_dir().join(file);
    std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn expected_event(e: &serde_json::Value) -> KvEvent {
    let medium = |m: &serde_json::Value| match m.as_str() {
        Some("gpu") => Medium::Gpu,
        Some("host") => Medium::Host,
        Some("disk") => Medium::Disk,
        other => panic!("expected.json: unknown medium {other:?}"),
    };
    let u64s = |v: &serde_json::Value| -> Vec<u64> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|h| h.as_u64().expect("u64"))
            .collect()
    };
    match e["kind"].as_str() {
        Some("stored") => KvEvent::Stored {
            parent: e["parent"].as_u64(),
            blocks: e["blocks"]
                .as_array()
                .expect("blocks")
                .iter()
                .map(|b| StoredBlock {
                    engine_hash: b["engine_hash"].as_u64().expect("engine_hash"),
                    local: b["local"].as_u64().expect("local"),
                })
                .collect(),
            block_size: e["block_size"].as_u64().expect("block_size") as u32,
            lora: e["lora"].as_str().map(str::to_owned),
            medium: medium(&e["medium"]),
            full_attention: e["full_attention"].as_bool().unwrap_or(true),
        },
        Some("removed") => KvEvent::Removed {
            engine_hashes: u64s(&e["engine_hashes"]),
            medium: medium(&e["medium"]),
        },
        Some("cleared") => KvEvent::Cleared,
        other => panic!("expected.json: unknown event kind {other:?}"),
    }
}

#[test]
fn vllm_fixtures_decode_as_expected() {
    let text = std::fs::read_to_string(fixture_dir().join("expected.json")).expect("expected.json");
    let expected: serde_json::Value = serde_json::from_str(&text).expect("expected.json parses");
    let fixtures = expected["fixtures"].as_array().expect("a fixtures array");
    assert!(
        fixtures.len() >= 15,
        "every fixture is described in expected.json"
    );

    let on_disk = std::fs::read_dir(fixture_dir())
        .expect("fixture dir")
        .filter(|e| {
            e.as_ref()
                .map(|e| e.path().extension().is_some_and(|x| x == "msgpack"))
                .unwrap_or(false)
        })
        .count();
    assert_eq!(
        on_disk,
        fixtures.len(),
        "every .msgpack file has an entry in expected.json"
    );

    for fx in fixtures {
        let file = fx["file"].as_str().expect("file");
        let result = decode(&read_fixture(file));
        if let Some(ok) = fx.get("ok") {
            let batch = result.unwrap_or_else(|r| panic!("{file} must decode, got {r:?}"));
            assert_eq!(
                batch.dp_rank as u64,
                ok["dp_rank"].as_u64().unwrap(),
                "{file}: dp rank"
            );
            let events: Vec<KvEvent> = ok["events"]
                .as_array()
                .expect("events")
                .iter()
                .map(expected_event)
                .collect();
            assert_eq!(
                batch.events, events,
                "{file}: decoded events match expected.json"
            );
            assert_eq!(
                (batch.seq, batch.model),
                (None, None),
                "{file}: no headers given"
            );
        } else {
            let reason = fx["error"].as_str().expect("ok or error");
            let r = result
                .map(|b| panic!("{file} must be rejected, decoded {b:?}"))
                .unwrap_err();
            assert_eq!(
                r.reason.as_str(),
                reason,
                "{file}: rejection reason ({})",
                r.detail
            );
        }
    }
}

#[test]
fn encoder_writes_the_same_bytes_as_msgspec() {
    const TS: f64 = 1700000000.25;
    let toks_a: Vec<u32> = (1..=8).collect();
    let toks_b: Vec<u32> = vec![9, 10, 11, 12];
    let big = u64::MAX - 4;
    let stored = |hashes: Vec<u64>,
                  parent: Option<u64>,
                  tokens: &Vec<u32>,
                  lora_id: Option<i64>,
                  medium: &str,
                  lora_name: Option<&str>| VllmEvent::BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: tokens.clone(),
        block_size: 4,
        lora_id,
        medium: Some(medium.into()),
        lora_name: lora_name.map(str::to_owned),
    };
    let cases: Vec<(&str, Vec<VllmEvent>, Option<u32>)> = vec![
        (
            "stored_chain_int_hashes.msgpack",
            vec![
                stored(vec![101, big], None, &toks_a, None, "GPU", None),
                stored(vec![103], Some(big), &toks_b, None, "GPU", None),
            ],
            None,
        ),
        (
            "removed.msgpack",
            vec![VllmEvent::BlockRemoved {
                block_hashes: vec![101, big, 103],
                medium: Some("GPU".into()),
            }],
            None,
        ),
        ("cleared.msgpack", vec![VllmEvent::AllBlocksCleared], None),
        (
            "dp_rank.msgpack",
            vec![stored(vec![55], None, &toks_b, None, "GPU", None)],
            Some(3),
        ),
        (
            "lora.msgpack",
            vec![
                stored(vec![61], None, &toks_b, Some(7), "GPU", Some("sql-adapter")),
                stored(vec![62], Some(61), &toks_b, Some(9), "GPU", None),
                stored(vec![63], Some(62), &toks_b, Some(9), "GPU", Some("")),
            ],
            None,
        ),
        (
            "cpu_medium.msgpack",
            vec![
                stored(vec![71], None, &toks_b, None, "CPU", None),
                VllmEvent::BlockRemoved {
                    block_hashes: vec![71],
                    medium: Some("cpu".into()),
                },
                stored(vec![72], None, &toks_b, None, "gpu", None),
            ],
            None,
        ),
    ];
    for (file, events, dp_rank) in cases {
        assert_eq!(
            encode_vllm_batch(TS, &events, dp_rank),
            read_fixture(file),
            "encode_vllm_batch must write msgspec's exact bytes for {file}"
        );
    }
}

// ------------------------------------------------------------------------------------------
// schemas/: examples and block-key vectors
// ------------------------------------------------------------------------------------------

#[test]
fn schema_examples_decode_with_their_decoders() {
    let dir = manifest_path("schemas/examples");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    let (mut kv, mut load_n, mut life) = (0, 0, 0);
    for path in paths {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).expect("example readable");
        let json: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name} is not JSON: {e}"));
        let payload = mp(json);
        if name.starts_with("kv-batch") {
            let batch = decode(&payload).unwrap_or_else(|r| panic!("{name}: {r:?}"));
            assert!(
                !batch.events.is_empty(),
                "{name}: an example batch carries events"
            );
            kv += 1;
        } else if name.starts_with("load-sample") {
            decode_load(&payload, worker()).unwrap_or_else(|r| panic!("{name}: {r:?}"));
            load_n += 1;
        } else if name.starts_with("lifecycle") {
            decode_lifecycle(&payload, worker()).unwrap_or_else(|r| panic!("{name}: {r:?}"));
            life += 1;
        } else {
            panic!("{name}: example names start with kv-batch, load-sample or lifecycle");
        }
    }
    assert!(
        kv >= 2 && load_n >= 1 && life >= 1,
        "examples exist for every payload kind"
    );
}

#[test]
fn block_key_vectors_match_the_hashing_module() {
    let path = manifest_path("schemas/block-keys.json");
    let text = std::fs::read_to_string(&path).expect("schemas/block-keys.json");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("block-keys.json parses");
    let vectors = doc["vectors"].as_array().expect("vectors");
    assert!(
        vectors.len() >= 4,
        "the design vector plus several multi-block vectors"
    );
    let u64s = |v: &serde_json::Value| -> Vec<u64> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_u64().expect("u64"))
            .collect()
    };
    let mut saw_design_vector = false;
    for v in vectors {
        let name = v["name"].as_str().expect("name");
        let bs = v["block_size"].as_u64().expect("block_size") as usize;
        let tokens: Vec<u32> = u64s(&v["tokens"]).into_iter().map(|t| t as u32).collect();
        let locals: Vec<u64> = tokens.chunks_exact(bs).map(local_hash).collect();
        assert_eq!(locals, u64s(&v["locals"]), "{name}: local hashes");
        assert_eq!(
            block_keys(&tokens, bs),
            u64s(&v["keys"]),
            "{name}: chained block keys"
        );
        saw_design_vector |= tokens == [1, 2, 3, 4] && locals == [14643705804678351452];
    }
    assert!(saw_design_vector, "the DESIGN.md §4 vector is published");
}

// ------------------------------------------------------------------------------------------
// property tests
// ------------------------------------------------------------------------------------------

/// Field names and tags that steer random maps and arrays into the decoders' deeper paths.
const WORDS: &[&str] = &[
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "type",
    "ts",
    "events",
    "data_parallel_rank",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "GPU",
    "CPU",
    "kv_usage",
    "running",
    "waiting",
    "max_running",
    "model",
    "op",
    "join",
    "drain",
    "leave",
    "capacity_blocks",
];

fn arb_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Nil),
        any::<bool>().prop_map(Value::Boolean),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0u64..20).prop_map(Value::from),
        any::<f64>().prop_map(Value::F64),
        any::<f32>().prop_map(Value::F32),
        prop::sample::select(WORDS).prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(Value::Binary),
        Just(Value::Binary(vec![7; 32])),
        (any::<i8>(), prop::collection::vec(any::<u8>(), 0..6)).prop_map(|(t, d)| Value::Ext(t, d)),
    ]
}

fn arb_value() -> impl Strategy<Value = Value> {
    arb_leaf().prop_recursive(6, 96, 10, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..10).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop_oneof![
                        prop::sample::select(WORDS).prop_map(Value::from),
                        arb_leaf()
                    ],
                    inner
                ),
                0..8
            )
            .prop_map(Value::Map),
        ]
    })
}

/// Values shaped like event fields: hash lists, token lists (plain or bigram), small ints.
fn arb_field() -> impl Strategy<Value = Value> {
    prop_oneof![
        arb_value(),
        prop::collection::vec(arb_leaf(), 0..4).prop_map(Value::Array),
        prop::collection::vec((0u32..5).prop_map(Value::from), 0..9).prop_map(Value::Array),
        prop::collection::vec(
            prop::collection::vec((0u32..5).prop_map(Value::from), 1..4).prop_map(Value::Array),
            0..9
        )
        .prop_map(Value::Array),
        (0u32..5).prop_map(Value::from),
    ]
}

fn arb_event() -> impl Strategy<Value = Value> {
    let tag = prop_oneof![
        prop::sample::select(&WORDS[..3]).prop_map(Value::from),
        arb_leaf()
    ];
    prop_oneof![
        (tag.clone(), prop::collection::vec(arb_field(), 0..12)).prop_map(|(tag, fields)| {
            Value::Array(std::iter::once(tag).chain(fields).collect())
        }),
        (
            tag,
            prop::collection::vec((prop::sample::select(WORDS), arb_field()), 0..10)
        )
            .prop_map(|(tag, fields)| {
                Value::Map(
                    std::iter::once((Value::from("type"), tag))
                        .chain(fields.into_iter().map(|(k, v)| (Value::from(k), v)))
                        .collect(),
                )
            }),
    ]
}

fn decode_everything(payload: &[u8]) {
    let _ = decode(payload);
    let _ = decode_load(payload, worker());
    let _ = decode_lifecycle(payload, worker());
}

/// A `BlockStored` whose token count is consistent, and the core event it must decode to.
fn arb_consistent_stored() -> impl Strategy<Value = (VllmEvent, KvEvent)> {
    (
        1u32..6,
        0usize..4,
        any::<Option<u64>>(),
        any::<Option<i64>>(),
        any::<bool>(),
    )
        .prop_flat_map(|(bs, n, parent, lora_id, gpu)| {
            (
                prop::collection::vec(any::<u64>(), n),
                prop::collection::vec(any::<u32>(), n * bs as usize),
                Just((bs, parent, lora_id, gpu)),
            )
        })
        .prop_map(|(hashes, tokens, (bs, parent, lora_id, gpu))| {
            let medium = if gpu { "GPU" } else { "CPU" };
            let core = KvEvent::Stored {
                parent,
                blocks: hashes
                    .iter()
                    .zip(tokens.chunks_exact(bs as usize))
                    .map(|(&engine_hash, t)| StoredBlock {
                        engine_hash,
                        local: local_hash(t),
                    })
                    .collect(),
                block_size: bs,
                lora: lora_id.map(|id| id.to_string()),
                medium: if gpu { Medium::Gpu } else { Medium::Host },
                full_attention: true,
            };
            let wire = VllmEvent::BlockStored {
                block_hashes: hashes,
                parent_block_hash: parent,
                token_ids: tokens,
                block_size: bs,
                lora_id,
                medium: Some(medium.into()),
                lora_name: None,
            };
            (wire, core)
        })
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic_any_decoder(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        decode_everything(&bytes);
    }

    #[test]
    fn arbitrary_msgpack_values_never_panic_any_decoder(v in arb_value()) {
        decode_everything(&mpv(&v));
    }

    #[test]
    fn event_shaped_values_never_panic_the_kv_decoder(
        // Mostly valid batch fields, so that most cases reach the events.
        ts in prop_oneof![3 => Just(Value::F64(1.0)), 1 => arb_leaf()],
        events in prop::collection::vec(arb_event(), 0..4),
        rank in prop_oneof![3 => Just(Value::Nil), 1 => arb_leaf()],
        as_map in any::<bool>(),
    ) {
        let batch = if as_map {
            Value::Map(vec![
                (Value::from("ts"), ts),
                (Value::from("events"), Value::Array(events)),
                (Value::from("data_parallel_rank"), rank),
            ])
        } else {
            Value::Array(vec![ts, Value::Array(events), rank])
        };
        let _ = decode(&mpv(&batch));
    }

    #[test]
    fn truncated_valid_batches_are_rejected_not_panicking(cut in 0usize..200) {
        let payload = read_fixture("stored_chain_int_hashes.msgpack");
        let cut = cut.min(payload.len().saturating_sub(1));
        let r = decode(&payload[..cut]);
        prop_assert!(r.is_err(), "a strict prefix of a batch is never a valid batch");
    }

    #[test]
    fn consistent_stored_events_round_trip_through_the_encoder(
        pairs in prop::collection::vec(arb_consistent_stored(), 0..4),
        dp in any::<Option<u32>>(),
    ) {
        let (wire, core): (Vec<VllmEvent>, Vec<KvEvent>) = pairs.into_iter().unzip();
        let batch = decode(&encode_vllm_batch(1.0, &wire, dp)).expect("encoder output decodes");
        prop_assert_eq!(batch.events, core, "decoded events equal the encoded ones");
        prop_assert_eq!(batch.dp_rank, dp.unwrap_or(0), "dp rank round-trips");
    }
}
