//! What a route needs besides the index, kept so that its cost follows the matched owners and
//! the sampled candidates, not the size of the fleet:
//!
//! - [`RouteScratch`]: one [`RankRow`] per rank, reused from route to route: the rank's depths
//!   on each tier (each row names the route it was written for, and a row of an earlier route
//!   reads as zero, so ending a route resets nothing) beside a copy of what the policy reads of
//!   its worker entry, in one cache line; and each rank's worker id, in a table of its own.
//! - [`Pools`]: the fleet's candidate pools (candidates, cool, safe; docs/architecture.md,
//!   "Policy") as order-statistic trees over slots, one per model, updated for each rank that
//!   changed (the worker table notes them) and for each rank whose telemetry went stale. A
//!   power-of-two draw then finds the k-th member in slot order without a scan, the same member a
//!   scan of every worker finds, so decisions (and old journals' replays) are unchanged. The
//!   same updates keep the rows' copies current.
//!
//! Neither is part of the router's state: both are rebuilt from it when needed.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Range;

use rand_chacha::rand_core::block::BlockRng;
use rand_chacha::ChaCha8Core;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use super::owner_order::OwnerOrder;
use crate::index::{extend_match, Slot};
use crate::input::WorkerId;
use crate::policy::{Fleet, PolicyConfig, Pool, WorkerView};
use crate::workers::{Worker, WorkerState, Workers};

/// Tiers a route walks, as columns of [`RouteScratch`].
pub(super) const DEVICE: usize = 0;
pub(super) const APPROX: usize = 1;
pub(super) const HOST: usize = 2;
pub(super) const DISK: usize = 3;

/// Per-rank rows of one route. Invariants: between routes, no row carries `route` (the next
/// route's number; or it is 0, and the next `prepare` clears every row's depths), so every
/// row's depths read as zero, and `touched` is empty; after [`RouteScratch::sync`] at `now`,
/// the row of every slot of the worker table holds what [`RankRow::refresh`] makes of its
/// entry at `now`, and its name is the entry's id.
#[derive(Debug, Default)]
pub(super) struct RouteScratch {
    rows: Vec<RankRow>,
    /// Each slot's worker id (`None`: a free slot), which a decision copies into its reply for
    /// each owner. Read from the worker entries, a wide decision's owners each cost two cache
    /// lines of an entry 256 bytes long (1 MiB at 4,096 ranks, more than a core's second-level
    /// cache on some hosts); here an id is 40 bytes of a dense table.
    names: Vec<Option<WorkerId>>,
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
    /// The generator of the route's random draws, reseeded by each route that draws (made at
    /// the first draw; boxed, so taking the buffers out moves a pointer, not its 256-byte
    /// buffer).
    pub(super) draws: Option<Box<RouteDraws>>,
}

/// ChaCha8's generator as `ChaCha8Rng` is made of, kept to be reseeded in place.
pub(super) type RouteDraws = BlockRng<ChaCha8Core>;

/// One rank as a route reads it, in one cache line: its depths per tier, valid for the route
/// it names, and a copy of the fields of its worker entry a view is made of. A wide decision
/// views hundreds of ranks: read from the worker entries, each cost two more cache lines
/// besides its depths' (and a line of the id labels), while the walk that writes a rank's
/// depths has already brought this line in.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
#[repr(C, align(64))]
pub(super) struct RankRow {
    depths: [u32; 4],
    route: u32,
    /// [`Workers::id_order`] of the rank.
    pub(super) id_order: u32,
    pub(super) dp_rank: u32,
    /// The `waiting` of its load sample (0 without one).
    pub(super) waiting: u32,
    pub(super) reserved_requests: u32,
    /// Its model's class in the pools ([`Classes`]) while it is active, or [`CLASS_PAST_ROW`].
    class: u16,
    /// [`LIVE`], [`ACTIVE`], [`PRESSURE`].
    flags: u8,
    pub(super) reserved_work: u64,
    pub(super) reserved_prefill: u64,
    /// [`PolicyConfig::ranked_pressure`] of the rank at the last sync, when `flags` holds
    /// [`PRESSURE`].
    pressure: f64,
}

