//! Block key → owner slots, packed: the index's dominant memory cost.
//!
//! Most blocks have one or two owners. Those are stored inline as two `u32` slots in one `u64`
//! table value (16 bytes per block with the key); a block with more owner entries keeps them in
//! an overflow slab, and its inline value names the slab entry, so reading a popular block's
//! owners costs one table probe and one indexed load, not a second hash lookup.

use std::fmt;
use std::ops::Range;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, SerializeStruct};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use smallvec::{smallvec, SmallVec};

use super::key_table::KeyTable;
use super::slab::Slab;
use super::Slot;

/// Marks an unused inline position.
const EMPTY: Slot = Slot::MAX;
/// In the first inline position: the block's owners live in the overflow slab, at the index in
/// the second position.
const OVERFLOW: Slot = Slot::MAX - 1;

/// Largest usable slot number (the two above are markers).
pub const MAX_SLOT: Slot = Slot::MAX - 2;

fn pack(a: Slot, b: Slot) -> u64 {
    a as u64 | ((b as u64) << 32)
}

fn unpack(v: u64) -> (Slot, Slot) {
    (v as Slot, (v >> 32) as Slot)
}

/// Owner entries of one block with more than two; up to the default ceiling of four without a
/// heap allocation.
type Overflow = SmallVec<[Slot; 4]>;

/// A multiset of owner slots per block key: a slot may appear more than once (one entry per
/// engine hash of that worker mapping to the block).
#[derive(Default)]
pub struct OwnerMap {
    inline: KeyTable,
    /// Owner lists of blocks with more than two entries.
    overflow: Slab<Overflow>,
}

clone_in_place!(OwnerMap { inline, overflow });

impl OwnerMap {
    /// Asks the CPU to start loading `key`'s inline entry (a hint: it changes nothing).
    pub fn prefetch(&self, key: u64) {
        self.inline.prefetch(key);
    }

    /// As [`prefetch`](Self::prefetch), for a removal ([`KeyTable::prefetch_run`]).
    pub fn prefetch_run(&self, key: u64) {
        self.inline.prefetch_run(key);
    }

    /// Adds one owner entry. Always inlined: a stored block's step (`EngineMap::store`).
    #[inline(always)]
    pub fn add(&mut self, key: u64, slot: Slot) {
        debug_assert!(slot <= MAX_SLOT);
        let packed = self.inline.get_or_insert(key, pack(EMPTY, EMPTY));
        match unpack(*packed) {
            (OVERFLOW, at) => self.overflow[at as usize].push(slot),
            (EMPTY, _) => *packed = pack(slot, EMPTY),
            (a, EMPTY) => *packed = pack(a, slot),
            (a, b) => *packed = pack(OVERFLOW, self.overflow.put(smallvec![a, b, slot]) as Slot),
        }
    }

    /// Removes one owner entry. False if `slot` was not an owner of `key`.
    pub fn remove(&mut self, key: u64, slot: Slot) -> bool {
        // One probe: the last owner's removal empties the bucket it found.
        let Some(mut entry) = self.inline.occupied(key) else {
            return false;
        };
        let packed = entry.value();
        match unpack(*packed) {
            (OVERFLOW, at) => {
                let owners = &mut self.overflow[at as usize];
                let Some(i) = owners.iter().position(|&s| s == slot) else {
                    return false;
                };
                owners.swap_remove(i);
                if owners.len() == 2 {
                    *packed = pack(owners[0], owners[1]);
                    self.overflow.release(at as usize);
                }
                true
            }
            (a, EMPTY) if a == slot => {
                entry.remove();
                true
            }
            (a, b) if a == slot => {
                *packed = pack(b, EMPTY);
                true
            }
            (a, b) if b == slot => {
                *packed = pack(a, EMPTY);
                true
            }
            _ => false,
        }
    }

    /// Calls `f` with the owner entries a table value stands for.
    fn unpacked<R>(&self, packed: u64, f: impl FnOnce(&[Slot]) -> R) -> R {
        match unpack(packed) {
            (OVERFLOW, at) => f(&self.overflow[at as usize]),
            (a, EMPTY) => f(&[a]),
            (a, b) => f(&[a, b]),
        }
    }

    /// Calls `f` with the owner entries of `key`, if it has any.
    pub fn with_owners<R>(&self, key: u64, f: impl FnOnce(&[Slot]) -> R) -> Option<R> {
        Some(self.unpacked(self.inline.get(key)?, f))
    }

