//! Snapshots, with their rule: **a snapshot is the state after exactly the journal entries up to
//! the sequence it names**, so restart = that snapshot + the journal after it.
//!
//! The copy is taken under the state lock, between two inputs (the writer thread holds the lock
//! for it, and the copy records the last applied sequence as it copies): the only pause a
//! snapshot costs routing. Encoding and writing the copy, several times longer, happen on the
//! snapshot thread while routing goes on; journal retention follows each write.
//!
//! The copy is kept once written and the next snapshot is copied into it ([`Snapshot::retake`]):
//! copying into fresh memory, nearly all of the pause was the kernel clearing the new pages
//! (about 200 ms for a million blocks; a copy into the kept one is a memory copy). The kept copy
//! holds as much memory as the copy did while it was written, so the process's peak is the
//! same; between snapshots it keeps that memory instead of giving it back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Clock, WriterSettings};
use crate::journal::{Journal, Snapshot};
use crate::router::Router;

/// Retention settings, as the snapshot thread applies them.
#[derive(Clone, Copy)]
pub struct Retention {
    max_age_ms: u64,
    max_bytes: u64,
}

impl WriterSettings {
    pub(super) fn retention(&self) -> Retention {
        Retention {
            max_age_ms: self.journal_max_age.as_millis() as u64,
            max_bytes: self.journal_max_bytes,
        }
    }
}

/// A copy of the state as of the last applied input (its sequence is the snapshot's), made in
/// `kept` (an earlier snapshot's copy) where one is given.
pub fn take_snapshot(router: &Router, clock: &mut Clock, kept: Option<Snapshot>) -> Snapshot {
    let started = Instant::now();
    let now = clock.now();
    let snapshot = match kept {
        Some(mut kept) => {
            kept.retake(router, now);
            kept
        }
        None => Snapshot::of(router, now),
    };
    metrics::gauge!("kvrouted_snapshot_copy_seconds").set(started.elapsed().as_secs_f64());
    snapshot
}

/// The thread that writes periodic snapshots and applies journal retention after each.
pub struct Snapshotter {
    tx: Option<std::sync::mpsc::SyncSender<Snapshot>>,
    busy: Arc<AtomicBool>,
    /// The last snapshot written, for the next one to be copied into.
    kept: Arc<Mutex<Option<Snapshot>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    journal: Journal,
    retention: Retention,
    interval: Duration,
    next: Instant,
}

impl Snapshotter {
    pub fn start(journal: Journal, settings: &WriterSettings) -> Snapshotter {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Snapshot>(1);
        let busy = Arc::new(AtomicBool::new(false));
        let kept = Arc::new(Mutex::new(None));
        let retention = settings.retention();
        let thread = {
            let (busy, journal, kept) = (busy.clone(), journal.clone(), kept.clone());
            std::thread::Builder::new()
                .name("kvrouted-snapshot".into())
                .spawn(move || {
                    for snapshot in rx {
                        write_snapshot(&journal, &snapshot, &retention);
                        *kept.lock().unwrap_or_else(|e| e.into_inner()) = Some(snapshot);
                        busy.store(false, Ordering::Release);
                    }
                })
                .expect("spawn snapshot thread")
        };
        Snapshotter {
            tx: Some(tx),
            busy,
            kept,
            thread: Some(thread),
            journal,
            retention,
            interval: settings.snapshot_interval,
            next: Instant::now() + settings.snapshot_interval,
        }
    }

    /// When the writer should next call [`Snapshotter::due`] at the latest.
    pub fn next_due(&self) -> Instant {
        self.next
    }

    /// Whether a periodic snapshot should be taken now. While the previous one is still being
    /// written, asks again shortly.
    pub fn due(&mut self) -> bool {
        if Instant::now() < self.next {
            return false;
        }
        if self.busy.load(Ordering::Acquire) {
            self.next = Instant::now() + Duration::from_millis(100);
            return false;
        }
        self.next = Instant::now() + self.interval;
        true
    }

    /// The last snapshot written, to copy the next one into ([`take_snapshot`]); `None` before
    /// the first, or while one is being written.
    pub fn take_kept(&self) -> Option<Snapshot> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Hands a copy to the snapshot thread.
    pub fn submit(&mut self, snapshot: Snapshot) {
        self.busy.store(true, Ordering::Release);
        if let Some(tx) = &self.tx {
            if tx.try_send(snapshot).is_err() {
                self.busy.store(false, Ordering::Release);
            }
        }
    }

