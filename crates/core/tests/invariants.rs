//! The invariants every policy keeps, checked on random fleets, events, loads and routes driven
//! through `Router::apply` exactly as the daemon drives it (stamped inputs, one at a time).
//!
//! The suite runs over `PolicyKind::ALL`, so a policy added later is checked by it without a
//! change here. What it checks:
//!
//! - every policy answers a known candidate: never a draining, excluded or unknown worker, and
//!   no decision only when there is no candidate;
//! - pressure-first never leaves a usable, unpressured owner: a request leaves its owners for a
//!   new worker only when every owner is pressured, and every hold lands on a known owner;
//! - decisions are a pure function of the journal: the same stamped inputs applied twice give
//!   the same outputs and the same state;
//! - a peer replica's routes, spills and releases (`Input::Peer`) mixed into the journal keep
//!   all of the above, and never make the router publish an event of its own (no echo), while
//!   each local route and found release gives exactly one.

use kvrouted_core::hashing::chain_locals;
use kvrouted_core::input::{
    Input, KvEvent, KvEventBatch, Lifecycle, LifecycleOp, LoadSample, Medium, RouteRequest,
    Stamped, StoredBlock, WorkerId,
};
use kvrouted_core::policy::{DecisionLabel, PolicyKind};
use kvrouted_core::replicas::{PeerEvent, PeerEventKind, PeerRoute};
use kvrouted_core::router::{Decision, ExplainRow, Output, Router, RouterConfig};
use kvrouted_core::workers::WorkerState;
use proptest::prelude::*;

const WORKERS: u8 = 5;
const CHAINS: u64 = 3;
const BLOCK_SIZE: u32 = 16;

/// One step of a random run: an input, or time passing.
#[derive(Debug, Clone)]
enum Step {
    Store {
        worker: u8,
        chain: u64,
        blocks: u64,
    },
    Remove {
        worker: u8,
        chain: u64,
        from: u64,
    },
    Clear {
        worker: u8,
    },
    Load {
        worker: u8,
        kv_usage: f64,
        waiting: u32,
    },
    Lifecycle {
        worker: u8,
        op: LifecycleOp,
    },
    Route {
        chain: u64,
        blocks: u64,
        exclude: u8,
    },
    Release {
        back: u64,
    },
    /// A peer replica routed (and maybe spilled) a prompt to a worker.
    PeerRoute {
        worker: u8,
        chain: u64,
        blocks: u64,
        spill: bool,
    },
    /// A peer replica released one of the peer's reservations.
    PeerRelease {
        back: u64,
    },
    Tick,
    Advance {
        ms: u64,
    },
}

fn step() -> impl Strategy<Value = Step> {
    let worker = 0..WORKERS;
    let chain = 0..CHAINS;
    prop_oneof![
        4 => (worker.clone(), chain.clone(), 1..8u64)
            .prop_map(|(worker, chain, blocks)| Step::Store { worker, chain, blocks }),
        1 => (worker.clone(), chain.clone(), 0..8u64)
            .prop_map(|(worker, chain, from)| Step::Remove { worker, chain, from }),
        1 => worker.clone().prop_map(|worker| Step::Clear { worker }),
        4 => (worker.clone(), 0..=10u32, 0..4u32).prop_map(|(worker, tenths, waiting)| {
            Step::Load { worker, kv_usage: f64::from(tenths) / 10.0, waiting }
        }),
        1 => (worker, prop_oneof![
            Just(LifecycleOp::Join),
            Just(LifecycleOp::Drain),
            Just(LifecycleOp::Leave),
        ])
            .prop_map(|(worker, op)| Step::Lifecycle { worker, op }),
        6 => (chain, 1..10u64, any::<u8>())
            .prop_map(|(chain, blocks, exclude)| Step::Route { chain, blocks, exclude }),
        1 => (0..20u64).prop_map(|back| Step::Release { back }),
        3 => (0..WORKERS, 0..CHAINS, 1..10u64, any::<bool>()).prop_map(
            |(worker, chain, blocks, spill)| Step::PeerRoute { worker, chain, blocks, spill }
        ),
        1 => (0..20u64).prop_map(|back| Step::PeerRelease { back }),
        1 => Just(Step::Tick),
        2 => prop_oneof![0..2_000u64, 0..40_000u64].prop_map(|ms| Step::Advance { ms }),
    ]
}

