//! kvrouted's index side by side with the two public Rust KV indexers (issue 6), on one KV
//! event stream: `kv-index`'s `ChainIndex`, and `dynamo-kv-router`'s `RadixTree` (single
//! threaded), `PositionalIndexer` (called directly) and the two backends Dynamo deploys behind
//! `ThreadPoolIndexer` (`PositionalIndexer` and `ConcurrentRadixTreeCompressed`).
//!
//! Run: `cargo bench --bench peers` (release; about five minutes on 2 cores at the defaults).
//! Options, after `--` (`-- --help` lists them; an unknown option or index name stops the run):
//! `--trace PATH` (or env `PEERS_TRACE`; default `../shared/traces/conversation_trace.jsonl`
//! relative to the crate root), `--dup N` (default 8), `--capacity BLOCKS` (default 4096),
//! `--workers 16,256,1024,4096` (the default; kv-index stops at 1,024), `--reps N` (default 5),
//! `--requests N` (first N trace lines only), `--only kvrouted,kv-index` (a subset of the
//! indexes, e.g. to profile one), `--only-depths MIN..MAX` and `--only-prompt-blocks MIN..MAX`
//! (a subset of the lookups, by their deepest match or their prompt's length in blocks: `96..`
//! times the longest matches, `..4` the cold misses and the shortest; every event still runs,
//! and the goals are not judged), `--pause DURATION` (a wait before each index's run, e.g.
//! `4s`) and `--per-rep` (each repetition's rates, not only the medians): the two that showed
//! why some runs apply more slowly on a VM that takes back freed memory (docs/performance.md,
//! the forty-first part); `--isolate` (each repetition of each index in a process of its own, so
//! no index grows into memory another freed: the forty-fourth part; the heap the stream's
//! construction freed goes back to the kernel before the index runs: the forty-sixth part).
//!
//! After each fleet size's table the run states the performance round's goals it can read off
//! that table, met or missed (`goals.rs`). Last, after every row has run, it states what a random
//! access to 64 MiB of memory costs on this machine (`machine.rs`): a long match pays about that
//! per block, and on a virtual machine it moves with the host.
//!
//! # The stream (precomputed once per worker count, then replayed through every index)
//!
//! - The Mooncake trace's `hash_ids` (512-token blocks; equal ids at the same position are the
//!   same prefix) are replayed `dup` times with disjoint id spaces, the copies interleaved request
//!   by request: `dup` tenants with the trace's shape, so the index is large enough that fixed
//!   costs do not dominate the memory figure. A block's content hash and its engine hash are two
//!   independent 64-bit mixes of its (tenant, id).
//! - Each request is first looked up (every index must answer, per worker, how many leading
//!   blocks it holds). It then goes to a worker by a fixed rule: the lowest-numbered worker with
//!   the deepest match if that match is at least 2 blocks (deeper than the tenant's shared first
//!   block), otherwise the next worker round robin.
//! - That worker holds a per-worker LRU of `capacity` blocks (the request is truncated to it).
//!   Its held prefix is touched; blocks are evicted least recently used first until the new
//!   blocks fit, published as one `BlockRemoved` with their engine hashes; the new blocks are
//!   published as one `BlockStored` whose parent is the last held block. Within a request a block
//!   counts as more recently used than the blocks after it (vLLM frees a request's blocks tail
//!   first), so a worker's holdings are always whole prefixes and evictions take leaves.
//! - The generator tracks who holds what, so every lookup has a known answer: a fingerprint of
//!   the (worker, depth) pairs. Every index's answer to every lookup is checked against it.
//!
//! # What is timed
//!
//! Each operation is timed on its own (`Instant` around the call; the timer's own cost is
//! printed). Each index receives its native input, built before the timer starts. kvrouted's
//! lookups include chaining the content hashes into its block keys as the walk draws them, a
//! few ahead of the one it reads (what a gateway that sends `tokens` costs it), stopping at the
//! first block no worker continues, as the peers stop walking content hashes. Result shapes are
//! each API's own: kvrouted and kv-index write depths into a caller's buffer (`OwnerIndex::walk`,
//! `ChainIndex::score_into`), dynamo returns a map (`RadixTree::find_matches`), whose drop is
//! timed too. Memory is the counting allocator's live bytes held by the index after the replay,
//! per (worker, block) entry resident at the end.
//!
//! Behind `ThreadPoolIndexer` (rows `dynamo-positional-pool`, `dynamo-crtc-pool`; its default
//! of 4 event threads, on a machine that may have fewer cores) events are applied on other
//! threads. Their events/s is a bulk pass: every event of the stream enqueued, then one wait
//! until all are applied, timed from the first enqueue. The checked pass waits (untimed) before
//! each lookup, so every answer reflects every earlier event; lookups run inline on the calling
//! thread, as the pool runs them (`ConcurrentRadixTreeCompressed` applies events only through a
//! pool: its `apply_event` is not public).
//!
//! Two diagnostic rows follow. `kvrouted-keys` is kvrouted's index with the block keys chained
//! before the clock starts (what a gateway sending `block_keys` saves it). `kvrouted-router`
//! replays the same stream through kvrouted's whole state machine
//! (`Router::apply`): events as KV event batches, lookups as full route decisions (policy,
//! reservations, decision record; approximate ownership disabled with a zero TTL so the answers
//! stay comparable, checked by the decision's matched depth). Neither is equivalent work to the
//! three index rows; the second shows what the daemon's single writer pays per input.

