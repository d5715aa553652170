//! The journal on a real sled dir: retention bounds, size accounting, export, refusals.

use super::*;
use crate::input::{KvEvent, KvEventBatch, LoadSample, Medium, RouteRequest, Stamped, StoredBlock};
use crate::replay::replay;
use crate::router::Router;

fn tick(at_ms: u64) -> JournalEntry {
    JournalEntry {
        at_ms,
        input: Input::Tick,
        outcome: None,
    }
}

fn snapshot_at(journal: &Journal, seq: u64) {
    let router = Router::new(RouterConfig::default());
    journal
        .write_snapshot(&Snapshot {
            seq,
            at_ms: seq,
            config: router.config().clone(),
            state: router.state().clone(),
        })
        .unwrap();
}

/// A journal of `n` ticks, the entry with sequence s stamped at s ms.
fn ticks(dir: &Path, n: u64) -> Journal {
    let journal = Journal::open(dir).unwrap();
    for seq in 1..=n {
        journal.append(seq, &tick(seq)).unwrap();
    }
    journal
}

/// Opens `dir` again in this process. sled lets go of its lock shortly after the previous
/// handle is dropped (its I/O threads finish first), so a reopen polls until it can.
fn reopen(dir: &Path, open: fn(&Path) -> Result<Journal>) -> Result<Journal> {
    let opened =
        kvrouted_testkit::poll_until(std::time::Duration::from_secs(10), || match open(dir) {
            Err(JournalError::Locked { .. }) => None,
            other => Some(other),
        });
    opened.unwrap_or_else(|| open(dir))
}

fn scanned_bytes(journal: &Journal) -> u64 {
    journal.settle().unwrap();
    journal
        .entries
        .iter()
        .values()
        .map(|v| v.unwrap().len() as u64)
        .sum()
}

#[test]
fn retention_never_drops_an_entry_the_oldest_kept_snapshot_does_not_cover() {
    let dir = tempfile::TempDir::new().unwrap();
    let journal = ticks(dir.path(), 100);
    assert_eq!(
        journal.prune(1_000, 0, 0).unwrap(),
        0,
        "without a snapshot nothing is covered, so nothing is dropped"
    );
    snapshot_at(&journal, 40);
    snapshot_at(&journal, 80);
    journal.prune(1_000, 0, 0).unwrap();
    assert_eq!(
        journal.first_seq().unwrap(),
        Some(41),
        "entries up to the oldest kept snapshot go, none after it"
    );
    snapshot_at(&journal, 90);
    journal.prune(1_000, 0, 0).unwrap();
    assert_eq!(
        journal.oldest_snapshot().unwrap().map(|s| s.seq),
        Some(80),
        "two snapshots are kept"
    );
    assert_eq!(journal.first_seq().unwrap(), Some(81));
    assert_eq!(journal.last_seq().unwrap(), Some(100));
}

#[test]
fn retention_by_age_drops_covered_entries_older_than_the_limit_and_stops_at_the_first_young_one() {
    let dir = tempfile::TempDir::new().unwrap();
    let journal = ticks(dir.path(), 100);
    snapshot_at(&journal, 60);
    snapshot_at(&journal, 70);
    // Now = 100 ms, max age 70 ms: entries stamped before 30 ms are too old.
    let dropped = journal.prune(100, 70, u64::MAX).unwrap();
    assert_eq!(dropped, 29);
    assert_eq!(journal.first_seq().unwrap(), Some(30));
}

#[test]
fn retention_by_size_drops_the_oldest_covered_entries_until_the_journal_fits() {
    let dir = tempfile::TempDir::new().unwrap();
    let journal = ticks(dir.path(), 100);
    snapshot_at(&journal, 90);
    let per_entry = scanned_bytes(&journal) / 100;
    journal.prune(100, u64::MAX, per_entry * 25).unwrap();
    assert_eq!(journal.first_seq().unwrap(), Some(76), "the newest 25 fit");
    assert_eq!(journal.journal_bytes().unwrap(), per_entry * 25);
}

