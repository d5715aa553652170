//! What comes out of the router: decisions and their explanation, what applying an event did,
//! what housekeeping did, and the rows of `GET /v1/workers`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::input::{Rejection, WorkerId};
use crate::policy::DecisionLabel;
use crate::replicas::PeerEvent;
use crate::workers::WorkerState;

/// A routing decision, as the HTTP API returns it and the journal records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub worker: WorkerId,
    /// The data-parallel rank chosen, when the worker has more than one (a gateway pins it, e.g.
    /// with vLLM's `X-data-parallel-rank` header).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub dp_rank: Option<u32>,
    pub decision: DecisionLabel,
    /// Leading blocks of the prompt the chosen worker rank holds: 0 for a spill to a non-owner,
    /// so reuse is never overstated.
    pub matched_blocks: u32,
    pub prompt_blocks: u32,
    /// Known owners of the matched prefix, by id.
    pub owners: Vec<WorkerId>,
    /// Reservation id to pass to `/v1/release`.
    pub reservation: u64,
    pub request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub explain: Option<Vec<ExplainRow>>,
    /// What peer replicas must apply to agree with this decision (see [`Output::peer_event`]).
    /// Not part of the reply or of the decision stream.
    #[serde(skip)]
    pub peer_event: Option<Box<PeerEvent>>,
}

/// Why a decision came out as it did: one row per known worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExplainRow {
    pub worker: WorkerId,
    /// The rank of this row, when the worker has more than one.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub dp_rank: Option<u32>,
    pub candidate: bool,
    pub state: WorkerState,
    pub depth: u32,
    /// Leading blocks held in host memory and on disk (lower tiers).
    pub host_depth: u32,
    pub disk_depth: u32,
    pub pressure: Option<f64>,
    pub telemetry_age_ms: Option<u64>,
    pub reserved_work: u64,
    /// Its load sample's pressure (`pressure` is what the policy ranked by).
    #[serde(default)]
    pub sample_pressure: Option<f64>,
    /// Reserved prompt tokens whose prefill it has not finished.
    #[serde(default)]
    pub prefill_backlog_tokens: u64,
    /// Blocks a match needed to make owners (min_match_blocks and min_match_ratio of the prompt).
    #[serde(default)]
    pub match_threshold: u32,
    /// The `dynamo_cost` baseline's cost of this worker for the request (candidates only).
    #[serde(default)]
    pub dynamo_cost: Option<f64>,
}

/// What applying a KV event batch, load sample or lifecycle message did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IngestReport {
    /// The worker was not known before this input.
    pub new_worker: bool,
    /// The batch's `Kv-Seq` was at or below the last applied one, or its `Kv-Epoch` is one the
    /// rank already left: skipped.
    pub duplicate: bool,
    /// Batches missed before this one, by `Kv-Seq`.
    pub seq_gap: u64,
    /// The batch started a new epoch (the engine restarted): the rank was cleared first.
    pub new_epoch: bool,
    /// The input came from a worker that left (sticky leave): ignored.
    pub departed: bool,
    /// Device blocks stored and removed (ownership ended).
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    /// Blocks stored and removed on a lower tier (host memory, disk).
    pub lower_tier_stored: u64,
    pub lower_tier_removed: u64,
    /// Blocks of stores whose parent engine hash was unknown: keyed as the start of a chain.
    pub orphan_blocks: u64,
    pub cleared: u64,
    /// Blocks of a group other than full attention (sliding window, mamba): counted, not indexed.
    pub ignored_blocks: u64,
    /// Device blocks a `join` (or a new epoch) cleared.
    pub cleared_blocks: u64,
    /// Workers removed (leave).
    pub removed_workers: Vec<WorkerId>,
    pub rejections: Vec<Rejection>,
}

/// Leading blocks of a prompt a worker rank holds on each lower tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierDepths {
    pub host: u32,
    pub disk: u32,
}

/// What housekeeping did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TickReport {
    pub aged_out: Vec<WorkerId>,
    pub reservations_expired: u64,
}

/// The result of applying one input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Output {
    Ingested(IngestReport),
    Routed(Decision),
    /// No candidate worker: HTTP 503.
    NoCandidate,
    Released {
        found: bool,
        /// The release for peer replicas, when it was found here (see [`Output::peer_event`]).
        #[serde(skip)]
        peer_event: Option<Box<PeerEvent>>,
    },
    Tick(TickReport),
    Resumed {
        workers: usize,
    },
    Configured,
    /// A peer replica's event was applied (effects only).
    Peer(PeerReport),
}

impl Output {
    /// The event this replica must publish to its peers after applying the input: for a route
    /// and for a release found here, unless the router runs alone (no replica id). Inputs that
    /// came from peers never give one, so events do not echo between replicas.
    pub fn peer_event(&self) -> Option<&PeerEvent> {
        match self {
            Output::Routed(decision) => decision.peer_event.as_deref(),
            Output::Released { peer_event, .. } => peer_event.as_deref(),
            _ => None,
        }
    }

    /// A local release's outcome: whether the reservation was known here.
    pub fn released(found: bool) -> Output {
        Output::Released {
            found,
            peer_event: None,
        }
    }
}

/// What applying a peer replica's event did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PeerReport {
    /// The event came from this replica itself (its own stream read back): ignored.
    pub own: bool,
    /// At or below the last sequence applied from that replica (a redelivery): ignored.
    pub duplicate: bool,
    /// The route's worker rank is unknown here (not joined yet, or gone): nothing recorded.
    pub unknown_worker: bool,
    /// A spill of a prefix that already had a provisional owner inside its cooldown: the two
    /// count as one, and every replica keeps the earlier of them.
    pub coalesced_spill: bool,
    /// The route's reservation id is already open here: its work was not added twice.
    pub reservation_conflict: bool,
    /// A release of a reservation known here, whose work was given back.
    pub released: bool,
    /// A release that arrived before the route it releases: remembered, and applied when the
    /// route arrives.
    pub early_release: bool,
    pub rejection: Option<Rejection>,
}

/// One row of `GET /v1/workers`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerRow {
    pub id: WorkerId,
    pub state: WorkerState,
    pub pressure: Option<f64>,
    pub telemetry_age_ms: Option<u64>,
    pub reserved_work: u64,
    pub blocks: u64,
    pub models: BTreeMap<String, u64>,
}
