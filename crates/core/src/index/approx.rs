//! Approximate ownership: the router's own recent routing records.
//!
//! When the router sends a request to a worker, that worker will hold the request's blocks
//! shortly, but its KV events arrive later. Recording the decision lets the next turn of the same
//! trajectory find its owner in the meantime. Records expire after `approx_ttl` and the total
//! number is bounded, oldest first.
//!
//! Every route walks these records block by block and writes one per block, so they live in the
//! same prefetching, tombstone-free [`KeyTable`] as the owner map: a block's one record packed
//! into the table's value, more than one in an overflow slab.

use std::collections::VecDeque;
use std::fmt;

use rustc_hash::FxHashMap;
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use smallvec::{smallvec, SmallVec};

use super::key_table::{ahead, KeyTable, PREFETCH_AHEAD};
use super::slab::Slab;
use super::{NsId, Slot};

/// (slot, expiry in ms) for each worker recorded on a block.
type Records = SmallVec<[(Slot, u64); 1]>;

/// A table value: one record as `slot << 48 | expiry`, or [`OVERFLOW`] with a slab index in the
/// low 48 bits. A slot at or above [`OVERFLOW`]'s 16 bits, or an expiry of 2^48 ms or more,
/// always goes to the slab.
const OVERFLOW: u64 = 0xFFFF << 48;
const LOW_48: u64 = (1 << 48) - 1;

enum Packed {
    One(Slot, u64),
    Slab(usize),
}

fn pack(slot: Slot, expires_ms: u64) -> Option<u64> {
    ((slot as u64) < (OVERFLOW >> 48) && expires_ms <= LOW_48)
        .then_some((slot as u64) << 48 | expires_ms)
}

fn unpack(value: u64) -> Packed {
    if value & OVERFLOW == OVERFLOW {
        Packed::Slab((value & LOW_48) as usize)
    } else {
        Packed::One((value >> 48) as Slot, value & LOW_48)
    }
}

/// One namespace's records: block key → (slot, expiry) per worker recorded on it.
#[derive(Default)]
struct ApproxMap {
    table: KeyTable,
    /// Records of blocks with more than one (or one that does not pack).
    slab: Slab<Records>,
}

/// The table value for `records`: packed if it is one record that packs, else a slab entry.
fn value_of(slab: &mut Slab<Records>, records: Records) -> u64 {
    match records.as_slice() {
        &[(slot, exp)] => pack(slot, exp).unwrap_or_else(|| OVERFLOW | slab.put(records) as u64),
        _ => OVERFLOW | slab.put(records) as u64,
    }
}

/// The value [`ApproxMap::upsert`] inserts for a new key before filling it in: a slab index no
/// slab reaches.
const NEW: u64 = u64::MAX;

clone_in_place!(ApproxMap { table, slab });

impl ApproxMap {
    fn with_records<R>(&self, value: u64, f: impl FnOnce(&[(Slot, u64)]) -> R) -> R {
        match unpack(value) {
            Packed::One(slot, exp) => f(&[(slot, exp)]),
            Packed::Slab(at) => f(&self.slab[at]),
        }
    }

    /// Records `slot` on `key` until `expires_ms`, replacing the slot's earlier expiry. One
    /// probe of the table. True when the record is new, false when it was refreshed.
    fn upsert(&mut self, key: u64, slot: Slot, expires_ms: u64) -> bool {
        let ApproxMap { table, slab } = self;
        let value = table.get_or_insert(key, NEW);
        let (packed, new) = match unpack(*value) {
            _ if *value == NEW => (value_of(slab, smallvec![(slot, expires_ms)]), true),
            Packed::One(s, _) if s == slot => {
                (value_of(slab, smallvec![(slot, expires_ms)]), false)
            }
            Packed::One(s, exp) => (
                value_of(slab, smallvec![(s, exp), (slot, expires_ms)]),
                true,
            ),
            Packed::Slab(at) => {
                // The table value (the slab index) stays; the records change in place.
                let records = &mut slab[at];
                return match records.iter_mut().find(|(s, _)| *s == slot) {
                    Some(record) => {
                        record.1 = expires_ms;
                        false
                    }
                    None => {
                        records.push((slot, expires_ms));
                        true
                    }
                };
            }
        };
        *value = packed;
        new
    }

