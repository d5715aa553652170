//! The engines' current layouts as documented examples, decoder limits on nesting and lengths,
//! both decoding paths agreeing on the newer forms, and journal compatibility of the changed
//! input types.

use super::*;

// ------------------------------------------------------------------------------------------
// schemas/examples of the engines' current layouts
// ------------------------------------------------------------------------------------------

fn example(name: &str) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../schemas/examples")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    mp(serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}")))
}

#[test]
fn the_engine_layout_examples_decode_to_what_the_docs_say() {
    let vllm = decode_ok(&example("kv-batch-vllm-0-33.json"));
    let kinds: Vec<(Medium, bool)> = vllm
        .events
        .iter()
        .filter_map(|e| match e {
            KvEvent::Stored {
                medium,
                full_attention,
                ..
            } => Some((*medium, *full_attention)),
            _ => None,
        })
        .collect();
    assert_eq!(
        (vllm.dp_rank, vllm.events.len(), kinds),
        (
            0,
            5,
            vec![
                (Medium::Gpu, true),
                (Medium::Gpu, false),
                (Medium::Host, true)
            ]
        ),
        "vLLM 0.33: a full-attention store, a sliding-window store, a CPU-tier store"
    );
    let sglang = decode_ok(&example("kv-batch-sglang-0-5-23.json"));
    match &sglang.events[0] {
        KvEvent::Stored { blocks, lora, .. } => assert_eq!(
            (blocks[0].engine_hash, lora.as_deref()),
            ((-4611686018427400249i64) as u64, Some("support-bot")),
            "SGLang 0.5.23: a signed hash and the LoRA name"
        ),
        other => panic!("a store, got {other:?}"),
    }
    assert_eq!(sglang.dp_rank, 1, "SGLang's attn_dp_rank");
    let (join, rejected) = decode_lifecycle(&example("lifecycle-join-bridge.json"), worker())
        .expect("the bridge's join decodes");
    assert_eq!(
        (join.op, join.dp_size, join.epoch.as_deref(), rejected.len()),
        (LifecycleOp::Join, Some(2), Some("7f3c9a1e-boot-1"), 0),
        "the bridge's join carries dp_size and epoch"
    );
}

#[test]
fn nesting_beyond_the_limit_is_malformed_not_a_stack_overflow() {
    let mut deep = vec![0x91u8; 100_000];
    deep.push(0xc0);
    for payload in [deep.clone(), [&[0x92, 0x00][..], &deep[..]].concat()] {
        assert_eq!(
            decode_kv_batch(&payload, worker(), KvHeaders::default())
                .unwrap_err()
                .reason,
            RejectReason::MalformedPayload,
            "100,000 nested arrays are refused"
        );
        assert!(decode_vllm_array(&payload).is_none());
        assert!(decode_lifecycle(&payload, worker()).is_err());
        assert!(decode_load(&payload, worker()).is_err());
    }
}

#[test]
fn lengths_that_the_payload_cannot_hold_allocate_nothing_and_are_malformed() {
    // array32 of 2^32-1 events, map32 of 2^32-1 entries, a bin32 hash of 4 GiB: 5 bytes each.
    for lie in [
        vec![0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff],
        vec![0xdf, 0xff, 0xff, 0xff, 0xff],
        vec![
            0x92, 0x00, 0x91, 0x92, 0xac, b'B', b'l', b'o', b'c', b'k', b'R', b'e', b'm', b'o',
            b'v', b'e', b'd', 0x91, 0xc6, 0xff, 0xff, 0xff, 0xff,
        ],
    ] {
        assert_eq!(
            decode_kv_batch(&lie, worker(), KvHeaders::default())
                .unwrap_err()
                .reason,
            RejectReason::MalformedPayload,
            "{lie:02x?}: a declared length beyond the payload is refused"
        );
        assert!(decode_vllm_array(&lie).is_none());
    }
}

// ------------------------------------------------------------------------------------------
// the two decoding paths agree on the newer forms
// ------------------------------------------------------------------------------------------

fn arb_hash() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0usize..6, any::<u8>()).prop_map(|(k, seed)| {
            let len = [0, 8, 16, 32, 64, 20][k];
            Value::Binary((0..len).map(|i| seed.wrapping_add(i as u8)).collect())
        }),
    ]
}

