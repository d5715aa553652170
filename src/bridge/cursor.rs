//! Where one dp rank's stream stands: what to forward, what is a duplicate, where a gap starts,
//! and when the engine restarted. Pure: the rank task feeds it sequence numbers and acts on the
//! answers.
//!
//! An engine numbers its batches 0, 1, 2, ... per process. The PUB socket delivers them in
//! order (or drops some under its high-water mark), so within one engine process a live
//! sequence only grows. The bridge forwards every sequence exactly once, in order:
//!
//! - the next expected sequence is forwarded;
//! - a higher one means a gap: the missing range is asked from the replay socket first;
//! - a lower one is either a batch the bridge already forwarded from a replay (the live queue
//!   still held it), which is skipped, or proof that the engine restarted and numbers from 0
//!   again: live sequences went backwards, or a sequence below the point the bridge resumed
//!   from arrived. A restart starts a new epoch, so the daemon clears the rank's old ownership.

/// What to do with one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The next expected sequence: forward it.
    Forward,
    /// Already forwarded: skip it.
    Duplicate,
    /// Sequences from `from` up to this one are missing: replay them first.
    Gap { from: u64 },
    /// The engine restarted: start a new epoch, then look at this batch again.
    Restart,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankCursor {
    /// The next sequence to forward.
    next: u64,
    /// Live sequences below this one cannot be duplicates of this engine process: the bridge
    /// resumed (or last restarted) here.
    floor: u64,
    /// The last sequence the PUB socket delivered; it only grows within one engine process.
    last_live: Option<u64>,
    pub epoch: String,
}

impl RankCursor {
    /// A rank that resumes after `last_forwarded` (read back from the stream) in `epoch`, or
    /// starts from sequence 0.
    pub fn resume(last_forwarded: Option<u64>, epoch: String) -> RankCursor {
        let next = last_forwarded.map_or(0, |s| s.saturating_add(1));
        RankCursor {
            next,
            floor: next,
            last_live: None,
            epoch,
        }
    }

    pub fn next(&self) -> u64 {
        self.next
    }

    /// The last forwarded sequence, if any.
    pub fn last_forwarded(&self) -> Option<u64> {
        self.next.checked_sub(1)
    }

    /// A batch from the PUB socket.
    pub fn live(&mut self, seq: u64) -> Step {
        let went_back = self.last_live.is_some_and(|l| seq <= l);
        if went_back || seq < self.floor {
            return Step::Restart;
        }
        self.last_live = Some(seq);
        self.position(seq)
    }

    /// A batch from a replay the bridge asked for.
    pub fn replayed(&mut self, seq: u64) -> Step {
        self.position(seq)
    }

    fn position(&self, seq: u64) -> Step {
        match seq.cmp(&self.next) {
            std::cmp::Ordering::Equal => Step::Forward,
            std::cmp::Ordering::Less => Step::Duplicate,
            std::cmp::Ordering::Greater => Step::Gap { from: self.next },
        }
    }

    /// `seq` was forwarded.
    pub fn forwarded(&mut self, seq: u64) {
        debug_assert_eq!(seq, self.next);
        self.next = seq + 1;
    }

    /// Sequences up to (not including) `seq` are gone for good; continue at `seq`. Returns how
    /// many were lost.
    pub fn skip_to(&mut self, seq: u64) -> u64 {
        let lost = seq.saturating_sub(self.next);
        self.next = self.next.max(seq);
        lost
    }

    /// The engine restarted: a new epoch, numbering from 0.
    pub fn restart(&mut self, epoch: String) {
        *self = RankCursor::resume(None, epoch);
    }
}

/// The epoch ids of one bridge: ranks restart one by one as each sees its engine come back,
/// and they should all land on the same new epoch.
pub struct Epochs {
    newest: std::sync::Mutex<String>,
    fresh: Box<dyn Fn() -> String + Send + Sync>,
}

impl Epochs {
    pub fn new(newest: String, fresh: Box<dyn Fn() -> String + Send + Sync>) -> Epochs {
        Epochs {
            newest: std::sync::Mutex::new(newest),
            fresh,
        }
    }

