//! Output of a simulation: the table on stdout and the `--json` document.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::engine::PolicyReport;
use crate::policy::DecisionLabel;

/// One policy in the `--json` document; these keys and no others.
#[derive(Serialize)]
struct JsonPolicy<'a> {
    policy: &'a str,
    prefix_hit_ratio: f64,
    ideal_hit_ratio: f64,
    duplicate_copies: u64,
    evictions: u64,
    ttft_p50_s: f64,
    ttft_p90_s: f64,
    ttft_p99_s: f64,
    throughput_rps: f64,
    decisions: &'a BTreeMap<String, u64>,
    load_spread: f64,
}

#[derive(Serialize)]
struct JsonDoc<'a> {
    policies: Vec<JsonPolicy<'a>>,
}

/// `{"policies": [{"policy", "prefix_hit_ratio", "ideal_hit_ratio", "duplicate_copies",
/// "evictions", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_rps", "decisions",
/// "load_spread"}]}`, one line.
pub fn to_json(reports: &[PolicyReport]) -> String {
    let doc = JsonDoc {
        policies: reports.iter().map(json_policy).collect(),
    };
    serde_json::to_string(&doc).expect("the report serializes")
}

fn json_policy(r: &PolicyReport) -> JsonPolicy<'_> {
    JsonPolicy {
        policy: r.policy.as_str(),
        prefix_hit_ratio: r.prefix_hit_ratio,
        ideal_hit_ratio: r.ideal_hit_ratio,
        duplicate_copies: r.duplicate_copies,
        evictions: r.evictions,
        ttft_p50_s: r.ttft_p50_s,
        ttft_p90_s: r.ttft_p90_s,
        ttft_p99_s: r.ttft_p99_s,
        throughput_rps: r.throughput_rps,
        decisions: &r.decisions,
        load_spread: r.load_spread,
    }
}

/// The columns every table has after the hit ratios: copies, evictions, TTFT, throughput and
/// load spread.
const OUTCOME_COLUMNS: [&str; 7] = [
    "dup_copies",
    "evictions",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "req/s",
    "spread",
];

/// The cells of [`OUTCOME_COLUMNS`] for one policy's report.
fn outcome_cells(r: &PolicyReport) -> [String; 7] {
    [
        r.duplicate_copies.to_string(),
        r.evictions.to_string(),
        format!("{:.3}s", r.ttft_p50_s),
        format!("{:.3}s", r.ttft_p90_s),
        format!("{:.3}s", r.ttft_p99_s),
        format!("{:.3}", r.throughput_rps),
        format!("{:.3}", r.load_spread),
    ]
}

/// Human-readable tables: metrics, then the decision mix.
pub fn to_table(reports: &[PolicyReport]) -> String {
    let mut out = String::new();
    let mut header = vec!["policy", "hit", "ideal"];
    header.extend(OUTCOME_COLUMNS);
    header.extend(["max/mean", "turn_moves"]);
    let rows: Vec<Vec<String>> = reports
        .iter()
        .map(|r| {
            let mut row = vec![
                r.policy.as_str().to_string(),
                format!("{:.3}", r.prefix_hit_ratio),
                format!("{:.3}", r.ideal_hit_ratio),
            ];
            row.extend(outcome_cells(r));
            row.push(format!("{:.2}", r.load_max_over_mean));
            row.push(if r.follow_ups > 0 {
                format!(
                    "{:.1}%",
                    100.0 * r.follow_up_moves as f64 / r.follow_ups as f64
                )
            } else {
                "-".to_string()
            });
            row
        })
        .collect();
    write_table(&mut out, &header, &rows);
    out.push('\n');
    let mut header = vec!["decisions"];
    header.extend(DecisionLabel::ALL.iter().map(|l| l.as_str()));
    let rows: Vec<Vec<String>> = reports
        .iter()
        .map(|r| {
            let mut row = vec![r.policy.as_str().to_string()];
            row.extend(DecisionLabel::ALL.iter().map(|l| {
                r.decisions
                    .get(l.as_str())
                    .copied()
                    .unwrap_or(0)
                    .to_string()
            }));
            row
        })
        .collect();
    write_table(&mut out, &header, &rows);
    out.push_str(
        "\nhit = cached prompt tokens / prompt tokens (leading blocks resident on the chosen worker \
         at prefill start); ideal = the same for one infinite cache;\ndup_copies = blocks stored \
         on a worker while resident on another; ttft = queueing + prefill; spread = coefficient of \
         variation\n(std/mean) of requests served per worker, max/mean of the same; turn_moves = later turns \
         of a session routed to another worker than the turn before (closed-loop workloads only).\n",
    );
    out
}

