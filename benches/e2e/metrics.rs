//! Metrics.

use std::collections::BTreeMap;

use super::*;

pub(crate) async fn metrics_text(client: &reqwest::Client, http: SocketAddr) -> String {
    match client.get(format!("http://{http}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

pub(crate) fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.trim().parse().ok()))
        .unwrap_or(0.0)
}

#[derive(Clone, Default)]
pub(crate) struct Counters {
    pub(crate) stored: f64,
    pub(crate) removed: f64,
    pub(crate) gaps: f64,
    pub(crate) route_sum: f64,
    pub(crate) route_count: f64,
    /// Every `kvrouted_route_decisions_total` series, by decision label.
    pub(crate) decisions: BTreeMap<String, f64>,
}

impl Counters {
    /// The decisions made since `before`, most frequent first, as `label count` pairs: every
    /// label, since under reserved-work pressure a phase's routes spill or hold at the ceiling
    /// instead of holding on their owner.
    pub(crate) fn decisions_since(&self, before: &Counters) -> String {
        let mut made: Vec<(&str, f64)> = self
            .decisions
            .iter()
            .map(|(label, &n)| {
                (
                    label.as_str(),
                    n - before.decisions.get(label).unwrap_or(&0.0),
                )
            })
            .filter(|&(_, n)| n > 0.0)
            .collect();
        made.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
        let listed: Vec<String> = made.iter().map(|(l, n)| format!("{l} {n:.0}")).collect();
        if listed.is_empty() {
            "none".to_string()
        } else {
            listed.join(", ")
        }
    }
}

pub(crate) async fn counters(client: &reqwest::Client, http: SocketAddr) -> Counters {
    let t = metrics_text(client, http).await;
    Counters {
        stored: metric(&t, "kvrouted_events_applied_total{kind=\"stored\"}"),
        removed: metric(&t, "kvrouted_events_applied_total{kind=\"removed\"}"),
        gaps: metric(&t, "kvrouted_event_seq_gaps_total"),
        route_sum: metric(&t, "kvrouted_route_duration_seconds_sum"),
        route_count: metric(&t, "kvrouted_route_duration_seconds_count"),
        decisions: t
            .lines()
            .filter_map(|l| l.strip_prefix("kvrouted_route_decisions_total{decision=\""))
            .filter_map(|rest| rest.split_once("\"}"))
            .filter_map(|(label, n)| Some((label.to_string(), n.trim().parse().ok()?)))
            .collect(),
    }
}