#[test]
fn the_journal_size_is_counted_across_reopen_appends_and_drops() {
    let dir = tempfile::TempDir::new().unwrap();
    {
        let journal = ticks(dir.path(), 50);
        assert_eq!(journal.journal_bytes().unwrap(), scanned_bytes(&journal));
        journal.flush().unwrap();
    }
    let journal = reopen(dir.path(), Journal::open).unwrap();
    for seq in 51..=80 {
        journal.append(seq, &tick(seq)).unwrap();
    }
    assert_eq!(
        journal.journal_bytes().unwrap(),
        scanned_bytes(&journal),
        "entries from before the reopen are counted once, appends since are added"
    );
    snapshot_at(&journal, 60);
    journal.prune(1_000, 0, 0).unwrap();
    assert_eq!(
        journal.journal_bytes().unwrap(),
        scanned_bytes(&journal),
        "dropped entries are subtracted"
    );
}

fn worker(i: u64) -> WorkerId {
    WorkerId::new(&format!("w{i}")).unwrap()
}

/// A load sample of `worker` for input `i`: its usage cycles through tenths.
fn load_sample(worker: WorkerId, i: u64, waiting: u32) -> Input {
    Input::Load(LoadSample {
        worker,
        kv_usage: (i % 10) as f64 / 10.0,
        running: 1,
        waiting,
        max_running: Some(8),
        model: None,
        dp_rank: 0,
    })
}

/// Inputs of a small fleet: stores, loads, routes over the stored prefixes.
pub(crate) fn traffic(i: u64) -> Input {
    let w = i % 3;
    match i % 4 {
        0 | 1 => Input::KvEvents(KvEventBatch {
            seq: Some(i + 1),
            ..KvEventBatch::stored(
                worker(w),
                None,
                (0..4)
                    .map(|b| StoredBlock {
                        engine_hash: i * 100 + b,
                        local: (i % 7) * 10 + b,
                    })
                    .collect(),
                16,
            )
        }),
        2 => load_sample(worker(w), i, 0),
        _ => Input::Route(RouteRequest {
            model: None,
            lora: None,
            keys: crate::hashing::chain_locals((0..4).map(|b| (i % 7) * 10 + b)),
            prompt_tokens: 64,
            max_output_tokens: None,
            exclude: Vec::new(),
            request_id: Some(format!("r{i}")),
            explain: false,
        }),
    }
}

/// Runs `n` inputs through a router and the journal, with a snapshot every 100.
fn recorded_run(journal: &Journal, n: u64) -> Router {
    let mut router = Router::new(RouterConfig::default());
    for i in 0..n {
        let stamped = Stamped {
            seq: i + 1,
            at_ms: 1_000 + i * 10,
            input: traffic(i),
        };
        let output = router.apply(&stamped);
        journal
            .append(
                stamped.seq,
                &JournalEntry {
                    at_ms: stamped.at_ms,
                    input: stamped.input,
                    outcome: RouteOutcome::of(&output),
                },
            )
            .unwrap();
        if stamped.seq.is_multiple_of(100) {
            journal
                .write_snapshot(&Snapshot::of(&router, stamped.at_ms))
                .unwrap();
        }
    }
    router
}

#[test]
fn an_export_of_a_pruned_journal_carries_its_oldest_snapshot_and_replays_every_decision_after_it() {
    let dir = tempfile::TempDir::new().unwrap();
    let data = dir.path().join("data");
    let journal = Journal::open(&data).unwrap();
    let live = recorded_run(&journal, 450);
    // Snapshots at 300 and 400 are kept; everything up to 300 may go.
    journal.prune(u64::MAX / 2, 0, 0).unwrap();
    assert_eq!(journal.first_seq().unwrap(), Some(301));
    let (start, after) = replay_start(&journal).unwrap();
    assert_eq!(
        (start.as_ref().map(|s| s.seq), after),
        (Some(300), 300),
        "an audit of a pruned journal starts from its oldest snapshot"
    );

    let file = dir.path().join("journal.kvj");
    assert_eq!(write_export(&journal, &file).unwrap(), 150);
    let (snapshot, reader) = read_export(&file).unwrap();
    assert_eq!(snapshot.as_ref().map(|s| s.seq), Some(300));
    let (replayed, stats) = replay(snapshot, reader, &|_| {}, |_, _, _| {}).unwrap();
    assert_eq!(stats.entries, 150);
    assert!(stats.decisions > 30, "the tail holds routes: {stats:?}");
    assert_eq!(
        stats.changed, 0,
        "every decision after the snapshot is re-derived"
    );
    assert_eq!(replayed.ownerships(), live.ownerships());
    assert_eq!(replayed.last_seq(), 450);
}

