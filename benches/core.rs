//! Core benchmarks (issue 2): applying stored events (ns per block), routing a 1,024-block
//! prompt across 64 workers (ns per decision), routing across 100,000 worker slots (a held
//! prefix, and a cold miss that draws from the whole fleet), routing a prefix all 4,096 workers
//! hold and a first block 512 of them hold (ns per decision with many owners), the snapshot's
//! copy of the state and its restore, and bytes per (block, owner) index entry.
//!
//! Run: `cargo bench --bench core`. The memory figure is printed first, from a counting
//! allocator, as `index_bytes_per_entry`.

use std::time::{Duration, Instant};

use criterion::{criterion_group, BatchSize, Criterion, Throughput};
use kvrouted::hashing::chain_locals;
use kvrouted::input::{
    Input, KvEventBatch, LoadSample, RouteRequest, Stamped, StoredBlock, WorkerId,
};
use kvrouted::router::{Output, Router, RouterConfig, RouterState};

use kvrouted_testkit::counting_alloc::{self, Counting};

#[global_allocator]
static GLOBAL: Counting = Counting;

const BLOCK: u32 = 16;
const BATCH_BLOCKS: u64 = 32;

fn worker(i: usize) -> WorkerId {
    WorkerId::new(&format!("worker-{i}")).unwrap()
}

/// A stored-event batch: `BATCH_BLOCKS` blocks continuing a worker's chain `chain`.
fn stored_batch(w: usize, chain: u64, part: u64) -> Input {
    let base = (chain << 20) | (part * BATCH_BLOCKS);
    let blocks = (0..BATCH_BLOCKS)
        .map(|i| StoredBlock {
            engine_hash: ((w as u64) << 48) | (base + i),
            local: base + i,
        })
        .collect();
    let parent = (part > 0).then(|| ((w as u64) << 48) | (base - 1));
    Input::KvEvents(KvEventBatch::stored(worker(w), parent, blocks, BLOCK))
}

fn stamp(seq: u64, input: Input) -> Stamped {
    Stamped {
        seq,
        at_ms: 1_000_000 + seq,
        input,
    }
}

fn config() -> RouterConfig {
    RouterConfig {
        block_size: BLOCK,
        ..RouterConfig::default()
    }
}

/// Live bytes per (block, owner) entry of an index holding `blocks` blocks on each of `owners`
/// workers (every block owned by all of them) — and of one owner per block.
fn bytes_per_entry(blocks: u64, owners: usize) -> f64 {
    // The allocator's bytes and the index's table arrays that are mappings of their own.
    let live = || counting_alloc::live_bytes() + kvrouted::index::mapped_table_bytes();
    let before = live();
    let mut router = Router::new(config());
    let mut seq = 0;
    for w in 0..owners {
        for part in 0..blocks / BATCH_BLOCKS {
            feed(&mut router, &mut seq, stored_batch(w, 1, part));
        }
    }
    // Different workers store the same locals under the same chain: shared blocks.
    let after = live();
    let entries = router.index_stats().entries as f64;
    let bytes = (after - before) as f64 / entries;
    drop(router);
    bytes
}

fn apply_stored_events(c: &mut Criterion) {
    let mut group = c.benchmark_group("apply_stored");
    group.throughput(Throughput::Elements(BATCH_BLOCKS));
    group.bench_function("32_block_batch_new_blocks", |b| {
        let mut router = Router::new(config());
        let mut seq = 0u64;
        b.iter_batched(
            || {
                seq += 1;
                stamp(seq, stored_batch((seq % 64) as usize, seq, 0))
            },
            |input| router.apply(&input),
            BatchSize::SmallInput,
        );
    });
    group.finish();
}

/// Applies `input` as the next input of `router` (sequence `seq`, advanced).
fn feed(router: &mut Router, seq: &mut u64, input: Input) {
    *seq += 1;
    router.apply(&stamp(*seq, input));
}

/// Times route decisions of `request`, releasing each reservation (untimed) before the next
/// so reserved work stays bounded.
fn time_routes(router: &mut Router, seq: &mut u64, request: &RouteRequest, iters: u64) -> Duration {
    let mut timed = Duration::ZERO;
    for _ in 0..iters {
        let reservation = *seq;
        feed(
            router,
            seq,
            Input::Release {
                reservation,
                phase: None,
            },
        );
        *seq += 1;
        let input = stamp(*seq, Input::Route(request.clone()));
        let start = Instant::now();
        std::hint::black_box(router.apply(&input));
        timed += start.elapsed();
    }
    timed
}

