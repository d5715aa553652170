//! Routes decided on the matched ranks and the fleet's candidate pools pick what a view of
//! every worker picks, through what changes pool membership: models, data-parallel ranks,
//! lower tiers, drains and leaves, stale telemetry, reserved prefill, settings, and a clock that
//! goes back.

use super::*;

use rand::{Rng, SeedableRng};

/// Two routers fed the same inputs; routes go to one as they are and to the other with explain
/// rows, which view every worker.
struct Twins {
    pooled: Fleet,
    scanned: Fleet,
    routes: usize,
}

impl Twins {
    fn new() -> Self {
        Twins {
            pooled: Fleet::new(),
            scanned: Fleet::new(),
            routes: 0,
        }
    }

    fn apply(&mut self, input: Input) {
        let a = self.pooled.apply(input.clone());
        let b = self.scanned.apply(input);
        assert_eq!(a, b, "the twins disagree on an input that is not a route");
    }

    fn set_now(&mut self, now: u64) {
        self.pooled.now = now;
        self.scanned.now = now;
    }

    fn route(&mut self, mut req: RouteRequest) {
        req.explain = false;
        let pooled = self.pooled.apply(Input::Route(req.clone()));
        self.pooled.router.assert_route_rows_follow_workers();
        req.explain = true;
        let mut scanned = self.scanned.apply(Input::Route(req));
        if let Output::Routed(d) = &mut scanned {
            d.explain = None;
        }
        assert_eq!(
            pooled, scanned,
            "a route on the pools decided otherwise than a view of every worker"
        );
        self.routes += 1;
    }
}

const MODELS: [Option<&str>; 3] = [None, Some("a"), Some("b")];

#[test]
fn routes_on_the_pools_decide_as_a_view_of_every_worker() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut twins = Twins::new();
    let worker = |i: u32| format!("w{i}");
    let mut now = 1_000_000u64;
    for step in 0..4_000u32 {
        let w = rng.random_range(0..12u32);
        let rank = rng.random_range(0..2u32);
        let model = MODELS[rng.random_range(0..MODELS.len())];
        let chain = rng.random_range(0..4u64);
        let locals: Vec<u64> = (0..rng.random_range(1..6u64))
            .map(|b| chain * 100 + b)
            .collect();
        match rng.random_range(0..20u32) {
            0..=3 => {
                let medium =
                    [Medium::Gpu, Medium::Gpu, Medium::Host, Medium::Disk][rng.random_range(0..4)];
                let mut batch =
                    KvEventBatch::of(id(&worker(w)), vec![chain_event(&locals, medium)]);
                batch.dp_rank = rank;
                twins.apply(Input::KvEvents(batch));
            }
            4 => {
                let mut batch =
                    KvEventBatch::of(id(&worker(w)), vec![removal(&locals, Medium::Gpu)]);
                batch.dp_rank = rank;
                twins.apply(Input::KvEvents(batch));
            }
            5..=8 => twins.apply(Input::Load(LoadSample {
                worker: id(&worker(w)),
                kv_usage: f64::from(rng.random_range(0..=12u32)) / 10.0,
                running: 1,
                waiting: rng.random_range(0..3),
                max_running: None,
                model: model.map(str::to_owned),
                dp_rank: rank,
            })),
            9 => twins.apply(Input::Lifecycle(Lifecycle {
                worker: id(&worker(w)),
                op: [LifecycleOp::Join, LifecycleOp::Drain, LifecycleOp::Leave]
                    [rng.random_range(0..3)],
                model: model.map(str::to_owned),
                block_size: None,
                capacity_blocks: None,
                dp_size: None,
                epoch: None,
            })),
            10 => twins.apply(Input::Release {
                reservation: u64::from(step.saturating_sub(rng.random_range(0..30))),
                phase: [None, Some(ReleasePhase::Prefill)][rng.random_range(0..2)],
            }),
            11 => twins.apply(Input::Tick),
            12 => {
                // Settings the pools count by: high_water and the backlog's weight.
                let mut config = twins.pooled.router.config().clone();
                config.policy.high_water = [0.5, 0.9][rng.random_range(0..2)];
                config.policy.backlog_pressure_tokens = [0, 8, 65_536][rng.random_range(0..3)];
                twins.apply(Input::Configure(Box::new(config)));
            }
            13 => {
                // Time passes, beyond the telemetry's 30s now and then, and sometimes goes back.
                now = match rng.random_range(0..8u32) {
                    0 => now - rng.random_range(0..40_000),
                    1..=2 => now + rng.random_range(0..40_000),
                    _ => now + rng.random_range(0..2_000),
                };
                twins.set_now(now);
            }
            _ => {
                let mut req = Fleet::request(&locals);
                req.model = MODELS[rng.random_range(0..MODELS.len())].map(str::to_owned);
                if rng.random_range(0..4) == 0 {
                    req.exclude = (0..rng.random_range(1..4))
                        .map(|_| id(&worker(rng.random_range(0..12))))
                        .collect();
                }
                twins.route(req);
            }
        }
    }
    assert!(twins.routes > 1_000, "the run routed too little to compare");
}

#[test]
fn a_worker_whose_high_pressure_sample_went_stale_is_drawn_again_on_cold_misses() {
    let mut fleet = Fleet::new();
    fleet.load("hot", 0.95);
    fleet.load("cool", 0.1);
    for i in 0..8 {
        let d = fleet.route(&[1_000 + i]);
        assert_eq!(
            d.worker.as_str(),
            "cool",
            "a worker above high_water takes no cold miss"
        );
    }
    // 31s later only "cool" has reported again: "hot"'s sample is stale, which is not pressure.
    fleet.advance(31_000);
    fleet.load("cool", 0.1);
    let chosen: Vec<String> = (0..16)
        .map(|i| fleet.route(&[2_000 + i]).worker.to_string())
        .collect();
    assert!(
        chosen.iter().any(|w| w == "hot"),
        "stale telemetry fails open: the worker must be drawn again, got {chosen:?}"
    );
}