fn worker_id(worker: u8) -> WorkerId {
    WorkerId::new(&format!("w{worker}")).unwrap()
}

/// The local hash of block `b` of chain `chain`: chains share nothing.
fn local(chain: u64, b: u64) -> u64 {
    chain * 1_000 + b
}

/// The engine's (opaque) hash of a block on a worker.
fn engine_hash(worker: u8, chain: u64, b: u64) -> u64 {
    (u64::from(worker) << 32) | local(chain, b)
}

/// The peer's reservation id for the peer event at journal position `seq`: far from the local
/// ones (journal sequences, as no secret is set).
fn peer_reservation(seq: u64) -> u64 {
    (1 << 40) + seq
}

fn peer_event(seq: u64, at_ms: u64, kind: PeerEventKind) -> Input {
    Input::Peer(Box::new(PeerEvent {
        replica: "peer".to_owned(),
        seq,
        at_ms,
        kind,
    }))
}

/// Turns random steps into the stamped inputs the daemon would journal.
fn journal(steps: &[Step]) -> Vec<Stamped> {
    let mut at_ms = 1_000_000;
    let mut stamped = Vec::new();
    for step in steps {
        let input = match *step {
            Step::Advance { ms } => {
                at_ms += ms;
                continue;
            }
            Step::Store {
                worker,
                chain,
                blocks,
            } => Input::KvEvents(KvEventBatch::stored(
                worker_id(worker),
                None,
                (0..blocks)
                    .map(|b| StoredBlock {
                        engine_hash: engine_hash(worker, chain, b),
                        local: local(chain, b),
                    })
                    .collect(),
                BLOCK_SIZE,
            )),
            Step::Remove {
                worker,
                chain,
                from,
            } => Input::KvEvents(KvEventBatch::of(
                worker_id(worker),
                vec![KvEvent::Removed {
                    engine_hashes: (from..8).map(|b| engine_hash(worker, chain, b)).collect(),
                    medium: Medium::Gpu,
                }],
            )),
            Step::Clear { worker } => {
                Input::KvEvents(KvEventBatch::of(worker_id(worker), vec![KvEvent::Cleared]))
            }
            Step::Load {
                worker,
                kv_usage,
                waiting,
            } => Input::Load(LoadSample {
                worker: worker_id(worker),
                kv_usage,
                running: 1,
                waiting,
                max_running: Some(8),
                model: None,
                dp_rank: 0,
            }),
            Step::Lifecycle { worker, op } => Input::Lifecycle(Lifecycle {
                worker: worker_id(worker),
                op,
                model: None,
                block_size: Some(BLOCK_SIZE),
                capacity_blocks: None,
                dp_size: None,
                epoch: None,
            }),
            Step::Route {
                chain,
                blocks,
                exclude,
            } => Input::Route(RouteRequest {
                model: None,
                lora: None,
                keys: chain_locals((0..blocks).map(|b| local(chain, b))),
                prompt_tokens: blocks * u64::from(BLOCK_SIZE),
                max_output_tokens: Some(64),
                exclude: (0..WORKERS)
                    .filter(|w| exclude & (1 << w) != 0 && exclude & 0x80 != 0)
                    .map(worker_id)
                    .collect(),
                request_id: None,
                explain: true,
            }),
            // Reservation ids are the sequence numbers of routes; some are unknown.
            Step::Release { back } => Input::Release {
                reservation: (stamped.len() as u64 + 1).saturating_sub(back),
                phase: None,
            },
            Step::PeerRoute {
                worker,
                chain,
                blocks,
                spill,
            } => {
                let keys = chain_locals((0..blocks).map(|b| local(chain, b)));
                let seq = stamped.len() as u64 + 1;
                peer_event(
                    seq,
                    at_ms,
                    PeerEventKind::Routed(PeerRoute {
                        model: None,
                        lora: None,
                        worker: worker_id(worker),
                        dp_rank: 0,
                        spilled_prefix: spill.then(|| *keys.last().expect("a block")),
                        work: blocks * u64::from(BLOCK_SIZE) + 64,
                        prefill: blocks * u64::from(BLOCK_SIZE),
                        keys,
                        reservation: peer_reservation(seq),
                        decision: if spill {
                            DecisionLabel::PressureSpill
                        } else {
                            DecisionLabel::OwnerHold
                        },
                    }),
                )
            }
            Step::PeerRelease { back } => {
                let seq = stamped.len() as u64 + 1;
                peer_event(
                    seq,
                    at_ms,
                    PeerEventKind::Released {
                        reservation: peer_reservation(seq.saturating_sub(back)),
                        phase: None,
                    },
                )
            }
            Step::Tick => Input::Tick,
        };
        stamped.push(Stamped {
            seq: stamped.len() as u64 + 1,
            at_ms,
            input,
        });
    }
    stamped
}

