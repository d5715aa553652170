//! The worker table: who is known, in what state, how loaded, and how much work the router has
//! reserved on each.

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::index::Slot;
use crate::input::{LoadSample, WorkerId};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    Active,
    /// Finishing its work: takes no new routes.
    Draining,
}

impl WorkerState {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Active => "active",
            WorkerState::Draining => "draining",
        }
    }
}

/// The latest load sample of a worker and when the daemon received it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Telemetry {
    pub pressure: f64,
    pub kv_usage: f64,
    pub running: u32,
    pub waiting: u32,
    /// Daemon clock at receipt: staleness never trusts the worker's clock.
    pub received_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Worker {
    pub id: WorkerId,
    pub state: WorkerState,
    /// The model it declared (lifecycle or load sample); routes for another model skip it.
    pub model: Option<String>,
    pub capacity_blocks: Option<u64>,
    pub telemetry: Option<Telemetry>,
    /// Daemon clock of the last message of any kind from this worker.
    pub last_heard_ms: u64,
    /// Sum of open reservations' work (DESIGN.md §6).
    pub reserved_work: u64,
    /// Number of open reservations: the request count the `legacy` baseline balances.
    pub reserved_requests: u32,
    /// Last applied `Kv-Seq` per data-parallel rank.
    pub last_seq: SmallVec<[(u32, u64); 1]>,
    /// The part of `reserved_work` that is prefill the worker has not finished.
    #[serde(default)]
    pub reserved_prefill: u64,
}

impl Worker {
    /// Pressure if the telemetry is fresh (no older than `max_age_ms` at `now_ms`).
    pub fn fresh_pressure(&self, now_ms: u64, max_age_ms: u64) -> Option<f64> {
        self.telemetry
            .filter(|t| now_ms.saturating_sub(t.received_ms) <= max_age_ms)
            .map(|t| t.pressure)
    }

    pub fn telemetry_age_ms(&self, now_ms: u64) -> Option<u64> {
        self.telemetry.map(|t| now_ms.saturating_sub(t.received_ms))
    }

    pub fn waiting(&self) -> u32 {
        self.telemetry.map_or(0, |t| t.waiting)
    }
}

/// Sequence check of a batch against the last applied one of its (worker, dp rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// Apply; `gap` batches were missed before this one.
    Apply { gap: u64 },
    /// At or below the last applied sequence: a redelivery, skip it.
    Duplicate,
}

/// Workers by slot. A slot is never reused for another id, so state keyed by slot (index,
/// records) cannot be confused between workers.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Workers {
    slots: Vec<Option<Worker>>,
    ids: Vec<WorkerId>,
    #[serde(skip)]
    by_id: FxHashMap<WorkerId, Slot>,
}

impl Workers {
    /// The slot of `id`, creating the worker (active) if it is not known.
    /// Returns the slot and whether the worker was new.
    pub fn touch(&mut self, id: &WorkerId, now_ms: u64) -> (Slot, bool) {
        let slot = match self.by_id.get(id) {
            Some(&slot) => slot,
            None => {
                let slot = self.slots.len() as Slot;
                self.slots.push(None);
                self.ids.push(id.clone());
                self.by_id.insert(id.clone(), slot);
                slot
            }
        };
        let entry = &mut self.slots[slot as usize];
        let new = entry.is_none();
        let worker = entry.get_or_insert_with(|| Worker {
            id: id.clone(),
            state: WorkerState::Active,
            model: None,
            capacity_blocks: None,
            telemetry: None,
            last_heard_ms: now_ms,
            reserved_work: 0,
            reserved_requests: 0,
            last_seq: SmallVec::new(),
            reserved_prefill: 0,
        });
        worker.last_heard_ms = worker.last_heard_ms.max(now_ms);
        (slot, new)
    }

    pub fn slot_of(&self, id: &WorkerId) -> Option<Slot> {
        self.by_id
            .get(id)
            .copied()
            .filter(|&s| self.slots[s as usize].is_some())
    }

    pub fn get(&self, slot: Slot) -> Option<&Worker> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    pub fn get_mut(&mut self, slot: Slot) -> Option<&mut Worker> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    /// Forgets a worker (leave or age-out). Its slot stays reserved for its id.
    pub fn remove(&mut self, slot: Slot) -> Option<Worker> {
        self.slots.get_mut(slot as usize).and_then(Option::take)
    }

    /// Known workers in slot order (deterministic).
    pub fn iter(&self) -> impl Iterator<Item = (Slot, &Worker)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, w)| w.as_ref().map(|w| (i as Slot, w)))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (Slot, &mut Worker)> {
        self.slots
            .iter_mut()
            .enumerate()
            .filter_map(|(i, w)| w.as_mut().map(|w| (i as Slot, w)))
    }

    /// Number of slots ever allocated (an upper bound for slot numbers).
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Rebuilds the id lookup after deserialization.
    pub fn rebuild(&mut self) {
        self.by_id = self
            .ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.clone(), i as Slot))
            .collect();
    }

    pub fn apply_load(&mut self, slot: Slot, sample: &LoadSample, now_ms: u64) {
        if let Some(w) = self.get_mut(slot) {
            w.telemetry = Some(Telemetry {
                pressure: sample.pressure(),
                kv_usage: sample.kv_usage,
                running: sample.running,
                waiting: sample.waiting,
                received_ms: now_ms,
            });
            if sample.model.is_some() {
                w.model = sample.model.clone();
            }
        }
    }

    /// Checks and records a batch's `Kv-Seq` for (worker, dp rank).
    pub fn check_seq(&mut self, slot: Slot, dp_rank: u32, seq: Option<u64>) -> SeqCheck {
        let (Some(w), Some(seq)) = (self.get_mut(slot), seq) else {
            return SeqCheck::Apply { gap: 0 };
        };
        match w.last_seq.iter_mut().find(|(rank, _)| *rank == dp_rank) {
            Some((_, last)) if seq <= *last => SeqCheck::Duplicate,
            Some((_, last)) => {
                let gap = seq - *last - 1;
                *last = seq;
                SeqCheck::Apply { gap }
            }
            None => {
                w.last_seq.push((dp_rank, seq));
                SeqCheck::Apply { gap: 0 }
            }
        }
    }
}
