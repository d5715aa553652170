//! A portable journal file (`kvrouted journal export`): a magic line, then MessagePack records —
//! an optional starting snapshot, then the entries in order.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{Journal, JournalEntry, JournalError, Result, Snapshot};

const MAGIC: &[u8] = b"KVROUTED-JOURNAL 1\n";

#[derive(Serialize, Deserialize)]
enum Record {
    Snapshot(Box<Snapshot>),
    Entry(u64, Box<JournalEntry>),
}

/// Where an audit replay of `journal` starts: from nothing when the journal is complete, else
/// from the oldest kept snapshot (retention never drops entries after it).
pub fn replay_start(journal: &Journal) -> Result<(Option<Snapshot>, u64)> {
    match journal.first_seq()? {
        None | Some(1) => Ok((None, 0)),
        Some(_) => match journal.oldest_snapshot()? {
            Some(s) => {
                let after = s.seq;
                Ok((Some(s), after))
            }
            None => Ok((None, 0)),
        },
    }
}

/// Writes the journal (and the snapshot it needs, if its head was pruned) to `out`.
/// Returns the number of entries written.
pub fn write_export(journal: &Journal, out: &Path) -> Result<u64> {
    let mut w = BufWriter::new(File::create(out)?);
    w.write_all(MAGIC)?;
    let (snapshot, after) = replay_start(journal)?;
    let encode_err = |e: rmp_serde::encode::Error| JournalError::Io(std::io::Error::other(e));
    if let Some(s) = snapshot {
        rmp_serde::encode::write(&mut w, &Record::Snapshot(Box::new(s))).map_err(encode_err)?;
    }
    let mut n = 0;
    for item in journal.entries_after(after) {
        let (seq, entry) = item?;
        rmp_serde::encode::write(&mut w, &Record::Entry(seq, Box::new(entry)))
            .map_err(encode_err)?;
        n += 1;
    }
    w.flush()?;
    Ok(n)
}

/// Reads an exported journal: the starting snapshot, if any, and an iterator over entries.
pub fn read_export(path: &Path) -> Result<(Option<Snapshot>, ExportReader)> {
    let mut r = BufReader::new(File::open(path)?);
    let mut magic = vec![0u8; MAGIC.len()];
    r.read_exact(&mut magic).map_err(|_| not_a_journal(path))?;
    if magic != MAGIC {
        return Err(not_a_journal(path));
    }
    let mut reader = ExportReader {
        r,
        pending: None,
        last_seq: 0,
    };
    let snapshot = match reader.next_record()? {
        Some(Record::Snapshot(s)) => Some(*s),
        Some(Record::Entry(seq, e)) => {
            reader.pending = Some((seq, *e));
            None
        }
        None => None,
    };
    Ok((snapshot, reader))
}

fn not_a_journal(path: &Path) -> JournalError {
    JournalError::Io(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("{} is not a kvrouted journal export", path.display()),
    ))
}

pub struct ExportReader {
    r: BufReader<File>,
    pending: Option<(u64, JournalEntry)>,
    last_seq: u64,
}

impl ExportReader {
    fn next_record(&mut self) -> Result<Option<Record>> {
        // EOF between records ends the file; anything else is corruption.
        if self.r.fill_buf_is_empty()? {
            return Ok(None);
        }
        rmp_serde::from_read(&mut self.r)
            .map(Some)
            .map_err(|e| JournalError::Corrupt {
                seq: self.last_seq + 1,
                detail: e.to_string(),
            })
    }
}

trait FillBufIsEmpty {
    fn fill_buf_is_empty(&mut self) -> std::io::Result<bool>;
}

impl FillBufIsEmpty for BufReader<File> {
    fn fill_buf_is_empty(&mut self) -> std::io::Result<bool> {
        use std::io::BufRead;
        Ok(self.fill_buf()?.is_empty())
    }
}

impl Iterator for ExportReader {
    type Item = Result<(u64, JournalEntry)>;
    fn next(&mut self) -> Option<Self::Item> {
        if let Some(p) = self.pending.take() {
            self.last_seq = p.0;
            return Some(Ok(p));
        }
        match self.next_record() {
            Ok(Some(Record::Entry(seq, e))) => {
                self.last_seq = seq;
                Some(Ok((seq, *e)))
            }
            Ok(Some(Record::Snapshot(_))) => Some(Err(JournalError::Corrupt {
                seq: self.last_seq + 1,
                detail: "a snapshot in the middle of an export".into(),
            })),
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        }
    }
}
