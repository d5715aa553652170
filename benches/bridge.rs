//! Engine bridge benchmark: what `kvrouted bridge` adds between an engine's ZeroMQ publisher and
//! JetStream, side by side with a publisher that writes to NATS directly.
//!
//! Run: `cargo bench --bench bridge` (on demand; never part of `cargo test`). Options after
//! `--` (`-- --help` lists them; an unknown one stops the run): `--batches N` (timed batches per
//! throughput run, default 60000), `--probes N` (latency probes per path, default 300),
//! `--max-seconds N` (watchdog, default 300). Needs `nats-server` (PATH, /usr/sbin, or
//! `NATS_SERVER_BIN`).
//!
//! 1. **Throughput.** The test engine (tests/engine: vLLM's `ZmqEventPublisher` framing and
//!    replay) publishes `--batches` vLLM batches of 32 `BlockStored` blocks each as fast as its
//!    PUB socket takes them; the bridge (release binary) forwards them to JetStream with
//!    pipelined acks. The figure is block events per second from the first ZMQ send until the
//!    stream holds the last batch. Side by side: the same pre-encoded batches published straight
//!    to JetStream from this process on one connection with the same ack window (1024), which
//!    is what the broker takes from one publisher. No daemon runs in this phase.
//! 2. **Latency.** With the daemon consuming, one probe at a time: a one-block batch is sent
//!    (ZMQ send through the bridge, or a JetStream publish) and `/v1/workers` is polled until
//!    the daemon shows the block applied. p50 / p99 per path; the difference is what the bridge
//!    adds.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use bytes::Bytes;
use clap::builder::RangedU64ValueParser;
use clap::Parser;
use kvrouted::wire::{encode_vllm_batch, VllmEvent};
use kvrouted_testkit::engine::{EngineOptions, TestEngine};
use kvrouted_testkit::{
    free_port, metric_at, start_watchdog, wait_for_port, wait_ready_at, Nats, Process, Watched,
};
use tempfile::TempDir;

const BLOCKS_PER_BATCH: usize = 32;
const BLOCK: usize = 16;
const ACK_WINDOW: usize = 1024;

/// Starts `cmd` (killed on drop, and by the watchdog).
fn spawn(cmd: Command, log: &Path) -> Watched<Process> {
    Watched::new(Process::spawn(cmd, log))
}

/// The test kit's nats-server (JetStream on a free port with its own storage), which the
/// watchdog kills too, and its URL.
fn start_nats() -> (Watched<Nats>, String) {
    let nats = Watched::new(Nats::start());
    let url = nats.url();
    (nats, url)
}

/// Command-line options (after `--` in `cargo bench --bench bridge -- ...`).
#[derive(Parser)]
#[command(
    name = "bridge",
    about = "What `kvrouted bridge` adds between an engine's ZeroMQ publisher and JetStream"
)]
struct Options {
    /// Timed batches per throughput run
    #[arg(long, default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    batches: u64,
    /// Latency probes per path
    #[arg(long, default_value_t = 300, value_parser = RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    probes: usize,
    /// The watchdog kills everything started and exits after this many seconds
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    max_seconds: u64,
    /// Passed by `cargo bench`; ignored
    #[arg(long, hide = true)]
    bench: bool,
}

/// Batch `i`: 32 chained blocks of distinct tokens.
fn batch(i: u64, blocks: usize) -> Vec<u8> {
    let base = i * blocks as u64;
    let tokens: Vec<u32> = (0..(blocks * BLOCK) as u64)
        .map(|t| ((base * BLOCK as u64 + t) % 4_000_000_000) as u32)
        .collect();
    encode_vllm_batch(
        i as f64,
        &[VllmEvent::BlockStored {
            block_hashes: (0..blocks as u64).map(|b| base + b + 1).collect(),
            parent_block_hash: (i > 0).then_some(base),
            token_ids: tokens,
            block_size: BLOCK as u32,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
        }],
        None,
    )
}

