//! The worker table: who is known, in what state, how loaded, and how much work the router has
//! reserved on each.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Bound;

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::index::Slot;
use crate::input::{LoadSample, WorkerId, MAX_SEQ_JUMP};

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

/// One data-parallel rank of a worker: the unit the router routes to, owns blocks, tracks load
/// and reserves work on. A worker with one rank (the common case) is one entry; a worker with
/// several has one entry per rank, and the worker-level fields (`state`, `model`,
/// `capacity_blocks`, `block_size`, `dp_size`, `last_heard_ms`) are kept equal across them.
///
/// A route reads no entry per owner: the router keeps copies of what a decision reads of each
/// rank (its per-rank rows and ids, refreshed for the entries that change). The entries keep
/// the order and the cache-line alignment they had when routes read each owner's id here:
/// with the compiler's order and no alignment the router applied events about 6% more slowly
/// in the peer bench at 1,024 workers (docs/performance.md, the fifty-third part). The snapshot
/// keeps its own field order (`WorkerWire`, private to this module).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(from = "WorkerWire", into = "WorkerWire")]
#[repr(C, align(64))]
pub struct Worker {
    /// The latest load sample of this rank.
    pub telemetry: Option<Telemetry>,
    /// Sum of open reservations' work on this rank (docs/architecture.md, "Reserved work").
    pub reserved_work: u64,
    /// The part of `reserved_work` that is prefill this rank has not finished.
    pub reserved_prefill: u64,
    /// The data-parallel rank of this entry (`Kv-Dp-Rank`, or the batch's own field).
    pub dp_rank: u32,
    /// Number of open reservations on this rank: the request count the `legacy` baseline
    /// balances.
    pub reserved_requests: u32,
    pub id: WorkerId,
    pub state: WorkerState,
    /// The model it declared (lifecycle or load sample); routes for another model skip it.
    pub model: Option<String>,
    pub capacity_blocks: Option<u64>,
    /// The block size the worker declared in its `join`.
    pub block_size: Option<u32>,
    /// The number of data-parallel ranks the worker declared in its `join`.
    pub dp_size: Option<u32>,
    /// Daemon clock of the last message of any kind from this worker (any rank).
    pub last_heard_ms: u64,
    /// The engine incarnation this rank runs (`Kv-Epoch`, or the epoch a `join` carried).
    pub epoch: Option<String>,
    /// Epochs this rank ran before, oldest first, at most [`RETIRED_EPOCHS_KEPT`]: a late batch
    /// of one of them is stale and skipped rather than taken for yet another restart.
    pub retired_epochs: SmallVec<[String; 1]>,
    /// Last applied `Kv-Seq` in the current epoch.
    pub last_seq: Option<u64>,
}

/// A [`Worker`] as snapshots write it: the fields in the order they always had (a snapshot
/// lists a struct's fields by position).
#[derive(Serialize, Deserialize)]
struct WorkerWire {
    id: WorkerId,
    dp_rank: u32,
    state: WorkerState,
    model: Option<String>,
    capacity_blocks: Option<u64>,
    block_size: Option<u32>,
    dp_size: Option<u32>,
    telemetry: Option<Telemetry>,
    last_heard_ms: u64,
    reserved_work: u64,
    reserved_requests: u32,
    epoch: Option<String>,
    retired_epochs: SmallVec<[String; 1]>,
    last_seq: Option<u64>,
    #[serde(default)]
    reserved_prefill: u64,
}

impl From<WorkerWire> for Worker {
    fn from(w: WorkerWire) -> Self {
        Worker {
            telemetry: w.telemetry,
            reserved_work: w.reserved_work,
            reserved_prefill: w.reserved_prefill,
            dp_rank: w.dp_rank,
            reserved_requests: w.reserved_requests,
            id: w.id,
            state: w.state,
            model: w.model,
            capacity_blocks: w.capacity_blocks,
            block_size: w.block_size,
            dp_size: w.dp_size,
            last_heard_ms: w.last_heard_ms,
            epoch: w.epoch,
            retired_epochs: w.retired_epochs,
            last_seq: w.last_seq,
        }
    }
}

