//! What goes into the routing core and what comes out of it.
//!
//! Every input is already parsed, validated and hashed (token ids turned into local block
//! hashes) by the adapter that received it; the core only folds it into state. Inputs are
//! serializable because they are exactly what the journal stores.

use std::fmt;

use serde::{Deserialize, Serialize};
use smol_str::SmolStr;

/// A worker id: 1 to 128 characters from `A-Z a-z 0-9 _ - :` (docs/architecture.md, "Wire
/// contract"). No dots, because a worker id is one NATS subject token.
///
/// Ordered as its text. The id's first 16 bytes, zero-padded, are kept beside it as two
/// big-endian numbers and compared first: ids never hold a zero byte, so those numbers order as
/// the text does, and sorting a route's owners (hundreds when a prefix is shared by a large fleet)
/// compares integers, not strings. Ids of up to 23 bytes are stored inline and longer ones
/// shared, so a decision copies its owners' ids without touching the heap.
///
/// `repr(C)` keeps the fields in the order written, the name after the prefix, so that a clone
/// moves into its place in the same pieces it was put together in. In the order the compiler
/// chose (the name first), each owner id a decision copied into its reply was reloaded in a
/// 16-byte piece that spanned two smaller stores, which the processor cannot forward to a load:
/// a stall per owner, a fifth of the route's own time in a profile of 256-worker decisions.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
#[repr(C)]
pub struct WorkerId {
    /// Field order matters: the derived order compares `prefix` first.
    prefix: [u64; 2],
    name: SmolStr,
}

/// Longest accepted worker id, in characters.
pub const MAX_WORKER_ID_LEN: usize = 128;

/// Longest name accepted, in bytes, for the model and LoRA names the core keeps (a LoRA name,
/// `Kv-Model`, a load sample's or lifecycle message's `model`, a route's `model` and `lora`):
/// each becomes a namespace or a worker's model, so a hostile publisher or caller must not be
/// able to make the core hold or journal megabytes of them.
pub const MAX_NAME_LEN: usize = 256;

impl WorkerId {
    pub fn new(id: &str) -> Result<Self, InvalidWorkerId> {
        let valid_len = !id.is_empty() && id.len() <= MAX_WORKER_ID_LEN;
        let valid_chars = id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b':'));
        if valid_len && valid_chars {
            let mut prefix = [0u8; 16];
            let n = id.len().min(16);
            prefix[..n].copy_from_slice(&id.as_bytes()[..n]);
            let prefix = u128::from_be_bytes(prefix);
            Ok(WorkerId {
                // Two halves rather than one u128, which would align the id to 16 bytes.
                prefix: [(prefix >> 64) as u64, prefix as u64],
                name: SmolStr::new(id),
            })
        } else {
            Err(InvalidWorkerId(
                id.chars().take(MAX_WORKER_ID_LEN + 8).collect(),
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.name
    }
}

impl fmt::Debug for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.name, f)
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

impl TryFrom<String> for WorkerId {
    type Error = InvalidWorkerId;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        WorkerId::new(&s)
    }
}

