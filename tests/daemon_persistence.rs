//! Event sourcing end to end (docs/architecture.md: "Failure and bad input"; issue 4): a real
//! nats-server with JetStream, the real `kvrouted` binary on a real sled data dir. The daemon is
//! killed with SIGKILL in the middle of an event burst and stopped cleanly with SIGTERM; its
//! journal is replayed, exported, questioned with counterfactual settings; broken data dirs are
//! refused.
mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::*;
use serde_json::{json, Value};

/// Blocks per stored prompt (and per `BlockStored` batch): a typical KV event batch.
const PROMPT_BLOCKS: usize = 32;

/// `kvrouted journal export` of the data dir `dir` into `work`; returns the export's path.
fn export_journal(dir: &Path, work: &Path) -> PathBuf {
    let exported = work.join("journal.kvj");
    let (ok, _, _, stderr) = kvrouted([
        "journal".as_ref(),
        "export".as_ref(),
        "--data-dir".as_ref(),
        dir.as_os_str(),
        "--out".as_ref(),
        exported.as_os_str(),
    ]);
    assert!(ok, "journal export succeeds: {stderr}");
    exported
}

/// The numeric `field=N` of a structured log line.
fn field(line: &str, name: &str) -> Option<u64> {
    let at = line.find(&format!(" {name}="))? + name.len() + 2;
    line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .ok()
}

/// The log lines (colour stripped) whose message contains `needle`.
fn log_lines(daemon: &Daemon, needle: &str) -> Vec<String> {
    plain(&daemon.log_text())
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_owned)
        .collect()
}

/// The `replayed N entries: D decisions, C changed (P%)` report of `kvrouted replay`.
#[derive(Debug, PartialEq)]
struct ReplayReport {
    entries: u64,
    decisions: u64,
    changed: u64,
}

/// The line of `kvrouted replay`'s output that starts with `start`, and its words.
fn report_line<'a>(stdout: &'a str, start: &str) -> (&'a str, Vec<&'a str>) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("replay prints a line starting {start:?}; stdout:\n{stdout}"));
    (line, line.split_whitespace().collect())
}

/// A count in a report line.
fn count(word: &str, line: &str) -> u64 {
    word.parse()
        .unwrap_or_else(|_| panic!("{word:?} in {line:?} is a count"))
}

fn replay_report(stdout: &str) -> ReplayReport {
    let (line, words) = report_line(stdout, "replayed ");
    // replayed N entries: D decisions, C changed (P%)
    assert_eq!(
        (words[0], words[2], words[4], words[6]),
        ("replayed", "entries:", "decisions,", "changed"),
        "report line format: {line}"
    );
    assert!(
        words[7].starts_with('(') && words[7].ends_with("%)"),
        "the report gives the changed share in percent: {line}"
    );
    let report = ReplayReport {
        entries: count(words[1], line),
        decisions: count(words[3], line),
        changed: count(words[5], line),
    };
    // applying them took the core T s: R routes in T s (U µs each), O other inputs in T s (U µs each)
    let (timing, words) = report_line(stdout, "applying them took the core ");
    assert_eq!(
        (words[8], words[16], words[17]),
        ("routes", "other", "inputs"),
        "timing line format: {timing}"
    );
    let (routes, others) = (count(words[7], timing), count(words[15], timing));
    assert_eq!(
        routes + others,
        report.entries,
        "the timing line accounts for every replayed entry: {timing}"
    );
    assert_eq!(
        routes, report.decisions,
        "every replayed route is a decision the report counts: {timing}"
    );
    report
}

/// The seq named by `first divergence at seq S: ...`, if printed.
fn first_divergence(stdout: &str) -> Option<(u64, String)> {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("first divergence at seq "))?;
    let rest = &line["first divergence at seq ".len()..];
    let (seq, detail) = rest.split_once(':')?;
    Some((seq.parse().ok()?, detail.trim().to_string()))
}

/// A worker and the blocks it holds by its own account: prompt seed → engine hashes still
/// resident, leading blocks first (tail evictions drop from the end).
struct Ledger {
    worker: Worker,
    held: BTreeMap<u32, Vec<u64>>,
    gone: Vec<u32>,
    batches: u64,
}

