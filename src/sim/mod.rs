//! `kvrouted simulate` (docs/architecture.md, "Simulator"): replays a trace against N simulated
//! workers driven by the same routing core as the daemon, once per policy, and measures what each
//! policy does to cache reuse, duplication, eviction and time to first token.
//!
//! - [`trace`]: Mooncake JSONL traces and the [`Trace`] model;
//! - [`generate`]: the agentic-trajectory and shared-system-prompt generators;
//! - [`worker`]: one simulated worker (KV cache with LRU eviction, batch limit, prefill engine);
//! - [`engine`]: the discrete-event loop around [`crate::router::Router::apply`];
//! - `replicas`: one router, or replicas behind a round-robin gateway sharing decisions;
//! - [`report`] and [`plot`]: table, JSON and SVG output.
//!
//! The CLI entry point is [`run`] with [`SimulateArgs`].

pub mod engine;
pub mod generate;
pub mod plot;
pub(crate) mod replicas;
pub mod report;
pub(crate) mod timeline;
pub mod trace;
pub(crate) mod worker;

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context;

pub use engine::{percentile, simulate, trace_keys, PolicyReport, SimConfig};
pub use generate::{AgenticParams, SharedPrefixParams};
pub use trace::{FollowUp, Trace, TraceRequest};

use crate::config::parse_duration;
use crate::policy::PolicyKind;
use crate::router::RouterConfig;

/// Built-in workload generators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Generator {
    /// Tool-using agent sessions: every turn re-sends the whole previous context.
    Agentic,
    /// Single-turn requests behind a few long common prefixes (system prompts): the herding case.
    SharedPrefix,
}

/// `--sweep FLAG=v1,v2,...`: the same workload once per value of one flag.
#[derive(Debug, Clone, PartialEq)]
pub struct Sweep {
    /// The flag's long name, without dashes.
    pub flag: String,
    pub values: Vec<String>,
}

/// Flags `--sweep` can vary: router settings and the fleet and load around them.
pub const SWEEPABLE: [&str; 19] = [
    "min-match-blocks",
    "min-match-ratio",
    "ceiling-overflow-pressure",
    "backlog-pressure-tokens",
    "max-owners-per-prefix",
    "spill-cooldown",
    "pressure-high-water",
    "pressure-slack",
    "approx-ttl",
    "workers",
    "capacity-blocks",
    "max-running",
    "speedup",
    "session-rate",
    "request-rate",
    "prefix-skew",
    "seed",
    "replicas",
    "decision-delay",
];

fn parse_sweep(s: &str) -> Result<Sweep, String> {
    let (flag, values) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: write FLAG=v1,v2,..."))?;
    let flag = flag.trim_start_matches('-').to_string();
    if !SWEEPABLE.contains(&flag.as_str()) {
        return Err(format!(
            "--{flag} cannot be swept; sweepable: {}",
            SWEEPABLE.join(", ")
        ));
    }
    let values: Vec<String> = values
        .split(',')
        .filter(|v| !v.is_empty())
        .map(str::to_string)
        .collect();
    if values.is_empty() {
        return Err(format!("--sweep {flag}= names no value"));
    }
    Ok(Sweep { flag, values })
}

/// `--decision-delay`: how long a replica's decisions take to reach the others, or `off` (the
/// replicas do not share them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecisionDelay(pub Option<Duration>);

fn parse_decision_delay(s: &str) -> Result<DecisionDelay, String> {
    if s.eq_ignore_ascii_case("off") {
        return Ok(DecisionDelay(None));
    }
    parse_duration(s).map(|d| DecisionDelay(Some(d)))
}

/// Flags of `kvrouted simulate`.
#[derive(Debug, Clone, clap::Args)]
#[command(group(clap::ArgGroup::new("workload").required(true).args(["trace", "generate"])))]
pub struct SimulateArgs {
    /// Mooncake JSONL trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Generate a workload instead of reading a trace.
    #[arg(long, value_enum, value_name = "KIND")]
    pub generate: Option<Generator>,
    /// Run the same workload once per value of one flag, e.g. `min-match-ratio=0,0.1,0.2`;
    /// the table gets the value as its first column.
    #[arg(long, value_name = "FLAG=V1,V2,...", value_parser = parse_sweep)]
    pub sweep: Option<Sweep>,
    /// Tokens per block of the trace's hash ids (and the router's block size).
    #[arg(long, default_value_t = 512)]
    pub block_tokens: u32,
    /// Simulate only the first N requests.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Divide the trace's arrival times by this factor (2 = twice the request rate).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,