fn load(w: usize, kv_usage: f64) -> Input {
    Input::Load(LoadSample {
        worker: worker(w),
        kv_usage,
        running: 4,
        waiting: 0,
        max_running: Some(64),
        model: None,
        dp_rank: 0,
    })
}

fn request(keys: Vec<u64>) -> RouteRequest {
    RouteRequest {
        model: None,
        lora: None,
        prompt_tokens: keys.len() as u64 * BLOCK as u64,
        keys,
        max_output_tokens: Some(256),
        exclude: vec![],
        request_id: None,
        explain: false,
    }
}

/// A fleet of 100,000 worker slots, each with a load sample (a tenth of them above
/// high_water), two of which hold a 64-block prompt: a route's cost must follow the owners and
/// the sampled candidates, not the fleet.
fn route_large_fleet(c: &mut Criterion) {
    const SLOTS: usize = 100_000;
    let mut router = Router::new(config());
    let mut seq = 0;
    for w in 0..SLOTS {
        feed(
            &mut router,
            &mut seq,
            load(w, if w % 10 == 0 { 0.95 } else { 0.5 }),
        );
    }
    for w in [11, 77_777] {
        for part in 0..2 {
            feed(&mut router, &mut seq, stored_batch(w, 1, part));
        }
    }
    let held = request(chain_locals((0..64).map(|i| (1u64 << 20) | i)));
    let cold = request(chain_locals((0..64).map(|i| (9u64 << 20) | i)));
    let mut group = c.benchmark_group("route");
    group.throughput(Throughput::Elements(1));
    group.bench_function("64_blocks_100000_slots_owner_hold", |b| {
        b.iter_custom(|iters| time_routes(&mut router, &mut seq, &held, iters));
    });
    group.bench_function("64_blocks_100000_slots_cold_miss", |b| {
        b.iter_custom(|iters| time_routes(&mut router, &mut seq, &cold, iters));
    });
    group.finish();
}

fn route_long_prompt(c: &mut Criterion) {
    let mut router = Router::new(config());
    let mut seq = 0;
    // 64 workers, each holding its own 1,024-block conversation; worker 7 also holds the one
    // we route, so the walk goes the whole depth.
    for w in 0..64 {
        for part in 0..1024 / BATCH_BLOCKS {
            feed(&mut router, &mut seq, stored_batch(w, 100 + w as u64, part));
        }
        feed(&mut router, &mut seq, load(w, 0.5));
    }
    for part in 0..1024 / BATCH_BLOCKS {
        feed(&mut router, &mut seq, stored_batch(7, 1, part));
    }
    let request = request(chain_locals((0..1024).map(|i| (1u64 << 20) | i)));
    let mut group = c.benchmark_group("route");
    group.throughput(Throughput::Elements(1));
    group.bench_function("1024_blocks_64_workers", |b| {
        b.iter_custom(|iters| time_routes(&mut router, &mut seq, &request, iters));
    });
    group.finish();
}

/// A reservation given back: the release a gateway sends after each routed request, applied
/// by the same single writer as the routes. Each timed release follows its route (untimed).
fn release_after_route(c: &mut Criterion) {
    let mut router = Router::new(config());
    let mut seq = 0;
    for w in 0..64 {
        feed(&mut router, &mut seq, stored_batch(w, 100 + w as u64, 0));
        feed(&mut router, &mut seq, load(w, 0.5));
    }
    let request = request(chain_locals((0..32).map(|i| (101u64 << 20) | i)));
    let mut group = c.benchmark_group("release");
    group.throughput(Throughput::Elements(1));
    group.bench_function("a_routed_requests_reservation", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                seq += 1;
                let routed = router.apply(&stamp(seq, Input::Route(request.clone())));
                let Output::Routed(decision) = routed else {
                    panic!("a fleet of 64 live workers has a candidate");
                };
                let reservation = decision.reservation;
                seq += 1;
                let input = stamp(
                    seq,
                    Input::Release {
                        reservation,
                        phase: None,
                    },
                );
                let start = Instant::now();
                let output = std::hint::black_box(router.apply(&input));
                timed += start.elapsed();
                assert!(
                    matches!(output, Output::Released { found: true, .. }),
                    "a route's reservation is known until it is released"
                );
            }
            timed
        });
    });
    group.finish();
}

/// 4,096 workers, each with a load sample, all holding the same 32-block prompt: every worker
/// is an owner, the worst case of a prefix the whole fleet shares. The figure divided by 4,096
/// is a decision's cost per owner.
fn route_shared_prefix(c: &mut Criterion) {
    const WORKERS: usize = 4096;
    let mut router = Router::new(config());
    let mut seq = 0;
    for w in 0..WORKERS {
        feed(&mut router, &mut seq, load(w, 0.5));
        feed(&mut router, &mut seq, stored_batch(w, 1, 0));
    }
    let request = request(chain_locals((0..BATCH_BLOCKS).map(|i| (1u64 << 20) | i)));
    let mut group = c.benchmark_group("route");
    group.throughput(Throughput::Elements(1));
    group.bench_function("32_blocks_4096_owners", |b| {
        b.iter_custom(|iters| time_routes(&mut router, &mut seq, &request, iters));
    });
    group.finish();
}