impl Ledger {
    fn blocks(&self) -> u64 {
        self.held.values().map(|h| h.len() as u64).sum()
    }

    /// The seed of prompt `i` of worker `w`: distinct token streams for every (worker, i).
    fn seed(w: usize, i: usize) -> u32 {
        1 + (w * 1000 + i) as u32
    }

    /// Batch `i` of a churning cache: mostly stores of new 32-block prompts, every fourth batch
    /// evicts the oldest prompt whole, and every fourth (offset) evicts the tail 8 blocks of the
    /// newest full prompt.
    async fn step(&mut self, w: usize, i: usize) {
        match i % 4 {
            3 if self.held.len() > 2 => {
                let (&seed, _) = self.held.iter().next().unwrap();
                let hashes = self.held.remove(&seed).unwrap();
                self.worker.remove(hashes).await;
                self.gone.push(seed);
            }
            1 if self.held.values().any(|h| h.len() == PROMPT_BLOCKS) => {
                let hashes = self
                    .held
                    .values_mut()
                    .rev()
                    .find(|h| h.len() == PROMPT_BLOCKS)
                    .unwrap();
                let tail = hashes.split_off(PROMPT_BLOCKS - 8);
                self.worker.remove(tail).await;
            }
            _ => {
                let seed = Self::seed(w, i);
                let hashes = self.worker.store(&prompt(seed, PROMPT_BLOCKS)).await;
                self.held.insert(seed, hashes);
            }
        }
        self.batches += 1;
    }
}