#[test]
fn a_complete_journal_exports_without_a_snapshot_and_replays_from_nothing() {
    let dir = tempfile::TempDir::new().unwrap();
    let journal = Journal::open(&dir.path().join("data")).unwrap();
    let live = recorded_run(&journal, 250);
    let file = dir.path().join("journal.kvj");
    assert_eq!(write_export(&journal, &file).unwrap(), 250);
    let (snapshot, reader) = read_export(&file).unwrap();
    assert!(snapshot.is_none());
    let (replayed, stats) = replay(None, reader, &|_| {}, |_, _, _| {}).unwrap();
    assert_eq!((stats.entries, stats.changed), (250, 0));
    assert_eq!(replayed.ownerships(), live.ownerships());
}

#[test]
fn a_file_that_is_not_an_export_or_is_cut_short_is_an_error() {
    let dir = tempfile::TempDir::new().unwrap();
    let other = dir.path().join("other");
    std::fs::write(&other, b"{\"hello\": 1}\n").unwrap();
    assert!(read_export(&other)
        .err()
        .unwrap()
        .to_string()
        .contains("is not a kvrouted journal export"));

    let journal = Journal::open(&dir.path().join("data")).unwrap();
    recorded_run(&journal, 20);
    let file = dir.path().join("journal.kvj");
    write_export(&journal, &file).unwrap();
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 5]).unwrap();
    let (_, reader) = read_export(&file).unwrap();
    let results: Vec<_> = reader.collect();
    assert!(
        matches!(results.last(), Some(Err(JournalError::Corrupt { .. }))),
        "a truncated last record is reported, not silently dropped"
    );
}

#[test]
fn reading_a_missing_dir_or_one_without_a_journal_is_refused_and_creates_nothing() {
    let dir = tempfile::TempDir::new().unwrap();
    let missing = dir.path().join("typo");
    let err = Journal::open_existing(&missing).err().unwrap();
    assert!(matches!(err, JournalError::NotADataDir { .. }), "{err}");
    assert!(!missing.exists(), "nothing is created where nothing was");

    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let err = Journal::open_existing(&empty).err().unwrap();
    assert!(matches!(err, JournalError::NotADataDir { .. }), "{err}");
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);

    let data = dir.path().join("data");
    drop(ticks(&data, 3));
    let journal = reopen(&data, Journal::open_existing).unwrap();
    assert_eq!(journal.last_seq().unwrap(), Some(3));
}

#[test]
fn a_dir_written_by_a_newer_schema_is_refused() {
    let dir = tempfile::TempDir::new().unwrap();
    write_schema_version(dir.path(), SCHEMA_VERSION + 1).unwrap();
    let err = reopen(dir.path(), Journal::open).err().unwrap();
    assert!(
        matches!(err, JournalError::FutureSchema { found, .. } if found == SCHEMA_VERSION + 1),
        "{err}"
    );
}

#[test]
fn a_dir_written_by_the_schema_before_per_rank_ownership_is_refused_with_the_way_out() {
    let dir = tempfile::TempDir::new().unwrap();
    write_schema_version(dir.path(), 1).unwrap();
    let err = reopen(dir.path(), Journal::open).err().unwrap();
    assert!(
        matches!(err, JournalError::PastSchema { found: 1, .. }),
        "a version-1 dir is refused, never opened with an unreadable snapshot: {err}"
    );
    let message = err.to_string();
    assert!(
        !message.contains('\n') && message.contains("empty --data-dir"),
        "the error is one line that says what to do: {message}"
    );
}

