//! Every decision label of docs/architecture.md, "Policy", reached from outside the daemon: workers
//! publish vLLM-format KV events (JetStream) and load samples (core NATS) on a real nats-server, a
//! gateway routes over real HTTP, and `/metrics` counts each decision under its label.
mod common;

use common::*;
use kvrouted::input::LifecycleOp;
use serde_json::{json, Value};

/// A broker, a daemon started with `flags`, and connected workers.
struct Fleet {
    daemon: Daemon,
    workers: Vec<Worker>,
    _nats: Nats,
}

impl Fleet {
    async fn start(flags: &[&str], ids: &[&str]) -> Fleet {
        let nats = Nats::start();
        let daemon = Daemon::start(&nats.url(), flags).await;
        daemon.wait_ready().await;
        let mut workers = Vec::new();
        for id in ids {
            workers.push(Worker::connect(&nats.url(), id).await);
        }
        Fleet {
            daemon,
            workers,
            _nats: nats,
        }
    }

    fn worker(&mut self, id: &str) -> &mut Worker {
        self.workers
            .iter_mut()
            .find(|w| w.id == id)
            .expect("a worker of this fleet")
    }

    /// `id` stores every block of `tokens`; waits until the daemon indexed them.
    async fn store(&mut self, id: &str, tokens: &[u32]) {
        let before = self
            .daemon
            .worker(id)
            .await
            .and_then(|w| w["blocks"].as_u64())
            .unwrap_or(0);
        self.worker(id).store(tokens).await;
        self.daemon
            .wait_blocks(id, before + (tokens.len() / 16) as u64)
            .await;
    }

    /// `id` reports `kv_usage`; waits until the daemon shows it as the worker's pressure.
    async fn load(&mut self, id: &str, kv_usage: f64) {
        self.worker(id).load(kv_usage).await;
        self.daemon.wait_load(id, kv_usage).await;
    }

    /// Routes `tokens` (with `extra` fields), expecting a 200; returns the reply.
    async fn route(&self, tokens: &[u32], extra: Value) -> Value {
        let (status, body) = self.daemon.route(tokens, extra).await;
        assert_eq!(status, 200, "a route with candidates is answered: {body}");
        body
    }

    /// Asserts `/metrics` counts `n` decisions labelled `label`.
    async fn assert_counted(&self, label: &str, n: f64) {
        assert_eq!(
            self.daemon.decisions(label).await,
            n,
            "kvrouted_route_decisions_total{{decision=\"{label}\"}} counts every {label} decision"
        );
    }
}