mod goals;
mod machine;
mod subjects;
mod workload;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::builder::RangedU64ValueParser;
use clap::Parser;
use kvrouted::config::parse_duration;
use kvrouted::sim::percentile;
use subjects::*;
use workload::*;

// ---------------------------------------------------------------------------------------------
// Counting allocator: live heap bytes, for the memory figures.

use kvrouted_testkit::counting_alloc::{self, Counting};

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Live bytes: the allocator's, and those of kvrouted's table arrays that are mappings of their
/// own (a huge page or more, on Linux), which the allocator does not see.
fn live() -> usize {
    counting_alloc::live_bytes() + kvrouted::index::mapped_table_bytes()
}

// ---------------------------------------------------------------------------------------------
// Options.

/// kv-index's `ChainIndex` indexes at most this many workers.
const KV_INDEX_MAX_WORKERS: usize = 1024;
const MAX_WORKERS: usize = 16_384;

/// Command-line options (after `--` in `cargo bench --bench peers -- ...`).
#[derive(Parser)]
#[command(
    name = "peers",
    about = "kvrouted's index side by side with the public Rust KV indexers, on one KV event stream"
)]
struct Options {
    /// Mooncake JSONL trace
    #[arg(long, value_name = "PATH", env = "PEERS_TRACE", default_value = DEFAULT_TRACE)]
    trace: PathBuf,
    /// Copies of the trace, replayed as tenants with disjoint block ids
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    dup: u64,
    /// Blocks each worker holds
    #[arg(long, value_name = "BLOCKS", default_value_t = 4096, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    capacity: usize,
    /// Fleet sizes (kv-index has no row above 1,024 workers, its limit)
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "16,256,1024,4096",
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_WORKERS as u64)
    )]
    workers: Vec<usize>,
    /// Repetitions per index; medians are reported
    #[arg(long, default_value_t = 5, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    reps: usize,
    /// Replay only the trace's first N requests
    #[arg(long, value_name = "N")]
    requests: Option<usize>,
    /// Only these indexes (for profiling one of them)
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(SUBJECTS))]
    only: Option<Vec<String>>,
    #[command(flatten)]
    lookups: LookupFilter,
    /// Wait this long before each index's run, with its unit (`4s`, `500ms`). For diagnosing runs
    /// that differ: a VM whose balloon reports free memory takes back what the process freed
    /// within seconds, and memory it took back costs a fault on the host at its next first touch
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = parse_duration)]
    pause: Duration,
    /// Print each repetition's rates as it finishes, not only the medians
    #[arg(long)]
    per_rep: bool,
    /// Run each repetition of each index in a process of its own (this binary again, with the
    /// same trace and options), so no index grows its tables into memory another index freed:
    /// every row starts from a new process, as a daemon does, with the heap the stream's
    /// construction freed handed back to the kernel first (on glibc). In one process an index is
    /// faster after a row that freed tables like its own (docs/performance.md, the forty-third
    /// part). Each process builds the stream again, so a run takes longer
    #[arg(long)]
    isolate: bool,
    /// What `--isolate` runs, with the run's own options: one repetition of INDEX at WORKERS
    /// workers, printed as one JSON line (the run's `--only`, `--workers` and `--reps` are not
    /// read)
    #[arg(long, hide = true, value_name = "INDEX:WORKERS", value_parser = parse_one_repetition)]
    one_repetition: Option<(String, usize)>,
    /// Passed by `cargo bench`; ignored
    #[arg(long, hide = true)]
    bench: bool,
}

