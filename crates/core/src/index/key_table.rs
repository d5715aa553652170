//! A `u64 → u64` hash table for the index's maps: the two a route walks block by block, the
//! owner map (block key → packed owners, shared by every worker) and approximate ownership
//! (block key → packed routing records), and each worker rank's engine-hash map (engine hash →
//! block key).
//!
//! Linear probing with backward-shift deletion, so a removal leaves no tombstone behind. That is
//! the reason this table exists: hashbrown marks removed buckets as tombstones, and under the
//! steady store/evict churn of a KV cache those tombstones make its tables double and stay
//! doubled (in the peer benchmark at 16 workers, four buckets per live block). Here the table's
//! size follows its live entries only, between [`MIN_LOAD`] and [`MAX_LOAD`].
//!
//! Like hashbrown, each bucket has a one-byte tag in a separate dense array, so a probe reads
//! mostly tags: inserting a new key (a probe that ends at a free tag) does not wait for a cache
//! miss on the 16-byte buckets, and the bucket itself is only written. As in hashbrown, a probe
//! compares sixteen tags at once ([`search_run`]), so it does not branch bucket by bucket.
//!
//! The price of the higher load is speed under churn: one remove plus one insert costs about
//! 1.6× hashbrown's at the load hashbrown settles at (`docs/performance.md`, Round 4). A batch
//! of them does not: every pass over a stored or removed batch asks for its entries a few
//! blocks ahead ([`ahead`]), which hashbrown offers no way to do, so their cache misses overlap
//! (Round 5, fourth part: the engine maps moved here and apply got faster and smaller).
//!
//! A large table's two arrays sit on huge pages where the kernel offers them
//! ([`TableArray`]), so a probe of a random bucket does not also miss the TLB.
//!
//! Keys are hashes already (xxh3 chains), but gateways may send any `u64` as a block key, so the
//! bucket is picked by a multiplicative (Fibonacci) hash of the key's bits: keys that differ
//! only in their high or low bits still spread.

use std::fmt;
use std::hint::select_unpredictable;
use std::mem::MaybeUninit;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::table_memory::{with_pages_faulted_ahead, TableArray, Writes};
use crate::prefetch::prefetch;

/// The tag of a free bucket. A used bucket's tag has its top bit set.
const FREE: u8 = 0;

/// Grow when live entries would pass 3/4 of the buckets: short probe runs (at that load, on
/// average about 2.5 buckets for a hit and 8.5 tags for a miss).
const MAX_LOAD: (usize, usize) = (3, 4);
/// Shrink when live entries fall below 1/8 of the buckets (after the grow point halves, load is
/// 3/8, so a table never bounces between the two).
const MIN_LOAD: (usize, usize) = (1, 8);
/// Smallest non-empty table.
const MIN_BUCKETS: usize = 8;
/// Buckets in one 64-byte cache line.
const BUCKETS_PER_LINE: usize = 64 / std::mem::size_of::<(u64, u64)>();
/// How many keys ahead of the one being read a pass over the index prefetches. Eight, not
/// four: where the index does not fit in the last-level cache (an AMD EPYC with 32 MiB of L3,
/// against 260–480 MiB on the Xeons of earlier rounds), each probe waits on memory, and four
/// keys ahead did not cover it (docs/performance.md, Round 5, sixteenth part: the decision's
/// p99 at 256 workers 8.8 → 7.2 µs, alternated; on the Xeons the two were alike).
pub(super) const PREFETCH_AHEAD: usize = 8;

/// What a pass over `items` asks the CPU to start loading at position `i`: the first
/// [`PREFETCH_AHEAD`] and the next at the start, then the item [`PREFETCH_AHEAD`] ahead. Each
/// pass of the index over a batch of keys (a stored or removed batch; a walk the same way over
/// keys it draws as it goes) prefetches this way, so their cache misses overlap instead of
/// queueing (a hint past the end is not given).
pub(super) fn ahead<T>(items: &[T], i: usize) -> &[T] {
    let end = (i + PREFETCH_AHEAD + 1).min(items.len());
    let start = if i == 0 { 0 } else { i + PREFETCH_AHEAD };
    &items[start.min(end)..end]
}

