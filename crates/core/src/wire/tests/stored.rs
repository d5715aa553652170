//! `BlockStored`: hashes, block size, token ids, medium, LoRA, optional and unknown fields.

use super::*;

#[test]
fn stored_event_hashes_each_block_of_tokens() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored",
        [10, 11],
        9,
        [1, 2, 3, 4, 5, 6, 7, 8],
        4,
        null,
        "GPU",
        null,
        null,
        null
    ]))));
    let (parent, blocks, block_size, lora, medium) = stored_parts(event);
    assert_eq!(parent, Some(9), "the parent hash is kept");
    assert_eq!(block_size, 4, "the block size is kept");
    assert_eq!(lora, None, "no LoRA");
    assert_eq!(medium, Medium::Gpu, "GPU medium");
    assert_eq!(
        blocks,
        vec![
            StoredBlock {
                engine_hash: 10,
                local: local_hash(&[1, 2, 3, 4])
            },
            StoredBlock {
                engine_hash: 11,
                local: local_hash(&[5, 6, 7, 8])
            },
        ],
        "block i's local is the hash of tokens[i*bs..(i+1)*bs]"
    );
    assert_eq!(
        blocks[0].local, 14643705804678351452,
        "the published block-key test vector"
    );
}

#[test]
fn negative_int64_hash_is_cast_to_u64() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored",
        [-1, i64::MIN],
        -42,
        [1, 2],
        1,
        null,
        null
    ]))));
    let (parent, blocks, ..) = stored_parts(event);
    assert_eq!(
        parent,
        Some(-42i64 as u64),
        "a negative parent is reinterpreted as u64"
    );
    let hashes: Vec<u64> = blocks.iter().map(|b| b.engine_hash).collect();
    assert_eq!(
        hashes,
        vec![u64::MAX, 1u64 << 63],
        "negative hashes are reinterpreted as u64"
    );
}

#[test]
fn uint64_hash_above_i64_max_is_kept() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockRemoved",
        [u64::MAX, (1u64 << 63) + 1]
    ]))));
    assert_eq!(
        event,
        KvEvent::Removed {
            engine_hashes: vec![u64::MAX, (1u64 << 63) + 1],
            medium: Medium::Gpu
        },
        "uint64 hashes are taken as they are"
    );
}

#[test]
fn bytes_hash_uses_its_last_eight_bytes_big_endian() {
    let mut digest = vec![0xAAu8; 24];
    digest.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
    let event = Value::Array(vec![
        Value::from("BlockRemoved"),
        Value::Array(vec![Value::Binary(digest)]),
    ]);
    let payload = mpv(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![event]),
    ]));
    assert_eq!(
        only_event(decode_ok(&payload)),
        KvEvent::Removed {
            engine_hashes: vec![0x0102030405060708],
            medium: Medium::Gpu
        },
        "a 32-byte hash is its last 8 bytes read big-endian"
    );
}

#[test]
fn hashes_of_other_kinds_are_invalid_field() {
    let bad_hashes = [
        Value::Binary(vec![]),
        Value::Binary(vec![1; 7]),
        Value::Binary(vec![1; 12]),
        Value::Binary(vec![1; 20]),
        Value::Binary(vec![1; 36]),
        Value::from("0xabc"),
        Value::F64(1.0),
        Value::Nil,
    ];
    for bad in bad_hashes {
        let event = Value::Array(vec![
            Value::from("BlockRemoved"),
            Value::Array(vec![bad.clone()]),
        ]);
        let payload = mpv(&Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![event]),
        ]));
        assert_rejected(
            &payload,
            RejectReason::InvalidField,
            "BlockRemoved.block_hashes[0]",
            format_args!("{bad:?} is not a block hash"),
        );
    }
}

