//! Workload generators: agentic trajectories (tool-using agent sessions whose turns each
//! re-send the whole previous context plus the model's last answer and new tool output) and
//! shared-system-prompt traffic (many single-turn requests behind a few long common prefixes,
//! the herding case).
//!
//! Hash ids follow the Mooncake convention so the generated trace is replayed exactly like a
//! real one: a session's turn `i + 1` repeats the ids of turn `i`'s full blocks and appends new
//! ids; sessions that share a system prompt share its leading full blocks; a partial tail
//! block always gets a fresh id (its content changes as it fills).
//!
//! Sessions start as a Poisson process. Turns are a closed loop: turn `i + 1` arrives a think
//! time (the tool's run time) after turn `i` finished, so a slow worker slows its sessions down
//! the way it would in production.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::trace::{FollowUp, Trace, TraceRequest};

/// Parameters of the agentic generator. Token counts are means of exponential distributions
/// unless said otherwise.
#[derive(Debug, Clone, PartialEq)]
pub struct AgenticParams {
    /// Number of sessions (trajectories).
    pub sessions: usize,
    /// Mean turns per session; each session draws uniformly from `[turns/2, 3*turns/2]`.
    pub turns: usize,
    /// Tokens of the first user message (after the system prompt).
    pub first_turn_tokens: u64,
    /// Tokens of tool output added per turn (on top of the previous answer).
    pub growth_tokens: u64,
    /// Output tokens per turn.
    pub output_tokens: u64,
    /// Mean think (tool) time between a turn's completion and the next turn, microseconds.
    pub think_us: u64,
    /// Number of distinct system prompts shared across sessions (0 = none).
    pub system_prompts: usize,
    /// Tokens of each system prompt (fixed).
    pub system_prompt_tokens: u64,
    /// Session arrival rate, sessions per second.
    pub session_rate: f64,
    /// A session ends when its context would exceed this many tokens.
    pub max_context_tokens: u64,
}

impl Default for AgenticParams {
    fn default() -> Self {
        AgenticParams {
            sessions: 400,
            turns: 12,
            first_turn_tokens: 1500,
            growth_tokens: 1000,
            output_tokens: 300,
            think_us: 2_000_000,
            system_prompts: 4,
            system_prompt_tokens: 4096,
            session_rate: 1.0,
            max_context_tokens: 131_072,
        }
    }
}

/// An exponential draw with the given mean, at least `min`.
fn exp_draw(rng: &mut ChaCha8Rng, mean: f64, min: f64) -> f64 {
    let u: f64 = rng.random();
    (-mean * (1.0 - u).ln()).max(min)
}

/// What both generators require: a positive block size and a positive, finite arrival rate
/// (`rate_name` says which rate, in the error).
fn check_common(block_tokens: u32, rate: f64, rate_name: &str) -> anyhow::Result<()> {
    anyhow::ensure!(block_tokens > 0, "block tokens must be positive");
    anyhow::ensure!(
        rate.is_finite() && rate > 0.0,
        "{rate_name} rate must be positive"
    );
    Ok(())
}

/// Block ids never used before: each names content of its own.
#[derive(Default)]
struct FreshIds(u64);

impl FreshIds {
    fn next(&mut self) -> u64 {
        self.0 += 1;
        self.0 - 1
    }

    /// `count` prompts of `tokens / block_tokens` fresh blocks each (shared system prompts or
    /// prefixes).
    fn prompts(&mut self, count: usize, tokens: u64, block_tokens: u64) -> Vec<Vec<u64>> {
        let blocks = (tokens / block_tokens) as usize;
        (0..count)
            .map(|_| (0..blocks).map(|_| self.next()).collect())
            .collect()
    }
}

/// Generates the sessions' requests, session by session (each session's turns in order).
pub fn agentic(params: &AgenticParams, block_tokens: u32, seed: u64) -> anyhow::Result<Trace> {
    check_common(block_tokens, params.session_rate, "session")?;
    let bt = block_tokens as u64;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut ids = FreshIds::default();
    let systems = ids.prompts(params.system_prompts, params.system_prompt_tokens, bt);
    let mut fresh = || ids.next();

    let mut requests = Vec::new();
    let mut start_us = 0f64;
    let lo = (params.turns / 2).max(1);
    let hi = (params.turns + params.turns / 2).max(lo);
    for _ in 0..params.sessions {
        start_us += exp_draw(&mut rng, 1e6 / params.session_rate, 0.0);
        let turns = rng.random_range(lo..=hi);
        let (system, mut context) = if systems.is_empty() {
            (&[][..], 0)
        } else {
            let s = &systems[rng.random_range(0..systems.len())];
            (&s[..], params.system_prompt_tokens)
        };
        // Full blocks of the context so far: the system prompt's, then the session's own.
        let mut full: Vec<u64> = system.to_vec();
        context += exp_draw(&mut rng, params.first_turn_tokens as f64, 1.0) as u64;
        let mut previous = None;
        for _ in 0..turns {
            if context > params.max_context_tokens {
                break;
            }
            while (full.len() as u64 + 1) * bt <= context {
                full.push(fresh());
            }
            let mut hash_ids = full.clone();
            if context % bt != 0 {
                hash_ids.push(fresh());
            }
            let output = exp_draw(&mut rng, params.output_tokens as f64, 1.0) as u64;
            let think = exp_draw(&mut rng, params.think_us as f64, 0.0) as u64;
            let index = requests.len();
            requests.push(TraceRequest {
                arrival_us: start_us as u64,
                input_tokens: context,
                output_tokens: output,
                hash_ids,
                follows: previous.map(|previous| FollowUp {
                    previous,
                    think_us: think,
                }),
            });
            previous = Some(index);
            context += output + exp_draw(&mut rng, params.growth_tokens as f64, 1.0) as u64;
        }
    }
    Trace::new(block_tokens, requests)
}

