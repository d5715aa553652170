//! The single writer (DESIGN.md §2): one thread owns the [`Router`], stamps every input with the
//! next journal sequence and the daemon clock, journals it, applies it and answers.
//!
//! Journal appends land in sled's memory; a separate flusher makes them durable every
//! `flush_interval` (group commit) and only then acks the JetStream messages they came from, so
//! the writer never waits for the disk and a crash never loses an acked event.
//!
//! Every `snapshot_interval` the writer copies the state (its only pause for a snapshot); a
//! snapshot thread encodes and writes the copy, then applies journal retention. The final
//! snapshot at shutdown is written by the writer itself, after any periodic one in progress.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::message::Acker;
use tokio::sync::{mpsc, oneshot};

use crate::input::{Input, Stamped};
use crate::journal::{Journal, JournalEntry, RouteOutcome, Snapshot};
use crate::metrics;
use crate::router::{Output, Router};

/// Capacity of the gateway lane (routes, releases, queries).
const GATEWAY_QUEUE: usize = 65_536;
/// Capacity of the ingest lane. Small on purpose: a full lane pushes back on NATS (JetStream
/// flow control) instead of building seconds of backlog that routes would wait behind.
const INGEST_QUEUE: usize = 4_096;

type Query = Box<dyn FnOnce(&Router, u64) + Send>;

#[allow(clippy::large_enum_variant)] // Apply is the hot path; boxing it would allocate per input
enum Command {
    Apply {
        input: Input,
        source: &'static str,
        reply: Option<oneshot::Sender<Output>>,
        ack: Option<Acker>,
    },
    Query(Query),
    Shutdown(oneshot::Sender<()>),
}

/// Messages waiting for the flush that makes their journal entries durable.
#[derive(Default)]
pub struct PendingAcks {
    acks: Mutex<VecDeque<(u64, Acker)>>,
    /// Last sequence appended to the journal (at the end of a writer burst).
    appended: AtomicU64,
    /// Last sequence known durable.
    flushed: AtomicU64,
}

/// Handle to the writer; cheap to clone.
///
/// Two lanes: gateway commands (routes, releases, queries) are always taken before ingest
/// (KV events, load samples, ticks), so a burst of events never delays a route by more than the
/// one input being applied.
#[derive(Clone)]
pub struct WriterHandle {
    gateway: mpsc::Sender<Command>,
    ingest: mpsc::Sender<Command>,
}

/// The writer's side of the two lanes.
struct Lanes {
    gateway: mpsc::Receiver<Command>,
    ingest: mpsc::Receiver<Command>,
    runtime: tokio::runtime::Handle,
}

impl Lanes {
    /// The next queued command, gateway first, without waiting.
    fn try_next(&mut self) -> Option<Command> {
        self.gateway
            .try_recv()
            .ok()
            .or_else(|| self.ingest.try_recv().ok())
    }

    /// The next command, waiting for one; `None` once every handle is gone.
    fn next(&mut self) -> Option<Command> {
        if let Some(cmd) = self.try_next() {
            return Some(cmd);
        }
        let Lanes {
            gateway,
            ingest,
            runtime,
        } = self;
        runtime.block_on(async {
            tokio::select! {
                biased;
                cmd = gateway.recv() => cmd,
                cmd = ingest.recv() => cmd,
            }
        })
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the router is shutting down")]
pub struct WriterGone;

impl WriterHandle {
    /// Applies an input and waits for its output.
    pub async fn apply(&self, input: Input, source: &'static str) -> Result<Output, WriterGone> {
        let (reply, rx) = oneshot::channel();
        self.gateway
            .send(Command::Apply {
                input,
                source,
                reply: Some(reply),
                ack: None,
            })
            .await
            .map_err(|_| WriterGone)?;
        rx.await.map_err(|_| WriterGone)
    }

    /// Queues an input; `ack` is acked once its journal entry is durable.
    pub async fn submit(
        &self,
        input: Input,
        source: &'static str,
        ack: Option<Acker>,
    ) -> Result<(), WriterGone> {
        self.ingest
            .send(Command::Apply {
                input,
                source,
                reply: None,
                ack,
            })
            .await
            .map_err(|_| WriterGone)
    }

    /// Reads the state (not journaled).
    pub async fn query<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Router, u64) -> R + Send + 'static,
    ) -> Result<R, WriterGone> {
        let (tx, rx) = oneshot::channel();
        let query: Query = Box::new(move |router, now| {
            let _ = tx.send(f(router, now));
        });
        self.gateway
            .send(Command::Query(query))
            .await
            .map_err(|_| WriterGone)?;
        rx.await.map_err(|_| WriterGone)
    }

