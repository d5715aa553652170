//! `kvrouted`: one binary, several subcommands (docs/architecture.md, "Command line and
//! configuration").

use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use kvrouted::config::{clap_error_line, merge_config_file, LogFormat, ServeArgs};
use kvrouted::journal::{self, Journal};

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
    Serve(Box<ServeArgs>),
    /// Re-apply a journal through the core: audit (--verify) or counterfactual (policy flags).
    Replay(kvrouted::replay::ReplayArgs),
    /// Journal tools.
    #[command(subcommand)]
    Journal(JournalCommand),
    /// Replay a trace against simulated workers and compare policies.
    Simulate(kvrouted::sim::SimulateArgs),
    /// Run a live simulated fleet against a running daemon (NATS + HTTP), then check that the
    /// daemon accounts for everything it sent.
    Demo(kvrouted::demo::DemoArgs),
    /// Sidecar for a vLLM / SGLang / TensorRT-LLM engine: forwards its ZeroMQ KV events to
    /// JetStream (repairing gaps from its replay socket), publishes load samples scraped from its
    /// Prometheus endpoint, and announces join / drain (SIGUSR1) / leave (SIGTERM).
    Bridge(kvrouted::bridge::BridgeArgs),
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

/// The command line, with the routing defaults shown from the core's configuration.
fn command() -> clap::Command {
    kvrouted::config::with_router_defaults(Cli::command())
}

/// Parses the command line, merging `serve --config FILE` under flags and environment.
fn parse() -> anyhow::Result<Cli> {
    let mut argv: Vec<OsString> = std::env::args_os().collect();
    let matches = command().get_matches_from(argv.clone());
    if let Some(("serve", serve)) = matches.subcommand() {
        if let Some(path) = serve.get_one::<PathBuf>("config") {
            merge_config_file(&mut argv, serve, path)?;
            // Flags and environment were valid above, so an error here comes from the file.
            let matches = command()
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
                .and_then(|rt| rt.block_on(kvrouted::daemon::serve(*args)))
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Replay(args) => kvrouted::replay::run(&args),
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
        Command::Demo(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the async runtime")
            .and_then(|rt| rt.block_on(kvrouted::demo::run(args)))
            .map(|()| ExitCode::SUCCESS),
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
