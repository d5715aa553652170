//! End-to-end load benchmark (issue 6): a real nats-server, the real daemon (release binary),
//! publisher workers sending 32-block KV event batches at full speed, and an HTTP load generator
//! sending route requests; compared with a trivial axum handler in this process (the HTTP floor).
//!
//! Run: `cargo bench --bench e2e` (on demand; never part of `cargo test`). It takes about three
//! minutes with the defaults, stops itself and kills everything it started (a watchdog kills the
//! children and exits after `--max-seconds`). Options, after `--` (`-- --help` lists them):
//! `--duration DURATION` (each phase, with its unit, default `8s`), `--publishers N` (NATS
//! connections, default 4), `--workers-per-publisher N` (default 4), `--concurrency N` (HTTP
//! requests in flight, default 16), `--window N` (unacknowledged JetStream publishes per
//! connection, default 256), `--modes jetstream,core`, `--max-seconds N` (default 600),
//! `--keep-data DIR` (each mode's data dir with its whole journal, for `kvrouted replay`). Needs
//! `nats-server` on the PATH, in /usr/sbin, or at `NATS_SERVER_BIN`. `KVROUTED_BIN` runs another
//! build of the daemon (for an A/B comparison), as for the tests.
//!
//! Per NATS mode (JetStream, then core NATS with `--no-jetstream`), on a fresh broker and data
//! dir:
//!
//! 1. **broker only**: the publishers at full speed into a scratch subject with nothing of
//!    kvrouted's listening (JetStream: a scratch stream; core: a subscriber here that only counts).
//!    This is what the broker and the publishers manage on this machine.
//! 2. **ingest**: the same publishers on `kv.events.<worker>` with the daemon consuming. Block
//!    events applied per second come from the daemon's `/metrics`
//!    (`kvrouted_events_applied_total{kind="stored"|"removed"}`). After the publishers stop, the
//!    backlog the daemon still has to apply is drained (at most 60 s) and its rate reported.
//! 3. **routes**: HTTP route requests with prompts of 1k–32k tokens (log-uniform), at fixed
//!    concurrency, over the index the ingest phase built.
//! 4. **kvrouted against the HTTP floor** (first mode only: routes do not depend on the NATS
//!    mode): 4,096-token prompts at concurrency 1 and at `--concurrency`, against the daemon, an
//!    axum server in this process that returns a fixed decision-shaped JSON (`floor`), and one
//!    that also parses the JSON body with serde_json (`floor+parse`). The three take turns
//!    in short rounds so that other load on the machine lands on all of them alike. Then the
//!    same prompts as `block_keys` (what a gateway that hashes tokens itself sends) at
//!    concurrency 1, against the same floors with the same bodies. Each reports kvrouted's
//!    decisions by label, as the routes phase does: what a route costs the daemon depends on
//!    the owners and pressure the phases before left it.
//! 5. **combined**: publishers and 1k–32k routes at once.
//!
//! Each mode ends with the round's end-to-end goals, met or missed ([`goals`]), and stops the
//! daemon with SIGTERM as an operator stops it (up to 30 s, then SIGKILL): a daemon built by
//! `scripts/build-pgo`'s first step writes the counts it trained on when it exits.
//!
//! The workload: 64 conversation prefixes of 32,768 tokens (2,048 blocks of 16). Each simulated
//! worker stores prefixes one after another, one 32-block `BlockStored` per message, each chained
//! on the last; once it holds 8 prefixes (16,384 blocks) it sends a 32-block `BlockRemoved` of
//! its oldest prefix (tail first) before each store, so every message is 32 block events and the
//! index stays bounded. Messages are vLLM's msgpack, pre-encoded before the clock starts, with a
//! `Kv-Seq` header per worker. Route prompts are prefixes of the same 64 conversations, so most
//! of them match a worker.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes as AxumBytes;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::post;
use bytes::Bytes;
use futures::StreamExt;
use kvrouted::wire::{encode_load, encode_vllm_batch, VllmEvent};
use serde::Deserialize;
use tempfile::TempDir;

use kvrouted_testkit::{
    free_port, kvrouted_bin, start_watchdog, wait_for_port, Nats, Process, Watched,
};

const BLOCK: usize = 16;
const BATCH_BLOCKS: usize = 32;
const PREFIXES: usize = 64;
const PREFIX_TOKENS: usize = 32_768;
const BATCHES_PER_PREFIX: usize = PREFIX_TOKENS / BLOCK / BATCH_BLOCKS;
/// Prefixes a worker holds before it evicts its oldest (8 × 2,048 = 16,384 blocks).
const HELD_PREFIXES: usize = 8;

mod floor;
mod goals;
mod http_load;
mod metrics;
mod mode;
mod options;
mod paired;
mod processes;
mod procfs;
mod report;
mod workload;

use floor::*;
use goals::*;
use http_load::*;
use metrics::*;
use mode::*;
use options::*;
use paired::*;
use processes::*;
use procfs::*;
use report::*;
use workload::*;

fn main() {
    let o = options();
    start_watchdog("e2e", Duration::from_secs(o.max_seconds));
    let started = Instant::now();
    let tck = clk_tck();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let workload = Workload {
        payloads: Arc::new(build_payloads()),
        mixed: Arc::new(mixed_bodies(256)),
        four_k: Arc::new((0..PREFIXES).map(|j| route_body(j, 4096)).collect()),
        four_k_keys: Arc::new((0..PREFIXES).map(|j| route_body_keys(j, 4096)).collect()),
    };
    let mut report = Report { json: Vec::new() };
    report.line(format!(
        "e2e: daemon {}; {} per phase, {} publisher connections × {} workers, HTTP concurrency {}, JetStream window {}; nproc {}; load average {}",
        kvrouted_bin().display(),
        humantime::format_duration(o.duration),
        o.publishers,
        o.workers_per_publisher,
        o.concurrency,
        o.window,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        loadavg()
    ));
    let floor = start_floor();
    wait_for_port(floor.port(), "floor server");
    rt.block_on(async {
        for (n, &mode) in o.modes.iter().enumerate() {
            run_mode(
                &o,
                mode,
                &workload,
                // Routes do not depend on the NATS mode: compare with the floor once.
                (n == 0).then_some(floor),
                &mut report,
                tck,
            )
            .await;
        }
    });
    report.line(format!(
        "\nfinished in {:.0} s; load average {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    ));
    println!(
        "{{\"bench\":\"e2e\",\"phase_seconds\":{},\"publishers\":{},\"workers\":{},\"concurrency\":{},\"results\":[{}]}}",
        o.duration.as_secs_f64(),
        o.publishers,
        o.publishers * o.workers_per_publisher,
        o.concurrency,
        report.json.join(",")
    );
    // The floor server's runtime thread is detached; leave without waiting for it.
    std::process::exit(0);
}

/// The machine's load averages (1, 5, 15 min): other work on a shared machine skews every figure.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