fn start_bridge(
    dir: &Path,
    nats_url: &str,
    engine: &TestEngine,
    worker: &str,
) -> (Watched<Process>, SocketAddr) {
    let http = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvrouted"));
    cmd.args(["bridge", "--zmq", &engine.zmq_endpoint()])
        .args(["--replay", &engine.replay_endpoint()])
        .args(["--worker", worker, "--nats-url", nats_url])
        .args(["--http-addr", &http.to_string(), "--block-size", "16"])
        .args(["--ack-window", &ACK_WINDOW.to_string()])
        .env("RUST_LOG", "warn");
    let p = spawn(cmd, &dir.join(format!("bridge-{worker}.log")));
    wait_for_port(http.port(), "kvrouted bridge");
    (p, http)
}

async fn stream_messages(js: &jetstream::Context) -> u64 {
    let mut s = js.get_stream("KVROUTED").await.unwrap();
    s.info().await.unwrap().state.messages
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

async fn blocks_of(client: &reqwest::Client, http: SocketAddr, worker: &str) -> u64 {
    let v: serde_json::Value = client
        .get(format!("http://{http}/v1/workers"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == worker)
        .and_then(|w| w["blocks"].as_u64())
        .unwrap_or(0)
}

#[tokio::main]
async fn main() {
    let o = Options::parse();
    let (n, probes) = (o.batches, o.probes);
    start_watchdog("bridge bench", Duration::from_secs(o.max_seconds));
    let client = reqwest::Client::new();

    println!("bridge bench: {n} batches x {BLOCKS_PER_BATCH} blocks per throughput run, {probes} latency probes per path");
    let payloads: Vec<Vec<u8>> = (0..n + 100).map(|i| batch(i, BLOCKS_PER_BATCH)).collect();
    println!(
        "payload: {} bytes per 32-block batch (vLLM msgpack)",
        payloads[0].len()
    );

    // 1a. ZMQ -> bridge -> JetStream.
    {
        let dir = TempDir::new().unwrap();
        let (_nats, url) = start_nats();
        let js = jetstream::new(async_nats::connect(&url).await.unwrap());
        let mut engine = TestEngine::start(EngineOptions::vllm()).await;
        let (_bridge, http) = start_bridge(dir.path(), &url, &engine, "wb");
        // Warm up until a live batch comes through (the SUB socket has joined).
        let mut i = 0u64;
        loop {
            engine.publish(0, payloads[i as usize].clone()).await;
            i += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
            if metric_at(&client, http, "kvrouted_bridge_forwarded_total{rank=\"0\"}").await
                >= i as f64
            {
                break;
            }
        }
        let before = stream_messages(&js).await;
        let start = Instant::now();
        for p in &payloads[i as usize..(i + n) as usize] {
            engine.publish(0, p.clone()).await;
        }
        let sent = start.elapsed();
        loop {
            if stream_messages(&js).await >= before + n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = start.elapsed();
        let lost = metric_at(&client, http, "kvrouted_bridge_lost_total{rank=\"0\"}").await;
        let replayed = metric_at(&client, http, "kvrouted_bridge_replayed_total{rank=\"0\"}").await;
        println!(
            "throughput  zmq -> bridge -> jetstream : {:>10.0} block events/s ({:>7.0} batches/s; engine sent all in {:.2}s, stream complete after {:.2}s; lost {lost}, replayed {replayed})",
            (n as usize * BLOCKS_PER_BATCH) as f64 / took.as_secs_f64(),
            n as f64 / took.as_secs_f64(),
            sent.as_secs_f64(),
            took.as_secs_f64()
        );
        engine.stop().await;
    }

    // 1b. Direct JetStream publisher, same payloads, same ack window.
    {
        let (_nats, url) = start_nats();
        let js = jetstream::new(async_nats::connect(&url).await.unwrap());
        js.get_or_create_stream(kvrouted::ingest::stream_config("KVROUTED", "kv"))
            .await
            .unwrap();
        let start = Instant::now();
        let mut inflight = std::collections::VecDeque::new();
        for (seq, p) in payloads[..n as usize].iter().enumerate() {
            if inflight.len() >= ACK_WINDOW {
                let ack: jetstream::context::PublishAckFuture = inflight.pop_front().unwrap();
                ack.await.unwrap();
            }
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Kv-Seq", seq.to_string().as_str());
            headers.insert("Kv-Epoch", "bench");
            headers.insert("Kv-Dp-Rank", "0");
            let ack = js
                .publish_with_headers("kv.events.wd", headers, Bytes::from(p.clone()))
                .await
                .unwrap();
            inflight.push_back(ack);
        }
        for ack in inflight {
            ack.await.unwrap();
        }
        let took = start.elapsed();
        println!(
            "throughput  direct jetstream publisher  : {:>10.0} block events/s ({:>7.0} batches/s in {:.2}s)",
            (n as usize * BLOCKS_PER_BATCH) as f64 / took.as_secs_f64(),
            n as f64 / took.as_secs_f64(),
            took.as_secs_f64()
        );
    }

    // 2. Latency to the daemon's apply.
    {
        let dir = TempDir::new().unwrap();
        let (_nats, url) = start_nats();
        let daemon_http = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvrouted"));
        cmd.args([
            "serve",
            "--nats-url",
            &url,
            "--http-addr",
            &daemon_http.to_string(),
        ])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .args(["--snapshot-interval", "1h"])
        .env("RUST_LOG", "warn");
        let _daemon = spawn(cmd, &dir.path().join("kvrouted.log"));
        wait_for_port(daemon_http.port(), "kvrouted");
        // The port opens while the state is still recovering, when /v1/workers answers 503.
        wait_ready_at(&client, &format!("http://{daemon_http}/readyz")).await;
        let nats = async_nats::connect(&url).await.unwrap();
        let js = jetstream::new(nats);
        let mut engine = TestEngine::start(EngineOptions::vllm()).await;
        let (_bridge, _) = start_bridge(dir.path(), &url, &engine, "wb");
        // The SUB socket joins: wait for the first probe through the start-up replay.
        engine.publish(0, batch(1_000_000, 1)).await;
        while blocks_of(&client, daemon_http, "wb").await < 1 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut via_bridge = Vec::with_capacity(probes);
        let mut direct = Vec::with_capacity(probes);
        for k in 0..probes as u64 {
            // Alternate the paths so other load on the machine lands on both alike.
            let payload = batch(2_000_000 + k, 1);
            let t = Instant::now();
            engine.publish(0, payload.clone()).await;
            while blocks_of(&client, daemon_http, "wb").await < k + 2 {}
            via_bridge.push(t.elapsed());

            let payload = batch(3_000_000 + k, 1);
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Kv-Seq", (k + 1).to_string().as_str());
            let t = Instant::now();
            let ack = js
                .publish_with_headers("kv.events.wd", headers, Bytes::from(payload))
                .await
                .unwrap();
            while blocks_of(&client, daemon_http, "wd").await < k + 1 {}
            direct.push(t.elapsed());
            ack.await.unwrap();
        }
        via_bridge.sort();
        direct.sort();
        println!(
            "latency send -> daemon apply, zmq via bridge : p50 {:.2} ms  p99 {:.2} ms",
            pct(&via_bridge, 0.5),
            pct(&via_bridge, 0.99)
        );
        println!(
            "latency send -> daemon apply, direct NATS    : p50 {:.2} ms  p99 {:.2} ms",
            pct(&direct, 0.5),
            pct(&direct, 0.99)
        );
        println!(
            "added by the bridge                          : p50 {:+.2} ms  p99 {:+.2} ms",
            pct(&via_bridge, 0.5) - pct(&direct, 0.5),
            pct(&via_bridge, 0.99) - pct(&direct, 0.99)
        );
        engine.stop().await;
    }
}
