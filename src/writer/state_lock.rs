//! The lock around the writer's state, with its one ordering rule: **a gateway input waiting for
//! the state is served before any queued ingest input.**
//!
//! Gateway inputs (routes, releases, queries) run on the HTTP task that parsed them; ingest
//! inputs run on the writer thread. Ingest stands aside whenever a gateway input is waiting, and
//! checks again once it holds the lock, so a route waits for at most the one ingest input being
//! applied when it arrived (microseconds), never for the queue behind it.
//!
//! Async callers never block a runtime worker thread for long: they try the lock for a short
//! while (an ingest apply is microseconds) and otherwise wait on tokio's blocking pool, so a
//! long holder (the snapshot copy, tens of milliseconds) cannot stall `/healthz`, `/metrics` or
//! the NATS tasks that share the runtime.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use super::WriterGone;

/// How long an async gateway caller tries the lock on its own thread before it moves the wait to
/// the blocking pool. Longer than an ingest apply, far shorter than a snapshot copy.
const SPIN_ON_RUNTIME_THREAD: Duration = Duration::from_micros(200);

/// The state behind its lock (`None` once the writer has shut down), and how many gateway
/// callers are waiting for it.
pub struct StateLock<T> {
    state: Mutex<Option<T>>,
    gateway_waiting: AtomicUsize,
    /// Times ingest stood aside for a waiting gateway caller (what the tests watch).
    #[cfg(test)]
    stood_aside: AtomicUsize,
}

/// Counts a waiting gateway caller for as long as it lives.
struct GatewayWaiting<'a>(&'a AtomicUsize);

impl<'a> GatewayWaiting<'a> {
    fn register(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        GatewayWaiting(count)
    }
}

