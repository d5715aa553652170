//! Re-applying a journal through the core: daemon recovery ([`replay`]) and `kvrouted replay`
//! ([`run`]), the audit and counterfactual of docs/architecture.md, "Audit replay".

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use crate::config::PolicyArgs;
use crate::input::{Input, Stamped};
use crate::journal::{self, Journal, JournalEntry, JournalError, RouteOutcome, Snapshot};
use crate::router::{Output, Router, RouterConfig};

/// A decision whose re-derived outcome differs from the recorded one.
#[derive(Debug, Clone, PartialEq)]
pub struct Divergence {
    pub seq: u64,
    pub recorded: RouteOutcome,
    pub replayed: RouteOutcome,
}

/// What a replay did. Not comparable as a whole: it holds the time applying took.
#[derive(Debug, Clone, Default)]
pub struct ReplayStats {
    pub entries: u64,
    pub decisions: u64,
    /// Decisions whose worker or label differs from the recorded one.
    pub changed: u64,
    pub first_divergence: Option<Divergence>,
    /// Route inputs applied, and the time the core took to apply them: what a journal's
    /// routes cost the router alone, without HTTP, parsing or the journal's own writes.
    pub routes: u64,
    pub routes_apply: Duration,
    /// The time the core took to apply every other input (KV events, load samples, ...).
    pub others_apply: Duration,
}

/// Replays `entries` onto `snapshot` (or an empty router). Every `Configure` input passes
/// through `adjust` first, which is how a counterfactual overrides recorded settings.
/// `on_output` sees each applied entry and what it produced.
pub fn replay(
    snapshot: Option<Snapshot>,
    entries: impl Iterator<Item = Result<(u64, JournalEntry), JournalError>>,
    adjust: &dyn Fn(&mut RouterConfig),
    mut on_output: impl FnMut(u64, &JournalEntry, &Output),
) -> Result<(Router, ReplayStats), JournalError> {
    let mut router = match snapshot {
        Some(s) => {
            let mut config = s.config;
            adjust(&mut config);
            Router::from_state(config, s.state)
        }
        None => {
            let mut config = RouterConfig::default();
            adjust(&mut config);
            Router::new(config)
        }
    };
    let mut stats = ReplayStats::default();
    for item in entries {
        let (seq, mut entry) = item?;
        if let Input::Configure(config) = &mut entry.input {
            adjust(config);
        }
        let stamped = Stamped {
            seq,
            at_ms: entry.at_ms,
            input: entry.input,
        };
        let is_route = matches!(stamped.input, Input::Route(_));
        let started = Instant::now();
        let output = router.apply(&stamped);
        let took = started.elapsed();
        if is_route {
            stats.routes += 1;
            stats.routes_apply += took;
        } else {
            stats.others_apply += took;
        }
        entry.input = stamped.input;
        stats.entries += 1;
        if let (Some(recorded), Some(replayed)) = (&entry.outcome, RouteOutcome::of(&output)) {
            stats.decisions += 1;
            if *recorded != replayed {
                stats.changed += 1;
                if stats.first_divergence.is_none() {
                    stats.first_divergence = Some(Divergence {
                        seq,
                        recorded: recorded.clone(),
                        replayed,
                    });
                }
            }
        }
        on_output(seq, &entry, &output);
    }
    Ok((router, stats))
}

/// Flags of `kvrouted replay`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Data dir of a stopped daemon
    #[arg(long, conflicts_with = "journal", required_unless_present = "journal")]
    pub data_dir: Option<PathBuf>,
    /// A file written by `kvrouted journal export`
    #[arg(long)]
    pub journal: Option<PathBuf>,
    /// Exit non-zero, naming the first divergent decision, if any re-derived decision differs
    #[arg(long)]
    pub verify: bool,
    /// Write every re-derived decision as JSON lines
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Any policy flag given here overrides the recorded setting (a counterfactual)
    #[command(flatten)]
    pub policy: PolicyArgs,
}

/// `kvrouted replay`: re-derives every decision of a journal, writes them with `--out`, and
/// with `--verify` fails on the first divergence.
pub fn run(args: &ReplayArgs) -> anyhow::Result<ExitCode> {
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
    let adjust = |config: &mut RouterConfig| {
        let applied = args.policy.apply(config);
        changes.borrow_mut().extend(applied);
    };
    let mut write_error = None;
    let (_, stats) = replay(snapshot, entries, &adjust, |seq, entry, output| {
        let Some(out) = out.as_mut() else { return };
        let line = match output {
            Output::Routed(d) => serde_json::json!({
                "seq": seq, "at_ms": entry.at_ms, "request_id": d.request_id,
                "reservation": d.reservation, "worker": d.worker, "decision": d.decision, "matched_blocks": d.matched_blocks,
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
    let each_us = |took: Duration, n: u64| 1e6 * took.as_secs_f64() / n.max(1) as f64;
    let others = stats.entries - stats.routes;
    println!(
        "applying them took the core {:.2} s: {} routes in {:.2} s ({:.1} µs each), {others} other inputs in {:.2} s ({:.1} µs each)",
        (stats.routes_apply + stats.others_apply).as_secs_f64(),
        stats.routes,
        stats.routes_apply.as_secs_f64(),
        each_us(stats.routes_apply, stats.routes),
        stats.others_apply.as_secs_f64(),
        each_us(stats.others_apply, others),
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
