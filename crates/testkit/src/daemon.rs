//! The kvrouted daemon as a process under test: its own data dir and HTTP port, killed on drop,
//! and the HTTP helpers a test talks to it with.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use serde_json::Value;
use tempfile::TempDir;

use crate::poll::{eventually, eventually_within_explained, poll_until, DEADLINE};
use crate::ports::free_port;
use crate::processes::{read_log, Process};
use crate::worker::Worker;

/// The `kvrouted` binary under test: `$KVROUTED_BIN`, else the one cargo built next to the
/// running test or bench (`target/<profile>/kvrouted`; cargo builds a package's binaries before
/// its integration tests and benches).
pub fn kvrouted_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("KVROUTED_BIN") {
        return bin.into();
    }
    let exe = std::env::current_exe().expect("the running test's path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("tests run from target/<profile>/deps");
    let bin = profile_dir.join(format!("kvrouted{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} not found: build it (cargo builds it for the root package's tests) or set KVROUTED_BIN",
        bin.display()
    );
    bin
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
    let Some(status) = poll_until(DEADLINE, || child.try_wait().unwrap()) else {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "{cmd:?} still running after {DEADLINE:?}; stderr:\n{}",
            read_log(&err)
        );
    };
    (status, read_log(&out), read_log(&err))
}

/// `cmd` run on a data dir that holds at most `bytes`, as a full disk does: a tmpfs of that size
/// mounted on `data_dir` in a mount namespace of the process's own (`unshare`, from util-linux;
/// a user namespace makes it work without root). Every file counts against it, sled's log and the
/// blob files it writes large leaves to alike, so the data dir fills after the same bytes whatever
/// the pace of the writes. A per-file limit (`RLIMIT_FSIZE`) did not: leaves written as blobs
/// left the log under it, and one run in CI answered 2,000 large routes without filling it. The
/// mount, and all the process wrote to it, go away with the process (a restart starts on an
/// empty data dir); `data_dir` itself stays an empty directory.
fn on_bounded_data_dir(cmd: &Command, data_dir: &Path, bytes: u64) -> Command {
    std::fs::create_dir_all(data_dir).unwrap();
    let mut bounded = Command::new("unshare");
    bounded
        .args(["--user", "--map-root-user", "--mount", "--", "sh", "-c"])
        .arg(r#"mount -t tmpfs -o "size=$1" kvrouted-data "$2" && shift 2 && exec "$@""#)
        .arg("sh")
        .arg(bytes.to_string())
        .arg(data_dir)
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        match value {
            Some(value) => bounded.env(key, value),
            None => bounded.env_remove(key),
        };
    }
    bounded
}

