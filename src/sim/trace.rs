//! Traces the simulator replays: Mooncake JSONL files and generated workloads.
//!
//! A request's prompt is described the Mooncake way: `hash_ids`, one id per block of `block_tokens`
//! tokens, where equal ids at equal positions mean equal prefixes. Only full blocks are keyed
//! (docs/architecture.md, "Block keys": a partial tail block is not keyed), so a request has
//! `min(hash_ids.len(), input_tokens / block_tokens)` keyed blocks. The ids are used as the blocks'
//! *local* hashes; the block keys are [`chain_locals`] of them, exactly as a gateway would send
//! them.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use anyhow::{bail, Context};
use rustc_hash::FxHashSet;
use serde::Deserialize;

use crate::hashing::chain_locals;

/// A request that is sent only after an earlier request of the same session finished: the
/// closed loop of an agent that waits for the model, runs a tool, then sends the next turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FollowUp {
    /// Index of the request whose completion releases this one (always an earlier index).
    pub previous: usize,
    /// Time between that completion and this request's arrival, in microseconds.
    pub think_us: u64,
}

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRequest {
    /// Arrival in microseconds since the start of the trace. For a follow-up this is only the
    /// nominal time; the real arrival is `think_us` after the previous request finished.
    pub arrival_us: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// One prefix-unique id per block of the prompt (the last one may be a partial block).
    pub hash_ids: Vec<u64>,
    pub follows: Option<FollowUp>,
}

/// A workload: requests in arrival order and the tokens per block of their hash ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    pub block_tokens: u32,
    pub requests: Vec<TraceRequest>,
}

/// One line of a Mooncake trace.
#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

impl Trace {
    /// A trace from requests given by hand. Follow-ups must name earlier requests.
    pub fn new(block_tokens: u32, requests: Vec<TraceRequest>) -> anyhow::Result<Trace> {
        if block_tokens == 0 {
            bail!("block tokens must be positive");
        }
        for (i, r) in requests.iter().enumerate() {
            if let Some(f) = r.follows {
                if f.previous >= i {
                    bail!(
                        "request {i} follows request {}, which is not earlier",
                        f.previous
                    );
                }
            }
        }
        Ok(Trace {
            block_tokens,
            requests,
        })
    }

    /// Reads a Mooncake JSONL trace (`timestamp` in ms, `input_length`, `output_length`,
    /// `hash_ids`), keeping the first `limit` requests. Requests are put in timestamp order
    /// (stable, so equal timestamps keep their file order).
    pub fn read_mooncake(
        reader: impl BufRead,
        block_tokens: u32,
        limit: Option<usize>,
    ) -> anyhow::Result<Trace> {
        let mut requests = Vec::new();
        for (n, line) in reader.lines().enumerate() {
            if limit.is_some_and(|limit| requests.len() >= limit) {
                break;
            }
            let line = line.with_context(|| format!("reading line {}", n + 1))?;
            if line.trim().is_empty() {
                continue;
            }
            let rec: MooncakeLine = serde_json::from_str(&line)
                .with_context(|| format!("line {}: not a Mooncake trace record", n + 1))?;
            if !rec.timestamp.is_finite() || rec.timestamp < 0.0 {
                bail!("line {}: timestamp {} is not a time", n + 1, rec.timestamp);
            }
            requests.push(TraceRequest {
                arrival_us: (rec.timestamp * 1000.0).round() as u64,
                input_tokens: rec.input_length,
                output_tokens: rec.output_length,
                hash_ids: rec.hash_ids,
                follows: None,
            });
        }
        requests.sort_by_key(|r| r.arrival_us);
        Trace::new(block_tokens, requests)
    }

    /// [`Trace::read_mooncake`] from a file.
    pub fn load_mooncake(
        path: &Path,
        block_tokens: u32,
        limit: Option<usize>,
    ) -> anyhow::Result<Trace> {
        let file = File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
        Trace::read_mooncake(BufReader::new(file), block_tokens, limit)
            .with_context(|| format!("reading trace {}", path.display()))
    }

    /// Keeps the first `limit` requests.
    pub fn truncate(&mut self, limit: usize) {
        self.requests.truncate(limit);
    }

    /// Divides open-loop arrival times by `factor` (2 = twice the request rate). Think times
    /// of follow-ups are a property of the agent, not of the arrival rate, and stay as they are.
    pub fn speed_up(&mut self, factor: f64) {
        assert!(
            factor.is_finite() && factor > 0.0,
            "speed-up must be positive"
        );
        for r in &mut self.requests {
            r.arrival_us = (r.arrival_us as f64 / factor).round() as u64;
        }
    }

    /// Number of keyed (full) blocks of request `i`.
    pub fn keyed_blocks(&self, i: usize) -> usize {
        let r = &self.requests[i];
        r.hash_ids
            .len()
            .min((r.input_tokens / self.block_tokens as u64) as usize)
    }

    /// The block keys a gateway would send for request `i`.
    pub fn keys(&self, i: usize) -> Vec<u64> {
        chain_locals(
            self.requests[i].hash_ids[..self.keyed_blocks(i)]
                .iter()
                .copied(),
        )
    }

    pub fn prompt_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.input_tokens).sum()
    }

    /// Hit ratio of one infinite cache that has seen every earlier request: cached prompt
    /// tokens / prompt tokens, where a request's cached tokens are its leading keyed blocks
    /// already in the cache times the block size.
    pub fn ideal_hit_ratio(&self) -> f64 {
        let mut seen = FxHashSet::default();
        let mut cached = 0u64;
        for i in 0..self.requests.len() {
            let keys = self.keys(i);
            let hit = keys.iter().take_while(|k| seen.contains(*k)).count();
            cached += hit as u64 * self.block_tokens as u64;
            seen.extend(keys);
        }
        ratio(cached, self.prompt_tokens())
    }
}

pub(crate) fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_lines_parse_and_partial_tail_blocks_are_not_keyed() {
        let text = "{\"timestamp\": 5, \"input_length\": 1030, \"output_length\": 7, \"hash_ids\": [0, 1, 2]}\n\n\
                    {\"timestamp\": 2, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [0]}\n";
        let trace = Trace::read_mooncake(text.as_bytes(), 512, None).unwrap();
        assert_eq!(trace.requests.len(), 2);
        assert_eq!(
            trace.requests[0].arrival_us, 2_000,
            "requests are sorted by timestamp"
        );
        assert_eq!(
            trace.keyed_blocks(1),
            2,
            "1030 tokens hold two full 512-token blocks"
        );
        assert_eq!(trace.keys(1), chain_locals([0, 1]));
        // The second request re-uses block 0 of the first: 512 of 1542 prompt tokens.
        assert!((trace.ideal_hit_ratio() - 512.0 / 1542.0).abs() < 1e-12);
    }

    #[test]
    fn limit_keeps_the_first_requests_of_the_file() {
        let text =
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n"
                .repeat(5);
        let trace = Trace::read_mooncake(text.as_bytes(), 512, Some(3)).unwrap();
        assert_eq!(trace.requests.len(), 3);
    }

    #[test]
    fn a_bad_line_is_reported_with_its_number() {
        let text = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\nnope\n";
        let err = Trace::read_mooncake(text.as_bytes(), 512, None).unwrap_err();
        assert!(format!("{err:#}").contains("line 2"), "{err:#}");
    }
}
