//! KV event batches (docs/architecture.md, "KV event batches"): exactly what vLLM's, SGLang's and
//! TensorRT-LLM's ZMQ KV-event publishers emit, so a worker (or the bridge) forwards the third ZMQ
//! frame untouched.
//!
//! Those publishers encode msgspec structs. In practice that means:
//!
//! - a batch is `[ts, events, dp_rank]` (vLLM's `data_parallel_rank`, SGLang's `attn_dp_rank`);
//!   releases before data-parallel support send `[ts, events]`; a publisher building plain dicts
//!   sends `{ts, events, data_parallel_rank}`;
//! - an event is a tagged map `{"type": tag, name: value}` in current releases (vLLM 0.33,
//!   SGLang 0.5.23: `tag=True, omit_defaults=True`, so fields left at None are absent), or a
//!   tagged array `[tag, field, field, ...]` in declaration order in older ones (`array_like`:
//!   msgspec writes every declared field, `None` as nil, but releases differ in how many fields
//!   they declare, so every field after the required ones may be missing or nil);
//! - fields a release adds are ignored, by name or past the last known position.
//!
//! The engine's block hashes are opaque to kvrouted: the core keys blocks by their content
//! ([`crate::hashing`]), so each stored block's tokens are hashed here, in the adapter, into its
//! local hash. The engine hash is kept only to resolve parents and removals.
//!
//! A batch is applied all or nothing: one invalid event rejects the whole batch, because applying
//! the events around a hole would leave the worker's chain of parents silently wrong.

use rmpv::ValueRef;

use super::value::{as_number, as_str, as_u32, got, kind, map_get, present, read_single, shorten};
use super::KvHeaders;
use crate::hashing::local_hash;
use crate::input::{KvEvent, KvEventBatch, Medium, RejectReason, Rejection, StoredBlock, WorkerId};

pub(super) use crate::input::MAX_NAME_LEN;

/// Decodes a `kv.events.<worker>` payload into the core's batch.
///
/// The data-parallel rank comes from the `Kv-Dp-Rank` header if present, else from the batch's
/// own field, else 0. `ts` is the engine's clock and only informational: it must be a number if
/// present, but the core never reads it (staleness uses the daemon's clock).
///
/// Rejections: not MessagePack, trailing bytes, or a top level that is not a batch →
/// `MalformedPayload`; a field of the wrong type or range → `InvalidField` (the detail names the
/// event type, the field and the event's index); an unknown event tag → `UnknownEventTag`;
/// `token_ids` not holding `block_size` tokens per block hash → `TokenCountMismatch`.
pub fn decode_kv_batch(
    payload: &[u8],
    worker: WorkerId,
    headers: KvHeaders,
) -> Result<KvEventBatch, Rejection> {
    let (batch_dp_rank, events) = match super::fast::decode_vllm_array(payload) {
        Some(decoded) => decoded,
        None => decode_tolerant(payload)?,
    };
    Ok(KvEventBatch {
        worker,
        model: headers.model,
        dp_rank: headers.dp_rank.or(batch_dp_rank).unwrap_or(0),
        seq: headers.seq,
        epoch: headers.epoch,
        events,
    })
}

/// Every accepted form, through an [`rmpv`] value tree: the batch's dp rank and its events.
pub(super) fn decode_tolerant(payload: &[u8]) -> Result<(Option<u32>, Vec<KvEvent>), Rejection> {
    let root = read_single(payload, "KV event batch")?;
    let (ts, events, batch_dp_rank) = match &root {
        ValueRef::Array(items) if items.len() >= 2 => (items.first(), &items[1], items.get(2)),
        ValueRef::Array(items) => {
            return Err(malformed(format!(
                "KV event batch: expected [ts, events] or [ts, events, dp_rank], got an array of {} elements",
                items.len()
            )))
        }
        ValueRef::Map(entries) => match map_get(entries, "events") {
            Some(events) => (
                map_get(entries, "ts"),
                events,
                map_get(entries, "data_parallel_rank").or_else(|| map_get(entries, "attn_dp_rank")),
            ),
            None => {
                return Err(malformed(
                    "KV event batch: map without an \"events\" key".to_owned(),
                ))
            }
        },
        other => {
            return Err(malformed(format!(
                "KV event batch: expected an array or a map, got {}",
                kind(other)
            )))
        }
    };

    if let Some(ts) = present(ts) {
        match as_number(ts) {
            Some(t) if t.is_finite() => {}
            _ => {
                return Err(invalid(format!(
                    "EventBatch.ts: expected a finite number, got {}",
                    got(ts)
                )))
            }
        }
    }
    let batch_dp_rank = match present(batch_dp_rank) {
        None => None,
        Some(v) => Some(as_u32(v).ok_or_else(|| {
            invalid(format!(
                "EventBatch.data_parallel_rank: expected a non-negative integer fitting u32, got {}",
                got(v)
            ))
        })?),
    };
    let events = match events {
        ValueRef::Array(events) => events,
        other => {
            return Err(invalid(format!(
                "EventBatch.events: expected an array, got {}",
                got(other)
            )))
        }
    };

    // One token buffer for the whole batch: every stored event refills it.
    let mut tokens = Vec::new();
    let decoded = events
        .iter()
        .enumerate()
        .map(|(index, event)| decode_event(event, index, &mut tokens))
        .collect::<Result<Vec<_>, _>>()?;

    Ok((batch_dp_rank, decoded))
}

