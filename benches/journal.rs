//! Journal and recovery measurements (issue 4, docs/architecture.md, "Persistence"), in one run:
//!
//! 1. **Sustained journaled ingest**: typical 32-block `BlockStored` batches from 32 workers go
//!    through the daemon's own write path (`writer::apply_journaled`: stamp, apply,
//!    append to sled) while a flusher thread group-commits every 10 ms, as `serve` does, until the
//!    index holds 1M blocks. Reported as events (batches) per second and blocks per second, next
//!    to the same inputs applied without a journal.
//! 2. **Journal bytes per entry**: the encoded size of each kind of entry (32-block stored batch,
//!    32-block removal, load sample, 64-block route), and sled's on-disk growth per entry.
//! 3. **Recovery**: a snapshot of that 1M-block state (written like the daemon's periodic
//!    snapshot), then a journal tail of 100k entries of steady-state traffic (stores and evictions
//!    that keep the index near 1M blocks, load samples, routes). The journal is closed and
//!    recovered exactly as `kvrouted serve` does: `Journal::open` + `latest_snapshot` +
//!    `replay` of the entries after it. The recovered index is checked against the original.
//!    Then periodic snapshots of the state after the tail, 500 ms apart, alternated: copied into
//!    fresh memory and dropped once encoded, or copied into the one kept from before
//!    (`Snapshot::retake`), as the writer takes every snapshot after its first.
//! 4. **Route entries of 4,096-token prompts**: 100,000 routes of 256 block keys appended through
//!    `Journal::append` on a fresh data dir while the flusher runs, reported as wall time and as
//!    the CPU of the whole process per entry (sled's own threads included: they do much of its
//!    work), next to encoding the same entries alone.
//!
//! 5. **Resident memory as the journal grows**: in a fresh process, 400,000 such route entries
//!    (about 1.2 GB of journal, more than the default retention of 1 GiB) appended to a fresh
//!    data dir with the flusher running, and the process's resident memory after each 100,000.
//!    Twice: each entry stored as it is appended (routes slower than the flushes, so each flush
//!    finds one or a few), and entries stored in full runs. A journal that only grows on disk
//!    leaves the memory level.
//!
//! The bench allocates with the daemon's allocator (mimalloc), so its memory and sled's
//! allocation costs are the daemon's.
//!
//! Run: `cargo bench --bench journal` (release; about a minute on 2 cores). The last line of
//! output is the same figures as one JSON object.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrouted::hashing::chain_locals;
use kvrouted::input::{
    Input, KvEvent, KvEventBatch, LoadSample, Medium, RouteRequest, Stamped, StoredBlock, WorkerId,
};
use kvrouted::journal::{Journal, JournalEntry, RouteOutcome, Snapshot};
use kvrouted::policy::DecisionLabel;
use kvrouted::replay::replay;
use kvrouted::router::{Router, RouterConfig};
use kvrouted::writer::{apply_journaled, Clock};
use kvrouted_testkit::{clk_tck, cpu_ticks, resident_mib};
use serde_json::json;

const WORKERS: usize = 32;
const BATCH_BLOCKS: usize = 32;
/// Batches per stored conversation (a chain of 256 blocks, continued batch by batch).
const CHAIN_BATCHES: usize = 8;
const SNAPSHOT_BLOCKS: u64 = 1_000_000;
const TAIL_ENTRIES: u64 = 100_000;
const ROUTE_BLOCKS: usize = 64;
/// Route entries of 4,096-token prompts (256 blocks of 16) in phase 4.
const LONG_ROUTES: u64 = 100_000;
const LONG_ROUTE_BLOCKS: u64 = 256;
const FLUSH_EVERY: Duration = Duration::from_millis(10);
/// Route entries appended in phase 5, and how often the resident memory is read.
const GROWTH_ROUTES: u64 = 400_000;
const GROWTH_STEP: u64 = 100_000;
/// Periodic snapshots timed each way in phase 3c, and the pause before each.
const SNAPSHOT_ROUNDS: usize = 4;
const SNAPSHOT_GAP: Duration = Duration::from_millis(500);

