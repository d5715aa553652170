//! The routing core of kvrouted: one pure, deterministic state machine.
//!
//! [`router::Router::apply`] folds one journaled input into the state and returns what it did.
//! Nothing in this crate does I/O, reads a clock or draws ambient randomness: time comes with
//! each input and random choices come from an RNG seeded by the input's journal sequence, so the
//! same journal always rebuilds the same state and the same decisions. The daemon crate wraps
//! it with adapters (NATS, HTTP, the journal, the simulator).
//!
//! # Layout
//!
//! - [`input`]: what goes in (KV event batches, load samples, lifecycle messages, routes,
//!   releases, ticks, peer replicas' decisions), already validated and hashed by an adapter.
//! - [`router`]: the state machine and what comes out ([`router::Output`], decisions).
//! - [`policy`]: the pressure-first longest-prefix policy, step by step, and the baselines.
//! - [`index`]: who owns which block (KV events) and the router's own recent records.
//! - [`workers`]: the worker table (state, telemetry, reserved work, sequence numbers).
//! - [`reservations`]: reserved work opened by routes, given back by releases or expiry.
//! - [`replicas`]: what replicas tell each other ([`replicas::PeerEvent`]) and reservation ids
//!   unique across them.
//! - [`hashing`]: block keys from token ids.
//! - [`wire`]: pure decoders and encoders of the NATS payloads.
//! - [`prefetch`]: the one cache-line hint the index and the route path share (and the peer
//!   benchmark's memory probe).

/// `Clone` for a struct of the state, field by field, whose `clone_from` copies each field into
/// the field's own memory (`Vec`, the maps and the index's tables reuse what they hold). The
/// writer makes each snapshot after its first in the last one's memory this way
/// (`RouterState::clone_from`): into fresh memory, nearly all of a copy's pause under the
/// state's lock was the kernel clearing new pages. The source is destructured by its fields'
/// names, so a field added to the struct and not to the list does not compile.
macro_rules! clone_in_place {
    ($name:ident $(<$param:ident>)? { $($field:ident),+ $(,)? }) => {
        impl$(<$param: Clone>)? Clone for $name$(<$param>)? {
            fn clone(&self) -> Self {
                $name { $($field: self.$field.clone()),+ }
            }

            fn clone_from(&mut self, source: &Self) {
                let $name { $($field),+ } = source;
                $(self.$field.clone_from($field);)+
            }
        }
    };
}

pub mod hashing;
pub mod index;
pub mod input;
pub mod policy;
pub mod prefetch;
pub mod replicas;
pub mod reservations;
pub mod router;
pub mod wire;
pub mod workers;
