//! Decoding a KV event batch (`kvrouted::wire::decode_kv_batch`), per layout the engines send:
//! one 32-block `BlockStored` of block size 16 (512 tokens), as
//!
//! - `vllm_array`: vLLM's positional events (releases before 0.33; what `encode_vllm_batch`
//!   writes),
//! - `vllm_0_33_map`: vLLM 0.33.0's tagged-map events with `group_idx`, `kv_cache_spec_kind`,
//!   `session_id`,
//! - `sglang_0_5_23_map`: SGLang 0.5.23's tagged-map events with `cache_salt`, `lora_name`.
//!
//! and parsing a `POST /v1/route` JSON body (`kvrouted::http::route_body::parse`) of 4,096 and
//! 32,768 token ids below 128,000 (a Llama 3 vocabulary), `compact` as serde_json writes it,
//! `spaced` as Python's `json.dumps` does (`", "` between values) and `lines` as an indenting
//! writer does (a value per line), beside serde_json reading the same body whole (`_serde_json`,
//! what the e2e bench's `floor+parse` does).
//!
//! Run: `cargo bench --bench wire`. Throughput is in blocks, and in token ids for the bodies.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvrouted::http::route_body::{self, RouteBody};
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

/// A route body of `n` token ids below 128,000, with `separator` between them.
fn route_json(n: u64, separator: &str) -> Vec<u8> {
    let ids: Vec<String> = (0..n)
        .map(|t| (t.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) % 128_000)
        .map(|id| id.to_string())
        .collect();
    format!(
        r#"{{"tokens":[{}],"max_output_tokens":256}}"#,
        ids.join(separator)
    )
    .into_bytes()
}

fn route_bodies(c: &mut Criterion) {
    let mut group = c.benchmark_group("route_body_json");
    for tokens in [4_096u64, 32_768] {
        group.throughput(Throughput::Elements(tokens));
        for (layout, separator) in [("compact", ","), ("spaced", ", "), ("lines", ",\n  ")] {
            let body = route_json(tokens, separator);
            let parsed = route_body::parse(false, &body).unwrap();
            assert_eq!(
                parsed.tokens.map(|t| t.len() as u64),
                Some(tokens),
                "{layout}: every token id is read"
            );
            group.bench_function(format!("{tokens}_{layout}"), |b| {
                b.iter(|| route_body::parse(false, std::hint::black_box(&body)).unwrap())
            });
            group.bench_function(format!("{tokens}_{layout}_serde_json"), |b| {
                b.iter(|| serde_json::from_slice::<RouteBody>(std::hint::black_box(&body)).unwrap())
            });
        }
    }
    group.finish();
}

criterion_group!(benches, decode, route_bodies);
criterion_main!(benches);
