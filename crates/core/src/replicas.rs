//! What replicas of the router tell each other, and the reservation ids that stay unique across
//! them.
//!
//! Several routers may serve one fleet. They build the same owner index from the same KV event
//! stream, but their own decisions (approximate owners, provisional owners of a spill and their
//! cooldown, reserved work and its releases) are local state they would otherwise disagree on.
//! Each replica therefore publishes a [`PeerEvent`] for every route and release it makes, and
//! applies its peers' events as [`crate::input::Input::Peer`]: journaled like any input, so every
//! replica's replay stays exact, and applied as effects only (no new decision, no new event).

use std::fmt;
use std::str::FromStr;

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};

use crate::input::WorkerId;
use crate::policy::DecisionLabel;
use crate::reservations::ReleasePhase;

/// Longest accepted replica id, in characters.
pub const MAX_REPLICA_ID_LEN: usize = 128;

/// Whether `id` is a usable replica id: 1 to 128 characters from `A-Z a-z 0-9 _ - :`, the same
/// rule as a worker id, because a replica id is one NATS subject token (no dots).
pub fn valid_replica_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_REPLICA_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b':'))
}

/// One thing a replica did that its peers must apply to agree with it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerEvent {
    /// The replica that made the decision or took the release.
    pub replica: String,
    /// The journal sequence of the input on that replica. Increases per replica, so a peer
    /// skips an event at or below the last one it applied from that replica (redelivery).
    pub seq: u64,
    /// That replica's clock when it applied the input (milliseconds, Unix epoch). The cooldown
    /// of a spill runs from here, so it does not grow by the time the event took to arrive.
    pub at_ms: u64,
    pub kind: PeerEventKind,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerEventKind {
    /// A route: its effects, to be recorded as if this replica had made it.
    Routed(PeerRoute),
    /// A release taken by that replica (of its own reservation or of a peer's).
    Released {
        reservation: u64,
        /// `prefill`: the prefill part only; none: all of it.
        #[serde(default)]
        phase: Option<ReleasePhase>,
    },
}

/// The effects of one routing decision: what a peer records so that its next decision sees the
/// same owners, the same spill cooldown and the same reserved work.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerRoute {
    /// The namespace: model and LoRA adapter.
    pub model: Option<String>,
    pub lora: Option<String>,
    pub worker: WorkerId,
    /// The rank chosen (0 for a worker with one rank).
    pub dp_rank: u32,
    /// The prompt's block keys, recorded as approximate ownership of `worker`.
    pub keys: Vec<u64>,
    /// Reserved work (prompt plus expected output tokens) and its prefill part.
    pub work: u64,
    pub prefill: u64,
    /// The reservation id a release names; unique across replicas.
    pub reservation: u64,
    /// The prefix key this route spilled (the chosen worker became its provisional owner), if
    /// it was a spill. Its cooldown runs from [`PeerEvent::at_ms`].
    pub spilled_prefix: Option<u64>,
    /// The decision's label, for peers' metrics.
    pub decision: DecisionLabel,
}

/// A secret of 32 bytes that makes reservation ids unguessable (see [`reservation_id`]).
///
/// Written as 64 hex digits (also in the journal, inside `Configure`: whoever can read the
/// journal can already release anything, since it holds every decision). Its `Debug` does not
/// show it, so logging a config never leaks it.
#[derive(Clone, PartialEq, Eq)]
pub struct ReservationSecret([u8; 32]);

impl ReservationSecret {
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        ReservationSecret(bytes)
    }

    /// The 64 lowercase hex digits the secret is written as.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for ReservationSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReservationSecret(<redacted>)")
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a reservation secret is 64 hex digits (32 bytes)")]
pub struct InvalidReservationSecret;

impl FromStr for ReservationSecret {
    type Err = InvalidReservationSecret;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.len() != 64 || !s.is_ascii() {
            return Err(InvalidReservationSecret);
        }
        let mut bytes = [0u8; 32];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
                .map_err(|_| InvalidReservationSecret)?;
        }
        Ok(ReservationSecret(bytes))
    }
}

impl Serialize for ReservationSecret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for ReservationSecret {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The reservation id of the route applied at journal sequence `seq` on replica `replica`.
///
/// Unique across replicas and unguessable, yet a pure function of journaled values, so replay
/// reproduces every id exactly:
/// - without a secret it is `seq` itself (what journals written before replicas existed
///   hold, and what their releases name); sequential, so anyone can release anyone's work;
/// - with a secret it is 64 bits of the ChaCha20 keystream keyed by the secret, at stream
///   `xxh3(replica)` and position `seq`: a keyed pseudo-random function, so without the secret
///   the ids of other requests cannot be predicted from one's own, and two replicas (two
///   streams) draw independent ids. Two open reservations share an id only by a 64-bit
///   collision.
pub fn reservation_id(secret: Option<&ReservationSecret>, replica: &str, seq: u64) -> u64 {
    let Some(secret) = secret else {
        return seq;
    };
    let mut rng = ChaCha20Rng::from_seed(secret.0);
    rng.set_stream(xxhash_rust::xxh3::xxh3_64(replica.as_bytes()));
    // Positions count 32-bit words; each id takes two.
    rng.set_word_pos(u128::from(seq) * 2);
    rng.next_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(byte: u8) -> ReservationSecret {
        ReservationSecret::from_bytes([byte; 32])
    }

    #[test]
    fn without_a_secret_the_reservation_id_is_the_journal_sequence_as_in_old_journals() {
        assert_eq!(reservation_id(None, "a", 42), 42);
        assert_eq!(reservation_id(None, "", 7), 7);
    }

    #[test]
    fn keyed_reservation_ids_are_reproducible_and_differ_across_replicas_and_secrets() {
        let s = secret(1);
        let a: Vec<u64> = (1..=1000)
            .map(|q| reservation_id(Some(&s), "a", q))
            .collect();
        let again: Vec<u64> = (1..=1000)
            .map(|q| reservation_id(Some(&s), "a", q))
            .collect();
        assert_eq!(
            a, again,
            "the same (secret, replica, seq) gives the same id"
        );
        let b: Vec<u64> = (1..=1000)
            .map(|q| reservation_id(Some(&s), "b", q))
            .collect();
        let other: Vec<u64> = (1..=1000)
            .map(|q| reservation_id(Some(&secret(2)), "a", q))
            .collect();
        let mut all: Vec<u64> = a.iter().chain(&b).chain(&other).copied().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(
            all.len(),
            3000,
            "ids are unique across replicas and secrets"
        );
        assert!(
            a.windows(2).all(|w| w[1].abs_diff(w[0]) > 1 << 20),
            "consecutive ids are not neighbours, so one's own id does not reveal the next"
        );
    }

    #[test]
    fn a_secret_reads_back_from_its_hex_and_never_shows_in_debug() {
        let s = ReservationSecret::from_bytes(std::array::from_fn(|i| i as u8 * 7));
        let hex = s.to_hex();
        assert_eq!(hex.len(), 64);
        assert_eq!(hex.parse::<ReservationSecret>(), Ok(s.clone()));
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<ReservationSecret>(&json).unwrap(), s);
        assert!(
            !format!("{s:?}").contains(&hex[..8]),
            "Debug redacts the secret"
        );
        assert!("abc".parse::<ReservationSecret>().is_err());
        assert!("zz".repeat(32).parse::<ReservationSecret>().is_err());
    }
}