/// A bucket: a key and its value, written where its tag is used and read only there.
type Bucket = MaybeUninit<(u64, u64)>;

/// The entry of a used bucket (its tag not [`FREE`]): the one read of a bucket, for the probes
/// over a table's slices ([`search_run`], the walk), [`KeyTable::entry`] and the rehash's pass
/// over the old arrays.
#[inline(always)]
fn used_entry(bucket: &Bucket) -> (u64, u64) {
    // SAFETY: a bucket's entry is written whenever its tag is set to a used one (`put`,
    // `resize`, the backward shift of `remove_at`, which moves a written entry), and only used
    // buckets are read.
    unsafe { bucket.assume_init() }
}

/// Tags read at once by a probe: a probe run is searched a group of this many buckets at a
/// time (tables at least this large).
const GROUP: usize = 16;

/// Searches `key`'s probe run from its home bucket `home`: `(bucket, true)` where the key is,
/// or `(the free bucket that ends the run, false)`. `tags` and `buckets` are a table's whole
/// arrays (a power of two long), taken as slices once by a caller that probes many keys.
///
/// Where the key lies in its run (at its home, or one or two buckets on) varies from key to
/// key, so a loop testing the tags one by one mispredicts its exit about once a probe, and a
/// walk loses the work it started on the keys after it. Sixteen tags compared at once (the
/// group that holds the home bucket, then the next) give the buckets with the key's tag before
/// the first free one as a bit mask, and that mask almost always holds exactly one bucket: the
/// key's. Tables smaller than a group (an engine map's first eight buckets) go tag by tag.
#[inline(always)]
fn search_run(tags: &[u8], buckets: &[Bucket], key: u64, home: usize) -> (usize, bool) {
    if tags.len() < GROUP {
        return search_run_tag_by_tag(tags, buckets, key, home);
    }
    let mask = tags.len() - 1;
    let tag = KeyTable::tag(key);
    let holds_key = |i: usize| used_entry(&buckets[i]).0 == key;
    // Groups are aligned to GROUP buckets, so a group never straddles the table's end (its
    // length is a power of two at least GROUP) and the run wraps by masking the group's start;
    // in the home bucket's group, the buckets before the home are not part of the run.
    let mut start = home & !(GROUP - 1);
    let mut in_run = u32::MAX << (home % GROUP);
    loop {
        let group = Group::load(tags, start);
        let free = group.free() & in_run;
        // The buckets before the first free one (all of the group's when none is free); a
        // free bucket's tag never equals a used tag, so including it is harmless.
        let before_free = free ^ free.wrapping_sub(1);
        let mut candidates = group.matching(tag) & in_run & before_free;
        while candidates != 0 {
            let i = start + candidates.trailing_zeros() as usize;
            if holds_key(i) {
                return (i, true);
            }
            candidates &= candidates - 1;
        }
        if free != 0 {
            return (start + free.trailing_zeros() as usize, false);
        }
        start = (start + GROUP) & mask;
        in_run = u32::MAX;
    }
}

/// [`search_run`], one tag at a time.
#[inline(always)]
fn search_run_tag_by_tag(tags: &[u8], buckets: &[Bucket], key: u64, home: usize) -> (usize, bool) {
    let (mask, tag) = (tags.len() - 1, KeyTable::tag(key));
    let mut i = home;
    loop {
        match tags[i] {
            FREE => return (i, false),
            t if t == tag && used_entry(&buckets[i]).0 == key => return (i, true),
            _ => i = (i + 1) & mask,
        }
    }
}

/// The [`GROUP`] tags of buckets `start..start + GROUP`, compared with one value at a time: an
/// SSE2 byte comparison and `movemask` on x86-64 (every x86-64 CPU has SSE2), elsewhere
/// [`matching_tags`], a loop the compiler may vectorise.
#[derive(Clone, Copy)]
struct Group([u8; GROUP]);

