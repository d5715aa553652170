//! One simulated inference worker: a KV cache of `capacity` blocks with LRU eviction of
//! unreferenced blocks, a batch limit, a FIFO waiting queue and one prefill engine.
//!
//! The cache model is vLLM's: a request pins its prompt's full blocks (cached or newly
//! computed) and holds *private* blocks for its partial tail and its output while it runs; when
//! it finishes, its prompt blocks stay cached but become evictable, and its private blocks are
//! freed. Evictable cached blocks count as free in `kv_usage`, as in vLLM.
//!
//! Blocks are released deepest first, so a block is always evicted before its parent: the
//! resident blocks of a worker are closed under prefixes, and a request's cache hit is the
//! leading run of its blocks that are resident.

use std::collections::{BTreeMap, VecDeque};

use rustc_hash::FxHashMap;

use crate::input::{StoredBlock, WorkerId};

/// The engine's own hash of a block. Engines hash content, so it is the same on every worker;
/// it only has to be unique per block key on one worker.
pub(crate) fn engine_hash(key: u64) -> u64 {
    // splitmix64 finalizer: a bijection, so distinct keys have distinct engine hashes.
    let mut z = key.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[derive(Debug, Clone, Copy)]
struct Block {
    /// Running requests using the block; evictable at 0.
    refs: u32,
    /// LRU stamp, meaningful while `refs == 0`.
    stamp: u64,
}

/// What a request needs from a worker's cache.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Need<'a> {
    /// Block keys of the prompt's full blocks that the worker will cache.
    pub keys: &'a [u64],
    /// The same blocks' local hashes (what a `BlockStored` event carries).
    pub locals: &'a [u64],
    /// Blocks for the partial tail and the output, freed when the request finishes.
    pub private: u64,
}

/// What admitting a request did to the cache.
#[derive(Debug, Default)]
pub(crate) struct Admission {
    /// Leading blocks of the prompt that were already resident (the cache hit).
    pub cached: usize,
    /// Engine hash of the block before the first stored one.
    pub parent: Option<u64>,
    /// Newly stored blocks, in prompt order, and their keys.
    pub stored: Vec<StoredBlock>,
    pub stored_keys: Vec<u64>,
    /// Evicted blocks' keys.
    pub evicted_keys: Vec<u64>,
}

#[derive(Debug)]
pub(crate) struct SimWorker {
    pub id: WorkerId,
    pub capacity: u64,
    pub max_running: u32,
    blocks: FxHashMap<u64, Block>,
    /// Unreferenced resident blocks by LRU stamp (oldest first).
    lru: BTreeMap<u64, u64>,
    next_stamp: u64,
    /// Resident blocks with `refs > 0`.
    pinned: u64,
    /// Private blocks of running requests.
    private: u64,
    pub running: u32,
    /// Request indices waiting for admission, in arrival order.
    pub waiting: VecDeque<usize>,
    /// When the prefill engine is free again (µs).
    pub prefill_free_us: u64,
    /// Highest `resident + private` ever seen.
    pub peak_used: u64,
    pub served: u64,
    pub evictions: u64,
    /// Publisher sequence of the next KV event batch (`Kv-Seq`).
    pub kv_seq: u64,
}

impl SimWorker {
    pub fn new(id: WorkerId, capacity: u64, max_running: u32) -> Self {
        SimWorker {
            id,
            capacity,
            max_running,
            blocks: FxHashMap::default(),
            lru: BTreeMap::new(),
            next_stamp: 0,
            pinned: 0,
            private: 0,
            running: 0,
            waiting: VecDeque::new(),
            prefill_free_us: 0,
            peak_used: 0,
            served: 0,
            evictions: 0,
            kv_seq: 0,
        }
    }

    /// Blocks in use: resident cached blocks (evictable or not) plus private blocks.
    pub fn used(&self) -> u64 {
        self.blocks.len() as u64 + self.private
    }

    /// Fraction of the cache held by running requests (vLLM's `kv_cache_usage`: evictable
    /// cached blocks count as free).
    pub fn kv_usage(&self) -> f64 {
        ((self.pinned + self.private) as f64 / self.capacity as f64).min(1.0)
    }

    #[cfg(test)]
    pub fn resident(&self, key: u64) -> bool {
        self.blocks.contains_key(&key)
    }

    /// Resident block keys, sorted.
    pub fn resident_keys(&self) -> Vec<u64> {
        let mut keys: Vec<u64> = self.blocks.keys().copied().collect();
        keys.sort_unstable();
        keys
    }

    /// Leading blocks of `keys` that are resident.
    pub fn leading_hits(&self, keys: &[u64]) -> usize {
        keys.iter()
            .take_while(|k| self.blocks.contains_key(*k))
            .count()
    }

