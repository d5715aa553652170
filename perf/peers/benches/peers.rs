//! kvrouted's index side by side with the two public Rust KV indexers (issue 6):
//! `dynamo-kv-router`'s `RadixTree` and `kv-index`'s `ChainIndex`, on one KV event stream.
//!
//! Run: `cargo bench --bench peers` (release; about a minute on 2 cores). Options, after `--`:
//! `--trace PATH` (or env `PEERS_TRACE`; default `../shared/traces/conversation_trace.jsonl`
//! relative to the crate root), `--dup N` (default 8), `--capacity BLOCKS` (default 4096),
//! `--workers 16,256`, `--reps N` (default 5), `--requests N` (first N trace lines only),
//! `--only kvrouted,kv-index` (a subset of the indexes, e.g. to profile one).
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
//! lookups include chaining the content hashes into its block keys, 16 at a time ahead of the
//! walk (what a gateway that sends `tokens` costs it), stopping at the first block no worker
//! continues, as the peers stop walking content hashes. Result shapes are each API's own:
//! kvrouted and kv-index write depths into a caller's buffer (`OwnerIndex::walk`,
//! `ChainIndex::score_into`), dynamo returns a map (`RadixTree::find_matches`), whose drop is
//! timed too. Memory is the counting allocator's live bytes held by the index after the replay,
//! per (worker, block) entry resident at the end.
//!
//! Two diagnostic rows follow. `kvrouted-keys` is kvrouted's index with the block keys chained
//! before the clock starts (what a gateway sending `block_keys` saves it). `kvrouted-router`
//! replays the same stream through kvrouted's whole state machine
//! (`Router::apply`): events as KV event batches, lookups as full route decisions (policy,
//! reservations, decision record; approximate ownership disabled with a zero TTL so the answers
//! stay comparable, checked by the decision's matched depth). Neither is equivalent work to the
//! three index rows; the second shows what the daemon's single writer pays per input.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use kvrouted::hashing::{chain, chain_locals};
use kvrouted::index::OwnerIndex;
use kvrouted::sim::percentile;
use kvrouted::input::{
    Input, KvEvent, KvEventBatch, Medium, RouteRequest, Stamped, StoredBlock, WorkerId,
};
use kvrouted::router::{Output, Router, RouterConfig};

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash,
};
use dynamo_kv_router::{RadixTree, RouterEvent};

use kv_index::{ChainBlockMap, ChainIndex, SequenceHash};

// ---------------------------------------------------------------------------------------------
// Counting allocator: live heap bytes, for the memory figures.

use kvrouted_testkit::counting_alloc::{self, Counting};

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> usize {
    counting_alloc::live_bytes()
}

// ---------------------------------------------------------------------------------------------
// Options.

struct Options {
    trace: PathBuf,
    dup: u64,
    capacity: usize,
    workers: Vec<usize>,
    reps: usize,
    requests: Option<usize>,
    /// Only these indexes (for profiling one of them).
    only: Option<Vec<String>>,
}

fn options() -> Options {
    let default_trace = std::env::var("PEERS_TRACE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../../shared/traces/conversation_trace.jsonl")
        });
    let mut o = Options {
        trace: default_trace,
        dup: 8,
        capacity: 4096,
        workers: vec![16, 256],
        reps: 5,
        requests: None,
        only: None,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let value = args.get(i + 1).cloned().unwrap_or_default();
        let num = |v: &str| -> usize {
            v.parse()
                .unwrap_or_else(|_| panic!("{}: expected a number, got {v:?}", args[i]))
        };
        match args[i].as_str() {
            "--trace" => o.trace = PathBuf::from(&value),
            "--dup" => o.dup = num(&value) as u64,
            "--capacity" => o.capacity = num(&value),
            "--reps" => o.reps = num(&value),
            "--requests" => o.requests = Some(num(&value)),
            "--workers" => o.workers = value.split(',').map(num).collect(),
            "--only" => o.only = Some(value.split(',').map(str::to_owned).collect()),
            // `cargo bench` passes `--bench`; anything else unknown is ignored the same way.
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    assert!(o.dup >= 1 && o.capacity >= 1 && o.reps >= 1, "bad options");
    assert!(
        o.workers.iter().all(|&n| (1..=1024).contains(&n)),
        "workers: 1 to 1024 (kv-index's limit)"
    );
    o
}

// ---------------------------------------------------------------------------------------------
// The stream.

#[derive(serde::Deserialize)]
struct TraceLine {
    hash_ids: Vec<u64>,
}

fn load_trace(path: &PathBuf, limit: Option<usize>) -> Vec<Vec<u64>> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| {
        panic!(
            "cannot read the trace {} ({e}); pass --trace PATH or set PEERS_TRACE",
            path.display()
        )
    });
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .take(limit.unwrap_or(usize::MAX))
        .map(|l| {
            serde_json::from_str::<TraceLine>(l)
                .expect("Mooncake trace line")
                .hash_ids
        })
        .collect()
}

