//! `kvrouted bridge` against a real nats-server, the real daemon, the real bridge binary and a
//! test engine that publishes on ZeroMQ exactly as vLLM's and SGLang's `ZmqEventPublisher` do
//! (`kvrouted_testkit::engine`). Waiting is polling against a deadline.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use common::{
    eventually, free_port, gpu_blocks_stored, kvrouted_command, metric_at, prompt, read_log,
    Daemon, Nats, Process, DEADLINE,
};
use futures::StreamExt;
use kvrouted::wire::{encode_vllm_batch, VllmEvent};
use kvrouted_testkit::engine::{EngineOptions, TestEngine};
use serde_json::{json, Value};
use tempfile::TempDir;

/// The bridge process under test.
struct Bridge {
    child: Option<Process>,
    http: SocketAddr,
    args: Vec<String>,
    log: PathBuf,
    _dir: TempDir,
    client: reqwest::Client,
}

impl Bridge {
    fn new(nats_url: &str, engine: &TestEngine, worker: &str, extra: &[&str]) -> Bridge {
        let dir = TempDir::new().unwrap();
        let http = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut args: Vec<String> = vec![
            "bridge".into(),
            "--zmq".into(),
            engine.zmq_endpoint(),
            "--replay".into(),
            engine.replay_endpoint(),
            "--dp-size".into(),
            engine.opts.dp_size.to_string(),
            "--worker".into(),
            worker.into(),
            "--nats-url".into(),
            nats_url.into(),
            "--http-addr".into(),
            http.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Bridge {
            child: None,
            http,
            args,
            log: dir.path().join("bridge.log"),
            _dir: dir,
            client: reqwest::Client::new(),
        }
    }

    async fn start(nats_url: &str, engine: &TestEngine, worker: &str, extra: &[&str]) -> Bridge {
        let mut b = Bridge::new(nats_url, engine, worker, extra);
        b.spawn().await;
        b
    }

    /// Starts the process (again) and waits for its /healthz.
    async fn spawn(&mut self) {
        assert!(self.child.is_none(), "bridge already running");
        let mut cmd = kvrouted_command();
        cmd.args(&self.args);
        self.child = Some(Process::spawn(cmd, &self.log));
        let url = format!("http://{}/healthz", self.http);
        let (client, url) = (&self.client, &url);
        let child = self.child.as_mut().expect("just spawned");
        child
            .wait_until_up("the bridge answers /healthz", move || async move {
                client.get(url).send().await.is_ok()
            })
            .await;
    }

    fn log_text(&self) -> String {
        read_log(&self.log)
    }

    fn kill9(&mut self) {
        self.child = None;
    }

    fn signal(&self, signal: &str) {
        self.child.as_ref().expect("bridge running").signal(signal);
    }

    /// SIGTERM, then the exit within the deadline.
    fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("bridge running");
        child.terminate_within(DEADLINE).unwrap_or_else(|| {
            panic!(
                "bridge did not exit after SIGTERM; log:\n{}",
                self.log_text()
            )
        })
    }

    async fn metric(&self, series: &str) -> f64 {
        metric_at(&self.client, self.http, series).await
    }

