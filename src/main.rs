//! `kvrouted`: one binary, several subcommands (DESIGN.md §13).

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use kvrouted::config::{clap_error_line, merge_config_file, LogFormat, PolicyArgs, ServeArgs};
use kvrouted::journal::{self, Journal};
use kvrouted::replay::replay;
use kvrouted::router::Output;

/// mimalloc instead of the system allocator: glibc's malloc and free were about a fifth of the
/// daemon's CPU under ingest (per-thread free lists and page reuse are what mimalloc does well).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Routes LLM inference requests to the worker whose KV cache already holds the longest prefix
/// of the prompt (pressure-first longest-prefix policy).
#[derive(Debug, Parser)]
#[command(name = "kvrouted", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon: ingest KV events and load from NATS, answer routes over HTTP.
    Serve(ServeArgs),
    /// Re-apply a journal through the core: audit (--verify) or counterfactual (policy flags).
    Replay(ReplayArgs),
    /// Journal tools.
    #[command(subcommand)]
    Journal(JournalCommand),
    /// Replay a trace against simulated workers and compare policies.
    Simulate(kvrouted::sim::SimulateArgs),
    /// Sidecar for a vLLM / SGLang / TensorRT-LLM engine: forwards its ZeroMQ KV events to
    /// JetStream (repairing gaps from its replay socket), publishes load samples scraped from its
    /// Prometheus endpoint, and announces join / drain (SIGUSR1) / leave (SIGTERM).
    Bridge(kvrouted::bridge::BridgeArgs),
}

#[derive(Debug, Args)]
struct ReplayArgs {
    /// Data dir of a stopped daemon
    #[arg(long, conflicts_with = "journal", required_unless_present = "journal")]
    data_dir: Option<PathBuf>,
    /// A file written by `kvrouted journal export`
    #[arg(long)]
    journal: Option<PathBuf>,
    /// Exit non-zero, naming the first divergent decision, if any re-derived decision differs
    #[arg(long)]
    verify: bool,
    /// Write every re-derived decision as JSON lines
    #[arg(long)]
    out: Option<PathBuf>,
    /// Any policy flag given here overrides the recorded setting (a counterfactual)
    #[command(flatten)]
    policy: PolicyArgs,
}

#[derive(Debug, Subcommand)]
enum JournalCommand {
    /// Write a portable journal file from a stopped daemon's data dir.
    Export {
        #[arg(long)]
        data_dir: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: log files and journald get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Parses the command line, merging `serve --config FILE` under flags and environment.
fn parse() -> anyhow::Result<Cli> {
    let mut argv: Vec<OsString> = std::env::args_os().collect();
    let matches = Cli::command().get_matches_from(argv.clone());
    if let Some(("serve", serve)) = matches.subcommand() {
        if let Some(path) = serve.get_one::<PathBuf>("config") {
            merge_config_file(&mut argv, serve, path)?;
            // Flags and environment were valid above, so an error here comes from the file.
            let matches = Cli::command()
                .try_get_matches_from(argv)
                .map_err(|e| anyhow::anyhow!("{}: {}", path.display(), clap_error_line(&e)))?;
            return Ok(Cli::from_arg_matches(&matches)?);
        }
    }
    Ok(Cli::from_arg_matches(&matches)?)
}

fn main() -> ExitCode {
    let cli = match parse() {
        Ok(cli) => cli,
        Err(e) => {
            eprintln!("kvrouted: {e:#}");
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Serve(args) => {
            init_logging(args.log_format);
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")
                .and_then(|rt| rt.block_on(kvrouted::daemon::serve(args)))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Replay(args) => run_replay(&args),
        Command::Journal(JournalCommand::Export { data_dir, out }) => (|| {
            let journal = Journal::open_existing(&data_dir)?;
            let n = journal::write_export(&journal, &out)?;
            eprintln!(
                "exported {n} journal entries from {} to {}",
                data_dir.display(),
                out.display()
            );
            Ok(ExitCode::SUCCESS)
        })(),
        Command::Simulate(args) => kvrouted::sim::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Bridge(args) => {
            init_logging(args.log_format);
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")
                .and_then(|rt| rt.block_on(kvrouted::bridge::run(args)))
                .map(|()| ExitCode::SUCCESS)
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvrouted: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run_replay(args: &ReplayArgs) -> anyhow::Result<ExitCode> {
    let (snapshot, entries): (_, Box<dyn Iterator<Item = _>>) =
        match (&args.data_dir, &args.journal) {
            (Some(dir), _) => {
                let journal = Journal::open_existing(dir)?;
                let (snapshot, after) = journal::replay_start(&journal)?;
                // Streamed: a journal can be far larger than memory.
                (snapshot, Box::new(journal.entries_after(after)))
            }
            (None, Some(file)) => {
                let (snapshot, reader) = journal::read_export(file)?;
                (snapshot, Box::new(reader))
            }
            (None, None) => unreachable!("clap requires one source"),
        };
    let mut out = match &args.out {
        Some(path) => {
            Some(BufWriter::new(File::create(path).with_context(|| {
                format!("cannot write {}", path.display())
            })?))
        }
        None => None,
    };
    let changes = std::cell::RefCell::new(Vec::new());
    let adjust = |config: &mut kvrouted::router::RouterConfig| {
        let applied = args.policy.apply(config);
        changes.borrow_mut().extend(applied);
    };
    let mut write_error = None;
    let (_, stats) = replay(snapshot, entries, &adjust, |seq, entry, output| {
        let Some(out) = out.as_mut() else { return };
        let line = match output {
            Output::Routed(d) => serde_json::json!({
                "seq": seq, "at_ms": entry.at_ms, "request_id": d.request_id,
                "worker": d.worker, "decision": d.decision, "matched_blocks": d.matched_blocks,
                "prompt_blocks": d.prompt_blocks, "owners": d.owners, "recorded": entry.outcome.as_ref().map(|o| o.to_string()),
            }),
            Output::NoCandidate => serde_json::json!({
                "seq": seq, "at_ms": entry.at_ms, "worker": null, "decision": "no_candidate",
                "recorded": entry.outcome.as_ref().map(|o| o.to_string()),
            }),
            _ => return,
        };
        if let Err(e) = writeln!(out, "{line}") {
            write_error.get_or_insert(e);
        }
    })?;
    if let Some(e) = write_error {
        return Err(e).context("writing --out");
    }
    if let Some(mut out) = out {
        out.flush()?;
    }
    let mut changes = changes.into_inner();
    changes.sort();
    changes.dedup();
    for change in &changes {
        eprintln!("counterfactual: {change}");
    }
    let pct = if stats.decisions > 0 {
        100.0 * stats.changed as f64 / stats.decisions as f64
    } else {
        0.0
    };
    println!(
        "replayed {} entries: {} decisions, {} changed ({pct:.2}%)",
        stats.entries, stats.decisions, stats.changed
    );
    if let Some(d) = &stats.first_divergence {
        println!(
            "first divergence at seq {}: recorded {}, replayed {}",
            d.seq, d.recorded, d.replayed
        );
        if args.verify {
            return Ok(ExitCode::FAILURE);
        }
    }
    Ok(ExitCode::SUCCESS)
}
