//! Prometheus metrics (bounded label sets) and the rate-limited rejection log.
//!
//! Names: `kvrouted_route_decisions_total{decision}`, `kvrouted_route_duration_seconds`,
//! `kvrouted_route_matched_blocks`, `kvrouted_prefix_owner_count`,
//! `kvrouted_events_applied_total{kind}`, `kvrouted_inputs_rejected_total{reason}`,
//! `kvrouted_event_seq_gaps_total`, `kvrouted_orphan_blocks_total`,
//! `kvrouted_engine_restarts_total`, `kvrouted_departed_inputs_total`, `kvrouted_index_blocks`,
//! `kvrouted_index_entries`, `kvrouted_workers{state}`, `kvrouted_worker_pressure{worker}`,
//! `kvrouted_worker_reserved_work{worker}`, `kvrouted_nats_reconnects_total`,
//! `kvrouted_ingest_lag_seconds`, `kvrouted_ingest_lost_deliveries_total{feed}` and
//! `kvrouted_ingest_rewinds_total{feed}` (deliveries lost in transit, and the consumer rewinds that
//! delivered them again in order), `kvrouted_journal_*` (`kvrouted_journal_errors_total`: failed
//! journal writes; `kvrouted_journal_fault_refusals_total`: inputs refused after one); from peer
//! replicas `kvrouted_peer_inputs_total{outcome}`, `kvrouted_peer_spills_coalesced_total`,
//! `kvrouted_peer_reservation_conflicts_total`, `kvrouted_peer_early_releases_total`; and this
//! replica's own decisions for them, `kvrouted_decisions_*` (see `decisions`).

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::{Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use metrics::{counter, gauge, histogram, Counter, Histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::input::{RejectReason, Rejection};
use crate::policy::DecisionLabel;
use crate::router::{IngestReport, Output, Router};
use crate::status::Feed;

/// The recorder's settings: histogram buckets, and gauges that go idle (a gauge nothing has set
/// for 300s leaves the page). Counters and histograms never expire, so a held handle
/// ([`Handles`]) stays the series it was registered as.
fn builder() -> anyhow::Result<PrometheusBuilder> {
    Ok(PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("kvrouted_route_duration_seconds".into()),
            &[
                1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1, 1.0,
            ],
        )?
        .set_buckets_for_metric(
            Matcher::Full("kvrouted_route_matched_blocks".into()),
            &[0.0, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0],
        )?
        .set_buckets_for_metric(
            Matcher::Full("kvrouted_prefix_owner_count".into()),
            &[0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0],
        )?
        .idle_timeout(
            metrics_util::MetricKindMask::GAUGE,
            Some(Duration::from_secs(300)),
        ))
}

/// The kinds of `kvrouted_events_applied_total`, in the order of [`Handles`]' counters.
const EVENT_KINDS: [&str; 7] = [
    "stored",
    "removed",
    "stored_lower_tier",
    "removed_lower_tier",
    "cleared",
    "ignored_group",
    "duplicate_batch",
];

/// Handles of the series recorded for every applied input, registered once. Naming a series
/// (`counter!(name, labels)`) hashes its key and looks it up in the recorder's registry, under
/// the registry's lock: five times per route inside the state's lock ([`record_output`] and the
/// journal's counters in `apply_journaled`), where every route waits behind it. A held handle is
/// one atomic update.
pub struct Handles {
    /// `kvrouted_route_decisions_total{decision}`, indexed by [`DecisionLabel`].
    decisions: [Counter; DecisionLabel::ALL.len()],
    matched_blocks: Histogram,
    owner_count: Histogram,
    route_duration: Histogram,
    journal_bytes: Counter,
    journal_entries: Counter,
    /// `kvrouted_events_applied_total{kind}`, indexed as [`EVENT_KINDS`].
    events_applied: [Counter; EVENT_KINDS.len()],
}

impl Handles {
    /// Registers every series with the recorder installed now.
    fn register() -> Handles {
        Handles {
            decisions: DecisionLabel::ALL.map(
                |label| counter!("kvrouted_route_decisions_total", "decision" => label.as_str()),
            ),
            matched_blocks: histogram!("kvrouted_route_matched_blocks"),
            owner_count: histogram!("kvrouted_prefix_owner_count"),
            route_duration: histogram!("kvrouted_route_duration_seconds"),
            journal_bytes: counter!("kvrouted_journal_bytes_total"),
            journal_entries: counter!("kvrouted_journal_entries_total"),
            events_applied: EVENT_KINDS
                .map(|kind| counter!("kvrouted_events_applied_total", "kind" => kind)),
        }
    }

    /// A route's decision: its label, the chosen worker's matched blocks and the known owners.
    fn routed(&self, decision: DecisionLabel, matched_blocks: u32, owners: usize) {
        self.decisions[decision as usize].increment(1);
        self.matched_blocks.record(f64::from(matched_blocks));
        self.owner_count.record(owners as f64);
    }

    /// What one KV event batch applied, by kind (a redelivered batch counts once, as
    /// `duplicate_batch`).
    fn ingested(&self, r: &IngestReport) {
        let applied = [
            r.stored_blocks,
            r.removed_blocks,
            r.lower_tier_stored,
            r.lower_tier_removed,
            r.cleared,
            r.ignored_blocks,
            u64::from(r.duplicate),
        ];
        for (counter, n) in self.events_applied.iter().zip(applied) {
            if n > 0 {
                counter.increment(n);
            }
        }
    }

    /// How long the HTTP handler took to answer a route (`kvrouted_route_duration_seconds`).
    pub fn route_took(&self, seconds: f64) {
        self.route_duration.record(seconds);
    }

    /// One journal entry of `bytes` written.
    pub fn journaled(&self, bytes: usize) {
        self.journal_bytes.increment(bytes as u64);
        self.journal_entries.increment(1);
    }
}

static HANDLES: OnceLock<Handles> = OnceLock::new();

/// The per-input series' handles, registered with the recorder installed at the first call:
/// [`install`] makes that call, before the daemon applies anything. Where no recorder is
/// installed (replay, the simulator, tests) they record nothing, as the macros would.
pub fn handles() -> &'static Handles {
    HANDLES.get_or_init(Handles::register)
}

