//! Routing one request: each candidate's matched depth on the device and lower tiers, the
//! policy's decision, and its effects (reserved work, the router's own records, the provisional
//! owner of a spill) inside the same transition.
//!
//! The normal path costs the matched owners and the sampled candidates, never the fleet: the
//! walks write depths into reused per-rank rows (a run of keys with the same owners at once,
//! not key by key) and list the ranks they touched, the policy sees views of those ranks only,
//! and power-of-two draws come from the fleet's pools ([`super::pools`]). Explain rows and the
//! baseline policies still view every worker.

use super::pools::{
    Classes, RankRow, RouteBuffers, RouteDraws, RouteFleet, RouteScratch, APPROX, DEVICE, DISK,
    HOST,
};
use super::*;
use crate::index::extend_match;
use crate::replicas::PeerRoute;
use rand_chacha::ChaCha8Core;

/// A live rank a route views: its slot, its row and its depths (device or approximate; host;
/// disk), each read once.
#[derive(Clone, Copy)]
struct ListedRank<'a> {
    slot: Slot,
    row: &'a RankRow,
    depths: (u32, u32, u32),
}

impl Router {
    /// Walks `keys` through device, approximate, host and disk ownership into `scratch`: each
    /// rank's longest consecutive match per tier, and the ranks with any. (The scratch is the
    /// router's own, borrowed beside the state rather than moved out of the router: it holds
    /// the pools, a few hundred bytes a route would otherwise copy out and back.)
    fn walk_depths(
        state: &RouterState,
        scratch: &mut RouteScratch,
        ns: Option<NsId>,
        keys: &[u64],
        now: u64,
    ) {
        scratch.prepare(state.workers.slot_count());
        let Some(ns) = ns else {
            return;
        };
        state.index.walk(ns, keys.iter().copied(), |at, owners| {
            scratch.extend::<DEVICE>(at, owners.iter().copied())
        });
        state
            .lower
            .host
            .walk(ns, keys.iter().copied(), |at, owners| {
                scratch.extend::<HOST>(at, owners.iter().copied())
            });
        state
            .lower
            .disk
            .walk(ns, keys.iter().copied(), |at, owners| {
                scratch.extend::<DISK>(at, owners.iter().copied())
            });
        state.approx.walk(ns, keys, now, |i, owners| {
            scratch.extend::<APPROX>(i..i + 1, owners)
        });
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
        let (Some(slot), Some(ns)) = (
            self.state.workers.slot_of(id, dp_rank),
            self.state.namespaces.get(model, lora),
        ) else {
            return TierDepths::default();
        };
        let depth_of = |tier: &OwnerIndex| {
            let mut depth = 0;
            tier.walk(ns, keys.iter().copied(), |at, owners| {
                owners.contains(&slot) && extend_match(&mut depth, &at)
            });
            depth
        };
        TierDepths {
            host: depth_of(&self.state.lower.host),
            disk: depth_of(&self.state.lower.disk),
        }
    }

    /// Writes what the policy knows about one live rank for this request into `view`, from
    /// its row alone, field by field where it lies: a view built on the stack and copied into
    /// the list stalled every listed rank (the copy's wide loads read the fields' narrower
    /// stores before they reached the cache, so store-to-load forwarding failed; a fifth of the
    /// route's own time in the profile of a 256-worker decision).
    fn write_view(
        &self,
        rank: ListedRank,
        request: (Option<&str>, Classes),
        excluded: &[Slot],
        view: &mut WorkerView,
    ) {
        let ListedRank {
            slot,
            row,
            depths: (depth, host_depth, disk_depth),
        } = rank;
        let (model, classes) = request;
        // Whether the rank serves the model: from its class, or (a class past the row) from
        // the model its entry declares.
        let serves = || {
            row.serves(classes).unwrap_or_else(|| {
                let worker = self.state.workers.get(slot).expect("a live rank");
                serves_model(&worker.model, model)
            })
        };
        view.slot = slot;
        view.id_order = row.id_order;
        view.candidate = row.is_active() && excluded.binary_search(&slot).is_err() && serves();
        view.depth = depth;
        view.host_depth = host_depth;
        view.disk_depth = disk_depth;
        view.pressure = row.pressure();
        view.waiting = row.waiting;
        view.reserved_work = row.reserved_work;
        view.reserved_requests = row.reserved_requests;
        view.prefill_backlog_tokens = row.reserved_prefill;
    }