    async fn health(&self) -> Value {
        self.client
            .get(format!("http://{}/healthz", self.http))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A vLLM batch storing every 16-token block of `prompt(seed, blocks)` in one chain.
fn store(seed: u32, blocks: usize) -> Vec<u8> {
    let tokens = prompt(seed, blocks);
    encode_vllm_batch(
        1.0 + seed as f64,
        &[gpu_blocks_stored(
            (0..blocks as u64)
                .map(|i| u64::from(seed) * 1_000 + i + 1)
                .collect(),
            tokens,
        )],
        None,
    )
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/kv_events")
            .join(name),
    )
    .unwrap()
}

/// A forwarded batch as the stream holds it.
#[derive(Debug, Clone, PartialEq)]
struct Forwarded {
    seq: u64,
    epoch: String,
    rank: u32,
}

/// Every message on `subject`, in stream order, once the stream holds at least `at_least`.
async fn stream_messages(
    nats_url: &str,
    subject: &str,
    at_least: usize,
) -> Vec<async_nats::jetstream::Message> {
    let client = async_nats::connect(nats_url).await.unwrap();
    let js = jetstream::new(client);
    eventually(
        &format!("the stream holds {at_least} messages on {subject}"),
        || {
            let js = js.clone();
            async move {
                let stream = js.get_stream("KVROUTED").await.ok()?;
                let consumer = stream
                    .create_consumer(consumer::pull::OrderedConfig {
                        filter_subject: subject.to_string(),
                        ..Default::default()
                    })
                    .await
                    .ok()?;
                let mut messages = consumer.messages().await.ok()?;
                let mut out = Vec::new();
                while let Ok(Some(Ok(m))) =
                    tokio::time::timeout(Duration::from_millis(300), messages.next()).await
                {
                    out.push(m);
                }
                (out.len() >= at_least).then_some(out)
            }
        },
    )
    .await
}

async fn forwarded(nats_url: &str, worker: &str, at_least: usize) -> Vec<Forwarded> {
    stream_messages(nats_url, &format!("kv.events.{worker}"), at_least)
        .await
        .iter()
        .map(|m| {
            let h = m.headers.as_ref().expect("forwarded batches carry headers");
            let get = |k: &str| h.get(k).expect(k).as_str().to_string();
            Forwarded {
                seq: get("Kv-Seq").parse().unwrap(),
                epoch: get("Kv-Epoch"),
                rank: get("Kv-Dp-Rank").parse().unwrap(),
            }
        })
        .collect()
}

/// The `epoch` of every lifecycle message the worker sent, with its op.
async fn lifecycle(nats_url: &str, worker: &str, at_least: usize) -> Vec<(String, String)> {
    stream_messages(nats_url, &format!("kv.workers.{worker}"), at_least)
        .await
        .iter()
        .map(|m| {
            let v: rmpv::Value = rmpv::decode::read_value(&mut &m.payload[..]).unwrap();
            let field = |k: &str| {
                v.as_map()
                    .unwrap()
                    .iter()
                    .find(|(key, _)| key.as_str() == Some(k))
                    .and_then(|(_, v)| v.as_str())
                    .unwrap_or_default()
                    .to_string()
            };
            (field("op"), field("epoch"))
        })
        .collect()
}

fn bridge_series(name: &str, rank: u32) -> String {
    format!("{name}{{rank=\"{rank}\"}}")
}

/// Fast idle checks, so that a batch the SUB socket joined too late for is replayed quickly.
const QUICK: &[&str] = &["--idle-check", "300ms", "--block-size", "16"];

async fn delivered_before_the_bridge_starts(opts: EngineOptions, file: &str, blocks: u64) {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &["--block-size", "4"]).await;
    let mut engine = TestEngine::start(opts).await;
    engine.publish(0, fixture(file)).await;
    let bridge = Bridge::start(&nats.url(), &engine, "w1", &["--block-size", "4"]).await;
    daemon.wait_blocks("w1", blocks).await;
    let health = eventually("healthz shows the acknowledged sequence", || async {
        let h = bridge.health().await;
        (h["ranks"][0]["last_forwarded_seq"] == 0).then_some(h)
    })
    .await;
    assert_eq!(health["status"], "ok", "{health}");
    assert_eq!(health["ranks"][0]["engine_connected"], true, "{health}");
    assert_eq!(
        bridge
            .metric(&bridge_series("kvrouted_bridge_replayed_total", 0))
            .await,
        1.0,
        "the batch came from the replay socket"
    );
}

#[tokio::test]
async fn batch_published_before_the_bridge_starts_is_delivered() {
    delivered_before_the_bridge_starts(EngineOptions::vllm(), "stored_chain_int_hashes.msgpack", 3)
        .await;
}

