//! The indexes under test behind one `Subject` interface, and the cycle-counter clock that
//! times them.

use std::hint::black_box;
use std::ops::Range;
use std::time::Instant;

use kvrouted::hashing::{chain_locals, chained};
use kvrouted::index::{extend_match, OwnerIndex};
use kvrouted::input::{
    Input, KvEvent, KvEventBatch, Medium, RouteRequest, Stamped, StoredBlock, WorkerId,
};
use kvrouted::router::{Output, Router, RouterConfig};
use kvrouted::sim::percentile;

use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::nested_map::{LevelIndex, SearchMode};
use dynamo_kv_router::protocols::WorkerWithDpRank;
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, PositionalIndexer, RadixTree, RouterEvent};
use rustc_hash::FxHashMap;

use kv_index::{ChainBlockMap, ChainIndex, SequenceHash};

// ---------------------------------------------------------------------------------------------
// The indexes under test. Each method builds its native input untimed, times the call and
// returns nanoseconds.

pub(crate) enum Answer {
    /// Per-worker depths, written into the caller's buffer.
    Depths,
    /// Only the deepest match is visible (the Router's decision). A match shorter than the
    /// policy's match threshold does not count as one (the decision is a cold miss), so only a
    /// deepest match at or above it is checked.
    MaxDepth { matched: u32, threshold: u32 },
}

pub(crate) trait Subject {
    /// Events are applied on other threads: `store` and `remove` only enqueue them. The
    /// replay then times event application as a bulk pass (every event enqueued, then
    /// [`Subject::settle`]) and settles untimed before each lookup of the checked pass.
    const THREADED: bool = false;
    fn new(workers: usize) -> Self;
    /// Waits until every event enqueued so far is applied; returns nanoseconds.
    fn settle(&mut self) -> u64 {
        0
    }
    fn store(&mut self, worker: u32, parent: Option<u64>, locals: &[u64], engines: &[u64]) -> u64;
    fn remove(&mut self, worker: u32, engines: &[u64]) -> u64;
    /// Looks up `locals`; fills `depth` (zeroed, one per worker) after the timer stops.
    fn lookup(&mut self, locals: &[u64], depth: &mut [u32]) -> (u64, Answer);
    /// Failed applies (an index refusing an event of the stream).
    fn errors(&self) -> u64 {
        0
    }
    /// Size notes for the report.
    fn notes(&self) -> String {
        String::new()
    }
    /// Heap bytes the subject holds for the bench's own figures, left out of its memory.
    fn bench_bytes(&self) -> usize {
        0
    }
}

// ---------------------------------------------------------------------------------------------
// The per-operation clock. `Instant` costs about 100 ns a pair on this VM, as much as a whole
// store event; the time-stamp counter (constant and non-stop on x86_64) costs a quarter of that.
// Its rate is calibrated against `Instant` at start, and the cost of an empty interval is
// subtracted from every measured one.

#[derive(Clone, Copy)]
pub(crate) struct Tick(u64);

#[cfg(target_arch = "x86_64")]
pub(crate) fn raw_ticks() -> u64 {
    // SAFETY: `rdtsc` has no preconditions on x86_64.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn raw_ticks() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

pub(crate) struct Clock {
    pub(crate) ns_per_tick: f64,
    /// Ticks of an empty interval (the floor), subtracted from every interval.
    pub(crate) floor: u64,
}

static CLOCK: std::sync::OnceLock<Clock> = std::sync::OnceLock::new();

pub(crate) fn clock() -> &'static Clock {
    CLOCK.get_or_init(|| {
        let (t, c) = (Instant::now(), raw_ticks());
        std::thread::sleep(std::time::Duration::from_millis(200));
        let ns_per_tick = t.elapsed().as_nanos() as f64 / (raw_ticks() - c).max(1) as f64;
        let mut empty: Vec<u64> = (0..100_000)
            .map(|_| {
                let a = raw_ticks();
                raw_ticks().saturating_sub(a)
            })
            .collect();
        empty.sort_unstable();
        Clock {
            ns_per_tick,
            floor: empty[empty.len() / 2],
        }
    })
}

