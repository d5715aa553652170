//! A route decision allocates only what it hands back: the reply's owner list. The walks'
//! depth rows, the views of the listed ranks, the excluded ranks and the owners' id order all
//! live in buffers the router keeps from one route to the next, and the policy names its known
//! owners instead of listing them, so a decision's cost does not grow by the heap's
//! (docs/performance.md, Round 5, fourteenth and fifteenth parts).
//!
//! Counted with the test kit's counting allocator, over many routes after a warm-up that grows
//! the buffers to their working size. This file holds one test, so no other test's allocations
//! are counted beside it.

use kvrouted::hashing::chain_locals;
use kvrouted::input::{
    Input, KvEventBatch, LoadSample, RouteRequest, Stamped, StoredBlock, WorkerId,
};
use kvrouted::router::{Output, Router, RouterConfig};
use kvrouted_testkit::counting_alloc::{self, Counting};

#[global_allocator]
static GLOBAL: Counting = Counting;

const BLOCK: u32 = 16;
/// Workers that hold prompts. A prefix all of them hold has more owners than a 64th of the
/// fleet's slots, which the owner order puts in id order by their places in the fleet.
const WORKERS: usize = 256;
/// Workers that only report load, so that a prefix [`SORTED_OWNERS`] workers hold has fewer
/// owners than a 64th of the fleet's slots.
const IDLE: usize = 8_200;
/// More owners than the owner order sorts with the standard sort (128), fewer than a 64th of
/// the fleet's slots: a counting pass sorts them, and its buffers are kept too.
const SORTED_OWNERS: usize = 130;
const PROMPT_BLOCKS: u64 = 32;

fn worker(i: usize) -> WorkerId {
    WorkerId::new(&format!("worker-{i}")).unwrap()
}

/// Blocks `0..PROMPT_BLOCKS` of chain `chain`, stored by worker `w`.
fn stored(w: usize, chain: u64) -> Input {
    let blocks = (0..PROMPT_BLOCKS)
        .map(|i| StoredBlock {
            engine_hash: ((w as u64) << 48) | (chain << 20) | i,
            local: (chain << 20) | i,
        })
        .collect();
    Input::KvEvents(KvEventBatch::stored(worker(w), None, blocks, BLOCK))
}

fn load(w: usize) -> Input {
    Input::Load(LoadSample {
        worker: worker(w),
        kv_usage: 0.3,
        running: 4,
        waiting: 0,
        max_running: Some(64),
        model: None,
        dp_rank: 0,
    })
}

fn request(chain: u64) -> RouteRequest {
    RouteRequest {
        model: None,
        lora: None,
        prompt_tokens: PROMPT_BLOCKS * u64::from(BLOCK),
        keys: chain_locals((0..PROMPT_BLOCKS).map(|i| (chain << 20) | i)),
        max_output_tokens: Some(256),
        exclude: vec![],
        request_id: None,
        explain: false,
    }
}

/// The request of the n-th route of a case.
type RequestFor = fn(u64) -> RouteRequest;

struct Fleet {
    router: Router,
    seq: u64,
}

impl Fleet {
    fn apply(&mut self, input: Input) -> Output {
        self.seq += 1;
        self.router.apply(&Stamped {
            seq: self.seq,
            at_ms: 1_000_000 + self.seq,
            input,
        })
    }

    /// Allocations per route over `routes` routes of the requests `request` makes (each
    /// reservation released before the next route, as a finished request releases it), after a
    /// warm-up; and the number of owners the last decision listed.
    fn allocations_per_route(
        &mut self,
        request: impl Fn(u64) -> RouteRequest,
        routes: u64,
    ) -> (f64, usize) {
        let mut owners = 0;
        let mut made = 0;
        let mut count = |fleet: &mut Fleet, n: u64| {
            let mut allocations = 0;
            for _ in 0..n {
                let input = Input::Route(request(made));
                made += 1;
                let before = counting_alloc::allocations();
                let output = fleet.apply(input);
                allocations += counting_alloc::allocations() - before;
                let Output::Routed(decision) = output else {
                    panic!("a fleet of candidates always routes: {output:?}");
                };
                owners = decision.owners.len();
                let reservation = decision.reservation;
                drop(decision);
                fleet.apply(Input::Release {
                    reservation,
                    phase: None,
                });
            }
            allocations
        };
        count(self, 64);
        let allocations = count(self, routes);
        (allocations as f64 / routes as f64, owners)
    }
}

#[test]
fn a_route_allocates_only_its_reply() {
    let mut fleet = Fleet {
        router: Router::new(RouterConfig {
            block_size: BLOCK,
            ..RouterConfig::default()
        }),
        seq: 0,
    };
    for w in 0..WORKERS + IDLE {
        fleet.apply(load(w));
    }
    // Chain 1 is held by two workers, chain 2 by every worker that holds prompts, chain 4 by
    // some of them; chain 3 by none.
    for w in [5, 40] {
        fleet.apply(stored(w, 1));
    }
    for w in 0..WORKERS {
        fleet.apply(stored(w, 2));
    }
    for w in 0..SORTED_OWNERS {
        fleet.apply(stored(w, 4));
    }
    const ROUTES: u64 = 1_000;
    // A cold miss asks for a chain nobody has seen: asking for one chain again would find the
    // worker the last route chose as its approximate owner.
    let cases: [(&str, RequestFor, usize); 4] = [
        ("a prefix two workers hold", |_| request(1), 2),
        ("a prefix 256 workers hold", |_| request(2), WORKERS),
        ("a prefix 130 workers hold", |_| request(4), SORTED_OWNERS),
        ("a cold miss", |i| request(1_000 + i), 0),
    ];
    for (what, requests, expected_owners) in cases {
        let (per_route, owners) = fleet.allocations_per_route(requests, ROUTES);
        assert_eq!(
            owners, expected_owners,
            "{what}: the reply lists its owners"
        );
        // The reply's owner list, however many owners there are: the policy names the known
        // owners (their depth and the provisional owner) rather than listing them.
        let reply = u32::from(expected_owners > 0);
        assert!(
            per_route <= f64::from(reply) + 0.05,
            "{what}: a route allocates only its reply ({per_route:.2} allocations per route, \
             {reply} for the owner list)"
        );
    }
}