#[tokio::test]
async fn batch_published_before_the_bridge_starts_is_delivered_from_a_replay_without_topic_frame() {
    delivered_before_the_bridge_starts(EngineOptions::sglang_legacy(), "sglang_bigram.msgpack", 2)
        .await;
}

/// Engine batches 0..5 forwarded, the bridge SIGKILLed, 5..10 published while it is away, the
/// bridge started again. Returns the forwarded messages and the lifecycle messages.
async fn kill_and_restart_the_bridge(
    nats: &Nats,
    daemon: &Daemon,
) -> (Vec<Forwarded>, Vec<(String, String)>) {
    let mut engine = TestEngine::start(EngineOptions::vllm()).await;
    let mut bridge = Bridge::start(&nats.url(), &engine, "w1", QUICK).await;
    for seed in 0..5 {
        engine.publish(0, store(seed, 1)).await;
    }
    daemon.wait_blocks("w1", 5).await;
    bridge.kill9();
    for seed in 5..10 {
        engine.publish(0, store(seed, 1)).await;
    }
    bridge.spawn().await;
    let batches = forwarded(&nats.url(), "w1", 10).await;
    let joins = lifecycle(&nats.url(), "w1", 2).await;
    (batches, joins)
}

#[tokio::test]
async fn bridge_killed_with_sigkill_and_restarted_forwards_every_buffered_batch_once() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    let (batches, joins) = kill_and_restart_the_bridge(&nats, &daemon).await;
    let seqs: Vec<u64> = batches.iter().map(|b| b.seq).collect();
    assert_eq!(
        seqs,
        (0..10).collect::<Vec<_>>(),
        "every engine batch is in the stream exactly once, in order"
    );
    let epoch = &batches[0].epoch;
    assert!(
        batches.iter().all(|b| &b.epoch == epoch),
        "the engine did not restart, so the epoch stays: {batches:?}"
    );
    assert_eq!(
        joins,
        vec![
            ("join".to_string(), epoch.clone()),
            ("join".to_string(), epoch.clone())
        ],
        "the restarted bridge's join carries the epoch it resumed"
    );
}

/// Needs the daemon to treat a join that repeats the ranks' epoch as a re-announcement.
#[tokio::test]
async fn bridge_restart_keeps_the_workers_ownership() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    kill_and_restart_the_bridge(&nats, &daemon).await;
    common::eventually("the daemon has consumed the stream", || {
        let url = nats.url();
        async move {
            let client = async_nats::connect(url).await.ok()?;
            common::consumer_settled(&client).await
        }
    })
    .await;
    daemon.wait_blocks("w1", 10).await;
}

#[tokio::test]
async fn dropped_range_is_repaired_from_the_replay_socket() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    let mut engine = TestEngine::start(EngineOptions::vllm()).await;
    for seed in 0..3 {
        engine.publish(0, store(seed, 1)).await;
    }
    // Idle checks off: only the sequence gap can trigger the repair.
    let bridge = Bridge::start(
        &nats.url(),
        &engine,
        "w1",
        &["--idle-check", "1h", "--block-size", "16"],
    )
    .await;
    daemon.wait_blocks("w1", 3).await;
    for seed in 3..6 {
        engine.publish_dropped(0, store(seed, 1)).await;
    }
    engine.publish(0, store(6, 1)).await;
    daemon.wait_blocks("w1", 7).await;
    assert_eq!(
        bridge
            .metric(&bridge_series("kvrouted_bridge_lost_total", 0))
            .await,
        0.0
    );
    assert!(
        bridge
            .metric(&bridge_series("kvrouted_bridge_replayed_total", 0))
            .await
            >= 6.0,
        "3 from the start-up replay and 3 from the gap"
    );
    let seqs: Vec<u64> = forwarded(&nats.url(), "w1", 7)
        .await
        .iter()
        .map(|b| b.seq)
        .collect();
    assert_eq!(seqs, (0..7).collect::<Vec<_>>(), "repaired in order");
}

