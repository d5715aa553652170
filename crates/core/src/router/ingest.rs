//! Applying what workers say: KV event batches (epochs, sequences, ranks, tiers), load
//! samples and lifecycle messages, and removing a worker rank with everything it owned.

use super::*;

impl Router {
    pub(super) fn apply_load(&mut self, sample: &LoadSample, now: u64) -> IngestReport {
        if self.is_departed(&sample.worker, now) {
            return IngestReport {
                departed: true,
                ..Default::default()
            };
        }
        if let Err(rejection) = self.admit(&sample.worker, sample.dp_rank, "load sample") {
            return IngestReport {
                rejections: vec![rejection],
                ..Default::default()
            };
        }
        let (slot, new_worker) = self
            .state
            .workers
            .touch(&sample.worker, sample.dp_rank, now);
        self.state.workers.apply_load(slot, sample, now);
        let mut report = IngestReport {
            new_worker,
            ..Default::default()
        };
        if let Some(model) = &sample.model {
            report
                .rejections
                .extend(self.declare_model(&sample.worker, model));
        }
        report
    }

    /// Whether a message of `id`'s rank `dp_rank` may create state: a rank below
    /// [`MAX_DP_SIZE`], and a known worker or room for a new one under `max_workers`. Workers
    /// already known are never refused, so a flood of invented ids cannot push them out.
    pub(super) fn admit(&self, id: &WorkerId, dp_rank: u32, what: &str) -> Result<(), Rejection> {
        if dp_rank >= MAX_DP_SIZE {
            return Err(Rejection::new(
                RejectReason::InvalidField,
                format!(
                    "worker {id}: {what} for dp rank {dp_rank}, ranks are below {MAX_DP_SIZE}; \
                     not applied"
                ),
            ));
        }
        let workers = &self.state.workers;
        if !workers.is_known(id) && workers.worker_count() >= self.config.max_workers {
            return Err(Rejection::new(
                RejectReason::WorkerLimit,
                format!(
                    "{what} from new worker {id} rejected: {} workers are known, the limit \
                     (--max-workers)",
                    workers.worker_count()
                ),
            ));
        }
        Ok(())
    }

    /// Whether `id` left (sticky leave) and has neither joined again nor been gone for
    /// `worker_ttl`.
    pub(super) fn is_departed(&self, id: &WorkerId, now: u64) -> bool {
        self.state
            .workers
            .is_departed(id, now, self.config.worker_ttl_ms)
    }

    /// Records the model a worker declared (join or load sample) on each of its ranks.
    ///
    /// Events that arrived before the declaration, with no `Kv-Model` header, were filed under
    /// no model: the rule is that a worker's blocks belong to the model it declares, so they
    /// move to that model's namespace (same LoRA) the moment it first declares one, and routes
    /// naming the model see them. Blocks filed under an explicit `Kv-Model` never move. When
    /// the model's namespace cannot be created (`max_models`), they stay where they are and
    /// the rejection is returned.
    pub(super) fn declare_model(&mut self, id: &WorkerId, model: &str) -> Option<Rejection> {
        let mut rejection = None;
        let slots: Vec<Slot> = self.state.workers.slots_of(id).collect();
        for slot in slots {
            let w = self.state.workers.get_mut(slot).expect("live slot");
            if w.model.as_deref() == Some(model) {
                continue;
            }
            let undeclared = w.model.is_none();
            w.model = Some(model.to_owned());
            if !undeclared {
                continue;
            }
            let from: Vec<NsId> = self
                .state
                .index
                .worker_blocks(slot)
                .map(|(ns, _)| ns)
                .chain(self.state.lower.host.worker_blocks(slot).map(|(ns, _)| ns))
                .chain(self.state.lower.disk.worker_blocks(slot).map(|(ns, _)| ns))
                .filter(|&ns| self.state.namespaces.name(ns).model.is_none())
                .collect();
            for ns in from {
                let lora = self.state.namespaces.name(ns).lora.clone();
                let Some(to) = self.intern(Some(model), lora.as_deref()) else {
                    rejection = Some(self.model_limit(
                        id,
                        Some(model),
                        lora.as_deref(),
                        "its blocks stay filed under no model",
                    ));
                    continue;
                };
                self.state.index.move_namespace(slot, ns, to);
                self.state.lower.move_namespace(slot, ns, to);
            }
        }
        rejection
    }

