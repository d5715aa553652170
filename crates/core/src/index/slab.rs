//! Lists too large for a table value, stored aside and named by index.
//!
//! The owner map and approximate ownership keep a block's one or two entries inside their
//! [`KeyTable`](super::key_table::KeyTable) value; a block with more keeps them here, and the
//! table value holds the index. Freed indexes are reused, so the slab's size follows the number
//! of such blocks.

use std::ops::{Index, IndexMut};

#[derive(Debug)]
pub struct Slab<T> {
    entries: Vec<T>,
    /// Indexes of released entries, reused first.
    free: Vec<usize>,
}

// Each entry is copied into its own memory where it has room.
clone_in_place!(Slab<T> { entries, free });

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            entries: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T: Default> Slab<T> {
    /// Stores `value`; returns its index.
    pub fn put(&mut self, value: T) -> usize {
        match self.free.pop() {
            Some(at) => {
                self.entries[at] = value;
                at
            }
            None => {
                self.entries.push(value);
                self.entries.len() - 1
            }
        }
    }

    /// Frees entry `at`, dropping its value (and any heap memory it held).
    pub fn release(&mut self, at: usize) {
        self.entries[at] = T::default();
        self.free.push(at);
    }

    /// Entries stored and not released.
    pub fn live(&self) -> usize {
        self.entries.len() - self.free.len()
    }
}

impl<T> Index<usize> for Slab<T> {
    type Output = T;
    fn index(&self, at: usize) -> &T {
        &self.entries[at]
    }
}

impl<T> IndexMut<usize> for Slab<T> {
    fn index_mut(&mut self, at: usize) -> &mut T {
        &mut self.entries[at]
    }
}
