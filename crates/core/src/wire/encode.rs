//! Encoders: the publishing side of the wire contract, used by the simulator, the bridge and the
//! integration tests to put on NATS exactly what a vLLM worker would.
//!
//! KV event batches are byte-for-byte what msgspec writes for vLLM's positional structs (releases
//! before 0.33, declared with `array_like=True, tag=True, omit_defaults=True`). msgspec ignores
//! `omit_defaults` for array-like structs, so every declared field is written, `None` as nil: a
//! batch is always `[ts, events, data_parallel_rank]` and a `BlockStored` always has its nine
//! fields. The fixtures in `tests/fixtures/kv_events/` (written by msgspec) pin this down; those
//! of the current layouts (tagged-map events) are there too, for publishers that need them.

use rmpv::Value;

use crate::input::LifecycleOp;

/// One KV cache event as vLLM declares it (`vllm/distributed/kv_events.py`). `extra_keys` and
/// `group_idx` are always written as nil: kvrouted never reads them.
#[derive(Debug, Clone, PartialEq)]
pub enum VllmEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        medium: Option<String>,
        lora_name: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
    },
    AllBlocksCleared,
}

/// A vLLM `KVEventBatch`: `[ts, events, data_parallel_rank]`, hashes as unsigned integers.
pub fn encode_vllm_batch(ts: f64, events: &[VllmEvent], dp_rank: Option<u32>) -> Vec<u8> {
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(event_value).collect()),
        opt(dp_rank.map(Value::from)),
    ]);
    to_bytes(&batch)
}

/// A load sample (docs/architecture.md, "Load samples") as a map: `kv_usage, running, waiting,
/// [max_running], ts, [model]`; absent optionals are left out.
pub fn encode_load(
    kv_usage: f64,
    running: u32,
    waiting: u32,
    max_running: Option<u32>,
    ts: f64,
    model: Option<&str>,
) -> Vec<u8> {
    let mut map = vec![
        (Value::from("kv_usage"), Value::F64(kv_usage)),
        (Value::from("running"), Value::from(running)),
        (Value::from("waiting"), Value::from(waiting)),
    ];
    if let Some(max) = max_running {
        map.push((Value::from("max_running"), Value::from(max)));
    }
    map.push((Value::from("ts"), Value::F64(ts)));
    if let Some(model) = model {
        map.push((Value::from("model"), Value::from(model)));
    }
    to_bytes(&Value::Map(map))
}

/// A lifecycle message as a map: `op, [model], [block_size], [capacity_blocks]`; absent
/// optionals are left out. [`encode_lifecycle_message`] writes every field.
pub fn encode_lifecycle(
    op: LifecycleOp,
    model: Option<&str>,
    block_size: Option<u32>,
    capacity_blocks: Option<u64>,
) -> Vec<u8> {
    encode_lifecycle_message(&LifecycleMessage {
        op,
        model,
        block_size,
        capacity_blocks,
        ..LifecycleMessage::new(op)
    })
}

/// The fields of a lifecycle message, for [`encode_lifecycle_message`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LifecycleMessage<'a> {
    pub op: LifecycleOp,
    pub model: Option<&'a str>,
    pub block_size: Option<u32>,
    pub capacity_blocks: Option<u64>,
    /// Data-parallel ranks the worker runs.
    pub dp_size: Option<u32>,
    /// The engine incarnation (the `Kv-Epoch` the worker publishes with).
    pub epoch: Option<&'a str>,
}

impl LifecycleMessage<'_> {
    /// `op` with no optional field.
    pub fn new(op: LifecycleOp) -> Self {
        LifecycleMessage {
            op,
            model: None,
            block_size: None,
            capacity_blocks: None,
            dp_size: None,
            epoch: None,
        }
    }
}

/// A lifecycle message as a map: `op, [model], [block_size], [capacity_blocks], [dp_size],
/// [epoch]`; absent optionals are left out.
pub fn encode_lifecycle_message(message: &LifecycleMessage<'_>) -> Vec<u8> {
    let op = match message.op {
        LifecycleOp::Join => "join",
        LifecycleOp::Drain => "drain",
        LifecycleOp::Leave => "leave",
    };
    let mut map = vec![(Value::from("op"), Value::from(op))];
    let mut put = |key: &str, value: Option<Value>| {
        if let Some(v) = value {
            map.push((Value::from(key), v));
        }
    };
    put("model", message.model.map(Value::from));
    put("block_size", message.block_size.map(Value::from));
    put("capacity_blocks", message.capacity_blocks.map(Value::from));
    put("dp_size", message.dp_size.map(Value::from));
    put("epoch", message.epoch.map(Value::from));
    to_bytes(&Value::Map(map))
}

fn event_value(event: &VllmEvent) -> Value {
    match event {
        VllmEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
        } => Value::Array(vec![
            Value::from("BlockStored"),
            hashes(block_hashes),
            opt(parent_block_hash.map(Value::from)),
            Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
            Value::from(*block_size),
            opt(lora_id.map(Value::from)),
            opt(medium.as_deref().map(Value::from)),
            opt(lora_name.as_deref().map(Value::from)),
            Value::Nil, // extra_keys
            Value::Nil, // group_idx
        ]),
        VllmEvent::BlockRemoved {
            block_hashes,
            medium,
        } => Value::Array(vec![
            Value::from("BlockRemoved"),
            hashes(block_hashes),
            opt(medium.as_deref().map(Value::from)),
            Value::Nil, // group_idx
        ]),
        VllmEvent::AllBlocksCleared => Value::Array(vec![Value::from("AllBlocksCleared")]),
    }
}

fn hashes(hashes: &[u64]) -> Value {
    Value::Array(hashes.iter().map(|&h| Value::from(h)).collect())
}

fn opt(v: Option<Value>) -> Value {
    v.unwrap_or(Value::Nil)
}

fn to_bytes(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    // Writing into a Vec cannot fail (it only grows), so there is no error to surface.
    rmpv::encode::write_value(&mut out, value).expect("MessagePack encoding into a Vec");
    out
}
