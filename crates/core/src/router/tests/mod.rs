//! Behaviour of the state machine and the pressure-first policy (docs/architecture.md, "Policy"),
//! one sentence per test.

use super::*;
use crate::hashing::chain_locals;
use crate::input::{LoadSample, StoredBlock};
use crate::policy::{DecisionLabel, PolicyKind};
use crate::reservations::ReleasePhase;

mod baselines;
mod bounds;
mod engines;
mod events;
mod peers;
mod policy;
mod pools;
mod replay;
mod reservations;

const BLOCK: u32 = 4;

/// A router driven by hand: a clock in milliseconds and a journal sequence.
struct Fleet {
    router: Router,
    seq: u64,
    now: u64,
}

fn id(s: &str) -> WorkerId {
    WorkerId::new(s).unwrap()
}

/// A `BlockStored` event of one block (engine hash = local).
fn one_block(local: u64, block_size: u32, medium: Medium) -> KvEvent {
    KvEvent::Stored {
        parent: None,
        blocks: vec![StoredBlock {
            engine_hash: local,
            local,
        }],
        block_size,
        lora: None,
        medium,
        full_attention: true,
    }
}

/// Engine hashes in tests are the keys themselves, xored so they differ from keys.
fn engine(key: u64) -> u64 {
    key ^ 0xE1
}

impl Fleet {
    fn new() -> Self {
        Fleet::with(|_| {})
    }

    fn with(configure: impl FnOnce(&mut RouterConfig)) -> Self {
        let mut config = RouterConfig {
            block_size: BLOCK,
            ..RouterConfig::default()
        };
        configure(&mut config);
        Fleet {
            router: Router::new(config),
            seq: 0,
            now: 1_000_000,
        }
    }

    fn apply(&mut self, input: Input) -> Output {
        self.seq += 1;
        self.router.apply(&Stamped {
            seq: self.seq,
            at_ms: self.now,
            input,
        })
    }

    fn advance(&mut self, ms: u64) {
        self.now += ms;
    }

    /// `worker` reports storing the prompt made of these block locals (a fresh chain).
    fn store(&mut self, worker: &str, locals: &[u64]) {
        let keys = chain_locals(locals.iter().copied());
        let blocks = keys
            .iter()
            .zip(locals)
            .map(|(&k, &local)| StoredBlock {
                engine_hash: engine(k),
                local,
            })
            .collect();
        let out = self.apply(Input::KvEvents(KvEventBatch::stored(
            id(worker),
            None,
            blocks,
            BLOCK,
        )));
        let Output::Ingested(report) = out else {
            panic!("{out:?}")
        };
        assert!(report.rejections.is_empty(), "{:?}", report.rejections);
    }

    /// Applies a KV event batch and returns what it did.
    fn ingest(
        &mut self,
        worker: &str,
        seq: Option<u64>,
        dp_rank: u32,
        events: Vec<KvEvent>,
    ) -> IngestReport {
        let out = self.apply(Input::KvEvents(KvEventBatch {
            worker: id(worker),
            model: None,
            dp_rank,
            seq,
            epoch: None,
            events,
        }));
        match out {
            Output::Ingested(report) => report,
            other => panic!("expected an ingest report, got {other:?}"),
        }
    }

    fn load(&mut self, worker: &str, pressure: f64) {
        self.apply(Input::Load(LoadSample {
            worker: id(worker),
            kv_usage: pressure,
            running: 1,
            waiting: 0,
            max_running: None,
            model: None,
            dp_rank: 0,
        }));
    }

    fn lifecycle(&mut self, worker: &str, op: LifecycleOp) {
        self.apply(Input::Lifecycle(Lifecycle {
            worker: id(worker),
            op,
            model: None,
            block_size: None,
            capacity_blocks: None,
            dp_size: None,
            epoch: None,
        }));
    }

    fn request(locals: &[u64]) -> RouteRequest {
        RouteRequest {
            model: None,
            lora: None,
            keys: chain_locals(locals.iter().copied()),
            prompt_tokens: locals.len() as u64 * BLOCK as u64,
            max_output_tokens: Some(100),
            exclude: vec![],
            request_id: None,
            explain: false,
        }
    }