impl Group {
    #[inline(always)]
    fn load(tags: &[u8], start: usize) -> Group {
        Group(
            tags[start..start + GROUP]
                .try_into()
                .expect("a group is GROUP tags"),
        )
    }

    /// Bit `j` set where tag `j` of the group equals `tag`.
    #[inline(always)]
    fn matching(self, tag: u8) -> u32 {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{
                _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_set1_epi8,
            };
            // SAFETY: the load reads the group's 16 bytes (it needs no alignment); the rest are
            // SSE2 instructions on values, and every x86-64 CPU has SSE2.
            let bits = unsafe {
                let tags = _mm_loadu_si128(self.0.as_ptr().cast());
                _mm_movemask_epi8(_mm_cmpeq_epi8(tags, _mm_set1_epi8(tag as i8)))
            };
            bits as u32
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            matching_tags(&self.0, tag)
        }
    }

    /// Bit `j` set where bucket `j` of the group is free.
    #[inline(always)]
    fn free(self) -> u32 {
        self.matching(FREE)
    }
}

/// [`Group::matching`] without SSE2, one tag at a time (built on every target, so its tests
/// check it against the SSE2 comparison).
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn matching_tags(tags: &[u8; GROUP], tag: u8) -> u32 {
    (tags.iter().enumerate()).fold(0, |bits, (j, &t)| bits | u32::from(t == tag) << j)
}

pub struct KeyTable {
    /// One per bucket: [`FREE`], or a used bucket's tag ([`KeyTable::tag`] of its key). Length
    /// is zero or a power of two.
    tags: TableArray<u8>,
    /// `(key, value)`, written where the tag is not free and read only there: a new array is
    /// left unwritten ([`TableArray::unwritten`]).
    buckets: TableArray<Bucket>,
    len: usize,
    /// `64 - log2(buckets)`: the hash's top bits pick the bucket.
    shift: u32,
}

// A table of the source's size keeps its arrays ([`TableArray`]'s `clone_from`).
clone_in_place!(KeyTable {
    tags,
    buckets,
    len,
    shift
});

impl Default for KeyTable {
    fn default() -> Self {
        KeyTable {
            tags: TableArray::empty(),
            buckets: TableArray::empty(),
            len: 0,
            shift: 64,
        }
    }
}

impl fmt::Debug for KeyTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// The multiplier of [`hash`]: 2^64 over the golden ratio, odd.
const FIBONACCI: u64 = 0x9E37_79B9_7F4A_7C15;

fn hash(key: u64) -> u64 {
    key.wrapping_mul(FIBONACCI)
}

impl KeyTable {
    fn mask(&self) -> usize {
        self.tags.len() - 1
    }

    /// The bucket a key's probe run starts at. Only called on a non-empty table.
    fn home(&self, key: u64) -> usize {
        (hash(key) >> self.shift) as usize
    }

    /// Seven hash bits below the ones [`home`](Self::home) uses (tables stay far below 2^56
    /// buckets), with the top bit set so a used tag is never [`FREE`].
    fn tag(key: u64) -> u8 {
        (hash(key) >> 24) as u8 | 0x80
    }

    /// The entry of bucket `i`, a used one (its tag not [`FREE`]).
    #[inline]
    fn entry(&self, i: usize) -> (u64, u64) {
        debug_assert_ne!(self.tags[i], FREE, "only a used bucket is read");
        used_entry(&self.buckets[i])
    }

    /// The value of bucket `i`, a used one, to change.
    #[inline]
    fn value_mut(&mut self, i: usize) -> &mut u64 {
        debug_assert_ne!(self.tags[i], FREE, "only a used bucket is changed");
        // SAFETY: as in `used_entry`.
        unsafe { &mut self.buckets[i].assume_init_mut().1 }
    }

    /// The bucket holding `key`, or the free bucket that ends its probe run.
    fn probe(&self, key: u64) -> (usize, bool) {
        let (tags, buckets) = self.arrays();
        search_run(tags, buckets, key, self.home(key))
    }

