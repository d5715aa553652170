//! The JetStream streams ingest reads and the broker-side calls on them.

use std::time::Duration;

use async_nats::jetstream::{self, stream};

/// The JetStream stream that captures KV events and lifecycle messages. The daemon and the
/// engine bridge both create it when missing, with the same settings.
pub fn stream_config(name: &str, prefix: &str) -> stream::Config {
    stream::Config {
        name: name.to_string(),
        subjects: vec![format!("{prefix}.events.>"), format!("{prefix}.workers.>")],
        storage: stream::StorageType::File,
        ..Default::default()
    }
}

/// Bytes the decisions stream keeps at most (the oldest go first): a route's decision carries
/// its prompt's block keys, so a busy fleet's decisions can outgrow the max age's worth of disk.
pub const DECISIONS_MAX_BYTES: i64 = 1 << 30;

/// The JetStream stream of every replica's decisions (`<prefix>.decisions.<replica>`). Short
/// lived on purpose: a decision matters for the spill cooldown, the routing records' TTL and a
/// reservation's TTL; a replica away for longer rebuilds ownership from the KV events alone.
/// Bounded by [`DECISIONS_MAX_BYTES`] too.
pub fn decisions_stream_config(name: &str, prefix: &str, max_age: Duration) -> stream::Config {
    stream::Config {
        name: name.to_string(),
        subjects: vec![format!("{prefix}.decisions.>")],
        storage: stream::StorageType::File,
        max_age,
        max_bytes: DECISIONS_MAX_BYTES,
        ..Default::default()
    }
}

/// Gets the stream, creating it as `wanted` if missing. An existing stream with fewer replicas
/// than asked (e.g. created by a bridge, or before the cluster grew) is raised to them, and a
/// decisions stream takes the asked max age, so `--stream-replicas` and the decisions' max age
/// hold whoever created the stream first. A failed update is logged; the stream is used as it
/// is.
pub(super) async fn ensure_stream(
    js: &jetstream::Context,
    wanted: stream::Config,
) -> Result<stream::Stream, String> {
    let stream = js
        .get_or_create_stream(wanted.clone())
        .await
        .map_err(|e| format!("stream {}: {e}", wanted.name))?;
    let current = stream.cached_info().config.clone();
    let raise_replicas = current.num_replicas < wanted.num_replicas;
    let set_max_age = !wanted.max_age.is_zero() && current.max_age != wanted.max_age;
    if raise_replicas || set_max_age {
        let updated = stream::Config {
            num_replicas: current.num_replicas.max(wanted.num_replicas),
            max_age: if set_max_age {
                wanted.max_age
            } else {
                current.max_age
            },
            ..current.clone()
        };
        match js.update_stream(&updated).await {
            Ok(_) => tracing::info!(
                stream = wanted.name,
                replicas = updated.num_replicas,
                max_age = ?updated.max_age,
                "updated the JetStream stream's replicas and max age"
            ),
            Err(e) => tracing::warn!(
                stream = wanted.name,
                replicas = current.num_replicas,
                wanted_replicas = wanted.num_replicas,
                "could not update the JetStream stream (used as it is): {e}"
            ),
        }
    }
    Ok(stream)
}

/// Recreates durable consumer `name` of `stream` with its settings, starting after its ack
/// floor, when it delivered messages that were never acknowledged: they are delivered again at
/// once and in order. Each replica owns its durable consumers, so nobody else reads from them.
/// A stream whose retention is not `limits` (interest or work queue) could drop messages while
/// the consumer is gone, so it is left alone. `Some((first stream sequence delivered again,
/// how many were unacknowledged))` when it rewound.
pub(super) async fn rewind_to_ack_floor(
    stream: &stream::Stream,
    name: &str,
) -> Result<Option<(u64, usize)>, String> {
    let retention = stream
        .get_info()
        .await
        .map_err(|e| e.to_string())?
        .config
        .retention;
    let info = stream
        .consumer_info(name)
        .await
        .map_err(|e| format!("consumer {name}: {e}"))?;
    if info.num_ack_pending == 0 || retention != stream::RetentionPolicy::Limits {
        return Ok(None);
    }
    let from = info.ack_floor.stream_sequence + 1;
    let mut config = info.config.clone();
    config.deliver_policy = jetstream::consumer::DeliverPolicy::ByStartSequence {
        start_sequence: from,
    };
    stream
        .delete_consumer(name)
        .await
        .map_err(|e| format!("delete: {e}"))?;
    stream
        .create_consumer(config)
        .await
        .map_err(|e| format!("recreate: {e}"))?;
    Ok(Some((from, info.num_ack_pending)))
}

/// Deletes durable consumer `name` of `stream` if it has delivered anything (one an earlier
/// data dir left); a consumer that never delivered, or none, is left as it is. Whether it
/// deleted one.
pub(super) async fn forget_consumer(stream: &stream::Stream, name: &str) -> Result<bool, String> {
    match stream.consumer_info(name).await {
        Ok(info) if info.delivered.stream_sequence > 0 => {}
        _ => return Ok(false),
    }
    stream
        .delete_consumer(name)
        .await
        .map_err(|e| format!("delete consumer {name}: {e}"))?;
    Ok(true)
}

/// Whether the broker has our stream and durable consumer (after a reconnect: a broker
/// restarted without its storage has neither). An unanswered check counts as missing: they are
/// then created if missing, or the message stream is set up again.
pub(super) async fn consumer_exists(js: &jetstream::Context, stream: &str, consumer: &str) -> bool {
    let check = async {
        let stream = js.get_stream(stream).await.ok()?;
        stream.consumer_info(consumer).await.ok()
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), check).await,
        Ok(Some(_))
    )
}
