//! Command-line options (after `--` in `cargo bench --bench e2e -- ...`).

use super::*;

use clap::builder::RangedU64ValueParser;
use clap::{Parser, ValueEnum};

#[derive(Debug, Parser)]
#[command(name = "e2e", about = "End-to-end load benchmark of kvrouted")]
pub(crate) struct Options {
    /// How long each phase runs, with its unit (`8s`, `1m`), as the daemon's durations are
    /// written
    #[arg(long, value_name = "DURATION", default_value = "8s", value_parser = phase_duration)]
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
    /// Keep each mode's daemon data dir and log in DIR/<mode> (DIR must not hold one yet), with
    /// the whole run's journal: `kvrouted replay --data-dir DIR/<mode>/data` then re-derives
    /// every decision of the run and times what the core alone took to apply its routes
    #[arg(long, value_name = "DIR")]
    pub(crate) keep_data: Option<PathBuf>,
    /// The watchdog kills everything started and exits after this many seconds
    #[arg(long, default_value_t = 600)]
    pub(crate) max_seconds: u64,
    /// Passed by `cargo bench`; ignored
    #[arg(long, hide = true)]
    bench: bool,
}

/// A phase's duration through the daemon's own parser (a bare number is refused with its
/// message); a phase must run for some time, since its rates divide by it.
fn phase_duration(v: &str) -> Result<Duration, String> {
    let d = kvrouted::config::parse_duration(v)?;
    if d.is_zero() {
        return Err("a phase must last longer than 0s".into());
    }
    Ok(d)
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
    // The bench once named its daemon build with a variable of its own; a run with that one set
    // would measure the default build unnoticed, so it is refused rather than ignored.
    if std::env::var_os("E2E_DAEMON_BIN").is_some() {
        eprintln!("error: E2E_DAEMON_BIN is no longer read: name the daemon build with KVROUTED_BIN=PATH, as for the tests");
        std::process::exit(2);
    }
    Options::parse()
}
