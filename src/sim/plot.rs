//! `--plot FILE.svg`: the TTFT distribution (CDF, log time axis) of every policy next to a bar
//! chart of prefix-hit ratio per policy against the ideal. Hand-written SVG, no dependency.

use std::fmt::Write as _;

use super::engine::PolicyReport;

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Dash patterns, so that policies with identical curves stay distinguishable.
const DASHES: [&str; 5] = ["none", "8 4", "2 3", "10 3 2 3", "4 4"];

const WIDTH: f64 = 980.0;
const HEIGHT: f64 = 460.0;
/// Plot areas: (left, top, width, height).
const CDF: (f64, f64, f64, f64) = (70.0, 64.0, 520.0, 320.0);
const BARS: (f64, f64, f64, f64) = (680.0, 64.0, 270.0, 320.0);

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The SVG document for `reports`, with `title` on top.
pub fn to_svg(reports: &[PolicyReport], title: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
        WIDTH / 2.0,
        esc(title)
    );
    cdf_panel(&mut s, reports);
    bar_panel(&mut s, reports);
    s.push_str("</svg>\n");
    s
}

fn cdf_panel(s: &mut String, reports: &[PolicyReport]) {
    let (left, top, w, h) = CDF;
    // From the lowest 1st percentile (the fastest 1% would only stretch the axis) to the
    // slowest request.
    let lo = reports
        .iter()
        .filter(|r| !r.ttft_s.is_empty())
        .map(|r| super::engine::percentile(&r.ttft_s, 0.01))
        .filter(|&t| t > 0.0)
        .fold(f64::INFINITY, f64::min);
    let hi = reports
        .iter()
        .filter_map(|r| r.ttft_s.last().copied())
        .fold(0f64, f64::max);
    let (lo_dec, hi_dec) = if lo.is_finite() {
        (
            lo.max(1e-4).log10().floor(),
            hi.log10().ceil().max(lo.max(1e-4).log10().floor() + 1.0),
        )
    } else {
        (-3.0, 0.0)
    };
    let x_of = |t: f64| {
        let l = t.max(10f64.powf(lo_dec)).log10();
        left + (l - lo_dec) / (hi_dec - lo_dec) * w
    };
    let y_of = |q: f64| top + h - q * h;
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle" font-size="13">TTFT CDF (queueing + prefill)</text>"#,
        left + w / 2.0,
        top - 10.0
    );
    // Grid and axes.
    let mut d = lo_dec;
    while d <= hi_dec + 1e-9 {
        let x = x_of(10f64.powf(d));
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{}" stroke="#ddd"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
            top + h,
            top + h + 16.0,
            fmt_secs(10f64.powf(d))
        );
        d += 1.0;
    }
    for i in 0..=4 {
        let q = i as f64 / 4.0;
        let y = y_of(q);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{q:.2}</text>"##,
            left + w,
            left - 6.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">TTFT (s, log scale)</text>"#,
        left + w / 2.0,
        top + h + 36.0
    );
    for (i, r) in reports.iter().enumerate() {
        let n = r.ttft_s.len();
        if n == 0 {
            continue;
        }
        let steps = n.min(500);
        let mut points = String::new();
        for k in 0..=steps {
            let q = k as f64 / steps as f64;
            let idx = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
            let _ = write!(points, "{:.1},{:.1} ", x_of(r.ttft_s[idx]), y_of(q));
        }
        let color = COLORS[i % COLORS.len()];
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" stroke-dasharray="{}" points="{}"/>"#,
            DASHES[i % DASHES.len()],
            points.trim_end()
        );
        // Legend, bottom right inside the panel.
        let ly = top + h - 20.0 - (reports.len() - 1 - i) as f64 * 16.0;
        let lx = left + w - 150.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3" stroke-dasharray="{}"/><text x="{}" y="{}">{}</text>"#,
            lx + 20.0,
            DASHES[i % DASHES.len()],
            lx + 26.0,
            ly + 4.0,
            esc(r.policy.as_str())
        );
    }
}

fn bar_panel(s: &mut String, reports: &[PolicyReport]) {
    let (left, top, w, h) = BARS;
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle" font-size="13">Prefix-hit ratio (dashed: ideal)</text>"#,
        left + w / 2.0,
        top - 10.0
    );
    for i in 0..=4 {
        let q = i as f64 / 4.0;
        let y = top + h - q * h;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{q:.2}</text>"##,
            left + w,
            left - 6.0,
            y + 4.0
        );
    }
    let n = reports.len().max(1) as f64;
    let slot = w / n;
    for (i, r) in reports.iter().enumerate() {
        let bh = r.prefix_hit_ratio.clamp(0.0, 1.0) * h;
        let x = left + i as f64 * slot + slot * 0.15;
        let color = COLORS[i % COLORS.len()];
        let _ = writeln!(
            s,
            r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{bh:.1}" fill="{color}"/><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11">{:.3}</text>"#,
            top + h - bh,
            slot * 0.7,
            x + slot * 0.35,
            top + h - bh - 4.0,
            r.prefix_hit_ratio
        );
        let lx = x + slot * 0.35;
        let ly = top + h + 14.0;
        let _ = writeln!(
            s,
            r#"<text x="{lx:.1}" y="{ly:.1}" text-anchor="end" font-size="11" transform="rotate(-30 {lx:.1} {ly:.1})">{}</text>"#,
            esc(r.policy.as_str())
        );
    }
    if let Some(ideal) = reports.first().map(|r| r.ideal_hit_ratio) {
        let y = top + h - ideal.clamp(0.0, 1.0) * h;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#000" stroke-dasharray="6 4"/>"##,
            left + w
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#333"/>"##
    );
}

fn fmt_secs(t: f64) -> String {
    if t >= 1.0 {
        format!("{t:.0}")
    } else {
        let s = format!("{t:.4}");
        s.trim_end_matches('0').to_string()
    }
}
