//! What a route needs besides the index, kept so that its cost follows the matched owners and
//! the sampled candidates, not the size of the fleet:
//!
//! - [`RouteScratch`]: per-rank depths on each tier, reused from route to route; each row names
//!   the route it was written for, and a row of an earlier route reads as zero, so ending a
//!   route resets nothing.
//! - [`Pools`]: the fleet's candidate pools (candidates, cool, safe; docs/architecture.md,
//!   "Policy") as order-statistic trees over slots, one per model, updated for each rank that
//!   changed (the worker table notes them) and for each rank whose telemetry went stale. A
//!   power-of-two draw then finds the k-th member in slot order without a scan, the same member a
//!   scan of every worker finds, so decisions (and old journals' replays) are unchanged.
//!
//! Neither is part of the router's state: both are rebuilt from it when needed.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use super::route::OwnerOrder;
use crate::index::Slot;
use crate::policy::{Fleet, PolicyConfig, Pool, WorkerView};
use crate::workers::{WorkerState, Workers};

/// Tiers a route walks, as columns of [`RouteScratch`].
pub(super) const DEVICE: usize = 0;
pub(super) const APPROX: usize = 1;
pub(super) const HOST: usize = 2;
pub(super) const DISK: usize = 3;

/// Depths of one route per rank and tier. Invariant between routes: no row carries `route` (the
/// next route's number; or it is 0, and the next `prepare` clears every row), so every row reads
/// as zero, and `touched` is empty.
#[derive(Debug, Default)]
pub(super) struct RouteScratch {
    depth: Vec<DepthRow>,
    /// The route the rows are being written for. A row of another route reads as zero, so
    /// ending a route zeroes nothing: a wide decision touches hundreds of rows, and storing
    /// to each of them again cost more than the check on every read.
    route: u32,
    /// Ranks with a non-zero depth on some tier, in the order the walks met them.
    touched: Vec<Slot>,
    /// The deepest depth per tier over all ranks: the last key a walk continued.
    deepest: [u32; 4],
    pub(super) pools: Pools,
    /// Slots the worker table reported changed; kept to reuse its buffer.
    changed: Vec<Slot>,
    /// The buffers a route takes while it runs, kept between routes so a route allocates none
    /// of them.
    buffers: RouteBuffers,
}

/// Buffers one route fills and empties, taken out of [`RouteScratch`] for the route's length
/// (the scratch itself is borrowed by the views meanwhile) and handed back at its end.
#[derive(Debug, Default)]
pub(super) struct RouteBuffers {
    /// The request's excluded ranks, ascending.
    pub(super) excluded: Vec<Slot>,
    /// The policy's views of the route's listed ranks (a wide decision lists hundreds).
    pub(super) views: Vec<WorkerView>,
    /// The route's owners in id order.
    pub(super) owner_order: OwnerOrder,
}

/// One rank's depths per tier, valid for the route it names.
#[derive(Debug, Default, Clone, Copy)]
struct DepthRow {
    depths: [u32; 4],
    route: u32,
}

impl RouteScratch {
    /// Makes room for `slots` ranks (rows only ever grow).
    pub(super) fn prepare(&mut self, slots: usize) {
        if self.depth.len() < slots {
            self.depth.resize(slots, DepthRow::default());
        }
        if self.route == 0 {
            // The first route, or the counter wrapped: no row may claim to be this route's.
            self.depth.fill(DepthRow::default());
            self.route = 1;
        }
    }

    /// Extends each owner's consecutive match on tier `TIER` from position `i` to `i + 1`: a
    /// depth only grows if it already covers every earlier key. Returns whether any rank still
    /// matches, so the walk stops at the first key nobody continues.
    ///
    /// A row is written for this route only when its rank matches a first key, on some tier:
    /// a rank first met further on matched nothing before it and never will on this route, so
    /// every row of the route is a rank with a non-zero depth, listed once in `touched`.
    pub(super) fn extend<const TIER: usize>(
        &mut self,
        i: usize,
        owners: impl Iterator<Item = Slot>,
    ) -> bool {
        let (route, i) = (self.route, i as u32);
        let mut any = false;
        for slot in owners {
            let row = &mut self.depth[slot as usize];
            if row.route != route {
                if i == 0 {
                    let mut depths = [0; 4];
                    depths[TIER] = 1;
                    *row = DepthRow { depths, route };
                    self.touched.push(slot);
                    any = true;
                }
                continue;
            }
            let depth = &mut row.depths[TIER];
            *depth += u32::from(*depth == i);
            // A slot can appear twice for one key (two engine hashes); it still counts once.
            any |= *depth == i + 1;
        }
        if any {
            self.deepest[TIER] = i + 1;
        }
        any
    }

