//! Reporting.

use super::*;

/// Lines are printed as they come; the JSON fragments make the last line.
pub(crate) struct Report {
    pub(crate) json: Vec<String>,
}

impl Report {
    pub(crate) fn line(&mut self, s: String) {
        println!("{s}");
    }
}

pub(crate) fn load_line(what: &str, l: &Load) -> String {
    let mut line = format!(
        "  {what:<34} {:>8.0} req/s  p50 {:>8.1} µs  p99 {:>8.1} µs  p999 {:>8.1} µs  mean {:>8.1} µs  ({} requests, {} errors, {:.1} KiB/body)",
        l.per_s, l.p50_us, l.p99_us, l.p999_us, l.mean_us, l.requests, l.errors, l.body_kib
    );
    if let Some(error) = &l.first_error {
        // Failed requests are counted in the latencies: the figures above are not clean.
        line.push_str(&format!("\n    FAILED REQUESTS; the first: {error}"));
    }
    line
}

pub(crate) fn load_json(l: &Load) -> String {
    format!(
        "{{\"per_s\":{:.0},\"p50_us\":{:.1},\"p99_us\":{:.1},\"p999_us\":{:.1},\"mean_us\":{:.1},\"requests\":{},\"errors\":{}}}",
        l.per_s, l.p50_us, l.p99_us, l.p999_us, l.mean_us, l.requests, l.errors
    )
}
