//! Routing one request: each candidate's matched depth on the device and lower tiers, the
//! policy's decision, and its effects (reserved work, the router's own records, the provisional
//! owner of a spill) inside the same transition.

use super::*;
use crate::replicas::PeerRoute;

impl Router {
    /// Longest consecutive match of `keys` per worker slot: authoritative or fresh approximate,
    /// whichever is deeper.
    pub(super) fn depths(&self, ns: Option<NsId>, keys: &[u64], now: u64) -> Vec<u32> {
        let mut depth = self.index_depths(&self.state.index, ns, keys);
        let Some(ns) = ns else {
            return depth;
        };
        let mut approx = vec![0u32; depth.len()];
        self.state.approx.walk(ns, keys, now, |i, owners| {
            extend_depths(&mut approx, i, owners)
        });
        for (d, a) in depth.iter_mut().zip(approx) {
            *d = (*d).max(a);
        }
        depth
    }

    /// Longest consecutive match of `keys` per worker slot in one owner index (the device's or
    /// a lower tier's).
    pub(super) fn index_depths(
        &self,
        tier: &OwnerIndex,
        ns: Option<NsId>,
        keys: &[u64],
    ) -> Vec<u32> {
        let mut depth = vec![0u32; self.state.workers.slot_count()];
        if let Some(ns) = ns {
            tier.walk(ns, keys, |i, owners| {
                extend_depths(&mut depth, i, owners.iter().copied())
            });
        }
        depth
    }

    /// The lower-tier depth of one worker rank for a prompt's block keys: how many leading
    /// blocks it holds consecutively in host memory and on disk (each tier on its own). The
    /// router fills the same figures into every [`WorkerView`] of a route.
    pub fn lower_tier_depth(
        &self,
        id: &WorkerId,
        dp_rank: u32,
        model: Option<&str>,
        lora: Option<&str>,
        keys: &[u64],
    ) -> TierDepths {
        let (Some(slot), ns) = (
            self.state.workers.slot_of(id, dp_rank),
            self.state.namespaces.get(model, lora),
        ) else {
            return TierDepths::default();
        };
        TierDepths {
            host: self.index_depths(&self.state.lower.host, ns, keys)[slot as usize],
            disk: self.index_depths(&self.state.lower.disk, ns, keys)[slot as usize],
        }
    }