/// An event's fields in either msgspec layout.
enum Fields<'v, 'a> {
    /// `[tag, f0, f1, ...]`: the elements after the tag, in declaration order.
    Positional(&'v [ValueRef<'a>]),
    /// `{"type": tag, name: value, ...}`.
    Named(&'v [(ValueRef<'a>, ValueRef<'a>)]),
}

impl<'v, 'a> Fields<'v, 'a> {
    /// The field at declaration position `pos` (counted after the tag), called `name`.
    fn get(&self, pos: usize, name: &str) -> Option<&'v ValueRef<'a>> {
        match self {
            Fields::Positional(items) => items.get(pos),
            Fields::Named(entries) => map_get(entries, name),
        }
    }
}

/// Names the event being decoded, so a detail reads
/// `BlockStored.block_size: expected a positive integer, got string (event 2)`.
#[derive(Clone, Copy)]
struct Ctx {
    event: &'static str,
    index: usize,
}

impl Ctx {
    fn reject(self, reason: RejectReason, field: &str, msg: impl std::fmt::Display) -> Rejection {
        Rejection::new(
            reason,
            format!("{}.{field}: {msg} (event {})", self.event, self.index),
        )
    }

    fn invalid(self, field: &str, expected: &str, got_value: &ValueRef<'_>) -> Rejection {
        self.reject(
            RejectReason::InvalidField,
            field,
            format_args!("expected {expected}, got {}", got(got_value)),
        )
    }

    fn missing(self, field: &str) -> Rejection {
        self.reject(RejectReason::InvalidField, field, "missing required field")
    }
}

fn decode_event(
    event: &ValueRef<'_>,
    index: usize,
    tokens: &mut Vec<u32>,
) -> Result<KvEvent, Rejection> {
    let generic = Ctx {
        event: "event",
        index,
    };
    let (tag, fields) = match event {
        ValueRef::Array(items) => match items.split_first() {
            Some((tag, rest)) => (tag, Fields::Positional(rest)),
            None => return Err(generic.missing("tag")),
        },
        ValueRef::Map(entries) => match map_get(entries, "type") {
            Some(tag) => (tag, Fields::Named(entries)),
            None => return Err(generic.missing("type")),
        },
        other => {
            return Err(generic.reject(
                RejectReason::InvalidField,
                "layout",
                format_args!("expected a tagged array or map, got {}", got(other)),
            ))
        }
    };
    let Some(tag) = as_str(tag) else {
        return Err(generic.invalid("tag", "a string", tag));
    };
    match tag {
        "BlockStored" => decode_stored(
            &fields,
            Ctx {
                event: "BlockStored",
                index,
            },
            tokens,
        ),
        "BlockRemoved" => decode_removed(
            &fields,
            Ctx {
                event: "BlockRemoved",
                index,
            },
        ),
        // No fields; anything a future release adds is ignored.
        "AllBlocksCleared" => Ok(KvEvent::Cleared),
        other => Err(Rejection::new(
            RejectReason::UnknownEventTag,
            format!(
                "unknown event tag {:?} (event {index}): expected BlockStored, BlockRemoved or AllBlocksCleared",
                shorten(other)
            ),
        )),
    }
}

