//! The lock around the writer's state, with its one ordering rule: **a gateway input waiting for
//! the state is served before any queued ingest input.**
//!
//! Gateway inputs (routes, releases, queries) run on the HTTP task that parsed them; ingest
//! inputs run on the writer thread. Ingest stands aside whenever a gateway input is waiting, and
//! checks again once it holds the lock, so a route waits for at most the one ingest input being
//! applied when it arrived (microseconds), never for the queue behind it.
//!
//! An async gateway caller that finds the state taken parks its task until the holder lets go,
//! and its runtime thread goes on parsing and hashing other requests meanwhile, instead of
//! spinning on a core the holder needs. A long holder (the snapshot copy, tens of milliseconds)
//! therefore never stalls `/healthz`, `/metrics` or the NATS tasks that share the runtime. The
//! lock itself is not handed over: whoever tries first once it is free takes it, so the state
//! never sits free while a woken task waits for its thread to run it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

use tokio::sync::Notify;

use super::WriterGone;

/// The state behind its lock (`None` once the writer has shut down), and how many gateway
/// callers are waiting for it.
pub struct StateLock<T> {
    state: Mutex<Option<T>>,
    /// Told each time a holder lets go; wakes one parked gateway caller to try again.
    freed: Notify,
    gateway_waiting: AtomicUsize,
    /// Times ingest stood aside for a waiting gateway caller (what the tests watch).
    #[cfg(test)]
    stood_aside: AtomicUsize,
}

/// Counts a waiting gateway caller for as long as it lives (a cancelled wait uncounts itself).
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

/// Wakes one parked gateway caller when dropped.
struct WakeOnDrop<'a>(&'a Notify);

impl Drop for WakeOnDrop<'_> {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

impl<T> StateLock<T> {
    pub fn new(state: T) -> Self {
        StateLock {
            state: Mutex::new(Some(state)),
            freed: Notify::new(),
            gateway_waiting: AtomicUsize::new(0),
            #[cfg(test)]
            stood_aside: AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, Option<T>>, WriterGone> {
        // A panic while applying poisons the lock: the writer is gone, as when its thread died.
        self.state.lock().map_err(|_| WriterGone)
    }

    /// Runs `f` on the held state, lets go of it and wakes a parked gateway caller, also when
    /// `f` panics (the woken caller then finds the lock poisoned: the writer is gone).
    fn run_and_release<R>(
        &self,
        guard: MutexGuard<'_, Option<T>>,
        f: impl FnOnce(&mut T) -> R,
    ) -> Result<R, WriterGone> {
        // Declared before the guard, so dropped after it: the wake follows the release.
        let _wake = WakeOnDrop(&self.freed);
        let mut guard = guard;
        guard.as_mut().map(f).ok_or(WriterGone)
    }

    /// Gateway callers waiting for the state now.
    pub fn gateway_waiting(&self) -> usize {
        self.gateway_waiting.load(Ordering::Acquire)
    }

    /// Runs the call in `f` (taking it out) if the state is free now; `None` if it is taken.
    fn try_gateway<R, F: FnOnce(&mut T) -> R>(
        &self,
        f: &mut Option<F>,
    ) -> Option<Result<R, WriterGone>> {
        let guard = match self.state.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(_)) => {
                // Passed on, so every parked caller learns the writer is gone.
                self.freed.notify_one();
                return Some(Err(WriterGone));
            }
            Err(TryLockError::WouldBlock) => return None,
        };
        let f = f.take().expect("a gateway call runs once");
        Some(self.run_and_release(guard, f))
    }

    /// Runs `f` on the state for a gateway input, parking this task while the state is taken.
    /// Ingest stands aside while this waits.
    pub async fn gateway<R>(&self, f: impl FnOnce(&mut T) -> R) -> Result<R, WriterGone> {
        let mut f = Some(f);
        let _waiting = GatewayWaiting::register(&self.gateway_waiting);
        loop {
            if let Some(result) = self.try_gateway(&mut f) {
                return result;
            }
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Registered before trying again, so a holder letting go in between wakes it.
            freed.as_mut().enable();
            if let Some(result) = self.try_gateway(&mut f) {
                return result;
            }
            freed.await;
        }
    }

