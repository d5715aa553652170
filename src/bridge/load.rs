//! Load samples from the engine's Prometheus endpoint.
//!
//! Every `--load-interval` the bridge reads the engine's `/metrics` and publishes one load
//! sample per dp rank on `<prefix>.load.<worker>` (core NATS, `Kv-Dp-Rank` header):
//!
//! | engine | kv_usage | running | waiting | rank label |
//! | --- | --- | --- | --- | --- |
//! | vLLM | `vllm:kv_cache_usage_perc` | `vllm:num_requests_running` | `vllm:num_requests_waiting` | `engine` |
//! | SGLang | `sglang:token_usage` | `sglang:num_running_reqs` | `sglang:num_queue_reqs` | `dp_rank` (0 when absent) |
//!
//! SGLang writes one series per tensor- and pipeline-parallel rank of the same dp rank; they
//! describe one engine, so the bridge takes the highest value of each gauge among them (the
//! busiest view). An unreachable endpoint publishes nothing: the daemon's telemetry for the
//! worker goes stale and fails open, which is the honest state.

use std::collections::BTreeMap;
use std::time::Duration;

use clap::ValueEnum;

use super::prom_text;
use crate::input::MAX_LOAD_COUNT;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Engine {
    Vllm,
    Sglang,
}

struct Names {
    kv_usage: &'static str,
    running: &'static str,
    waiting: &'static str,
    rank_label: &'static str,
}

impl Engine {
    fn names(self) -> Names {
        match self {
            Engine::Vllm => Names {
                kv_usage: "vllm:kv_cache_usage_perc",
                running: "vllm:num_requests_running",
                waiting: "vllm:num_requests_waiting",
                rank_label: "engine",
            },
            Engine::Sglang => Names {
                kv_usage: "sglang:token_usage",
                running: "sglang:num_running_reqs",
                waiting: "sglang:num_queue_reqs",
                rank_label: "dp_rank",
            },
        }
    }
}

/// One rank's load, as read from the engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankLoad {
    pub kv_usage: f64,
    pub running: u32,
    pub waiting: u32,
}

#[derive(Debug, Default, Clone, Copy)]
struct Partial {
    kv_usage: Option<f64>,
    running: Option<f64>,
    waiting: Option<f64>,
}

fn max_into(slot: &mut Option<f64>, v: f64) {
    *slot = Some(slot.map_or(v, |s| s.max(v)));
}

/// The load of every rank the text reports all three gauges for, by rank. Lines that cannot be
/// read, non-finite values and unparsable rank labels are returned as problems (the caller logs
/// them) and skipped.
pub fn read_loads(engine: Engine, text: &str) -> (BTreeMap<u32, RankLoad>, Vec<String>) {
    let names = engine.names();
    let (samples, errors) = prom_text::parse(text, &[names.kv_usage, names.running, names.waiting]);
    let mut problems: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
    let mut partial: BTreeMap<u32, Partial> = BTreeMap::new();
    for s in samples {
        let rank = match s.label(names.rank_label) {
            None => 0,
            Some(r) => match r.parse::<u32>() {
                Ok(r) => r,
                Err(_) => {
                    problems.push(format!("{}: rank label {r:?} is not a number", s.name));
                    continue;
                }
            },
        };
        if !s.value.is_finite() || s.value < 0.0 {
            problems.push(format!("{}: value {} out of range", s.name, s.value));
            continue;
        }
        let p = partial.entry(rank).or_default();
        if s.name == names.kv_usage {
            max_into(&mut p.kv_usage, s.value);
        } else if s.name == names.running {
            max_into(&mut p.running, s.value);
        } else {
            max_into(&mut p.waiting, s.value);
        }
    }
    let loads = partial
        .into_iter()
        .filter_map(|(rank, p)| {
            Some((
                rank,
                RankLoad {
                    // A usage a hair above 1 (rounding) is full, not invalid.
                    kv_usage: p.kv_usage?.min(1.0),
                    // Past the daemon's bound a sample would be rejected: report the bound.
                    running: p.running?.round().min(MAX_LOAD_COUNT as f64) as u32,
                    waiting: p.waiting?.round().min(MAX_LOAD_COUNT as f64) as u32,
                },
            ))
        })
        .collect();
    (loads, problems)
}

/// Fetches the endpoint's text.
pub async fn scrape(client: &reqwest::Client, url: &str) -> Result<String, String> {
    let response = client
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("HTTP {}", response.status()));
    }
    response.text().await.map_err(|e| e.to_string())
}

/// What the scrape loop needs.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    pub url: String,
    pub engine: Engine,
    pub interval: Duration,
    pub max_running: Option<u32>,
    pub dp_size: u32,
    pub model: Option<String>,
    /// `<prefix>.load.<worker>`
    pub subject: String,
}

