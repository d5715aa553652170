//! The single writer (DESIGN.md §2): inputs are stamped with the next journal sequence and the
//! daemon clock, journaled and applied one at a time, in one order, by whoever holds the
//! [`WriterState`].
//!
//! Gateway inputs (routes, releases, queries) are applied on the HTTP task that parsed them,
//! under the state's lock: handing each route to another thread and back cost two context
//! switches, the largest item in a route's profile (docs/performance.md). Ingest inputs go
//! through a bounded lane to the writer thread, which applies them one lock at a time and
//! stands aside between inputs while a gateway input waits, so a route waits for at most the
//! one input being applied. The lock is the order: the journal sequence is taken under it.
//!
//! Journal appends land in sled's memory; a separate flusher makes them durable every
//! `flush_interval` (group commit) and only then acks the JetStream messages they came from, so
//! neither path waits for the disk and a crash never loses an acked event.
//!
//! Every `snapshot_interval` the writer thread copies the state (the only pause for a snapshot);
//! a snapshot thread encodes and writes the copy, then applies journal retention. The final
//! snapshot at shutdown is written by the writer thread itself, after any periodic one in
//! progress.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::message::Acker;
use tokio::sync::{mpsc, oneshot};

use crate::input::{Input, Stamped};
use crate::journal::{Journal, JournalEntry, RouteOutcome, Snapshot};
use crate::metrics;
use crate::router::{BlockSizes, Output, Router};

/// Capacity of the ingest lane. Small on purpose: a full lane pushes back on NATS (JetStream
/// flow control) instead of building seconds of backlog in memory.
const INGEST_QUEUE: usize = 4_096;

enum Command {
    Apply {
        input: Input,
        source: &'static str,
        ack: Option<Ack>,
    },
    /// A message with nothing to journal (rejected): acked after the entries before it.
    Ack(Ack),
    Shutdown(oneshot::Sender<()>),
}

/// A JetStream message to acknowledge once the journal entries up to it are durable.
pub struct Ack {
    pub acker: Acker,
    /// The consumer acks cumulatively (`AckPolicy::All`): acking this message acknowledges every
    /// earlier one too, so of a flushed group only the last is acked (one publish per flush
    /// instead of one per message).
    pub cumulative: bool,
}

/// Messages waiting for the flush that makes their journal entries durable.
#[derive(Default)]
pub struct PendingAcks {
    acks: Mutex<VecDeque<(u64, Ack)>>,
    /// Last sequence appended to the journal.
    appended: AtomicU64,
    /// Last sequence known durable.
    flushed: AtomicU64,
    /// A journal append failed while acks were cumulative (see [`PendingAcks::queue`]).
    cumulative_stopped: AtomicBool,
}

/// What the single writer owns: the router, the journal every input goes to first, and the
/// clock that stamps inputs.
pub struct WriterState {
    router: Router,
    journal: Journal,
    clock: Clock,
    pending: Arc<PendingAcks>,
}

impl WriterState {
    /// Journals and applies one input; the next flush makes it durable.
    fn apply(&mut self, input: Input, source: &str) -> Applied {
        let applied = apply_journaled(
            &mut self.router,
            &self.journal,
            &mut self.clock,
            input,
            source,
        );
        self.pending
            .appended
            .store(self.router.last_seq(), Ordering::Release);
        applied
    }
}

/// The state behind its lock, and how many gateway inputs are waiting for it.
struct Shared {
    /// `None` once the writer has shut down.
    state: Mutex<Option<WriterState>>,
    gateway_waiting: AtomicUsize,
    /// Each model's block size, for handlers cutting tokens into blocks without the state's
    /// lock; replaced whenever a lifecycle message is applied (joins declare sizes).
    block_sizes: RwLock<Arc<BlockSizes>>,
}

impl Shared {
    fn lock(&self) -> Result<MutexGuard<'_, Option<WriterState>>, WriterGone> {
        // A panic while applying poisons the lock: the writer is gone, as when its thread died.
        self.state.lock().map_err(|_| WriterGone)
    }

    /// Runs `f` on the state for a gateway input. Ingest stands aside while any is waiting.
    fn with_state_for_gateway<R>(
        &self,
        f: impl FnOnce(&mut WriterState) -> R,
    ) -> Result<R, WriterGone> {
        self.gateway_waiting.fetch_add(1, Ordering::AcqRel);
        let result = self
            .lock()
            .and_then(|mut guard| guard.as_mut().map(f).ok_or(WriterGone));
        self.gateway_waiting.fetch_sub(1, Ordering::AcqRel);
        result
    }

    /// Waits while gateway inputs are waiting for the state: a route is never queued behind
    /// more than the one ingest input being applied.
    fn yield_to_gateway(&self) {
        while self.gateway_waiting.load(Ordering::Acquire) > 0 {
            std::thread::yield_now();
        }
    }
}

