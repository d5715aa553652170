//! Command-line configuration (docs/architecture.md, "Command line and configuration").
//!
//! Every `serve` flag can also come from the environment (`KVROUTED_` + the flag name in upper
//! snake case) or a TOML file (`--config kvrouted.toml`, keys are flag names); flags win over the
//! environment, which wins over the file. Durations are written with their unit (`30s`, `500ms`).

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args};

use crate::nats_options::NatsArgs;
use crate::policy::PolicyKind;
use crate::router::RouterConfig;

/// Parses `30s`, `500ms`, `2m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{e}: write durations with their unit, e.g. 30s or 500ms"))
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

pub fn parse_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if v.is_finite() && (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is outside 0..=1"))
    }
}

/// Parses `NAME=SIZE` for `--model-block-size`.
fn parse_model_block_size(s: &str) -> Result<(String, u32), String> {
    let (name, size) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("{s:?}: expected NAME=SIZE, e.g. llama-3-8b=16"))?;
    let name = name.trim();
    if name.is_empty() {
        return Err(format!("{s:?}: the model name is empty"));
    }
    match size.trim().parse::<u32>() {
        Ok(n) if n > 0 => Ok((name.to_owned(), n)),
        _ => Err(format!("{s:?}: the block size must be a positive integer")),
    }
}

/// Parses a pressure threshold (a non-negative number; above 1 means requests queue beyond the
/// batch) or `off`.
pub fn parse_optional_pressure(s: &str) -> Result<OptionalPressure, String> {
    if s.eq_ignore_ascii_case("off") {
        return Ok(OptionalPressure(None));
    }
    let v: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is neither a number nor off"))?;
    if v.is_finite() && v >= 0.0 {
        Ok(OptionalPressure(Some(v)))
    } else {
        Err(format!("{v} is not a non-negative number"))
    }
}

/// A pressure threshold that can be switched off (`off`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptionalPressure(pub Option<f64>);

impl From<OptionalPressure> for Option<f64> {
    fn from(v: OptionalPressure) -> Self {
        v.0
    }
}

