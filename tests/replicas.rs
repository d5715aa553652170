//! Replicas on a NATS cluster (docs/deploy.md; docs/architecture.md, "Scale"): a real 3-server
//! nats-server cluster on loopback with the streams at 3 replicas, and 2 or 3 real `kvrouted`
//! processes, each connected to a different server with its own data dir and consumers. Events
//! published to any server reach every replica; replicas share their decisions, so they agree on
//! owners, coalesce spills and release each other's reservations; the loss of a server or of a
//! replica loses nothing, and a replica that comes back catches up before it is ready.
mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use kvrouted::wire::encode_vllm_batch;
use serde_json::{json, Value};

/// Starts replica `name` connected to server `server` of the cluster; waits until it is ready.
async fn start_replica(cluster: &NatsCluster, server: usize, name: &str) -> Daemon {
    Daemon::start_replica(&cluster.url(server), name, &["--spill-cooldown", "60s"]).await
}

fn decided(body: &Value) -> (&str, &str) {
    (
        body["worker"].as_str().unwrap_or("?"),
        body["decision"].as_str().unwrap_or("?"),
    )
}

/// Routes `tokens` on `daemon`, expecting an answer; returns the reply.
async fn route(daemon: &Daemon, tokens: &[u32]) -> Value {
    let (status, body) = daemon.route(tokens, json!({})).await;
    assert_eq!(
        status, 200,
        "a replica answers a route with candidates: {body}"
    );
    body
}

/// Polls until every replica shows the same reserved work per worker, and returns it. Equal
/// figures can also come from decisions that have not all arrived yet (two replicas that each
/// made one route of the same size): where that can happen, wait for a known total
/// ([`reserved_work_reaches`]).
async fn reserved_work_agrees(replicas: &[&Daemon]) -> BTreeMap<String, u64> {
    eventually("every replica shows the same reserved work", || async {
        let first = replicas[0].reserved_work().await;
        for other in &replicas[1..] {
            if other.reserved_work().await != first {
                return None;
            }
        }
        Some(first)
    })
    .await
}

/// Polls until every replica shows `expected` reserved work per worker. Each figure that differs
/// is printed once, so a timeout shows where the replicas stood.
async fn reserved_work_reaches(
    replicas: &[&Daemon],
    expected: &BTreeMap<String, u64>,
    deadline: Duration,
) {
    let last_seen = std::sync::Mutex::new(Vec::new());
    let last_seen = &last_seen;
    eventually_within(
        deadline,
        "every replica shows the expected reserved work",
        || async move {
            let mut seen = Vec::with_capacity(replicas.len());
            for replica in replicas {
                seen.push(replica.reserved_work().await);
            }
            if seen.iter().all(|figures| figures == expected) {
                return Some(());
            }
            let mut last = last_seen.lock().unwrap();
            if *last != seen {
                eprintln!("reserved work per replica {seen:?}, expected {expected:?}");
                *last = seen;
            }
            None
        },
    )
    .await
}