fn mix(mut x: u64) -> u64 {
    // splitmix64's finalizer.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn content_hash(id: u64) -> u64 {
    mix(id ^ 0x00c0_ffee_0000_0001)
}

fn engine_hash(id: u64) -> u64 {
    mix(id ^ 0x0e61_6e00_0000_0002)
}

/// Fingerprint of a lookup's answer: the (worker, depth) pairs with depth > 0, by worker.
fn fingerprint(pairs: impl Iterator<Item = (u32, u32)>) -> u64 {
    pairs.fold(0x243f_6a88_85a3_08d3, |h, (w, d)| {
        mix(h ^ (((w as u64) << 32) | d as u64))
    })
}

#[derive(Clone, Copy)]
enum Op {
    /// Look up request blocks `start..start+len`; the answer's fingerprint and maximum depth.
    Lookup {
        start: u32,
        len: u32,
        expect: u64,
        max_depth: u32,
    },
    /// Store request blocks `start+skip..start+len` on `worker`, after the block at
    /// `start+skip-1` (no parent when `skip` is 0).
    Store {
        worker: u32,
        start: u32,
        skip: u32,
        len: u32,
    },
    /// Remove the engine hashes `removed[start..start+len]` from `worker`.
    Remove { worker: u32, start: u32, len: u32 },
}

struct Stream {
    workers: usize,
    /// Per request block, in request order: content hash and engine hash.
    locals: Vec<u64>,
    engines: Vec<u64>,
    removed: Vec<u64>,
    ops: Vec<Op>,
    lookups: usize,
    stored_blocks: u64,
    removed_blocks: u64,
    /// (worker, block) entries and distinct blocks resident at the end.
    resident: u64,
    distinct: u64,
    /// Lookups answered with a match of at least one block, and the mean deepest match.
    hits: usize,
    mean_max_depth: f64,
}