#[tokio::test]
async fn range_the_engine_no_longer_buffers_is_counted_as_lost() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    let mut engine = TestEngine::start(EngineOptions {
        buffer_steps: 2,
        ..EngineOptions::vllm()
    })
    .await;
    engine.publish(0, store(0, 1)).await;
    let bridge = Bridge::start(
        &nats.url(),
        &engine,
        "w1",
        &["--idle-check", "1h", "--block-size", "16"],
    )
    .await;
    daemon.wait_blocks("w1", 1).await;
    for seed in 1..5 {
        engine.publish_dropped(0, store(seed, 1)).await;
    }
    // The engine now buffers 4 and 5 only: 1, 2 and 3 are gone.
    engine.publish(0, store(5, 1)).await;
    daemon.wait_blocks("w1", 3).await;
    assert_eq!(
        bridge
            .metric(&bridge_series("kvrouted_bridge_lost_total", 0))
            .await,
        3.0,
        "the loss is counted, never silent"
    );
}

/// The engine publishes 0..3, restarts (numbering from 0 again, empty buffer) and publishes one
/// batch of a new prompt.
async fn restart_the_engine(nats: &Nats, daemon: &Daemon) -> (Vec<Forwarded>, Bridge) {
    let mut engine = TestEngine::start(EngineOptions::vllm()).await;
    for seed in 0..3 {
        engine.publish(0, store(seed, 1)).await;
    }
    let bridge = Bridge::start(&nats.url(), &engine, "w1", QUICK).await;
    daemon.wait_blocks("w1", 3).await;
    let (opts, pub_port, replay_port) = (engine.opts.clone(), engine.pub_port, engine.replay_port);
    engine.stop().await;
    let mut engine = TestEngine::start_on(opts, pub_port, replay_port).await;
    engine.publish(0, store(100, 2)).await;
    let batches = forwarded(&nats.url(), "w1", 4).await;
    drop(engine);
    (batches, bridge)
}

#[tokio::test]
async fn engine_restart_starts_a_new_epoch_in_the_stream() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    let (batches, bridge) = restart_the_engine(&nats, &daemon).await;
    assert_eq!(batches.len(), 4, "{batches:?}");
    let (before, after) = (&batches[2], &batches[3]);
    assert_eq!(after.seq, 0, "the new engine numbers from 0");
    assert_ne!(
        before.epoch, after.epoch,
        "a restarted engine gets a new epoch"
    );
    assert!(!after.epoch.is_empty() && after.epoch.len() <= 64);
    assert_eq!(
        bridge
            .metric(&bridge_series("kvrouted_bridge_engine_restarts_total", 0))
            .await,
        1.0
    );
}

/// Needs the daemon to clear a rank when its `Kv-Epoch` changes.
#[tokio::test]
async fn engine_restart_drops_that_ranks_old_ownership() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    let _ = restart_the_engine(&nats, &daemon).await;
    daemon.wait_blocks("w1", 2).await;
    let (_, reply) = daemon.route(&prompt(0, 1), json!({})).await;
    assert_eq!(
        reply["matched_blocks"], 0,
        "the restarted engine no longer holds its old blocks: {reply}"
    );
}

/// Rank 0 holds prompt 1 (2 blocks), rank 1 prompt 2 (3 blocks).
async fn two_ranks(nats: &Nats) -> (TestEngine, Bridge) {
    let mut engine = TestEngine::start(EngineOptions {
        dp_size: 2,
        ..EngineOptions::vllm()
    })
    .await;
    engine.publish(0, store(1, 2)).await;
    engine.publish(1, store(2, 3)).await;
    let bridge = Bridge::start(&nats.url(), &engine, "w1", QUICK).await;
    (engine, bridge)
}