    /// The deepest device or approximate depth of any rank, known without a pass over them.
    pub(super) fn deepest_match(&self) -> u32 {
        self.deepest[DEVICE].max(self.deepest[APPROX])
    }

    /// Whether any rank has a host-memory or disk match.
    pub(super) fn any_lower_tier(&self) -> bool {
        self.deepest[HOST] > 0 || self.deepest[DISK] > 0
    }

    /// The depths of `slot`: (device or approximate, whichever is deeper; host; disk).
    pub(super) fn depths(&self, slot: Slot) -> (u32, u32, u32) {
        let row = match self.depth.get(slot as usize) {
            Some(row) if row.route == self.route => row.depths,
            _ => [0; 4],
        };
        (row[DEVICE].max(row[APPROX]), row[HOST], row[DISK])
    }

    /// Ranks with a match on some tier.
    pub(super) fn touched(&self) -> &[Slot] {
        &self.touched
    }

    /// The route's buffers, empty, until [`RouteScratch::finish`] hands them back.
    pub(super) fn take_buffers(&mut self) -> RouteBuffers {
        std::mem::take(&mut self.buffers)
    }

    /// Ends a route: its rows go stale at once, and the buffers the route took are kept.
    pub(super) fn finish(&mut self, mut buffers: RouteBuffers) {
        // Wrapping to 0 makes the next `prepare` clear every row.
        self.route = self.route.wrapping_add(1);
        self.touched.clear();
        self.deepest = [0; 4];
        buffers.excluded.clear();
        buffers.views.clear();
        buffers.owner_order.clear();
        self.buffers = buffers;
    }

    /// Brings the pools up to date for a route at `now`.
    pub(super) fn sync_pools(&mut self, workers: &mut Workers, config: &PolicyConfig, now: u64) {
        workers.take_changed(&mut self.changed);
        self.pools.sync(workers, config, now, &self.changed);
        self.changed.clear();
    }
}

/// A Fenwick tree of member counts over slots.
#[derive(Debug, Default, Clone)]
struct Counts {
    /// 1-based; `tree.len() - 1` is a power of two.
    tree: Vec<u32>,
    total: usize,
}

impl Counts {
    fn add(&mut self, slot: Slot, cap: usize, up: bool) {
        if self.tree.len() != cap + 1 {
            self.tree.resize(cap + 1, 0);
        }
        let mut i = slot as usize + 1;
        while i <= cap {
            if up {
                self.tree[i] += 1;
            } else {
                self.tree[i] -= 1;
            }
            i += i & i.wrapping_neg();
        }
        if up {
            self.total += 1;
        } else {
            self.total -= 1;
        }
    }

    fn node(&self, i: usize) -> u32 {
        self.tree.get(i).copied().unwrap_or(0)
    }
}

/// Which members one request may use, as indexes into [`Pools::trees`]: the whole fleet for a
/// request without a model; ranks without a declared model plus those of the model otherwise.
#[derive(Debug, Clone, Copy)]
pub(super) struct Classes(usize, Option<usize>);

const ALL: usize = 0;
const NO_MODEL: usize = 1;

/// One rank's membership: a bit per [`Pool`] and its model class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Member {
    pools: u8,
    class: usize,
}

fn bit(pool: Pool) -> u8 {
    match pool {
        Pool::Candidates => 1,
        Pool::Cool => 2,
        Pool::Safe => 4,
    }
}

const POOLS: [Pool; 3] = [Pool::Candidates, Pool::Cool, Pool::Safe];

