//! The engines' ZeroMQ framing.
//!
//! Live messages on the PUB socket are `[topic, seq, payload]`: the topic the engine was
//! configured with (possibly carrying a suffix after a NUL byte, which is ignored), the batch's
//! sequence number as 8 bytes big-endian, and the msgpack batch.
//!
//! Replay replies reach the DEALER as `["", topic, seq, payload]` (vLLM 0.33, SGLang 0.5.23,
//! TensorRT-LLM) or `["", seq, payload]` (older vLLM and SGLang). The replay ends with a message
//! whose seq is all ones (`ff…ff`).

use bytes::Bytes;

/// The sequence number that marks the end of a replay.
pub const END_OF_REPLAY: u64 = u64::MAX;

/// Why a frame set was not a batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("expected {expected} frames, got {got}")]
    FrameCount { expected: &'static str, got: usize },
    #[error("sequence frame is {0} bytes, expected 8")]
    SeqLength(usize),
}

impl FrameError {
    /// The bounded label of `kvrouted_bridge_rejected_total{reason}`.
    pub fn reason(&self) -> &'static str {
        match self {
            FrameError::FrameCount { .. } => "frame_count",
            FrameError::SeqLength(_) => "seq_length",
        }
    }
}

/// One numbered batch from the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Numbered {
    pub seq: u64,
    pub payload: Bytes,
}

/// The topic without any suffix after a NUL byte.
pub fn topic_name(topic: &[u8]) -> &[u8] {
    match topic.iter().position(|&b| b == 0) {
        Some(nul) => &topic[..nul],
        None => topic,
    }
}

fn seq_of(frame: &[u8]) -> Result<u64, FrameError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| FrameError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// A live PUB message `[topic, seq, payload]`. The topic itself was matched by the
/// subscription; it is not returned.
pub fn parse_live(frames: &[Bytes]) -> Result<Numbered, FrameError> {
    let [_topic, seq, payload] = frames else {
        return Err(FrameError::FrameCount {
            expected: "3 (topic, seq, payload)",
            got: frames.len(),
        });
    };
    Ok(Numbered {
        seq: seq_of(seq)?,
        payload: payload.clone(),
    })
}

/// One replay reply as the DEALER receives it: the empty delimiter, then `[topic, seq,
/// payload]` or `[seq, payload]`. The end marker comes back as `seq == END_OF_REPLAY`.
pub fn parse_replay(frames: &[Bytes]) -> Result<Numbered, FrameError> {
    let body = match frames.split_first() {
        Some((first, rest)) if first.is_empty() && (rest.len() == 2 || rest.len() == 3) => rest,
        // A router that does not echo the delimiter.
        _ => frames,
    };
    let (seq, payload) = match body {
        [_topic, seq, payload] => (seq, payload),
        [seq, payload] => (seq, payload),
        _ => {
            return Err(FrameError::FrameCount {
                expected: "2 or 3 after the delimiter ([topic,] seq, payload)",
                got: frames.len(),
            })
        }
    };
    Ok(Numbered {
        seq: seq_of(seq)?,
        payload: payload.clone(),
    })
}

/// The replay request: `["", start_seq u64 BE]` from a DEALER.
pub fn replay_request(start_seq: u64) -> [Bytes; 2] {
    [
        Bytes::new(),
        Bytes::copy_from_slice(&start_seq.to_be_bytes()),
    ]
}

/// The endpoint of dp rank `rank`: the port of rank 0's endpoint plus the rank, as the engines
/// offset their sockets.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> anyhow::Result<String> {
    if rank == 0 {
        return Ok(endpoint.to_string());
    }
    let (host, port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| anyhow::anyhow!("endpoint {endpoint} has no port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| anyhow::anyhow!("endpoint {endpoint}: port is not a number"))?;
    let port = port
        .checked_add(u16::try_from(rank)?)
        .ok_or_else(|| anyhow::anyhow!("endpoint {endpoint}: port + rank {rank} overflows"))?;
    Ok(format!("{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &[u8]) -> Bytes {
        Bytes::copy_from_slice(s)
    }

    #[test]
    fn live_frames_give_sequence_and_untouched_payload() {
        let got = parse_live(&[b(b"kv"), b(&7u64.to_be_bytes()), b(b"\x92\x01\x90")]).unwrap();
        assert_eq!(got.seq, 7);
        assert_eq!(&got.payload[..], b"\x92\x01\x90");
    }

    #[test]
    fn live_frames_of_the_wrong_shape_are_errors() {
        assert_eq!(
            parse_live(&[b(b""), b(&1u64.to_be_bytes())])
                .unwrap_err()
                .reason(),
            "frame_count"
        );
        assert_eq!(
            parse_live(&[b(b""), b(&[0, 1]), b(b"x")])
                .unwrap_err()
                .reason(),
            "seq_length"
        );
    }

    #[test]
    fn topic_suffix_after_nul_is_ignored() {
        assert_eq!(topic_name(b"kv\0dp3"), b"kv");
        assert_eq!(topic_name(b"kv"), b"kv");
    }

    #[test]
    fn replay_replies_with_and_without_topic_frame_parse_alike() {
        let seq = b(&42u64.to_be_bytes());
        let with_topic = parse_replay(&[b(b""), b(b"kv"), seq.clone(), b(b"p")]).unwrap();
        let without = parse_replay(&[b(b""), seq, b(b"p")]).unwrap();
        assert_eq!(with_topic, without);
        assert_eq!(with_topic.seq, 42);
    }

    #[test]
    fn replay_end_marker_is_all_ones() {
        let end = parse_replay(&[b(b""), b(b""), b(&[0xff; 8]), b(b"")]).unwrap();
        assert_eq!(end.seq, END_OF_REPLAY);
        let old = parse_replay(&[b(b""), b(&[0xff; 8]), b(b"")]).unwrap();
        assert_eq!(old.seq, END_OF_REPLAY);
    }

    #[test]
    fn replay_request_is_delimiter_and_big_endian_start() {
        let [delim, start] = replay_request(0x0102);
        assert!(delim.is_empty());
        assert_eq!(&start[..], &[0, 0, 0, 0, 0, 0, 1, 2]);
    }

    #[test]
    fn rank_endpoints_offset_the_port() {
        assert_eq!(rank_endpoint("tcp://e:5557", 0).unwrap(), "tcp://e:5557");
        assert_eq!(rank_endpoint("tcp://e:5557", 3).unwrap(), "tcp://e:5560");
        assert!(rank_endpoint("tcp://e:65535", 1).is_err());
        assert!(rank_endpoint("tcp://e", 1).is_err());
    }
}
