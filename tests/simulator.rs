//! The simulator (docs/architecture.md, "Simulator"), driven through its library API: one behaviour
//! per test.

use clap::Parser;
use kvrouted::policy::PolicyKind;
use kvrouted::sim::{
    self, generate, simulate, trace_keys, FollowUp, PolicyReport, SimConfig, SimulateArgs, Trace,
    TraceRequest,
};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: SimulateArgs,
}

fn args(line: &str) -> SimulateArgs {
    let argv = std::iter::once("simulate").chain(line.split_whitespace());
    Cli::try_parse_from(argv).expect("valid flags").args
}

fn run(line: &str) -> String {
    let mut out = Vec::new();
    sim::run_to(&args(line), &mut out).expect("the simulation runs");
    String::from_utf8(out).expect("utf-8 output")
}

/// A small agentic workload that overloads a small fleet: queues, evictions and spills happen.
fn small_agentic(seed: u64) -> Trace {
    let params = generate::AgenticParams {
        sessions: 40,
        turns: 8,
        session_rate: 2.0,
        ..Default::default()
    };
    generate::agentic(&params, 512, seed).unwrap()
}

fn tight_fleet() -> SimConfig {
    SimConfig {
        workers: 4,
        capacity_blocks: 160,
        max_running: 4,
        ..SimConfig::default()
    }
}

fn run_all(trace: &Trace, config: &SimConfig) -> Vec<PolicyReport> {
    sim::simulate_all(trace, config, &PolicyKind::ALL, 2, None).expect("every policy runs")
}

fn request(at_s: f64, input: u64, output: u64, ids: &[u64]) -> TraceRequest {
    TraceRequest {
        arrival_us: (at_s * 1e6) as u64,
        input_tokens: input,
        output_tokens: output,
        hash_ids: ids.to_vec(),
        follows: None,
    }
}

/// One worker, 4-token blocks, prefill 1e-4 s per token, decode 0.02 s per token.
fn one_worker(capacity_blocks: u64) -> SimConfig {
    SimConfig {
        workers: 1,
        capacity_blocks,
        ..SimConfig::default()
    }
}

fn simulate_one(trace: &Trace, config: &SimConfig, policy: PolicyKind) -> PolicyReport {
    simulate(trace, &trace_keys(trace), config, policy, None).expect("the simulation runs")
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn every_request_is_routed_once_and_finishes_once_under_every_policy() {
    let trace = small_agentic(3);
    let n = trace.requests.len() as u64;
    assert!(n > 100, "the workload is not trivial");
    for r in run_all(&trace, &tight_fleet()) {
        assert_eq!(r.completed, n, "{}: every request finishes", r.policy);
        assert_eq!(
            r.decisions.values().sum::<u64>(),
            n,
            "{}: every request is routed exactly once",
            r.policy
        );
        assert_eq!(
            r.served_per_worker.iter().sum::<u64>(),
            n,
            "{}: every request is served by exactly one worker",
            r.policy
        );
        assert_eq!(r.ttft_s.len() as u64, n);
    }
}

#[test]
fn a_workers_cache_never_exceeds_its_capacity_even_under_eviction_pressure() {
    let trace = small_agentic(4);
    for r in run_all(&trace, &tight_fleet()) {
        assert!(
            r.evictions > 0,
            "{}: the fleet is small enough to evict",
            r.policy
        );
        for (w, peak) in r.peak_blocks.iter().enumerate() {
            assert!(
                *peak <= r.capacity_blocks,
                "{}: worker {w} peaked at {peak} blocks, capacity {}",
                r.policy,
                r.capacity_blocks
            );
        }
    }
}

#[test]
fn kv_events_keep_the_routers_index_equal_to_the_simulated_caches() {
    let trace = small_agentic(5);
    for r in run_all(&trace, &tight_fleet()) {
        assert_eq!(
            r.router_rejections, 0,
            "{}: the router accepts every event",
            r.policy
        );
        assert!(
            r.index_in_sync,
            "{}: after the last event the router owns exactly the resident blocks",
            r.policy
        );
    }
}

#[test]
fn the_same_seed_gives_byte_identical_json_sequential_or_parallel() {
    let flags = "--generate agentic --sessions 30 --turns 6 --workers 4 --capacity-blocks 200 \
                 --max-running 4 --session-rate 2 --json --quiet --seed 9";
    let first = run(&format!("{flags} --threads 2"));
    let second = run(&format!("{flags} --threads 1"));
    assert_eq!(first, second, "same seed, same bytes, however many threads");
    let other = run(&flags.replace("--seed 9", "--seed 10"));
    assert_ne!(first, other, "the seed changes the generated workload");
}

#[test]
fn json_output_has_exactly_the_documented_keys() {
    let out = run(
        "--generate agentic --sessions 5 --turns 3 --workers 2 --json --quiet \
                   --policy pressure_first,legacy",
    );
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    let policies = doc["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 2);
    assert_eq!(
        policies[0]["policy"], "pressure_first",
        "policies keep the order given"
    );
    let mut keys: Vec<&str> = policies[0]
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "decisions",
            "duplicate_copies",
            "evictions",
            "ideal_hit_ratio",
            "load_spread",
            "policy",
            "prefix_hit_ratio",
            "throughput_rps",
            "ttft_p50_s",
            "ttft_p90_s",
            "ttft_p99_s"
        ]
    );
    let decisions = policies[0]["decisions"].as_object().unwrap();
    assert_eq!(
        decisions.len(),
        kvrouted::policy::DecisionLabel::ALL.len(),
        "every decision label is reported, zero or not"
    );
}

