//! `kvrouted demo` against a real nats-server and a real daemon: the live fleet is routed to
//! its owners, the daemon lists its workers with their blocks, and the demo exits 0; when the
//! daemon cannot be reached or disagrees with what the demo sent, the demo exits non-zero and
//! says why.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};

use common::{eventually, free_port, read_log, run_to_exit, Daemon, Nats};
use serde_json::Value;
use tempfile::TempDir;

/// The demo binary with the flags every test gives it.
fn demo(nats_url: &str, daemon: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvrouted"));
    cmd.arg("demo")
        .args(["--nats-url", nats_url, "--daemon", daemon])
        .args(extra);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KVROUTED_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// A running demo, killed on drop; its output goes to files read at exit.
struct DemoProcess {
    child: Child,
    _dir: TempDir,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl DemoProcess {
    fn spawn(mut cmd: Command) -> DemoProcess {
        let dir = TempDir::new().unwrap();
        let (stdout, stderr) = (dir.path().join("stdout"), dir.path().join("stderr"));
        let child = cmd
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("start kvrouted demo");
        DemoProcess {
            child,
            _dir: dir,
            stdout,
            stderr,
        }
    }

    /// Waits for the exit (polling against the deadline); returns status, stdout, stderr.
    async fn exit(&mut self) -> (ExitStatus, String, String) {
        let status = eventually("the demo exits", || {
            let status = self.child.try_wait().unwrap();
            async move { status }
        })
        .await;
        (status, read_log(&self.stdout), read_log(&self.stderr))
    }
}

impl Drop for DemoProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const WORKERS: [&str; 3] = ["demo-w00", "demo-w01", "demo-w02"];

#[tokio::test]
async fn a_live_demo_fleet_is_routed_to_its_owners_and_the_daemon_lists_its_workers_blocks() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &[]).await;
    daemon.wait_ready().await;
    let base = format!("http://{}", daemon.http);
    let mut run = DemoProcess::spawn(demo(
        &nats.url(),
        &base,
        &[
            "--workers",
            "3",
            "--rate",
            "12",
            "--duration",
            "4s",
            "--json",
            "--quiet",
        ],
    ));

    // While it runs, the daemon lists the demo's workers and their caches fill up.
    eventually(
        "/v1/workers lists every demo worker, holding blocks",
        || async {
            let blocks = daemon.blocks().await;
            let listed = WORKERS.iter().all(|w| blocks.contains_key(*w));
            (listed && WORKERS.iter().map(|w| blocks[*w]).sum::<u64>() > 0).then_some(())
        },
    )
    .await;

    let (status, stdout, stderr) = run.exit().await;
    assert!(
        status.success(),
        "the demo exits 0 against a daemon that applies everything; stderr:\n{stderr}"
    );
    let report: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!("the demo prints its summary as JSON ({e}); stdout:\n{stdout}\nstderr:\n{stderr}")
    });
    assert_eq!(
        report["problems"],
        serde_json::json!([]),
        "no disagreement with the daemon"
    );
    let owner_hold = report["summary"]["decisions"]["owner_hold"]
        .as_u64()
        .unwrap();
    assert!(
        owner_hold > 0,
        "turns that extend a prefix are held on its owner: {report}"
    );
    assert!(
        daemon.decisions("owner_hold").await >= owner_hold as f64,
        "the daemon counted the owner holds the demo saw"
    );
    assert_eq!(report["summary"]["failed_routes"], 0, "{report}");
    let workers = report["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 3);
    assert!(
        workers.iter().any(|w| w["blocks"].as_u64().unwrap() > 0),
        "the workers cached blocks: {report}"
    );
    for w in workers {
        assert_eq!(
            w["daemon_blocks"], w["blocks"],
            "the daemon's blocks of a worker equal what its cache holds at the end: {w}"
        );
    }
    assert!(
        report["summary"]["hit_ratio"].as_f64().unwrap() > 0.0,
        "{report}"
    );

    // It left on exit: its workers are no longer listed.
    eventually("the demo's workers left", || async {
        let blocks = daemon.blocks().await;
        WORKERS
            .iter()
            .all(|w| !blocks.contains_key(*w))
            .then_some(())
    })
    .await;
}

#[tokio::test]
async fn the_demo_exits_non_zero_naming_the_counter_when_the_daemon_does_not_apply_its_events() {
    // The daemon fixes the demo model's blocks at 32 tokens (a join cannot change a size the
    // operator fixed): the demo's 16-token blocks are rejected, so the stored blocks it
    // published are never applied.
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &["--model-block-size", "demo=32"]).await;
    daemon.wait_ready().await;
    let base = format!("http://{}", daemon.http);
    let (status, _, stderr) = run_to_exit(demo(
        &nats.url(),
        &base,
        &[
            "--workers",
            "2",
            "--rate",
            "10",
            "--duration",
            "2s",
            "--check-timeout",
            "3s",
            "--quiet",
        ],
    ));
    assert!(!status.success(), "a disagreement is a failure: {stderr}");
    assert!(
        stderr.contains("disagrees with what the demo sent")
            && stderr.contains("kvrouted_events_applied_total{kind=\"stored\"}"),
        "the message names the counter that does not account for the events:\n{stderr}"
    );
    assert!(
        daemon.rejected("block_size_mismatch").await > 0.0,
        "the daemon rejected the events for their block size"
    );
}

#[tokio::test]
async fn the_demo_exits_non_zero_when_the_daemon_reads_another_subject_prefix() {
    let nats = Nats::start();
    let daemon = Daemon::start(&nats.url(), &["--subject-prefix", "other"]).await;
    daemon.wait_ready().await;
    let base = format!("http://{}", daemon.http);
    let (status, _, stderr) = run_to_exit(demo(
        &nats.url(),
        &base,
        &["--duration", "2s", "--check-timeout", "3s", "--quiet"],
    ));
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("--subject-prefix kv"),
        "the message points at the subject prefix:\n{stderr}"
    );
}

#[test]
fn the_demo_exits_non_zero_when_the_daemon_is_not_reachable() {
    let nowhere = format!("http://127.0.0.1:{}", free_port());
    let (status, _, stderr) = run_to_exit(demo(
        "nats://127.0.0.1:1",
        &nowhere,
        &["--check-timeout", "500ms", "--quiet"],
    ));
    assert!(!status.success());
    assert!(
        stderr.contains(&format!("cannot reach the kvrouted daemon at {nowhere}")),
        "the message names the daemon it could not reach:\n{stderr}"
    );
}
