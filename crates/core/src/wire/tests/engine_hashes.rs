//! What the engines send today (vLLM 0.33.0, SGLang 0.5.23, TensorRT-LLM): every block hash
//! form, the medium tiers and the KV cache group kinds.

use super::*;

// ------------------------------------------------------------------------------------------
// block hashes
// ------------------------------------------------------------------------------------------

#[test]
fn a_16_byte_xxhash_digest_is_read_as_vllms_integer_mode_would_send_it() {
    let digest: Vec<u8> = (0x10..0x20).collect();
    let payload = array_batch_of(stored_array(Value::Binary(digest.clone()), vec![]));
    assert_eq!(
        engine_hash_of(&payload),
        0x1819_1a1b_1c1d_1e1f,
        "a 16-byte digest (--prefix-caching-hash-algo xxhash, integer hashes off) is its last 8 \
         bytes, big-endian"
    );
    assert_eq!(
        engine_hash_of(&payload),
        vllm_int_mode(&digest),
        "which is what vLLM sends for the same block in integer mode"
    );
    assert!(
        decode_vllm_array(&payload).is_some(),
        "vLLM's array layout with a 16-byte digest takes the single-pass decoder"
    );
}

#[test]
fn bin_hashes_of_8_bytes_or_any_multiple_of_16_equal_the_integer_mode() {
    for len in [8usize, 16, 32, 48, 64, 96, 128, 256, 1024] {
        let digest: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
        for event in [
            stored_array(Value::Binary(digest.clone()), vec![]),
            Value::Array(vec![
                Value::from("BlockRemoved"),
                Value::Array(vec![Value::Binary(digest.clone())]),
            ]),
        ] {
            assert_eq!(
                engine_hash_of(&array_batch_of(event)),
                vllm_int_mode(&digest),
                "a {len}-byte digest is its last 8 bytes, big-endian"
            );
        }
        let parent = Value::Array(vec![
            Value::from("BlockStored"),
            Value::Array(vec![Value::from(1)]),
            Value::Binary(digest.clone()),
            Value::Array(vec![Value::from(1)]),
            Value::from(1),
        ]);
        let KvEvent::Stored { parent, .. } = only_event(decode_ok(&array_batch_of(parent))) else {
            panic!("a store")
        };
        assert_eq!(
            parent,
            Some(vllm_int_mode(&digest)),
            "a {len}-byte parent hash reads the same way"
        );
    }
}

#[test]
fn bin_hashes_of_other_lengths_are_invalid_field() {
    for len in [0usize, 1, 4, 7, 9, 12, 15, 20, 24, 33, 36, 40] {
        let r = reject_reason(&array_batch_of(stored_array(
            Value::Binary(vec![7; len]),
            vec![],
        )));
        assert_eq!(
            r.reason,
            RejectReason::InvalidField,
            "a {len}-byte hash is no digest we know"
        );
        assert!(
            r.detail.contains("block_hashes[0]"),
            "the detail names the hash: {}",
            r.detail
        );
    }
}

#[test]
fn integer_hashes_of_every_width_and_sign_are_read_as_u64() {
    let cases: Vec<(Vec<u8>, u64)> = {
        let mut v = Vec::new();
        let mut w = |f: &dyn Fn(&mut Vec<u8>), expected: u64| {
            let mut buf = Vec::new();
            f(&mut buf);
            v.push((buf, expected));
        };
        w(&|b| rmp::encode::write_pfix(b, 7).unwrap(), 7);
        w(&|b| rmp::encode::write_u8(b, 200).unwrap(), 200);
        w(&|b| rmp::encode::write_u16(b, 60_000).unwrap(), 60_000);
        w(
            &|b| rmp::encode::write_u32(b, 4_000_000_000).unwrap(),
            4_000_000_000,
        );
        w(&|b| rmp::encode::write_u64(b, u64::MAX).unwrap(), u64::MAX);
        w(&|b| rmp::encode::write_u64(b, 5).unwrap(), 5);
        w(&|b| rmp::encode::write_nfix(b, -3).unwrap(), -3i64 as u64);
        w(&|b| rmp::encode::write_i8(b, -100).unwrap(), -100i64 as u64);
        w(&|b| rmp::encode::write_i8(b, 100).unwrap(), 100);
        w(
            &|b| rmp::encode::write_i16(b, -30_000).unwrap(),
            -30_000i64 as u64,
        );
        w(
            &|b| rmp::encode::write_i32(b, -2_000_000_000).unwrap(),
            -2_000_000_000i64 as u64,
        );
        w(
            &|b| rmp::encode::write_i64(b, i64::MIN).unwrap(),
            i64::MIN as u64,
        );
        w(&|b| rmp::encode::write_i64(b, 42).unwrap(), 42);
        v
    };
    for (hash_bytes, expected) in cases {
        // [1.5, [["BlockRemoved", [<hash>]]]]
        let mut payload = vec![0x92, 0xcb];
        payload.extend(1.5f64.to_be_bytes());
        payload.extend([0x91, 0x92, 0xac]);
        payload.extend(b"BlockRemoved");
        payload.push(0x91);
        payload.extend(&hash_bytes);
        assert_eq!(
            engine_hash_of(&payload),
            expected,
            "{hash_bytes:02x?} is the u64 {expected}"
        );
    }
}