/// The fleet's pools. Invariant (after [`Pools::sync`] at `now`): a rank is counted in a pool
/// exactly when [`Pool::admits`] its view at `now`, leaving aside exclusion and model, which
/// a route applies itself.
#[derive(Debug, Default)]
pub(super) struct Pools {
    built: bool,
    /// Slots the trees cover: a power of two.
    cap: usize,
    members: Vec<Member>,
    /// Model name → its class (2 and up).
    models: FxHashMap<String, usize>,
    /// Per class ([`ALL`], [`NO_MODEL`], then one per model), one count tree per pool.
    trees: Vec<[Counts; 3]>,
    /// (time its telemetry turns stale, slot) for ranks counted with fresh telemetry. Entries
    /// that no longer apply are harmless: a rank is only ever recounted from its current state.
    stale_at: BinaryHeap<Reverse<(u64, Slot)>>,
    /// The deadline queued for each slot, so a rank is queued once per sample.
    queued: Vec<u64>,
    last_now: u64,
}

impl Pools {
    /// Drops everything: the next sync recounts the fleet (settings changed, or a snapshot).
    pub(super) fn invalidate(&mut self) {
        self.built = false;
    }

    fn sync(&mut self, workers: &Workers, config: &PolicyConfig, now: u64, changed: &[Slot]) {
        // Staleness only ever sets in as time passes; if time went back, recount.
        if !self.built || now < self.last_now {
            self.rebuild(workers, config, now);
            return;
        }
        self.last_now = now;
        for &slot in changed {
            self.refresh(slot, workers, config, now);
        }
        while let Some(&Reverse((stale, slot))) = self.stale_at.peek() {
            if stale >= now {
                break;
            }
            self.stale_at.pop();
            if self.queued[slot as usize] == stale {
                self.queued[slot as usize] = u64::MAX;
            }
            self.refresh(slot, workers, config, now);
        }
    }

    fn rebuild(&mut self, workers: &Workers, config: &PolicyConfig, now: u64) {
        *self = Pools {
            built: true,
            cap: workers.slot_count().next_power_of_two().max(64),
            last_now: now,
            ..Pools::default()
        };
        self.trees = vec![Default::default(), Default::default()];
        self.members = vec![Member::default(); self.cap];
        self.queued = vec![u64::MAX; self.cap];
        for slot in 0..workers.slot_count() {
            self.refresh(slot as Slot, workers, config, now);
        }
    }

    /// Recounts one rank from its current state.
    fn refresh(&mut self, slot: Slot, workers: &Workers, config: &PolicyConfig, now: u64) {
        if slot as usize >= self.cap {
            self.grow(slot as usize + 1);
        }
        let mut want = Member::default();
        if let Some(w) = workers.get(slot).filter(|w| w.state == WorkerState::Active) {
            let max_age = config.telemetry_max_age_ms;
            let pressure =
                config.ranked_pressure(w.fresh_pressure(now, max_age), w.reserved_prefill);
            want.pools = bit(Pool::Candidates);
            if pressure.is_none_or(|p| p <= config.high_water) {
                want.pools |= bit(Pool::Cool);
            }
            if pressure.is_some_and(|p| p <= config.high_water) {
                want.pools |= bit(Pool::Safe);
            }
            want.class = match &w.model {
                None => NO_MODEL,
                Some(m) => match self.models.get(m) {
                    Some(&c) => c,
                    None => {
                        let c = self.trees.len();
                        self.trees.push(Default::default());
                        self.models.insert(m.clone(), c);
                        c
                    }
                },
            };
            if let Some(t) = w.telemetry.filter(|_| pressure.is_some()) {
                let stale = t.received_ms.saturating_add(max_age);
                if self.queued[slot as usize] != stale {
                    self.queued[slot as usize] = stale;
                    self.stale_at.push(Reverse((stale, slot)));
                }
            }
        }
        let had = self.members[slot as usize];
        if had == want {
            return;
        }
        self.count(slot, had, false);
        self.count(slot, want, true);
        self.members[slot as usize] = want;
    }

    fn count(&mut self, slot: Slot, member: Member, up: bool) {
        for (p, pool) in POOLS.iter().enumerate() {
            if member.pools & bit(*pool) != 0 {
                self.trees[ALL][p].add(slot, self.cap, up);
                self.trees[member.class][p].add(slot, self.cap, up);
            }
        }
    }

