//! `kvrouted demo`: a live simulated fleet against a running daemon.
//!
//! The simulator's workers, driven by the wall clock, publish their KV events, load samples and
//! lifecycle messages over NATS exactly as a real fleet does, and its gateways route and
//! release requests over the daemon's HTTP API, then execute each request on the chosen
//! worker (prefill by uncached tokens, decode, LRU eviction, which the workers announce as KV
//! events). A live line every second shows the decisions, the prefix hit ratio and the time to
//! first token; Ctrl-C or SIGTERM stops it cleanly.
//!
//! It doubles as a smoke test of a deployment: after the run the daemon's `/metrics` must
//! account for every route answered and every block stored and removed, and `/v1/workers` must
//! show each worker holding exactly the blocks its cache holds; otherwise the demo exits
//! non-zero naming each disagreement.
//!
//! - [`workload`]: the requests (a Mooncake trace or the agentic generator), as tokens;
//! - [`fleet`]: the workers and the gateways, in real time;
//! - [`publish`]: the fleet's NATS publications;
//! - [`gateway`]: the HTTP client of the daemon;
//! - [`summary`]: the counts and what is printed from them;
//! - [`check`]: the comparison with the daemon's state.

pub mod check;
pub mod fleet;
pub mod gateway;
pub mod publish;
pub mod summary;
pub mod workload;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::config::parse_duration;
use crate::http::auth::{ApiClientArgs, Scope};
use crate::nats_options::NatsArgs;
use crate::sim::Generator;
use check::{disagreements, DaemonCounters, Expected};
use fleet::{Fleet, FleetConfig, Stop};
use gateway::{Gateway, GatewayAuth, ListedWorker};
use publish::Publisher;
use workload::Workload;

