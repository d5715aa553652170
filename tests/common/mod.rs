//! Test harness: real nats-server processes on free loopback ports with their own storage, the
//! real `kvrouted` binary, real HTTP. Everything started here is killed on drop and every temp
//! dir removed. Waiting is always polling against a deadline, never a bare sleep.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvrouted::hashing::block_keys;
use kvrouted::input::LifecycleOp;
use kvrouted::wire::{encode_lifecycle, encode_load, encode_vllm_batch, VllmEvent};
use serde_json::Value;
use tempfile::TempDir;

pub const DEADLINE: Duration = Duration::from_secs(20);

/// A free TCP port on loopback (bound and released; the OS does not hand it out again at once).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls `check` until it returns `Some`, or panics with `what` after [`DEADLINE`].
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "timed out after {DEADLINE:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn nats_server_bin() -> PathBuf {
    if let Ok(p) = std::env::var("NATS_SERVER_BIN") {
        return p.into();
    }
    for dir in std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .chain(["/usr/sbin", "/usr/bin"])
    {
        let p = Path::new(dir).join("nats-server");
        if p.exists() {
            return p;
        }
    }
    panic!("nats-server not found: run scripts/test (it installs the Debian package nats-server)");
}

fn wait_for_port(port: u16, what: &str) {
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < DEADLINE,
            "{what} did not listen on port {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A nats-server with JetStream on a free port and its own storage dir.
pub struct Nats {
    child: Option<Child>,
    pub port: u16,
    dir: TempDir,
}

impl Nats {
    pub fn start() -> Nats {
        let mut nats = Nats {
            child: None,
            port: free_port(),
            dir: TempDir::new().unwrap(),
        };
        nats.restart();
        nats
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts (again) on the same port with the same storage.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "nats-server already running");
        let log = std::fs::File::create(self.dir.path().join("nats.log")).unwrap();
        let child = Command::new(nats_server_bin())
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.path().join("js"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        wait_for_port(self.port, "nats-server");
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The kvrouted daemon under test.
pub struct Daemon {
    child: Option<Child>,
    pub http: SocketAddr,
    pub data_dir: PathBuf,
    nats_url: String,
    extra: Vec<String>,
    log: PathBuf,
    _dir: Option<TempDir>,
    client: reqwest::Client,
}

/// Flags that keep tests fast: quick ticks and flushes.
const TEST_FLAGS: &[&str] = &["--tick-interval", "100ms", "--flush-interval", "5ms"];

impl Daemon {
    /// Starts a daemon with a fresh data dir.
    pub async fn start(nats_url: &str, extra: &[&str]) -> Daemon {
        let dir = TempDir::new().unwrap();
        let data_dir = dir.path().join("data");
        let mut d = Daemon {
            child: None,
            http: SocketAddr::from(([127, 0, 0, 1], free_port())),
            log: dir.path().join("kvrouted.log"),
            data_dir,
            nats_url: nats_url.to_string(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            _dir: Some(dir),
            client: reqwest::Client::new(),
        };
        d.restart().await;
        d
    }

    pub fn command(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvrouted"));
        cmd.arg("serve")
            .args(["--nats-url", &self.nats_url])
            .args(["--http-addr", &self.http.to_string()])
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args(TEST_FLAGS)
            .args(&self.extra)
            .env("RUST_LOG", "info");
        cmd
    }

    /// Starts the process (again) on the same data dir and port, and waits for /healthz.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "daemon already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = self
            .command()
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start kvrouted");
        self.child = Some(child);
        let url = self.url("/healthz");
        let client = self.client.clone();
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "kvrouted exited with {status} at start; log:\n{}",
                    self.log_text()
                );
            }
            if client.get(&url).send().await.is_ok() {
                break;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "kvrouted did not come up; log:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// SIGKILL: no snapshot, no flush.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait for a clean exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("daemon running");
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        c.wait().unwrap()
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    pub async fn wait_ready(&self) {
        let url = self.url("/readyz");
        let client = self.client.clone();
        eventually("/readyz says ready", || {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let r = client.get(&url).send().await.ok()?;
                let v: Value = r.json().await.ok()?;
                (v["status"] == "ready").then_some(())
            }
        })
        .await;
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn post_raw(&self, path: &str, content_type: &str, body: Vec<u8>) -> (u16, String) {
        let r = self
            .client
            .post(self.url(path))
            .header("content-type", content_type)
            .body(body)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap_or_default())
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = self.client.get(self.url(path)).send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// `POST /v1/route` with these tokens; returns (status, body).
    pub async fn route(&self, tokens: &[u32], extra: Value) -> (u16, Value) {
        let mut body = serde_json::json!({ "tokens": tokens });
        if let Value::Object(m) = extra {
            body.as_object_mut().unwrap().extend(m);
        }
        self.post("/v1/route", &body).await
    }

    pub async fn workers(&self) -> Value {
        let (status, text) = self.get("/v1/workers").await;
        assert_eq!(status, 200);
        serde_json::from_str(&text).unwrap()
    }

    /// Blocks owned by KV events per worker id, from `/v1/workers`.
    pub async fn blocks(&self) -> std::collections::BTreeMap<String, u64> {
        self.workers().await["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| {
                (
                    w["id"].as_str().unwrap().to_string(),
                    w["blocks"].as_u64().unwrap(),
                )
            })
            .collect()
    }

    /// The value of a Prometheus sample line, e.g. `kvrouted_inputs_rejected_total{reason="x"}`.
    pub async fn metric(&self, series: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        text.lines()
            .find_map(|l| {
                l.strip_prefix(series)
                    .and_then(|rest| rest.trim().parse().ok())
            })
            .unwrap_or(0.0)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Tokens of a prompt of `blocks` full 16-token blocks, distinct per `seed`.
pub fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..blocks as u32 * 16)
        .map(|i| seed * 1_000_000 + i)
        .collect()
}

/// A simulated vLLM worker publishing on NATS exactly what vLLM's publisher would.
pub struct Worker {
    pub id: String,
    client: async_nats::Client,
    pub seq: u64,
    /// Engine hash of each stored block key (engine hashes are opaque: derived, not equal).
    next_engine: u64,
    chain: std::collections::HashMap<u64, u64>,
}

impl Worker {
    pub async fn connect(nats_url: &str, id: &str) -> Worker {
        let client = async_nats::connect(nats_url)
            .await
            .expect("connect to nats");
        Worker {
            id: id.into(),
            client,
            seq: 0,
            next_engine: 1,
            chain: Default::default(),
        }
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// Publishes a batch on `kv.events.<id>` with the next `Kv-Seq`, through JetStream (waits
    /// for the stream's ack so ordering with later messages is certain).
    pub async fn publish_events(&mut self, events: &[VllmEvent]) {
        self.seq += 1;
        let payload = encode_vllm_batch(1.0, events, None);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Kv-Seq", self.seq.to_string().as_str());
        let js = async_nats::jetstream::new(self.client.clone());
        js.publish_with_headers(format!("kv.events.{}", self.id), headers, payload.into())
            .await
            .expect("publish")
            .await
            .expect("stream ack");
    }

    /// Stores every full block of `tokens` (as one BlockStored event chained from the start).
    /// Returns the engine hashes used.
    pub async fn store(&mut self, tokens: &[u32]) -> Vec<u64> {
        let n = tokens.len() / 16;
        let hashes: Vec<u64> = (0..n as u64)
            .map(|i| self.engine_hash(tokens, i as usize))
            .collect();
        self.publish_events(&[VllmEvent::BlockStored {
            block_hashes: hashes.clone(),
            parent_block_hash: None,
            token_ids: tokens[..n * 16].to_vec(),
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
        }])
        .await;
        hashes
    }

    /// A stable engine hash per (worker, block key): what a real engine's hash would be.
    fn engine_hash(&mut self, tokens: &[u32], block: usize) -> u64 {
        let key = block_keys(&tokens[..(block + 1) * 16], 16)[block];
        let next = &mut self.next_engine;
        *self.chain.entry(key).or_insert_with(|| {
            *next += 1;
            *next * 7919
        })
    }

    pub async fn remove(&mut self, hashes: Vec<u64>) {
        self.publish_events(&[VllmEvent::BlockRemoved {
            block_hashes: hashes,
            medium: Some("GPU".into()),
        }])
        .await;
    }

    /// Publishes a load sample on core NATS (`kv.load.<id>`).
    pub async fn load(&self, kv_usage: f64) {
        let payload = encode_load(kv_usage, 1, 0, Some(64), 0.0, None);
        self.client
            .publish(format!("kv.load.{}", self.id), payload.into())
            .await
            .unwrap();
        self.client.flush().await.unwrap();
    }

    pub async fn lifecycle(&self, op: LifecycleOp) {
        let payload = encode_lifecycle(op, None, Some(16), None);
        let js = async_nats::jetstream::new(self.client.clone());
        js.publish(format!("kv.workers.{}", self.id), payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
}
