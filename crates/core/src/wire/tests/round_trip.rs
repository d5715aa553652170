//! The encoders: what they write decodes back to the same inputs.

use super::*;

#[test]
fn encoded_vllm_batch_round_trips_to_core_events() {
    let events = vec![
        VllmEvent::BlockStored {
            block_hashes: vec![u64::MAX, 5],
            parent_block_hash: Some(4),
            token_ids: vec![1, 2, 3, 4, 5, 6],
            block_size: 3,
            lora_id: Some(2),
            medium: Some("GPU".into()),
            lora_name: None,
        },
        VllmEvent::BlockRemoved {
            block_hashes: vec![5],
            medium: Some("CPU".into()),
        },
        VllmEvent::AllBlocksCleared,
    ];
    let batch = decode_ok(&encode_vllm_batch(3.5, &events, Some(4)));
    assert_eq!(batch.dp_rank, 4, "the rank round-trips");
    assert_eq!(
        batch.events,
        vec![
            KvEvent::Stored {
                parent: Some(4),
                blocks: vec![
                    StoredBlock {
                        engine_hash: u64::MAX,
                        local: local_hash(&[1, 2, 3])
                    },
                    StoredBlock {
                        engine_hash: 5,
                        local: local_hash(&[4, 5, 6])
                    },
                ],
                block_size: 3,
                lora: Some("2".into()),
                medium: Medium::Gpu,
                full_attention: true,
            },
            KvEvent::Removed {
                engine_hashes: vec![5],
                medium: Medium::Host
            },
            KvEvent::Cleared,
        ],
        "what the encoder writes, the decoder reads back"
    );
    assert_eq!(
        decode_ok(&encode_vllm_batch(0.0, &[], None)).dp_rank,
        0,
        "no rank → 0"
    );
}

#[test]
fn encoded_load_and_lifecycle_round_trip() {
    let s = decode_load(
        &encode_load(0.75, 9, 4, Some(32), 100.5, Some("m")),
        worker(),
    )
    .unwrap();
    assert_eq!(
        (
            s.kv_usage,
            s.running,
            s.waiting,
            s.max_running,
            s.model.as_deref()
        ),
        (0.75, 9, 4, Some(32), Some("m")),
        "every load field round-trips"
    );
    let s = decode_load(&encode_load(0.0, 0, 0, None, 0.0, None), worker()).unwrap();
    assert_eq!(
        (s.max_running, s.model),
        (None, None),
        "absent optionals stay absent"
    );
    for op in [LifecycleOp::Join, LifecycleOp::Drain, LifecycleOp::Leave] {
        let (l, _) = decode_lifecycle(
            &encode_lifecycle(op, Some("m"), Some(16), Some(1024)),
            worker(),
        )
        .unwrap();
        assert_eq!(
            (l.op, l.model.as_deref(), l.block_size, l.capacity_blocks),
            (op, Some("m"), Some(16), Some(1024)),
            "every lifecycle field round-trips"
        );
    }
    let (l, _) = decode_lifecycle(
        &encode_lifecycle(LifecycleOp::Leave, None, None, None),
        worker(),
    )
    .unwrap();
    assert_eq!(
        (l.model, l.block_size, l.capacity_blocks),
        (None, None, None),
        "bare op"
    );
}