/// Parameters of the shared-system-prompt generator. Token counts are means of exponential
/// distributions unless said otherwise.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedPrefixParams {
    /// Number of requests (each a single turn).
    pub requests: usize,
    /// Request arrival rate, requests per second (Poisson).
    pub request_rate: f64,
    /// Number of distinct common prefixes.
    pub prefixes: usize,
    /// Tokens of each common prefix (fixed).
    pub prefix_tokens: u64,
    /// Zipf exponent of prefix popularity: 0 = uniform, 1 = the first prefix is twice as
    /// popular as the second.
    pub prefix_skew: f64,
    /// Tokens of each request's own part after the prefix.
    pub suffix_tokens: u64,
    /// Output tokens per request.
    pub output_tokens: u64,
}

impl Default for SharedPrefixParams {
    fn default() -> Self {
        SharedPrefixParams {
            requests: 6000,
            request_rate: 8.0,
            prefixes: 4,
            prefix_tokens: 8192,
            prefix_skew: 1.0,
            suffix_tokens: 1024,
            output_tokens: 300,
        }
    }
}

/// Generates single-turn requests, each a common prefix (drawn by Zipf popularity) followed by
/// a part of its own.
pub fn shared_prefix(
    params: &SharedPrefixParams,
    block_tokens: u32,
    seed: u64,
) -> anyhow::Result<Trace> {
    check_common(block_tokens, params.request_rate, "request")?;
    anyhow::ensure!(params.prefixes >= 1, "at least one common prefix is needed");
    anyhow::ensure!(
        params.prefix_skew.is_finite() && params.prefix_skew >= 0.0,
        "prefix skew must be a non-negative number"
    );
    let bt = block_tokens as u64;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut ids = FreshIds::default();
    let prefixes = ids.prompts(params.prefixes, params.prefix_tokens, bt);
    let mut fresh = || ids.next();
    let weights: Vec<f64> = (1..=params.prefixes)
        .map(|rank| (rank as f64).powf(-params.prefix_skew))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut requests = Vec::with_capacity(params.requests);
    let mut at_us = 0f64;
    for _ in 0..params.requests {
        at_us += exp_draw(&mut rng, 1e6 / params.request_rate, 0.0);
        let mut pick = rng.random::<f64>() * total;
        let mut p = 0;
        while p + 1 < weights.len() && pick >= weights[p] {
            pick -= weights[p];
            p += 1;
        }
        let input =
            params.prefix_tokens + exp_draw(&mut rng, params.suffix_tokens as f64, 1.0) as u64;
        let mut hash_ids = prefixes[p].clone();
        while (hash_ids.len() as u64 + 1) * bt <= input {
            hash_ids.push(fresh());
        }
        if !input.is_multiple_of(bt) {
            hash_ids.push(fresh());
        }
        let output = exp_draw(&mut rng, params.output_tokens as f64, 1.0) as u64;
        requests.push(TraceRequest {
            arrival_us: at_us as u64,
            input_tokens: input,
            output_tokens: output,
            hash_ids,
            follows: None,
        });
    }
    Trace::new(block_tokens, requests)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_requests_share_one_of_the_common_prefixes_and_nothing_after_it() {
        let params = SharedPrefixParams {
            requests: 300,
            prefixes: 3,
            prefix_tokens: 2048,
            ..SharedPrefixParams::default()
        };
        let trace = shared_prefix(&params, 512, 5).unwrap();
        assert_eq!(trace.requests.len(), 300);
        let mut heads = std::collections::BTreeMap::new();
        let mut seen_after = std::collections::HashSet::new();
        for r in &trace.requests {
            assert!(r.follows.is_none(), "every request is a single turn");
            assert!(r.input_tokens > 2048, "a prefix and a part of its own");
            *heads.entry(r.hash_ids[..4].to_vec()).or_insert(0) += 1;
            for id in &r.hash_ids[4..] {
                assert!(
                    seen_after.insert(*id),
                    "block {id} after the prefix is unique"
                );
            }
        }
        assert_eq!(
            heads.len(),
            3,
            "every request starts with one of 3 prefixes"
        );
        let mut counts: Vec<u32> = heads.into_values().collect();
        counts.sort();
        assert!(
            counts[2] > counts[0],
            "Zipf popularity: the most popular prefix beats the least ({counts:?})"
        );
    }

    #[test]
    fn each_turn_resends_the_previous_turns_full_blocks() {
        let params = AgenticParams {
            sessions: 5,
            ..AgenticParams::default()
        };
        let trace = agentic(&params, 512, 7).unwrap();
        for (i, r) in trace.requests.iter().enumerate() {
            if let Some(f) = r.follows {
                let prev = trace.keys(f.previous);
                let keys = trace.keys(i);
                assert!(keys.len() >= prev.len());
                assert_eq!(
                    &keys[..prev.len()],
                    &prev[..],
                    "turn {i} extends its previous turn"
                );
            }
        }
    }

    #[test]
    fn the_generator_is_deterministic_for_a_seed() {
        let params = AgenticParams {
            sessions: 20,
            ..AgenticParams::default()
        };
        assert_eq!(
            agentic(&params, 512, 1).unwrap(),
            agentic(&params, 512, 1).unwrap()
        );
        assert_ne!(
            agentic(&params, 512, 1).unwrap(),
            agentic(&params, 512, 2).unwrap()
        );
    }
}
