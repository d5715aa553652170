//! Authoritative ownership from KV events.

use super::owner_map::OwnerMap;
use super::{NsId, Slot};
use crate::hashing::chain;
use crate::input::StoredBlock;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

/// One worker's blocks in one namespace: engine hash → block key. Removals name engine hashes,
/// which are opaque, so this map is how a removal finds the key it drops.
type EngineMap = FxHashMap<u64, u64>;

/// Content key → owners per namespace, plus each worker's engine-hash map.
///
/// Invariant: `slot ∈ blocks[ns][key]` exactly as many times as `workers[slot]` maps an engine
/// hash of `ns` to `key`.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct OwnerIndex {
    /// Per namespace: block key → owner slots. A slot appears once per engine hash of that
    /// worker mapping to the block, so a worker that stored the same content under two engine
    /// hashes keeps owning it until both are removed.
    blocks: Vec<OwnerMap>,
    /// Per worker slot: its blocks per namespace.
    workers: Vec<Vec<(NsId, EngineMap)>>,
    /// Number of (block, owner) entries, i.e. the total length of all owner lists.
    entries: u64,
}

/// Sizes of the index, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct IndexStats {
    /// Distinct (namespace, block key) pairs with at least one owner.
    pub blocks: u64,
    /// (block, owner) entries.
    pub entries: u64,
}

impl OwnerIndex {
    fn worker_map(&mut self, slot: Slot, ns: NsId) -> &mut EngineMap {
        let slot = slot as usize;
        if self.workers.len() <= slot {
            self.workers.resize_with(slot + 1, Vec::new);
        }
        let maps = &mut self.workers[slot];
        let i = match maps.iter().position(|(n, _)| *n == ns) {
            Some(i) => i,
            None => {
                maps.push((ns, EngineMap::default()));
                maps.len() - 1
            }
        };
        &mut maps[i].1
    }

    fn add_owner(&mut self, ns: NsId, key: u64, slot: Slot) {
        let ns = ns as usize;
        if self.blocks.len() <= ns {
            self.blocks.resize_with(ns + 1, OwnerMap::default);
        }
        self.blocks[ns].add(key, slot);
        self.entries += 1;
    }

    fn remove_owner(&mut self, ns: NsId, key: u64, slot: Slot) {
        if let Some(blocks) = self.blocks.get_mut(ns as usize) {
            if blocks.remove(key, slot) {
                self.entries -= 1;
            }
        }
    }

    /// Applies a `BlockStored` event: chains each block's local hash onto its parent's key and
    /// records the worker as an owner. A parent the worker never reported starts a new chain.
    /// Returns the key of the last block (where a continuation would chain on).
    pub fn store(
        &mut self,
        slot: Slot,
        ns: NsId,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Option<u64> {
        let mut parent_key = parent.and_then(|p| self.worker_map(slot, ns).get(&p).copied());
        for block in blocks {
            let key = chain(parent_key, block.local);
            match self.worker_map(slot, ns).insert(block.engine_hash, key) {
                Some(old) if old == key => {} // a re-announcement: already owned
                Some(old) => {
                    self.remove_owner(ns, old, slot);
                    self.add_owner(ns, key, slot);
                }
                None => self.add_owner(ns, key, slot),
            }
            parent_key = Some(key);
        }
        parent_key
    }

    /// Applies a `BlockRemoved` event. Unknown engine hashes are ignored (the block may predate
    /// this router). Returns how many blocks were removed.
    pub fn remove(&mut self, slot: Slot, engine_hashes: &[u64]) -> usize {
        let Some(maps) = self.workers.get_mut(slot as usize) else {
            return 0;
        };
        let mut dropped = Vec::new();
        for hash in engine_hashes {
            for (ns, map) in maps.iter_mut() {
                if let Some(key) = map.remove(hash) {
                    dropped.push((*ns, key));
                    break;
                }
            }
        }
        for &(ns, key) in &dropped {
            self.remove_owner(ns, key, slot);
        }
        dropped.len()
    }

    /// Drops every block of a worker (`AllBlocksCleared`, leave, age-out). Returns how many.
    pub fn clear_worker(&mut self, slot: Slot) -> usize {
        let Some(maps) = self.workers.get_mut(slot as usize) else {
            return 0;
        };
        let maps = std::mem::take(maps);
        let mut count = 0;
        for (ns, map) in maps {
            for key in map.into_values() {
                self.remove_owner(ns, key, slot);
                count += 1;
            }
        }
        count
    }

    /// For each key of `keys` in order, calls `visit(position, owners)` until a key has no
    /// owners. Owners may repeat a slot (see [`Owners`]).
    pub fn walk(&self, ns: NsId, keys: &[u64], visit: impl FnMut(usize, &[Slot]) -> bool) {
        if let Some(blocks) = self.blocks.get(ns as usize) {
            blocks.walk(keys, visit);
        }
    }

    /// Whether `slot` owns `key` in `ns`.
    pub fn owns(&self, ns: NsId, key: u64, slot: Slot) -> bool {
        self.blocks
            .get(ns as usize)
            .and_then(|b| b.with_owners(key, |owners| owners.contains(&slot)))
            .unwrap_or(false)
    }

    /// Blocks a worker owns, per namespace.
    pub fn worker_blocks(&self, slot: Slot) -> impl Iterator<Item = (NsId, usize)> + '_ {
        self.workers
            .get(slot as usize)
            .into_iter()
            .flatten()
            .map(|(ns, map)| (*ns, map.len()))
    }

