//! Finding ports and the nats-server binary for processes a benchmark or test starts on
//! loopback.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long a started process may take to listen.
const LISTEN_DEADLINE: Duration = Duration::from_secs(20);

/// A free TCP port on loopback (bound and released; the OS does not hand it out again at once).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls until something listens on `port`, or panics naming `what`.
pub fn wait_for_port(port: u16, what: &str) {
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < LISTEN_DEADLINE,
            "{what} did not listen on port {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `$NATS_SERVER_BIN`, else `nats-server` on the PATH, in /usr/sbin or /usr/bin.
pub fn nats_server_bin() -> PathBuf {
    if let Ok(p) = std::env::var("NATS_SERVER_BIN") {
        return p.into();
    }
    for dir in std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .chain(["/usr/sbin", "/usr/bin"])
    {
        let p = Path::new(dir).join("nats-server");
        if p.exists() {
            return p;
        }
    }
    panic!("nats-server not found: run scripts/test (it installs the Debian package nats-server) or set NATS_SERVER_BIN");
}
