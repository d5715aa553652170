//! Wire formats (docs/architecture.md, "Wire contract"): decoders that turn NATS payloads into the
//! core's inputs, and encoders that publish exactly what a vLLM worker would.
//!
//! Decoders validate everything the core relies on and reject the rest with a typed
//! [`Rejection`] whose [`RejectReason`] is a bounded metric label and whose detail names the
//! offending field. They never panic, whatever the bytes: a payload arrives from the network and
//! one bad worker must not take the daemon down.
//!
//! - [`decode_kv_batch`]: `kv.events.<worker>`, the engines' own KV-event batches (§3.1), with the
//!   `Kv-Seq` / `Kv-Epoch` / `Kv-Model` / `Kv-Dp-Rank` headers parsed by [`parse_kv_headers`];
//! - [`decode_load`]: `kv.load.<worker>` load samples (§3.2);
//! - [`decode_lifecycle`]: `kv.workers.<worker>` lifecycle messages (§3.3);
//! - [`encode_vllm_batch`], [`encode_load`], [`encode_lifecycle`] / [`encode_lifecycle_message`]:
//!   the publishing side, used by
//!   the simulator, the bridge and integration tests.
//!
//! The payloads are walked as an [`rmpv::ValueRef`] tree that borrows strings and byte strings
//! from the payload, so decoding allocates only the tree's arrays and the decoded output.

mod encode;
mod fast;
pub mod fuzz;
mod kv;
mod lifecycle;
mod load;
mod value;

#[cfg(test)]
mod tests;

pub use encode::{
    encode_lifecycle, encode_lifecycle_message, encode_load, encode_vllm_batch, LifecycleMessage,
    VllmEvent,
};
pub use kv::decode_kv_batch;
pub use lifecycle::decode_lifecycle;
pub use load::decode_load;

use crate::input::{RejectReason, Rejection};

/// The optional NATS headers of a `kv.events.<worker>` message, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvHeaders {
    /// `Kv-Seq`: the publisher's sequence number, which orders and de-duplicates batches.
    pub seq: Option<u64>,
    /// `Kv-Model`: the model the batch belongs to.
    pub model: Option<String>,
    /// `Kv-Dp-Rank`: the data-parallel rank; wins over the batch's own field.
    pub dp_rank: Option<u32>,
    /// `Kv-Epoch`: the publisher's incarnation; a new one means the engine restarted.
    pub epoch: Option<String>,
}

/// Longest `Kv-Epoch` accepted, in characters.
pub const MAX_EPOCH_LEN: usize = 64;

/// Parses the raw header values of a `kv.events.<worker>` message (a load sample passes only
/// `Kv-Model` and `Kv-Dp-Rank`).
///
/// Values are trimmed of surrounding whitespace. `Kv-Seq` and `Kv-Dp-Rank` must be plain decimal
/// integers (digits only, in range), and `Kv-Epoch` 1 to 64 printable ASCII characters without
/// spaces; otherwise the whole message is rejected with [`RejectReason::InvalidHeader`]: a
/// sequence or epoch we cannot read would silently break de-duplication, gap and restart
/// detection, so it is better refused and counted. An empty `Kv-Model` means no model; one
/// longer than 256 bytes is an invalid header.
pub fn parse_kv_headers(
    seq: Option<&str>,
    model: Option<&str>,
    dp_rank: Option<&str>,
    epoch: Option<&str>,
) -> Result<KvHeaders, Rejection> {
    let seq = seq.map(|s| parse_decimal::<u64>("Kv-Seq", s)).transpose()?;
    let dp_rank = dp_rank
        .map(|s| parse_decimal::<u32>("Kv-Dp-Rank", s))
        .transpose()?;
    let model = match model.map(str::trim).filter(|m| !m.is_empty()) {
        Some(m) if m.len() > kv::MAX_NAME_LEN => {
            return Err(Rejection::new(
                RejectReason::InvalidHeader,
                format!(
                    "Kv-Model: {} bytes is longer than the {}-byte limit",
                    m.len(),
                    kv::MAX_NAME_LEN
                ),
            ))
        }
        m => m.map(str::to_owned),
    };
    let epoch = epoch.map(parse_epoch).transpose()?;
    Ok(KvHeaders {
        seq,
        model,
        dp_rank,
        epoch,
    })
}

/// An epoch (`Kv-Epoch`, a lifecycle `epoch`): 1 to 64 printable ASCII characters, no spaces.
pub(crate) fn is_valid_epoch(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_EPOCH_LEN && s.bytes().all(|b| b.is_ascii_graphic())
}

/// `Kv-Epoch`, trimmed, by [`is_valid_epoch`].
fn parse_epoch(raw: &str) -> Result<String, Rejection> {
    let s = raw.trim();
    if is_valid_epoch(s) {
        Ok(s.to_owned())
    } else {
        let shown: String = raw.chars().take(MAX_EPOCH_LEN + 8).collect();
        Err(Rejection::new(
            RejectReason::InvalidHeader,
            format!(
                "Kv-Epoch: expected 1 to {MAX_EPOCH_LEN} printable ASCII characters without spaces, got {shown:?}"
            ),
        ))
    }
}

/// Digits only: `str::parse` alone would also accept a leading `+`.
fn parse_decimal<T: std::str::FromStr>(header: &str, raw: &str) -> Result<T, Rejection> {
    let s = raw.trim();
    let invalid = || {
        let shown: String = raw.chars().take(40).collect();
        Rejection::new(
            RejectReason::InvalidHeader,
            format!("{header}: expected a decimal integer, got {shown:?}"),
        )
    };
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid());
    }
    s.parse::<T>().map_err(|_| invalid())
}
