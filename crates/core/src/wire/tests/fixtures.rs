//! Byte fixtures written by msgspec with vLLM's struct layout (`tests/fixtures/kv_events/`).

use super::*;

fn expected_event(e: &serde_json::Value) -> KvEvent {
    let medium = |m: &serde_json::Value| match m.as_str() {
        Some("gpu") => Medium::Gpu,
        Some("host") => Medium::Host,
        Some("disk") => Medium::Disk,
        other => panic!("expected.json: unknown medium {other:?}"),
    };
    let u64s = |v: &serde_json::Value| -> Vec<u64> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|h| h.as_u64().expect("u64"))
            .collect()
    };
    match e["kind"].as_str() {
        Some("stored") => KvEvent::Stored {
            parent: e["parent"].as_u64(),
            blocks: e["blocks"]
                .as_array()
                .expect("blocks")
                .iter()
                .map(|b| StoredBlock {
                    engine_hash: b["engine_hash"].as_u64().expect("engine_hash"),
                    local: b["local"].as_u64().expect("local"),
                })
                .collect(),
            block_size: e["block_size"].as_u64().expect("block_size") as u32,
            lora: e["lora"].as_str().map(str::to_owned),
            medium: medium(&e["medium"]),
            full_attention: e["full_attention"].as_bool().unwrap_or(true),
        },
        Some("removed") => KvEvent::Removed {
            engine_hashes: u64s(&e["engine_hashes"]),
            medium: medium(&e["medium"]),
        },
        Some("cleared") => KvEvent::Cleared,
        other => panic!("expected.json: unknown event kind {other:?}"),
    }
}

#[test]
fn vllm_fixtures_decode_as_expected() {
    let text = std::fs::read_to_string(fixture_dir().join("expected.json")).expect("expected.json");
    let expected: serde_json::Value = serde_json::from_str(&text).expect("expected.json parses");
    let fixtures = expected["fixtures"].as_array().expect("a fixtures array");
    assert!(
        fixtures.len() >= 15,
        "every fixture is described in expected.json"
    );

    let on_disk = std::fs::read_dir(fixture_dir())
        .expect("fixture dir")
        .filter(|e| {
            e.as_ref()
                .map(|e| e.path().extension().is_some_and(|x| x == "msgpack"))
                .unwrap_or(false)
        })
        .count();
    assert_eq!(
        on_disk,
        fixtures.len(),
        "every .msgpack file has an entry in expected.json"
    );

    for fx in fixtures {
        let file = fx["file"].as_str().expect("file");
        let result = decode(&read_fixture(file));
        if let Some(ok) = fx.get("ok") {
            let batch = result.unwrap_or_else(|r| panic!("{file} must decode, got {r:?}"));
            assert_eq!(
                batch.dp_rank as u64,
                ok["dp_rank"].as_u64().unwrap(),
                "{file}: dp rank"
            );
            let events: Vec<KvEvent> = ok["events"]
                .as_array()
                .expect("events")
                .iter()
                .map(expected_event)
                .collect();
            assert_eq!(
                batch.events, events,
                "{file}: decoded events match expected.json"
            );
            assert_eq!(
                (batch.seq, batch.model),
                (None, None),
                "{file}: no headers given"
            );
        } else {
            let reason = fx["error"].as_str().expect("ok or error");
            let r = result
                .map(|b| panic!("{file} must be rejected, decoded {b:?}"))
                .unwrap_err();
            assert_eq!(
                r.reason.as_str(),
                reason,
                "{file}: rejection reason ({})",
                r.detail
            );
        }
    }
}

#[test]
fn encoder_writes_the_same_bytes_as_msgspec() {
    const TS: f64 = 1700000000.25;
    let toks_a: Vec<u32> = (1..=8).collect();
    let toks_b: Vec<u32> = vec![9, 10, 11, 12];
    let big = u64::MAX - 4;
    let stored = |hashes: Vec<u64>,
                  parent: Option<u64>,
                  tokens: &Vec<u32>,
                  lora_id: Option<i64>,
                  medium: &str,
                  lora_name: Option<&str>| VllmEvent::BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: tokens.clone(),
        block_size: 4,
        lora_id,
        medium: Some(medium.into()),
        lora_name: lora_name.map(str::to_owned),
    };
    let cases: Vec<(&str, Vec<VllmEvent>, Option<u32>)> = vec![
        (
            "stored_chain_int_hashes.msgpack",
            vec![
                stored(vec![101, big], None, &toks_a, None, "GPU", None),
                stored(vec![103], Some(big), &toks_b, None, "GPU", None),
            ],
            None,
        ),
        (
            "removed.msgpack",
            vec![VllmEvent::BlockRemoved {
                block_hashes: vec![101, big, 103],
                medium: Some("GPU".into()),
            }],
            None,
        ),
        ("cleared.msgpack", vec![VllmEvent::AllBlocksCleared], None),
        (
            "dp_rank.msgpack",
            vec![stored(vec![55], None, &toks_b, None, "GPU", None)],
            Some(3),
        ),
        (
            "lora.msgpack",
            vec![
                stored(vec![61], None, &toks_b, Some(7), "GPU", Some("sql-adapter")),
                stored(vec![62], Some(61), &toks_b, Some(9), "GPU", None),
                stored(vec![63], Some(62), &toks_b, Some(9), "GPU", Some("")),
            ],
            None,
        ),
        (
            "cpu_medium.msgpack",
            vec![
                stored(vec![71], None, &toks_b, None, "CPU", None),
                VllmEvent::BlockRemoved {
                    block_hashes: vec![71],
                    medium: Some("cpu".into()),
                },
                stored(vec![72], None, &toks_b, None, "gpu", None),
            ],
            None,
        ),
    ];
    for (file, events, dp_rank) in cases {
        assert_eq!(
            encode_vllm_batch(TS, &events, dp_rank),
            read_fixture(file),
            "encode_vllm_batch must write msgspec's exact bytes for {file}"
        );
    }
}