fn config(kind: PolicyKind, max_owners: usize) -> RouterConfig {
    let mut config = RouterConfig {
        block_size: BLOCK_SIZE,
        ..RouterConfig::default()
    };
    config.policy.kind = kind;
    config.policy.max_owners_per_prefix = max_owners;
    // A replica: local routes and releases give events for peers.
    config.replica_id = "local".to_owned();
    config
}

/// The workers that may take this request, judged from the outside before it is applied.
fn candidates(router: &Router, now: u64, exclude: &[WorkerId]) -> Vec<WorkerId> {
    router
        .worker_rows(now)
        .into_iter()
        .filter(|row| row.state == WorkerState::Active && !exclude.contains(&row.id))
        .map(|row| row.id)
        .collect()
}

/// The owners of the request's longest match: candidates at the deepest depth, if it counts.
/// The owners a decision saw: the candidates at the deepest match, when that match reaches the
/// threshold the explain rows name (min_match_blocks and min_match_ratio of the prompt).
fn owners(rows: &[ExplainRow]) -> Vec<&ExplainRow> {
    let threshold = rows.first().map_or(1, |r| r.match_threshold.max(1));
    let deepest = rows
        .iter()
        .filter(|r| r.candidate)
        .map(|r| r.depth)
        .max()
        .unwrap_or(0);
    if deepest < threshold {
        return Vec::new();
    }
    rows.iter()
        .filter(|r| r.candidate && r.depth == deepest)
        .collect()
}

/// Pressure-first's rules, checked on one decision and the explain rows that led to it.
fn check_pressure_first(config: &RouterConfig, decision: &Decision) {
    let policy = &config.policy;
    let rows = decision.explain.as_deref().expect("routes ask for explain");
    let owners = owners(rows);
    let chosen = &decision.worker;
    match decision.decision {
        DecisionLabel::PressureSpill => {
            // A spill happens only without a provisional owner, so the known owners are the
            // owners: each must be above the limit set by the best of them.
            let best = owners
                .iter()
                .filter_map(|o| o.pressure)
                .min_by(f64::total_cmp)
                .expect("a spill needs fresh telemetry on every owner");
            let limit = (best + policy.pressure_slack).min(policy.high_water);
            for owner in &owners {
                assert!(
                    owner.pressure.is_some_and(|p| p > limit),
                    "spilled to {chosen} while owner {} was usable and unpressured \
                     (pressure {:?}, limit {limit}): {rows:?}",
                    owner.worker,
                    owner.pressure
                );
            }
            assert!(
                owners.iter().all(|o| o.worker != *chosen),
                "a spill goes to a new worker"
            );
        }
        DecisionLabel::OverloadSpill => {
            let overflow = policy
                .ceiling_overflow_pressure
                .expect("an overload spill needs --ceiling-overflow-pressure");
            for owner in &owners {
                assert!(
                    owner.pressure.is_some_and(|p| p > overflow),
                    "overload spill from {chosen} while owner {} was at or below {overflow}: \
                     {rows:?}",
                    owner.worker
                );
            }
            assert!(
                owners.iter().all(|o| o.worker != *chosen),
                "an overload spill goes to a new worker"
            );
        }
        DecisionLabel::OwnerHold
        | DecisionLabel::SpillCooldownHold
        | DecisionLabel::NoSafeHomeHold
        | DecisionLabel::CeilingHold => {
            assert!(
                decision.owners.contains(chosen),
                "{} holds on {chosen}, which is not a known owner {:?}",
                decision.decision,
                decision.owners
            );
        }
        DecisionLabel::ColdMiss | DecisionLabel::OwnerUnavailable => assert!(
            owners.is_empty(),
            "{} while candidates own the prefix: {rows:?}",
            decision.decision
        ),
    }
    // Telemetry gaps fail open: an owner without fresh telemetry is never pressured.
    if owners.iter().any(|o| o.pressure.is_none()) {
        assert_eq!(
            decision.decision,
            DecisionLabel::OwnerHold,
            "an owner without fresh telemetry is usable: {rows:?}"
        );
    }
}