#[test]
fn block_size_must_be_a_positive_integer() {
    for bad in [
        json!("4"),
        json!(0),
        json!(-4),
        json!(4.0),
        json!(null),
        json!(4294967296u64),
    ] {
        let r = reject_reason(&batch_of(json!([
            "BlockStored",
            [1],
            null,
            [1, 2, 3, 4],
            bad
        ])));
        assert_eq!(
            r.reason,
            RejectReason::InvalidField,
            "block_size {bad} is rejected"
        );
        assert!(
            r.detail
                .starts_with("BlockStored.block_size: expected a positive integer, got"),
            "detail names the event type and field: {}",
            r.detail
        );
    }
    let r = reject_reason(&batch_of(json!([
        "BlockStored",
        [1],
        null,
        [1, 2, 3, 4],
        "4"
    ])));
    assert_eq!(
        r.detail, "BlockStored.block_size: expected a positive integer, got string (event 0)",
        "the detail has the documented wording"
    );
}

#[test]
fn missing_required_stored_fields_are_invalid_field() {
    let cases = [
        (json!(["BlockStored"]), "block_hashes"),
        (json!(["BlockStored", [1], null]), "token_ids"),
        (json!(["BlockStored", [1], null, [1]]), "block_size"),
        (
            json!({"type": "BlockStored", "token_ids": [1], "block_size": 1}),
            "block_hashes",
        ),
        (
            json!({"type": "BlockStored", "block_hashes": [1], "block_size": 1}),
            "token_ids",
        ),
        (json!({"type": "BlockRemoved"}), "block_hashes"),
    ];
    for (event, field) in cases {
        assert_rejected(
            &batch_of(event.clone()),
            RejectReason::InvalidField,
            field,
            format_args!("{event} lacks {field}"),
        );
    }
}

#[test]
fn token_count_must_equal_blocks_times_block_size() {
    for tokens in [
        json!([1, 2, 3, 4, 5, 6, 7]),
        json!([1, 2, 3, 4, 5, 6, 7, 8, 9]),
        json!([]),
    ] {
        let r = reject_reason(&batch_of(json!(["BlockStored", [1, 2], null, tokens, 4])));
        assert_eq!(
            r.reason,
            RejectReason::TokenCountMismatch,
            "{tokens} is not 2 blocks × 4 tokens"
        );
    }
}

#[test]
fn token_ids_must_be_u32() {
    for bad in [json!(-1), json!(4294967296u64), json!("1"), json!(1.0)] {
        assert_rejected(
            &batch_of(json!(["BlockStored", [1], null, [1, bad], 2])),
            RejectReason::InvalidField,
            "token_ids[1]",
            format_args!("token {bad} is rejected"),
        );
    }
    let r = reject_reason(&batch_of(json!(["BlockStored", [1], null, "abcd", 4])));
    assert_eq!(
        r.reason,
        RejectReason::InvalidField,
        "token_ids must be an array"
    );
}

#[test]
fn bigram_token_ids_take_the_first_element_of_each_pair() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored",
        [1, 2],
        null,
        [[10, 11], [11, 12], [12, 13], [13, 14]],
        2,
        null,
        "GPU"
    ]))));
    let (_, blocks, ..) = stored_parts(event);
    assert_eq!(
        blocks.iter().map(|b| b.local).collect::<Vec<_>>(),
        vec![local_hash(&[10, 11]), local_hash(&[12, 13])],
        "bigram pairs [t_i, t_i+1] contribute t_i"
    );
}

#[test]
fn malformed_bigrams_are_invalid_field() {
    for pairs in [
        json!([[1, 2], [2]]),
        json!([[1, 2], [2, 3, 4]]),
        json!([[1, 2], 3]),
        json!([[1, -2], [2, 3]]),
        json!([[1, 2], ["2", 3]]),
    ] {
        let r = reject_reason(&batch_of(json!(["BlockStored", [1], null, pairs, 2])));
        assert_eq!(
            r.reason,
            RejectReason::InvalidField,
            "{pairs} is not a list of u32 pairs"
        );
    }
}

