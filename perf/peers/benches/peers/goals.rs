//! The performance round's goals read off one fleet size's rows, so a run states its own
//! verdicts instead of leaving them to be worked out by hand from the table.
//!
//! The goals (issue 16): the whole route decision (`kvrouted-router`) at 256 workers at least
//! half kvrouted's lookup rate with p99 under 10 µs, and p99 under 20 µs at 4,096 workers;
//! kvrouted's apply and lookup rates at or above the best peer's and its lookup p99 no worse
//! than the best peer's at 16, 256 and 1,024 workers; its memory per entry the lowest. "The
//! best peer" is the peer best on that figure (the highest rate, the lowest p99, the fewest
//! bytes), so each comparison is against the hardest row of the table.

/// One index's medians at one fleet size, as the table prints them.
pub(crate) struct Row<'a> {
    pub(crate) name: &'a str,
    pub(crate) events_per_s: f64,
    pub(crate) lookups_per_s: f64,
    pub(crate) p99_ns: u64,
    pub(crate) bytes_per_entry: f64,
}

/// Rows that are kvrouted itself rather than a peer.
const OWN_ROWS: [&str; 3] = ["kvrouted", "kvrouted-router", "kvrouted-keys"];

/// Fleet sizes whose apply, lookup and p99 figures the goals name (kv-index stops at 1,024).
const COMPARED_FLEETS: [usize; 3] = [16, 256, 1024];

/// The verdict lines for one fleet size: empty when the rows needed are missing (`--only`).
pub(crate) fn verdicts(workers: usize, rows: &[Row]) -> Vec<String> {
    let row = |name: &str| rows.iter().find(|r| r.name == name);
    let peers: Vec<&Row> = rows
        .iter()
        .filter(|r| !OWN_ROWS.contains(&r.name))
        .collect();
    let met = |ok: bool| if ok { "met" } else { "MISSED" };
    let mut lines = Vec::new();
    if let Some(decision) = row("kvrouted-router") {
        let p99_goal_us = match workers {
            256 => Some(10),
            4096 => Some(20),
            _ => None,
        };
        if let (256, Some(own)) = (workers, row("kvrouted")) {
            let ratio = decision.lookups_per_s / own.lookups_per_s;
            lines.push(format!(
                "decision rate {ratio:.2}× kvrouted's lookup rate (goal at least 0.5×): {}",
                met(ratio >= 0.5)
            ));
        }
        if let Some(limit) = p99_goal_us {
            let p99_us = decision.p99_ns as f64 / 1e3;
            lines.push(format!(
                "decision p99 {p99_us:.1} µs (goal under {limit} µs): {}",
                met(p99_us < f64::from(limit))
            ));
        }
    }
    let Some(own) = row("kvrouted") else {
        return lines;
    };
    // The peer best on one figure: (its name, its value).
    let best = |value: fn(&Row) -> f64, higher_is_better: bool| {
        let scored = peers.iter().map(|r| (r.name, value(r)));
        if higher_is_better {
            scored.max_by(|a, b| a.1.total_cmp(&b.1))
        } else {
            scored.min_by(|a, b| a.1.total_cmp(&b.1))
        }
    };
    if COMPARED_FLEETS.contains(&workers) {
        if let Some((peer, events)) = best(|r| r.events_per_s, true) {
            let ratio = own.events_per_s / events;
            lines.push(format!(
                "apply {ratio:.2}× the best peer's ({peer}): {}",
                met(ratio >= 1.0)
            ));
        }
        if let Some((peer, lookups)) = best(|r| r.lookups_per_s, true) {
            let ratio = own.lookups_per_s / lookups;
            lines.push(format!(
                "lookups {ratio:.2}× the best peer's ({peer}): {}",
                met(ratio >= 1.0)
            ));
        }
        if let Some((peer, p99)) = best(|r| r.p99_ns as f64, false) {
            let over = own.p99_ns as f64 / p99 - 1.0;
            lines.push(format!(
                "lookup p99 {} ns, {:+.1}% against the best peer's ({peer}, {p99:.0} ns): {}",
                own.p99_ns,
                100.0 * over,
                met(over <= 0.0)
            ));
        }
    }
    if let Some((peer, bytes)) = best(|r| r.bytes_per_entry, false) {
        lines.push(format!(
            "memory {:.1} bytes per entry against the best peer's {bytes:.1} ({peer}): {}",
            own.bytes_per_entry,
            met(own.bytes_per_entry < bytes)
        ));
    }
    lines
}