    /// The tag and bucket arrays as slices of exactly the table's bucket count: the form every
    /// probe run is searched over. Slicing both to `mask + 1` tells the compiler they have the
    /// same length, so a bucket read at a tag's index needs no bounds check of its own (over
    /// the whole arrays the rehash ran 1% more instructions under callgrind).
    #[inline(always)]
    fn arrays(&self) -> (&[u8], &[Bucket]) {
        let mask = self.mask();
        (&self.tags[..=mask], &self.buckets[..=mask])
    }

    /// For each key of `keys` in order, calls `visit(position, value)` until a key is absent or
    /// `visit` returns false.
    ///
    /// A long walk probes a random bucket per key: the walk starts loading the lines
    /// [`prefetch_run`](Self::prefetch_run) asks for, of the key [`PREFETCH_AHEAD`] positions
    /// ahead, so the cache misses of a long match overlap instead of queueing (a prefetch past
    /// the walk's end only costs the hint). The keys are drawn from the iterator that far ahead
    /// too, so a caller may produce them as the walk goes (chaining a prompt's keys from its
    /// content hashes) and still keep the misses overlapped: producing every key first wastes
    /// the work past the match, and producing them in chunks restarts the look-ahead at each
    /// chunk. At most [`PREFETCH_AHEAD`] keys are drawn past the one the walk stops at.
    pub fn walk(
        &self,
        keys: impl IntoIterator<Item = u64>,
        mut visit: impl FnMut(usize, u64) -> bool,
    ) {
        if self.tags.is_empty() {
            return;
        }
        // Keys drawn and asked for, not yet probed: positions `probed..drawn`, each at
        // `position % PENDING` (a power of two, so the index is a mask). As [`ahead`] over a
        // slice: the first keys at the start, then each step the key `PREFETCH_AHEAD` past the
        // one it probes.
        const PENDING: usize = (PREFETCH_AHEAD + 1).next_power_of_two();
        let mut pending = [0u64; PENDING];
        let mut keys = keys.into_iter().fuse();
        let (mut drawn, mut probed) = (0, 0);
        // The hints of `prefetch_run` written out over the arrays taken once as slices
        // (`arrays`) and read at masked indices, so the compiler drops their bounds checks;
        // each key's run is then searched over the same slices (`search_run`, as `probe`
        // does). Through `prefetch_run` and `probe` a lookup at 16 workers (whose
        // table sits in the cache, so the walk runs at the rate of its instructions) made 7%
        // more instructions (docs/performance.md, thirty-third part).
        let mask = self.mask();
        let (tags, buckets) = self.arrays();
        loop {
            while drawn <= probed + PREFETCH_AHEAD {
                let Some(key) = keys.next() else { break };
                let i = self.home(key) & mask;
                prefetch(&tags[i]);
                prefetch(&buckets[i]);
                prefetch(&buckets[(i + BUCKETS_PER_LINE) & mask]);
                pending[drawn % PENDING] = key;
                drawn += 1;
            }
            if probed == drawn {
                return;
            }
            let key = pending[probed % PENDING];
            let (i, found) = search_run(tags, buckets, key, self.home(key) & mask);
            if !found {
                return;
            }
            let (_, value) = used_entry(&buckets[i]);
            if !visit(probed, value) {
                return;
            }
            probed += 1;
        }
    }

    /// The bucket holding `key`, if any (the table may be empty).
    fn find(&self, key: u64) -> Option<usize> {
        if self.tags.is_empty() {
            return None;
        }
        let (i, found) = self.probe(key);
        found.then_some(i)
    }

    /// Asks the CPU to start loading `key`'s tag and bucket: what an insert reads and writes.
    #[inline]
    pub(super) fn prefetch(&self, key: u64) {
        self.prefetch_lines(key, 1);
    }

    /// As [`prefetch`](Self::prefetch), and also the cache line of buckets after the home
    /// bucket's: for reads that go past a key's home. A walk finds a key up to a few buckets
    /// beyond it, and a removal's backward shift reads the buckets after the removed one.
    /// Without this hint the first bucket read past a line's end waited for memory: a quarter
    /// of a removal's time in the peer benchmark at 16 workers. (Inserts do without it: asked
    /// there too, stored batches were no faster on that benchmark.)
    #[inline]
    pub(super) fn prefetch_run(&self, key: u64) {
        self.prefetch_lines(key, 2);
    }

