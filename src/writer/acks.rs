//! Acknowledging broker messages, with the rule that makes JetStream delivery lossless: **a
//! message is acked only after the journal entry holding it has been flushed.** A crash before
//! the flush means redelivery (and the per-worker sequence skips what was applied twice); a
//! crash after it loses nothing.
//!
//! The writer records each message's ack with the journal sequence of its entry; the flusher
//! ([`run_flusher`]) makes the journal durable up to what was appended when the flush began,
//! then acks exactly the messages at or below that sequence. The broker sits behind
//! [`Acknowledge`] and the journal behind [`Durable`], so these rules are tested without either.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::journal::Journal;
use crate::status::JournalFault;

/// A future returned by [`Acknowledge::ack`].
pub type AckFuture<'a> = Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'a>>;

/// Whatever acknowledges one broker message (JetStream's acker in the daemon).
pub trait Acknowledge: Send + Sync + 'static {
    fn ack(&self) -> AckFuture<'_>;
}

/// The journal, as the flusher needs it: make every entry appended so far durable.
pub trait Durable: Send + Sync {
    fn flush(&self) -> impl Future<Output = Result<(), String>> + Send;
}

impl Durable for Journal {
    async fn flush(&self) -> Result<(), String> {
        self.flush_async().await.map_err(|e| e.to_string())
    }
}

/// A broker message to acknowledge once the journal entries up to it are durable.
pub struct Ack {
    pub acker: Box<dyn Acknowledge>,
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
    /// Where the writer and the flusher record a failed journal write.
    fault: Arc<JournalFault>,
}

impl PendingAcks {
    /// Pending acks whose journal failures are recorded in `fault` (the daemon's readiness).
    pub fn new(fault: Arc<JournalFault>) -> Self {
        PendingAcks {
            fault,
            ..PendingAcks::default()
        }
    }

    /// The journal's fault, shared by the writer and the flusher.
    pub fn fault(&self) -> &JournalFault {
        &self.fault
    }

    /// Records that the journal holds entries up to `seq` (not durable yet).
    pub fn appended(&self, seq: u64) {
        self.appended.store(seq, Ordering::Release);
    }

    /// Last sequence appended to the journal.
    pub fn last_appended(&self) -> u64 {
        self.appended.load(Ordering::Acquire)
    }