fn decided(body: &Value) -> (&str, &str) {
    (
        body["worker"].as_str().unwrap_or("?"),
        body["decision"].as_str().unwrap_or("?"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpressured_owner_holds_its_prefix_even_when_another_worker_is_cooler() {
    let mut fleet = Fleet::start(&[], &["owner", "cool", "hot"]).await;
    let tokens = prompt(1, 8);
    fleet.store("owner", &tokens).await;
    fleet.load("owner", 0.6).await;
    fleet.load("cool", 0.0).await;
    fleet.load("hot", 0.99).await;

    let body = fleet.route(&tokens, json!({})).await;
    assert_eq!(
        decided(&body),
        ("owner", "owner_hold"),
        "a usable owner keeps its prefix; load elsewhere never moves it: {body}"
    );
    assert_eq!(
        body["matched_blocks"], 8,
        "the whole prefix matched: {body}"
    );
    assert_eq!(
        body["prompt_blocks"], 8,
        "8 full blocks in the prompt: {body}"
    );
    assert_eq!(body["owners"], json!(["owner"]), "the owner set: {body}");

    // The next turns extend the same prefix and stay on the same owner: turn 2 matches the 8
    // blocks the owner reported; turn 3 also matches turn 2's 12 blocks, known only from the
    // router's own record of turn 2 (no KV event for them yet).
    let turn2 = fleet.route(&prompt(1, 12), json!({})).await;
    assert_eq!(
        (decided(&turn2), &turn2["matched_blocks"]),
        (("owner", "owner_hold"), &json!(8)),
        "the next turn of a trajectory stays on its owner: {turn2}"
    );
    let turn3 = fleet.route(&prompt(1, 16), json!({})).await;
    assert_eq!(
        (decided(&turn3), &turn3["matched_blocks"]),
        (("owner", "owner_hold"), &json!(12)),
        "the turn after matches the previous turn's routing record on the same owner: {turn3}"
    );
    fleet.assert_counted("owner_hold", 3.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pressured_sole_owner_spills_once_to_a_safe_home_and_further_spills_wait_out_the_cooldown(
) {
    let mut fleet = Fleet::start(&["--spill-cooldown", "60s"], &["owner", "home", "hot"]).await;
    let tokens = prompt(2, 8);
    fleet.store("owner", &tokens).await;
    fleet.load("owner", 0.95).await;
    fleet.load("home", 0.2).await;
    fleet.load("hot", 0.99).await;

    let spill = fleet.route(&tokens, json!({})).await;
    assert_eq!(
        decided(&spill),
        ("home", "pressure_spill"),
        "every owner is pressured: replicate to the only safe home (fresh, at or below high \
         water); the hot worker is not safe: {spill}"
    );
    assert_eq!(
        spill["owners"],
        json!(["owner"]),
        "the owners at decision time: {spill}"
    );

    let again = fleet.route(&tokens, json!({})).await;
    assert_eq!(
        decided(&again),
        ("home", "owner_hold"),
        "the spill target is now a known owner (before any KV event from it) and it is not \
         pressured: hold there rather than spill again: {again}"
    );
    assert_eq!(
        again["owners"],
        json!(["home", "owner"]),
        "owner and provisional owner are both known owners: {again}"
    );

    // The new owner gets hot too: every known owner is pressured, but a spill for this prefix
    // happened within the cooldown, so no third owner is created.
    fleet.load("home", 0.96).await;
    let held = fleet.route(&tokens, json!({})).await;
    assert_eq!(
        decided(&held),
        ("owner", "spill_cooldown_hold"),
        "within the cooldown, hold on the least-pressured known owner: {held}"
    );
    fleet.assert_counted("pressure_spill", 1.0).await;
    fleet.assert_counted("owner_hold", 1.0).await;
    fleet.assert_counted("spill_cooldown_hold", 1.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_owner_pressured_and_no_safe_home_the_least_pressured_owner_holds() {
    let mut fleet = Fleet::start(&[], &["o1", "o2", "hot", "silent"]).await;
    let tokens = prompt(3, 8);
    fleet.store("o1", &tokens).await;
    fleet.store("o2", &tokens).await;
    fleet.load("o1", 0.97).await;
    fleet.load("o2", 0.93).await;
    fleet.load("hot", 0.99).await;
    // Known, but without telemetry: never a safe home.
    fleet.worker("silent").lifecycle(LifecycleOp::Join).await;
    fleet.daemon.wait_state("silent", "active").await;

    let body = fleet.route(&tokens, json!({})).await;
    assert_eq!(
        decided(&body),
        ("o2", "no_safe_home_hold"),
        "no fresh worker at or below high water: hold on the least-pressured owner: {body}"
    );
    assert_eq!(body["owners"], json!(["o1", "o2"]), "both owners: {body}");
    fleet.assert_counted("no_safe_home_hold", 1.0).await;
    fleet.assert_counted("pressure_spill", 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_owner_ceiling_a_pressured_owner_holds_instead_of_spilling() {
    let mut fleet = Fleet::start(&["--max-owners-per-prefix", "1"], &["owner", "cool"]).await;
    let tokens = prompt(4, 8);
    fleet.store("owner", &tokens).await;
    fleet.load("owner", 0.95).await;
    fleet.load("cool", 0.1).await;

    let body = fleet.route(&tokens, json!({})).await;
    assert_eq!(
        decided(&body),
        ("owner", "ceiling_hold"),
        "one known owner is the ceiling: no new owner, even with a safe home available: {body}"
    );
    fleet.assert_counted("ceiling_hold", 1.0).await;
    fleet.assert_counted("pressure_spill", 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_nobody_holds_is_a_cold_miss_on_a_worker_below_high_water() {
    let mut fleet = Fleet::start(&[], &["owner", "hot", "cool"]).await;
    fleet.store("owner", &prompt(5, 8)).await;
    fleet.load("owner", 0.95).await;
    fleet.load("hot", 0.99).await;
    fleet.load("cool", 0.3).await;

    let body = fleet.route(&prompt(6, 8), json!({})).await;
    assert_eq!(
        decided(&body),
        ("cool", "cold_miss"),
        "no owner: power-of-two choices among workers not above high water: {body}"
    );
    assert_eq!(body["matched_blocks"], 0, "nothing matched: {body}");
    assert_eq!(
        body["owners"],
        json!([]),
        "a cold miss has no owners: {body}"
    );
    fleet.assert_counted("cold_miss", 1.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_excluded_or_draining_owner_falls_back_as_owner_unavailable() {
    let mut fleet = Fleet::start(&[], &["owner", "other"]).await;
    let (first, second) = (prompt(7, 8), prompt(8, 8));
    fleet.store("owner", &first).await;
    fleet.store("owner", &second).await;
    fleet.load("owner", 0.1).await;
    fleet.load("other", 0.5).await;

    let body = fleet.route(&first, json!({"exclude": ["owner"]})).await;
    assert_eq!(
        decided(&body),
        ("other", "owner_unavailable"),
        "the only owner is excluded: fall back to another candidate: {body}"
    );
    assert_eq!(body["owners"], json!([]), "no usable owner: {body}");

    // A drain (lifecycle message on kv.workers.owner) stops new routes to the owner.
    fleet.worker("owner").lifecycle(LifecycleOp::Drain).await;
    fleet.daemon.wait_state("owner", "draining").await;
    let body = fleet.route(&second, json!({})).await;
    assert_eq!(
        decided(&body),
        ("other", "owner_unavailable"),
        "the only owner is draining: fall back to another candidate: {body}"
    );
    assert_eq!(
        fleet.daemon.worker("owner").await.unwrap()["blocks"],
        16,
        "a draining worker keeps its ownership (only leave removes it)"
    );
    fleet.assert_counted("owner_unavailable", 2.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_candidate_worker_a_route_is_503_with_a_one_line_error() {
    let mut fleet = Fleet::start(&[], &["only"]).await;
    let tokens = prompt(9, 4);
    let (status, body) = fleet.daemon.route(&tokens, json!({})).await;
    assert_eq!(status, 503, "no worker known at all: 503: {body}");
    let error = body["error"].as_str().expect("an error field");
    assert!(
        !error.is_empty() && !error.contains('\n'),
        "the error is one line: {error:?}"
    );

    fleet.load("only", 0.1).await;
    let (status, body) = fleet
        .daemon
        .route(&tokens, json!({"exclude": ["only"]}))
        .await;
    assert_eq!(
        status, 503,
        "the only worker excluded: no candidate: {body}"
    );
    fleet.worker("only").lifecycle(LifecycleOp::Drain).await;
    fleet.daemon.wait_state("only", "draining").await;
    let (status, body) = fleet.daemon.route(&tokens, json!({})).await;
    assert_eq!(
        status, 503,
        "the only worker draining: no candidate: {body}"
    );
    for label in [
        "owner_hold",
        "pressure_spill",
        "spill_cooldown_hold",
        "no_safe_home_hold",
        "ceiling_hold",
        "cold_miss",
        "owner_unavailable",
    ] {
        fleet.assert_counted(label, 0.0).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_every_known_worker_with_depth_pressure_telemetry_age_and_reserved_work() {
    let mut fleet = Fleet::start(&[], &["owner", "other", "excluded"]).await;
    let tokens = prompt(10, 8);
    fleet.store("owner", &tokens).await;
    fleet.load("owner", 0.5).await;
    fleet.load("other", 0.2).await;
    fleet.load("excluded", 0.3).await;

    let plain = fleet.route(&tokens, json!({})).await;
    assert!(
        plain.get("explain").is_none(),
        "no explain unless asked: {plain}"
    );
    let (status, _) = fleet
        .daemon
        .post("/v1/release", &json!({"reservation": plain["reservation"]}))
        .await;
    assert_eq!(status, 200, "the reservation releases");

    let body = fleet
        .route(
            &tokens,
            json!({"explain": true, "exclude": ["excluded"], "max_output_tokens": 100}),
        )
        .await;
    assert_eq!(decided(&body), ("owner", "owner_hold"), "{body}");
    let rows = body["explain"].as_array().expect("explain rows");
    assert_eq!(rows.len(), 3, "one row per known worker: {body}");
    let row = |id: &str| -> &Value {
        rows.iter()
            .find(|r| r["worker"] == id)
            .unwrap_or_else(|| panic!("a row for {id}: {body}"))
    };
    for r in rows {
        for field in [
            "worker",
            "candidate",
            "state",
            "depth",
            "pressure",
            "telemetry_age_ms",
            "reserved_work",
        ] {
            assert!(r.get(field).is_some(), "every row has {field}: {r}");
        }
        let age = r["telemetry_age_ms"].as_u64().expect("age in ms");
        assert!(age < 30_000, "fresh telemetry is younger than 30 s: {r}");
        assert_eq!(r["state"], "active", "all workers are active: {r}");
        assert_eq!(
            r["reserved_work"], 0,
            "the earlier reservation was released, this one is counted after: {r}"
        );
    }
    let owner = row("owner");
    assert_eq!(owner["depth"], 8, "the owner holds all 8 blocks: {owner}");
    assert_eq!(owner["candidate"], true, "{owner}");
    assert!(
        (owner["pressure"].as_f64().unwrap() - 0.5).abs() < 1e-9,
        "the owner's pressure: {owner}"
    );
    assert_eq!(row("other")["depth"], 0, "other holds nothing");
    assert_eq!(
        row("excluded")["candidate"],
        false,
        "an excluded worker is not a candidate"
    );

    let workers = fleet.daemon.workers().await;
    let reserved = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == "owner")
        .unwrap()["reserved_work"]
        .clone();
    assert_eq!(
        reserved,
        json!(128 + 100),
        "the route reserved prompt tokens + max_output_tokens on the owner"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_at_the_first_token_gives_back_the_prefill_part_and_the_final_release_the_rest() {
    let mut fleet = Fleet::start(&[], &["w"]).await;
    fleet.store("w", &prompt(1, 4)).await;
    fleet.load("w", 0.1).await;
    // 8 blocks of 16 tokens, 4 of them cached on w: 64 tokens to prefill.
    let body = fleet
        .route(&prompt(1, 8), json!({"max_output_tokens": 100}))
        .await;
    assert_eq!(decided(&body), ("w", "owner_hold"), "{body}");
    let reservation = body["reservation"].clone();
    let reserved = |w: Option<Value>| w.and_then(|w| w["reserved_work"].as_u64());
    assert_eq!(
        reserved(fleet.daemon.worker("w").await),
        Some(128 + 100),
        "work = prompt + output"
    );

    let (status, reply) = fleet
        .daemon
        .post(
            "/v1/release",
            &json!({"reservation": reservation, "phase": "prefill"}),
        )
        .await;
    assert_eq!(
        (status, &reply),
        (200, &json!({"released": reservation, "phase": "prefill"})),
        "the first token releases the prefill part"
    );
    assert_eq!(
        reserved(fleet.daemon.worker("w").await),
        Some(64 + 100),
        "the 64 uncached prompt tokens are given back, the rest stays"
    );

    let (status, reply) = fleet
        .daemon
        .post(
            "/v1/release",
            &json!({"reservation": reservation, "phase": "decode"}),
        )
        .await;
    assert_eq!(status, 400, "an unknown phase is bad input: {reply}");
    assert!(
        reply["error"]
            .as_str()
            .is_some_and(|e| e.contains("prefill")),
        "the error names the phases there are: {reply}"
    );

    let (status, _) = fleet
        .daemon
        .post("/v1/release", &json!({"reservation": reservation}))
        .await;
    assert_eq!(status, 200, "the request finished: everything else");
    assert_eq!(reserved(fleet.daemon.worker("w").await), Some(0));
    let (status, _) = fleet
        .daemon
        .post("/v1/release", &json!({"reservation": reservation}))
        .await;
    assert_eq!(status, 404, "a released reservation is gone");
}