/// Routing settings, shared by `serve` (defaults as shown) and `replay` (where a flag given
/// overrides the recorded setting: a counterfactual). The defaults are `RouterConfig::default()`;
/// [`with_router_defaults`] shows them in the help, so they are written once, in the core.
#[derive(Debug, Clone, Default, Args)]
pub struct PolicyArgs {
    /// Routing policy: pressure_first, or a baseline (legacy, round_robin, p2c, longest_prefix,
    /// dynamo_cost)
    #[arg(long, env = "KVROUTED_POLICY")]
    pub policy: Option<PolicyKind>,
    /// Tokens per KV block; events with another block size are rejected
    #[arg(long, env = "KVROUTED_BLOCK_SIZE", value_parser = clap::value_parser!(u32).range(1..))]
    pub block_size: Option<u32>,
    /// A model's block size, fixed: NAME=SIZE (repeatable, or comma-separated). Other models use
    /// what their workers' joins declare, else --block-size
    #[arg(
        long = "model-block-size",
        env = "KVROUTED_MODEL_BLOCK_SIZE",
        value_parser = parse_model_block_size,
        value_delimiter = ','
    )]
    pub model_block_size: Vec<(String, u32)>,
    /// Known owners of a prefix at which the router stops creating new ones
    #[arg(long, env = "KVROUTED_MAX_OWNERS_PER_PREFIX", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_owners_per_prefix: Option<u64>,
    /// After a pressure spill for a prefix, no other owner is created for it this long
    #[arg(long, env = "KVROUTED_SPILL_COOLDOWN", value_parser = parse_duration)]
    pub spill_cooldown: Option<Duration>,
    /// Pressure (0..1) above which a worker is never a safe home
    #[arg(long, env = "KVROUTED_PRESSURE_HIGH_WATER", value_parser = parse_fraction)]
    pub pressure_high_water: Option<f64>,
    /// An owner more than this above the best owner's pressure is pressured
    #[arg(long, env = "KVROUTED_PRESSURE_SLACK", value_parser = parse_fraction)]
    pub pressure_slack: Option<f64>,
    /// Load samples older than this are stale: they fail open to known owners
    #[arg(long, env = "KVROUTED_TELEMETRY_MAX_AGE", value_parser = parse_duration)]
    pub telemetry_max_age: Option<Duration>,
    /// Matches shorter than this many blocks are cold misses
    #[arg(long, env = "KVROUTED_MIN_MATCH_BLOCKS")]
    pub min_match_blocks: Option<u32>,
    /// A match must also cover this fraction (0..1) of the prompt's blocks, rounded up, to make
    /// owners (chosen by the simulator sweep in docs/quality.md)
    #[arg(long, env = "KVROUTED_MIN_MATCH_RATIO", value_parser = parse_fraction)]
    pub min_match_ratio: Option<f64>,
    /// At the owner ceiling, still spill (once per cooldown, `overload_spill`) when every known
    /// owner's pressure is above this; `off` never
    #[arg(long, env = "KVROUTED_CEILING_OVERFLOW_PRESSURE", value_parser = parse_optional_pressure)]
    pub ceiling_overflow_pressure: Option<OptionalPressure>,
    /// Fold unfinished reserved prefill into pressure: this many tokens count as 1.0 of pressure;
    /// 0 does not fold (chosen by the simulator sweep in docs/quality.md)
    #[arg(long, env = "KVROUTED_BACKLOG_PRESSURE_TOKENS")]
    pub backlog_pressure_tokens: Option<u64>,
    /// How long the router's own routing records count as ownership
    #[arg(long, env = "KVROUTED_APPROX_TTL", value_parser = parse_duration)]
    pub approx_ttl: Option<Duration>,
    /// Bound on routing records (one per routed block and worker; routing a block to the same
    /// worker again refreshes its record, it adds none). Past it, the oldest go first
    #[arg(long, env = "KVROUTED_APPROX_MAX_RECORDS")]
    pub approx_max_records: Option<usize>,
    /// Reservations not released by then expire
    #[arg(long, env = "KVROUTED_RESERVATION_TTL", value_parser = parse_duration)]
    pub reservation_ttl: Option<Duration>,
    /// Output tokens assumed for reserved work when a request gives no smaller maximum
    #[arg(long, env = "KVROUTED_OUTPUT_ESTIMATE")]
    pub output_estimate: Option<u64>,
    /// A worker silent this long is removed like a leave
    #[arg(long, env = "KVROUTED_WORKER_TTL", value_parser = parse_duration)]
    pub worker_ttl: Option<Duration>,
    /// Most workers known at once: load samples, KV events and joins from a new worker id
    /// beyond it are rejected and counted (`worker_limit`); known workers are unaffected, and
    /// a worker that leaves or ages out frees its place
    #[arg(long, env = "KVROUTED_MAX_WORKERS", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_workers: Option<u64>,
    /// Most (model, LoRA) namespaces: KV events and model declarations needing a new one
    /// beyond it are rejected and counted (`model_limit`); routes never create one for a name
    /// no worker announced
    #[arg(long, env = "KVROUTED_MAX_MODELS", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_models: Option<u64>,
}

