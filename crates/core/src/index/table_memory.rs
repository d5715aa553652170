//! Zeroed arrays for [`KeyTable`](super::key_table::KeyTable)'s tags and buckets, on huge pages
//! when they are large, and grown where they lie.
//!
//! A probe of the owner table lands on a random bucket of tens of megabytes. With the kernel's
//! 4 KiB pages nearly every such probe also misses the TLB, and the page walk is a cache miss of
//! its own, which a prefetch hides badly (a prefetch that misses the TLB stalls the core on some
//! CPUs). An array of at least [`HUGE_PAGE`] bytes is therefore a mapping of its own, on a
//! huge-page boundary, marked `MADV_HUGEPAGE` before it is first written, so it faults in as
//! 2 MiB pages (fresh anonymous memory reads as zero: no zeroing pass).
//!
//! Such an array also grows where it lies ([`TableArray::grow`]): the kernel moves its pages to
//! a larger mapping (`mremap`) instead of the table faulting in a new array twice the size and
//! copying itself over. A table that only grows then faults in each page once, where doubling
//! into fresh arrays faulted in twice its final size; clearing those fresh pages was the largest
//! part of a stored batch's time while the tables grow (docs/performance.md, Round 5, nineteenth
//! part). The hints are hints: where the kernel declines huge pages (transparent huge pages off)
//! the mapping is the same memory on small pages; off Linux every array comes from the global
//! allocator and grows by copying.
//!
//! Mapped arrays bypass the global allocator, so [`mapped_table_bytes`] counts them: memory
//! figures add it to the allocator's live bytes.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Arrays at least this large are mappings of their own, aligned to it, offered huge pages.
const HUGE_PAGE: usize = 2 << 20;

/// Bytes of table arrays mapped outside the global allocator, process-wide.
static MAPPED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Bytes of the index's large table arrays, which are mapped outside the global allocator (so
/// an allocator's count of live bytes misses them): a memory figure is the allocator's live
/// bytes plus these. Zero off Linux, where every array comes from the allocator.
pub fn mapped_table_bytes() -> usize {
    MAPPED_BYTES.load(Ordering::Relaxed)
}

/// Element types whose all-zero bytes are a valid value and that need no drop.
///
/// # Safety
/// Implementors must be plain data for which every all-zero bit pattern is a valid value.
pub(super) unsafe trait Zeroable: Copy {}

// SAFETY: integers and tuples of integers: zero is a value, nothing to drop.
unsafe impl Zeroable for u8 {}
// SAFETY: as above.
unsafe impl Zeroable for (u64, u64) {}

/// A fixed-length, zero-initialised array owned like a `Box<[T]>`.
pub(super) struct TableArray<T: Zeroable> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the array owns its elements exclusively, as a `Box<[T]>` does.
unsafe impl<T: Zeroable + Send> Send for TableArray<T> {}
// SAFETY: shared access only hands out `&[T]`.
unsafe impl<T: Zeroable + Sync> Sync for TableArray<T> {}

/// Where an array of a given size lives.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Backing {
    /// No bytes: a dangling pointer, nothing to free.
    None,
    /// The global allocator.
    Heap(Layout),
    /// A mapping of its own ([`mapping`]), huge-page aligned; this many bytes, a multiple of
    /// [`HUGE_PAGE`].
    Mapped(usize),
}

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
        let ptr = match Self::backing(len) {
            Backing::None => NonNull::dangling(),
            // SAFETY: the layout has a non-zero size.
            Backing::Heap(layout) => non_null(unsafe { alloc::alloc_zeroed(layout) }, layout),
            // Fresh anonymous memory reads as zero.
            Backing::Mapped(bytes) => mapping::map(bytes).cast(),
        };
        TableArray { ptr, len }
    }

    /// Lengthens the array to `len` elements (at least its length): the elements it holds stay
    /// where they are in it, the new ones are zero. A mapped array is moved by the kernel
    /// ([`mapping::remap`]), its pages kept; one from the allocator is reallocated (extended
    /// where it lies when the allocator can) and its new elements zeroed; one that becomes large
    /// enough to map is copied into its mapping.
    pub(super) fn grow(&mut self, len: usize) {
        assert!(len >= self.len, "an array grows, never shrinks");
        let old_len = self.len;
        match (Self::backing(old_len), Self::backing(len)) {
            (Backing::Mapped(old_bytes), Backing::Mapped(new_bytes)) => {
                self.ptr = mapping::remap(self.ptr.cast(), old_bytes, new_bytes).cast();
            }
            (Backing::Heap(layout), Backing::Heap(grown)) => {
                // SAFETY: allocated by the global allocator with `layout` (`zeroed`, or an
                // earlier `grow`); the new size is non-zero and keeps the alignment.
                let raw = unsafe { alloc::realloc(self.ptr.as_ptr().cast(), layout, grown.size()) };
                self.ptr = non_null(raw, grown);
                // SAFETY: the reallocation has room for `len` elements and holds the first
                // `old_len`; zero is a valid `T` (`Zeroable`).
                unsafe { self.ptr.as_ptr().add(old_len).write_bytes(0, len - old_len) };
            }
            _ => {
                let mut grown = Self::zeroed(len);
                grown[..old_len].copy_from_slice(self);
                *self = grown;
                return;
            }
        }
        self.len = len;
    }

    /// Where `len` elements live: none, the allocator below a huge page, their own mapping from
    /// one (on Linux).
    fn backing(len: usize) -> Backing {
        let bytes = len
            .checked_mul(size_of::<T>())
            .expect("table size overflows");
        if bytes == 0 {
            Backing::None
        } else if bytes >= HUGE_PAGE && mapping::AVAILABLE {
            // Whole huge pages (table arrays are powers of two: already so).
            Backing::Mapped(bytes.next_multiple_of(HUGE_PAGE))
        } else {
            Backing::Heap(Layout::from_size_align(bytes, align_of::<T>()).expect("table layout"))
        }
    }
}