/// Flags of `kvrouted demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// NATS server the daemon reads, and the demo workers' credentials.
    #[command(flatten)]
    pub nats: NatsArgs,
    /// The daemon's HTTP API (`http://` or `https://`).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub daemon: String,
    /// Bearer tokens for the daemon's API, when it runs with --api-token-file: routes and
    /// releases need the `route` scope, the final check reads `/v1/workers` and `/metrics`
    /// with the `read` scope.
    #[command(flatten)]
    pub api: ApiClientArgs,
    /// PEM CA certificate to trust for an `https://` daemon (default: the system's roots).
    #[arg(long)]
    pub daemon_ca: Option<PathBuf>,
    /// Subject prefix the daemon reads (`<prefix>.events.<worker>`, ...).
    #[arg(long, default_value = "kv")]
    pub subject_prefix: String,
    /// Model the workers serve (`Kv-Model`, the join, and every route); empty for none.
    #[arg(long, default_value = "demo")]
    pub model: String,
    /// Tokens per KV block: must be the daemon's `--block-size`.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,

    /// Number of simulated workers (`demo-w00`, `demo-w01`, ...).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Routes per second in steady state (default: the workload's own pace, about 8/s for the
    /// generator). A session's later turns wait for its previous turn, so the rate ramps up
    /// over the first turns and drops when the simulated workers cannot keep up.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Stop after this long, e.g. 30s (default: run until Ctrl-C or SIGTERM).
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Mooncake JSONL trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`),
    /// replayed in a loop.
    #[arg(long, value_name = "FILE", conflicts_with = "generate")]
    pub trace: Option<PathBuf>,
    /// Generate the workload (the default: agentic sessions whose turns extend a prefix).
    #[arg(long, value_enum, value_name = "KIND")]
    pub generate: Option<Generator>,
    /// Tokens per hash id of the `--trace`.
    #[arg(long, default_value_t = 512)]
    pub trace_block_tokens: u32,
    /// Seed of the generator and of the workers' load-sample phases.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// KV cache capacity of each worker, in blocks (small, so eviction shows within seconds).
    #[arg(long, default_value_t = 1024)]
    pub capacity_blocks: u64,
    /// Batch limit of each worker.
    #[arg(long, default_value_t = 16)]
    pub max_running: u32,
    /// Prefill time per uncached prompt token, seconds.
    #[arg(long, default_value_t = 1e-4)]
    pub prefill_s_per_token: f64,
    /// Decode time per output token, seconds.
    #[arg(long, default_value_t = 0.01)]
    pub decode_s_per_token: f64,

    /// How long to wait for the daemon: at start, for its replies at the end, and for its
    /// state to account for what the demo sent.
    #[arg(long, value_parser = parse_duration, default_value = "15s")]
    pub check_timeout: Duration,
    /// Print the final summary as one JSON document on stdout.
    #[arg(long)]
    pub json: bool,
    /// No live lines on stderr.
    #[arg(long)]
    pub quiet: bool,
}

/// Runs `kvrouted demo`. An error means the demo could not run or the daemon disagreed with
/// what it sent; the message says which.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=1000).contains(&args.workers),
        "--workers must be 1 to 1000"
    );
    anyhow::ensure!(args.block_size > 0, "--block-size must be positive");
    anyhow::ensure!(
        args.capacity_blocks > 0,
        "--capacity-blocks must be positive"
    );
    anyhow::ensure!(args.max_running > 0, "--max-running must be positive");
    for (flag, v) in [
        ("--prefill-s-per-token", args.prefill_s_per_token),
        ("--decode-s-per-token", args.decode_s_per_token),
    ] {
        anyhow::ensure!(
            v.is_finite() && v >= 0.0,
            "{flag} must be a non-negative number"
        );
    }
    let workload = Workload::build(
        args.trace.as_deref(),
        args.generate,
        args.trace_block_tokens,
        args.block_size,
        args.rate,
        args.seed,
    )?;
    let auth = GatewayAuth {
        route_token: args.api.bearer(Scope::Route)?,
        read_token: args.api.bearer(Scope::Read)?,
        ca_pem: args
            .daemon_ca
            .as_deref()
            .map(|path| {
                std::fs::read(path).with_context(|| format!("--daemon-ca {}", path.display()))
            })
            .transpose()?,
    };
    let gateway = Gateway::new(&args.daemon, auth)?;
    let model = Some(args.model.clone()).filter(|m| !m.is_empty());

    wait_ready(&gateway, args.check_timeout).await?;
    let options = args
        .nats
        .connect_options()?
        .name("kvrouted-demo")
        .connection_timeout(args.check_timeout);
    let client = args
        .nats
        .connect(options)
        .await
        .with_context(|| format!("cannot connect to NATS at {}", args.nats.redacted_url()))?;
    let before = DaemonCounters::parse(&gateway.metrics().await?);
    let cfg = FleetConfig {
        workers: args.workers,
        capacity_blocks: args.capacity_blocks,
        max_running: args.max_running,
        prefill_s_per_token: args.prefill_s_per_token,
        decode_s_per_token: args.decode_s_per_token,
        block_size: args.block_size,
        model: model.clone(),
        load_interval: Duration::from_secs(1),
        seed: args.seed,
    };
    let publisher = Publisher::new(client, &args.subject_prefix, model.clone());
    let mut fleet = Fleet::new(cfg, workload, publisher, gateway.clone());

    let result = run_fleet(&args, &mut fleet, &gateway, &before).await;
    // Leave in every case, so a failed run does not leave ghost workers behind.
    let left = tokio::time::timeout(args.check_timeout, fleet.leave()).await;
    let problems = result?;
    left.map_err(|_| anyhow::anyhow!("NATS did not take the workers' leave messages"))??;
    if !problems.is_empty() {
        anyhow::bail!(
            "the daemon at {} disagrees with what the demo sent:\n  - {}",
            gateway.base(),
            problems.join("\n  - ")
        );
    }
    Ok(())
}

/// Joins, runs until stopped, winds down, checks and prints the final summary. Returns the
/// disagreements found.
async fn run_fleet(
    args: &DemoArgs,
    fleet: &mut Fleet,
    gateway: &Gateway,
    before: &DaemonCounters,
) -> anyhow::Result<Vec<String>> {
    fleet.join().await?;
    let ids = fleet.worker_ids();
    let deadline = Instant::now() + args.check_timeout;
    loop {
        let listed = gateway.workers().await?;
        let missing = ids
            .iter()
            .filter(|id| !listed.iter().any(|w| &w.id == *id))
            .count();
        if missing == 0 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the daemon at {} does not list {missing} of the demo's {} workers {:?} after {:?}: \
             does it read --subject-prefix {} on {}?",
            gateway.base(),
            ids.len(),
            short_ids(&ids),
            args.check_timeout,
            args.subject_prefix,
            args.nats.redacted_url()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if !args.quiet {
        eprintln!(
            "demo: {} workers ({}) publishing on {} under '{}', routing through {}; {}",
            ids.len(),
            short_ids(&ids),
            args.nats.redacted_url(),
            args.subject_prefix,
            gateway.base(),
            match args.duration {
                Some(d) => format!("stopping after {}", humantime::format_duration(d)),
                None => "Ctrl-C stops".into(),
            }
        );
    }

    let duration = args.duration;
    let stop = async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        let timer = async {
            match duration {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => Stop::Signal("Ctrl-C"),
            _ = term.recv() => Stop::Signal("SIGTERM"),
            _ = timer => Stop::Duration,
        }
    };
    let quiet = args.quiet;
    let mut shown_command = false;
    let route_command = |fleet: &Fleet| {
        fleet
            .held_prefix
            .as_ref()
            .map(|p| route_command(gateway.base(), args.model.as_str(), p))
    };
    let mut print = |fleet: &Fleet, routes_before: u64, window_s: f64| {
        if quiet {
            return;
        }
        let snap = fleet
            .summary
            .snapshot(fleet.elapsed_s(), routes_before, window_s);
        eprintln!("{}", snap.line());
        if !shown_command {
            if let Some(cmd) = route_command(fleet) {
                eprintln!("demo: a prefix the workers hold, with explain:\n  {cmd}");
                shown_command = true;
            }
        }
    };
    let why = fleet.run(stop, Duration::from_secs(1), &mut print).await?;
    let elapsed_s = fleet.elapsed_s();
    if !args.quiet {
        let why = match why {
            Stop::Signal(s) => format!("{s}: stopping"),
            Stop::Duration => "duration reached: stopping".to_string(),
        };
        eprintln!("demo: {why}; releasing reservations, announcing the last blocks");
    }
    // A second Ctrl-C does not wait for the wind-down and the check.
    tokio::spawn(async {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("demo: second Ctrl-C: exiting at once, without the check or leave");
            std::process::exit(130);
        }
    });
    fleet.wind_down(args.check_timeout).await?;

    // The daemon applies what was published in its own time: poll until it accounts for it.
    let expected = Expected {
        routes: fleet.summary.routes,
        stored_blocks: fleet.summary.stored_blocks,
        removed_blocks: fleet.summary.removed_blocks,
        workers: fleet.resident_blocks(),
    };
    let deadline = Instant::now() + args.check_timeout;
    let (problems, listed) = loop {
        let now = DaemonCounters::parse(&gateway.metrics().await?);
        let listed = gateway.workers().await?;
        let problems = disagreements(&expected, before, &now, &listed);
        if problems.is_empty() || Instant::now() >= deadline {
            break (problems, listed);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut problems = problems;
    if fleet.summary.failed_routes > 0 {
        problems.push(format!(
            "{} routes got no decision; the first: {}",
            fleet.summary.failed_routes,
            fleet.summary.first_route_failure.as_deref().unwrap_or("?")
        ));
    }
    if fleet.summary.failed_releases > 0 {
        problems.push(format!(
            "{} releases of the daemon's own reservations were refused; the first: {}",
            fleet.summary.failed_releases,
            fleet
                .summary
                .first_release_failure
                .as_deref()
                .unwrap_or("?")
        ));
    }
    if fleet.summary.routes == 0 {
        problems.push("no route was answered during the run".to_string());
    }

    let snap = fleet
        .summary
        .snapshot(elapsed_s, 0, elapsed_s.max(f64::MIN_POSITIVE));
    if args.json {
        let workers: Vec<serde_json::Value> = expected
            .workers
            .iter()
            .map(|(id, blocks)| {
                let listed = listed
                    .iter()
                    .find(|w: &&ListedWorker| &w.id == id)
                    .map(|w| w.blocks);
                serde_json::json!({"id": id, "blocks": blocks, "daemon_blocks": listed})
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({ "summary": snap, "workers": workers, "problems": problems })
        );
    } else {
        print!("{}", snap.text());
        if let Some(cmd) = route_command(fleet) {
            println!("  try (while a demo runs):\n    {cmd}");
        }
        if problems.is_empty() {
            println!(
                "  daemon check      ok: its counters and /v1/workers account for every route and block"
            );
        }
    }
    Ok(problems)
}

/// Polls `/readyz` until the daemon answers `ready` or `degraded` (serving routes).
async fn wait_ready(gateway: &Gateway, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let result = gateway.readiness().await;
        match &result {
            Ok(status) if status == "ready" || status == "degraded" => return Ok(()),
            _ if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(status) => anyhow::bail!(
                "the daemon at {} is still {status} after {timeout:?}",
                gateway.base()
            ),
            Err(_) => {
                return result
                    .map(|_| ())
                    .with_context(|| format!("still unreachable after {timeout:?}"))
            }
        }
    }
}

/// Worker ids, shortened to the first and last when there are many.
fn short_ids(ids: &[String]) -> String {
    match ids {
        [] => String::new(),
        [one] => one.clone(),
        [first, .., last] if ids.len() > 3 => format!("{first} .. {last}"),
        _ => ids.join(", "),
    }
}

/// A ready-to-paste `curl` routing `tokens` with explain; consecutive tokens are written as a
/// `seq` range to keep the line short.
fn route_command(base: &str, model: &str, tokens: &[u32]) -> String {
    let consecutive = tokens.windows(2).all(|w| w[1] == w[0].wrapping_add(1));
    let list = match (consecutive, tokens.first(), tokens.last()) {
        (true, Some(first), Some(last)) if tokens.len() > 2 => {
            format!("$(seq -s, {first} {last})")
        }
        _ => tokens
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(","),
    };
    let model = if model.is_empty() {
        String::new()
    } else {
        format!("\\\"model\\\": \\\"{model}\\\", ")
    };
    format!(
        "curl -s -XPOST {base}/v1/route -d \"{{{model}\\\"tokens\\\": [{list}], \\\"explain\\\": true}}\""
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_route_command_writes_consecutive_tokens_as_a_seq_range() {
        let cmd = route_command("http://127.0.0.1:8080", "demo", &[0, 1, 2, 3]);
        assert_eq!(
            cmd,
            r#"curl -s -XPOST http://127.0.0.1:8080/v1/route -d "{\"model\": \"demo\", \"tokens\": [$(seq -s, 0 3)], \"explain\": true}""#
        );
        let cmd = route_command("http://h:1", "", &[5, 9, 2]);
        assert!(cmd.contains("[5,9,2]"), "{cmd}");
        assert!(!cmd.contains("model"), "{cmd}");
    }
}
