//! A decision's owners in id order, as the reply lists them: each worker once, at its lowest
//! slot.
//!
//! Two ways to the same order. A decision whose owners are few beside the fleet sorts them
//! ([`OwnerOrder::sort`]). One whose owners are at least a 64th of the fleet's slots marks a
//! bit per owner at its place in the fleet's id order, kept from route to route
//! ([`IdPlaces`]), and reads the bits back: a word per 64 slots, no more words than owners.
//! The places keep the ids in id order too, so those owners' ids are read front to back. At
//! 4,096 workers a tenant's shared prefix has 512 owners; sorting them and reading their ids
//! from all over the slot table took about a fifth of such a decision (docs/performance.md,
//! fifty-fourth part).

use super::pools::RankRow;
use super::*;

/// A decision's owners put in id order, with the sort's buffers and the fleet's places: kept
/// between routes, so a wide decision allocates none. Each owner is its id label (the number
/// that orders ids, read once per owner, where comparing ids reads two of them per step) packed
/// above its slot into one integer, so the sort compares and moves single words. Slots are
/// distinct, so the order is that of a stable sort over the owners in slot order.
#[derive(Debug, Default)]
pub(super) struct OwnerOrder {
    /// The keys: label in the high 32 bits, slot in the low.
    keys: Vec<u64>,
    /// The smallest and largest label pushed since the last clear (the counting pass's range,
    /// kept as the keys come rather than found by a pass of its own).
    labels: Option<(u32, u32)>,
    /// Bucket starts of the counting pass.
    counts: Vec<u32>,
    /// The counting pass's output, swapped with `keys` at the end.
    spare: Vec<u64>,
    /// Each live rank's place in id order.
    places: IdPlaces,
    /// A bit per place: the decision's owners.
    bits: Vec<u64>,
}

/// Every live rank's place in id order (by label, then slot) and the ids in that order, kept
/// from route to route and rebuilt from the route rows and names after ranks join, leave or are
/// labelled afresh. Invariant: while `current`, `order` holds the key (label above slot) of
/// every live row, ascending, `place` maps each live row's slot to its key's index in `order`,
/// and `names` holds each key's id at its index.
#[derive(Debug, Default)]
struct IdPlaces {
    order: Vec<u64>,
    /// Indexed by slot; read only for live ranks.
    place: Vec<u32>,
    /// The ids in place order, so that a wide decision reads its owners' ids front to back
    /// rather than from all over the table by slot (where each was a cache miss).
    names: Vec<Option<WorkerId>>,
    current: bool,
    /// Owners sorted since the places went out of date ([`REBUILD_AFTER`]).
    sorted_since: usize,
}

impl IdPlaces {
    /// Places every live rank of `rows`, whose ids are `names`.
    fn rebuild(&mut self, rows: &[RankRow], names: &[Option<WorkerId>]) {
        self.order.clear();
        self.order.extend(
            rows.iter()
                .enumerate()
                .filter(|(_, row)| row.is_live())
                .map(|(slot, row)| key(row.id_order, slot as u32)),
        );
        // Slots are distinct, so the keys are: an unstable sort gives the one order.
        self.order.sort_unstable();
        self.place.resize(rows.len(), 0);
        self.names.clear();
        for (place, &packed) in self.order.iter().enumerate() {
            let slot = low_of(packed);
            self.place[slot] = place as u32;
            self.names.push(names[slot].clone());
        }
        self.current = true;
        self.sorted_since = 0;
    }
}

impl OwnerOrder {
    pub(super) fn clear(&mut self) {
        self.keys.clear();
        self.labels = None;
    }

    /// Adds an owner: its id label ([`Workers::id_order`](crate::workers::Workers::id_order))
    /// and its slot.
    pub(super) fn push(&mut self, label: u32, slot: Slot) {
        self.keys.push(key(label, slot));
        let (lowest, highest) = self.labels.unwrap_or((label, label));
        self.labels = Some((lowest.min(label), highest.max(label)));
    }

    /// Notes that a rank joined, left, or took another label or id: the places are out of date.
    pub(super) fn ranks_moved(&mut self) {
        self.places.current = false;
    }