/// Installs the Prometheus recorder and pre-registers every bounded label so dashboards see
/// zeros rather than missing series.
pub fn install() -> anyhow::Result<PrometheusHandle> {
    let handle = builder()?.install_recorder()?;
    for decisions in &handles().decisions {
        decisions.absolute(0);
    }
    for reason in RejectReason::ALL {
        counter!("kvrouted_inputs_rejected_total", "reason" => reason.as_str()).absolute(0);
    }
    counter!("kvrouted_event_seq_gaps_total").absolute(0);
    counter!("kvrouted_orphan_blocks_total").absolute(0);
    counter!("kvrouted_engine_restarts_total").absolute(0);
    counter!("kvrouted_departed_inputs_total").absolute(0);
    counter!("kvrouted_nats_reconnects_total").absolute(0);
    for feed in [Feed::Events, Feed::Decisions] {
        counter!("kvrouted_ingest_lost_deliveries_total", "feed" => feed.name()).absolute(0);
        counter!("kvrouted_ingest_rewinds_total", "feed" => feed.name()).absolute(0);
    }
    counter!("kvrouted_journal_errors_total").absolute(0);
    counter!("kvrouted_journal_fault_refusals_total").absolute(0);
    for outcome in PEER_OUTCOMES {
        counter!("kvrouted_peer_inputs_total", "outcome" => outcome).absolute(0);
    }
    counter!("kvrouted_peer_spills_coalesced_total").absolute(0);
    counter!("kvrouted_peer_reservation_conflicts_total").absolute(0);
    counter!("kvrouted_peer_early_releases_total").absolute(0);
    crate::decisions::register_metrics();
    Ok(handle)
}

/// Counts a rejected input and logs it, at most once per second per reason.
pub fn reject(rejection: &Rejection, source: &str) {
    counter!("kvrouted_inputs_rejected_total", "reason" => rejection.reason.as_str()).increment(1);
    if let Some(suppressed) = log_allowed(rejection.reason.as_str()) {
        tracing::warn!(
            reason = rejection.reason.as_str(),
            source,
            suppressed,
            "rejected input: {}",
            rejection.detail
        );
    }
}

