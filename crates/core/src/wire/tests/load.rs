//! Load samples.

use super::*;
use crate::input::MAX_LOAD_COUNT;

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
fn queue_counts_above_a_million_are_rejected_so_pressure_stays_bounded() {
    // u32::MAX running and waiting over max_running 1 made a pressure of 8.6e9.
    for field in ["running", "waiting", "max_running"] {
        let mut sample = json!({"kv_usage": 0.5, "running": 1, "waiting": 1, "max_running": 1});
        sample[field] = json!(u32::MAX);
        assert_eq!(
            load(sample.clone()).unwrap_err().reason,
            RejectReason::InvalidLoadValue,
            "{field} = u32::MAX is out of range"
        );
        sample[field] = json!(MAX_LOAD_COUNT + 1);
        assert_eq!(
            load(sample.clone()).unwrap_err().reason,
            RejectReason::InvalidLoadValue,
            "{field} just above the bound is out of range"
        );
    }
    let at_bound = load(json!({
        "kv_usage": 0.5, "running": MAX_LOAD_COUNT, "waiting": MAX_LOAD_COUNT, "max_running": 1
    }))
    .unwrap();
    assert_eq!(
        at_bound.pressure(),
        2.0 * MAX_LOAD_COUNT as f64,
        "the largest accepted sample's pressure is the documented bound"
    );
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
