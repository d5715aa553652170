//! Bad input on every NATS subject and HTTP endpoint (docs/architecture.md, "Failure and bad
//! input"): each is rejected with a clear error (HTTP: a status and a one-line `error`) or dropped
//! with a counted reason (`kvrouted_inputs_rejected_total{reason}`), the daemon keeps running, and
//! nothing already applied is lost or changed.
mod common;

use common::*;
use kvrouted::input::LifecycleOp;
use kvrouted::wire::{encode_lifecycle, encode_load, encode_vllm_batch, VllmEvent};
use rmpv::Value as Mp;
use serde_json::{json, Value};

/// Flags of the daemons below: small limits so oversize input is cheap to produce.
const LIMITS: &[&str] = &["--max-body-bytes", "4096", "--max-prompt-tokens", "256"];

/// A daemon that knows `owner` (holding the 8 blocks of `prompt(1, 8)`, pressure 0.4) and
/// `other` (pressure 0.2).
struct Setup {
    daemon: Daemon,
    owner: Worker,
    tokens: Vec<u32>,
    nats: Nats,
}

async fn setup() -> Setup {
    setup_with(LIMITS).await
}

async fn setup_with(flags: &[&str]) -> Setup {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), flags).await;
    daemon.wait_ready().await;
    let OwnerAndOther { owner, tokens, .. } =
        OwnerAndOther::publish(&daemon, &nats.url(), 0.4, 0.2).await;
    Setup {
        daemon,
        owner,
        tokens,
        nats,
    }
}

/// What `/v1/workers` says, minus the telemetry age (which moves with the clock).
async fn state(daemon: &Daemon) -> Vec<Value> {
    let mut rows = daemon.workers().await["workers"]
        .as_array()
        .unwrap()
        .clone();
    for row in &mut rows {
        row.as_object_mut().unwrap().remove("telemetry_age_ms");
    }
    rows
}

/// Routes the stored prompt, checks it goes to its owner with the whole prefix matched, and
/// releases the reservation so reserved work is back where it was.
async fn assert_prefix_routes_to_owner(s: &Setup, when: &str) {
    let (status, body) = s.daemon.route(&s.tokens, json!({})).await;
    assert_eq!(
        status, 200,
        "{when}: the stored prefix still routes: {body}"
    );
    assert_eq!(
        (&body["worker"], &body["decision"], &body["matched_blocks"]),
        (&json!("owner"), &json!("owner_hold"), &json!(8)),
        "{when}: the stored prefix routes to its owner with all 8 blocks matched: {body}"
    );
    let (status, _) = s
        .daemon
        .post("/v1/release", &json!({"reservation": body["reservation"]}))
        .await;
    assert_eq!(status, 200, "{when}: the route's reservation releases");
}

fn headers(pairs: &[(&str, &str)]) -> async_nats::HeaderMap {
    let mut h = async_nats::HeaderMap::new();
    for (k, v) in pairs {
        h.insert(*k, *v);
    }
    h
}

fn mp(value: Mp) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &value).unwrap();
    out
}

/// A load sample map with `kv_usage` and `running` as given (hand-encoded: the encoder only
/// writes valid samples).
fn load_sample(kv_usage: Mp, running: Mp) -> Vec<u8> {
    mp(Mp::Map(vec![
        (Mp::from("kv_usage"), kv_usage),
        (Mp::from("running"), running),
        (Mp::from("waiting"), Mp::from(0)),
        (Mp::from("ts"), Mp::F64(0.0)),
    ]))
}

fn stored(hashes: Vec<u64>, tokens: Vec<u32>, block_size: u32) -> Vec<u8> {
    encode_vllm_batch(
        1.0,
        &[VllmEvent::BlockStored {
            block_hashes: hashes,
            parent_block_hash: None,
            token_ids: tokens,
            block_size,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
        }],
        None,
    )
}