/// The daemon's allocator: sled's memory and allocation costs depend on it.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// splitmix64: engine hashes and token hashes look random, as real ones do.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn worker(w: usize) -> WorkerId {
    WorkerId::new(&format!("worker-{w:02}")).unwrap()
}

/// One stored batch: the worker, its engine hashes (for a later eviction) and the input.
struct Stored {
    worker: usize,
    engine: Vec<u64>,
    input: Input,
}

/// A stream of stored batches: each worker extends its current conversation by 32 blocks per
/// batch and starts a new one every [`CHAIN_BATCHES`] batches. Keeps the locals of a few
/// conversations so routes can ask for their prefixes.
struct Traffic {
    rng: Rng,
    /// Per worker: (engine hash of the last block, batches in this chain, locals of the chain).
    chains: Vec<(Option<u64>, usize, Vec<u64>)>,
    /// (worker, locals) of finished conversations, newest last.
    finished: VecDeque<(usize, Vec<u64>)>,
    next_worker: usize,
}

impl Traffic {
    fn new() -> Self {
        Traffic {
            rng: Rng(42),
            chains: vec![(None, 0, Vec::new()); WORKERS],
            finished: VecDeque::new(),
            next_worker: 0,
        }
    }

    fn stored(&mut self) -> Stored {
        let w = self.next_worker;
        self.next_worker = (w + 1) % WORKERS;
        if self.chains[w].1 == CHAIN_BATCHES {
            let locals = std::mem::take(&mut self.chains[w].2);
            self.finished.push_back((w, locals));
            if self.finished.len() > 4096 {
                self.finished.pop_front();
            }
            self.chains[w] = (None, 0, Vec::new());
        }
        let blocks: Vec<StoredBlock> = (0..BATCH_BLOCKS)
            .map(|_| StoredBlock {
                engine_hash: self.rng.next(),
                local: self.rng.next(),
            })
            .collect();
        let chain = &mut self.chains[w];
        let parent = chain.0;
        chain.0 = Some(blocks[BATCH_BLOCKS - 1].engine_hash);
        chain.1 += 1;
        chain.2.extend(blocks.iter().map(|b| b.local));
        Stored {
            worker: w,
            engine: blocks.iter().map(|b| b.engine_hash).collect(),
            input: Input::KvEvents(KvEventBatch::stored(worker(w), parent, blocks, 16)),
        }
    }

    fn load(&mut self) -> Input {
        let w = (self.rng.next() % WORKERS as u64) as usize;
        Input::Load(LoadSample {
            worker: worker(w),
            kv_usage: (self.rng.next() % 1000) as f64 / 1000.0,
            running: (self.rng.next() % 32) as u32,
            waiting: (self.rng.next() % 4) as u32,
            max_running: Some(64),
            model: None,
            dp_rank: 0,
        })
    }

    /// A route for the first 64 blocks of a recent conversation (the next turn of a trajectory).
    fn route(&mut self, id: u64) -> Input {
        let i = (self.rng.next() % self.finished.len() as u64) as usize;
        let (_, locals) = &self.finished[i];
        let keys = chain_locals(locals[..ROUTE_BLOCKS].iter().copied());
        Input::Route(RouteRequest {
            model: None,
            lora: None,
            keys,
            prompt_tokens: (ROUTE_BLOCKS * 16) as u64 + 7,
            max_output_tokens: Some(512),
            exclude: Vec::new(),
            request_id: Some(format!("req-{id:08}")),
            explain: false,
        })
    }
}

fn evict(worker_slot: usize, engine: Vec<u64>) -> Input {
    Input::KvEvents(KvEventBatch::of(
        worker(worker_slot),
        vec![KvEvent::Removed {
            engine_hashes: engine,
            medium: Medium::Gpu,
        }],
    ))
}

/// Flushes the journal every [`FLUSH_EVERY`] on its own thread, like the daemon's flusher.
struct Flusher {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Flusher {
    fn start(journal: &Journal) -> Flusher {
        let stop = Arc::new(AtomicBool::new(false));
        let journal = journal.clone();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut flushes = 0;
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(FLUSH_EVERY);
                journal.flush().expect("flush");
                flushes += 1;
            }
            flushes
        });
        Flusher {
            stop,
            thread: Some(thread),
        }
    }

    fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

