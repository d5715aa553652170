//! Lifecycle messages (docs/architecture.md, "Lifecycle messages"): `kv.workers.<worker>`.
//!
//! A map `{op, model?, block_size?, capacity_blocks?, dp_size?, epoch?}`; unknown keys are
//! ignored and nil counts as absent for the optional fields.
//!
//! Only an unusable payload or `op` rejects the message. A bad optional field is rejected on its
//! own (returned, so it is counted) and the op still applied without it: a `drain` whose
//! `block_size` has the wrong type must still drain, and a `leave` must still leave.

use rmpv::ValueRef;

use super::is_valid_epoch;
use super::kv::MAX_NAME_LEN;
use super::value::{as_str, got, kind, map_get, present, read_single, shorten};
use crate::input::{Lifecycle, LifecycleOp, RejectReason, Rejection, WorkerId};

/// Decodes a `kv.workers.<worker>` payload into the lifecycle message and the rejections of its
/// bad optional fields (each left out of the message).
///
/// `op` is required and must be exactly `join`, `drain` or `leave` (another string is
/// `UnknownLifecycleOp`, so an operator sees a typo'd op counted under its own reason rather than
/// lost among type errors); a payload that is not a map, or has no string `op`, is rejected
/// whole. Optional fields: `model` a string of at most 256 bytes (empty means none),
/// `block_size` and `dp_size` positive integers fitting u32, `capacity_blocks` a non-negative
/// integer, `epoch` 1 to 64 printable ASCII characters without spaces (as the `Kv-Epoch`
/// header). A field breaking its rule is `InvalidField`.
pub fn decode_lifecycle(
    payload: &[u8],
    worker: WorkerId,
) -> Result<(Lifecycle, Vec<Rejection>), Rejection> {
    let root = read_single(payload, "lifecycle message")?;
    let ValueRef::Map(entries) = &root else {
        return Err(Rejection::new(
            RejectReason::MalformedPayload,
            format!("lifecycle message: expected a map, got {}", kind(&root)),
        ));
    };

    let Some(op) = present(map_get(entries, "op")) else {
        return Err(invalid("op: missing required field".to_owned()));
    };
    let op = match as_str(op) {
        Some("join") => LifecycleOp::Join,
        Some("drain") => LifecycleOp::Drain,
        Some("leave") => LifecycleOp::Leave,
        Some(other) => {
            return Err(Rejection::new(
                RejectReason::UnknownLifecycleOp,
                format!(
                    "Lifecycle.op: expected join, drain or leave, got {:?}",
                    shorten(other)
                ),
            ))
        }
        None => return Err(invalid(format!("op: expected a string, got {}", got(op)))),
    };

    let mut rejections = Vec::new();
    let r = &mut rejections;
    let model = optional(entries, "model", "a string of at most 256 bytes", &name, r)
        .filter(|m| !m.is_empty());
    let block_size = optional(entries, "block_size", POSITIVE_U32, &positive_u32, r);
    let capacity_blocks = optional(
        entries,
        "capacity_blocks",
        "a non-negative integer",
        &as_u64,
        r,
    );
    let dp_size = optional(entries, "dp_size", POSITIVE_U32, &positive_u32, r);
    let epoch = optional(entries, "epoch", EPOCH, &epoch_string, r);

    Ok((
        Lifecycle {
            worker,
            op,
            model,
            block_size,
            capacity_blocks,
            dp_size,
            epoch,
        },
        rejections,
    ))
}

/// The optional field `name` read by `read`; a present value it cannot read is rejected into
/// `rejections` and treated as absent.
fn optional<T>(
    entries: &[(ValueRef<'_>, ValueRef<'_>)],
    name: &str,
    expected: &str,
    read: &dyn Fn(&ValueRef<'_>) -> Option<T>,
    rejections: &mut Vec<Rejection>,
) -> Option<T> {
    let v = present(map_get(entries, name))?;
    let value = read(v);
    if value.is_none() {
        rejections.push(invalid(format!(
            "{name}: expected {expected}, got {}",
            got(v)
        )));
    }
    value
}

fn as_u64(v: &ValueRef<'_>) -> Option<u64> {
    match v {
        ValueRef::Integer(i) => i.as_u64(),
        _ => None,
    }
}

const POSITIVE_U32: &str = "a positive integer fitting u32";
const EPOCH: &str = "1 to 64 printable ASCII characters without spaces";

fn name(v: &ValueRef<'_>) -> Option<String> {
    as_str(v)
        .filter(|m| m.len() <= MAX_NAME_LEN)
        .map(str::to_owned)
}

/// The `Kv-Epoch` rule; a lifecycle `epoch` is not trimmed (it is not a header).
fn epoch_string(v: &ValueRef<'_>) -> Option<String> {
    as_str(v).filter(|s| is_valid_epoch(s)).map(str::to_owned)
}

fn positive_u32(v: &ValueRef<'_>) -> Option<u32> {
    as_u64(v)
        .and_then(|n| u32::try_from(n).ok())
        .filter(|&n| n > 0)
}

fn invalid(detail: String) -> Rejection {
    Rejection::new(RejectReason::InvalidField, format!("Lifecycle.{detail}"))
}