    /// The namespace of (model, lora), created if `max_models` allows.
    pub(super) fn intern(&mut self, model: Option<&str>, lora: Option<&str>) -> Option<NsId> {
        self.state
            .namespaces
            .intern(model, lora, self.config.max_models)
    }

    pub(super) fn model_limit(
        &self,
        id: &WorkerId,
        model: Option<&str>,
        lora: Option<&str>,
        outcome: &str,
    ) -> Rejection {
        Rejection::new(
            RejectReason::ModelLimit,
            format!(
                "worker {id}: model {} lora {} would be a new namespace, {} exist, the limit \
                 (--max-models); {outcome}",
                model.unwrap_or("(none)"),
                lora.unwrap_or("(none)"),
                self.state.namespaces.len()
            ),
        )
    }

    /// Drops everything a worker rank is believed to hold: device and lower-tier ownership and
    /// the router's own approximate records. Returns the device blocks dropped.
    pub(super) fn clear_rank(&mut self, slot: Slot) -> u64 {
        let state = &mut self.state;
        state.lower.clear_worker(slot);
        state.approx.forget_worker(slot);
        state.index.clear_worker(slot) as u64
    }

    /// The ownership a KV event on `medium` changes: the device index, or a lower tier's.
    fn tier_index(&self, medium: Medium) -> &OwnerIndex {
        self.state.lower.tier(medium).unwrap_or(&self.state.index)
    }

    /// The key of a stored block's parent, looked up among the rank's blocks on the store's own
    /// tier first, then the device, host and disk tiers (an offloaded block names a parent that
    /// may live on another tier).
    pub(super) fn parent_key(
        &self,
        slot: Slot,
        ns: NsId,
        medium: Medium,
        parent: u64,
    ) -> Option<u64> {
        let lower = &self.state.lower;
        let own = self.tier_index(medium).key_of(slot, ns, parent);
        own.or_else(|| self.state.index.key_of(slot, ns, parent))
            .or_else(|| lower.host.key_of(slot, ns, parent))
            .or_else(|| lower.disk.key_of(slot, ns, parent))
    }

    pub(super) fn apply_kv_events(&mut self, batch: &KvEventBatch, now: u64) -> IngestReport {
        let mut report = IngestReport::default();
        if self.is_departed(&batch.worker, now) {
            report.departed = true;
            return report;
        }
        if let Err(rejection) = self.admit(&batch.worker, batch.dp_rank, "KV event batch") {
            report.rejections.push(rejection);
            return report;
        }
        let (slot, new_worker) = self.state.workers.touch(&batch.worker, batch.dp_rank, now);
        report.new_worker = new_worker;
        match self
            .state
            .workers
            .check_seq(slot, batch.epoch.as_deref(), batch.seq)
        {
            SeqCheck::Duplicate | SeqCheck::StaleEpoch => {
                report.duplicate = true;
                return report;
            }
            SeqCheck::Jump { last } => {
                report.rejections.push(Rejection::new(
                    RejectReason::SeqJump,
                    format!(
                        "worker {} dp rank {}: Kv-Seq {} is more than {MAX_SEQ_JUMP} ahead of \
                         the last applied {last}; batch not applied",
                        batch.worker,
                        batch.dp_rank,
                        batch.seq.unwrap_or_default()
                    ),
                ));
                return report;
            }
            SeqCheck::Apply { gap, new_epoch } => {
                report.seq_gap = gap;
                if new_epoch {
                    report.new_epoch = true;
                    report.cleared_blocks += self.clear_rank(slot);
                }
            }
        }
        let declared_model = self.state.workers.get(slot).and_then(|w| w.model.clone());
        let model = batch.model.as_deref().or(declared_model.as_deref());
        let model_block_size = self.block_size_of(model);
        for event in &batch.events {
            match event {
                KvEvent::Stored {
                    parent,
                    blocks,
                    block_size,
                    lora,
                    medium,
                    full_attention,
                } => {
                    let n = blocks.len() as u64;
                    if !full_attention {
                        report.ignored_blocks += n;
                        continue;
                    }
                    if *block_size != model_block_size {
                        report.rejections.push(Rejection::new(
                            RejectReason::BlockSizeMismatch,
                            format!(
                                "worker {}: BlockStored with block_size {block_size}, model {} \
                                 has block size {model_block_size}",
                                batch.worker,
                                model.unwrap_or("(none)")
                            ),
                        ));
                        continue;
                    }
                    let Some(ns) = self.intern(model, lora.as_deref()) else {
                        report.rejections.push(self.model_limit(
                            &batch.worker,
                            model,
                            lora.as_deref(),
                            "BlockStored not applied",
                        ));
                        continue;
                    };
                    self.tier_index(*medium)
                        .prefetch_store(slot, ns, *parent, blocks);
                    let parent_key = parent.and_then(|p| self.parent_key(slot, ns, *medium, p));
                    if parent.is_some() && parent_key.is_none() {
                        report.orphan_blocks += n;
                    }
                    match self.state.lower.tier_mut(*medium) {
                        None => {
                            self.state.index.store(slot, ns, parent_key, blocks);
                            report.stored_blocks += n;
                        }
                        Some(tier) => {
                            tier.store(slot, ns, parent_key, blocks);
                            report.lower_tier_stored += n;
                        }
                    }
                }
                KvEvent::Removed {
                    engine_hashes,
                    medium,
                } => match self.state.lower.tier_mut(*medium) {
                    None => {
                        let dropped = self.state.index.remove(slot, engine_hashes);
                        report.removed_blocks += dropped.len() as u64;
                        // What the worker no longer holds, the router stops believing from its
                        // own records too.
                        for &(ns, key) in dropped {
                            self.state.approx.forget_blocks(ns, [key], slot);
                        }
                    }
                    Some(tier) => {
                        report.lower_tier_removed += tier.remove(slot, engine_hashes).len() as u64
                    }
                },
                KvEvent::Cleared => {
                    self.clear_rank(slot);
                    report.cleared += 1;
                }
            }
        }
        report
    }

