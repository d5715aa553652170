//! Test harness: real nats-server processes on free loopback ports with their own storage, the
//! real `kvrouted` binary, real HTTP. Everything started here is killed on drop and every temp
//! dir removed. Waiting is always polling against a deadline, never a bare sleep.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvrouted::hashing::block_keys;
use kvrouted::input::LifecycleOp;
use kvrouted::wire::{encode_lifecycle, encode_load, encode_vllm_batch, VllmEvent};
use serde_json::Value;
use tempfile::TempDir;

#[path = "../../benches/support/local_processes.rs"]
mod local_processes;
pub use local_processes::{free_port, nats_server_bin, wait_for_port};

pub const DEADLINE: Duration = Duration::from_secs(20);

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

/// A nats-server with JetStream on a free port and its own storage dir.
pub struct Nats {
    child: Option<Child>,
    pub port: u16,
    dir: TempDir,
    /// nats-server configuration text (authorization, TLS), if started with one.
    config: Option<String>,
}

impl Nats {
    pub fn start() -> Nats {
        let mut nats = Nats {
            child: None,
            port: free_port(),
            dir: TempDir::new().unwrap(),
            config: None,
        };
        nats.restart();
        nats
    }

    /// A nats-server with JetStream on a free port and its own storage dir, with this
    /// configuration text added (e.g. an `authorization` or `tls` block).
    pub fn start_with_config(config: &str) -> Nats {
        let mut nats = Nats {
            child: None,
            port: free_port(),
            dir: TempDir::new().unwrap(),
            config: Some(config.to_string()),
        };
        nats.restart();
        nats
    }

    /// A scratch dir that lives as long as the server (for its certificates and keys).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts (again) on the same port with the same storage.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "nats-server already running");
        let log = std::fs::File::create(self.dir.path().join("nats.log")).unwrap();
        let mut cmd = Command::new(nats_server_bin());
        cmd.args([
            "-a",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-js",
            "-sd",
        ])
        .arg(self.dir.path().join("js"));
        if let Some(config) = &self.config {
            let path = self.dir.path().join("nats.conf");
            std::fs::write(&path, config).unwrap();
            cmd.arg("-c").arg(path);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        wait_for_port(self.port, "nats-server");
    }

    /// Deletes the stopped server's JetStream storage: the next [`Nats::restart`] comes back
    /// empty, without streams or consumers.
    pub fn wipe_storage(&mut self) {
        assert!(self.child.is_none(), "stop nats-server first");
        let _ = std::fs::remove_dir_all(self.dir.path().join("js"));
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

/// Runs `cmd` to completion (killing it and failing if it outlives [`DEADLINE`]); returns its
/// exit status, stdout and stderr.
pub fn run_to_exit(mut cmd: Command) -> (ExitStatus, String, String) {
    let dir = TempDir::new().unwrap();
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("start command");
    let start = Instant::now();
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, read(&out), read(&err));
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{cmd:?} still running after {DEADLINE:?}; stderr:\n{}",
                read(&err)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The kvrouted daemon under test.
pub struct Daemon {
    child: Option<Child>,
    /// Where the test talks HTTP to it (and, with `pass_http_addr`, what `--http-addr` says).
    pub http: SocketAddr,
    pub data_dir: PathBuf,
    nats_url: String,
    extra: Vec<String>,
    /// Environment variables set on the process (e.g. `KVROUTED_...` settings).
    pub env: Vec<(String, String)>,
    /// Whether `--http-addr` is passed; off when the address comes from a file or the environment.
    pub pass_http_addr: bool,
    log: PathBuf,
    _dir: Option<TempDir>,
    client: reqwest::Client,
    /// `http` or `https` (see [`Daemon::use_https`]).
    scheme: &'static str,
    /// CA certificate trusted for HTTPS, and the bearer token every helper request carries.
    ca_pem: Option<String>,
    token: Option<String>,
}

/// Flags that keep tests fast: quick ticks and flushes.
const TEST_FLAGS: &[&str] = &["--tick-interval", "100ms", "--flush-interval", "5ms"];

impl Daemon {
    /// Starts a daemon with a fresh data dir.
    pub async fn start(nats_url: &str, extra: &[&str]) -> Daemon {
        let mut d = Daemon::new(nats_url, extra);
        d.restart().await;
        d
    }

    /// A daemon with a fresh data dir and HTTP port, not started yet: adjust `env`,
    /// `pass_http_addr`, `http` or `data_dir`, then [`Daemon::restart`].
    pub fn new(nats_url: &str, extra: &[&str]) -> Daemon {
        let dir = TempDir::new().unwrap();
        Daemon {
            child: None,
            http: SocketAddr::from(([127, 0, 0, 1], free_port())),
            log: dir.path().join("kvrouted.log"),
            data_dir: dir.path().join("data"),
            nats_url: nats_url.to_string(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
            pass_http_addr: true,
            _dir: Some(dir),
            client: reqwest::Client::new(),
            scheme: "http",
            ca_pem: None,
            token: None,
        }
    }

    /// Talks HTTPS to the daemon, trusting only the CA certificate `ca_pem`.
    pub fn use_https(&mut self, ca_pem: &str) {
        self.ca_pem = Some(ca_pem.to_string());
        self.scheme = "https";
        self.rebuild_client();
    }

    /// Sends `Authorization: Bearer <token>` with every helper request.
    pub fn use_token(&mut self, token: &str) {
        self.token = Some(token.to_string());
        self.rebuild_client();
    }

    fn rebuild_client(&mut self) {
        let mut builder = reqwest::Client::builder();
        if let Some(ca) = &self.ca_pem {
            builder = builder
                .tls_built_in_root_certs(false)
                .add_root_certificate(reqwest::Certificate::from_pem(ca.as_bytes()).unwrap());
        }
        if let Some(token) = &self.token {
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(
                reqwest::header::AUTHORIZATION,
                format!("Bearer {token}").parse().unwrap(),
            );
            builder = builder.default_headers(headers);
        }
        self.client = builder.build().unwrap();
    }

    /// Sends a signal (`HUP`, `TERM`, ...) to the running daemon.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("daemon running").id();
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} {pid}");
    }

    /// The HTTP client the helpers use (HTTPS-aware after [`Daemon::use_https`]).
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    pub fn command(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvrouted"));
        cmd.arg("serve").args(["--nats-url", &self.nats_url]);
        if self.pass_http_addr {
            cmd.args(["--http-addr", &self.http.to_string()]);
        }
        cmd.arg("--data-dir")
            .arg(&self.data_dir)
            .args(TEST_FLAGS)
            .args(&self.extra)
            .env("RUST_LOG", "info");
        // Only the settings a test gives: none leak in from the environment running the tests.
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("KVROUTED_") {
                cmd.env_remove(k);
            }
        }
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd
    }