    /// Admits a request if a batch slot is free and its blocks fit after evicting unreferenced
    /// blocks; otherwise leaves the cache untouched and returns `None`.
    pub fn admit(&mut self, need: Need) -> Option<Admission> {
        if self.running >= self.max_running {
            return None;
        }
        let cached = self.leading_hits(need.keys);
        debug_assert!(
            need.keys[cached..]
                .iter()
                .all(|k| !self.blocks.contains_key(k)),
            "resident blocks are closed under prefixes"
        );
        // Cached blocks that are evictable now get pinned, so they cannot make room.
        let cached_unpinned = need.keys[..cached]
            .iter()
            .filter(|k| self.blocks[*k].refs == 0)
            .count() as u64;
        let new_blocks = (need.keys.len() - cached) as u64 + need.private;
        let free = self.capacity - self.used();
        let evictable = self.lru.len() as u64 - cached_unpinned;
        if new_blocks > free + evictable {
            return None;
        }

        let mut admission = Admission {
            cached,
            parent: cached.checked_sub(1).map(|i| engine_hash(need.keys[i])),
            ..Admission::default()
        };
        for key in &need.keys[..cached] {
            self.pin(*key);
        }
        while self.capacity - self.used() < new_blocks {
            let (_, key) = self
                .lru
                .pop_first()
                .expect("enough evictable blocks were counted");
            self.blocks.remove(&key);
            self.evictions += 1;
            admission.evicted_keys.push(key);
        }
        for (key, local) in need.keys[cached..].iter().zip(&need.locals[cached..]) {
            self.blocks.insert(*key, Block { refs: 1, stamp: 0 });
            self.pinned += 1;
            admission.stored.push(StoredBlock {
                engine_hash: engine_hash(*key),
                local: *local,
            });
            admission.stored_keys.push(*key);
        }
        self.private += need.private;
        self.running += 1;
        self.peak_used = self.peak_used.max(self.used());
        assert!(
            self.used() <= self.capacity,
            "worker {}: {} blocks in use exceed the capacity of {}",
            self.id,
            self.used(),
            self.capacity
        );
        Some(admission)
    }

    fn pin(&mut self, key: u64) {
        let block = self.blocks.get_mut(&key).expect("pinned block is resident");
        if block.refs == 0 {
            self.lru.remove(&block.stamp);
            self.pinned += 1;
        }
        block.refs += 1;
    }

    /// A request finished: unpin its blocks deepest first (so deeper blocks are evicted first)
    /// and free its private blocks.
    pub fn release(&mut self, keys: &[u64], private: u64) {
        for key in keys.iter().rev() {
            let block = self
                .blocks
                .get_mut(key)
                .expect("a running request's blocks are resident");
            block.refs -= 1;
            if block.refs == 0 {
                block.stamp = self.next_stamp;
                self.lru.insert(self.next_stamp, *key);
                self.next_stamp += 1;
                self.pinned -= 1;
            }
        }
        self.private -= private;
        self.running -= 1;
        self.served += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(capacity: u64) -> SimWorker {
        SimWorker::new(WorkerId::new("w").unwrap(), capacity, 8)
    }

    fn need<'a>(keys: &'a [u64], private: u64) -> Need<'a> {
        Need {
            keys,
            locals: keys,
            private,
        }
    }

    #[test]
    fn evictions_take_the_deepest_unreferenced_block_first() {
        let mut w = worker(3);
        let a = w.admit(need(&[1, 2], 0)).unwrap();
        assert_eq!((a.cached, a.stored.len()), (0, 2));
        w.release(&[1, 2], 0);
        let b = w.admit(need(&[7, 8], 0)).unwrap();
        assert_eq!(b.evicted_keys, vec![2], "the leaf goes before its parent");
        assert!(w.resident(1));
        assert_eq!(w.used(), 3);
    }

    #[test]
    fn pinned_blocks_are_never_evicted_and_a_request_that_does_not_fit_waits() {
        let mut w = worker(3);
        w.admit(need(&[1, 2], 0)).unwrap();
        assert!(w.admit(need(&[7, 8], 0)).is_none(), "only one free block");
        assert_eq!(w.used(), 2, "a refused admission changes nothing");
        let hit = w.admit(need(&[1, 2], 1)).unwrap();
        assert_eq!(
            (hit.cached, hit.stored.len()),
            (2, 0),
            "shared blocks are reused"
        );
        assert_eq!(w.used(), 3);
        assert!((w.kv_usage() - 1.0).abs() < 1e-12);
    }
}
