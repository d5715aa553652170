//! Sharing decisions between replicas: the effects a route records (shared by local routes and
//! peers' ones), the events a replica publishes for its own routes and releases, and applying
//! its peers' events.
//!
//! A peer's event is applied as effects only: no decision is taken and no event comes out, so
//! events never echo between replicas. After every replica has applied every other's events,
//! they hold the same approximate owners, the same provisional owner for each spilled prefix
//! and the same reserved work.

use std::collections::VecDeque;

use super::*;
use crate::replicas::{self, PeerEvent, PeerEventKind, PeerRoute};
use crate::reservations::ReleasePhase;

/// Most peer replicas tracked; events from more replica ids are rejected, so a hostile or
/// mistyped publisher cannot grow the state without bound.
pub const MAX_PEER_REPLICAS: usize = 1024;

/// Most remembered releases of reservations not known yet (see [`PeerState`]); the oldest is
/// forgotten first.
pub const MAX_EARLY_RELEASES: usize = 65_536;

/// How far a peer's event may arrive behind newer ones of the same peer and still be applied:
/// a publisher retries a decision for up to 30s while later ones are stored, so the stream
/// may hold them out of order. Measured on the peer's own clock (`at_ms`), so replay agrees.
pub const PEER_REORDER_WINDOW_MS: u64 = 120_000;

/// Most sequences remembered per peer inside [`PEER_REORDER_WINDOW_MS`]; beyond it the oldest
/// are folded into the floor (a reordered event below the floor is then skipped as a
/// redelivery: it costs one shared decision, never a double count).
pub const MAX_RECENT_PER_PEER: usize = 131_072;

/// What a router knows of its peer replicas.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PeerState {
    /// Per peer, the floor: an event at or below it counts as applied (a redelivery), so a
    /// peer's reserved work is never added twice. Journal sequences start at 1.
    applied_floor: BTreeMap<String, u64>,
    /// Releases of reservations this router has not seen opened yet. Replica B may release
    /// replica A's reservation and tell replica C before A's route reaches C (they travel on
    /// different streams); C remembers the release until the route arrives, or until the
    /// reservation TTL, when the route would have expired anyway. Value: (full release,
    /// forget at ms).
    early_releases: FxHashMap<u64, (bool, u64)>,
    /// (forget at ms, id) in arrival order.
    early_order: VecDeque<(u64, u64)>,
    /// Per peer, the events applied above its floor and inside the reorder window, so one
    /// that arrives after newer ones (a retried publish) is applied, and once only.
    #[serde(default)]
    recent: BTreeMap<String, RecentSeqs>,
}

/// A peer's events applied above its floor (see [`PeerState`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct RecentSeqs {
    /// The newest `at_ms` applied from the peer: the window's end.
    newest_ms: u64,
    /// Sequence → `at_ms` of each event applied above the floor.
    applied: BTreeMap<u64, u64>,
}

impl PeerState {
    /// Whether `seq` (stamped `at_ms` by its peer) from `replica` is new; records it as applied
    /// if so. Events may arrive out of order inside [`PEER_REORDER_WINDOW_MS`]; one further
    /// behind its peer's newest is taken for a redelivery. `None` when the replica would be one
    /// too many to track.
    fn advance(&mut self, replica: &str, seq: u64, at_ms: u64) -> Option<bool> {
        if !self.applied_floor.contains_key(replica) {
            if self.applied_floor.len() >= MAX_PEER_REPLICAS {
                return None;
            }
            self.applied_floor.insert(replica.to_owned(), 0);
        }
        // Keyed by name like the floors; the name is copied only for a peer's first event.
        if !self.recent.contains_key(replica) {
            self.recent
                .insert(replica.to_owned(), RecentSeqs::default());
        }
        let floor = self.applied_floor.get_mut(replica)?;
        let recent = self.recent.get_mut(replica)?;
        // Below the floor, already applied, or too far behind the peer's newest to tell.
        if seq <= *floor
            || recent.applied.contains_key(&seq)
            || at_ms < recent.newest_ms.saturating_sub(PEER_REORDER_WINDOW_MS)
        {
            return Some(false);
        }
        recent.applied.insert(seq, at_ms);
        recent.newest_ms = recent.newest_ms.max(at_ms);
        // Fold what left the window (or overflows it) into the floor, oldest first.
        let window_start = recent.newest_ms.saturating_sub(PEER_REORDER_WINDOW_MS);
        while let Some((&oldest, &oldest_ms)) = recent.applied.first_key_value() {
            if oldest_ms >= window_start && recent.applied.len() <= MAX_RECENT_PER_PEER {
                break;
            }
            recent.applied.pop_first();
            *floor = (*floor).max(oldest);
        }
        Some(true)
    }