    /// Starts the process (again) on the same data dir and port, and waits for /healthz.
    /// Starts the process (again) on the same data dir and port without waiting for anything.
    pub fn spawn(&mut self) {
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
    }

    /// Starts the process (again) on the same data dir and port, and waits until its API is up:
    /// the state is recovered (`/readyz` answers and no longer says `recovering`; `/healthz`
    /// already answers during recovery).
    pub async fn restart(&mut self) {
        self.spawn();
        let url = self.url("/readyz");
        let client = self.client.clone();
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "kvrouted exited with {status} at start; log:\n{}",
                    self.log_text()
                );
            }
            if let Ok(r) = client.get(&url).send().await {
                let v: Value = r.json().await.unwrap_or(Value::Null);
                if v["status"] != "recovering" {
                    break;
                }
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
        format!("{}://{}{path}", self.scheme, self.http)
    }

    /// SIGKILL: no snapshot, no flush.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM; waits up to [`DEADLINE`] for the exit. `None` if the process is still running
    /// then (it is left to the drop's SIGKILL).
    pub fn terminate_within_deadline(&mut self) -> Option<ExitStatus> {
        let c = self.child.as_mut().expect("daemon running");
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        let start = Instant::now();
        while start.elapsed() < DEADLINE {
            if let Some(status) = c.try_wait().unwrap() {
                self.child = None;
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
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

    /// `POST` raw bytes; returns (status, content type, body bytes).
    pub async fn post_bytes(
        &self,
        path: &str,
        content_type: &str,
        body: Vec<u8>,
    ) -> (u16, String, Vec<u8>) {
        let r = self
            .client
            .post(self.url(path))
            .header("content-type", content_type)
            .body(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let ct = r
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        (status, ct, r.bytes().await.unwrap_or_default().to_vec())
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

    /// `kvrouted_route_decisions_total{decision="<label>"}`.
    pub async fn decisions(&self, label: &str) -> f64 {
        self.metric(&format!(
            "kvrouted_route_decisions_total{{decision=\"{label}\"}}"
        ))
        .await
    }

    /// `kvrouted_inputs_rejected_total{reason="<reason>"}`.
    pub async fn rejected(&self, reason: &str) -> f64 {
        self.metric(&format!(
            "kvrouted_inputs_rejected_total{{reason=\"{reason}\"}}"
        ))
        .await
    }

    /// Polls /metrics until `series` has reached `at_least`; returns its value.
    pub async fn wait_metric(&self, series: &str, at_least: f64) -> f64 {
        eventually(&format!("{series} reaches {at_least}"), || async {
            let v = self.metric(series).await;
            (v >= at_least).then_some(v)
        })
        .await
    }

    /// Polls until `kvrouted_inputs_rejected_total{reason}` has reached `at_least`.
    pub async fn wait_rejected(&self, reason: &str, at_least: f64) -> f64 {
        self.wait_metric(
            &format!("kvrouted_inputs_rejected_total{{reason=\"{reason}\"}}"),
            at_least,
        )
        .await
    }

    /// The `/v1/workers` row of worker `id`, if it is listed.
    pub async fn worker(&self, id: &str) -> Option<Value> {
        self.workers().await["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["id"] == id)
            .cloned()
    }

    /// Polls `/v1/workers` until worker `id` shows the pressure of a [`Worker::load`] sample
    /// with this `kv_usage`: the daemon has applied it (load travels on core NATS, unordered
    /// with events).
    pub async fn wait_load(&self, id: &str, kv_usage: f64) {
        let expected = Worker::pressure_of(kv_usage);
        eventually(
            &format!("{id}'s pressure {expected} is visible"),
            || async {
                let p = self.worker(id).await?["pressure"].as_f64()?;
                ((p - expected).abs() < 1e-9).then_some(())
            },
        )
        .await
    }

    /// Polls `/v1/workers` until worker `id` owns `blocks` blocks by KV events.
    pub async fn wait_blocks(&self, id: &str, blocks: u64) {
        eventually(&format!("{id} owns {blocks} blocks"), || async {
            (self.worker(id).await?["blocks"].as_u64()? == blocks).then_some(())
        })
        .await
    }

    /// Polls `/v1/workers` until worker `id` is listed with `state` (active | draining).
    pub async fn wait_state(&self, id: &str, state: &str) {
        eventually(&format!("{id} is listed as {state}"), || async {
            (self.worker(id).await?["state"] == state).then_some(())
        })
        .await
    }

    /// Polls `/readyz` until its `status` is `status` (HTTP code aside); returns the reply.
    pub async fn wait_readyz(&self, status: &str) -> (u16, Value) {
        eventually(&format!("/readyz says {status}"), || async {
            let (code, text) = self.get("/readyz").await;
            let v: Value = serde_json::from_str(&text).ok()?;
            (v["status"] == status).then_some((code, v))
        })
        .await
    }

    /// Runs the daemon's command to its exit, which must come within [`DEADLINE`] (for starts
    /// that are meant to fail). Returns the status and stderr.
    pub fn run_expecting_exit(&self) -> (ExitStatus, String) {
        let (status, _, stderr) = run_to_exit(self.command());
        (status, stderr)
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
        Worker::connect_with(async_nats::ConnectOptions::new(), nats_url, id).await
    }

    /// Connects with these options (credentials, TLS) as worker `id`.
    pub async fn connect_with(
        options: async_nats::ConnectOptions,
        nats_url: &str,
        id: &str,
    ) -> Worker {
        let client = options.connect(nats_url).await.expect("connect to nats");
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

    /// The pressure the daemon derives from a [`Worker::load`] sample: one running request of
    /// 64 counts as 1/64 of queue pressure.
    pub fn pressure_of(kv_usage: f64) -> f64 {
        kv_usage.max(1.0 / 64.0)
    }

    /// Publishes raw bytes on core NATS (flushed): for load subjects, or anything a broken
    /// publisher might send.
    pub async fn publish_core(&self, subject: &str, payload: Vec<u8>) {
        self.client
            .publish(subject.to_string(), payload.into())
            .await
            .unwrap();
        self.client.flush().await.unwrap();
    }

    /// Publishes raw bytes (and headers) through JetStream and waits for the stream's ack: for
    /// the event and lifecycle subjects the stream captures.
    pub async fn publish_js(
        &self,
        subject: &str,
        headers: async_nats::HeaderMap,
        payload: Vec<u8>,
    ) {
        let js = async_nats::jetstream::new(self.client.clone());
        js.publish_with_headers(subject.to_string(), headers, payload.into())
            .await
            .expect("publish")
            .await
            .expect("stream ack");
    }

    /// Waits until this worker's connection to the broker is up (after a broker restart).
    pub async fn wait_connected(&self) {
        eventually(
            &format!("worker {} reconnects to NATS", self.id),
            || async {
                (self.client.connection_state() == async_nats::connection::State::Connected)
                    .then_some(())
            },
        )
        .await
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

/// Whether the daemon's durable consumer has delivered everything in the stream and every
/// delivered message is acked: all published events are applied and journaled durably.
pub async fn consumer_settled(client: &async_nats::Client) -> Option<()> {
    let js = async_nats::jetstream::new(client.clone());
    let stream = js.get_stream("KVROUTED").await.ok()?;
    let info = stream.consumer_info("kvrouted").await.ok()?;
    (info.num_pending == 0 && info.num_ack_pending == 0).then_some(())
}