    /// Policies to compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = PolicyKind::ALL)]
    pub policy: Vec<PolicyKind>,
    /// Seed of the generator, the load-sample phases and the router's random choices.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the results as one JSON document on stdout.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG plot (TTFT CDF and hit ratio per policy).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// No progress lines on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Policies simulated in parallel (default: available cores).
    #[arg(long)]
    pub threads: Option<usize>,

    /// Number of simulated workers.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// KV cache capacity of each worker, in blocks.
    #[arg(long, default_value_t = 2048)]
    pub capacity_blocks: u64,
    /// Batch limit: requests running at once on a worker (the load samples' max_running).
    #[arg(long, default_value_t = 16)]
    pub max_running: u32,
    /// Prefill time per uncached prompt token, seconds.
    #[arg(long, default_value_t = 1e-4)]
    pub prefill_s_per_token: f64,
    /// Decode time per output token, seconds.
    #[arg(long, default_value_t = 0.02)]
    pub decode_s_per_token: f64,
    /// Delay of KV events from a worker to the router.
    #[arg(long, value_parser = parse_duration, default_value = "50ms")]
    pub kv_event_delay: Duration,
    /// Interval of each worker's load samples.
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    pub load_interval: Duration,
    /// Interval of the router's housekeeping ticks.
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    pub tick_interval: Duration,
    /// Routers behind a round-robin gateway (1 to 64): each applies every worker event, routes
    /// go to each in turn, and a gateway releases on the replica that routed the request.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// With --replicas above 1: how long one replica's decisions and releases take to reach
    /// the others (`0ms`: at once; `off`: replicas do not share them and decide alone).
    #[arg(long, value_parser = parse_decision_delay, default_value = "5ms", value_name = "DURATION|off")]
    pub decision_delay: DecisionDelay,

    /// Router: no new owner of a prefix once this many are known.
    #[arg(long)]
    pub max_owners_per_prefix: Option<usize>,
    /// Router: no second spill of a prefix within this window.
    #[arg(long, value_parser = parse_duration)]
    pub spill_cooldown: Option<Duration>,
    /// Router: pressure above this is never safe.
    #[arg(long)]
    pub pressure_high_water: Option<f64>,
    /// Router: how far above the best owner an owner may be before it is pressured.
    #[arg(long)]
    pub pressure_slack: Option<f64>,
    /// Router: matches shallower than this many blocks are cold misses.
    #[arg(long)]
    pub min_match_blocks: Option<u32>,
    /// Router: matches covering less than this fraction of the prompt are cold misses.
    #[arg(long, value_parser = crate::config::parse_fraction)]
    pub min_match_ratio: Option<f64>,
    /// Router: at the owner ceiling, spill anyway when every owner is above this pressure
    /// (`off`: never).
    #[arg(long, value_parser = crate::config::parse_optional_pressure)]
    pub ceiling_overflow_pressure: Option<crate::config::OptionalPressure>,
    /// Router: unfinished reserved prefill tokens that count as 1.0 of pressure (0: not folded).
    #[arg(long)]
    pub backlog_pressure_tokens: Option<u64>,
    /// Router: lifetime of its own routing records as ownership.
    #[arg(long, value_parser = parse_duration)]
    pub approx_ttl: Option<Duration>,

    /// Generator: number of agent sessions.
    #[arg(long, default_value_t = AgenticParams::default().sessions)]
    pub sessions: usize,
    /// Generator: mean turns per session (uniform in [turns/2, 3*turns/2]).
    #[arg(long, default_value_t = AgenticParams::default().turns)]
    pub turns: usize,
    /// Generator: mean tokens of the first user message.
    #[arg(long, default_value_t = AgenticParams::default().first_turn_tokens)]
    pub first_turn_tokens: u64,
    /// Generator: mean tokens of tool output added per turn.
    #[arg(long, default_value_t = AgenticParams::default().growth_tokens)]
    pub growth_tokens: u64,
    /// Generator: mean output tokens per turn.
    #[arg(long, default_value_t = AgenticParams::default().output_tokens)]
    pub output_tokens: u64,
    /// Generator: mean think (tool) time between a turn's answer and the next turn.
    #[arg(long, value_parser = parse_duration, default_value = "2s")]
    pub think_time: Duration,
    /// Generator: distinct system prompts shared by the sessions.
    #[arg(long, default_value_t = AgenticParams::default().system_prompts)]
    pub system_prompts: usize,
    /// Generator: tokens of each system prompt.
    #[arg(long, default_value_t = AgenticParams::default().system_prompt_tokens)]
    pub system_prompt_tokens: u64,
    /// Generator: new sessions per second (Poisson).
    #[arg(long, default_value_t = AgenticParams::default().session_rate)]
    pub session_rate: f64,
    /// Generator: a session ends when its context would exceed this many tokens.
    #[arg(long, default_value_t = AgenticParams::default().max_context_tokens)]
    pub max_context_tokens: u64,

