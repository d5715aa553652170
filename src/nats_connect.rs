//! How a kvrouted process reaches NATS: the connection flags shared by the commands that talk to
//! the broker, and a client that reconnects with backoff for as long as the process runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use clap::Args;

/// NATS connection flags.
#[derive(Debug, Clone, Args)]
pub struct NatsArgs {
    /// NATS server URL
    #[arg(
        long,
        env = "KVROUTED_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
}

impl NatsArgs {
    /// A client named `name` that keeps retrying (also the first connect) and keeps `connected`
    /// up to date. Returns at once: publishes wait in the client until the broker answers.
    pub async fn connect(
        &self,
        name: &str,
        connected: Arc<AtomicBool>,
    ) -> anyhow::Result<async_nats::Client> {
        async_nats::ConnectOptions::new()
            .name(name)
            .retry_on_initial_connect()
            .max_reconnects(None)
            .event_callback(move |event| {
                let connected = connected.clone();
                async move {
                    match event {
                        async_nats::Event::Connected => {
                            connected.store(true, Ordering::Release);
                            tracing::info!("NATS connected");
                        }
                        async_nats::Event::Disconnected => {
                            connected.store(false, Ordering::Release);
                            tracing::warn!("NATS disconnected; reconnecting with backoff");
                        }
                        other => tracing::info!("NATS: {other}"),
                    }
                }
            })
            .connect(&self.nats_url)
            .await
            .with_context(|| format!("invalid NATS url {}", self.nats_url))
    }
}
