//! Metrics.

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

#[derive(Clone, Copy, Default)]
pub(crate) struct Counters {
    pub(crate) stored: f64,
    pub(crate) removed: f64,
    pub(crate) gaps: f64,
    pub(crate) route_sum: f64,
    pub(crate) route_count: f64,
    pub(crate) owner_hold: f64,
    pub(crate) cold_miss: f64,
}

pub(crate) async fn counters(client: &reqwest::Client, http: SocketAddr) -> Counters {
    let t = metrics_text(client, http).await;
    Counters {
        stored: metric(&t, "kvrouted_events_applied_total{kind=\"stored\"}"),
        removed: metric(&t, "kvrouted_events_applied_total{kind=\"removed\"}"),
        gaps: metric(&t, "kvrouted_event_seq_gaps_total"),
        route_sum: metric(&t, "kvrouted_route_duration_seconds_sum"),
        route_count: metric(&t, "kvrouted_route_duration_seconds_count"),
        owner_hold: metric(
            &t,
            "kvrouted_route_decisions_total{decision=\"owner_hold\"}",
        ),
        cold_miss: metric(&t, "kvrouted_route_decisions_total{decision=\"cold_miss\"}"),
    }
}