    /// Queues the ack of a message whose entry is journaled as `seq` (`journaled` false: the
    /// append failed, and the message must be delivered again). After a failed append no
    /// cumulative ack is queued again by this process, since it would cover the lost message;
    /// JetStream redelivers them all after `ack_wait`, or a restart rewinds to the ack floor.
    ///
    /// A flush acks only messages whose sequence it covers, so an ack queued while a flush is
    /// under way waits for the next one: queued late, never acked early.
    pub fn queue(&self, seq: u64, ack: Ack, journaled: bool) {
        // After a journal fault nothing more is acked: the restart rewinds to the ack floor.
        if !journaled || self.fault.failed() {
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

    /// Queues the ack of a message with nothing to journal (rejected) behind every entry
    /// appended so far: a cumulative ack must not cover earlier messages before their entries
    /// are durable.
    pub fn queue_after_appended(&self, ack: Ack) {
        self.queue(self.last_appended(), ack, true);
    }

    fn awaiting_ack(&self) -> bool {
        !self.acks.lock().unwrap().is_empty()
    }
}

/// Group commit: while messages wait for their ack, flushes the journal every `interval` and then
/// acks the messages it covers; otherwise flushes every `soft_interval`.
pub async fn run_flusher(
    journal: impl Durable,
    pending: Arc<PendingAcks>,
    interval: Duration,
    soft_interval: Duration,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_flush = Instant::now();
    loop {
        ticker.tick().await;
        if pending.fault.failed() {
            // Nothing is appended or acked any more; retrying a failing disk every tick would
            // only add to its load. The stop's last flush still tries once.
            return;
        }
        // A flush costs every route some latency, so without a message waiting for its ack the
        // journal is flushed only every `soft_interval`.
        if pending.awaiting_ack() || last_flush.elapsed() >= soft_interval {
            flush_and_ack(&journal, &pending).await;
            last_flush = Instant::now();
        }
    }
}

/// Makes every journal entry appended so far durable, then acks the messages they hold. Nothing
/// is acked if the flush fails: those messages stay unacked and are redelivered.
pub async fn flush_and_ack(journal: &impl Durable, pending: &PendingAcks) {
    let upto = pending.last_appended();
    // Acks of rejected messages can wait on entries that an earlier flush already covered.
    if upto > pending.flushed.load(Ordering::Acquire) {
        if let Err(e) = journal.flush().await {
            // Messages stay unacked and are redelivered; entries may be lost, so the live state
            // is no longer the journal's.
            pending.fault.record("flush", &e);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What happened, in order: flushes (up to the sequence appended when they began) and acks
    /// (of the message journaled at a sequence).
    #[derive(Debug, Clone, PartialEq)]
    enum Event {
        Flushed(u64),
        Acked(u64),
    }

    type Log = Arc<Mutex<Vec<Event>>>;

    struct FakeAcker {
        seq: u64,
        log: Log,
    }

    impl Acknowledge for FakeAcker {
        fn ack(&self) -> AckFuture<'_> {
            Box::pin(async move {
                self.log.lock().unwrap().push(Event::Acked(self.seq));
                Ok(())
            })
        }
    }

    /// A journal whose flush covers what `pending` says was appended when the flush began, and
    /// that can be held in the middle of a flush or made to fail.
    struct FakeJournal {
        log: Log,
        pending: Arc<PendingAcks>,
        hold: tokio::sync::Mutex<()>,
        started: tokio::sync::Notify,
        fail: AtomicBool,
    }

    impl Durable for FakeJournal {
        async fn flush(&self) -> Result<(), String> {
            let upto = self.pending.last_appended();
            self.started.notify_one();
            let _held = self.hold.lock().await;
            if self.fail.load(Ordering::Acquire) {
                return Err("disk full".into());
            }
            self.log.lock().unwrap().push(Event::Flushed(upto));
            Ok(())
        }
    }

    fn setup() -> (Log, Arc<PendingAcks>, Arc<FakeJournal>) {
        let log = Log::default();
        let pending = Arc::new(PendingAcks::default());
        let journal = Arc::new(FakeJournal {
            log: log.clone(),
            pending: pending.clone(),
            hold: Default::default(),
            started: Default::default(),
            fail: AtomicBool::new(false),
        });
        (log, pending, journal)
    }

    fn ack(log: &Log, seq: u64, cumulative: bool) -> Ack {
        Ack {
            acker: Box::new(FakeAcker {
                seq,
                log: log.clone(),
            }),
            cumulative,
        }
    }

    /// What the writer does for one journaled message.
    fn journal_message(pending: &PendingAcks, log: &Log, seq: u64, cumulative: bool) {
        pending.queue(seq, ack(log, seq, cumulative), true);
        pending.appended(seq);
    }

    /// Every ack in `log` comes after a flush that covers its sequence.
    fn assert_acks_follow_their_flush(log: &[Event]) {
        let mut durable = 0;
        for event in log {
            match *event {
                Event::Flushed(upto) => durable = durable.max(upto),
                Event::Acked(seq) => assert!(
                    seq <= durable,
                    "message {seq} acked before its journal entry was flushed: {log:?}"
                ),
            }
        }
    }

    #[tokio::test]
    async fn an_ack_never_precedes_the_flush_of_its_entry() {
        let (log, pending, journal) = setup();
        for seq in 1..=2 {
            journal_message(&pending, &log, seq, false);
        }
        // A flush begins, covering 1..=2, and is held mid-way while message 3 is journaled.
        let held = journal.hold.lock().await;
        let flush = tokio::spawn({
            let (journal, pending) = (journal.clone(), pending.clone());
            async move { flush_and_ack(&*journal, &pending).await }
        });
        journal.started.notified().await;
        journal_message(&pending, &log, 3, false);
        drop(held);
        flush.await.unwrap();
        assert_eq!(
            *log.lock().unwrap(),
            [Event::Flushed(2), Event::Acked(1), Event::Acked(2)],
            "the flush acks only what it made durable; message 3 waits for the next flush"
        );
        flush_and_ack(&*journal, &pending).await;
        let log = log.lock().unwrap().clone();
        assert_eq!(log[3..], [Event::Flushed(3), Event::Acked(3)]);
        assert_acks_follow_their_flush(&log);
    }

    #[tokio::test]
    async fn a_failed_flush_acks_nothing() {
        let (log, pending, journal) = setup();
        journal_message(&pending, &log, 1, false);
        journal.fail.store(true, Ordering::Release);
        flush_and_ack(&*journal, &pending).await;
        assert!(
            log.lock().unwrap().is_empty(),
            "no ack without a successful flush: {:?}",
            log.lock().unwrap()
        );
        journal.fail.store(false, Ordering::Release);
        flush_and_ack(&*journal, &pending).await;
        assert_eq!(*log.lock().unwrap(), [Event::Flushed(1), Event::Acked(1)]);
    }

    #[tokio::test]
    async fn after_a_failed_flush_no_later_message_is_acked_and_the_fault_is_reported() {
        let (log, pending, journal) = setup();
        journal_message(&pending, &log, 1, true);
        journal.fail.store(true, Ordering::Release);
        flush_and_ack(&*journal, &pending).await;
        assert!(
            pending
                .fault()
                .reason()
                .is_some_and(|r| r.contains("disk full")),
            "a failed flush is a journal fault, with its reason"
        );
        // The disk recovers: what was appended before the fault is acked once durable, nothing
        // queued after it (the state is no longer the journal's; the restart redelivers it).
        journal.fail.store(false, Ordering::Release);
        pending.queue_after_appended(ack(&log, 2, true));
        flush_and_ack(&*journal, &pending).await;
        assert_eq!(
            *log.lock().unwrap(),
            [Event::Flushed(1), Event::Acked(1)],
            "only the message journaled before the fault is acked"
        );
    }

    #[tokio::test]
    async fn of_cumulative_acks_only_the_last_of_a_flush_is_sent() {
        let (log, pending, journal) = setup();
        for seq in 1..=3 {
            journal_message(&pending, &log, seq, true);
        }
        flush_and_ack(&*journal, &pending).await;
        assert_eq!(
            *log.lock().unwrap(),
            [Event::Flushed(3), Event::Acked(3)],
            "one cumulative ack covers the flushed group"
        );
    }

    #[tokio::test]
    async fn a_rejected_message_is_acked_behind_the_entries_before_it() {
        let (log, pending, journal) = setup();
        journal_message(&pending, &log, 1, true);
        // A rejected message: nothing to journal, queued behind entry 1.
        pending.queue_after_appended(ack(&log, 1, true));
        flush_and_ack(&*journal, &pending).await;
        let log = log.lock().unwrap().clone();
        assert_eq!(log.first(), Some(&Event::Flushed(1)));
        assert_acks_follow_their_flush(&log);
    }

    #[tokio::test]
    async fn after_a_failed_append_no_cumulative_ack_is_sent() {
        let (log, pending, journal) = setup();
        journal_message(&pending, &log, 1, true);
        // Message 2's append failed: a cumulative ack of anything later would cover it.
        pending.queue(2, ack(&log, 2, true), false);
        journal_message(&pending, &log, 3, true);
        flush_and_ack(&*journal, &pending).await;
        let acked: Vec<_> = log
            .lock()
            .unwrap()
            .iter()
            .filter(|e| matches!(e, Event::Acked(_)))
            .cloned()
            .collect();
        assert_eq!(
            acked,
            [Event::Acked(1)],
            "a cumulative ack past a lost entry would lose it"
        );
    }
}
