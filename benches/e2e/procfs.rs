//! /proc figures.

use super::*;

#[derive(Clone, Copy)]
pub(crate) struct CpuSample {
    pub(crate) at: Instant,
    pub(crate) ticks: u64,
}

pub(crate) use kvrouted_testkit::clk_tck;

pub(crate) fn cpu(pid: u32) -> CpuSample {
    CpuSample {
        at: Instant::now(),
        ticks: kvrouted_testkit::cpu_ticks(pid).unwrap_or(0),
    }
}

/// Cores used between two samples.
pub(crate) fn cores(a: CpuSample, b: CpuSample, tck: f64) -> f64 {
    (b.ticks.saturating_sub(a.ticks)) as f64 / tck / (b.at - a.at).as_secs_f64()
}

/// (VmRSS, VmHWM) in MiB; zero once the process is gone.
pub(crate) fn rss_mib(pid: u32) -> (f64, f64) {
    kvrouted_testkit::resident_mib(pid).unwrap_or((0.0, 0.0))
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