#[test]
fn hit_ratio_on_a_hand_made_trace_is_the_hand_computed_one() {
    // Block size 4, one worker with room for everything, requests far apart in time.
    let trace = Trace::new(
        4,
        vec![
            request(0.0, 8, 1, &[1, 2]),      // cold: 0 cached
            request(10.0, 12, 1, &[1, 2, 3]), // [1,2] cached: 8 tokens
            request(20.0, 10, 1, &[1, 4, 5]), // keyed [1,4] (10/4 = 2 full blocks): 4 tokens
        ],
    )
    .unwrap();
    let r = simulate_one(&trace, &one_worker(100), PolicyKind::PressureFirst);
    assert_eq!(r.prompt_tokens, 30);
    assert_eq!(r.cached_tokens, 12, "0 + 8 + 4 cached tokens");
    assert!(
        close(r.prefix_hit_ratio, 0.4),
        "12 / 30, got {}",
        r.prefix_hit_ratio
    );
    assert!(
        close(r.ideal_hit_ratio, 0.4),
        "one big cache is the ideal one"
    );
    assert_eq!((r.evictions, r.duplicate_copies), (0, 0));
    // An idle worker's TTFT is its prefill of the uncached tokens: 8, 4 and 6 tokens.
    assert!(
        close(r.ttft_p50_s, 6e-4),
        "median of 0.8, 0.4, 0.6 ms: {}",
        r.ttft_p50_s
    );
    assert!(close(r.ttft_p99_s, 8e-4), "{}", r.ttft_p99_s);
}

#[test]
fn lru_eviction_drops_the_deepest_block_first_so_a_repeated_prompt_keeps_its_head() {
    // Capacity 4 blocks. Each request holds its 2 prompt blocks plus 1 private block
    // (ceil((8 + 1) / 4) = 3 blocks in all).
    let trace = Trace::new(
        4,
        vec![
            request(0.0, 8, 1, &[1, 2]),  // stores A1 A2
            request(10.0, 8, 1, &[3, 4]), // needs 3, 2 free: evicts A2 (the deepest)
            request(20.0, 8, 1, &[1, 2]), // hits A1; needs 2, 1 free: evicts B4
        ],
    )
    .unwrap();
    let r = simulate_one(&trace, &one_worker(4), PolicyKind::PressureFirst);
    assert_eq!(r.cached_tokens, 4, "only A1 survived");
    assert_eq!(r.evictions, 2);
    assert!(close(r.prefix_hit_ratio, 4.0 / 24.0));
    assert!(
        close(r.ideal_hit_ratio, 8.0 / 24.0),
        "an infinite cache keeps all of A"
    );
    assert_eq!(r.peak_blocks, vec![4]);
    assert!(r.index_in_sync, "removals reached the router");
}

#[test]
fn a_block_stored_while_resident_on_another_worker_is_a_duplicate_copy() {
    // Round robin sends the same prompt to w00, then w01.
    let trace = Trace::new(
        4,
        vec![request(0.0, 8, 1, &[1, 2]), request(10.0, 8, 1, &[1, 2])],
    )
    .unwrap();
    let config = SimConfig {
        workers: 2,
        ..one_worker(100)
    };
    let rr = simulate_one(&trace, &config, PolicyKind::RoundRobin);
    assert_eq!(rr.served_per_worker, vec![1, 1]);
    assert_eq!(
        rr.duplicate_copies, 2,
        "both blocks were copied to the second worker"
    );
    assert_eq!(rr.cached_tokens, 0);
    let pf = simulate_one(&trace, &config, PolicyKind::PressureFirst);
    assert_eq!(
        pf.duplicate_copies, 0,
        "pressure-first reuses the idle owner"
    );
    assert_eq!(pf.cached_tokens, 8);
}

