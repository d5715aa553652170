//! The smoke test: does the daemon's state account for what the demo sent?
//!
//! Pure comparisons of what the demo published and routed with the daemon's `/metrics`
//! counters (read before and after the run, so other traffic on a shared daemon only adds) and
//! its `/v1/workers` rows (the demo's workers are its own: their blocks must match exactly,
//! and their load samples must have made their pressure known).

use super::gateway::ListedWorker;

/// The daemon counters the demo accounts for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DaemonCounters {
    /// `kvrouted_route_decisions_total`, every label.
    pub decisions: u64,
    /// `kvrouted_events_applied_total{kind="stored"}` and `{kind="removed"}`: blocks.
    pub stored_blocks: u64,
    pub removed_blocks: u64,
}

impl DaemonCounters {
    /// Reads the counters from Prometheus text (absent series count as 0).
    pub fn parse(text: &str) -> DaemonCounters {
        let mut c = DaemonCounters::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            let value = value.max(0.0) as u64;
            if series.starts_with("kvrouted_route_decisions_total") {
                c.decisions += value;
            } else if series == "kvrouted_events_applied_total{kind=\"stored\"}" {
                c.stored_blocks = value;
            } else if series == "kvrouted_events_applied_total{kind=\"removed\"}" {
                c.removed_blocks = value;
            }
        }
        c
    }
}

/// What the demo sent: routes the daemon answered, blocks its KV events stored and removed,
/// and the blocks each of its workers holds now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expected {
    pub routes: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub workers: Vec<(String, u64)>,
}

/// Every way the daemon disagrees with `expected`; empty when it accounts for all of it.
/// `before` and `now` are the daemon's counters at the start and at the end of the run.
pub fn disagreements(
    expected: &Expected,
    before: &DaemonCounters,
    now: &DaemonCounters,
    listed: &[ListedWorker],
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut counter = |what: &str, series: &str, sent: u64, before: u64, now: u64| {
        let applied = now.saturating_sub(before);
        if now < before {
            problems.push(format!(
                "{series} went back from {before} to {now}: the daemon restarted during the run"
            ));
        } else if applied < sent {
            problems.push(format!(
                "the demo {what} {sent}, the daemon counted {applied} ({series})"
            ));
        }
    };
    counter(
        "had routes answered",
        "kvrouted_route_decisions_total",
        expected.routes,
        before.decisions,
        now.decisions,
    );
    counter(
        "published stored blocks",
        "kvrouted_events_applied_total{kind=\"stored\"}",
        expected.stored_blocks,
        before.stored_blocks,
        now.stored_blocks,
    );
    counter(
        "published removed blocks",
        "kvrouted_events_applied_total{kind=\"removed\"}",
        expected.removed_blocks,
        before.removed_blocks,
        now.removed_blocks,
    );
    for (id, blocks) in &expected.workers {
        match listed.iter().find(|w| &w.id == id) {
            None => problems.push(format!("/v1/workers does not list worker {id}")),
            Some(w) => {
                if w.blocks != *blocks {
                    problems.push(format!(
                        "/v1/workers says {id} holds {} blocks, its cache holds {blocks}",
                        w.blocks
                    ));
                }
                if w.pressure.is_none() {
                    problems.push(format!(
                        "/v1/workers has no fresh load sample of {id} (its pressure is null)"
                    ));
                }
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS: &str = "\
# TYPE kvrouted_route_decisions_total counter
kvrouted_route_decisions_total{decision=\"owner_hold\"} 7
kvrouted_route_decisions_total{decision=\"cold_miss\"} 3
kvrouted_events_applied_total{kind=\"stored\"} 120
kvrouted_events_applied_total{kind=\"removed\"} 20
kvrouted_events_applied_total{kind=\"duplicate_batch\"} 2
kvrouted_index_blocks 100
";

    fn listed(rows: &[(&str, u64)]) -> Vec<ListedWorker> {
        rows.iter()
            .map(|(id, blocks)| ListedWorker {
                id: id.to_string(),
                blocks: *blocks,
                pressure: Some(0.5),
            })
            .collect()
    }

    #[test]
    fn counters_sum_every_decision_label_and_read_stored_and_removed_blocks() {
        assert_eq!(
            DaemonCounters::parse(METRICS),
            DaemonCounters {
                decisions: 10,
                stored_blocks: 120,
                removed_blocks: 20
            }
        );
        assert_eq!(DaemonCounters::parse(""), DaemonCounters::default());
    }

    #[test]
    fn a_daemon_that_applied_everything_and_more_agrees() {
        let expected = Expected {
            routes: 10,
            stored_blocks: 100,
            removed_blocks: 20,
            workers: vec![("demo-w0".into(), 80)],
        };
        let before = DaemonCounters::default();
        let now = DaemonCounters {
            decisions: 12,
            stored_blocks: 100,
            removed_blocks: 20,
        };
        let problems = disagreements(&expected, &before, &now, &listed(&[("demo-w0", 80)]));
        assert!(problems.is_empty(), "{problems:?}");
    }

    #[test]
    fn events_published_but_not_applied_are_named_with_their_counter() {
        let expected = Expected {
            routes: 0,
            stored_blocks: 100,
            removed_blocks: 0,
            workers: vec![("demo-w0".into(), 100), ("demo-w1".into(), 5)],
        };
        let before = DaemonCounters {
            decisions: 0,
            stored_blocks: 40,
            removed_blocks: 0,
        };
        let now = DaemonCounters {
            stored_blocks: 90,
            ..before
        };
        let problems = disagreements(&expected, &before, &now, &listed(&[("demo-w0", 50)]));
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].contains("stored blocks 100, the daemon counted 50"));
        assert!(problems[1].contains("demo-w0 holds 50 blocks, its cache holds 100"));
        assert!(problems[2].contains("does not list worker demo-w1"));
    }

    #[test]
    fn a_worker_without_fresh_load_samples_is_a_disagreement() {
        let expected = Expected {
            workers: vec![("demo-w0".into(), 0)],
            ..Expected::default()
        };
        let mut rows = listed(&[("demo-w0", 0)]);
        rows[0].pressure = None;
        let c = DaemonCounters::default();
        let problems = disagreements(&expected, &c, &c, &rows);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("no fresh load sample of demo-w0"));
    }

    #[test]
    fn counters_that_went_back_mean_a_restart() {
        let expected = Expected::default();
        let before = DaemonCounters {
            decisions: 5,
            ..DaemonCounters::default()
        };
        let problems = disagreements(&expected, &before, &DaemonCounters::default(), &[]);
        assert_eq!(problems.len(), 1);
        assert!(problems[0].contains("restarted"), "{problems:?}");
    }
}