    /// The owners' ids in id order, each worker once: of a worker's ranks (one label), the
    /// lowest slot's. `rows` and `names` are the route rows and names as the route's sync left
    /// them, which cover every slot of the fleet.
    pub(super) fn ids_in_id_order(
        &mut self,
        rows: &[RankRow],
        names: &[Option<WorkerId>],
    ) -> Vec<WorkerId> {
        // The keys' low halves: places into the places' names, or slots into the route's.
        let names = if self.order_by_places(rows, names) {
            &self.places.names
        } else {
            self.sort();
            names
        };
        self.keys.dedup_by_key(|&mut packed| label_of(packed));
        self.keys
            .iter()
            .map(|&packed| names[low_of(packed)].clone().expect("a live rank"))
            .collect()
    }

    /// Puts the keys in order by their places, when there are at least [`PLACES_FROM`] and a
    /// word of bits per 64 slots of `rows` comes to no more words than keys, each key's slot
    /// replaced by its place (the order of the places is that of the slots within a label);
    /// returns false otherwise, and while the places wait for their rebuild, leaving the keys
    /// to the sort.
    fn order_by_places(&mut self, rows: &[RankRow], names: &[Option<WorkerId>]) -> bool {
        let n = self.keys.len();
        if n < PLACES_FROM || rows.len().div_ceil(64) > n {
            return false;
        }
        let places = &mut self.places;
        if !places.current {
            places.sorted_since += n;
            if places.sorted_since < REBUILD_AFTER * rows.len() {
                return false;
            }
            places.rebuild(rows, names);
        }
        let bits = &mut self.bits;
        bits.clear();
        bits.resize(places.order.len().div_ceil(64), 0);
        for &packed in &self.keys {
            let place = places.place[low_of(packed)] as usize;
            debug_assert_eq!(
                places.order[place], packed,
                "an owner's place holds its key"
            );
            bits[place / 64] |= 1 << (place % 64);
        }
        self.keys.clear();
        for (word, &set) in bits.iter().enumerate() {
            let mut set = set;
            while set != 0 {
                let place = word * 64 + set.trailing_zeros() as usize;
                self.keys
                    .push(key(label_of(places.order[place]), place as u32));
                set &= set - 1;
            }
        }
        true
    }

    /// Whether the places are up to date with the rows.
    #[cfg(test)]
    pub(super) fn places_current(&self) -> bool {
        self.places.current
    }

    /// Checks [`IdPlaces`]' invariant against the route rows.
    #[cfg(test)]
    pub(super) fn assert_places_follow(&self, rows: &[RankRow], names: &[Option<WorkerId>]) {
        if !self.places.current {
            return;
        }
        let mut fresh = IdPlaces::default();
        fresh.rebuild(rows, names);
        assert_eq!(
            self.places.order, fresh.order,
            "current places hold every live rank in id order"
        );
        assert_eq!(
            self.places.names, fresh.names,
            "current places hold each live rank's id at its place"
        );
        for &packed in &fresh.order {
            let slot = low_of(packed);
            assert_eq!(
                self.places.place[slot], fresh.place[slot],
                "the place of slot {slot} indexes its key"
            );
        }
    }

