//! Event sourcing on sled (docs/architecture.md, "Persistence"): the journal of every applied input
//! and the snapshots that bound recovery time.
//!
//! Layout of the data directory (one sled database):
//!
//! - tree `journal`: sequence number (u64 big-endian) → a run of [`JournalEntry`]s (MessagePack,
//!   one after another), the first with that sequence number and each next one the number after;
//!   schema version 2 wrote one entry per key, which reads as a run of one;
//! - tree `snapshots`: sequence number covered → [`Snapshot`] (MessagePack); the latest two kept;
//! - tree `meta`: `schema_version`; `reservation_secret` (32 random bytes, made on the first
//!   start: the key of this replica's reservation ids) and `incarnation` (4 random bytes: which
//!   data dir this is, part of the replica id its decisions go out under; renewed after an
//!   unclean stop); `running` while a daemon runs on it.
//!
//! Restart = the latest snapshot + the journal after it. The journal is also the audit log that
//! `kvrouted replay` re-applies.

mod export;

pub use export::replay_start;
pub use export::{read_export, write_export, ExportReader};

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError};

use serde::{Deserialize, Serialize};

use crate::input::{Input, WorkerId};
use crate::policy::DecisionLabel;
use crate::router::{Output, RouterConfig, RouterState};

/// Version of the on-disk format. A data dir written by a newer version is refused, and one
/// older than [`OLDEST_READABLE_SCHEMA`] too.
///
/// Version 2 holds ownership, load and reserved work per (worker, data-parallel rank), with
/// epochs, store counts and lower tiers: a version-1 snapshot cannot be read as that state.
/// Version 3 stores journal entries in runs (see [`RUN_BYTES`]); it reads version 2's single
/// entries as runs of one, so a version-2 dir is opened and stamped 3, after which a version-2
/// build refuses it (it would read only the first entry of each run).
pub const SCHEMA_VERSION: u32 = 3;

/// The oldest on-disk format this build reads (see [`SCHEMA_VERSION`]).
pub const OLDEST_READABLE_SCHEMA: u32 = 2;

/// Journal entries are gathered into runs of about this many bytes, each stored under one sled
/// key. sled's cost per insert is large and grows with the value (it rewrites a leaf of up to 16
/// values every 10 inserts into it): one insert per 2.3 KB route entry cost 22–45 µs of CPU,
/// counting sled's own threads, where runs of 64 KiB cost 6–16 µs per entry, and journaled ingest
/// ran twice as fast (`cargo bench --bench journal`; docs/performance.md, "Round 5, tenth
/// part"). Leaves of runs this size pass sled's blob threshold, so sled writes them to files of
/// their own instead of its log; runs of 7 KB, which stay in the log, saved nothing. The price
/// is memory while inputs fill runs faster than flushes store them (a flood of routes or of KV
/// events): a process appending 400,000 route entries in full runs held 386–647 MiB, where runs
/// of 32 KiB held 273–376 MiB at 17% more CPU per entry (docs/performance.md, "Round 5, eleventh
/// part").
const RUN_BYTES: usize = 64 << 10;

/// Snapshots kept; journal retention never drops entries the oldest of them needs.
const SNAPSHOTS_KEPT: usize = 2;

/// sled's page cache: small, because sled does not hold a larger one to its size. It splits the
/// cache into 256 shards, each of which evicts only once the pages it has counted pass its share,
/// and it counts a page by its bytes in the log: a leaf written to a file of its own (a leaf of
/// journal runs, up to 1 MiB) counts as the pointer to it. With 128 MiB the resident memory grew
/// with the journal (`cargo bench --bench journal`, phase 5, route entries stored one by one:
/// from 219–264 MiB after 100,000 entries to 318–435 MiB after 400,000, and 1.2 GiB after 1.2 M
/// in a longer run); with 4 MiB it stays at 122–142 MiB. The daemon reads sled only to recover
/// at start, for retention's cut of the oldest runs, and for `replay` and `journal export`, so
/// no route or ingest waits on it.
const CACHE_BYTES: u64 = 4 << 20;

/// One journaled input and, for routes, the decision it produced (for `replay --verify`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JournalEntry {
    pub at_ms: u64,
    pub input: Input,
    pub outcome: Option<RouteOutcome>,
}

