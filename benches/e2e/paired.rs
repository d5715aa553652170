//! kvrouted against the HTTP floor.

use super::*;

pub(crate) struct PairedTargets<'a> {
    pub(crate) route: &'a str,
    pub(crate) floor: SocketAddr,
    pub(crate) daemon: SocketAddr,
}

/// Rounds in which kvrouted, the floor and the floor that parses take turns, so that whatever
/// else the machine does lands on all three alike.
pub(crate) const PAIRED_ROUNDS: u32 = 4;

/// How a paired phase's 4k-token prompts are sent.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum BodyKind {
    /// `{"tokens": [...4,096 ids...]}`, 24.6 KiB.
    Tokens,
    /// `{"block_keys": [...256 keys...]}`, what a gateway that hashes tokens itself sends.
    BlockKeys,
}

/// 4k-token route requests at `concurrency` against kvrouted, the floor (fixed reply) and the
/// floor that also parses the body; reports all three and kvrouted's own share, and returns
/// kvrouted's routes per second over those of the floor that parses.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn paired_4k(
    o: &Options,
    targets: PairedTargets<'_>,
    pids: &Pids,
    (kind, bodies): (BodyKind, Arc<Vec<Bytes>>),
    concurrency: usize,
    mode: Mode,
    report: &mut Report,
    tck: f64,
) -> f64 {
    let urls = [
        targets.route.to_owned(),
        format!("http://{}/floor", targets.floor),
        format!("http://{}/floor_parse", targets.floor),
    ];
    let names = ["kvrouted", "floor", "floor+parse"];
    let client = http_client(concurrency);
    let slice = o.duration / PAIRED_ROUNDS;
    let mut raws: [Raw; 3] = Default::default();
    let (mut handler_sum, mut handler_count, mut daemon_ticks, mut daemon_secs) =
        (0.0, 0.0, 0u64, 0.0);
    let metrics_client = reqwest::Client::new();
    // Only kvrouted's turns reach the daemon, so its counters across all the rounds are its own.
    let before = counters(&metrics_client, targets.daemon).await;
    for _ in 0..PAIRED_ROUNDS {
        for (i, url) in urls.iter().enumerate() {
            let (c0, cpu0) = if i == 0 {
                (
                    counters(&metrics_client, targets.daemon).await,
                    Some(cpu(pids.daemon)),
                )
            } else {
                (Counters::default(), None)
            };
            let raw = http_load_raw(&client, url, bodies.clone(), concurrency, slice).await;
            if let Some(cpu0) = cpu0 {
                let c1 = counters(&metrics_client, targets.daemon).await;
                let cpu1 = cpu(pids.daemon);
                handler_sum += c1.route_sum - c0.route_sum;
                handler_count += c1.route_count - c0.route_count;
                daemon_ticks += cpu1.ticks.saturating_sub(cpu0.ticks);
                daemon_secs += (cpu1.at - cpu0.at).as_secs_f64();
            }
            raws[i].add(raw);
        }
    }
    let decisions = counters(&metrics_client, targets.daemon)
        .await
        .decisions_since(&before);
    let loads: Vec<Load> = raws.into_iter().map(Raw::summary).collect();
    let handler_mean = 1e6 * handler_sum / handler_count.max(1.0);
    let daemon_cores = daemon_ticks as f64 / tck / daemon_secs.max(1e-9);
    let (what, phase) = match kind {
        BodyKind::Tokens => ("4k-token prompts", "4k paired"),
        BodyKind::BlockKeys => ("4k-token prompts as block_keys", "4k block_keys paired"),
    };
    report.line(format!(
        "  {what}, concurrency {concurrency}, {PAIRED_ROUNDS} interleaved rounds:"
    ));
    for (name, load) in names.iter().zip(&loads) {
        report.line(load_line(name, load));
    }
    let share = |route: f64, floor: f64| 100.0 * (1.0 - floor / route);
    let (route, bare, parse) = (&loads[0], &loads[1], &loads[2]);
    report.line(format!(
        "    daemon handler mean {handler_mean:.1} µs; daemon {daemon_cores:.2} cores while serving. kvrouted's own share of the route: {:.0}% at p50, {:.0}% of the mean; beyond parsing the JSON body: {:.0}% at p50; decisions: {decisions}",
        share(route.p50_us, bare.p50_us),
        share(route.mean_us, bare.mean_us),
        share(route.p50_us, parse.p50_us),
    ));
    report.json.push(format!(
        "{{\"mode\":\"{}\",\"phase\":\"{phase}, concurrency {concurrency}\",\"kvrouted\":{},\"floor\":{},\"floor_parse\":{},\"daemon_handler_mean_us\":{handler_mean:.1},\"share_p50_pct\":{:.1},\"share_mean_pct\":{:.1},\"share_beyond_parse_p50_pct\":{:.1}}}",
        mode.name(),
        load_json(route),
        load_json(bare),
        load_json(parse),
        share(route.p50_us, bare.p50_us),
        share(route.mean_us, bare.mean_us),
        share(route.p50_us, parse.p50_us),
    ));
    route.per_s / parse.per_s.max(1e-9)
}