    /// Checks a block size a worker declared in its join for `model`. A size fixed by
    /// `--model-block-size`, or declared by another live worker of the model, cannot be changed;
    /// a worker without a model must use `--block-size`.
    pub(super) fn check_declared_block_size(
        &self,
        id: &WorkerId,
        model: Option<&str>,
        size: u32,
    ) -> Result<(), Rejection> {
        let mismatch = |have: u32, why: &str| {
            Rejection::new(
                RejectReason::BlockSizeMismatch,
                format!(
                    "worker {id}: joined with block_size {size}, model {} has block size {have} \
                     ({why}); the field is ignored",
                    model.unwrap_or("(none)")
                ),
            )
        };
        let Some(model) = model else {
            return match size == self.config.block_size {
                true => Ok(()),
                false => Err(mismatch(self.config.block_size, "--block-size")),
            };
        };
        if let Some(&fixed) = self.config.model_block_sizes.get(model) {
            return match size == fixed {
                true => Ok(()),
                false => Err(mismatch(fixed, "--model-block-size")),
            };
        }
        match self.state.declared_block_sizes.get(model) {
            Some(&declared) if declared != size => {
                let held = self.state.workers.iter().any(|(_, w)| {
                    &w.id != id
                        && w.model.as_deref() == Some(model)
                        && w.block_size == Some(declared)
                });
                match held {
                    true => Err(mismatch(declared, "declared by another live worker")),
                    false => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }

    pub(super) fn apply_lifecycle(&mut self, msg: &Lifecycle, now: u64) -> IngestReport {
        let mut report = IngestReport::default();
        let id = &msg.worker;
        match msg.op {
            LifecycleOp::Leave => {
                let slots: Vec<Slot> = self.state.workers.slots_of(id).collect();
                if !slots.is_empty() {
                    report.removed_workers.push(id.clone());
                }
                for slot in slots {
                    self.remove_slot(slot);
                }
                // Sticky: late load samples or events do not bring it back.
                self.state.workers.depart(id, now);
                return report;
            }
            LifecycleOp::Join => self.state.workers.readmit(id),
            LifecycleOp::Drain => {
                if self.is_departed(id, now) {
                    report.departed = true;
                    return report;
                }
            }
        }
        if let Err(rejection) = self.admit(id, 0, "lifecycle message") {
            report.rejections.push(rejection);
            return report;
        }
        // A bad field is rejected (counted) and the op still applied.
        let dp_size = match msg.dp_size {
            Some(n) if n == 0 || n > MAX_DP_SIZE => {
                report.rejections.push(Rejection::new(
                    RejectReason::InvalidField,
                    format!("worker {id}: dp_size {n} is outside 1..={MAX_DP_SIZE}; ignored"),
                ));
                None
            }
            other => other,
        };
        let known_model = self
            .state
            .workers
            .slots_of(id)
            .next()
            .and_then(|s| self.state.workers.get(s))
            .and_then(|w| w.model.clone());
        let model = msg.model.clone().or(known_model);
        let block_size = match msg.block_size {
            Some(size) => match self.check_declared_block_size(id, model.as_deref(), size) {
                Ok(()) => Some(size),
                Err(rejection) => {
                    report.rejections.push(rejection);
                    None
                }
            },
            None => None,
        };
        if let (LifecycleOp::Join, Some(n)) = (msg.op, dp_size) {
            // The new process has exactly `n` ranks: ranks beyond them are gone.
            let gone: Vec<Slot> = self
                .state
                .workers
                .slots_of(id)
                .filter(|&s| self.state.workers.get(s).is_some_and(|w| w.dp_rank >= n))
                .collect();
            for slot in gone {
                self.remove_slot(slot);
            }
        }
        let mut ranks: Vec<u32> = self
            .state
            .workers
            .slots_of(id)
            .filter_map(|s| self.state.workers.get(s).map(|w| w.dp_rank))
            .collect();
        ranks.extend(0..dp_size.unwrap_or(1));
        ranks.sort_unstable();
        ranks.dedup();
        for rank in ranks {
            report.new_worker |= self.state.workers.touch(id, rank, now).1;
        }
        let slots: Vec<Slot> = self.state.workers.slots_of(id).collect();
        for &slot in &slots {
            let w = self.state.workers.get_mut(slot).expect("live slot");
            match msg.op {
                LifecycleOp::Join => {
                    w.state = WorkerState::Active;
                    // A join announces a new engine process and clears what its ranks held,
                    // unless it carries the epoch a rank already runs: a re-announcement (a
                    // restarted sidecar in front of a running engine) clears nothing and keeps
                    // the rank's sequence.
                    let reannounced = msg.epoch.is_some() && w.epoch == msg.epoch;
                    if !reannounced {
                        self.state.workers.enter_epoch(slot, msg.epoch.clone());
                        report.cleared_blocks += self.clear_rank(slot);
                    }
                }
                LifecycleOp::Drain => w.state = WorkerState::Draining,
                LifecycleOp::Leave => unreachable!("handled above"),
            }
            let w = self.state.workers.get_mut(slot).expect("live slot");
            if msg.capacity_blocks.is_some() {
                w.capacity_blocks = msg.capacity_blocks;
            }
            if dp_size.is_some() {
                w.dp_size = dp_size;
            }
            if block_size.is_some() {
                w.block_size = block_size;
            }
        }
        if let (Some(model), Some(size)) = (&model, block_size) {
            let declared = &mut self.state.declared_block_sizes;
            let fixed = self.config.model_block_sizes.contains_key(model);
            let room = declared.contains_key(model) || declared.len() < self.config.max_models;
            if !fixed && room {
                declared.insert(model.clone(), size);
            } else if !fixed {
                report.rejections.push(Rejection::new(
                    RejectReason::ModelLimit,
                    format!(
                        "worker {id}: block size of new model {model} not recorded, {} models \
                         have one, the limit (--max-models)",
                        declared.len()
                    ),
                ));
            }
        }
        if let Some(model) = &msg.model {
            report.rejections.extend(self.declare_model(id, model));
        }
        report
    }

    /// Removes a worker rank and all of its ownership, records and reservations.
    pub(super) fn remove_slot(&mut self, slot: Slot) {
        self.clear_rank(slot);
        let state = &mut self.state;
        state.reservations.forget_worker(slot);
        state.provisional.retain(|_, p| p.slot != slot);
        state.workers.remove(slot);
        // The slot table may have shrunk: per-slot tables shrink with it.
        let slots = state.workers.slot_count();
        state.index.truncate_slots(slots);
        state.lower.host.truncate_slots(slots);
        state.lower.disk.truncate_slots(slots);
    }
}
