//! The single writer: inputs are stamped with the next journal sequence and the daemon clock,
//! journaled and applied one at a time, in one order, by whoever holds the state (see
//! docs/architecture.md, "The writer").
//!
//! Its parts, each with the ordering rule it keeps and the tests of that rule:
//!
//! - [`state_lock`]: gateway inputs (routes, releases, queries) are applied on the HTTP task that
//!   parsed them, under the state's lock, and are served before queued ingest. Handing each route
//!   to another thread and back cost two context switches, the largest item in a route's profile
//!   (docs/performance.md). The lock is the order: the journal sequence is taken under it.
//! - this module: ingest inputs go through a bounded lane to the writer thread, which applies
//!   them one lock at a time; [`WriterHandle`] is the typed API the handlers call.
//! - [`acks`]: journal appends land in sled's memory; a flusher makes them durable every
//!   `flush_interval` (group commit) and only then acks the broker messages they came from, so
//!   neither path waits for the disk and a crash never loses an acked event.
//! - [`snapshotter`]: every `snapshot_interval` the writer thread copies the state (the only
//!   pause for a snapshot); a snapshot thread encodes and writes the copy, then applies journal
//!   retention. The final snapshot at shutdown is written after any periodic one in progress.

pub mod acks;
pub mod snapshotter;
pub mod state_lock;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, oneshot};

use crate::decisions::DecisionSink;
use crate::input::{Input, RouteRequest, Stamped};
use crate::journal::{Journal, JournalEntry, RouteOutcome};
use crate::prom;
use crate::replicas::PeerEvent;
use crate::reservations::ReleasePhase;
use crate::router::{BlockSizes, Decision, Output, Router, WorkerRow};
pub use acks::{flush_and_ack, run_flusher, Ack, AckFuture, Acknowledge, PendingAcks};
use snapshotter::{take_snapshot, Snapshotter};
use state_lock::StateLock;

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

/// What the single writer owns: the router, the journal every input goes to first, and the
/// clock that stamps inputs.
pub struct WriterState {
    router: Router,
    journal: Journal,
    clock: Clock,
    pending: Arc<PendingAcks>,
}

impl WriterState {
    /// Journals and applies one input; the next flush makes it durable. Once a journal write
    /// has failed, applies nothing more: the state may already hold an input the journal does
    /// not, and must not move further from it (see [`crate::status::JournalFault`]).
    fn apply(&mut self, input: Input, source: &str) -> Result<Applied, JournalFaulted> {
        let fault = self.pending.fault();
        if let Some(reason) = fault.reason() {
            fault.refuse(source);
            return Err(JournalFaulted(reason.to_string()));
        }
        let applied = apply_journaled(
            &mut self.router,
            &self.journal,
            &mut self.clock,
            input,
            source,
        );
        if let Err(e) = &applied.journaled {
            // Applied but not journaled: its output is never handed out.
            fault.record("append", e);
            fault.refuse(source);
            return Err(JournalFaulted(e.clone()));
        }
        self.pending.appended(self.router.last_seq());
        Ok(applied)
    }

    /// Whether the state is still the journal's (no journal write has failed), so that a
    /// snapshot of it may be written.
    fn consistent(&self) -> bool {
        !self.pending.fault().failed()
    }
}

/// Handle to the writer; cheap to clone.
#[derive(Clone)]
pub struct WriterHandle {
    shared: Arc<StateLock<WriterState>>,
    /// Each model's block size, for handlers cutting tokens into blocks without the state's
    /// lock; replaced whenever a lifecycle message is applied (joins declare sizes).
    block_sizes: Arc<RwLock<Arc<BlockSizes>>>,
    ingest: mpsc::Sender<Command>,
    control: mpsc::Sender<Command>,
    /// Where this replica's routes and releases go for its peers (none: it runs alone).
    decisions: Option<DecisionSink>,
    /// The journal, for storing the runs a gateway input sealed once the state's lock is free.
    journal: Journal,
    pending: Arc<PendingAcks>,
    /// Set while a blocking task is scheduled to store the sealed runs or storing them (see
    /// [`WriterHandle::store_sealed_in_background`]).
    store_scheduled: Arc<AtomicBool>,
    /// Store tasks scheduled so far (what the tests watch).
    #[cfg(test)]
    store_tasks: Arc<std::sync::atomic::AtomicUsize>,
}