/// Scrapes every `interval` and publishes one sample per rank on core NATS. Failures are
/// counted and logged at most once per 30s.
pub async fn run(cfg: LoadConfig, client: async_nats::Client) {
    let http = reqwest::Client::new();
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_log: Option<std::time::Instant> = None;
    let mut suppressed = 0u64;
    let mut log = |what: String| {
        if last_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(30)) {
            tracing::warn!(suppressed, "load: {what}");
            last_log = Some(std::time::Instant::now());
            suppressed = 0;
        } else {
            suppressed += 1;
        }
    };
    metrics::counter!("kvrouted_bridge_load_samples_total").absolute(0);
    metrics::counter!("kvrouted_bridge_scrape_errors_total").absolute(0);
    loop {
        tick.tick().await;
        let text = match scrape(&http, &cfg.url).await {
            Ok(t) => t,
            Err(e) => {
                metrics::counter!("kvrouted_bridge_scrape_errors_total").increment(1);
                log(format!("{} unreachable, publishing nothing: {e}", cfg.url));
                continue;
            }
        };
        let (loads, problems) = read_loads(cfg.engine, &text);
        if !problems.is_empty() {
            log(format!("{}: {}", cfg.url, problems.join("; ")));
        }
        if loads.is_empty() {
            metrics::counter!("kvrouted_bridge_scrape_errors_total").increment(1);
            log(format!("{} has no {:?} load gauges", cfg.url, cfg.engine));
            continue;
        }
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        for (rank, load) in loads.range(..cfg.dp_size) {
            let payload = crate::wire::encode_load(
                load.kv_usage,
                load.running,
                load.waiting,
                cfg.max_running,
                ts,
                cfg.model.as_deref(),
            );
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Kv-Dp-Rank", rank.to_string().as_str());
            if let Some(model) = &cfg.model {
                headers.insert("Kv-Model", model.as_str());
            }
            match client
                .publish_with_headers(cfg.subject.clone(), headers, payload.into())
                .await
            {
                Ok(()) => metrics::counter!("kvrouted_bridge_load_samples_total").increment(1),
                Err(e) => log(format!("publish on {}: {e}", cfg.subject)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_gauges_are_read_per_engine_label() {
        let text = "\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.25
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 4.0
vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 1.0
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0
vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 0.0
vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"m\",reason=\"x\"} 9.0
";
        let (loads, problems) = read_loads(Engine::Vllm, text);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(
            loads[&0],
            RankLoad {
                kv_usage: 0.5,
                running: 4,
                waiting: 2
            }
        );
        assert_eq!(loads[&1].kv_usage, 0.25);
    }

    #[test]
    fn sglang_tp_series_of_one_dp_rank_are_one_engine() {
        let text = "\
sglang:token_usage{model_name=\"m\",tp_rank=\"0\",pp_rank=\"0\"} 0.3
sglang:token_usage{model_name=\"m\",tp_rank=\"1\",pp_rank=\"0\"} 0.4
sglang:num_running_reqs{model_name=\"m\",tp_rank=\"0\",pp_rank=\"0\"} 7
sglang:num_running_reqs{model_name=\"m\",tp_rank=\"1\",pp_rank=\"0\"} 7
sglang:num_queue_reqs{model_name=\"m\",tp_rank=\"0\",pp_rank=\"0\"} 1
";
        let (loads, _) = read_loads(Engine::Sglang, text);
        assert_eq!(loads.len(), 1, "no dp_rank label: everything is rank 0");
        assert_eq!(
            loads[&0],
            RankLoad {
                kv_usage: 0.4,
                running: 7,
                waiting: 1
            }
        );
    }

    #[test]
    fn sglang_dp_rank_label_names_the_rank() {
        let text = "\
sglang:token_usage{dp_rank=\"2\",tp_rank=\"0\"} 0.9
sglang:num_running_reqs{dp_rank=\"2\",tp_rank=\"0\"} 3
sglang:num_queue_reqs{dp_rank=\"2\",tp_rank=\"0\"} 0
";
        let (loads, _) = read_loads(Engine::Sglang, text);
        assert_eq!(loads.keys().copied().collect::<Vec<_>>(), vec![2]);
    }

    #[test]
    fn a_rank_missing_a_gauge_or_with_a_bad_value_gives_no_sample() {
        let text = "\
vllm:kv_cache_usage_perc{engine=\"0\"} NaN
vllm:num_requests_running{engine=\"0\"} 1
vllm:num_requests_waiting{engine=\"0\"} 1
vllm:kv_cache_usage_perc{engine=\"1\"} 0.1
vllm:num_requests_running{engine=\"1\"} 1
";
        let (loads, problems) = read_loads(Engine::Vllm, text);
        assert!(loads.is_empty(), "{loads:?}");
        assert_eq!(problems.len(), 1, "the NaN is reported: {problems:?}");
    }
}