/// [`RankRow::flags`]: the slot holds a rank.
const LIVE: u8 = 1;
/// The rank is active (not draining).
const ACTIVE: u8 = 2;
/// The rank has fresh telemetry, so a ranked pressure.
const PRESSURE: u8 = 4;
/// A class number past what a row holds: whether the rank serves a model is then decided on
/// its worker entry (a fleet would need 65,534 models for it).
const CLASS_PAST_ROW: u16 = u16::MAX;

impl RankRow {
    /// Copies what a view reads of `worker` (`None`: the slot is free), with its id label,
    /// its pools class and its ranked pressure at the time of the sync. The depths stay.
    fn refresh(
        &mut self,
        worker: Option<&Worker>,
        id_order: u32,
        class: usize,
        pressure: Option<f64>,
    ) {
        let Some(w) = worker else {
            self.flags = 0;
            return;
        };
        self.id_order = id_order;
        self.dp_rank = w.dp_rank;
        self.waiting = w.waiting();
        self.reserved_requests = w.reserved_requests;
        self.class = u16::try_from(class).unwrap_or(CLASS_PAST_ROW);
        self.flags = LIVE;
        if w.state == WorkerState::Active {
            self.flags |= ACTIVE;
        }
        if pressure.is_some() {
            self.flags |= PRESSURE;
        }
        self.reserved_work = w.reserved_work;
        self.reserved_prefill = w.reserved_prefill;
        self.pressure = pressure.unwrap_or(0.0);
    }

    /// A row of a live rank labelled `id_order`, and nothing else a view reads: what the owner
    /// order reads of a row (a sync also sets the rank's state, class and load).
    #[cfg(test)]
    pub(super) fn live_labelled(id_order: u32) -> Self {
        RankRow {
            id_order,
            flags: LIVE,
            ..RankRow::default()
        }
    }

    pub(super) fn is_live(&self) -> bool {
        self.flags & LIVE != 0
    }

    pub(super) fn is_active(&self) -> bool {
        self.flags & ACTIVE != 0
    }

    /// The ranked pressure: `None` when the telemetry is missing or stale.
    pub(super) fn pressure(&self) -> Option<f64> {
        (self.flags & PRESSURE != 0).then_some(self.pressure)
    }

    /// Whether the rank serves a request limited to `classes` (an active rank's only);
    /// `None` when its class is past what the row holds.
    pub(super) fn serves(&self, classes: Classes) -> Option<bool> {
        if classes.any_model() {
            return Some(true);
        }
        (self.class != CLASS_PAST_ROW).then(|| classes.admits(usize::from(self.class)))
    }

    /// The depths on each tier, valid for `route`.
    fn depths(&self, route: u32) -> [u32; 4] {
        if self.route == route {
            self.depths
        } else {
            [0; 4]
        }
    }
}

impl RouteScratch {
    /// Makes room for `slots` ranks (rows only ever grow).
    fn cover(&mut self, slots: usize) {
        if self.rows.len() < slots {
            self.rows.resize(slots, RankRow::default());
            self.names.resize(slots, None);
        }
    }

    /// Readies the rows for a route over `slots` ranks.
    pub(super) fn prepare(&mut self, slots: usize) {
        self.cover(slots);
        if self.route == 0 {
            // The first route, or the counter wrapped: no row may claim to be this route's.
            for row in &mut self.rows {
                (row.depths, row.route) = ([0; 4], 0);
            }
            self.route = 1;
        }
    }