fn generate(trace: &[Vec<u64>], workers: usize, capacity: usize, dup: u64) -> Stream {
    let mut s = Stream {
        workers,
        locals: Vec::new(),
        engines: Vec::new(),
        removed: Vec::new(),
        ops: Vec::new(),
        lookups: 0,
        stored_blocks: 0,
        removed_blocks: 0,
        resident: 0,
        distinct: 0,
        hits: 0,
        mean_max_depth: 0.0,
    };
    let mut holders: FxHashMap<u64, SmallVec<[u32; 4]>> = FxHashMap::default();
    // Per worker: LRU order (stamp → block) and each held block's stamp.
    let mut lru: Vec<BTreeMap<u64, u64>> = vec![BTreeMap::new(); workers];
    let mut stamps: Vec<FxHashMap<u64, u64>> = vec![FxHashMap::default(); workers];
    let mut depth = vec![0u32; workers];
    let mut matched: Vec<u32> = Vec::new();
    let mut next_rr = 0usize;
    let mut clock = 0u64;
    let mut depth_sum = 0u64;
    // Within one request, an earlier block is more recent than a later one.
    let stamp = |clock: u64, pos: usize| (clock << 16) | (0xffff - pos as u64);
    assert!(capacity < 0xffff, "capacity must fit the LRU stamp");

    for req in trace {
        for tenant in 0..dup {
            let ids: Vec<u64> = req.iter().map(|&h| h | (tenant << 40)).collect();
            let start = s.locals.len() as u32;
            s.locals.extend(ids.iter().map(|&id| content_hash(id)));
            s.engines.extend(ids.iter().map(|&id| engine_hash(id)));

            // The answer: per worker, the consecutive prefix it holds.
            for &w in &matched {
                depth[w as usize] = 0;
            }
            matched.clear();
            for (pos, id) in ids.iter().enumerate() {
                let Some(hs) = holders.get(id) else { break };
                let mut any = false;
                for &w in hs {
                    let d = &mut depth[w as usize];
                    if *d as usize == pos {
                        if pos == 0 {
                            matched.push(w);
                        }
                        *d += 1;
                        any = true;
                    }
                }
                if !any {
                    break;
                }
            }
            matched.sort_unstable();
            let max_depth = matched
                .iter()
                .map(|&w| depth[w as usize])
                .max()
                .unwrap_or(0);
            s.ops.push(Op::Lookup {
                start,
                len: ids.len() as u32,
                expect: fingerprint(matched.iter().map(|&w| (w, depth[w as usize]))),
                max_depth,
            });
            s.lookups += 1;
            s.hits += (max_depth > 0) as usize;
            depth_sum += max_depth as u64;

            // The fixed placement rule.
            let w = if max_depth >= 2 {
                *matched
                    .iter()
                    .find(|&&w| depth[w as usize] == max_depth)
                    .expect("a worker at the deepest match")
            } else {
                next_rr += 1;
                ((next_rr - 1) % workers) as u32
            };
            let wi = w as usize;
            let held = depth[wi] as usize;
            let len = ids.len().min(capacity);
            clock += 1;
            for (pos, id) in ids.iter().enumerate().take(held) {
                let old = stamps[wi].insert(*id, stamp(clock, pos)).expect("held");
                lru[wi].remove(&old);
                lru[wi].insert(stamp(clock, pos), *id);
            }
            let new = len.saturating_sub(held);
            let removed_start = s.removed.len() as u32;
            while stamps[wi].len() + new > capacity {
                let (_, id) = lru[wi].pop_first().expect("something to evict");
                stamps[wi].remove(&id);
                let hs = holders.get_mut(&id).expect("evicted block has holders");
                hs.retain(|h| *h != w);
                if hs.is_empty() {
                    holders.remove(&id);
                }
                s.removed.push(engine_hash(id));
            }
            let evicted = s.removed.len() as u32 - removed_start;
            if evicted > 0 {
                s.ops.push(Op::Remove {
                    worker: w,
                    start: removed_start,
                    len: evicted,
                });
                s.removed_blocks += evicted as u64;
            }
            if new > 0 {
                for (pos, id) in ids.iter().enumerate().take(len).skip(held) {
                    stamps[wi].insert(*id, stamp(clock, pos));
                    lru[wi].insert(stamp(clock, pos), *id);
                    holders.entry(*id).or_default().push(w);
                }
                s.ops.push(Op::Store {
                    worker: w,
                    start,
                    skip: held as u32,
                    len: len as u32,
                });
                s.stored_blocks += new as u64;
            }
        }
    }
    s.resident = holders.values().map(|h| h.len() as u64).sum();
    s.distinct = holders.len() as u64;
    s.mean_max_depth = depth_sum as f64 / s.lookups.max(1) as f64;
    s
}

// ---------------------------------------------------------------------------------------------
// The indexes under test. Each method builds its native input untimed, times the call and
// returns nanoseconds.

enum Answer {
    /// Per-worker depths, written into the caller's buffer.
    Depths,
    /// Only the deepest match is visible (the Router's decision).
    MaxDepth(u32),
}

trait Subject {
    fn new(workers: usize) -> Self;
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
}

// ---------------------------------------------------------------------------------------------
// The per-operation clock. `Instant` costs about 100 ns a pair on this VM, as much as a whole
// store event; the time-stamp counter (constant and non-stop on x86_64) costs a quarter of that.
// Its rate is calibrated against `Instant` at start, and the cost of an empty interval is
// subtracted from every measured one.

#[derive(Clone, Copy)]
struct Tick(u64);

