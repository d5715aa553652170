//! The HTTP API (docs/architecture.md, "HTTP API"). Handlers are thin: parse and validate, hash
//! tokens into block keys (outside the writer's lock), call the writer's typed API (applied on this
//! task, see [`crate::writer`]), shape the reply. Every failure is one [`ApiError`]: a status and a
//! one-line `error` JSON body. [`server`] serves them (connection cap, timeouts, TLS) and [`auth`]
//! checks bearer tokens.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Extension, FromRequest, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router as HttpRouter};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::hashing;
use crate::input::{RejectReason, Rejection, RouteRequest, WorkerId, MAX_NAME_LEN};
use crate::prom::reject;
use crate::reservations::ReleasePhase;
use crate::status::Status;
use crate::writer::{RouteError, Unavailable, WriterGone, WriterHandle};

pub mod auth;
pub mod route_body;
pub mod server;
mod token_list;

use route_body::RouteBody;

/// Explicit handler state, shared by every request behind one `Arc`: axum clones the state for
/// each request, and a clone of the fields themselves (the writer's channels and shared parts,
/// the status, the Prometheus handle) took a dozen atomic reference counts, on lines both
/// cores were updating (1% of the daemon's time at concurrency 16).
pub struct AppState {
    pub writer: WriterHandle,
    pub status: Arc<Status>,
    pub prometheus: PrometheusHandle,
    pub max_prompt_tokens: usize,
}

pub fn app(state: AppState, max_body_bytes: usize) -> HttpRouter {
    HttpRouter::new()
        .route("/v1/route", post(route))
        .route("/v1/release", post(release))
        .route("/v1/workers", get(workers))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/readyz", get(readyz))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(Extension(BodyLimit(max_body_bytes)))
        .with_state(Arc::new(state))
}

/// The configured body limit (`--max-body-bytes`), for the 413 message.
#[derive(Debug, Clone, Copy)]
struct BodyLimit(usize);

/// An error reply: a status and a one-line message.
pub struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

impl From<WriterGone> for ApiError {
    fn from(e: WriterGone) -> Self {
        ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
    }
}

impl From<Unavailable> for ApiError {
    fn from(e: Unavailable) -> Self {
        ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
    }
}

impl From<RouteError> for ApiError {
    fn from(e: RouteError) -> Self {
        ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
    }
}

fn bad_request(reason: RejectReason, detail: String) -> ApiError {
    reject(&Rejection::new(reason, detail.clone()), "http");
    ApiError(StatusCode::BAD_REQUEST, detail)
}

/// A request body read within `--max-body-bytes`. Handlers take it as
/// `Result<RequestBody, ApiError>`, so their error replies and metrics cover it too.
struct RequestBody(Bytes);

impl<S: Send + Sync> FromRequest<S> for RequestBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .copied()
            .expect("app() installs the body limit");
        body_bytes(Bytes::from_request(req, state).await, limit).map(RequestBody)
    }
}

/// The request body, or a one-line error: over `--max-body-bytes` is a counted `413`, not
/// axum's plain-text rejection.
fn body_bytes(body: Result<Bytes, BytesRejection>, limit: BodyLimit) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        let status = rejection.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            let detail = format!(
                "request body exceeds the limit of {} bytes (--max-body-bytes)",
                limit.0
            );
            reject(
                &Rejection::new(RejectReason::OversizePayload, detail.clone()),
                "http",
            );
            ApiError(status, detail)
        } else {
            ApiError(
                status,
                format!("cannot read the request body: {}", rejection.body_text()),
            )
        }
    })
}

fn is_msgpack(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.starts_with("application/msgpack") || v.starts_with("application/x-msgpack")
        })
}

/// Parses a JSON or MessagePack body into `T`, with a one-line error.
fn parse_body<T: DeserializeOwned>(headers: &HeaderMap, body: &[u8]) -> Result<T, ApiError> {
    let parsed = if is_msgpack(headers) {
        rmp_serde::from_slice(body).map_err(|e| e.to_string())
    } else {
        serde_json::from_slice(body).map_err(|e| e.to_string())
    };
    parsed.map_err(|e| {
        bad_request(
            RejectReason::InvalidField,
            format!("invalid request body: {e}"),
        )
    })
}

/// Replies in the request's encoding.
fn reply<T: Serialize>(headers: &HeaderMap, status: StatusCode, value: &T) -> Response {
    if is_msgpack(headers) {
        let bytes = rmp_serde::to_vec_named(value).expect("replies serialize");
        (
            status,
            [(header::CONTENT_TYPE, "application/msgpack")],
            bytes,
        )
            .into_response()
    } else {
        (status, Json(value)).into_response()
    }
}

/// Parses a route body ([`route_body::parse`]), with a one-line error.
fn parse_route_body(headers: &HeaderMap, body: &[u8]) -> Result<RouteBody, ApiError> {
    route_body::parse(is_msgpack(headers), body).map_err(|e| {
        bad_request(
            RejectReason::InvalidField,
            format!("invalid request body: {e}"),
        )
    })
}

const MAX_REQUEST_ID: usize = 256;

/// Most workers one route may exclude. A gateway excludes the few workers that just failed a
/// request; a longer list is a mistake or an attack, and each route's work must stay bounded.
pub const MAX_EXCLUDE: usize = 1024;