/// Appends `[default: X]` to the help of each routing flag of `serve` and `replay`, from
/// `RouterConfig::default()`.
pub fn with_router_defaults(cli: clap::Command) -> clap::Command {
    let config = RouterConfig::default();
    let policy = &config.policy;
    let duration = |ms: u64| {
        if ms.is_multiple_of(1000) {
            format!("{}s", ms / 1000)
        } else {
            format!("{ms}ms")
        }
    };
    let defaults = [
        ("policy", policy.kind.to_string()),
        ("block_size", config.block_size.to_string()),
        (
            "max_owners_per_prefix",
            policy.max_owners_per_prefix.to_string(),
        ),
        ("spill_cooldown", duration(policy.spill_cooldown_ms)),
        ("pressure_high_water", format!("{:.2}", policy.high_water)),
        ("pressure_slack", format!("{:.2}", policy.pressure_slack)),
        ("telemetry_max_age", duration(policy.telemetry_max_age_ms)),
        ("min_match_blocks", policy.min_match_blocks.to_string()),
        ("min_match_ratio", policy.min_match_ratio.to_string()),
        (
            "ceiling_overflow_pressure",
            policy
                .ceiling_overflow_pressure
                .map_or_else(|| "off".to_owned(), |p| p.to_string()),
        ),
        (
            "backlog_pressure_tokens",
            policy.backlog_pressure_tokens.to_string(),
        ),
        ("approx_ttl", duration(config.approx_ttl_ms)),
        ("approx_max_records", config.approx_max_records.to_string()),
        ("reservation_ttl", duration(config.reservation_ttl_ms)),
        ("output_estimate", config.output_estimate.to_string()),
        ("worker_ttl", duration(config.worker_ttl_ms)),
        ("max_workers", config.max_workers.to_string()),
        ("max_models", config.max_models.to_string()),
    ];
    let show = |command: clap::Command| {
        defaults.iter().fold(command, |command, (id, value)| {
            command.mut_arg(*id, |arg| {
                let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
                arg.help(format!("{help} [default: {value}]"))
            })
        })
    };
    cli.mut_subcommand("serve", show)
        .mut_subcommand("replay", show)
}

