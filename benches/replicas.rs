//! Replicas on a NATS cluster (docs/deploy.md): routes per second through 1 and through 2
//! replicas, and the failover time when a NATS server is killed under load, in one run on a real
//! 3-server nats-server cluster on loopback with the release daemon.
//!
//! Run: `cargo bench --bench replicas` (on demand, never part of `cargo test`); options after
//! `--` (`-- --help` lists them; an unknown one stops the run): `--seconds N` (each routes round,
//! default 5), `--rounds N` (default 3), `--concurrency N` (HTTP routes in flight, default 16).
//! Needs `nats-server` (see `scripts/nats-server.sh`). Everything it starts is killed on exit.
//!
//! 1. **routes**: 64 workers each hold 8 prefixes of 64 blocks (KV events through the cluster);
//!    routes of 1,024-token prompts extending those prefixes, at fixed concurrency, through
//!    replica a alone and then spread round robin over replicas a and b. The two take turns in
//!    `--rounds` rounds (b is stopped for the one-replica rounds) so that other load on the
//!    machine lands on both alike. Each replica also applies its peer's decisions.
//! 2. **failover**: a publisher sends a KV batch every 5 ms through server 2 and routes go to
//!    replica a (connected to server 0) in a loop; server 0 is killed. Reported: the time until
//!    replica a has applied a batch published after the kill (ingest back: everything before
//!    it is applied too), the longest gap between answered routes on a, routes that failed, and
//!    the publisher's longest wait for an ack (the cluster's own failover).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::builder::RangedU64ValueParser;
use clap::Parser;
use kvrouted::wire::encode_vllm_batch;
use kvrouted_testkit::{gpu_blocks_stored, prompt, Daemon, NatsCluster, Worker};
use serde_json::json;

const WORKERS: u32 = 64;
const PREFIXES_PER_WORKER: u32 = 8;
const PREFIX_BLOCKS: usize = 64;

/// Command-line options (after `--` in `cargo bench --bench replicas -- ...`).
#[derive(Parser)]
#[command(
    name = "replicas",
    about = "Routes through one and two kvrouted replicas on a NATS cluster, and failover when a server dies"
)]
struct Options {
    /// Seconds of each routes round
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    seconds: u64,
    /// Rounds of one replica and of two, taking turns
    #[arg(long, default_value_t = 3, value_parser = RangedU64ValueParser::<usize>::new().range(1..=100))]
    rounds: usize,
    /// HTTP routes in flight
    #[arg(long, default_value_t = 16, value_parser = RangedU64ValueParser::<usize>::new().range(1..=4096))]
    concurrency: usize,
    /// Passed by `cargo bench`; ignored
    #[arg(long, hide = true)]
    bench: bool,
}

async fn start_replica(url: &str, name: &str) -> Daemon {
    Daemon::start_replica(url, name, &["--log-format", "json"]).await
}

