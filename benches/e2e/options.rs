//! Command-line options (after `--` in `cargo bench --bench e2e -- ...`).

use super::*;

use clap::builder::RangedU64ValueParser;
use clap::{Parser, ValueEnum};

#[derive(Debug, Parser)]
#[command(name = "e2e", about = "End-to-end load benchmark of kvrouted")]
pub(crate) struct Options {
    /// Seconds per phase
    #[arg(long, value_name = "SECS", default_value = "8", value_parser = seconds)]
    pub(crate) duration: Duration,
    /// NATS publisher connections
    #[arg(long, default_value_t = 4, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    pub(crate) publishers: usize,
    /// Simulated workers per publisher connection
    #[arg(long, default_value_t = 4, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    pub(crate) workers_per_publisher: usize,
    /// HTTP requests in flight
    #[arg(long, default_value_t = 16, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    pub(crate) concurrency: usize,
    /// Unacknowledged JetStream publishes per connection
    #[arg(long, default_value_t = 256)]
    pub(crate) window: usize,
    /// NATS modes to run, in order
    #[arg(long, value_delimiter = ',', default_value = "jetstream,core")]
    pub(crate) modes: Vec<Mode>,
    /// The watchdog kills everything started and exits after this many seconds
    #[arg(long, default_value_t = 600)]
    pub(crate) max_seconds: u64,
    /// Passed by `cargo bench`; ignored
    #[arg(long, hide = true)]
    bench: bool,
}

fn seconds(v: &str) -> Result<Duration, String> {
    v.parse()
        .map(Duration::from_secs)
        .map_err(|_| format!("expected whole seconds, got {v:?}"))
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
pub(crate) enum Mode {
    #[value(name = "jetstream")]
    JetStream,
    Core,
}

impl Mode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::JetStream => "jetstream",
            Mode::Core => "core",
        }
    }
}

pub(crate) fn options() -> Options {
    Options::parse()
}