impl From<WorkerId> for String {
    fn from(id: WorkerId) -> String {
        id.name.to_string()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid worker id {0:?}: expected 1 to 128 characters from A-Z a-z 0-9 _ - :")]
pub struct InvalidWorkerId(pub String);

/// Why an input (or part of one) was not applied. The set is closed so that
/// `kvrouted_inputs_rejected_total{reason}` has bounded labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectReason {
    /// Not MessagePack (or not JSON), or the wrong shape at the top level.
    MalformedPayload,
    /// An event tag that is not `BlockStored`, `BlockRemoved` or `AllBlocksCleared`.
    UnknownEventTag,
    /// A required field is missing or has the wrong type or range.
    InvalidField,
    /// `token_ids` does not hold `block_size` tokens for every block hash.
    TokenCountMismatch,
    /// An event's block size differs from the model's configured block size.
    BlockSizeMismatch,
    /// A load value that is NaN, infinite or out of range.
    InvalidLoadValue,
    /// A worker id (subject token) that breaks the naming rule.
    InvalidWorkerId,
    /// A payload above the size limit.
    OversizePayload,
    /// A lifecycle `op` other than join, drain, leave.
    UnknownLifecycleOp,
    /// A `Kv-Seq` or `Kv-Dp-Rank` header that is not a decimal integer.
    InvalidHeader,
    /// A `Kv-Seq` more than [`MAX_SEQ_JUMP`] ahead of the last applied one of its (worker, dp
    /// rank, epoch): a corrupt or hostile sequence that would make every later batch look like a
    /// duplicate. The batch is not applied and the sequence does not advance.
    SeqJump,
    /// A message from a new worker while `--max-workers` workers are known: the worker is not
    /// created; workers already known are unaffected.
    WorkerLimit,
    /// A new (model, LoRA) namespace while `--max-models` exist: what needed it is not applied.
    ModelLimit,
}

/// The largest forward jump of `Kv-Seq` within one epoch that is believed: a million batches
/// is minutes of a busy engine's events, far more than any broker or bridge outage loses
/// while the publisher keeps its epoch. A larger jump is rejected ([`RejectReason::SeqJump`]).
pub const MAX_SEQ_JUMP: u64 = 1_000_000;

impl RejectReason {
    pub const ALL: [RejectReason; 13] = [
        RejectReason::MalformedPayload,
        RejectReason::UnknownEventTag,
        RejectReason::InvalidField,
        RejectReason::TokenCountMismatch,
        RejectReason::BlockSizeMismatch,
        RejectReason::InvalidLoadValue,
        RejectReason::InvalidWorkerId,
        RejectReason::OversizePayload,
        RejectReason::UnknownLifecycleOp,
        RejectReason::InvalidHeader,
        RejectReason::SeqJump,
        RejectReason::WorkerLimit,
        RejectReason::ModelLimit,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::MalformedPayload => "malformed_payload",
            RejectReason::UnknownEventTag => "unknown_event_tag",
            RejectReason::InvalidField => "invalid_field",
            RejectReason::TokenCountMismatch => "token_count_mismatch",
            RejectReason::BlockSizeMismatch => "block_size_mismatch",
            RejectReason::InvalidLoadValue => "invalid_load_value",
            RejectReason::InvalidWorkerId => "invalid_worker_id",
            RejectReason::OversizePayload => "oversize_payload",
            RejectReason::UnknownLifecycleOp => "unknown_lifecycle_op",
            RejectReason::InvalidHeader => "invalid_header",
            RejectReason::SeqJump => "seq_jump",
            RejectReason::WorkerLimit => "worker_limit",
            RejectReason::ModelLimit => "model_limit",
        }
    }
}

/// A typed rejection: the bounded reason for metrics plus a one-line detail for logs and HTTP.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{detail}")]
pub struct Rejection {
    pub reason: RejectReason,
    pub detail: String,
}

impl Rejection {
    pub fn new(reason: RejectReason, detail: impl Into<String>) -> Self {
        Rejection {
            reason,
            detail: detail.into(),
        }
    }
}

/// Where a block lives on the worker. Only `Gpu` is device ownership; the others are lower
/// tiers, tracked apart and never mixed with device ownership.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Medium {
    Gpu,
    /// Host memory: `CPU`, `CPU_PINNED`.
    Host,
    /// `DISK`, `STORAGE`, `FS`, `OBJ`, `EXTERNAL` and any unknown medium string.
    #[serde(alias = "Other")]
    Disk,
}

impl Medium {
    /// The tier a medium string names: `GPU` the device, `CPU` and `CPU_PINNED` host memory,
    /// anything else (`DISK`, `STORAGE`, `FS`, `OBJ`, `EXTERNAL`, unknown) disk.
    pub fn from_name(name: &str) -> Medium {
        if name.eq_ignore_ascii_case("GPU") {
            Medium::Gpu
        } else if name.eq_ignore_ascii_case("CPU") || name.eq_ignore_ascii_case("CPU_PINNED") {
            Medium::Host
        } else {
            Medium::Disk
        }
    }
}

fn default_true() -> bool {
    true
}

/// One block of a `BlockStored` event, already hashed by the adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    /// The engine's own (opaque) hash, used by later removals and as a parent reference.
    pub engine_hash: u64,
    /// [`crate::hashing::local_hash`] of the block's tokens.
    pub local: u64,
}