    fn remember_release(&mut self, id: u64, phase: Option<ReleasePhase>, forget_ms: u64) {
        let full = phase.is_none();
        if let Some(entry) = self.early_releases.get_mut(&id) {
            entry.0 |= full;
            return;
        }
        if self.early_releases.len() >= MAX_EARLY_RELEASES {
            self.forget_oldest();
        }
        self.early_releases.insert(id, (full, forget_ms));
        self.early_order.push_back((forget_ms, id));
    }

    /// Takes the release remembered for `id`: `Some(true)` a full release, `Some(false)` the
    /// prefill part only.
    fn take_release(&mut self, id: u64) -> Option<bool> {
        self.early_releases.remove(&id).map(|(full, _)| full)
    }

    fn expire(&mut self, now_ms: u64) {
        while self
            .early_order
            .front()
            .is_some_and(|&(at, _)| at <= now_ms)
        {
            self.forget_oldest();
        }
    }

    fn forget_oldest(&mut self) {
        if let Some((at, id)) = self.early_order.pop_front() {
            if self.early_releases.get(&id).is_some_and(|&(_, a)| a == at) {
                self.early_releases.remove(&id);
            }
        }
    }
}

/// The reserved work a route opens.
pub(super) struct Reserve {
    pub id: u64,
    pub work: u64,
    pub prefill: u64,
}

impl Router {
    /// The id of the reservation opened by the route at journal sequence `seq`.
    pub(super) fn reservation_id(&self, seq: u64) -> u64 {
        replicas::reservation_id(
            self.config.reservation_secret.as_ref(),
            &self.config.replica_id,
            seq,
        )
    }

    /// Records what a route did besides its provisional owner, for a local route and a peer's
    /// alike: its reserved work on `slot` (unless `None`) and approximate ownership of `keys` in
    /// namespace `ns` (none: nothing to record under) for `slot`, so the next turn of a trajectory
    /// stays on it before its KV events arrive.
    pub(super) fn record_route_effects(
        &mut self,
        ns: Option<NsId>,
        keys: &[u64],
        slot: Slot,
        reserve: Option<Reserve>,
        now: u64,
    ) {
        if let Some(r) = reserve {
            self.state.reservations.open(
                &mut self.state.workers,
                r.id,
                slot,
                r.work,
                r.prefill,
                now.saturating_add(self.config.reservation_ttl_ms),
            );
        }
        // A zero `approx_ttl` turns approximate ownership off: a record would expire as it is
        // written (a walk counts only records expiring after now), so none is written.
        if let (Some(ns), true) = (ns, self.config.approx_ttl_ms > 0) {
            self.state.approx.record(
                ns,
                keys,
                slot,
                now.saturating_add(self.config.approx_ttl_ms),
            );
        }
    }

    /// The event peers need to follow a local route; none (and nothing copied) when the
    /// router runs alone.
    pub(super) fn route_event(
        &self,
        seq: u64,
        now: u64,
        route: impl FnOnce() -> PeerRoute,
    ) -> Option<Box<PeerEvent>> {
        self.own_event(seq, now, || PeerEventKind::Routed(route()))
    }

    /// An event of this replica's own for its peers, built only when it has peers. A kind made
    /// up front and dropped unused was a copy of the whole enum (as large as a route's effects)
    /// on every release of a router running alone: a sixth of a release's time in the core
    /// bench.
    fn own_event(
        &self,
        seq: u64,
        now: u64,
        kind: impl FnOnce() -> PeerEventKind,
    ) -> Option<Box<PeerEvent>> {
        (!self.config.replica_id.is_empty()).then(|| {
            Box::new(PeerEvent {
                replica: self.config.replica_id.clone(),
                seq,
                at_ms: now,
                kind: kind(),
            })
        })
    }

    /// A release taken here (`POST /v1/release`): gives the work back and, when the
    /// reservation was known, tells the peers, so a release takes effect on every replica
    /// whichever one received it.
    pub(super) fn release(
        &mut self,
        reservation: u64,
        phase: Option<ReleasePhase>,
        seq: u64,
        now: u64,
    ) -> Output {
        let found = self
            .state
            .reservations
            .release(&mut self.state.workers, reservation, phase);
        let peer_event = if found {
            self.own_event(seq, now, || PeerEventKind::Released { reservation, phase })
        } else {
            None
        };
        Output::Released { found, peer_event }
    }

