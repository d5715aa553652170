//! Property tests: no input makes a decoder panic; consistent events round-trip.

use super::*;

/// Field names and tags that steer random maps and arrays into the decoders' deeper paths.
const WORDS: &[&str] = &[
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "type",
    "ts",
    "events",
    "data_parallel_rank",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "GPU",
    "CPU",
    "kv_usage",
    "running",
    "waiting",
    "max_running",
    "model",
    "op",
    "join",
    "drain",
    "leave",
    "capacity_blocks",
];

fn arb_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Nil),
        any::<bool>().prop_map(Value::Boolean),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0u64..20).prop_map(Value::from),
        any::<f64>().prop_map(Value::F64),
        any::<f32>().prop_map(Value::F32),
        prop::sample::select(WORDS).prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(Value::Binary),
        Just(Value::Binary(vec![7; 32])),
        (any::<i8>(), prop::collection::vec(any::<u8>(), 0..6)).prop_map(|(t, d)| Value::Ext(t, d)),
    ]
}

fn arb_value() -> impl Strategy<Value = Value> {
    arb_leaf().prop_recursive(6, 96, 10, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..10).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop_oneof![
                        prop::sample::select(WORDS).prop_map(Value::from),
                        arb_leaf()
                    ],
                    inner
                ),
                0..8
            )
            .prop_map(Value::Map),
        ]
    })
}

/// Values shaped like event fields: hash lists, token lists (plain or bigram), small ints.
fn arb_field() -> impl Strategy<Value = Value> {
    prop_oneof![
        arb_value(),
        prop::collection::vec(arb_leaf(), 0..4).prop_map(Value::Array),
        prop::collection::vec((0u32..5).prop_map(Value::from), 0..9).prop_map(Value::Array),
        prop::collection::vec(
            prop::collection::vec((0u32..5).prop_map(Value::from), 1..4).prop_map(Value::Array),
            0..9
        )
        .prop_map(Value::Array),
        (0u32..5).prop_map(Value::from),
    ]
}

fn arb_event() -> impl Strategy<Value = Value> {
    let tag = prop_oneof![
        prop::sample::select(&WORDS[..3]).prop_map(Value::from),
        arb_leaf()
    ];
    prop_oneof![
        (tag.clone(), prop::collection::vec(arb_field(), 0..12)).prop_map(|(tag, fields)| {
            Value::Array(std::iter::once(tag).chain(fields).collect())
        }),
        (
            tag,
            prop::collection::vec((prop::sample::select(WORDS), arb_field()), 0..10)
        )
            .prop_map(|(tag, fields)| {
                Value::Map(
                    std::iter::once((Value::from("type"), tag))
                        .chain(fields.into_iter().map(|(k, v)| (Value::from(k), v)))
                        .collect(),
                )
            }),
    ]
}

fn decode_everything(payload: &[u8]) {
    let _ = decode(payload);
    let _ = decode_load(payload, worker());
    let _ = decode_lifecycle(payload, worker());
}

/// A token id in any of the four widths msgpack gives one (positive fixint, uint 8, 16, 32), so
/// a token list mixes them as real vocabularies do.
fn arb_token() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..0x80, 0x80u32..0x100, 0x100u32..0x1_0000, any::<u32>()]
}

/// A `BlockStored` whose token count is consistent, and the core event it must decode to.
fn arb_consistent_stored() -> impl Strategy<Value = (VllmEvent, KvEvent)> {
    (
        1u32..6,
        0usize..4,
        any::<Option<u64>>(),
        any::<Option<i64>>(),
        any::<bool>(),
    )
        .prop_flat_map(|(bs, n, parent, lora_id, gpu)| {
            (
                prop::collection::vec(any::<u64>(), n),
                prop::collection::vec(arb_token(), n * bs as usize),
                Just((bs, parent, lora_id, gpu)),
            )
        })
        .prop_map(|(hashes, tokens, (bs, parent, lora_id, gpu))| {
            let medium = if gpu { "GPU" } else { "CPU" };
            let core = KvEvent::Stored {
                parent,
                blocks: hashes
                    .iter()
                    .zip(tokens.chunks_exact(bs as usize))
                    .map(|(&engine_hash, t)| StoredBlock {
                        engine_hash,
                        local: local_hash(t),
                    })
                    .collect(),
                block_size: bs,
                lora: lora_id.map(|id| id.to_string()),
                medium: if gpu { Medium::Gpu } else { Medium::Host },
                full_attention: true,
            };
            let wire = VllmEvent::BlockStored {
                block_hashes: hashes,
                parent_block_hash: parent,
                token_ids: tokens,
                block_size: bs,
                lora_id,
                medium: Some(medium.into()),
                lora_name: None,
            };
            (wire, core)
        })
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic_any_decoder(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        decode_everything(&bytes);
    }

    #[test]
    fn arbitrary_msgpack_values_never_panic_any_decoder(v in arb_value()) {
        decode_everything(&mpv(&v));
    }

    #[test]
    fn event_shaped_values_never_panic_the_kv_decoder(
        // Mostly valid batch fields, so that most cases reach the events.
        ts in prop_oneof![3 => Just(Value::F64(1.0)), 1 => arb_leaf()],
        events in prop::collection::vec(arb_event(), 0..4),
        rank in prop_oneof![3 => Just(Value::Nil), 1 => arb_leaf()],
        as_map in any::<bool>(),
    ) {
        let batch = if as_map {
            Value::Map(vec![
                (Value::from("ts"), ts),
                (Value::from("events"), Value::Array(events)),
                (Value::from("data_parallel_rank"), rank),
            ])
        } else {
            Value::Array(vec![ts, Value::Array(events), rank])
        };
        let _ = decode(&mpv(&batch));
    }

    #[test]
    fn truncated_valid_batches_are_rejected_not_panicking(cut in 0usize..200) {
        let payload = read_fixture("stored_chain_int_hashes.msgpack");
        let cut = cut.min(payload.len().saturating_sub(1));
        let r = decode(&payload[..cut]);
        prop_assert!(r.is_err(), "a strict prefix of a batch is never a valid batch");
    }

    #[test]
    fn consistent_stored_events_round_trip_through_the_encoder(
        pairs in prop::collection::vec(arb_consistent_stored(), 0..4),
        dp in any::<Option<u32>>(),
    ) {
        let (wire, core): (Vec<VllmEvent>, Vec<KvEvent>) = pairs.into_iter().unzip();
        let batch = decode(&encode_vllm_batch(1.0, &wire, dp)).expect("encoder output decodes");
        prop_assert_eq!(batch.events, core, "decoded events equal the encoded ones");
        prop_assert_eq!(batch.dp_rank, dp.unwrap_or(0), "dp rank round-trips");
    }
}
