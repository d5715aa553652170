//! What the demo counts while it runs, and the lines and JSON it prints from those counts.
//!
//! Pure arithmetic: the fleet loop records what happened (a decision, an admission, a first
//! token, a publication) and asks for a [`Snapshot`] when it prints.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::policy::DecisionLabel;
use crate::sim::percentile;

/// Counts of everything the demo sent and saw.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Route decisions by the daemon's label.
    decisions: BTreeMap<String, u64>,
    /// Routes the daemon answered with a decision.
    pub routes: u64,
    /// Routes that got no decision (HTTP error, unreachable daemon), and the first reason.
    pub failed_routes: u64,
    pub first_route_failure: Option<String>,
    /// Decisions naming a worker that is not one of the demo's (another fleet shares the
    /// daemon): released at once, never executed.
    pub foreign_routes: u64,
    /// Prompt tokens of the requests the simulated workers started, and how many of them the
    /// chosen worker already held in its cache.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Time to first token of each request that reached it, seconds (unsorted).
    ttft_s: Vec<f64>,
    /// Requests that finished on their worker.
    pub completed: u64,
    /// Releases the daemon accepted and refused, and the first refusal's reason.
    pub releases: u64,
    pub failed_releases: u64,
    pub first_release_failure: Option<String>,
    /// What the fleet published: KV event batches and the blocks they stored and removed,
    /// load samples.
    pub kv_batches: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub load_samples: u64,
}

/// A point-in-time view of a [`Summary`], as printed and as `--json` writes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Snapshot {
    pub elapsed_s: f64,
    pub routes: u64,
    /// Routes per second since the previous snapshot (over the whole run in the final one).
    pub routes_per_s: f64,
    pub decisions: BTreeMap<String, u64>,
    pub failed_routes: u64,
    pub foreign_routes: u64,
    /// Cached prompt tokens / prompt tokens of the started requests.
    pub hit_ratio: f64,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    pub completed: u64,
    pub releases: u64,
    pub failed_releases: u64,
    pub kv_batches: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub load_samples: u64,
}

impl Summary {
    pub fn new() -> Summary {
        Summary {
            decisions: DecisionLabel::ALL
                .iter()
                .map(|l| (l.as_str().to_string(), 0))
                .collect(),
            ..Summary::default()
        }
    }

    /// A decision with this label (a label this version does not know is counted as is).
    pub fn record_decision(&mut self, label: &str) {
        self.routes += 1;
        *self.decisions.entry(label.to_string()).or_insert(0) += 1;
    }

    pub fn record_route_failure(&mut self, reason: impl FnOnce() -> String) {
        self.failed_routes += 1;
        if self.first_route_failure.is_none() {
            self.first_route_failure = Some(reason());
        }
    }

    pub fn record_release_failure(&mut self, reason: String) {
        self.failed_releases += 1;
        if self.first_release_failure.is_none() {
            self.first_release_failure = Some(reason);
        }
    }

    /// A request started on its worker with `cached` of its `prompt` tokens in the cache.
    pub fn record_start(&mut self, prompt: u64, cached: u64) {
        self.prompt_tokens += prompt;
        self.cached_tokens += cached.min(prompt);
    }

    pub fn record_ttft(&mut self, seconds: f64) {
        self.ttft_s.push(seconds);
    }

    pub fn decisions(&self, label: &str) -> u64 {
        self.decisions.get(label).copied().unwrap_or(0)
    }

    pub fn hit_ratio(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }

    /// The counts now; `routes_per_s` is `routes - routes_before` over `window_s`.
    pub fn snapshot(&self, elapsed_s: f64, routes_before: u64, window_s: f64) -> Snapshot {
        let mut ttft = self.ttft_s.clone();
        ttft.sort_by(f64::total_cmp);
        Snapshot {
            elapsed_s,
            routes: self.routes,
            routes_per_s: per_second(self.routes.saturating_sub(routes_before), window_s),
            decisions: self.decisions.clone(),
            failed_routes: self.failed_routes,
            foreign_routes: self.foreign_routes,
            hit_ratio: self.hit_ratio(),
            ttft_p50_s: percentile(&ttft, 0.50),
            ttft_p99_s: percentile(&ttft, 0.99),
            completed: self.completed,
            releases: self.releases,
            failed_releases: self.failed_releases,
            kv_batches: self.kv_batches,
            stored_blocks: self.stored_blocks,
            removed_blocks: self.removed_blocks,
            load_samples: self.load_samples,
        }
    }
}

fn per_second(n: u64, window_s: f64) -> f64 {
    if window_s > 0.0 {
        n as f64 / window_s
    } else {
        0.0
    }
}