impl From<Worker> for WorkerWire {
    fn from(w: Worker) -> Self {
        WorkerWire {
            id: w.id,
            dp_rank: w.dp_rank,
            state: w.state,
            model: w.model,
            capacity_blocks: w.capacity_blocks,
            block_size: w.block_size,
            dp_size: w.dp_size,
            telemetry: w.telemetry,
            last_heard_ms: w.last_heard_ms,
            reserved_work: w.reserved_work,
            reserved_requests: w.reserved_requests,
            epoch: w.epoch,
            retired_epochs: w.retired_epochs,
            last_seq: w.last_seq,
            reserved_prefill: w.reserved_prefill,
        }
    }
}

/// Retired epochs remembered per rank.
pub const RETIRED_EPOCHS_KEPT: usize = 4;

/// Departed ids remembered (sticky leave). Beyond it the oldest departure is forgotten first: a
/// late message for that id can then bring it back, which is the pre-leave behaviour, never a
/// loss of state.
pub const MAX_DEPARTED: usize = 16_384;

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

    /// Moves this rank to `epoch`: the current one (if any) is retired and the sequence starts
    /// over.
    fn enter_epoch(&mut self, epoch: Option<String>) {
        if let Some(old) = self.epoch.take() {
            if epoch.as_ref() != Some(&old) && !self.retired_epochs.contains(&old) {
                if self.retired_epochs.len() >= RETIRED_EPOCHS_KEPT {
                    self.retired_epochs.remove(0);
                }
                self.retired_epochs.push(old);
            }
        }
        if let Some(e) = &epoch {
            self.retired_epochs.retain(|r| r != e);
        }
        self.epoch = epoch;
        self.last_seq = None;
    }
}

/// Sequence check of a batch against the last applied one of its (worker, dp rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// Apply; `gap` batches were missed before this one. `new_epoch`: the batch starts a new
    /// engine incarnation, so the rank's ownership must be cleared before it is applied.
    Apply { gap: u64, new_epoch: bool },
    /// At or below the last applied sequence: a redelivery, skip it.
    Duplicate,
    /// From an epoch this rank already left behind: skip it.
    StaleEpoch,
    /// More than [`MAX_SEQ_JUMP`] ahead of `last`: rejected, the sequence does not advance.
    Jump { last: u64 },
}

/// Ids that left (or aged out), and when: until their next `join` or for `worker_ttl`, late
/// load samples and events do not bring them back. Bounded by [`MAX_DEPARTED`].
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct Departed {
    /// (departure time, id), oldest first. An id appears once.
    order: VecDeque<(u64, WorkerId)>,
}

impl Departed {
    fn position(&self, id: &WorkerId) -> Option<usize> {
        self.order.iter().position(|(_, d)| d == id)
    }
}

/// Worker ranks by slot. A slot is one live (worker id, dp rank); when the rank leaves or ages
/// out, everything keyed by its slot (ownership, records, reservations, provisional owners) is
/// dropped with it (`Router::remove_slot`), and only then is the slot free for another rank.
/// A new rank takes the lowest free slot and free slots at the end of the table are cut off, so
/// the table (and every per-slot vector sized by it) shrinks back after a churn of workers,
/// and slot numbers are a function of the live ranks alone: a router restored from a snapshot
/// allocates exactly as the one that wrote it.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Workers {
    slots: Vec<Option<Worker>>,
    /// Written empty: a slot's (id, rank) is its worker's own. Snapshots written before slots
    /// were reused list every slot ever allocated here; they still decode, and the list is
    /// dropped.
    #[serde(default)]
    keys: Vec<(WorkerId, u32)>,
    departed: Departed,
    #[serde(skip)]
    by_key: FxHashMap<(WorkerId, u32), Slot>,
    /// The live slots of each live id, in slot order.
    #[serde(skip)]
    by_id: FxHashMap<WorkerId, SmallVec<[Slot; 1]>>,
    /// Free slots below the end of the table; the lowest is taken first.
    #[serde(skip)]
    free: BTreeSet<Slot>,
    /// Departure time per departed id (mirror of `departed.order`).
    #[serde(skip)]
    departed_at: FxHashMap<WorkerId, u64>,
    /// Ranks that may have changed since the router last took them ([`Workers::take_changed`]),
    /// each once: what keeps its candidate pools current without scanning the fleet.
    #[serde(skip)]
    changed: Vec<Slot>,
    #[serde(skip)]
    is_changed: Vec<bool>,
    /// Each live id's place in id order as a number ([`Workers::id_order`]), so a decision
    /// sorts its owners by a number beside it instead of reading every owner's id again at
    /// each comparison. Labels leave gaps: a new id takes the midpoint of its neighbours' (or,
    /// beyond an end, the usual spacing past it), and only when no gap is left are all ids
    /// labelled afresh, evenly spaced.
    #[serde(skip)]
    order_labels: BTreeMap<WorkerId, u32>,
    /// Per slot: its id's order label and how many live ranks the id has.
    #[serde(skip)]
    slot_meta: Vec<SlotMeta>,
}

