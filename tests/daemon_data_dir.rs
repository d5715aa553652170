//! Data dirs that cannot be used are refused with one line and a failing exit, never opened as
//! an empty index: locked by a running daemon, missing, a regular file, or from a future schema.

mod common;

use std::path::{Path, PathBuf};

use common::*;

/// The one line a refused start prints, asserting the process printed nothing else of note.
fn the_error_line(stderr: &str) -> String {
    let stderr = plain(stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .map(str::trim_end)
        .filter(|l| l.starts_with("kvrouted:"))
        .collect();
    assert_eq!(lines.len(), 1, "exactly one error line; stderr:\n{stderr}");
    lines[0].to_string()
}

fn serve_args(data_dir: &Path, nats_url: &str) -> Vec<std::ffi::OsString> {
    vec![
        "serve".into(),
        "--nats-url".into(),
        nats_url.into(),
        "--http-addr".into(),
        format!("127.0.0.1:{}", free_port()).into(),
        "--data-dir".into(),
        data_dir.into(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_locked_by_a_running_daemon_is_refused_with_one_line_and_a_failing_exit() {
    let nats = Nats::start();
    let mut daemon = Daemon::start(&nats.url(), &[]).await;
    daemon.wait_ready().await;
    let dir = daemon.data_dir.clone();
    for (what, args) in [
        ("serve", serve_args(&dir, &nats.url())),
        (
            "replay",
            vec!["replay".into(), "--data-dir".into(), dir.clone().into()],
        ),
        (
            "journal export",
            vec![
                "journal".into(),
                "export".into(),
                "--data-dir".into(),
                dir.clone().into(),
                "--out".into(),
                dir.join("never-written").into(),
            ],
        ),
    ] {
        let (ok, code, _, stderr) = kvrouted(args);
        assert!(!ok && code.is_some(), "{what} on a locked data dir fails");
        let line = the_error_line(&stderr);
        assert!(
            line.contains("in use by another kvrouted process")
                && line.contains(&dir.display().to_string()),
            "{what}: the error names the dir and the lock: {line}"
        );
    }
    assert!(daemon.is_running(), "the running daemon is unaffected");
    daemon.wait_ready().await;
}

#[test]
fn replaying_or_exporting_a_data_dir_that_does_not_exist_is_an_error_not_an_empty_journal() {
    let work = tempfile::TempDir::new().unwrap();
    let missing = work.path().join("typo");
    for args in [
        vec!["replay".into(), "--data-dir".into(), missing.clone().into()],
        vec![
            "journal".into(),
            "export".into(),
            "--data-dir".into(),
            missing.clone().into(),
            "--out".into(),
            work.path().join("out").into(),
        ],
    ] {
        let (ok, code, stdout, stderr) = kvrouted::<_, std::ffi::OsString>(args);
        assert!(!ok && code.is_some());
        let line = the_error_line(&stderr);
        assert!(
            line.contains("is not a kvrouted data dir") && line.contains("typo"),
            "{line}"
        );
        assert!(!stdout.contains("replayed"));
    }
    assert!(!missing.exists(), "no data dir is created by reading one");
}

#[test]
fn a_data_dir_that_is_a_regular_file_is_refused_with_one_line_and_a_failing_exit() {
    let work = tempfile::TempDir::new().unwrap();
    let file = work.path().join("not-a-dir");
    std::fs::write(&file, b"hello").unwrap();
    for args in [
        serve_args(&file, "nats://127.0.0.1:1"),
        vec!["replay".into(), "--data-dir".into(), file.clone().into()],
    ] {
        let (ok, code, _, stderr) = kvrouted(&args);
        assert!(!ok && code.is_some(), "{args:?} fails");
        let line = the_error_line(&stderr);
        assert!(
            line.contains("cannot open data dir") && line.contains("not-a-dir"),
            "the error says which dir cannot be opened: {line}"
        );
    }
    assert_eq!(
        std::fs::read(&file).unwrap(),
        b"hello",
        "the file is untouched"
    );
}

#[test]
fn a_data_dir_from_a_future_schema_version_is_refused_never_opened_empty() {
    let work = tempfile::TempDir::new().unwrap();
    let dir: PathBuf = work.path().join("data");
    kvrouted::journal::write_schema_version(&dir, u32::MAX).unwrap();
    // sled lets go of its lock on the dir shortly after the handle is dropped: wait for that,
    // so what follows sees the schema, not this process's lock.
    let unlocked = poll_until(DEADLINE, || {
        let (.., stderr) = kvrouted(["replay".as_ref(), "--data-dir".as_ref(), dir.as_os_str()]);
        (!stderr.contains("in use by another kvrouted process")).then_some(())
    });
    assert!(unlocked.is_some(), "sled keeps the dir locked");
    for args in [
        serve_args(&dir, "nats://127.0.0.1:1"),
        vec!["replay".into(), "--data-dir".into(), dir.clone().into()],
        vec![
            "journal".into(),
            "export".into(),
            "--data-dir".into(),
            dir.clone().into(),
            "--out".into(),
            work.path().join("out").into(),
        ],
    ] {
        let (ok, code, stdout, stderr) = kvrouted(&args);
        assert!(!ok && code.is_some(), "{args:?} fails");
        let line = the_error_line(&stderr);
        assert!(
            line.contains("newer kvrouted") && line.contains(&u32::MAX.to_string()),
            "the error names the schema version found: {line}"
        );
        assert!(
            !stdout.contains("replayed"),
            "nothing is replayed from a dir that cannot be read"
        );
    }
    assert!(
        !work.path().join("out").exists(),
        "no export is written from it"
    );
}