/// One KV cache event, in the engine-neutral form the core applies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum KvEvent {
    Stored {
        /// Engine hash of the block before the first one; unknown parents start a new chain.
        parent: Option<u64>,
        blocks: Vec<StoredBlock>,
        block_size: u32,
        /// LoRA adapter name; each (model, LoRA) pair is its own namespace.
        lora: Option<String>,
        medium: Medium,
        /// False when the event's `kv_cache_spec_kind` names a kind other than full attention
        /// (sliding window, mamba, ...): accepted, counted as ignored, not ownership.
        #[serde(default = "default_true")]
        full_attention: bool,
    },
    Removed {
        engine_hashes: Vec<u64>,
        medium: Medium,
    },
    Cleared,
}

/// A KV event batch from one worker (`kv.events.<worker>`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvEventBatch {
    pub worker: WorkerId,
    /// `Kv-Model` header; falls back to the model the worker declared.
    pub model: Option<String>,
    /// Data-parallel rank (`Kv-Dp-Rank` header or the batch's own field); 0 when absent.
    pub dp_rank: u32,
    /// `Kv-Seq` publisher sequence; batches without one apply in arrival order.
    pub seq: Option<u64>,
    pub events: Vec<KvEvent>,
    /// `Kv-Epoch`: the publisher's incarnation (1–64 chars). A new epoch means the engine
    /// restarted. None = no header.
    ///
    /// Last, because the journal writes structs as arrays: a batch journaled before this field
    /// existed ends after `events` and still reads, with no epoch.
    #[serde(default)]
    pub epoch: Option<String>,
}

impl KvEventBatch {
    /// A batch of `events` from `worker` without headers: no model, dp rank 0, no `Kv-Seq`.
    pub fn of(worker: WorkerId, events: Vec<KvEvent>) -> KvEventBatch {
        KvEventBatch {
            worker,
            model: None,
            dp_rank: 0,
            seq: None,
            epoch: None,
            events,
        }
    }

    /// A batch of one `BlockStored` of GPU blocks without LoRA: the plain store that benches,
    /// tests and the simulator build.
    pub fn stored(
        worker: WorkerId,
        parent: Option<u64>,
        blocks: Vec<StoredBlock>,
        block_size: u32,
    ) -> KvEventBatch {
        KvEventBatch::of(
            worker,
            vec![KvEvent::Stored {
                parent,
                blocks,
                block_size,
                lora: None,
                medium: Medium::Gpu,
                full_attention: true,
            }],
        )
    }
}

/// Largest `running`, `waiting` or `max_running` a load sample may carry: no engine rank runs
/// or queues a million requests, so a larger count is a broken or hostile publisher, rejected
/// (`invalid_load_value`) rather than ranked. It bounds the queue part of pressure at
/// 2,000,000.
pub const MAX_LOAD_COUNT: u32 = 1_000_000;

/// A load sample (`kv.load.<worker>`), validated: `kv_usage` is finite and within 0..=1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadSample {
    pub worker: WorkerId,
    pub kv_usage: f64,
    pub running: u32,
    pub waiting: u32,
    pub max_running: Option<u32>,
    pub model: Option<String>,
    /// `Kv-Dp-Rank` header; 0 when absent.
    #[serde(default)]
    pub dp_rank: u32,
}

impl LoadSample {
    /// Pressure = max(kv_usage, (running + waiting) / max_running when max_running > 0).
    pub fn pressure(&self) -> f64 {
        let queue = match self.max_running {
            Some(max) if max > 0 => (self.running as f64 + self.waiting as f64) / max as f64,
            _ => 0.0,
        };
        self.kv_usage.max(queue)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LifecycleOp {
    Join,
    Drain,
    Leave,
}

/// A lifecycle message (`kv.workers.<worker>`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lifecycle {
    pub worker: WorkerId,
    pub op: LifecycleOp,
    pub model: Option<String>,
    pub block_size: Option<u32>,
    pub capacity_blocks: Option<u64>,
    #[serde(default)]
    pub dp_size: Option<u32>,
    /// The engine incarnation the worker's ranks run (the bridge sends the epoch it publishes
    /// with). A join with the epoch the ranks already have is a re-announcement: clears nothing.
    #[serde(default)]
    pub epoch: Option<String>,
}

/// A routing request, reduced to what the decision needs (tokens are already block keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteRequest {
    pub model: Option<String>,
    pub lora: Option<String>,
    pub keys: Vec<u64>,
    pub prompt_tokens: u64,
    pub max_output_tokens: Option<u64>,
    pub exclude: Vec<WorkerId>,
    pub request_id: Option<String>,
    pub explain: bool,
}

