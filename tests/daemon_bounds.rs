//! Bounded state from the outside (docs/security.md, "Bounded state"): `--max-workers` and
//! `--max-models` refuse what is new beyond them, counted, without touching what is known; a
//! worker that leaves frees its place and its metric series; oversize names in routes are
//! refused.
mod common;

use common::*;
use kvrouted::input::LifecycleOp;
use kvrouted::wire::{encode_vllm_batch, VllmEvent};
use serde_json::json;

/// Whether `/metrics` has a per-worker series of `id`.
async fn has_worker_series(daemon: &Daemon, id: &str) -> bool {
    let (_, text) = daemon.get("/metrics").await;
    let label = format!("{{worker=\"{id}\"}}");
    text.lines().any(|l| l.contains(&label))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_worker_beyond_max_workers_is_refused_until_a_known_one_leaves() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &["--max-workers", "3"]).await;
    daemon.wait_ready().await;
    let OwnerAndOther { tokens, .. } = OwnerAndOther::publish(&daemon, &nats.url(), 0.4, 0.2).await;
    let third = Worker::connect(&nats.url(), "third").await;
    third.load(0.3).await;
    daemon.wait_load("third", 0.3).await;
    eventually("third's pressure series is exported", || async {
        has_worker_series(&daemon, "third").await.then_some(())
    })
    .await;

    let fourth = Worker::connect(&nats.url(), "fourth").await;
    fourth.load(0.1).await;
    daemon.wait_rejected("worker_limit", 1.0).await;
    fourth.lifecycle(LifecycleOp::Join).await;
    daemon.wait_rejected("worker_limit", 2.0).await;
    assert!(
        daemon.worker("fourth").await.is_none(),
        "a fourth worker is not created past --max-workers 3"
    );
    assert!(
        plain(&daemon.log_text()).contains("from new worker fourth rejected: 3 workers are known"),
        "the log says which worker was refused and why"
    );
    let (status, body) = daemon.route(&tokens, json!({})).await;
    assert_eq!(
        (status, &body["worker"], &body["decision"]),
        (200, &json!("owner"), &json!("owner_hold")),
        "known workers are unaffected: the owner keeps its prefix: {body}"
    );

    third.lifecycle(LifecycleOp::Leave).await;
    eventually("third's metric series end once it left", || async {
        (!has_worker_series(&daemon, "third").await).then_some(())
    })
    .await;
    // Its place is free: the fourth worker's next sample is applied.
    eventually("the fourth worker is admitted", || async {
        fourth.load(0.1).await;
        daemon.worker("fourth").await.map(|_| ())
    })
    .await;
    assert!(
        has_worker_series(&daemon, "owner").await,
        "the owner's series stay"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_model_beyond_max_models_is_refused_and_route_names_are_bounded() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &["--max-models", "1"]).await;
    daemon.wait_ready().await;
    let OwnerAndOther { tokens, .. } = OwnerAndOther::publish(&daemon, &nats.url(), 0.4, 0.2).await;
    // The owner's blocks made the default namespace: a model is a second one.
    let typo = Worker::connect(&nats.url(), "typo").await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Kv-Model", "llama-typo");
    let stored = VllmEvent::BlockStored {
        block_hashes: vec![101, 102],
        parent_block_hash: None,
        token_ids: prompt(9, 2),
        block_size: 16,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
    };
    typo.publish_js(
        "kv.events.typo",
        headers,
        encode_vllm_batch(1.0, &[stored], None),
    )
    .await;
    daemon.wait_rejected("model_limit", 1.0).await;
    assert_eq!(
        daemon.blocks().await.get("typo").copied().unwrap_or(0),
        0,
        "the refused model's blocks are not stored"
    );

    let long = "m".repeat(257);
    for field in ["model", "lora"] {
        let (status, body) = daemon.route(&tokens, json!({ field: long })).await;
        assert_eq!(status, 400, "a {field} over 256 bytes is refused: {body}");
        assert!(
            body["error"]
                .as_str()
                .is_some_and(|e| e.contains("longer than 256 bytes")),
            "the error names the limit: {body}"
        );
    }
    let (status, body) = daemon
        .route(&tokens, json!({"model": "never-announced"}))
        .await;
    assert_eq!(
        status, 200,
        "a route naming an unannounced model is served (cold miss): {body}"
    );
    let (status, body) = daemon.route(&tokens, json!({})).await;
    assert_eq!(
        (status, &body["worker"], &body["decision"]),
        (200, &json!("owner"), &json!("owner_hold")),
        "the known namespace is unaffected: {body}"
    );
}
