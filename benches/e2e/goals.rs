//! The performance round's end-to-end goals read off one NATS mode's phases, so a run states
//! its own verdicts instead of leaving them to be worked out by hand from the figures.
//!
//! The goals (issue 16): the daemon applies at least 1 M block events/s while the publishers
//! run flat out; 4k-token routes at `--concurrency` reach at least 0.8× the routes per second of
//! the floor that parses the same JSON body; with the publishers and the 1k–32k routes at once,
//! the routes' p99 stays within 2× their p99 alone and the daemon still applies at least 0.5 M
//! block events/s. The machine's cores are shared by the broker, the publishers, the load
//! generator and the daemon; each phase's line reports what each took.

/// One mode's figures the goals name.
pub(crate) struct Goals {
    /// Block events the daemon applied per second while the publishers ran (phase 2).
    pub(crate) ingest_per_s: f64,
    /// 1k–32k routes' p99 alone, in µs (phase 3).
    pub(crate) solo_p99_us: f64,
    /// 4k-token routes per second at `--concurrency`, kvrouted's over the floor that parses
    /// (phase 4; measured in the first mode only).
    pub(crate) against_parse_floor: Option<f64>,
    /// The same routes' p99 with the publishers running, in µs (phase 5).
    pub(crate) combined_p99_us: f64,
    /// Block events applied per second meanwhile (phase 5).
    pub(crate) combined_ingest_per_s: f64,
}

impl Goals {
    /// The verdict lines, one per goal.
    pub(crate) fn verdicts(&self, concurrency: usize) -> Vec<String> {
        let met = |ok: bool| if ok { "met" } else { "MISSED" };
        let mut lines = vec![format!(
            "ingest {:.2} M block events/s while publishing (goal at least 1 M): {}",
            self.ingest_per_s / 1e6,
            met(self.ingest_per_s >= 1e6)
        )];
        if let Some(ratio) = self.against_parse_floor {
            lines.push(format!(
                "4k-token routes at concurrency {concurrency} {ratio:.2}× the floor that parses the body (goal at least 0.8×): {}",
                met(ratio >= 0.8)
            ));
        }
        let p99_ratio = self.combined_p99_us / self.solo_p99_us.max(1e-9);
        lines.push(format!(
            "route p99 with full-rate ingest {p99_ratio:.2}× its p99 alone ({:.1} against {:.1} ms; goal at most 2×): {}",
            self.combined_p99_us / 1e3,
            self.solo_p99_us / 1e3,
            met(p99_ratio <= 2.0)
        ));
        lines.push(format!(
            "ingest meanwhile {:.0} k block events/s (goal at least 0.5 M): {}",
            self.combined_ingest_per_s / 1e3,
            met(self.combined_ingest_per_s >= 0.5e6)
        ));
        lines
    }
}
