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

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;
    use crate::input::WorkerId;

    /// The shapes a snapshot had before reservations had a prefill part and a deadline heap.
    #[derive(Serialize)]
    struct OldReservation {
        slot: Slot,
        work: u64,
        expires_ms: u64,
    }
    #[derive(Serialize)]
    struct OldReservations {
        open: FxHashMap<u64, OldReservation>,
        queue: VecDeque<(u64, u64)>,
    }

    #[test]
    fn a_snapshot_from_before_prefill_parts_decodes_and_expires_by_its_deadlines() {
        let old = OldReservations {
            open: [
                (
                    7,
                    OldReservation {
                        slot: 0,
                        work: 100,
                        expires_ms: 900,
                    },
                ),
                (
                    8,
                    OldReservation {
                        slot: 0,
                        work: 50,
                        expires_ms: 500,
                    },
                ),
            ]
            .into_iter()
            .collect(),
            // Creation order, not deadline order: the later one expires first.
            queue: VecDeque::from([(900, 7), (500, 8)]),
        };
        let bytes = rmp_serde::to_vec(&old).unwrap();
        let mut reservations: Reservations =
            rmp_serde::from_slice(&bytes).expect("old snapshots stay decodable");
        assert_eq!(
            reservations.get(7).map(|r| (r.work, r.prefill)),
            Some((100, 0)),
            "an old reservation has no prefill part"
        );
        let mut workers = Workers::default();
        let (slot, _) = workers.touch(&WorkerId::new("w").unwrap(), 0, 0);
        workers.get_mut(slot).unwrap().reserved_work = 150;
        assert_eq!(reservations.expire(&mut workers, 500), 1, "8 at 500");
        assert_eq!(workers.get(slot).unwrap().reserved_work, 100);
        assert_eq!(reservations.expire(&mut workers, 899), 0);
        assert_eq!(reservations.expire(&mut workers, 900), 1, "7 at 900");
        assert!(reservations.is_empty());
    }
}