#[tokio::test]
async fn two_dp_ranks_forward_on_their_own_ports_with_their_rank() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    let (_engine, _bridge) = two_ranks(&nats).await;
    daemon.wait_blocks("w1", 5).await;
    let mut batches = forwarded(&nats.url(), "w1", 2).await;
    batches.sort_by_key(|b| b.rank);
    assert_eq!(
        batches.iter().map(|b| (b.rank, b.seq)).collect::<Vec<_>>(),
        vec![(0, 0), (1, 0)],
        "each rank's socket numbers its own batches"
    );
    let joins = lifecycle(&nats.url(), "w1", 1).await;
    assert_eq!(joins[0].1, batches[0].epoch, "the join carries the epoch");
}

/// Needs per-rank ownership, `dp_rank` in route replies and per-rank clears in the daemon.
#[tokio::test]
async fn two_dp_ranks_are_routed_by_rank_and_one_ranks_clear_leaves_the_other() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    let (mut engine, _bridge) = two_ranks(&nats).await;
    daemon.wait_blocks("w1", 5).await;
    let (_, a) = daemon.route(&prompt(1, 2), json!({})).await;
    let (_, b) = daemon.route(&prompt(2, 3), json!({})).await;
    assert_eq!(
        (&a["dp_rank"], &a["matched_blocks"]),
        (&json!(0), &json!(2)),
        "{a}"
    );
    assert_eq!(
        (&b["dp_rank"], &b["matched_blocks"]),
        (&json!(1), &json!(3)),
        "{b}"
    );
    engine
        .publish(
            1,
            encode_vllm_batch(9.0, &[VllmEvent::AllBlocksCleared], None),
        )
        .await;
    daemon.wait_blocks("w1", 2).await;
    let (_, a) = daemon.route(&prompt(1, 2), json!({})).await;
    assert_eq!(
        (&a["dp_rank"], &a["matched_blocks"]),
        (&json!(0), &json!(2)),
        "rank 0 still holds its prefix after rank 1 cleared: {a}"
    );
}

/// A tiny HTTP server answering `/metrics` with `body`.
async fn metrics_server(body: String) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let body = body.clone();
            async move { body }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

#[tokio::test]
async fn load_from_the_engines_metrics_endpoint_shows_as_the_workers_pressure() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    let engine = TestEngine::start(EngineOptions::vllm()).await;
    // vLLM's exposition: the engine label is the rank; waiting-by-reason is not the gauge.
    let text = "\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.42
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 30.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0
vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"m\",reason=\"capacity\"} 50.0
";
    let addr = metrics_server(text.to_string()).await;
    let url = format!("http://{addr}/metrics");
    let _bridge = Bridge::start(
        &nats.url(),
        &engine,
        "w1",
        &[
            "--metrics",
            &url,
            "--max-running",
            "64",
            "--load-interval",
            "100ms",
        ],
    )
    .await;
    // max(0.42, (30 + 2) / 64) = 0.5
    eventually("w1's pressure is the scraped load", || async {
        let p = daemon.worker("w1").await?["pressure"].as_f64()?;
        ((p - 0.5).abs() < 1e-9).then_some(())
    })
    .await;
}

#[tokio::test]
async fn unreachable_metrics_endpoint_publishes_no_load() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    let engine = TestEngine::start(EngineOptions::vllm()).await;
    let url = format!("http://127.0.0.1:{}/metrics", free_port());
    let bridge = Bridge::start(
        &nats.url(),
        &engine,
        "w1",
        &["--metrics", &url, "--load-interval", "50ms"],
    )
    .await;
    eventually("scrape errors are counted", || async {
        (bridge.metric("kvrouted_bridge_scrape_errors_total").await >= 3.0).then_some(())
    })
    .await;
    let row = daemon.worker("w1").await.expect("the join made w1 known");
    assert_eq!(
        row["pressure"],
        Value::Null,
        "no sample: telemetry stays missing: {row}"
    );
    assert_eq!(
        bridge.metric("kvrouted_bridge_load_samples_total").await,
        0.0
    );
}