#[test]
fn medium_gpu_in_any_case_or_nil_is_gpu_and_other_strings_are_lower_tiers() {
    let medium_of = |m: serde_json::Value| {
        stored_parts(only_event(decode_ok(&batch_of(json!([
            "BlockStored",
            [1],
            null,
            [1],
            1,
            null,
            m
        ])))))
        .4
    };
    assert_eq!(medium_of(json!("GPU")), Medium::Gpu, "GPU is the GPU tier");
    assert_eq!(
        medium_of(json!("gpu")),
        Medium::Gpu,
        "the comparison ignores case"
    );
    assert_eq!(medium_of(json!(null)), Medium::Gpu, "nil means GPU");
    assert_eq!(
        medium_of(json!("CPU")),
        Medium::Host,
        "CPU offload is the host tier"
    );
    assert_eq!(
        medium_of(json!("DISK")),
        Medium::Disk,
        "disk is the disk tier"
    );
    let absent = stored_parts(only_event(decode_ok(&batch_of(json!([
        "BlockStored",
        [1],
        null,
        [1],
        1
    ])))));
    assert_eq!(absent.4, Medium::Gpu, "an absent medium means GPU");
    let r = reject_reason(&batch_of(json!(["BlockRemoved", [1], 3])));
    assert_eq!(
        r.reason,
        RejectReason::InvalidField,
        "a non-string medium is rejected"
    );
}

#[test]
fn lora_name_wins_and_lora_id_is_the_fallback() {
    let lora_of = |id: serde_json::Value, name: serde_json::Value| {
        stored_parts(only_event(decode_ok(&batch_of(json!([
            "BlockStored",
            [1],
            null,
            [1],
            1,
            id,
            null,
            name
        ])))))
        .3
    };
    assert_eq!(
        lora_of(json!(7), json!("sql")).as_deref(),
        Some("sql"),
        "the name wins"
    );
    assert_eq!(
        lora_of(json!(7), json!(null)).as_deref(),
        Some("7"),
        "the id as decimal"
    );
    assert_eq!(
        lora_of(json!(7), json!("")).as_deref(),
        Some("7"),
        "an empty name is no name"
    );
    assert_eq!(
        lora_of(json!(-3), json!(null)).as_deref(),
        Some("-3"),
        "any int id"
    );
    assert_eq!(
        lora_of(json!(null), json!("sql")).as_deref(),
        Some("sql"),
        "name alone"
    );
    assert_eq!(lora_of(json!(null), json!(null)), None, "no LoRA");
    for (id, name) in [(json!("7"), json!(null)), (json!(null), json!(7))] {
        let r = reject_reason(&batch_of(json!([
            "BlockStored",
            [1],
            null,
            [1],
            1,
            id,
            null,
            name
        ])));
        assert_eq!(
            r.reason,
            RejectReason::InvalidField,
            "lora_id {id} / lora_name {name}"
        );
    }
}

#[test]
fn extra_keys_and_group_idx_are_accepted_and_ignored() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored", [1], null, [1], 1, null, "GPU", null,
        [["mm-hash", 0], null, {"anything": true}], "not-even-an-int"
    ]))));
    assert_eq!(
        stored_parts(event).1.len(),
        1,
        "extra_keys/group_idx do not affect decoding"
    );
}

#[test]
fn unknown_trailing_fields_are_ignored() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored", [1], null, [1], 1, null, "GPU", null, null, 0, "future", [1, 2], {"k": 1}
    ]))));
    assert_eq!(
        stored_parts(event).1.len(),
        1,
        "elements past group_idx are ignored"
    );
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockRemoved",
        [1],
        "GPU",
        0,
        "future"
    ]))));
    assert_eq!(
        event,
        KvEvent::Removed {
            engine_hashes: vec![1],
            medium: Medium::Gpu
        },
        "elements past BlockRemoved.group_idx are ignored"
    );
}