/// `kvrouted` (see [`kvrouted_bin`]) logging at `info`, with no `KVROUTED_...` setting of the
/// environment running the tests: only what a test gives.
pub fn kvrouted_command() -> Command {
    let mut cmd = Command::new(kvrouted_bin());
    cmd.env("RUST_LOG", "info");
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KVROUTED_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// The kvrouted daemon under test.
pub struct Daemon {
    child: Option<Process>,
    /// Where the test talks HTTP to it (and, with `pass_http_addr`, what `--http-addr` says).
    pub http: SocketAddr,
    pub data_dir: PathBuf,
    nats_url: String,
    extra: Vec<String>,
    /// Environment variables set on the process (e.g. `KVROUTED_...` settings).
    pub env: Vec<(String, String)>,
    /// Whether `--http-addr` is passed; off when the address comes from a file or the environment.
    pub pass_http_addr: bool,
    /// Bytes the data dir holds: a write past them fails with `ENOSPC`, as on a full disk (the
    /// daemon runs on a tmpfs of that size mounted on its data dir).
    pub data_dir_capacity: Option<u64>,
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

    /// Starts replica `name` sharing decisions on a 3-server cluster (its own durable
    /// consumer, the streams at 3 replicas) with a fresh data dir; waits until it is ready.
    pub async fn start_replica(nats_url: &str, name: &str, extra: &[&str]) -> Daemon {
        let consumer = format!("kvrouted-{name}");
        let mut flags = vec![
            "--replica-id",
            name,
            "--consumer",
            &consumer,
            "--stream-replicas",
            "3",
        ];
        flags.extend_from_slice(extra);
        let daemon = Daemon::start(nats_url, &flags).await;
        daemon.wait_ready().await;
        daemon
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
            data_dir_capacity: None,
            _dir: Some(dir),
            client: fresh_connections().build().unwrap(),
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
        let mut builder = fresh_connections();
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
        self.child.as_ref().expect("daemon running").signal(signal);
    }

    /// The HTTP client the helpers use (HTTPS-aware after [`Daemon::use_https`]).
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    pub fn command(&self) -> Command {
        let mut cmd = kvrouted_command();
        cmd.arg("serve").args(["--nats-url", &self.nats_url]);
        if self.pass_http_addr {
            cmd.args(["--http-addr", &self.http.to_string()]);
        }
        cmd.arg("--data-dir")
            .arg(&self.data_dir)
            .args(TEST_FLAGS)
            .args(&self.extra);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd
    }

    /// Starts the process (again) on the same data dir and port without waiting for anything.
    pub fn spawn(&mut self) {
        assert!(self.child.is_none(), "daemon already running");
        let mut cmd = self.command();
        if let Some(bytes) = self.data_dir_capacity {
            cmd = on_bounded_data_dir(&cmd, &self.data_dir, bytes);
        }
        self.child = Some(Process::spawn(cmd, &self.log));
    }

    /// Starts the process (again) on the same data dir and port, and waits until its API is up:
    /// the state is recovered (`/readyz` answers and no longer says `recovering`; `/healthz`
    /// already answers during recovery).
    pub async fn restart(&mut self) {
        self.spawn();
        let url = self.url("/readyz");
        let (client, url) = (&self.client, &url);
        let what = format!("kvrouted at {} has recovered its state", self.http);
        let child = self.child.as_mut().expect("just spawned");
        child
            .wait_until_up(&what, move || async move {
                match client.get(url).send().await {
                    Ok(r) => {
                        r.json::<Value>().await.unwrap_or(Value::Null)["status"] != "recovering"
                    }
                    Err(_) => false,
                }
            })
            .await;
    }

    pub fn log_text(&self) -> String {
        read_log(&self.log)
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}://{}{path}", self.scheme, self.http)
    }

    /// SIGKILL: no snapshot, no flush.
    pub fn kill9(&mut self) {
        self.child = None;
    }

    /// SIGTERM; waits up to [`DEADLINE`] for the exit. `None` if the process is still running
    /// then (it is left to the drop's SIGKILL).
    pub fn terminate_within_deadline(&mut self) -> Option<ExitStatus> {
        let status = self
            .child
            .as_mut()
            .expect("daemon running")
            .terminate_within(DEADLINE);
        if status.is_some() {
            self.child = None;
        }
        status
    }

    /// SIGTERM and the exit, which must come within [`DEADLINE`].
    pub fn terminate(&mut self) -> ExitStatus {
        self.terminate_within_deadline().unwrap_or_else(|| {
            panic!(
                "kvrouted still running {DEADLINE:?} after SIGTERM; log:\n{}",
                self.log_text()
            )
        })
    }

    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| c.exited().is_none())
    }

    pub async fn wait_ready(&self) {
        wait_ready_at(&self.client, &self.url("/readyz")).await;
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
        self.worker_column("blocks").await
    }

    /// Reserved work per worker id, from `/v1/workers` (replicas that share their decisions
    /// agree on it once every decision has arrived).
    pub async fn reserved_work(&self) -> std::collections::BTreeMap<String, u64> {
        self.worker_column("reserved_work").await
    }

    /// One numeric column of `/v1/workers`, per worker id.
    async fn worker_column(&self, column: &str) -> std::collections::BTreeMap<String, u64> {
        self.workers().await["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| {
                (
                    w["id"].as_str().unwrap().to_string(),
                    w[column].as_u64().unwrap(),
                )
            })
            .collect()
    }

    /// The value of a Prometheus sample line, e.g. `kvrouted_inputs_rejected_total{reason="x"}`.
    pub async fn metric(&self, series: &str) -> f64 {
        series_value(&self.get("/metrics").await.1, series)
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
        self.wait_blocks_within(id, blocks, DEADLINE).await
    }

    /// [`wait_blocks`](Self::wait_blocks) with a deadline of the caller's (see
    /// [`eventually_within`](crate::poll::eventually_within)). Running out, it reports the
    /// count it saw last and the daemon's log: a replica that never catches up after a failover
    /// says what its feeds did.
    pub async fn wait_blocks_within(&self, id: &str, blocks: u64, deadline: Duration) {
        let what = format!("{id} owns {blocks} blocks on the daemon at {}", self.http);
        let seen = std::sync::Mutex::new(None);
        let seen = &seen;
        eventually_within_explained(
            deadline,
            &what,
            || async move {
                let owned = self.worker(id).await?["blocks"].as_u64()?;
                *seen.lock().unwrap() = Some(owned);
                (owned == blocks).then_some(())
            },
            || {
                let seen = match *seen.lock().unwrap() {
                    Some(owned) => format!("it owned {owned} blocks when last asked"),
                    None => "it never listed the worker's blocks".to_string(),
                };
                format!("; {seen}; log:\n{}", self.log_text())
            },
        )
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

/// A client that opens a connection per request: the daemon closes idle connections after
/// `--http-idle-timeout` (short in some tests), and a pooled connection it just closed would
/// fail the next request for no reason of the test's.
fn fresh_connections() -> reqwest::ClientBuilder {
    reqwest::Client::builder().pool_max_idle_per_host(0)
}

/// The value of `series` (a name with its labels, as printed) in Prometheus text; 0 when absent.
pub fn series_value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

/// Polls `readyz_url` (a daemon's `/readyz`, for one not started as a [`Daemon`]) until it says
/// `ready`: the state is recovered and ingest caught up. Its port opens earlier, while the API
/// still answers 503.
pub async fn wait_ready_at(client: &reqwest::Client, readyz_url: &str) {
    eventually("/readyz says ready", || async {
        let r = client.get(readyz_url).send().await.ok()?;
        let v: Value = r.json().await.ok()?;
        (v["status"] == "ready").then_some(())
    })
    .await;
}

/// The value of `series` on the `/metrics` of a plain-HTTP process at `http` (a bridge, a
/// daemon started by a bench); 0 when absent.
pub async fn metric_at(client: &reqwest::Client, http: SocketAddr, series: &str) -> f64 {
    let text = client
        .get(format!("http://{http}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    series_value(&text, series)
}

/// Runs `kvrouted ARGS` to its exit; returns (success, exit code, stdout, stderr).
pub fn kvrouted<I, S>(args: I) -> (bool, Option<i32>, String, String)
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut cmd = kvrouted_command();
    cmd.args(args);
    let (status, stdout, stderr) = run_to_exit(cmd);
    (status.success(), status.code(), stdout, stderr)
}

/// `kvrouted replay --verify` of a data dir (`source` `--data-dir`) or an export (`--journal`),
/// writing the decisions to `out` if given; returns (success, stdout, stderr).
pub fn replay_verify(source: &str, path: &Path, out: Option<&Path>) -> (bool, String, String) {
    let mut args: Vec<&std::ffi::OsStr> = vec![
        "replay".as_ref(),
        source.as_ref(),
        path.as_os_str(),
        "--verify".as_ref(),
    ];
    if let Some(out) = out {
        args.extend(["--out".as_ref(), out.as_os_str()]);
    }
    let (ok, _, stdout, stderr) = kvrouted(args);
    (ok, stdout, stderr)
}

/// The log without ANSI colour codes.
pub fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ params final-byte
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
