//! The routers of a simulated deployment: one router, or R replicas behind a round-robin
//! gateway that share their decisions as the daemon's replicas do.
//!
//! Every replica consumes the same worker inputs (KV events, load samples, lifecycle, ticks),
//! as replicas consuming one stream do. Each route goes to the next replica in turn; the
//! route's [`PeerEvent`] (and that of each release the replica takes) reaches the other
//! replicas after the decision delay and is applied there as [`Input::Peer`], the path the
//! daemon uses. Without sharing (`decision_delay_ms` none) replicas decide alone.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::input::{Input, Stamped};
use crate::replicas::{PeerEvent, ReservationSecret};
use crate::router::{Output, Router, RouterConfig};

/// One replica: its router and its journal sequence.
struct Replica {
    router: Router,
    seq: u64,
}

pub(super) struct Routers {
    replicas: Vec<Replica>,
    /// The replica the gateway sends the next route to.
    next: usize,
    /// Delay of a decision from its replica to the others; none: they do not share.
    delay_us: Option<u64>,
}

impl Routers {
    /// `count` routers with `config`; the first journal sequence of the first is `first_seq`
    /// (so one router runs exactly as before replicas existed), the others' and their
    /// reservation secrets come from `seed`. Replicas are named `r0`, `r1`, ...; a single
    /// router runs alone (no replica id: it publishes nothing).
    pub fn new(
        config: RouterConfig,
        count: usize,
        decision_delay_ms: Option<u64>,
        first_seq: u64,
        seed: u64,
    ) -> Routers {
        // Apart from the load-sample phases drawn from `seed`, so one router runs as before.
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_0f4e_9c1a_5e9d);
        let replicas = (0..count.max(1))
            .map(|i| {
                let mut config = config.clone();
                if count > 1 {
                    config.replica_id = format!("r{i}");
                    config.reservation_secret = Some(ReservationSecret::from_bytes(rng.random()));
                }
                let seq = if i == 0 {
                    first_seq
                } else {
                    rng.random::<u64>() >> 24
                };
                Replica {
                    router: Router::new(config),
                    seq,
                }
            })
            .collect();
        Routers {
            replicas,
            next: 0,
            delay_us: decision_delay_ms.map(|ms| ms * 1000),
        }
    }

    pub fn len(&self) -> usize {
        self.replicas.len()
    }

    pub fn router(&self, replica: usize) -> &Router {
        &self.replicas[replica].router
    }

    /// The replica the round-robin gateway sends the next route to.
    pub fn next_for_route(&mut self) -> usize {
        let r = self.next;
        self.next = (self.next + 1) % self.replicas.len();
        r
    }

    /// Applies `input` on one replica, stamped with its next journal sequence.
    pub fn apply(&mut self, replica: usize, at_ms: u64, input: Input) -> Output {
        let replica = &mut self.replicas[replica];
        replica.seq += 1;
        replica.router.apply(&Stamped {
            seq: replica.seq,
            at_ms,
            input,
        })
    }

    /// Applies an input every replica consumes (worker events, load samples, lifecycle,
    /// ticks); returns each replica's output.
    pub fn apply_all(&mut self, at_ms: u64, input: &Input) -> Vec<Output> {
        (0..self.replicas.len())
            .map(|r| self.apply(r, at_ms, input.clone()))
            .collect()
    }

    /// Where and when `output`'s event for peers (if any) must be applied: every other replica
    /// after the decision delay, none without sharing.
    pub fn deliveries(
        &self,
        from: usize,
        now_us: u64,
        output: &Output,
    ) -> Vec<(u64, usize, Box<PeerEvent>)> {
        let (Some(delay), Some(event)) = (self.delay_us, output.peer_event()) else {
            return Vec::new();
        };
        (0..self.replicas.len())
            .filter(|&to| to != from)
            .map(|to| (now_us + delay, to, Box::new(event.clone())))
            .collect()
    }
}
