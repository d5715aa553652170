//! The `Kv-Seq`, `Kv-Model` and `Kv-Dp-Rank` headers.

use super::*;

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