#[derive(Debug, thiserror::Error)]
#[error("the router is shutting down")]
pub struct WriterGone;

/// An input refused because a journal write failed (see [`crate::status::JournalFault`]).
#[derive(Debug, thiserror::Error)]
#[error("the journal cannot be written ({0}); kvrouted refuses inputs until it restarts")]
pub struct JournalFaulted(pub String);

/// Why a gateway input (a route or a release) was not applied.
#[derive(Debug, thiserror::Error)]
pub enum Unavailable {
    #[error(transparent)]
    WriterGone(#[from] WriterGone),
    #[error(transparent)]
    JournalFault(#[from] JournalFaulted),
}

/// Why a route got no decision.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("no candidate worker: none known, or all draining or excluded")]
    NoCandidate,
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
}

/// The source label of inputs from gateways, in metrics.
const GATEWAY: &str = "http";

impl WriterHandle {
    /// Journals and applies a route on the calling task; holds the state's lock for the one
    /// input (microseconds).
    pub async fn route(&self, request: RouteRequest) -> Result<Decision, RouteError> {
        let output = self.apply_gateway(Input::Route(request)).await?;
        match output {
            Output::Routed(mut decision) => {
                self.share(decision.peer_event.take());
                Ok(decision)
            }
            Output::NoCandidate => Err(RouteError::NoCandidate),
            other => unreachable!("the router answers a route with a decision or none: {other:?}"),
        }
    }

    /// Journals and applies a release (of the prefill part with `phase`, else all of it);
    /// `false` when the reservation is unknown, released or expired.
    pub async fn release(
        &self,
        reservation: u64,
        phase: Option<ReleasePhase>,
    ) -> Result<bool, Unavailable> {
        match self
            .apply_gateway(Input::Release { reservation, phase })
            .await?
        {
            Output::Released { found, peer_event } => {
                self.share(peer_event);
                Ok(found)
            }
            other => {
                unreachable!("the router answers a release with whether it found it: {other:?}")
            }
        }
    }

    /// Hands a route's or release's event to the publisher for peer replicas, after its journal
    /// entry is written and the state's lock released (never waiting for NATS).
    fn share(&self, event: Option<Box<PeerEvent>>) {
        if let (Some(sink), Some(event)) = (&self.decisions, event) {
            sink.offer(event);
        }
    }

    /// The block size routes for `model` are cut with.
    pub fn block_size_of(&self, model: Option<&str>) -> u32 {
        let sizes = self
            .block_sizes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        sizes.of(model)
    }

    /// The rows of `GET /v1/workers` (not journaled).
    pub async fn workers(&self) -> Result<Vec<WorkerRow>, WriterGone> {
        self.query(|router, now| router.worker_rows(now)).await
    }

    async fn apply_gateway(&self, input: Input) -> Result<Output, Unavailable> {
        let applied = self
            .shared
            .gateway(move |state| state.apply(input, GATEWAY))
            .await??;
        self.store_sealed_in_background();
        Ok(applied.output)
    }