/// The recorded result of a route input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RouteOutcome {
    Routed {
        worker: WorkerId,
        decision: DecisionLabel,
    },
    NoCandidate,
}

impl RouteOutcome {
    /// The outcome to record for an applied input's output, if it was a route.
    pub fn of(output: &Output) -> Option<RouteOutcome> {
        match output {
            Output::Routed(d) => Some(RouteOutcome::Routed {
                worker: d.worker.clone(),
                decision: d.decision,
            }),
            Output::NoCandidate => Some(RouteOutcome::NoCandidate),
            _ => None,
        }
    }
}

impl std::fmt::Display for RouteOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RouteOutcome::Routed { worker, decision } => write!(f, "{worker} ({decision})"),
            RouteOutcome::NoCandidate => f.write_str("no candidate (503)"),
        }
    }
}

/// The router's state as of journal sequence `seq`, with the settings in force.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot {
    pub seq: u64,
    pub at_ms: u64,
    pub config: RouterConfig,
    pub state: RouterState,
}

impl Snapshot {
    /// The router's state as of its last applied input, taken at `at_ms`.
    pub fn of(router: &crate::router::Router, at_ms: u64) -> Snapshot {
        Snapshot {
            seq: router.last_seq(),
            at_ms,
            config: router.config().clone(),
            state: router.state().clone(),
        }
    }