    /// Extends each owner's consecutive match on tier `TIER` over `keys`, positions its owners
    /// all hold (one key, or the rest of a run with the same owners: [`OwnerIndex::walk`]): a
    /// depth only grows if it already covers every key before them. Returns whether any rank
    /// still matches, so the walk stops at the first key nobody continues.
    ///
    /// A row is written for this route only when its rank matches a first key, on some tier:
    /// a rank first met further on matched nothing before it and never will on this route, so
    /// every row of the route is a rank with a non-zero depth, listed once in `touched`.
    ///
    /// [`OwnerIndex::walk`]: crate::index::OwnerIndex::walk
    pub(super) fn extend<const TIER: usize>(
        &mut self,
        keys: Range<usize>,
        owners: impl Iterator<Item = Slot>,
    ) -> bool {
        let route = self.route;
        let mut any = false;
        for slot in owners {
            let row = &mut self.rows[slot as usize];
            if row.route != route {
                if keys.start == 0 {
                    let mut depths = [0; 4];
                    depths[TIER] = keys.end as u32;
                    (row.depths, row.route) = (depths, route);
                    self.touched.push(slot);
                    any = true;
                }
                continue;
            }
            // A slot can appear twice for one key (two engine hashes); it still counts once.
            any |= extend_match(&mut row.depths[TIER], &keys);
        }
        if any {
            self.deepest[TIER] = keys.end as u32;
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
        self.rows
            .get(slot as usize)
            .map_or((0, 0, 0), |row| self.depths_of(row))
    }

    /// The depths of a row (as [`RouteScratch::depths`]).
    pub(super) fn depths_of(&self, row: &RankRow) -> (u32, u32, u32) {
        let d = row.depths(self.route);
        (d[DEVICE].max(d[APPROX]), d[HOST], d[DISK])
    }

    /// The row of `slot`, if it holds a live rank.
    pub(super) fn row(&self, slot: Slot) -> Option<&RankRow> {
        self.rows.get(slot as usize).filter(|row| row.is_live())
    }

    /// Every slot's row and name, as the last sync left them.
    pub(super) fn rows_and_names(&self) -> (&[RankRow], &[Option<WorkerId>]) {
        (&self.rows, &self.names)
    }

    /// The worker id of a live rank.
    pub(super) fn name(&self, slot: Slot) -> &WorkerId {
        self.names[slot as usize].as_ref().expect("a live rank")
    }

    /// Whether the owner order's places in id order are up to date with the rows.
    #[cfg(test)]
    pub(super) fn owner_places_current(&self) -> bool {
        self.buffers.owner_order.places_current()
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

    /// Brings the pools and the rows' and names' copies of the worker entries up to date for a
    /// route at `now`.
    pub(super) fn sync(&mut self, workers: &mut Workers, config: &PolicyConfig, now: u64) {
        workers.take_changed(&mut self.changed);
        self.cover(workers.slot_count());
        let copies = RankCopies {
            rows: &mut self.rows,
            names: &mut self.names,
            owner_order: &mut self.buffers.owner_order,
        };
        self.pools.sync(workers, config, now, &self.changed, copies);
        self.changed.clear();
    }

    /// Checks the invariant that [`RouteScratch::sync`] keeps: the row of every slot that has
    /// not changed since copies its worker entry as a refresh at the time of the sync would, and
    /// its name is the entry's id.
    #[cfg(test)]
    pub(super) fn assert_rows_follow(&self, workers: &Workers, config: &PolicyConfig) {
        let now = self.pools.last_now;
        for slot in 0..workers.slot_count() as Slot {
            if workers.has_changed(slot) {
                continue;
            }
            let mut fresh = self.rows[slot as usize];
            let worker = workers.get(slot);
            let class = self.pools.members[slot as usize].class;
            fresh.refresh(
                worker,
                workers.id_order(slot),
                class,
                ranked(worker, config, now),
            );
            assert_eq!(
                self.rows[slot as usize], fresh,
                "the row of slot {slot} copies its worker entry as of the last sync"
            );
            assert_eq!(
                self.names[slot as usize].as_ref(),
                worker.map(|w| &w.id),
                "the name of slot {slot} is its worker's id"
            );
        }
        self.buffers
            .owner_order
            .assert_places_follow(&self.rows, &self.names);
    }
}

/// What a route reads of each rank's worker entry, refreshed together by [`Pools::sync`]: the
/// rows and the names of [`RouteScratch`], and the places in id order its owner order keeps.
struct RankCopies<'a> {
    rows: &'a mut [RankRow],
    names: &'a mut [Option<WorkerId>],
    owner_order: &'a mut OwnerOrder,
}

impl RankCopies<'_> {
    /// Copies what a route reads of `slot`'s entry (`worker`; `None`: the slot is free), with
    /// its id label, its pools class and its ranked pressure.
    fn refresh(
        &mut self,
        slot: Slot,
        worker: Option<&Worker>,
        id_order: u32,
        class: usize,
        pressure: Option<f64>,
    ) {
        // A slot past the rows is one past the table: a rank that left, whose row went with it.
        let Some(row) = self.rows.get_mut(slot as usize) else {
            return;
        };
        let placed = (row.is_live(), row.id_order);
        row.refresh(worker, id_order, class, pressure);
        // Most refreshes follow a reservation or a load sample, which leave the id as it was.
        let name = &mut self.names[slot as usize];
        let id = worker.map(|w| &w.id);
        let renamed = name.as_ref() != id;
        if renamed {
            *name = id.cloned();
        }
        // A rank that joined, left, took another label or another worker's id moves in id
        // order; the same label and id in the same slot does not.
        if renamed || (row.is_live(), row.id_order) != placed {
            self.owner_order.ranks_moved();
        }
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

impl Classes {
    /// Whether a request without a model (every class will do).
    fn any_model(self) -> bool {
        self.0 == ALL
    }

    /// Whether a rank of `class` may serve the request: the one rule the pools' members and
    /// the rows' copies follow.
    fn admits(self, class: usize) -> bool {
        self.any_model() || class == self.0 || Some(class) == self.1
    }
}

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

    /// Recounts the ranks in `changed` and those whose telemetry went stale by `now`, and
    /// refreshes their copies (which cover every slot of `workers`).
    fn sync(
        &mut self,
        workers: &Workers,
        config: &PolicyConfig,
        now: u64,
        changed: &[Slot],
        mut copies: RankCopies,
    ) {
        // Staleness only ever sets in as time passes; if time went back, recount.
        if !self.built || now < self.last_now {
            self.rebuild(workers, config, now, copies);
            return;
        }
        self.last_now = now;
        for &slot in changed {
            self.refresh(slot, workers, config, now, &mut copies);
        }
        while let Some(&Reverse((stale, slot))) = self.stale_at.peek() {
            if stale >= now {
                break;
            }
            self.stale_at.pop();
            if self.queued[slot as usize] == stale {
                self.queued[slot as usize] = u64::MAX;
            }
            self.refresh(slot, workers, config, now, &mut copies);
        }
    }

    fn rebuild(
        &mut self,
        workers: &Workers,
        config: &PolicyConfig,
        now: u64,
        mut copies: RankCopies,
    ) {
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
            self.refresh(slot as Slot, workers, config, now, &mut copies);
        }
        // Copies past the table (kept from a larger one) hold no rank.
        for slot in workers.slot_count()..copies.rows.len() {
            copies.refresh(slot as Slot, None, 0, 0, None);
        }
    }