    /// Walks `keys` in order, handing `visit` each key's owners, until a key has no owners or
    /// `visit` returns false. A run of consecutive keys with the same owner list (the usual
    /// shape: the workers that stored a prompt's prefix each stored it whole) is handed over
    /// twice, not once per key: its first key alone (`i..i + 1`) as soon as it is read, so the
    /// caller can stop the walk there, then the rest of the run (`i + 1..end`) once a key with
    /// other owners, or the walk's end, shows where the run stops.
    ///
    /// So each call says: these owners hold every key of the range. A caller counting each
    /// owner's consecutive match from the first key extends a count that equals the range's
    /// start to its end, and leaves any other count alone ([`extend_match`]); that is the count
    /// a call per key would give. A run of `n` keys then costs two passes over its owners, not
    /// `n`: a prefix that hundreds of ranks share was a pass over all of them per key.
    ///
    /// Lists are compared as they are stored (same slots, same order), which is the cheap test;
    /// two keys whose owners are the same set in another order are handed over one by one.
    pub fn walk(
        &self,
        keys: impl IntoIterator<Item = u64>,
        mut visit: impl FnMut(Range<usize>, &[Slot]) -> bool,
    ) {
        // The run being read: its first key's position and table value, and where it ends.
        // `None` once the caller stopped the walk inside a run, so its rest is not handed over.
        let mut run: Option<(usize, u64)> = None;
        let mut end = 0;
        self.inline.walk(keys, |i, packed| {
            if let Some((first, repeated)) = run {
                if self.same_owners(repeated, packed) {
                    end = i + 1;
                    return true;
                }
                if end > first + 1
                    && !self.unpacked(repeated, |owners| visit(first + 1..end, owners))
                {
                    run = None;
                    return false;
                }
            }
            (run, end) = (Some((i, packed)), i + 1);
            self.unpacked(packed, |owners| visit(i..i + 1, owners))
        });
        if let Some((first, repeated)) = run.filter(|&(first, _)| end > first + 1) {
            self.unpacked(repeated, |owners| visit(first + 1..end, owners));
        }
    }

    /// Whether two table values stand for the same owner list, slot for slot.
    ///
    /// Always inlined: a walk asks once per key, and the whole-program build kept it a call,
    /// around which the walk saved and restored its registers. Inlined, lookups at 16 workers had
    /// a p99 of 620-630 ns against 670-681, and decisions ran 2-9% faster (docs/performance.md,
    /// thirty-fourth part).
    #[inline(always)]
    fn same_owners(&self, a: u64, b: u64) -> bool {
        match (unpack(a), unpack(b)) {
            ((OVERFLOW, x), (OVERFLOW, y)) => {
                self.overflow[x as usize] == self.overflow[y as usize]
            }
            _ => a == b,
        }
    }

    /// Distinct blocks with at least one owner.
    pub fn len(&self) -> usize {
        self.inline.len()
    }
}

/// The walk's counting rule ([`OwnerIndex::walk`]) for one owner's consecutive match from the
/// first key: a count that has reached `keys.start` (the owner held every key before the range)
/// reaches `keys.end`, and any other count stays. Returns whether the count now covers the
/// range, that is, whether the owner continues the match.
///
/// [`OwnerIndex::walk`]: super::OwnerIndex::walk
#[inline]
pub fn extend_match(count: &mut u32, keys: &Range<usize>) -> bool {
    // Compared as `u32`s: inlined in a loop over owners, the two casts are made once.
    let (start, end) = (keys.start as u32, keys.end as u32);
    if *count == start {
        *count = end;
    }
    *count == end
}

impl fmt::Debug for OwnerMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(
                self.inline
                    .iter()
                    .map(|(k, _)| (k, self.with_owners(k, <[Slot]>::to_vec))),
            )
            .finish()
    }
}

/// The snapshot form as generic maps, for the tests that check it is unchanged.
#[cfg(test)]
#[derive(Serialize, Deserialize, PartialEq, Debug)]
struct OwnerMapForm {
    inline: rustc_hash::FxHashMap<u64, u64>,
    overflow: rustc_hash::FxHashMap<u64, Overflow>,
}