/// Mean encoded size per kind of entry.
#[derive(Default)]
struct Sizes {
    stored: (u64, u64),
    removed: (u64, u64),
    load: (u64, u64),
    route: (u64, u64),
}

impl Sizes {
    fn add(&mut self, input: &Input, bytes: usize) {
        let slot = match input {
            Input::KvEvents(b) => match b.events.first() {
                Some(KvEvent::Stored { .. }) => &mut self.stored,
                _ => &mut self.removed,
            },
            Input::Load(_) => &mut self.load,
            Input::Route(_) => &mut self.route,
            _ => return,
        };
        slot.0 += bytes as u64;
        slot.1 += 1;
    }

    fn mean(v: (u64, u64)) -> f64 {
        v.0 as f64 / v.1.max(1) as f64
    }
}

/// CPU time used by this process so far, all threads (user + system), in seconds.
fn process_cpu_seconds() -> f64 {
    let ticks = cpu_ticks(std::process::id()).expect("/proc/self/stat");
    ticks as f64 / clk_tck()
}

/// The journal entry of a routed 4,096-token prompt: 256 chained block keys.
fn long_route(rng: &mut Rng, at_ms: u64) -> JournalEntry {
    JournalEntry {
        at_ms,
        input: Input::Route(RouteRequest {
            model: None,
            lora: None,
            keys: chain_locals((0..LONG_ROUTE_BLOCKS).map(|_| rng.next())),
            prompt_tokens: LONG_ROUTE_BLOCKS * 16,
            max_output_tokens: Some(512),
            exclude: Vec::new(),
            request_id: None,
            explain: false,
        }),
        outcome: Some(RouteOutcome::Routed {
            worker: worker(3),
            decision: DecisionLabel::OwnerHold,
        }),
    }
}

/// (wall, CPU of all threads) per entry, in µs, of appending [`LONG_ROUTES`] route entries to a
/// fresh journal in `dir` while the flusher runs, and the encoding alone per entry.
fn long_route_appends(dir: &std::path::Path) -> (f64, f64, f64) {
    let mut rng = Rng(7);
    let entries: Vec<JournalEntry> = (0..LONG_ROUTES).map(|i| long_route(&mut rng, i)).collect();
    let started = Instant::now();
    for entry in &entries {
        std::hint::black_box(rmp_serde::to_vec(entry).unwrap());
    }
    let encode = started.elapsed();
    let journal = Journal::open(dir).expect("open journal");
    let flusher = Flusher::start(&journal);
    let cpu = process_cpu_seconds();
    let started = Instant::now();
    for (seq, entry) in (1..).zip(&entries) {
        journal.append(seq, entry).expect("append");
    }
    journal.flush().unwrap();
    let wall = started.elapsed();
    flusher.stop();
    let cpu = process_cpu_seconds() - cpu;
    let per_entry = |seconds: f64| seconds * 1e6 / LONG_ROUTES as f64;
    (
        per_entry(wall.as_secs_f64()),
        per_entry(cpu),
        per_entry(encode.as_secs_f64()),
    )
}

/// How the route entries of phase 5 reach sled.
#[derive(Clone, Copy)]
enum Runs {
    /// Each entry is stored as it is appended (a read after every append settles it): a
    /// moderate route rate, where each 10 ms flush finds one entry or a few.
    OfOne,
    /// Entries gather into full runs: routes faster than the flushes.
    Full,
}

impl Runs {
    const ALL: [Runs; 2] = [Runs::OfOne, Runs::Full];
    /// Names the kind of run a child process of phase 5 runs.
    const ENV: &'static str = "KVROUTED_JOURNAL_BENCH_GROWTH";

    fn name(self) -> &'static str {
        match self {
            Runs::OfOne => "runs_of_one",
            Runs::Full => "full_runs",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Runs::OfOne => "each entry stored as appended",
            Runs::Full => "entries stored in full runs",
        }
    }

    /// The kind of run this process is the phase 5 child for, if it is one.
    fn of_this_child() -> Option<Runs> {
        let name = std::env::var(Runs::ENV).ok()?;
        Runs::ALL.into_iter().find(|runs| runs.name() == name)
    }
}