/// Applies the journal to a fresh router, checking every decision; returns the outputs.
fn run_checked(config: &RouterConfig, journal: &[Stamped]) -> (Router, Vec<Output>) {
    let mut router = Router::new(config.clone());
    let mut outputs = Vec::with_capacity(journal.len());
    for stamped in journal {
        let candidates = match &stamped.input {
            Input::Route(req) => Some(candidates(&router, stamped.at_ms, &req.exclude)),
            _ => None,
        };
        let output = router.apply(stamped);
        let publishes = match (&stamped.input, &output) {
            (Input::Route(_), Output::Routed(_))
            | (Input::Release { .. }, Output::Released { found: true, .. }) => true,
            (Input::Peer(_), out) => {
                assert!(matches!(out, Output::Peer(_)), "a peer input gave {out:?}");
                false
            }
            _ => false,
        };
        assert_eq!(
            output.peer_event().is_some(),
            publishes,
            "exactly local routes and found releases are published, peer inputs never: \
             {:?} gave {output:?}",
            stamped.input
        );
        if let Some(candidates) = candidates {
            match &output {
                Output::Routed(decision) => {
                    assert!(
                        candidates.contains(&decision.worker),
                        "{} answered {}, not a candidate {candidates:?}",
                        config.policy.kind,
                        decision.worker
                    );
                    if config.policy.kind == PolicyKind::PressureFirst {
                        check_pressure_first(config, decision);
                    }
                }
                Output::NoCandidate => assert!(
                    candidates.is_empty(),
                    "{} answered no candidate while {candidates:?} could take it",
                    config.policy.kind
                ),
                other => panic!("a route produced {other:?}"),
            }
        }
        outputs.push(output);
    }
    (router, outputs)
}

/// A random journal and owner ceiling.
fn run() -> impl Strategy<Value = (Vec<Stamped>, usize)> {
    (prop::collection::vec(step(), 1..160), 1..5usize)
        .prop_map(|(steps, max_owners)| (journal(&steps), max_owners))
}

fn encoded_state(router: &Router) -> Vec<u8> {
    rmp_serde::to_vec(router.state()).expect("the state serializes")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn every_policy_answers_a_candidate_and_pressure_first_keeps_usable_owners(
        (journal, max_owners) in run(),
    ) {
        for kind in PolicyKind::ALL {
            run_checked(&config(kind, max_owners), &journal);
        }
    }

    #[test]
    fn decisions_are_a_pure_function_of_the_journal((journal, max_owners) in run()) {
        for kind in PolicyKind::ALL {
            let config = config(kind, max_owners);
            let (first, first_outputs) = run_checked(&config, &journal);
            let (second, second_outputs) = run_checked(&config, &journal);
            prop_assert_eq!(
                &first_outputs, &second_outputs,
                "{}: the same journal gave different outputs", kind
            );
            prop_assert!(
                encoded_state(&first) == encoded_state(&second),
                "{}: the same journal gave a different state", kind
            );
        }
    }
}