    /// Removes the records of `key` that `drop` selects.
    fn remove_where(&mut self, key: u64, mut drop: impl FnMut(Slot, u64) -> bool) {
        let Some(value) = self.table.get(key) else {
            return;
        };
        match unpack(value) {
            Packed::One(slot, exp) => {
                if drop(slot, exp) {
                    self.table.remove(key);
                }
            }
            Packed::Slab(at) => {
                let records = &mut self.slab[at];
                records.retain(|&mut (s, e)| !drop(s, e));
                match records.as_slice() {
                    [] => self.table.remove(key),
                    &[(slot, exp)] => match pack(slot, exp) {
                        Some(value) => self.table.insert(key, value),
                        None => return, // one record that does not pack stays in the slab
                    },
                    _ => return, // still more than one record
                };
                self.slab.release(at);
            }
        }
    }

    fn records(&self) -> impl Iterator<Item = (u64, Records)> + '_ {
        self.table
            .iter()
            .map(|(key, value)| (key, self.with_records(value, Records::from_slice)))
    }
}

impl fmt::Debug for ApproxMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.records()).finish()
    }
}

/// Serialized as the `FxHashMap<u64, Records>` it replaced, so snapshots written before it
/// still load.
impl Serialize for ApproxMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.table.len()))?;
        for (key, value) in self.table.iter() {
            self.with_records(value, |records| map.serialize_entry(&key, records))?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for ApproxMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let wire = FxHashMap::<u64, Records>::deserialize(deserializer)?;
        let mut map = ApproxMap::default();
        // Sized once for the records read (as the owner map's table is).
        map.table.reserve(wire.len());
        for (key, records) in wire {
            if !records.is_empty() {
                let value = value_of(&mut map.slab, records);
                map.table.insert(key, value);
            }
        }
        Ok(map)
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ApproxIndex {
    blocks: Vec<ApproxMap>,
    /// One entry per record, in the order records were made, with the expiry each was queued
    /// with. A refresh queues nothing: the prompts that come back (a system prompt, a
    /// conversation's next turn) rewrite their records' expiries in the table only, so the
    /// queue holds records, not writes, and the size bound counts records. When an entry comes
    /// to the front, its record is dropped if it still has that expiry (or an earlier one), and
    /// queued again at the back with its new expiry if it was refreshed since.
    ///
    /// A requeued entry can sit behind entries that expire later, so an expired record may
    /// stay in the table until the queue reaches it (at most one `approx_ttl` later); a walk
    /// never counts it, as it counts only records still fresh.
    queue: VecDeque<(u64, NsId, u64, Slot)>,
    max_records: usize,
}

clone_in_place!(ApproxIndex {
    blocks,
    queue,
    max_records
});

impl ApproxIndex {
    pub fn new(max_records: usize) -> Self {
        ApproxIndex {
            blocks: Vec::new(),
            queue: VecDeque::new(),
            max_records: max_records.max(1),
        }
    }

    pub fn set_max_records(&mut self, max_records: usize) {
        self.max_records = max_records.max(1);
    }

    /// Records that `slot` will hold every key of `keys` until `expires_ms`.
    pub fn record(&mut self, ns: NsId, keys: &[u64], slot: Slot, expires_ms: u64) {
        let ns_idx = ns as usize;
        if self.blocks.len() <= ns_idx {
            self.blocks.resize_with(ns_idx + 1, ApproxMap::default);
        }
        let blocks = &mut self.blocks[ns_idx];
        // Each key is a random bucket of a table that outgrows the caches (the default bound is
        // millions of records), so its entry is asked for a few keys ahead of its upsert, as a
        // stored batch's are: the misses of a long prompt overlap instead of queueing.
        for (i, &key) in keys.iter().enumerate() {
            for &next in ahead(keys, i) {
                blocks.table.prefetch(next);
            }
            if blocks.upsert(key, slot, expires_ms) {
                self.queue.push_back((expires_ms, ns, key, slot));
            }
        }
        // A run of refreshed records at the front would each go to the back first (after an
        // upgrade, a snapshot's queue holds millions of stale entries), so one call sends back
        // at most as many as it has keys; past that, the front record goes whatever its expiry.
        // A route's work under the lock stays in proportion to its prompt.
        self.pop_front_while(keys.len(), |index| index.queue.len() > index.max_records);
    }

    /// Drops the records that expired at or before `now_ms`, as their entries reach the front
    /// (one behind a requeued entry waits for it; see `queue`).
    pub fn expire(&mut self, now_ms: u64) {
        // No bound on requeues: every refreshed record goes back under its new expiry.
        self.pop_front_while(usize::MAX, |index| {
            index.queue.front().is_some_and(|&(exp, ..)| exp <= now_ms)
        });
    }

    /// Pops front entries ([`pop_front`](Self::pop_front)) while `more` holds, letting at most
    /// `requeues` of them go to the back. The front records are as random as a route's keys, so
    /// their table entries are asked for ahead of their removal: the first few before the pops
    /// start (only when some will: under the bound a route drops nothing), then each pop the one
    /// that far past the front.
    fn pop_front_while(&mut self, mut requeues: usize, more: impl Fn(&Self) -> bool) {
        if more(self) {
            for at in 0..PREFETCH_AHEAD {
                self.prefetch_queued(at);
            }
        }
        while more(self) {
            self.prefetch_queued(PREFETCH_AHEAD);
            if self.pop_front(requeues > 0) {
                requeues -= 1;
            }
        }
    }

    /// Asks for the table entry of the queue's record `at` places from the front, if any.
    fn prefetch_queued(&self, at: usize) {
        if let Some(&(_, ns, key, _)) = self.queue.get(at) {
            self.blocks[ns as usize].table.prefetch_run(key);
        }
    }

    /// Takes the front entry and drops its record, unless `requeue` and the record was
    /// refreshed to a later expiry since it was queued: then it goes to the back under that
    /// expiry (each refresh requeues at most once). Returns whether it went to the back.
    fn pop_front(&mut self, requeue: bool) -> bool {
        let Some((queued, ns, key, slot)) = self.queue.pop_front() else {
            return false;
        };
        // A record forgotten since (the worker removed the block) leaves nothing to do.
        let mut refreshed = None;
        self.blocks[ns as usize].remove_where(key, |s, exp| {
            let keep = s == slot && requeue && exp > queued;
            if keep {
                refreshed = Some(exp);
            }
            s == slot && !keep
        });
        if let Some(exp) = refreshed {
            self.queue.push_back((exp, ns, key, slot));
        }
        refreshed.is_some()
    }

    /// Drops every record of a worker (it left or aged out).
    pub fn forget_worker(&mut self, slot: Slot) {
        for blocks in &mut self.blocks {
            let keys: Vec<u64> = blocks
                .records()
                .filter(|(_, records)| records.iter().any(|&(s, _)| s == slot))
                .map(|(key, _)| key)
                .collect();
            for key in keys {
                blocks.remove_where(key, |s, _| s == slot);
            }
        }
        self.queue.retain(|&(.., s)| s != slot);
    }

    /// Drops `slot`'s records of `keys` in `ns` (the worker said it no longer holds them).
    pub fn forget_blocks(&mut self, ns: NsId, keys: impl IntoIterator<Item = u64>, slot: Slot) {
        let Some(blocks) = self.blocks.get_mut(ns as usize) else {
            return;
        };
        for key in keys {
            blocks.remove_where(key, |s, _| s == slot);
        }
    }

    /// Like [`super::OwnerIndex::walk`], over records that are still fresh at `now_ms`.
    pub fn walk(
        &self,
        ns: NsId,
        keys: &[u64],
        now_ms: u64,
        mut visit: impl FnMut(usize, &mut dyn Iterator<Item = Slot>) -> bool,
    ) {
        let Some(blocks) = self.blocks.get(ns as usize) else {
            return;
        };
        blocks.table.walk(keys.iter().copied(), |i, value| {
            blocks.with_records(value, |records| {
                let mut fresh = records
                    .iter()
                    .filter(|&&(_, exp)| exp > now_ms)
                    .map(|&(s, _)| s);
                visit(i, &mut fresh)
            })
        });
    }

    /// Number of live records.
    pub fn len(&self) -> usize {
        self.blocks
            .iter()
            .flat_map(ApproxMap::records)
            .map(|(_, records)| records.len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.iter().all(|b| b.table.len() == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fresh_owners(index: &ApproxIndex, key: u64, now: u64) -> Vec<Slot> {
        let mut out = Vec::new();
        index.walk(0, &[key], now, |_, it| {
            out.extend(it);
            true
        });
        out
    }

    #[test]
    fn records_expire_after_their_ttl() {
        let mut index = ApproxIndex::new(100);
        index.record(0, &[1, 2], 7, 1_000);
        assert_eq!(
            fresh_owners(&index, 1, 999),
            vec![7],
            "record is fresh before expiry"
        );
        assert!(
            fresh_owners(&index, 1, 1_000).is_empty(),
            "record is stale at expiry"
        );
        index.expire(1_000);
        assert!(index.is_empty(), "expired records are dropped");
    }

    #[test]
    fn refreshed_record_outlives_its_first_expiry() {
        let mut index = ApproxIndex::new(100);
        index.record(0, &[1], 7, 1_000);
        index.record(0, &[1], 7, 2_000);
        index.expire(1_500);
        assert_eq!(
            fresh_owners(&index, 1, 1_500),
            vec![7],
            "refresh extends the record"
        );
    }

    #[test]
    fn record_count_is_bounded_oldest_first() {
        let mut index = ApproxIndex::new(3);
        index.record(0, &[1, 2, 3, 4], 0, 1_000);
        assert_eq!(index.len(), 3, "never more records than the bound");
        assert!(
            fresh_owners(&index, 1, 0).is_empty(),
            "the oldest record went first"
        );
        assert_eq!(fresh_owners(&index, 4, 0), vec![0]);
    }

    #[test]
    fn refreshed_records_do_not_count_against_the_bound_twice() {
        let mut index = ApproxIndex::new(3);
        index.record(0, &[1, 2, 3], 7, 1_000);
        for turn in 1..=10 {
            index.record(0, &[1], 7, 1_000 + 10 * turn);
        }
        assert_eq!(
            index.len(),
            3,
            "three records fit a bound of three, however often one of them is refreshed"
        );
        assert_eq!(index.queue.len(), 3, "the queue holds one entry per record");
        index.record(0, &[4], 7, 2_000);
        assert!(
            fresh_owners(&index, 2, 0).is_empty(),
            "a fourth record drops the oldest one not refreshed since it was made"
        );
        for key in [1, 3, 4] {
            assert_eq!(fresh_owners(&index, key, 999), vec![7], "key {key} is kept");
        }
        index.expire(1_050);
        assert_eq!(
            fresh_owners(&index, 1, 1_050),
            vec![7],
            "a refreshed record outlives the expiry it was queued with"
        );
        index.expire(2_000);
        assert!(
            index.is_empty(),
            "and every record expires at its last expiry"
        );
        assert!(index.queue.is_empty(), "leaving no queue entry behind");
    }

    #[test]
    fn one_record_call_sends_back_no_more_refreshed_records_than_it_has_keys() {
        let mut index = ApproxIndex::new(4);
        index.record(0, &[1, 2, 3, 4], 7, 1_000);
        index.record(0, &[1, 2, 3, 4], 7, 2_000);
        index.record(0, &[5], 7, 2_000);
        assert_eq!(index.len(), 4, "the bound holds");
        assert!(
            fresh_owners(&index, 2, 0).is_empty(),
            "after one record sent back (key 1), the next goes though refreshed"
        );
        for key in [1, 3, 4, 5] {
            assert_eq!(fresh_owners(&index, key, 0), vec![7], "key {key} is kept");
        }
    }

    #[test]
    fn records_of_several_workers_share_a_block_and_shrink_back() {
        let mut index = ApproxIndex::new(100);
        index.record(0, &[1], 7, 1_000);
        index.record(0, &[1], 8, 2_000);
        index.record(0, &[1], 9, 3_000);
        let mut owners = fresh_owners(&index, 1, 0);
        owners.sort();
        assert_eq!(
            owners,
            vec![7, 8, 9],
            "every worker recorded on a block is found"
        );
        index.expire(2_000);
        assert_eq!(
            fresh_owners(&index, 1, 0),
            vec![9],
            "expired records leave, one by one"
        );
        assert_eq!(
            index.blocks[0]
                .table
                .get(1)
                .map(|v| matches!(unpack(v), Packed::One(9, 3_000))),
            Some(true),
            "a block left with one record packs it inline again"
        );
        index.record(0, &[1, 2], 8, 4_000);
        index.forget_blocks(0, [2], 8);
        assert!(
            fresh_owners(&index, 2, 0).is_empty(),
            "a forgotten block of a worker leaves no record"
        );
        index.record(0, &[2], 8, 4_000);
        index.forget_worker(9);
        assert_eq!(
            fresh_owners(&index, 1, 0),
            vec![8],
            "a forgotten worker leaves no record"
        );
        assert_eq!(index.len(), 2);
    }

    #[test]
    fn a_slot_or_expiry_too_large_to_pack_is_kept_whole() {
        let mut index = ApproxIndex::new(100);
        let (big_slot, far) = (0x1_0000, 1u64 << 50);
        index.record(0, &[1], big_slot, far);
        assert_eq!(fresh_owners(&index, 1, far - 1), vec![big_slot]);
        assert!(
            fresh_owners(&index, 1, far).is_empty(),
            "expiry kept to the ms"
        );
        index.expire(far);
        assert!(index.is_empty(), "and it expires like any other");
    }

    #[test]
    fn snapshots_keep_the_form_written_before_the_table() {
        let mut index = ApproxIndex::new(100);
        index.record(0, &[1, 2], 7, 1_000);
        index.record(0, &[2], 8, 2_000);
        let bytes = rmp_serde::to_vec(&index.blocks[0]).unwrap();
        let mut wire: FxHashMap<u64, Records> = rmp_serde::from_slice(&bytes).unwrap();
        for records in wire.values_mut() {
            records.sort();
        }
        let expected: FxHashMap<u64, Records> = [
            (1, smallvec![(7, 1_000)]),
            (2, smallvec![(7, 1_000), (8, 2_000)]),
        ]
        .into_iter()
        .collect();
        assert_eq!(wire, expected, "the snapshot form is unchanged");
        let back: ApproxMap =
            rmp_serde::from_slice(&rmp_serde::to_vec(&expected).unwrap()).unwrap();
        let mut records: Vec<_> = back.records().collect();
        records.sort();
        let mut expected: Vec<_> = expected.into_iter().collect();
        expected.sort();
        assert_eq!(records, expected, "an old snapshot loads the same records");
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Keys (from a small pool), a slot (some too large to pack), a TTL.
        Record(Vec<u64>, Slot, u64),
        Expire(u64),
        Forget(Slot),
    }

    fn op() -> impl Strategy<Value = Op> {
        let slot = prop_oneof![0u32..4, Just(0x1_0000u32)];
        prop_oneof![
            4 => (prop::collection::vec(0u64..6, 1..4), slot.clone(), 1u64..50)
                .prop_map(|(keys, slot, ttl)| Op::Record(keys, slot, ttl)),
            2 => (0u64..20).prop_map(Op::Expire),
            1 => slot.prop_map(Op::Forget),
        ]
    }

    /// The records as a plain map, with the queue rules of [`ApproxIndex`] spelled out.
    #[derive(Default)]
    struct Model {
        current: std::collections::BTreeMap<(u64, Slot), u64>,
        queue: VecDeque<(u64, u64, Slot)>,
    }

    impl Model {
        fn record(&mut self, key: u64, slot: Slot, exp: u64) {
            // Only a new record is queued; a refresh changes its expiry alone.
            if self.current.insert((key, slot), exp).is_none() {
                self.queue.push_back((exp, key, slot));
            }
        }

        /// Pops the front entry; true if it went to the back.
        fn pop(&mut self, requeue: bool) -> bool {
            let Some((queued, key, slot)) = self.queue.pop_front() else {
                return false;
            };
            // A pop drops the record unless it may requeue and the record was refreshed to a
            // later expiry since it was queued; then it is queued again under that expiry.
            match self.current.get(&(key, slot)) {
                Some(&exp) if requeue && exp > queued => {
                    self.queue.push_back((exp, key, slot));
                    true
                }
                Some(_) => {
                    self.current.remove(&(key, slot));
                    false
                }
                None => false,
            }
        }
    }

    proptest! {
        /// The table with its packed records and slab against a plain map of records, through
        /// records, refreshes, expiry, the size bound and forgotten workers.
        #[test]
        fn fresh_owners_match_a_plain_model(ops in prop::collection::vec(op(), 0..80)) {
            let mut index = ApproxIndex::new(12);
            let mut model = Model::default();
            let mut now = 0;
            for op in ops {
                match op {
                    Op::Record(keys, slot, ttl) => {
                        index.record(0, &keys, slot, now + ttl);
                        // One call sends back at most as many refreshed records as it has keys.
                        let mut requeues = keys.len();
                        for key in keys {
                            model.record(key, slot, now + ttl);
                        }
                        while model.queue.len() > 12 {
                            if model.pop(requeues > 0) {
                                requeues -= 1;
                            }
                        }
                    }
                    Op::Expire(step) => {
                        now += step;
                        index.expire(now);
                        while model.queue.front().is_some_and(|&(exp, ..)| exp <= now) {
                            model.pop(true);
                        }
                    }
                    Op::Forget(slot) => {
                        index.forget_worker(slot);
                        model.current.retain(|&(_, s), _| s != slot);
                        model.queue.retain(|&(.., s)| s != slot);
                    }
                }
                for key in 0..6 {
                    let mut got = fresh_owners(&index, key, now);
                    got.sort();
                    let want: Vec<Slot> = model
                        .current
                        .iter()
                        .filter(|&(&(k, _), &exp)| k == key && exp > now)
                        .map(|(&(_, s), _)| s)
                        .collect();
                    prop_assert_eq!(got, want, "fresh owners of key {}", key);
                }
                prop_assert_eq!(index.len(), model.current.len(), "live records");
            }
        }
    }
}