/// The depth of worker `id` for `tokens`, from the `explain` rows of a route.
async fn depth_of(daemon: &Daemon, tokens: &[u32], id: &str) -> u64 {
    let (status, body) = daemon.route(tokens, json!({"explain": true})).await;
    assert_eq!(status, 200, "{body}");
    body["explain"]
        .as_array()
        .unwrap_or_else(|| panic!("an explained route lists every worker: {body}"))
        .iter()
        .find(|row| row["worker"] == id)
        .unwrap_or_else(|| panic!("{id} is in the explain rows: {body}"))["depth"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_mid_burst_and_events_published_while_down_leave_every_block_owned_exactly_once() {
    const WORKERS: usize = 4;
    const BURST: usize = 200;
    const WHILE_DOWN: usize = 40;
    let nats = Nats::start();
    let mut daemon = Daemon::start(&nats.url(), &[]).await;
    daemon.wait_ready().await;
    let mut ledgers = Vec::new();
    for w in 0..WORKERS {
        ledgers.push(Ledger {
            worker: Worker::connect(&nats.url(), &format!("w{w}")).await,
            held: BTreeMap::new(),
            gone: Vec::new(),
            batches: 0,
        });
    }

    // The burst: every worker publishes concurrently while the daemon is killed under it.
    let published = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (w, mut ledger) in ledgers.into_iter().enumerate() {
        let published = published.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..BURST {
                ledger.step(w, i).await;
                published.fetch_add(1, Ordering::Relaxed);
            }
            ledger
        }));
    }
    let total = (WORKERS * BURST) as u64;
    eventually("the daemon has applied part of the burst", || async {
        let applied: u64 = daemon.blocks().await.values().sum();
        (applied >= 40 * PROMPT_BLOCKS as u64).then_some(())
    })
    .await;
    daemon.kill9();
    let at_kill = published.load(Ordering::Relaxed);
    assert!(
        at_kill < total,
        "the kill lands in the middle of the burst ({at_kill} of {total} batches published)"
    );
    let mut ledgers = Vec::new();
    for t in tasks {
        ledgers.push(t.await.unwrap());
    }

    // While the daemon is down, the fleet keeps caching and evicting.
    for (w, ledger) in ledgers.iter_mut().enumerate() {
        for i in BURST..BURST + WHILE_DOWN {
            ledger.step(w, i).await;
        }
    }

    daemon.restart().await;
    daemon.wait_ready().await;
    let observer = async_nats::connect(nats.url()).await.unwrap();
    eventually(
        "the durable consumer has delivered and acked every message",
        || consumer_settled(&observer),
    )
    .await;
    let blocks = daemon.blocks().await;
    for (w, ledger) in ledgers.iter().enumerate() {
        let id = format!("w{w}");
        assert_eq!(
            blocks.get(&id).copied(),
            Some(ledger.blocks()),
            "{id} owns exactly the blocks its {} published batches leave resident \
             (nothing lost across the kill, nothing applied twice)",
            ledger.batches
        );
    }

    assert_eq!(
        daemon.metric("kvrouted_event_seq_gaps_total").await,
        0.0,
        "every worker's batches arrived in Kv-Seq order with none missing after the restart"
    );

    // Depth per prompt, as the routing policy sees it: a full prompt, a tail-evicted one and an
    // evicted one, per worker.
    for (w, ledger) in ledgers.iter().enumerate() {
        let id = format!("w{w}");
        let full = ledger
            .held
            .iter()
            .find(|(_, h)| h.len() == PROMPT_BLOCKS)
            .map(|(s, _)| *s)
            .expect("a full prompt is resident");
        let trimmed = ledger
            .held
            .iter()
            .find(|(_, h)| h.len() < PROMPT_BLOCKS)
            .map(|(s, _)| *s)
            .expect("a tail-evicted prompt is resident");
        let gone = *ledger.gone.last().expect("a prompt was evicted");
        assert_eq!(
            depth_of(&daemon, &prompt(full, PROMPT_BLOCKS), &id).await,
            PROMPT_BLOCKS as u64,
            "{id} holds every block of prompt {full}"
        );
        assert_eq!(
            depth_of(&daemon, &prompt(trimmed, PROMPT_BLOCKS), &id).await,
            ledger.held[&trimmed].len() as u64,
            "{id} holds prompt {trimmed} up to its evicted tail"
        );
        assert_eq!(
            depth_of(&daemon, &prompt(gone, PROMPT_BLOCKS), &id).await,
            0,
            "{id} holds nothing of evicted prompt {gone}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_sigterm_writes_a_snapshot_that_the_restart_recovers_from_before_turning_ready() {
    let nats = Nats::start();
    let mut daemon = Daemon::start(&nats.url(), &[]).await;
    daemon.wait_ready().await;
    let mut a = Worker::connect(&nats.url(), "a").await;
    let mut b = Worker::connect(&nats.url(), "b").await;
    for seed in 1..=6 {
        a.store(&prompt(seed, 8)).await;
    }
    let evicted = b.store(&prompt(100, 8)).await;
    b.store(&prompt(101, 4)).await;
    b.remove(evicted).await;
    daemon.wait_blocks("a", 48).await;
    daemon.wait_blocks("b", 4).await;

    assert!(
        daemon.terminate().success(),
        "SIGTERM is a clean exit; log:\n{}",
        daemon.log_text()
    );
    let written = log_lines(&daemon, "snapshot written");
    let snapshot_seq = written
        .last()
        .and_then(|l| field(l, "seq"))
        .unwrap_or_else(|| {
            panic!(
                "the shutdown logs its snapshot; log:\n{}",
                daemon.log_text()
            )
        });
    assert!(snapshot_seq > 0, "the snapshot covers the inputs applied");

    // Poll readiness from the moment the process starts: it may say `recovering` (503), then
    // `catching_up` or `ready`; whenever it says ready, the state must already be whole.
    daemon.spawn();
    let seen = std::sync::Mutex::new(Vec::<String>::new());
    eventually("/readyz turns ready", || async {
        // Not listening yet is not an answer.
        let reply = reqwest::get(daemon.url("/readyz")).await.ok()?;
        let code = reply.status().as_u16();
        let text = reply.text().await.ok()?;
        let v: Value = serde_json::from_str(&text).ok()?;
        let status = v["status"].as_str()?.to_string();
        {
            let mut seen = seen.lock().unwrap();
            if seen.last() != Some(&status) {
                seen.push(status.clone());
            }
        }
        match status.as_str() {
            "recovering" | "catching_up" => {
                assert_eq!(code, 503, "not ready is a 503: {v}");
                None
            }
            "ready" => {
                assert_eq!(code, 200);
                let blocks = daemon.blocks().await;
                assert_eq!(
                    (blocks.get("a"), blocks.get("b")),
                    (Some(&48), Some(&4)),
                    "a daemon that says ready serves the recovered index"
                );
                Some(())
            }
            other => panic!("unexpected readiness {other:?} during a restart"),
        }
    })
    .await;
    let (code, health) = daemon.get("/healthz").await;
    assert_eq!(code, 200, "{health}");
    eprintln!(
        "readiness seen during the restart: {:?}",
        seen.lock().unwrap()
    );
    let recovered = log_lines(&daemon, "state recovered");
    let line = recovered.last().expect("the restart logs its recovery");
    assert_eq!(
        field(line, "snapshot_seq"),
        Some(snapshot_seq),
        "recovery starts from the shutdown snapshot: {line}"
    );
    assert_eq!(
        field(line, "replayed"),
        Some(0),
        "nothing was journaled after the final snapshot: {line}"
    );
    assert_eq!(
        depth_of(&daemon, &prompt(3, 8), "a").await,
        8,
        "the recovered owner still holds its prefix"
    );
    assert_eq!(depth_of(&daemon, &prompt(100, 8), "b").await, 0);
}

/// What the gateway was told for one route: request id (if any), worker, decision.
#[derive(Debug, Clone, PartialEq)]
struct Told {
    request_id: Option<String>,
    worker: Option<String>,
    decision: String,
    reservation: Option<u64>,
}

struct Gateway<'a> {
    daemon: &'a Daemon,
    told: Vec<Told>,
}