const GARBAGE: &[u8] = b"\xc1\xc1 this is not MessagePack";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_nats_input_on_every_subject_is_dropped_with_a_counted_reason_and_changes_nothing() {
    let mut s = setup().await;
    let d = &s.daemon;
    assert_prefix_routes_to_owner(&s, "before the bad input").await;
    let before = state(d).await;
    let none = || headers(&[]);
    let w = &s.owner;
    let long_id = "w".repeat(129);

    // Garbage bytes on each subject kind; from an unknown worker it must not make it known.
    w.publish_js("kv.events.intruder", none(), GARBAGE.to_vec())
        .await;
    w.publish_core("kv.load.intruder", GARBAGE.to_vec()).await;
    w.publish_js("kv.workers.owner", none(), GARBAGE.to_vec())
        .await;
    // KV events: a block size other than the configured 16; tokens not matching the hashes;
    // an unknown tag; an unreadable Kv-Seq; a payload over --max-body-bytes (valid otherwise).
    let big = prompt(50, 300);
    let hashes32: Vec<u64> = (900..904).collect();
    w.publish_js(
        "kv.events.owner",
        none(),
        stored(hashes32, prompt(51, 8), 32),
    )
    .await;
    w.publish_js(
        "kv.events.owner",
        none(),
        stored(vec![1, 2], prompt(52, 1), 16),
    )
    .await;
    let unknown_tag = mp(Mp::Array(vec![
        Mp::F64(1.0),
        Mp::Array(vec![Mp::Array(vec![
            Mp::from("BlockTeleported"),
            Mp::Array(vec![Mp::from(7)]),
        ])]),
        Mp::Nil,
    ]));
    w.publish_js("kv.events.owner", none(), unknown_tag).await;
    w.publish_js(
        "kv.events.owner",
        headers(&[("Kv-Seq", "12abc")]),
        stored(vec![3], prompt(53, 1), 16),
    )
    .await;
    // An unreadable Kv-Epoch (a space inside), and a batch whose ts is NaN.
    w.publish_js(
        "kv.events.owner",
        headers(&[("Kv-Epoch", "engine 2")]),
        stored(vec![5], prompt(55, 1), 16),
    )
    .await;
    let nan_ts = mp(Mp::Array(vec![
        Mp::F64(f64::NAN),
        Mp::Array(vec![Mp::Array(vec![Mp::from("AllBlocksCleared")])]),
        Mp::Nil,
    ]));
    w.publish_js("kv.events.owner", none(), nan_ts).await;
    w.publish_js(
        "kv.events.owner",
        none(),
        stored((1000..1300).collect(), big, 16),
    )
    .await;
    // Load samples: NaN, infinite, above 1, below 0, a negative count, a wrong type.
    for kv_usage in [f64::NAN, f64::INFINITY, 1.5, -0.25] {
        w.publish_core("kv.load.owner", load_sample(Mp::F64(kv_usage), Mp::from(1)))
            .await;
    }
    w.publish_core("kv.load.owner", load_sample(Mp::F64(0.9), Mp::from(-3)))
        .await;
    w.publish_core("kv.load.owner", load_sample(Mp::from("high"), Mp::from(1)))
        .await;
    // Worker ids in subjects: over-long (129 characters), a forbidden character, dotted.
    let sample = encode_load(0.99, 1, 0, Some(64), 0.0, None);
    w.publish_core(&format!("kv.load.{long_id}"), sample.clone())
        .await;
    w.publish_core("kv.load.bad!id", sample).await;
    w.publish_js(
        &format!("kv.events.{long_id}"),
        none(),
        stored(vec![4], prompt(54, 1), 16),
    )
    .await;
    w.publish_js(
        "kv.workers.a.b",
        none(),
        encode_lifecycle(LifecycleOp::Join, None, Some(16), None),
    )
    .await;
    // Lifecycle: an unknown op, a wrong type. (A lifecycle message with a bad field has that
    // field rejected and its op applied, so it changes state: tests/daemon_engine_fleet.rs.)
    let op = |op: Mp| mp(Mp::Map(vec![(Mp::from("op"), op)]));
    w.publish_js("kv.workers.owner", none(), op(Mp::from("reboot")))
        .await;
    w.publish_js("kv.workers.owner", none(), op(Mp::from(5)))
        .await;
    // Last in the stream, a message with nothing to journal: its ack must not wait forever.
    w.publish_js("kv.events.owner", none(), GARBAGE.to_vec())
        .await;

    let expected = [
        ("malformed_payload", 4.0),
        ("block_size_mismatch", 1.0),
        ("token_count_mismatch", 1.0),
        ("unknown_event_tag", 1.0),
        ("invalid_header", 2.0),
        ("oversize_payload", 1.0),
        ("invalid_load_value", 5.0),
        ("invalid_field", 3.0),
        ("invalid_worker_id", 4.0),
        ("unknown_lifecycle_op", 1.0),
    ];
    for (reason, n) in expected {
        d.wait_rejected(reason, n).await;
    }
    for (reason, n) in expected {
        assert_eq!(
            d.rejected(reason).await,
            n,
            "each bad message is counted once, under its own reason ({reason})"
        );
    }

    assert_eq!(
        state(d).await,
        before,
        "no bad message changed a worker's state, pressure, ownership or reserved work, and \
         none made a worker known"
    );
    assert_prefix_routes_to_owner(&s, "after the bad input").await;
    let observer = async_nats::connect(s.nats.url()).await.unwrap();
    eventually(
        "the bad JetStream messages, the last in the stream, are acked and not redelivered",
        || consumer_settled(&observer),
    )
    .await;
    assert_eq!(
        d.metric("kvrouted_events_applied_total{kind=\"stored\"}")
            .await,
        8.0,
        "only the 8 good blocks were ever stored"
    );

    // Ingest is not wedged on a bad message: a good event after them is applied.
    s.owner.store(&prompt(2, 4)).await;
    s.daemon.wait_blocks("owner", 12).await;
    assert!(
        s.daemon.is_running(),
        "the daemon process survives every bad message"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_http_requests_get_a_status_and_a_one_line_error_and_change_nothing() {
    let mut s = setup().await;
    let d = &s.daemon;
    assert_prefix_routes_to_owner(&s, "before the bad requests").await;
    let before = state(d).await;
    let t = &s.tokens;

    let route_cases: Vec<(&str, Value, u16)> = vec![
        ("tokens of the wrong type", json!({"tokens": "abc"}), 400),
        ("a negative token id", json!({"tokens": [1, -2]}), 400),
        ("a fractional token id", json!({"tokens": [1.5]}), 400),
        (
            "a negative prompt_tokens",
            json!({"block_keys": [1, 2], "prompt_tokens": -5}),
            400,
        ),
        (
            "a negative max_output_tokens",
            json!({"tokens": t, "max_output_tokens": -1}),
            400,
        ),
        ("a negative block key", json!({"block_keys": [-1]}), 400),
        (
            "both tokens and block_keys",
            json!({"tokens": t, "block_keys": [1]}),
            400,
        ),
        ("neither tokens nor block_keys", json!({"model": "m"}), 400),
        (
            "exclude not a list",
            json!({"tokens": t, "exclude": "owner"}),
            400,
        ),
        (
            "an exclude id with a forbidden character",
            json!({"tokens": t, "exclude": ["bad id!"]}),
            400,
        ),
        (
            "an exclude id of 129 characters",
            json!({"tokens": t, "exclude": ["w".repeat(129)]}),
            400,
        ),
        (
            "explain not a boolean",
            json!({"tokens": t, "explain": "yes"}),
            400,
        ),
        ("model not a string", json!({"tokens": t, "model": 7}), 400),
        (
            "a request_id over 256 bytes",
            json!({"tokens": t, "request_id": "r".repeat(300)}),
            400,
        ),
        ("a JSON array body", json!([1, 2, 3]), 400),
        (
            "a prompt over --max-prompt-tokens (tokens)",
            json!({"tokens": prompt(3, 16).into_iter().chain([7]).collect::<Vec<_>>()}),
            413,
        ),
        (
            "a prompt over --max-prompt-tokens (block keys × block size)",
            json!({"block_keys": (1..=17).collect::<Vec<u64>>()}),
            413,
        ),
        (
            "a body over --max-body-bytes",
            json!({"tokens": t, "request_id": "r".repeat(5000)}),
            413,
        ),
    ];
    let mut cases: Vec<(String, &str, &str, Vec<u8>, u16)> = route_cases
        .into_iter()
        .map(|(what, body, status)| {
            let bytes = serde_json::to_vec(&body).unwrap();
            (
                what.to_string(),
                "/v1/route",
                "application/json",
                bytes,
                status,
            )
        })
        .collect();
    cases.extend([
        (
            "a body that is not JSON".to_string(),
            "/v1/route",
            "application/json",
            b"{not json".to_vec(),
            400,
        ),
        (
            "an empty body".to_string(),
            "/v1/route",
            "application/json",
            Vec::new(),
            400,
        ),
        (
            "a body that is not MessagePack".to_string(),
            "/v1/route",
            "application/msgpack",
            GARBAGE.to_vec(),
            400,
        ),
        (
            "release: a negative reservation".to_string(),
            "/v1/release",
            "application/json",
            br#"{"reservation": -1}"#.to_vec(),
            400,
        ),
        (
            "release: a reservation of the wrong type".to_string(),
            "/v1/release",
            "application/json",
            br#"{"reservation": "abc"}"#.to_vec(),
            400,
        ),
        (
            "release: no reservation".to_string(),
            "/v1/release",
            "application/json",
            b"{}".to_vec(),
            400,
        ),
        (
            "release: an unknown reservation".to_string(),
            "/v1/release",
            "application/json",
            br#"{"reservation": 987654321}"#.to_vec(),
            404,
        ),
    ]);

    for (what, path, content_type, body, expected) in cases {
        let (status, ct, reply) = d.post_bytes(path, content_type, body).await;
        let text = String::from_utf8_lossy(&reply);
        assert_eq!(
            status, expected,
            "{what} on {path} is answered {expected}: {text}"
        );
        assert!(
            ct.starts_with("application/json") || ct.starts_with("application/msgpack"),
            "{what}: the error reply is structured (JSON or MessagePack), not {ct:?}: {text}"
        );
        let reply: Value = if ct.starts_with("application/msgpack") {
            rmp_serde::from_slice(&reply).unwrap()
        } else {
            serde_json::from_slice(&reply).unwrap()
        };
        let error = reply["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{what}: the reply has an error field: {reply}"));
        assert!(
            !error.is_empty() && !error.contains('\n') && error.len() < 400,
            "{what}: the error is one short line: {error:?}"
        );
    }

    // The MessagePack form of a route request works and is answered in MessagePack.
    let body = rmp_serde::to_vec_named(&json!({"tokens": t, "request_id": "mp-1"})).unwrap();
    let (status, ct, reply) = d.post_bytes("/v1/route", "application/msgpack", body).await;
    assert_eq!(status, 200, "a MessagePack route request is accepted");
    assert!(
        ct.starts_with("application/msgpack"),
        "a MessagePack request gets a MessagePack reply, not {ct:?}"
    );
    let reply: Value = rmp_serde::from_slice(&reply).expect("a MessagePack reply");
    assert_eq!(
        (
            &reply["worker"],
            &reply["matched_blocks"],
            &reply["request_id"]
        ),
        (&json!("owner"), &json!(8), &json!("mp-1")),
        "the MessagePack request routes like the JSON one: {reply}"
    );
    let (status, _) = d
        .post("/v1/release", &json!({"reservation": reply["reservation"]}))
        .await;
    assert_eq!(status, 200, "the MessagePack route's reservation releases");

    assert_eq!(
        state(d).await,
        before,
        "no bad request changed a worker's state, pressure, ownership or reserved work"
    );
    assert_prefix_routes_to_owner(&s, "after the bad requests").await;
    assert_eq!(
        d.get("/healthz").await.0,
        200,
        "the daemon is healthy after the bad requests"
    );
    assert!(
        s.daemon.is_running(),
        "the daemon process survives every bad request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lifecycle_message_with_a_bad_field_is_applied_without_it_and_the_field_is_counted() {
    let mut s = setup().await;
    let d = &s.daemon;
    // A drain whose block_size has the wrong type: the field is rejected, the drain applied.
    let drain = mp(Mp::Map(vec![
        (Mp::from("op"), Mp::from("drain")),
        (Mp::from("block_size"), Mp::from("16")),
    ]));
    s.owner
        .publish_js("kv.workers.owner", headers(&[]), drain)
        .await;
    d.wait_state("owner", "draining").await;
    d.wait_rejected("invalid_field", 1.0).await;
    assert_eq!(
        d.rejected("invalid_field").await,
        1.0,
        "the bad field is counted once, under invalid_field"
    );
    assert_eq!(
        d.blocks().await.get("owner").copied(),
        Some(8),
        "a drain keeps the worker's ownership"
    );
    assert!(s.daemon.is_running(), "the daemon keeps running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_prompt_tokens_or_exclude_list_is_refused_before_it_reaches_the_router() {
    // Default body limits, so the exclude list fits in the body and is refused for its length.
    let s = setup_with(&["--max-prompt-tokens", "256"]).await;
    let d = &s.daemon;
    assert_prefix_routes_to_owner(&s, "before the requests").await;
    let before = state(d).await;
    // Would wrap reserved work, or keep every cold miss off the worker for the reservation's
    // lifetime.
    for prompt_tokens in [
        json!(18446744073709547520u64),
        json!(1_000_000_000_000_000_000u64),
    ] {
        let (status, body) = d
            .post(
                "/v1/route",
                &json!({"block_keys": [1], "prompt_tokens": prompt_tokens}),
            )
            .await;
        assert_eq!(
            status, 413,
            "prompt_tokens {prompt_tokens} is refused: {body}"
        );
        assert!(
            body["error"]
                .as_str()
                .is_some_and(|e| e.contains("--max-prompt-tokens")),
            "the error names the limit: {body}"
        );
    }
    let excluded: Vec<String> = (0..1025).map(|i| format!("w{i}")).collect();
    let (status, body) = d
        .post(
            "/v1/route",
            &json!({"tokens": s.tokens, "exclude": excluded}),
        )
        .await;
    assert_eq!(
        status, 400,
        "an exclude list over 1024 workers is refused: {body}"
    );
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("at most 1024")),
        "the error names the limit: {body}"
    );
    assert_eq!(
        state(d).await,
        before,
        "refused routes reserve nothing and change nothing"
    );
    assert_prefix_routes_to_owner(&s, "after the requests").await;
}
