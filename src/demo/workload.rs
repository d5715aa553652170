//! The demo's requests: a Mooncake trace or the simulator's agentic generator, turned into the
//! token lists a gateway sends, paced to the requested rate and repeated until the demo stops.
//!
//! Traces describe prompts by block ids (equal ids at equal positions are equal prefixes). The
//! demo gives block id `h` the tokens `h * B, h * B + 1, ..., h * B + B - 1`, where `B` is the
//! trace's tokens per id, so equal ids are equal tokens and the daemon's own hashing of the
//! tokens finds the same prefixes. Sessions repeat after a pass of the workload (about two
//! minutes for the generator). The generated workload's first system prompt is therefore
//! always the tokens `0, 1, 2, ...`: a prefix the demo's workers hold once it has run a few
//! seconds.

use std::path::Path;

use crate::sim::{generate, AgenticParams, Generator, SharedPrefixParams, Trace};

/// Seconds one pass of the generated workload lasts at least (at `--rate`), before its
/// sessions repeat.
const GENERATED_PASS_S: f64 = 120.0;
/// Bounds the generated workload's memory at very high rates.
const MAX_SESSIONS: usize = 100_000;

/// The generator's parameters for a live demo: smaller prompts than the simulator's defaults,
/// so token lists stay small on the wire and a few workers show reuse and eviction within
/// seconds. About 8 routes per second before `--rate` scales them.
pub fn demo_agentic_params() -> AgenticParams {
    AgenticParams {
        sessions: 200,
        turns: 8,
        first_turn_tokens: 512,
        growth_tokens: 256,
        output_tokens: 64,
        think_us: 1_000_000,
        system_prompts: 4,
        system_prompt_tokens: 1024,
        session_rate: 1.0,
        max_context_tokens: 8192,
    }
}

/// The shared-system-prompt workload at demo scale: single-turn requests behind four common
/// prefixes, short enough that simulated prefill and decode take milliseconds.
pub fn demo_shared_prefix_params() -> SharedPrefixParams {
    SharedPrefixParams {
        requests: 600,
        request_rate: 5.0,
        prefixes: 4,
        prefix_tokens: 1024,
        prefix_skew: 1.0,
        suffix_tokens: 256,
        output_tokens: 64,
    }
}

/// Requests in a repeating schedule.
#[derive(Debug, Clone)]
pub struct Workload {
    pub trace: Trace,
    /// Request → the follow-up turn its completion releases.
    pub follow_up: Vec<Option<usize>>,
    /// Requests that arrive on their own (not follow-ups), in arrival order.
    pub open: Vec<usize>,
    /// Length of one pass of the schedule: the next pass starts this long after the previous.
    pub cycle_us: u64,
}

impl Workload {
    /// Reads `trace` (Mooncake JSONL with `trace_block_tokens` tokens per hash id) or generates
    /// the `generator`'s workload (agentic when none is named), and scales open-loop arrivals
    /// to `rate` routes per second.
    pub fn build(
        trace: Option<&Path>,
        generator: Option<Generator>,
        trace_block_tokens: u32,
        block_size: u32,
        rate: Option<f64>,
        seed: u64,
    ) -> anyhow::Result<Workload> {
        let trace = match (trace, generator) {
            (Some(path), _) => Trace::load_mooncake(path, trace_block_tokens, None)?,
            (None, None | Some(Generator::Agentic)) => {
                let mut params = demo_agentic_params();
                // Enough sessions that one pass lasts about two minutes at the rate before the
                // same sessions come back (a repeat would overstate the hit ratio).
                if let Some(rate) = rate.filter(|r| r.is_finite() && *r > 0.0) {
                    let needed = (GENERATED_PASS_S * rate / params.turns as f64).ceil() as usize;
                    params.sessions = params.sessions.max(needed.min(MAX_SESSIONS));
                }
                generate::agentic(&params, block_size, seed)?
            }
            (None, Some(Generator::SharedPrefix)) => {
                let mut params = demo_shared_prefix_params();
                if let Some(rate) = rate.filter(|r| r.is_finite() && *r > 0.0) {
                    params.request_rate = rate;
                    params.requests = ((GENERATED_PASS_S * rate).ceil() as usize).max(100);
                }
                generate::shared_prefix(&params, block_size, seed)?
            }
        };
        Workload::new(trace, rate)
    }

    pub fn new(mut trace: Trace, rate: Option<f64>) -> anyhow::Result<Workload> {
        anyhow::ensure!(!trace.requests.is_empty(), "the workload has no requests");
        let open: Vec<usize> = (0..trace.requests.len())
            .filter(|&i| trace.requests[i].follows.is_none())
            .collect();
        anyhow::ensure!(!open.is_empty(), "the workload has no first requests");
        if let Some(rate) = rate {
            anyhow::ensure!(
                rate.is_finite() && rate > 0.0,
                "--rate must be a positive number of routes per second"
            );
            // Follow-ups arrive when their previous turn finished, so one pass of the open
            // arrivals carries every request: scaling the open arrivals scales the route rate.
            let native = trace.requests.len() as f64 / span_s(&trace, &open);
            trace.speed_up(rate / native);
        }
        let span_us = (span_s(&trace, &open) * 1e6) as u64;
        let cycle_us = span_us + span_us / open.len() as u64;
        let mut follow_up = vec![None; trace.requests.len()];
        for (i, r) in trace.requests.iter().enumerate() {
            if let Some(f) = r.follows {
                follow_up[f.previous] = Some(i);
            }
        }
        Ok(Workload {
            trace,
            follow_up,
            open,
            cycle_us: cycle_us.max(1),
        })
    }

