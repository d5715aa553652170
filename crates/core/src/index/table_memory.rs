//! Arrays for [`KeyTable`](super::key_table::KeyTable)'s tags (zeroed) and buckets (left
//! unwritten: a bucket is read only where its tag says it was written), on huge pages when they
//! are large.
//!
//! A probe of the owner table lands on a random bucket of tens of megabytes. With the kernel's
//! 4 KiB pages nearly every such probe also misses the TLB, and the page walk is a cache miss of
//! its own, which a prefetch hides badly (a prefetch that misses the TLB stalls the core on some
//! CPUs). An array of at least [`HUGE_PAGE`] bytes is therefore allocated on a huge-page
//! boundary, a whole number of huge pages long, and marked `MADV_HUGEPAGE` before it is first
//! written, so its memory faults in as 2 MiB pages. That is a hint: where the kernel declines
//! (transparent huge pages off) or off Linux, the array is the same memory on small pages.
//!
//! On Linux such an array is a mapping of its own rather than the allocator's (it is always
//! fresh memory, so it always faults in as huge pages), and a table's doubling lengthens its
//! bucket array where it lies ([`TableArray::lengthen`]): the kernel moves the old pages into
//! the longer mapping and only the new half is memory the table has not touched. A copying
//! doubling writes a whole new array of twice the size, so a table grown by doublings touched
//! twice its final size of fresh memory, and where the host is slow to hand out fresh memory
//! that was most of a stored block's time in a new process (docs/performance.md, fiftieth and
//! fifty-first parts). The mappings' bytes are counted in [`mapped_table_bytes`], which the
//! memory figures add to the allocator's.
//!
//! Each page a table's pass reaches for the first time faults in on the writer's thread. Where
//! the host is slow to hand out fresh memory, those faults were two fifths of a stored block's
//! time in a new process (docs/performance.md, fiftieth part), so a large range of fresh pages
//! is faulted in by a helper thread from the end the pass reaches last
//! ([`with_pages_faulted_ahead`]): a rehashed table's new bucket array (one that halves, one
//! sized at once by `reserve`, or one whose bucket array is not yet a mapping), written from
//! start to end, and a doubling in place's new half, written from end to start.

use std::alloc::{self, Layout};
use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Arrays at least this large are aligned to it and offered huge pages.
const HUGE_PAGE: usize = 2 << 20;

/// Arrays at least this large are mappings of their own, which a doubling lengthens where they
/// lie: those on huge pages, on Linux (elsewhere none, and a table always doubles by copying).
const MAPPED_BYTES: usize = if cfg!(target_os = "linux") {
    HUGE_PAGE
} else {
    usize::MAX
};

/// Bytes of every table array that is a mapping of its own, live now.
static MAPPED: AtomicUsize = AtomicUsize::new(0);

/// Bytes of the index's table arrays that are mappings of their own rather than the global
/// allocator's (those of a huge page or more, on Linux): what a memory figure that counts the
/// allocator's bytes adds to count every table.
pub fn mapped_table_bytes() -> usize {
    MAPPED.load(Ordering::Relaxed)
}

/// Ranges at least this large are faulted in by a helper thread as they are first written
/// ([`with_pages_faulted_ahead`]): four huge pages, so a helper is started only where it
/// has whole huge pages to fault while the writer works (a few times per table as it doubles
/// past it), not for the many small tables.
const HELPED_BYTES: usize = 4 * HUGE_PAGE;

/// Element types whose all-zero bytes are a valid value and that need no drop.
///
/// # Safety
/// Implementors must be plain data for which every all-zero bit pattern is a valid value.
pub(super) unsafe trait Zeroable: Copy {}

// SAFETY: an integer: zero is a value, nothing to drop.
unsafe impl Zeroable for u8 {}
// SAFETY: as above, for a pair of integers (the tests' stand-in for a written bucket array).
#[cfg(test)]
unsafe impl Zeroable for (u64, u64) {}
// SAFETY: any bytes, zero among them, are a `MaybeUninit`; a `Copy` type has nothing to drop.
unsafe impl<T: Copy> Zeroable for MaybeUninit<T> {}