/// Whether a log line of kind `key` may be written now: at most one per second per kind, so a
/// flood of bad input or a failing disk cannot flood the log. `Some(n)` when it may, with the
/// number of lines of that kind suppressed since the last one (to log with it).
pub fn log_allowed(key: &'static str) -> Option<u64> {
    static LAST: Mutex<Option<HashMap<&'static str, (Instant, u64)>>> = Mutex::new(None);
    let mut guard = LAST.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    let now = Instant::now();
    let entry = map.entry(key).or_insert((now - Duration::from_secs(2), 0));
    if now.duration_since(entry.0) >= Duration::from_secs(1) {
        let suppressed = entry.1;
        *entry = (now, 0);
        Some(suppressed)
    } else {
        entry.1 += 1;
        None
    }
}

/// What applying a peer replica's decision did: `applied`, or ignored as this replica's `own`,
/// a `duplicate` (redelivered), or naming an `unknown_worker`.
const PEER_OUTCOMES: [&str; 4] = ["applied", "own", "duplicate", "unknown_worker"];

/// Records what one applied input did.
pub fn record_output(output: &Output, source: &str) {
    match output {
        Output::Routed(d) => handles().routed(d.decision, d.matched_blocks, d.owners.len()),
        Output::Ingested(r) => {
            handles().ingested(r);
            if r.orphan_blocks > 0 {
                // Blocks keyed from a chain start because their parent was unknown.
                counter!("kvrouted_orphan_blocks_total").increment(r.orphan_blocks);
            }
            if r.new_epoch {
                counter!("kvrouted_engine_restarts_total").increment(1);
                tracing::info!(
                    source,
                    cleared_blocks = r.cleared_blocks,
                    "new KV event epoch: engine restarted, its rank was cleared"
                );
            }
            if r.departed {
                // A late message from a worker that left: ignored, never brings it back.
                counter!("kvrouted_departed_inputs_total").increment(1);
            }
            if r.seq_gap > 0 {
                counter!("kvrouted_event_seq_gaps_total").increment(r.seq_gap);
                tracing::warn!(source, missed = r.seq_gap, "KV event sequence gap");
            }
            for rejection in &r.rejections {
                reject(rejection, source);
            }
            for w in &r.removed_workers {
                tracing::info!(worker = %w, "worker left");
            }
        }
        Output::Peer(p) => {
            if let Some(rejection) = &p.rejection {
                reject(rejection, source);
                return;
            }
            let outcome = if p.own {
                PEER_OUTCOMES[1]
            } else if p.duplicate {
                PEER_OUTCOMES[2]
            } else if p.unknown_worker {
                PEER_OUTCOMES[3]
            } else {
                PEER_OUTCOMES[0]
            };
            counter!("kvrouted_peer_inputs_total", "outcome" => outcome).increment(1);
            if p.coalesced_spill {
                counter!("kvrouted_peer_spills_coalesced_total").increment(1);
            }
            if p.reservation_conflict {
                counter!("kvrouted_peer_reservation_conflicts_total").increment(1);
            }
            if p.early_release {
                counter!("kvrouted_peer_early_releases_total").increment(1);
            }
        }
        Output::Tick(t) => {
            for w in &t.aged_out {
                tracing::warn!(worker = %w, "worker aged out (silent for worker_ttl)");
            }
        }
        _ => {}
    }
}

/// The per-worker series (`kvrouted_worker_pressure{worker}`,
/// `kvrouted_worker_reserved_work{worker}`) of the live workers, in exposition format, as of
/// the last tick. They are rendered here rather than through the recorder because the
/// Prometheus exporter cannot remove one series: a worker's series must end when the worker
/// leaves or ages out, so their number follows the live workers (at most `--max-workers`)
/// instead of every id ever seen.
static WORKER_SERIES: RwLock<String> = RwLock::new(String::new());

/// The `/metrics` page: the recorder's series and the live workers' series.
pub fn render(handle: &PrometheusHandle) -> String {
    let mut page = handle.render();
    page.push_str(&WORKER_SERIES.read().unwrap_or_else(|e| e.into_inner()));
    page
}