    /// Shared-prefix generator: number of single-turn requests.
    #[arg(long, default_value_t = SharedPrefixParams::default().requests)]
    pub requests: usize,
    /// Shared-prefix generator: requests per second (Poisson).
    #[arg(long, default_value_t = SharedPrefixParams::default().request_rate)]
    pub request_rate: f64,
    /// Shared-prefix generator: number of distinct common prefixes.
    #[arg(long, default_value_t = SharedPrefixParams::default().prefixes)]
    pub prefixes: usize,
    /// Shared-prefix generator: tokens of each common prefix.
    #[arg(long, default_value_t = SharedPrefixParams::default().prefix_tokens)]
    pub prefix_tokens: u64,
    /// Shared-prefix generator: Zipf exponent of prefix popularity (0 = uniform).
    #[arg(long, default_value_t = SharedPrefixParams::default().prefix_skew)]
    pub prefix_skew: f64,
    /// Shared-prefix generator: mean tokens of each request's own part after its prefix.
    #[arg(long, default_value_t = SharedPrefixParams::default().suffix_tokens)]
    pub suffix_tokens: u64,
}

impl SimulateArgs {
    /// The generator parameters given by the flags.
    pub fn agentic_params(&self) -> AgenticParams {
        AgenticParams {
            sessions: self.sessions,
            turns: self.turns,
            first_turn_tokens: self.first_turn_tokens,
            growth_tokens: self.growth_tokens,
            output_tokens: self.output_tokens,
            think_us: self.think_time.as_micros() as u64,
            system_prompts: self.system_prompts,
            system_prompt_tokens: self.system_prompt_tokens,
            session_rate: self.session_rate,
            max_context_tokens: self.max_context_tokens,
        }
    }

    /// The shared-prefix generator parameters given by the flags (`--output-tokens` is shared
    /// with the agentic generator).
    pub fn shared_prefix_params(&self) -> SharedPrefixParams {
        SharedPrefixParams {
            requests: self.requests,
            request_rate: self.request_rate,
            prefixes: self.prefixes,
            prefix_tokens: self.prefix_tokens,
            prefix_skew: self.prefix_skew,
            suffix_tokens: self.suffix_tokens,
            output_tokens: self.output_tokens,
        }
    }

    /// These flags with `--{flag} {value}` set instead (for one run of a sweep). The value goes
    /// through the flag's own parser.
    pub fn with_flag(&self, flag: &str, value: &str) -> anyhow::Result<SimulateArgs> {
        use clap::{Args as _, FromArgMatches as _};
        let command = SimulateArgs::augment_args(clap::Command::new("simulate"));
        let argv = [
            "simulate",
            "--generate",
            "agentic",
            &format!("--{flag}"),
            value,
        ];
        let matches = command.try_get_matches_from(argv).map_err(|e| {
            anyhow::anyhow!("--{flag} {value}: {}", crate::config::clap_error_line(&e))
        })?;
        let parsed = SimulateArgs::from_arg_matches(&matches)
            .map_err(|e| anyhow::anyhow!("--{flag} {value}: {e}"))?;
        let mut args = self.clone();
        match flag {
            "min-match-blocks" => args.min_match_blocks = parsed.min_match_blocks,
            "min-match-ratio" => args.min_match_ratio = parsed.min_match_ratio,
            "ceiling-overflow-pressure" => {
                args.ceiling_overflow_pressure = parsed.ceiling_overflow_pressure
            }
            "backlog-pressure-tokens" => {
                args.backlog_pressure_tokens = parsed.backlog_pressure_tokens
            }
            "max-owners-per-prefix" => args.max_owners_per_prefix = parsed.max_owners_per_prefix,
            "spill-cooldown" => args.spill_cooldown = parsed.spill_cooldown,
            "pressure-high-water" => args.pressure_high_water = parsed.pressure_high_water,
            "pressure-slack" => args.pressure_slack = parsed.pressure_slack,
            "approx-ttl" => args.approx_ttl = parsed.approx_ttl,
            "workers" => args.workers = parsed.workers,
            "capacity-blocks" => args.capacity_blocks = parsed.capacity_blocks,
            "max-running" => args.max_running = parsed.max_running,
            "speedup" => args.speedup = parsed.speedup,
            "session-rate" => args.session_rate = parsed.session_rate,
            "request-rate" => args.request_rate = parsed.request_rate,
            "prefix-skew" => args.prefix_skew = parsed.prefix_skew,
            "seed" => args.seed = parsed.seed,
            "replicas" => args.replicas = parsed.replicas,
            "decision-delay" => args.decision_delay = parsed.decision_delay,
            other => anyhow::bail!(
                "--{other} cannot be swept; sweepable: {}",
                SWEEPABLE.join(", ")
            ),
        }
        args.sweep = None;
        Ok(args)
    }