#[test]
fn a_follow_up_turn_arrives_a_think_time_after_its_previous_turn_finished() {
    let mut second = request(0.0, 12, 1, &[1, 2, 3]);
    second.follows = Some(FollowUp {
        previous: 0,
        think_us: 1_000_000,
    });
    let trace = Trace::new(4, vec![request(0.0, 8, 100, &[1, 2]), second]).unwrap();
    let r = simulate_one(&trace, &one_worker(100), PolicyKind::PressureFirst);
    // Turn 1: prefill 8 tokens (0.8 ms) + 100 output tokens (2 s). Think 1 s. Turn 2: prefill
    // the 4 uncached tokens (0.4 ms) + 1 output token (20 ms).
    assert!(
        close(r.makespan_s, 0.0008 + 2.0 + 1.0 + 0.0004 + 0.02),
        "{}",
        r.makespan_s
    );
    assert_eq!(r.cached_tokens, 8, "turn 2 reuses turn 1's blocks");
}

#[test]
fn a_request_larger_than_the_cache_still_runs_and_finishes() {
    let ids: Vec<u64> = (0..10).collect();
    let trace = Trace::new(
        4,
        vec![request(0.0, 40, 8, &ids), request(1.0, 40, 8, &ids)],
    )
    .unwrap();
    let r = simulate_one(&trace, &one_worker(6), PolicyKind::PressureFirst);
    assert_eq!(r.completed, 2);
    assert_eq!(r.peak_blocks, vec![6], "it caches only what fits");
    assert_eq!(
        r.cached_tokens, 24,
        "the second request hits the 6 cached blocks"
    );
}

#[test]
fn the_plot_is_an_svg_with_a_curve_and_a_bar_per_policy() {
    let trace = small_agentic(6);
    let reports = run_all(&trace, &tight_fleet());
    let svg = sim::plot::to_svg(&reports, "test");
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<polyline").count(), reports.len());
    for r in &reports {
        assert!(svg.contains(r.policy.as_str()));
    }
}

#[test]
fn gateways_release_the_prefill_part_at_the_first_token_and_the_rest_at_completion() {
    let trace = small_agentic(7);
    let n = trace.requests.len() as u64;
    for r in run_all(&trace, &tight_fleet()) {
        assert_eq!(
            r.first_token_releases, n,
            "{}: every request's first token releases its prefill part",
            r.policy
        );
        assert_eq!(
            r.reserved_work_at_end, 0,
            "{}: completions give back the rest of every reservation",
            r.policy
        );
    }
}

#[test]
fn the_shared_prefix_generator_runs_single_turn_requests_behind_common_prefixes() {
    let out = run(
        "--generate shared-prefix --requests 200 --prefixes 2 --prefix-tokens 4096 \
         --request-rate 4 --workers 4 --quiet --policy pressure_first,dynamo_cost",
    );
    assert!(
        out.starts_with("generated shared-prefix workload: 200 requests"),
        "{out}"
    );
    assert!(
        out.contains("dynamo_cost"),
        "the dynamo_cost baseline runs: {out}"
    );
    let a = args("--generate shared-prefix --requests 300 --prefixes 2 --prefix-tokens 4096");
    let trace = a.workload().unwrap();
    assert!(
        trace.ideal_hit_ratio() > 0.5,
        "8 shared blocks of about 10 per request are reusable: {}",
        trace.ideal_hit_ratio()
    );
}

#[test]
fn a_sweep_runs_the_workload_once_per_value_with_the_value_as_a_column() {
    let flags = "--generate agentic --sessions 10 --turns 3 --workers 2 --quiet \
                 --policy pressure_first --sweep min-match-ratio=0,0.9";
    let out = run(flags);
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("pressure_first"))
        .collect();
    assert_eq!(rows.len(), 2, "one row per value: {out}");
    assert!(
        rows[0].starts_with("0 ") && rows[1].starts_with("0.9 "),
        "{out}"
    );
    let json = run(&format!("{flags} --json"));
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(doc["flag"], "min-match-ratio");
    let runs = doc["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(
        (runs[0]["value"].as_str(), runs[1]["value"].as_str()),
        (Some("0"), Some("0.9"))
    );
    let holds = |run: &serde_json::Value| run["policies"][0]["decisions"]["owner_hold"].as_u64();
    assert!(
        holds(&runs[0]) > holds(&runs[1]),
        "a 0.9 ratio turns most shallow matches into cold misses: the value was applied"
    );
}