/// A fixed-length array owned like a `Box<[T]>`: zero-initialised, or left unwritten where the
/// element type is a `MaybeUninit` ([`TableArray::unwritten`]).
pub(super) struct TableArray<T: Zeroable> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the array owns its elements exclusively, as a `Box<[T]>` does.
unsafe impl<T: Zeroable + Send> Send for TableArray<T> {}
// SAFETY: shared access only hands out `&[T]`.
unsafe impl<T: Zeroable + Sync> Sync for TableArray<T> {}

impl<T: Zeroable> TableArray<T> {
    /// An array of no elements (no allocation).
    pub(super) fn empty() -> Self {
        TableArray {
            ptr: NonNull::dangling(),
            len: 0,
        }
    }

    /// `len` zeroed elements.
    pub(super) fn zeroed(len: usize) -> Self {
        Self::new(len, true)
    }

    /// `len` elements, zeroed when `zero` (otherwise the allocation as it comes, which only a
    /// `MaybeUninit` element type may be: [`TableArray::unwritten`]).
    fn new(len: usize, zero: bool) -> Self {
        let Some((raw, layout)) = Self::allocate(len) else {
            return Self::empty();
        };
        // A new mapping is zeroed already, by the kernel, as each page is first touched.
        if zero && !is_mapping(layout) {
            // SAFETY: `raw` is valid for `layout.size()` bytes; zero is a valid `T`
            // (`Zeroable`).
            unsafe { raw.as_ptr().cast::<u8>().write_bytes(0, layout.size()) };
        }
        TableArray { ptr: raw, len }
    }

    /// Uninitialised room for `len` elements, with the layout [`Drop`] frees it with (`None`
    /// for no bytes).
    fn allocate(len: usize) -> Option<(NonNull<T>, Layout)> {
        let layout = Self::layout(len)?;
        let raw = if is_mapping(layout) {
            map(layout.size())
        } else {
            // SAFETY: the layout has a non-zero size.
            unsafe { alloc::alloc(layout) }
        };
        match NonNull::new(raw.cast::<T>()) {
            Some(ptr) => Some((ptr, layout)),
            None => alloc::handle_alloc_error(layout),
        }
    }

    /// The allocation for `len` elements (`None` for no bytes): when at least a huge page long,
    /// huge-page aligned and a whole number of huge pages, so its advice covers whole huge
    /// pages (an advised range that ends inside one splits that huge page's range between two
    /// of the kernel's mappings) and a lengthened mapping starts on a huge page too.
    fn layout(len: usize) -> Option<Layout> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .expect("table size overflows");
        if bytes == 0 {
            return None;
        }
        let (bytes, align) = if bytes >= HUGE_PAGE {
            (bytes.next_multiple_of(HUGE_PAGE), HUGE_PAGE)
        } else {
            (bytes, align_of::<T>())
        };
        Some(Layout::from_size_align(bytes, align).expect("table layout"))
    }

    /// The memory of this array's elements from index `from` on, as plain numbers a helper
    /// thread may fault in ([`with_pages_faulted_ahead`]), when it is at least
    /// [`HELPED_BYTES`] long. It starts at the first huge page boundary from `from`'s element,
    /// so the helper's advice covers whole pages.
    pub(super) fn pages_worth_a_helper(&self, from: usize) -> Option<Pages> {
        let array = self.ptr.as_ptr() as usize;
        let end = array + self.len * size_of::<T>();
        let start = (array + from.min(self.len) * size_of::<T>()).next_multiple_of(HUGE_PAGE);
        (end.saturating_sub(start) >= HELPED_BYTES).then(|| Pages {
            start,
            bytes: end - start,
        })
    }
}

impl<T: Copy> TableArray<MaybeUninit<T>> {
    /// `len` elements not yet written: no zeroing pass. For arrays whose elements are only
    /// read where something else (a bucket's tag) says they were written. Zeroing a grown
    /// table's buckets was an eighth of a stored batch's time in the peer benchmark at 1,024
    /// workers, for bytes nobody reads (docs/performance.md, Round 5, nineteenth part).
    pub(super) fn unwritten(len: usize) -> Self {
        Self::new(len, false)
    }

    /// Whether this array is a mapping of its own, which [`lengthen`](Self::lengthen) grows
    /// where it lies.
    pub(super) fn is_mapping(&self) -> bool {
        Self::layout(self.len).is_some_and(is_mapping)
    }

