//! End-to-end load benchmark (issue 6): a real nats-server, the real daemon (release binary),
//! publisher workers sending 32-block KV event batches at full speed, and an HTTP load generator
//! sending route requests; compared with a trivial axum handler in this process (the HTTP floor).
//!
//! Run: `cargo bench --bench e2e` (on demand; never part of `cargo test`). It takes about three
//! minutes with the defaults, stops itself and kills everything it started (a watchdog kills the
//! children and exits after `--max-seconds`). Options, after `--`: `--duration SECS` (each
//! phase, default 8), `--publishers N` (NATS connections, default 4), `--workers-per-publisher N`
//! (default 4), `--concurrency N` (HTTP requests in flight, default 16), `--window N`
//! (unacknowledged JetStream publishes per connection, default 256), `--modes jetstream,core`,
//! `--max-seconds N` (default 600). Needs `nats-server` on the PATH, in /usr/sbin, or at
//! `NATS_SERVER_BIN`. `E2E_DAEMON_BIN` runs another build of the daemon (for an A/B comparison).
//!
//! Per NATS mode (JetStream, then core NATS with `--no-jetstream`), on a fresh broker and data
//! dir:
//!
//! 1. **broker only**: the publishers at full speed into a scratch subject with nothing of
//!    kvrouted's listening (JetStream: a scratch stream; core: a subscriber here that only counts).
//!    This is what the broker and the publishers manage on this machine.
//! 2. **ingest**: the same publishers on `kv.events.<worker>` with the daemon consuming. Block
//!    events applied per second come from the daemon's `/metrics`
//!    (`kvrouted_events_applied_total{kind="stored"|"removed"}`). After the publishers stop, the
//!    backlog the daemon still has to apply is drained (at most 60 s) and its rate reported.
//! 3. **routes**: HTTP route requests with prompts of 1k–32k tokens (log-uniform), at fixed
//!    concurrency, over the index the ingest phase built.
//! 4. **kvrouted against the HTTP floor** (first mode only: routes do not depend on the NATS
//!    mode): 4,096-token prompts at concurrency 1 and at `--concurrency`, against the daemon, an
//!    axum server in this process that returns a fixed decision-shaped JSON (`floor`), and one
//!    that also parses the JSON body with serde_json (`floor+parse`). The three take turns
//!    in short rounds so that other load on the machine lands on all of them alike. Then the
//!    same prompts as `block_keys` (what a gateway that hashes tokens itself sends) at
//!    concurrency 1, against the same floors with the same bodies.
//! 5. **combined**: publishers and 1k–32k routes at once.
//!
//! The workload: 64 conversation prefixes of 32,768 tokens (2,048 blocks of 16). Each simulated
//! worker stores prefixes one after another, one 32-block `BlockStored` per message, each chained
//! on the last; once it holds 8 prefixes (16,384 blocks) it sends a 32-block `BlockRemoved` of
//! its oldest prefix (tail first) before each store, so every message is 32 block events and the
//! index stays bounded. Messages are vLLM's msgpack, pre-encoded before the clock starts, with a
//! `Kv-Seq` header per worker. Route prompts are prefixes of the same 64 conversations, so most
//! of them match a worker.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes as AxumBytes;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::post;
use bytes::Bytes;
use futures::StreamExt;
use kvrouted::wire::{encode_load, encode_vllm_batch, VllmEvent};
use serde::Deserialize;
use tempfile::TempDir;

use kvrouted_testkit::{free_port, nats_server_bin, wait_for_port};

const BLOCK: usize = 16;
const BATCH_BLOCKS: usize = 32;
const PREFIXES: usize = 64;
const PREFIX_TOKENS: usize = 32_768;
const BATCHES_PER_PREFIX: usize = PREFIX_TOKENS / BLOCK / BATCH_BLOCKS;
/// Prefixes a worker holds before it evicts its oldest (8 × 2,048 = 16,384 blocks).
const HELD_PREFIXES: usize = 8;

// ---------------------------------------------------------------------------------------------
// Options.

struct Options {
    duration: Duration,
    publishers: usize,
    workers_per_publisher: usize,
    concurrency: usize,
    window: usize,
    modes: Vec<Mode>,
    max_seconds: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    JetStream,
    Core,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::JetStream => "jetstream",
            Mode::Core => "core",
        }
    }
}