    /// Sorts the keys. A wide decision has hundreds, in an order unrelated to their ids, and a
    /// comparison sort of them mispredicts a branch at nearly every step. A counting pass on
    /// the labels, scaled from the smallest to the largest (a fresh labelling fills the middle
    /// half of the `u32` range, so scaling the whole range would leave half the buckets
    /// empty), about [`BUCKETS_PER_KEY`] buckets per key, leaves them nearly sorted, and an
    /// insertion pass finishes. Labels crowded together (many ids joined between two
    /// neighbours) leave the buckets unbalanced; when the insertion pass has moved keys eight
    /// times their number, the standard sort takes over, so the worst case stays a comparison
    /// sort's.
    fn sort(&mut self) {
        let keys = &mut self.keys;
        let n = keys.len();
        if n < 128 {
            keys.sort_unstable();
            return;
        }
        let (lowest, highest) = self.labels.expect("labels of the keys pushed");
        // bucket = (label - lowest) * buckets / span, as a multiply and a shift: below
        // `buckets` for every label up to `highest`, and never smaller for a larger label.
        // (At most 2^24 buckets, so the scaled labels stay far inside 64 bits.)
        let buckets = (n * BUCKETS_PER_KEY).next_power_of_two().min(1 << 24);
        let span = u64::from(highest - lowest) + 1;
        let scale = ((buckets as u64) << 32) / span;
        let bucket = |k: u64| ((u64::from(label_of(k) - lowest) * scale) >> 32) as usize;
        let counts = &mut self.counts;
        counts.clear();
        counts.resize(buckets + 1, 0);
        for &k in keys.iter() {
            counts[bucket(k) + 1] += 1;
        }
        // Each bucket's start: the keys in the buckets below it (a running sum, which reads
        // each count once and needs no bounds check).
        let mut below = 0;
        for count in counts.iter_mut() {
            below += *count;
            *count = below;
        }
        // Every place of `out` below `n` is written by the counting pass, so what the buffer
        // held from an earlier route is left as it is rather than zeroed first.
        let out = &mut self.spare;
        if out.len() < n {
            out.resize(n, 0);
        }
        out.truncate(n);
        for &k in keys.iter() {
            let b = bucket(k);
            out[counts[b] as usize] = k;
            counts[b] += 1;
        }
        // The largest key so far is kept at hand: most keys are already in place.
        let mut moves = 0usize;
        let mut largest = out[0];
        for i in 1..n {
            let k = out[i];
            if k >= largest {
                largest = k;
                continue;
            }
            let mut j = i;
            while j > 0 && out[j - 1] > k {
                out[j] = out[j - 1];
                j -= 1;
            }
            out[j] = k;
            moves += i - j;
            if moves > 8 * n {
                out.sort_unstable();
                break;
            }
        }
        std::mem::swap(keys, out);
    }
}

/// An owner's key: its id label above `low`, its slot (or, once put in order by the places,
/// its place), so that keys order as (label, slot) do.
fn key(label: u32, low: u32) -> u64 {
    u64::from(label) << 32 | u64::from(low)
}

fn label_of(key: u64) -> u32 {
    (key >> 32) as u32
}

/// The slot or place under a key's label.
fn low_of(key: u64) -> usize {
    key as u32 as usize
}

/// The fewest owners a decision puts in order by their places; fewer are left to the standard
/// sort, which is quick on a few. (32 is a wide decision's owners at 256 workers in the peer
/// bench, where the two ways measured alike.)
const PLACES_FROM: usize = 32;

/// The places wait for their rebuild (a sort of the whole fleet) until the owners sorted since
/// they went out of date add up to this many times the fleet's slots. A rebuild then costs
/// about a sixteenth of the sorting before it, and it is one decision's: at 4,096 workers a
/// rebuild took up to 76 µs, and rebuilt after every fleet's worth of sorted owners, the hundred
/// rebuilds while the peer bench's workers join were among its slowest 1% of decisions.
const REBUILD_AFTER: usize = 16;

