//! `kvrouted bridge`: the sidecar that makes a vLLM, SGLang or TensorRT-LLM engine a kvrouted
//! worker without changing the engine (docs/engines.md).
//!
//! Engines publish KV events on ZeroMQ and their load only on a Prometheus endpoint. The bridge
//! runs beside the engine and:
//!
//! - subscribes to the engine's KV-event PUB socket, one per dp rank ([`rank`]), and forwards
//!   every batch untouched to `<prefix>.events.<worker>` on JetStream with `Kv-Seq`, `Kv-Epoch`,
//!   `Kv-Model` and `Kv-Dp-Rank`, in the engine's order, waiting for the stream's acks
//!   ([`forward`]);
//! - repairs sequence gaps from the engine's replay socket ([`replay`]), and counts what the
//!   engine no longer buffers as lost;
//! - resumes after a restart of its own from the last batch it forwarded (read back from the
//!   stream), and starts a new epoch when the engine restarted ([`cursor`]);
//! - scrapes the engine's metrics into load samples ([`load`]);
//! - announces `join`, `drain` (SIGUSR1) and `leave` (SIGTERM, SIGINT) ([`lifecycle`]);
//! - serves its own `/metrics` and `/healthz` ([`http`]).

pub mod cursor;
pub mod forward;
pub mod frames;
pub mod http;
pub mod lifecycle;
pub mod load;
pub mod prom_text;
pub mod rank;
pub mod replay;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokio::signal::unix::{signal, SignalKind};

use crate::input::{LifecycleOp, WorkerId};
use crate::nats_options::NatsArgs;
use crate::wire::{encode_lifecycle_message, LifecycleMessage};
use cursor::{Epochs, RankCursor};
use load::Engine;

/// Flags of `kvrouted bridge`.
#[derive(Debug, Clone, Args)]
pub struct BridgeArgs {
    /// The engine's KV-event PUB socket for dp rank 0 (the engine's `endpoint` with its host);
    /// rank r uses this port + r
    #[arg(long, env = "KVROUTED_BRIDGE_ZMQ", value_name = "tcp://HOST:PORT")]
    pub zmq: String,
    /// The engine's replay socket (ROUTER) for dp rank 0; rank r uses this port + r. Without
    /// it gaps cannot be repaired and a restarted bridge forwards only what is new
    #[arg(long, env = "KVROUTED_BRIDGE_REPLAY", value_name = "tcp://HOST:PORT")]
    pub replay: Option<String>,
    /// Data-parallel ranks of the engine (one PUB and one replay socket each)
    #[arg(long, env = "KVROUTED_BRIDGE_DP_SIZE", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub dp_size: u32,
    /// The engine's KV-event topic (its `topic` setting); empty matches the engines' default
    #[arg(long, env = "KVROUTED_BRIDGE_TOPIC", default_value = "")]
    pub topic: String,
    /// The engine's Prometheus endpoint; without it no load samples are published
    #[arg(
        long,
        env = "KVROUTED_BRIDGE_METRICS",
        value_name = "http://HOST:PORT/metrics"
    )]
    pub metrics: Option<String>,
    /// Which engine's metric names to read
    #[arg(
        long,
        env = "KVROUTED_BRIDGE_ENGINE",
        value_enum,
        default_value = "vllm"
    )]
    pub engine: Engine,
    /// The engine's batch limit (vLLM `--max-num-seqs`, SGLang `--max-running-requests`):
    /// queue pressure is (running + waiting) / this; at most 1,000,000
    #[arg(long, env = "KVROUTED_BRIDGE_MAX_RUNNING",
          value_parser = clap::value_parser!(u32).range(0..=i64::from(crate::input::MAX_LOAD_COUNT)))]
    pub max_running: Option<u32>,
    /// How often to scrape the metrics endpoint and publish load samples
    #[arg(long, env = "KVROUTED_BRIDGE_LOAD_INTERVAL", default_value = "1s", value_parser = humantime::parse_duration)]
    pub load_interval: Duration,
    /// The worker id this engine is known by (1–128 of A-Z a-z 0-9 _ - :)
    #[arg(long, env = "KVROUTED_BRIDGE_WORKER")]
    pub worker: String,
    /// The model the engine serves (its served model name); sent as `Kv-Model` and in the join
    #[arg(long, env = "KVROUTED_BRIDGE_MODEL")]
    pub model: Option<String>,
    /// The engine's KV block size in tokens, announced in the join
    #[arg(long, env = "KVROUTED_BRIDGE_BLOCK_SIZE", value_parser = clap::value_parser!(u32).range(1..))]
    pub block_size: Option<u32>,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Address of the bridge's own /metrics and /healthz
    #[arg(
        long,
        env = "KVROUTED_BRIDGE_HTTP_ADDR",
        default_value = "127.0.0.1:9090"
    )]
    pub http_addr: SocketAddr,
    /// NATS subject prefix (as the daemon's)
    #[arg(long, env = "KVROUTED_SUBJECT_PREFIX", default_value = "kv")]
    pub subject_prefix: String,
    /// JetStream stream that captures KV events (as the daemon's); created when missing
    #[arg(long, env = "KVROUTED_STREAM", default_value = "KVROUTED")]
    pub stream: String,
    /// Batches published to JetStream per rank whose acks may be outstanding at once
    #[arg(long, env = "KVROUTED_BRIDGE_ACK_WINDOW", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub ack_window: u32,
    /// With no KV event from a rank for this long, ask its replay socket whether one was missed
    #[arg(long, env = "KVROUTED_BRIDGE_IDLE_CHECK", default_value = "2s", value_parser = humantime::parse_duration)]
    pub idle_check: Duration,
    /// How long the engine may take to answer one replay reply
    #[arg(long, env = "KVROUTED_BRIDGE_REPLAY_TIMEOUT", default_value = "2s", value_parser = humantime::parse_duration)]
    pub replay_timeout: Duration,
    /// Log format: text or json
    #[arg(long, env = "KVROUTED_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: crate::config::LogFormat,
}

