//! Waiting for state: poll against a deadline, never a bare sleep.

use std::time::{Duration, Instant};

pub const DEADLINE: Duration = Duration::from_secs(20);

/// How often a wait checks again.
const POLL_EVERY: Duration = Duration::from_millis(20);

/// Polls `check` until it returns `Some`, or panics with `what` after [`DEADLINE`].
pub async fn eventually<T, F, Fut>(what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    eventually_within(DEADLINE, what, check).await
}

/// [`eventually`] with a deadline of its own, for a wait that the test knows to be longer than
/// usual (one that spans a broker's failover, say); the caller's constant says why.
pub async fn eventually_within<T, F, Fut>(deadline: Duration, what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    eventually_within_explained(deadline, what, check, String::new).await
}

/// [`eventually_within`] whose panic at the deadline ends with `explain()`: what the wait saw
/// last and whatever else says why it never came (a daemon's log), so a wait that runs out in
/// CI, where nothing can be looked at afterwards, reports its cause.
pub async fn eventually_within_explained<T, F, Fut>(
    deadline: Duration,
    what: &str,
    mut check: F,
    explain: impl FnOnce() -> String,
) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if start.elapsed() >= deadline {
            panic!(
                "timed out after {deadline:?} waiting for: {what}{}",
                explain()
            );
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// Polls `check` until it returns `Some`, or gives `None` once `deadline` has passed: the
/// blocking twin of [`eventually`], for code outside a runtime (starting, stopping and waiting
/// for processes), where each caller says what running out of time means.
pub fn poll_until<T>(deadline: Duration, mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = check() {
            return Some(v);
        }
        if start.elapsed() >= deadline {
            return None;
        }
        std::thread::sleep(POLL_EVERY);
    }
}

/// The message a future panicked with, run on a task of its own (the tests of the waits'
/// failures); `why` says why it must panic.
#[cfg(test)]
pub(crate) async fn panic_message<F>(future: F, why: &str) -> String
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + std::fmt::Debug + 'static,
{
    let panic = tokio::spawn(future).await.expect_err(why).into_panic();
    match panic.downcast::<String>() {
        Ok(message) => *message,
        Err(_) => panic!("{why}, with a formatted message"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocking_poll_returns_the_first_answer_or_none_at_its_deadline() {
        let mut calls = 0;
        let third = poll_until(DEADLINE, || {
            calls += 1;
            (calls == 3).then_some(calls)
        });
        assert_eq!(
            third,
            Some(3),
            "the poll returns the first Some, checking again until then"
        );

        let start = Instant::now();
        let never = poll_until(Duration::from_millis(100), || None::<()>);
        assert_eq!(never, None, "a check that never answers gives None");
        assert!(
            start.elapsed() >= Duration::from_millis(100),
            "None comes only once the deadline has passed"
        );
    }

    #[tokio::test]
    async fn a_wait_that_runs_out_ends_its_panic_with_what_explains_it() {
        let wait = eventually_within_explained(
            Duration::from_millis(50),
            "an answer that never comes",
            || async { None::<()> },
            || "; it saw nothing; log: the feed stopped".to_string(),
        );
        let message = panic_message(
            wait,
            "a wait whose check never answers panics at its deadline",
        )
        .await;
        assert!(
            message.ends_with(
                "waiting for: an answer that never comes; it saw nothing; log: the feed stopped"
            ),
            "the panic names the wait, then what explains it: {message}"
        );
    }
}
