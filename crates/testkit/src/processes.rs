//! Waiting for a port and finding the nats-server binary for processes a benchmark or test
//! starts on loopback (the ports themselves come from [`crate::ports`]), and the CPU time and
//! memory a process has used.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::poll::{eventually_within_explained, poll_until, DEADLINE};

/// How long a started process may take to listen.
pub(crate) const LISTEN_DEADLINE: Duration = Duration::from_secs(20);

/// Polls until something listens on `port`, or panics naming `what`.
pub fn wait_for_port(port: u16, what: &str) {
    let listening = poll_until(LISTEN_DEADLINE, || {
        TcpStream::connect(("127.0.0.1", port)).ok()
    });
    assert!(listening.is_some(), "{what} did not listen on port {port}");
}

/// `$NATS_SERVER_BIN`, else `nats-server` on the PATH, in /usr/sbin or /usr/bin.
pub fn nats_server_bin() -> PathBuf {
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
    panic!("nats-server not found: run scripts/test (it installs the Debian package nats-server) or set NATS_SERVER_BIN");
}

/// Clock ticks per second, the unit of [`cpu_ticks`].
pub fn clk_tck() -> f64 {
    // SAFETY: sysconf reads a system setting and touches no memory of ours.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

/// CPU time (user and system, all threads) the process `pid` has used, in clock ticks
/// ([`clk_tck`] per second), from `/proc/<pid>/stat`; `None` when the process is gone.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces): state is field 3, utime and stime
    // are fields 14 and 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// The resident memory of the process `pid` and its peak so far (`VmRSS` and `VmHWM` in
/// `/proc/<pid>/status`), in MiB; `None` when the process is gone.
pub fn resident_mib(pid: u32) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let mib = |name: &str| {
        let kib: f64 = status
            .lines()
            .find_map(|line| line.strip_prefix(name))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        Some(kib / 1024.0)
    };
    Some((mib("VmRSS:")?, mib("VmHWM:")?))
}

/// What a process wrote to a file of its output so far (empty before it wrote anything): the one
/// reader of a started process's log, stdout or stderr, for a running [`Process`] and for a log
/// that outlives its process (a daemon's, across restarts).
pub fn read_log(log: &Path) -> String {
    std::fs::read_to_string(log).unwrap_or_default()
}

/// A process a test or benchmark started, its stdout and stderr appended to a log file; killed
/// (SIGKILL) on drop, so that a failing test leaves nothing running.
pub struct Process {
    child: std::process::Child,
    log: PathBuf,
}

impl Process {
    /// Starts `cmd` with stdin closed and its output appended to `log`.
    pub fn spawn(mut cmd: std::process::Command, log: &Path) -> Process {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let child = cmd
            .stdin(std::process::Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        Process {
            child,
            log: log.to_path_buf(),
        }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// What the process wrote so far.
    pub fn log_text(&self) -> String {
        read_log(&self.log)
    }

    /// The exit status, if it has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().unwrap()
    }

    /// Sends a signal (`HUP`, `TERM`, ...).
    pub fn signal(&self, signal: &str) {
        let pid = self.id().to_string();
        let status = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} {pid}");
    }

    /// Waits until `up` answers `true` (asked as [`eventually`](crate::poll::eventually) asks,
    /// for up to [`DEADLINE`]): a process that exits first fails the wait at once, and either
    /// failure ends with the process's log, so a start that goes wrong in CI says why.
    pub async fn wait_until_up<F, Fut>(&mut self, what: &str, mut up: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        // The check borrows the process to ask whether it exited; the explanation reads the log
        // from its own copy of the path.
        let log = self.log.clone();
        eventually_within_explained(
            DEADLINE,
            what,
            || {
                if let Some(status) = self.exited() {
                    panic!(
                        "{what}: the process exited with {status}; log:\n{}",
                        read_log(&log)
                    );
                }
                let answered = up();
                async move { answered.await.then_some(()) }
            },
            || format!("; log:\n{}", read_log(&log)),
        )
        .await
    }

    /// SIGTERM, then the exit status if the process exits within `deadline` (`None`: still
    /// running, left to the drop's SIGKILL).
    pub fn terminate_within(&mut self, deadline: Duration) -> Option<std::process::ExitStatus> {
        self.signal("TERM");
        poll_until(deadline, || self.exited())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_memory_is_read_in_mib_and_a_gone_process_has_none() {
        let held = vec![1u8; 64 << 20];
        let (resident, peak) = resident_mib(std::process::id()).expect("this process's status");
        assert!(
            resident >= 64.0 && peak >= resident,
            "64 MiB written are resident ({resident} MiB), and the peak is at least that ({peak} MiB)"
        );
        std::hint::black_box(&held);
        let mut gone = std::process::Command::new("true")
            .spawn()
            .expect("start true");
        let pid = gone.id();
        gone.wait().expect("true exits");
        assert_eq!(
            resident_mib(pid),
            None,
            "a reaped process has no memory to read"
        );
    }

    #[tokio::test]
    async fn a_process_that_exits_before_it_is_up_fails_the_wait_at_once_with_its_log() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let log = dir.path().join("log");
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", "echo no config; exit 3"]);
        let mut process = Process::spawn(cmd, &log);
        let started = std::time::Instant::now();
        let wait = async move {
            process
                .wait_until_up("a server that never listens", || async { false })
                .await
        };
        let message = crate::poll::panic_message(wait, "a process that exits is never up").await;
        assert!(
            message.contains("a server that never listens: the process exited with")
                && message.ends_with("log:\nno config\n"),
            "the failure names the wait, the exit and the log: {message}"
        );
        assert!(
            started.elapsed() < DEADLINE,
            "an exit fails the wait at once, not at the deadline"
        );
    }
}