/// Refreshes the state gauges (on every tick).
pub fn record_state(router: &Router, now_ms: u64) {
    let stats = router.index_stats();
    gauge!("kvrouted_index_blocks").set(stats.blocks as f64);
    gauge!("kvrouted_index_entries").set(stats.entries as f64);
    let rows = router.worker_rows(now_ms);
    let mut active = 0;
    let mut draining = 0;
    // Worker ids are `A-Z a-z 0-9 _ - :`: nothing in them needs escaping in a label value.
    let mut pressure = String::from("# TYPE kvrouted_worker_pressure gauge\n");
    let mut reserved = String::from("# TYPE kvrouted_worker_reserved_work gauge\n");
    for row in &rows {
        match row.state {
            crate::workers::WorkerState::Active => active += 1,
            crate::workers::WorkerState::Draining => draining += 1,
        }
        if let Some(p) = row.pressure {
            let _ = writeln!(
                pressure,
                "kvrouted_worker_pressure{{worker=\"{}\"}} {p}",
                row.id
            );
        }
        let _ = writeln!(
            reserved,
            "kvrouted_worker_reserved_work{{worker=\"{}\"}} {}",
            row.id, row.reserved_work
        );
    }
    pressure.push_str(&reserved);
    *WORKER_SERIES.write().unwrap_or_else(|e| e.into_inner()) = pressure;
    gauge!("kvrouted_workers", "state" => "active").set(active as f64);
    gauge!("kvrouted_workers", "state" => "draining").set(draining as f64);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Renders what `record` recorded through handles registered with a recorder of the
    /// daemon's settings (local to the test, so tests do not share a global one).
    fn recorded(record: impl FnOnce(&Handles)) -> String {
        let recorder = builder().expect("the settings are valid").build_recorder();
        let page = recorder.handle();
        let handles = metrics::with_local_recorder(&recorder, Handles::register);
        record(&handles);
        page.render()
    }

    fn has_line(page: &str, line: &str) -> bool {
        page.lines().any(|l| l == line)
    }

    #[test]
    fn each_decision_label_is_counted_in_its_own_series() {
        let page = recorded(|h| {
            for (n, label) in DecisionLabel::ALL.into_iter().enumerate() {
                for _ in 0..=n {
                    h.routed(label, 3, 2);
                }
            }
        });
        for (n, label) in DecisionLabel::ALL.into_iter().enumerate() {
            let line = format!(
                "kvrouted_route_decisions_total{{decision=\"{label}\"}} {}",
                n + 1
            );
            assert!(
                has_line(&page, &line),
                "each label's decisions count under that label ({line}):\n{page}"
            );
        }
        let routes = DecisionLabel::ALL.len() * (DecisionLabel::ALL.len() + 1) / 2;
        for histogram in [
            "kvrouted_route_matched_blocks",
            "kvrouted_prefix_owner_count",
        ] {
            let line = format!("{histogram}_count {routes}");
            assert!(
                has_line(&page, &line),
                "every route is observed ({line}):\n{page}"
            );
        }
    }

    #[test]
    fn each_kind_of_applied_event_is_counted_in_its_own_series() {
        let report = IngestReport {
            stored_blocks: 1,
            removed_blocks: 2,
            lower_tier_stored: 3,
            lower_tier_removed: 4,
            cleared: 5,
            ignored_blocks: 6,
            duplicate: true,
            ..IngestReport::default()
        };
        let page = recorded(|h| {
            h.ingested(&report);
            h.journaled(100);
            h.journaled(20);
        });
        for (n, kind) in EVENT_KINDS.into_iter().enumerate() {
            let count = if kind == "duplicate_batch" { 1 } else { n + 1 };
            let line = format!("kvrouted_events_applied_total{{kind=\"{kind}\"}} {count}");
            assert!(
                has_line(&page, &line),
                "{kind} counts its own ({line}):\n{page}"
            );
        }
        assert!(
            has_line(&page, "kvrouted_journal_bytes_total 120")
                && has_line(&page, "kvrouted_journal_entries_total 2"),
            "journal entries and their bytes add up:\n{page}"
        );
    }
}
