//! Event layouts (tagged array, tagged map) and tags.

use super::*;

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