    fn route_req(&mut self, req: RouteRequest) -> Decision {
        match self.apply(Input::Route(req)) {
            Output::Routed(d) => d,
            other => panic!("expected a decision, got {other:?}"),
        }
    }

    fn route(&mut self, locals: &[u64]) -> Decision {
        self.route_req(Fleet::request(locals))
    }

    /// The workers `routes` back-to-back routes of `locals` choose (each reserves its work
    /// before the next is decided).
    fn chosen(&mut self, locals: &[u64], routes: usize) -> Vec<String> {
        (0..routes)
            .map(|_| self.route(locals).worker.to_string())
            .collect()
    }

    fn route_excluding(&mut self, locals: &[u64], exclude: &[&str]) -> Decision {
        let mut req = Fleet::request(locals);
        req.exclude = exclude.iter().map(|w| id(w)).collect();
        self.route_req(req)
    }

    fn reserved(&self, worker: &str) -> u64 {
        let slot = self.router.state.workers.slot_of(&id(worker), 0).unwrap();
        self.router.state.workers.get(slot).unwrap().reserved_work
    }
}

const PROMPT: [u64; 4] = [11, 12, 13, 14];

fn decided(d: &Decision) -> (&str, DecisionLabel) {
    (d.worker.as_str(), d.decision)
}

// ------------------------------------------------------------------------------------------
// Fleet semantics of real engines: epochs, ranks, store counts, tiers, sticky leave, models
// ------------------------------------------------------------------------------------------

/// A `BlockStored` of the prompt made of `locals` (a fresh chain) on `medium`, engine hashes as
/// [`Fleet::store`] makes them.
fn chain_event(locals: &[u64], medium: Medium) -> KvEvent {
    let keys = chain_locals(locals.iter().copied());
    KvEvent::Stored {
        parent: None,
        blocks: keys
            .iter()
            .zip(locals)
            .map(|(&k, &local)| StoredBlock {
                engine_hash: engine(k),
                local,
            })
            .collect(),
        block_size: BLOCK,
        lora: None,
        medium,
        full_attention: true,
    }
}

/// A `BlockRemoved` of the blocks of the prompt made of `locals`.
fn removal(locals: &[u64], medium: Medium) -> KvEvent {
    KvEvent::Removed {
        engine_hashes: chain_locals(locals.iter().copied())
            .into_iter()
            .map(engine)
            .collect(),
        medium,
    }
}

/// Headers of a batch: (dp rank, Kv-Epoch, Kv-Seq).
type Headers<'a> = (u32, Option<&'a str>, Option<u64>);

impl Fleet {
    fn batch(&mut self, worker: &str, headers: Headers, events: Vec<KvEvent>) -> IngestReport {
        let (dp_rank, epoch, seq) = headers;
        match self.apply(Input::KvEvents(KvEventBatch {
            worker: id(worker),
            model: None,
            dp_rank,
            seq,
            epoch: epoch.map(str::to_owned),
            events,
        })) {
            Output::Ingested(report) => report,
            other => panic!("expected an ingest report, got {other:?}"),
        }
    }

    fn join(&mut self, msg: Lifecycle) -> IngestReport {
        match self.apply(Input::Lifecycle(msg)) {
            Output::Ingested(report) => report,
            other => panic!("expected an ingest report, got {other:?}"),
        }
    }

    fn load_rank(&mut self, worker: &str, dp_rank: u32, pressure: f64, model: Option<&str>) {
        self.apply(Input::Load(LoadSample {
            worker: id(worker),
            kv_usage: pressure,
            running: 1,
            waiting: 0,
            max_running: None,
            model: model.map(str::to_owned),
            dp_rank,
        }));
    }

    /// Whether `worker` (rank `dp_rank`) owns every block of the prompt made of `locals`.
    fn owns_prompt(&self, worker: &str, dp_rank: u32, locals: &[u64]) -> bool {
        chain_locals(locals.iter().copied())
            .into_iter()
            .all(|k| self.router.rank_owns(&id(worker), dp_rank, None, None, k))
    }
}

fn lifecycle(worker: &str, op: LifecycleOp) -> Lifecycle {
    Lifecycle {
        worker: id(worker),
        op,
        model: None,
        block_size: None,
        capacity_blocks: None,
        dp_size: None,
        epoch: None,
    }
}