/// What a route reads of a slot's id without hashing it ([`Workers::id_order`],
/// [`Workers::multi_rank`]).
#[derive(Debug, Default, Clone, Copy)]
struct SlotMeta {
    order: u32,
    ranks: u32,
}

impl Workers {
    /// The slot of rank `dp_rank` of `id`, creating it (active) if it is not known. A new rank
    /// of a known worker takes the worker-level fields of its siblings. Every live rank of the
    /// worker is marked heard at `now_ms`. Returns the slot and whether the worker (any rank)
    /// was unknown before.
    pub fn touch(&mut self, id: &WorkerId, dp_rank: u32, now_ms: u64) -> (Slot, bool) {
        let sibling = self.slots_of(id).next();
        let new_worker = sibling.is_none();
        let slot = match self.by_key.get(&(id.clone(), dp_rank)) {
            Some(&slot) => slot,
            None => {
                let slot = match self.free.pop_first() {
                    Some(slot) => slot,
                    None => {
                        self.slots.push(None);
                        (self.slots.len() - 1) as Slot
                    }
                };
                self.by_key.insert((id.clone(), dp_rank), slot);
                // Slot order, as `rebuild` lists them, so a restored router iterates alike.
                let slots = self.by_id.entry(id.clone()).or_default();
                slots.insert(slots.partition_point(|&s| s < slot), slot);
                if new_worker {
                    self.label_new_id(id);
                }
                self.refresh_meta_of(id);
                slot
            }
        };
        if self.slots[slot as usize].is_none() {
            self.mark_changed(slot);
            let template = sibling.and_then(|s| self.get(s)).cloned();
            let worker = match template {
                Some(t) => Worker {
                    dp_rank,
                    telemetry: None,
                    reserved_work: 0,
                    reserved_requests: 0,
                    epoch: None,
                    retired_epochs: SmallVec::new(),
                    last_seq: None,
                    reserved_prefill: 0,
                    ..t
                },
                None => Worker {
                    id: id.clone(),
                    dp_rank,
                    state: WorkerState::Active,
                    model: None,
                    capacity_blocks: None,
                    block_size: None,
                    dp_size: None,
                    telemetry: None,
                    last_heard_ms: now_ms,
                    reserved_work: 0,
                    reserved_requests: 0,
                    epoch: None,
                    retired_epochs: SmallVec::new(),
                    last_seq: None,
                    reserved_prefill: 0,
                },
            };
            self.slots[slot as usize] = Some(worker);
        }
        let siblings: SmallVec<[Slot; 4]> = self.slots_of(id).collect();
        for s in siblings {
            let w = self.slots[s as usize].as_mut().expect("live sibling");
            w.last_heard_ms = w.last_heard_ms.max(now_ms);
        }
        (slot, new_worker)
    }

    /// The slot of rank `dp_rank` of `id`, if it is live.
    pub fn slot_of(&self, id: &WorkerId, dp_rank: u32) -> Option<Slot> {
        self.by_key.get(&(id.clone(), dp_rank)).copied()
    }