impl OwnerMap {
    fn overflowed(&self) -> impl Iterator<Item = (u64, &Overflow)> + '_ {
        self.inline.iter().filter_map(|(k, v)| match unpack(v) {
            (OVERFLOW, at) => Some((k, &self.overflow[at as usize])),
            _ => None,
        })
    }
}

impl Serialize for OwnerMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        struct Inline<'a>(&'a OwnerMap);
        impl Serialize for Inline<'_> {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let mut map = serializer.serialize_map(Some(self.0.inline.len()))?;
                for (k, v) in self.0.inline.iter() {
                    let v = match unpack(v) {
                        (OVERFLOW, _) => pack(OVERFLOW, OVERFLOW),
                        _ => v,
                    };
                    map.serialize_entry(&k, &v)?;
                }
                map.end()
            }
        }
        struct Overflowed<'a>(&'a OwnerMap);
        impl Serialize for Overflowed<'_> {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let mut map = serializer.serialize_map(Some(self.0.overflow.live()))?;
                for (k, owners) in self.0.overflowed() {
                    map.serialize_entry(&k, owners)?;
                }
                map.end()
            }
        }
        let mut s = serializer.serialize_struct("OwnerMap", 2)?;
        s.serialize_field("inline", &Inline(self))?;
        s.serialize_field("overflow", &Overflowed(self))?;
        s.end()
    }
}

/// The snapshot form, unchanged since the overflow lived in a hash map of its own: `inline` maps
/// every block to its packed pair (both positions [`OVERFLOW`] for an overflowed block), then
/// `overflow` maps overflowed blocks to their owner lists. Both are decoded where they will stay:
/// `inline` straight into the table the map keeps ([`KeyTable`] reads the same map form), and
/// each list straight into the slab, its block's value pointed at it as it is read. So a
/// million-block snapshot is built once, not first as hash maps of its own and then copied.
impl<'de> Deserialize<'de> for OwnerMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_struct("OwnerMap", &["inline", "overflow"], OwnerMapVisitor)
    }
}

struct OwnerMapVisitor;

/// The snapshot's two fields, by name where a struct is written as a map.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum OwnerMapField {
    Inline,
    Overflow,
}

impl<'de> Visitor<'de> for OwnerMapVisitor {
    type Value = OwnerMap;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an owner map: its blocks' packed owners, then the overflowed blocks' lists")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<OwnerMap, A::Error> {
        let inline = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(0, &self))?;
        let mut map = OwnerMap {
            inline,
            overflow: Slab::default(),
        };
        seq.next_element_seed(OverflowLists(&mut map))?
            .ok_or_else(|| de::Error::invalid_length(1, &self))?;
        map.every_overflowed_block_has_its_list()?;
        Ok(map)
    }

    /// The same fields by name, as they are written: the lists name blocks of the table, so
    /// the table comes first.
    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<OwnerMap, A::Error> {
        let Some(OwnerMapField::Inline) = access.next_key()? else {
            return Err(de::Error::custom("an owner map's `inline` must come first"));
        };
        let mut map = OwnerMap {
            inline: access.next_value()?,
            overflow: Slab::default(),
        };
        let Some(OwnerMapField::Overflow) = access.next_key()? else {
            return Err(de::Error::missing_field("overflow"));
        };
        access.next_value_seed(OverflowLists(&mut map))?;
        map.every_overflowed_block_has_its_list()?;
        Ok(map)
    }
}

/// Decodes the overflow lists into a map whose table is already decoded: each list goes into the
/// slab and its block's value names it. A list must name a block the table marks overflowed and
/// not yet given one; anything else is a damaged snapshot (the writer lists each overflowed block
/// once), refused by name.
struct OverflowLists<'a>(&'a mut OwnerMap);

impl<'de> DeserializeSeed<'de> for OverflowLists<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for OverflowLists<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a map from overflowed blocks to their owner lists")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<(), A::Error> {
        let map = self.0;
        while let Some((key, owners)) = access.next_entry::<u64, Overflow>()? {
            let refused = || {
                de::Error::custom(format!(
                    "block {key:#x} has an owner list but is not marked overflowed, or has two"
                ))
            };
            let mut entry = map.inline.occupied(key).ok_or_else(refused)?;
            let packed = entry.value();
            if *packed != pack(OVERFLOW, OVERFLOW) {
                return Err(refused());
            }
            *packed = pack(OVERFLOW, map.overflow.put(owners) as Slot);
        }
        Ok(())
    }
}