/// What a phase 5 child reports: its resident memory (MiB) before and after each
/// [`GROWTH_STEP`], and the journal's size on disk.
#[derive(serde::Serialize, serde::Deserialize)]
struct Growth {
    resident_mib: Vec<f64>,
    journal_mib: f64,
}

/// Phase 5 for one kind of run, in a process of its own started from this bench's binary, so
/// that neither the earlier phases nor the other kind of run leave memory behind in it.
fn resident_memory_as_the_journal_grows(runs: Runs) -> Growth {
    let output = std::process::Command::new(std::env::current_exe().expect("this bench's path"))
        .env(Runs::ENV, runs.name())
        .output()
        .expect("start the bench's phase 5");
    assert!(
        output.status.success(),
        "phase 5 ({}) failed: {}",
        runs.name(),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("phase 5 prints its figures as JSON")
}

/// The child's side of phase 5: appends [`GROWTH_ROUTES`] route entries to a fresh journal
/// while the flusher runs, and prints its resident memory before and after each
/// [`GROWTH_STEP`]. The entries cycle over 1,000 distinct ones, so the bench's own memory stays
/// the same.
fn grow_the_journal(runs: Runs) {
    let dir = tempfile::TempDir::new().expect("temp dir");
    let mut rng = Rng(11);
    let entries: Vec<JournalEntry> = (0..1_000).map(|i| long_route(&mut rng, i)).collect();
    let journal = Journal::open(dir.path()).expect("open journal");
    let flusher = Flusher::start(&journal);
    let resident_now = || {
        resident_mib(std::process::id())
            .expect("/proc/self/status")
            .0
            .round()
    };
    let mut resident = vec![resident_now()];
    for seq in 1..=GROWTH_ROUTES {
        let entry = &entries[(seq % entries.len() as u64) as usize];
        journal.append(seq, entry).expect("append");
        if let Runs::OfOne = runs {
            journal.first_seq().expect("read the journal");
        }
        if seq % GROWTH_STEP == 0 {
            resident.push(resident_now());
        }
    }
    journal.flush().unwrap();
    flusher.stop();
    let growth = Growth {
        resident_mib: resident,
        journal_mib: mib(journal.size_on_disk().unwrap()).round(),
    };
    println!("{}", serde_json::to_string(&growth).unwrap());
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() {
    // `cargo bench` passes `--bench`; nothing here takes arguments. Phase 5 runs in children
    // of this process, which the environment tells apart.
    if let Some(runs) = Runs::of_this_child() {
        return grow_the_journal(runs);
    }
    let dir = tempfile::TempDir::new().expect("temp dir");
    let data = dir.path().join("data");
    let config = RouterConfig::default();
    let mut traffic = Traffic::new();

    // 1. Sustained journaled ingest until the index holds 1M blocks.
    let batches = (SNAPSHOT_BLOCKS as usize).div_ceil(BATCH_BLOCKS);
    let inputs: Vec<Stored> = (0..batches).map(|_| traffic.stored()).collect();
    let bare = {
        let mut router = Router::new(config.clone());
        let started = Instant::now();
        for (i, s) in inputs.iter().enumerate() {
            router.apply(&Stamped {
                seq: i as u64 + 1,
                at_ms: 1,
                input: s.input.clone(),
            });
        }
        started.elapsed()
    };
    let journal = Journal::open(&data).expect("open journal");
    let disk_empty = journal.size_on_disk().unwrap();
    let mut router = Router::new(config.clone());
    let mut clock = Clock::new(0);
    let mut resident: VecDeque<(usize, Vec<u64>)> = VecDeque::new();
    let mut owned: Vec<Input> = Vec::with_capacity(inputs.len());
    for s in inputs {
        resident.push_back((s.worker, s.engine));
        owned.push(s.input);
    }
    let flusher = Flusher::start(&journal);
    let started = Instant::now();
    for input in owned {
        apply_journaled(&mut router, &journal, &mut clock, input, "bench");
    }
    journal.flush().unwrap();
    let ingest = started.elapsed();
    let flushes = flusher.stop();
    let ingest_disk = journal.size_on_disk().unwrap() - disk_empty;
    let blocks_at_snapshot = router.index_stats().blocks;
    assert!(blocks_at_snapshot >= SNAPSHOT_BLOCKS);

    // A few thousand routes and load samples before the snapshot, so it holds approximate
    // owners, reservations and telemetry as a running daemon's would.
    for i in 0..5_000u64 {
        let input = if i % 2 == 0 {
            traffic.route(i)
        } else {
            traffic.load()
        };
        apply_journaled(&mut router, &journal, &mut clock, input, "bench");
    }

    // 3a. The snapshot, as the writer thread takes it.
    let started = Instant::now();
    let snapshot = Snapshot::of(&router, clock.now());
    let snapshot_clone = started.elapsed();
    let snapshot_bytes = journal.write_snapshot(&snapshot).expect("snapshot");
    let snapshot_write = started.elapsed();
    let snapshot_seq = snapshot.seq;
    // Kept, as the writer keeps it, for the next snapshot to be copied into (3c).
    let kept = snapshot;

    // 3b. The tail: steady-state traffic. Per 10 entries: 3.5 stored + 3.5 evicted batches,
    // 2 load samples, 1 route.
    let disk_before_tail = journal.size_on_disk().unwrap();
    let flusher = Flusher::start(&journal);
    let started = Instant::now();
    for i in 0..TAIL_ENTRIES {
        let input = match i % 20 {
            0..=6 => {
                let s = traffic.stored();
                resident.push_back((s.worker, s.engine));
                s.input
            }
            7..=13 => {
                let (w, engine) = resident.pop_front().unwrap();
                evict(w, engine)
            }
            14..=17 => traffic.load(),
            _ => traffic.route(1_000_000 + i),
        };
        apply_journaled(&mut router, &journal, &mut clock, input, "bench");
    }
    journal.flush().unwrap();
    let tail_time = started.elapsed();
    flusher.stop();
    let tail_disk = journal.size_on_disk().unwrap() - disk_before_tail;
    // 3c. Periodic snapshots of that state, as the writer takes them: each copy encoded (the
    // snapshot thread's work, here into memory), then dropped (as every copy was before the
    // writer kept one) or kept for the next copy to be made in (`Snapshot::retake`), with a
    // pause between snapshots in which the allocator may hand freed memory back. The two
    // alternate; the writer's pause is the copy.
    let (mut fresh_copies, mut kept_copies) = (Vec::new(), Vec::new());
    let mut kept = Some(kept);
    for round in 0..2 * SNAPSHOT_ROUNDS {
        std::thread::sleep(SNAPSHOT_GAP);
        let started = Instant::now();
        if round % 2 == 0 {
            let copy = Snapshot::of(&router, clock.now());
            fresh_copies.push(started.elapsed().as_secs_f64() * 1e3);
            std::hint::black_box(rmp_serde::to_vec(&copy).expect("encode"));
        } else {
            let mut copy = kept.take().expect("the kept copy");
            copy.retake(&router, clock.now());
            kept_copies.push(started.elapsed().as_secs_f64() * 1e3);
            std::hint::black_box(rmp_serde::to_vec(&copy).expect("encode"));
            kept = Some(copy);
        }
    }
    drop(kept);
    let expected = router.index_stats();
    let expected_ownerships = router.ownerships().len();
    let last_seq = router.last_seq();
    drop(router);
    drop(journal);

    // 3c. Recovery, the daemon's way.
    let started = Instant::now();
    let journal = Journal::open(&data).expect("reopen journal");
    let opened = started.elapsed();
    let snapshot = journal.latest_snapshot().unwrap().expect("a snapshot");
    assert_eq!(snapshot.seq, snapshot_seq);
    let loaded = started.elapsed();
    let (recovered, stats) = replay(
        Some(snapshot),
        journal.entries_after(snapshot_seq),
        &|_| {},
        |_, _, _| {},
    )
    .expect("replay");
    let recovery = started.elapsed();
    assert_eq!(stats.entries, TAIL_ENTRIES);
    assert_eq!(recovered.last_seq(), last_seq);
    assert_eq!(recovered.index_stats(), expected, "recovered index differs");
    assert_eq!(recovered.ownerships().len(), expected_ownerships);
    assert_eq!(
        stats.changed, 0,
        "recovery re-derives every decision of the tail"
    );
    let disk_total = journal.size_on_disk().unwrap();
    // How much of the replay is reading and decoding the tail (the rest is applying it).
    let started = Instant::now();
    let read = journal.entries_after(snapshot_seq).count() as u64;
    let read_decode = started.elapsed();
    assert_eq!(read, TAIL_ENTRIES);
    // The retention check run after every snapshot (on the snapshot thread), when nothing is
    // due: the first after open counts the journal's bytes once, later ones are O(1).
    let mut retention = |journal: &Journal| {
        let started = Instant::now();
        let pruned = journal
            .prune(clock.now(), u64::MAX / 2, u64::MAX / 2)
            .expect("prune");
        assert_eq!(pruned, 0);
        started.elapsed()
    };
    let retention_first = retention(&journal);
    let retention_check = retention(&journal);
    let (route_wall_us, route_cpu_us, route_encode_us) =
        long_route_appends(&dir.path().join("routes"));
    let growth: Vec<(Runs, Growth)> = Runs::ALL
        .into_iter()
        .map(|runs| (runs, resident_memory_as_the_journal_grows(runs)))
        .collect();
    // Entry sizes: the journal's records are the MessagePack encoding of these entries.
    let mut sizes = Sizes::default();
    for item in journal.entries_after(snapshot_seq) {
        let (_, entry) = item.unwrap();
        sizes.add(&entry.input, rmp_serde::to_vec(&entry).unwrap().len());
    }

    let ingest_events = batches as f64 / ingest.as_secs_f64();
    let ingest_blocks = ingest_events * BATCH_BLOCKS as f64;
    let bare_events = batches as f64 / bare.as_secs_f64();
    let tail_rate = TAIL_ENTRIES as f64 / tail_time.as_secs_f64();
    let stored = Sizes::mean(sizes.stored);
    let removed = Sizes::mean(sizes.removed);
    let load = Sizes::mean(sizes.load);
    let route = Sizes::mean(sizes.route);
    let disk_per_ingest_batch = ingest_disk as f64 / batches as f64;
    let disk_per_tail_entry = tail_disk as f64 / TAIL_ENTRIES as f64;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;

    println!("kvrouted journal benchmark (sled, release, {WORKERS} workers, {BATCH_BLOCKS}-block batches)");
    println!();
    println!("sustained journaled ingest (apply + append, flush every {FLUSH_EVERY:?}, {flushes} flushes)");
    println!(
        "  {batches} stored batches in {:.0} ms: {:>10.0} events/s {:>12.0} blocks/s",
        ms(ingest),
        ingest_events,
        ingest_blocks
    );
    println!(
        "  same inputs, no journal:      {:>10.0} events/s {:>12.0} blocks/s",
        bare_events,
        bare_events * BATCH_BLOCKS as f64
    );
    println!(
        "  steady-state tail (mixed):    {:>10.0} entries/s",
        tail_rate
    );
    println!();
    println!("journal bytes per entry (MessagePack record; sled on-disk growth)");
    println!(
        "  32-block stored batch   {:>7.0} B  = {:>5.1} B/block",
        stored,
        stored / BATCH_BLOCKS as f64
    );
    println!(
        "  32-block removal batch  {:>7.0} B  = {:>5.1} B/block",
        removed,
        removed / BATCH_BLOCKS as f64
    );
    println!("  load sample             {load:>7.0} B");
    println!(
        "  route ({ROUTE_BLOCKS} keys)         {route:>7.0} B  = {:>5.1} B/key",
        route / ROUTE_BLOCKS as f64
    );
    println!(
        "  on disk: {:.0} B per stored batch (ingest), {:.0} B per tail entry (mixed)",
        disk_per_ingest_batch, disk_per_tail_entry
    );
    println!();
    println!(
        "snapshot: {blocks_at_snapshot} blocks, {:.1} MiB: writer pauses {:.0} ms to copy the state; \
         the snapshot thread encodes, writes and flushes it in {:.0} ms",
        mib(snapshot_bytes as u64),
        ms(snapshot_clone),
        ms(snapshot_write - snapshot_clone)
    );
    let list = |v: &[f64]| {
        v.iter()
            .map(|ms| format!("{ms:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "periodic snapshots of the state after the tail, {} ms apart, the writer's pause: \
         {} ms into fresh memory, {} ms into the copy kept from the last one",
        SNAPSHOT_GAP.as_millis(),
        list(&fresh_copies),
        list(&kept_copies)
    );
    println!(
        "recovery of snapshot + {TAIL_ENTRIES}-entry tail ({} blocks after): {:.0} ms",
        expected.blocks,
        ms(recovery)
    );
    println!(
        "  open {:.0} ms, load snapshot {:.0} ms, replay tail {:.0} ms ({:.0} entries/s)",
        ms(opened),
        ms(loaded - opened),
        ms(recovery - loaded),
        TAIL_ENTRIES as f64 / (recovery - loaded).as_secs_f64()
    );
    println!(
        "  (reading + decoding the tail alone: {:.0} ms)",
        ms(read_decode)
    );
    println!(
        "retention check after a snapshot (nothing due): first after open {:.0} ms, then {:.3} ms",
        ms(retention_first),
        ms(retention_check)
    );
    println!("data dir on disk: {:.1} MiB", mib(disk_total));
    println!(
        "route entries of {LONG_ROUTE_BLOCKS} keys ({LONG_ROUTES} appended, flush every {FLUSH_EVERY:?}): \
         {route_wall_us:.1} µs wall, {route_cpu_us:.1} µs CPU of all threads per entry \
         (encoding alone {route_encode_us:.1} µs)"
    );
    println!(
        "resident memory of a process appending {GROWTH_ROUTES} such route entries to a fresh \
         journal (before, then every {GROWTH_STEP}):"
    );
    for (runs, growth) in &growth {
        let steps: Vec<String> = growth
            .resident_mib
            .iter()
            .map(|m| format!("{m:.0}"))
            .collect();
        println!(
            "  {:<29}: {} MiB ({:.0} MiB of journal)",
            runs.label(),
            steps.join(" → "),
            growth.journal_mib
        );
    }
    println!(
        "{}",
        json!({
            "bench": "journal",
            "ingest_events_per_s": ingest_events.round(),
            "ingest_blocks_per_s": ingest_blocks.round(),
            "apply_only_events_per_s": bare_events.round(),
            "tail_entries_per_s": tail_rate.round(),
            "bytes_stored_batch_32": stored.round(),
            "bytes_per_stored_block": (stored / BATCH_BLOCKS as f64 * 10.0).round() / 10.0,
            "bytes_removed_batch_32": removed.round(),
            "bytes_load_sample": load.round(),
            "bytes_route_64_keys": route.round(),
            "disk_bytes_per_stored_batch": disk_per_ingest_batch.round(),
            "disk_bytes_per_tail_entry": disk_per_tail_entry.round(),
            "snapshot_blocks": blocks_at_snapshot,
            "snapshot_bytes": snapshot_bytes,
            "snapshot_clone_ms": ms(snapshot_clone).round(),
            "periodic_snapshot_fresh_copy_ms": fresh_copies,
            "periodic_snapshot_kept_copy_ms": kept_copies,
            "snapshot_write_ms": ms(snapshot_write - snapshot_clone).round(),
            "tail_entries": TAIL_ENTRIES,
            "recovery_ms": ms(recovery).round(),
            "recovery_open_ms": ms(opened).round(),
            "recovery_snapshot_ms": ms(loaded - opened).round(),
            "recovery_replay_ms": ms(recovery - loaded).round(),
            "tail_read_decode_ms": ms(read_decode).round(),
            "retention_first_check_ms": ms(retention_first).round(),
            "retention_check_ms": (ms(retention_check) * 1000.0).round() / 1000.0,
            "data_dir_bytes": disk_total,
            "route_256_keys_append_wall_us": (route_wall_us * 10.0).round() / 10.0,
            "route_256_keys_append_cpu_us": (route_cpu_us * 10.0).round() / 10.0,
            "route_256_keys_encode_us": (route_encode_us * 10.0).round() / 10.0,
            "growth_resident_mib": growth
                .iter()
                .map(|(runs, growth)| (runs.name(), &growth.resident_mib))
                .collect::<std::collections::BTreeMap<_, _>>(),
        })
    );
}
