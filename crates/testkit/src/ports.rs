//! Ports for the servers a test or benchmark starts on loopback.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// A TCP port nothing listens on at loopback, for a server a test or bench starts.
pub fn free_port() -> u16 {
    free_port_run(1)
}

/// The lowest port [`free_port_run`] hands out.
const LOWEST_PORT: u32 = 10_000;

/// A base port such that `base .. base + n` are all free on loopback.
///
/// The ports are drawn below the kernel's ephemeral range, not by binding port 0: a port from
/// inside that range can become the source port of any outgoing connection between this check
/// and the server's own bind (a daemon in CI failed to start with "Address already in use" on
/// such a port). Each call takes the next ports from a start that differs from process to
/// process, so parallel tests in one process never draw the same ones and test processes side
/// by side rarely do; ports something listens on are skipped.
pub fn free_port_run(n: u16) -> u16 {
    static START: OnceLock<u32> = OnceLock::new();
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = u32::from(n.max(1));
    let span = ephemeral_low().max(LOWEST_PORT + 1_000) - LOWEST_PORT;
    let start = *START.get_or_init(|| {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        (std::process::id().wrapping_mul(0x9E37_79B1) ^ nanos) % span
    });
    loop {
        let drawn = NEXT.fetch_add(n, Ordering::Relaxed);
        assert!(
            drawn < span,
            "no run of {n} free ports below the ephemeral range"
        );
        let offset = (start + drawn) % span;
        if offset + n > span {
            continue;
        }
        let base = LOWEST_PORT + offset;
        let all_free = (base..base + n).all(|p| TcpListener::bind(("127.0.0.1", p as u16)).is_ok());
        if all_free {
            return base as u16;
        }
    }
}

/// The first port of the kernel's ephemeral range, where outgoing connections take their
/// source ports (32768, Linux's default, where it cannot be read).
fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_drawn_below_the_ephemeral_range_free_and_never_twice_in_a_process() {
        let low = ephemeral_low();
        let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
        for &port in &ports {
            assert!(
                (LOWEST_PORT..low).contains(&u32::from(port)),
                "port {port} lies below the ephemeral range ({low} and up), where no outgoing \
                 connection takes it"
            );
        }
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "no port is handed out twice");
        let base = free_port_run(4);
        let held: Vec<TcpListener> = (base..base + 4)
            .map(|p| TcpListener::bind(("127.0.0.1", p)).expect("every port of a run is free"))
            .collect();
        assert_eq!(held.len(), 4);
        assert!(
            !ports.contains(&base),
            "a run does not repeat a port handed out before"
        );
    }
}