/// Inputs journaled before epochs, ranks and tiers: the same fields less the new trailing ones,
/// and `Other` for any non-GPU medium.
#[test]
fn inputs_journaled_before_epochs_and_tiers_still_decode() {
    use crate::input::{KvEvent, Lifecycle, LifecycleOp, Medium};
    #[derive(serde::Serialize)]
    enum OldMedium {
        #[allow(dead_code)]
        Gpu,
        Other,
    }
    #[derive(serde::Serialize)]
    struct OldLifecycle {
        worker: String,
        op: LifecycleOp,
        model: Option<String>,
        block_size: Option<u32>,
        capacity_blocks: Option<u64>,
    }
    #[derive(serde::Serialize)]
    enum OldEvent {
        Removed {
            engine_hashes: Vec<u64>,
            medium: OldMedium,
        },
    }
    let old = rmp_serde::to_vec(&OldLifecycle {
        worker: "w".into(),
        op: LifecycleOp::Join,
        model: None,
        block_size: Some(16),
        capacity_blocks: None,
    })
    .unwrap();
    let new: Lifecycle = rmp_serde::from_slice(&old).expect("an old lifecycle decodes");
    assert_eq!((new.dp_size, new.epoch), (None, None));
    let old = rmp_serde::to_vec(&OldEvent::Removed {
        engine_hashes: vec![1],
        medium: OldMedium::Other,
    })
    .unwrap();
    let new: KvEvent = rmp_serde::from_slice(&old).expect("an old event decodes");
    assert_eq!(
        new,
        KvEvent::Removed {
            engine_hashes: vec![1],
            medium: Medium::Disk
        },
        "Other decodes as the disk tier"
    );
}

#[test]
fn the_reservation_secret_and_incarnation_are_made_once_per_data_dir_and_kept_across_restarts() {
    let dir = tempfile::TempDir::new().unwrap();
    let first = Journal::open(dir.path()).unwrap();
    let secret = first.reservation_secret().unwrap();
    let incarnation = first.incarnation().unwrap();
    assert_eq!(
        first.reservation_secret().unwrap(),
        secret,
        "asking again gives the same secret"
    );
    drop(first);
    let again = reopen(dir.path(), Journal::open).unwrap();
    assert_eq!(
        again.reservation_secret().unwrap(),
        secret,
        "a restart keeps the secret, so reservation ids stay unique and unguessable"
    );
    assert_eq!(
        again.incarnation().unwrap(),
        incarnation,
        "a restart is the same incarnation of the data dir"
    );
    let other = tempfile::TempDir::new().unwrap();
    let other = Journal::open(other.path()).unwrap();
    assert_ne!(
        other.reservation_secret().unwrap(),
        secret,
        "another data dir (another replica) has its own secret"
    );
    assert_ne!(
        other.incarnation().unwrap(),
        incarnation,
        "a data dir made afresh is another incarnation"
    );
}

#[test]
fn an_unclean_stop_renews_the_incarnation_and_a_clean_one_keeps_it() {
    let dir = tempfile::TempDir::new().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    assert!(
        journal.begin_run().unwrap(),
        "a new data dir has no unclean stop behind it"
    );
    let first = journal.incarnation().unwrap();
    journal.end_run().unwrap();
    assert!(
        journal.begin_run().unwrap(),
        "after end_run the stop was clean"
    );
    assert_eq!(
        journal.incarnation().unwrap(),
        first,
        "a clean restart keeps the incarnation"
    );
    // No end_run: the process died.
    assert!(
        !journal.begin_run().unwrap(),
        "a run that never ended is an unclean stop"
    );
    assert_ne!(
        journal.incarnation().unwrap(),
        first,
        "after an unclean stop decisions go out under a new incarnation"
    );
}

/// A route of `blocks` keys of its own (keys differ from `seq` to `seq`).
pub(crate) fn long_request(seq: u64, blocks: u64) -> RouteRequest {
    RouteRequest {
        model: None,
        lora: None,
        keys: crate::hashing::chain_locals((0..blocks).map(|b| seq * 1_000 + b)),
        prompt_tokens: blocks * 16,
        max_output_tokens: None,
        exclude: Vec::new(),
        request_id: None,
        explain: false,
    }
}

