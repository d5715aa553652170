//! A benchmark's watchdog: once its time limit has passed, it kills (SIGKILL) every process
//! still [`Watched`] and exits the benchmark with status 2, so a run that hangs leaves nothing
//! running. (Tests need none: their processes die with their drops, and the test harness
//! reports a hang.)

use std::ops::{Deref, DerefMut};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

/// The process ids the watchdog kills.
static WATCHED: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Starts the watchdog of the benchmark `bench`, which fires once `limit` has passed.
pub fn start_watchdog(bench: &'static str, limit: Duration) {
    std::thread::spawn(move || {
        // A time limit, not a wait for state: nothing here can tell the run is done sooner.
        std::thread::sleep(limit);
        eprintln!("{bench}: still running after {limit:?}; killing what it started and exiting");
        for pid in WATCHED.lock().unwrap().iter() {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        std::process::exit(2);
    });
}

/// A handle of one running process, whose id the watchdog kills.
pub trait ProcessHandle {
    fn process_id(&self) -> u32;
}

impl ProcessHandle for crate::Process {
    fn process_id(&self) -> u32 {
        self.id()
    }
}

impl ProcessHandle for crate::Nats {
    fn process_id(&self) -> u32 {
        self.pid().expect("a started nats-server")
    }
}

impl ProcessHandle for std::process::Child {
    fn process_id(&self) -> u32 {
        self.id()
    }
}

/// A process handle (a [`crate::Process`], a [`crate::Nats`], a `Child`) whose process the
/// watchdog kills while the handle lives; used as the handle itself.
pub struct Watched<T> {
    handle: T,
    pid: u32,
}

impl<T: ProcessHandle> Watched<T> {
    /// Watches the process that `handle` runs.
    pub fn new(handle: T) -> Watched<T> {
        let pid = handle.process_id();
        WATCHED.lock().unwrap().push(pid);
        Watched { handle, pid }
    }
}

impl<T> Watched<T> {
    pub fn pid(&self) -> u32 {
        self.pid
    }
}

impl<T> Deref for Watched<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.handle
    }
}

impl<T> DerefMut for Watched<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.handle
    }
}

impl<T> Drop for Watched<T> {
    /// The handle's own drop stops the process right after; its id is no longer the watchdog's
    /// to kill (the system may give it to another process).
    fn drop(&mut self) {
        WATCHED.lock().unwrap().retain(|&p| p != self.pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handle that names a process id without running one.
    #[derive(Debug, PartialEq)]
    struct Named(u32);

    impl ProcessHandle for Named {
        fn process_id(&self) -> u32 {
            self.0
        }
    }

    #[test]
    fn a_process_is_watched_while_its_handle_lives() {
        let handle = Watched::new(Named(4_000_001));
        assert_eq!(
            *handle,
            Named(4_000_001),
            "the watched handle is used as the handle itself"
        );
        assert!(
            WATCHED.lock().unwrap().contains(&4_000_001),
            "a live handle's process is the watchdog's to kill"
        );
        drop(handle);
        assert!(
            !WATCHED.lock().unwrap().contains(&4_000_001),
            "a dropped handle's process id is no longer killed"
        );
    }
}
