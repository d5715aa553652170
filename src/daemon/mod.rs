//! `kvrouted serve`: the HTTP port (answering "recovering" meanwhile), recovery, then the writer,
//! the flusher, NATS ingest and the HTTP API.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::config::ServeArgs;
use crate::decisions;
use crate::http::auth::ApiTokens;
use crate::http::server::ServerSettings;
use crate::http::{self, AppState};
use crate::ingest::{self, IngestSettings};
use crate::input::Input;
use crate::journal::Journal;
use crate::prom;
use crate::replay::replay;
use crate::replicas::ReservationSecret;
use crate::router::{Router, RouterConfig};
use crate::status::{Status, EXIT_STORAGE_FAULT};
use crate::writer::{self, apply_journaled, Clock, PendingAcks, WriterSettings};
use metrics_exporter_prometheus::PrometheusHandle;

/// What recovery hands to the running daemon.
struct Recovered {
    journal: Journal,
    router: Router,
    clock: Clock,
    /// The replica id its decisions go out under: `--replica-id` and the data dir's incarnation.
    /// `<--replica-id>:<incarnation>` when decisions are shared.
    replica_id: Option<String>,
    /// The data dir held nothing before this start.
    fresh: bool,
}

/// Loads the latest snapshot, replays the journal after it, and journals this start's settings
/// (with this replica's id and the data dir's reservation secret). Failing to open or read the
/// data dir is fatal: never start with a silently empty index.
fn recover(args: &ServeArgs, mut config: RouterConfig) -> anyhow::Result<Recovered> {
    let started = Instant::now();
    let journal = Journal::open(&args.data_dir)?;
    if !journal.begin_run()? {
        tracing::warn!(
            "the previous kvrouted on this data dir did not stop cleanly: this replica's \
             decisions go out under a new incarnation"
        );
    }
    // A data dir made afresh, or one whose last entries may be lost, is another incarnation:
    // its journal sequences start again from what is durable, and peers skip the sequences
    // they have seen from a replica id.
    let replica_id = match args.replica_id() {
        Some(id) => Some(format!("{id}:{}", journal.incarnation()?)),
        None => None,
    };
    config.replica_id = replica_id.clone().unwrap_or_default();
    config.reservation_secret = Some(ReservationSecret::from_bytes(journal.reservation_secret()?));
    let snapshot = journal.latest_snapshot()?;
    let fresh = snapshot.is_none() && journal.last_seq()?.is_none();
    let snapshot_seq = snapshot.as_ref().map_or(0, |s| s.seq);
    let mut last_at = snapshot.as_ref().map_or(0, |s| s.at_ms);
    let (mut router, stats) = replay(
        snapshot,
        journal.entries_after(snapshot_seq),
        &|_| {},
        |_, entry, _| last_at = entry.at_ms,
    )
    .context("recovering from the journal")?;
    let mut clock = Clock::new(last_at);
    for input in [Input::Configure(Box::new(config)), Input::Resume] {
        if let Err(e) = apply_journaled(&mut router, &journal, &mut clock, input, "start").journaled
        {
            anyhow::bail!(
                "cannot write to the journal in {}: {e}",
                args.data_dir.display()
            );
        }
    }
    journal.flush()?;
    let recovery = started.elapsed();
    metrics::gauge!("kvrouted_recovery_seconds").set(recovery.as_secs_f64());
    let index = router.index_stats();
    tracing::info!(
        data_dir = %args.data_dir.display(),
        snapshot_seq,
        replayed = stats.entries,
        blocks = index.blocks,
        entries = index.entries,
        took_ms = recovery.as_millis() as u64,
        "state recovered"
    );
    Ok(Recovered {
        journal,
        router,
        clock,
        replica_id,
        fresh,
    })
}

/// The HTTP API while the state is being recovered: `/healthz` says the process is up,
/// `/readyz` says `recovering` (503), everything else is a 503 too. Every reply closes its
/// connection so that no client keeps talking to this server once the real API takes over.
fn recovering_app(prometheus: PrometheusHandle) -> axum::Router {
    use axum::http::{header, HeaderValue, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::routing::get;
    use axum::Json;
    use serde_json::json;
    axum::Router::new()
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        .route(
            "/readyz",
            get(|| async {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    Json(json!({"status": "recovering"})),
                )
            }),
        )
        .route(
            "/metrics",
            get(move || async move { prom::render(&prometheus) }),
        )
        .fallback(|| async {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({"error": "recovering state from the journal; not ready yet"})),
            )
        })
        .layer(axum::middleware::map_response(|mut r: Response| async {
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            r.into_response()
        }))
}