/// `INDEX:WORKERS`, as `--isolate` asks for one repetition.
fn parse_one_repetition(text: &str) -> Result<(String, usize), String> {
    let (name, workers) = text
        .split_once(':')
        .ok_or_else(|| format!("`{text}` is not INDEX:WORKERS"))?;
    if !SUBJECTS.contains(&name) {
        return Err(format!("`{name}` is not an index of the bench"));
    }
    let workers = workers
        .parse()
        .map_err(|e| format!("`{workers}` is not a number of workers: {e}"))?;
    Ok((name.to_string(), workers))
}

/// A range of block counts, `MIN..MAX` (MAX excluded).
type Blocks = std::ops::Range<u32>;

/// `MIN..MAX`, `MIN..` or `..MAX`, in blocks.
fn parse_blocks(text: &str) -> Result<Blocks, String> {
    let (min, max) = text
        .split_once("..")
        .ok_or_else(|| format!("`{text}` is not a range of blocks such as 4..32, 96.. or ..4"))?;
    let end = |s: &str, default: u32| {
        if s.is_empty() {
            Ok(default)
        } else {
            s.parse::<u32>()
                .map_err(|e| format!("`{s}` in `{text}` is not a block count: {e}"))
        }
    };
    let range = end(min, 0)?..end(max, u32::MAX)?;
    if range.is_empty() {
        return Err(format!("`{text}` holds no block count"));
    }
    Ok(range)
}

/// Which lookups a run replays: all of them unless `--only-depths` or `--only-prompt-blocks`
/// narrow them.
#[derive(clap::Args)]
struct LookupFilter {
    /// Only the lookups whose deepest match is MIN to MAX blocks (`MIN..MAX`, either end may be
    /// left out, MAX excluded): the others are left out of the replay, every event still runs.
    /// For timing or profiling one kind of lookup; the goals are not judged
    #[arg(long = "only-depths", value_name = "MIN..MAX", value_parser = parse_blocks)]
    depths: Option<Blocks>,
    /// Only the lookups of prompts of MIN to MAX blocks (`MIN..MAX`, as --only-depths)
    #[arg(long = "only-prompt-blocks", value_name = "MIN..MAX", value_parser = parse_blocks)]
    prompt_blocks: Option<Blocks>,
}

impl LookupFilter {
    fn admits(&self, max_depth: u32, prompt_blocks: u32) -> bool {
        let within = |range: &Option<Blocks>, n: u32| range.as_ref().is_none_or(|r| r.contains(&n));
        within(&self.depths, max_depth) && within(&self.prompt_blocks, prompt_blocks)
    }

    fn is_narrowed(&self) -> bool {
        self.depths.is_some() || self.prompt_blocks.is_some()
    }
}

/// The trace beside the repository (`../shared/traces/`); it is never copied into it.
const DEFAULT_TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/traces/conversation_trace.jsonl"
);

// ---------------------------------------------------------------------------------------------
// Replay and report.

#[derive(serde::Serialize, serde::Deserialize)]
struct Rep {
    events_per_s: f64,
    lookups_per_s: f64,
    p50_ns: u64,
    p99_ns: u64,
    bytes: usize,
    mismatches: u64,
    errors: u64,
    notes: String,
}

/// Event application of a threaded subject: every event enqueued, then settled (no lookups in
/// between, so the event threads are never held up by the checks).
fn bulk_events<S: Subject>(stream: &Stream) -> u64 {
    let mut subject = S::new(stream.workers);
    let ns: u64 = stream
        .ops
        .iter()
        .map(|op| apply_event(&mut subject, stream, op))
        .sum();
    ns + subject.settle()
}

/// Applies a store or remove op to `subject`; nanoseconds it took (0 for a lookup).
fn apply_event<S: Subject>(subject: &mut S, stream: &Stream, op: &Op) -> u64 {
    match *op {
        Op::Lookup { .. } => 0,
        Op::Store {
            worker,
            start,
            skip,
            len,
        } => {
            let (from, to) = ((start + skip) as usize, (start + len) as usize);
            let parent = (skip > 0).then(|| stream.engines[from - 1]);
            subject.store(
                worker,
                parent,
                &stream.locals[from..to],
                &stream.engines[from..to],
            )
        }
        Op::Remove { worker, start, len } => subject.remove(
            worker,
            &stream.removed[start as usize..(start + len) as usize],
        ),
    }
}

