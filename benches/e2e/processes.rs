//! Processes: the daemon is stopped with SIGTERM at the end of a mode, as an operator stops it;
//! everything started is killed on drop (a failed run), and by the watchdog.

use super::*;

pub(crate) struct Proc {
    pub(crate) child: Watched<Child>,
    pub(crate) name: &'static str,
    pub(crate) log: PathBuf,
}

impl Proc {
    pub(crate) fn spawn(name: &'static str, mut cmd: Command, log: PathBuf) -> Proc {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Proc {
            child: Watched::new(child),
            name,
            log,
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "{} exited with {status}; log:\n{}",
                self.name,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }

    /// SIGTERM, then up to `deadline` for the process to exit; `false` if it is still running
    /// (the drop's SIGKILL then ends it). A daemon that exits by itself runs its shutdown: the
    /// final journal flush, and the profile a build instrumented for profile-guided
    /// optimisation writes at exit (`scripts/build-pgo` trains on this bench).
    pub(crate) fn stop(&mut self, deadline: Duration) -> bool {
        let pid = self.pid().to_string();
        let sent = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .is_ok_and(|s| s.success());
        sent && poll_until(deadline, || self.child.try_wait().ok().flatten()).is_some()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) async fn start_daemon(dir: &Path, nats_url: &str, mode: Mode) -> (Proc, SocketAddr) {
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