fn write_table(out: &mut String, header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    for (i, (h, w)) in header.iter().zip(&widths).enumerate() {
        if i == 0 {
            let _ = write!(out, "{h:<w$}");
        } else {
            let _ = write!(out, "  {h:>w$}");
        }
    }
    out.push('\n');
    for row in rows {
        for (i, (cell, w)) in row.iter().zip(&widths).enumerate() {
            if i == 0 {
                let _ = write!(out, "{cell:<w$}");
            } else {
                let _ = write!(out, "  {cell:>w$}");
            }
        }
        out.push('\n');
    }
}

/// Short names of the decision labels, for the one-cell decision mix of a sweep table.
fn short_label(label: DecisionLabel) -> &'static str {
    match label {
        DecisionLabel::OwnerHold => "hold",
        DecisionLabel::PressureSpill => "spill",
        DecisionLabel::SpillCooldownHold => "cooldown",
        DecisionLabel::NoSafeHomeHold => "no_home",
        DecisionLabel::CeilingHold => "ceiling",
        DecisionLabel::ColdMiss => "cold",
        DecisionLabel::OwnerUnavailable => "unavailable",
        DecisionLabel::OverloadSpill => "overload",
    }
}

/// The non-zero decisions of a report, e.g. `hold 120, spill 3, cold 9`.
pub fn decision_mix(report: &PolicyReport) -> String {
    DecisionLabel::ALL
        .iter()
        .filter_map(|l| {
            let n = report.decisions.get(l.as_str()).copied().unwrap_or(0);
            (n > 0).then(|| format!("{} {n}", short_label(*l)))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// One table for a sweep: a row per (value, policy), the swept value first.
pub fn sweep_to_table(flag: &str, runs: &[(String, Vec<PolicyReport>)]) -> String {
    let mut out = String::new();
    let mut header = vec![flag, "policy", "hit"];
    header.extend(OUTCOME_COLUMNS);
    header.push("decisions");
    let rows: Vec<Vec<String>> = runs
        .iter()
        .flat_map(|(value, reports)| {
            reports.iter().map(move |r| {
                let mut row = vec![
                    value.clone(),
                    r.policy.as_str().to_string(),
                    format!("{:.3}", r.prefix_hit_ratio),
                ];
                row.extend(outcome_cells(r));
                row.push(decision_mix(r));
                row
            })
        })
        .collect();
    write_table(&mut out, &header, &rows);
    out
}

#[derive(Serialize)]
struct JsonSweepRun<'a> {
    value: &'a str,
    policies: Vec<JsonPolicy<'a>>,
}

#[derive(Serialize)]
struct JsonSweep<'a> {
    flag: &'a str,
    runs: Vec<JsonSweepRun<'a>>,
}

/// `{"flag", "runs": [{"value", "policies": [...as in to_json...]}]}`, one line.
pub fn sweep_to_json(flag: &str, runs: &[(String, Vec<PolicyReport>)]) -> String {
    let doc = JsonSweep {
        flag,
        runs: runs
            .iter()
            .map(|(value, reports)| JsonSweepRun {
                value,
                policies: reports.iter().map(json_policy).collect(),
            })
            .collect(),
    };
    serde_json::to_string(&doc).expect("the sweep serializes")
}