    /// Asks for `key`'s tag and `lines` cache lines of buckets from its home bucket on.
    #[inline]
    fn prefetch_lines(&self, key: u64, lines: usize) {
        if !self.tags.is_empty() {
            let i = self.home(key);
            prefetch(&self.tags[i]);
            for line in 0..lines {
                prefetch(&self.buckets[(i + line * BUCKETS_PER_LINE) & self.mask()]);
            }
        }
    }

    pub fn get(&self, key: u64) -> Option<u64> {
        self.find(key).map(|i| self.entry(i).1)
    }

    /// The value of `key`, inserting `default` first if the key is absent. Always inlined, as
    /// [`insert`](Self::insert) is: a stored block's step (`EngineMap::store`).
    #[inline(always)]
    pub fn get_or_insert(&mut self, key: u64, default: u64) -> &mut u64 {
        self.reserve_one();
        let (i, found) = self.probe(key);
        if !found {
            self.put(i, key, default);
        }
        self.value_mut(i)
    }

    /// Sets `key` to `value`; returns the value it replaced. Always inlined: a stored block's
    /// step (`EngineMap::store`).
    #[inline(always)]
    pub fn insert(&mut self, key: u64, value: u64) -> Option<u64> {
        self.reserve_one();
        match self.probe(key) {
            (i, true) => Some(std::mem::replace(self.value_mut(i), value)),
            (i, false) => {
                self.put(i, key, value);
                None
            }
        }
    }

    fn put(&mut self, i: usize, key: u64, value: u64) {
        self.tags[i] = Self::tag(key);
        self.buckets[i].write((key, value));
        self.len += 1;
    }

    /// Removes `key`; returns its value.
    pub fn remove(&mut self, key: u64) -> Option<u64> {
        self.occupied(key).map(Occupied::remove)
    }

