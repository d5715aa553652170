//! Block key → owner slots, packed: the index's dominant memory cost.
//!
//! Most blocks have one or two owners. Those are stored inline as two `u32` slots in one `u64`
//! map value (16 bytes per block with the key); a block with more owner entries moves them to
//! an overflow map.

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use smallvec::{smallvec, SmallVec};

use super::Slot;

/// Marks an unused inline position.
const EMPTY: Slot = Slot::MAX;
/// Marks a block whose owners live in the overflow map.
const OVERFLOW: Slot = Slot::MAX - 1;

/// Largest usable slot number (the two above are markers).
pub const MAX_SLOT: Slot = Slot::MAX - 2;

fn pack(a: Slot, b: Slot) -> u64 {
    a as u64 | ((b as u64) << 32)
}

fn unpack(v: u64) -> (Slot, Slot) {
    (v as Slot, (v >> 32) as Slot)
}

/// A multiset of owner slots per block key: a slot may appear more than once (one entry per
/// engine hash of that worker mapping to the block).
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct OwnerMap {
    inline: FxHashMap<u64, u64>,
    /// Up to the default ceiling of four owners without a heap allocation.
    overflow: FxHashMap<u64, SmallVec<[Slot; 4]>>,
}

impl OwnerMap {
    /// Adds one owner entry.
    pub fn add(&mut self, key: u64, slot: Slot) {
        debug_assert!(slot <= MAX_SLOT);
        let packed = self.inline.entry(key).or_insert(pack(EMPTY, EMPTY));
        match unpack(*packed) {
            (OVERFLOW, _) => self.overflow.entry(key).or_default().push(slot),
            (EMPTY, _) => *packed = pack(slot, EMPTY),
            (a, EMPTY) => *packed = pack(a, slot),
            (a, b) => {
                self.overflow.insert(key, smallvec![a, b, slot]);
                *packed = pack(OVERFLOW, OVERFLOW);
            }
        }
    }

    /// Removes one owner entry. False if `slot` was not an owner of `key`.
    pub fn remove(&mut self, key: u64, slot: Slot) -> bool {
        let Some(packed) = self.inline.get_mut(&key) else {
            return false;
        };
        match unpack(*packed) {
            (OVERFLOW, _) => {
                let owners = self
                    .overflow
                    .get_mut(&key)
                    .expect("overflowed block has owners");
                let Some(i) = owners.iter().position(|&s| s == slot) else {
                    return false;
                };
                owners.swap_remove(i);
                if owners.len() == 2 {
                    *packed = pack(owners[0], owners[1]);
                    self.overflow.remove(&key);
                }
                true
            }
            (a, b) if a == slot => {
                if b == EMPTY {
                    self.inline.remove(&key);
                } else {
                    *packed = pack(b, EMPTY);
                }
                true
            }
            (a, b) if b == slot => {
                *packed = pack(a, EMPTY);
                true
            }
            _ => false,
        }
    }

    /// Calls `f` with the owner entries of `key`, if it has any.
    pub fn with_owners<R>(&self, key: u64, f: impl FnOnce(&[Slot]) -> R) -> Option<R> {
        let packed = *self.inline.get(&key)?;
        Some(match unpack(packed) {
            (OVERFLOW, _) => f(&self.overflow[&key]),
            (a, EMPTY) => f(&[a]),
            (a, b) => f(&[a, b]),
        })
    }

    /// Distinct blocks with at least one owner.
    pub fn len(&self) -> usize {
        self.inline.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            map.overflow.is_empty(),
            "overflow is released when two entries remain"
        );
        assert!(!map.remove(7, 9), "a non-owner is not removed");
        assert!(map.remove(7, 3) && map.remove(7, 1));
        assert_eq!(map.len(), 0, "a block without owners is dropped");
    }
}
