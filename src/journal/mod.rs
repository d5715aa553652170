//! Event sourcing on sled (DESIGN.md §8): the journal of every applied input and the snapshots
//! that bound recovery time.
//!
//! Layout of the data directory (one sled database):
//!
//! - tree `journal`: sequence number (u64 big-endian) → [`JournalEntry`] (MessagePack);
//! - tree `snapshots`: sequence number covered → [`Snapshot`] (MessagePack); the latest two kept;
//! - tree `meta`: `schema_version`.
//!
//! Restart = the latest snapshot + the journal after it. The journal is also the audit log that
//! `kvrouted replay` re-applies.

mod export;

pub use export::replay_start;
pub use export::{read_export, write_export, ExportReader};

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::input::{Input, WorkerId};
use crate::policy::DecisionLabel;
use crate::router::{Output, RouterConfig, RouterState};

/// Version of the on-disk format. A data dir written by a newer version is refused.
pub const SCHEMA_VERSION: u32 = 1;

/// Snapshots kept; journal retention never drops entries the oldest of them needs.
const SNAPSHOTS_KEPT: usize = 2;

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

/// The journal and snapshots in one sled database.
#[derive(Clone)]
pub struct Journal {
    db: sled::Db,
    entries: sled::Tree,
    snapshots: sled::Tree,
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
        let shown = dir.display().to_string();
        std::fs::create_dir_all(dir).map_err(|e| JournalError::Open {
            dir: shown.clone(),
            source: sled::Error::Io(e),
        })?;
        let db = sled::Config::new()
            .path(dir)
            .mode(sled::Mode::HighThroughput)
            .open()
            .map_err(|e| match e {
                sled::Error::Io(ref io)
                    if io.kind() == std::io::ErrorKind::WouldBlock
                        || io.to_string().contains("could not acquire lock") =>
                {
                    JournalError::Locked { dir: shown.clone() }
                }
                e => JournalError::Open {
                    dir: shown.clone(),
                    source: e,
                },
            })?;
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
            }
            None => {
                meta.insert("schema_version", &SCHEMA_VERSION.to_be_bytes())?;
            }
        }
        Ok(Journal {
            entries: db.open_tree("journal")?,
            snapshots: db.open_tree("snapshots")?,
            db,
        })
    }

    /// Appends one entry (in memory until the next flush). Returns its encoded size.
    pub fn append(&self, seq: u64, entry: &JournalEntry) -> Result<usize> {
        let bytes = encode(entry);
        let len = bytes.len();
        self.entries.insert(seq.to_be_bytes(), bytes)?;
        Ok(len)
    }

    /// Makes every append so far durable.
    pub fn flush(&self) -> Result<()> {
        self.db.flush()?;
        Ok(())
    }

    pub async fn flush_async(&self) -> Result<()> {
        self.db.flush_async().await?;
        Ok(())
    }

    /// Sequence number of the last journaled entry.
    pub fn last_seq(&self) -> Result<Option<u64>> {
        Ok(self.entries.last()?.map(|(k, _)| seq_of(&k)))
    }

    pub fn first_seq(&self) -> Result<Option<u64>> {
        Ok(self.entries.first()?.map(|(k, _)| seq_of(&k)))
    }

    /// Entries with a sequence number above `after`, in order.
    pub fn entries_after(&self, after: u64) -> impl Iterator<Item = Result<(u64, JournalEntry)>> {
        self.entries
            .range((after.saturating_add(1)).to_be_bytes()..)
            .map(|item| {
                let (k, v) = item?;
                let seq = seq_of(&k);
                let entry = rmp_serde::from_slice(&v).map_err(|e| JournalError::Corrupt {
                    seq,
                    detail: e.to_string(),
                })?;
                Ok((seq, entry))
            })
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
    pub fn prune(&self, now_ms: u64, max_age_ms: u64, max_bytes: u64) -> Result<u64> {
        let Some(covered) = self.snapshots.first()?.map(|(k, _)| seq_of(&k)) else {
            return Ok(0);
        };
        let mut total: u64 = self
            .entries
            .iter()
            .values()
            .map(|v| v.map(|v| v.len() as u64))
            .sum::<Result<u64, _>>()?;
        let mut dropped = 0;
        for item in self.entries.range(..=covered.to_be_bytes()) {
            let (k, v) = item?;
            let entry: JournalEntry =
                rmp_serde::from_slice(&v).map_err(|e| JournalError::Corrupt {
                    seq: seq_of(&k),
                    detail: e.to_string(),
                })?;
            let too_old = now_ms.saturating_sub(entry.at_ms) > max_age_ms;
            if !too_old && total <= max_bytes {
                break;
            }
            self.entries.remove(&k)?;
            total -= v.len() as u64;
            dropped += 1;
        }
        Ok(dropped)
    }

    /// Bytes on disk of the whole data dir.
    pub fn size_on_disk(&self) -> Result<u64> {
        Ok(self.db.size_on_disk()?)
    }

    pub fn entry_count(&self) -> usize {
        self.entries.len()
    }
}
