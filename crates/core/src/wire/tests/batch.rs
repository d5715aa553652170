//! Batch shapes (array, legacy array, map) and the dp rank.

use super::*;

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