    /// `key`'s bucket, to read, change or empty with one probe; `None` if the key is absent.
    pub fn occupied(&mut self, key: u64) -> Option<Occupied<'_>> {
        let at = self.find(key)?;
        Some(Occupied { table: self, at })
    }

    /// Empties bucket `hole` and returns its value. The entries after it in its probe run shift
    /// back into the hole, so every remaining key stays reachable from its home bucket without
    /// a marker.
    fn remove_at(&mut self, mut hole: usize) -> u64 {
        let value = self.entry(hole).1;
        let mask = self.mask();
        let mut i = hole;
        loop {
            i = (i + 1) & mask;
            if self.tags[i] == FREE {
                break;
            }
            // The entry at `i` may fill the hole unless its home lies after the hole (cyclically,
            // in `(hole, i]`): moving it before its home would hide it from its own probe.
            let home = self.home(self.entry(i).0);
            let fills = i.wrapping_sub(home) & mask >= i.wrapping_sub(hole) & mask;
            // Whether it fills the hole is a coin toss to the branch predictor, so it is chosen
            // without a branch: the entry is copied into the hole either way, and the hole only
            // moves on to `i` when the entry may fill it. When it may not, the copy is harmless:
            // nothing reads the hole until a later entry is copied over it or the loop frees it.
            self.tags[hole] = self.tags[i];
            self.buckets[hole] = self.buckets[i];
            hole = select_unpredictable(fills, i, hole);
        }
        self.tags[hole] = FREE;
        self.len -= 1;
        if self.tags.len() > MIN_BUCKETS && self.len * MIN_LOAD.1 < self.tags.len() * MIN_LOAD.0 {
            self.resize(self.tags.len() / 2);
        }
        value
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Every `(key, value)`, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.tags
            .iter()
            .enumerate()
            .filter(|(_, &t)| t != FREE)
            .map(|(i, _)| self.entry(i))
    }

    /// Room for `additional` more entries without growing, made at once: a table restored from
    /// a snapshot knows how many entries it will hold, where inserting them one by one would
    /// double its way there, rehashing everything it held at each step (and writing about twice
    /// its final size into new arrays).
    pub fn reserve(&mut self, additional: usize) {
        let needed = self.len.saturating_add(additional);
        if needed.saturating_mul(MAX_LOAD.1) > self.tags.len() * MAX_LOAD.0 {
            // The smallest table holding `needed` entries at `MAX_LOAD`: the size the doublings
            // would have reached.
            let buckets = needed
                .checked_mul(MAX_LOAD.1)
                .expect("table size overflows")
                .div_ceil(MAX_LOAD.0)
                .next_power_of_two()
                .max(MIN_BUCKETS);
            self.resize(buckets);
        }
    }

    /// Room for one more entry: a comparison, inlined into each insert; the growth itself is
    /// rare and out of line.
    #[inline(always)]
    fn reserve_one(&mut self) {
        let buckets = self.tags.len();
        if (self.len + 1) * MAX_LOAD.1 > buckets * MAX_LOAD.0 {
            self.resize((buckets * 2).max(MIN_BUCKETS));
        }
    }

    #[cold]
    #[inline(never)]
    fn resize(&mut self, buckets: usize) {
        debug_assert!(buckets.is_power_of_two() && self.len * MAX_LOAD.1 <= buckets * MAX_LOAD.0);
        #[cfg(test)]
        RESIZES.with(|n| n.set(n.get() + 1));
        // A doubling of a mapped bucket array happens where it lies; anything else (halving, a
        // size reserved at once, an array not yet a mapping) is copied into new arrays.
        if buckets == 2 * self.tags.len() && self.buckets.is_mapping() {
            self.double_in_place();
            return;
        }
        // FREE is zero: a zeroed tag array is all free.
        let old_tags = std::mem::replace(&mut self.tags, TableArray::zeroed(buckets));
        let old = std::mem::replace(&mut self.buckets, TableArray::unwritten(buckets));
        self.shift = 64 - buckets.trailing_zeros();
        let pages = self.buckets.pages_worth_a_helper(0);
        with_pages_faulted_ahead(pages, Writes::Upwards, || self.rehash(&old_tags, &old));
    }

    /// Doubles the table where its buckets lie: the bucket array is lengthened
    /// ([`TableArray::lengthen`]: in place, for a mapping of its own), the tags are new, and
    /// every entry moves to its place in the doubled table, from the last old bucket down.
    /// A copying rehash writes a new array of twice the size; this touches only the new half
    /// for the first time (and the new tags, a sixteenth of the buckets' bytes), and first
    /// touches are what a doubling costs where the host is slow to hand out fresh memory
    /// (docs/performance.md, fifty-first part).
    ///
    /// An old entry not yet moved is marked by its old tag. Each marked entry probes from its
    /// new home for the first bucket not yet placed: free, the entry moves there; marked, the
    /// two swap and the entry that came back is placed next; its own bucket, it stays. A placed
    /// entry never moves again and every bucket between its home and it was placed before it,
    /// so every key stays reachable from its home, as in a table rebuilt from scratch. Going
    /// down, an entry's new home (about twice its old bucket) mostly lies in the part of the
    /// array already passed or new, so swaps are rare and the reads and writes both run
    /// downwards in order.
    ///
    /// The pass writes the new half in its first half, from the top down, so a helper thread
    /// faults the new half in from its start up meanwhile ([`with_pages_faulted_ahead`]): a
    /// table grown to 2^21 buckets from a new process spent about half as long in these
    /// doublings with it (docs/performance.md, fifty-second part).
    fn double_in_place(&mut self) {
        let old_len = self.tags.len();
        self.buckets.lengthen(2 * old_len);
        let moving = std::mem::replace(&mut self.tags, TableArray::zeroed(2 * old_len));
        self.shift -= 1;
        let new_half = self.buckets.pages_worth_a_helper(old_len);
        with_pages_faulted_ahead(new_half, Writes::Downwards, || self.place_downwards(moving));
    }

    /// [`double_in_place`](Self::double_in_place)'s pass: places every entry `moving` marks,
    /// from the last old bucket down.
    fn place_downwards(&mut self, mut moving: TableArray<u8>) {
        let old_len = moving.len();
        let mask = self.mask();
        for i in (0..old_len).rev() {
            while moving[i] != FREE {
                let (key, value) = used_entry(&self.buckets[i]);
                let mut j = self.home(key);
                while self.tags[j] != FREE {
                    j = (j + 1) & mask;
                }
                self.tags[j] = moving[i];
                if j == i {
                    moving[i] = FREE;
                } else if j >= old_len || moving[j] == FREE {
                    self.buckets[j].write((key, value));
                    moving[i] = FREE;
                } else {
                    self.buckets.swap(i, j);
                    moving[i] = moving[j];
                    moving[j] = FREE;
                }
            }
        }
    }

    /// Moves every used entry of `old_tags` and `old` into this table's new arrays, in bucket
    /// order, so the new buckets are written from the start of their array to its end.
    fn rehash(&mut self, old_tags: &[u8], old: &[Bucket]) {
        for (&tag, entry) in old_tags.iter().zip(old.iter()) {
            if tag != FREE {
                let (key, value) = used_entry(entry);
                // Tag by tag: moved in bucket order into a table at most 3/8 full, an entry
                // nearly always lands at its home or just past the entry moved before it, so
                // the first tag's test predicts well and costs less than a group's (apply at
                // 1,024 workers fell from 1.18× kv-index's rate to 0.98× with groups here too:
                // docs/performance.md, thirty-seventh part).
                let (tags, buckets) = self.arrays();
                let (i, _) = search_run_tag_by_tag(tags, buckets, key, self.home(key));
                self.tags[i] = tag;
                self.buckets[i].write((key, value));
            }
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Resizes made on this thread, for tests that count a restore's.
    static RESIZES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Resizes of every table `f` makes on this thread.
#[cfg(test)]
pub(super) fn resizes_in(f: impl FnOnce()) -> usize {
    let before = RESIZES.with(|n| n.get());
    f();
    RESIZES.with(|n| n.get()) - before
}

/// A held key's bucket ([`KeyTable::occupied`]): its value changed in place, or the key removed,
/// without probing for it again.
pub struct Occupied<'a> {
    table: &'a mut KeyTable,
    at: usize,
}

impl Occupied<'_> {
    /// The key's value, to read or change in place.
    pub fn value(&mut self) -> &mut u64 {
        self.table.value_mut(self.at)
    }

    /// Removes the key; returns its value.
    pub fn remove(self) -> u64 {
        self.table.remove_at(self.at)
    }
}

