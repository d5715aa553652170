//! Reserved work (DESIGN.md §6): each route reserves `prompt_tokens + min(max_output_tokens,
//! output_estimate)` on the chosen worker inside the same transition that chose it, so two
//! requests decided back to back already see each other's load. Released by `/v1/release` or
//! after `reservation_ttl`.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::index::Slot;
use crate::workers::Workers;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    pub slot: Slot,
    pub work: u64,
    pub expires_ms: u64,
}

#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Reservations {
    open: FxHashMap<u64, Reservation>,
    /// (expiry, id) in creation order; with a fixed TTL that is expiry order.
    queue: VecDeque<(u64, u64)>,
}

impl Reservations {
    /// Opens reservation `id` and adds its work to the worker.
    pub fn open(&mut self, workers: &mut Workers, id: u64, slot: Slot, work: u64, expires_ms: u64) {
        if let Some(w) = workers.get_mut(slot) {
            w.reserved_work += work;
            w.reserved_requests += 1;
        }
        self.open.insert(
            id,
            Reservation {
                slot,
                work,
                expires_ms,
            },
        );
        self.queue.push_back((expires_ms, id));
    }

    /// Gives reservation `id` back. False if it is unknown or already gone.
    pub fn release(&mut self, workers: &mut Workers, id: u64) -> bool {
        match self.open.remove(&id) {
            Some(r) => {
                if let Some(w) = workers.get_mut(r.slot) {
                    w.reserved_work = w.reserved_work.saturating_sub(r.work);
                    w.reserved_requests = w.reserved_requests.saturating_sub(1);
                }
                true
            }
            None => false,
        }
    }

    /// Releases every reservation that expired at or before `now_ms`. Returns how many.
    pub fn expire(&mut self, workers: &mut Workers, now_ms: u64) -> usize {
        let mut expired = 0;
        while let Some(&(exp, id)) = self.queue.front() {
            if exp > now_ms {
                break;
            }
            self.queue.pop_front();
            if self.open.get(&id).is_some_and(|r| r.expires_ms == exp) && self.release(workers, id)
            {
                expired += 1;
            }
        }
        // Released reservations leave their queue entries behind; drop them once they dominate.
        if self.queue.len() > 2 * self.open.len() + 1024 {
            let open = &self.open;
            self.queue.retain(|(_, id)| open.contains_key(id));
        }
        expired
    }

    /// Drops a departed worker's reservations (its reserved work goes with it).
    pub fn forget_worker(&mut self, slot: Slot) {
        self.open.retain(|_, r| r.slot != slot);
    }

    pub fn len(&self) -> usize {
        self.open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }
}
