//! Approximate ownership: the router's own recent routing records.
//!
//! When the router sends a request to a worker, that worker will hold the request's blocks
//! shortly, but its KV events arrive later. Recording the decision lets the next turn of the same
//! trajectory find its owner in the meantime. Records expire after `approx_ttl` and the total
//! number is bounded, oldest first.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use super::{NsId, Slot};

/// (slot, expiry in ms) for each worker recorded on a block.
type Records = SmallVec<[(Slot, u64); 1]>;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApproxIndex {
    blocks: Vec<FxHashMap<u64, Records>>,
    /// Every record in the order written, with the expiry it was written with. Because the TTL
    /// is fixed, this is also expiry order; a refreshed record leaves a stale queue entry that is
    /// skipped when popped.
    queue: VecDeque<(u64, NsId, u64, Slot)>,
    max_records: usize,
}

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
            self.blocks.resize_with(ns_idx + 1, FxHashMap::default);
        }
        let blocks = &mut self.blocks[ns_idx];
        for &key in keys {
            let records = blocks.entry(key).or_default();
            match records.iter_mut().find(|(s, _)| *s == slot) {
                Some(record) => record.1 = expires_ms,
                None => records.push((slot, expires_ms)),
            }
            self.queue.push_back((expires_ms, ns, key, slot));
        }
        while self.queue.len() > self.max_records {
            self.pop_front();
        }
    }

    /// Drops records that expired at or before `now_ms`.
    pub fn expire(&mut self, now_ms: u64) {
        while self.queue.front().is_some_and(|&(exp, ..)| exp <= now_ms) {
            self.pop_front();
        }
    }

    fn pop_front(&mut self) {
        let Some((exp, ns, key, slot)) = self.queue.pop_front() else {
            return;
        };
        let blocks = &mut self.blocks[ns as usize];
        if let Some(records) = blocks.get_mut(&key) {
            // Only the entry written with this exact expiry is removed; a later refresh of the
            // same record has its own queue entry.
            if let Some(i) = records.iter().position(|&(s, e)| s == slot && e == exp) {
                records.swap_remove(i);
                if records.is_empty() {
                    blocks.remove(&key);
                }
            }
        }
    }

    /// Drops every record of a worker (it left or aged out).
    pub fn forget_worker(&mut self, slot: Slot) {
        for blocks in &mut self.blocks {
            blocks.retain(|_, records| {
                records.retain(|(s, _)| *s != slot);
                !records.is_empty()
            });
        }
        self.queue.retain(|&(.., s)| s != slot);
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
        for (i, key) in keys.iter().enumerate() {
            let Some(records) = blocks.get(key) else {
                return;
            };
            let mut fresh = records
                .iter()
                .filter(|&&(_, exp)| exp > now_ms)
                .map(|&(s, _)| s);
            if !visit(i, &mut fresh) {
                return;
            }
        }
    }

    /// Number of live records.
    pub fn len(&self) -> usize {
        self.blocks
            .iter()
            .map(|b| b.values().map(|r| r.len()).sum::<usize>())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.iter().all(|b| b.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
