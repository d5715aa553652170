//! A decision's owners in id order, as the reply lists them: each worker once, at its lowest
//! slot.

use super::*;

/// A decision's owners put in id order, with the sort's buffers: kept between routes, so a wide
/// decision allocates none. Each owner is its id label (the number that orders ids, read once
/// per owner, where comparing ids reads two of them per step) packed above its slot into one
/// integer, so the sort compares and moves single words. Slots are distinct, so the order is
/// that of a stable sort over the owners in slot order.
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
}

impl OwnerOrder {
    pub(super) fn clear(&mut self) {
        self.keys.clear();
        self.labels = None;
    }

    /// Adds an owner: its id label ([`Workers::id_order`](crate::workers::Workers::id_order))
    /// and its slot.
    pub(super) fn push(&mut self, label: u32, slot: Slot) {
        self.keys.push(u64::from(label) << 32 | u64::from(slot));
        let (lowest, highest) = self.labels.unwrap_or((label, label));
        self.labels = Some((lowest.min(label), highest.max(label)));
    }

    /// The owners' slots in id order, each worker once: of a worker's ranks (one label), the
    /// lowest slot.
    pub(super) fn slots_in_id_order(&mut self) -> impl Iterator<Item = Slot> + '_ {
        self.sort();
        self.keys.dedup_by_key(|&mut packed| packed >> 32);
        self.keys.iter().map(|&packed| packed as u32)
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
        let label = |k: u64| (k >> 32) as u32;
        let (lowest, highest) = self.labels.expect("labels of the keys pushed");
        // bucket = (label - lowest) * buckets / span, as a multiply and a shift: below
        // `buckets` for every label up to `highest`, and never smaller for a larger label.
        // (At most 2^24 buckets, so the scaled labels stay far inside 64 bits.)
        let buckets = (n * BUCKETS_PER_KEY).next_power_of_two().min(1 << 24);
        let span = u64::from(highest - lowest) + 1;
        let scale = ((buckets as u64) << 32) / span;
        let bucket = |k: u64| ((u64::from(label(k) - lowest) * scale) >> 32) as usize;
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

/// Buckets per key of [`OwnerOrder::sort`]'s counting pass: fewer keys share one, so fewer are
/// left out of order.
const BUCKETS_PER_KEY: usize = 2;

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn owners_come_out_in_id_order_each_worker_once_at_its_lowest_slot() {
        let mut order = OwnerOrder::default();
        for (label, slot) in [(5, 9), (3, 4), (5, 2), (3, 7), (8, 1)] {
            order.push(label, slot);
        }
        assert_eq!(
            order.slots_in_id_order().collect::<Vec<_>>(),
            [4, 2, 1],
            "labels 3, 5, 8 in order; of a worker's ranks (one label) its lowest slot"
        );
        order.clear();
        assert_eq!(
            order.slots_in_id_order().count(),
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
}