    /// Recounts one rank from its current state and refreshes its copies.
    fn refresh(
        &mut self,
        slot: Slot,
        workers: &Workers,
        config: &PolicyConfig,
        now: u64,
        copies: &mut RankCopies,
    ) {
        if slot as usize >= self.cap {
            self.grow(slot as usize + 1);
        }
        let worker = workers.get(slot);
        let pressure = ranked(worker, config, now);
        // Every rank with fresh telemetry is queued to go stale (a draining one too: its row
        // shows its pressure).
        if let Some(t) = worker
            .and_then(|w| w.telemetry)
            .filter(|_| pressure.is_some())
        {
            let stale = t.received_ms.saturating_add(config.telemetry_max_age_ms);
            if self.queued[slot as usize] != stale {
                self.queued[slot as usize] = stale;
                self.stale_at.push(Reverse((stale, slot)));
            }
        }
        let mut want = Member::default();
        if let Some(w) = worker.filter(|w| w.state == WorkerState::Active) {
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
        }
        copies.refresh(slot, worker, workers.id_order(slot), want.class, pressure);
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
        m.pools & bit(pool) != 0 && classes.admits(m.class)
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

/// The pressure a rank is ranked by at `now` ([`PolicyConfig::ranked_pressure`] of its fresh
/// telemetry): `None` for a free slot or missing or stale telemetry.
fn ranked(worker: Option<&Worker>, config: &PolicyConfig, now: u64) -> Option<f64> {
    let w = worker?;
    config.ranked_pressure(
        w.fresh_pressure(now, config.telemetry_max_age_ms),
        w.reserved_prefill,
    )
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
mod tests;