    /// The ranks pressure-first decides on besides the fleet's pools (the provisional owner
    /// aside): every rank with a lower-tier match, and of the matches reaching the threshold
    /// the deepest level holding a candidate (the owners) and every level above it (deeper
    /// ranks that are not candidates). Shallower matches play no part in a decision that has
    /// owners, so a prefix the whole fleet shares costs its owners, not its holders. When no
    /// candidate reaches the threshold, every rank that does is listed (step 7 labels by them).
    /// A match short of the threshold without a lower-tier match is never listed.
    ///
    /// Returns the owners' depth, the level where candidates were found (every other listed
    /// rank is shallower or not a candidate), or `None` when no listed level holds one.
    ///
    /// `push_view` is a generic closure, not a `&dyn Fn`: called once per listed rank, it is
    /// then a direct call (2-7% more decisions per second at 16 and 256 workers in the peer
    /// bench, the thirty-fourth part). `write_view` is left to the compiler, which keeps it a
    /// call in the listing: forced inline there, decisions with hundreds of owners took 10%
    /// longer.
    fn listed_views(
        &self,
        scratch: &RouteScratch,
        prompt_blocks: usize,
        push_view: &impl Fn(ListedRank, &mut Vec<WorkerView>),
        views: &mut Vec<WorkerView>,
    ) -> Option<u32> {
        let threshold = self.config.policy.match_threshold(prompt_blocks);
        let depth = |slot: Slot| scratch.depths(slot).0;
        // Each listed rank's row is read once, here, and handed to its view with its depths.
        // (The same three fields are built by `rank_of` in `route`; one constructor for both
        // made the listing's view writes a call of their own: +1.8% instructions per decision
        // at 4,096 workers under callgrind.)
        let listed = |slot: Slot| {
            let row = scratch.row(slot)?;
            Some(ListedRank {
                slot,
                row,
                depths: scratch.depths_of(row),
            })
        };
        // Levels at or above `listed_from` are listed. Two levels are tried one at a time (a
        // deepest match held only by draining or excluded ranks); past that, the rest at once.
        // The deepest level is known from the walks; only the next one needs a pass.
        let mut listed_from = u32::MAX;
        let mut owners_depth = None;
        let mut level = scratch.deepest_match();
        for attempt in 0..2 {
            if level == 0 || level < threshold {
                break;
            }
            // Room for every touched rank in all (and the provisional owner), so the views are
            // written once, whichever levels are listed: growing a vector of hundreds of views
            // costs more than the spare room.
            let touched = scratch.touched();
            views.reserve(touched.len() + 1 - views.len());
            for &slot in touched {
                if let Some(rank) = listed(slot).filter(|rank| rank.depths.0 == level) {
                    push_view(rank, views);
                    // Read back from the view just written: whether the rank can be chosen.
                    if views.last().is_some_and(|v| v.candidate) {
                        owners_depth = Some(level);
                    }
                }
            }
            listed_from = level;
            if attempt == 1 || owners_depth.is_some() {
                break;
            }
            level = scratch
                .touched()
                .iter()
                .map(|&slot| depth(slot))
                .filter(|&d| d < listed_from)
                .max()
                .unwrap_or(0);
        }
        // Below the listed levels: lower-tier matches, and the rest of the threshold's when
        // no candidate was found. Without a lower-tier match there is nothing to list when
        // owners were found, nor when no match reaches the threshold (a cold miss, or a match
        // too short for the prompt: four in ten decisions of the peer bench at 256 workers),
        // so the pass over the touched ranks is left out.
        let owners_found = owners_depth.is_some();
        if !scratch.any_lower_tier() && (owners_found || scratch.deepest_match() < threshold) {
            return owners_depth;
        }
        for &slot in scratch.touched() {
            let Some(rank) = listed(slot) else {
                continue;
            };
            let (d, host, disk) = rank.depths;
            if d < listed_from && (host > 0 || disk > 0 || (!owners_found && d >= threshold)) {
                push_view(rank, views);
            }
        }
        owners_depth
    }

    /// The namespace a route's effects are recorded under. A route never creates a namespace
    /// for a name no worker announced: only the default one, or the model the chosen worker
    /// declared (without a LoRA, which only KV events name), and only within `max_models`.
    /// Otherwise there is nothing to record under. A peer's route follows the same rule, so
    /// replicas agree on the namespaces they hold.
    pub(super) fn route_namespace(
        &mut self,
        known: Option<NsId>,
        model: Option<&str>,
        lora: Option<&str>,
        slot: Slot,
    ) -> Option<NsId> {
        if known.is_some() {
            return known;
        }
        let announced = lora.is_none()
            && (model.is_none()
                || self
                    .state
                    .workers
                    .get(slot)
                    .and_then(|w| w.model.as_deref())
                    == model);
        if announced {
            self.intern(model, lora)
        } else {
            None
        }
    }

