//! State-growth attacks (on demand: `cargo bench --bench attacks`): what a publisher inventing
//! worker ids, and a gateway inventing model names, cost the daemon. It starts its own
//! nats-server and daemon (`KVROUTED_BIN=/path/to/kvrouted` measures another build, for a
//! before/after), keeps one real worker (`keeper`, 8 blocks, a load sample every second), and
//! prints, after each phase: the daemon's RSS, `/metrics` (bytes and series), `/v1/workers`
//! bytes, the latency of routes of the keeper's prompt (p50, p99 on one keep-alive connection)
//! and the size of the next snapshot.
//!
//! 1. Workers: `ATTACK_WORKERS` (100,000) load samples from distinct worker ids; then the ids
//!    age out (`--worker-ttl 20s`) while the keeper stays.
//! 2. Models: `ATTACK_MODELS` (100,000) routes naming distinct models; 200 routes naming a
//!    1 MB model; a join declaring a model of 1,000,000 bytes.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use kvrouted::input::LifecycleOp;
use kvrouted::sim::percentile;
use kvrouted::wire::{encode_lifecycle, encode_load};
use kvrouted_testkit::{prompt, Daemon, Nats, Worker};
use serde_json::json;

/// One keep-alive HTTP/1.1 connection (responses carry `content-length`).
struct Http {
    addr: SocketAddr,
    conn: Option<BufReader<TcpStream>>,
}

impl Http {
    fn new(addr: SocketAddr) -> Http {
        Http { addr, conn: None }
    }

    fn request(&mut self, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
        for _ in 0..3 {
            if let Ok(reply) = self.try_request(method, path, body) {
                return reply;
            }
            self.conn = None; // the server closed it (e.g. after an error reply): reconnect
        }
        panic!("{method} {path}: no reply");
    }

    fn try_request(
        &mut self,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> std::io::Result<(u16, Vec<u8>)> {
        if self.conn.is_none() {
            let s = TcpStream::connect(self.addr)?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(Duration::from_secs(60)))?;
            self.conn = Some(BufReader::new(s));
        }
        let conn = self.conn.as_mut().expect("connected");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: kvrouted\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            body.len()
        );
        conn.get_mut().write_all(head.as_bytes())?;
        conn.get_mut().write_all(body)?;
        let mut line = String::new();
        conn.read_line(&mut line)?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("status line {line:?}")))?;
        let mut length = 0;
        let mut close = false;
        loop {
            line.clear();
            conn.read_line(&mut line)?;
            let l = line.trim_end().to_ascii_lowercase();
            if l.is_empty() {
                break;
            }
            if let Some(v) = l.strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
            close |= l == "connection: close";
        }
        let mut reply = vec![0; length];
        conn.read_exact(&mut reply)?;
        if close {
            self.conn = None;
        }
        Ok((status, reply))
    }
}

/// The daemon's process id: the one whose command line names its data dir.
fn daemon_pid(daemon: &Daemon) -> u32 {
    let dir = daemon.data_dir.to_string_lossy().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&dir))
        })
        .expect("the daemon's process")
}

fn rss_mb(pid: u32) -> f64 {
    kvrouted_testkit::resident_mib(pid)
        .expect("the daemon's /proc/<pid>/status")
        .0
}

/// Byte sizes of the snapshots the daemon logged so far.
fn snapshots(daemon: &Daemon) -> Vec<u64> {
    kvrouted_testkit::plain(&daemon.log_text())
        .lines()
        .filter(|l| l.contains("snapshot written"))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("bytes="))
                .and_then(|b| b.parse().ok())
        })
        .collect()
}