fn arb_tail() -> impl Strategy<Value = Vec<Value>> {
    let kind = prop_oneof![
        Just(Value::Nil),
        Just(Value::from("full_attention")),
        Just(Value::from("sliding_window")),
        Just(Value::from(7)),
    ];
    let lora_name = prop_oneof![
        Just(Value::Nil),
        Just(Value::from("x")),
        Just(Value::Map(vec![(
            Value::from("cache_salt"),
            Value::from("s")
        )])),
    ];
    let medium = prop_oneof![
        Just(Value::Nil),
        Just(Value::from("GPU")),
        Just(Value::from("CPU_PINNED")),
        Just(Value::from("STORAGE")),
    ];
    (medium, lora_name, kind, 0usize..13).prop_map(|(medium, lora_name, kind, len)| {
        let full = vec![
            Value::Nil, // lora_id
            medium,
            lora_name,
            Value::Array(vec![Value::Nil]), // extra_keys
            Value::from(0),                 // group_idx
            kind,
            Value::from(4096),
            Value::from("LOCAL"),
            Value::Nil,
            Value::from("s"),
            Value::Array(vec![Value::Array(vec![Value::from(1)])]),
            Value::from("future"),
        ];
        full.into_iter().take(len).collect()
    })
}

/// A tagged-map event: a tag and a random selection, in random order, of field names with
/// values that are sometimes right and sometimes not, and sometimes a repeated key.
fn arb_map_event() -> impl Strategy<Value = Value> {
    let tag = prop_oneof![
        Just(Value::from("BlockStored")),
        Just(Value::from("BlockRemoved")),
        Just(Value::from("AllBlocksCleared")),
        Just(Value::from(1)),
    ];
    let field = prop_oneof![
        arb_hash().prop_map(|h| ("block_hashes", Value::Array(vec![h]))),
        Just(("block_hashes", Value::Array(vec![]))),
        Just(("block_hashes", Value::Nil)),
        arb_hash().prop_map(|h| ("parent_block_hash", h)),
        Just(("parent_block_hash", Value::Nil)),
        Just((
            "token_ids",
            Value::Array(vec![Value::from(1), Value::from(2)])
        )),
        Just(("token_ids", Value::Array(vec![]))),
        Just((
            "token_ids",
            Value::Array(vec![Value::Array(vec![Value::from(1), Value::from(2)])])
        )),
        Just(("block_size", Value::from(2))),
        Just(("block_size", Value::from(0))),
        Just(("lora_id", Value::from(-3))),
        Just(("lora_id", Value::from("x"))),
        Just(("medium", Value::from("CPU"))),
        Just(("medium", Value::from(1))),
        Just(("lora_name", Value::from("a"))),
        Just(("lora_name", Value::from(""))),
        Just(("lora_name", Value::Map(vec![]))),
        Just(("kv_cache_spec_kind", Value::from("mamba"))),
        Just(("kv_cache_spec_kind", Value::from(2))),
        Just((
            "mm_keys",
            Value::Array(vec![Value::Array(vec![Value::Binary(vec![0; 32])])])
        )),
        Just(("session_id", Value::Nil)),
    ];
    (tag, proptest::collection::vec(field, 0..9), any::<bool>()).prop_map(
        |(tag, fields, tag_last)| {
            let mut entries: Vec<(Value, Value)> = fields
                .into_iter()
                .map(|(k, v)| (Value::from(k), v))
                .collect();
            let tag = (Value::from("type"), tag);
            if tag_last {
                entries.push(tag);
            } else {
                entries.insert(0, tag);
            }
            Value::Map(entries)
        },
    )
}

