//! The demo's gateways: HTTP to the daemon, as an inference gateway talks to it.
//!
//! Every request goes through one [`Gateway`], built in one place ([`Gateway::new`]): it holds
//! the bearer tokens (`route` scope for routes and releases, `read` for workers and metrics)
//! and, for an HTTPS daemon, the CA certificate to trust.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

/// What `POST /v1/route` is sent.
#[derive(Debug, Clone, Serialize)]
pub struct RouteBody<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<&'a str>,
    pub tokens: &'a [u32],
    pub max_output_tokens: u64,
    pub request_id: String,
}

/// The part of a route reply the demo uses.
#[derive(Debug, Clone, Deserialize)]
pub struct RouteReply {
    pub worker: String,
    pub decision: String,
    pub matched_blocks: u32,
    pub reservation: u64,
}

/// One row of `GET /v1/workers`, the fields the demo checks.
#[derive(Debug, Clone, Deserialize)]
pub struct ListedWorker {
    pub id: String,
    pub blocks: u64,
    /// `None` when the worker's load samples are missing or stale.
    #[serde(default)]
    pub pressure: Option<f64>,
}

#[derive(Deserialize)]
struct WorkerList {
    workers: Vec<ListedWorker>,
}

#[derive(Deserialize)]
struct Readiness {
    status: String,
}

/// Most routes and releases a [`Gateway`] has under way at once.
const MAX_IN_FLIGHT: usize = 64;

/// An HTTP client of one daemon.
#[derive(Debug, Clone)]
pub struct Gateway {
    client: reqwest::Client,
    /// Requests under way at once, as a gateway's connection pool bounds them: without it the
    /// demo's stop (one release per queued request) opens more connections than the daemon's
    /// `--max-connections`, whose surplus it resets.
    in_flight: Arc<Semaphore>,
    base: String,
    /// Bearer tokens for the `route` and `read` scopes, when the API asks for them.
    route_token: Option<String>,
    read_token: Option<String>,
}

/// How the demo authenticates to the daemon's API.
#[derive(Debug, Clone, Default)]
pub struct GatewayAuth {
    pub route_token: Option<String>,
    pub read_token: Option<String>,
    /// PEM CA certificate trusted for an `https://` daemon (else the system's roots).
    pub ca_pem: Option<Vec<u8>>,
}

impl Gateway {
    /// A client of the daemon at `base_url` (`http://HOST:PORT`).
    pub fn new(base_url: &str, auth: GatewayAuth) -> anyhow::Result<Gateway> {
        let base = base_url.trim_end_matches('/').to_string();
        anyhow::ensure!(
            base.starts_with("http://") || base.starts_with("https://"),
            "--daemon {base_url}: expected an http:// or https:// URL, e.g. http://127.0.0.1:8080"
        );
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(10))
            // Below the daemon's idle timeout (`--http-idle-timeout`, 30s by default): a pooled
            // connection the daemon is closing would fail the request sent on it.
            .pool_idle_timeout(Duration::from_secs(15));
        if let Some(pem) = &auth.ca_pem {
            let ca = reqwest::Certificate::from_pem(pem)
                .context("--daemon-ca: not a PEM certificate")?;
            builder = builder
                .tls_built_in_root_certs(false)
                .add_root_certificate(ca);
        }
        let client = builder.build().context("building the HTTP client")?;
        Ok(Gateway {
            client,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            base,
            route_token: auth.route_token,
            read_token: auth.read_token,
        })
    }

    /// A request with the bearer token of its scope, when one is configured.
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let token = match path {
            "/v1/route" | "/v1/release" => &self.route_token,
            _ => &self.read_token,
        };
        let request = self.client.request(method, self.url(path));
        match token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `GET /readyz`: the daemon's readiness status (`ready`, `degraded`, `recovering`, ...).
    pub async fn readiness(&self) -> anyhow::Result<String> {
        let reply = self
            .request(reqwest::Method::GET, "/readyz")
            .send()
            .await
            .with_context(|| format!("cannot reach the kvrouted daemon at {}", self.base))?;
        let body: Readiness = reply
            .json()
            .await
            .with_context(|| format!("{}/readyz did not answer like kvrouted", self.base))?;
        Ok(body.status)
    }

    /// `POST /v1/route`; an error is one line naming the status and the daemon's message.
    pub async fn route(&self, body: &RouteBody<'_>) -> Result<RouteReply, String> {
        let _slot = self.in_flight.acquire().await.expect("never closed");
        let reply = self
            .request(reqwest::Method::POST, "/v1/route")
            .json(body)
            .send()
            .await
            .map_err(|e| format!("POST /v1/route: {:#}", anyhow::Error::new(e)))?;
        let status = reply.status();
        if !status.is_success() {
            let text = reply.text().await.unwrap_or_default();
            return Err(format!("POST /v1/route: {status}: {}", text.trim()));
        }
        reply
            .json()
            .await
            .map_err(|e| format!("POST /v1/route: unreadable reply: {e}"))
    }

    /// `POST /v1/release` of a whole reservation.
    pub async fn release(&self, reservation: u64) -> Result<(), String> {
        let _slot = self.in_flight.acquire().await.expect("never closed");
        let reply = self
            .request(reqwest::Method::POST, "/v1/release")
            .json(&serde_json::json!({ "reservation": reservation }))
            .send()
            .await
            .map_err(|e| format!("POST /v1/release: {:#}", anyhow::Error::new(e)))?;
        let status = reply.status();
        if status.is_success() {
            Ok(())
        } else {
            let text = reply.text().await.unwrap_or_default();
            Err(format!("POST /v1/release: {status}: {}", text.trim()))
        }
    }

    /// `GET /v1/workers`.
    pub async fn workers(&self) -> anyhow::Result<Vec<ListedWorker>> {
        let list: WorkerList = self
            .request(reqwest::Method::GET, "/v1/workers")
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .with_context(|| format!("GET {}/v1/workers", self.base))?
            .json()
            .await
            .with_context(|| format!("GET {}/v1/workers: unreadable reply", self.base))?;
        Ok(list.workers)
    }

    /// `GET /metrics` as Prometheus text.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        self.request(reqwest::Method::GET, "/metrics")
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .with_context(|| format!("GET {}/metrics", self.base))?
            .text()
            .await
            .with_context(|| format!("GET {}/metrics: unreadable reply", self.base))
    }
}