    /// When the `pos`-th open arrival of pass `pass` is due, in microseconds since the start.
    pub fn open_at_us(&self, pos: usize, pass: u64) -> u64 {
        let arrival = |i: usize| self.trace.requests[self.open[i]].arrival_us;
        pass * self.cycle_us + (arrival(pos) - arrival(0))
    }

    /// The prompt of request `i` as tokens (`input_tokens` of them).
    pub fn tokens(&self, i: usize) -> Vec<u32> {
        let r = &self.trace.requests[i];
        let bt = self.trace.block_tokens as u64;
        (0..r.input_tokens)
            .map(|t| {
                let block = (t / bt) as usize;
                // A trace with fewer ids than blocks: the rest is content of this request only.
                let id = r
                    .hash_ids
                    .get(block)
                    .copied()
                    .unwrap_or_else(|| u64::MAX / 2 - (i as u64) * 4096 - block as u64);
                id.wrapping_mul(bt).wrapping_add(t % bt) as u32
            })
            .collect()
    }
}

/// Seconds from the first to the last open arrival, at least one second.
fn span_s(trace: &Trace, open: &[usize]) -> f64 {
    let first = trace.requests[open[0]].arrival_us;
    let last = trace.requests[*open.last().expect("open is not empty")].arrival_us;
    ((last - first) as f64 / 1e6).max(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::block_keys;
    use crate::sim::{FollowUp, TraceRequest};

    fn request(arrival_us: u64, input: u64, ids: &[u64], follows: Option<usize>) -> TraceRequest {
        TraceRequest {
            arrival_us,
            input_tokens: input,
            output_tokens: 4,
            hash_ids: ids.to_vec(),
            follows: follows.map(|previous| FollowUp {
                previous,
                think_us: 0,
            }),
        }
    }

    #[test]
    fn equal_block_ids_give_equal_tokens_and_so_equal_block_keys() {
        let trace = Trace::new(
            4,
            vec![
                request(0, 10, &[7, 8, 9], None),
                request(1, 8, &[7, 8], Some(0)),
                request(2, 8, &[7, 3], None),
            ],
        )
        .unwrap();
        let w = Workload::new(trace, None).unwrap();
        let (a, b, c) = (w.tokens(0), w.tokens(1), w.tokens(2));
        assert_eq!(a.len(), 10, "a prompt has input_tokens tokens");
        assert_eq!(&a[..4], &[28, 29, 30, 31], "block id 7 is tokens 28..32");
        assert_eq!(block_keys(&a, 4), block_keys(&b, 4), "same ids, same keys");
        let (ka, kc) = (block_keys(&a, 4), block_keys(&c, 4));
        assert_eq!(ka[0], kc[0], "a shared first block is a shared prefix");
        assert_ne!(ka[1], kc[1], "different second ids are different prefixes");
        assert_eq!(w.open, vec![0, 2], "the follow-up is not an open arrival");
        assert_eq!(w.follow_up[0], Some(1));
    }

    #[test]
    fn rate_scales_open_arrivals_so_all_requests_fit_the_rate() {
        // 4 requests whose open arrivals span 4 s: 1 route/s natively.
        let trace = Trace::new(
            4,
            vec![
                request(0, 4, &[1], None),
                request(0, 4, &[1], Some(0)),
                request(2_000_000, 4, &[2], None),
                request(4_000_000, 4, &[3], None),
            ],
        )
        .unwrap();
        let w = Workload::new(trace, Some(4.0)).unwrap();
        let last = w.trace.requests[3].arrival_us;
        assert_eq!(last, 1_000_000, "4 routes/s: the 4 requests fit in 1 s");
        assert!(w.cycle_us > last, "the next pass starts after this one");
        assert!(Workload::new(w.trace.clone(), Some(0.0)).is_err());
    }

    #[test]
    fn a_generated_pass_lasts_minutes_even_at_a_high_rate() {
        let w = Workload::build(None, None, 512, 16, Some(200.0), 0).unwrap();
        assert!(
            w.cycle_us >= 100_000_000,
            "sessions repeat only after about two minutes, not {}us",
            w.cycle_us
        );
    }

    #[test]
    fn the_default_workload_sends_its_first_system_prompt_from_token_zero_within_seconds() {
        let w = Workload::build(None, None, 512, 16, None, 0).unwrap();
        let prompt = demo_agentic_params().system_prompt_tokens as u32;
        let first = (0..w.trace.requests.len())
            .find(|&i| w.tokens(i)[0] == 0)
            .expect("some session uses the first system prompt");
        let expected: Vec<u32> = (0..prompt).collect();
        assert_eq!(&w.tokens(first)[..prompt as usize], &expected[..]);
        assert!(
            w.trace.requests[first].arrival_us < 5_000_000,
            "the README's prefix (tokens 0..63) is routed within the first seconds"
        );
    }
}