proptest! {
    #[test]
    fn both_paths_agree_on_tagged_map_events(events in proptest::collection::vec(arb_map_event(), 1..4)) {
        let payload = mpv(&Value::Array(vec![
            Value::F64(1.5),
            Value::Array(events),
            Value::from(0),
        ]));
        if let Some(fast) = decode_vllm_array(&payload) {
            prop_assert_eq!(Some(fast), decode_tolerant(&payload).ok(), "the single-pass decoder agrees");
        }
    }

    #[test]
    fn both_paths_agree_on_the_engines_newer_array_layouts(
        hash in arb_hash(),
        tail in arb_tail(),
        ts in prop_oneof![Just(1.5), Just(f64::NAN), Just(f64::INFINITY)],
        rank in proptest::option::of(0u32..4),
    ) {
        let payload = mpv(&Value::Array(vec![
            Value::F64(ts),
            Value::Array(vec![stored_array(hash, tail)]),
            rank.map(Value::from).unwrap_or(Value::Nil),
        ]));
        let fast = decode_vllm_array(&payload);
        let tolerant = decode_tolerant(&payload);
        if let Some(fast) = fast {
            prop_assert_eq!(Some(fast), tolerant.ok(), "the single-pass decoder agrees");
        }
    }
}

// ------------------------------------------------------------------------------------------
// journal compatibility of the changed input types
// ------------------------------------------------------------------------------------------

/// The journal stores inputs with `rmp_serde::to_vec` (structs as arrays). Entries written
/// before this round's type changes must still read.
#[test]
fn inputs_journaled_before_the_type_changes_still_decode() {
    #[derive(serde::Serialize)]
    enum OldMedium {
        Gpu,
        Other,
    }
    #[derive(serde::Serialize)]
    enum OldKvEvent {
        Stored {
            parent: Option<u64>,
            blocks: Vec<StoredBlock>,
            block_size: u32,
            lora: Option<String>,
            medium: OldMedium,
        },
    }
    let old = rmp_serde::to_vec(&OldKvEvent::Stored {
        parent: None,
        blocks: vec![],
        block_size: 16,
        lora: None,
        medium: OldMedium::Other,
    })
    .unwrap();
    let event: KvEvent = rmp_serde::from_slice(&old).expect("an old Stored event decodes");
    assert_eq!(
        event,
        KvEvent::Stored {
            parent: None,
            blocks: vec![],
            block_size: 16,
            lora: None,
            medium: Medium::Disk,
            full_attention: true,
        },
        "an old Other medium reads as Disk and an old store as full attention"
    );
    let _ = OldMedium::Gpu;

    #[derive(serde::Serialize)]
    struct OldLoadSample {
        worker: WorkerId,
        kv_usage: f64,
        running: u32,
        waiting: u32,
        max_running: Option<u32>,
        model: Option<String>,
    }
    let old = rmp_serde::to_vec(&OldLoadSample {
        worker: worker(),
        kv_usage: 0.5,
        running: 1,
        waiting: 2,
        max_running: None,
        model: None,
    })
    .unwrap();
    let sample: crate::input::LoadSample =
        rmp_serde::from_slice(&old).expect("an old load sample decodes");
    assert_eq!(sample.dp_rank, 0, "an old sample is rank 0");

    #[derive(serde::Serialize)]
    struct OldLifecycle {
        worker: WorkerId,
        op: LifecycleOp,
        model: Option<String>,
        block_size: Option<u32>,
        capacity_blocks: Option<u64>,
    }
    let old = rmp_serde::to_vec(&OldLifecycle {
        worker: worker(),
        op: LifecycleOp::Drain,
        model: None,
        block_size: Some(16),
        capacity_blocks: None,
    })
    .unwrap();
    let l: crate::input::Lifecycle =
        rmp_serde::from_slice(&old).expect("an old lifecycle message decodes");
    assert_eq!((l.op, l.dp_size, l.epoch), (LifecycleOp::Drain, None, None));

    #[derive(serde::Serialize)]
    struct OldKvEventBatch {
        worker: WorkerId,
        model: Option<String>,
        dp_rank: u32,
        seq: Option<u64>,
        events: Vec<KvEvent>,
    }
    let old = rmp_serde::to_vec(&OldKvEventBatch {
        worker: worker(),
        model: None,
        dp_rank: 1,
        seq: Some(4),
        events: vec![KvEvent::Cleared],
    })
    .unwrap();
    let batch: KvEventBatch = rmp_serde::from_slice(&old).expect("an old KV batch decodes");
    assert_eq!(
        (batch.dp_rank, batch.seq, batch.epoch, batch.events),
        (1, Some(4), None, vec![KvEvent::Cleared]),
        "an old batch reads with no epoch"
    );
}
