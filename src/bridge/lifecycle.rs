//! The worker's lifecycle as the bridge announces it on `<prefix>.workers.<worker>`: `join` at
//! start, `drain` on SIGUSR1, `leave` on SIGTERM or SIGINT.

use std::time::Duration;

use async_nats::jetstream;
use serde::Serialize;

use crate::input::LifecycleOp;

/// A lifecycle message: the map of the wire contract, absent fields left out.
#[derive(Debug, Clone, Serialize)]
pub struct Announcement<'a> {
    pub op: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_size: Option<u32>,
    /// The engine incarnation the ranks run: a join that repeats the epoch the daemon already
    /// has (a restarted bridge in front of a running engine) clears nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epoch: Option<&'a str>,
}

impl Announcement<'_> {
    pub fn encode(&self) -> Vec<u8> {
        // A map of strings and integers always encodes.
        rmp_serde::to_vec_named(self).expect("lifecycle message encodes")
    }
}

pub fn op_name(op: LifecycleOp) -> &'static str {
    match op {
        LifecycleOp::Join => "join",
        LifecycleOp::Drain => "drain",
        LifecycleOp::Leave => "leave",
    }
}

/// Publishes through JetStream and waits for the stream's ack, retrying with backoff until
/// `give_up` has passed.
pub async fn publish(
    js: &jetstream::Context,
    subject: &str,
    payload: Vec<u8>,
    give_up: Duration,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now().checked_add(give_up);
    let mut backoff = Duration::from_millis(100);
    loop {
        let attempt = async {
            js.publish(subject.to_string(), payload.clone().into())
                .await
                .map_err(|e| e.to_string())?
                .await
                .map_err(|e| e.to_string())
        }
        .await;
        match attempt {
            Ok(_) => return Ok(()),
            Err(e) if deadline.is_some_and(|d| tokio::time::Instant::now() + backoff > d) => {
                return Err(format!("{subject}: {e}"))
            }
            Err(e) => {
                tracing::warn!(subject, "lifecycle publish failed, retrying: {e}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::WorkerId;

    #[test]
    fn a_join_decodes_as_a_lifecycle_message_with_its_fields() {
        let bytes = Announcement {
            op: op_name(LifecycleOp::Join),
            model: Some("m"),
            block_size: Some(16),
            dp_size: Some(2),
            epoch: Some("e1"),
        }
        .encode();
        let decoded = crate::wire::decode_lifecycle(&bytes, WorkerId::new("w").unwrap());
        let decoded = format!("{decoded:?}");
        assert!(decoded.contains("Join"), "{decoded}");
        assert!(decoded.contains("block_size: Some(16)"), "{decoded}");
        let raw: rmpv::Value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let keys: Vec<String> = raw
            .as_map()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str().unwrap().to_string())
            .collect();
        assert_eq!(keys, ["op", "model", "block_size", "dp_size", "epoch"]);
    }
}