    /// Makes this snapshot the router's state as of its last applied input, taken at
    /// `at_ms`, as [`Snapshot::of`] does but in this snapshot's own memory where it has room:
    /// the copy a writer keeps from its last snapshot (see `RouterState::clone_from`).
    pub fn retake(&mut self, router: &crate::router::Router, at_ms: u64) {
        self.seq = router.last_seq();
        self.at_ms = at_ms;
        self.config.clone_from(router.config());
        self.state.clone_from(router.state());
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("data dir {dir} is in use by another kvrouted process (sled lock held); stop it or pass another --data-dir")]
    Locked { dir: String },
    #[error("data dir {dir} was written by a newer kvrouted (schema version {found}, this build reads up to {supported}); refusing to start with an empty index")]
    FutureSchema {
        dir: String,
        found: u32,
        supported: u32,
    },
    #[error("data dir {dir} was written by an older kvrouted (schema version {found}; this build reads version {oldest} and later, with ownership per data-parallel rank); move it aside and start with an empty --data-dir: JetStream redelivers what the stream still holds")]
    PastSchema {
        dir: String,
        found: u32,
        oldest: u32,
    },
    #[error("{dir} is not a kvrouted data dir (no journal there); check --data-dir")]
    NotADataDir { dir: String },
    #[error("cannot open data dir {dir}: {source}")]
    Open { dir: String, source: sled::Error },
    #[error("journal storage error: {0}")]
    Storage(#[from] sled::Error),
    #[error("corrupt journal record at seq {seq}: {detail}")]
    Corrupt { seq: u64, detail: String },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = JournalError> = std::result::Result<T, E>;

/// Stamps the schema version of the data dir at `dir` (which no process may hold open), without
/// checking the one already there. For migrations and for tests of the refusal of a future
/// version.
pub fn write_schema_version(dir: &Path, version: u32) -> Result<()> {
    let db = sled::Config::new()
        .path(dir)
        .open()
        .map_err(|e| open_error(dir, e))?;
    db.open_tree("meta")?
        .insert("schema_version", &version.to_be_bytes())?;
    db.flush()?;
    Ok(())
}

fn open_error(dir: &Path, e: sled::Error) -> JournalError {
    let dir = dir.display().to_string();
    match e {
        sled::Error::Io(ref io)
            if io.kind() == std::io::ErrorKind::WouldBlock
                || io.to_string().contains("could not acquire lock") =>
        {
            JournalError::Locked { dir }
        }
        source => JournalError::Open { dir, source },
    }
}

/// The journal and snapshots in one sled database.
#[derive(Clone)]
pub struct Journal {
    db: sled::Db,
    entries: sled::Tree,
    snapshots: sled::Tree,
    bytes: Arc<ByteCount>,
    pending: Arc<Pending>,
}

/// Runs sealed by appends and not yet stored that make an append store them itself: a caller
/// that never calls [`Journal::store_sealed`] (a test, a tool) holds at most this many in memory.
const MAX_SEALED: usize = 8;

/// Buffers of stored runs kept for the runs sealed after them: enough for the writer's usual
/// one or two runs between stores, so an append allocates no run buffer.
const SPARE_RUNS: usize = 2;

/// The entries appended since the last settle, in memory. Every read and every flush settles
/// them first, so appended entries are visible at once and a flush makes all of them durable.
///
/// An append only adds to the open run and, once the run holds [`RUN_BYTES`], seals it: the sled
/// insert of a sealed run is left to [`Journal::store_sealed`], which the writer calls after
/// letting go of the state's lock. The insert of a 64 KiB run was a tenth of the daemon's CPU
/// with 4k-token routes at concurrency 16, and every route waiting for the state's lock waited
/// for it too (docs/performance.md, Round 5, twenty-second part).
struct Pending {
    entries: sled::Tree,
    run: Mutex<Run>,
    /// Sealed runs, oldest first (shared with the insert that reads one while appends go on).
    sealed: Mutex<VecDeque<Arc<Run>>>,
    /// Held across every sled insert of runs, by a settle from the sealing of the open run on,
    /// so a flush never finds a run on its way to sled and acks entries that are in neither place.
    storing: Mutex<()>,
    /// Buffers of stored runs, reused by the runs sealed after them.
    spare: Mutex<Vec<Vec<u8>>>,
}

#[derive(Default)]
struct Run {
    first_seq: u64,
    next_seq: u64,
    bytes: Vec<u8>,
}

/// Locks a mutex of the journal's pending entries. Entries are encoded before the run's lock is
/// taken and a sealed run leaves its queue only once sled holds it, so a panic under one (in
/// sled) leaves whole entries behind.
fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Pending {
    fn new(entries: sled::Tree) -> Self {
        Pending {
            entries,
            run: Mutex::default(),
            sealed: Mutex::default(),
            storing: Mutex::default(),
            spare: Mutex::default(),
        }
    }

    /// Seals the open run (if it holds anything) and opens an empty one.
    fn seal(&self, run: &mut Run) {
        if run.bytes.is_empty() {
            return;
        }
        let bytes = locked(&self.spare).pop().unwrap_or_default();
        let full = std::mem::replace(
            run,
            Run {
                bytes,
                ..Run::default()
            },
        );
        locked(&self.sealed).push_back(Arc::new(full));
    }

    fn sealed_count(&self) -> usize {
        locked(&self.sealed).len()
    }

    /// Stores every sealed run, oldest first, each under its first sequence number. The caller
    /// holds `storing`, so only this pops the queue: a run leaves it once sled holds it, and
    /// one whose insert fails (or panics) stays at the front for the next try.
    fn store_sealed(&self, _storing: &MutexGuard<'_, ()>) -> Result<()> {
        loop {
            let Some(run) = locked(&self.sealed).front().cloned() else {
                return Ok(());
            };
            self.entries
                .insert(run.first_seq.to_be_bytes(), &run.bytes[..])?;
            locked(&self.sealed).pop_front();
            if let Ok(Run { mut bytes, .. }) = Arc::try_unwrap(run) {
                bytes.clear();
                let mut spare = locked(&self.spare);
                if spare.len() < SPARE_RUNS {
                    spare.push(bytes);
                }
            }
        }
    }

    /// Seals the open run and stores every sealed one.
    fn settle(&self) -> Result<()> {
        let storing = locked(&self.storing);
        self.seal(&mut locked(&self.run));
        self.store_sealed(&storing)
    }
}

impl Drop for Pending {
    /// The last handle's drop stores what is left, as sled keeps what was inserted when its last
    /// handle goes.
    fn drop(&mut self) {
        if let Err(e) = self.settle() {
            tracing::error!("journal entries appended last were not stored: {e}");
        }
    }
}

/// The entries of one stored run, in order, each with its sequence number, where its bytes start
/// in the run and how many there are.
struct StoredRun {
    seq: u64,
    value: sled::IVec,
    at: usize,
}

struct StoredEntry {
    seq: u64,
    entry: JournalEntry,
    at: usize,
    len: usize,
}

impl StoredRun {
    fn new(key: &[u8], value: sled::IVec) -> StoredRun {
        StoredRun {
            seq: seq_of(key),
            value,
            at: 0,
        }
    }
}

impl Iterator for StoredRun {
    type Item = Result<StoredEntry>;

    fn next(&mut self) -> Option<Result<StoredEntry>> {
        if self.at >= self.value.len() {
            return None;
        }
        let mut rest = &self.value[self.at..];
        let before = rest.len();
        let seq = self.seq;
        match rmp_serde::from_read::<_, JournalEntry>(&mut rest) {
            Ok(entry) => {
                let (at, len) = (self.at, before - rest.len());
                self.at += len;
                self.seq += 1;
                Some(Ok(StoredEntry {
                    seq,
                    entry,
                    at,
                    len,
                }))
            }
            Err(e) => {
                self.at = self.value.len();
                Some(Err(JournalError::Corrupt {
                    seq,
                    detail: e.to_string(),
                }))
            }
        }
    }
}

/// The sequence number of the last entry in `entries`, if any.
fn last_seq_in(entries: &sled::Tree) -> Result<Option<u64>> {
    let Some((k, v)) = entries.last()? else {
        return Ok(None);
    };
    let mut last = None;
    for stored in StoredRun::new(&k, v) {
        last = Some(stored?.seq);
    }
    Ok(last)
}

/// The encoded size of the journal, kept up to date so that retention does not rescan it after
/// every snapshot. The entries that were there at open are counted once, on the first retention
/// check (off the writer thread); appends and drops since are added up as they happen.
struct ByteCount {
    /// Last sequence number journaled when the dir was opened.
    at_open_upto: Option<u64>,
    /// Bytes of the entries up to `at_open_upto`, counted when first needed.
    at_open: OnceLock<u64>,
    appended: AtomicU64,
    dropped: AtomicU64,
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    rmp_serde::to_vec(value).expect("journal records always serialize")
}

fn seq_of(key: &[u8]) -> u64 {
    u64::from_be_bytes(key.try_into().expect("journal keys are 8 bytes"))
}

impl Journal {
    /// Opens (or creates) the data dir. Refuses a dir locked by another process or written by a
    /// newer schema, with an error that says which.
    pub fn open(dir: &Path) -> Result<Journal> {
        Journal::open_inner(dir, true)
    }

    fn open_inner(dir: &Path, create: bool) -> Result<Journal> {
        let shown = dir.display().to_string();
        std::fs::create_dir_all(dir).map_err(|e| JournalError::Open {
            dir: shown.clone(),
            source: sled::Error::Io(e),
        })?;
        let db = sled::Config::new()
            .path(dir)
            .mode(sled::Mode::HighThroughput)
            .cache_capacity(CACHE_BYTES)
            .open()
            .map_err(|e| open_error(dir, e))?;
        let meta = db.open_tree("meta")?;
        match meta.get("schema_version")? {
            Some(v) => {
                let found = u32::from_be_bytes(v.as_ref().try_into().map_err(|_| {
                    JournalError::Corrupt {
                        seq: 0,
                        detail: "schema_version is not 4 bytes".into(),
                    }
                })?);
                if found > SCHEMA_VERSION {
                    return Err(JournalError::FutureSchema {
                        dir: shown,
                        found,
                        supported: SCHEMA_VERSION,
                    });
                }
                if found < OLDEST_READABLE_SCHEMA {
                    return Err(JournalError::PastSchema {
                        dir: shown,
                        found,
                        oldest: OLDEST_READABLE_SCHEMA,
                    });
                }
                if found < SCHEMA_VERSION && create {
                    // This daemon writes runs, which the build that wrote the dir cannot read.
                    meta.insert("schema_version", &SCHEMA_VERSION.to_be_bytes())?;
                }
            }
            None if create => {
                meta.insert("schema_version", &SCHEMA_VERSION.to_be_bytes())?;
            }
            None => return Err(JournalError::NotADataDir { dir: shown }),
        }
        let entries = db.open_tree("journal")?;
        let at_open_upto = last_seq_in(&entries)?;
        Ok(Journal {
            pending: Arc::new(Pending::new(entries.clone())),
            entries,
            snapshots: db.open_tree("snapshots")?,
            db,
            bytes: Arc::new(ByteCount {
                at_open_upto,
                at_open: OnceLock::new(),
                appended: AtomicU64::new(0),
                dropped: AtomicU64::new(0),
            }),
        })
    }

    /// Opens the data dir of an existing daemon, for reading it (`replay`, `journal export`):
    /// unlike [`Journal::open`], a missing dir or one that holds no kvrouted journal is an error,
    /// not a new empty journal.
    pub fn open_existing(dir: &Path) -> Result<Journal> {
        let not_a_data_dir = || JournalError::NotADataDir {
            dir: dir.display().to_string(),
        };
        if dir.exists() && !dir.is_dir() {
            // Let `open` say why it cannot be used (not a directory).
            return Journal::open(dir);
        }
        if !dir.join("db").is_file() {
            return Err(not_a_data_dir());
        }
        Journal::open_inner(dir, false)
    }

    /// Appends one entry (in memory until the next flush). Returns its encoded size.
    ///
    /// Entries with consecutive sequence numbers join the open run, which is sealed once it
    /// holds [`RUN_BYTES`]; an entry that does not follow the one before starts a new run. A
    /// sealed run goes to sled at the next [`store_sealed`](Self::store_sealed) or settle (or
    /// here, past [`MAX_SEALED`] of them).
    pub fn append(&self, seq: u64, entry: &JournalEntry) -> Result<usize> {
        let encoded = encode(entry);
        let sealed = {
            let mut run = locked(&self.pending.run);
            if seq != run.next_seq {
                self.pending.seal(&mut run);
            }
            if run.bytes.is_empty() {
                run.first_seq = seq;
            }
            run.bytes.extend_from_slice(&encoded);
            run.next_seq = seq + 1;
            let full = run.bytes.len() >= RUN_BYTES;
            if full {
                self.pending.seal(&mut run);
            }
            full
        };
        let len = encoded.len();
        self.bytes.appended.fetch_add(len as u64, Ordering::Relaxed);
        if sealed && self.pending.sealed_count() > MAX_SEALED {
            self.store_sealed()?;
        }
        Ok(len)
    }

    /// Stores the runs appends have sealed in sled (see [`Pending`]). Called by whoever appended
    /// once it holds no lock others wait on; their entries are in memory until then, read and
    /// flushed like the open run's.
    pub fn store_sealed(&self) -> Result<()> {
        let storing = locked(&self.pending.storing);
        self.pending.store_sealed(&storing)
    }

    /// As [`store_sealed`](Self::store_sealed), unless another caller is storing runs now. That
    /// one stores until the queue is empty, so it takes these runs along; one that was about to
    /// finish leaves them to the next store or flush, and past [`MAX_SEALED`] of them an
    /// append stores them itself.
    pub fn store_sealed_unless_busy(&self) -> Result<()> {
        match self.pending.storing.try_lock() {
            Ok(storing) => self.pending.store_sealed(&storing),
            Err(TryLockError::WouldBlock) => Ok(()),
            Err(TryLockError::Poisoned(poisoned)) => {
                self.pending.store_sealed(&poisoned.into_inner())
            }
        }
    }

    /// Whether appends have sealed runs that are not in sled yet.
    pub fn has_sealed(&self) -> bool {
        self.pending.sealed_count() > 0
    }

    /// Holds off every store of runs for as long as the guard lives: for tests of who waits
    /// on a busy sled.
    #[cfg(test)]
    pub(crate) fn hold_stores(&self) -> MutexGuard<'_, ()> {
        locked(&self.pending.storing)
    }

    /// Runs sealed and not yet stored, and runs in sled: for tests of who stores them.
    #[cfg(test)]
    pub(crate) fn runs_sealed_and_stored(&self) -> (usize, usize) {
        (self.pending.sealed_count(), self.entries.len())
    }

    /// Stores the open run and the sealed ones in sled, where reads and flushes find them.
    fn settle(&self) -> Result<()> {
        self.pending.settle()
    }

    /// Makes every append so far durable.
    pub fn flush(&self) -> Result<()> {
        self.settle()?;
        self.db.flush()?;
        Ok(())
    }

    pub async fn flush_async(&self) -> Result<()> {
        self.settle()?;
        self.db.flush_async().await?;
        Ok(())
    }

    /// The secret this data dir's reservation ids are derived with: 32 random bytes, the same
    /// on every start. Kept beside the journal, so a replica's ids stay unguessable and unique
    /// across restarts.
    pub fn reservation_secret(&self) -> Result<[u8; 32]> {
        self.made_once("reservation_secret")
    }

    /// This data dir's incarnation: 8 hex digits, the same on every start. A data dir made
    /// afresh (lost, wiped) gets another, so that peers never take its journal sequences, which
    /// start again at 1, for those of the dir it replaces (they skip what they have seen).
    pub fn incarnation(&self) -> Result<String> {
        let bytes: [u8; 4] = self.made_once("incarnation")?;
        Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Marks the data dir as in use by a running daemon until [`Journal::end_run`]. Returns
    /// whether the daemon before stopped cleanly (or there was none). After an unclean stop
    /// (crash, kill -9) the incarnation is renewed: the last journal entries before it may not
    /// have been flushed, yet their decisions may have reached peers, and this start will
    /// number its inputs from the last durable entry again. Under a new incarnation peers take
    /// those numbers for new ones (and apply the lost decisions as a peer's, which they were).
    pub fn begin_run(&self) -> Result<bool> {
        const KEY: &str = "running";
        let meta = self.db.open_tree("meta")?;
        let clean = meta.get(KEY)?.is_none();
        if !clean {
            meta.remove("incarnation")?;
        }
        meta.insert(KEY, &[1u8])?;
        self.db.flush()?;
        Ok(clean)
    }

    /// Marks a clean stop: everything journaled is flushed, the next start keeps the
    /// incarnation.
    pub fn end_run(&self) -> Result<()> {
        self.db.open_tree("meta")?.remove("running")?;
        self.flush()
    }

    /// `N` random bytes from the operating system under `key` in the `meta` tree: made and
    /// flushed on the first call, read back on every later one.
    fn made_once<const N: usize>(&self, key: &str) -> Result<[u8; N]> {
        let meta = self.db.open_tree("meta")?;
        if let Some(v) = meta.get(key)? {
            return v.as_ref().try_into().map_err(|_| JournalError::Corrupt {
                seq: 0,
                detail: format!("{key} is not {N} bytes"),
            });
        }
        let mut bytes = [0u8; N];
        getrandom::fill(&mut bytes)
            .map_err(|e| std::io::Error::other(format!("no randomness for {key}: {e}")))?;
        meta.insert(key, &bytes[..])?;
        self.db.flush()?;
        Ok(bytes)
    }

    /// Sequence number of the last journaled entry.
    pub fn last_seq(&self) -> Result<Option<u64>> {
        self.settle()?;
        last_seq_in(&self.entries)
    }

    pub fn first_seq(&self) -> Result<Option<u64>> {
        self.settle()?;
        Ok(self.entries.first()?.map(|(k, _)| seq_of(&k)))
    }

    /// Entries with a sequence number above `after`, in order.
    pub fn entries_after(&self, after: u64) -> impl Iterator<Item = Result<(u64, JournalEntry)>> {
        let start = after.saturating_add(1);
        // The run that holds `start` begins at or before it.
        let from = self.settle().and_then(|()| {
            Ok(
                match self.entries.range(..=start.to_be_bytes()).next_back() {
                    Some(item) => seq_of(&item?.0),
                    None => start,
                },
            )
        });
        let (runs, failed) = match from {
            Ok(from) => (Some(self.entries.range(from.to_be_bytes()..)), None),
            Err(e) => (None, Some(Err(e))),
        };
        let entries = runs.into_iter().flatten().flat_map(|item| {
            let run: Box<dyn Iterator<Item = Result<StoredEntry>>> = match item {
                Ok((k, v)) => Box::new(StoredRun::new(&k, v)),
                Err(e) => Box::new(std::iter::once(Err(e.into()))),
            };
            run
        });
        failed.into_iter().chain(
            entries
                .filter(move |stored| !matches!(stored, Ok(s) if s.seq < start))
                .map(|stored| stored.map(|s| (s.seq, s.entry))),
        )
    }

    /// Stores a snapshot and flushes; keeps the latest [`SNAPSHOTS_KEPT`].
    pub fn write_snapshot(&self, snapshot: &Snapshot) -> Result<usize> {
        let bytes = encode(snapshot);
        let len = bytes.len();
        self.snapshots.insert(snapshot.seq.to_be_bytes(), bytes)?;
        while self.snapshots.len() > SNAPSHOTS_KEPT {
            self.snapshots.pop_min()?;
        }
        self.flush()?;
        Ok(len)
    }

    fn decode_snapshot(k: &[u8], v: &[u8]) -> Result<Snapshot> {
        rmp_serde::from_slice(v).map_err(|e| JournalError::Corrupt {
            seq: seq_of(k),
            detail: format!("snapshot: {e}"),
        })
    }

    /// The newest snapshot, if any.
    pub fn latest_snapshot(&self) -> Result<Option<Snapshot>> {
        match self.snapshots.last()? {
            Some((k, v)) => Ok(Some(Self::decode_snapshot(&k, &v)?)),
            None => Ok(None),
        }
    }

    /// The oldest snapshot kept: where an audit replay starts when the journal's head was
    /// dropped by retention.
    pub fn oldest_snapshot(&self) -> Result<Option<Snapshot>> {
        match self.snapshots.first()? {
            Some((k, v)) => Ok(Some(Self::decode_snapshot(&k, &v)?)),
            None => Ok(None),
        }
    }

    /// Drops journal entries older than `max_age_ms` or beyond `max_bytes` (oldest first), but
    /// never one that the oldest kept snapshot does not cover. Returns how many were dropped.
    ///
    /// A run is dropped entry by entry: when it is cut, the entries kept are stored again under
    /// the first one's sequence number, in one batch with the run's removal.
    pub fn prune(&self, now_ms: u64, max_age_ms: u64, max_bytes: u64) -> Result<u64> {
        let Some(covered) = self.snapshots.first()?.map(|(k, _)| seq_of(&k)) else {
            return Ok(0);
        };
        self.settle()?;
        let mut total = self.journal_bytes()?;
        let mut dropped = 0;
        for item in self.entries.range(..=covered.to_be_bytes()) {
            let (k, v) = item?;
            let mut kept_from = None;
            let mut dropped_bytes = 0;
            for stored in StoredRun::new(&k, v.clone()) {
                let stored = stored?;
                let too_old = now_ms.saturating_sub(stored.entry.at_ms) > max_age_ms;
                if stored.seq > covered || (!too_old && total <= max_bytes) {
                    kept_from = Some(stored);
                    break;
                }
                total = total.saturating_sub(stored.len as u64);
                dropped_bytes += stored.len as u64;
                dropped += 1;
            }
            if dropped_bytes == 0 {
                break;
            }
            let mut batch = sled::Batch::default();
            batch.remove(&k);
            if let Some(kept) = &kept_from {
                batch.insert(&kept.seq.to_be_bytes(), &v[kept.at..]);
            }
            self.entries.apply_batch(batch)?;
            self.bytes
                .dropped
                .fetch_add(dropped_bytes, Ordering::Relaxed);
            if kept_from.is_some() {
                break;
            }
        }
        Ok(dropped)
    }

    /// Encoded bytes of the journal entries kept (what retention's `max_bytes` bounds). The first
    /// call reads the sizes of the entries that were there at open; later calls are O(1).
    pub fn journal_bytes(&self) -> Result<u64> {
        let at_open = match self.bytes.at_open.get() {
            Some(&n) => n,
            None => {
                let mut n = 0;
                if let Some(upto) = self.bytes.at_open_upto {
                    for item in self.entries.range(..=upto.to_be_bytes()) {
                        n += item?.1.len() as u64;
                    }
                }
                *self.bytes.at_open.get_or_init(|| n)
            }
        };
        let appended = self.bytes.appended.load(Ordering::Relaxed);
        let dropped = self.bytes.dropped.load(Ordering::Relaxed);
        Ok((at_open + appended).saturating_sub(dropped))
    }

    /// Bytes on disk of the whole data dir.
    pub fn size_on_disk(&self) -> Result<u64> {
        Ok(self.db.size_on_disk()?)
    }
}

#[cfg(test)]
pub(crate) mod tests;