    /// Runs `f` on the state for an ingest input, blocking this thread (never a runtime thread):
    /// waits while any gateway input is waiting, and gives the lock back if one started waiting
    /// while this one was taking it.
    pub fn ingest<R>(&self, f: impl FnOnce(&mut T) -> R) -> Result<R, WriterGone> {
        loop {
            while self.gateway_waiting() > 0 {
                #[cfg(test)]
                self.stood_aside.fetch_add(1, Ordering::AcqRel);
                std::thread::yield_now();
            }
            let guard = self.lock()?;
            if self.gateway_waiting() > 0 {
                self.release(guard);
                continue;
            }
            return self.run_and_release(guard, f);
        }
    }

    /// Takes the state out for good (shutdown): every later caller gets [`WriterGone`].
    pub fn take(&self) -> Option<T> {
        let mut guard = self.lock().ok()?;
        let state = guard.take();
        self.release(guard);
        state
    }

    /// Lets go of the state without running a call on it, and wakes a parked gateway caller to
    /// try again.
    fn release(&self, guard: MutexGuard<'_, Option<T>>) {
        drop(guard);
        self.freed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::panic::{self, AssertUnwindSafe};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// Drives an async gateway call to its end on this thread, as an HTTP task would.
    fn block_on<F: Future>(call: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(call)
    }

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
            std::thread::spawn(move || block_on(lock.gateway(|log| log.push("gateway"))))
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
        lock.release(held);
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
            "the route counts as waiting while its task is parked"
        );
        lock.release(held);
        assert_eq!(route.await.unwrap().unwrap(), 1);
        assert_eq!(lock.gateway_waiting(), 0);
    }

    #[test]
    fn after_take_every_caller_is_told_the_writer_is_gone() {
        let lock = StateLock::new(1u32);
        assert_eq!(lock.take(), Some(1));
        assert!(block_on(lock.gateway(|n| *n)).is_err());
        assert!(lock.ingest(|n| *n).is_err());
    }

    #[test]
    fn a_panic_while_applying_leaves_every_later_caller_told_the_writer_is_gone() {
        let lock = StateLock::new(1u32);
        let applied = panic::catch_unwind(AssertUnwindSafe(|| {
            lock.ingest(|_| -> u32 { panic!("a bug while applying") })
        }));
        assert!(applied.is_err(), "the panic goes on to the caller");
        assert!(
            block_on(lock.gateway(|n| *n)).is_err(),
            "a half-applied state is never served"
        );
        assert!(lock.ingest(|n| *n).is_err());
        assert_eq!(lock.take(), None);
    }

    #[test]
    fn a_parked_gateway_caller_is_woken_and_told_the_writer_is_gone_when_the_holder_panics() {
        let lock = Arc::new(StateLock::new(0u32));
        let holding = Arc::new(AtomicBool::new(false));
        let holder = {
            let (lock, holding) = (lock.clone(), holding.clone());
            std::thread::spawn(move || {
                lock.ingest(|_| {
                    holding.store(true, Ordering::Release);
                    wait_until("the gateway caller parks", || lock.gateway_waiting() == 1);
                    panic!("a bug while applying")
                })
            })
        };
        wait_until("the holder holds the state", || {
            holding.load(Ordering::Acquire)
        });
        let (told, answer) = std::sync::mpsc::channel();
        let gateway = {
            let lock = lock.clone();
            std::thread::spawn(move || told.send(block_on(lock.gateway(|n| *n)).is_err()))
        };
        assert!(holder.join().is_err(), "the holder panicked");
        assert_eq!(
            answer.recv_timeout(Duration::from_secs(10)),
            Ok(true),
            "the parked caller wakes and is told the writer is gone, not left waiting"
        );
        gateway.join().unwrap().unwrap();
    }
}
