//! Processes: the daemon is stopped with SIGTERM at the end of a mode, as an operator stops it;
//! everything started is killed on drop (a failed run), and by the watchdog.

use super::*;

/// The daemon under load: testkit's [`Process`] (its output in a log file, SIGKILL on drop), under
/// the watchdog.
pub(crate) struct Proc {
    pub(crate) child: Watched<Process>,
}

/// How long the daemon has to exit after SIGTERM at the end of a mode before the drop's SIGKILL.
pub(crate) const STOP_TIMEOUT: Duration = Duration::from_secs(30);

impl Proc {
    pub(crate) fn spawn(cmd: Command, log: PathBuf) -> Proc {
        Proc {
            child: Watched::new(Process::spawn(cmd, &log)),
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn assert_running(&mut self) {
        if let Some(status) = self.child.exited() {
            panic!(
                "kvrouted exited with {status}; log:\n{}",
                self.child.log_text()
            );
        }
    }

    /// SIGTERM, then up to [`STOP_TIMEOUT`] for the daemon to exit; `false` if it is still
    /// running (the drop's SIGKILL then ends it). A daemon that exits by itself runs its
    /// shutdown: the final journal flush, and the profile a build instrumented for profile-guided
    /// optimisation writes at exit (`scripts/build-pgo` trains on this bench).
    pub(crate) fn stop(&mut self) -> bool {
        self.child.terminate_within(STOP_TIMEOUT).is_some()
    }
}

/// Starts the daemon on `dir`; `keep_journal` lifts the journal's size bound, so the run's
/// whole journal stays for a replay (`--keep-data`).
pub(crate) async fn start_daemon(
    dir: &Path,
    nats_url: &str,
    mode: Mode,
    keep_journal: bool,
) -> (Proc, SocketAddr) {
    let http = SocketAddr::from(([127, 0, 0, 1], free_port()));
    // `KVROUTED_BIN` measures another build of the daemon (an A/B comparison) with this bench,
    // as it runs the tests and the attacks bench against one.
    let mut cmd = Command::new(kvrouted_bin());
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
    if keep_journal {
        cmd.args(["--journal-max-bytes", &u64::MAX.to_string()]);
    }
    let mut proc = Proc::spawn(cmd, dir.join("kvrouted.log"));
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