impl PendingAcks {
    /// Queues the ack of a message whose entry is journaled as `seq` (`journaled` false: the
    /// append failed, and the message must be delivered again). After a failed append no
    /// cumulative ack is queued again by this process, since it would cover the lost message;
    /// JetStream redelivers them all after `ack_wait`, or a restart rewinds to the ack floor.
    fn queue(&self, seq: u64, ack: Ack, journaled: bool) {
        if !journaled {
            if ack.cumulative && !self.cumulative_stopped.swap(true, Ordering::AcqRel) {
                tracing::error!(
                    seq,
                    "a journal append failed: acknowledgements stop until kvrouted restarts \
                     (unacked messages are redelivered, nothing is lost)"
                );
            }
            return;
        }
        if ack.cumulative && self.cumulative_stopped.load(Ordering::Acquire) {
            return;
        }
        self.acks.lock().unwrap().push_back((seq, ack));
    }
}

/// Handle to the writer; cheap to clone.
#[derive(Clone)]
pub struct WriterHandle {
    shared: Arc<Shared>,
    ingest: mpsc::Sender<Command>,
    control: mpsc::Sender<Command>,
}

#[derive(Debug, thiserror::Error)]
#[error("the router is shutting down")]
pub struct WriterGone;

impl WriterHandle {
    /// Applies a gateway input on the calling task and returns its output. Holds the state's
    /// lock for the one input: microseconds.
    pub async fn apply(&self, input: Input, source: &'static str) -> Result<Output, WriterGone> {
        self.shared
            .with_state_for_gateway(|state| state.apply(input, source).output)
    }

    /// Queues an ingest input for the writer thread; `ack` is acked once its journal entry is
    /// durable. Waits while the ingest lane is full.
    pub async fn submit(
        &self,
        input: Input,
        source: &'static str,
        ack: Option<Ack>,
    ) -> Result<(), WriterGone> {
        self.ingest
            .send(Command::Apply { input, source, ack })
            .await
            .map_err(|_| WriterGone)
    }

    /// Acks a message that has nothing to journal once everything queued before it is durable
    /// (a cumulative ack must not cover earlier messages before their entries are).
    pub async fn ack_in_order(&self, ack: Ack) -> Result<(), WriterGone> {
        self.ingest
            .send(Command::Ack(ack))
            .await
            .map_err(|_| WriterGone)
    }

    /// The block size routes for `model` are cut with.
    pub fn block_size_of(&self, model: Option<&str>) -> u32 {
        let sizes = self
            .shared
            .block_sizes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        sizes.of(model)
    }

