//! HTTP load.

use super::*;

/// A route request body with the first `len` tokens of prefix `j`.
pub(crate) fn route_body(j: usize, len: usize) -> Bytes {
    let tokens: Vec<u32> = (0..len).map(|t| token(j, t)).collect();
    Bytes::from(
        serde_json::to_vec(&serde_json::json!({ "tokens": tokens, "max_output_tokens": 256 }))
            .unwrap(),
    )
}

/// The same prompt as [`route_body`], sent as the block keys a gateway that hashes tokens itself
/// sends (`len / 16` keys instead of `len` token ids).
pub(crate) fn route_body_keys(j: usize, len: usize) -> Bytes {
    let tokens: Vec<u32> = (0..len).map(|t| token(j, t)).collect();
    let keys = kvrouted::hashing::block_keys(&tokens, BLOCK);
    Bytes::from(
        serde_json::to_vec(
            &serde_json::json!({ "block_keys": keys, "prompt_tokens": len, "max_output_tokens": 256 }),
        )
        .unwrap(),
    )
}

/// Bodies with log-uniform prompt lengths between 1k and 32k tokens.
pub(crate) fn mixed_bodies(n: usize) -> Vec<Bytes> {
    (0..n)
        .map(|i| {
            let r = mix(0x5eed_0000 + i as u64);
            let j = (r % PREFIXES as u64) as usize;
            let u = (r >> 16) as f64 / (1u64 << 48) as f64;
            let len = (1024.0 * 32f64.powf(u)) as usize;
            route_body(j, len.clamp(1024, PREFIX_TOKENS))
        })
        .collect()
}

pub(crate) struct Load {
    pub(crate) requests: u64,
    pub(crate) errors: u64,
    /// The first failed request's status and body (or transport error), for the report.
    pub(crate) first_error: Option<String>,
    pub(crate) per_s: f64,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    pub(crate) p999_us: f64,
    pub(crate) mean_us: f64,
    pub(crate) body_kib: f64,
}

/// The `p` percentile of sorted nanosecond latencies, in microseconds.
pub(crate) fn pct(sorted: &[u64], p: f64) -> f64 {
    kvrouted::sim::percentile(sorted, p) as f64 / 1000.0
}

/// What one load run measured: every latency (ns), errors, body bytes and the wall time.
#[derive(Default)]
pub(crate) struct Raw {
    pub(crate) lat: Vec<u64>,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
    pub(crate) bytes: u64,
    pub(crate) secs: f64,
}

impl Raw {
    pub(crate) fn add(&mut self, other: Raw) {
        self.lat.extend(other.lat);
        self.errors += other.errors;
        self.first_error = self.first_error.take().or(other.first_error);
        self.bytes += other.bytes;
        self.secs += other.secs;
    }

    pub(crate) fn summary(mut self) -> Load {
        self.lat.sort_unstable();
        let n = self.lat.len().max(1) as f64;
        Load {
            requests: self.lat.len() as u64,
            errors: self.errors,
            first_error: self.first_error,
            per_s: self.lat.len() as f64 / self.secs.max(1e-9),
            p50_us: pct(&self.lat, 0.5),
            p99_us: pct(&self.lat, 0.99),
            p999_us: pct(&self.lat, 0.999),
            mean_us: self.lat.iter().sum::<u64>() as f64 / n / 1000.0,
            body_kib: self.bytes as f64 / n / 1024.0,
        }
    }
}

/// `concurrency` request loops against `url` until `duration` has passed.
pub(crate) async fn http_load_raw(
    client: &reqwest::Client,
    url: &str,
    bodies: Arc<Vec<Bytes>>,
    concurrency: usize,
    duration: Duration,
) -> Raw {
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::new();
    for c in 0..concurrency {
        let (client, bodies, url) = (client.clone(), bodies.clone(), url.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut raw = Raw::default();
            let mut n = c;
            while Instant::now() < deadline {
                let body = bodies[n % bodies.len()].clone();
                n += concurrency;
                raw.bytes += body.len() as u64;
                let t = Instant::now();
                let error = match client
                    .post(&url)
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(body)
                    .send()
                    .await
                {
                    Ok(r) => {
                        let status = r.status();
                        match r.bytes().await {
                            Ok(_) if status.is_success() => None,
                            Ok(body) => Some(format!(
                                "{status}: {}",
                                String::from_utf8_lossy(&body[..body.len().min(200)])
                            )),
                            Err(e) => Some(e.to_string()),
                        }
                    }
                    Err(e) => Some(e.to_string()),
                };
                raw.lat.push(t.elapsed().as_nanos() as u64);
                if let Some(error) = error {
                    raw.errors += 1;
                    raw.first_error.get_or_insert(error);
                }
            }
            raw
        }));
    }
    let mut all = Raw::default();
    for t in tasks {
        all.add(t.await.unwrap());
    }
    all.secs = start.elapsed().as_secs_f64();
    all
}

pub(crate) fn http_client(concurrency: usize) -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()
        .unwrap()
}

pub(crate) async fn http_load(
    url: &str,
    bodies: Arc<Vec<Bytes>>,
    concurrency: usize,
    duration: Duration,
) -> Load {
    let client = http_client(concurrency);
    http_load_raw(&client, url, bodies, concurrency, duration)
        .await
        .summary()
}
