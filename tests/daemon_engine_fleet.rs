//! What real engines do, driven from outside the daemon: engine restarts (`Kv-Epoch`),
//! re-announced joins, poisoned sequences, data-parallel ranks, blocks stored twice, orphans,
//! lower tiers, caches cleared under the router's own records, sticky leaves, lifecycle
//! messages with a bad field, events before a model is declared, spills, and block sizes per
//! model. Workers publish vLLM-format batches with headers on a real nats-server (JetStream),
//! load samples on core NATS, and a gateway routes over real HTTP.
mod common;

use async_nats::HeaderMap;
use common::*;
use kvrouted::hashing::block_keys;
use kvrouted::wire::{encode_load, encode_vllm_batch, VllmEvent};
use rmpv::Value as Mp;
use serde_json::{json, Value};

/// A broker, a daemon and one NATS connection to publish as any worker.
struct Fleet {
    daemon: Daemon,
    publisher: Worker,
    _nats: Nats,
}

/// Headers of a KV event batch.
#[derive(Default, Clone, Copy)]
struct Headers<'a> {
    seq: Option<u64>,
    epoch: Option<&'a str>,
    rank: Option<u32>,
    model: Option<&'a str>,
}

fn seq(seq: u64) -> Headers<'static> {
    Headers {
        seq: Some(seq),
        ..Headers::default()
    }
}

fn none() -> Headers<'static> {
    Headers::default()
}

/// Engine hashes are opaque: derived from the block key, not equal to it.
fn engine_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    block_keys(tokens, block_size)
        .into_iter()
        .map(|k| k.rotate_left(17) ^ 0x5EED)
        .collect()
}

/// A `BlockStored` of every full 16-token block of `tokens`, from the start of a chain.
fn stored(tokens: &[u32], medium: &str) -> VllmEvent {
    stored_sized(tokens, 16, medium)
}

fn stored_sized(tokens: &[u32], block_size: usize, medium: &str) -> VllmEvent {
    VllmEvent::BlockStored {
        block_hashes: engine_hashes(tokens, block_size),
        parent_block_hash: None,
        token_ids: tokens[..tokens.len() / block_size * block_size].to_vec(),
        block_size: block_size as u32,
        lora_id: None,
        medium: Some(medium.into()),
        lora_name: None,
    }
}

fn removed(tokens: &[u32], medium: &str) -> VllmEvent {
    VllmEvent::BlockRemoved {
        block_hashes: engine_hashes(tokens, 16),
        medium: Some(medium.into()),
    }
}

impl Fleet {
    async fn start(flags: &[&str]) -> Fleet {
        let nats = Nats::start();
        let daemon = Daemon::start(&nats.url(), flags).await;
        daemon.wait_ready().await;
        let publisher = Worker::connect(&nats.url(), "publisher").await;
        Fleet {
            daemon,
            publisher,
            _nats: nats,
        }
    }

    /// Publishes a batch on `kv.events.<worker>` through JetStream with these headers.
    async fn events(&self, worker: &str, h: Headers<'_>, events: &[VllmEvent]) {
        let mut headers = HeaderMap::new();
        if let Some(s) = h.seq {
            headers.insert("Kv-Seq", s.to_string().as_str());
        }
        if let Some(e) = h.epoch {
            headers.insert("Kv-Epoch", e);
        }
        if let Some(r) = h.rank {
            headers.insert("Kv-Dp-Rank", r.to_string().as_str());
        }
        if let Some(m) = h.model {
            headers.insert("Kv-Model", m);
        }
        self.publisher
            .publish_js(
                &format!("kv.events.{worker}"),
                headers,
                encode_vllm_batch(1.0, events, None),
            )
            .await;
    }

    /// Publishes a lifecycle message `{op, ...fields}` on `kv.workers.<worker>`.
    async fn lifecycle(&self, worker: &str, op: &str, fields: &[(&str, Mp)]) {
        let mut map = vec![(Mp::from("op"), Mp::from(op))];
        map.extend(fields.iter().map(|(k, v)| (Mp::from(*k), v.clone())));
        let mut payload = Vec::new();
        rmpv::encode::write_value(&mut payload, &Mp::Map(map)).unwrap();
        self.publisher
            .publish_js(&format!("kv.workers.{worker}"), HeaderMap::new(), payload)
            .await;
    }

