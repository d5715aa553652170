//! `kvrouted serve`: recovery, then the writer, the flusher, NATS ingest and the HTTP API.

pub mod writer;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;

use crate::config::ServeArgs;
use crate::http::{self, AppState};
use crate::ingest::{self, IngestSettings, Status};
use crate::input::Input;
use crate::journal::Journal;
use crate::metrics;
use crate::replay::replay;
use writer::{apply_journaled, Clock, PendingAcks, WriterSettings};

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let prometheus = metrics::install()?;
    let status = Arc::new(Status::default());
    let config = args.router_config();

    // Recovery: the latest snapshot plus the journal after it. Failing to open the data dir is
    // fatal: never start with a silently empty index.
    let started = Instant::now();
    let journal = Journal::open(&args.data_dir)?;
    let snapshot = journal.latest_snapshot()?;
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
    apply_journaled(
        &mut router,
        &journal,
        &mut clock,
        Input::Configure(Box::new(config.clone())),
        "start",
    );
    apply_journaled(&mut router, &journal, &mut clock, Input::Resume, "start");
    journal.flush()?;
    let recovery = started.elapsed();
    ::metrics::gauge!("kvrouted_recovery_seconds").set(recovery.as_secs_f64());
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
    status.recovered.store(true, Ordering::Release);

    let pending = Arc::new(PendingAcks::default());
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
    );
    tokio::spawn(writer::run_flusher(
        journal.clone(),
        pending,
        args.flush_interval,
    ));

    // NATS: connect in the background and keep retrying; routes are served meanwhile.
    let events_status = status.clone();
    let client = async_nats::ConnectOptions::new()
        .name("kvrouted")
        .retry_on_initial_connect()
        .max_reconnects(None)
        .event_callback(move |event| {
            let status = events_status.clone();
            async move {
                match event {
                    async_nats::Event::Connected => {
                        status.nats_connected.store(true, Ordering::Release);
                        tracing::info!("NATS connected");
                    }
                    async_nats::Event::Disconnected => {
                        status.nats_connected.store(false, Ordering::Release);
                        ::metrics::counter!("kvrouted_nats_reconnects_total").increment(1);
                        tracing::warn!("NATS disconnected; reconnecting with backoff, routing on the last known state");
                    }
                    other => tracing::info!("NATS: {other}"),
                }
            }
        })
        .connect(&args.nats_url)
        .await
        .with_context(|| format!("invalid NATS url {}", args.nats_url))?;
    tokio::spawn(ingest::run(
        client.clone(),
        IngestSettings {
            subject_prefix: args.subject_prefix.clone(),
            stream: args.stream.clone(),
            consumer: args.consumer.clone(),
            jetstream: !args.no_jetstream,
            max_payload_bytes: args.max_body_bytes,
        },
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
                    || writer.query(metrics::record_state).await.is_err()
                {
                    return;
                }
            }
        });
    }

    let listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .with_context(|| format!("cannot listen on {} (--http-addr)", args.http_addr))?;
    tracing::info!(http = %listener.local_addr()?, nats = args.nats_url, "kvrouted serving");
    let app = http::app(
        AppState {
            writer: writer.clone(),
            status,
            prometheus,
            block_size: config.block_size as usize,
            max_prompt_tokens: args.max_prompt_tokens,
        },
        args.max_body_bytes,
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await?;

    tracing::info!("shutting down: writing a final snapshot");
    writer.shutdown().await;
    let _ = tokio::task::spawn_blocking(move || writer_thread.join()).await;
    client.flush().await.ok();
    tracing::info!("stopped");
    Ok(())
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
