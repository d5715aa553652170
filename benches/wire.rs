//! Decoding a KV event batch (`kvrouted::wire::decode_kv_batch`), per layout the engines send:
//! one 32-block `BlockStored` of block size 16 (512 tokens), as
//!
//! - `vllm_array`: vLLM's positional events (releases before 0.33; what `encode_vllm_batch`
//!   writes),
//! - `vllm_0_33_map`: vLLM 0.33.0's tagged-map events with `group_idx`, `kv_cache_spec_kind`,
//!   `session_id`,
//! - `sglang_0_5_23_map`: SGLang 0.5.23's tagged-map events with `cache_salt`, `lora_name`.
//!
//! Run: `cargo bench --bench wire`. Throughput is in blocks.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvrouted::input::WorkerId;
use kvrouted::wire::{decode_kv_batch, encode_vllm_batch, KvHeaders, VllmEvent};
use rmpv::Value;

const BLOCKS: u32 = 32;
const BLOCK: u32 = 16;

fn hashes() -> Vec<u64> {
    (0..BLOCKS as u64)
        .map(|i| 0x9E37_79B9_7F4A_7C15 ^ (i << 40))
        .collect()
}

fn tokens() -> Vec<u32> {
    (0..BLOCKS * BLOCK).map(|t| 1_000 + t * 7).collect()
}

fn to_bytes(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// `[ts, [{"type": "BlockStored", ...}], rank]` with `fields` after the required ones.
fn map_batch(fields: Vec<(&str, Value)>) -> Vec<u8> {
    let mut event = vec![
        (Value::from("type"), Value::from("BlockStored")),
        (
            Value::from("block_hashes"),
            Value::Array(hashes().into_iter().map(Value::from).collect()),
        ),
        (Value::from("parent_block_hash"), Value::Nil),
        (
            Value::from("token_ids"),
            Value::Array(tokens().into_iter().map(Value::from).collect()),
        ),
        (Value::from("block_size"), Value::from(BLOCK)),
        (Value::from("lora_id"), Value::Nil),
    ];
    event.extend(fields.into_iter().map(|(k, v)| (Value::from(k), v)));
    to_bytes(&Value::Array(vec![
        Value::F64(1_700_000_000.25),
        Value::Array(vec![Value::Map(event)]),
        Value::from(0),
    ]))
}

fn decode(c: &mut Criterion) {
    let layouts = [
        (
            "vllm_array",
            encode_vllm_batch(
                1_700_000_000.25,
                &[VllmEvent::BlockStored {
                    block_hashes: hashes(),
                    parent_block_hash: None,
                    token_ids: tokens(),
                    block_size: BLOCK,
                    lora_id: None,
                    medium: Some("GPU".into()),
                    lora_name: None,
                }],
                Some(0),
            ),
        ),
        (
            "vllm_0_33_map",
            map_batch(vec![
                ("medium", Value::from("GPU")),
                ("lora_name", Value::Nil),
                ("group_idx", Value::from(0)),
                ("kv_cache_spec_kind", Value::from("full_attention")),
                ("session_id", Value::from("session-42")),
            ]),
        ),
        (
            "sglang_0_5_23_map",
            map_batch(vec![
                ("medium", Value::from("GPU")),
                ("cache_salt", Value::from("tenant-a")),
                ("lora_name", Value::from("support-bot")),
            ]),
        ),
    ];
    let worker = WorkerId::new("bench-worker").unwrap();
    let mut group = c.benchmark_group("decode_kv_batch_32_blocks");
    group.throughput(Throughput::Elements(BLOCKS as u64));
    for (name, payload) in &layouts {
        let decoded = decode_kv_batch(payload, worker.clone(), KvHeaders::default())
            .unwrap_or_else(|r| panic!("{name}: {r:?}"));
        assert_eq!(decoded.events.len(), 1, "{name}: one store");
        group.bench_function(*name, |b| {
            b.iter(|| {
                decode_kv_batch(
                    std::hint::black_box(payload),
                    worker.clone(),
                    KvHeaders::default(),
                )
                .unwrap()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, decode);
criterion_main!(benches);
