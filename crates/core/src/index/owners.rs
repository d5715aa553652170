//! Authoritative ownership from KV events.

use std::ops::Range;

use super::key_table::{ahead, KeyTable};
use super::owner_map::OwnerMap;
use super::{NsId, Slot};
use crate::hashing::chained;
use crate::input::StoredBlock;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

/// One worker rank's blocks in one namespace: engine hash → block key. Removals name engine
/// hashes, which are opaque, so this map is how a removal finds the key it drops. A
/// [`KeyTable`], as the owner map is, so a stored or removed batch asks for its entries a few
/// blocks ahead (hashbrown cannot be asked) and churn leaves no tombstones; it is written as
/// the map it replaced.
#[derive(Debug, Default, Serialize, Deserialize)]
struct EngineMap {
    keys: KeyTable,
    /// Engine hashes stored more than once (two physical copies, or a publisher that reports
    /// every store again): the stores beyond the first, each needing its own removal. Kept
    /// apart so the common single store costs nothing extra.
    extra_stores: FxHashMap<u64, u32>,
}

clone_in_place!(EngineMap { keys, extra_stores });

impl EngineMap {
    /// Records one store of `engine_hash` with a known `key` by `slot`, owned in `owners` (its
    /// namespace's owner map). The same hash stored again under the same key counts one more
    /// store; under another key (the engine reused the hash for other content) the new content
    /// replaces the old. Returns the change in (block, owner) entries.
    ///
    /// Always inlined into a stored batch's loop, with the table inserts it makes (the tables'
    /// growth stays out of line): as calls, which even the whole-program build kept, they were
    /// three calls a block. Inlined, the peer bench applied 4% more events per second at 16
    /// workers and 11% more at 256, and at 1,024 0.94-0.97x kv-index's rate against 0.77-0.82x
    /// (docs/performance.md, thirty-fourth part).
    #[inline(always)]
    fn store(&mut self, owners: &mut OwnerMap, slot: Slot, engine_hash: u64, key: u64) -> i64 {
        match self.keys.insert(engine_hash, key) {
            Some(old) if old == key => {
                *self.extra_stores.entry(engine_hash).or_insert(0) += 1;
                0
            }
            Some(old) => {
                self.extra_stores.remove(&engine_hash);
                // Ends the old key's ownership; the router's records of it are not dropped, as
                // the engine never said it evicted that content.
                let ended = owners.remove(old, slot);
                owners.add(key, slot);
                1 - i64::from(ended)
            }
            None => {
                owners.add(key, slot);
                1
            }
        }
    }
}

/// A worker rank's engine maps, one per namespace it stored blocks in. The first lies in the
/// index's array of ranks itself, so a stored batch reaches its engine map's table with one load
/// fewer: a rank's list was an allocation of its own, a load that waited on memory before the
/// batch could ask for any of its table entries (docs/performance.md, thirty-fourth part). A rank
/// with blocks under several models keeps the others on the heap. Serialized as the list it is.
type RankMaps = SmallVec<[(NsId, EngineMap); 1]>;

/// Content key → owners per namespace, plus each worker rank's engine-hash map.
///
/// Invariant: `slot ∈ blocks[ns][key]` exactly as many times as `workers[slot]` maps an engine
/// hash of `ns` to `key`.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct OwnerIndex {
    /// Per namespace: block key → owner slots. A slot appears once per engine hash of that
    /// worker rank mapping to the block, so a rank that stored the same content under two engine
    /// hashes keeps owning it until both are removed.
    blocks: Vec<OwnerMap>,
    /// Per worker-rank slot: its blocks per namespace.
    workers: Vec<RankMaps>,
    /// Number of (block, owner) entries, i.e. the total length of all owner lists.
    entries: u64,
    /// The blocks the last [`remove`](Self::remove) ended, kept between calls so a removal
    /// allocates nothing once it has seen its largest batch.
    #[serde(skip)]
    ended: Vec<(NsId, u64)>,
}

impl Clone for OwnerIndex {
    fn clone(&self) -> Self {
        OwnerIndex {
            blocks: self.blocks.clone(),
            workers: self.workers.clone(),
            entries: self.entries,
            ended: Vec::new(),
        }
    }

