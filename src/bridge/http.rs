//! The bridge's own HTTP endpoint: `/metrics` (Prometheus) and `/healthz`.
//!
//! Metrics, per rank (`rank` is bounded by `--dp-size`):
//! `kvrouted_bridge_forwarded_total` (batches the stream acknowledged),
//! `kvrouted_bridge_replayed_total` (of those, fetched from the replay socket),
//! `kvrouted_bridge_lost_total` (batches the engine no longer buffered when asked),
//! `kvrouted_bridge_duplicates_total` (live batches already forwarded from a replay),
//! `kvrouted_bridge_engine_restarts_total`, `kvrouted_bridge_publish_retries_total`,
//! `kvrouted_bridge_lag_seconds` (engine receive to stream ack of the last batch);
//! `kvrouted_bridge_rejected_total{reason}` (messages from the engine that are not batches),
//! `kvrouted_bridge_load_samples_total`, `kvrouted_bridge_scrape_errors_total`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use super::Health;

pub fn install_metrics() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new().install_recorder()?;
    for reason in ["frame_count", "seq_length"] {
        metrics::counter!("kvrouted_bridge_rejected_total", "reason" => reason).absolute(0);
    }
    Ok(handle)
}

pub async fn serve(
    listener: tokio::net::TcpListener,
    prometheus: PrometheusHandle,
    health: Arc<Health>,
) {
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let p = prometheus.clone();
                async move { p.render() }
            }),
        )
        .route("/healthz", get(healthz))
        .with_state(health);
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("HTTP server stopped: {e}");
    }
}

/// 200 while the process runs; `status` is `degraded` when NATS or an engine socket is down.
async fn healthz(State(health): State<Arc<Health>>) -> impl IntoResponse {
    let ranks: Vec<serde_json::Value> = health
        .ranks
        .iter()
        .map(|r| {
            let last = r.last_acked.load(Ordering::Acquire);
            serde_json::json!({
                "rank": r.rank,
                "engine_connected": r.engine_connected.load(Ordering::Acquire),
                "last_forwarded_seq": (last != u64::MAX).then_some(last),
                "epoch": *r.epoch.lock().unwrap_or_else(|e| e.into_inner()),
            })
        })
        .collect();
    let ok = health.nats_connected()
        && health
            .ranks
            .iter()
            .all(|r| r.engine_connected.load(Ordering::Acquire));
    (
        StatusCode::OK,
        Json(serde_json::json!({
            "status": if ok { "ok" } else { "degraded" },
            "nats_connected": health.nats_connected(),
            "ranks": ranks,
        })),
    )
}