// ------------------------------------------------------------------------------------------
// tiers and KV cache groups
// ------------------------------------------------------------------------------------------

fn medium_and_group(payload: &[u8]) -> (Medium, bool) {
    match only_event(decode_ok(payload)) {
        KvEvent::Stored {
            medium,
            full_attention,
            ..
        } => (medium, full_attention),
        other => panic!("expected a store, got {other:?}"),
    }
}

#[test]
fn medium_strings_map_to_the_device_host_and_disk_tiers() {
    let cases = [
        ("GPU", Medium::Gpu),
        ("gpu", Medium::Gpu),
        ("CPU", Medium::Host),
        ("cpu", Medium::Host),
        ("CPU_PINNED", Medium::Host),
        ("DISK", Medium::Disk),
        ("STORAGE", Medium::Disk),
        ("FS", Medium::Disk),
        ("OBJ", Medium::Disk),
        ("EXTERNAL", Medium::Disk),
        ("a-tier-from-next-year", Medium::Disk),
        ("", Medium::Disk),
    ];
    for (m, expected) in cases {
        let array = array_batch_of(stored_array(
            Value::from(1),
            vec![Value::Nil, Value::from(m)],
        ));
        assert_eq!(
            medium_and_group(&array).0,
            expected,
            "medium {m:?} in a positional store"
        );
        let map = mp(json!([1.5, [{
            "type": "BlockRemoved", "block_hashes": [1], "medium": m
        }]]));
        let KvEvent::Removed { medium, .. } = only_event(decode_ok(&map)) else {
            panic!("a removal")
        };
        assert_eq!(medium, expected, "medium {m:?} in a tagged-map removal");
    }
    let absent = mp(json!([1.5, [{"type": "BlockRemoved", "block_hashes": [1]}]]));
    let KvEvent::Removed { medium, .. } = only_event(decode_ok(&absent)) else {
        panic!("a removal")
    };
    assert_eq!(
        medium,
        Medium::Gpu,
        "SGLang omits a GPU medium: absent is GPU"
    );
}

/// A positional vLLM 0.33.0 store with `kind` as `kv_cache_spec_kind`.
fn store_of_kind(kind: Value) -> Vec<u8> {
    array_batch_of(stored_array(
        Value::from(1),
        vec![
            Value::Nil,                                             // lora_id
            Value::from("GPU"),                                     // medium
            Value::Nil,                                             // lora_name
            Value::Nil,                                             // extra_keys
            Value::from(1),                                         // group_idx
            kind,                                                   // kv_cache_spec_kind
            Value::from(4096),                                      // kv_cache_spec_sliding_window
            Value::from("LOCAL"),                                   // locality
            Value::Nil,                                             // ownership
            Value::from("session"),                                 // session_id
            Value::Array(vec![Value::Array(vec![Value::from(3)])]), // lookahead_token_ids
        ],
    ))
}

#[test]
fn stores_of_a_group_other_than_full_attention_are_not_full_attention() {
    for kind in [
        "sliding_window",
        "sliding_window_mla",
        "chunked_local_attention",
        "mamba",
        "encoder_only_attention",
        "cross_attention",
        "unknown",
        "",
    ] {
        let array = store_of_kind(Value::from(kind));
        assert_eq!(
            medium_and_group(&array),
            (Medium::Gpu, false),
            "a {kind:?} store is accepted and is no prefix ownership"
        );
        assert!(
            decode_vllm_array(&array).is_some(),
            "vLLM's array layout with a kind takes the single-pass decoder"
        );
        let map = mp(json!([1.5, [{
            "type": "BlockStored", "block_hashes": [1], "parent_block_hash": null,
            "token_ids": [1, 2], "block_size": 2, "lora_id": null, "medium": "GPU",
            "lora_name": null, "group_idx": 1, "kv_cache_spec_kind": kind,
            "kv_cache_spec_sliding_window": 4096
        }]]));
        assert_eq!(
            medium_and_group(&map),
            (Medium::Gpu, false),
            "a {kind:?} tagged-map store is no prefix ownership"
        );
    }
}

#[test]
fn full_attention_kinds_and_stores_without_a_kind_are_full_attention() {
    for kind in [
        Value::from("full_attention"),
        Value::from("FULL_ATTENTION"),
        Value::from("mla_attention"),
        Value::from("sink_full_attention"),
        Value::Nil,
        // Not a kind at all (another engine's field at that position): no statement.
        Value::from(3),
    ] {
        assert_eq!(
            medium_and_group(&store_of_kind(kind.clone())),
            (Medium::Gpu, true),
            "a store of kind {kind} is full attention"
        );
    }
    let older = array_batch_of(stored_array(
        Value::from(1),
        vec![Value::Nil, Value::from("GPU")],
    ));
    assert!(
        medium_and_group(&older).1,
        "a release that sends no kind has one group: full attention"
    );
}
