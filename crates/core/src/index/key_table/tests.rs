//! The table's tests: probes, walks, growth and shrinking, removal, and its snapshot form.

use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

#[test]
fn a_pass_asks_for_every_item_once_and_ahead_of_its_use() {
    for len in 0..12 {
        let items: Vec<usize> = (0..len).collect();
        let mut asked = Vec::new();
        for i in 0..len {
            for &item in ahead(&items, i) {
                assert!(
                    item >= i && item <= i + PREFETCH_AHEAD,
                    "at {i} of {len}, item {item} is asked for at most {PREFETCH_AHEAD} ahead"
                );
                asked.push(item);
            }
        }
        assert_eq!(asked, items, "each item is asked for once, in order");
    }
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u64, u64),
    Remove(u64),
}

/// Keys from a small pool (so removals hit), including 0 and keys that share their low or
/// high bits (so probe runs collide and wrap).
fn key() -> impl Strategy<Value = u64> {
    prop_oneof![
        (0u64..64),
        (0u64..64).prop_map(|k| k << 58),
        (0u64..64).prop_map(|k| k.wrapping_mul(FIBONACCI)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (key(), any::<u64>()).prop_map(|(k, v)| Op::Insert(k, v)),
        key().prop_map(Op::Remove),
    ]
}

proptest! {
    #[test]
    fn behaves_like_a_hash_map_through_any_churn(ops in prop::collection::vec(op(), 0..600)) {
        let mut table = KeyTable::default();
        let mut model = HashMap::new();
        for op in ops {
            match op {
                Op::Insert(k, v) => prop_assert_eq!(table.insert(k, v), model.insert(k, v)),
                Op::Remove(k) => prop_assert_eq!(table.remove(k), model.remove(&k)),
            }
            prop_assert_eq!(table.len(), model.len(), "len counts live entries");
        }
        for (&k, &v) in &model {
            prop_assert_eq!(table.get(k), Some(v), "every live key stays reachable");
        }
        let mut entries: Vec<_> = table.iter().collect();
        entries.sort_unstable();
        let mut expected: Vec<_> = model.into_iter().collect();
        expected.sort_unstable();
        prop_assert_eq!(entries, expected, "iteration yields exactly the live entries");
    }
}

#[test]
fn a_walk_visits_drawn_keys_in_order_and_draws_at_most_the_look_ahead_past_its_stop() {
    let mut table = KeyTable::default();
    // Keys 1..=40 are present; the walk over 1..=100 stops at 41, the first absent one.
    for k in 1..=40u64 {
        table.insert(k, k * 10);
    }
    for stop_early in [None, Some(5), Some(39)] {
        let mut drawn = 0;
        let keys = (1..=100u64).inspect(|_| drawn += 1);
        let mut visited = Vec::new();
        table.walk(keys, |i, value| {
            visited.push((i, value));
            stop_early != Some(i)
        });
        let last = stop_early.unwrap_or(39);
        let expected: Vec<(usize, u64)> = (0..=last).map(|i| (i, (i as u64 + 1) * 10)).collect();
        assert_eq!(
            visited, expected,
            "a walk visits each key's value in order until a key is absent or the visitor stops"
        );
        let stopped_at = if stop_early.is_some() { last } else { last + 1 };
        assert!(
            drawn <= stopped_at + 1 + PREFETCH_AHEAD,
            "the walk stopped at position {stopped_at} and drew {drawn} keys: \
             at most {PREFETCH_AHEAD} past it"
        );
        assert!(
            drawn >= (stopped_at + 1 + PREFETCH_AHEAD).min(100),
            "the walk draws {PREFETCH_AHEAD} keys ahead of the one it reads, so their probes \
             overlap: it stopped at {stopped_at} having drawn only {drawn}"
        );
    }
    let none = KeyTable::default();
    none.walk([1u64, 2], |_, _| {
        panic!("an empty table has nothing to visit")
    });
}

#[test]
fn a_walk_stops_at_an_absent_key_even_where_a_held_key_shares_its_tag() {
    let mut table = KeyTable::default();
    for key in 0..48u64 {
        table.insert(key, key + 100);
    }
    // An absent key whose probe run passes a held key with the same tag: only comparing
    // the keys tells them apart.
    let tag_matches_in_run = |key: u64| {
        let mut i = table.home(key);
        loop {
            match table.tags[i] {
                FREE => return false,
                t if t == KeyTable::tag(key) => return true,
                _ => i = (i + 1) & table.mask(),
            }
        }
    };
    let absent = (1_000u64..)
        .find(|&key| tag_matches_in_run(key))
        .expect("some key's run holds its tag");
    let mut visited = Vec::new();
    table.walk([3, absent, 5], |i, value| {
        visited.push((i, value));
        true
    });
    assert_eq!(
        visited,
        [(0, 103)],
        "a walk stops at a key the table does not hold, though a held key in its run has \
         the same tag"
    );
}

#[test]
fn a_group_marks_exactly_the_tags_equal_to_the_one_asked_for() {
    let mut tags = [FREE; GROUP];
    for (j, tag) in tags.iter_mut().enumerate() {
        // Free, 0x80 and 0xff (the signed byte comparison's edges) and a repeated tag.
        *tag = [FREE, 0x80, 0xff, 0x93, 0x93][j % 5];
    }
    for tag in [FREE, 0x80, 0xff, 0x93, 0x94] {
        let expected = (0..GROUP)
            .filter(|&j| tags[j] == tag)
            .fold(0, |b, j| b | 1 << j);
        assert_eq!(
            Group(tags).matching(tag),
            expected,
            "the group's bits for tag {tag:#x}"
        );
        assert_eq!(
            matching_tags(&tags, tag),
            expected,
            "the portable bits for {tag:#x}"
        );
    }
}

#[test]
fn a_probe_run_crosses_groups_and_wraps_around_the_table_end() {
    // In a table of 64 buckets, 20 keys whose home is bucket 60 fill 60..=63 and 0..=15
    // (past a group's end, around the table's end and through a whole group), and 10
    // whose home is 20 fill 20..=29, behind free buckets in their own group.
    let home_in_64 = |key: u64| (hash(key) >> 58) as usize;
    let with_home = |home: usize| (1u64..).filter(move |&key| home_in_64(key) == home);
    let run: Vec<u64> = with_home(60).take(21).collect();
    let (run, absent_at_60) = (&run[..20], run[20]);
    let behind_free: Vec<u64> = with_home(20).take(11).collect();
    let (behind_free, absent_at_20) = (&behind_free[..10], behind_free[10]);
    let mut table = KeyTable::default();
    for &key in run.iter().chain(behind_free) {
        table.insert(key, !key);
    }
    assert_eq!(
        table.tags.len(),
        64,
        "the scenario needs a table of 64 buckets"
    );
    for &key in run.iter().chain(behind_free) {
        assert_eq!(
            table.get(key),
            Some(!key),
            "a key past its home's group is found"
        );
    }
    for absent in [absent_at_60, absent_at_20] {
        assert_eq!(
            table.get(absent),
            None,
            "a run ends at its first free bucket"
        );
    }
    let mut visited = Vec::new();
    table.walk(run.iter().copied(), |i, value| {
        visited.push((i, value));
        true
    });
    let expected: Vec<(usize, u64)> = run.iter().map(|&k| !k).enumerate().collect();
    assert_eq!(
        visited, expected,
        "a walk finds every key of a run that wraps"
    );
    // An absent key goes to the free bucket that ends its run: after the wrapped run
    // (bucket 16), and after its home rather than before it in its group (bucket 30).
    table.insert(absent_at_60, 1);
    table.insert(absent_at_20, 2);
    assert_eq!(
        table.probe(absent_at_60),
        (16, true),
        "placed where its run ends"
    );
    assert_eq!(
        table.probe(absent_at_20),
        (30, true),
        "placed after its home"
    );
    // A removal shifts the run back over the table's end: every key stays reachable.
    assert_eq!(
        table.remove(run[3]),
        Some(!run[3]),
        "a key in a wrapped run is removed"
    );
    for &key in run.iter().filter(|&&k| k != run[3]) {
        assert_eq!(
            table.get(key),
            Some(!key),
            "reachable after a removal in its run"
        );
    }
    assert_eq!(
        table.get(absent_at_60),
        Some(1),
        "reachable after a removal in its run"
    );
}

#[test]
fn size_follows_live_entries_under_churn() {
    let mut table = KeyTable::default();
    // A sliding window of 1,000 live keys over 200,000 insertions: an LRU's steady state.
    for k in 1..=200_000u64 {
        table.insert(k, k);
        if k > 1_000 {
            assert_eq!(table.remove(k - 1_000), Some(k - 1_000));
        }
    }
    assert_eq!(table.len(), 1_000);
    assert!(
        table.tags.len() <= 2_048,
        "churn must not grow the table past what 1,000 live keys need: {} buckets",
        table.tags.len()
    );
    for k in 199_001..=200_000 {
        table.remove(k);
    }
    assert!(
        table.tags.len() <= MIN_BUCKETS,
        "an emptied table shrinks back: {} buckets",
        table.tags.len()
    );
}

/// A key whose [`hash`] is `hash`: the multiplier is odd, so it has an inverse modulo 2^64
/// (each step of Newton's iteration doubles the inverse's bits that are right, from 3 to 96).
fn key_hashing_to(hash: u64) -> u64 {
    let inverse = (0..5).fold(FIBONACCI, |x, _| {
        x.wrapping_mul(2u64.wrapping_sub(FIBONACCI.wrapping_mul(x)))
    });
    hash.wrapping_mul(inverse)
}

#[test]
fn a_table_doubled_in_place_keeps_every_key_reachable_when_runs_wrap_past_the_last_bucket() {
    // Keys homed at the last bucket at every table size, whose runs wrap to the first buckets,
    // keys homed at the first bucket among them, and spread keys.
    let keys: Vec<u64> = (0..3_000u64)
        .map(|i| match i % 3 {
            0 => key_hashing_to(u64::MAX - i),
            1 => key_hashing_to(i),
            _ => i.wrapping_mul(0x2545_F491_4F6C_DD1D),
        })
        .collect();
    let mut table = KeyTable::default();
    for (n, &key) in keys.iter().enumerate() {
        table.insert(key, n as u64);
        // At the grow point (the next insert would double it), the table doubled in place.
        if (table.len() + 1) * MAX_LOAD.1 > table.tags.len() * MAX_LOAD.0 {
            let mut doubled = table.clone();
            doubled.double_in_place();
            assert_eq!(doubled.tags.len(), 2 * table.tags.len());
            assert!(
                (keys[..=n].iter().enumerate()).all(|(m, &k)| doubled.get(k) == Some(m as u64)),
                "doubled in place to {} buckets, every key is reachable from its home",
                doubled.tags.len()
            );
            assert_eq!(
                doubled.iter().count(),
                n + 1,
                "every entry is in exactly one bucket after the doubling"
            );
        }
    }
}

proptest! {
    #[test]
    fn a_table_doubled_in_place_holds_exactly_what_it_held(
        keys in prop::collection::vec(
            prop_oneof![key(), any::<u64>(), (0u64..8).prop_map(|k| key_hashing_to(!k))],
            1..300,
        ),
    ) {
        let mut table = KeyTable::default();
        for (i, &k) in keys.iter().enumerate() {
            table.insert(k, i as u64);
        }
        let mut doubled = table.clone();
        doubled.double_in_place();
        let mut before: Vec<_> = table.iter().collect();
        before.sort_unstable();
        let mut after: Vec<_> = doubled.iter().collect();
        after.sort_unstable();
        prop_assert_eq!(after, before, "the doubled table holds the same entries");
        prop_assert!(
            table.iter().all(|(k, v)| doubled.get(k) == Some(v)),
            "every key is reachable from its home in the doubled table"
        );
    }
}

#[test]
fn a_large_table_doubles_where_its_buckets_lie_and_shrinks_with_a_helper_keeping_every_entry() {
    let mut table = KeyTable::default();
    // Past 2^17 buckets (2 MiB) the bucket array is a mapping of its own, lengthened in place
    // at each doubling; the last, to 2^20 buckets, has a helper fault its new 8 MiB in.
    let key = |k: u64| k.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    for k in 0..400_000u64 {
        table.insert(key(k), k);
    }
    assert_eq!(table.tags.len(), 1 << 20, "doubled up to 2^20 buckets");
    if cfg!(target_os = "linux") {
        assert!(
            table.buckets.is_mapping(),
            "16 MiB of buckets are a mapping"
        );
        assert!(
            crate::index::mapped_table_bytes() >= table.buckets.len() * 16,
            "the mapping's bytes are counted"
        );
    }
    assert!(
        (0..400_000u64).all(|k| table.get(key(k)) == Some(k)),
        "every entry moved through the doublings is found with its value"
    );
    // Below an eighth full it halves by copying into a new array of 8 MiB, which a helper
    // thread faults in from its end while the rehash writes it from its start.
    for k in 100_000..400_000u64 {
        assert_eq!(table.remove(key(k)), Some(k));
    }
    assert_eq!(table.tags.len(), 1 << 19, "halved to 2^19 buckets");
    assert!(
        table.buckets.pages_worth_a_helper(0).is_some(),
        "the halved table's array is one a helper faults in"
    );
    assert_eq!(table.len(), 100_000);
    assert!(
        (0..100_000u64).all(|k| table.get(key(k)) == Some(k)),
        "every entry left is found with its value after the helped halving"
    );
}

#[test]
fn serializes_as_the_hash_map_it_replaced() {
    let mut table = KeyTable::default();
    let mut map = rustc_hash::FxHashMap::default();
    for k in [0u64, 1, 7, u64::MAX] {
        table.insert(k, k ^ 5);
        map.insert(k, k ^ 5);
    }
    let from_table: rustc_hash::FxHashMap<u64, u64> =
        rmp_serde::from_slice(&rmp_serde::to_vec(&table).unwrap()).unwrap();
    assert_eq!(from_table, map, "a table reads back as a map");
    let from_map: KeyTable = rmp_serde::from_slice(&rmp_serde::to_vec(&map).unwrap()).unwrap();
    let mut entries: Vec<_> = from_map.iter().collect();
    entries.sort_unstable();
    assert_eq!(
        entries,
        vec![(0, 5), (1, 4), (7, 2), (u64::MAX, u64::MAX ^ 5)],
        "a map written before the table loads into it"
    );
}

#[test]
fn a_reserved_table_takes_its_entries_without_growing() {
    for n in [1, 6, 7, 100, 3 * 1024, 3 * 1024 + 1, 100_000] {
        let mut table = KeyTable::default();
        table.reserve(n);
        let buckets = table.tags.len();
        assert!(
            n * MAX_LOAD.1 <= buckets * MAX_LOAD.0 && buckets / 2 * MAX_LOAD.0 < n * MAX_LOAD.1
                || buckets == MIN_BUCKETS,
            "room for {n} entries is the smallest table holding them: {buckets} buckets"
        );
        let grew = resizes_in(|| {
            for k in 0..n as u64 {
                table.insert(k.wrapping_mul(0x9E37_79B9), k);
            }
        });
        assert_eq!(grew, 0, "{n} reserved entries went in without a resize");
        assert_eq!(table.len(), n);
        assert!((0..n as u64).all(|k| table.get(k.wrapping_mul(0x9E37_79B9)) == Some(k)));
    }
    let mut table = KeyTable::default();
    table.reserve(10);
    let buckets = table.tags.len();
    table.reserve(5);
    assert_eq!(
        table.tags.len(),
        buckets,
        "room already there is not made again"
    );
}

#[test]
fn a_restored_table_is_sized_once_and_a_damaged_length_costs_a_bounded_table() {
    let mut table = KeyTable::default();
    for k in 0..50_000u64 {
        table.insert(k * 3, k);
    }
    let bytes = rmp_serde::to_vec(&table).unwrap();
    let mut restored = None;
    let resized = resizes_in(|| restored = Some(rmp_serde::from_slice::<KeyTable>(&bytes)));
    let restored = restored.unwrap().unwrap();
    assert_eq!(
        resized, 1,
        "a restored table is sized for its entries once, then filled"
    );
    assert_eq!(restored.len(), 50_000);
    assert_eq!(
        restored.tags.len(),
        table.tags.len(),
        "the size inserting them gives"
    );
    assert!((0..50_000u64).all(|k| restored.get(k * 3) == Some(k)));

    // A map header claiming 2^32 - 1 entries, then one entry: an error, after reserving at
    // most MAX_PRESIZED_ENTRIES.
    let mut damaged = vec![0xdf, 0xff, 0xff, 0xff, 0xff];
    damaged.extend(rmp_serde::to_vec(&(1u64, 2u64)).unwrap()[1..].iter());
    assert!(
        rmp_serde::from_slice::<KeyTable>(&damaged).is_err(),
        "a map shorter than its length is refused"
    );
}