/// 4,096 workers, each with a load sample; every eighth holds the first block of a 4-block
/// prompt and nobody the rest: 512 owners at a depth of one (the match threshold of a 4-block
/// prompt). The common wide decision of a large fleet, a shared first block (a system prompt)
/// under prompts that part after it: the walk is one key, the rest of the decision lists,
/// ranks and names 512 owners.
fn route_shared_first_block(c: &mut Criterion) {
    const WORKERS: usize = 4096;
    // Approximate ownership off: each route would record its worker as the approximate owner
    // of all four blocks, and the next route would hold on it alone.
    let mut router = Router::new(RouterConfig {
        approx_ttl_ms: 0,
        approx_max_records: 1,
        ..config()
    });
    let mut seq = 0;
    let first = (1u64 << 20) | 1;
    for w in 0..WORKERS {
        feed(&mut router, &mut seq, load(w, 0.5));
        if w % 8 == 0 {
            let block = StoredBlock {
                engine_hash: ((w as u64) << 48) | first,
                local: first,
            };
            let batch = KvEventBatch::stored(worker(w), None, vec![block], BLOCK);
            feed(&mut router, &mut seq, Input::KvEvents(batch));
        }
    }
    let request = request(chain_locals([first, 2, 3, 4]));
    let mut group = c.benchmark_group("route");
    group.throughput(Throughput::Elements(1));
    group.bench_function("4_blocks_512_of_4096_hold_the_first", |b| {
        b.iter_custom(|iters| time_routes(&mut router, &mut seq, &request, iters));
    });
    group.finish();
}

/// The snapshot's copy of the state, taken under the state's lock (routing waits for it): a
/// router holding 2^20 blocks of one worker, so its owner table and engine map are each
/// several huge pages. Into fresh memory (the first snapshot), and into the copy kept from the
/// last snapshot (every later one).
fn copy_state(c: &mut Criterion) {
    let mut router = Router::new(config());
    let mut seq = 0;
    for part in 0..(1 << 20) / BATCH_BLOCKS {
        feed(&mut router, &mut seq, stored_batch(0, 1, part));
    }
    let mut group = c.benchmark_group("snapshot");
    group.sample_size(20);
    group.bench_function("state_copy_1m_blocks", |b| {
        b.iter_with_large_drop(|| router.state().clone())
    });
    // As the writer copies every snapshot after its first: into the copy it kept.
    let mut kept = router.state().clone();
    group.bench_function("state_copy_1m_blocks_into_kept", |b| {
        b.iter(|| kept.clone_from(router.state()))
    });
    group.finish();
}

/// Restoring a snapshot's state, as recovery does before it replays the journal after it: a
/// router holding 2^18 blocks each stored by four workers (a prefix a fleet shares), so every
/// block keeps its owners in a list of its own beside the owner table.
fn load_state(c: &mut Criterion) {
    let mut router = Router::new(config());
    let mut seq = 0;
    for w in 0..4 {
        for part in 0..(1 << 18) / BATCH_BLOCKS {
            feed(&mut router, &mut seq, stored_batch(w, 1, part));
        }
    }
    let encoded = rmp_serde::to_vec(router.state()).expect("the state encodes");
    let mut group = c.benchmark_group("snapshot");
    group.sample_size(20);
    group.bench_function("state_load_256k_blocks_of_4_owners", |b| {
        b.iter_with_large_drop(|| {
            rmp_serde::from_slice::<RouterState>(&encoded).expect("the state decodes")
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    apply_stored_events,
    copy_state,
    load_state,
    route_long_prompt,
    route_large_fleet,
    route_shared_prefix,
    route_shared_first_block,
    release_after_route
);

fn main() {
    // Hash tables grow by doubling, so the figure depends on where the size falls between two
    // growth steps: 2^20 blocks is just past one (worst case), 700k mid-way.
    for blocks in [700_000 / BATCH_BLOCKS * BATCH_BLOCKS, 1 << 20] {
        let single = bytes_per_entry(blocks, 1);
        let shared = bytes_per_entry(blocks / 4, 4);
        println!(
            "index_bytes_per_entry blocks={blocks} one_owner_per_block={single:.1} \
             four_owners_per_block={shared:.1}"
        );
    }
    benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
