//! Re-applying a journal through the core: daemon recovery and the audit replay of DESIGN.md §9.

use crate::input::{Input, Stamped};
use crate::journal::{JournalEntry, JournalError, RouteOutcome, Snapshot};
use crate::router::{Output, Router, RouterConfig};

/// A decision whose re-derived outcome differs from the recorded one.
#[derive(Debug, Clone, PartialEq)]
pub struct Divergence {
    pub seq: u64,
    pub recorded: RouteOutcome,
    pub replayed: RouteOutcome,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplayStats {
    pub entries: u64,
    pub decisions: u64,
    /// Decisions whose worker or label differs from the recorded one.
    pub changed: u64,
    pub first_divergence: Option<Divergence>,
}

/// Replays `entries` onto `snapshot` (or an empty router). Every `Configure` input passes
/// through `adjust` first, which is how a counterfactual overrides recorded settings.
/// `on_output` sees each applied entry and what it produced.
pub fn replay(
    snapshot: Option<Snapshot>,
    entries: impl Iterator<Item = Result<(u64, JournalEntry), JournalError>>,
    adjust: &dyn Fn(&mut RouterConfig),
    mut on_output: impl FnMut(u64, &JournalEntry, &Output),
) -> Result<(Router, ReplayStats), JournalError> {
    let mut router = match snapshot {
        Some(s) => {
            let mut config = s.config;
            adjust(&mut config);
            Router::from_state(config, s.state)
        }
        None => {
            let mut config = RouterConfig::default();
            adjust(&mut config);
            Router::new(config)
        }
    };
    let mut stats = ReplayStats::default();
    for item in entries {
        let (seq, mut entry) = item?;
        if let Input::Configure(config) = &mut entry.input {
            adjust(config);
        }
        let stamped = Stamped {
            seq,
            at_ms: entry.at_ms,
            input: entry.input,
        };
        let output = router.apply(&stamped);
        entry.input = stamped.input;
        stats.entries += 1;
        if let (Some(recorded), Some(replayed)) = (&entry.outcome, RouteOutcome::of(&output)) {
            stats.decisions += 1;
            if *recorded != replayed {
                stats.changed += 1;
                if stats.first_divergence.is_none() {
                    stats.first_divergence = Some(Divergence {
                        seq,
                        recorded: recorded.clone(),
                        replayed,
                    });
                }
            }
        }
        on_output(seq, &entry, &output);
    }
    Ok((router, stats))
}