pub(crate) fn now() -> Tick {
    Tick(raw_ticks())
}

pub(crate) fn ns_since(t: Tick) -> u64 {
    let end = raw_ticks();
    let c = clock();
    let ticks = end.saturating_sub(t.0).saturating_sub(c.floor);
    (ticks as f64 * c.ns_per_tick) as u64
}

/// The per-worker consecutive match, as the router's walk counts it from `OwnerIndex::walk`:
/// `owners` hold every key of `keys` (one key, or the rest of a run of keys with the same
/// owners), so a worker matching every key before them now matches through them.
pub(crate) fn extend_depths(depth: &mut [u32], keys: Range<usize>, owners: &[u32]) -> bool {
    let mut any = false;
    for &slot in owners {
        any |= extend_match(&mut depth[slot as usize], &keys);
    }
    any
}

/// kvrouted's `OwnerIndex`, driven directly. With `KEYS_GIVEN`, the request's block keys are
/// chained before the clock starts (a gateway that sends `block_keys`): a diagnostic row showing
/// what chaining costs the lookup.
pub(crate) struct Kvrouted<const KEYS_GIVEN: bool> {
    pub(crate) index: OwnerIndex,
    pub(crate) blocks: Vec<StoredBlock>,
    pub(crate) keys: Vec<u64>,
    pub(crate) depth: Vec<u32>,
}

impl<const KEYS_GIVEN: bool> Subject for Kvrouted<KEYS_GIVEN> {
    fn new(workers: usize) -> Self {
        Kvrouted {
            index: OwnerIndex::default(),
            blocks: Vec::new(),
            keys: Vec::new(),
            depth: vec![0; workers],
        }
    }

    fn store(&mut self, worker: u32, parent: Option<u64>, locals: &[u64], engines: &[u64]) -> u64 {
        self.blocks.clear();
        self.blocks
            .extend(engines.iter().zip(locals).map(|(&e, &l)| StoredBlock {
                engine_hash: e,
                local: l,
            }));
        let t = now();
        // The parent arrives as the engine's hash; the index chains on its block key, which the
        // router looks up among the worker's blocks (timed: the peers resolve it inside), after
        // asking for it and the first blocks' entries at once, as the router does.
        self.index.prefetch_store(worker, 0, parent, &self.blocks);
        let parent_key = parent.and_then(|p| self.index.key_of(worker, 0, p));
        black_box(self.index.store(worker, 0, parent_key, &self.blocks));
        ns_since(t)
    }

    fn remove(&mut self, worker: u32, engines: &[u64]) -> u64 {
        let t = now();
        black_box(self.index.remove(worker, engines));
        ns_since(t)
    }

    fn lookup(&mut self, locals: &[u64], depth: &mut [u32]) -> (u64, Answer) {
        if KEYS_GIVEN {
            self.keys.clear();
            self.keys.extend(chained(None, locals.iter().copied()));
        }
        let t = now();
        self.depth.fill(0);
        let d = &mut self.depth;
        if KEYS_GIVEN {
            self.index.walk(0, self.keys.iter().copied(), |at, owners| {
                extend_depths(d, at, owners)
            });
        } else {
            // Chains each key as the walk draws it (a few ahead of the one it reads, so a long
            // match's probes overlap) and stops at the first block no worker continues, as the
            // peers stop walking content hashes.
            self.index
                .walk(0, chained(None, locals.iter().copied()), |at, owners| {
                    extend_depths(d, at, owners)
                });
        }
        let ns = ns_since(t);
        depth.copy_from_slice(&self.depth);
        (ns, Answer::Depths)
    }

    fn notes(&self) -> String {
        let s = self.index.stats();
        format!("blocks={} entries={}", s.blocks, s.entries)
    }
}

/// dynamo-kv-router's single-threaded `RadixTree`.
pub(crate) struct Dynamo {
    pub(crate) tree: RadixTree,
    pub(crate) event_id: u64,
    pub(crate) errors: u64,
}

impl Dynamo {
    /// Applies one event to the tree, timed; a refused event counts as an error.
    fn timed_apply(&mut self, event: RouterEvent) -> u64 {
        let t = now();
        let r = self.tree.apply_event(event);
        let ns = ns_since(t);
        self.errors += r.is_err() as u64;
        ns
    }
}