    /// The live slots of `id` (one per known rank), in slot order.
    pub fn slots_of<'a>(&'a self, id: &WorkerId) -> impl Iterator<Item = Slot> + 'a {
        self.by_id.get(id).into_iter().flatten().copied()
    }

    /// Whether `id` has a live rank.
    pub fn is_known(&self, id: &WorkerId) -> bool {
        self.by_id.contains_key(id)
    }

    /// Number of live workers (ids, whatever their ranks).
    pub fn worker_count(&self) -> usize {
        self.by_id.len()
    }

    /// Whether the worker of `slot` has more than one data-parallel rank (known or declared):
    /// then a route reply names the rank.
    pub fn multi_rank(&self, slot: Slot) -> bool {
        let Some(w) = self.get(slot) else {
            return false;
        };
        w.dp_size.is_some_and(|n| n > 1)
            || self
                .slot_meta
                .get(slot as usize)
                .is_some_and(|m| m.ranks > 1)
    }

    /// A number that orders live ranks as their ids order: equal for the ranks of one worker,
    /// smaller for a smaller id. It changes as ids join, so it is only compared within one
    /// route, never kept. 32 bits, so a route packs it with an owner's position into one
    /// integer to sort; a fleet of 10,000 ids leaves gaps of 200,000 between labels.
    pub fn id_order(&self, slot: Slot) -> u32 {
        self.slot_meta.get(slot as usize).map_or(0, |m| m.order)
    }

    /// Gives a new id the label halfway between its neighbours', or labels every id afresh when
    /// they leave no gap. An id beyond either end takes the spacing of a fresh labelling past
    /// its neighbour, not half the room left there: ids often join in their own order (`w0001`,
    /// `w0002`, ...), and halving would label every id afresh every few dozen joins.
    fn label_new_id(&mut self, id: &WorkerId) {
        let below = self.order_labels.range(..id).next_back().map(|(_, &l)| l);
        let above = self
            .order_labels
            .range((Bound::Excluded(id), Bound::Unbounded))
            .next()
            .map(|(_, &l)| l);
        let step = self.label_step();
        let label = match (below, above) {
            (Some(low), None) => low.checked_add(step).filter(|&l| l < u32::MAX),
            (None, Some(high)) => high.checked_sub(step).filter(|&l| l > 0),
            (low, high) => {
                let (low, high) = (low.unwrap_or(0), high.unwrap_or(u32::MAX));
                (high - low > 1).then(|| low + (high - low) / 2)
            }
        };
        match label {
            Some(label) => {
                self.order_labels.insert(id.clone(), label);
            }
            None => {
                self.order_labels.insert(id.clone(), 0);
                self.relabel_ids();
            }
        }
    }

    /// The spacing of a fresh labelling: the live ids spread over the middle half of the u32
    /// range, so each end keeps a quarter of it for ids that join beyond the ends.
    fn label_step(&self) -> u32 {
        (u64::from(u32::MAX / 2) / (self.order_labels.len() as u64 + 1)).max(1) as u32
    }

    /// Labels every live id evenly over the middle half of the u32 range, in id order, and
    /// refreshes every slot.
    fn relabel_ids(&mut self) {
        let step = u64::from(self.label_step());
        let start = u64::from(u32::MAX / 4);
        for (i, label) in self.order_labels.values_mut().enumerate() {
            *label = (start + (i as u64 + 1) * step) as u32;
        }
        self.slot_meta.clear();
        // A pass over the live ids, once the ids joining beyond an end have used its quarter of
        // the range (about a quarter as many joins as there are ids) or the ids joining between
        // two neighbours have halved their gap away; cloning them keeps one writer
        // of the per-slot entries.
        let ids: Vec<WorkerId> = self.by_id.keys().cloned().collect();
        for id in &ids {
            self.refresh_meta_of(id);
        }
    }

    /// Writes the label and rank count of `id` into each of its live slots.
    fn refresh_meta_of(&mut self, id: &WorkerId) {
        let Some(slots) = self.by_id.get(id) else {
            return;
        };
        let meta = SlotMeta {
            order: self.order_labels.get(id).copied().unwrap_or(0),
            ranks: slots.len() as u32,
        };
        if self.slot_meta.len() < self.slots.len() {
            self.slot_meta.resize(self.slots.len(), SlotMeta::default());
        }
        let slots = slots.clone();
        for slot in slots {
            self.slot_meta[slot as usize] = meta;
            // A route copies the label of each rank it may view: the rank has changed for it.
            self.mark_changed(slot);
        }
    }

    pub fn get(&self, slot: Slot) -> Option<&Worker> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    pub fn get_mut(&mut self, slot: Slot) -> Option<&mut Worker> {
        self.mark_changed(slot);
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    /// Forgets a worker rank (leave or age-out) and frees its slot. The caller has dropped
    /// everything keyed by the slot first ([`Workers`]).
    pub fn remove(&mut self, slot: Slot) -> Option<Worker> {
        self.mark_changed(slot);
        let worker = self.slots.get_mut(slot as usize).and_then(Option::take)?;
        self.by_key.remove(&(worker.id.clone(), worker.dp_rank));
        if let Some(slots) = self.by_id.get_mut(&worker.id) {
            slots.retain(|s| *s != slot);
            if slots.is_empty() {
                self.by_id.remove(&worker.id);
                self.order_labels.remove(&worker.id);
            }
        }
        self.refresh_meta_of(&worker.id);
        self.free.insert(slot);
        // Free slots at the end are cut off, so the table shrinks back after a churn.
        while self.slots.last().is_some_and(Option::is_none) {
            self.slots.pop();
            self.free.remove(&(self.slots.len() as Slot));
        }
        if self.slots.capacity() > 2 * self.slots.len() + 16 {
            self.slots.shrink_to_fit();
        }
        Some(worker)
    }

    /// Notes that the rank of `slot` may have changed (every mutable access goes through here).
    fn mark_changed(&mut self, slot: Slot) {
        let i = slot as usize;
        if i >= self.is_changed.len() {
            self.is_changed.resize(self.slots.len().max(i + 1), false);
        }
        if !self.is_changed[i] {
            self.is_changed[i] = true;
            self.changed.push(slot);
        }
    }

    /// Whether the rank of `slot` has changed since the last [`Workers::take_changed`].
    #[cfg(test)]
    pub(crate) fn has_changed(&self, slot: Slot) -> bool {
        self.is_changed.get(slot as usize).copied().unwrap_or(false)
    }

    /// Moves the ranks changed since the last call into `into`, each once.
    pub fn take_changed(&mut self, into: &mut Vec<Slot>) {
        for &slot in &self.changed {
            self.is_changed[slot as usize] = false;
        }
        into.append(&mut self.changed);
    }

    /// Known worker ranks in slot order (deterministic).
    pub fn iter(&self) -> impl Iterator<Item = (Slot, &Worker)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, w)| w.as_ref().map(|w| (i as Slot, w)))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (Slot, &mut Worker)> {
        for slot in 0..self.slots.len() {
            self.mark_changed(slot as Slot);
        }
        self.slots
            .iter_mut()
            .enumerate()
            .filter_map(|(i, w)| w.as_mut().map(|w| (i as Slot, w)))
    }

    /// Length of the slot table (an upper bound for live slot numbers).
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Rebuilds the lookups after deserialization.
    pub fn rebuild(&mut self) {
        self.keys = Vec::new();
        while self.slots.last().is_some_and(Option::is_none) {
            self.slots.pop();
        }
        self.by_key.clear();
        self.by_id.clear();
        self.free.clear();
        for (i, w) in self.slots.iter().enumerate() {
            let slot = i as Slot;
            match w {
                Some(w) => {
                    self.by_key.insert((w.id.clone(), w.dp_rank), slot);
                    self.by_id.entry(w.id.clone()).or_default().push(slot);
                }
                None => {
                    self.free.insert(slot);
                }
            }
        }
        self.order_labels = self.by_id.keys().map(|id| (id.clone(), 0)).collect();
        self.relabel_ids();
        self.departed_at = self
            .departed
            .order
            .iter()
            .map(|(at, id)| (id.clone(), *at))
            .collect();
    }

    /// Records that `id` left at `now_ms` (sticky leave).
    pub fn depart(&mut self, id: &WorkerId, now_ms: u64) {
        self.readmit(id);
        if self.departed.order.len() >= MAX_DEPARTED {
            if let Some((_, oldest)) = self.departed.order.pop_front() {
                self.departed_at.remove(&oldest);
            }
        }
        self.departed.order.push_back((now_ms, id.clone()));
        self.departed_at.insert(id.clone(), now_ms);
    }

    /// Forgets a departure (the id joined again).
    pub fn readmit(&mut self, id: &WorkerId) {
        if self.departed_at.remove(id).is_some() {
            if let Some(i) = self.departed.position(id) {
                self.departed.order.remove(i);
            }
        }
    }

    /// Whether `id` left less than `ttl_ms` before `now_ms` and has not joined since.
    pub fn is_departed(&self, id: &WorkerId, now_ms: u64, ttl_ms: u64) -> bool {
        self.departed_at
            .get(id)
            .is_some_and(|&at| now_ms.saturating_sub(at) < ttl_ms)
    }

    /// Forgets departures older than `ttl_ms` at `now_ms`.
    pub fn expire_departed(&mut self, now_ms: u64, ttl_ms: u64) {
        while let Some(&(at, _)) = self.departed.order.front() {
            if now_ms.saturating_sub(at) < ttl_ms {
                break;
            }
            let (_, id) = self.departed.order.pop_front().expect("front exists");
            self.departed_at.remove(&id);
        }
    }

    /// Number of remembered departures.
    pub fn departed_len(&self) -> usize {
        self.departed.order.len()
    }

    /// Records a load sample as the telemetry of `slot`'s rank.
    pub fn apply_load(&mut self, slot: Slot, sample: &LoadSample, now_ms: u64) {
        if let Some(w) = self.get_mut(slot) {
            w.telemetry = Some(Telemetry {
                pressure: sample.pressure(),
                kv_usage: sample.kv_usage,
                running: sample.running,
                waiting: sample.waiting,
                received_ms: now_ms,
            });
        }
    }

    /// Moves the rank of `slot` to `epoch` (a `join`): the current epoch is retired and the
    /// sequence starts over.
    pub fn enter_epoch(&mut self, slot: Slot, epoch: Option<String>) {
        if let Some(w) = self.get_mut(slot) {
            w.enter_epoch(epoch);
        }
    }

    /// Checks a batch's `Kv-Epoch` and `Kv-Seq` against the rank of `slot` and records them.
    ///
    /// A batch with an epoch other than the rank's current one starts a new epoch (the engine
    /// restarted), unless it is one of the rank's retired epochs (a late batch: stale); a rank
    /// without an epoch adopts the first one it sees, and its sequence starts over. Within an
    /// epoch a sequence at or below the last applied one is a duplicate, a jump beyond
    /// [`MAX_SEQ_JUMP`] is rejected without advancing, and a skip is a gap. The first sequence
    /// of an epoch is taken as it comes.
    pub fn check_seq(&mut self, slot: Slot, epoch: Option<&str>, seq: Option<u64>) -> SeqCheck {
        let Some(w) = self.get_mut(slot) else {
            return SeqCheck::Apply {
                gap: 0,
                new_epoch: false,
            };
        };
        let mut new_epoch = false;
        if let Some(e) = epoch {
            if w.epoch.as_deref() != Some(e) {
                if w.retired_epochs.iter().any(|r| r == e) {
                    return SeqCheck::StaleEpoch;
                }
                // The first epoch a rank hears of (after a join, or from a publisher that sent
                // none before) is adopted; only a change from one epoch to another is a restart.
                new_epoch = w.epoch.is_some();
                w.enter_epoch(Some(e.to_owned()));
            }
        }
        let gap = match (seq, w.last_seq) {
            (None, _) => 0,
            (Some(seq), None) => {
                w.last_seq = Some(seq);
                0
            }
            (Some(seq), Some(last)) if seq <= last => return SeqCheck::Duplicate,
            (Some(seq), Some(last)) if seq - last > MAX_SEQ_JUMP => return SeqCheck::Jump { last },
            (Some(seq), Some(last)) => {
                w.last_seq = Some(seq);
                seq - last - 1
            }
        };
        SeqCheck::Apply { gap, new_epoch }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> WorkerId {
        WorkerId::new(s).unwrap()
    }

    /// Every pair of live ranks compares by `id_order` as by id, and `multi_rank` says whether
    /// the id has more than one live rank.
    fn assert_order_follows_ids(workers: &Workers, when: &str) {
        let live: Vec<(Slot, &Worker)> = workers.iter().collect();
        for &(a, wa) in &live {
            let ranks = workers.slots_of(&wa.id).count();
            assert_eq!(
                workers.multi_rank(a),
                ranks > 1,
                "{when}: multi_rank of {:?} rank {} follows its {ranks} live ranks",
                wa.id,
                wa.dp_rank
            );
            for &(b, wb) in &live {
                assert_eq!(
                    workers.id_order(a).cmp(&workers.id_order(b)),
                    wa.id.cmp(&wb.id),
                    "{when}: id_order of {:?} and {:?} compares as the ids do",
                    wa.id,
                    wb.id
                );
            }
        }
    }

    #[test]
    fn id_order_compares_as_ids_do_through_joins_leaves_relabelling_and_restore() {
        let mut workers = Workers::default();
        workers.touch(&id("m"), 0, 0);
        // Ids joining in ascending order above "m" and in descending order below it: each
        // takes the usual spacing past its end, so the ends' room runs out and the labels are
        // all written afresh, several times.
        for i in 0..150 {
            for name in [format!("w{i:04}"), format!("d{:04}", 999 - i)] {
                let (slot, _) = workers.touch(&id(&name), 0, 0);
                if i % 3 == 0 {
                    workers.touch(&id(&name), 1, 0);
                }
                if i % 5 == 0 {
                    workers.remove(slot);
                }
            }
        }
        // Ids squeezed between the same two neighbours ("m0" < "m09" < "m099" < ... < "m1"):
        // each halves the gap left, so it closes and the labels are written afresh.
        workers.touch(&id("m0"), 0, 0);
        workers.touch(&id("m1"), 0, 0);
        for k in 1..=80 {
            workers.touch(&id(&format!("m0{}", "9".repeat(k))), 0, 0);
        }
        assert_order_follows_ids(&workers, "after joins and leaves");
        let mut restored: Workers =
            serde_json::from_str(&serde_json::to_string(&workers).unwrap()).unwrap();
        restored.rebuild();
        assert_order_follows_ids(&restored, "after a restore");
    }

    #[test]
    fn a_worker_is_written_in_the_snapshots_field_order_whatever_its_layout() {
        let mut workers = Workers::default();
        let (slot, _) = workers.touch(&id("w1"), 3, 40);
        let w = workers.get_mut(slot).unwrap();
        w.model = Some("m".into());
        w.telemetry = Some(Telemetry {
            pressure: 0.5,
            kv_usage: 0.25,
            running: 2,
            waiting: 1,
            received_ms: 40,
        });
        w.reserved_work = 700;
        w.reserved_requests = 2;
        w.reserved_prefill = 300;
        let worker = workers.get(slot).unwrap().clone();
        let bytes = rmp_serde::to_vec(&worker).unwrap();
        let rmpv::Value::Array(fields) = rmpv::decode::read_value(&mut &bytes[..]).unwrap() else {
            panic!("a worker is written as an array of its fields");
        };
        let at = |i: usize| fields[i].to_string();
        assert_eq!(fields.len(), 15, "fifteen fields, as snapshots always held");
        assert_eq!(
            [at(0), at(1), at(3), at(9), at(10), at(14)],
            ["\"w1\"", "3", "\"m\"", "700", "2", "300"].map(String::from),
            "id, rank, model and reserved work at the positions snapshots put them"
        );
        assert!(
            matches!(&fields[7], rmpv::Value::Array(t) if t[0].as_f64() == Some(0.5)),
            "the load sample is the eighth field"
        );
        let back: Worker = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(
            rmp_serde::to_vec(&back).unwrap(),
            bytes,
            "a worker reads back as it was written"
        );
    }

    #[test]
    fn the_id_a_route_copies_of_each_owner_lies_within_one_cache_line() {
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!(align_of::<Worker>(), 64, "an entry starts a cache line");
        let (start, end) = (
            offset_of!(Worker, id),
            offset_of!(Worker, id) + size_of::<WorkerId>(),
        );
        assert_eq!(
            start / 64,
            (end - 1) / 64,
            "the id (bytes {start}..{end}) lies within one line"
        );
    }
}