#[cfg(target_arch = "x86_64")]
fn raw_ticks() -> u64 {
    // SAFETY: `rdtsc` has no preconditions on x86_64.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
fn raw_ticks() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

struct Clock {
    ns_per_tick: f64,
    /// Ticks of an empty interval (the floor), subtracted from every interval.
    floor: u64,
}

static CLOCK: std::sync::OnceLock<Clock> = std::sync::OnceLock::new();

fn clock() -> &'static Clock {
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

fn now() -> Tick {
    Tick(raw_ticks())
}

fn ns_since(t: Tick) -> u64 {
    let end = raw_ticks();
    let c = clock();
    let ticks = end.saturating_sub(t.0).saturating_sub(c.floor);
    (ticks as f64 * c.ns_per_tick) as u64
}

/// The per-worker consecutive match, as `Router::depths` computes it from `OwnerIndex::walk`.
fn extend_depths(depth: &mut [u32], i: usize, owners: &[u32]) -> bool {
    let mut any = false;
    for &slot in owners {
        let d = &mut depth[slot as usize];
        if *d as usize == i {
            *d += 1;
        }
        any |= *d as usize == i + 1;
    }
    any
}

/// kvrouted's `OwnerIndex`, driven directly. With `KEYS_GIVEN`, the request's block keys are
/// chained before the clock starts (a gateway that sends `block_keys`): a diagnostic row showing
/// what chaining costs the lookup.
struct Kvrouted<const KEYS_GIVEN: bool> {
    index: OwnerIndex,
    blocks: Vec<StoredBlock>,
    keys: Vec<u64>,
    depth: Vec<u32>,
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
        black_box(self.index.store(worker, 0, parent, &self.blocks));
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
            self.keys.extend(chain_locals(locals.iter().copied()));
        }
        let t = now();
        self.depth.fill(0);
        let d = &mut self.depth;
        if KEYS_GIVEN {
            self.index
                .walk(0, &self.keys, |i, owners| extend_depths(d, i, owners));
        } else {
            // Chains keys a chunk ahead of the walk and stops at the first block no worker
            // continues, as the peers stop walking content hashes. Chunks (not key by key)
            // keep several probes of a long match in flight at once.
            const CHUNK: usize = 16;
            self.keys.clear();
            let mut parent = None;
            for chunk in locals.chunks(CHUNK) {
                let start = self.keys.len();
                for &local in chunk {
                    let key = chain(parent, local);
                    self.keys.push(key);
                    parent = Some(key);
                }
                let (mut reached, mut continues) = (0, true);
                self.index.walk(0, &self.keys[start..], |i, owners| {
                    reached = i + 1;
                    continues = extend_depths(d, start + i, owners);
                    continues
                });
                if !continues || reached < chunk.len() {
                    break;
                }
            }
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
struct Dynamo {
    tree: RadixTree,
    event_id: u64,
    errors: u64,
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
        let event = RouterEvent::new(
            worker as u64,
            KvCacheEvent {
                event_id: self.event_id,
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
        );
        self.timed_apply(event)
    }

    fn remove(&mut self, worker: u32, engines: &[u64]) -> u64 {
        self.event_id += 1;
        let event = RouterEvent::new(
            worker as u64,
            KvCacheEvent {
                event_id: self.event_id,
                data: KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: engines
                        .iter()
                        .map(|&e| ExternalSequenceBlockHash(e))
                        .collect(),
                }),
                dp_rank: 0,
            },
        );
        self.timed_apply(event)
    }

    fn lookup(&mut self, locals: &[u64], depth: &mut [u32]) -> (u64, Answer) {
        let sequence: Vec<LocalBlockHash> = locals.iter().map(|&l| LocalBlockHash(l)).collect();
        let t = now();
        let scores = self.tree.find_matches(sequence, false);
        let mut ns = ns_since(t);
        for (w, &s) in &scores.scores {
            depth[w.worker_id as usize] = s;
        }
        let t = now();
        drop(scores);
        ns += ns_since(t);
        (ns, Answer::Depths)
    }

    fn errors(&self) -> u64 {
        self.errors
    }

    fn notes(&self) -> String {
        format!("entries={}", self.tree.current_size())
    }
}