/// Dynamo's native stored event.
fn dynamo_stored(
    event_id: u64,
    worker: u32,
    parent: Option<u64>,
    locals: &[u64],
    engines: &[u64],
) -> RouterEvent {
    RouterEvent::new(
        worker as u64,
        KvCacheEvent {
            event_id,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks: engines
                    .iter()
                    .zip(locals)
                    .map(|(&e, &l)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(e),
                        tokens_hash: LocalBlockHash(l),
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
            dp_rank: 0,
        },
    )
}

/// Dynamo's native removed event.
fn dynamo_removed(event_id: u64, worker: u32, engines: &[u64]) -> RouterEvent {
    RouterEvent::new(
        worker as u64,
        KvCacheEvent {
            event_id,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: engines
                    .iter()
                    .map(|&e| ExternalSequenceBlockHash(e))
                    .collect(),
            }),
            dp_rank: 0,
        },
    )
}

/// Times one Dynamo lookup of `locals` (its result dropped inside the clock, as Dynamo pays
/// for it) and writes its scores into `depth`.
fn timed_dynamo_lookup(
    locals: &[u64],
    depth: &mut [u32],
    find: impl FnOnce(Vec<LocalBlockHash>) -> dynamo_kv_router::protocols::OverlapScores,
) -> (u64, Answer) {
    let sequence: Vec<LocalBlockHash> = locals.iter().map(|&l| LocalBlockHash(l)).collect();
    let t = now();
    let scores = find(sequence);
    let mut ns = ns_since(t);
    dynamo_depths(&scores, depth);
    let t = now();
    drop(scores);
    ns += ns_since(t);
    (ns, Answer::Depths)
}

/// Dynamo's match scores into the caller's per-worker depths.
fn dynamo_depths(scores: &dynamo_kv_router::protocols::OverlapScores, depth: &mut [u32]) {
    for (w, &s) in &scores.scores {
        depth[w.worker_id as usize] = s;
    }
}

impl Subject for Dynamo {
    fn new(_workers: usize) -> Self {
        Dynamo {
            tree: RadixTree::new(),
            event_id: 0,
            errors: 0,
        }
    }

    fn store(&mut self, worker: u32, parent: Option<u64>, locals: &[u64], engines: &[u64]) -> u64 {
        self.event_id += 1;
        let event = dynamo_stored(self.event_id, worker, parent, locals, engines);
        self.timed_apply(event)
    }

    fn remove(&mut self, worker: u32, engines: &[u64]) -> u64 {
        self.event_id += 1;
        let event = dynamo_removed(self.event_id, worker, engines);
        self.timed_apply(event)
    }

    fn lookup(&mut self, locals: &[u64], depth: &mut [u32]) -> (u64, Answer) {
        timed_dynamo_lookup(locals, depth, |sequence| {
            self.tree.find_matches(sequence, false)
        })
    }

    fn errors(&self) -> u64 {
        self.errors
    }

    fn notes(&self) -> String {
        format!("entries={}", self.tree.current_size())
    }
}

/// Jump size of Dynamo's positional indexer (the value its documentation gives).
const POSITIONAL_JUMP: usize = 32;
/// Event threads of Dynamo's `ThreadPoolIndexer` (its `router_event_threads` default).
const DYNAMO_EVENT_THREADS: usize = 4;

/// dynamo-kv-router's `PositionalIndexer` called directly on this thread: events through its
/// public `apply_event` with one caller-owned per-worker level map, lookups through
/// `find_matches` (what `ThreadPoolIndexer` runs inline on the caller's thread).
pub(crate) struct DynamoPositional {
    pub(crate) index: PositionalIndexer,
    pub(crate) levels: FxHashMap<WorkerWithDpRank, LevelIndex>,
    pub(crate) event_id: u64,
    pub(crate) errors: u64,
}

impl DynamoPositional {
    fn timed_apply(&mut self, event: RouterEvent) -> u64 {
        let t = now();
        let r = self.index.apply_event(&mut self.levels, event, None);
        let ns = ns_since(t);
        self.errors += r.is_err() as u64;
        ns
    }
}