    /// The trace the flags describe (read or generated), limited and sped up.
    pub fn workload(&self) -> anyhow::Result<Trace> {
        anyhow::ensure!(
            self.speedup.is_finite() && self.speedup > 0.0,
            "--speedup must be a positive number"
        );
        let mut trace = match (&self.trace, self.generate) {
            (Some(path), _) => Trace::load_mooncake(path, self.block_tokens, self.limit)?,
            (None, Some(Generator::Agentic)) => {
                let mut t =
                    generate::agentic(&self.agentic_params(), self.block_tokens, self.seed)?;
                if let Some(limit) = self.limit {
                    t.truncate(limit);
                }
                t
            }
            (None, Some(Generator::SharedPrefix)) => {
                let mut t = generate::shared_prefix(
                    &self.shared_prefix_params(),
                    self.block_tokens,
                    self.seed,
                )?;
                if let Some(limit) = self.limit {
                    t.truncate(limit);
                }
                t
            }
            (None, None) => {
                anyhow::bail!("give --trace FILE or --generate agentic|shared-prefix")
            }
        };
        if self.speedup != 1.0 {
            trace.speed_up(self.speedup);
        }
        Ok(trace)
    }

    /// The simulated fleet and router settings the flags describe.
    pub fn sim_config(&self) -> SimConfig {
        let mut router = RouterConfig::default();
        let policy = &mut router.policy;
        if let Some(v) = self.max_owners_per_prefix {
            policy.max_owners_per_prefix = v;
        }
        if let Some(v) = self.spill_cooldown {
            policy.spill_cooldown_ms = v.as_millis() as u64;
        }
        if let Some(v) = self.pressure_high_water {
            policy.high_water = v;
        }
        if let Some(v) = self.pressure_slack {
            policy.pressure_slack = v;
        }
        if let Some(v) = self.min_match_blocks {
            policy.min_match_blocks = v;
        }
        if let Some(v) = self.min_match_ratio {
            policy.min_match_ratio = v;
        }
        if let Some(v) = self.ceiling_overflow_pressure {
            policy.ceiling_overflow_pressure = v.0;
        }
        if let Some(v) = self.backlog_pressure_tokens {
            policy.backlog_pressure_tokens = v;
        }
        if let Some(v) = self.approx_ttl {
            router.approx_ttl_ms = v.as_millis() as u64;
        }
        SimConfig {
            workers: self.workers,
            capacity_blocks: self.capacity_blocks,
            max_running: self.max_running,
            prefill_s_per_token: self.prefill_s_per_token,
            decode_s_per_token: self.decode_s_per_token,
            kv_event_delay_ms: self.kv_event_delay.as_millis() as u64,
            load_interval_ms: self.load_interval.as_millis() as u64,
            tick_interval_ms: self.tick_interval.as_millis() as u64,
            router,
            seed: self.seed,
            replicas: self.replicas,
            decision_delay_ms: self.decision_delay.0.map(|d| d.as_millis() as u64),
        }
    }

