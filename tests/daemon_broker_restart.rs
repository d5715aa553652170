//! The broker goes away under a running daemon and comes back on the same port with the same
//! storage (docs/architecture.md, "Failure and bad input"): routes are served from the last known
//! state throughout, readiness says degraded (and stays in rotation) meanwhile, and ingest resumes
//! on both paths afterwards: KV events through the JetStream durable consumer, load samples on core
//! NATS. A delivery the daemon never receives is delivered again within seconds, also the last of a
//! burst.
mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::*;
use futures::StreamExt;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_lost_at_the_end_of_a_burst_is_delivered_again_within_seconds_not_after_ack_wait(
) {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    daemon.wait_ready().await;
    let mut worker = Worker::connect(&nats.url(), "w").await;

    // Another pull request on the daemon's durable consumer, whose deliveries nobody hands to
    // the daemon: what a pull request of a process that died, or a server that went away with
    // a delivery, leaves. JetStream serves waiting pull requests in turn, so one of the next
    // deliveries goes there.
    let thief = async_nats::connect(nats.url()).await.unwrap();
    let inbox = thief.new_inbox();
    let mut taken = thief.subscribe(inbox.clone()).await.unwrap();
    thief
        .publish_with_reply(
            "$JS.API.CONSUMER.MSG.NEXT.KVROUTED.kvrouted",
            inbox,
            r#"{"batch":1,"expires":120000000000}"#.into(),
        )
        .await
        .unwrap();
    thief.flush().await.unwrap();
    let taken_count = Arc::new(AtomicU64::new(0));
    let counter = taken_count.clone();
    tokio::spawn(async move {
        while let Some(msg) = taken.next().await {
            // Data messages keep their own subject; status replies come on the inbox.
            if msg.subject.starts_with("kv.") {
                counter.fetch_add(1, Ordering::Release);
            }
        }
    });

    // Batches one at a time until one is taken: the daemon applies each until then, so the
    // taken one is the last of the burst, with no later delivery to reveal its loss.
    let mut published = 0;
    while taken_count.load(Ordering::Acquire) == 0 {
        assert!(
            published < 20,
            "a waiting pull request of its own is served within a few deliveries"
        );
        published += 1;
        worker.store(&prompt(published, 1)).await;
        eventually(
            "the batch reaches the daemon or the other pull request",
            || {
                let taken_count = taken_count.clone();
                let daemon = &daemon;
                async move {
                    let applied = daemon.blocks().await.get("w").copied().unwrap_or(0);
                    (applied == u64::from(published) || taken_count.load(Ordering::Acquire) > 0)
                        .then_some(())
                }
            },
        )
        .await;
    }

    // The deadline (20s) is shorter than JetStream's own redelivery after `ack_wait` (30s).
    daemon.wait_blocks("w", u64::from(published)).await;
    assert!(
        daemon
            .metric("kvrouted_ingest_lost_deliveries_total{feed=\"events\"}")
            .await
            >= 1.0,
        "the delivery that never arrived is counted as lost"
    );
    let (status, body) = daemon.route(&prompt(published, 1), json!({})).await;
    assert_eq!(
        (status, &body["worker"], &body["matched_blocks"]),
        (200, &json!("w"), &json!(1)),
        "the batch delivered again is applied like any other: {body}"
    );
}