/// `BlockStored`: `block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
/// lora_name, extra_keys, group_idx, ...`; the first four are required (a map may omit the
/// parent, meaning none).
fn decode_stored(
    fields: &Fields<'_, '_>,
    ctx: Ctx,
    tokens: &mut Vec<u32>,
) -> Result<KvEvent, Rejection> {
    // Engine hashes go straight into the output blocks; locals are filled in once the tokens
    // are known.
    let hashes = fields
        .get(0, "block_hashes")
        .ok_or_else(|| ctx.missing("block_hashes"))?;
    let mut blocks = engine_hashes(hashes, ctx, "block_hashes", |engine_hash| StoredBlock {
        engine_hash,
        local: 0,
    })?;

    let parent = match present(fields.get(1, "parent_block_hash")) {
        None => None,
        Some(v) => {
            Some(engine_hash(v).ok_or_else(|| ctx.invalid("parent_block_hash", HASH_EXPECTED, v))?)
        }
    };

    let token_ids = fields
        .get(2, "token_ids")
        .ok_or_else(|| ctx.missing("token_ids"))?;
    let ValueRef::Array(token_ids) = token_ids else {
        return Err(ctx.invalid("token_ids", "an array of token ids", token_ids));
    };

    let block_size = fields
        .get(3, "block_size")
        .ok_or_else(|| ctx.missing("block_size"))?;
    let block_size = match as_u32(block_size) {
        Some(bs) if bs > 0 => bs,
        _ => return Err(ctx.invalid("block_size", "a positive integer", block_size)),
    };
    let bs = block_size as usize;

    let expected = blocks.len().checked_mul(bs);
    if expected != Some(token_ids.len()) {
        return Err(ctx.reject(
            RejectReason::TokenCountMismatch,
            "token_ids",
            format_args!(
                "{} tokens for {} block hashes of block_size {block_size}: expected exactly block_hashes × block_size",
                token_ids.len(),
                blocks.len()
            ),
        ));
    }
    read_tokens(token_ids, ctx, tokens)?;
    for (block, block_tokens) in blocks.iter_mut().zip(tokens.chunks_exact(bs)) {
        block.local = local_hash(block_tokens);
    }

    // The LoRA namespace: the adapter's name when the engine sends one (vLLM ≥ the release
    // that added `lora_name`), else its numeric id, which older releases send alone.
    let lora_id = match present(fields.get(4, "lora_id")) {
        None => None,
        Some(ValueRef::Integer(id)) => Some(id),
        Some(other) => return Err(ctx.invalid("lora_id", "an integer or nil", other)),
    };
    let medium = medium(fields.get(5, "medium"), ctx)?;
    let lora_name = match (&fields, present(fields.get(6, "lora_name"))) {
        (_, None) => None,
        // SGLang's older array layout puts a metadata map (`{cache_salt}`) at this position.
        (Fields::Positional(_), Some(ValueRef::Map(_))) => None,
        (_, Some(v)) => match as_str(v) {
            Some(name) if name.len() <= MAX_NAME_LEN => Some(name),
            Some(name) => {
                return Err(ctx.reject(
                    RejectReason::InvalidField,
                    "lora_name",
                    format_args!(
                        "{} bytes is longer than the {MAX_NAME_LEN}-byte limit",
                        name.len()
                    ),
                ))
            }
            None => return Err(ctx.invalid("lora_name", "a string or nil", v)),
        },
    };
    let lora = match lora_name.filter(|name| !name.is_empty()) {
        Some(name) => Some(name.to_owned()),
        None => lora_id.map(|id| id.to_string()),
    };
    // `extra_keys` (multimodal hashes, cache salt, per-block LoRA keys), `group_idx` (the KV
    // cache group of hybrid models) and every later field (`kv_cache_spec_sliding_window`,
    // `locality`, `ownership`, `session_id`, `lookahead_token_ids`; SGLang's `cache_salt`;
    // TensorRT-LLM's `mm_keys`) are accepted and ignored: content keys come from the tokens, and
    // the (model, LoRA) namespace from `lora_name`/`lora_id`. None is even type-checked, so their
    // evolving shapes never reject an otherwise good event.
    let full_attention = match present(fields.get(SPEC_KIND_POS, "kv_cache_spec_kind")) {
        Some(v) => as_str(v).is_none_or(is_full_attention_kind),
        None => true,
    };

    Ok(KvEvent::Stored {
        parent,
        blocks,
        block_size,
        lora,
        medium,
        full_attention,
    })
}

/// `BlockRemoved`: `block_hashes, medium, group_idx, ...`; only `block_hashes` is required.
fn decode_removed(fields: &Fields<'_, '_>, ctx: Ctx) -> Result<KvEvent, Rejection> {
    let hashes = fields
        .get(0, "block_hashes")
        .ok_or_else(|| ctx.missing("block_hashes"))?;
    let engine_hashes = engine_hashes(hashes, ctx, "block_hashes", |h| h)?;
    let medium = medium(fields.get(1, "medium"), ctx)?;
    // `group_idx` is accepted and ignored, as for BlockStored.
    Ok(KvEvent::Removed {
        engine_hashes,
        medium,
    })
}

/// Position of `kv_cache_spec_kind` after the tag in vLLM's positional `BlockStored`:
/// `block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
/// extra_keys, group_idx, kv_cache_spec_kind, ...`.
pub(super) const SPEC_KIND_POS: usize = 9;