impl Subject for DynamoPositional {
    fn new(_workers: usize) -> Self {
        DynamoPositional {
            index: PositionalIndexer::new_with_mode(POSITIONAL_JUMP, SearchMode::Strided),
            levels: FxHashMap::default(),
            event_id: 0,
            errors: 0,
        }
    }

    fn store(&mut self, worker: u32, parent: Option<u64>, locals: &[u64], engines: &[u64]) -> u64 {
        self.event_id += 1;
        let event = dynamo_stored(self.event_id, worker, parent, locals, engines);
        self.timed_apply(event)
    }

    fn remove(&mut self, worker: u32, engines: &[u64]) -> u64 {
        self.event_id += 1;
        let event = dynamo_removed(self.event_id, worker, engines);
        self.timed_apply(event)
    }

    fn lookup(&mut self, locals: &[u64], depth: &mut [u32]) -> (u64, Answer) {
        timed_dynamo_lookup(locals, depth, |sequence| {
            SyncIndexer::find_matches(&self.index, &sequence, false)
        })
    }

    fn errors(&self) -> u64 {
        self.errors
    }
}

/// A dynamo-kv-router backend behind `ThreadPoolIndexer`, as Dynamo deploys it: events are
/// enqueued to its event threads (sharded by worker), lookups run inline on the caller's thread.
pub(crate) struct DynamoPool<T: SyncIndexer> {
    pub(crate) pool: ThreadPoolIndexer<T>,
    pub(crate) runtime: tokio::runtime::Runtime,
    pub(crate) event_id: u64,
    pub(crate) errors: u64,
}

/// Which backend a [`DynamoPool`] wraps.
pub(crate) trait PoolBackend: SyncIndexer + Sized {
    fn backend() -> Self;
}

impl PoolBackend for ConcurrentRadixTreeCompressed {
    fn backend() -> Self {
        ConcurrentRadixTreeCompressed::new()
    }
}

impl PoolBackend for PositionalIndexer {
    fn backend() -> Self {
        PositionalIndexer::new_with_mode(POSITIONAL_JUMP, SearchMode::Strided)
    }
}

impl<T: PoolBackend> DynamoPool<T> {
    fn timed_enqueue(&mut self, event: RouterEvent) -> u64 {
        let t = now();
        let r = self.pool.enqueue_event(event);
        let ns = ns_since(t);
        self.errors += r.is_err() as u64;
        ns
    }
}

impl<T: PoolBackend> Subject for DynamoPool<T> {
    const THREADED: bool = true;

    fn new(_workers: usize) -> Self {
        DynamoPool {
            pool: ThreadPoolIndexer::new(T::backend(), DYNAMO_EVENT_THREADS, TRACE_BLOCK),
            runtime: tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("a runtime to wait on the event threads"),
            event_id: 0,
            errors: 0,
        }
    }

    fn settle(&mut self) -> u64 {
        let t = now();
        let r = self.runtime.block_on(self.pool.flush_and_wait());
        let ns = ns_since(t);
        self.errors += r.is_err() as u64;
        ns
    }

    fn store(&mut self, worker: u32, parent: Option<u64>, locals: &[u64], engines: &[u64]) -> u64 {
        self.event_id += 1;
        let event = dynamo_stored(self.event_id, worker, parent, locals, engines);
        self.timed_enqueue(event)
    }

    fn remove(&mut self, worker: u32, engines: &[u64]) -> u64 {
        self.event_id += 1;
        let event = dynamo_removed(self.event_id, worker, engines);
        self.timed_enqueue(event)
    }

    fn lookup(&mut self, locals: &[u64], depth: &mut [u32]) -> (u64, Answer) {
        // The pool's `find_matches` runs exactly this inline on the caller's thread (no channel);
        // only its async wrapper is left out.
        timed_dynamo_lookup(locals, depth, |sequence| {
            self.pool.backend().find_matches(&sequence, false)
        })
    }

    fn errors(&self) -> u64 {
        self.errors
    }
}

