//! Lifecycle messages (DESIGN.md §3.3): `kv.workers.<worker>`.
//!
//! A map `{op, model?, block_size?, capacity_blocks?}`; unknown keys are ignored and nil counts
//! as absent for the optional fields.

use rmpv::ValueRef;

use super::value::{as_str, got, kind, map_get, present, read_single, shorten};
use crate::input::{Lifecycle, LifecycleOp, RejectReason, Rejection, WorkerId};

/// Decodes a `kv.workers.<worker>` payload.
///
/// `op` is required and must be exactly `join`, `drain` or `leave` (another string is
/// `UnknownLifecycleOp`, so an operator sees a typo'd op counted under its own reason rather than
/// lost among type errors). `model` is a string (empty means none), `block_size` a positive
/// integer fitting u32, `capacity_blocks` a non-negative integer.
pub fn decode_lifecycle(payload: &[u8], worker: WorkerId) -> Result<Lifecycle, Rejection> {
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

    let model = match present(map_get(entries, "model")) {
        None => None,
        Some(v) => match as_str(v) {
            Some(m) => Some(m).filter(|m| !m.is_empty()).map(str::to_owned),
            None => return Err(invalid(format!("model: expected a string, got {}", got(v)))),
        },
    };
    let block_size = match present(map_get(entries, "block_size")) {
        None => None,
        Some(v) => match v {
            ValueRef::Integer(i) => match i.as_u64().and_then(|n| u32::try_from(n).ok()) {
                Some(bs) if bs > 0 => Some(bs),
                _ => None,
            },
            _ => None,
        }
        .map(Some)
        .ok_or_else(|| {
            invalid(format!(
                "block_size: expected a positive integer fitting u32, got {}",
                got(v)
            ))
        })?,
    };
    let capacity_blocks = match present(map_get(entries, "capacity_blocks")) {
        None => None,
        Some(v) => match v {
            ValueRef::Integer(i) => i.as_u64(),
            _ => None,
        }
        .map(Some)
        .ok_or_else(|| {
            invalid(format!(
                "capacity_blocks: expected a non-negative integer, got {}",
                got(v)
            ))
        })?,
    };

    let dp_size = match present(map_get(entries, "dp_size")) {
        None => None,
        Some(v) => match v {
            ValueRef::Integer(i) => i.as_u64().and_then(|n| u32::try_from(n).ok()),
            _ => None,
        }
        .map(Some)
        .ok_or_else(|| {
            invalid(format!(
                "dp_size: expected a non-negative integer fitting u32, got {}",
                got(v)
            ))
        })?,
    };
    let epoch = match present(map_get(entries, "epoch")) {
        None => None,
        Some(v) => match as_str(v) {
            Some(e) if !e.is_empty() && e.len() <= 64 => Some(e.to_owned()),
            _ => {
                return Err(invalid(format!(
                    "epoch: expected a string of 1 to 64 characters, got {}",
                    got(v)
                )))
            }
        },
    };

    Ok(Lifecycle {
        worker,
        op,
        model,
        block_size,
        capacity_blocks,
        dp_size,
        epoch,
    })
}

fn invalid(detail: String) -> Rejection {
    Rejection::new(RejectReason::InvalidField, format!("Lifecycle.{detail}"))
}