/// Polls until `worker`'s load sample with `kv_usage` is applied on every replica.
async fn load_everywhere(worker: &Worker, kv_usage: f64, replicas: &[&Daemon]) {
    worker.load(kv_usage).await;
    for replica in replicas {
        replica.wait_load(&worker.id, kv_usage).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_on_a_cluster_agree_on_owners_coalesce_spills_and_release_each_others_reservations(
) {
    let cluster = NatsCluster::start().await;
    let a = start_replica(&cluster, 0, "ra").await;
    let b = start_replica(&cluster, 1, "rb").await;
    let replicas = [&a, &b];
    // Workers publish to every server: to the one neither replica reads from, and to each
    // replica's own.
    let mut owner = Worker::connect(&cluster.url(2), "owner").await;
    let home = Worker::connect(&cluster.url(0), "home").await;
    let hot = Worker::connect(&cluster.url(1), "hot").await;
    let spare = Worker::connect(&cluster.url(2), "spare").await;

    let first = prompt(1, 8);
    owner.store(&first).await;
    for replica in replicas {
        replica.wait_blocks("owner", 8).await;
    }
    load_everywhere(&owner, 0.5, &replicas).await;
    load_everywhere(&home, 0.2, &replicas).await;
    load_everywhere(&hot, 0.99, &replicas).await;
    load_everywhere(&spare, 0.3, &replicas).await;

    let mut first_decision = None;
    for replica in replicas {
        let body = route(replica, &first).await;
        assert_eq!(
            decided(&body),
            ("owner", "owner_hold"),
            "every replica routes a prefix to the owner its KV events name: {body}"
        );
        if first_decision.is_none() {
            // The first decision anywhere, applied where it was made at once: one route's work.
            first_decision = Some(replica.reserved_work().await);
        }
    }
    // Both replicas hold both routes before the release below is counted from them: equal
    // figures alone could be each replica's own route before the other's arrived (seen under
    // load: the release then seemed to give back nothing).
    let mut before = first_decision.expect("every replica routed");
    let one_route = before["owner"];
    before.insert("owner".to_string(), 2 * one_route);
    reserved_work_reaches(&replicas, &before, DEADLINE).await;

    // A reservation made through one replica is released through the other, and the release
    // takes effect on both.
    let made = route(&a, &first).await;
    let reservation = made["reservation"].clone();
    let after_route = reserved_work_agrees(&replicas).await;
    assert!(
        after_route["owner"] > before["owner"],
        "a route on one replica reserves work on every replica: {before:?} -> {after_route:?}"
    );
    let (status, body) = b
        .post("/v1/release", &json!({ "reservation": reservation }))
        .await;
    assert_eq!(
        status, 200,
        "a release of a peer's reservation is found on the replica it reaches: {body}"
    );
    let after_release = reserved_work_agrees(&replicas).await;
    assert_eq!(
        after_release["owner"], before["owner"],
        "a release through any replica gives the work back on every replica"
    );

    // A spill through replica a: every owner of the prefix is pressured, `home` is the safe home.
    let second = prompt(2, 8);
    owner.store(&second).await;
    for replica in replicas {
        replica.wait_blocks("owner", 16).await;
    }
    load_everywhere(&owner, 0.95, &replicas).await;
    let spill = route(&a, &second).await;
    assert_eq!(
        decided(&spill),
        ("home", "pressure_spill"),
        "the pressured sole owner spills to the least pressured safe home: {spill}"
    );
    reserved_work_agrees(&replicas).await;
    // Now `home` is hot too. Replica b has not spilled, but a did inside the cooldown: b knows
    // `home` as a provisional owner and holds, rather than spilling again to `spare`.
    load_everywhere(&home, 0.96, &replicas).await;
    let held = route(&b, &second).await;
    assert_eq!(
        decided(&held),
        ("owner", "spill_cooldown_hold"),
        "a peer's spill inside the cooldown counts as this replica's own: no second spill: {held}"
    );
    assert_eq!(
        held["owners"],
        json!(["home", "owner"]),
        "the peer's spill target is a known owner on this replica: {held}"
    );
    assert_eq!(
        b.decisions("pressure_spill").await,
        0.0,
        "replica b never spilled this prefix itself"
    );
}

/// A publisher that numbers its batches and, when the cluster does not ack one (a server is
/// being killed), publishes it again with the same `Kv-Seq`: what the engine bridge does.
struct BurstPublisher {
    id: String,
    js: async_nats::jetstream::Context,
    seq: u64,
    next_hash: u64,
}

impl BurstPublisher {
    async fn connect(url: &str, id: &str) -> BurstPublisher {
        let client = async_nats::connect(url)
            .await
            .expect("connect to the cluster");
        BurstPublisher {
            id: id.to_string(),
            js: async_nats::jetstream::new(client),
            seq: 0,
            next_hash: 1,
        }
    }

    /// Stores every block of `tokens` in one batch; returns once the stream has acked it. The
    /// batch after a server's loss is acked only once the stream has a new leader, so the wait is
    /// a failover's ([`FAILOVER`]): with the default 20 s, one run in 25 beside a busy loop ran
    /// out on the batch published just after the loss.
    async fn store(&mut self, tokens: &[u32]) {
        self.seq += 1;
        let blocks = tokens.len() / 16;
        let hashes: Vec<u64> = (0..blocks as u64).map(|i| self.next_hash + i).collect();
        self.next_hash += blocks as u64;
        let payload: bytes::Bytes = encode_vllm_batch(
            1.0,
            &[gpu_blocks_stored(hashes, tokens[..blocks * 16].to_vec())],
            None,
        )
        .into();
        let subject = format!("kv.events.{}", self.id);
        let seq = self.seq.to_string();
        eventually_within(FAILOVER, &format!("the cluster acks batch {seq}"), || {
            let (js, subject, payload) = (self.js.clone(), subject.clone(), payload.clone());
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Kv-Seq", seq.as_str());
            async move {
                let ack = js
                    .publish_with_headers(subject, headers, payload)
                    .await
                    .ok()?;
                ack.await.ok().map(|_| ())
            }
        })
        .await;
    }
}

/// How long a wait may take that spans a lost server: the cluster elects new leaders for the
/// streams and consumers the server led (each election takes seconds, and on a loaded 2-core
/// machine it can take more than one round), and a replica's consumer retries with a backoff
/// of up to 5 s. Measured: 0.2–15 s with two busy loops beside the test, once over 20 s.
const FAILOVER: Duration = Duration::from_secs(60);

/// Batches of the burst, and blocks per batch.
const BURST: u32 = 120;
const BURST_BLOCKS: usize = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_server_mid_burst_and_a_replica_loses_nothing_and_the_restarted_replica_catches_up_before_it_is_ready(
) {
    let mut cluster = NatsCluster::start().await;
    let a = start_replica(&cluster, 0, "ra").await;
    let b = start_replica(&cluster, 1, "rb").await;
    let mut c = start_replica(&cluster, 2, "rc").await;
    let mut publisher = BurstPublisher::connect(&cluster.url(1), "w").await;
    let worker = Worker::connect(&cluster.url(2), "w").await;
    load_everywhere(&worker, 0.3, &[&a, &b, &c]).await;

    // A burst of events, with routes through replica a; a third of the way in, the server that
    // replica a reads from is killed. Every route of the burst reserves the same work (prompts
    // of one length, no output limit): counted, they give the total the replicas must reach.
    let mut burst_routes = 0;
    let mut burst_route_work = 0;
    for i in 0..BURST {
        if i == BURST / 3 {
            cluster.stop(0);
            route(&b, &prompt(1_000, BURST_BLOCKS)).await;
            burst_routes += 1;
        }
        let tokens = prompt(1_000 + i, BURST_BLOCKS);
        publisher.store(&tokens).await;
        if i % 10 == 0 {
            let (status, body) = a.route(&tokens, json!({})).await;
            assert_eq!(
                status, 200,
                "the replica whose server died keeps answering routes: {body}"
            );
            burst_routes += 1;
            if i == 0 {
                // The first decision anywhere, applied where it was made at once.
                burst_route_work = a.reserved_work().await["w"];
            }
        }
    }
    let burst_blocks = u64::from(BURST) * BURST_BLOCKS as u64;
    for replica in [&a, &b, &c] {
        replica
            .wait_blocks_within("w", burst_blocks, FAILOVER)
            .await;
    }
    cluster.restart(0);
    // Equal figures are not enough here: a replica that lacks one peer decision can match
    // replicas that lack another while the decisions made during the outage arrive.
    let before = burst_routes * burst_route_work;
    let agreed_before = BTreeMap::from([("w".to_string(), before)]);
    reserved_work_reaches(&[&a, &b, &c], &agreed_before, FAILOVER).await;

    // Replica c goes away; the others keep answering and keep deciding.
    c.kill9();
    let later = prompt(2_000, 4);
    publisher.store(&later).await;
    let mut own_work = 0;
    for replica in [&a, &b] {
        replica.wait_blocks("w", burst_blocks + 4).await;
        let body = route(replica, &later).await;
        assert_eq!(
            decided(&body),
            ("w", "owner_hold"),
            "with a replica gone the others answer, on the owner: {body}"
        );
        if own_work == 0 {
            // A decision is applied where it is made at once: what the first one reserved.
            own_work = replica.reserved_work().await["w"] - before;
        }
    }
    // Both routes reserved the same work; equal figures on a and b alone could be each one's
    // own decision without the other's.
    let agreed = BTreeMap::from([("w".to_string(), before + 2 * own_work)]);
    reserved_work_reaches(&[&a, &b], &agreed, DEADLINE).await;

    // Back: ready only once it has caught up with both streams, so it agrees at once.
    c.restart().await;
    c.wait_ready().await;
    assert_eq!(
        c.blocks().await.get("w"),
        Some(&(burst_blocks + 4)),
        "a replica is ready only after the events published while it was down are applied"
    );
    assert_eq!(
        c.reserved_work().await,
        agreed,
        "a replica is ready only after the decisions its peers made while it was down are applied"
    );
    let body = route(&c, &later).await;
    assert_eq!(
        decided(&body),
        ("w", "owner_hold"),
        "the restarted replica routes as its peers do: {body}"
    );

    let mut replicas = [a, b, c];
    for replica in &mut replicas {
        assert!(replica.terminate().success(), "a replica stops cleanly");
        let (ok, stdout, stderr) = replay_verify("--data-dir", &replica.data_dir, None);
        assert!(
            ok,
            "replay --verify of every replica's journal re-derives its decisions, peers' inputs \
             included; stdout:\n{stdout}\nstderr:\n{stderr}"
        );
    }
}