impl Snapshot {
    /// The live line: time, rate, decisions that happened (zero labels left out), hit ratio,
    /// TTFT and what was published.
    pub fn line(&self) -> String {
        let decisions: Vec<String> = self
            .decisions
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(l, n)| format!("{l} {n}"))
            .collect();
        let mut line = format!(
            "demo {:>5.1}s  {} routes ({:.1}/s)  [{}]  hit {:.1}%  ttft p50 {} p99 {}  \
             kv events {} (+{} -{} blocks)",
            self.elapsed_s,
            self.routes,
            self.routes_per_s,
            if decisions.is_empty() {
                "no decisions yet".to_string()
            } else {
                decisions.join(", ")
            },
            self.hit_ratio * 100.0,
            millis(self.ttft_p50_s),
            millis(self.ttft_p99_s),
            self.kv_batches,
            self.stored_blocks,
            self.removed_blocks,
        );
        if self.failed_routes > 0 {
            line.push_str(&format!("  FAILED routes {}", self.failed_routes));
        }
        line
    }

    /// The final summary as text, one fact per line.
    pub fn text(&self) -> String {
        let mut out = format!(
            "demo summary after {:.1}s\n  routes answered   {} ({:.1}/s), failed {}, to other fleets {}\n",
            self.elapsed_s, self.routes, self.routes_per_s, self.failed_routes, self.foreign_routes
        );
        for (label, n) in &self.decisions {
            out.push_str(&format!("    {label:<20} {n}\n"));
        }
        out.push_str(&format!(
            "  prefix hit ratio  {:.1}%\n  TTFT              p50 {}  p99 {}\n  completed         {} (releases {}, refused {})\n  published         {} KV event batches (+{} / -{} blocks), {} load samples\n",
            self.hit_ratio * 100.0,
            millis(self.ttft_p50_s),
            millis(self.ttft_p99_s),
            self.completed,
            self.releases,
            self.failed_releases,
            self.kv_batches,
            self.stored_blocks,
            self.removed_blocks,
            self.load_samples,
        ));
        out
    }
}

fn millis(seconds: f64) -> String {
    format!("{:.0}ms", seconds * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_label_is_listed_and_unknown_labels_are_counted_as_they_come() {
        let mut s = Summary::new();
        s.record_decision("owner_hold");
        s.record_decision("owner_hold");
        s.record_decision("a_future_label");
        let snap = s.snapshot(1.0, 0, 1.0);
        assert_eq!(snap.decisions["owner_hold"], 2);
        assert_eq!(snap.decisions["cold_miss"], 0, "known labels start at zero");
        assert_eq!(snap.decisions["a_future_label"], 1);
        assert_eq!(snap.routes, 3, "every decision is an answered route");
    }

    #[test]
    fn hit_ratio_is_cached_over_prompt_tokens_of_started_requests() {
        let mut s = Summary::new();
        assert_eq!(s.hit_ratio(), 0.0, "no requests: no division by zero");
        s.record_start(1000, 600);
        s.record_start(1000, 0);
        assert!((s.hit_ratio() - 0.3).abs() < 1e-12);
        s.record_start(100, 500);
        assert!(
            s.hit_ratio() <= 1.0,
            "cached tokens never exceed the prompt's"
        );
    }

    #[test]
    fn routes_per_second_count_only_the_window() {
        let mut s = Summary::new();
        for _ in 0..30 {
            s.record_decision("cold_miss");
        }
        let snap = s.snapshot(3.0, 10, 2.0);
        assert!((snap.routes_per_s - 10.0).abs() < 1e-12, "20 routes in 2s");
        assert_eq!(s.snapshot(0.0, 0, 0.0).routes_per_s, 0.0, "empty window");
    }

    #[test]
    fn ttft_percentiles_are_nearest_rank_over_every_request() {
        let mut s = Summary::new();
        for ms in (1..=100).rev() {
            s.record_ttft(ms as f64 / 1000.0);
        }
        let snap = s.snapshot(1.0, 0, 1.0);
        assert!((snap.ttft_p50_s - 0.050).abs() < 1e-12);
        assert!((snap.ttft_p99_s - 0.099).abs() < 1e-12);
    }

    #[test]
    fn only_the_first_route_failure_is_kept_as_the_reason() {
        let mut s = Summary::new();
        s.record_route_failure(|| "503 no candidate".into());
        s.record_route_failure(|| "timeout".into());
        assert_eq!(s.failed_routes, 2);
        assert_eq!(s.first_route_failure.as_deref(), Some("503 no candidate"));
        assert!(s.snapshot(1.0, 0, 1.0).line().contains("FAILED routes 2"));
    }
}