impl PolicyArgs {
    /// Applies the flags that were given to `config`. Returns a line per change.
    pub fn apply(&self, config: &mut RouterConfig) -> Vec<String> {
        let mut changes = Vec::new();
        macro_rules! set {
            ($field:expr, $value:expr, $name:literal) => {
                if let Some(v) = $value {
                    let v = v.into();
                    if $field != v {
                        changes.push(format!("{}: {:?} -> {:?}", $name, $field, v));
                        $field = v;
                    }
                }
            };
        }
        let p = &mut config.policy;
        set!(p.kind, self.policy, "policy");
        set!(
            p.max_owners_per_prefix,
            self.max_owners_per_prefix.map(|v| v as usize),
            "max_owners_per_prefix"
        );
        set!(
            p.spill_cooldown_ms,
            self.spill_cooldown.map(ms),
            "spill_cooldown_ms"
        );
        set!(
            p.high_water,
            self.pressure_high_water,
            "pressure_high_water"
        );
        set!(p.pressure_slack, self.pressure_slack, "pressure_slack");
        set!(
            p.telemetry_max_age_ms,
            self.telemetry_max_age.map(ms),
            "telemetry_max_age_ms"
        );
        set!(
            p.min_match_blocks,
            self.min_match_blocks,
            "min_match_blocks"
        );
        set!(p.min_match_ratio, self.min_match_ratio, "min_match_ratio");
        set!(
            p.ceiling_overflow_pressure,
            self.ceiling_overflow_pressure,
            "ceiling_overflow_pressure"
        );
        set!(
            p.backlog_pressure_tokens,
            self.backlog_pressure_tokens,
            "backlog_pressure_tokens"
        );
        set!(config.block_size, self.block_size, "block_size");
        if !self.model_block_size.is_empty() {
            let sizes: std::collections::BTreeMap<String, u32> =
                self.model_block_size.iter().cloned().collect();
            set!(config.model_block_sizes, Some(sizes), "model_block_sizes");
        }
        set!(
            config.approx_ttl_ms,
            self.approx_ttl.map(ms),
            "approx_ttl_ms"
        );
        set!(
            config.approx_max_records,
            self.approx_max_records,
            "approx_max_records"
        );
        set!(
            config.reservation_ttl_ms,
            self.reservation_ttl.map(ms),
            "reservation_ttl_ms"
        );
        set!(
            config.output_estimate,
            self.output_estimate,
            "output_estimate"
        );
        set!(
            config.worker_ttl_ms,
            self.worker_ttl.map(ms),
            "worker_ttl_ms"
        );
        set!(
            config.max_workers,
            self.max_workers.map(|v| v as usize),
            "max_workers"
        );
        set!(
            config.max_models,
            self.max_models.map(|v| v as usize),
            "max_models"
        );
        changes
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// HTTP API security and limits of `serve`.
#[derive(Debug, Clone, Args)]
pub struct HttpArgs {
    /// File of API tokens, one `TOKEN SCOPE` per line (scopes: `route` for /v1/route and
    /// /v1/release, `read` for /v1/workers and /metrics; `#` starts a comment). Every endpoint
    /// but /healthz and /readyz then needs `Authorization: Bearer TOKEN`. Re-read on SIGHUP
    #[arg(long, env = "KVROUTED_API_TOKEN_FILE")]
    pub api_token_file: Option<PathBuf>,
    /// PEM certificate chain: serve HTTPS (with --tls-key)
    #[arg(long, env = "KVROUTED_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert
    #[arg(long, env = "KVROUTED_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Allow a non-loopback --http-addr without --api-token-file (anyone who reaches the port
    /// can route, release and read)
    #[arg(long, env = "KVROUTED_INSECURE_PUBLIC")]
    pub insecure_public: bool,
    /// Open HTTP connections served at once; beyond it a connection only gets /healthz and
    /// /readyz (others a 503) or, past a small reserve, is closed at once. Keep it well below
    /// the process's file-descriptor limit
    #[arg(long, env = "KVROUTED_MAX_CONNECTIONS", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// A request's line and headers must arrive within this, from their first byte (and a TLS
    /// handshake within it from the connection's start); slower connections are closed
    #[arg(long, env = "KVROUTED_HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub http_header_timeout: Duration,
    /// A request's body must arrive within this once its handler reads it (408 otherwise)
    #[arg(long, env = "KVROUTED_HTTP_BODY_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub http_body_timeout: Duration,
    /// A connection with no request in progress (new, or kept alive after a response) that
    /// sends nothing for this long is closed
    #[arg(long, env = "KVROUTED_HTTP_IDLE_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub http_idle_timeout: Duration,
}

/// `kvrouted serve`: run the daemon.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// TOML file with any of these settings (keys are flag names, e.g. `nats-url = "..."`);
    /// flags and environment variables win over it
    #[arg(long, env = "KVROUTED_CONFIG")]
    pub config: Option<PathBuf>,
    /// NATS server to ingest from, its credentials and TLS
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Address of the HTTP API and /metrics; without --api-token-file only a loopback address
    /// is accepted unless --insecure-public is given
    #[arg(long, env = "KVROUTED_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http_addr: SocketAddr,
    #[command(flatten)]
    pub http: HttpArgs,
    /// Where the journal and snapshots live (sled)
    #[arg(long, env = "KVROUTED_DATA_DIR", default_value = "./kvrouted-data")]
    pub data_dir: PathBuf,
    /// NATS subject prefix: <prefix>.events.<worker>, <prefix>.load.<worker>,
    /// <prefix>.workers.<worker>
    #[arg(long, env = "KVROUTED_SUBJECT_PREFIX", default_value = "kv")]
    pub subject_prefix: String,
    /// JetStream stream capturing KV events and lifecycle messages (created if missing)
    #[arg(long, env = "KVROUTED_STREAM", default_value = "KVROUTED")]
    pub stream: String,
    /// Durable consumer name; each replica needs its own
    #[arg(long, env = "KVROUTED_CONSUMER", default_value = "kvrouted")]
    pub consumer: String,
    /// Subscribe on core NATS only (no JetStream: events published while down are lost)
    #[arg(long, env = "KVROUTED_NO_JETSTREAM")]
    pub no_jetstream: bool,
    /// Share decisions with other replicas under this name (1 to 64 characters from A-Z a-z
    /// 0-9 _ -; each replica needs its own, with its own --consumer and --data-dir, e.g. the
    /// pod name). Its routes and releases are published on
    /// <prefix>.decisions.<replica-id>:<incarnation> (8 hex digits naming the data dir, renewed
    /// after an unclean stop) and it applies the other replicas'. Unset, the daemon runs alone:
    /// it neither publishes nor reads decisions
    #[arg(long, env = "KVROUTED_REPLICA_ID", value_parser = parse_replica_id)]
    pub replica_id: Option<String>,
    /// JetStream replicas of the streams kvrouted creates (events, decisions): 1 on a single
    /// server, 3 on a 3-server cluster, so that losing a server loses nothing. An existing
    /// stream with fewer replicas is raised to this
    #[arg(long, env = "KVROUTED_STREAM_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=5))]
    pub stream_replicas: u8,
    /// How long the decisions stream (<stream>_DECISIONS, subjects <prefix>.decisions.>) keeps
    /// the replicas' decisions; a replica away longer than this catches up from the KV events
    /// only. Keep it at least --reservation-ttl, so a restarted replica still learns every
    /// reservation a peer may release
    #[arg(long, env = "KVROUTED_DECISIONS_MAX_AGE", default_value = "10m", value_parser = parse_duration)]
    pub decisions_max_age: Duration,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// How often the state is snapshotted (and the journal pruned). Each snapshot is copied
    /// under the state's lock into the last one's memory, which stays resident between them
    #[arg(long, env = "KVROUTED_SNAPSHOT_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub snapshot_interval: Duration,
    /// Journal entries older than this may be dropped once a snapshot covers them
    #[arg(long, env = "KVROUTED_JOURNAL_MAX_AGE", default_value = "24h", value_parser = parse_duration)]
    pub journal_max_age: Duration,
    /// Journal size above which the oldest snapshot-covered entries are dropped
    #[arg(long, env = "KVROUTED_JOURNAL_MAX_BYTES", default_value_t = 1 << 30)]
    pub journal_max_bytes: u64,
    /// Group-commit interval: journal flushes (and JetStream acks) happen this often
    #[arg(long, env = "KVROUTED_FLUSH_INTERVAL", default_value = "10ms", value_parser = parse_duration)]
    pub flush_interval: Duration,
    /// Inputs no JetStream message waits on (routes, releases, load samples, ticks) are made
    /// durable at least this often; set it equal to --flush-interval for an audit log that loses
    /// nothing on a crash, at some route latency
    #[arg(long, env = "KVROUTED_SOFT_FLUSH_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub soft_flush_interval: Duration,
    /// On SIGTERM, how long the final snapshot and journal flush may take; past it (a failing
    /// disk) kvrouted exits anyway with code 74, keeping the journal up to its last flush
    #[arg(long, env = "KVROUTED_SHUTDOWN_TIMEOUT", default_value = "20s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,
    /// Housekeeping interval (worker age-out, expiries, gauges)
    #[arg(long, env = "KVROUTED_TICK_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub tick_interval: Duration,
    /// Largest accepted HTTP body or NATS payload, in bytes
    #[arg(long, env = "KVROUTED_MAX_BODY_BYTES", default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Largest accepted prompt, in tokens (or blocks × block size)
    #[arg(long, env = "KVROUTED_MAX_PROMPT_TOKENS", default_value_t = 1 << 20)]
    pub max_prompt_tokens: usize,
    /// Log format
    #[arg(long, env = "KVROUTED_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// The longest replica id: it names a NATS subject token and a durable consumer.
const MAX_REPLICA_ID: usize = 64;

/// Checks a `--replica-id`: 1 to 64 characters from `A-Z a-z 0-9 _ -` (it becomes a subject
/// token and part of a consumer name, where dots, wildcards and spaces are not allowed).
pub fn parse_replica_id(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > MAX_REPLICA_ID {
        return Err(format!(
            "{s:?}: a replica id has 1 to {MAX_REPLICA_ID} characters"
        ));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        return Err(format!(
            "{s:?}: {c:?} is not allowed in a replica id (A-Z a-z 0-9 _ -)"
        ));
    }
    Ok(s.to_owned())
}

impl ServeArgs {
    /// `--replica-id`: the name this daemon shares its decisions under, none when it runs
    /// alone.
    pub fn replica_id(&self) -> Option<&str> {
        self.replica_id.as_deref()
    }

    /// The decisions stream: named after `--stream`.
    pub fn decisions_stream(&self) -> String {
        format!("{}_DECISIONS", self.stream)
    }

    /// This replica's durable consumer of the decisions stream: named after its replica id,
    /// which is unique among the replicas (none when it runs alone).
    pub fn decisions_consumer(&self) -> Option<String> {
        self.replica_id()
            .map(|id| format!("kvrouted-decisions-{id}"))
    }

    pub fn router_config(&self) -> RouterConfig {
        let mut config = RouterConfig::default();
        self.policy.apply(&mut config);
        config
    }
}

/// Adds the settings of a `--config` TOML file to `argv` as flags, for every setting that was
/// not given as a flag or environment variable. `matches` are the `serve` matches of `argv`.
///
/// Every setting in the file is checked (name, type and value, with the flag's own parser), also
/// those a flag or environment variable overrides: a broken file is an error, reported on one
/// line naming the file and the setting.
pub fn merge_config_file(
    argv: &mut Vec<OsString>,
    matches: &ArgMatches,
    path: &Path,
) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| {
        let (line, column) = e
            .span()
            .map_or((1, 1), |span| line_column(&text, span.start));
        anyhow::anyhow!(
            "{}: invalid TOML at line {line}, column {column}: {}",
            path.display(),
            e.message().trim()
        )
    })?;
    let command = ServeArgs::augment_args(clap::Command::new("serve"));
    for (key, value) in table {
        let id = key.replace('-', "_");
        let Some(arg) = command.get_arguments().find(|a| a.get_id() == id.as_str()) else {
            bail!(
                "{}: unknown setting {key:?} (settings are serve's flag names, e.g. nats-url)",
                path.display()
            );
        };
        if id == "config" {
            bail!(
                "{}: a config file cannot name another config file",
                path.display()
            );
        }
        let flag: OsString = format!(
            "--{}",
            arg.get_long().expect("every serve setting is a long flag")
        )
        .into();
        let is_switch = !arg.get_action().takes_values();
        if is_switch != value.is_bool() {
            bail!(
                "{}: {key} must be {}, got a TOML {}",
                path.display(),
                if is_switch {
                    "true or false"
                } else {
                    "a value (string or number)"
                },
                value.type_str()
            );
        }
        let args: Vec<OsString> = match value {
            toml::Value::Boolean(true) => vec![flag],
            toml::Value::Boolean(false) => vec![],
            toml::Value::String(s) => vec![flag, s.into()],
            toml::Value::Integer(i) => vec![flag, i.to_string().into()],
            toml::Value::Float(f) => vec![flag, f.to_string().into()],
            other => bail!(
                "{}: {key} must be a string or a number, got a TOML {}",
                path.display(),
                other.type_str()
            ),
        };
        let alone = std::iter::once(OsString::from("serve")).chain(args.iter().cloned());
        if let Err(e) = command.clone().try_get_matches_from(alone) {
            bail!("{}: {key}: {}", path.display(), clap_error_line(&e));
        }
        if matches!(
            matches.value_source(&id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        argv.extend(args);
    }
    Ok(())
}

/// The first line of a clap error, without its `error: ` prefix (clap adds usage and a hint on
/// further lines).
pub fn clap_error_line(e: &clap::Error) -> String {
    let text = e.to_string();
    let line = text.lines().next().unwrap_or_default();
    line.strip_prefix("error: ").unwrap_or(line).to_string()
}

/// 1-based line and column of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_id_is_a_subject_token_and_consumer_name() {
        assert_eq!(parse_replica_id("kvrouted-0").as_deref(), Ok("kvrouted-0"));
        for bad in ["", "a.b", "a b", "a>", "a*", "a:b", &"x".repeat(65)] {
            assert!(
                parse_replica_id(bad).is_err(),
                "{bad:?} cannot name a subject token or a durable consumer"
            );
        }
    }
}
