//! Reserved work: each route reserves `prompt_tokens + min(max_output_tokens, output_estimate)`
//! on the chosen worker inside the same transition that chose it, so two requests decided back
//! to back already see each other's load. Its prefill part (the prompt tokens the worker did not
//! already hold) is the worker's unfinished prefill until the gateway reports the first token
//! (a release with phase `prefill`); the rest stays until the request finishes (a release
//! without a phase) or the reservation's own deadline passes.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::index::Slot;
use crate::workers::Workers;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    pub slot: Slot,
    /// Work still reserved, prefill part included.
    pub work: u64,
    pub expires_ms: u64,
    /// The prefill part not released yet (0 once the first token was reported).
    #[serde(default)]
    pub prefill: u64,
}

/// Which part of a reservation a release gives back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleasePhase {
    /// The first token was produced: the prefill part is done, the rest stays reserved.
    Prefill,
}

#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Reservations {
    open: FxHashMap<u64, Reservation>,
    /// (deadline, id), earliest deadline first. Each reservation carries its own deadline, so a
    /// shorter TTL after a restart expires new reservations before older, longer ones.
    queue: BinaryHeap<Reverse<(u64, u64)>>,
}

impl Reservations {
    /// Opens reservation `id` of `work`, `prefill` of it unfinished prefill, and adds it to
    /// the worker.
    pub fn open(
        &mut self,
        workers: &mut Workers,
        id: u64,
        slot: Slot,
        work: u64,
        prefill: u64,
        expires_ms: u64,
    ) {
        let prefill = prefill.min(work);
        if let Some(w) = workers.get_mut(slot) {
            w.reserved_work = w.reserved_work.saturating_add(work);
            w.reserved_prefill = w.reserved_prefill.saturating_add(prefill);
            w.reserved_requests = w.reserved_requests.saturating_add(1);
        }
        self.open.insert(
            id,
            Reservation {
                slot,
                work,
                expires_ms,
                prefill,
            },
        );
        self.queue.push(Reverse((expires_ms, id)));
    }

    /// Gives reservation `id` back: its prefill part with [`ReleasePhase::Prefill`] (the
    /// reservation stays open for the rest), all of it without a phase. False if it is unknown
    /// or already gone.
    pub fn release(&mut self, workers: &mut Workers, id: u64, phase: Option<ReleasePhase>) -> bool {
        match phase {
            Some(ReleasePhase::Prefill) => {
                let Some(r) = self.open.get_mut(&id) else {
                    return false;
                };
                if let Some(w) = workers.get_mut(r.slot) {
                    w.reserved_work = w.reserved_work.saturating_sub(r.prefill);
                    w.reserved_prefill = w.reserved_prefill.saturating_sub(r.prefill);
                }
                r.work = r.work.saturating_sub(r.prefill);
                r.prefill = 0;
                true
            }
            None => match self.open.remove(&id) {
                Some(r) => {
                    if let Some(w) = workers.get_mut(r.slot) {
                        w.reserved_work = w.reserved_work.saturating_sub(r.work);
                        w.reserved_prefill = w.reserved_prefill.saturating_sub(r.prefill);
                        w.reserved_requests = w.reserved_requests.saturating_sub(1);
                    }
                    true
                }
                None => false,
            },
        }
    }

    /// Releases every reservation whose deadline is at or before `now_ms`. Returns how many.
    pub fn expire(&mut self, workers: &mut Workers, now_ms: u64) -> usize {
        let mut expired = 0;
        while let Some(&Reverse((deadline, id))) = self.queue.peek() {
            if deadline > now_ms {
                break;
            }
            self.queue.pop();
            if self.open.get(&id).is_some_and(|r| r.expires_ms == deadline)
                && self.release(workers, id, None)
            {
                expired += 1;
            }
        }
        // Released reservations leave their queue entries behind; drop them once they dominate.
        if self.queue.len() > 2 * self.open.len() + 1024 {
            let open = &self.open;
            self.queue.retain(|Reverse((_, id))| open.contains_key(id));
        }
        expired
    }

    /// Drops a departed worker's reservations (its reserved work goes with it).
    pub fn forget_worker(&mut self, slot: Slot) {
        self.open.retain(|_, r| r.slot != slot);
    }

    pub fn get(&self, id: u64) -> Option<&Reservation> {
        self.open.get(&id)
    }

    pub fn len(&self) -> usize {
        self.open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }
}