    /// Writes over this index's tables where they have the source's size, so the snapshot's
    /// copy kept from the last snapshot is refreshed without new memory (see
    /// `RouterState::clone_from`). The removal scratch (`ended`) is not state.
    fn clone_from(&mut self, source: &Self) {
        let OwnerIndex {
            blocks,
            workers,
            entries,
            ended: _,
        } = source;
        self.blocks.clone_from(blocks);
        // Element by element: a tuple's `clone_from` would clone the engine map anew.
        self.workers.truncate(workers.len());
        let kept = self.workers.len();
        for (mine, theirs) in self.workers.iter_mut().zip(workers) {
            mine.truncate(theirs.len());
            let common = mine.len();
            for ((ns, map), (their_ns, their_map)) in mine.iter_mut().zip(theirs) {
                *ns = *their_ns;
                map.clone_from(their_map);
            }
            mine.extend(theirs[common..].iter().cloned());
        }
        self.workers.extend_from_slice(&workers[kept..]);
        self.entries = *entries;
    }
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
    /// The owner map of `ns` and the engine map of (`slot`, `ns`), each created if missing. A
    /// stored batch looks both up once, not once per block.
    fn maps_mut(&mut self, slot: Slot, ns: NsId) -> (&mut OwnerMap, &mut EngineMap) {
        if self.blocks.len() <= ns as usize {
            self.blocks.resize_with(ns as usize + 1, OwnerMap::default);
        }
        let slot = slot as usize;
        if self.workers.len() <= slot {
            self.workers.resize_with(slot + 1, RankMaps::new);
        }
        let maps = &mut self.workers[slot];
        let i = match maps.iter().position(|(n, _)| *n == ns) {
            Some(i) => i,
            None => {
                maps.push((ns, EngineMap::default()));
                maps.len() - 1
            }
        };
        (&mut self.blocks[ns as usize], &mut maps[i].1)
    }

    /// Records one store of `engine_hash` with a known `key` by `slot` and counts its entry.
    fn store_keyed(&mut self, slot: Slot, ns: NsId, engine_hash: u64, key: u64) {
        let (owners, map) = self.maps_mut(slot, ns);
        let added = map.store(owners, slot, engine_hash, key);
        self.entries = self.entries.wrapping_add_signed(added);
    }

    fn remove_owner(&mut self, ns: NsId, key: u64, slot: Slot) {
        if let Some(blocks) = self.blocks.get_mut(ns as usize) {
            if blocks.remove(key, slot) {
                self.entries -= 1;
            }
        }
    }

    /// The block key `slot` stored under `engine_hash` in `ns`, if any.
    pub fn key_of(&self, slot: Slot, ns: NsId, engine_hash: u64) -> Option<u64> {
        self.engine_map(slot, ns)?.keys.get(engine_hash)
    }

    /// Asks the CPU to start loading the first entries a stored batch reads in `slot`'s engine
    /// map: its parent's (the batch's keys chain on the parent's key, so that lookup comes
    /// before anything else) and its first blocks'. Called before the parent is looked up, the
    /// parent's cache miss overlaps the blocks' instead of coming before them. A hint: it
    /// changes nothing. ([`store`](Self::store) asks for the first blocks again, so it stands
    /// alone; a second hint for a line already on its way costs next to nothing.)
    pub fn prefetch_store(
        &self,
        slot: Slot,
        ns: NsId,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) {
        let Some(map) = self.engine_map(slot, ns) else {
            return;
        };
        if let Some(parent) = parent {
            map.keys.prefetch(parent);
        }
        for block in ahead(blocks, 0) {
            map.keys.prefetch(block.engine_hash);
        }
    }