/// kv-index's `ChainIndex` (the crate's only KV index since 2.0, which removed the positional
/// indexer), one caller-owned lane map per worker.
struct KvIndex {
    index: ChainIndex,
    ids: Vec<u32>,
    workers_of: Vec<u32>,
    maps: Vec<ChainBlockMap>,
    blocks: Vec<kv_index::StoredBlock>,
    hashes: Vec<SequenceHash>,
    scores: Vec<u32>,
    errors: u64,
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
struct FullRouter {
    router: Router,
    seq: u64,
    ids: Vec<WorkerId>,
    no_candidate: u64,
}

/// Mooncake blocks are 512 tokens; the router is configured for that block size.
const TRACE_BLOCK: u32 = 512;

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
                let release = self.stamp(Input::Release { reservation });
                self.router.apply(&release);
                matched
            }
            _ => {
                self.no_candidate += 1;
                0
            }
        };
        (ns, Answer::MaxDepth(matched))
    }

    fn notes(&self) -> String {
        let s = self.router.index_stats();
        format!(
            "blocks={} entries={} no_candidate={}",
            s.blocks, s.entries, self.no_candidate
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Replay and report.

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

fn replay<S: Subject>(stream: &Stream) -> Rep {
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
                depth.fill(0);
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
                    Answer::MaxDepth(d) => d == max_depth,
                };
                if !ok {
                    mismatches += 1;
                    first_mismatch.get_or_insert(n);
                }
            }
            Op::Store {
                worker,
                start,
                skip,
                len,
            } => {
                let (from, to) = ((start + skip) as usize, (start + len) as usize);
                let parent = (skip > 0).then(|| stream.engines[from - 1]);
                event_ns += subject.store(
                    worker,
                    parent,
                    &stream.locals[from..to],
                    &stream.engines[from..to],
                );
            }
            Op::Remove { worker, start, len } => {
                let hashes = &stream.removed[start as usize..(start + len) as usize];
                event_ns += subject.remove(worker, hashes);
            }
        }
    }
    let bytes = live().saturating_sub(before);
    let errors = subject.errors();
    let mut notes = subject.notes();
    if let Some(n) = first_mismatch {
        notes.push_str(&format!(" first_mismatch_op={n}"));
    }
    drop(subject);
    let lookup_ns: u64 = latencies.iter().sum();
    latencies.sort_unstable();
    Rep {
        events_per_s: (stream.stored_blocks + stream.removed_blocks) as f64
            / (event_ns as f64 / 1e9),
        lookups_per_s: stream.lookups as f64 / (lookup_ns as f64 / 1e9),
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

const SUBJECTS: [&str; 5] = [
    "kvrouted",
    "dynamo-kv-router",
    "kv-index",
    "kvrouted-router",
    "kvrouted-keys",
];

fn run_subject(name: &str, stream: &Stream) -> Rep {
    match name {
        "kvrouted" => replay::<Kvrouted<false>>(stream),
        "kvrouted-keys" => replay::<Kvrouted<true>>(stream),
        "dynamo-kv-router" => replay::<Dynamo>(stream),
        "kv-index" => replay::<KvIndex>(stream),
        "kvrouted-router" => replay::<FullRouter>(stream),
        other => unreachable!("{other}"),
    }
}

/// The empty interval subtracted from every measurement, in ns.
fn timer_floor_ns() -> f64 {
    let c = clock();
    c.floor as f64 * c.ns_per_tick
}

fn main() {
    let started = Instant::now();
    let o = options();
    let trace = load_trace(&o.trace, o.requests);
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
    let mut json_rows = Vec::new();
    for &workers in &o.workers {
        let t = Instant::now();
        let stream = generate(&trace, workers, o.capacity, o.dup);
        println!(
            "\n{workers} workers: {} lookups ({:.1}% hit, mean deepest match {:.1} blocks), {} stored + {} removed block events, {} (worker, block) entries / {} distinct blocks resident at the end (generated in {:.1} s)",
            stream.lookups,
            100.0 * stream.hits as f64 / stream.lookups as f64,
            stream.mean_max_depth,
            stream.stored_blocks,
            stream.removed_blocks,
            stream.resident,
            stream.distinct,
            t.elapsed().as_secs_f64()
        );
        let chosen = |name: &str| {
            o.only
                .as_ref()
                .is_none_or(|only| only.iter().any(|n| n == name))
        };
        let mut reps: Vec<Vec<Rep>> = SUBJECTS.iter().map(|_| Vec::new()).collect();
        for rep in 0..o.reps {
            // Rotate the order so no index always runs first (cold caches) or last.
            for k in 0..SUBJECTS.len() {
                let i = (k + rep) % SUBJECTS.len();
                if chosen(SUBJECTS[i]) {
                    reps[i].push(run_subject(SUBJECTS[i], &stream));
                }
            }
        }
        println!(
            "{:<18} {:>13} {:>13} {:>9} {:>9} {:>12} {:>10}  notes",
            "index", "events/s", "lookups/s", "p50 ns", "p99 ns", "bytes/entry", "mismatch"
        );
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
            json_rows.push(format!(
                "{{\"index\":\"{name}\",\"workers\":{workers},\"events_per_s\":{events:.0},\"lookups_per_s\":{lookups:.0},\"lookup_p50_ns\":{p50},\"lookup_p99_ns\":{p99},\"bytes_per_entry\":{per_entry:.1},\"bytes_per_distinct_block\":{per_distinct:.1},\"resident_entries\":{},\"mismatches\":{mismatches},\"errors\":{errors}}}",
                stream.resident
            ));
        }
    }
    println!(
        "\nfinished in {:.1} s; load average {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    println!(
        "{{\"bench\":\"peers\",\"trace\":\"{}\",\"requests\":{},\"dup\":{},\"capacity_blocks\":{},\"reps\":{},\"results\":[{}]}}",
        o.trace.file_name().and_then(|n| n.to_str()).unwrap_or("?"),
        trace.len(),
        o.dup,
        o.capacity,
        o.reps,
        json_rows.join(",")
    );
}

/// The machine's load averages (1, 5, 15 min): other work on a shared machine skews every figure.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
