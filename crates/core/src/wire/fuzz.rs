//! Fuzzing entry points: one per wire decoder.
//!
//! Every payload a decoder sees comes from the network, so for any bytes at all a decoder must
//! return (never panic, never allocate without bound) and what it accepts must be valid. The
//! fuzz targets in `fuzz/` (run on demand with `scripts/fuzz`, nightly `cargo fuzz`) call these
//! functions with arbitrary bytes; the corpus they grow is replayed through the same functions as
//! an ordinary test on stable (`crates/core/tests/fuzz_corpus.rs`), so an input that once broke a
//! decoder keeps being checked in CI after the fix.
//!
//! Each function panics only when an invariant breaks, which is what the fuzzer reports.

use super::{decode_kv_batch, decode_lifecycle, decode_load, parse_kv_headers, KvHeaders};
use crate::input::{KvEvent, WorkerId};

/// A fuzzing entry point: any bytes in, a panic only when an invariant breaks.
pub type Target = fn(&[u8]);

/// The fuzzing targets, by name: the directory names under `fuzz/corpus/`.
pub const TARGETS: [(&str, Target); 4] = [
    ("kv_batch", kv_batch),
    ("load_sample", load_sample),
    ("lifecycle", lifecycle),
    ("kv_headers", kv_headers),
];

fn worker() -> WorkerId {
    WorkerId::new("fuzz-worker").expect("a valid worker id")
}

/// `kv.events.<worker>` payloads. The single-pass fast decoder and the tolerant decoder must
/// agree wherever the fast one accepts, and an accepted batch keeps the token-count invariant
/// the core relies on (one local hash per stored block).
pub fn kv_batch(data: &[u8]) {
    if let Some(fast) = super::fast::decode_vllm_array(data) {
        let tolerant = super::kv::decode_tolerant(data);
        assert_eq!(
            Ok(fast),
            tolerant,
            "what the fast path accepts, the tolerant path decodes the same"
        );
    }
    if let Ok(batch) = decode_kv_batch(data, worker(), KvHeaders::default()) {
        for event in &batch.events {
            if let KvEvent::Stored { block_size, .. } = event {
                assert!(
                    *block_size > 0,
                    "an accepted store has a positive block size"
                );
            }
        }
    }
}

/// `kv.load.<worker>` payloads: an accepted sample has a usage in 0..=1 and a finite pressure.
pub fn load_sample(data: &[u8]) {
    if let Ok(sample) = decode_load(data, worker()) {
        assert!(
            (0.0..=1.0).contains(&sample.kv_usage),
            "accepted kv_usage is within 0..=1"
        );
        assert!(
            sample.pressure().is_finite(),
            "accepted load gives a finite pressure"
        );
    }
}

/// `kv.workers.<worker>` payloads: an accepted message keeps only valid fields (a positive
/// block size, an epoch of 1 to 64 characters), and each field it dropped is named.
pub fn lifecycle(data: &[u8]) {
    if let Ok((msg, rejected)) = decode_lifecycle(data, worker()) {
        assert!(
            msg.block_size != Some(0),
            "an accepted block size is positive"
        );
        assert!(
            msg.epoch
                .as_ref()
                .is_none_or(|e| (1..=64).contains(&e.len())),
            "an accepted epoch has 1 to 64 characters"
        );
        for r in &rejected {
            assert!(
                r.detail.starts_with("Lifecycle."),
                "a rejected field is named: {}",
                r.detail
            );
        }
    }
}

/// The `Kv-Seq`, `Kv-Model`, `Kv-Dp-Rank` and `Kv-Epoch` header values, split from the input at
/// `0xff` bytes (which no UTF-8 header value contains): an accepted sequence or rank was written
/// in decimal digits, an accepted epoch is 1 to 64 printable characters.
pub fn kv_headers(data: &[u8]) {
    let mut parts = data.split(|&b| b == 0xff).map(std::str::from_utf8);
    let (Some(Ok(seq)), Some(Ok(model)), Some(Ok(rank))) =
        (parts.next(), parts.next(), parts.next())
    else {
        return;
    };
    let epoch = match parts.next() {
        Some(Ok(epoch)) => epoch,
        Some(Err(_)) => return,
        None => "",
    };
    fn given(s: &str) -> Option<&str> {
        Some(s).filter(|s| !s.is_empty())
    }
    if let Ok(headers) = parse_kv_headers(given(seq), given(model), given(rank), given(epoch)) {
        let decimal = |s: &str| s.trim().bytes().all(|b| b.is_ascii_digit());
        if headers.seq.is_some() {
            assert!(decimal(seq), "an accepted Kv-Seq is decimal digits");
        }
        if headers.dp_rank.is_some() {
            assert!(decimal(rank), "an accepted Kv-Dp-Rank is decimal digits");
        }
        if let Some(e) = &headers.epoch {
            assert!(
                (1..=64).contains(&e.len()) && e.bytes().all(|b| b.is_ascii_graphic()),
                "an accepted Kv-Epoch is 1 to 64 printable characters: {e:?}"
            );
        }
    }
}
