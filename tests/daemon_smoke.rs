//! The daemon end to end: a vLLM-format worker publishes, a gateway routes.
mod common;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_prefix_routes_to_its_owner_over_http() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    daemon.wait_ready().await;
    let OwnerAndOther { tokens, .. } = OwnerAndOther::publish(&daemon, &nats.url(), 0.5, 0.0).await;
    assert_eq!(
        daemon.blocks().await.len(),
        2,
        "both workers are known, the owner's 8 blocks indexed"
    );
    let (status, body) = daemon.route(&tokens, json!({"request_id": "r1"})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["worker"], "owner",
        "the owner of the whole prefix is chosen: {body}"
    );
    assert_eq!(body["decision"], "owner_hold");
    assert_eq!(body["matched_blocks"], 8);
    assert_eq!(body["prompt_blocks"], 8);
    assert_eq!(body["request_id"], "r1");
    let reservation = body["reservation"].as_u64().unwrap();
    let (status, _) = daemon
        .post("/v1/release", &json!({"reservation": reservation}))
        .await;
    assert_eq!(status, 200, "a fresh reservation releases");
    let (status, _) = daemon
        .post("/v1/release", &json!({"reservation": reservation}))
        .await;
    assert_eq!(status, 404, "a released reservation is unknown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_examples_in_schemas_are_accepted() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    daemon.wait_ready().await;
    let worker = Worker::connect(&nats.url(), "worker-1").await;
    worker.load(0.1).await;
    eventually("the worker is known", || async {
        daemon.blocks().await.contains_key("worker-1").then_some(())
    })
    .await;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas/examples/http");
    let example = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join(name)).unwrap()).unwrap()
    };
    for name in ["route-tokens.json", "route-block-keys.json"] {
        let (status, body) = daemon.post("/v1/route", &example(name)).await;
        assert_eq!(status, 200, "{name} is a valid route request: {body}");
        assert_eq!(body["worker"], "worker-1");
    }
    for name in ["release.json", "release-prefill.json"] {
        let (status, body) = daemon.post("/v1/release", &example(name)).await;
        assert_eq!(
            status, 404,
            "{name} decodes; reservation 42 is unknown here: {body}"
        );
        assert!(
            body["error"].as_str().unwrap().contains("42"),
            "the error names the reservation"
        );
    }
}