    fn grow(&mut self, slots: usize) {
        let members = std::mem::take(&mut self.members);
        self.cap = slots.next_power_of_two();
        self.members = vec![Member::default(); self.cap];
        self.queued.resize(self.cap, u64::MAX);
        for trees in &mut self.trees {
            *trees = Default::default();
        }
        for (slot, m) in members.into_iter().enumerate() {
            self.count(slot as Slot, m, true);
            self.members[slot] = m;
        }
    }

    /// The classes a request for `model` may use.
    pub(super) fn classes(&self, model: Option<&str>) -> Classes {
        match model {
            None => Classes(ALL, None),
            Some(m) => Classes(NO_MODEL, self.models.get(m).copied()),
        }
    }

    fn is_member(&self, slot: Slot, pool: Pool, classes: Classes) -> bool {
        let Some(m) = self.members.get(slot as usize) else {
            return false;
        };
        m.pools & bit(pool) != 0
            && (classes.0 == ALL || m.class == classes.0 || Some(m.class) == classes.1)
    }

    fn total(&self, pool: Pool, classes: Classes) -> usize {
        let p = pool_index(pool);
        self.trees[classes.0][p].total + classes.1.map_or(0, |c| self.trees[c][p].total)
    }

    /// The `k`-th (from 0) member in slot order: a descent of the Fenwick tree (two trees
    /// summed for a model's request).
    fn select(&self, pool: Pool, classes: Classes, k: usize) -> Slot {
        let p = pool_index(pool);
        let a = &self.trees[classes.0][p];
        let b = classes.1.map(|c| &self.trees[c][p]);
        debug_assert!(k < self.total(pool, classes), "the k-th of fewer members");
        // The whole tree (node `cap`) holds more than `k` members, so the descent starts one
        // level down. Whether a step is taken is a coin flip to the branch predictor, so it is
        // taken by masking, without a branch.
        let mut pos = 0;
        let mut rest = k as u32;
        let mut step = self.cap >> 1;
        while step > 0 {
            let next = pos + step;
            let here = a.node(next) + b.map_or(0, |b| b.node(next));
            let take = usize::from(here <= rest).wrapping_neg();
            pos += step & take;
            rest -= here & take as u32;
            step >>= 1;
        }
        pos as Slot
    }
}

fn pool_index(pool: Pool) -> usize {
    POOLS.iter().position(|&p| p == pool).expect("every pool")
}

/// The fleet as one route sees it: the pools less the request's excluded ranks, limited to the
/// model it asks for.
pub(super) struct RouteFleet<'a> {
    pub(super) pools: &'a Pools,
    pub(super) classes: Classes,
    /// Excluded ranks, ascending.
    pub(super) excluded: &'a [Slot],
    pub(super) view: &'a dyn Fn(Slot) -> WorkerView,
}