/// A route entry of `blocks` keys, stamped at `seq` ms.
fn long_route(seq: u64, blocks: u64) -> JournalEntry {
    JournalEntry {
        at_ms: seq,
        input: Input::Route(long_request(seq, blocks)),
        outcome: None,
    }
}

/// Appends 256-key route entries (2.3 KB each) under the sequence numbers `seqs`.
fn append_long_routes(journal: &Journal, seqs: std::ops::RangeInclusive<u64>) {
    for seq in seqs {
        journal.append(seq, &long_route(seq, 256)).unwrap();
    }
}

#[test]
fn entries_are_stored_in_runs_and_read_back_one_by_one_from_any_sequence_number() {
    let dir = tempfile::TempDir::new().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    let written: Vec<JournalEntry> = (1..=120).map(|seq| long_route(seq, 256)).collect();
    for (seq, entry) in (1..).zip(&written) {
        journal.append(seq, entry).unwrap();
    }
    journal.settle().unwrap();
    let runs = journal.entries.len();
    assert!(
        (2..=10).contains(&runs),
        "120 entries of 2.3 KB go to sled in a few runs of about {RUN_BYTES} bytes, not one \
         insert each: {runs} keys"
    );
    for after in [0, 1, 27, 28, 29, 64, 119, 120] {
        let read: Vec<(u64, JournalEntry)> =
            journal.entries_after(after).collect::<Result<_>>().unwrap();
        let expected: Vec<(u64, JournalEntry)> = (after + 1..=120)
            .map(|seq| (seq, written[seq as usize - 1].clone()))
            .collect();
        assert!(
            read == expected,
            "entries after {after} are each entry after it once, in order, with its own \
             sequence number (read {} entries)",
            read.len()
        );
    }
    assert_eq!(journal.last_seq().unwrap(), Some(120));
    drop(journal);
    let journal = reopen(dir.path(), Journal::open).unwrap();
    assert_eq!(
        journal.entries_after(0).count(),
        120,
        "the run still pending when the last handle went was stored"
    );
    assert_eq!(journal.last_seq().unwrap(), Some(120));
}

#[test]
fn an_entry_that_does_not_follow_the_last_starts_a_run_of_its_own() {
    let dir = tempfile::TempDir::new().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    for seq in [1, 2, 3, 10, 11] {
        journal.append(seq, &tick(seq)).unwrap();
    }
    let seqs: Vec<u64> = journal.entries_after(0).map(|e| e.unwrap().0).collect();
    assert_eq!(
        seqs,
        vec![1, 2, 3, 10, 11],
        "no entry takes a number it was not given"
    );
    let after: Vec<u64> = journal.entries_after(5).map(|e| e.unwrap().0).collect();
    assert_eq!(after, vec![10, 11]);
}

#[test]
fn a_dir_of_single_entries_from_schema_2_is_read_and_stamped_as_runs() {
    let dir = tempfile::TempDir::new().unwrap();
    write_schema_version(dir.path(), 2).unwrap();
    {
        // What a version-2 build wrote: one entry under each sequence number.
        let db = sled::Config::new().path(dir.path()).open().unwrap();
        let entries = db.open_tree("journal").unwrap();
        for seq in 1..=3u64 {
            entries
                .insert(seq.to_be_bytes(), encode(&long_route(seq, 8)))
                .unwrap();
        }
        db.flush().unwrap();
    }
    let journal = reopen(dir.path(), Journal::open).unwrap();
    assert_eq!(journal.last_seq().unwrap(), Some(3));
    journal.append(4, &long_route(4, 8)).unwrap();
    let read: Vec<(u64, JournalEntry)> = journal.entries_after(0).collect::<Result<_>>().unwrap();
    let expected: Vec<(u64, JournalEntry)> = (1..=4).map(|s| (s, long_route(s, 8))).collect();
    assert!(read == expected, "version-2 entries read as runs of one");
    let stamped = journal
        .db
        .open_tree("meta")
        .unwrap()
        .get("schema_version")
        .unwrap();
    assert_eq!(
        stamped.as_deref(),
        Some(&SCHEMA_VERSION.to_be_bytes()[..]),
        "once this build writes runs, a version-2 build must refuse the dir"
    );
}