/// Serialized as a map, exactly as the `FxHashMap<u64, u64>` it replaced, so snapshots written
/// before it still load.
impl Serialize for KeyTable {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.len()))?;
        for (k, v) in self.iter() {
            map.serialize_entry(&k, &v)?;
        }
        map.end()
    }
}

/// The most entries a decoded table makes room for before it reads them (2,097,152, in 68 MiB of
/// arrays: the owner table of a snapshot of 2M blocks); a larger table grows as it fills past
/// them, and a damaged length costs no more than that before the decode fails.
const MAX_PRESIZED_ENTRIES: usize = 1 << 21;

impl<'de> Deserialize<'de> for KeyTable {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TableVisitor;
        impl<'de> Visitor<'de> for TableVisitor {
            type Value = KeyTable;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of u64 to u64")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<KeyTable, A::Error> {
                let mut table = KeyTable::default();
                // Sized once for the entries the map says it holds, up to a bound: a damaged
                // length then costs at most that much memory before the entries run out.
                table.reserve(access.size_hint().unwrap_or(0).min(MAX_PRESIZED_ENTRIES));
                while let Some((k, v)) = access.next_entry::<u64, u64>()? {
                    table.insert(k, v);
                }
                Ok(table)
            }
        }
        deserializer.deserialize_map(TableVisitor)
    }
}

#[cfg(test)]
mod tests;