    /// Every (slot, namespace, key) ownership, for tests and audits.
    pub fn ownerships(&self) -> impl Iterator<Item = (Slot, NsId, u64)> + '_ {
        self.workers.iter().enumerate().flat_map(|(slot, maps)| {
            maps.iter()
                .flat_map(move |(ns, map)| map.values().map(move |&k| (slot as Slot, *ns, k)))
        })
    }

    pub fn stats(&self) -> IndexStats {
        IndexStats {
            blocks: self.blocks.iter().map(|b| b.len() as u64).sum(),
            entries: self.entries,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::chain_locals;

    fn blocks(locals: &[u64]) -> Vec<StoredBlock> {
        locals
            .iter()
            .map(|&l| StoredBlock {
                engine_hash: l + 1000,
                local: l,
            })
            .collect()
    }

    #[test]
    fn stored_chain_is_keyed_like_a_prompt() {
        let mut index = OwnerIndex::default();
        index.store(0, 0, None, &blocks(&[1, 2, 3]));
        for key in chain_locals([1, 2, 3]) {
            assert!(index.owns(0, key, 0), "event keys must equal prompt keys");
        }
        // A continuation names its parent by engine hash and extends the same chain.
        let last = index.store(0, 0, Some(1003), &blocks(&[4]));
        assert_eq!(last, Some(chain_locals([1, 2, 3, 4])[3]));
        assert_eq!(
            index.stats(),
            IndexStats {
                blocks: 4,
                entries: 4
            }
        );
    }

    #[test]
    fn unknown_parent_starts_a_new_chain() {
        let mut index = OwnerIndex::default();
        let last = index.store(0, 0, Some(42), &blocks(&[7]));
        assert_eq!(
            last,
            Some(7),
            "a block with an unknown parent is keyed as a chain start"
        );
    }

    #[test]
    fn removal_by_engine_hash_drops_only_that_owner() {
        let mut index = OwnerIndex::default();
        index.store(0, 0, None, &blocks(&[1, 2]));
        index.store(1, 0, None, &blocks(&[1, 2]));
        assert_eq!(index.remove(0, &[1002]), 1);
        let k = chain_locals([1, 2]);
        assert!(
            !index.owns(0, k[1], 0),
            "removed block is no longer owned by worker 0"
        );
        assert!(index.owns(0, k[1], 1), "worker 1 still owns its copy");
        assert_eq!(index.stats().entries, 3);
    }

    #[test]
    fn clearing_a_worker_leaves_no_trace() {
        let mut index = OwnerIndex::default();
        index.store(3, 0, None, &blocks(&[1, 2]));
        index.store(3, 1, None, &blocks(&[5]));
        assert_eq!(index.clear_worker(3), 3);
        assert_eq!(index.stats(), IndexStats::default());
        assert_eq!(index.ownerships().count(), 0);
    }
}