    /// Lengthens the array to `len` elements (no fewer than it has): its elements stay at their
    /// indices and the rest are unwritten. A mapping of its own is lengthened where it lies:
    /// `mremap` moves its pages into a mapping of the new length on a huge-page boundary, so
    /// none is copied or touched again. Any other array (or a mapping the kernel will not move)
    /// is copied into a new one.
    pub(super) fn lengthen(&mut self, len: usize) {
        debug_assert!(len >= self.len, "an array is lengthened, not shortened");
        if let (Some(old), Some(new)) = (Self::layout(self.len), Self::layout(len)) {
            if is_mapping(old) {
                if let Some(moved) = remap(self.ptr.as_ptr().cast(), old.size(), new.size()) {
                    self.ptr = moved.cast();
                    self.len = len;
                    // The moved mapping is advised again, its new part with it: left to the
                    // advice it carried over, apply at 1,024 workers from a new process ran
                    // lower in four alternated pairs (docs/performance.md, fifty-first part).
                    advise(moved.as_ptr(), new.size(), Advice::HugePages);
                    return;
                }
            }
        }
        let mut longer = Self::unwritten(len);
        longer[..self.len].copy_from_slice(self);
        *self = longer;
    }
}

/// Whether an allocation of `layout` is a mapping of its own ([`MAPPED_BYTES`]).
fn is_mapping(layout: Layout) -> bool {
    layout.size() >= MAPPED_BYTES
}

