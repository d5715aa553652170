//! The worker's lifecycle as the bridge announces it on `<prefix>.workers.<worker>`: `join` at
//! start, `drain` on SIGUSR1, `leave` on SIGTERM or SIGINT.

use std::time::Duration;

use async_nats::jetstream;

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
    use crate::input::{LifecycleOp, WorkerId};
    use crate::wire::{decode_lifecycle, encode_lifecycle_message, LifecycleMessage};

    #[test]
    fn the_bridges_join_carries_its_dp_size_and_epoch_to_the_daemon() {
        let bytes = encode_lifecycle_message(&LifecycleMessage {
            op: LifecycleOp::Join,
            model: Some("m"),
            block_size: Some(16),
            capacity_blocks: None,
            dp_size: Some(2),
            epoch: Some("e1"),
        });
        let (join, rejected) = decode_lifecycle(&bytes, WorkerId::new("w").unwrap()).unwrap();
        assert!(rejected.is_empty(), "no field of the join is rejected");
        assert_eq!(
            (
                join.op,
                join.block_size,
                join.dp_size,
                join.epoch.as_deref()
            ),
            (LifecycleOp::Join, Some(16), Some(2), Some("e1")),
            "the daemon reads the join's block size, dp size and epoch"
        );
    }
}
