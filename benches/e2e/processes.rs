//! Processes: everything started is killed on drop, and by the watchdog.

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
