//! Property test: the owner index agrees with a naive model — a set of (worker, key) pairs —
//! after every step of random stored / removed / cleared / leave sequences.

use std::collections::{BTreeMap, BTreeSet};

use kvrouted::hashing::chain;
use kvrouted::input::{
    Input, KvEvent, KvEventBatch, Lifecycle, LifecycleOp, Medium, Stamped, StoredBlock, WorkerId,
};
use kvrouted::router::{Router, RouterConfig};
use proptest::prelude::*;

const BLOCK: u32 = 16;
const WORKERS: [&str; 3] = ["w0", "w1", "w2"];

/// Engine hashes are a bijection of content keys here, so one engine hash names one key.
fn engine(key: u64) -> u64 {
    key.rotate_left(17) ^ 0x5EED
}

#[derive(Debug, Clone)]
enum Step {
    /// Store a chain of blocks (locals from a tiny alphabet so workers share prefixes),
    /// continuing from the `parent`-th key the worker holds, or a fresh chain, or an unknown
    /// parent.
    Store {
        worker: usize,
        parent: Option<usize>,
        unknown_parent: bool,
        locals: Vec<u64>,
    },
    /// Remove the chosen held keys, plus an engine hash the worker never reported.
    Remove {
        worker: usize,
        picks: Vec<usize>,
    },
    Clear {
        worker: usize,
    },
    Leave {
        worker: usize,
    },
}

fn step() -> impl Strategy<Value = Step> {
    let worker = 0..WORKERS.len();
    prop_oneof![
        6 => (worker.clone(), proptest::option::of(0usize..64), any::<bool>(), proptest::collection::vec(0u64..4, 1..6))
            .prop_map(|(worker, parent, unknown_parent, locals)| Step::Store { worker, parent, unknown_parent, locals }),
        3 => (worker.clone(), proptest::collection::vec(0usize..64, 0..4))
            .prop_map(|(worker, picks)| Step::Remove { worker, picks }),
        1 => worker.clone().prop_map(|worker| Step::Clear { worker }),
        1 => worker.prop_map(|worker| Step::Leave { worker }),
    ]
}

fn id(w: usize) -> WorkerId {
    WorkerId::new(WORKERS[w]).unwrap()
}

fn batch(worker: usize, event: KvEvent) -> Input {
    Input::KvEvents(KvEventBatch {
        worker: id(worker),
        model: None,
        dp_rank: 0,
        seq: None,
        epoch: None,
        events: vec![event],
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn index_matches_a_naive_set_of_worker_key_pairs(steps in proptest::collection::vec(step(), 1..60)) {
        let mut router = Router::new(RouterConfig { block_size: BLOCK, ..RouterConfig::default() });
        // The model: per worker, the set of keys it holds.
        let mut model: BTreeMap<usize, BTreeSet<u64>> = BTreeMap::new();
        for (seq, step) in steps.into_iter().enumerate() {
            let input = match step {
                Step::Store { worker, parent, unknown_parent, locals } => {
                    let held: Vec<u64> = model.get(&worker).map(|s| s.iter().copied().collect()).unwrap_or_default();
                    let (parent_hash, mut parent_key) = match parent.filter(|_| !held.is_empty()) {
                        _ if unknown_parent => (Some(0xDEAD_BEEF), None),
                        Some(p) => { let k = held[p % held.len()]; (Some(engine(k)), Some(k)) }
                        None => (None, None),
                    };
                    let mut blocks = Vec::new();
                    for local in locals {
                        let key = chain(parent_key, local);
                        blocks.push(StoredBlock { engine_hash: engine(key), local });
                        model.entry(worker).or_default().insert(key);
                        parent_key = Some(key);
                    }
                    batch(worker, KvEvent::Stored { parent: parent_hash, blocks, block_size: BLOCK, lora: None, medium: Medium::Gpu, full_attention: true })
                }
                Step::Remove { worker, picks } => {
                    let held: Vec<u64> = model.get(&worker).map(|s| s.iter().copied().collect()).unwrap_or_default();
                    let mut hashes = vec![0xDEAD_BEEF];
                    if !held.is_empty() {
                        for p in picks {
                            let key = held[p % held.len()];
                            hashes.push(engine(key));
                            model.entry(worker).or_default().remove(&key);
                        }
                    }
                    batch(worker, KvEvent::Removed { engine_hashes: hashes, medium: Medium::Gpu })
                }
                Step::Clear { worker } => {
                    model.remove(&worker);
                    batch(worker, KvEvent::Cleared)
                }
                Step::Leave { worker } => {
                    model.remove(&worker);
                    Input::Lifecycle(Lifecycle { worker: id(worker), op: LifecycleOp::Leave, model: None, block_size: None, capacity_blocks: None, dp_size: None, epoch: None })
                }
            };
            router.apply(&Stamped { seq: seq as u64 + 1, at_ms: 1_000 + seq as u64, input });

            let expected: BTreeSet<(String, u64)> = model
                .iter()
                .flat_map(|(w, keys)| keys.iter().map(move |&k| (WORKERS[*w].to_string(), k)))
                .collect();
            let actual: BTreeSet<(String, u64)> = router
                .ownerships()
                .into_iter()
                .map(|(w, _, _, k)| (w.to_string(), k))
                .collect();
            prop_assert_eq!(&actual, &expected, "index ownership equals the naive model after step {}", seq);
            let stats = router.index_stats();
            prop_assert_eq!(stats.entries as usize, expected.len(), "one entry per (block, owner)");
            let distinct: BTreeSet<u64> = expected.iter().map(|(_, k)| *k).collect();
            prop_assert_eq!(stats.blocks as usize, distinct.len(), "one block per distinct key");
            for (w, k) in &expected {
                prop_assert!(router.owns(&WorkerId::new(w).unwrap(), None, None, *k));
            }
        }
    }
}
