//! Asking the CPU to start loading memory a loop will read soon, so that the cache misses of
//! many reads overlap instead of queueing (the index's probes).

/// Starts loading the cache line that holds `addr`. A hint: it reads nothing the program can
/// see, never faults (any address will do, even one past an allocation), and does nothing on
/// other architectures.
#[inline]
pub fn prefetch<T>(addr: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` needs SSE, which every x86-64 CPU has; a prefetch never faults
    // and changes no memory.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(addr.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}
