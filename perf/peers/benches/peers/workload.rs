//! The benchmark's workload: the trace, the hashes each index is given, and the event stream
//! (stores, removals, lookups) every index replays.

use std::collections::BTreeMap;
use std::path::PathBuf;

use dynamo_kv_router::protocols::{compute_next_seq_hash, LocalBlockHash};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

// ---------------------------------------------------------------------------------------------
// The stream.

#[derive(serde::Deserialize)]
pub(crate) struct TraceLine {
    pub(crate) hash_ids: Vec<u64>,
}

pub(crate) fn load_trace(path: &PathBuf, limit: Option<usize>) -> Vec<Vec<u64>> {
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

pub(crate) fn mix(mut x: u64) -> u64 {
    // splitmix64's finalizer.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

pub(crate) fn content_hash(id: u64) -> u64 {
    mix(id ^ 0x00c0_ffee_0000_0001)
}

/// A block's engine hash: Dynamo's sequence hash of its prefix (the first block's is its local
/// hash, each next one `compute_next_seq_hash(parent, local)`), as engines publish for Dynamo.
/// Dynamo's `PositionalIndexer` checks stored hashes against the ones it computes from a
/// request, so any other engine hash never matches there; the other indexes take it as opaque.
/// The trace's block ids are prefix ids (an id always follows the same parent), so an id has
/// one engine hash.
fn engine_hash(parent: Option<u64>, local: u64) -> u64 {
    match parent {
        None => local,
        Some(p) => compute_next_seq_hash(p, LocalBlockHash(local)),
    }
}

/// Fingerprint of a lookup's answer: the (worker, depth) pairs with depth > 0, by worker.
pub(crate) fn fingerprint(pairs: impl Iterator<Item = (u32, u32)>) -> u64 {
    pairs.fold(0x243f_6a88_85a3_08d3, |h, (w, d)| {
        mix(h ^ (((w as u64) << 32) | d as u64))
    })
}

#[derive(Clone, Copy)]
pub(crate) enum Op {
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

pub(crate) struct Stream {
    pub(crate) workers: usize,
    /// Per request block, in request order: content hash and engine hash.
    pub(crate) locals: Vec<u64>,
    pub(crate) engines: Vec<u64>,
    pub(crate) removed: Vec<u64>,
    pub(crate) ops: Vec<Op>,
    pub(crate) lookups: usize,
    pub(crate) stored_blocks: u64,
    pub(crate) removed_blocks: u64,
    /// (worker, block) entries and distinct blocks resident at the end.
    pub(crate) resident: u64,
    pub(crate) distinct: u64,
    /// Lookups answered with a match of at least one block, and the mean deepest match.
    pub(crate) hits: usize,
    pub(crate) mean_max_depth: f64,
    /// Mean ranks per lookup with any match, and at the deepest match (a route decision weighs
    /// the latter: its cost follows them, not the fleet).
    pub(crate) mean_matched: f64,
    pub(crate) mean_deepest_owners: f64,
}

pub(crate) fn generate(trace: &[Vec<u64>], workers: usize, capacity: usize, dup: u64) -> Stream {
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
        mean_matched: 0.0,
        mean_deepest_owners: 0.0,
    };
    let mut holders: FxHashMap<u64, SmallVec<[u32; 4]>> = FxHashMap::default();
    // Block id → engine hash.
    let mut engines: FxHashMap<u64, u64> = FxHashMap::default();
    // Per worker: LRU order (stamp → block) and each held block's stamp.
    let mut lru: Vec<BTreeMap<u64, u64>> = vec![BTreeMap::new(); workers];
    let mut stamps: Vec<FxHashMap<u64, u64>> = vec![FxHashMap::default(); workers];
    let mut depth = vec![0u32; workers];
    let mut matched: Vec<u32> = Vec::new();
    let mut next_rr = 0usize;
    let mut clock = 0u64;
    let mut depth_sum = 0u64;
    let (mut matched_sum, mut deepest_owners_sum) = (0u64, 0u64);
    // Within one request, an earlier block is more recent than a later one.
    let stamp = |clock: u64, pos: usize| (clock << 16) | (0xffff - pos as u64);
    assert!(capacity < 0xffff, "capacity must fit the LRU stamp");

    for req in trace {
        for tenant in 0..dup {
            let ids: Vec<u64> = req.iter().map(|&h| h | (tenant << 40)).collect();
            let start = s.locals.len() as u32;
            s.locals.extend(ids.iter().map(|&id| content_hash(id)));
            let mut parent = None;
            for &id in &ids {
                let engine = *engines
                    .entry(id)
                    .or_insert_with(|| engine_hash(parent, content_hash(id)));
                s.engines.push(engine);
                parent = Some(engine);
            }

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
            matched_sum += matched.len() as u64;
            deepest_owners_sum += matched
                .iter()
                .filter(|&&w| max_depth > 0 && depth[w as usize] == max_depth)
                .count() as u64;

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
                s.removed.push(engines[&id]);
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
    s.mean_matched = matched_sum as f64 / s.lookups.max(1) as f64;
    s.mean_deepest_owners = deepest_owners_sum as f64 / s.lookups.max(1) as f64;
    s
}