/// Routes prompts of the workers' prefixes for `seconds` at `concurrency`, spread round robin
/// over `targets`; returns the routes answered per second.
async fn route_round(targets: &[String], seconds: u64, concurrency: usize) -> f64 {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..concurrency {
        let (client, stop, answered) = (client.clone(), stop.clone(), answered.clone());
        let targets = targets.to_vec();
        tasks.push(tokio::spawn(async move {
            let mut n = t;
            while !stop.load(Ordering::Relaxed) {
                let seed = (n as u32 * 7919) % (WORKERS * PREFIXES_PER_WORKER);
                let body = json!({ "tokens": prompt(seed, 64) });
                let url = &targets[n % targets.len()];
                if let Ok(r) = client.post(url).json(&body).send().await {
                    if r.status().is_success() {
                        answered.fetch_add(1, Ordering::Relaxed);
                    }
                }
                n += concurrency;
            }
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    answered.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let o = Options::parse();
    let mut cluster = NatsCluster::start().await;
    let a = start_replica(&cluster.url(0), "ra").await;

    // The fleet: every worker holds its prefixes (through server 2), with a load sample.
    let setup = Instant::now();
    for w in 0..WORKERS {
        let mut worker = Worker::connect(&cluster.url(2), &format!("w{w}")).await;
        for p in 0..PREFIXES_PER_WORKER {
            worker
                .store(&prompt(w * PREFIXES_PER_WORKER + p, PREFIX_BLOCKS))
                .await;
        }
        worker.load(0.3).await;
    }
    let fleet_blocks = u64::from(WORKERS * PREFIXES_PER_WORKER) * PREFIX_BLOCKS as u64;
    wait_total_blocks(&a, fleet_blocks).await;
    println!(
        "fleet: {WORKERS} workers x {PREFIXES_PER_WORKER} prefixes x {PREFIX_BLOCKS} blocks, \
         indexed in {:.1}s",
        setup.elapsed().as_secs_f64()
    );

    // Routes: one replica and two, in turns.
    let mut b = start_replica(&cluster.url(1), "rb").await;
    b.terminate();
    let (mut one, mut two) = (Vec::new(), Vec::new());
    for round in 0..o.rounds {
        one.push(route_round(&[a.url("/v1/route")], o.seconds, o.concurrency).await);
        b.restart().await;
        b.wait_ready().await;
        two.push(
            route_round(
                &[a.url("/v1/route"), b.url("/v1/route")],
                o.seconds,
                o.concurrency,
            )
            .await,
        );
        b.terminate();
        println!(
            "round {round}: 1 replica {:.0} routes/s, 2 replicas {:.0} routes/s",
            one[round], two[round]
        );
    }
    let (one, two) = (median(one), median(two));
    println!(
        "routes/s (median of {} rounds of {}s, concurrency {}): 1 replica {one:.0}, 2 replicas \
         {two:.0} (ratio {:.2})",
        o.rounds,
        o.seconds,
        o.concurrency,
        two / one
    );

    // Failover: server 0 (replica a's) is killed under events and routes.
    b.restart().await;
    b.wait_ready().await;
    failover(&mut cluster, &a).await;
    drop(b);
}

/// Sum of blocks over every worker on `daemon`.
async fn total_blocks(daemon: &Daemon) -> u64 {
    daemon.blocks().await.values().sum()
}

async fn wait_total_blocks(daemon: &Daemon, at_least: u64) {
    kvrouted_testkit::eventually("the replica indexed the fleet", || async {
        (total_blocks(daemon).await >= at_least).then_some(())
    })
    .await;
}

/// Blocks of the failover publisher's worker on `daemon`.
async fn fo_blocks(daemon: &Daemon) -> u64 {
    daemon.blocks().await.get("fo").copied().unwrap_or(0)
}

async fn failover(cluster: &mut NatsCluster, a: &Daemon) {
    let client = async_nats::connect(cluster.url(2)).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let acked = Arc::new(AtomicU64::new(0));
    let max_ack_wait = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // One block per batch from worker `fo`, every 5 ms, each retried until acked.
    let publisher = {
        let (acked, max_ack_wait, stop) = (acked.clone(), max_ack_wait.clone(), stop.clone());
        tokio::spawn(async move {
            let mut seq = 0u64;
            let mut ticker = tokio::time::interval(Duration::from_millis(5));
            while !stop.load(Ordering::Relaxed) {
                ticker.tick().await;
                seq += 1;
                // One block of its own per batch.
                let tokens = vec![seq as u32; 16];
                let payload: bytes::Bytes =
                    encode_vllm_batch(1.0, &[gpu_blocks_stored(vec![seq], tokens)], None).into();
                let started = Instant::now();
                loop {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("Kv-Seq", seq.to_string().as_str());
                    let sent = js
                        .publish_with_headers("kv.events.fo", headers, payload.clone())
                        .await;
                    if let Ok(ack) = sent {
                        if ack.await.is_ok() {
                            break;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                let waited = started.elapsed().as_millis() as u64;
                max_ack_wait.fetch_max(waited, Ordering::Relaxed);
                acked.store(seq, Ordering::Release);
            }
        })
    };
    // Routes on replica a in a loop: the longest gap between answers, and failures.
    let router = {
        let (url, stop) = (a.url("/v1/route"), stop.clone());
        tokio::spawn(async move {
            let client = reqwest::Client::new();
            let body = json!({ "tokens": prompt(1, 64) });
            let (mut last, mut max_gap, mut failed) = (Instant::now(), Duration::ZERO, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let ok = client
                    .post(&url)
                    .json(&body)
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                if ok {
                    max_gap = max_gap.max(last.elapsed());
                    last = Instant::now();
                } else {
                    failed += 1;
                }
            }
            (max_gap, failed)
        })
    };
    // Steady state first.
    while fo_blocks(a).await < 200 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let killed_at = Instant::now();
    cluster.stop(0);
    let last_before = acked.load(Ordering::Acquire);
    let ingest_back = loop {
        if fo_blocks(a).await > last_before {
            break killed_at.elapsed();
        }
        if killed_at.elapsed() > Duration::from_secs(60) {
            panic!("replica a did not apply a batch published after the kill within 60s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let _ = publisher.await;
    let (max_gap, failed) = router.await.unwrap();
    println!(
        "failover (server 0 killed, replica a on it): ingest back after {} ms; routes on a: \
         longest gap between answers {} ms, {failed} failed; publisher's longest ack wait {} ms",
        ingest_back.as_millis(),
        max_gap.as_millis(),
        max_ack_wait.load(Ordering::Relaxed)
    );
    cluster.restart(0);
}
