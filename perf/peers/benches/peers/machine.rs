//! What a random access to memory costs on this machine, measured after the rows have run: the
//! figure a long match pays per block. A walk probes one random bucket per block of a table of
//! tens of megabytes, and on a virtual machine that figure moves with the host, so a run that
//! states it can be read beside runs on other machines (docs/performance.md, the forty-eighth
//! part).

use std::alloc::{self, Layout};
use std::fmt;
use std::time::Instant;

use kvrouted::prefetch::prefetch;

use crate::workload::mix;

/// The array the probe reads: about kvrouted's whole index at 256 workers (71 MB), twice the
/// last-level cache of the machines measured, so most reads miss it.
const PROBE_BYTES: usize = 64 << 20;
/// Huge-page size and alignment, as kvrouted's large tables are allocated.
const HUGE_PAGE: usize = 2 << 20;
/// Lines a random read asks for ahead of the one it reads, as the index's walk does with keys.
const AHEAD: usize = 8;

/// What [`probe_memory`] measured.
pub(crate) struct MemoryProbe {
    /// A load that waits on the one before it, in ns: the memory's latency.
    pub(crate) dependent_ns: f64,
    /// A random line among independent ones asked for [`AHEAD`] lines ahead, in ns: what
    /// overlapping the misses buys.
    pub(crate) independent_ns: f64,
    /// How much of the array the kernel backed with huge pages, in MiB (a walk over small pages
    /// also waits on the TLB).
    pub(crate) huge_page_mib: u64,
}

/// The line the run prints, with the probe's own size and look-ahead.
impl fmt::Display for MemoryProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "memory, probed after the rows ({} of its {} MiB on huge pages): a load that waits on \
             the one before it {:.0} ns, a random line among independent ones asked for {AHEAD} \
             ahead {:.1} ns",
            self.huge_page_mib,
            PROBE_BYTES >> 20,
            self.dependent_ns,
            self.independent_ns
        )
    }
}

/// Reads [`PROBE_BYTES`] of lines on huge pages where the kernel gives them: first along one
/// random cycle through every line (each load's address is the load before it), then at random
/// independent lines.
pub(crate) fn probe_memory() -> MemoryProbe {
    let lines = PROBE_BYTES / 64;
    let layout = Layout::from_size_align(PROBE_BYTES, HUGE_PAGE).expect("a valid layout");
    let huge_before = anon_huge_pages_kib();
    // SAFETY: the layout's size is not zero. Every line is written (below) before it is read,
    // and the array is freed with the same layout.
    let base = unsafe { alloc::alloc(layout) };
    assert!(!base.is_null(), "{PROBE_BYTES} bytes for the memory probe");
    #[cfg(target_os = "linux")]
    // SAFETY: a hint over memory this function owns, given before it is first written.
    unsafe {
        libc::madvise(base.cast(), PROBE_BYTES, libc::MADV_HUGEPAGE);
    }
    // SAFETY: `base` holds `lines` 64-byte lines, aligned to 2 MiB; written before they are read.
    let line = |i: usize| unsafe { base.add(i * 64).cast::<u64>() };
    // Random numbers as the stream's hashes are made: the workload's mix of a counter.
    let mut counter = 0u64;
    let mut next = move || {
        counter += 1;
        mix(counter)
    };
    // One cycle through every line (Sattolo's shuffle), written as each line's next line.
    let mut order: Vec<usize> = (0..lines).collect();
    for i in (1..lines).rev() {
        let j = (next() % i as u64) as usize;
        order.swap(i, j);
    }
    for (k, &from) in order.iter().enumerate() {
        // SAFETY: `from` and its successor are lines of the array.
        unsafe { line(from).write(order[(k + 1) % lines] as u64) };
    }
    let huge_page_mib = anon_huge_pages_kib().saturating_sub(huge_before) / 1024;
    let loads = 2_000_000;
    let mut at = order[0];
    let t = Instant::now();
    for _ in 0..loads {
        // SAFETY: every line holds the index of another line, written above.
        at = unsafe { line(at).read() } as usize;
    }
    let dependent_ns = t.elapsed().as_nanos() as f64 / loads as f64;
    std::hint::black_box(at);
    let targets: Vec<usize> = (0..4_000_000).map(|_| next() as usize % lines).collect();
    let mut sum = 0u64;
    let t = Instant::now();
    for (k, &i) in targets.iter().enumerate() {
        if let Some(&ahead) = targets.get(k + AHEAD) {
            prefetch(line(ahead).cast_const());
        }
        // SAFETY: `i` is a line of the array, written above.
        sum = sum.wrapping_add(unsafe { line(i).read() });
    }
    let independent_ns = t.elapsed().as_nanos() as f64 / targets.len() as f64;
    std::hint::black_box(sum);
    // SAFETY: allocated above with this layout, and no reference to it outlives this call.
    unsafe { alloc::dealloc(base, layout) };
    MemoryProbe {
        dependent_ns,
        independent_ns,
        huge_page_mib,
    }
}

/// The process's anonymous memory on huge pages, in KiB (0 where the kernel does not say).
fn anon_huge_pages_kib() -> u64 {
    std::fs::read_to_string("/proc/self/smaps_rollup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("AnonHugePages:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}