#[tokio::test]
async fn sigterm_makes_the_worker_leave() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    let mut engine = TestEngine::start(EngineOptions::vllm()).await;
    engine.publish(0, store(1, 2)).await;
    let mut bridge = Bridge::start(&nats.url(), &engine, "w1", QUICK).await;
    daemon.wait_blocks("w1", 2).await;
    let status = bridge.terminate();
    assert!(status.success(), "clean exit on SIGTERM: {status}");
    eventually("w1 is no longer listed", || async {
        daemon.worker("w1").await.is_none().then_some(())
    })
    .await;
    let ops: Vec<String> = lifecycle(&nats.url(), "w1", 2)
        .await
        .into_iter()
        .map(|(op, _)| op)
        .collect();
    assert_eq!(ops, ["join", "leave"]);
}

#[tokio::test]
async fn sigusr1_drains_the_worker() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    let engine = TestEngine::start(EngineOptions::vllm()).await;
    let bridge = Bridge::start(&nats.url(), &engine, "w1", QUICK).await;
    daemon.wait_state("w1", "active").await;
    bridge.signal("USR1");
    daemon.wait_state("w1", "draining").await;
}

#[test]
fn bridge_help_explains_every_flag() {
    let (status, out, _) = common::run_to_exit({
        let mut c = kvrouted_command();
        c.args(["bridge", "--help"]);
        c
    });
    assert!(status.success());
    for flag in [
        "--zmq",
        "--replay",
        "--dp-size",
        "--topic",
        "--metrics",
        "--engine",
        "--max-running",
        "--load-interval",
        "--worker",
        "--model",
        "--block-size",
        "--nats-url",
        "--http-addr",
        "--subject-prefix",
        "--stream",
    ] {
        let lines: Vec<&str> = out.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.trim_start().starts_with(&format!("{flag} ")))
            .unwrap_or_else(|| panic!("{flag} missing from --help:\n{out}"));
        let explained = lines
            .get(at + 1)
            .is_some_and(|next| next.trim().len() > 10 && !next.trim_start().starts_with('-'));
        assert!(explained, "{flag} has an explanation:\n{out}");
    }
}

#[test]
fn bridge_with_an_invalid_worker_id_exits_with_a_clear_error() {
    let (status, _, err) = common::run_to_exit({
        let mut c = kvrouted_command();
        c.args(["bridge", "--zmq", "tcp://127.0.0.1:1", "--worker", "a.b"]);
        c
    });
    assert!(!status.success());
    assert!(
        err.contains("--worker") && err.contains("invalid worker id"),
        "{err}"
    );
}

#[tokio::test]
async fn bridge_forwards_what_the_engine_published_while_nats_was_down() {
    let mut nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    let mut engine = TestEngine::start(EngineOptions::vllm()).await;
    engine.publish(0, store(0, 1)).await;
    let bridge = Bridge::start(&nats.url(), &engine, "w1", QUICK).await;
    daemon.wait_blocks("w1", 1).await;
    nats.stop();
    eventually("the bridge sees NATS down", || async {
        let h = bridge.health().await;
        (h["nats_connected"] == false && h["status"] == "degraded").then_some(())
    })
    .await;
    for seed in 1..4 {
        engine.publish(0, store(seed, 1)).await;
    }
    nats.restart();
    daemon.wait_blocks("w1", 4).await;
    let seqs: Vec<u64> = forwarded(&nats.url(), "w1", 4)
        .await
        .iter()
        .map(|b| b.seq)
        .collect();
    assert_eq!(seqs, vec![0, 1, 2, 3], "in order, each once");
    assert_eq!(
        bridge
            .metric(&bridge_series("kvrouted_bridge_lost_total", 0))
            .await,
        0.0
    );
}