/// A new journal (in its own temporary dir) with entries 1 to 60 appended, 2.3 KB each: at
/// least one sealed run, none stored yet. Returns the dir, the journal and the runs sealed.
fn journal_with_sealed_runs() -> (tempfile::TempDir, Journal, usize) {
    let dir = tempfile::TempDir::new().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    append_long_routes(&journal, 1..=60);
    let sealed = journal.pending.sealed_count();
    assert!(
        sealed >= 1,
        "60 entries of 2.3 KB fill at least one run of {RUN_BYTES} bytes"
    );
    (dir, journal, sealed)
}

#[test]
fn a_full_run_is_sealed_by_the_append_and_stored_by_store_sealed_or_any_read_or_flush() {
    let (_dir, journal, sealed) = journal_with_sealed_runs();
    assert_eq!(
        journal.entries.len(),
        0,
        "an append inserts nothing into sled: its caller may hold the state's lock"
    );
    journal.store_sealed().unwrap();
    assert_eq!(
        (journal.entries.len(), journal.pending.sealed_count()),
        (sealed, 0),
        "store_sealed inserts every sealed run and leaves the open run in memory"
    );
    append_long_routes(&journal, 61..=120);
    assert!(journal.pending.sealed_count() >= 1);
    journal.flush().unwrap();
    assert_eq!(
        journal.pending.sealed_count(),
        0,
        "a flush stores the sealed runs before it makes sled durable"
    );
    let seqs: Vec<u64> = journal.entries_after(0).map(|e| e.unwrap().0).collect();
    assert_eq!(
        seqs,
        (1..=120).collect::<Vec<_>>(),
        "every entry is read back once, in order, whichever call stored its run"
    );
}

#[test]
fn a_store_that_finds_another_under_way_leaves_the_runs_to_it_and_a_flush_stores_them() {
    let (_dir, journal, sealed) = journal_with_sealed_runs();
    std::thread::scope(|s| {
        let busy = journal.hold_stores();
        let (done, stored) = std::sync::mpsc::channel();
        let journal = &journal;
        s.spawn(move || done.send(journal.store_sealed_unless_busy().is_ok()));
        assert_eq!(
            stored.recv_timeout(kvrouted_testkit::poll::DEADLINE),
            Ok(true),
            "a store that finds another under way returns at once, without an error"
        );
        assert_eq!(
            (journal.pending.sealed_count(), journal.entries.len()),
            (sealed, 0),
            "and leaves the sealed runs to the store under way"
        );
        drop(busy);
    });
    journal.store_sealed_unless_busy().unwrap();
    assert_eq!(
        (journal.pending.sealed_count(), journal.entries.len()),
        (0, sealed),
        "with no other store under way it stores every sealed run"
    );
    append_long_routes(&journal, 61..=120);
    let busy = journal.hold_stores();
    journal.store_sealed_unless_busy().unwrap();
    assert!(journal.pending.sealed_count() >= 1);
    drop(busy);
    journal.flush().unwrap();
    assert_eq!(
        journal.entries_after(0).count(),
        120,
        "a flush stores what a store left to another, so every entry is read back"
    );
}

#[test]
fn appends_that_nobody_stores_keep_at_most_a_few_sealed_runs_in_memory() {
    let dir = tempfile::TempDir::new().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    for seq in 1..=600 {
        journal.append(seq, &long_route(seq, 256)).unwrap();
        assert!(
            journal.pending.sealed_count() <= MAX_SEALED,
            "past {MAX_SEALED} sealed runs an append stores them itself (after entry {seq})"
        );
    }
    assert!(
        journal.entries.len() > MAX_SEALED,
        "600 entries of 2.3 KB went to sled in runs without a flush"
    );
    assert_eq!(journal.entries_after(0).count(), 600);
}