    /// Applies a `BlockStored` event whose parent block has key `parent_key` (None: the blocks
    /// start a chain): chains each block's local hash onto its parent's key and records the
    /// worker rank as an owner. An engine hash stored again under the same key counts one more
    /// store, which needs one more removal. Returns the key of the last block (where a
    /// continuation would chain on).
    pub fn store(
        &mut self,
        slot: Slot,
        ns: NsId,
        parent_key: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Option<u64> {
        if blocks.is_empty() {
            return parent_key;
        }
        // Each key chains on the one before it, so they are computed first: the owner table
        // then starts loading a block's entry a few blocks ahead of its insert, and a batch's
        // cache misses overlap instead of waiting one behind the other.
        let keys: SmallVec<[u64; 64]> =
            chained(parent_key, blocks.iter().map(|block| block.local)).collect();
        let (owners, map) = self.maps_mut(slot, ns);
        let mut added = 0;
        for (i, (block, &key)) in blocks.iter().zip(&keys).enumerate() {
            for &next in ahead(&keys, i) {
                owners.prefetch(next);
            }
            for next in ahead(blocks, i) {
                map.keys.prefetch(next.engine_hash);
            }
            added += map.store(owners, slot, block.engine_hash, key);
        }
        self.entries = self.entries.wrapping_add_signed(added);
        keys.last().copied()
    }

    fn engine_map(&self, slot: Slot, ns: NsId) -> Option<&EngineMap> {
        let maps = self.workers.get(slot as usize)?;
        maps.iter().find(|(n, _)| *n == ns).map(|(_, map)| map)
    }

    fn prefetch_run(&self, ns: NsId, key: u64) {
        if let Some(blocks) = self.blocks.get(ns as usize) {
            blocks.prefetch_run(key);
        }
    }

    /// Applies a `BlockRemoved` event. Unknown engine hashes are ignored (the block may predate
    /// this router); a hash stored more than once loses one store. Returns the (namespace, key)
    /// of every block whose ownership by `slot` ended.
    pub fn remove(&mut self, slot: Slot, engine_hashes: &[u64]) -> &[(NsId, u64)] {
        // The list is the index's own, out of it while the index changes.
        let mut ended = std::mem::take(&mut self.ended);
        ended.clear();
        if let Some(maps) = self.workers.get_mut(slot as usize) {
            // Room for every hash at once: grown block by block, it was reallocated several
            // times per batch (8% of a removal's time in the peer bench at 16 workers).
            ended.reserve(engine_hashes.len());
            for (i, hash) in engine_hashes.iter().enumerate() {
                // As in `store`: the engine maps' entries are asked for a few hashes ahead.
                for &next in ahead(engine_hashes, i) {
                    for (_, map) in maps.iter() {
                        map.keys.prefetch_run(next);
                    }
                }
                for (ns, map) in maps.iter_mut() {
                    if let Some(extra) = map.extra_stores.get_mut(hash) {
                        *extra -= 1;
                        if *extra == 0 {
                            map.extra_stores.remove(hash);
                        }
                        break;
                    }
                    if let Some(key) = map.keys.remove(*hash) {
                        ended.push((*ns, key));
                        break;
                    }
                }
            }
        }
        // As in `store`: the owner table's entries are asked for a few blocks ahead.
        for (i, &(ns, key)) in ended.iter().enumerate() {
            for &(ns, next) in ahead(&ended, i) {
                self.prefetch_run(ns, next);
            }
            self.remove_owner(ns, key, slot);
        }
        self.ended = ended;
        &self.ended
    }

    /// Drops every block of a worker rank (`AllBlocksCleared`, a new epoch, join, leave,
    /// age-out). Returns how many.
    pub fn clear_worker(&mut self, slot: Slot) -> usize {
        let Some(maps) = self.workers.get_mut(slot as usize) else {
            return 0;
        };
        let maps = std::mem::take(maps);
        let mut count = 0;
        for (ns, map) in maps {
            for (_, key) in map.keys.iter() {
                self.remove_owner(ns, key, slot);
                count += 1;
            }
        }
        count
    }

    /// Drops the (empty) per-slot tables of slots at or above `slots`, the worker table's new
    /// length, so they shrink with it after a churn of workers.
    pub fn truncate_slots(&mut self, slots: usize) {
        debug_assert!(self.workers.iter().skip(slots).all(RankMaps::is_empty));
        if self.workers.len() > slots {
            self.workers.truncate(slots);
            if self.workers.capacity() > 2 * slots + 16 {
                self.workers.shrink_to_fit();
            }
        }
    }

    /// Moves every block `slot` holds in namespace `from` to namespace `to` (keys do not depend
    /// on the namespace). Returns how many blocks moved.
    pub fn move_namespace(&mut self, slot: Slot, from: NsId, to: NsId) -> usize {
        if from == to {
            return 0;
        }
        let Some(maps) = self.workers.get_mut(slot as usize) else {
            return 0;
        };
        let Some(i) = maps.iter().position(|(n, _)| *n == from) else {
            return 0;
        };
        let (_, moved) = maps.swap_remove(i);
        let count = moved.keys.len();
        for (hash, key) in moved.keys.iter() {
            self.remove_owner(from, key, slot);
            let stores = 1 + moved.extra_stores.get(&hash).copied().unwrap_or(0);
            for _ in 0..stores {
                self.store_keyed(slot, to, hash, key);
            }
        }
        count
    }

    /// Walks `keys` in order until a key has no owners or `visit` returns false, calling
    /// `visit(positions, owners)` with owners that hold every key of `positions`: a key alone,
    /// or the rest of a run of keys with the same owners; [`extend_match`](super::extend_match)
    /// counts each owner's match from them. Owners may repeat a slot (one entry per engine hash
    /// of a worker that maps to the block). The keys may be produced as the walk goes: it draws
    /// them a few ahead of the one it reads, so a caller may chain a prompt's keys as it goes.
    pub fn walk(
        &self,
        ns: NsId,
        keys: impl IntoIterator<Item = u64>,
        visit: impl FnMut(Range<usize>, &[Slot]) -> bool,
    ) {
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
            .map(|(ns, map)| (*ns, map.keys.len()))
    }

    /// Every (slot, namespace, key) ownership, for tests and audits.
    pub fn ownerships(&self) -> impl Iterator<Item = (Slot, NsId, u64)> + '_ {
        self.workers.iter().enumerate().flat_map(|(slot, maps)| {
            maps.iter().flat_map(move |(ns, map)| {
                map.keys.iter().map(move |(_, k)| (slot as Slot, *ns, k))
            })
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
    fn an_index_serializes_as_it_did_with_a_list_per_rank_on_the_heap() {
        // The form snapshots were written in before a rank's first engine map moved inline.
        #[derive(Serialize)]
        struct Before<'a> {
            blocks: &'a Vec<OwnerMap>,
            workers: Vec<Vec<(NsId, &'a EngineMap)>>,
            entries: u64,
        }
        let mut index = OwnerIndex::default();
        index.store(0, 0, None, &blocks(&[1, 2, 3]));
        index.store(2, 0, None, &blocks(&[1, 4]));
        // A rank with blocks under two namespaces: its second map is past the inline one.
        index.store(2, 1, None, &blocks(&[5]));
        let before = Before {
            blocks: &index.blocks,
            workers: index
                .workers
                .iter()
                .map(|maps| maps.iter().map(|(ns, map)| (*ns, map)).collect())
                .collect(),
            entries: index.entries,
        };
        let bytes = rmp_serde::to_vec(&index).unwrap();
        assert_eq!(
            bytes,
            rmp_serde::to_vec(&before).unwrap(),
            "the index's bytes are those of its former layout, so earlier snapshots load"
        );
        let loaded: OwnerIndex = rmp_serde::from_slice(&bytes).unwrap();
        let mut theirs: Vec<_> = loaded.ownerships().collect();
        let mut ours: Vec<_> = index.ownerships().collect();
        theirs.sort_unstable();
        ours.sort_unstable();
        assert_eq!(
            theirs, ours,
            "a loaded index holds every ownership it was saved with"
        );
        assert_eq!(
            ours.len(),
            6,
            "the test saves every ownership it stored: three blocks of rank 0, three of rank 2"
        );
    }

    #[test]
    fn stored_chain_is_keyed_like_a_prompt() {
        let mut index = OwnerIndex::default();
        index.store(0, 0, None, &blocks(&[1, 2, 3]));
        for key in chain_locals([1, 2, 3]) {
            assert!(index.owns(0, key, 0), "event keys must equal prompt keys");
        }
        // A continuation names its parent by engine hash and extends the same chain.
        let parent = index.key_of(0, 0, 1003);
        let last = index.store(0, 0, parent, &blocks(&[4]));
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
        let last = index.store(0, 0, index.key_of(0, 0, 42), &blocks(&[7]));
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
        assert_eq!(index.remove(0, &[1002]), vec![(0, chain_locals([1, 2])[1])]);
        let k = chain_locals([1, 2]);
        assert!(
            !index.owns(0, k[1], 0),
            "removed block is no longer owned by worker 0"
        );
        assert!(index.owns(0, k[1], 1), "worker 1 still owns its copy");
        assert_eq!(index.stats().entries, 3);
    }

    #[test]
    fn a_removal_reports_only_the_blocks_it_ended() {
        let mut index = OwnerIndex::default();
        index.store(0, 0, None, &blocks(&[1, 2, 3]));
        let k = chain_locals([1, 2, 3]);
        assert_eq!(index.remove(0, &[1003, 1002]), vec![(0, k[2]), (0, k[1])]);
        assert!(
            index.remove(0, &[1003, 4242]).is_empty(),
            "a removal of hashes no longer held ends nothing, whatever the last one ended"
        );
        assert!(
            index.remove(7, &[1001]).is_empty(),
            "a removal by an unknown rank ends nothing"
        );
        assert_eq!(index.remove(0, &[1001]), vec![(0, k[0])]);
        assert_eq!(index.stats(), IndexStats::default());
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

    #[test]
    fn a_block_stored_twice_needs_two_removals() {
        let mut index = OwnerIndex::default();
        index.store(0, 0, None, &blocks(&[1]));
        index.store(0, 0, None, &blocks(&[1]));
        let key = chain_locals([1])[0];
        assert!(
            index.remove(0, &[1001]).is_empty(),
            "the first removal of a twice-stored block ends no ownership"
        );
        assert!(index.owns(0, key, 0), "one store is still held");
        assert_eq!(index.remove(0, &[1001]), vec![(0, key)]);
        assert!(!index.owns(0, key, 0), "the second removal ends ownership");
        assert_eq!(index.stats(), IndexStats::default());
    }

    #[test]
    fn an_engine_hash_stored_again_for_other_content_moves_its_one_entry() {
        let mut index = OwnerIndex::default();
        index.store(0, 0, None, &blocks(&[1]));
        // The engine reuses hash 1001 for other content: the new key replaces the old one.
        let reused = [StoredBlock {
            engine_hash: 1001,
            local: 9,
        }];
        index.store(0, 0, None, &reused);
        let (old, new) = (chain_locals([1])[0], chain_locals([9])[0]);
        assert!(
            !index.owns(0, old, 0),
            "the replaced content is no longer owned"
        );
        assert!(index.owns(0, new, 0), "the new content is owned");
        assert_eq!(
            index.stats(),
            IndexStats {
                blocks: 1,
                entries: 1
            },
            "a replacement moves the rank's one entry, it does not add one"
        );
        assert_eq!(index.remove(0, &[1001]), vec![(0, new)]);
        assert_eq!(index.stats(), IndexStats::default());
    }

    #[test]
    fn moving_a_namespace_keeps_keys_and_store_counts() {
        let mut index = OwnerIndex::default();
        index.store(0, 0, None, &blocks(&[1, 2]));
        index.store(0, 0, None, &blocks(&[1]));
        assert_eq!(index.move_namespace(0, 0, 5), 2);
        let k = chain_locals([1, 2]);
        assert!(
            !index.owns(0, k[0], 0),
            "nothing stays in the old namespace"
        );
        assert!(index.owns(5, k[0], 0) && index.owns(5, k[1], 0));
        assert!(
            index.remove(0, &[1001]).is_empty(),
            "the second store moved with the block"
        );
        assert_eq!(index.remove(0, &[1001]), vec![(5, k[0])]);
    }
}