    /// Applies a peer replica's event: its effects only.
    pub(super) fn apply_peer(&mut self, event: &PeerEvent, now: u64) -> PeerReport {
        let mut report = PeerReport::default();
        if !replicas::valid_replica_id(&event.replica) {
            report.rejection = Some(Rejection::new(
                RejectReason::InvalidField,
                format!(
                    "peer event from invalid replica id {:?}: expected 1 to 128 characters \
                     from A-Z a-z 0-9 _ - :",
                    event.replica.chars().take(136).collect::<String>()
                ),
            ));
            return report;
        }
        if event.replica == self.config.replica_id {
            report.own = true;
            return report;
        }
        match self
            .state
            .peers
            .advance(&event.replica, event.seq, event.at_ms)
        {
            None => {
                report.rejection = Some(Rejection::new(
                    RejectReason::InvalidField,
                    format!(
                        "peer event from replica {:?}: already tracking {MAX_PEER_REPLICAS} \
                         replicas",
                        event.replica
                    ),
                ));
                return report;
            }
            Some(false) => {
                report.duplicate = true;
                return report;
            }
            Some(true) => {}
        }
        self.state.peers.expire(now);
        match &event.kind {
            PeerEventKind::Routed(route) => {
                self.apply_peer_route(route, event.at_ms, now, &mut report)
            }
            PeerEventKind::Released { reservation, phase } => {
                report.released =
                    self.state
                        .reservations
                        .release(&mut self.state.workers, *reservation, *phase);
                if !report.released {
                    report.early_release = true;
                    let forget_ms = now.saturating_add(self.config.reservation_ttl_ms);
                    self.state
                        .peers
                        .remember_release(*reservation, *phase, forget_ms);
                }
            }
        }
        report
    }

    fn apply_peer_route(
        &mut self,
        route: &PeerRoute,
        spilled_ms: u64,
        now: u64,
        report: &mut PeerReport,
    ) {
        let Some(slot) = self.state.workers.slot_of(&route.worker, route.dp_rank) else {
            report.unknown_worker = true;
            return;
        };
        let released_early = self.state.peers.take_release(route.reservation);
        report.early_release = released_early.is_some();
        report.reservation_conflict = self.state.reservations.get(route.reservation).is_some();
        let reserve = match released_early {
            _ if report.reservation_conflict => None,
            Some(true) => None,
            // The first token was reported already: only the rest of the work stays reserved.
            Some(false) => Some(Reserve {
                id: route.reservation,
                work: route.work.saturating_sub(route.prefill.min(route.work)),
                prefill: 0,
            }),
            None => Some(Reserve {
                id: route.reservation,
                work: route.work,
                prefill: route.prefill,
            }),
        };
        let known = self
            .state
            .namespaces
            .get(route.model.as_deref(), route.lora.as_deref());
        let ns = self.route_namespace(known, route.model.as_deref(), route.lora.as_deref(), slot);
        self.record_route_effects(ns, &route.keys, slot, reserve, now);
        if let (Some(ns), Some(prefix)) = (ns, route.spilled_prefix) {
            let incoming = ProvisionalOwner { slot, spilled_ms };
            self.merge_provisional(ns, prefix, incoming, now, report);
        }
    }

    /// Records a peer's spill of `prefix`. Inside the cooldown of a spill already recorded
    /// here, the two coalesce: every replica keeps the earlier one (ties: the lower worker id
    /// and rank), so all of them converge on one provisional owner whatever order the events
    /// arrive in, and none spills the prefix again before the cooldown ends.
    fn merge_provisional(
        &mut self,
        ns: NsId,
        prefix: u64,
        incoming: ProvisionalOwner,
        now: u64,
        report: &mut PeerReport,
    ) {
        let cooldown = self.config.policy.spill_cooldown_ms;
        let order = |p: &ProvisionalOwner| {
            let w = self.state.workers.get(p.slot);
            (p.spilled_ms, w.map(|w| w.id.clone()), w.map(|w| w.dp_rank))
        };
        let keep_current = match self.state.provisional.get(&(ns, prefix)) {
            Some(current)
                if now.saturating_sub(current.spilled_ms) < cooldown
                    && self.state.workers.get(current.slot).is_some() =>
            {
                report.coalesced_spill = true;
                order(current) <= order(&incoming)
            }
            _ => false,
        };
        if !keep_current {
            self.state.provisional.insert((ns, prefix), incoming);
        }
    }
}