fn replay<S: Subject>(stream: &Stream, filter: &LookupFilter) -> Rep {
    let bulk_event_ns = S::THREADED.then(|| bulk_events::<S>(stream));
    let mut latencies = Vec::with_capacity(stream.lookups);
    let mut depth = vec![0u32; stream.workers];
    let mut mismatches = 0u64;
    let mut first_mismatch = None;
    let mut event_ns = 0u64;
    let before = live();
    let mut subject = S::new(stream.workers);
    for (n, op) in stream.ops.iter().enumerate() {
        match *op {
            Op::Lookup {
                start,
                len,
                expect,
                max_depth,
            } => {
                if !filter.admits(max_depth, len) {
                    continue;
                }
                depth.fill(0);
                // A threaded subject answers from what its event threads have applied.
                subject.settle();
                let locals = &stream.locals[start as usize..(start + len) as usize];
                let (ns, answer) = subject.lookup(locals, &mut depth);
                latencies.push(ns);
                let ok = match answer {
                    Answer::Depths => {
                        let got = fingerprint(
                            depth
                                .iter()
                                .enumerate()
                                .filter(|(_, &d)| d > 0)
                                .map(|(w, &d)| (w as u32, d)),
                        );
                        got == expect
                    }
                    Answer::MaxDepth { matched, threshold } => {
                        max_depth < threshold || matched == max_depth
                    }
                };
                if !ok {
                    mismatches += 1;
                    first_mismatch.get_or_insert(n);
                }
            }
            Op::Store { .. } | Op::Remove { .. } => {
                event_ns += apply_event(&mut subject, stream, op);
            }
        }
    }
    let bytes = live()
        .saturating_sub(before)
        .saturating_sub(subject.bench_bytes());
    let errors = subject.errors();
    let mut notes = subject.notes();
    if let Some(n) = first_mismatch {
        notes.push_str(&format!(" first_mismatch_op={n}"));
    }
    drop(subject);
    let event_ns = bulk_event_ns.unwrap_or(event_ns);
    let lookup_ns: u64 = latencies.iter().sum();
    latencies.sort_unstable();
    Rep {
        events_per_s: (stream.stored_blocks + stream.removed_blocks) as f64
            / (event_ns as f64 / 1e9),
        lookups_per_s: latencies.len() as f64 / (lookup_ns as f64 / 1e9),
        p50_ns: percentile(&latencies, 0.50),
        p99_ns: percentile(&latencies, 0.99),
        bytes,
        mismatches,
        errors,
        notes,
    }
}