/// `raw` as a pointer, or the allocator's out-of-memory handling for `layout`.
fn non_null<T>(raw: *mut u8, layout: Layout) -> NonNull<T> {
    match NonNull::new(raw.cast::<T>()) {
        Some(ptr) => ptr,
        None => alloc::handle_alloc_error(layout),
    }
}

impl<T: Zeroable> Drop for TableArray<T> {
    fn drop(&mut self) {
        match Self::backing(self.len) {
            Backing::None => {}
            // SAFETY: allocated by the global allocator with this same layout (`zeroed`).
            Backing::Heap(layout) => unsafe { alloc::dealloc(self.ptr.as_ptr().cast(), layout) },
            Backing::Mapped(bytes) => mapping::unmap(self.ptr.cast(), bytes),
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
/// waits), encoded on the snapshot thread and dropped: a new array with the elements copied in.
impl<T: Zeroable> Clone for TableArray<T> {
    fn clone(&self) -> Self {
        let mut copy = Self::zeroed(self.len);
        copy.copy_from_slice(self);
        copy
    }
}

/// Mappings of their own for large arrays: `mmap`, `mremap` and `munmap` of private anonymous
/// memory, on huge-page boundaries. Only on glibc Linux targets (the release image is one),
/// where `libc` names every call used.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod mapping {
    use std::ptr::{self, NonNull};
    use std::sync::atomic::Ordering;

    use super::{HUGE_PAGE, MAPPED_BYTES};

    pub(super) const AVAILABLE: bool = true;

    /// `bytes` (a multiple of [`HUGE_PAGE`]) of fresh zero memory on a huge-page boundary,
    /// marked for huge pages before anything touches it.
    pub(super) fn map(bytes: usize) -> NonNull<u8> {
        let start = aligned_range(bytes, libc::PROT_READ | libc::PROT_WRITE);
        advise_huge_pages(start, bytes);
        MAPPED_BYTES.fetch_add(bytes, Ordering::Relaxed);
        start
    }

    /// Moves the mapping of `old_bytes` at `old` to a huge-page-aligned mapping of `new_bytes`:
    /// the kernel moves the page tables (a huge page as one entry), so the held bytes are
    /// neither copied nor faulted in again; the bytes past `old_bytes` are fresh zero memory.
    /// The old range is gone afterwards.
    pub(super) fn remap(old: NonNull<u8>, old_bytes: usize, new_bytes: usize) -> NonNull<u8> {
        // A reservation (no access, no memory) picks an aligned destination; the move replaces
        // it. An unaligned destination would split the huge pages the move carries.
        let dest = aligned_range(new_bytes, libc::PROT_NONE);
        // SAFETY: `old` is one live mapping of ours of `old_bytes`, and `dest` a reservation of
        // ours of `new_bytes`, apart from it: nothing else refers to either.
        let moved = unsafe {
            libc::mremap(
                old.as_ptr().cast(),
                old_bytes,
                new_bytes,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                dest.as_ptr().cast::<libc::c_void>(),
            )
        };
        if moved == libc::MAP_FAILED {
            // The reservation is still there: make it memory and copy.
            unmap_range(dest, new_bytes);
            let grown = map(new_bytes);
            // SAFETY: two live mappings of ours, apart, each at least `old_bytes` long.
            unsafe { ptr::copy_nonoverlapping(old.as_ptr(), grown.as_ptr(), old_bytes) };
            unmap(old, old_bytes);
            return grown;
        }
        advise_huge_pages(dest, new_bytes);
        MAPPED_BYTES.fetch_add(new_bytes - old_bytes, Ordering::Relaxed);
        dest
    }

    /// Unmaps an array's mapping of `bytes`.
    pub(super) fn unmap(start: NonNull<u8>, bytes: usize) {
        unmap_range(start, bytes);
        MAPPED_BYTES.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// A new private anonymous mapping of `bytes` with `protection`, starting on a huge-page
    /// boundary: a huge page more is mapped, and the ends outside the aligned range unmapped.
    fn aligned_range(bytes: usize, protection: libc::c_int) -> NonNull<u8> {
        let padded = bytes + HUGE_PAGE;
        // SAFETY: a new anonymous mapping the kernel places; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                ptr::null_mut(),
                padded,
                protection,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            let layout = std::alloc::Layout::from_size_align(bytes, HUGE_PAGE).expect("layout");
            std::alloc::handle_alloc_error(layout);
        }
        let raw = raw as usize;
        let start = raw.next_multiple_of(HUGE_PAGE);
        let head = start - raw;
        let pointer = |address: usize| NonNull::new(address as *mut u8).expect("mapped");
        if head > 0 {
            unmap_range(pointer(raw), head);
        }
        if HUGE_PAGE - head > 0 {
            unmap_range(pointer(start + bytes), HUGE_PAGE - head);
        }
        pointer(start)
    }

    fn unmap_range(start: NonNull<u8>, bytes: usize) {
        // SAFETY: the range is (part of) a mapping of ours that nothing refers to any more.
        let unmapped = unsafe { libc::munmap(start.as_ptr().cast(), bytes) };
        debug_assert_eq!(unmapped, 0, "munmap of our own mapping");
    }

    /// `MADV_HUGEPAGE`: fault the range in as huge pages. A hint: a kernel without transparent
    /// huge pages declines, and the memory stays on small pages.
    fn advise_huge_pages(start: NonNull<u8>, bytes: usize) {
        // SAFETY: the range is one live mapping of ours; the advice changes how the kernel
        // backs it, never its contents.
        unsafe {
            libc::madvise(start.as_ptr().cast(), bytes, libc::MADV_HUGEPAGE);
        }
    }
}

/// Off glibc Linux every array comes from the global allocator; nothing is mapped.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod mapping {
    use std::ptr::NonNull;

    pub(super) const AVAILABLE: bool = false;

    pub(super) fn map(_bytes: usize) -> NonNull<u8> {
        unreachable!("no array is mapped off Linux")
    }

    pub(super) fn remap(_old: NonNull<u8>, _old_bytes: usize, _new_bytes: usize) -> NonNull<u8> {
        unreachable!("no array is mapped off Linux")
    }

    pub(super) fn unmap(_start: NonNull<u8>, _bytes: usize) {
        unreachable!("no array is mapped off Linux")
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
    fn an_array_grows_keeping_its_elements_and_zeroing_the_new_ones() {
        let per_huge_page = HUGE_PAGE / 16;
        // Empty to small, small to small, small to mapped, mapped to mapped (twice, as a
        // table doubles), and a length that is not a whole number of huge pages.
        for (from, to) in [
            (0, 5),
            (5, 1000),
            (1000, 2 * per_huge_page),
            (per_huge_page, 2 * per_huge_page),
            (2 * per_huge_page, 4 * per_huge_page),
            (per_huge_page + 3, 3 * per_huge_page + 1),
        ] {
            let mut array = TableArray::<(u64, u64)>::zeroed(from);
            for (i, e) in array.iter_mut().enumerate() {
                *e = (i as u64, !(i as u64));
            }
            array.grow(to);
            assert_eq!(array.len(), to);
            assert!(
                array[..from]
                    .iter()
                    .enumerate()
                    .all(|(i, &e)| e == (i as u64, !(i as u64))),
                "growing {from} → {to} keeps every element where it was"
            );
            assert!(
                array[from..].iter().all(|&e| e == (0, 0)),
                "growing {from} → {to} adds zero elements"
            );
            if to >= per_huge_page {
                assert_eq!(
                    array.as_ptr() as usize % HUGE_PAGE,
                    0,
                    "a grown array a huge page long or more starts on a huge-page boundary"
                );
            }
        }
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn mapped_arrays_are_counted_while_they_live() {
        let bytes = 2 * HUGE_PAGE;
        let mut array = TableArray::<u8>::zeroed(bytes);
        assert!(
            mapped_table_bytes() >= bytes,
            "a mapped array's bytes are counted (other tests' arrays only add to the count)"
        );
        array.grow(2 * bytes);
        assert!(
            mapped_table_bytes() >= 2 * bytes,
            "a grown mapped array is counted at its new size"
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
        // Written as a table writes its buckets, then grown (the written pages move) and
        // written again: each time all of it sits on huge pages.
        let mut array = TableArray::<(u64, u64)>::zeroed(2 * HUGE_PAGE / 16);
        array.fill((1, 1));
        let huge_kib = huge_kib_of_mapping_at(array.as_ptr() as usize);
        assert!(
            huge_kib >= 2 * HUGE_PAGE as u64 / 1024,
            "with transparent huge pages `{mode}`, a written 4 MiB table array sits on huge pages \
             (its mapping has {huge_kib} KiB of them)"
        );
        array.grow(4 * HUGE_PAGE / 16);
        array.fill((2, 2));
        let huge_kib = huge_kib_of_mapping_at(array.as_ptr() as usize);
        assert!(
            huge_kib >= 4 * HUGE_PAGE as u64 / 1024,
            "with transparent huge pages `{mode}`, a table array grown to 8 MiB and written sits \
             on huge pages (its mapping has {huge_kib} KiB of them)"
        );
    }
}