impl OwnerMap {
    /// After the lists are read, every block the table marks overflowed names a list of its own:
    /// one whose list never came, or whose mark names none of the lists (a damaged value), is
    /// refused, so no later step reads a list that is not there.
    fn every_overflowed_block_has_its_list<E: de::Error>(&self) -> Result<(), E> {
        let mut overflowed = 0;
        for (key, packed) in self.inline.iter() {
            match unpack(packed) {
                (OVERFLOW, OVERFLOW) => {
                    return Err(E::custom(format!("block {key:#x} overflows to no owners")))
                }
                (OVERFLOW, _) => overflowed += 1,
                _ => {}
            }
        }
        // Each list placed names the one block it was read for, so a further mark is damaged.
        if overflowed != self.overflow.live() {
            return Err(E::custom(format!(
                "{overflowed} blocks are marked overflowed for {} owner lists",
                self.overflow.live()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Each call of a walk over `keys`: the positions and the owners handed over. The walk stops
    /// where `stop_at` says (a position whose first call returns false).
    fn walk_calls(
        map: &OwnerMap,
        keys: &[u64],
        stop_at: Option<usize>,
    ) -> Vec<(Range<usize>, Vec<Slot>)> {
        let mut calls = Vec::new();
        map.walk(keys.iter().copied(), |at, owners| {
            let go_on = stop_at != Some(at.start);
            calls.push((at, owners.to_vec()));
            go_on
        });
        calls
    }

    /// Each slot's consecutive match from the first key, counted from a walk's calls by
    /// [`extend_match`], stopping at the first call nobody continues; and the same counted key
    /// by key, the definition.
    fn depths_by_runs(map: &OwnerMap, keys: &[u64]) -> Vec<u32> {
        let mut depth = vec![0u32; 8];
        map.walk(keys.iter().copied(), |at, owners| {
            let mut any = false;
            for &slot in owners {
                any |= extend_match(&mut depth[slot as usize], &at);
            }
            any
        });
        depth
    }

    fn depths_key_by_key(map: &OwnerMap, keys: &[u64]) -> Vec<u32> {
        let mut depth = vec![0u32; 8];
        for (i, &key) in keys.iter().enumerate() {
            let Some(any) = map.with_owners(key, |owners| {
                let mut any = false;
                for &slot in owners {
                    let d = &mut depth[slot as usize];
                    if *d as usize == i {
                        *d += 1;
                    }
                    any |= *d as usize == i + 1;
                }
                any
            }) else {
                break;
            };
            if !any {
                break;
            }
        }
        depth
    }

    #[test]
    fn a_run_of_keys_with_the_same_owners_is_handed_over_as_its_first_key_then_the_rest() {
        let mut map = OwnerMap::default();
        for key in 1..=3 {
            for slot in [3, 1, 4] {
                map.add(key, slot);
            }
        }
        for key in 4..=5 {
            for slot in [3, 1] {
                map.add(key, slot);
            }
        }
        map.add(6, 3);
        let calls = walk_calls(&map, &[1, 2, 3, 4, 5, 6, 7], None);
        assert_eq!(
            calls,
            vec![
                (0..1, vec![3, 1, 4]),
                (1..3, vec![3, 1, 4]),
                (3..4, vec![3, 1]),
                (4..5, vec![3, 1]),
                (5..6, vec![3]),
            ],
            "a run's first key comes alone, the rest of it in one call once it ends; a key \
             nobody holds ends the walk"
        );
        assert_eq!(
            walk_calls(&map, &[1, 2, 3], None),
            vec![(0..1, vec![3, 1, 4]), (1..3, vec![3, 1, 4])],
            "a walk whose keys run out inside a run still hands over the rest of it"
        );
        assert_eq!(
            walk_calls(&map, &[1, 2, 3, 4, 5], Some(1)),
            vec![(0..1, vec![3, 1, 4]), (1..3, vec![3, 1, 4])],
            "a walk stopped on the rest of a run hands it over once and ends"
        );
        let stopped = walk_calls(&map, &[1, 2, 3, 4, 5], Some(3));
        assert_eq!(
            stopped.last(),
            Some(&(3..4, vec![3, 1])),
            "a walk stopped at a run's first key hands over nothing of the run after it"
        );
        assert_eq!(
            stopped.len(),
            3,
            "the runs before the stop are handed over whole"
        );
    }

    proptest! {
        /// Counting each owner's match from the runs gives the count key by key: whatever the
        /// lists (inline or overflowed, a slot twice, the same set in another order) and
        /// wherever the walk ends.
        #[test]
        fn depths_counted_from_runs_equal_depths_counted_key_by_key(
            pool in prop::collection::vec(prop::collection::vec(0u32..8, 1..6), 1..4),
            picks in prop::collection::vec(0usize..5, 1..24),
        ) {
            let mut map = OwnerMap::default();
            // Key i + 1 gets the list its pick names; a pick past the pool leaves it absent.
            for (i, &pick) in picks.iter().enumerate() {
                if let Some(list) = pool.get(pick) {
                    for &slot in list {
                        map.add(i as u64 + 1, slot);
                    }
                }
            }
            let keys: Vec<u64> = (1..=picks.len() as u64).collect();
            prop_assert_eq!(depths_by_runs(&map, &keys), depths_key_by_key(&map, &keys));
        }
    }

    fn owners(map: &OwnerMap, key: u64) -> Vec<Slot> {
        let mut v = map.with_owners(key, |o| o.to_vec()).unwrap_or_default();
        v.sort();
        v
    }

    #[test]
    fn owners_move_to_overflow_and_back_without_loss() {
        let mut map = OwnerMap::default();
        for slot in [3, 1, 4, 1] {
            map.add(7, slot);
        }
        assert_eq!(
            owners(&map, 7),
            vec![1, 1, 3, 4],
            "four entries, one slot twice"
        );
        assert!(map.remove(7, 1));
        assert!(map.remove(7, 4));
        assert_eq!(owners(&map, 7), vec![1, 3], "back to two inline entries");
        assert!(
            map.overflow.live() == 0,
            "the overflow entry is released when two entries remain"
        );
        assert!(!map.remove(7, 9), "a non-owner is not removed");
        assert!(map.remove(7, 3) && map.remove(7, 1));
        assert_eq!(map.len(), 0, "a block without owners is dropped");
    }

    /// Blocks 1 to 3 with one, two and four owner entries (one slot twice): inline, inline and
    /// overflowed.
    fn three_blocks() -> OwnerMap {
        let mut map = OwnerMap::default();
        for (key, slots) in [(1u64, &[5u32][..]), (2, &[5, 6]), (3, &[1, 2, 3, 1])] {
            for &slot in slots {
                map.add(key, slot);
            }
        }
        map
    }

    #[test]
    fn snapshots_keep_the_form_written_before_the_overflow_slab() {
        let map = three_blocks();
        let wire: OwnerMapForm =
            rmp_serde::from_slice(&rmp_serde::to_vec(&map).unwrap()).expect("decodes as before");
        let expected = OwnerMapForm {
            inline: [
                (1, pack(5, EMPTY)),
                (2, pack(5, 6)),
                (3, pack(OVERFLOW, OVERFLOW)),
            ]
            .into_iter()
            .collect(),
            overflow: [(3, smallvec![1, 2, 3, 1])].into_iter().collect(),
        };
        assert_eq!(wire, expected, "the snapshot form is unchanged");
        let back = load_form(&expected).expect("old form loads");
        assert_same_owners(&back, &map, 1..=3, "an old snapshot loads the same owners");
    }

    /// Asserts that `back` holds the same owners as `map` for each of `keys`.
    fn assert_same_owners(
        back: &OwnerMap,
        map: &OwnerMap,
        keys: impl IntoIterator<Item = u64>,
        why: &str,
    ) {
        for key in keys {
            assert_eq!(owners(back, key), owners(map, key), "{why} (block {key})");
        }
    }

    #[test]
    fn a_restored_owner_map_sizes_its_table_once() {
        let mut map = OwnerMap::default();
        for key in 0..20_000u64 {
            map.add(key, (key % 7) as Slot);
            if key % 3 == 0 {
                map.add(key, 8);
                map.add(key, 9);
            }
        }
        let bytes = rmp_serde::to_vec(&map).unwrap();
        let mut back = None;
        let resized = super::super::key_table::resizes_in(|| {
            back = Some(rmp_serde::from_slice::<OwnerMap>(&bytes).expect("loads"));
        });
        let back = back.unwrap();
        assert_eq!(
            resized, 1,
            "a restored owner map sizes its table once, then fills it"
        );
        assert_eq!(back.len(), map.len());
        assert_same_owners(
            &back,
            &map,
            [0, 1, 2, 3, 9_999, 19_998, 19_999],
            "owners survive the restore",
        );
    }

    /// An owner map decoded from `form` as a snapshot writes it (fields in order).
    fn load_form(form: &impl Serialize) -> Result<OwnerMap, rmp_serde::decode::Error> {
        rmp_serde::from_slice(&rmp_serde::to_vec(form).unwrap())
    }

    #[test]
    fn a_snapshot_whose_overflowed_block_has_no_list_is_refused() {
        let form = OwnerMapForm {
            inline: [(1, pack(5, EMPTY)), (0xab, pack(OVERFLOW, OVERFLOW))]
                .into_iter()
                .collect(),
            overflow: Default::default(),
        };
        let err =
            load_form(&form).expect_err("a block marked overflowed without its list does not load");
        assert!(
            err.to_string()
                .contains("block 0xab overflows to no owners"),
            "the error names the block: {err}"
        );
    }

    #[test]
    fn a_snapshot_with_a_damaged_overflow_mark_is_refused_rather_than_read_past_its_lists() {
        let form = OwnerMapForm {
            inline: [(1, pack(OVERFLOW, OVERFLOW)), (2, pack(OVERFLOW, 7))]
                .into_iter()
                .collect(),
            overflow: [(1, smallvec![1, 2, 3])].into_iter().collect(),
        };
        let err = load_form(&form).expect_err("a mark that names no list read does not load");
        assert!(
            err.to_string()
                .contains("2 blocks are marked overflowed for 1 owner lists"),
            "the error counts the marks and the lists: {err}"
        );
    }

    /// The snapshot form with its lists in a given order, a block's twice if need be.
    #[derive(Serialize)]
    struct ListsInOrder {
        inline: rustc_hash::FxHashMap<u64, u64>,
        #[serde(serialize_with = "lists_as_map")]
        overflow: Vec<(u64, Overflow)>,
    }

    fn lists_as_map<S: Serializer>(lists: &[(u64, Overflow)], s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(lists.iter().map(|(key, owners)| (key, owners)))
    }

    #[test]
    fn a_snapshot_whose_list_names_no_overflowed_block_is_refused() {
        let inline: rustc_hash::FxHashMap<u64, u64> =
            [(1, pack(5, EMPTY)), (2, pack(OVERFLOW, OVERFLOW))]
                .into_iter()
                .collect();
        for (lists, named) in [
            (vec![(1, smallvec![1, 2, 3])], "0x1"),
            (vec![(9, smallvec![1, 2, 3])], "0x9"),
            (
                vec![(2, smallvec![1, 2, 3]), (2, smallvec![4, 5, 6])],
                "0x2",
            ),
        ] {
            let form = ListsInOrder {
                inline: inline.clone(),
                overflow: lists,
            };
            let err = load_form(&form)
                .expect_err("a list for a block not marked overflowed, or a second, does not load");
            assert!(
                err.to_string().contains(&format!(
                    "block {named} has an owner list but is not marked overflowed, or has two"
                )),
                "the error names the block: {err}"
            );
        }
    }

    #[test]
    fn a_snapshot_written_with_field_names_loads_with_its_table_first() {
        let map = three_blocks();
        let back: OwnerMap = rmp_serde::from_slice(&rmp_serde::to_vec_named(&map).unwrap())
            .expect("the fields by name load");
        assert_same_owners(&back, &map, 1..=3, "the named form loads the same owners");

        /// The same two fields, the lists first: they name blocks of a table not read yet.
        #[derive(Serialize)]
        struct OverflowFirst<'a> {
            overflow: &'a rustc_hash::FxHashMap<u64, Overflow>,
            inline: &'a rustc_hash::FxHashMap<u64, u64>,
        }
        let form: OwnerMapForm = rmp_serde::from_slice(&rmp_serde::to_vec(&map).unwrap()).unwrap();
        let swapped = OverflowFirst {
            overflow: &form.overflow,
            inline: &form.inline,
        };
        let err = rmp_serde::from_slice::<OwnerMap>(&rmp_serde::to_vec_named(&swapped).unwrap())
            .expect_err("the lists before the table they name do not load");
        assert!(
            err.to_string()
                .contains("an owner map's `inline` must come first"),
            "the error says which field comes first: {err}"
        );
    }
}
