//! Load samples (docs/architecture.md, "Load samples"): `kv.load.<worker>`.
//!
//! A map `{kv_usage, running, waiting, max_running?, ts?, model?}`. Unknown keys are ignored so
//! workers can add their own telemetry; nil counts as absent for the optional fields.
//!
//! Values feed the pressure the policy compares against its limits, so a sample that is NaN,
//! infinite or out of range is rejected (`InvalidLoadValue`) rather than clamped: a clamped
//! value would look like healthy telemetry and pull or push traffic for no real reason.

use rmpv::ValueRef;

use super::kv::MAX_NAME_LEN;
use super::value::{as_number, as_str, got, kind, map_get, present, read_single};
use crate::input::{LoadSample, RejectReason, Rejection, WorkerId, MAX_LOAD_COUNT};

/// Decodes and validates a `kv.load.<worker>` payload.
///
/// `kv_usage` must be a finite number in 0..=1 (an integer 0 or 1 is fine); `running`, `waiting`
/// and `max_running` integers in 0..=[`MAX_LOAD_COUNT`]; `ts` (the worker's clock, informational:
/// staleness is judged by the daemon's receive time) a finite number; `model` a string of at most
/// 256 bytes (empty means none). The data-parallel rank is not in the payload: the caller sets it
/// from the `Kv-Dp-Rank` header. Wrong types and missing required keys are `InvalidField`;
/// non-finite or out-of-range values are `InvalidLoadValue`.
pub fn decode_load(payload: &[u8], worker: WorkerId) -> Result<LoadSample, Rejection> {
    let root = read_single(payload, "load sample")?;
    let ValueRef::Map(entries) = &root else {
        return Err(Rejection::new(
            RejectReason::MalformedPayload,
            format!("load sample: expected a map, got {}", kind(&root)),
        ));
    };

    let kv_usage = required(entries, "kv_usage")?;
    let kv_usage = match as_number(kv_usage) {
        Some(u) if u.is_finite() && (0.0..=1.0).contains(&u) => u,
        Some(u) => {
            return Err(out_of_range(
                "kv_usage",
                "a finite number in 0..=1",
                &u.to_string(),
            ))
        }
        None => return Err(wrong_type("kv_usage", "a number", kv_usage)),
    };
    let running = count(required(entries, "running")?, "running")?;
    let waiting = count(required(entries, "waiting")?, "waiting")?;
    let max_running = present(map_get(entries, "max_running"))
        .map(|v| count(v, "max_running"))
        .transpose()?;
    if let Some(ts) = present(map_get(entries, "ts")) {
        match as_number(ts) {
            Some(t) if t.is_finite() => {}
            Some(t) => return Err(out_of_range("ts", "a finite number", &t.to_string())),
            None => return Err(wrong_type("ts", "a number", ts)),
        }
    }
    let model = match present(map_get(entries, "model")) {
        None => None,
        Some(v) => match as_str(v) {
            Some(m) if m.len() <= MAX_NAME_LEN => {
                Some(m).filter(|m| !m.is_empty()).map(str::to_owned)
            }
            _ => return Err(wrong_type("model", "a string of at most 256 bytes", v)),
        },
    };

    Ok(LoadSample {
        worker,
        kv_usage,
        running,
        waiting,
        max_running,
        model,
        // The payload carries no rank: ingest fills it from the `Kv-Dp-Rank` header.
        dp_rank: 0,
    })
}

fn required<'v, 'a>(
    entries: &'v [(ValueRef<'a>, ValueRef<'a>)],
    field: &str,
) -> Result<&'v ValueRef<'a>, Rejection> {
    present(map_get(entries, field)).ok_or_else(|| {
        Rejection::new(
            RejectReason::InvalidField,
            format!("LoadSample.{field}: missing required field"),
        )
    })
}

/// An integer in 0..=[`MAX_LOAD_COUNT`]: other kinds are the wrong type, other integers are
/// out of range.
fn count(v: &ValueRef<'_>, field: &str) -> Result<u32, Rejection> {
    match v {
        ValueRef::Integer(i) => i
            .as_u64()
            .filter(|&n| n <= u64::from(MAX_LOAD_COUNT))
            .map(|n| n as u32)
            .ok_or_else(|| {
                out_of_range(
                    field,
                    &format!("an integer in 0..={MAX_LOAD_COUNT}"),
                    &got(v),
                )
            }),
        other => Err(wrong_type(field, "a non-negative integer", other)),
    }
}

fn wrong_type(field: &str, expected: &str, v: &ValueRef<'_>) -> Rejection {
    Rejection::new(
        RejectReason::InvalidField,
        format!("LoadSample.{field}: expected {expected}, got {}", got(v)),
    )
}

fn out_of_range(field: &str, expected: &str, value: &str) -> Rejection {
    Rejection::new(
        RejectReason::InvalidLoadValue,
        format!("LoadSample.{field}: expected {expected}, got {value}"),
    )
}