    pub(super) fn route(&mut self, req: &RouteRequest, seq: u64, now: u64) -> Option<Decision> {
        let ns = self
            .state
            .namespaces
            .get(req.model.as_deref(), req.lora.as_deref());
        let depths = self.depths(ns, &req.keys, now);
        let host_depths = self.index_depths(&self.state.lower.host, ns, &req.keys);
        let disk_depths = self.index_depths(&self.state.lower.disk, ns, &req.keys);
        let max_age = self.config.policy.telemetry_max_age_ms;
        let policy_config = &self.config.policy;
        let block_size = self.block_size_of(req.model.as_deref());
        // Looked up once per worker rank: a set, so the cost of a route does not grow with the
        // product of the fleet and the exclude list.
        let excluded: FxHashSet<&WorkerId> = req.exclude.iter().collect();
        // One candidate per worker rank, each with its own ownership, load and reserved work.
        let views: Vec<WorkerView> = self
            .state
            .workers
            .iter()
            .map(|(slot, w)| WorkerView {
                slot,
                id: &w.id,
                dp_rank: w.dp_rank,
                candidate: w.state == WorkerState::Active
                    && !excluded.contains(&w.id)
                    && serves_model(w.model.as_deref(), req.model.as_deref()),
                depth: depths[slot as usize],
                host_depth: host_depths[slot as usize],
                disk_depth: disk_depths[slot as usize],
                pressure: policy_config
                    .ranked_pressure(w.fresh_pressure(now, max_age), w.reserved_prefill),
                waiting: w.waiting(),
                reserved_work: w.reserved_work,
                reserved_requests: w.reserved_requests,
                prefill_backlog_tokens: w.reserved_prefill,
            })
            .collect();
        let provisional =
            |prefix: u64| ns.and_then(|ns| self.state.provisional.get(&(ns, prefix)).copied());
        let view = RouteView {
            now_ms: now,
            keys: &req.keys,
            prompt_tokens: req.prompt_tokens,
            block_size,
            workers: &views,
            provisional: &provisional,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(seq);
        let mut policy_state = std::mem::take(&mut self.state.policy);
        let choice = policy::decide(&self.config.policy, &mut policy_state, &view, &mut rng);
        let Some(choice) = choice else {
            self.state.policy = policy_state;
            return None;
        };
        let chosen = &views[choice.worker];
        let slot = chosen.slot;
        let worker_id = chosen.id.clone();
        let rank = chosen.dp_rank;
        let dp_rank = self
            .state
            .workers
            .multi_rank(slot)
            .then_some(chosen.dp_rank);
        // The chosen rank's own depth: a spill to a non-owner reuses nothing.
        let matched_blocks = chosen.depth;
        let held_tokens = u64::from(chosen.depth).saturating_mul(u64::from(block_size));
        let mut owners: Vec<WorkerId> = choice
            .known_owners
            .iter()
            .map(|&i| views[i].id.clone())
            .collect();
        owners.sort();
        owners.dedup();
        let match_threshold = self.config.policy.match_threshold(req.keys.len());
        let explain = req.explain.then(|| {
            views
                .iter()
                .map(|v| {
                    let w = self
                        .state
                        .workers
                        .get(v.slot)
                        .expect("viewed worker exists");
                    ExplainRow {
                        worker: v.id.clone(),
                        dp_rank: self.state.workers.multi_rank(v.slot).then_some(v.dp_rank),
                        candidate: v.candidate,
                        state: w.state,
                        depth: v.depth,
                        host_depth: v.host_depth,
                        disk_depth: v.disk_depth,
                        pressure: v.pressure,
                        telemetry_age_ms: w.telemetry_age_ms(now),
                        reserved_work: v.reserved_work,
                        sample_pressure: w.fresh_pressure(now, max_age),
                        prefill_backlog_tokens: v.prefill_backlog_tokens,
                        match_threshold,
                        dynamo_cost: v
                            .candidate
                            .then(|| policy::baselines::dynamo_cost_of(&view, v)),
                    }
                })
                .collect()
        });
        drop(views);
        self.state.policy = policy_state;

        // Effects, inside the same transition that chose the worker.
        let output = req
            .max_output_tokens
            .unwrap_or(self.config.output_estimate)
            .min(self.config.output_estimate);
        let work = req.prompt_tokens.saturating_add(output);
        // The prefill part: the prompt tokens the chosen worker does not already hold.
        let prefill = req.prompt_tokens.saturating_sub(held_tokens);
        let reservation = self.reservation_id(seq);
        let reserve = peers::Reserve {
            id: reservation,
            work,
            prefill,
        };
        let ns = ns.unwrap_or_else(|| {
            self.state
                .namespaces
                .intern(req.model.as_deref(), req.lora.as_deref())
        });
        self.record_route_effects(ns, &req.keys, slot, Some(reserve), now);
        if let Some(prefix) = choice.spilled_prefix {
            self.state.provisional.insert(
                (ns, prefix),
                ProvisionalOwner {
                    slot,
                    spilled_ms: now,
                },
            );
        }
        let peer_event = self.route_event(seq, now, || PeerRoute {
            model: req.model.clone(),
            lora: req.lora.clone(),
            worker: worker_id.clone(),
            dp_rank: rank,
            keys: req.keys.clone(),
            work,
            prefill,
            reservation,
            spilled_prefix: choice.spilled_prefix,
            decision: choice.label,
        });
        Some(Decision {
            worker: worker_id,
            dp_rank,
            decision: choice.label,
            matched_blocks,
            prompt_blocks: req.keys.len() as u32,
            owners,
            reservation,
            request_id: req.request_id.clone(),
            explain,
            peer_event,
        })
    }
}

/// Extends each owner's consecutive match from position `i` to `i + 1`: a depth only grows if
/// it already covers every earlier key. Returns whether any worker still matches, so the walk
/// stops at the first key nobody continues.
fn extend_depths(depth: &mut [u32], i: usize, owners: impl Iterator<Item = Slot>) -> bool {
    let mut any = false;
    for slot in owners {
        let d = &mut depth[slot as usize];
        if *d as usize == i {
            *d += 1;
        }
        // A slot can appear twice for one key (two engine hashes); it still counts once.
        any |= *d as usize == i + 1;
    }
    any
}

/// A worker without a declared model serves any model; a request without a model fits any worker.
fn serves_model(worker_model: Option<&str>, requested: Option<&str>) -> bool {
    match (worker_model, requested) {
        (Some(w), Some(r)) => w == r,
        _ => true,
    }
}