/// Checks the HTTP security settings and loads the token file and TLS certificate: any
/// problem is a one-line error before anything starts.
fn http_server_settings(args: &ServeArgs) -> anyhow::Result<ServerSettings> {
    let http = &args.http;
    if http.api_token_file.is_none() && !http.insecure_public && !args.http_addr.ip().is_loopback()
    {
        anyhow::bail!(
            "--http-addr {} is not a loopback address and no --api-token-file is given: \
             anyone reaching it could route, release and read; give --api-token-file (and \
             --tls-cert/--tls-key), or --insecure-public to serve it without authentication",
            args.http_addr
        );
    }
    let tokens = http
        .api_token_file
        .as_deref()
        .map(ApiTokens::load)
        .transpose()?
        .map(Arc::new);
    let tls = match (&http.tls_cert, &http.tls_key) {
        (Some(cert), Some(key)) => Some(http::server::load_tls(cert, key)?),
        _ => None,
    };
    Ok(ServerSettings {
        max_connections: http.max_connections as usize,
        header_timeout: http.http_header_timeout,
        body_timeout: http.http_body_timeout,
        idle_timeout: http.http_idle_timeout,
        tls,
        tokens,
    })
}

/// Re-reads the API token file on every SIGHUP; a file that does not parse keeps the tokens in
/// force. Installed without a token file too, so that SIGHUP never kills the daemon.
fn reload_tokens_on_sighup(tokens: Option<Arc<ApiTokens>>) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hangups = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            let Some(tokens) = &tokens else {
                tracing::info!("SIGHUP: no --api-token-file to reload");
                continue;
            };
            match tokens.reload() {
                Ok(n) => {
                    metrics::counter!("kvrouted_api_token_reloads_total", "outcome" => "ok")
                        .increment(1);
                    tracing::info!(tokens = n, "SIGHUP: API tokens reloaded");
                }
                Err(e) => {
                    metrics::counter!("kvrouted_api_token_reloads_total", "outcome" => "error")
                        .increment(1);
                    tracing::error!("SIGHUP: {e:#}; keeping the previous tokens");
                }
            }
        }
    });
    Ok(())
}

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let server_settings = http_server_settings(&args)?;
    let status = Arc::new(Status::default());
    status
        .shares_decisions
        .store(args.replica_id().is_some(), Ordering::Release);
    // Credentials and TLS files are read now: a bad one is an error before anything starts.
    let events_status = status.clone();
    let nats_options = args
        .nats
        .reconnecting_options("kvrouted", move |connected| {
            events_status.on_nats_connected(connected);
            if !connected {
                metrics::counter!("kvrouted_nats_reconnects_total").increment(1);
                tracing::warn!(
                    "NATS disconnected; reconnecting with backoff, routing on the last known state"
                );
            }
        })?;
    let prometheus = prom::install()?;
    let config = args.router_config();
    reload_tokens_on_sighup(server_settings.tokens.clone())?;

    // The HTTP port first, so that probes see the process up and not ready while a large state
    // is recovered; the real API takes the same socket afterwards.
    let socket = std::net::TcpListener::bind(args.http_addr)
        .with_context(|| format!("cannot listen on {} (--http-addr)", args.http_addr))?;
    socket.set_nonblocking(true)?;
    let (recovered_tx, recovered_rx) = tokio::sync::oneshot::channel::<()>();
    let recovering_server = {
        let listener = tokio::net::TcpListener::from_std(socket.try_clone()?)?;
        let app = recovering_app(prometheus.clone());
        let settings = server_settings.clone();
        tokio::spawn(async move {
            let _ = http::server::serve(listener, app, settings, async {
                let _ = recovered_rx.await;
            })
            .await;
        })
    };

    // NATS: connect in the background (meanwhile recovery runs) and keep retrying; routes are
    // served while it is down.
    let client = args.nats.connect(nats_options).await?;
    let recovered = {
        let args = args.clone();
        let config = config.clone();
        tokio::task::spawn_blocking(move || recover(&args, config))
            .await
            .context("recovery panicked")??
    };
    let Recovered {
        journal,
        router,
        clock,
        replica_id,
        fresh,
    } = recovered;
    match &replica_id {
        Some(id) => tracing::info!(replica_id = %id, "sharing decisions with peer replicas"),
        None => tracing::info!("running alone (no --replica-id): decisions are not shared"),
    }

    // Hand the socket over: the recovering server stops accepting (connections arriving
    // meanwhile wait in the backlog), then the real API serves them.
    let _ = recovered_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(2), recovering_server).await;
    status.recovered.store(true, Ordering::Release);

    let pending = Arc::new(PendingAcks::new(status.journal_fault.clone()));
    let decisions = replica_id.as_ref().map(|id| {
        decisions::spawn_publisher(
            client.clone(),
            format!("{}.decisions.{id}", args.subject_prefix),
            !args.no_jetstream,
        )
    });
    let (writer, writer_thread) = writer::spawn(
        router,
        journal.clone(),
        clock,
        pending.clone(),
        WriterSettings {
            snapshot_interval: args.snapshot_interval,
            journal_max_age: args.journal_max_age,
            journal_max_bytes: args.journal_max_bytes,
        },
        decisions,
    );
    tokio::spawn(writer::run_flusher(
        journal.clone(),
        pending.clone(),
        args.flush_interval,
        args.soft_flush_interval,
    ));

    let settings = IngestSettings {
        subject_prefix: args.subject_prefix.clone(),
        stream: args.stream.clone(),
        consumer: args.consumer.clone(),
        jetstream: !args.no_jetstream,
        max_payload_bytes: args.max_body_bytes,
        stream_replicas: args.stream_replicas.into(),
        replica_id: replica_id.clone(),
        decisions_stream: args.decisions_stream(),
        decisions_max_age: args.decisions_max_age,
        decisions_consumer: args.decisions_consumer(),
        fresh_data_dir: fresh,
    };
    tokio::spawn(ingest::run(
        client.clone(),
        settings,
        writer.clone(),
        status.clone(),
    ));

    // Housekeeping ticks (journaled) and state gauges.
    {
        let writer = writer.clone();
        let status = status.clone();
        let client = client.clone();
        let period = args.tick_interval;
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(period);
            loop {
                ticker.tick().await;
                let connected =
                    client.connection_state() == async_nats::connection::State::Connected;
                status.nats_connected.store(connected, Ordering::Release);
                if writer.submit(Input::Tick, "tick", None).await.is_err()
                    || writer.query(prom::record_state).await.is_err()
                {
                    return;
                }
            }
        });
    }

    let listener = tokio::net::TcpListener::from_std(socket)?;
    tracing::info!(
        http = %listener.local_addr()?,
        tls = server_settings.tls.is_some(),
        auth = server_settings.tokens.is_some(),
        nats = args.nats.redacted_url(),
        "kvrouted serving"
    );
    let fault = status.journal_fault.clone();
    let app = http::app(
        AppState {
            writer: writer.clone(),
            status,
            prometheus,
            max_prompt_tokens: args.max_prompt_tokens,
        },
        args.max_body_bytes,
    );
    let stop = async {
        tokio::select! {
            _ = shutdown_signal() => {}
            _ = async {
                fault.occurred().await;
                // Long enough for probes and load balancers to see `/readyz` say why.
                tokio::time::sleep(FAULT_EXIT_AFTER).await;
            } => tracing::error!(
                "stopping after a journal fault, so that a supervisor restarts kvrouted from its \
                 journal"
            ),
        }
    };
    http::server::serve(listener, app, server_settings, stop).await?;

    if fault.failed() {
        tracing::info!("shutting down: no final snapshot (the state is not the journal's)");
    } else {
        tracing::info!("shutting down: writing a final snapshot");
    }
    let finish = async {
        writer.shutdown().await;
        let _ = tokio::task::spawn_blocking(move || writer_thread.join()).await;
        // The final snapshot flushed the journal: ack what it covers, so a clean restart does
        // not see those messages again.
        writer::flush_and_ack(&journal, &pending).await;
        if !fault.failed() {
            if let Err(e) = journal.end_run() {
                tracing::warn!("could not mark the clean stop in the data dir: {e}");
            }
        }
        // With the broker down a flush would wait forever: give it a moment, then stop anyway.
        let _ = tokio::time::timeout(Duration::from_secs(2), client.flush()).await;
    };
    let finished = tokio::time::timeout(args.shutdown_timeout, finish)
        .await
        .is_ok();
    if let Some(reason) = fault.reason() {
        exit_storage_fault(&format!("a journal write failed while serving ({reason})"));
    }
    if !finished {
        exit_storage_fault(&format!(
            "the final snapshot and journal flush did not finish within {:?} \
             (--shutdown-timeout); the journal up to its last flush is kept",
            args.shutdown_timeout
        ));
    }
    tracing::info!("stopped");
    Ok(())
}

/// How long the daemon keeps answering `/readyz` (503, with the reason) after a journal fault
/// before it stops by itself.
const FAULT_EXIT_AFTER: Duration = Duration::from_secs(15);

/// Ends the process with [`EXIT_STORAGE_FAULT`] at once. Destructors are skipped on purpose:
/// sled's, on a failed disk, wait for a flush that never completes (which is what a stop
/// without this deadline did until killed). Unacked JetStream messages are delivered again to
/// the restarted daemon, which recovers from the journal.
fn exit_storage_fault(reason: &str) -> ! {
    tracing::error!(
        exit_code = EXIT_STORAGE_FAULT,
        "stopped by a storage fault: {reason}; restart kvrouted once the data dir can be written"
    );
    std::process::exit(i32::from(EXIT_STORAGE_FAULT))
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install SIGTERM handler");
    tokio::select! {
        _ = ctrl_c => {},
        _ = term.recv() => {},
    }
}