/// Everything the state machine applies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Input {
    KvEvents(KvEventBatch),
    Load(LoadSample),
    Lifecycle(Lifecycle),
    Route(RouteRequest),
    Release {
        reservation: u64,
        /// `prefill`: give back the prefill part only (the first token was produced); none:
        /// all of it. Journals written before phases existed decode as none.
        #[serde(default)]
        phase: Option<crate::reservations::ReleasePhase>,
    },
    /// Periodic housekeeping: worker age-out and expiry of reservations and records.
    Tick,
    /// The daemon came back up: every known worker gets a fresh `worker_ttl` to be heard from,
    /// because time the daemon was down does not count against workers.
    Resume,
    /// The daemon started with these settings. Journaled so a replay decides with the settings
    /// that were in force, and can override them for a counterfactual.
    Configure(Box<crate::router::RouterConfig>),
    /// What a peer replica decided or released: applied as effects only (no decision of its
    /// own, no event for peers), so replicas agree on approximate owners, spill cooldowns and
    /// reserved work. Journaled like any input, so replay is exact.
    Peer(Box<crate::replicas::PeerEvent>),
}

impl Input {
    /// Short name of the input kind, for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Input::KvEvents(_) => "kv_events",
            Input::Load(_) => "load",
            Input::Lifecycle(_) => "lifecycle",
            Input::Route(_) => "route",
            Input::Release { .. } => "release",
            Input::Tick => "tick",
            Input::Resume => "resume",
            Input::Configure(_) => "configure",
            Input::Peer(_) => "peer",
        }
    }
}

/// An input as journaled: its sequence number and the daemon clock when it was applied.
/// The sequence number also seeds the decision's random choices, so replay is exact.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stamped {
    pub seq: u64,
    /// Milliseconds on the daemon's clock (Unix epoch).
    pub at_ms: u64,
    pub input: Input,
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::WorkerId;

    proptest! {
        #[test]
        fn worker_ids_order_and_compare_as_their_text(
            a in "[A-Za-z0-9_:-]{1,24}",
            b in "[A-Za-z0-9_:-]{1,24}",
            shared in "[a-z]{0,20}",
        ) {
            // A shared start makes ties of the 16-byte prefix common.
            let (a, b) = (format!("{shared}{a}"), format!("{shared}{b}"));
            let (x, y) = (WorkerId::new(&a).unwrap(), WorkerId::new(&b).unwrap());
            prop_assert_eq!(x.cmp(&y), a.cmp(&b), "an id orders as its text");
            prop_assert_eq!(x == y, a == b, "ids are equal exactly when their text is");
        }
    }

    #[test]
    fn a_worker_id_keeps_its_prefix_before_its_name() {
        // The layout a clone's pieces line up in (see `WorkerId`): a change of field order or
        // representation would bring back the stalled reload of each owner id a route copies.
        assert_eq!(
            (
                std::mem::offset_of!(WorkerId, prefix),
                std::mem::offset_of!(WorkerId, name),
                std::mem::size_of::<WorkerId>(),
            ),
            (0, 16, 40),
            "a worker id is its 16-byte prefix followed by its 24-byte name"
        );
    }

    #[test]
    fn a_shorter_id_sorts_before_its_extensions() {
        let mut ids: Vec<WorkerId> = [
            "w10",
            "w1",
            "w1-",
            "w1000000000000000",
            "w100000000000000",
            "W1",
        ]
        .iter()
        .map(|s| WorkerId::new(s).unwrap())
        .collect();
        ids.sort();
        let sorted: Vec<&str> = ids.iter().map(WorkerId::as_str).collect();
        assert_eq!(
            sorted,
            [
                "W1",
                "w1",
                "w1-",
                "w10",
                "w100000000000000",
                "w1000000000000000"
            ],
            "ids sort as their text, also past the 16-byte prefix"
        );
    }
}