    /// Hands the runs that gateway inputs' appends sealed to a thread of the blocking pool,
    /// which stores them in sled; the input's task answers meanwhile. A run's insert creates a
    /// file of its own (a run is past sled's blob threshold), and on a route's task it held
    /// the runtime thread for that long, and with it the other requests the thread serves:
    /// with 4k-token routes at concurrency 16 the file's creation and write were a tenth of the
    /// daemon's samples, and the routes' p99 was 2.5-5.2 ms on disk against 2.3 ms with the
    /// data dir in memory (docs/performance.md, Round 5, thirty-first part).
    ///
    /// One store task at a time: the flag stays set from its scheduling until it has stored
    /// the queue and found it empty after clearing the flag, so routes that seal runs while it
    /// waits for sled schedule no other (a task per sealed run, each waiting for the one
    /// before, doubled the daemon's peak memory with routes and ingest together: 1.2-1.5 GiB
    /// against 0.73-0.77 GiB), and a run sealed once the flag is clear schedules the next. An
    /// append past [`Journal`]'s bound of sealed runs stores them itself, so a store that lags
    /// (a slow disk) bounds the memory they hold.
    fn store_sealed_in_background(&self) {
        if !self.journal.has_sealed() || self.store_scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        #[cfg(test)]
        self.store_tasks.fetch_add(1, Ordering::AcqRel);
        let (journal, pending, scheduled) = (
            self.journal.clone(),
            self.pending.clone(),
            self.store_scheduled.clone(),
        );
        tokio::task::spawn_blocking(move || loop {
            record_store(&pending, journal.store_sealed());
            scheduled.store(false, Ordering::Release);
            // A run sealed between the store and the clear found the flag still set and
            // scheduled nothing: this task takes it, unless a route already scheduled one.
            if !journal.has_sealed() || scheduled.swap(true, Ordering::AcqRel) {
                return;
            }
        });
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

    /// Reads the state (not journaled).
    pub async fn query<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Router, u64) -> R + Send + 'static,
    ) -> Result<R, WriterGone> {
        self.shared
            .gateway(move |state| f(&state.router, state.clock.now()))
            .await
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

impl WriterSettings {
    /// Snapshots every `snapshot_interval`, and the journal kept (no retention due): what the
    /// writer's and the snapshotter's tests run with.
    #[cfg(test)]
    pub(crate) fn keeping_the_journal(snapshot_interval: Duration) -> Self {
        let year = Duration::from_secs(365 * 24 * 3600);
        WriterSettings {
            snapshot_interval,
            journal_max_age: year,
            journal_max_bytes: u64::MAX,
        }
    }
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
    let journaled = journal
        .append(seq, &entry)
        .map(|bytes| prom::handles().journaled(bytes))
        .map_err(|e| e.to_string());
    if journaled.is_ok() {
        prom::record_output(&output, source);
    }
    Applied {
        seq,
        output,
        journaled,
    }
}

/// Records how a store of the journal runs that appends sealed went ([`Journal::store_sealed`],
/// made after the state's lock is let go, so the sled insert of a run does not hold up the
/// inputs waiting for it). A failed insert is a journal fault, as a failed append is: inputs
/// are refused from then on, and the flush that would have covered the run fails, so nothing
/// it held is acked.
fn record_store(pending: &PendingAcks, stored: crate::journal::Result<()>) {
    if let Err(e) = stored {
        pending.fault().record("store", &e.to_string());
    }
}

/// The result of [`apply_journaled`].
pub struct Applied {
    pub seq: u64,
    pub output: Output,
    /// The entry is in the journal (durable at the next flush), or why the append failed. When
    /// it failed, the input is applied but not journaled: its output must not be handed out,
    /// and the message it came from must not be acked (JetStream delivers it again).
    pub journaled: Result<(), String>,
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
    decisions: Option<DecisionSink>,
) -> (WriterHandle, std::thread::JoinHandle<()>) {
    let (control, control_rx) = mpsc::channel::<Command>(1);
    let (ingest, ingest_rx) = mpsc::channel::<Command>(INGEST_QUEUE);
    let mut lanes = Lanes {
        control: control_rx,
        ingest: ingest_rx,
        runtime: tokio::runtime::Handle::current(),
    };
    let block_sizes = Arc::new(RwLock::new(Arc::new(router.block_sizes())));
    let shared = Arc::new(StateLock::new(WriterState {
        router,
        journal: journal.clone(),
        clock,
        pending: pending.clone(),
    }));
    let handle = WriterHandle {
        shared: shared.clone(),
        block_sizes: block_sizes.clone(),
        ingest,
        control,
        decisions,
        journal: journal.clone(),
        pending: pending.clone(),
        store_scheduled: Arc::default(),
        #[cfg(test)]
        store_tasks: Arc::default(),
    };
    let store_journal = journal.clone();
    let thread = std::thread::Builder::new()
        .name("kvrouted-writer".into())
        .spawn(move || {
            let mut snapshotter = Snapshotter::start(journal, &settings);
            let shutdown = loop {
                match lanes.next(snapshotter.next_due()) {
                    Ok(Some(Command::Apply { input, source, ack })) => {
                        let applied = shared.ingest(|state| {
                            let lifecycle = matches!(input, Input::Lifecycle(_));
                            let applied = state.apply(input, source);
                            if lifecycle && applied.is_ok() {
                                let sizes = Arc::new(state.router.block_sizes());
                                *block_sizes.write().unwrap_or_else(|e| e.into_inner()) = sizes;
                            }
                            // Queued under the lock, right after the entry's append; a message
                            // not journaled stays unacked (delivered again).
                            if let Some(ack) = ack {
                                let seq = state.router.last_seq();
                                pending.queue(seq, ack, applied.is_ok());
                            }
                        });
                        if applied.is_err() {
                            return;
                        }
                        // A run being stored by a gateway input's blocking task is not waited
                        // for: ingest goes on, and that task takes this input's runs along.
                        record_store(&pending, store_journal.store_sealed_unless_busy());
                    }
                    Ok(Some(Command::Ack(ack))) => pending.queue_after_appended(ack),
                    Ok(Some(Command::Shutdown(done))) => break Some(done),
                    Ok(None) => {}
                    Err(WriterGone) => break None,
                }
                if snapshotter.due() {
                    let kept = snapshotter.take_kept();
                    // Never a snapshot of a state the journal does not hold.
                    if let Ok(Some(snapshot)) = shared.ingest(|state| {
                        state
                            .consistent()
                            .then(|| take_snapshot(&state.router, &mut state.clock, kept))
                    }) {
                        snapshotter.submit(snapshot);
                    }
                }
            };
            // Let a periodic snapshot in progress finish, then write the final one.
            snapshotter.finish(|kept| {
                shared.take().and_then(|mut state| {
                    state
                        .consistent()
                        .then(|| take_snapshot(&state.router, &mut state.clock, kept))
                })
            });
            if let Some(done) = shutdown {
                let _ = done.send(());
            }
        })
        .expect("spawn writer thread");
    (handle, thread)
}

/// A writer over `journal` with a new router, as the daemon starts one, snapshotting every
/// `snapshot_interval` and keeping the journal (no retention due).
#[cfg(test)]
pub(crate) fn spawn_for_test(
    journal: &Journal,
    pending: Arc<PendingAcks>,
    snapshot_interval: Duration,
) -> (WriterHandle, std::thread::JoinHandle<()>) {
    spawn(
        Router::new(crate::router::RouterConfig::default()),
        journal.clone(),
        Clock::new(0),
        pending,
        WriterSettings::keeping_the_journal(snapshot_interval),
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::tests::long_request;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_route_answers_while_its_runs_wait_for_sled_and_one_task_stores_them() {
        let dir = tempfile::TempDir::new().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let pending = Arc::new(PendingAcks::default());
        let (writer, thread) = spawn_for_test(&journal, pending.clone(), Duration::from_secs(3600));
        // sled is busy storing (another thread holds the store lock) until `release` is sent
        // or dropped.
        let (release, released) = std::sync::mpsc::channel::<()>();
        let (held, holding) = std::sync::mpsc::channel::<()>();
        let busy_sled = {
            let journal = journal.clone();
            std::thread::spawn(move || {
                let _busy = journal.hold_stores();
                held.send(()).unwrap();
                let _ = released.recv();
            })
        };
        holding.recv().unwrap();
        // Routes of 256 keys (2.3 KB entries) to an empty fleet: each is journaled, none routed.
        for i in 0..180u64 {
            let route = tokio::spawn({
                let writer = writer.clone();
                async move { writer.route(long_request(i, 256)).await }
            });
            let answer = tokio::time::timeout(kvrouted_testkit::poll::DEADLINE, route).await;
            assert!(
                matches!(answer, Ok(Ok(Err(RouteError::NoCandidate)))),
                "a route is answered while the run its entry sealed waits for sled (route {i})"
            );
        }
        assert!(
            journal.runs_sealed_and_stored().0 >= 4,
            "180 entries of 2.3 KB sealed several runs, which wait while sled is busy"
        );
        assert_eq!(
            writer.store_tasks.load(Ordering::Acquire),
            1,
            "routes that seal runs while a store waits for sled schedule no other store"
        );
        release.send(()).unwrap();
        busy_sled.join().unwrap();
        kvrouted_testkit::poll::eventually("the sealed runs are stored without a flush", || {
            let (sealed, stored) = journal.runs_sealed_and_stored();
            std::future::ready((sealed == 0 && stored >= 1).then_some(()))
        })
        .await;
        assert!(pending.fault().reason().is_none(), "no journal fault");
        writer.shutdown().await;
        thread.join().unwrap();
    }
}