fn options() -> Options {
    let mut o = Options {
        duration: Duration::from_secs(8),
        publishers: 4,
        workers_per_publisher: 4,
        concurrency: 16,
        window: 256,
        modes: vec![Mode::JetStream, Mode::Core],
        max_seconds: 600,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let value = args.get(i + 1).cloned().unwrap_or_default();
        let num = |v: &str| -> u64 {
            v.parse()
                .unwrap_or_else(|_| panic!("{}: expected a number, got {v:?}", args[i]))
        };
        match args[i].as_str() {
            "--duration" => o.duration = Duration::from_secs(num(&value)),
            "--publishers" => o.publishers = num(&value) as usize,
            "--workers-per-publisher" => o.workers_per_publisher = num(&value) as usize,
            "--concurrency" => o.concurrency = num(&value) as usize,
            "--window" => o.window = num(&value) as usize,
            "--max-seconds" => o.max_seconds = num(&value),
            "--modes" => {
                o.modes = value
                    .split(',')
                    .map(|m| match m {
                        "jetstream" => Mode::JetStream,
                        "core" => Mode::Core,
                        other => panic!("--modes: jetstream or core, not {other:?}"),
                    })
                    .collect()
            }
            // `cargo bench` passes `--bench`; other unknown arguments are ignored the same way.
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    assert!(o.publishers >= 1 && o.workers_per_publisher >= 1 && o.concurrency >= 1);
    o
}

// ---------------------------------------------------------------------------------------------
// Processes: everything started is killed on drop, and by the watchdog.

static CHILDREN: Mutex<Vec<u32>> = Mutex::new(Vec::new());

struct Proc {
    child: Child,
    name: &'static str,
    log: PathBuf,
}

impl Proc {
    fn spawn(name: &'static str, mut cmd: Command, log: PathBuf) -> Proc {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        CHILDREN.lock().unwrap().push(child.id());
        Proc { child, name, log }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "{} exited with {status}; log:\n{}",
                self.name,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        CHILDREN.lock().unwrap().retain(|&p| p != self.child.id());
    }
}

fn start_watchdog(limit: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        eprintln!("e2e: still running after {limit:?}; killing what it started and exiting");
        for pid in CHILDREN.lock().unwrap().iter() {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        std::process::exit(2);
    });
}

fn start_nats(dir: &Path) -> (Proc, String) {
    let port = free_port();
    let mut cmd = Command::new(nats_server_bin());
    cmd.args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(dir.join("js"));
    let proc = Proc::spawn("nats-server", cmd, dir.join("nats.log"));
    wait_for_port(port, "nats-server");
    (proc, format!("nats://127.0.0.1:{port}"))
}

async fn start_daemon(dir: &Path, nats_url: &str, mode: Mode) -> (Proc, SocketAddr) {
    let http = SocketAddr::from(([127, 0, 0, 1], free_port()));
    // `E2E_DAEMON_BIN` measures another build of the daemon (an A/B comparison) with this bench.
    let bin =
        std::env::var_os("E2E_DAEMON_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_kvrouted").into());
    let mut cmd = Command::new(bin);
    cmd.arg("serve")
        .args(["--nats-url", nats_url, "--http-addr", &http.to_string()])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(["--block-size", &BLOCK.to_string()])
        // The periodic snapshot (default every 60 s) would land in a phase at random; it is a
        // separate cost, kept out of these steady-state figures.
        .args(["--snapshot-interval", "1h"])
        .env("RUST_LOG", "warn");
    if mode == Mode::Core {
        cmd.arg("--no-jetstream");
    }
    let mut proc = Proc::spawn("kvrouted", cmd, dir.join("kvrouted.log"));
    let client = reqwest::Client::new();
    let start = Instant::now();
    loop {
        proc.assert_running();
        if let Ok(r) = client.get(format!("http://{http}/readyz")).send().await {
            if r.text().await.unwrap_or_default().contains("\"ready\"") {
                break;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "kvrouted did not become ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (proc, http)
}

// ---------------------------------------------------------------------------------------------
// /proc figures.

#[derive(Clone, Copy)]
struct CpuSample {
    at: Instant,
    ticks: u64,
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

fn cpu(pid: u32) -> CpuSample {
    let ticks = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // Fields after the command name (which may hold spaces): state is field 3, utime
            // and stime are fields 14 and 15.
            let rest = s.rsplit_once(')')?.1.to_owned();
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0);
    CpuSample {
        at: Instant::now(),
        ticks,
    }
}

/// Cores used between two samples.
fn cores(a: CpuSample, b: CpuSample, tck: f64) -> f64 {
    (b.ticks.saturating_sub(a.ticks)) as f64 / tck / (b.at - a.at).as_secs_f64()
}

/// (VmRSS, VmHWM) in MiB.
fn rss_mib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (field("VmRSS:"), field("VmHWM:"))
}

struct Pids {
    daemon: u32,
    nats: u32,
    me: u32,
}

struct CpuWindow {
    daemon: CpuSample,
    nats: CpuSample,
    me: CpuSample,
}

impl Pids {
    fn sample(&self) -> CpuWindow {
        CpuWindow {
            daemon: cpu(self.daemon),
            nats: cpu(self.nats),
            me: cpu(self.me),
        }
    }

    /// "daemon 1.23 cores, nats-server 0.45, bench 0.30"
    fn usage(&self, from: &CpuWindow, tck: f64) -> (f64, f64, f64) {
        let now = self.sample();
        (
            cores(from.daemon, now.daemon, tck),
            cores(from.nats, now.nats, tck),
            cores(from.me, now.me, tck),
        )
    }
}

// ---------------------------------------------------------------------------------------------
// The workload.

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Token `t` of conversation prefix `j`: a vocabulary of 128k ids.
fn token(j: usize, t: usize) -> u32 {
    (mix(((j as u64) << 32) | t as u64) % 128_000) as u32
}

/// The engine's hash of block `b` of prefix `j` (the same on every worker, as vLLM's are).
fn engine_hash(j: usize, b: usize) -> u64 {
    mix(((j as u64) << 32) | b as u64 | (1 << 63)) >> 1
}

/// Pre-encoded events: `stored[j][i]` stores batch `i` of prefix `j`, `removed[j][i]` removes it.
struct Payloads {
    stored: Vec<Vec<Vec<u8>>>,
    removed: Vec<Vec<Vec<u8>>>,
}

/// The msgpack of one event, cut out of a one-event vLLM batch `[ts, [event], nil]`.
fn event_bytes(event: VllmEvent) -> Vec<u8> {
    let batch = encode_vllm_batch(1.0, &[event], None);
    assert_eq!(
        (batch[0], batch[1], batch[10], *batch.last().unwrap()),
        (0x93, 0xcb, 0x91, 0xc0),
        "vLLM batch layout"
    );
    batch[11..batch.len() - 1].to_vec()
}

/// `[ts, [events...], nil]`, byte for byte what `encode_vllm_batch` writes.
fn batch_bytes(events: &[&[u8]]) -> Bytes {
    let len: usize = events.iter().map(|e| e.len()).sum();
    let mut out = Vec::with_capacity(12 + len);
    out.push(0x93);
    out.push(0xcb);
    out.extend_from_slice(&1.0f64.to_be_bytes());
    out.push(0x90 | events.len() as u8);
    for e in events {
        out.extend_from_slice(e);
    }
    out.push(0xc0);
    Bytes::from(out)
}

fn build_payloads() -> Payloads {
    let mut p = Payloads {
        stored: Vec::new(),
        removed: Vec::new(),
    };
    for j in 0..PREFIXES {
        let (mut stored, mut removed) = (Vec::new(), Vec::new());
        for i in 0..BATCHES_PER_PREFIX {
            let blocks = i * BATCH_BLOCKS..(i + 1) * BATCH_BLOCKS;
            let hashes: Vec<u64> = blocks.clone().map(|b| engine_hash(j, b)).collect();
            stored.push(event_bytes(VllmEvent::BlockStored {
                block_hashes: hashes.clone(),
                parent_block_hash: (i > 0).then(|| engine_hash(j, blocks.start - 1)),
                token_ids: (blocks.start * BLOCK..blocks.end * BLOCK)
                    .map(|t| token(j, t))
                    .collect(),
                block_size: BLOCK as u32,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
            }));
            removed.push(event_bytes(VllmEvent::BlockRemoved {
                block_hashes: hashes.into_iter().rev().collect(),
                medium: Some("GPU".into()),
            }));
        }
        p.stored.push(stored);
        p.removed.push(removed);
    }
    p
}

/// A simulated worker's position in its stream of prefixes.
struct SimWorker {
    subject: String,
    w: usize,
    seq: u64,
    /// Prefixes started so far, and the next batch of the current one.
    k: usize,
    i: usize,
    /// Whether the removal that goes before batch `i` has been sent.
    evicted: bool,
}

impl SimWorker {
    fn prefix(&self, k: usize) -> usize {
        (self.w * 5 + k) % PREFIXES
    }

    /// The next message, one 32-block event each: (payload, stored blocks, removed blocks).
    fn next(&mut self, p: &Payloads) -> (Bytes, u64, u64) {
        self.seq += 1;
        if self.k >= HELD_PREFIXES && !self.evicted {
            // Evict the oldest prefix tail first: 32 blocks before each 32 stored.
            self.evicted = true;
            let old = self.prefix(self.k - HELD_PREFIXES);
            let removed = &p.removed[old][BATCHES_PER_PREFIX - 1 - self.i];
            return (batch_bytes(&[removed]), 0, BATCH_BLOCKS as u64);
        }
        self.evicted = false;
        let stored = &p.stored[self.prefix(self.k)][self.i];
        self.i += 1;
        if self.i == BATCHES_PER_PREFIX {
            self.i = 0;
            self.k += 1;
        }
        (batch_bytes(&[stored]), BATCH_BLOCKS as u64, 0)
    }
}

#[derive(Default)]
struct Published {
    batches: AtomicU64,
    stored: AtomicU64,
    removed: AtomicU64,
    errors: AtomicU64,
}

/// Runs every publisher until `deadline`. `prefix` is the subject prefix (`kv` for the daemon,
/// `base` for the broker-only baseline). Returns what was published (and, for JetStream,
/// acknowledged by the stream).
async fn publish(
    o: &Options,
    nats_url: &str,
    mode: Mode,
    prefix: &str,
    payloads: Arc<Payloads>,
    workers: Arc<Mutex<Vec<SimWorker>>>,
    deadline: Instant,
) -> Arc<Published> {
    let published = Arc::new(Published::default());
    let mut tasks = Vec::new();
    // Each connection takes its workers out of the shared list and puts them back, so the next
    // phase continues every worker's stream (and its Kv-Seq) where this one stopped.
    let mut shares: Vec<Vec<SimWorker>> = (0..o.publishers).map(|_| Vec::new()).collect();
    for worker in std::mem::take(&mut *workers.lock().unwrap()) {
        let p = worker.w % o.publishers;
        shares[p].push(worker);
    }
    for mine in shares {
        let client = async_nats::ConnectOptions::new()
            .connect(nats_url)
            .await
            .expect("publisher connects");
        let (payloads, published, workers) = (payloads.clone(), published.clone(), workers.clone());
        let (window, prefix) = (o.window, prefix.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut mine = mine;
            let js = async_nats::jetstream::new(client.clone());
            let mut inflight = VecDeque::new();
            let (mut batches, mut stored, mut removed) = (0u64, 0u64, 0u64);
            'outer: loop {
                for worker in mine.iter_mut() {
                    if Instant::now() >= deadline {
                        break 'outer;
                    }
                    let (payload, s, r) = worker.next(&payloads);
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("Kv-Seq", worker.seq.to_string().as_str());
                    let subject = format!("{prefix}{}", &worker.subject);
                    match mode {
                        Mode::JetStream => {
                            match js.publish_with_headers(subject, headers, payload).await {
                                Ok(ack) => inflight.push_back((ack, s, r)),
                                Err(_) => {
                                    published.errors.fetch_add(1, Ordering::Relaxed);
                                    continue;
                                }
                            }
                            if inflight.len() >= window {
                                let (ack, s, r) = inflight.pop_front().unwrap();
                                if ack.await.is_ok() {
                                    batches += 1;
                                    stored += s;
                                    removed += r;
                                } else {
                                    published.errors.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                        Mode::Core => {
                            if client
                                .publish_with_headers(subject, headers, payload)
                                .await
                                .is_ok()
                            {
                                batches += 1;
                                stored += s;
                                removed += r;
                            } else {
                                published.errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
            }
            for (ack, s, r) in inflight {
                match tokio::time::timeout(Duration::from_secs(10), ack).await {
                    Ok(Ok(_)) => {
                        batches += 1;
                        stored += s;
                        removed += r;
                    }
                    _ => {
                        published.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            let _ = tokio::time::timeout(Duration::from_secs(10), client.flush()).await;
            published.batches.fetch_add(batches, Ordering::Relaxed);
            published.stored.fetch_add(stored, Ordering::Relaxed);
            published.removed.fetch_add(removed, Ordering::Relaxed);
            workers.lock().unwrap().extend(mine);
        }));
    }
    for t in tasks {
        t.await.expect("publisher task");
    }
    workers.lock().unwrap().sort_by_key(|w| w.w);
    published
}

fn sim_workers(o: &Options) -> Arc<Mutex<Vec<SimWorker>>> {
    Arc::new(Mutex::new(
        (0..o.publishers * o.workers_per_publisher)
            .map(|w| SimWorker {
                subject: format!(".events.w{w:03}"),
                w,
                seq: 0,
                k: 0,
                i: 0,
                evicted: false,
            })
            .collect(),
    ))
}

/// Publishes a load sample for every simulated worker every `5s` until dropped, as a real
/// worker's metrics loop does. Without it the workers fall silent once publishing stops, and
/// the later route phases run into `worker_ttl` (60s): every worker ages out, and routes get
/// `503`s.
struct Heartbeat(tokio::task::JoinHandle<()>);

impl Heartbeat {
    async fn start(nats_url: &str, workers: usize) -> Heartbeat {
        let client = async_nats::connect(nats_url).await.unwrap();
        let sample = Bytes::from(encode_load(0.3, 4, 0, Some(64), 0.0, None));
        Heartbeat(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                for w in 0..workers {
                    // A lost sample is made up 5s later; the daemon counts any it rejects.
                    let _ = client
                        .publish(format!("kv.load.w{w:03}"), sample.clone())
                        .await;
                }
            }
        }))
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP load.

/// A route request body with the first `len` tokens of prefix `j`.
fn route_body(j: usize, len: usize) -> Bytes {
    let tokens: Vec<u32> = (0..len).map(|t| token(j, t)).collect();
    Bytes::from(
        serde_json::to_vec(&serde_json::json!({ "tokens": tokens, "max_output_tokens": 256 }))
            .unwrap(),
    )
}

/// The same prompt as [`route_body`], sent as the block keys a gateway that hashes tokens itself
/// sends (`len / 16` keys instead of `len` token ids).
fn route_body_keys(j: usize, len: usize) -> Bytes {
    let tokens: Vec<u32> = (0..len).map(|t| token(j, t)).collect();
    let keys = kvrouted::hashing::block_keys(&tokens, BLOCK);
    Bytes::from(
        serde_json::to_vec(
            &serde_json::json!({ "block_keys": keys, "prompt_tokens": len, "max_output_tokens": 256 }),
        )
        .unwrap(),
    )
}

/// Bodies with log-uniform prompt lengths between 1k and 32k tokens.
fn mixed_bodies(n: usize) -> Vec<Bytes> {
    (0..n)
        .map(|i| {
            let r = mix(0x5eed_0000 + i as u64);
            let j = (r % PREFIXES as u64) as usize;
            let u = (r >> 16) as f64 / (1u64 << 48) as f64;
            let len = (1024.0 * 32f64.powf(u)) as usize;
            route_body(j, len.clamp(1024, PREFIX_TOKENS))
        })
        .collect()
}

struct Load {
    requests: u64,
    errors: u64,
    /// The first failed request's status and body (or transport error), for the report.
    first_error: Option<String>,
    per_s: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    mean_us: f64,
    body_kib: f64,
}

fn pct(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1000.0
}

/// What one load run measured: every latency (ns), errors, body bytes and the wall time.
#[derive(Default)]
struct Raw {
    lat: Vec<u64>,
    errors: u64,
    first_error: Option<String>,
    bytes: u64,
    secs: f64,
}

impl Raw {
    fn add(&mut self, other: Raw) {
        self.lat.extend(other.lat);
        self.errors += other.errors;
        self.first_error = self.first_error.take().or(other.first_error);
        self.bytes += other.bytes;
        self.secs += other.secs;
    }

    fn summary(mut self) -> Load {
        self.lat.sort_unstable();
        let n = self.lat.len().max(1) as f64;
        Load {
            requests: self.lat.len() as u64,
            errors: self.errors,
            first_error: self.first_error,
            per_s: self.lat.len() as f64 / self.secs.max(1e-9),
            p50_us: pct(&self.lat, 0.5),
            p99_us: pct(&self.lat, 0.99),
            p999_us: pct(&self.lat, 0.999),
            mean_us: self.lat.iter().sum::<u64>() as f64 / n / 1000.0,
            body_kib: self.bytes as f64 / n / 1024.0,
        }
    }
}

/// `concurrency` request loops against `url` until `duration` has passed.
async fn http_load_raw(
    client: &reqwest::Client,
    url: &str,
    bodies: Arc<Vec<Bytes>>,
    concurrency: usize,
    duration: Duration,
) -> Raw {
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::new();
    for c in 0..concurrency {
        let (client, bodies, url) = (client.clone(), bodies.clone(), url.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut raw = Raw::default();
            let mut n = c;
            while Instant::now() < deadline {
                let body = bodies[n % bodies.len()].clone();
                n += concurrency;
                raw.bytes += body.len() as u64;
                let t = Instant::now();
                let error = match client
                    .post(&url)
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(body)
                    .send()
                    .await
                {
                    Ok(r) => {
                        let status = r.status();
                        match r.bytes().await {
                            Ok(_) if status.is_success() => None,
                            Ok(body) => Some(format!(
                                "{status}: {}",
                                String::from_utf8_lossy(&body[..body.len().min(200)])
                            )),
                            Err(e) => Some(e.to_string()),
                        }
                    }
                    Err(e) => Some(e.to_string()),
                };
                raw.lat.push(t.elapsed().as_nanos() as u64);
                if let Some(error) = error {
                    raw.errors += 1;
                    raw.first_error.get_or_insert(error);
                }
            }
            raw
        }));
    }
    let mut all = Raw::default();
    for t in tasks {
        all.add(t.await.unwrap());
    }
    all.secs = start.elapsed().as_secs_f64();
    all
}

fn http_client(concurrency: usize) -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()
        .unwrap()
}

async fn http_load(
    url: &str,
    bodies: Arc<Vec<Bytes>>,
    concurrency: usize,
    duration: Duration,
) -> Load {
    let client = http_client(concurrency);
    http_load_raw(&client, url, bodies, concurrency, duration)
        .await
        .summary()
}

// ---------------------------------------------------------------------------------------------
// The HTTP floor: a trivial axum server in this process, on its own runtime.

const FIXED_REPLY: &str = r#"{"worker":"w007","decision":"owner_hold","matched_blocks":256,"prompt_blocks":256,"owners":["w007"],"reservation":123456,"request_id":null}"#;

#[derive(Deserialize)]
struct ParseOnly {
    #[allow(dead_code)]
    tokens: Option<Vec<u32>>,
    #[allow(dead_code)]
    block_keys: Option<Vec<u64>>,
    #[allow(dead_code)]
    max_output_tokens: Option<u64>,
}

async fn floor(body: AxumBytes) -> impl IntoResponse {
    std::hint::black_box(body.len());
    ([(header::CONTENT_TYPE, "application/json")], FIXED_REPLY)
}

async fn floor_parse(body: AxumBytes) -> impl IntoResponse {
    let parsed: ParseOnly = serde_json::from_slice(&body).expect("a route body");
    std::hint::black_box(&parsed);
    ([(header::CONTENT_TYPE, "application/json")], FIXED_REPLY)
}

/// Starts the floor server (2 worker threads, like the daemon on this machine); returns its
/// address. It lives until the process exits.
fn start_floor() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let app = axum::Router::new()
                .route("/floor", post(floor))
                .route("/floor_parse", post(floor_parse))
                .layer(axum::extract::DefaultBodyLimit::max(8 << 20));
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    addr
}

// ---------------------------------------------------------------------------------------------
// Metrics.

async fn metrics_text(client: &reqwest::Client, http: SocketAddr) -> String {
    match client.get(format!("http://{http}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.trim().parse().ok()))
        .unwrap_or(0.0)
}

#[derive(Clone, Copy, Default)]
struct Counters {
    stored: f64,
    removed: f64,
    gaps: f64,
    route_sum: f64,
    route_count: f64,
    owner_hold: f64,
    cold_miss: f64,
}

async fn counters(client: &reqwest::Client, http: SocketAddr) -> Counters {
    let t = metrics_text(client, http).await;
    Counters {
        stored: metric(&t, "kvrouted_events_applied_total{kind=\"stored\"}"),
        removed: metric(&t, "kvrouted_events_applied_total{kind=\"removed\"}"),
        gaps: metric(&t, "kvrouted_event_seq_gaps_total"),
        route_sum: metric(&t, "kvrouted_route_duration_seconds_sum"),
        route_count: metric(&t, "kvrouted_route_duration_seconds_count"),
        owner_hold: metric(
            &t,
            "kvrouted_route_decisions_total{decision=\"owner_hold\"}",
        ),
        cold_miss: metric(&t, "kvrouted_route_decisions_total{decision=\"cold_miss\"}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Reporting.

/// Lines are printed as they come; the JSON fragments make the last line.
struct Report {
    json: Vec<String>,
}

impl Report {
    fn line(&mut self, s: String) {
        println!("{s}");
    }
}

fn load_line(what: &str, l: &Load) -> String {
    let mut line = format!(
        "  {what:<34} {:>8.0} req/s  p50 {:>8.1} µs  p99 {:>8.1} µs  p999 {:>8.1} µs  mean {:>8.1} µs  ({} requests, {} errors, {:.1} KiB/body)",
        l.per_s, l.p50_us, l.p99_us, l.p999_us, l.mean_us, l.requests, l.errors, l.body_kib
    );
    if let Some(error) = &l.first_error {
        // Failed requests are counted in the latencies: the figures above are not clean.
        line.push_str(&format!("\n    FAILED REQUESTS; the first: {error}"));
    }
    line
}

fn load_json(l: &Load) -> String {
    format!(
        "{{\"per_s\":{:.0},\"p50_us\":{:.1},\"p99_us\":{:.1},\"p999_us\":{:.1},\"mean_us\":{:.1},\"requests\":{},\"errors\":{}}}",
        l.per_s, l.p50_us, l.p99_us, l.p999_us, l.mean_us, l.requests, l.errors
    )
}

// ---------------------------------------------------------------------------------------------
// kvrouted against the HTTP floor.

struct PairedTargets<'a> {
    route: &'a str,
    floor: SocketAddr,
    daemon: SocketAddr,
}

/// Rounds in which kvrouted, the floor and the floor that parses take turns, so that whatever
/// else the machine does lands on all three alike.
const PAIRED_ROUNDS: u32 = 4;

/// How a paired phase's 4k-token prompts are sent.
#[derive(Clone, Copy, PartialEq)]
enum BodyKind {
    /// `{"tokens": [...4,096 ids...]}`, 24.6 KiB.
    Tokens,
    /// `{"block_keys": [...256 keys...]}`, what a gateway that hashes tokens itself sends.
    BlockKeys,
}

/// 4k-token route requests at `concurrency` against kvrouted, the floor (fixed reply) and the
/// floor that also parses the body; reports all three and kvrouted's own share.
#[allow(clippy::too_many_arguments)]
async fn paired_4k(
    o: &Options,
    targets: PairedTargets<'_>,
    pids: &Pids,
    (kind, bodies): (BodyKind, Arc<Vec<Bytes>>),
    concurrency: usize,
    mode: Mode,
    report: &mut Report,
    tck: f64,
) {
    let urls = [
        targets.route.to_owned(),
        format!("http://{}/floor", targets.floor),
        format!("http://{}/floor_parse", targets.floor),
    ];
    let names = ["kvrouted", "floor", "floor+parse"];
    let client = http_client(concurrency);
    let slice = o.duration / PAIRED_ROUNDS;
    let mut raws: [Raw; 3] = Default::default();
    let (mut handler_sum, mut handler_count, mut daemon_ticks, mut daemon_secs) =
        (0.0, 0.0, 0u64, 0.0);
    let metrics_client = reqwest::Client::new();
    for _ in 0..PAIRED_ROUNDS {
        for (i, url) in urls.iter().enumerate() {
            let (c0, cpu0) = if i == 0 {
                (
                    counters(&metrics_client, targets.daemon).await,
                    Some(cpu(pids.daemon)),
                )
            } else {
                (Counters::default(), None)
            };
            let raw = http_load_raw(&client, url, bodies.clone(), concurrency, slice).await;
            if let Some(cpu0) = cpu0 {
                let c1 = counters(&metrics_client, targets.daemon).await;
                let cpu1 = cpu(pids.daemon);
                handler_sum += c1.route_sum - c0.route_sum;
                handler_count += c1.route_count - c0.route_count;
                daemon_ticks += cpu1.ticks.saturating_sub(cpu0.ticks);
                daemon_secs += (cpu1.at - cpu0.at).as_secs_f64();
            }
            raws[i].add(raw);
        }
    }
    let loads: Vec<Load> = raws.into_iter().map(Raw::summary).collect();
    let handler_mean = 1e6 * handler_sum / handler_count.max(1.0);
    let daemon_cores = daemon_ticks as f64 / tck / daemon_secs.max(1e-9);
    let (what, phase) = match kind {
        BodyKind::Tokens => ("4k-token prompts", "4k paired"),
        BodyKind::BlockKeys => ("4k-token prompts as block_keys", "4k block_keys paired"),
    };
    report.line(format!(
        "  {what}, concurrency {concurrency}, {PAIRED_ROUNDS} interleaved rounds:"
    ));
    for (name, load) in names.iter().zip(&loads) {
        report.line(load_line(name, load));
    }
    let share = |route: f64, floor: f64| 100.0 * (1.0 - floor / route);
    let (route, bare, parse) = (&loads[0], &loads[1], &loads[2]);
    report.line(format!(
        "    daemon handler mean {handler_mean:.1} µs; daemon {daemon_cores:.2} cores while serving. kvrouted's own share of the route: {:.0}% at p50, {:.0}% of the mean; beyond parsing the JSON body: {:.0}% at p50",
        share(route.p50_us, bare.p50_us),
        share(route.mean_us, bare.mean_us),
        share(route.p50_us, parse.p50_us),
    ));
    report.json.push(format!(
        "{{\"mode\":\"{}\",\"phase\":\"{phase}, concurrency {concurrency}\",\"kvrouted\":{},\"floor\":{},\"floor_parse\":{},\"daemon_handler_mean_us\":{handler_mean:.1},\"share_p50_pct\":{:.1},\"share_mean_pct\":{:.1},\"share_beyond_parse_p50_pct\":{:.1}}}",
        mode.name(),
        load_json(route),
        load_json(bare),
        load_json(parse),
        share(route.p50_us, bare.p50_us),
        share(route.mean_us, bare.mean_us),
        share(route.p50_us, parse.p50_us),
    ));
}

// ---------------------------------------------------------------------------------------------
// One NATS mode.

/// What the publishers and the load generator send, built before any clock starts.
struct Workload {
    payloads: Arc<Payloads>,
    /// Route bodies of 1k–32k tokens.
    mixed: Arc<Vec<Bytes>>,
    /// Route bodies of 4,096 tokens.
    four_k: Arc<Vec<Bytes>>,
    /// The same prompts as `four_k`, as block keys.
    four_k_keys: Arc<Vec<Bytes>>,
}

async fn run_mode(
    o: &Options,
    mode: Mode,
    w: &Workload,
    floor: Option<SocketAddr>,
    report: &mut Report,
    tck: f64,
) {
    let (payloads, mixed, four_k) = (w.payloads.clone(), w.mixed.clone(), w.four_k.clone());
    let four_k_keys = w.four_k_keys.clone();
    let dir = TempDir::new().unwrap();
    let (nats, nats_url) = start_nats(dir.path());
    let me = std::process::id();
    report.line(format!(
        "\n== {} ({} publisher connections × {} workers, 32-block batches) ==",
        mode.name(),
        o.publishers,
        o.workers_per_publisher
    ));

    // 1. The broker alone.
    let baseline = {
        let client = async_nats::connect(&nats_url).await.unwrap();
        let received = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let counter = if mode == Mode::Core {
            let mut sub = client.subscribe("base.events.>").await.unwrap();
            let (received, stop) = (received.clone(), stop.clone());
            Some(tokio::spawn(async move {
                loop {
                    match tokio::time::timeout(Duration::from_millis(200), sub.next()).await {
                        Ok(Some(_)) => {
                            received.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(None) => break,
                        Err(_) if stop.load(Ordering::Relaxed) => break,
                        Err(_) => {}
                    }
                }
            }))
        } else {
            let js = async_nats::jetstream::new(client.clone());
            js.create_stream(async_nats::jetstream::stream::Config {
                name: "BASELINE".into(),
                subjects: vec!["base.events.>".into()],
                storage: async_nats::jetstream::stream::StorageType::File,
                ..Default::default()
            })
            .await
            .expect("baseline stream");
            None
        };
        let pids = Pids {
            daemon: me,
            nats: nats.pid(),
            me,
        };
        let window = pids.sample();
        let start = Instant::now();
        let published = publish(
            o,
            &nats_url,
            mode,
            "base",
            payloads.clone(),
            sim_workers(o),
            start + o.duration,
        )
        .await;
        let secs = start.elapsed().as_secs_f64();
        let (_, nats_cpu, me_cpu) = pids.usage(&window, tck);
        if let Some(counter) = counter {
            tokio::time::sleep(Duration::from_millis(200)).await;
            stop.store(true, Ordering::Relaxed);
            let _ = tokio::time::timeout(Duration::from_secs(2), counter).await;
        } else {
            let js = async_nats::jetstream::new(client.clone());
            let _ = js.delete_stream("BASELINE").await;
        }
        let events = (published.stored.load(Ordering::Relaxed)
            + published.removed.load(Ordering::Relaxed)) as f64;
        let published_rate = events / secs;
        // JetStream: what the stream acknowledged. Core NATS: what reached a subscriber (each
        // message is one 32-block event).
        let rate = match mode {
            Mode::JetStream => published_rate,
            Mode::Core => received.load(Ordering::Relaxed) as f64 * BATCH_BLOCKS as f64 / secs,
        };
        report.line(format!(
            "broker only: {rate:.0} block events/s {} ({published_rate:.0}/s published; nats-server {nats_cpu:.2} cores, bench {me_cpu:.2}; {} publish errors)",
            match mode {
                Mode::JetStream => "published and acknowledged by the stream",
                Mode::Core => "delivered to a subscriber that only counts them",
            },
            published.errors.load(Ordering::Relaxed),
        ));
        rate
    };

    // 2. Ingest into the daemon.
    let (mut daemon, http) = start_daemon(dir.path(), &nats_url, mode).await;
    if mode == Mode::Core {
        // Core NATS readiness does not wait for the subscriptions to reach the server.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let _heartbeat = Heartbeat::start(&nats_url, o.publishers * o.workers_per_publisher).await;
    let pids = Pids {
        daemon: daemon.pid(),
        nats: nats.pid(),
        me,
    };
    let client = reqwest::Client::new();
    let workers = sim_workers(o);
    let c0 = counters(&client, http).await;
    let window = pids.sample();
    let start = Instant::now();
    let published = publish(
        o,
        &nats_url,
        mode,
        "kv",
        payloads.clone(),
        workers.clone(),
        start + o.duration,
    )
    .await;
    let publish_secs = start.elapsed().as_secs_f64();
    let c1 = counters(&client, http).await;
    let at_end = start.elapsed().as_secs_f64();
    let (d_cpu, n_cpu, b_cpu) = pids.usage(&window, tck);
    let pub_stored = published.stored.load(Ordering::Relaxed) as f64;
    let pub_removed = published.removed.load(Ordering::Relaxed) as f64;
    // Drain: wait until the daemon has applied everything published (JetStream) or the
    // counter stops moving (core NATS may have dropped messages), at most 60 s.
    let drain_start = Instant::now();
    let mut last = c1;
    let mut still = 0;
    while drain_start.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let c = counters(&client, http).await;
        if c.stored + c.removed >= c0.stored + c0.removed + pub_stored + pub_removed {
            last = c;
            break;
        }
        still = if c.stored + c.removed == last.stored + last.removed {
            still + 1
        } else {
            0
        };
        last = c;
        if still >= 8 {
            break;
        }
    }
    let drain_secs = drain_start.elapsed().as_secs_f64();
    daemon.assert_running();
    let events = |c: &Counters| c.stored + c.removed;
    let pub_events = pub_stored + pub_removed;
    let applied_in_window = (events(&c1) - events(&c0)) / at_end;
    let stored_in_window = (c1.stored - c0.stored) / at_end;
    let applied_total = events(&last) - events(&c0);
    let drain_rate = (events(&last) - events(&c1)) / drain_secs.max(1e-9);
    let (rss, hwm) = rss_mib(daemon.pid());
    report.line(format!(
        "ingest: published {:.0} block events/s ({:.0} stored + {:.0} removed, 32 per message); the daemon applied {applied_in_window:.0} block events/s while they were published ({stored_in_window:.0} stored/s; {:.2}× the broker-only rate)",
        pub_events / publish_secs,
        pub_stored / publish_secs,
        pub_removed / publish_secs,
        applied_in_window / baseline.max(1.0),
    ));
    report.line(format!(
        "  in the end {applied_total:.0} of {pub_events:.0} published block events applied ({:.1}%); the backlog left when publishing stopped ({:.0}) took {drain_secs:.1} s ({drain_rate:.0}/s); seq gaps {:.0}",
        100.0 * applied_total / pub_events.max(1.0),
        (events(&c0) + pub_events - events(&c1)).max(0.0),
        last.gaps - c0.gaps,
    ));
    report.line(format!(
        "  cpu during publishing: daemon {d_cpu:.2} cores, nats-server {n_cpu:.2}, bench (publishers) {b_cpu:.2}; daemon RSS {rss:.0} MiB (peak {hwm:.0})"
    ));
    report.json.push(format!(
        "{{\"mode\":\"{}\",\"phase\":\"ingest\",\"broker_only_events_per_s\":{baseline:.0},\"published_events_per_s\":{:.0},\"applied_events_per_s\":{applied_in_window:.0},\"applied_stored_per_s\":{stored_in_window:.0},\"applied_fraction\":{:.4},\"drain_events_per_s\":{drain_rate:.0},\"daemon_cores\":{d_cpu:.2},\"nats_cores\":{n_cpu:.2},\"bench_cores\":{b_cpu:.2},\"daemon_rss_mib\":{rss:.0},\"daemon_peak_rss_mib\":{hwm:.0}}}",
        mode.name(),
        pub_events / publish_secs,
        applied_total / pub_events.max(1.0),
    ));

    // 3. Routes over the index the ingest phase built.
    let url = format!("http://{http}/v1/route");
    {
        let c0 = counters(&client, http).await;
        let window = pids.sample();
        let load = http_load(&url, mixed.clone(), o.concurrency, o.duration).await;
        let (d_cpu, _, b_cpu) = pids.usage(&window, tck);
        let c1 = counters(&client, http).await;
        let server_mean =
            1e6 * (c1.route_sum - c0.route_sum) / (c1.route_count - c0.route_count).max(1.0);
        let (rss, _) = rss_mib(daemon.pid());
        let label = format!("routes 1k-32k tokens, concurrency {}", o.concurrency);
        report.line(load_line(&label, &load));
        report.line(format!(
            "    daemon handler mean {server_mean:.1} µs (kvrouted_route_duration_seconds); owner_hold {:.0}, cold_miss {:.0}; cpu daemon {d_cpu:.2} cores, bench {b_cpu:.2}; RSS {rss:.0} MiB",
            c1.owner_hold - c0.owner_hold,
            c1.cold_miss - c0.cold_miss
        ));
        report.json.push(format!(
            "{{\"mode\":\"{}\",\"phase\":\"{label}\",\"load\":{},\"daemon_handler_mean_us\":{server_mean:.1},\"daemon_cores\":{d_cpu:.2},\"daemon_rss_mib\":{rss:.0}}}",
            mode.name(),
            load_json(&load)
        ));
    }

    // 4. 4k-token routes against the HTTP floor, interleaved so both see the same machine.
    if let Some(floor) = floor {
        let runs = [
            (BodyKind::Tokens, 1),
            (BodyKind::Tokens, o.concurrency),
            (BodyKind::BlockKeys, 1),
        ];
        for (kind, concurrency) in runs {
            let bodies = match kind {
                BodyKind::Tokens => four_k.clone(),
                BodyKind::BlockKeys => four_k_keys.clone(),
            };
            paired_4k(
                o,
                PairedTargets {
                    route: &url,
                    floor,
                    daemon: http,
                },
                &pids,
                (kind, bodies),
                concurrency,
                mode,
                report,
                tck,
            )
            .await;
        }
    }

    // 5. Both at once.
    let c0 = counters(&client, http).await;
    let window = pids.sample();
    let start = Instant::now();
    let (published, load) = tokio::join!(
        publish(
            o,
            &nats_url,
            mode,
            "kv",
            payloads.clone(),
            workers.clone(),
            start + o.duration
        ),
        http_load(&url, mixed.clone(), o.concurrency, o.duration)
    );
    let c1 = counters(&client, http).await;
    let secs = start.elapsed().as_secs_f64();
    let (d_cpu, n_cpu, b_cpu) = pids.usage(&window, tck);
    let (rss, hwm) = rss_mib(daemon.pid());
    daemon.assert_running();
    report.line(format!(
        "combined: published {:.0} block events/s, the daemon applied {:.0}/s while serving",
        (published.stored.load(Ordering::Relaxed) + published.removed.load(Ordering::Relaxed))
            as f64
            / secs,
        (c1.stored + c1.removed - c0.stored - c0.removed) / secs
    ));
    report.line(load_line(
        &format!("routes 1k-32k tokens, concurrency {}", o.concurrency),
        &load,
    ));
    report.line(format!(
        "    cpu daemon {d_cpu:.2} cores, nats-server {n_cpu:.2}, bench {b_cpu:.2}; daemon RSS {rss:.0} MiB (peak {hwm:.0})"
    ));
    report.json.push(format!(
        "{{\"mode\":\"{}\",\"phase\":\"combined\",\"applied_events_per_s\":{:.0},\"load\":{},\"daemon_cores\":{d_cpu:.2},\"nats_cores\":{n_cpu:.2},\"daemon_peak_rss_mib\":{hwm:.0}}}",
        mode.name(),
        (c1.stored + c1.removed - c0.stored - c0.removed) / secs,
        load_json(&load)
    ));
    drop(daemon);
    drop(nats);
}

fn main() {
    let o = options();
    start_watchdog(Duration::from_secs(o.max_seconds));
    let started = Instant::now();
    let tck = clk_tck();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let workload = Workload {
        payloads: Arc::new(build_payloads()),
        mixed: Arc::new(mixed_bodies(256)),
        four_k: Arc::new((0..PREFIXES).map(|j| route_body(j, 4096)).collect()),
        four_k_keys: Arc::new((0..PREFIXES).map(|j| route_body_keys(j, 4096)).collect()),
    };
    let mut report = Report { json: Vec::new() };
    report.line(format!(
        "e2e: {} s per phase, {} publisher connections × {} workers, HTTP concurrency {}, JetStream window {}; nproc {}; load average {}",
        o.duration.as_secs(),
        o.publishers,
        o.workers_per_publisher,
        o.concurrency,
        o.window,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        loadavg()
    ));
    let floor = start_floor();
    wait_for_port(floor.port(), "floor server");
    rt.block_on(async {
        for (n, &mode) in o.modes.iter().enumerate() {
            run_mode(
                &o,
                mode,
                &workload,
                // Routes do not depend on the NATS mode: compare with the floor once.
                (n == 0).then_some(floor),
                &mut report,
                tck,
            )
            .await;
        }
    });
    report.line(format!(
        "\nfinished in {:.0} s; load average {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    ));
    println!(
        "{{\"bench\":\"e2e\",\"phase_seconds\":{},\"publishers\":{},\"workers\":{},\"concurrency\":{},\"results\":[{}]}}",
        o.duration.as_secs(),
        o.publishers,
        o.publishers * o.workers_per_publisher,
        o.concurrency,
        report.json.join(",")
    );
    // The floor server's runtime thread is detached; leave without waiting for it.
    std::process::exit(0);
}

/// The machine's load averages (1, 5, 15 min): other work on a shared machine skews every figure.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