/// Buckets per key of [`OwnerOrder::sort`]'s counting pass: fewer keys share one, so fewer are
/// left out of order.
const BUCKETS_PER_KEY: usize = 2;

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The id the tests give the rank in `slot`.
    fn name(slot: usize) -> WorkerId {
        WorkerId::new(&format!("s{slot}")).expect("a valid id")
    }

    /// Rows and names of `slots` ranks, none live: a test pushes its owners' labels itself.
    fn fleet(slots: usize) -> (Vec<RankRow>, Vec<Option<WorkerId>>) {
        (
            vec![RankRow::default(); slots],
            (0..slots).map(|s| Some(name(s))).collect(),
        )
    }

    #[test]
    fn owners_come_out_in_id_order_each_worker_once_at_its_lowest_slot() {
        let mut order = OwnerOrder::default();
        let (rows, names) = fleet(10);
        for (label, slot) in [(5, 9), (3, 4), (5, 2), (3, 7), (8, 1)] {
            order.push(label, slot);
        }
        assert_eq!(
            order.ids_in_id_order(&rows, &names),
            [name(4), name(2), name(1)],
            "labels 3, 5, 8 in order; of a worker's ranks (one label) its lowest slot"
        );
        order.clear();
        assert_eq!(
            order.ids_in_id_order(&rows, &names).len(),
            0,
            "a cleared order names no owner"
        );
    }

    #[test]
    fn packed_owner_keys_come_out_in_order_spread_crowded_labelled_or_few() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        // One order for every sort, as a router keeps it: what one sort leaves in its buffers
        // must not leak into the next.
        let mut order = OwnerOrder::default();
        for n in [0, 1, 5, 127, 128, 300, 512, 4096, 200] {
            let spread: Vec<u64> = (0..n).map(|_| rng.random()).collect();
            // Two labels, positions descending: the buckets hold half the keys each, out of
            // order, so the insertion pass gives up and the standard sort finishes.
            let crowded: Vec<u64> = (0..n)
                .map(|i| (rng.random_range(0..2u64) << 32) | (n - i) as u64)
                .collect();
            // One label far from the rest, which lie within 1,000 of each other: the rest share
            // a bucket.
            let outlier: Vec<u64> = (0..n)
                .map(|i| match i {
                    0 => u64::from(u32::MAX) << 32,
                    _ => (rng.random_range(0..1_000u64) << 32) | i as u64,
                })
                .collect();
            let descending: Vec<u64> = (0..n as u64).rev().map(|i| i << 40).collect();
            // A fresh labelling: labels evenly spaced over the middle half of the range, met in
            // an order unrelated to them.
            let middle: Vec<u64> = (0..n as u64)
                .map(|i| ((1u64 << 30) + (i * 7_919 % n.max(1) as u64) * 100_000) << 32 | i)
                .collect();
            // One worker's ranks only: one label, positions descending.
            let one_label: Vec<u64> = (0..n as u64).map(|i| 9 << 32 | (n as u64 - i)).collect();
            for (form, keys) in [
                ("spread", spread),
                ("crowded", crowded),
                ("outlier", outlier),
                ("descending", descending),
                ("middle", middle),
                ("one label", one_label),
            ] {
                let mut expected = keys.clone();
                expected.sort_unstable();
                order.clear();
                for &k in &keys {
                    order.push((k >> 32) as u32, k as u32);
                }
                order.sort();
                assert_eq!(
                    order.keys, expected,
                    "{n} {form} keys are sorted as the standard sort sorts them"
                );
            }
        }
    }

    #[test]
    fn owners_come_out_in_id_order_whether_placed_or_sorted_as_ranks_move() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        // One order for every decision, as a router keeps it: places built for one fleet must
        // be rebuilt once ranks move, never read stale.
        let mut order = OwnerOrder::default();
        let (mut rows, names) = fleet(300);
        for (slot, row) in rows.iter_mut().enumerate() {
            if slot % 3 != 0 {
                *row = RankRow::live_labelled(rng.random_range(0..200));
            }
        }
        let mut placed = 0;
        for round in 0..600 {
            // Ranks join, leave or take another label; a few labels are shared (the ranks of
            // one worker). Between changes, enough owners are sorted for a rebuild.
            if round % 60 == 0 {
                for _ in 0..rng.random_range(1..20) {
                    let slot = rng.random_range(0..rows.len());
                    rows[slot] = match rng.random_range(0..3) {
                        0 => RankRow::default(),
                        _ => RankRow::live_labelled(rng.random_range(0..200)),
                    };
                }
                order.ranks_moved();
            }
            let live: Vec<Slot> = (0..rows.len() as Slot)
                .filter(|&s| rows[s as usize].is_live())
                .collect();
            // From none to all of them, mostly past a 64th of the slots.
            let n = match round % 5 {
                0 => rng.random_range(0..40),
                _ => rng.random_range(live.len() / 2..=live.len()),
            };
            order.clear();
            let mut keys = Vec::new();
            for &slot in live.iter().filter(|_| rng.random_range(0..live.len()) < n) {
                order.push(rows[slot as usize].id_order, slot);
                keys.push((rows[slot as usize].id_order, slot));
            }
            // Id order, then each label's lowest slot.
            keys.sort();
            keys.dedup_by_key(|&mut (label, _)| label);
            let expected: Vec<WorkerId> =
                keys.iter().map(|&(_, slot)| name(slot as usize)).collect();
            let got = order.ids_in_id_order(&rows, &names);
            assert_eq!(
                got, expected,
                "round {round}: owners come out in id order, each label once at its lowest slot"
            );
            order.assert_places_follow(&rows, &names);
            placed += usize::from(order.places_current());
        }
        assert!(
            placed > 200,
            "a third of the rounds read the places ({placed} of 600)"
        );
    }
}
