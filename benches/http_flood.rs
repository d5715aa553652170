//! Connection-flood benchmark (on demand: `cargo bench --bench http_flood`): a daemon limited to
//! 1,024 file descriptors (`ulimit -n 1024`) receives 1,100 idle TCP connections that never send
//! a byte; meanwhile `/healthz` and `/readyz` are probed on fresh connections every 250ms for
//! 45s. Prints how many probes answered and their latency, before and after the idle timeout
//! (30s by default), and the daemon's open descriptors.
//!
//! `FLOOD_DAEMON_BIN=/path/to/kvrouted` measures another build (an A/B comparison);
//! `FLOOD_SOCKETS`, `FLOOD_SECONDS` change the flood and the probing time.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvrouted::sim::percentile;
use kvrouted_testkit::{free_port, Nats};

/// Kills the process on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// One `GET path` on a fresh connection: the status code and the latency, or `None` if it did
/// not answer within [`PROBE_TIMEOUT`] (or the connection failed).
fn probe(addr: SocketAddr, path: &str) -> (Option<u16>, Duration) {
    let start = Instant::now();
    let attempt = || -> std::io::Result<u16> {
        let mut s = TcpStream::connect_timeout(&addr, PROBE_TIMEOUT)?;
        s.set_read_timeout(Some(PROBE_TIMEOUT))?;
        s.set_write_timeout(Some(PROBE_TIMEOUT))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: kvrouted\r\nConnection: close\r\n\r\n"
        )?;
        let mut reply = Vec::new();
        s.read_to_end(&mut reply)?;
        let text = String::from_utf8_lossy(&reply);
        text.split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("no status line: {text:?}")))
    };
    let result = attempt().ok();
    (result, start.elapsed())
}

fn summary(label: &str, probes: &[(Option<u16>, Duration)]) {
    let answered: Vec<&(Option<u16>, Duration)> =
        probes.iter().filter(|(s, _)| s.is_some()).collect();
    let ok = probes.iter().filter(|(s, _)| *s == Some(200)).count();
    let mut latencies: Vec<Duration> = answered.iter().map(|(_, d)| *d).collect();
    latencies.sort();
    println!(
        "{label:<34} {:>4} probes  {:>4} answered  {:>4} x 200  p50 {:>9.2?}  p99 {:>9.2?}  max {:>9.2?}",
        probes.len(),
        answered.len(),
        ok,
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or_default()
    );
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` and test discovery
    }
    let sockets: usize = std::env::var("FLOOD_SOCKETS").map_or(1100, |v| v.parse().unwrap());
    let seconds: u64 = std::env::var("FLOOD_SECONDS").map_or(45, |v| v.parse().unwrap());
    let dir = tempfile::tempdir().unwrap();

    let nats = Nats::start();

    let http = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let bin = std::env::var_os("FLOOD_DAEMON_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_kvrouted").into());
    let log = std::fs::File::create(dir.path().join("kvrouted.log")).unwrap();
    let daemon = Proc(
        Command::new("sh")
            .args(["-c", "ulimit -n 1024 && exec \"$0\" \"$@\""])
            .arg(&bin)
            .arg("serve")
            .args(["--nats-url", &nats.url()])
            .args(["--http-addr", &http.to_string()])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start kvrouted"),
    );
    let pid = daemon.0.id();
    let start = Instant::now();
    while probe(http, "/readyz").0 != Some(200) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "kvrouted did not become ready"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "daemon {} (ulimit -n 1024), {sockets} idle sockets, probing for {seconds}s",
        Path::new(&bin).display()
    );
    let baseline: Vec<_> = (0..20).map(|_| probe(http, "/healthz")).collect();
    summary("/healthz before the flood", &baseline);
    let fds_before = open_fds(pid);

    let mut idle = Vec::with_capacity(sockets);
    let mut refused = 0;
    for _ in 0..sockets {
        match TcpStream::connect_timeout(&http, Duration::from_secs(1)) {
            Ok(s) => idle.push(s),
            Err(_) => refused += 1,
        }
    }
    let flooded = Instant::now();
    println!(
        "opened {} idle sockets ({refused} failed to connect)",
        idle.len()
    );
    let mut during = (Vec::new(), Vec::new());
    let mut late = (Vec::new(), Vec::new());
    let mut peak_fds = 0;
    while flooded.elapsed() < Duration::from_secs(seconds) {
        let phase = if flooded.elapsed() < Duration::from_secs(25) {
            &mut during
        } else {
            &mut late
        };
        phase.0.push(probe(http, "/healthz"));
        phase.1.push(probe(http, "/readyz"));
        peak_fds = peak_fds.max(open_fds(pid));
        std::thread::sleep(Duration::from_millis(250));
    }
    summary("/healthz, 0-25s into the flood", &during.0);
    summary("/readyz, 0-25s into the flood", &during.1);
    summary(&format!("/healthz, 25-{seconds}s into the flood"), &late.0);
    summary(&format!("/readyz, 25-{seconds}s into the flood"), &late.1);
    println!(
        "daemon descriptors: {fds_before} before, peak {peak_fds} during, {} at the end",
        open_fds(pid)
    );
    let still_open = idle
        .iter_mut()
        .filter_map(|s| {
            s.set_nonblocking(true).unwrap();
            let mut b = [0u8; 1];
            matches!(s.read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
                .then_some(())
        })
        .count();
    println!(
        "idle sockets the daemon still holds open at the end: {still_open} of {}",
        idle.len()
    );
}