/// kv-index's `ChainIndex` (the crate's only KV index since 2.0, which removed the positional
/// indexer), one caller-owned lane map per worker.
pub(crate) struct KvIndex {
    pub(crate) index: ChainIndex,
    pub(crate) ids: Vec<u32>,
    pub(crate) workers_of: Vec<u32>,
    pub(crate) maps: Vec<ChainBlockMap>,
    pub(crate) blocks: Vec<kv_index::StoredBlock>,
    pub(crate) hashes: Vec<SequenceHash>,
    pub(crate) scores: Vec<u32>,
    pub(crate) errors: u64,
}

impl Subject for KvIndex {
    fn new(workers: usize) -> Self {
        let index = ChainIndex::with_max_workers(workers);
        let ids: Vec<u32> = (0..workers)
            .map(|w| index.intern_worker(&format!("w{w}")).expect("worker slot"))
            .collect();
        let mut workers_of = vec![u32::MAX; workers];
        for (w, &id) in ids.iter().enumerate() {
            workers_of[id as usize] = w as u32;
        }
        KvIndex {
            index,
            ids,
            workers_of,
            maps: (0..workers).map(|_| ChainBlockMap::new()).collect(),
            blocks: Vec::new(),
            hashes: Vec::new(),
            scores: vec![0; workers],
            errors: 0,
        }
    }

    fn store(&mut self, worker: u32, parent: Option<u64>, locals: &[u64], engines: &[u64]) -> u64 {
        self.blocks.clear();
        self.blocks.extend(
            engines
                .iter()
                .zip(locals)
                .map(|(&e, &l)| kv_index::StoredBlock {
                    seq_hash: SequenceHash(e),
                    content_hash: kv_index::ContentHash(l),
                }),
        );
        let (id, map) = (self.ids[worker as usize], &mut self.maps[worker as usize]);
        let t = now();
        let r = self
            .index
            .apply_stored(id, &self.blocks, parent.map(SequenceHash), map);
        let ns = ns_since(t);
        self.errors += r.is_err() as u64;
        ns
    }

    fn remove(&mut self, worker: u32, engines: &[u64]) -> u64 {
        self.hashes.clear();
        self.hashes.extend(engines.iter().map(|&e| SequenceHash(e)));
        let (id, map) = (self.ids[worker as usize], &mut self.maps[worker as usize]);
        let t = now();
        self.index.apply_removed(id, &self.hashes, map);
        ns_since(t)
    }

    fn lookup(&mut self, locals: &[u64], depth: &mut [u32]) -> (u64, Answer) {
        let t = now();
        self.scores.fill(0);
        let scores = &mut self.scores;
        self.index
            .score_into(locals, |h| *h, false, |id, s| scores[id as usize] = s);
        let ns = ns_since(t);
        for (id, &s) in self.scores.iter().enumerate() {
            if s > 0 {
                depth[self.workers_of[id] as usize] = s;
            }
        }
        (ns, Answer::Depths)
    }

    fn errors(&self) -> u64 {
        self.errors
    }

    fn notes(&self) -> String {
        let s = self.index.stats();
        format!(
            "entries={} arena_used={} arena_chunks={} slab={}",
            self.index.current_size(),
            s.arena_bytes,
            s.arena_chunk_bytes,
            s.slab_bytes
        )
    }
}

/// kvrouted's whole state machine: what the daemon's single writer runs per input.
pub(crate) struct FullRouter {
    pub(crate) router: Router,
    pub(crate) seq: u64,
    pub(crate) ids: Vec<WorkerId>,
    pub(crate) no_candidate: u64,
    /// (time, owners listed in the reply) of each decision: a decision weighs its owners, so
    /// its time is reported apart for those with many.
    pub(crate) decisions: Vec<(u64, usize)>,
}

/// Decisions with at least this many owners are reported apart (the notes' `wide_`).
const WIDE_DECISION_OWNERS: usize = 256;

/// Mooncake blocks are 512 tokens; the router is configured for that block size.
pub(crate) const TRACE_BLOCK: u32 = 512;