/// A new anonymous mapping of `bytes` (a whole number of huge pages) on a huge-page boundary,
/// marked `MADV_HUGEPAGE` before anything touches it and counted in [`MAPPED`]; null where the
/// kernel refuses. The kernel places a mapping on a page boundary only, so one a huge page
/// longer is asked for and the slack on either side of the boundary given back.
#[cfg(target_os = "linux")]
fn map(bytes: usize) -> *mut u8 {
    // SAFETY: a new anonymous mapping, of which only the part from the boundary on is kept;
    // nothing else refers to the slack given back.
    let start = unsafe {
        let raw = libc::mmap(
            std::ptr::null_mut(),
            bytes + HUGE_PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if raw == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        let start = (raw as usize).next_multiple_of(HUGE_PAGE);
        let before = start - raw as usize;
        if before > 0 {
            libc::munmap(raw, before);
        }
        if before < HUGE_PAGE {
            libc::munmap((start + bytes) as *mut libc::c_void, HUGE_PAGE - before);
        }
        start as *mut u8
    };
    advise(start, bytes, Advice::HugePages);
    MAPPED.fetch_add(bytes, Ordering::Relaxed);
    start
}

/// Moves the mapping of `old_bytes` at `start` into a new one of `new_bytes` on a huge-page
/// boundary, its pages with it (`None`, and the mapping left where it is, where the kernel
/// refuses). The new place is made by [`map`] and `MREMAP_FIXED` replaces it; the kernel's own
/// choice of place (`MREMAP_MAYMOVE` alone) need not be on a huge-page boundary, and there the
/// moved huge pages would be split.
#[cfg(target_os = "linux")]
fn remap(start: *mut u8, old_bytes: usize, new_bytes: usize) -> Option<NonNull<u8>> {
    let target = NonNull::new(map(new_bytes))?;
    // SAFETY: `start` is a live mapping of `old_bytes` of ours, `target` a mapping of
    // `new_bytes` just made for it, which the move replaces; nothing refers to either but
    // the array being lengthened.
    let moved = unsafe {
        libc::mremap(
            start.cast(),
            old_bytes,
            new_bytes,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            target.as_ptr().cast::<libc::c_void>(),
        )
    };
    if moved == libc::MAP_FAILED {
        unmap(target.as_ptr(), new_bytes);
        return None;
    }
    MAPPED.fetch_sub(old_bytes, Ordering::Relaxed);
    Some(target)
}

/// Gives back a mapping of `bytes` made by [`map`] or [`remap`].
#[cfg(target_os = "linux")]
fn unmap(start: *mut u8, bytes: usize) {
    // SAFETY: a live mapping of ours of this length, which nothing refers to any more.
    unsafe { libc::munmap(start.cast(), bytes) };
    MAPPED.fetch_sub(bytes, Ordering::Relaxed);
}

// Off Linux no array is a mapping ([`MAPPED_BYTES`]), so these are never called.
#[cfg(not(target_os = "linux"))]
fn map(_bytes: usize) -> *mut u8 {
    std::ptr::null_mut()
}

#[cfg(not(target_os = "linux"))]
fn remap(_start: *mut u8, _old_bytes: usize, _new_bytes: usize) -> Option<NonNull<u8>> {
    None
}

#[cfg(not(target_os = "linux"))]
fn unmap(_start: *mut u8, _bytes: usize) {}

/// What [`advise`] tells the kernel about a range.
#[derive(Clone, Copy)]
enum Advice {
    /// Back the range with huge pages when it is faulted in (`MADV_HUGEPAGE`).
    HugePages,
    /// Fault the range's pages in as a write to each would, without writing them
    /// (`MADV_POPULATE_WRITE`, Linux 5.14).
    FaultIn,
}

/// Whether [`advise`] tells the kernel anything on this target.
const ADVICE_TAKES_EFFECT: bool = cfg!(all(target_os = "linux", target_env = "gnu"));

/// Gives the kernel `advice` about one live allocation of ours. Errors are ignored: a kernel
/// without the feature, or one that declines, leaves the memory as it was. Only on glibc
/// targets (the release image is one).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn advise(start: *mut u8, bytes: usize, advice: Advice) {
    let advice = match advice {
        Advice::HugePages => libc::MADV_HUGEPAGE,
        Advice::FaultIn => libc::MADV_POPULATE_WRITE,
    };
    // SAFETY: the range lies in one live allocation, page aligned (huge-page aligned, in
    // fact); these advices change how the kernel backs it, never its contents.
    unsafe {
        libc::madvise(start.cast(), bytes, advice);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn advise(_start: *mut u8, _bytes: usize, _advice: Advice) {}

/// A range of one array's memory: its address and length, not a reference to it, since the
/// writer keeps writing the array while a helper faults its pages in.
#[derive(Clone, Copy, Debug)]
pub(super) struct Pages {
    /// On a huge-page boundary ([`TableArray::pages_worth_a_helper`]).
    start: usize,
    bytes: usize,
}

impl Pages {
    /// The range's huge pages (the last one cut at the range's end) as `(from, to)` addresses,
    /// in the order a helper faults them in: from the end a pass writing as `writes` says
    /// reaches last.
    fn huge_pages_ahead_of(self, writes: Writes) -> impl Iterator<Item = (usize, usize)> {
        let (start, end) = (self.start, self.start + self.bytes);
        let count = self.bytes.div_ceil(HUGE_PAGE);
        (0..count).map(move |k| {
            let k = match writes {
                Writes::Upwards => count - 1 - k,
                Writes::Downwards => k,
            };
            let from = start + k * HUGE_PAGE;
            (from, (from + HUGE_PAGE).min(end))
        })
    }
}

/// Which way a pass writes an array's memory: a helper faults it in from the other end
/// ([`with_pages_faulted_ahead`]).
#[derive(Clone, Copy, Debug)]
pub(super) enum Writes {
    /// From the start towards the end (a copying rehash, which moves entries in bucket order).
    Upwards,
    /// From the end towards the start (a doubling in place, which moves entries from the last
    /// old bucket down, into the new half first).
    Downwards,
}

/// Runs `write`, a pass that writes `pages` in the direction `writes` says, while a helper
/// thread faults them in from the other end, a huge page at a time, until `write` returns or
/// the helper has crossed the range (past the pages the writer reached first, each costs it
/// only a look at the page table). The writer then finds the far part of its range already
/// backed by the kernel instead of faulting every page in itself: in a new process, where those
/// first touches were the slow part of a doubling, the two cores share them.
///
/// Faulting a page in changes nothing in it: the kernel backs a page that was never written
/// with zeros, and leaves a page the writer already reached as it is. So the helper needs no
/// other agreement with the writer than a flag to stop at, and a helper that cannot be started
/// leaves the writer to fault every page, as it did before.
pub(super) fn with_pages_faulted_ahead<R>(
    pages: Option<Pages>,
    writes: Writes,
    write: impl FnOnce() -> R,
) -> R {
    let Some(pages) = pages.filter(|_| ADVICE_TAKES_EFFECT) else {
        return write();
    };
    let written = AtomicBool::new(false);
    std::thread::scope(|scope| {
        // A helper that cannot be started is no error: the writer faults every page itself.
        let _ = std::thread::Builder::new()
            .name("kvrouted-pages".into())
            .spawn_scoped(scope, || {
                for (from, to) in pages.huge_pages_ahead_of(writes) {
                    if written.load(Ordering::Relaxed) {
                        break;
                    }
                    advise(from as *mut u8, to - from, Advice::FaultIn);
                }
            });
        let result = write();
        // The scope joins the helper as it ends: it stops at its next huge page.
        written.store(true, Ordering::Relaxed);
        result
    })
}

impl<T: Zeroable> Drop for TableArray<T> {
    fn drop(&mut self) {
        if let Some(layout) = Self::layout(self.len) {
            if is_mapping(layout) {
                unmap(self.ptr.as_ptr().cast(), layout.size());
                return;
            }
            // SAFETY: allocated in `allocate` (for `zeroed` or `clone`) with this same layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr().cast(), layout) }
        }
    }
}

impl<T: Zeroable> Deref for TableArray<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised elements (or dangles, aligned, for none).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> DerefMut for TableArray<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// Clones are the snapshot's temporary copy of the state, made under the state's lock (routing
/// waits), encoded on the snapshot thread and dropped. So a clone is copied straight into new
/// memory, without a zeroing pass: a new mapping still faults in as huge pages (fewer, cheaper
/// faults than 4 KiB ones).
impl<T: Zeroable> Clone for TableArray<T> {
    fn clone(&self) -> Self {
        let Some((raw, _)) = Self::allocate(self.len) else {
            return Self::empty();
        };
        // SAFETY: `raw` has room for `len` elements and is a new allocation, so the ranges do not
        // overlap; the source holds `len` initialised elements.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), raw.as_ptr(), self.len) };
        TableArray {
            ptr: raw,
            len: self.len,
        }
    }

    /// Copies `source` into this array's own memory when the lengths match, so a copy kept from
    /// one snapshot to the next is written over in place: no allocation, and no page of it
    /// faulted in again (the kernel clearing fresh pages was nearly all of a snapshot's pause).
    /// Otherwise a new clone, as [`Clone::clone`].
    fn clone_from(&mut self, source: &Self) {
        if self.len != source.len {
            *self = source.clone();
            return;
        }
        // SAFETY: both arrays hold `len` elements and are distinct allocations (`&mut self`
        // and `&Self` cannot alias); the source's elements are initialised.
        unsafe { std::ptr::copy_nonoverlapping(source.ptr.as_ptr(), self.ptr.as_ptr(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_array_starts_zeroed_and_keeps_what_is_written() {
        for len in [0, 1, 1000, HUGE_PAGE / 16 + 3] {
            let mut array = TableArray::<(u64, u64)>::zeroed(len);
            assert_eq!(array.len(), len);
            assert!(
                array.iter().all(|&e| e == (0, 0)),
                "a new array is all zero"
            );
            if len > 0 {
                array[len - 1] = (7, 9);
                let copy = array.clone();
                assert_eq!(copy[len - 1], (7, 9), "a clone holds what was written");
                assert_eq!(copy.len(), len);
            }
        }
    }

    #[test]
    fn a_lengthened_array_keeps_its_elements_and_a_mapping_its_huge_pages() {
        for len in [1000, HUGE_PAGE / 16, 2 * HUGE_PAGE / 16] {
            let mut array = TableArray::<MaybeUninit<(u64, u64)>>::unwritten(len);
            for (i, bucket) in array.iter_mut().enumerate() {
                bucket.write((i as u64, !(i as u64)));
            }
            array.lengthen(2 * len);
            assert_eq!(array.len(), 2 * len);
            // SAFETY: the first `len` elements were written above, and lengthening keeps them.
            let kept = array[..len].iter().map(|b| unsafe { b.assume_init() });
            assert!(
                (kept.enumerate()).all(|(i, b)| b == (i as u64, !(i as u64))),
                "a lengthened array of {len} elements keeps every one at its index"
            );
            if len * 16 < MAPPED_BYTES {
                continue;
            }
            assert!(
                array.is_mapping(),
                "an array of {len} elements is a mapping"
            );
            assert_eq!(
                array.as_ptr() as usize % HUGE_PAGE,
                0,
                "a lengthened mapping starts on a huge page"
            );
            assert!(
                mapped_table_bytes() >= 2 * len * 16,
                "a lengthened mapping's bytes are counted"
            );
            for bucket in array[len..].iter_mut().step_by(256) {
                bucket.write((1, 1));
            }
            if let Some(mode) = transparent_huge_pages().filter(|mode| mode != "never") {
                let huge_kib = huge_kib_of_mapping_at(array.as_ptr() as usize);
                assert!(
                    huge_kib >= (2 * len * 16 / 1024) as u64,
                    "with transparent huge pages `{mode}`, a mapping lengthened to {} KiB \
                     sits on huge pages, the pages it kept and the new ones (it has {huge_kib} \
                     KiB of them)",
                    2 * len * 16 / 1024
                );
            }
        }
    }

    #[test]
    fn a_copy_into_an_array_of_the_same_length_keeps_its_memory() {
        let mut source = TableArray::<u8>::zeroed(HUGE_PAGE + 5);
        source[HUGE_PAGE + 4] = 7;
        let mut kept = TableArray::<u8>::zeroed(HUGE_PAGE + 5);
        kept[0] = 9;
        let memory = kept.as_ptr();
        kept.clone_from(&source);
        assert_eq!(
            kept.as_ptr(),
            memory,
            "a copy into an array of the same length writes over its memory"
        );
        assert!(kept[..] == source[..], "and holds the source's elements");
        let mut shorter = TableArray::<u8>::zeroed(3);
        shorter.clone_from(&source);
        assert!(
            shorter[..] == source[..],
            "a copy into an array of another length is a new clone"
        );
    }

    #[test]
    fn a_huge_array_is_aligned_to_a_huge_page() {
        let array = TableArray::<u8>::zeroed(HUGE_PAGE);
        assert_eq!(
            array.as_ptr() as usize % HUGE_PAGE,
            0,
            "an array a huge page long starts on a huge-page boundary, so every page of it can be one"
        );
        let small = TableArray::<u8>::zeroed(HUGE_PAGE - 1);
        assert_eq!(small.len(), HUGE_PAGE - 1);
    }

    /// The kernel's transparent huge page mode (`always`, `madvise` or `never`), if it has one.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn transparent_huge_pages() -> Option<String> {
        let modes = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
        let start = modes.find('[')? + 1;
        let end = modes[start..].find(']')? + start;
        Some(modes[start..end].to_owned())
    }

    /// Huge-page memory the kernel reports for the mapping that holds `address`, in KiB.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn huge_kib_of_mapping_at(address: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split(' ').next().unwrap_or("");
            if let Some((from, to)) = range.split_once('-') {
                if let (Ok(from), Ok(to)) = (
                    usize::from_str_radix(from, 16),
                    usize::from_str_radix(to, 16),
                ) {
                    inside = (from..to).contains(&address);
                    continue;
                }
            }
            if let (true, Some(kib)) = (inside, line.strip_prefix("AnonHugePages:")) {
                return kib
                    .trim()
                    .trim_end_matches(" kB")
                    .parse()
                    .expect("a size in kB");
            }
        }
        0
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_huge_array_is_backed_by_huge_pages_where_the_kernel_offers_them() {
        let Some(mode) = transparent_huge_pages().filter(|mode| mode != "never") else {
            eprintln!("transparent huge pages are off here: nothing to check");
            return;
        };
        // Zeroed (by the kernel, as a new mapping's pages are first touched), then written
        // here and there, as a table's tags are.
        let mut array = TableArray::<(u64, u64)>::zeroed(2 * HUGE_PAGE / 16);
        for entry in array.iter_mut().step_by(256) {
            *entry = (1, 1);
        }
        let huge_kib = huge_kib_of_mapping_at(array.as_ptr() as usize);
        assert!(
            huge_kib >= 2 * HUGE_PAGE as u64 / 1024,
            "with transparent huge pages `{mode}`, a 4 MiB table array sits on huge pages \
             (its mapping has {huge_kib} KiB of them)"
        );
        drop(array);
        // Left unwritten, then written here and there, as a grown table's buckets are.
        let mut unwritten = TableArray::<MaybeUninit<(u64, u64)>>::unwritten(4 * HUGE_PAGE / 16);
        for bucket in unwritten.iter_mut().step_by(256) {
            bucket.write((1, 1));
        }
        let huge_kib = huge_kib_of_mapping_at(unwritten.as_ptr() as usize);
        assert!(
            huge_kib >= 4 * HUGE_PAGE as u64 / 1024,
            "with transparent huge pages `{mode}`, an 8 MiB table array left unwritten, then \
             written in places, sits on huge pages (its mapping has {huge_kib} KiB of them)"
        );
    }
    /// Whether the page holding `address` is resident (`mincore`).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn resident(address: usize) -> bool {
        // SAFETY: sysconf reads a constant of the system.
        let page_size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let page = address & !(page_size - 1);
        let mut flag = 0u8;
        // SAFETY: one page of a live mapping, one byte of result.
        let rc = unsafe { libc::mincore(page as *mut libc::c_void, page_size, &mut flag) };
        assert_eq!(rc, 0, "mincore of a live array");
        flag & 1 == 1
    }

    #[test]
    fn a_helper_starts_at_the_end_its_writer_reaches_last_and_covers_the_range_once() {
        let pages = Pages {
            start: 8 * HUGE_PAGE,
            bytes: 2 * HUGE_PAGE + 100,
        };
        let end = pages.start + pages.bytes;
        let upwards: Vec<_> = pages.huge_pages_ahead_of(Writes::Upwards).collect();
        let downwards: Vec<_> = pages.huge_pages_ahead_of(Writes::Downwards).collect();
        assert_eq!(
            upwards,
            [
                (10 * HUGE_PAGE, end),
                (9 * HUGE_PAGE, 10 * HUGE_PAGE),
                (8 * HUGE_PAGE, 9 * HUGE_PAGE)
            ],
            "a pass writing upwards has its range faulted in from the end down, in whole huge \
             pages"
        );
        assert_eq!(
            downwards,
            [
                (8 * HUGE_PAGE, 9 * HUGE_PAGE),
                (9 * HUGE_PAGE, 10 * HUGE_PAGE),
                (10 * HUGE_PAGE, end)
            ],
            "a pass writing downwards has its range faulted in from the start up"
        );
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_helper_faults_in_the_pages_the_writer_has_not_reached_and_changes_none() {
        // Two helped ranges of HELPED_BYTES each: the whole of an array written upwards, and
        // the back half of one twice as long written downwards (a doubling's new half).
        for (writes, len, from) in [
            (Writes::Upwards, HELPED_BYTES / 16, 0),
            (Writes::Downwards, HELPED_BYTES / 8, HELPED_BYTES / 16),
        ] {
            let mut array = TableArray::<MaybeUninit<(u64, u64)>>::unwritten(len);
            let (start, bytes) = (array.as_ptr() as usize, len * 16);
            // Whatever the allocator handed out, its pages are given back, so none is
            // resident. SAFETY: the array's own range; its elements are `MaybeUninit`, so
            // zeroed or dropped contents are allowed.
            unsafe { libc::madvise(start as *mut libc::c_void, bytes, libc::MADV_DONTNEED) };
            // The writer's first element, and the far end of the range from it.
            let (first, far) = match writes {
                Writes::Upwards => (from, start + bytes - 1),
                Writes::Downwards => (len - 1, start + from * 16),
            };
            assert!(!resident(far), "a page given back is not resident");
            array[first].write((7, 9));
            let pages = array.pages_worth_a_helper(from);
            assert!(
                pages.is_some_and(|p| p.start == start + from * 16 && p.bytes == HELPED_BYTES),
                "{HELPED_BYTES} bytes from element {from} are worth a helper: {pages:?}"
            );
            // The writer stays on its first page until the helper has reached the far one.
            let reached = with_pages_faulted_ahead(pages, writes, || {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
                while !resident(far) && std::time::Instant::now() < deadline {
                    std::thread::yield_now();
                }
                resident(far)
            });
            assert!(
                reached,
                "while the writer works {writes:?} from one end, the helper faults the other in"
            );
            // SAFETY: written above.
            let written = unsafe { array[first].assume_init() };
            assert_eq!(written, (7, 9), "faulting pages in leaves what was written");
        }
        let array = TableArray::<u8>::zeroed(HELPED_BYTES + 1);
        assert!(
            array.pages_worth_a_helper(0).is_some() && array.pages_worth_a_helper(1).is_none(),
            "a range shorter than {HELPED_BYTES} bytes from its first huge page on is left to \
             its writer"
        );
    }
}