impl RouteFleet<'_> {
    /// The members of `pool` among the excluded ranks and `minus`, ascending, each once.
    fn left_out(&self, pool: Pool, minus: &[Slot]) -> SmallVec<[Slot; 8]> {
        if self.excluded.is_empty() && minus.is_empty() {
            return SmallVec::new();
        }
        let mut out: SmallVec<[Slot; 8]> = self
            .excluded
            .iter()
            .chain(minus)
            .copied()
            .filter(|&s| self.pools.is_member(s, pool, self.classes))
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

impl Fleet for RouteFleet<'_> {
    fn count(&self, pool: Pool, minus: &[Slot]) -> usize {
        self.pools.total(pool, self.classes) - self.left_out(pool, minus).len()
    }

    fn nth(&self, pool: Pool, k: usize, minus: &[Slot]) -> Slot {
        let left_out = self.left_out(pool, minus);
        // The k-th member after skipping left-out ones: select k + (left-out members up to the
        // answer) until that count stops changing.
        let mut skipped = 0;
        loop {
            let slot = self.pools.select(pool, self.classes, k + skipped);
            let up_to = left_out.partition_point(|&s| s <= slot);
            if up_to == skipped {
                return slot;
            }
            skipped = up_to;
        }
    }

    fn view(&self, slot: Slot) -> WorkerView {
        (self.view)(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One route's walk: `owners` of each key in turn, on the device tier.
    fn walk(scratch: &mut RouteScratch, keys: &[&[Slot]]) {
        scratch.prepare(8);
        for (i, owners) in keys.iter().enumerate() {
            if !scratch.extend::<DEVICE>(i, owners.iter().copied()) {
                break;
            }
        }
    }

    #[test]
    fn only_ranks_matching_a_first_key_are_listed_and_each_tier_counts_on_its_own() {
        let mut scratch = RouteScratch::default();
        scratch.prepare(8);
        let device: [&[Slot]; 3] = [&[1], &[1, 3], &[1, 1]];
        for (i, owners) in device.iter().enumerate() {
            assert!(scratch.extend::<DEVICE>(i, owners.iter().copied()));
        }
        let host: [&[Slot]; 2] = [&[2, 1], &[2]];
        for (i, owners) in host.iter().enumerate() {
            assert!(scratch.extend::<HOST>(i, owners.iter().copied()));
        }
        assert!(
            !scratch.extend::<DISK>(0, [].into_iter()),
            "a key nobody holds ends the walk"
        );
        assert_eq!(
            scratch.depths(1),
            (3, 1, 0),
            "rank 1: three device keys (one listed twice), the first host key only"
        );
        assert_eq!(
            scratch.depths(2),
            (0, 2, 0),
            "rank 2 is met on the host tier"
        );
        assert_eq!(
            scratch.depths(3),
            (0, 0, 0),
            "rank 3 holds the second key without the first: no match"
        );
        assert_eq!(
            scratch.touched(),
            &[1, 2],
            "each rank with a match is listed once; rank 3 never is"
        );
        assert_eq!(scratch.deepest[DEVICE], 3, "the device walk reached key 3");
        assert_eq!(scratch.deepest[HOST], 2, "the host walk reached key 2");
    }

    #[test]
    fn a_draw_finds_the_kth_member_in_slot_order_up_to_the_last_slot() {
        let cap = 16;
        let mut pools = Pools {
            cap,
            trees: vec![Default::default(); 3],
            members: vec![Member::default(); cap],
            ..Pools::default()
        };
        // Slots 0 and 15 (the first and last the trees cover) without a model, 4 and 9 of
        // model class 2, 6 of another class that neither request below may use but the
        // whole fleet.
        let members = [(0, NO_MODEL), (4, 2), (6, 3), (9, 2), (15, NO_MODEL)];
        pools.trees.push(Default::default());
        for (slot, class) in members {
            let member = Member {
                pools: bit(Pool::Candidates),
                class,
            };
            pools.count(slot, member, true);
            pools.members[slot as usize] = member;
        }
        let drawn = |classes: Classes| -> Vec<Slot> {
            (0..pools.total(Pool::Candidates, classes))
                .map(|k| pools.select(Pool::Candidates, classes, k))
                .collect()
        };
        assert_eq!(
            drawn(Classes(ALL, None)),
            [0, 4, 6, 9, 15],
            "every member of the fleet, in slot order"
        );
        assert_eq!(
            drawn(Classes(NO_MODEL, Some(2))),
            [0, 4, 9, 15],
            "a model's request draws from two trees summed: no model, and its own"
        );
        assert_eq!(
            pools.total(Pool::Cool, Classes(ALL, None)),
            0,
            "a member counts only in its own pools"
        );
    }

    #[test]
    fn a_finished_routes_depths_read_as_zero_in_later_routes_also_past_the_counters_wrap() {
        let mut scratch = RouteScratch::default();
        walk(&mut scratch, &[&[1, 2], &[1]]);
        assert_eq!(scratch.depths(1), (2, 0, 0), "rank 1 matched both keys");
        assert_eq!(scratch.touched(), &[1, 2]);
        scratch.finish(RouteBuffers::default());
        // As if 2^32 - 3 routes that never met rank 1 went by: the counter is about to come
        // back to the number rank 1's row carries.
        scratch.route = u32::MAX;
        for _ in 0..3 {
            walk(&mut scratch, &[&[2]]);
            assert_eq!(
                scratch.depths(1),
                (0, 0, 0),
                "a depth of an earlier route never leaks into a later one"
            );
            assert_eq!(
                scratch.depths(2),
                (1, 0, 0),
                "rank 2 starts over at the first key"
            );
            assert_eq!(
                scratch.touched(),
                &[2],
                "only this route's matches are listed"
            );
            scratch.finish(RouteBuffers::default());
        }
    }
}