#[test]
fn a_sweep_of_a_flag_that_cannot_be_swept_or_a_bad_value_is_an_error() {
    let cli = |line: &str| {
        let argv = std::iter::once("simulate").chain(line.split_whitespace());
        Cli::try_parse_from(argv).map(|c| c.args)
    };
    let err = cli("--generate agentic --sweep policy=p2c").expect_err("rejected");
    assert!(err.to_string().contains("cannot be swept"), "{err}");
    let bad = args("--generate agentic --sessions 2 --quiet --sweep min-match-ratio=2");
    let mut out = Vec::new();
    let err = sim::run_to(&bad, &mut out).expect_err("2 is not a fraction");
    assert!(err.to_string().contains("min-match-ratio"), "{err}");
}

/// Summed over seeds 0..4 of the shared-prefix workload on a small fleet (the herding case:
/// many requests behind a few common prefixes at once): (prefix-hit ratio averaged, duplicate
/// copies summed), for `replicas` routers whose decisions reach each other after `delay_ms`
/// (none: not shared).
fn shared_prefix_over_seeds(replicas: usize, delay_ms: Option<u64>) -> (f64, u64) {
    let params = generate::SharedPrefixParams {
        requests: 300,
        ..Default::default()
    };
    let mut hit = 0.0;
    let mut dups = 0;
    for seed in 0..4 {
        let trace = generate::shared_prefix(&params, 512, seed).unwrap();
        let config = SimConfig {
            replicas,
            decision_delay_ms: delay_ms,
            seed,
            ..tight_fleet()
        };
        let r = simulate_one(&trace, &config, PolicyKind::PressureFirst);
        assert_eq!(r.completed, r.requests, "every request finishes");
        assert!(r.index_in_sync, "every replica's index equals the caches");
        assert_eq!(
            r.reserved_work_at_end, 0,
            "every release reaches every replica: no reserved work is left behind"
        );
        hit += r.prefix_hit_ratio / 4.0;
        dups += r.duplicate_copies;
    }
    (hit, dups)
}

#[test]
fn three_replicas_sharing_decisions_at_once_route_like_one_router_within_tolerance() {
    // Not exactly: each replica draws its power-of-two choices from its own journal
    // sequence, so single decisions differ; over the workload the outcome must not.
    let (one_hit, one_dups) = shared_prefix_over_seeds(1, None);
    let (three_hit, three_dups) = shared_prefix_over_seeds(3, Some(0));
    assert!(
        (three_hit - one_hit).abs() <= 0.01,
        "3 replicas sharing at once keep one router's hit ratio within 0.01: {three_hit:.3} \
         against {one_hit:.3}"
    );
    assert!(
        three_dups as f64 <= 1.2 * one_dups as f64,
        "3 replicas sharing at once make at most 1.2x one router's duplicate copies: \
         {three_dups} against {one_dups}"
    );
}

#[test]
fn sharing_decisions_between_replicas_reduces_duplicate_copies_against_deciding_alone() {
    let (shared_hit, shared_dups) = shared_prefix_over_seeds(3, Some(5));
    let (alone_hit, alone_dups) = shared_prefix_over_seeds(3, None);
    assert!(
        shared_dups < alone_dups,
        "replicas that share decisions (5ms) copy prefixes less than replicas deciding alone: \
         {shared_dups} against {alone_dups}"
    );
    assert!(
        shared_hit >= alone_hit,
        "and reuse at least as much: {shared_hit:.3} against {alone_hit:.3}"
    );
}

#[test]
fn replicas_and_decision_delay_are_flags_and_can_be_swept() {
    let config = args("--generate agentic --replicas 3 --decision-delay off").sim_config();
    assert_eq!((config.replicas, config.decision_delay_ms), (3, None));
    let config = args("--generate agentic --replicas 3 --decision-delay 50ms").sim_config();
    assert_eq!((config.replicas, config.decision_delay_ms), (3, Some(50)));
    let swept = args("--generate agentic")
        .with_flag("decision-delay", "0ms")
        .expect("decision-delay can be swept");
    assert_eq!(swept.sim_config().decision_delay_ms, Some(0));
    assert!(
        SimConfig {
            replicas: 0,
            ..SimConfig::default()
        }
        .validate()
        .is_err(),
        "zero replicas is refused"
    );
}