/// Mixed traffic that fills every part of the state a snapshot copies: device, host and disk
/// ownership in two models' namespaces, blocks with more than two owners, removals, approximate
/// records, reservations and load.
fn varied_traffic(i: u64) -> Input {
    let w = worker(i % 5);
    // Prefixes come back (blocks gain owners) while new ones keep coming, so a router after
    // more inputs holds more blocks, in larger tables.
    let prefix = i * 7_919 % (i / 4 + 11);
    // Each worker's own engine hash for block `b` of the prefix.
    let engine = |b: u64| ((i % 5) << 32) | (prefix * 10 + b);
    let blocks = |medium| KvEvent::Stored {
        parent: None,
        blocks: (0..6)
            .map(|b| StoredBlock {
                engine_hash: engine(b),
                local: prefix * 10 + b,
            })
            .collect(),
        block_size: 16,
        lora: None,
        medium,
        full_attention: true,
    };
    match i % 6 {
        0 | 1 => Input::KvEvents(KvEventBatch {
            model: (i % 4 == 1).then(|| "m2".to_owned()),
            ..KvEventBatch::of(w, vec![blocks(Medium::Gpu)])
        }),
        2 => Input::KvEvents(KvEventBatch::of(
            w,
            vec![blocks([Medium::Host, Medium::Disk][(i / 6 % 2) as usize])],
        )),
        3 => Input::KvEvents(KvEventBatch::of(
            w,
            vec![KvEvent::Removed {
                engine_hashes: (3..6).map(engine).collect(),
                medium: Medium::Gpu,
            }],
        )),
        4 => load_sample(w, i, (i % 3) as u32),
        _ => Input::Route(RouteRequest {
            model: None,
            lora: None,
            keys: crate::hashing::chain_locals((0..8).map(|b| prefix * 10 + b)),
            prompt_tokens: 128,
            max_output_tokens: None,
            exclude: Vec::new(),
            request_id: None,
            explain: false,
        }),
    }
}

/// A router after `n` inputs of [`varied_traffic`].
fn varied_router(n: u64) -> Router {
    let mut router = Router::new(RouterConfig::default());
    for i in 0..n {
        router.apply(&Stamped {
            seq: i + 1,
            at_ms: 1_000 + i,
            input: varied_traffic(i),
        });
    }
    router
}

#[test]
fn a_snapshot_retaken_into_a_kept_copy_holds_the_routers_state() {
    let encode = |seq: u64, at_ms: u64, config: &RouterConfig, state: &RouterState| {
        (
            seq,
            at_ms,
            rmp_serde::to_vec(config).unwrap(),
            rmp_serde::to_vec(state).unwrap(),
        )
    };
    let router = varied_router(3_000);
    let original = encode(router.last_seq(), 9, router.config(), router.state());
    let empty = rmp_serde::to_vec(Router::new(RouterConfig::default()).state()).unwrap();
    assert!(
        original.3.len() > 10 * empty.len(),
        "the traffic fills the state"
    );
    // Copies of an empty router and of a smaller, an equal and a larger state than the one
    // retaken: tables that must grow, that keep their size, and that must shrink.
    for kept_of in [0, 300, 2_990, 3_000, 30_000] {
        let mut kept = Snapshot::of(&varied_router(kept_of), 7);
        kept.retake(&router, 9);
        assert!(
            encode(kept.seq, kept.at_ms, &kept.config, &kept.state) == original,
            "a snapshot retaken into the copy of a router after {kept_of} inputs holds exactly \
             the router's state"
        );
    }
    // A router restored from the retaken copy itself (no encoding between) decides as the
    // original does: its tables find their keys.
    let mut kept = Snapshot::of(&varied_router(30_000), 7);
    kept.retake(&router, 9);
    let (mut restored, mut original_router) = (Router::from_state(kept.config, kept.state), router);
    for i in 3_000..3_600 {
        let input = Stamped {
            seq: i + 1,
            at_ms: 1_000 + i,
            input: varied_traffic(i),
        };
        assert_eq!(
            restored.apply(&input),
            original_router.apply(&input),
            "a router restored from a retaken copy answers input {i} as the original does"
        );
    }
    let router = original_router;
    let original = encode(router.last_seq(), 9, router.config(), router.state());
    let fresh = Snapshot::of(&router, 9);
    assert!(
        encode(fresh.seq, fresh.at_ms, &fresh.config, &fresh.state) == original,
        "a fresh copy holds exactly the router's state"
    );
}
