//! Tests for the wire decoders and encoders, one module per subject: behaviour by behaviour
//! (headers, batch shapes, events, `BlockStored`, load samples, lifecycle, encoder round
//! trips), then the msgspec byte fixtures (`tests/fixtures/kv_events/`), the schema examples
//! and block-key vectors (`schemas/`), and property tests that no input makes a decoder panic.
//! The helpers below are shared by every module.

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use rmpv::Value;
use serde_json::json;

use super::fast::decode_vllm_array;
use super::kv::decode_tolerant;
use super::*;
use crate::hashing::{block_keys, local_hash};
use crate::input::{
    KvEvent, KvEventBatch, LifecycleOp, Medium, RejectReason, Rejection, StoredBlock, WorkerId,
};

mod batch;
mod engine_fields;
mod engine_hashes;
mod engine_layouts;
mod events;
mod fixtures;
mod headers;
mod lifecycle;
mod load;
mod properties;
mod round_trip;
mod schemas;
mod stored;

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

/// A path under the repository root (fixtures and schemas are shared with the daemon's tests).
fn manifest_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

fn fixture_dir() -> PathBuf {
    manifest_path("tests/fixtures/kv_events")
}

fn read_fixture(file: &str) -> Vec<u8> {
    let path = fixture_dir().join(file);
    std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// `[ts, [event], nil]`: vLLM's array batch of one event.
fn array_batch_of(event: Value) -> Vec<u8> {
    mpv(&Value::Array(vec![
        Value::F64(1.5),
        Value::Array(vec![event]),
        Value::Nil,
    ]))
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