impl Drop for GatewayWaiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<T> StateLock<T> {
    pub fn new(state: T) -> Self {
        StateLock {
            state: Mutex::new(Some(state)),
            gateway_waiting: AtomicUsize::new(0),
            #[cfg(test)]
            stood_aside: AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, Option<T>>, WriterGone> {
        // A panic while applying poisons the lock: the writer is gone, as when its thread died.
        self.state.lock().map_err(|_| WriterGone)
    }

    /// Gateway callers waiting for the state now.
    pub fn gateway_waiting(&self) -> usize {
        self.gateway_waiting.load(Ordering::Acquire)
    }

    /// Runs `f` on the state for a gateway input, blocking this thread until the lock is free.
    /// Ingest stands aside while this waits.
    pub fn gateway_blocking<R>(&self, f: impl FnOnce(&mut T) -> R) -> Result<R, WriterGone> {
        let _waiting = GatewayWaiting::register(&self.gateway_waiting);
        let mut guard = self.lock()?;
        guard.as_mut().map(f).ok_or(WriterGone)
    }

    /// Runs `f` on the state for an ingest input: waits while any gateway input is waiting, and
    /// gives the lock back if one started waiting while this one was taking it.
    pub fn ingest<R>(&self, f: impl FnOnce(&mut T) -> R) -> Result<R, WriterGone> {
        loop {
            while self.gateway_waiting() > 0 {
                #[cfg(test)]
                self.stood_aside.fetch_add(1, Ordering::AcqRel);
                std::thread::yield_now();
            }
            let mut guard = self.lock()?;
            if self.gateway_waiting() > 0 {
                drop(guard);
                continue;
            }
            return guard.as_mut().map(f).ok_or(WriterGone);
        }
    }

    /// Takes the state out for good (shutdown): every later caller gets [`WriterGone`].
    pub fn take(&self) -> Option<T> {
        self.lock().ok().and_then(|mut guard| guard.take())
    }
}

impl<T: Send + 'static> StateLock<T> {
    /// [`StateLock::gateway_blocking`] for async callers: tries the lock briefly on this thread,
    /// then waits for it on the blocking pool instead of holding a runtime worker thread.
    pub async fn gateway<R, F>(self: &Arc<Self>, f: F) -> Result<R, WriterGone>
    where
        F: FnOnce(&mut T) -> R + Send + 'static,
        R: Send + 'static,
    {
        let waiting = GatewayWaiting::register(&self.gateway_waiting);
        let started = Instant::now();
        loop {
            match self.state.try_lock() {
                Ok(mut guard) => {
                    drop(waiting);
                    return guard.as_mut().map(f).ok_or(WriterGone);
                }
                Err(TryLockError::Poisoned(_)) => return Err(WriterGone),
                Err(TryLockError::WouldBlock) if started.elapsed() < SPIN_ON_RUNTIME_THREAD => {
                    std::thread::yield_now()
                }
                Err(TryLockError::WouldBlock) => break,
            }
        }
        // The count passes to the blocking task, so ingest stays aside until it is served.
        std::mem::forget(waiting);
        let this = self.clone();
        let task = tokio::task::spawn_blocking(move || {
            let _waiting = GatewayWaiting(&this.gateway_waiting);
            let mut guard = this.lock()?;
            guard.as_mut().map(f).ok_or(WriterGone)
        });
        task.await.map_err(|_| WriterGone)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// Polls `done` for up to 10 s.
    fn wait_until(what: &str, done: impl Fn() -> bool) {
        let started = Instant::now();
        while !done() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "timed out waiting until {what}"
            );
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_waiting_gateway_input_is_served_before_queued_ingest() {
        let lock = Arc::new(StateLock::new(Vec::<&'static str>::new()));
        // The writer is busy: this thread holds the state.
        let held = lock.state.lock().unwrap();
        let gateway = {
            let lock = lock.clone();
            std::thread::spawn(move || lock.gateway_blocking(|log| log.push("gateway")))
        };
        wait_until("the gateway input waits", || lock.gateway_waiting() == 1);
        let ingest_started = Arc::new(AtomicBool::new(false));
        let ingest = {
            let (lock, started) = (lock.clone(), ingest_started.clone());
            std::thread::spawn(move || {
                started.store(true, Ordering::Release);
                lock.ingest(|log| log.push("ingest"))
            })
        };
        wait_until("the ingest input is queued", || {
            ingest_started.load(Ordering::Acquire)
        });
        drop(held);
        gateway.join().unwrap().unwrap();
        ingest.join().unwrap().unwrap();
        assert_eq!(
            lock.take().unwrap(),
            ["gateway", "ingest"],
            "a gateway input waiting when the state frees up goes before queued ingest"
        );
    }

    #[test]
    fn ingest_that_took_the_lock_gives_it_back_to_a_waiting_gateway_input() {
        let lock = StateLock::new(0u32);
        // A gateway caller registered between ingest's check and its lock.
        let waiting = GatewayWaiting::register(&lock.gateway_waiting);
        std::thread::scope(|s| {
            let ingest = s.spawn(|| lock.ingest(|n| *n += 1));
            // Ingest cannot apply while the gateway caller waits: let it try many times.
            wait_until("ingest stood aside 1,000 times", || {
                lock.stood_aside.load(Ordering::Acquire) >= 1_000
            });
            assert_eq!(
                *lock.state.lock().unwrap(),
                Some(0),
                "no ingest input is applied while a gateway input waits"
            );
            drop(waiting);
            ingest.join().unwrap().unwrap();
        });
        assert_eq!(
            lock.take(),
            Some(1),
            "ingest runs once the gateway is served"
        );
    }

    // The test holds the lock across awaits on purpose: it plays a long holder (a snapshot copy).
    #[allow(clippy::await_holding_lock)]
    #[tokio::test(flavor = "current_thread")]
    async fn an_async_gateway_caller_waits_off_the_runtime_thread_for_a_long_holder() {
        let lock = Arc::new(StateLock::new(0u32));
        let held = lock.state.lock().unwrap();
        let route = tokio::spawn({
            let lock = lock.clone();
            async move { lock.gateway(|n| *n + 1).await }
        });
        // With one runtime thread, this task only runs if the route is not blocking it.
        let ticked = tokio::spawn(async { "the runtime kept running" });
        assert_eq!(ticked.await.unwrap(), "the runtime kept running");
        assert_eq!(
            lock.gateway_waiting(),
            1,
            "the route still counts as waiting while it waits on the blocking pool"
        );
        drop(held);
        assert_eq!(route.await.unwrap().unwrap(), 1);
        assert_eq!(lock.gateway_waiting(), 0);
    }

    #[test]
    fn after_take_every_caller_is_told_the_writer_is_gone() {
        let lock = StateLock::new(1u32);
        assert_eq!(lock.take(), Some(1));
        assert!(lock.gateway_blocking(|n| *n).is_err());
        assert!(lock.ingest(|n| *n).is_err());
    }
}
