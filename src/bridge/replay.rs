//! Replay client: asks the engine's ROUTER socket for every batch it still buffers from a
//! sequence on.
//!
//! A fresh DEALER connection per request: requests are rare (a gap, a start, an idle check), and
//! a new connection cannot carry a stale reply of an earlier request that timed out.

use std::time::Duration;

use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::frames::{parse_replay, replay_request, FrameError, Numbered, END_OF_REPLAY};

/// What one replay returned.
#[derive(Debug, Default)]
pub struct Replayed {
    /// The buffered batches at or after the requested start, in the engine's order.
    pub batches: Vec<Numbered>,
    /// Replies that were not batches (counted as rejected).
    pub rejected: Vec<FrameError>,
}

/// Sends `["", start_seq]` and collects replies up to the end marker. Fails when the engine does
/// not answer within `timeout` (per reply) or the connection breaks.
pub async fn request(
    endpoint: &str,
    start_seq: u64,
    timeout: Duration,
) -> Result<Replayed, String> {
    let mut socket = DealerSocket::new();
    tokio::time::timeout(timeout, socket.connect(endpoint))
        .await
        .map_err(|_| format!("replay socket {endpoint}: no connection within {timeout:?}"))?
        .map_err(|e| format!("replay socket {endpoint}: {e}"))?;
    let [delimiter, start] = replay_request(start_seq);
    let mut message = ZmqMessage::from(delimiter);
    message.push_back(start);
    socket
        .send(message)
        .await
        .map_err(|e| format!("replay request to {endpoint}: {e}"))?;
    let mut out = Replayed::default();
    loop {
        let reply = tokio::time::timeout(timeout, socket.recv())
            .await
            .map_err(|_| format!("replay socket {endpoint}: no reply within {timeout:?}"))?
            .map_err(|e| format!("replay reply from {endpoint}: {e}"))?;
        match parse_replay(&reply.into_vec()) {
            Ok(n) if n.seq == END_OF_REPLAY => break,
            Ok(n) => out.batches.push(n),
            Err(e) => out.rejected.push(e),
        }
    }
    let _ = socket.close().await;
    Ok(out)
}