    /// Writes a final snapshot and stops the writer.
    pub async fn shutdown(&self) {
        let (tx, rx) = oneshot::channel();
        if self.gateway.send(Command::Shutdown(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}

/// Wall-clock milliseconds, never going backwards within this process.
pub struct Clock {
    last: u64,
}

impl Clock {
    pub fn new(not_before: u64) -> Self {
        Clock { last: not_before }
    }

    pub fn now(&mut self) -> u64 {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        self.last = self.last.max(wall);
        self.last
    }
}

pub struct WriterSettings {
    pub snapshot_interval: Duration,
    pub journal_max_age: Duration,
    pub journal_max_bytes: u64,
}

/// Applies one input through the journal; shared by the writer loop and startup.
pub fn apply_journaled(
    router: &mut Router,
    journal: &Journal,
    clock: &mut Clock,
    input: Input,
    source: &str,
) -> Applied {
    let seq = router.last_seq() + 1;
    let stamped = Stamped {
        seq,
        at_ms: clock.now(),
        input,
    };
    let output = router.apply(&stamped);
    let entry = JournalEntry {
        at_ms: stamped.at_ms,
        input: stamped.input,
        outcome: RouteOutcome::of(&output),
    };
    let journaled = match journal.append(seq, &entry) {
        Ok(bytes) => {
            ::metrics::counter!("kvrouted_journal_bytes_total").increment(bytes as u64);
            ::metrics::counter!("kvrouted_journal_entries_total").increment(1);
            true
        }
        Err(e) => {
            ::metrics::counter!("kvrouted_journal_errors_total").increment(1);
            tracing::error!(seq, "journal append failed: {e}");
            false
        }
    };
    metrics::record_output(&output, source);
    Applied {
        seq,
        output,
        journaled,
    }
}

/// The result of [`apply_journaled`].
pub struct Applied {
    pub seq: u64,
    pub output: Output,
    /// The entry is in the journal (durable at the next flush). When not, the message it came
    /// from must not be acked: it stays pending and JetStream delivers it again.
    pub journaled: bool,
}

/// Starts the writer thread. Returns its handle and the join handle.
pub fn spawn(
    mut router: Router,
    journal: Journal,
    mut clock: Clock,
    pending: Arc<PendingAcks>,
    settings: WriterSettings,
) -> (WriterHandle, std::thread::JoinHandle<()>) {
    let (gateway, gateway_rx) = mpsc::channel::<Command>(GATEWAY_QUEUE);
    let (ingest, ingest_rx) = mpsc::channel::<Command>(INGEST_QUEUE);
    let mut lanes = Lanes {
        gateway: gateway_rx,
        ingest: ingest_rx,
        runtime: tokio::runtime::Handle::current(),
    };
    let thread = std::thread::Builder::new()
        .name("kvrouted-writer".into())
        .spawn(move || {
            let mut snapshotter = Snapshotter::start(journal.clone(), &settings);
            let mut last_snapshot = Instant::now();
            while let Some(first) = lanes.next() {
                let mut next = Some(first);
                // Drain what is queued so the ack bookkeeping happens once per burst.
                let mut burst = 0;
                let mut shutdown = None;
                while let Some(cmd) = next.take() {
                    match cmd {
                        Command::Apply {
                            input,
                            source,
                            reply,
                            ack,
                        } => {
                            let applied =
                                apply_journaled(&mut router, &journal, &mut clock, input, source);
                            if let Some(ack) = ack.filter(|_| applied.journaled) {
                                pending.acks.lock().unwrap().push_back((applied.seq, ack));
                            }
                            if let Some(reply) = reply {
                                let _ = reply.send(applied.output);
                            }
                        }
                        Command::Query(f) => f(&router, clock.now()),
                        Command::Shutdown(done) => {
                            shutdown = Some(done);
                            break;
                        }
                    }
                    burst += 1;
                    if burst < 1024 {
                        next = lanes.try_next();
                    }
                }
                pending.appended.store(router.last_seq(), Ordering::Release);
                if let Some(done) = shutdown {
                    // Let a periodic snapshot in progress finish, then write the final one here.
                    snapshotter.stop();
                    let snapshot = take_snapshot(&router, &mut clock);
                    write_snapshot(&journal, &snapshot, &settings.retention());
                    let _ = journal.flush();
                    let _ = done.send(());
                    return;
                }
                if last_snapshot.elapsed() >= settings.snapshot_interval && snapshotter.idle() {
                    snapshotter.submit(take_snapshot(&router, &mut clock));
                    last_snapshot = Instant::now();
                }
            }
        })
        .expect("spawn writer thread");
    (WriterHandle { gateway, ingest }, thread)
}

/// Retention settings, as the snapshot thread applies them.
#[derive(Clone, Copy)]
struct Retention {
    max_age_ms: u64,
    max_bytes: u64,
}

impl WriterSettings {
    fn retention(&self) -> Retention {
        Retention {
            max_age_ms: self.journal_max_age.as_millis() as u64,
            max_bytes: self.journal_max_bytes,
        }
    }
}

/// A copy of the state as of the last applied input. Copying is the only part of a snapshot the
/// writer thread pays for (tens of milliseconds per million blocks); encoding and writing it,
/// several times longer, happen on the snapshot thread while routing goes on.
fn take_snapshot(router: &Router, clock: &mut Clock) -> Snapshot {
    let started = Instant::now();
    let snapshot = Snapshot::of(router, clock.now());
    ::metrics::gauge!("kvrouted_snapshot_copy_seconds").set(started.elapsed().as_secs_f64());
    snapshot
}

/// The thread that writes periodic snapshots and applies journal retention after each.
struct Snapshotter {
    tx: Option<std::sync::mpsc::SyncSender<Snapshot>>,
    busy: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Snapshotter {
    fn start(journal: Journal, settings: &WriterSettings) -> Snapshotter {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Snapshot>(1);
        let busy = Arc::new(AtomicBool::new(false));
        let retention = settings.retention();
        let thread = {
            let busy = busy.clone();
            std::thread::Builder::new()
                .name("kvrouted-snapshot".into())
                .spawn(move || {
                    for snapshot in rx {
                        write_snapshot(&journal, &snapshot, &retention);
                        drop(snapshot);
                        busy.store(false, Ordering::Release);
                    }
                })
                .expect("spawn snapshot thread")
        };
        Snapshotter {
            tx: Some(tx),
            busy,
            thread: Some(thread),
        }
    }

    /// Whether the previous snapshot is written (so taking another is worth it).
    fn idle(&self) -> bool {
        !self.busy.load(Ordering::Acquire)
    }

    fn submit(&mut self, snapshot: Snapshot) {
        self.busy.store(true, Ordering::Release);
        if let Some(tx) = &self.tx {
            if tx.try_send(snapshot).is_err() {
                self.busy.store(false, Ordering::Release);
            }
        }
    }

    /// Waits for a snapshot in progress and ends the thread.
    fn stop(&mut self) {
        self.tx.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn write_snapshot(journal: &Journal, snapshot: &Snapshot, retention: &Retention) {
    let started = Instant::now();
    match journal.write_snapshot(snapshot) {
        Ok(bytes) => {
            let pruned = journal
                .prune(snapshot.at_ms, retention.max_age_ms, retention.max_bytes)
                .unwrap_or_else(|e| {
                    tracing::error!("journal retention failed: {e}");
                    0
                });
            ::metrics::gauge!("kvrouted_snapshot_seconds").set(started.elapsed().as_secs_f64());
            if let Ok(bytes) = journal.journal_bytes() {
                ::metrics::gauge!("kvrouted_journal_size_bytes").set(bytes as f64);
            }
            tracing::info!(
                seq = snapshot.seq,
                bytes,
                pruned,
                took_ms = started.elapsed().as_millis() as u64,
                "snapshot written"
            );
        }
        Err(e) => tracing::error!("snapshot failed: {e}"),
    }
}

/// Group commit: while messages wait for their ack, flushes the journal every `interval` and then
/// acks the messages it covers; otherwise flushes every `soft_interval`.
pub async fn run_flusher(
    journal: Journal,
    pending: Arc<PendingAcks>,
    interval: Duration,
    soft_interval: Duration,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_flush = Instant::now();
    loop {
        ticker.tick().await;
        // A flush costs every route some latency, so without a message waiting for its ack the
        // journal is flushed only every `soft_interval`.
        let awaiting_ack = !pending.acks.lock().unwrap().is_empty();
        if awaiting_ack || last_flush.elapsed() >= soft_interval {
            flush_and_ack(&journal, &pending).await;
            last_flush = Instant::now();
        }
    }
}

/// Makes every journal entry appended so far durable, then acks the messages they hold. Nothing
/// is acked if the flush fails: those messages stay unacked and are redelivered.
pub async fn flush_and_ack(journal: &Journal, pending: &PendingAcks) {
    let upto = pending.appended.load(Ordering::Acquire);
    if upto == pending.flushed.load(Ordering::Acquire) {
        return;
    }
    if let Err(e) = journal.flush_async().await {
        ::metrics::counter!("kvrouted_journal_errors_total").increment(1);
        tracing::error!(
            "journal flush failed (messages stay unacked and will be redelivered): {e}"
        );
        return;
    }
    pending.flushed.fetch_max(upto, Ordering::AcqRel);
    let ready: Vec<Acker> = {
        let mut acks = pending.acks.lock().unwrap();
        let n = acks.iter().take_while(|(seq, _)| *seq <= upto).count();
        acks.drain(..n).map(|(_, a)| a).collect()
    };
    for acker in ready {
        if let Err(e) = acker.ack().await {
            tracing::debug!("ack failed (message will be redelivered, sequence dedupes it): {e}");
        }
    }
}