    /// Reads the state (not journaled).
    pub async fn query<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Router, u64) -> R + Send + 'static,
    ) -> Result<R, WriterGone> {
        self.shared
            .with_state_for_gateway(|state| f(&state.router, state.clock.now()))
    }

    /// Writes a final snapshot and stops the writer.
    pub async fn shutdown(&self) {
        let (tx, rx) = oneshot::channel();
        if self.control.send(Command::Shutdown(tx)).await.is_ok() {
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

/// The writer thread's side of its two channels.
struct Lanes {
    control: mpsc::Receiver<Command>,
    ingest: mpsc::Receiver<Command>,
    runtime: tokio::runtime::Handle,
}

impl Lanes {
    /// The next command, control first, waiting for one until `deadline`. `Ok(None)` at the
    /// deadline; `Err` once every handle is gone.
    fn next(&mut self, deadline: Instant) -> Result<Option<Command>, WriterGone> {
        if let Ok(cmd) = self.control.try_recv() {
            return Ok(Some(cmd));
        }
        if let Ok(cmd) = self.ingest.try_recv() {
            return Ok(Some(cmd));
        }
        let Lanes {
            control,
            ingest,
            runtime,
        } = self;
        runtime.block_on(async {
            tokio::select! {
                biased;
                cmd = control.recv() => cmd.map(Some).ok_or(WriterGone),
                cmd = ingest.recv() => cmd.map(Some).ok_or(WriterGone),
                _ = tokio::time::sleep_until(deadline.into()) => Ok(None),
            }
        })
    }
}

/// Starts the writer thread. Returns its handle and the join handle.
pub fn spawn(
    router: Router,
    journal: Journal,
    clock: Clock,
    pending: Arc<PendingAcks>,
    settings: WriterSettings,
) -> (WriterHandle, std::thread::JoinHandle<()>) {
    let (control, control_rx) = mpsc::channel::<Command>(1);
    let (ingest, ingest_rx) = mpsc::channel::<Command>(INGEST_QUEUE);
    let mut lanes = Lanes {
        control: control_rx,
        ingest: ingest_rx,
        runtime: tokio::runtime::Handle::current(),
    };
    let block_sizes = RwLock::new(Arc::new(router.block_sizes()));
    let shared = Arc::new(Shared {
        block_sizes,
        state: Mutex::new(Some(WriterState {
            router,
            journal: journal.clone(),
            clock,
            pending: pending.clone(),
        })),
        gateway_waiting: AtomicUsize::new(0),
    });
    let handle = WriterHandle {
        shared: shared.clone(),
        ingest,
        control,
    };
    let thread = std::thread::Builder::new()
        .name("kvrouted-writer".into())
        .spawn(move || {
            let mut snapshotter = Snapshotter::start(journal.clone(), &settings);
            let mut next_snapshot = Instant::now() + settings.snapshot_interval;
            let shutdown = loop {
                match lanes.next(next_snapshot) {
                    Ok(Some(Command::Apply { input, source, ack })) => {
                        shared.yield_to_gateway();
                        let Ok(mut guard) = shared.lock() else { return };
                        let Some(state) = guard.as_mut() else { return };
                        let lifecycle = matches!(input, Input::Lifecycle(_));
                        let applied = state.apply(input, source);
                        if lifecycle {
                            let sizes = Arc::new(state.router.block_sizes());
                            *shared
                                .block_sizes
                                .write()
                                .unwrap_or_else(|e| e.into_inner()) = sizes;
                        }
                        // Queued under the lock, so the flusher never sees `appended` past an
                        // entry whose ack is not queued yet.
                        if let Some(ack) = ack {
                            pending.queue(applied.seq, ack, applied.journaled);
                        }
                    }
                    Ok(Some(Command::Ack(ack))) => {
                        pending.queue(pending.appended.load(Ordering::Acquire), ack, true);
                    }
                    Ok(Some(Command::Shutdown(done))) => break Some(done),
                    Ok(None) => {}
                    Err(WriterGone) => break None,
                }
                if Instant::now() >= next_snapshot {
                    if !snapshotter.idle() {
                        // The previous one is still being written: look again shortly.
                        next_snapshot = Instant::now() + Duration::from_millis(100);
                        continue;
                    }
                    if let Ok(Some(state)) = shared.lock().as_deref_mut() {
                        snapshotter.submit(take_snapshot(&state.router, &mut state.clock));
                    }
                    next_snapshot = Instant::now() + settings.snapshot_interval;
                }
            };
            // Let a periodic snapshot in progress finish, then write the final one here.
            snapshotter.stop();
            let state = shared.lock().ok().and_then(|mut guard| guard.take());
            if let Some(mut state) = state {
                let snapshot = take_snapshot(&state.router, &mut state.clock);
                write_snapshot(&journal, &snapshot, &settings.retention());
                let _ = journal.flush();
            }
            if let Some(done) = shutdown {
                let _ = done.send(());
            }
        })
        .expect("spawn writer thread");
    (handle, thread)
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
    // Acks of rejected messages can wait on entries that an earlier flush already covered.
    if upto > pending.flushed.load(Ordering::Acquire) {
        if let Err(e) = journal.flush_async().await {
            ::metrics::counter!("kvrouted_journal_errors_total").increment(1);
            tracing::error!(
                "journal flush failed (messages stay unacked and will be redelivered): {e}"
            );
            return;
        }
        pending.flushed.fetch_max(upto, Ordering::AcqRel);
    }
    let ready: Vec<Ack> = {
        let mut acks = pending.acks.lock().unwrap();
        let n = acks.iter().take_while(|(seq, _)| *seq <= upto).count();
        acks.drain(..n).map(|(_, a)| a).collect()
    };
    // Explicit acks one by one; of cumulative ones only the last, which covers the rest.
    let last_cumulative = ready.iter().rposition(|a| a.cumulative);
    for (i, ack) in ready.into_iter().enumerate() {
        if ack.cumulative && Some(i) != last_cumulative {
            continue;
        }
        if let Err(e) = ack.acker.ack().await {
            tracing::debug!("ack failed (message will be redelivered, sequence dedupes it): {e}");
        }
    }
}