/// The next snapshot's size (snapshots every 5s).
fn next_snapshot(daemon: &Daemon) -> u64 {
    let before = snapshots(daemon).len();
    let start = Instant::now();
    loop {
        let all = snapshots(daemon);
        if all.len() > before {
            return *all.last().unwrap();
        }
        assert!(start.elapsed() < Duration::from_secs(120), "no snapshot");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

struct Probe<'a> {
    daemon: &'a Daemon,
    pid: u32,
    http: Http,
    route_body: Vec<u8>,
}

impl Probe<'_> {
    fn metrics(&mut self) -> String {
        String::from_utf8(self.http.request("GET", "/metrics", b"").1).unwrap()
    }

    fn report(&mut self, phase: &str) {
        let metrics = self.metrics();
        let series = metrics
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .count();
        let workers = self.http.request("GET", "/v1/workers", b"").1.len();
        let mut latencies = Vec::new();
        for _ in 0..300 {
            let started = Instant::now();
            let (status, body) = self.http.request("POST", "/v1/route", &self.route_body);
            latencies.push(started.elapsed());
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            let reservation: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let release = json!({"reservation": reservation["reservation"]}).to_string();
            self.http.request("POST", "/v1/release", release.as_bytes());
        }
        latencies.sort();
        let snapshot = next_snapshot(self.daemon);
        println!(
            "{phase:<44} rss {:>7.1} MB  /metrics {:>9} B {:>7} series  /v1/workers {:>9} B  \
             route p50 {:>8.2?} p99 {:>8.2?}  snapshot {:>10} B",
            rss_mb(self.pid),
            metrics.len(),
            series,
            workers,
            percentile(&latencies, 0.5),
            percentile(&latencies, 0.99),
            snapshot
        );
    }

    /// Waits until `f(metrics)` stays the same for 3s; returns it.
    fn settle(&mut self, f: impl Fn(&str) -> f64) -> f64 {
        let mut last = f(&self.metrics());
        let mut since = Instant::now();
        while since.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(250));
            let now = f(&self.metrics());
            if now != last {
                (last, since) = (now, Instant::now());
            }
        }
        last
    }
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).map_or(default, |v| v.parse().expect(name))
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` and test discovery
    }
    let attack_workers = env("ATTACK_WORKERS", 100_000);
    let attack_models = env("ATTACK_MODELS", 100_000);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let nats = Nats::start();
    let daemon = rt.block_on(Daemon::start(
        &nats.url(),
        &["--worker-ttl", "20s", "--snapshot-interval", "5s"],
    ));
    rt.block_on(daemon.wait_ready());
    println!(
        "daemon {} (ticks every 100ms, worker-ttl 20s, snapshots every 5s)",
        kvrouted_testkit::kvrouted_bin().display()
    );
    let pid = daemon_pid(&daemon);

    // The keeper: 8 blocks and a heartbeat every second for the whole run.
    let tokens = prompt(1, 8);
    let mut keeper = rt.block_on(Worker::connect(&nats.url(), "keeper"));
    rt.block_on(keeper.store(&tokens));
    let heartbeat = rt.spawn(async move {
        loop {
            keeper.load(0.2).await;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    rt.block_on(daemon.wait_blocks("keeper", 8));
    let mut probe = Probe {
        daemon: &daemon,
        pid,
        http: Http::new(daemon.http),
        route_body: json!({ "tokens": tokens }).to_string().into_bytes(),
    };
    probe.report("one live worker");

    // Attack 1: load samples from distinct worker ids.
    let flood = rt.block_on(Worker::connect(&nats.url(), "flood"));
    let payload = encode_load(0.5, 1, 0, Some(64), 0.0, None);
    let started = Instant::now();
    rt.block_on(async {
        for chunk in (0..attack_workers).collect::<Vec<_>>().chunks(1000) {
            for i in chunk {
                flood
                    .client()
                    .publish(format!("kv.load.attacker-{i}"), payload.clone().into())
                    .await
                    .unwrap();
            }
            flood.client().flush().await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let active = probe.settle(|m| metric(m, "kvrouted_workers{state=\"active\"}"));
    let rejected = metric(
        &probe.metrics(),
        "kvrouted_inputs_rejected_total{reason=\"worker_limit\"}",
    );
    println!(
        "published {attack_workers} load samples from distinct ids in {:.1?}: {active} workers \
         active, {rejected} rejected (worker_limit)",
        started.elapsed()
    );
    probe.report(&format!("{active} workers (attack 1)"));

    let start = Instant::now();
    while metric(&probe.metrics(), "kvrouted_workers{state=\"active\"}") > 1.0 {
        assert!(start.elapsed() < Duration::from_secs(300), "no age-out");
        std::thread::sleep(Duration::from_millis(500));
    }
    println!(
        "the attacking ids aged out {:.1?} after the flood",
        started.elapsed()
    );
    probe.report("after they aged out (one live worker)");

    // Attack 2: model names in routes.
    let rss_before = rss_mb(pid);
    let started = Instant::now();
    let threads = 4;
    std::thread::scope(|s| {
        for t in 0..threads {
            let (addr, tokens) = (daemon.http, &tokens);
            s.spawn(move || {
                let mut http = Http::new(addr);
                for i in (t..attack_models).step_by(threads) {
                    let body = json!({"tokens": tokens, "model": format!("model-{i}")});
                    let (_, reply) = http.request("POST", "/v1/route", body.to_string().as_bytes());
                    let reply: serde_json::Value =
                        serde_json::from_slice(&reply).unwrap_or_default();
                    if let Some(r) = reply.get("reservation") {
                        let release = json!({ "reservation": r }).to_string();
                        http.request("POST", "/v1/release", release.as_bytes());
                    }
                }
            });
        }
    });
    println!(
        "{attack_models} routes naming distinct models in {:.1?}: rss {rss_before:.1} -> {:.1} MB",
        started.elapsed(),
        rss_mb(pid)
    );
    probe.report(&format!("after {attack_models} model names in routes"));

    let rss_before = rss_mb(pid);
    let mut http = Http::new(daemon.http);
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..200 {
        let model = format!("{i:03}{}", "m".repeat(1 << 20));
        let body = json!({"tokens": tokens, "model": model}).to_string();
        let (status, _) = http.request("POST", "/v1/route", body.as_bytes());
        *statuses.entry(status).or_insert(0) += 1;
    }
    println!(
        "200 routes naming a 1 MB model (statuses {statuses:?}): rss {rss_before:.1} -> {:.1} MB",
        rss_mb(pid)
    );
    probe.report("after 200 routes with a 1 MB model");

    let rss_before = rss_mb(pid);
    let joiner = rt.block_on(Worker::connect(&nats.url(), "big-model"));
    let model = "m".repeat(1_000_000);
    let join = encode_lifecycle(LifecycleOp::Join, Some(&model), Some(16), None);
    rt.block_on(joiner.publish_js("kv.workers.big-model", async_nats::HeaderMap::new(), join));
    rt.block_on(daemon.wait_state("big-model", "active"));
    println!(
        "a join declaring a 1,000,000-byte model: rss {rss_before:.1} -> {:.1} MB",
        rss_mb(pid)
    );
    probe.report("after a join with a 1 MB model");
    heartbeat.abort();
}