    /// Publishes a load sample on core NATS, with `Kv-Dp-Rank` when `rank` is given.
    async fn load(&self, worker: &str, rank: Option<u32>, kv_usage: f64, model: Option<&str>) {
        let payload = encode_load(kv_usage, 1, 0, Some(64), 0.0, model);
        let mut headers = HeaderMap::new();
        if let Some(r) = rank {
            headers.insert("Kv-Dp-Rank", r.to_string().as_str());
        }
        let client = self.publisher.client();
        client
            .publish_with_headers(format!("kv.load.{worker}"), headers, payload.into())
            .await
            .unwrap();
        client.flush().await.unwrap();
    }

    /// Publishes a load sample and waits until the daemon shows it.
    async fn loaded(&self, worker: &str, kv_usage: f64) {
        self.load(worker, None, kv_usage, None).await;
        self.daemon.wait_load(worker, kv_usage).await;
    }

    async fn route(&self, tokens: &[u32], extra: Value) -> Value {
        let (status, body) = self.daemon.route(tokens, extra).await;
        assert_eq!(status, 200, "a route with candidates is answered: {body}");
        body
    }

    async fn blocks(&self, worker: &str) -> Option<u64> {
        self.daemon.worker(worker).await?["blocks"].as_u64()
    }
}

fn decided(body: &Value) -> (&str, &str, u64) {
    (
        body["worker"].as_str().unwrap_or("?"),
        body["decision"].as_str().unwrap_or("?"),
        body["matched_blocks"].as_u64().unwrap_or(u64::MAX),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_with_a_new_epoch_is_applied_and_owns_none_of_its_old_blocks() {
    let fleet = Fleet::start(&[]).await;
    let old = prompt(1, 4);
    let epoch_a = |s| Headers {
        seq: Some(s),
        epoch: Some("run-a"),
        ..none()
    };
    fleet.events("w", epoch_a(40), &[stored(&old, "GPU")]).await;
    fleet.daemon.wait_blocks("w", 4).await;
    // The engine restarts: its sequence starts at 0 again, under a new epoch.
    let fresh = prompt(2, 2);
    let epoch_b = Headers {
        seq: Some(0),
        epoch: Some("run-b"),
        ..none()
    };
    fleet.events("w", epoch_b, &[stored(&fresh, "GPU")]).await;
    fleet.daemon.wait_blocks("w", 2).await;
    let body = fleet.route(&old, json!({})).await;
    assert_eq!(
        decided(&body),
        ("w", "cold_miss", 0),
        "the restarted engine does not hold its old blocks: {body}"
    );
    assert_eq!(
        fleet.daemon.metric("kvrouted_engine_restarts_total").await,
        1.0,
        "the restart is counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_with_the_running_epoch_clears_nothing_and_a_plain_join_clears_the_worker() {
    let fleet = Fleet::start(&[]).await;
    let e1 = |s| Headers {
        seq: Some(s),
        epoch: Some("e1"),
        ..none()
    };
    fleet
        .events("w", e1(5), &[stored(&prompt(1, 4), "GPU")])
        .await;
    fleet.daemon.wait_blocks("w", 4).await;
    // A restarted sidecar re-announces the engine that kept running.
    fleet
        .lifecycle("w", "join", &[("epoch", Mp::from("e1"))])
        .await;
    // Redelivered batch 5 must stay a duplicate; batch 6 is new.
    fleet
        .events("w", e1(5), &[stored(&prompt(2, 2), "GPU")])
        .await;
    fleet
        .events("w", e1(6), &[stored(&prompt(3, 1), "GPU")])
        .await;
    fleet.daemon.wait_blocks("w", 5).await;
    // A join without an epoch announces a new engine process.
    fleet.lifecycle("w", "join", &[]).await;
    fleet
        .events("w", none(), &[stored(&prompt(4, 1), "GPU")])
        .await;
    fleet.daemon.wait_blocks("w", 1).await;
    let body = fleet.route(&prompt(1, 4), json!({})).await;
    assert_eq!(
        decided(&body).1,
        "cold_miss",
        "after a clearing join the old prefix has no owner: {body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisoned_sequence_is_rejected_and_later_batches_apply_across_a_daemon_restart() {
    let mut fleet = Fleet::start(&[]).await;
    fleet
        .events("w", seq(1), &[stored(&prompt(1, 1), "GPU")])
        .await;
    fleet.daemon.wait_blocks("w", 1).await;
    fleet
        .events("w", seq(u64::MAX), &[stored(&prompt(2, 1), "GPU")])
        .await;
    fleet.daemon.wait_rejected("seq_jump", 1.0).await;
    fleet.daemon.terminate();
    fleet.daemon.restart().await;
    fleet.daemon.wait_ready().await;
    fleet
        .events("w", seq(2), &[stored(&prompt(3, 1), "GPU")])
        .await;
    fleet.daemon.wait_blocks("w", 2).await;
    let body = fleet.route(&prompt(2, 1), json!({})).await;
    assert_eq!(
        decided(&body).2,
        0,
        "the poisoned batch was never applied: {body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_dp_ranks_are_routed_by_rank_and_one_ranks_clear_leaves_the_others_blocks() {
    let fleet = Fleet::start(&[]).await;
    let rank = |r| Headers {
        rank: Some(r),
        ..none()
    };
    let long = prompt(1, 4);
    fleet
        .events("w", rank(0), &[stored(&prompt(2, 2), "GPU")])
        .await;
    fleet.events("w", rank(1), &[stored(&long, "GPU")]).await;
    fleet.daemon.wait_blocks("w", 6).await;
    let body = fleet.route(&long, json!({})).await;
    assert_eq!(
        (decided(&body), body["dp_rank"].as_u64()),
        (("w", "owner_hold", 4), Some(1)),
        "the rank holding the prompt is chosen and named: {body}"
    );
    fleet
        .events("w", rank(0), &[VllmEvent::AllBlocksCleared])
        .await;
    fleet.daemon.wait_blocks("w", 4).await;
    let body = fleet.route(&long, json!({})).await;
    assert_eq!(
        (decided(&body), body["dp_rank"].as_u64()),
        (("w", "owner_hold", 4), Some(1)),
        "rank 0's clear left rank 1's blocks: {body}"
    );
    // Both ranks hold it; each rank's own load decides.
    fleet.events("w", rank(0), &[stored(&long, "GPU")]).await;
    fleet.daemon.wait_blocks("w", 8).await;
    fleet.load("w", Some(0), 0.30, None).await;
    fleet.load("w", Some(1), 0.95, None).await;
    fleet.daemon.wait_load("w", 0.95).await;
    let body = fleet.route(&long, json!({})).await;
    assert_eq!(
        (decided(&body), body["dp_rank"].as_u64()),
        (("w", "owner_hold", 4), Some(0)),
        "the pressured rank is passed over for its unpressured sibling: {body}"
    );
    fleet.loaded("single", 0.1).await;
    let body = fleet.route(&prompt(9, 1), json!({"exclude": ["w"]})).await;
    assert!(
        body.get("dp_rank").is_none(),
        "a worker with one rank is not named by rank: {body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_stored_twice_is_owned_until_its_second_removal() {
    let fleet = Fleet::start(&[]).await;
    let p = prompt(1, 4);
    fleet.events("w", none(), &[stored(&p, "GPU")]).await;
    fleet.events("w", none(), &[stored(&p, "GPU")]).await;
    fleet.events("w", none(), &[removed(&p, "GPU")]).await;
    // Ordered after the removal on the stream: once it shows, the removal was applied.
    fleet
        .events("w", none(), &[stored(&prompt(2, 1), "GPU")])
        .await;
    fleet.daemon.wait_blocks("w", 5).await;
    let body = fleet.route(&p, json!({})).await;
    assert_eq!(
        decided(&body),
        ("w", "owner_hold", 4),
        "one removal of a twice-stored block ends no ownership: {body}"
    );
    fleet.events("w", none(), &[removed(&p, "GPU")]).await;
    fleet.daemon.wait_blocks("w", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_with_an_unknown_parent_is_counted_and_keyed_as_a_chain_start() {
    let fleet = Fleet::start(&[]).await;
    let p = prompt(1, 2);
    let VllmEvent::BlockStored {
        block_hashes,
        token_ids,
        ..
    } = stored(&p, "GPU")
    else {
        unreachable!()
    };
    let orphan = VllmEvent::BlockStored {
        block_hashes,
        parent_block_hash: Some(0x00AB_5E17),
        token_ids,
        block_size: 16,
        lora_id: None,
        medium: None,
        lora_name: None,
    };
    fleet.events("w", none(), &[orphan]).await;
    fleet.daemon.wait_blocks("w", 2).await;
    assert_eq!(
        fleet.daemon.metric("kvrouted_orphan_blocks_total").await,
        2.0,
        "the orphan store's blocks are counted"
    );
    let body = fleet.route(&p, json!({})).await;
    assert_eq!(decided(&body), ("w", "owner_hold", 2), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_and_disk_blocks_show_as_lower_tier_depth_never_as_device_ownership() {
    let fleet = Fleet::start(&[]).await;
    let p = prompt(1, 4);
    fleet.loaded("x", 0.1).await;
    fleet.events("w", none(), &[stored(&p, "CPU")]).await;
    fleet.events("w", none(), &[stored(&p[..32], "DISK")]).await;
    let row_of_w = |body: &Value| {
        body["explain"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["worker"] == "w").cloned())
    };
    let row = eventually("w's lower-tier blocks show in explain", || async {
        let body = fleet
            .route(&p, json!({"explain": true, "exclude": ["w"]}))
            .await;
        let row = row_of_w(&body)?;
        (row["host_depth"] == 4 && row["disk_depth"] == 2).then_some(row)
    })
    .await;
    assert_eq!(row["depth"], 0, "lower tiers are not device depth: {row}");
    assert_eq!(fleet.blocks("w").await, Some(0), "nor device blocks");
    fleet.events("w", none(), &[removed(&p, "CPU")]).await;
    eventually("a lower-tier removal drops the host blocks", || async {
        let body = fleet
            .route(&p, json!({"explain": true, "exclude": ["w"]}))
            .await;
        let row = row_of_w(&body)?;
        (row["host_depth"] == 0 && row["disk_depth"] == 2).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cleared_its_cache_is_not_routed_its_old_prefix() {
    let fleet = Fleet::start(&[]).await;
    fleet.loaded("w", 0.1).await;
    fleet.loaded("x", 0.1).await;
    let p = prompt(1, 4);
    let first = fleet.route(&p, json!({"exclude": ["x"]})).await;
    assert_eq!(decided(&first).0, "w");
    fleet.events("w", none(), &[stored(&p, "GPU")]).await;
    fleet.daemon.wait_blocks("w", 4).await;
    fleet
        .events("w", none(), &[VllmEvent::AllBlocksCleared])
        .await;
    fleet.daemon.wait_blocks("w", 0).await;
    let body = fleet.route(&p, json!({})).await;
    assert_eq!(
        decided(&body).1,
        "cold_miss",
        "the router's own record of w's prefix went with the clear: {body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leave_is_not_undone_by_late_load_samples_or_events() {
    let fleet = Fleet::start(&[]).await;
    fleet.loaded("w", 0.1).await;
    fleet.lifecycle("w", "leave", &[]).await;
    eventually("w is removed", || async {
        fleet.daemon.worker("w").await.is_none().then_some(())
    })
    .await;
    // Late messages, each followed on the same path by a barrier from another worker.
    fleet.load("w", None, 0.2, None).await;
    fleet.loaded("barrier", 0.3).await;
    fleet
        .events("w", none(), &[stored(&prompt(1, 2), "GPU")])
        .await;
    fleet
        .events("barrier", none(), &[stored(&prompt(2, 1), "GPU")])
        .await;
    fleet.daemon.wait_blocks("barrier", 1).await;
    assert!(
        fleet.daemon.worker("w").await.is_none(),
        "a late load sample or event does not bring a departed worker back"
    );
    assert!(fleet.daemon.metric("kvrouted_departed_inputs_total").await >= 2.0);
    fleet.lifecycle("w", "join", &[]).await;
    fleet.daemon.wait_state("w", "active").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_with_a_wrong_block_size_still_drains() {
    let fleet = Fleet::start(&[]).await;
    fleet.lifecycle("w", "join", &[]).await;
    fleet.daemon.wait_state("w", "active").await;
    fleet
        .lifecycle("w", "drain", &[("block_size", Mp::from(17))])
        .await;
    fleet.daemon.wait_state("w", "draining").await;
    assert_eq!(
        fleet.daemon.rejected("block_size_mismatch").await,
        1.0,
        "the bad field is counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_stored_before_the_model_is_declared_serve_routes_naming_the_model() {
    let fleet = Fleet::start(&[]).await;
    let p = prompt(1, 4);
    fleet.events("w", none(), &[stored(&p, "GPU")]).await;
    fleet.daemon.wait_blocks("w", 4).await;
    fleet.loaded("x", 0.1).await;
    // The sample that declares the model; once its load shows, the declaration is applied.
    fleet.load("w", None, 0.42, Some("llama")).await;
    fleet.daemon.wait_load("w", 0.42).await;
    assert_eq!(
        fleet.daemon.worker("w").await.unwrap()["models"],
        json!({"llama": 4}),
        "the blocks are filed under the declared model"
    );
    let body = fleet.route(&p, json!({"model": "llama"})).await;
    assert_eq!(
        (decided(&body), &body["owners"]),
        (("w", "owner_hold", 4), &json!(["w"])),
        "a route naming the model finds the blocks stored before it was declared: {body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spill_reports_no_matched_blocks_for_the_non_owner_it_chose() {
    let fleet = Fleet::start(&[]).await;
    let p = prompt(1, 4);
    fleet.events("owner", none(), &[stored(&p, "GPU")]).await;
    fleet.daemon.wait_blocks("owner", 4).await;
    fleet.loaded("owner", 0.95).await;
    fleet.loaded("cool", 0.1).await;
    let body = fleet.route(&p, json!({})).await;
    assert_eq!(
        decided(&body),
        ("cool", "pressure_spill", 0),
        "the chosen worker holds none of the prefix: {body}"
    );
    assert_eq!(
        body["owners"],
        json!(["owner"]),
        "owners still shows the owner"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_sizes_are_per_model_fixed_by_flag_or_declared_by_join() {
    let fleet = Fleet::start(&["--model-block-size", "big=32"]).await;
    let model = |m| Headers {
        model: Some(m),
        ..none()
    };
    let p = prompt(1, 4);
    fleet
        .events("w", model("big"), &[stored_sized(&p, 16, "GPU")])
        .await;
    fleet.daemon.wait_rejected("block_size_mismatch", 1.0).await;
    fleet
        .events("w", model("big"), &[stored_sized(&p, 32, "GPU")])
        .await;
    fleet.daemon.wait_blocks("w", 2).await;
    let body = fleet.route(&p, json!({"model": "big"})).await;
    assert_eq!(
        (decided(&body), body["prompt_blocks"].as_u64()),
        (("w", "owner_hold", 2), Some(2)),
        "routes for the model are cut with its block size: {body}"
    );
    // A join declares another model's block size.
    fleet
        .lifecycle(
            "v",
            "join",
            &[("model", Mp::from("wide")), ("block_size", Mp::from(64))],
        )
        .await;
    fleet
        .events("v", model("wide"), &[stored_sized(&p, 64, "GPU")])
        .await;
    fleet.daemon.wait_blocks("v", 1).await;
    assert_eq!(
        fleet.daemon.rejected("block_size_mismatch").await,
        1.0,
        "only the mismatched store was rejected"
    );
}