fn median_f(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn median_u(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

const SUBJECTS: [&str; 8] = [
    "kvrouted",
    "dynamo-kv-router",
    "dynamo-positional",
    "dynamo-positional-pool",
    "dynamo-crtc-pool",
    "kv-index",
    "kvrouted-router",
    "kvrouted-keys",
];

fn run_subject(name: &str, stream: &Stream, filter: &LookupFilter) -> Rep {
    match name {
        "kvrouted" => replay::<Kvrouted<false>>(stream, filter),
        "kvrouted-keys" => replay::<Kvrouted<true>>(stream, filter),
        "dynamo-kv-router" => replay::<Dynamo>(stream, filter),
        "dynamo-positional" => replay::<DynamoPositional>(stream, filter),
        "dynamo-positional-pool" => {
            replay::<DynamoPool<dynamo_kv_router::PositionalIndexer>>(stream, filter)
        }
        "dynamo-crtc-pool" => {
            replay::<DynamoPool<dynamo_kv_router::ConcurrentRadixTreeCompressed>>(stream, filter)
        }
        "kv-index" => replay::<KvIndex>(stream, filter),
        "kvrouted-router" => replay::<FullRouter>(stream, filter),
        other => unreachable!("{other}"),
    }
}

/// One repetition of `name` at `workers` in a process of its own (`--isolate`): this binary
/// again, with this run's own arguments (the trace, its options and the lookup filter as given)
/// and `--one-repetition`.
fn run_isolated(name: &str, workers: usize) -> Rep {
    let exe = std::env::current_exe().expect("the bench's own path");
    let output = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .arg(format!("--one-repetition={name}:{workers}"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("the bench starts itself again");
    assert!(
        output.status.success(),
        "the process running {name} at {workers} workers failed ({})",
        output.status
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| {
        panic!(
            "the process running {name} at {workers} workers printed no repetition ({e}): {line}"
        )
    })
}

/// `--one-repetition`: `name` run once at `workers` workers, its repetition printed as one JSON
/// line (what [`run_isolated`] reads).
fn one_repetition(o: &Options, trace: &[Vec<u64>], name: &str, workers: usize) {
    let stream = generate(trace, workers, o.capacity, o.dup);
    hand_back_freed_heap();
    let rep = run_subject(name, &stream, &o.lookups);
    println!(
        "{}",
        serde_json::to_string(&rep).expect("a repetition as JSON")
    );
}

/// Hands the heap's free memory back to the kernel (`malloc_trim`). Building the stream frees
/// hundreds of megabytes that the heap keeps, already faulted in: an index that allocates from
/// the heap (kv-index's arena chunks, the peers' nodes) would reuse them without a page fault,
/// where kvrouted's large tables, on huge pages of their own, fault in fresh memory. A daemon's
/// first tables find no such heap, so in a process of its own every index starts without it
/// (docs/performance.md, the forty-sixth part). Only glibc keeps such a heap here and has the
/// call; on other targets this does nothing.
fn hand_back_freed_heap() {
    // SAFETY: `malloc_trim` only returns free heap memory to the kernel; every live allocation
    // stays where it is.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The empty interval subtracted from every measurement, in ns.
fn timer_floor_ns() -> f64 {
    let c = clock();
    c.floor as f64 * c.ns_per_tick
}

fn main() {
    let started = Instant::now();
    let o = Options::parse();
    let trace = load_trace(&o.trace, o.requests);
    if let Some((name, workers)) = &o.one_repetition {
        return one_repetition(&o, &trace, name, *workers);
    }
    println!(
        "trace {} ({} requests{}), dup {}, capacity {} blocks/worker, reps {}, timer floor {:.0} ns subtracted per op; load average {}",
        o.trace.display(),
        trace.len(),
        o.requests.map_or(String::new(), |n| format!(", first {n}")),
        o.dup,
        o.capacity,
        o.reps,
        timer_floor_ns(),
        loadavg()
    );
    if o.isolate {
        println!("each repetition of each index runs in a process of its own (--isolate)");
    }
    let filter = &o.lookups;
    if filter.is_narrowed() {
        println!(
            "only the lookups whose deepest match is {} blocks and whose prompt is {} blocks: \
             the rates, p50 and p99 are theirs, and the goals are not judged",
            show_blocks(filter.depths.as_ref()),
            show_blocks(filter.prompt_blocks.as_ref())
        );
    }
    let mut json_rows = Vec::new();
    for &workers in &o.workers {
        let t = Instant::now();
        let stream = generate(&trace, workers, o.capacity, o.dup);
        println!(
            "\n{workers} workers: {} lookups ({:.1}% hit, mean deepest match {:.1} blocks held by {:.1} workers, {:.1} workers with a match), {} stored + {} removed block events, {} (worker, block) entries / {} distinct blocks resident at the end (generated in {:.1} s)",
            stream.lookups,
            100.0 * stream.hits as f64 / stream.lookups as f64,
            stream.mean_max_depth,
            stream.mean_deepest_owners,
            stream.mean_matched,
            stream.stored_blocks,
            stream.removed_blocks,
            stream.resident,
            stream.distinct,
            t.elapsed().as_secs_f64()
        );
        let chosen = |name: &str| {
            let fits = name != "kv-index" || workers <= KV_INDEX_MAX_WORKERS;
            fits && o
                .only
                .as_ref()
                .is_none_or(|only| only.iter().any(|n| n == name))
        };
        if workers > KV_INDEX_MAX_WORKERS {
            println!("(kv-index has no row: it indexes at most {KV_INDEX_MAX_WORKERS} workers)");
        }
        let mut reps: Vec<Vec<Rep>> = SUBJECTS.iter().map(|_| Vec::new()).collect();
        for rep in 0..o.reps {
            // Rotate the order so no index always runs first (cold caches) or last.
            for k in 0..SUBJECTS.len() {
                let i = (k + rep) % SUBJECTS.len();
                if chosen(SUBJECTS[i]) {
                    std::thread::sleep(o.pause);
                    let r = if o.isolate {
                        run_isolated(SUBJECTS[i], workers)
                    } else {
                        run_subject(SUBJECTS[i], &stream, filter)
                    };
                    if o.per_rep {
                        println!(
                            "repetition {rep} {}: {:.2} M events/s, {:.2} M lookups/s, p99 {} ns",
                            SUBJECTS[i],
                            r.events_per_s / 1e6,
                            r.lookups_per_s / 1e6,
                            r.p99_ns
                        );
                    }
                    reps[i].push(r);
                }
            }
        }
        println!(
            "{:<18} {:>13} {:>13} {:>9} {:>9} {:>12} {:>10}  notes",
            "index", "events/s", "lookups/s", "p50 ns", "p99 ns", "bytes/entry", "mismatch"
        );
        let mut rows = Vec::new();
        for (i, name) in SUBJECTS.iter().enumerate() {
            let r = &reps[i];
            if r.is_empty() {
                continue;
            }
            let events = median_f(r.iter().map(|x| x.events_per_s).collect());
            let lookups = median_f(r.iter().map(|x| x.lookups_per_s).collect());
            let p50 = median_u(r.iter().map(|x| x.p50_ns).collect());
            let p99 = median_u(r.iter().map(|x| x.p99_ns).collect());
            let bytes = median_u(r.iter().map(|x| x.bytes as u64).collect());
            let per_entry = bytes as f64 / stream.resident.max(1) as f64;
            let per_distinct = bytes as f64 / stream.distinct.max(1) as f64;
            let mismatches = r.iter().map(|x| x.mismatches).max().unwrap_or(0);
            let errors = r.iter().map(|x| x.errors).max().unwrap_or(0);
            println!(
                "{name:<18} {events:>13.0} {lookups:>13.0} {p50:>9} {p99:>9} {per_entry:>12.1} {mismatches:>10}  {} errors={errors} bytes/distinct={per_distinct:.1} total_bytes={bytes}",
                r[0].notes
            );
            if mismatches > 0 || errors > 0 {
                println!("  WARNING: {name} disagreed with the expected answers or refused events: its figures are not comparable");
            }
            rows.push(goals::Row {
                name,
                events_per_s: events,
                lookups_per_s: lookups,
                p99_ns: p99,
                bytes_per_entry: per_entry,
            });
            json_rows.push(format!(
                "{{\"index\":\"{name}\",\"workers\":{workers},\"events_per_s\":{events:.0},\"lookups_per_s\":{lookups:.0},\"lookup_p50_ns\":{p50},\"lookup_p99_ns\":{p99},\"bytes_per_entry\":{per_entry:.1},\"bytes_per_distinct_block\":{per_distinct:.1},\"resident_entries\":{},\"mismatches\":{mismatches},\"errors\":{errors}}}",
                stream.resident
            ));
        }
        let verdicts = goals::verdicts(workers, &rows);
        if !verdicts.is_empty() && !filter.is_narrowed() {
            println!("goals at {workers} workers (the best peer: the peer best on that figure):");
            for line in verdicts {
                println!("  {line}");
            }
        }
    }
    let memory = machine::probe_memory();
    println!("\n{memory}");
    println!(
        "finished in {:.1} s; load average {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    println!(
        "{{\"bench\":\"peers\",\"trace\":\"{}\",\"requests\":{},\"dup\":{},\"capacity_blocks\":{},\"reps\":{},\"isolate\":{},\"only_depths\":{},\"only_prompt_blocks\":{},\"memory_dependent_load_ns\":{:.1},\"memory_random_line_ns\":{:.1},\"results\":[{}]}}",
        o.trace.file_name().and_then(|n| n.to_str()).unwrap_or("?"),
        trace.len(),
        o.dup,
        o.capacity,
        o.reps,
        o.isolate,
        json_blocks(filter.depths.as_ref()),
        json_blocks(filter.prompt_blocks.as_ref()),
        memory.dependent_ns,
        memory.independent_ns,
        json_rows.join(",")
    );
}

/// A range as `--only-depths` takes it; any count when there is none.
fn show_blocks(range: Option<&Blocks>) -> String {
    match range {
        None => "any number of".to_string(),
        Some(r) if r.end == u32::MAX => format!("{} or more", r.start),
        Some(r) => format!("{} to {}", r.start, r.end - 1),
    }
}

/// A range as the JSON line gives it: `[MIN, MAX]` (MAX excluded), or `null` for every count.
fn json_blocks(range: Option<&Blocks>) -> String {
    range.map_or("null".to_string(), |r| format!("[{},{}]", r.start, r.end))
}

/// The machine's load averages (1, 5, 15 min): other work on a shared machine skews every figure.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
