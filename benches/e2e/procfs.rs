//! /proc figures.

use super::*;

#[derive(Clone, Copy)]
pub(crate) struct CpuSample {
    pub(crate) at: Instant,
    pub(crate) ticks: u64,
}

pub(crate) fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

pub(crate) fn cpu(pid: u32) -> CpuSample {
    let ticks = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // Fields after the command name (which may hold spaces): state is field 3, utime
            // and stime are fields 14 and 15.
            let rest = s.rsplit_once(')')?.1.to_owned();
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0);
    CpuSample {
        at: Instant::now(),
        ticks,
    }
}

/// Cores used between two samples.
pub(crate) fn cores(a: CpuSample, b: CpuSample, tck: f64) -> f64 {
    (b.ticks.saturating_sub(a.ticks)) as f64 / tck / (b.at - a.at).as_secs_f64()
}

/// (VmRSS, VmHWM) in MiB.
pub(crate) fn rss_mib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (field("VmRSS:"), field("VmHWM:"))
}

pub(crate) struct Pids {
    pub(crate) daemon: u32,
    pub(crate) nats: u32,
    pub(crate) me: u32,
}

pub(crate) struct CpuWindow {
    pub(crate) daemon: CpuSample,
    pub(crate) nats: CpuSample,
    pub(crate) me: CpuSample,
}

impl Pids {
    pub(crate) fn sample(&self) -> CpuWindow {
        CpuWindow {
            daemon: cpu(self.daemon),
            nats: cpu(self.nats),
            me: cpu(self.me),
        }
    }

    /// "daemon 1.23 cores, nats-server 0.45, bench 0.30"
    pub(crate) fn usage(&self, from: &CpuWindow, tck: f64) -> (f64, f64, f64) {
        let now = self.sample();
        (
            cores(from.daemon, now.daemon, tck),
            cores(from.nats, now.nats, tck),
            cores(from.me, now.me, tck),
        )
    }
}