    /// Waits for a periodic snapshot in progress, then writes the one `last` takes (the state
    /// at shutdown, copied into the kept snapshot it is given) after it and flushes the
    /// journal.
    pub fn finish(mut self, last: impl FnOnce(Option<Snapshot>) -> Option<Snapshot>) {
        self.tx.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        if let Some(snapshot) = last(self.take_kept()) {
            write_snapshot(&self.journal, &snapshot, &self.retention);
            let _ = self.journal.flush();
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
            metrics::gauge!("kvrouted_snapshot_seconds").set(started.elapsed().as_secs_f64());
            if let Ok(bytes) = journal.journal_bytes() {
                metrics::gauge!("kvrouted_journal_size_bytes").set(bytes as f64);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::Input;
    use crate::journal::tests::traffic;
    use crate::replay::replay;
    use crate::router::RouterState;
    use crate::writer::{spawn_for_test, PendingAcks, RouteError};

    #[test]
    fn a_written_snapshot_is_kept_for_the_next_copy_to_be_made_in() {
        let dir = tempfile::TempDir::new().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let hour = Duration::from_secs(3600);
        let mut snapshotter =
            Snapshotter::start(journal.clone(), &WriterSettings::keeping_the_journal(hour));
        assert!(
            snapshotter.take_kept().is_none(),
            "nothing is kept before the first snapshot"
        );
        let mut router = Router::new(Default::default());
        for i in 0..50 {
            router.apply(&crate::input::Stamped {
                seq: i + 1,
                at_ms: i,
                input: crate::journal::tests::traffic(i),
            });
        }
        let mut clock = Clock::new(0);
        snapshotter.submit(take_snapshot(&router, &mut clock, None));
        let kept =
            kvrouted_testkit::poll_until(Duration::from_secs(30), || snapshotter.take_kept())
                .expect("the snapshot thread keeps the snapshot it wrote");
        assert_eq!(kept.seq, 50, "the kept copy is the snapshot written");
        assert_eq!(
            journal.latest_snapshot().unwrap().map(|s| s.seq),
            Some(50),
            "and it was written before it was kept"
        );
        // The next copy is made in it and holds the router's state.
        router.apply(&crate::input::Stamped {
            seq: 51,
            at_ms: 51,
            input: Input::Tick,
        });
        let next = take_snapshot(&router, &mut clock, Some(kept));
        assert_eq!(
            next.seq, 51,
            "the copy made in the kept one names the last input"
        );
        assert!(
            rmp_serde::to_vec(&next.state).unwrap() == rmp_serde::to_vec(router.state()).unwrap(),
            "the copy made in the kept one holds the router's state"
        );
        snapshotter.finish(|_| None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_snapshot_is_consistent_with_the_journal_sequence_it_names() {
        let dir = tempfile::TempDir::new().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let (writer, thread) = spawn_for_test(
            &journal,
            Arc::new(PendingAcks::default()),
            Duration::from_millis(1),
        );
        // Routes and ingest race with periodic snapshots; keep one taken mid-stream.
        let mut taken = None;
        for i in 0.. {
            match traffic(i) {
                // Early routes may find no worker yet: ingest is queued.
                Input::Route(request) => match writer.route(request).await {
                    Ok(_) | Err(RouteError::NoCandidate) => {}
                    Err(e) => panic!("route failed: {e}"),
                },
                input => writer.submit(input, "test", None).await.unwrap(),
            }
            if i >= 200 {
                taken = journal.latest_snapshot().unwrap().filter(|s| s.seq > 100);
            }
            assert!(i < 1_000_000, "no periodic snapshot was written");
            if taken.is_some() && i >= 400 {
                break;
            }
        }
        // Inputs after the kept snapshot, so it is one taken mid-stream even if it covered the
        // last input of the loop.
        for _ in 0..10 {
            writer.submit(Input::Tick, "test", None).await.unwrap();
        }
        // A shutdown is taken before queued ingest (it comes on the gateway's lane), so wait
        // until the ticks are applied and journaled.
        let kept_seq = taken.as_ref().expect("a snapshot taken mid-stream").seq;
        kvrouted_testkit::eventually("the inputs after the kept snapshot are journaled", || {
            let last = journal.last_seq().unwrap().unwrap_or(0);
            async move { (last > kept_seq).then_some(()) }
        })
        .await;
        writer.shutdown().await;
        thread.join().unwrap();
        let snapshot = taken.unwrap();
        assert!(
            journal.last_seq().unwrap().unwrap() > snapshot.seq,
            "the snapshot was taken while inputs kept coming"
        );

        let upto = snapshot.seq;
        let entries = journal
            .entries_after(0)
            .take_while(|e| e.as_ref().map_or(true, |(seq, _)| *seq <= upto));
        let (rebuilt, stats) = replay(None, entries, &|_| {}, |_, _, _| {}).unwrap();
        assert_eq!(
            stats.entries, upto,
            "the journal holds every entry up to the snapshot"
        );
        assert_eq!(rebuilt.last_seq(), snapshot.seq);
        // The snapshot was read back from sled, so its tables were rebuilt from their encoding;
        // compare with the replayed state after the same round trip.
        let encode = |state: &RouterState| rmp_serde::to_vec(state).unwrap();
        let round_trip = |state: &RouterState| {
            encode(&rmp_serde::from_slice::<RouterState>(&encode(state)).unwrap())
        };
        assert!(
            round_trip(rebuilt.state()) == encode(&snapshot.state),
            "the snapshot is the state after exactly the entries up to seq {upto}"
        );
    }
}