impl FullRouter {
    fn stamp(&mut self, input: Input) -> Stamped {
        self.seq += 1;
        Stamped {
            seq: self.seq,
            at_ms: self.seq,
            input,
        }
    }
}

impl Subject for FullRouter {
    fn new(workers: usize) -> Self {
        FullRouter {
            router: Router::new(RouterConfig {
                block_size: TRACE_BLOCK,
                // Approximate ownership off (records expire as written), so each decision sees
                // exactly the KV-event ownership the other indexes hold.
                approx_ttl_ms: 0,
                approx_max_records: 1,
                ..RouterConfig::default()
            }),
            seq: 0,
            ids: (0..workers)
                .map(|w| WorkerId::new(&format!("w{w}")).unwrap())
                .collect(),
            no_candidate: 0,
            decisions: Vec::new(),
        }
    }

    fn store(&mut self, worker: u32, parent: Option<u64>, locals: &[u64], engines: &[u64]) -> u64 {
        let blocks = engines
            .iter()
            .zip(locals)
            .map(|(&e, &l)| StoredBlock {
                engine_hash: e,
                local: l,
            })
            .collect();
        let input = self.stamp(Input::KvEvents(KvEventBatch::stored(
            self.ids[worker as usize].clone(),
            parent,
            blocks,
            TRACE_BLOCK,
        )));
        let t = now();
        black_box(self.router.apply(&input));
        ns_since(t)
    }

    fn remove(&mut self, worker: u32, engines: &[u64]) -> u64 {
        let input = self.stamp(Input::KvEvents(KvEventBatch {
            worker: self.ids[worker as usize].clone(),
            model: None,
            dp_rank: 0,
            seq: None,
            epoch: None,
            events: vec![KvEvent::Removed {
                engine_hashes: engines.to_vec(),
                medium: Medium::Gpu,
            }],
        }));
        let t = now();
        black_box(self.router.apply(&input));
        ns_since(t)
    }

    fn lookup(&mut self, locals: &[u64], _depth: &mut [u32]) -> (u64, Answer) {
        let seq = self.seq + 1;
        let t = now();
        let keys = chain_locals(locals.iter().copied());
        let input = Stamped {
            seq,
            at_ms: seq,
            input: Input::Route(RouteRequest {
                model: None,
                lora: None,
                prompt_tokens: keys.len() as u64 * TRACE_BLOCK as u64,
                keys,
                max_output_tokens: Some(256),
                exclude: Vec::new(),
                request_id: None,
                explain: false,
            }),
        };
        let output = self.router.apply(&input);
        let ns = ns_since(t);
        self.seq = seq;
        let matched = match output {
            Output::Routed(d) => {
                let reservation = d.reservation;
                let matched = d.matched_blocks;
                self.decisions.push((ns, d.owners.len()));
                let release = self.stamp(Input::Release {
                    reservation,
                    phase: None,
                });
                self.router.apply(&release);
                matched
            }
            _ => {
                self.no_candidate += 1;
                0
            }
        };
        let threshold = self.router.config().policy.match_threshold(locals.len());
        (ns, Answer::MaxDepth { matched, threshold })
    }

    fn bench_bytes(&self) -> usize {
        self.decisions.capacity() * std::mem::size_of::<(u64, usize)>()
    }

    fn notes(&self) -> String {
        let s = self.router.index_stats();
        let (mut wide, mut narrow): (Vec<u64>, Vec<u64>) = (Vec::new(), Vec::new());
        for &(ns, owners) in &self.decisions {
            if owners >= WIDE_DECISION_OWNERS {
                wide.push(ns);
            } else {
                narrow.push(ns);
            }
        }
        wide.sort_unstable();
        narrow.sort_unstable();
        format!(
            "blocks={} entries={} no_candidate={} wide_decisions={} (>={WIDE_DECISION_OWNERS} owners) \
             wide_p50_ns={} wide_p99_ns={} other_p50_ns={} other_p99_ns={}",
            s.blocks,
            s.entries,
            self.no_candidate,
            wide.len(),
            percentile(&wide, 0.50),
            percentile(&wide, 0.99),
            percentile(&narrow, 0.50),
            percentile(&narrow, 0.99),
        )
    }
}
