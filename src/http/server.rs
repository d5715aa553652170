//! Serving the HTTP API: the accept loop, the connection cap with its probe lane, the header,
//! body and idle timeouts, optional TLS (rustls) and the token check.
//!
//! Why not `axum::serve`: it has no connection cap and no timeouts, so idle or slow sockets
//! (slowloris) pile up until the process runs out of file descriptors and even `/healthz`
//! stops answering. Here:
//!
//! - At most `max_connections` connections are served. Past that, a small reserve of
//!   connections is served `/healthz` and `/readyz` only (everything else a 503), one request
//!   each with short timeouts. When the reserve is full, a new connection takes the place of the
//!   oldest reserve connection that has not sent a byte yet (a flood of idle sockets cannot hold
//!   the reserve); if every one is mid-request, the new connection is reset at once. So probes
//!   keep answering under a connection flood, and descriptors stay bounded.
//! - A connection with no request in progress (new, or kept alive) that sends nothing for the
//!   idle timeout is closed; once a request's first byte arrives its line and headers must be
//!   complete within the header timeout (a TLS handshake too, from the connection's start).
//! - A request body must arrive within the body timeout after its headers (408 otherwise).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use hyper::body::{Frame, SizeHint};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, Semaphore};
use tokio::time::Instant;
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use super::auth::{self, ApiTokens};

/// Connections past `max_connections` that are still served the probes.
pub const PROBE_RESERVE: usize = 32;
/// Timeouts of a probe-lane connection: it gets one request, quickly, or is closed.
const PROBE_LANE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a stopping server waits for open connections to finish their request.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How the API is served.
#[derive(Clone)]
pub struct ServerSettings {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub idle_timeout: Duration,
    pub tls: Option<TlsAcceptor>,
    pub tokens: Option<Arc<ApiTokens>>,
}