/// Whether a `kv_cache_spec_kind` names a full-attention KV cache group, whose blocks hold the
/// whole prefix (vLLM's `KVCacheSpecKind`: `full_attention`, `mla_attention` and
/// `sink_full_attention`). Every other kind (`sliding_window`, `sliding_window_mla`,
/// `chunked_local_attention`, `mamba`, `encoder_only_attention`, `cross_attention`,
/// `unknown`) and any string not listed keeps only part of the prefix, so it is no proof that
/// the prefix is cached.
pub(super) fn is_full_attention_kind(kind: &str) -> bool {
    ["full_attention", "mla_attention", "sink_full_attention"]
        .iter()
        .any(|k| kind.eq_ignore_ascii_case(k))
}

const HASH_EXPECTED: &str =
    "an integer hash, or a binary hash of 8 bytes or a multiple of 16 bytes";

/// One engine block hash as u64: integers of any width (a negative int64, Python's `hash()`,
/// reinterpreted as u64), or a binary digest by [`bin_hash`].
fn engine_hash(v: &ValueRef<'_>) -> Option<u64> {
    match v {
        ValueRef::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|n| n as u64)),
        ValueRef::Binary(b) => bin_hash(b),
        _ => None,
    }
}

/// A binary block hash as u64: its last 8 bytes, big-endian, which is exactly what vLLM sends
/// in its integer mode (`int.from_bytes(digest, "big") & (2**64 - 1)`). Accepted lengths are
/// 8, or a multiple of 16: xxh3-128 (16 bytes), sha256 (32), and older hybrid-model builds that
/// concatenated one digest per KV cache group. Anything else is not a digest we know.
pub(super) fn bin_hash(b: &[u8]) -> Option<u64> {
    let len = b.len();
    if len == 8 || (len >= 16 && len.is_multiple_of(16)) {
        let tail: [u8; 8] = b[len - 8..].try_into().ok()?;
        Some(u64::from_be_bytes(tail))
    } else {
        None
    }
}

fn engine_hashes<T>(
    v: &ValueRef<'_>,
    ctx: Ctx,
    field: &str,
    wrap: impl Fn(u64) -> T,
) -> Result<Vec<T>, Rejection> {
    let ValueRef::Array(items) = v else {
        return Err(ctx.invalid(field, "an array of block hashes", v));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match engine_hash(item) {
            Some(h) => Ok(wrap(h)),
            None => Err(ctx.invalid(&format!("{field}[{i}]"), HASH_EXPECTED, item)),
        })
        .collect()
}

/// Token ids into `out`: plain `[t0, t1, ...]`, or SGLang's EAGLE bigrams
/// `[[t0, t1], [t1, t2], ...]` whose first elements are the tokens (one pair per token
/// position, so the count rule is the same). The first element decides the form.
fn read_tokens(items: &[ValueRef<'_>], ctx: Ctx, out: &mut Vec<u32>) -> Result<(), Rejection> {
    out.clear();
    out.reserve(items.len());
    let bigram = matches!(items.first(), Some(ValueRef::Array(_)));
    for (i, item) in items.iter().enumerate() {
        let token = if bigram {
            match item {
                ValueRef::Array(pair) if pair.len() == 2 => {
                    match (as_u32(&pair[0]), as_u32(&pair[1])) {
                        (Some(first), Some(_)) => Some(first),
                        _ => None,
                    }
                }
                _ => None,
            }
        } else {
            as_u32(item)
        };
        match token {
            Some(t) => out.push(t),
            None if bigram => {
                return Err(ctx.invalid(
                    &format!("token_ids[{i}]"),
                    "a pair of token ids [u32, u32] (bigram form)",
                    item,
                ))
            }
            None => return Err(ctx.invalid(&format!("token_ids[{i}]"), "a token id (u32)", item)),
        }
    }
    Ok(())
}

/// Absent or nil is the GPU tier; a string is read by [`medium_of`].
fn medium(v: Option<&ValueRef<'_>>, ctx: Ctx) -> Result<Medium, Rejection> {
    match present(v) {
        None => Ok(Medium::Gpu),
        Some(v) => match as_str(v) {
            Some(m) => Ok(medium_of(m)),
            None => Err(ctx.invalid("medium", "a string or nil", v)),
        },
    }
}

/// A medium string, in any case: `GPU` is the device; `CPU` (vLLM's offload tier) and
/// `CPU_PINNED` (SGLang's L2) are host memory; everything else (`STORAGE`, `DISK`, `FS`, `OBJ`,
/// `EXTERNAL`, strings we do not know) is a lower, slower tier.
pub(super) fn medium_of(m: &str) -> Medium {
    if m.eq_ignore_ascii_case("GPU") {
        Medium::Gpu
    } else if m.eq_ignore_ascii_case("CPU") || m.eq_ignore_ascii_case("CPU_PINNED") {
        Medium::Host
    } else {
        Medium::Disk
    }
}

fn malformed(detail: String) -> Rejection {
    Rejection::new(RejectReason::MalformedPayload, detail)
}

fn invalid(detail: String) -> Rejection {
    Rejection::new(RejectReason::InvalidField, detail)
}