impl Gateway<'_> {
    async fn route(&mut self, tokens: &[u32], extra: Value) -> Told {
        let id = format!("r{}", self.told.len());
        let mut body = json!({"request_id": id});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, reply) = self.daemon.route(tokens, body).await;
        let told = match status {
            200 => Told {
                request_id: Some(id),
                worker: reply["worker"].as_str().map(str::to_owned),
                decision: reply["decision"].as_str().unwrap().to_owned(),
                reservation: reply["reservation"].as_u64(),
            },
            503 => Told {
                request_id: None,
                worker: None,
                decision: "no_candidate".into(),
                reservation: None,
            },
            other => panic!("unexpected status {other}: {reply}"),
        };
        self.told.push(told.clone());
        told
    }
}

fn read_decisions(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: a JSON line: {l}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaying_a_real_runs_journal_reproduces_every_decision_and_counterfactuals_count_changes()
{
    let nats = Nats::start();
    let mut daemon = Daemon::start(&nats.url(), &[]).await;
    daemon.wait_ready().await;
    let mut a = Worker::connect(&nats.url(), "a").await;
    let b = Worker::connect(&nats.url(), "b").await;
    let c = Worker::connect(&nats.url(), "c").await;
    let owned: Vec<Vec<u32>> = (1..=6).map(|s| prompt(s, 8)).collect();
    for p in &owned {
        a.store(p).await;
    }
    for (w, usage) in [(&a, 0.2), (&b, 0.1), (&c, 0.3)] {
        w.load(usage).await;
        daemon.wait_load(&w.id, usage).await;
    }
    daemon.wait_blocks("a", 48).await;

    let mut gw = Gateway {
        daemon: &daemon,
        told: Vec::new(),
    };
    for p in &owned {
        let t = gw.route(p, json!({})).await;
        assert_eq!(
            (t.worker.as_deref(), t.decision.as_str()),
            (Some("a"), "owner_hold")
        );
    }
    let fresh: Vec<Vec<u32>> = (200..212).map(|s| prompt(s, 4)).collect();
    for p in &fresh {
        assert_eq!(gw.route(p, json!({})).await.decision, "cold_miss");
    }
    for p in &fresh[..6] {
        assert_eq!(
            gw.route(p, json!({"max_output_tokens": 64})).await.decision,
            "owner_hold",
            "a routed prompt's next turn holds on its approximate owner"
        );
    }
    // The owner of the stored prefixes comes under pressure: its prefixes spill.
    a.load(0.95).await;
    daemon.wait_load("a", 0.95).await;
    let spill = gw.route(&owned[0], json!({})).await;
    assert_eq!(spill.decision, "pressure_spill", "{spill:?}");
    gw.route(&owned[0], json!({})).await;
    assert_eq!(
        gw.route(&owned[1], json!({})).await.decision,
        "pressure_spill"
    );
    for told in gw.told.clone().iter().step_by(5) {
        let (status, _) = daemon
            .post(
                "/v1/release",
                &json!({"reservation": told.reservation.unwrap()}),
            )
            .await;
        assert_eq!(status, 200);
    }
    let none = gw
        .route(&owned[2], json!({"exclude": ["a", "b", "c"]}))
        .await;
    assert_eq!(none.decision, "no_candidate");
    let told_before_restart = gw.told;

    // A clean restart in the middle: the replay crosses it, and the decisions after it were made
    // on state recovered from a snapshot.
    assert!(daemon.terminate().success());
    daemon.restart().await;
    daemon.wait_ready().await;
    let mut gw = Gateway {
        daemon: &daemon,
        told: told_before_restart,
    };
    let after_restart = gw.route(&owned[2], json!({})).await;
    assert_eq!(after_restart.decision, "pressure_spill");
    for p in fresh.iter().take(8) {
        gw.route(p, json!({})).await;
    }
    for s in 300..305 {
        gw.route(&prompt(s, 2), json!({})).await;
    }
    let told = gw.told;
    let mut labels: Vec<&str> = told.iter().map(|t| t.decision.as_str()).collect();
    labels.sort();
    labels.dedup();
    assert!(
        labels.len() >= 4,
        "the run exercises several decision labels: {labels:?}"
    );
    assert!(daemon.terminate().success());

    let dir = daemon.data_dir.clone();
    let work = tempfile::TempDir::new().unwrap();
    let out = work.path().join("decisions.jsonl");
    let (ok, stdout, stderr) = replay_verify("--data-dir", &dir, Some(&out));
    assert!(
        ok,
        "replay --verify of the daemon's own journal succeeds; stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let report = replay_report(&stdout);
    assert_eq!(
        (report.decisions, report.changed),
        (told.len() as u64, 0),
        "every route is re-derived, none differs: {stdout}"
    );
    let replayed = read_decisions(&out);
    assert_eq!(
        replayed.len(),
        told.len(),
        "--out has one line per decision"
    );
    let by_request: HashMap<&str, &Value> = replayed
        .iter()
        .filter_map(|d| Some((d["request_id"].as_str()?, d)))
        .collect();
    for t in &told {
        match &t.request_id {
            Some(id) => {
                let d = by_request[id.as_str()];
                assert_eq!(
                    (
                        d["worker"].as_str(),
                        d["decision"].as_str(),
                        d["reservation"].as_u64()
                    ),
                    (
                        t.worker.as_deref(),
                        Some(t.decision.as_str()),
                        t.reservation
                    ),
                    "request {id} replays to what the gateway was told, reservation id included"
                );
            }
            None => assert_eq!(
                replayed
                    .iter()
                    .filter(|d| d["decision"] == "no_candidate")
                    .count(),
                1,
                "the 503 replays as no_candidate"
            ),
        }
    }

    // The portable export replays to the same decision stream.
    let exported = export_journal(&dir, work.path());
    let out2 = work.path().join("decisions-from-export.jsonl");
    let (ok, stdout, stderr) = replay_verify("--journal", &exported, Some(&out2));
    assert!(
        ok,
        "replay --verify of the export succeeds: {stdout}{stderr}"
    );
    assert_eq!(
        replay_report(&stdout),
        report,
        "same report from the export"
    );
    assert_eq!(
        read_decisions(&out2),
        replayed,
        "the export replays to the same decisions"
    );

    // Counterfactual: a ceiling of one owner per prefix forbids every spill.
    let cf = |extra: &[&str], verify: bool| {
        let mut args: Vec<std::ffi::OsString> = vec!["replay".into(), "--data-dir".into()];
        args.push(dir.clone().into());
        if verify {
            args.push("--verify".into());
        }
        args.extend(extra.iter().map(Into::into));
        kvrouted(args)
    };
    let (ok, _, stdout, stderr) = cf(&["--max-owners-per-prefix", "1"], false);
    assert!(
        ok,
        "a counterfactual without --verify reports and succeeds: {stderr}"
    );
    assert!(
        stderr.contains("counterfactual: max_owners_per_prefix: 4 -> 1"),
        "the override is named: {stderr}"
    );
    let ceiling = replay_report(&stdout);
    let spills = told
        .iter()
        .filter(|t| t.decision == "pressure_spill")
        .count() as u64;
    assert_eq!(ceiling.decisions, told.len() as u64);
    assert!(
        ceiling.changed >= spills && spills >= 3,
        "each of the {spills} spills is a ceiling hold with one owner per prefix: {stdout}"
    );
    let (ok, code, stdout, _) = cf(&["--max-owners-per-prefix", "1"], true);
    assert!(
        !ok && code.is_some(),
        "--verify fails on a divergence: {stdout}"
    );
    let (seq, detail) = first_divergence(&stdout)
        .unwrap_or_else(|| panic!("--verify names the first divergent decision: {stdout}"));
    let spill_seq = spill
        .request_id
        .as_deref()
        .and_then(|id| by_request[id]["seq"].as_u64());
    assert_eq!(
        Some(seq),
        spill_seq,
        "the first divergence is the first spill"
    );
    assert!(
        detail.contains("pressure_spill") && detail.contains("ceiling_hold"),
        "it says what was recorded and what the counterfactual decides: {detail}"
    );
    let (ok, _, stdout, _) = cf(&["--policy", "round_robin"], false);
    assert!(ok);
    let rr = replay_report(&stdout);
    assert_eq!(rr.decisions, told.len() as u64);
    assert!(
        rr.changed > 0 && rr.changed <= rr.decisions,
        "round robin moves some decisions: {stdout}"
    );

    // The routing-quality settings and the dynamo_cost baseline are counterfactuals too.
    let (ok, _, stdout, stderr) = cf(
        &[
            "--min-match-ratio",
            "1",
            "--backlog-pressure-tokens",
            "0",
            "--ceiling-overflow-pressure",
            "1.5",
        ],
        false,
    );
    assert!(ok, "the new policy flags replay: {stderr}");
    for change in [
        "min_match_ratio: 0.2 -> 1.0",
        "backlog_pressure_tokens: 65536 -> 0",
        "ceiling_overflow_pressure: None -> Some(1.5)",
    ] {
        assert!(
            stderr.contains(&format!("counterfactual: {change}")),
            "the override {change} is named: {stderr}"
        );
    }
    assert_eq!(replay_report(&stdout).decisions, told.len() as u64);
    let (ok, _, stdout, stderr) = cf(&["--policy", "dynamo_cost"], false);
    assert!(ok, "dynamo_cost replays: {stderr}");
    let dynamo = replay_report(&stdout);
    assert_eq!(dynamo.decisions, told.len() as u64);
    assert!(
        dynamo.changed > 0,
        "dynamo_cost spreads cold misses and spills differently: {stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_pruned_by_retention_still_replays_every_decision_after_its_oldest_snapshot() {
    let nats = Nats::start();
    // A size bound of one byte: every snapshot lets retention drop all it covers.
    let mut daemon = Daemon::start(
        &nats.url(),
        &["--snapshot-interval", "1s", "--journal-max-bytes", "1"],
    )
    .await;
    daemon.wait_ready().await;
    let mut a = Worker::connect(&nats.url(), "a").await;
    let b = Worker::connect(&nats.url(), "b").await;
    for seed in 1..=4 {
        a.store(&prompt(seed, 4)).await;
    }
    a.load(0.2).await;
    b.load(0.1).await;
    daemon.wait_blocks("a", 16).await;
    daemon.wait_load("b", 0.1).await;
    let mut gw = Gateway {
        daemon: &daemon,
        told: Vec::new(),
    };
    for seed in (1..=4).chain(50..56) {
        gw.route(&prompt(seed, 4), json!({})).await;
    }
    let pruned = eventually("a periodic snapshot prunes the journal", || async {
        log_lines(&daemon, "snapshot written")
            .iter()
            .find_map(|l| field(l, "pruned").filter(|&n| n > 0))
    })
    .await;
    let before_snapshot = gw.told.len();
    // Routed after the snapshot (the next one is a second away): kept by retention.
    for seed in (1..=4).chain(60..66) {
        gw.route(&prompt(seed, 4), json!({})).await;
    }
    let kept: Vec<Told> = gw.told[before_snapshot..].to_vec();
    assert!(daemon.terminate().success());

    let dir = daemon.data_dir.clone();
    let work = tempfile::TempDir::new().unwrap();
    let out = work.path().join("decisions.jsonl");
    let (ok, stdout, stderr) = replay_verify("--data-dir", &dir, Some(&out));
    assert!(ok, "{stdout}{stderr}");
    let report = replay_report(&stdout);
    assert_eq!(
        (report.decisions, report.changed),
        (kept.len() as u64, 0),
        "the {pruned} pruned entries are covered by the snapshot the replay starts from; every \
         decision after it is re-derived: {stdout}"
    );
    let ids: Vec<String> = read_decisions(&out)
        .iter()
        .map(|d| d["request_id"].as_str().unwrap().to_string())
        .collect();
    let expected: Vec<String> = kept.iter().map(|t| t.request_id.clone().unwrap()).collect();
    assert_eq!(
        ids, expected,
        "the decisions kept are the ones routed after the snapshot"
    );

    let exported = export_journal(&dir, work.path());
    let (ok, stdout, stderr) = replay_verify("--journal", &exported, None);
    assert!(
        ok,
        "the export carries the snapshot it needs: {stdout}{stderr}"
    );
    assert_eq!(replay_report(&stdout), report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_consumer_left_with_explicit_acks_by_an_older_version_is_still_fully_acked() {
    use async_nats::jetstream::{consumer, stream};
    let nats = Nats::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let kv_stream = js
        .create_stream(stream::Config {
            name: "KVROUTED".into(),
            subjects: vec!["kv.events.>".into(), "kv.workers.>".into()],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .unwrap();
    kv_stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("kvrouted".into()),
            ack_policy: consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();

    let daemon = Daemon::start(&nats.url(), &[]).await;
    daemon.wait_ready().await;
    let mut worker = Worker::connect(&nats.url(), "w0").await;
    for seed in 0..20 {
        worker.store(&prompt(seed, 4)).await;
    }
    daemon.wait_blocks("w0", 80).await;
    eventually(
        "every message is acked one by one under the consumer's explicit policy",
        || consumer_settled(&client),
    )
    .await;
    let kv_stream = js.get_stream("KVROUTED").await.unwrap();
    let info = kv_stream.consumer_info("kvrouted").await.unwrap();
    assert_eq!(
        info.config.ack_policy,
        consumer::AckPolicy::Explicit,
        "the daemon follows the existing consumer's ack policy instead of replacing it"
    );
    assert_eq!(
        info.ack_floor.stream_sequence, 20,
        "all 20 batches are acked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_data_dir_reads_the_stream_from_its_start_though_its_durable_consumer_read_it_before()
{
    let nats = Nats::start();
    let mut first = Daemon::start(&nats.url(), &[]).await;
    first.wait_ready().await;
    let mut worker = Worker::connect(&nats.url(), "w").await;
    worker.store(&prompt(1, 4)).await;
    first.wait_blocks("w", 4).await;
    eventually(
        "the durable consumer has delivered and acked every message",
        || consumer_settled(worker.client()),
    )
    .await;
    assert!(
        first.terminate().success(),
        "the first daemon stops cleanly"
    );

    // The same broker and durable consumer name, an empty data dir: its journal never held the
    // messages the consumer already delivered.
    let second = Daemon::start(&nats.url(), &[]).await;
    second.wait_ready().await;
    assert_eq!(
        second.blocks().await.get("w"),
        Some(&4),
        "a new data dir is ready only once the stream is applied from its start"
    );
}