    pub(super) fn route(&mut self, req: &RouteRequest, seq: u64, now: u64) -> Option<Decision> {
        let ns = self
            .state
            .namespaces
            .get(req.model.as_deref(), req.lora.as_deref());
        let mut policy_state = std::mem::take(&mut self.state.policy);
        self.scratch
            .sync(&mut self.state.workers, &self.config.policy, now);
        Self::walk_depths(&self.state, &mut self.scratch, ns, &req.keys, now);
        let max_age = self.config.policy.telemetry_max_age_ms;
        let block_size = self.block_size_of(req.model.as_deref());
        let mut buffers = self.scratch.take_buffers();
        let RouteBuffers {
            excluded,
            views,
            owner_order,
            draws,
        } = &mut buffers;
        // Every live rank of an excluded worker, ascending: looked up per rank, so the cost of a
        // route does not grow with the product of the fleet and the exclude list.
        for id in &req.exclude {
            excluded.extend(self.state.workers.slots_of(id));
        }
        excluded.sort_unstable();
        excluded.dedup();
        // Read-only from here until the route ends: the view function and the fleet borrow it.
        let scratch = &self.scratch;
        let model = req.model.as_deref();
        let classes = scratch.pools.classes(model);
        let rank_of = |slot: Slot| {
            let row = scratch.row(slot).expect("a live rank");
            ListedRank {
                slot,
                row,
                depths: scratch.depths_of(row),
            }
        };
        let push_listed = |rank: ListedRank, views: &mut Vec<WorkerView>| {
            views.push(WorkerView::default());
            let view = views.last_mut().expect("just pushed");
            self.write_view(rank, (model, classes), excluded, view);
        };
        let push_view = |slot: Slot, views: &mut Vec<WorkerView>| push_listed(rank_of(slot), views);
        let view_of = |slot: Slot| {
            let mut view = WorkerView::default();
            self.write_view(rank_of(slot), (model, classes), excluded, &mut view);
            view
        };
        // Pressure-first decides on the matched ranks and the fleet's pools; explain rows and the
        // baselines see every worker.
        let sparse = self.config.policy.kind == PolicyKind::PressureFirst && !req.explain;
        if sparse {
            let owners_depth = self.listed_views(scratch, req.keys.len(), &push_listed, views);
            // The provisional owner of the longest match's prefix, which the policy may add to
            // the known owners: the deepest candidate's depth (known from the listing when it
            // found owners; otherwise a shallower candidate with a lower-tier match may have it).
            let deepest = owners_depth.unwrap_or_else(|| {
                views
                    .iter()
                    .filter(|v| v.candidate)
                    .map(|v| v.depth)
                    .max()
                    .unwrap_or(0)
            });
            if let (Some(ns), true) = (ns, deepest > 0) {
                let prefix = req.keys[deepest as usize - 1];
                if let Some(p) = self.state.provisional.get(&(ns, prefix)) {
                    if self.state.workers.get(p.slot).is_some()
                        && views.iter().all(|v| v.slot != p.slot)
                    {
                        push_view(p.slot, views);
                    }
                }
            }
            views.sort_unstable_by_key(|v| v.slot);
        } else {
            for (slot, _) in self.state.workers.iter() {
                push_view(slot, views);
            }
        }
        let fleet = RouteFleet {
            pools: &scratch.pools,
            classes,
            excluded,
            view: &view_of,
        };
        let provisional =
            |prefix: u64| ns.and_then(|ns| self.state.provisional.get(&(ns, prefix)).copied());
        let view = RouteView {
            now_ms: now,
            keys: &req.keys,
            prompt_tokens: req.prompt_tokens,
            block_size,
            workers: views,
            provisional: &provisional,
            fleet: sparse.then_some(&fleet as &dyn policy::Fleet),
        };
        let mut rng = SeededOnDraw::new(seq, draws);
        let choice = policy::decide(&self.config.policy, &mut policy_state, &view, &mut rng);
        let Some(choice) = choice else {
            self.state.policy = policy_state;
            self.scratch.finish(buffers);
            return None;
        };
        let id_of = |slot: Slot| scratch.name(slot).clone();
        let chosen = view_of(choice.slot);
        let slot = chosen.slot;
        let worker_id = id_of(slot);
        // The rank number from the rank's row: a view carries the slot alone.
        let rank = scratch.row(slot).expect("a viewed rank is live").dp_rank;
        let dp_rank = self.state.workers.multi_rank(slot).then_some(rank);
        // The chosen rank's own depth: a spill to a non-owner reuses nothing.
        let matched_blocks = chosen.depth;
        let held_tokens = u64::from(chosen.depth).saturating_mul(u64::from(block_size));
        // In id order, each worker once (its ranks share the id): see `OwnerOrder`.
        choice
            .known_owners
            .for_each(views, |_, v| owner_order.push(v.id_order, v.slot));
        let (rows, names) = scratch.rows_and_names();
        let owners = owner_order.ids_in_id_order(rows, names);
        let explain = req.explain.then(|| {
            let match_threshold = self.config.policy.match_threshold(req.keys.len());
            views
                .iter()
                .map(|v| {
                    let w = self
                        .state
                        .workers
                        .get(v.slot)
                        .expect("viewed worker exists");
                    ExplainRow {
                        worker: w.id.clone(),
                        dp_rank: self.state.workers.multi_rank(v.slot).then_some(w.dp_rank),
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
        self.state.policy = policy_state;
        self.scratch.finish(buffers);

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
        let ns = self.route_namespace(ns, req.model.as_deref(), req.lora.as_deref(), slot);
        self.record_route_effects(ns, &req.keys, slot, Some(reserve), now);
        if let (Some(ns), Some(prefix)) = (ns, choice.spilled_prefix) {
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

/// A worker without a declared model serves any model; a request without a model fits any worker.
fn serves_model(worker_model: &Option<String>, requested: Option<&str>) -> bool {
    // The request first: without a model, the worker's is never read.
    requested.is_none_or(|r| worker_model.as_deref().is_none_or(|w| w == r))
}

/// The route's random draws: ChaCha8 seeded with the input's sequence number, as every route
/// has been since the first journal, so replays draw the same numbers. Seeding (and the first
/// block of the stream) costs more than many a decision, and most decisions hold on an owner
/// without drawing, so the generator is only seeded at the first draw.
///
/// The generator is the router's own ([`RouteBuffers::draws`]), reseeded in place: `ChaCha8Rng`
/// is this same [`RouteDraws`] (`BlockRng` over [`ChaCha8Core`]), and a fresh one per route
/// zeroed its 256-byte output buffer and copied it twice on its way into the route
/// (docs/performance.md, Round 5, thirty-second part). Reseeding replaces the cipher's state
/// and marks the buffer used up, so the first draw computes the new seed's blocks and nothing of
/// the last route's is read.
struct SeededOnDraw<'a> {
    seed: u64,
    seeded: bool,
    generator: &'a mut Option<Box<RouteDraws>>,
}

impl<'a> SeededOnDraw<'a> {
    fn new(seed: u64, generator: &'a mut Option<Box<RouteDraws>>) -> Self {
        SeededOnDraw {
            seed,
            seeded: false,
            generator,
        }
    }

    fn rng(&mut self) -> &mut RouteDraws {
        if !self.seeded {
            self.seeded = true;
            let core = ChaCha8Core::seed_from_u64(self.seed);
            match self.generator {
                Some(generator) => {
                    generator.core = core;
                    generator.reset();
                }
                None => *self.generator = Some(Box::new(RouteDraws::new(core))),
            }
        }
        self.generator.as_mut().expect("made at the first draw")
    }
}

impl rand::RngCore for SeededOnDraw<'_> {
    fn next_u32(&mut self) -> u32 {
        self.rng().next_u32()
    }

    fn next_u64(&mut self) -> u64 {
        self.rng().next_u64()
    }

    fn fill_bytes(&mut self, dst: &mut [u8]) {
        self.rng().fill_bytes(dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, RngCore};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn seeding_on_the_first_draw_draws_what_seeding_up_front_draws() {
        // One generator for every seed, as a router keeps it: what one route left in its
        // buffer must not be read by the next.
        let mut generator = None;
        for seed in [0, 1, 7, u64::MAX, 7] {
            let mut eager = ChaCha8Rng::seed_from_u64(seed);
            let mut lazy = SeededOnDraw::new(seed, &mut generator);
            // Past one 64-word buffer, and across its end with a 64-bit draw.
            for round in 0..70 {
                let (a, b) = match round % 3 {
                    0 => (u64::from(eager.next_u32()), u64::from(lazy.next_u32())),
                    1 => (eager.next_u64(), lazy.next_u64()),
                    _ => (eager.random_range(0..17), lazy.random_range(0..17)),
                };
                assert_eq!(
                    a, b,
                    "seed {seed}, draw {round}: a replay must draw the same numbers"
                );
            }
        }
        // A route that draws once, after one that drew a few words.
        let mut few = SeededOnDraw::new(3, &mut generator);
        few.next_u32();
        let mut next = SeededOnDraw::new(4, &mut generator);
        assert_eq!(
            next.next_u64(),
            ChaCha8Rng::seed_from_u64(4).next_u64(),
            "a route's first draw starts its own seed's stream"
        );
    }
}