/// What `/healthz` reports.
pub struct Health {
    pub nats_connected: Arc<AtomicBool>,
    pub ranks: Vec<Arc<rank::RankStatus>>,
}

/// Runs the bridge until SIGTERM or SIGINT.
pub async fn run(mut args: BridgeArgs) -> anyhow::Result<()> {
    // An empty setting (e.g. an unset variable in a compose file) means none.
    args.model = args.model.filter(|m| !m.is_empty());
    args.metrics = args.metrics.filter(|m| !m.is_empty());
    args.replay = args.replay.filter(|r| !r.is_empty());
    let worker = WorkerId::new(&args.worker).map_err(|e| anyhow::anyhow!("--worker: {e}"))?;
    let mut endpoints = Vec::new();
    for r in 0..args.dp_size {
        let pub_endpoint = frames::rank_endpoint(&args.zmq, r).context("--zmq")?;
        let replay_endpoint = args
            .replay
            .as_deref()
            .map(|e| frames::rank_endpoint(e, r))
            .transpose()
            .context("--replay")?;
        endpoints.push((pub_endpoint, replay_endpoint));
    }
    let prometheus = http::install_metrics()?;
    let nats_connected = Arc::new(AtomicBool::new(false));
    let client = connect_nats(&args.nats, nats_connected.clone()).await?;
    let forwarder = forward::Forwarder::new(
        client.clone(),
        &args.subject_prefix,
        &args.stream,
        worker.as_str(),
        args.model.clone(),
    );

    // Where each rank left off, from the stream (retrying while NATS is not there yet).
    let positions = {
        let mut backoff = Duration::from_millis(100);
        loop {
            match forwarder.last_forwarded(args.dp_size).await {
                Ok(p) => break p,
                Err(e) => {
                    tracing::warn!("cannot read the last forwarded batches yet: {e}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    };
    let newest = positions
        .values()
        .filter(|p| !p.epoch.is_empty())
        .max_by_key(|p| p.stream_seq)
        .map(|p| p.epoch.clone())
        .unwrap_or_else(cursor::fresh_epoch);
    let epochs = Arc::new(Epochs::new(newest.clone(), Box::new(cursor::fresh_epoch)));
    for r in 0..args.dp_size {
        match positions.get(&r) {
            Some(p) => tracing::info!(
                rank = r,
                seq = p.seq,
                epoch = p.epoch,
                "resuming after the last forwarded batch"
            ),
            None => tracing::info!(
                rank = r,
                "nothing forwarded yet: replaying what the engine buffers"
            ),
        }
    }

    // Join with the epoch the ranks run (unchanged after a bridge restart: nothing is cleared).
    let workers_subject = format!("{}.workers.{}", args.subject_prefix, worker);
    let announce = |op: LifecycleOp| {
        encode_lifecycle_message(&LifecycleMessage {
            op,
            model: args.model.as_deref(),
            block_size: args.block_size,
            capacity_blocks: None,
            dp_size: Some(args.dp_size),
            epoch: Some(&newest),
        })
    };
    lifecycle::publish(
        forwarder.jetstream(),
        &workers_subject,
        announce(LifecycleOp::Join),
        Duration::MAX,
    )
    .await
    .map_err(|e| anyhow::anyhow!("join: {e}"))?;
    tracing::info!(worker = %worker, epoch = newest, dp_size = args.dp_size, "joined");

    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let mut statuses = Vec::new();
    let mut tasks = Vec::new();
    for (r, (pub_endpoint, replay_endpoint)) in endpoints.into_iter().enumerate() {
        let r = r as u32;
        let (last, epoch, last_payload) = match positions.get(&r) {
            Some(p) if !p.epoch.is_empty() => {
                (Some(p.seq), p.epoch.clone(), Some(p.payload.clone()))
            }
            _ => (None, newest.clone(), None),
        };
        let status = Arc::new(rank::RankStatus::new(r, epoch.clone()));
        statuses.push(status.clone());
        tasks.push(tokio::spawn(rank::run(
            rank::RankConfig {
                rank: r,
                pub_endpoint,
                replay_endpoint,
                topic: args.topic.clone(),
                replay_timeout: args.replay_timeout,
                ack_window: args.ack_window as usize,
                idle_check: args.idle_check,
            },
            RankCursor::resume(last, epoch),
            last_payload,
            forwarder.clone(),
            epochs.clone(),
            status,
            shutdown_rx.clone(),
        )));
    }

    if let Some(url) = args.metrics.clone() {
        tokio::spawn(load::run(
            load::LoadConfig {
                url,
                engine: args.engine,
                interval: args.load_interval,
                max_running: args.max_running,
                dp_size: args.dp_size,
                model: args.model.clone(),
                subject: format!("{}.load.{}", args.subject_prefix, worker),
            },
            client.clone(),
        ));
    }

    let health = Arc::new(Health {
        nats_connected,
        ranks: statuses,
    });
    let listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .with_context(|| format!("cannot listen on {}", args.http_addr))?;
    tracing::info!(http = %listener.local_addr()?, worker = %worker, "kvrouted bridge running");
    tokio::spawn(http::serve(listener, prometheus, health));

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut usr1 = signal(SignalKind::user_defined1())?;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = usr1.recv() => {
                match lifecycle::publish(forwarder.jetstream(), &workers_subject, announce(LifecycleOp::Drain), Duration::from_secs(10)).await {
                    Ok(()) => tracing::info!("SIGUSR1: draining (no new routes)"),
                    Err(e) => tracing::error!("SIGUSR1: drain not published: {e}"),
                }
            }
        }
    }
    // Forward what is in flight, then leave.
    let _ = shutdown_tx.send(true);
    for task in tasks {
        let _ = task.await;
    }
    let left = lifecycle::publish(
        forwarder.jetstream(),
        &workers_subject,
        announce(LifecycleOp::Leave),
        Duration::from_secs(10),
    )
    .await;
    match left {
        Ok(()) => tracing::info!("left"),
        Err(e) => tracing::error!("leave not published: {e}"),
    }
    let _ = client.flush().await;
    Ok(())
}

impl Health {
    pub fn nats_connected(&self) -> bool {
        self.nats_connected.load(Ordering::Acquire)
    }
}

/// A NATS client with the operator's credentials and TLS that keeps retrying (also the first
/// connect) and keeps `connected` up to date. Returns at once: publishes wait in the client
/// until the broker answers.
async fn connect_nats(
    nats: &NatsArgs,
    connected: Arc<AtomicBool>,
) -> anyhow::Result<async_nats::Client> {
    let options = nats.reconnecting_options("kvrouted-bridge", move |up| {
        connected.store(up, Ordering::Release);
        if !up {
            tracing::warn!("NATS disconnected; reconnecting with backoff");
        }
    })?;
    nats.connect(options).await
}