/// Loads a PEM certificate chain and private key into a TLS acceptor (HTTP/1.1 over rustls).
pub fn load_tls(cert: &Path, key: &Path) -> anyhow::Result<TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        .map_err(|e| anyhow::anyhow!("--tls-cert {}: {e}", cert.display()))?;
    if certs.is_empty() {
        anyhow::bail!("--tls-cert {}: no certificate in the file", cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| anyhow::anyhow!("--tls-key {}: {e}", key.display()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| anyhow::anyhow!("--tls-cert/--tls-key: {e}"))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Zeros for every bounded label, so dashboards see the series before the first event.
fn register_metrics() {
    for failure in auth::AuthFailure::ALL {
        metrics::counter!("kvrouted_http_auth_failures_total", "reason" => failure.as_str())
            .absolute(0);
    }
    for outcome in ["probes_only", "evicted", "closed"] {
        metrics::counter!("kvrouted_http_connections_shed_total", "outcome" => outcome).absolute(0);
    }
    for phase in Phase::LABELS {
        metrics::counter!("kvrouted_http_timeouts_total", "phase" => phase).absolute(0);
    }
}

fn count_timeout(phase: &'static str) {
    metrics::counter!("kvrouted_http_timeouts_total", "phase" => phase).increment(1);
}

/// The layers every served app gets: the token check (when configured) and the body deadline.
fn layered(app: axum::Router, settings: &ServerSettings) -> axum::Router {
    let timeout = settings.body_timeout;
    let app = app.layer(middleware::from_fn(move |req: Request, next: Next| {
        body_deadline(req, next, timeout)
    }));
    match &settings.tokens {
        Some(tokens) => app.layer(middleware::from_fn_with_state(
            tokens.clone(),
            auth::require_token,
        )),
        None => app,
    }
}

/// Gives the request body a deadline; a body that misses it turns the reply into a 408 and
/// closes the connection.
async fn body_deadline(req: Request, next: Next, timeout: Duration) -> Response {
    let deadline = Instant::now() + timeout;
    let missed = Arc::new(AtomicBool::new(false));
    let flag = missed.clone();
    let req = req.map(|body| {
        let stream = futures::stream::unfold(
            (body.into_data_stream(), flag, false),
            move |(mut data, flag, done)| async move {
                if done {
                    return None;
                }
                match tokio::time::timeout_at(deadline, data.next()).await {
                    Ok(Some(chunk)) => Some((chunk, (data, flag, false))),
                    Ok(None) => None,
                    Err(_) => {
                        flag.store(true, Ordering::Release);
                        let error = axum::Error::new(format!(
                            "request body not received within {timeout:?} (--http-body-timeout)"
                        ));
                        Some((Err(error), (data, flag, true)))
                    }
                }
            },
        );
        Body::from_stream(stream)
    });
    let response = next.run(req).await;
    if !missed.load(Ordering::Acquire) {
        return response;
    }
    count_timeout("body");
    let mut response = (
        StatusCode::REQUEST_TIMEOUT,
        Json(json!({"error": format!(
            "request body not received within {timeout:?} (--http-body-timeout)"
        )})),
    )
        .into_response();
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// The probe lane's app: `/healthz` and `/readyz` as usual, everything else a 503.
async fn probes_only(req: Request, next: Next) -> Response {
    let mut response = match req.uri().path() {
        "/healthz" | "/readyz" => next.run(req).await,
        _ => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "too many connections (--max-connections); retry shortly"})),
        )
            .into_response(),
    };
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Serves `app` on `listener` until `shutdown` completes, then lets open connections finish
/// their request (for a few seconds at most).
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    settings: ServerSettings,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    register_metrics();
    let app = layered(app, &settings);
    let probe_app = app.clone().layer(middleware::from_fn(probes_only));
    let main_lane = Lane {
        slots: Arc::new(Semaphore::new(settings.max_connections)),
        capacity: settings.max_connections,
        limits: Limits {
            header: settings.header_timeout,
            idle: settings.idle_timeout,
            keep_alive: true,
        },
        app,
    };
    let probe_lane = ProbeLane {
        open: Mutex::new(VecDeque::with_capacity(PROBE_RESERVE + 1)),
        limits: Limits {
            header: settings.header_timeout.min(PROBE_LANE_TIMEOUT),
            idle: settings.idle_timeout.min(PROBE_LANE_TIMEOUT),
            keep_alive: false,
        },
        app: probe_app,
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let open = metrics::gauge!("kvrouted_http_connections");
    tokio::pin!(shutdown);
    let mut accept_errors = AcceptErrorLog::default();
    loop {
        let (tcp, _peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of descriptors (or a connection reset before accept): back off
                    // briefly rather than spin; connections wait in the backlog meanwhile.
                    accept_errors.record(&e);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        let activity = Arc::new(Activity::new());
        let (app, limits, permit) = if let Ok(p) = main_lane.slots.clone().try_acquire_owned() {
            (main_lane.app.clone(), main_lane.limits, Some(p))
        } else if probe_lane.admit(&activity) {
            metrics::counter!("kvrouted_http_connections_shed_total", "outcome" => "probes_only")
                .increment(1);
            (probe_lane.app.clone(), probe_lane.limits, None)
        } else {
            metrics::counter!("kvrouted_http_connections_shed_total", "outcome" => "closed")
                .increment(1);
            // Reset rather than linger: the descriptor is free at once.
            let _ = tcp.set_zero_linger();
            drop(tcp);
            continue;
        };
        let tls = settings.tls.clone();
        let stop = stop_rx.clone();
        let open = open.clone();
        open.increment(1.0);
        tokio::spawn(async move {
            serve_connection(tcp, tls, app, limits, activity.clone(), stop).await;
            activity.finished.store(true, Ordering::Release);
            open.decrement(1.0);
            drop(permit);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Probe-lane connections need no wait: one request each, with short timeouts.
    let drained = main_lane.slots.acquire_many(main_lane.capacity as u32);
    if tokio::time::timeout(SHUTDOWN_GRACE, drained).await.is_err() {
        tracing::warn!(
            "HTTP connections still open {SHUTDOWN_GRACE:?} after shutdown; leaving them"
        );
    }
    Ok(())
}

struct Lane {
    slots: Arc<Semaphore>,
    capacity: usize,
    limits: Limits,
    app: axum::Router,
}

/// The reserve past the connection cap: its open connections, oldest first.
struct ProbeLane {
    open: Mutex<VecDeque<Arc<Activity>>>,
    limits: Limits,
    app: axum::Router,
}

impl ProbeLane {
    /// Admits a connection to the reserve, evicting the oldest one that has not sent a byte if
    /// the reserve is full. `false` when every reserve connection is mid-request.
    fn admit(&self, activity: &Arc<Activity>) -> bool {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.retain(|a| !a.finished.load(Ordering::Acquire));
        if open.len() >= PROBE_RESERVE {
            let Some(oldest_idle) = open.iter().position(|a| a.is_idle()) else {
                return false;
            };
            if let Some(evicted) = open.remove(oldest_idle) {
                evicted.evict.notify_one();
                metrics::counter!("kvrouted_http_connections_shed_total", "outcome" => "evicted")
                    .increment(1);
            }
        }
        open.push_back(activity.clone());
        true
    }
}

#[derive(Debug, Clone, Copy)]
struct Limits {
    header: Duration,
    idle: Duration,
    keep_alive: bool,
}

/// Logs failed accepts at most once a second, with how many were suppressed.
#[derive(Default)]
struct AcceptErrorLog {
    last: Option<std::time::Instant>,
    suppressed: u64,
}

impl AcceptErrorLog {
    fn record(&mut self, e: &io::Error) {
        let now = std::time::Instant::now();
        if self
            .last
            .is_some_and(|at| now.duration_since(at) < Duration::from_secs(1))
        {
            self.suppressed += 1;
            return;
        }
        tracing::warn!(suppressed = self.suppressed, "HTTP accept failed: {e}");
        self.last = Some(now);
        self.suppressed = 0;
    }
}

async fn serve_connection(
    tcp: TcpStream,
    tls: Option<TlsAcceptor>,
    app: axum::Router,
    limits: Limits,
    activity: Arc<Activity>,
    stop: watch::Receiver<bool>,
) {
    let _ = tcp.set_nodelay(true);
    let Some(acceptor) = tls else {
        return serve_io(tcp, app, limits, activity, stop).await;
    };
    let handshake = tokio::select! {
        handshake = tokio::time::timeout(limits.header, acceptor.accept(tcp)) => handshake,
        () = activity.evict.notified() => return,
    };
    match handshake {
        Ok(Ok(stream)) => serve_io(stream, app, limits, activity, stop).await,
        Ok(Err(e)) => {
            metrics::counter!("kvrouted_http_tls_handshake_failures_total").increment(1);
            tracing::debug!("TLS handshake failed: {e}");
        }
        Err(_) => count_timeout("tls_handshake"),
    }
}

async fn serve_io<T>(
    io: T,
    app: axum::Router,
    limits: Limits,
    activity: Arc<Activity>,
    mut stop: watch::Receiver<bool>,
) where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let io = TokioIo::new(Watched {
        inner: io,
        activity: activity.clone(),
    });
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let app = app.clone();
            let guard = RequestGuard::start(activity.clone());
            async move {
                let response = app
                    .oneshot(req.map(Body::new))
                    .await
                    .unwrap_or_else(|never: Infallible| match never {});
                Ok::<_, Infallible>(response.map(|body| GuardedBody {
                    body,
                    _guard: guard,
                }))
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.keep_alive(limits.keep_alive);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            phase = activity.expired(limits) => {
                count_timeout(phase.label());
                return; // dropping the connection closes it
            }
            () = activity.evict.notified() => return,
            changed = stop.changed(), if !stopping => {
                stopping = true;
                if changed.is_ok() {
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// Where a connection stands, for its timeouts.
#[derive(Debug, Clone, Copy)]
enum Phase {
    /// No request in progress and no byte of the next one since `since`.
    Idle { since: Instant },
    /// The first byte of a request arrived at `since`; its headers are not complete yet.
    Head { since: Instant },
    /// `n` requests are being handled (their bodies have their own deadline).
    Busy { n: usize },
}

impl Phase {
    const LABELS: [&'static str; 4] = ["idle", "header", "body", "tls_handshake"];

    fn label(self) -> &'static str {
        match self {
            Phase::Idle { .. } => "idle",
            Phase::Head { .. } => "header",
            Phase::Busy { .. } => "body",
        }
    }
}

/// A connection's phase, updated by its reads and requests, watched for timeouts.
struct Activity {
    phase: Mutex<Phase>,
    changed: Notify,
    /// Closes the connection (a reserve connection making room for a newer one).
    evict: Notify,
    /// The connection is closed.
    finished: AtomicBool,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            phase: Mutex::new(Phase::Idle {
                since: Instant::now(),
            }),
            changed: Notify::new(),
            evict: Notify::new(),
            finished: AtomicBool::new(false),
        }
    }

    /// No request in progress and no byte of the next one.
    fn is_idle(&self) -> bool {
        matches!(
            *self.phase.lock().unwrap_or_else(|e| e.into_inner()),
            Phase::Idle { .. }
        )
    }

    fn update(&self, f: impl FnOnce(Phase) -> Phase) {
        let mut phase = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        *phase = f(*phase);
        drop(phase);
        self.changed.notify_one();
    }

    fn bytes_read(&self) {
        let mut phase = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        if let Phase::Idle { .. } = *phase {
            *phase = Phase::Head {
                since: Instant::now(),
            };
            drop(phase);
            self.changed.notify_one();
        }
    }

    /// Completes with the phase whose timeout passed.
    async fn expired(&self, limits: Limits) -> Phase {
        loop {
            let phase = *self.phase.lock().unwrap_or_else(|e| e.into_inner());
            let deadline = match phase {
                Phase::Idle { since } => Some(since + limits.idle),
                Phase::Head { since } => Some(since + limits.header),
                Phase::Busy { .. } => None,
            };
            match deadline {
                Some(deadline) => tokio::select! {
                    () = tokio::time::sleep_until(deadline) => {
                        let now = *self.phase.lock().unwrap_or_else(|e| e.into_inner());
                        if same_phase(now, phase) {
                            return phase;
                        }
                    }
                    () = self.changed.notified() => {}
                },
                None => self.changed.notified().await,
            }
        }
    }
}

fn same_phase(a: Phase, b: Phase) -> bool {
    match (a, b) {
        (Phase::Idle { since: x }, Phase::Idle { since: y })
        | (Phase::Head { since: x }, Phase::Head { since: y }) => x == y,
        _ => false,
    }
}

/// Marks a request in progress from its dispatch until its response body is done (or dropped).
struct RequestGuard(Arc<Activity>);

impl RequestGuard {
    fn start(activity: Arc<Activity>) -> RequestGuard {
        activity.update(|phase| match phase {
            Phase::Busy { n } => Phase::Busy { n: n + 1 },
            _ => Phase::Busy { n: 1 },
        });
        RequestGuard(activity)
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.update(|phase| match phase {
            Phase::Busy { n } if n > 1 => Phase::Busy { n: n - 1 },
            _ => Phase::Idle {
                since: Instant::now(),
            },
        });
    }
}

/// A response body that holds its request's guard until hyper has written (or dropped) it.
struct GuardedBody {
    body: Body,
    _guard: RequestGuard,
}

impl hyper::body::Body for GuardedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The connection's stream, reporting reads to its [`Activity`].
struct Watched<T> {
    inner: T,
    activity: Arc<Activity>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.bytes_read();
        }
        result
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
