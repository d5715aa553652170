//! The broker goes away under a running daemon and comes back on the same port with the same
//! storage (docs/architecture.md, "Failure and bad input"): routes are served from the last known state throughout, readiness
//! says degraded (and stays in rotation) meanwhile, and ingest resumes on both paths afterwards:
//! KV events through the JetStream durable consumer, load samples on core NATS.
mod common;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_are_served_through_a_broker_restart_and_ingest_resumes_after_it() {
    let mut nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    daemon.wait_ready().await;
    let OwnerAndOther {
        mut owner,
        other,
        tokens: first,
    } = OwnerAndOther::publish(&daemon, &nats.url(), 0.4, 0.2).await;

    nats.stop();
    let (status, ready) = daemon.wait_readyz("degraded").await;
    assert_eq!(
        status, 200,
        "with NATS down the daemon stays in rotation: readiness says degraded, it does not fail: \
         {ready}"
    );
    let (status, body) = daemon.route(&first, json!({})).await;
    assert_eq!(status, 200, "routes are served while NATS is down: {body}");
    assert_eq!(
        (&body["worker"], &body["decision"], &body["matched_blocks"]),
        (&json!("owner"), &json!("owner_hold"), &json!(8)),
        "routing uses the last known state while NATS is down: {body}"
    );
    let (status, body) = daemon.route(&prompt(9, 4), json!({})).await;
    assert_eq!(
        (status, &body["decision"]),
        (200, &json!("cold_miss")),
        "a new prompt is placed while NATS is down: {body}"
    );
    assert_eq!(
        daemon.blocks().await.get("owner"),
        Some(&8),
        "nothing applied is lost while NATS is down"
    );

    nats.restart();
    daemon.wait_ready().await;
    owner.wait_connected().await;
    other.wait_connected().await;

    // JetStream path: a batch published after the restart (same publisher, next Kv-Seq).
    let second = prompt(2, 4);
    owner.store(&second).await;
    daemon.wait_blocks("owner", 12).await;
    // Core NATS path: a new load sample.
    other.load(0.7).await;
    daemon.wait_load("other", 0.7).await;

    let (status, body) = daemon.route(&second, json!({})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (&body["worker"], &body["matched_blocks"]),
        (&json!("owner"), &json!(4)),
        "a prefix stored after the broker restart routes to its owner: {body}"
    );
    assert!(
        daemon.metric("kvrouted_nats_reconnects_total").await >= 1.0,
        "the lost connection is counted in kvrouted_nats_reconnects_total"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_whose_broker_is_down_still_stops_on_sigterm() {
    let mut nats = Nats::start();
    let mut daemon = Daemon::start(&nats.url(), &[]).await;
    daemon.wait_ready().await;
    nats.stop();
    daemon.wait_readyz("degraded").await;
    let status = daemon.terminate_within_deadline();
    assert!(
        status.is_some_and(|s| s.success()),
        "SIGTERM stops the daemon cleanly even while NATS is down (exit: {status:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restarted_empty_gets_its_stream_back_before_readiness_and_loses_no_event() {
    let mut nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    daemon.wait_ready().await;
    let mut owner = Worker::connect(&nats.url(), "owner").await;
    owner.store(&prompt(1, 4)).await;
    daemon.wait_blocks("owner", 4).await;

    nats.stop();
    daemon.wait_readyz("degraded").await;
    nats.wipe_storage();
    nats.restart();
    // Ready again only once the stream and the consumer exist on the empty broker.
    daemon.wait_ready().await;
    let js = async_nats::jetstream::new(owner.client().clone());
    owner.wait_connected().await;
    let stream = js
        .get_stream("KVROUTED")
        .await
        .expect("the stream exists again when /readyz says ready");
    stream
        .consumer_info("kvrouted")
        .await
        .expect("the durable consumer exists again when /readyz says ready");

    // Published right after: captured by the stream (the publish is acked) and applied.
    let after = prompt(2, 3);
    owner.store(&after).await;
    daemon.wait_blocks("owner", 7).await;
    let (status, body) = daemon.route(&after, json!({})).await;
    assert_eq!(
        (status, &body["worker"], &body["matched_blocks"]),
        (200, &json!("owner"), &json!(3)),
        "an event published right after the broker came back empty is applied: {body}"
    );
}
