//! A data dir that stops taking writes (a full disk, made here without root by a small tmpfs on
//! the data dir in the daemon's own mount namespace): the live state never moves ahead of the
//! journal. The daemon refuses routes with a 503 and a counter, `/readyz` says why, the error log
//! stays bounded, and SIGTERM ends it within the shutdown deadline with exit code 74 for a
//! supervisor to restart it from the journal.

mod common;

use std::time::Instant;

use common::*;
use kvrouted::input::LifecycleOp;
use serde_json::{json, Value};

/// Bytes the data dir holds: room for the start (sled's first segments), then a few hundred
/// routes fill it.
const DATA_DIR_CAPACITY: u64 = 8 << 20;

/// The exit code of a daemon stopped by a storage fault (`EX_IOERR`), as documented.
const EXIT_STORAGE_FAULT: i32 = 74;

/// A route whose journal entry is large (4,000 block keys, about 36 KB), so the data dir fills
/// quickly.
fn large_route() -> Value {
    let keys: Vec<u64> = (1..=4_000u64).collect();
    json!({ "block_keys": keys, "request_id": "fill" })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_that_cannot_be_written_stops_routing_and_ends_the_daemon_with_exit_code_74() {
    let nats = Nats::start();
    let mut daemon = Daemon::new(
        &nats.url(),
        &["--soft-flush-interval", "5ms", "--shutdown-timeout", "5s"],
    );
    daemon.data_dir_capacity = Some(DATA_DIR_CAPACITY);
    daemon.restart().await;
    // The join is published on the daemon's JetStream stream, which exists once it is ready.
    daemon.wait_ready().await;
    let worker = Worker::connect(&nats.url(), "worker-1").await;
    worker.lifecycle(LifecycleOp::Join).await;
    daemon.wait_state("worker-1", "active").await;

    // Route until the data dir is full: every route before that is answered, the first after
    // it is refused.
    let mut answered = 0;
    let refused = loop {
        let (status, body) = daemon.post("/v1/route", &large_route()).await;
        if status != 200 {
            break (status, body);
        }
        answered += 1;
        assert!(
            answered < 2_000,
            "a data dir of {DATA_DIR_CAPACITY} bytes fills up with 36 KB journal entries"
        );
    };
    assert!(
        answered > 0,
        "routes were answered while the journal could be written"
    );
    assert_eq!(
        refused.0, 503,
        "a route that could not be journaled is refused with a 503: {}",
        refused.1
    );
    assert!(
        refused.1["error"]
            .as_str()
            .is_some_and(|e| e.contains("journal cannot be written")),
        "the refusal says the journal cannot be written: {}",
        refused.1
    );

    let (status, readyz) = daemon.get("/readyz").await;
    let readyz: Value = serde_json::from_str(&readyz).unwrap();
    assert_eq!(
        status, 503,
        "a daemon whose journal failed is not ready: {readyz}"
    );
    assert_eq!(
        readyz["status"], "journal_fault",
        "/readyz names the fault: {readyz}"
    );
    assert!(
        readyz["reason"]
            .as_str()
            .is_some_and(|r| r.contains("journal")),
        "/readyz gives the reason: {readyz}"
    );

    // Every later route is refused and counted, and the log does not grow with them.
    let refusals_before = daemon.metric("kvrouted_journal_fault_refusals_total").await;
    let flood_started = Instant::now();
    for _ in 0..200 {
        let (status, body) = daemon.route(&prompt(7, 4), json!({})).await;
        assert_eq!(
            status, 503,
            "no route is answered from a state the journal does not hold: {body}"
        );
    }
    let flood_seconds = flood_started.elapsed().as_secs();
    let refusals = daemon.metric("kvrouted_journal_fault_refusals_total").await;
    assert!(
        refusals >= refusals_before + 200.0,
        "each refused input is counted: {refusals_before} then {refusals}"
    );
    assert!(
        daemon.metric("kvrouted_journal_errors_total").await >= 1.0,
        "the failed journal write is counted"
    );
    let log = plain(&daemon.log_text());
    let refusal_lines = log
        .lines()
        .filter(|l| l.contains("input refused: the journal cannot be written"))
        .count() as u64;
    assert!(
        refusal_lines <= flood_seconds + 3,
        "refusals are logged at most once a second ({refusal_lines} lines in {flood_seconds}s)"
    );

    let status = daemon
        .terminate_within_deadline()
        .unwrap_or_else(|| panic!("SIGTERM ends the daemon; log:\n{}", daemon.log_text()));
    assert_eq!(
        status.code(),
        Some(EXIT_STORAGE_FAULT),
        "a daemon stopped by a storage fault exits with code 74; log:\n{}",
        daemon.log_text()
    );
    assert!(
        plain(&daemon.log_text()).contains("stopped by a storage fault"),
        "the exit is logged with its reason"
    );
}