    fn describe(&self, trace: &Trace) -> String {
        let source = match &self.trace {
            Some(path) => path.display().to_string(),
            None => match self.generate {
                Some(Generator::SharedPrefix) => "generated shared-prefix workload".to_string(),
                _ => "generated agentic workload".to_string(),
            },
        };
        let routers = match (self.replicas, self.decision_delay.0) {
            (1, _) => String::new(),
            (n, Some(delay)) => format!(", {n} replicas sharing decisions after {delay:?}"),
            (n, None) => format!(", {n} replicas not sharing decisions"),
        };
        format!(
            "{source}: {} requests, {} workers x {} blocks of {} tokens, max_running {}{routers}",
            trace.requests.len(),
            self.workers,
            self.capacity_blocks,
            trace.block_tokens,
            self.max_running
        )
    }
}

/// Simulates every policy of `policies` on the same trace and configuration, `threads` at a
/// time; reports come back in the order of `policies`.
pub fn simulate_all(
    trace: &Trace,
    config: &SimConfig,
    policies: &[PolicyKind],
    threads: usize,
    progress: Option<engine::Progress>,
) -> anyhow::Result<Vec<PolicyReport>> {
    config.validate()?;
    let keys = trace_keys(trace);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<anyhow::Result<PolicyReport>>>> =
        Mutex::new((0..policies.len()).map(|_| None).collect());
    let threads = threads.clamp(1, policies.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(&policy) = policies.get(i) else {
                    break;
                };
                let result = simulate(trace, &keys, config, policy, progress);
                results.lock().expect("no thread panicked holding the lock")[i] = Some(result);
            });
        }
    });
    results
        .into_inner()
        .expect("no thread panicked holding the lock")
        .into_iter()
        .map(|r| r.expect("every policy was simulated"))
        .collect()
}

/// Runs `kvrouted simulate`: prints the table (or `--json`) on stdout, progress on stderr, and
/// writes the `--plot`.
pub fn run(args: &SimulateArgs) -> anyhow::Result<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    run_to(args, &mut out)
}

/// [`run`] writing the results to `out` instead of stdout.
pub fn run_to(args: &SimulateArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    match &args.sweep {
        Some(sweep) => run_sweep(args, sweep, out),
        None => run_once(args, out),
    }
}

/// One simulation per value of the swept flag, one after the other; one table (or JSON
/// document) with the value as a column.
fn run_sweep(args: &SimulateArgs, sweep: &Sweep, out: &mut dyn Write) -> anyhow::Result<()> {
    anyhow::ensure!(!args.policy.is_empty(), "--policy names no policy");
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mut runs = Vec::new();
    let mut description = String::new();
    for value in &sweep.values {
        let one = args.with_flag(&sweep.flag, value)?;
        let trace = one.workload()?;
        let config = one.sim_config();
        config.validate()?;
        if description.is_empty() {
            description = one.describe(&trace);
        }
        if !args.quiet {
            eprintln!(
                "simulate: --{} {value}: {}",
                sweep.flag,
                one.describe(&trace)
            );
        }
        let reports = simulate_all(&trace, &config, &args.policy, threads, None)?;
        runs.push((value.clone(), reports));
    }
    if args.json {
        writeln!(out, "{}", report::sweep_to_json(&sweep.flag, &runs))?;
    } else {
        writeln!(out, "{description}; sweep --{}\n", sweep.flag)?;
        write!(out, "{}", report::sweep_to_table(&sweep.flag, &runs))?;
    }
    Ok(())
}

fn run_once(args: &SimulateArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    anyhow::ensure!(!args.policy.is_empty(), "--policy names no policy");
    let trace = args.workload()?;
    let config = args.sim_config();
    config.validate()?;
    let description = args.describe(&trace);
    if !args.quiet {
        eprintln!("simulate: {description}");
    }
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let print_progress = |policy: PolicyKind, done: u64, total: u64| {
        eprintln!(
            "simulate: {:<14} {:>3}% ({done}/{total} requests)",
            policy.as_str(),
            done * 100 / total.max(1)
        );
    };
    let progress: Option<engine::Progress> = if args.quiet {
        None
    } else {
        Some(&print_progress)
    };
    let reports = simulate_all(&trace, &config, &args.policy, threads, progress)?;
    if args.json {
        writeln!(out, "{}", report::to_json(&reports))?;
    } else {
        writeln!(out, "{description}\n")?;
        write!(out, "{}", report::to_table(&reports))?;
    }
    if let Some(path) = &args.plot {
        std::fs::write(path, plot::to_svg(&reports, &description))
            .with_context(|| format!("writing plot {}", path.display()))?;
        if !args.quiet {
            eprintln!("simulate: wrote {}", path.display());
        }
    }
    Ok(())
}
