//! Authentication and limits, driven from outside: bearer tokens and their scopes on the HTTP
//! API (reloaded on SIGHUP), HTTPS, the loopback-only default, the HTTP timeouts and connection
//! cap, and a nats-server configured as docs/security.md describes: each worker's user may
//! publish only on its own subjects, the daemon authenticates (nkey, user and password, over
//! TLS) and a broker refusing it is an error in its log.
mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use kvrouted::wire::{encode_lifecycle, encode_vllm_batch, VllmEvent};
use serde_json::{json, Value};

const ROUTE_TOKEN: &str = "route-token-0123456789abcdef";
const READ_TOKEN: &str = "read-token-0123456789abcdef";
const NEW_READ_TOKEN: &str = "new-read-token-0123456789abcdef";

fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A request with an optional bearer token, on a fresh client (no token by default).
async fn call(method: &str, url: &str, token: Option<&str>) -> (u16, Value) {
    let client = reqwest::Client::new();
    let mut request = match method {
        "GET" => client.get(url),
        _ => client
            .post(url)
            .json(&json!({"tokens": prompt(1, 2), "reservation": 1})),
    };
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_clients_without_a_token_get_401_with_the_wrong_scope_403_and_with_the_right_one_200()
{
    let nats = Nats::start();
    let dir = tempfile::tempdir().unwrap();
    let tokens = write_file(
        dir.path(),
        "tokens",
        &format!("# gateways\n{ROUTE_TOKEN} route\n{READ_TOKEN} read\n"),
    );
    let mut daemon = Daemon::new(&nats.url(), &["--api-token-file", tokens.to_str().unwrap()]);
    daemon.use_token(READ_TOKEN);
    daemon.restart().await;
    let worker = Worker::connect(&nats.url(), "w1").await;
    worker.load(0.1).await;
    daemon.wait_load("w1", 0.1).await;

    for (method, path, scope_token, other_token) in [
        ("POST", "/v1/route", ROUTE_TOKEN, READ_TOKEN),
        ("GET", "/v1/workers", READ_TOKEN, ROUTE_TOKEN),
        ("GET", "/metrics", READ_TOKEN, ROUTE_TOKEN),
    ] {
        let url = daemon.url(path);
        let (status, body) = call(method, &url, None).await;
        assert_eq!(
            status, 401,
            "{method} {path} without a token is refused: {body}"
        );
        assert!(
            body["error"].as_str().is_some_and(|e| !e.contains('\n')),
            "the refusal is a one-line JSON error: {body}"
        );
        let (status, body) = call(method, &url, Some("unknown-token-0123456789")).await;
        assert_eq!(status, 401, "{method} {path} with an unknown token: {body}");
        let (status, body) = call(method, &url, Some(other_token)).await;
        assert_eq!(status, 403, "{method} {path} with the wrong scope: {body}");
        let (status, body) = call(method, &url, Some(scope_token)).await;
        assert_eq!(status, 200, "{method} {path} with the right scope: {body}");
    }
    let (status, _) = call("POST", &daemon.url("/v1/release"), Some(READ_TOKEN)).await;
    assert_eq!(status, 403, "releasing needs the route scope");
    for probe in ["/healthz", "/readyz"] {
        let (status, body) = call("GET", &daemon.url(probe), None).await;
        assert!(
            status == 200 || body["status"].is_string(),
            "{probe} answers without a token: {status} {body}"
        );
    }
    assert!(
        daemon
            .metric("kvrouted_http_auth_failures_total{reason=\"missing\"}")
            .await
            >= 3.0,
        "refusals are counted by reason"
    );
    assert!(
        daemon
            .metric("kvrouted_http_auth_failures_total{reason=\"scope\"}")
            .await
            >= 4.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_token_file_and_a_broken_file_keeps_the_tokens_in_force() {
    let nats = Nats::start();
    let dir = tempfile::tempdir().unwrap();
    let tokens = write_file(dir.path(), "tokens", &format!("{READ_TOKEN} read\n"));
    let mut daemon =
        Daemon::start(&nats.url(), &["--api-token-file", tokens.to_str().unwrap()]).await;
    let workers = daemon.url("/v1/workers");
    assert_eq!(call("GET", &workers, Some(READ_TOKEN)).await.0, 200);
    assert_eq!(call("GET", &workers, Some(NEW_READ_TOKEN)).await.0, 401);

    write_file(dir.path(), "tokens", &format!("{NEW_READ_TOKEN} read\n"));
    daemon.signal("HUP");
    eventually("SIGHUP puts the new token in force", || async {
        (call("GET", &workers, Some(NEW_READ_TOKEN)).await.0 == 200).then_some(())
    })
    .await;
    assert_eq!(
        call("GET", &workers, Some(READ_TOKEN)).await.0,
        401,
        "a token removed from the file no longer opens anything after SIGHUP"
    );

    write_file(
        dir.path(),
        "tokens",
        "this line is not a token and a scope\n",
    );
    daemon.signal("HUP");
    eventually("the broken file is reported", || async {
        daemon
            .log_text()
            .contains("keeping the previous tokens")
            .then_some(())
    })
    .await;
    assert_eq!(
        call("GET", &workers, Some(NEW_READ_TOKEN)).await.0,
        200,
        "a token file that does not parse on reload keeps the tokens in force"
    );
    assert!(
        daemon.is_running(),
        "a broken token file never stops the daemon"
    );
}

#[test]
fn a_bad_token_file_at_start_is_a_one_line_error_and_a_non_zero_exit() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = write_file(dir.path(), "tokens", &format!("{ROUTE_TOKEN} everything\n"));
    let daemon = Daemon::new(
        "nats://127.0.0.1:1",
        &["--api-token-file", tokens.to_str().unwrap()],
    );
    let (status, stderr) = daemon.run_expecting_exit();
    assert!(
        !status.success(),
        "a bad token file stops the start: {stderr}"
    );
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("--api-token-file"))
        .collect();
    assert_eq!(
        errors.len(),
        1,
        "one line names the file and the problem: {stderr}"
    );
    assert!(
        errors[0].contains("line 1") && errors[0].contains("everything"),
        "{stderr}"
    );
    assert!(
        !stderr.contains(ROUTE_TOKEN),
        "errors never echo a token: {stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_public_http_address_needs_a_token_file_or_insecure_public() {
    let nats = Nats::start();
    let mut daemon = Daemon::new(&nats.url(), &[]);
    daemon.pass_http_addr = false;
    daemon.env.push((
        "KVROUTED_HTTP_ADDR".into(),
        format!("0.0.0.0:{}", daemon.http.port()),
    ));
    let (status, stderr) = daemon.run_expecting_exit();
    assert!(
        !status.success(),
        "a non-loopback address without tokens is refused: {stderr}"
    );
    assert!(
        stderr.contains("--insecure-public") && stderr.contains("--api-token-file"),
        "the error says how to proceed: {stderr}"
    );
    daemon
        .env
        .push(("KVROUTED_INSECURE_PUBLIC".into(), "true".into()));
    daemon.restart().await;
    assert_eq!(daemon.get("/v1/workers").await.0, 200);
}

/// A throwaway CA and a certificate for 127.0.0.1 signed by it: (CA PEM, cert PEM, key PEM).
fn throwaway_certificates() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    (ca.pem(), cert.pem(), key.serialize_pem())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_is_served_over_https_with_the_given_certificate() {
    let nats = Nats::start();
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = throwaway_certificates();
    let cert = write_file(dir.path(), "cert.pem", &cert);
    let key = write_file(dir.path(), "key.pem", &key);
    let tokens = write_file(dir.path(), "tokens", &format!("{READ_TOKEN} read\n"));
    let mut daemon = Daemon::new(
        &nats.url(),
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--api-token-file",
            tokens.to_str().unwrap(),
        ],
    );
    daemon.use_https(&ca);
    daemon.use_token(READ_TOKEN);
    daemon.restart().await;
    assert!(daemon.url("/v1/workers").starts_with("https://"));
    assert_eq!(
        daemon.get("/v1/workers").await.0,
        200,
        "HTTPS with a certificate from the trusted CA, and a token"
    );
    let plain = reqwest::Client::new()
        .get(format!("http://{}/healthz", daemon.http))
        .send()
        .await;
    assert!(
        plain.is_err() || !plain.unwrap().status().is_success(),
        "plain HTTP is not served on the HTTPS port"
    );
}

/// Reads from `socket` until it is closed by the daemon; fails after [`DEADLINE`]. Returns
/// what was read.
fn read_until_closed(socket: &mut TcpStream) -> Vec<u8> {
    socket
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let start = Instant::now();
    let mut read = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match socket.read(&mut buf) {
            Ok(0) => return read,
            Ok(n) => read.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return read, // reset: closed too
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the daemon kept the connection open for {DEADLINE:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_idle_connections_and_slow_bodies_are_cut_off_by_their_timeouts() {
    let nats = Nats::start();
    let daemon = Daemon::start(
        &nats.url(),
        &[
            "--http-header-timeout",
            "300ms",
            "--http-idle-timeout",
            "600ms",
            "--http-body-timeout",
            "300ms",
        ],
    )
    .await;
    let addr = daemon.http;
    // Slowloris: a request line and part of a header, then nothing.
    let mut slow_head = TcpStream::connect(addr).unwrap();
    slow_head
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: kvrouted\r\nX-Slow: ")
        .unwrap();
    // Idle: connects and never sends anything.
    let mut idle = TcpStream::connect(addr).unwrap();
    // Kept alive after a response, then idle.
    let mut kept_alive = TcpStream::connect(addr).unwrap();
    kept_alive
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: kvrouted\r\n\r\n")
        .unwrap();
    // A body announced as 100 bytes of which 10 arrive.
    let mut slow_body = TcpStream::connect(addr).unwrap();
    slow_body
        .write_all(
            b"POST /v1/route HTTP/1.1\r\nHost: kvrouted\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"tokens\":",
        )
        .unwrap();

    assert!(
        read_until_closed(&mut slow_head).is_empty(),
        "a connection whose headers do not complete is closed without a reply"
    );
    assert!(read_until_closed(&mut idle).is_empty());
    let reply = String::from_utf8(read_until_closed(&mut kept_alive)).unwrap();
    assert!(
        reply.starts_with("HTTP/1.1 200"),
        "the kept-alive connection got its reply before it was closed: {reply}"
    );
    let reply = String::from_utf8(read_until_closed(&mut slow_body)).unwrap();
    assert!(
        reply.starts_with("HTTP/1.1 408") && reply.contains("--http-body-timeout"),
        "a body that does not arrive in time gets a 408: {reply}"
    );
    for (phase, at_least) in [("header", 1.0), ("idle", 2.0), ("body", 1.0)] {
        assert!(
            daemon
                .metric(&format!(
                    "kvrouted_http_timeouts_total{{phase=\"{phase}\"}}"
                ))
                .await
                >= at_least,
            "{phase} timeouts are counted"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_connection_cap_probes_still_answer_and_other_requests_get_503() {
    let nats = Nats::start();
    let daemon = Daemon::start(
        &nats.url(),
        &["--max-connections", "3", "--http-idle-timeout", "60s"],
    )
    .await;
    daemon.wait_ready().await;
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let get = |path: &str| {
        let (fresh, url) = (fresh.clone(), daemon.url(path));
        async move {
            let r = fresh.get(url).send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    // One more idle socket after each request served, until a request is shed. A connection
    // the client just closed can hold its slot for a moment on a loaded machine: a request shed
    // with fewer idle sockets than the cap met one, and is tried again with no new socket until
    // the slot is free; an idle socket that met one waits in the reserve past the cap, and the
    // next request is served, so the cap can take one more idle socket to reach.
    let idle = std::sync::Mutex::new(Vec::new());
    let (status, body) = eventually("the cap is reached", || async {
        let (status, body) = get("/v1/workers").await;
        let mut idle = idle.lock().unwrap();
        match status {
            200 => {
                idle.push(TcpStream::connect(daemon.http).unwrap());
                None
            }
            503 if idle.len() >= 3 => Some((status, body)),
            _ => None,
        }
    })
    .await;
    let idle = idle.into_inner().unwrap();
    assert!(
        idle.len() >= 3,
        "requests are served until the {} idle connections fill the cap of 3",
        idle.len()
    );
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("--max-connections")),
        "past the cap a request is shed with a one-line error: {status} {body}"
    );
    // More idle sockets than the reserve past the cap holds: the newest connections still get in.
    let flood: Vec<TcpStream> = (0..40)
        .map(|_| TcpStream::connect(daemon.http).unwrap())
        .collect();
    let (status, body) = get("/healthz").await;
    assert_eq!(
        (status, &body["status"]),
        (200, &json!("ok")),
        "/healthz answers past the cap, with the reserve flooded by idle sockets"
    );
    let (_, body) = get("/readyz").await;
    assert!(
        body["status"].is_string(),
        "/readyz answers past the cap: {body}"
    );

    drop(idle);
    drop(flood);
    eventually(
        "requests are served again once connections close",
        || async { (get("/v1/workers").await.0 == 200).then_some(()) },
    )
    .await;
    assert!(
        daemon
            .metric("kvrouted_http_connections_shed_total{outcome=\"probes_only\"}")
            .await
            >= 3.0,
        "connections past the cap are counted"
    );
    assert!(
        daemon
            .metric("kvrouted_http_connections_shed_total{outcome=\"evicted\"}")
            .await
            >= 1.0,
        "idle reserve connections evicted for newer ones are counted"
    );
}

/// Connect options for a worker's user: its password and its own reply inbox, with every
/// server-side refusal sent to the returned channel.
fn worker_options(
    user: &str,
) -> (
    async_nats::ConnectOptions,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let options = async_nats::ConnectOptions::new()
        .user_and_password(user.into(), format!("{user}-secret"))
        .custom_inbox_prefix(format!("_INBOX_{user}"))
        .request_timeout(Some(Duration::from_secs(2)))
        .event_callback(move |event| {
            let tx = tx.clone();
            async move {
                if let async_nats::Event::ServerError(e) = event {
                    let _ = tx.send(e.to_string());
                }
            }
        });
    (options, rx)
}

/// The worker part of the nats-server configuration of docs/security.md, for workers `ids`.
fn worker_users(ids: &[&str]) -> String {
    ids.iter()
        .map(|w| {
            format!(
                r#"    {{ user: "{w}", password: "{w}-secret", permissions: {{
        publish: {{ allow: ["kv.events.{w}", "kv.load.{w}", "kv.workers.{w}"] }}
        subscribe: {{ allow: ["_INBOX_{w}.>"] }}
    }} }}
"#
            )
        })
        .collect()
}

/// The daemon's permissions (docs/security.md): the JetStream API of its two streams (events
/// and decisions), acks, publishing its decisions, its replies, and reading every kv subject.
const DAEMON_PERMISSIONS: &str = r#"permissions: {
        publish: { allow: [
            "$JS.API.STREAM.INFO.KVROUTED", "$JS.API.STREAM.CREATE.KVROUTED",
            "$JS.API.STREAM.UPDATE.KVROUTED",
            "$JS.API.CONSUMER.*.KVROUTED.>", "$JS.API.CONSUMER.DURABLE.CREATE.KVROUTED.>",
            "$JS.API.CONSUMER.MSG.NEXT.KVROUTED.>", "$JS.ACK.KVROUTED.>",
            "$JS.API.STREAM.INFO.KVROUTED_DECISIONS", "$JS.API.STREAM.CREATE.KVROUTED_DECISIONS",
            "$JS.API.STREAM.UPDATE.KVROUTED_DECISIONS",
            "$JS.API.CONSUMER.*.KVROUTED_DECISIONS.>",
            "$JS.API.CONSUMER.DURABLE.CREATE.KVROUTED_DECISIONS.>",
            "$JS.API.CONSUMER.MSG.NEXT.KVROUTED_DECISIONS.>", "$JS.ACK.KVROUTED_DECISIONS.>",
            "kv.decisions.>"
        ] }
        subscribe: { allow: ["kv.>", "_INBOX.>"] }
    }"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cannot_publish_on_another_workers_subjects() {
    let daemon_key = nkeys::KeyPair::new_user();
    let config = format!(
        "authorization {{\n  users = [\n    {{ nkey: \"{}\", {DAEMON_PERMISSIONS} }}\n{}  ]\n}}\n",
        daemon_key.public_key(),
        worker_users(&["w1", "w2"])
    );
    let nats = Nats::start_with_config(&config);
    let seed = write_file(nats.dir(), "daemon.nk", &daemon_key.seed().unwrap());
    let daemon = Daemon::start(&nats.url(), &["--nats-nkey", seed.to_str().unwrap()]).await;
    daemon.wait_ready().await;

    let (options, _) = worker_options("w2");
    let mut victim = Worker::connect_with(options, &nats.url(), "w2").await;
    let victim_prompt = prompt(2, 4);
    let victim_hashes = victim.store(&victim_prompt).await;
    daemon.wait_blocks("w2", 4).await;

    let (options, mut refusals) = worker_options("w1");
    let mut attacker = Worker::connect_with(options, &nats.url(), "w1").await;
    // Forge the victim's eviction and its leave, then publish something of its own.
    let forged_removal = encode_vllm_batch(
        1.0,
        &[VllmEvent::BlockRemoved {
            block_hashes: victim_hashes,
            medium: Some("GPU".into()),
        }],
        None,
    );
    attacker.publish_core("kv.events.w2", forged_removal).await;
    attacker
        .publish_core(
            "kv.workers.w2",
            encode_lifecycle(kvrouted::input::LifecycleOp::Leave, None, None, None),
        )
        .await;
    let refusal = tokio::time::timeout(DEADLINE, refusals.recv())
        .await
        .expect("the broker reports the refused publish")
        .unwrap();
    assert!(
        refusal.to_lowercase().contains("permissions violation")
            && refusal.contains("kv.events.w2"),
        "the broker refuses a publish on another worker's subject: {refusal}"
    );
    let js_forgery = async_nats::jetstream::new(attacker.client().clone())
        .publish("kv.workers.w2", vec![].into())
        .await;
    let acked = match js_forgery {
        Ok(ack) => ack.await.is_ok(),
        Err(_) => false,
    };
    assert!(!acked, "the stream never stores a forged lifecycle message");

    // Published after the forgeries on the same connection: once it is applied, so would
    // they have been.
    attacker.store(&prompt(1, 2)).await;
    daemon.wait_blocks("w1", 2).await;
    let victim_row = daemon.worker("w2").await.expect("w2 is still listed");
    assert_eq!(
        (&victim_row["blocks"], &victim_row["state"]),
        (&json!(4), &json!("active")),
        "forged events never reach the daemon: w2 keeps its blocks and stays: {victim_row}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_applies_a_workers_events_through_an_authenticated_tls_broker() {
    let (ca, cert, key) = throwaway_certificates();
    let scratch = tempfile::tempdir().unwrap();
    let ca_path = write_file(scratch.path(), "ca.pem", &ca);
    let cert_path = write_file(scratch.path(), "server.pem", &cert);
    let key_path = write_file(scratch.path(), "server.key", &key);
    let config = format!(
        "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n}}\nauthorization {{\n  users = [\n    {{ user: \"daemon\", password: \"daemon-secret\", {DAEMON_PERMISSIONS} }}\n{}  ]\n}}\n",
        cert_path.display(),
        key_path.display(),
        worker_users(&["w1"])
    );
    let nats = Nats::start_with_config(&config);
    // Credentials in the URL, the CA by flag.
    let url = format!("nats://daemon:daemon-secret@127.0.0.1:{}", nats.port);
    let daemon = Daemon::start(&url, &["--nats-tls-ca", ca_path.to_str().unwrap()]).await;
    daemon.wait_ready().await;

    let (options, _) = worker_options("w1");
    let options = options
        .add_root_certificates(ca_path.clone())
        .require_tls(true);
    let mut worker = Worker::connect_with(options, &nats.url(), "w1").await;
    let tokens = prompt(7, 3);
    worker.store(&tokens).await;
    worker.load(0.3).await;
    daemon.wait_blocks("w1", 3).await;
    daemon.wait_load("w1", 0.3).await;
    let (status, body) = daemon.route(&tokens, json!({})).await;
    assert_eq!(
        (status, &body["worker"], &body["matched_blocks"]),
        (200, &json!("w1"), &json!(3)),
        "events received over TLS with credentials route to their owner: {body}"
    );
    assert!(
        !daemon.log_text().contains("daemon-secret"),
        "the password in the URL is never logged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_refusing_the_daemons_credentials_is_an_error_in_its_log() {
    let config = format!(
        "authorization {{\n  users = [\n    {{ user: \"daemon\", password: \"daemon-secret\", {DAEMON_PERMISSIONS} }}\n  ]\n}}\n"
    );
    let nats = Nats::start_with_config(&config);
    let mut daemon = Daemon::new(&nats.url(), &["--nats-user", "daemon"]);
    daemon
        .env
        .push(("KVROUTED_NATS_PASSWORD".into(), "not-the-password".into()));
    daemon.restart().await;
    eventually("the refusal is logged as an error", || async {
        let log = daemon.log_text();
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("refused our credentials"))
            .then_some(())
    })
    .await;
    assert!(
        daemon
            .metric("kvrouted_nats_refused_total{reason=\"authorization\"}")
            .await
            >= 1.0,
        "refusals are counted"
    );
    let (status, body) = daemon.get("/readyz").await;
    assert_ne!(
        status, 200,
        "a daemon the broker refuses is not ready: {body}"
    );
    assert!(
        !daemon.log_text().contains("not-the-password"),
        "the password is never logged"
    );
}

/// The JSON array after `prefix` on the line of `text` that runs `serve` (a Dockerfile `CMD` or
/// a compose `command:`).
fn json_array_after(text: &str, prefix: &str) -> Vec<String> {
    let line = text
        .lines()
        .map(str::trim)
        .filter(|l| l.contains("\"serve\""))
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no line starting with {prefix}"));
    serde_json::from_str(line.trim()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_container_commands_start_under_the_loopback_rule_and_compose_publishes_on_loopback_only(
) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let compose = std::fs::read_to_string(root.join("docker-compose.yml")).unwrap();
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile")).unwrap();
    let published: Vec<&str> = compose
        .lines()
        .map(str::trim)
        .filter_map(|l| l.strip_prefix("- \""))
        .filter(|l| l.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .collect();
    assert!(!published.is_empty(), "compose publishes ports");
    for port in &published {
        assert!(
            port.starts_with("127.0.0.1:"),
            "compose publishes {port} on the host's loopback only"
        );
    }

    let nats = Nats::start();
    for (what, command) in [
        ("Dockerfile CMD", json_array_after(&dockerfile, "CMD ")),
        ("compose command", json_array_after(&compose, "command: ")),
    ] {
        // The container's command, on a free port, with the test's broker and data dir.
        let port = free_port();
        let mut args = command.into_iter().skip_while(|a| a != "serve").skip(1);
        let mut extra = Vec::new();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--nats-url" | "--data-dir" => {
                    args.next();
                }
                "--http-addr" => {
                    let value = args.next().unwrap();
                    assert!(value.starts_with("0.0.0.0:"), "{what}: {value}");
                    extra.push(arg);
                    extra.push(format!("0.0.0.0:{port}"));
                }
                _ => extra.push(arg),
            }
        }
        assert!(
            extra.iter().any(|a| a == "--http-addr"),
            "{what}: {extra:?}"
        );
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let mut daemon = Daemon::new(&nats.url(), &extra);
        daemon.pass_http_addr = false;
        daemon.http.set_port(port);
        daemon.restart().await;
        assert_eq!(
            daemon.get("/healthz").await.0,
            200,
            "the {what} starts and serves"
        );
    }
}