    pub fn newest(&self) -> String {
        self.newest
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The epoch a rank that ran `old` moves to after its engine restarted: the newest one if
    /// another rank already moved, else a fresh one.
    pub fn after(&self, old: &str) -> String {
        let mut newest = self.newest.lock().unwrap_or_else(|e| e.into_inner());
        if *newest == old {
            *newest = (self.fresh)();
        }
        newest.clone()
    }
}

impl std::fmt::Debug for Epochs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Epochs")
            .field("newest", &self.newest())
            .finish()
    }
}

/// A new epoch id: the wall clock in milliseconds and the process id, in hex (1–64 printable
/// characters). Unique enough: two incarnations of one engine never start in the same
/// millisecond under the same pid.
pub fn fresh_epoch() -> String {
    static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{ms:x}-{:x}-{n:x}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cursor(last: Option<u64>) -> RankCursor {
        RankCursor::resume(last, "e1".into())
    }

    #[test]
    fn a_fresh_rank_forwards_from_zero_in_order() {
        let mut c = cursor(None);
        for seq in 0..3 {
            assert_eq!(c.live(seq), Step::Forward);
            c.forwarded(seq);
        }
        assert_eq!(c.last_forwarded(), Some(2));
    }

    #[test]
    fn a_skipped_sequence_is_a_gap_from_the_first_missing_one() {
        let mut c = cursor(Some(4));
        assert_eq!(c.live(9), Step::Gap { from: 5 });
    }

    #[test]
    fn live_batches_already_forwarded_by_a_replay_are_duplicates() {
        let mut c = cursor(Some(4));
        assert_eq!(c.live(7), Step::Gap { from: 5 });
        for seq in 5..=9 {
            assert_eq!(c.replayed(seq), Step::Forward);
            c.forwarded(seq);
        }
        assert_eq!(c.live(8), Step::Duplicate);
        assert_eq!(c.live(9), Step::Duplicate);
        assert_eq!(c.live(10), Step::Forward);
    }

    #[test]
    fn live_sequences_going_back_mean_the_engine_restarted() {
        let mut c = cursor(None);
        for seq in 0..5 {
            c.live(seq);
            c.forwarded(seq);
        }
        assert_eq!(c.live(0), Step::Restart);
        c.restart("e2".into());
        assert_eq!(c.live(0), Step::Forward);
        assert_eq!(c.epoch, "e2");
    }

    #[test]
    fn a_sequence_below_the_resume_point_means_the_engine_restarted() {
        // The bridge resumes after 500, and the engine's first live batch is 3.
        let mut c = cursor(Some(500));
        assert_eq!(c.live(3), Step::Restart);
        c.restart("e2".into());
        assert_eq!(c.live(3), Step::Gap { from: 0 });
    }

    #[test]
    fn what_the_engine_no_longer_buffers_is_counted_as_lost() {
        let mut c = cursor(Some(4));
        assert_eq!(c.skip_to(8), 3);
        assert_eq!(c.live(8), Step::Forward);
    }

    #[test]
    fn ranks_that_restart_one_after_another_share_the_new_epoch() {
        let n = std::sync::atomic::AtomicU32::new(0);
        let epochs = Epochs::new(
            "old".into(),
            Box::new(move || {
                format!(
                    "new{}",
                    n.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                )
            }),
        );
        let rank0 = epochs.after("old");
        let rank1 = epochs.after("old");
        assert_eq!(rank0, "new0");
        assert_eq!(rank1, "new0", "the second rank joins the first one's epoch");
        assert_eq!(epochs.after("new0"), "new1", "a second restart");
    }

    #[test]
    fn fresh_epochs_are_short_printable_and_distinct() {
        let (a, b) = (fresh_epoch(), fresh_epoch());
        assert_ne!(a, b);
        assert!(a.len() <= 64 && a.bytes().all(|c| c.is_ascii_graphic()));
    }
}
