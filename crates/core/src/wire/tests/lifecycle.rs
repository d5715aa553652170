//! Lifecycle messages.

use super::*;

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