#[test]
fn map_events_read_fields_by_name_and_ignore_unknown_keys() {
    let event = only_event(decode_ok(&batch_of(json!({
        "block_size": 2,
        "token_ids": [5, 6],
        "type": "BlockStored",
        "block_hashes": [77],
        "lora_name": "x",
        "weird": [1, 2, 3],
    }))));
    assert_eq!(
        event,
        KvEvent::Stored {
            parent: None,
            blocks: vec![StoredBlock {
                engine_hash: 77,
                local: local_hash(&[5, 6])
            }],
            block_size: 2,
            lora: Some("x".into()),
            medium: Medium::Gpu,
            full_attention: true,
        },
        "key order does not matter and an absent parent is none"
    );
}

#[test]
fn stored_event_with_no_blocks_is_accepted() {
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored",
        [],
        null,
        [],
        16
    ]))));
    assert!(
        stored_parts(event).1.is_empty(),
        "zero blocks and zero tokens are consistent"
    );
}

#[test]
fn blocks_longer_than_the_stack_buffer_hash_correctly() {
    let tokens: Vec<u32> = (0..256).collect();
    let event = only_event(decode_ok(&batch_of(json!([
        "BlockStored",
        [1, 2],
        null,
        tokens,
        128
    ]))));
    let locals: Vec<u64> = stored_parts(event).1.iter().map(|b| b.local).collect();
    assert_eq!(
        locals,
        vec![local_hash(&tokens[..128]), local_hash(&tokens[128..])],
        "block sizes above 64 use the same hashing"
    );
}

#[test]
fn token_ids_decode_alike_in_every_integer_form() {
    use rmp::encode::{write_array_len, write_f64, write_i32, write_i8, write_nil, write_str};
    use rmp::encode::{write_pfix, write_u16, write_u32, write_u64, write_u8};
    // Each unsigned form a token id takes (the single-pass decoder reads these straight from
    // the bytes), then the forms it leaves to the general reader: a non-negative value under a
    // signed marker, a small value in a uint 64.
    type Write = fn(&mut Vec<u8>, u32);
    let forms: [(u32, Write); 11] = [
        (0, |b, t| write_pfix(b, t as u8).unwrap()),
        (127, |b, t| write_pfix(b, t as u8).unwrap()),
        (128, |b, t| write_u8(b, t as u8).unwrap()),
        (255, |b, t| write_u8(b, t as u8).unwrap()),
        (256, |b, t| write_u16(b, t as u16).unwrap()),
        (65_535, |b, t| write_u16(b, t as u16).unwrap()),
        (65_536, |b, t| write_u32(b, t).unwrap()),
        (u32::MAX, |b, t| write_u32(b, t).unwrap()),
        (5, |b, t| write_i8(b, t as i8).unwrap()),
        (70_000, |b, t| write_i32(b, t as i32).unwrap()),
        (300, |b, t| write_u64(b, u64::from(t)).unwrap()),
    ];
    let mut payload = Vec::new();
    write_array_len(&mut payload, 2).unwrap();
    write_f64(&mut payload, 1.0).unwrap();
    write_array_len(&mut payload, 1).unwrap();
    write_array_len(&mut payload, 5).unwrap();
    write_str(&mut payload, "BlockStored").unwrap();
    write_array_len(&mut payload, forms.len() as u32).unwrap();
    for hash in 0..forms.len() {
        write_pfix(&mut payload, hash as u8).unwrap();
    }
    write_nil(&mut payload).unwrap();
    write_array_len(&mut payload, forms.len() as u32).unwrap();
    for (token, write) in forms {
        write(&mut payload, token);
    }
    write_pfix(&mut payload, 1).unwrap();
    assert!(
        decode_vllm_array(&payload).is_some(),
        "the single-pass decoder takes the batch"
    );
    let (_, blocks, ..) = stored_parts(only_event(decode_ok(&payload)));
    let locals: Vec<u64> = blocks.iter().map(|b| b.local).collect();
    let want: Vec<u64> = forms.iter().map(|&(t, _)| local_hash(&[t])).collect();
    assert_eq!(
        locals, want,
        "every integer form of a token id decodes to the same id on both decoders"
    );
}