/// Validates a route body and hashes its tokens into block keys.
fn route_request(state: &AppState, body: RouteBody) -> Result<RouteRequest, ApiError> {
    // Each model's own block size, so the prompt is keyed as its KV events are.
    let bs = state.writer.block_size_of(body.model.as_deref()) as usize;
    let too_large = |tokens: usize| {
        reject(
            &Rejection::new(
                RejectReason::OversizePayload,
                format!("prompt of {tokens} tokens"),
            ),
            "http",
        );
        ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "prompt of {tokens} tokens exceeds the limit of {} (--max-prompt-tokens)",
                state.max_prompt_tokens
            ),
        )
    };
    let (keys, prompt_tokens) = match (body.tokens, body.block_keys) {
        (Some(tokens), None) => {
            if tokens.len() > state.max_prompt_tokens {
                return Err(too_large(tokens.len()));
            }
            (hashing::block_keys(&tokens, bs), tokens.len() as u64)
        }
        (None, Some(keys)) => {
            let tokens = keys.len().saturating_mul(bs);
            if tokens > state.max_prompt_tokens {
                return Err(too_large(tokens));
            }
            let prompt = body.prompt_tokens.unwrap_or(tokens as u64);
            // The stated size counts as reserved work: bounded like a token list, so no value
            // can wrap the arithmetic or steer routes away from a worker for the reservation's
            // lifetime.
            if prompt > state.max_prompt_tokens as u64 {
                return Err(too_large(usize::try_from(prompt).unwrap_or(usize::MAX)));
            }
            (keys, prompt)
        }
        _ => {
            return Err(bad_request(
                RejectReason::InvalidField,
                "give exactly one of tokens or block_keys".into(),
            ))
        }
    };
    if body
        .request_id
        .as_ref()
        .is_some_and(|id| id.len() > MAX_REQUEST_ID)
    {
        return Err(bad_request(
            RejectReason::InvalidField,
            format!("request_id longer than {MAX_REQUEST_ID} bytes"),
        ));
    }
    for (field, name) in [("model", &body.model), ("lora", &body.lora)] {
        if name.as_ref().is_some_and(|n| n.len() > MAX_NAME_LEN) {
            return Err(bad_request(
                RejectReason::InvalidField,
                format!("{field} longer than {MAX_NAME_LEN} bytes"),
            ));
        }
    }
    if body.exclude.len() > MAX_EXCLUDE {
        return Err(bad_request(
            RejectReason::InvalidField,
            format!(
                "exclude lists {} workers; at most {MAX_EXCLUDE} may be excluded",
                body.exclude.len()
            ),
        ));
    }
    let exclude = body
        .exclude
        .iter()
        .map(|w| WorkerId::new(w))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad_request(RejectReason::InvalidWorkerId, format!("exclude: {e}")))?;
    Ok(RouteRequest {
        model: body.model.filter(|m| !m.is_empty()),
        lora: body.lora.filter(|l| !l.is_empty()),
        keys,
        prompt_tokens,
        max_output_tokens: body.max_output_tokens,
        exclude,
        request_id: body.request_id,
        explain: body.explain,
    })
}

async fn route(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<RequestBody, ApiError>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let response = async {
        let RequestBody(body) = body?;
        let body = parse_route_body(&headers, &body)?;
        let request = route_request(&state, body)?;
        let decision = state.writer.route(request).await?;
        Ok(reply(&headers, StatusCode::OK, &decision))
    }
    .await;
    crate::prom::handles().route_took(started.elapsed().as_secs_f64());
    response
}

#[derive(Debug, Deserialize)]
struct ReleaseBody {
    reservation: u64,
    /// `prefill`: the gateway saw the first token; only the prefill part is given back.
    #[serde(default)]
    phase: Option<ReleasePhase>,
}

async fn release(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<RequestBody, ApiError>,
) -> Result<Response, ApiError> {
    let RequestBody(body) = body?;
    let ReleaseBody { reservation, phase } = parse_body(&headers, &body)?;
    if !state.writer.release(reservation, phase).await? {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("reservation {reservation} is unknown, released or expired"),
        ));
    }
    let released = match phase {
        Some(phase) => json!({ "released": reservation, "phase": phase }),
        None => json!({ "released": reservation }),
    };
    Ok(reply(&headers, StatusCode::OK, &released))
}

async fn workers(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let rows = state.writer.workers().await?;
    Ok(Json(json!({ "workers": rows })).into_response())
}

async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::prom::render(&state.prometheus),
    )
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    let s = &state.status;
    if let Some(reason) = s.journal_fault.reason() {
        // Inputs are refused until a restart: out of rotation, saying why.
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "journal_fault", "reason": reason})),
        )
            .into_response();
    }
    if !s.recovered.load(Ordering::Acquire) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "recovering"})),
        )
            .into_response();
    }
    let subscribed = s.core_subscribed.load(Ordering::Acquire);
    let subscriptions_live =
        subscribed > 0 && subscribed >= s.core_expected.load(Ordering::Acquire);
    // Connected again but the stream and consumer are not back yet (a broker restarted empty):
    // events published now would not be captured, so not ready.
    let consumer_missing = s.consumer_missing() && s.nats_connected.load(Ordering::Acquire);
    if !s.caught_up() || !subscriptions_live || consumer_missing {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "catching_up"})),
        )
            .into_response();
    }
    if !s.nats_connected.load(Ordering::Acquire) {
        // Still serving routes from the last known state: stay in rotation, say degraded.
        return Json(json!({"status": "degraded", "reason": "NATS disconnected; routing on the last known state"}))
            .into_response();
    }
    Json(json!({"status": "ready"})).into_response()
}
