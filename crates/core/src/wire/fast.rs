//! A single-pass decoder for the layouts the engines' publishers actually emit: an array batch of
//! tagged-map events (`[ts, [{"type": "BlockStored", ...}, ...], dp_rank]`, vLLM 0.33 and SGLang
//! 0.5.23) or of tagged-array events (`[ts, [["BlockStored", ...], ...], dp_rank]`, older vLLM).
//!
//! Building the [`rmpv::ValueRef`] tree for a 32-block batch costs ~14 µs, most of the daemon's
//! ingest budget; reading the same bytes straight into the token buffer costs a fraction of
//! that. This path accepts only payloads it can decode exactly as the tolerant decoder in
//! `kv.rs` would; on anything else (map forms, bigram tokens, any invalid field) it returns
//! `None` and the tolerant decoder decides, with its precise rejection.

use rmp::Marker;

use super::kv::{bin_hash, is_full_attention_kind, medium_of, MAX_NAME_LEN, SPEC_KIND_POS};
use crate::hashing::local_hash;
use crate::input::{KvEvent, Medium, StoredBlock};

/// Nesting depth the skipper follows before giving up (to the tolerant decoder).
const MAX_SKIP_DEPTH: usize = 32;

/// A token id and the bytes it takes, from the big-endian word that starts at its marker, for
/// the four forms a token id takes (positive fixint, uint 8, 16 and 32); `None` for any other.
/// A 32-block batch carries hundreds of token ids: through the general reader (the marker
/// decoded into an enum, then a signed-or-unsigned value, then a range check) they were about
/// half of the decoder's time in the daemon's ingest profile, and read byte by byte, with a
/// bounds check each, 40% of a batch in `cargo bench --bench wire`.
fn token_form(word: u64) -> Option<(u32, usize)> {
    const U8: u8 = Marker::U8.to_u8();
    const U16: u8 = Marker::U16.to_u8();
    const U32: u8 = Marker::U32.to_u8();
    Some(match (word >> 56) as u8 {
        // A positive fixint is its own value.
        first @ 0x00..=0x7f => (u32::from(first), 1),
        U8 => ((word >> 48) as u8 as u32, 2),
        U16 => ((word >> 40) as u16 as u32, 3),
        U32 => ((word >> 24) as u32, 5),
        _ => return None,
    })
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// A decoded integer: msgpack keeps the sign in the marker.
enum Int {
    Pos(u64),
    Neg(i64),
}

impl<'a> Cursor<'a> {
    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let out = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(out)
    }

    fn be<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.bytes(N)?.try_into().ok()
    }

    fn peek(&self) -> Option<Marker> {
        self.buf.get(self.pos).map(|&b| Marker::from_u8(b))
    }

    fn marker(&mut self) -> Option<Marker> {
        let m = self.peek()?;
        self.pos += 1;
        Some(m)
    }

    /// Consumes a nil if one is next.
    fn nil(&mut self) -> bool {
        if self.peek() == Some(Marker::Null) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn int_after(&mut self, m: Marker) -> Option<Int> {
        Some(match m {
            Marker::FixPos(n) => Int::Pos(n as u64),
            Marker::U8 => Int::Pos(self.be::<1>()?[0] as u64),
            Marker::U16 => Int::Pos(u16::from_be_bytes(self.be()?) as u64),
            Marker::U32 => Int::Pos(u32::from_be_bytes(self.be()?) as u64),
            Marker::U64 => Int::Pos(u64::from_be_bytes(self.be()?)),
            Marker::FixNeg(n) => Int::Neg(n as i64),
            Marker::I8 => Int::Neg(i8::from_be_bytes(self.be()?) as i64),
            Marker::I16 => Int::Neg(i16::from_be_bytes(self.be()?) as i64),
            Marker::I32 => Int::Neg(i32::from_be_bytes(self.be()?) as i64),
            Marker::I64 => Int::Neg(i64::from_be_bytes(self.be()?)),
            _ => return None,
        })
        .map(|i| match i {
            // Signed markers may carry non-negative values.
            Int::Neg(v) if v >= 0 => Int::Pos(v as u64),
            other => other,
        })
    }

    fn int(&mut self) -> Option<Int> {
        let m = self.marker()?;
        self.int_after(m)
    }

    fn u32(&mut self) -> Option<u32> {
        match self.int()? {
            Int::Pos(v) => u32::try_from(v).ok(),
            Int::Neg(_) => None,
        }
    }

    fn array_len(&mut self) -> Option<usize> {
        Some(match self.marker()? {
            Marker::FixArray(n) => n as usize,
            Marker::Array16 => u16::from_be_bytes(self.be()?) as usize,
            Marker::Array32 => u32::from_be_bytes(self.be()?) as usize,
            _ => return None,
        })
    }

    fn str_after(&mut self, m: Marker) -> Option<&'a str> {
        let len = match m {
            Marker::FixStr(n) => n as usize,
            Marker::Str8 => self.be::<1>()?[0] as usize,
            Marker::Str16 => u16::from_be_bytes(self.be()?) as usize,
            Marker::Str32 => u32::from_be_bytes(self.be()?) as usize,
            _ => return None,
        };
        std::str::from_utf8(self.bytes(len)?).ok()
    }

    fn str(&mut self) -> Option<&'a str> {
        let m = self.marker()?;
        self.str_after(m)
    }

    /// The bytes of a bin value whose marker was just read.
    fn bin_after(&mut self, m: Marker) -> Option<&'a [u8]> {
        let len = match m {
            Marker::Bin8 => self.be::<1>()?[0] as usize,
            Marker::Bin16 => u16::from_be_bytes(self.be()?) as usize,
            Marker::Bin32 => u32::from_be_bytes(self.be()?) as usize,
            _ => return None,
        };
        self.bytes(len)
    }

    /// A block hash: an integer of any width (negative int64 cast), or a bin digest read as
    /// the tolerant decoder reads it.
    fn hash(&mut self) -> Option<u64> {
        match self.marker()? {
            m @ (Marker::Bin8 | Marker::Bin16 | Marker::Bin32) => bin_hash(self.bin_after(m)?),
            m => match self.int_after(m)? {
                Int::Pos(v) => Some(v),
                Int::Neg(v) => Some(v as u64),
            },
        }
    }

    /// A finite number (float or integer).
    fn finite_number(&mut self) -> Option<()> {
        let finite = match self.marker()? {
            Marker::F32 => f32::from_be_bytes(self.be()?).is_finite(),
            Marker::F64 => f64::from_be_bytes(self.be()?).is_finite(),
            m => self.int_after(m).is_some(),
        };
        finite.then_some(())
    }

    /// Skips one value of any type.
    fn skip(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_SKIP_DEPTH {
            return None;
        }
        let m = self.marker()?;
        let len = match m {
            Marker::Null | Marker::True | Marker::False => return Some(()),
            Marker::F32 => return self.be::<4>().map(drop),
            Marker::F64 => return self.be::<8>().map(drop),
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                return self.str_after(m).map(drop)
            }
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => return self.bin_after(m).map(drop),
            Marker::FixArray(n) => return self.skip_n(n as usize, depth),
            Marker::Array16 => {
                let n = u16::from_be_bytes(self.be()?) as usize;
                return self.skip_n(n, depth);
            }
            Marker::Array32 => {
                let n = u32::from_be_bytes(self.be()?) as usize;
                return self.skip_n(n, depth);
            }
            Marker::FixMap(n) => return self.skip_n(2 * n as usize, depth),
            Marker::Map16 => {
                let n = u16::from_be_bytes(self.be()?) as usize;
                return self.skip_n(2 * n, depth);
            }
            Marker::Map32 => {
                let n = u32::from_be_bytes(self.be()?) as usize;
                return self.skip_n(2 * n, depth);
            }
            Marker::FixExt1 => 2,
            Marker::FixExt2 => 3,
            Marker::FixExt4 => 5,
            Marker::FixExt8 => 9,
            Marker::FixExt16 => 17,
            Marker::Ext8 => self.be::<1>()?[0] as usize + 1,
            Marker::Ext16 => u16::from_be_bytes(self.be()?) as usize + 1,
            Marker::Ext32 => u32::from_be_bytes(self.be()?) as usize + 1,
            Marker::Reserved => return None,
            m => return self.int_after(m).map(drop),
        };
        self.bytes(len).map(drop)
    }

    fn skip_n(&mut self, n: usize, depth: usize) -> Option<()> {
        (0..n).try_for_each(|_| self.skip(depth + 1))
    }

    /// `nil` or a string medium; absent fields are handled by the caller.
    fn medium(&mut self) -> Option<Medium> {
        if self.nil() {
            return Some(Medium::Gpu);
        }
        self.str().map(medium_of)
    }
}

/// Decodes an array batch of tagged-array events. Returns the batch's dp rank and its events,
/// or `None` when the payload is not in exactly that layout or not valid.
pub(super) fn decode_vllm_array(payload: &[u8]) -> Option<(Option<u32>, Vec<KvEvent>)> {
    let mut c = Cursor {
        buf: payload,
        pos: 0,
    };
    let len = c.array_len()?;
    if len < 2 {
        return None;
    }
    if !c.nil() {
        c.finite_number()?;
    }
    let n_events = c.array_len()?;
    let mut events = Vec::with_capacity(n_events.min(1024));
    let mut tokens = Vec::new();
    for _ in 0..n_events {
        events.push(event(&mut c, &mut tokens)?);
    }
    let dp_rank = if len >= 3 && !c.nil() {
        Some(c.u32()?)
    } else {
        None
    };
    c.skip_n(len.saturating_sub(3), 0)?;
    (c.pos == payload.len()).then_some((dp_rank, events))
}

fn event(c: &mut Cursor<'_>, tokens: &mut Vec<u32>) -> Option<KvEvent> {
    if let Some(entries) = c.map_len() {
        return map_event(c, entries, tokens);
    }
    // An empty array has no tag: whatever follows belongs to the enclosing array (found by the
    // `kv_batch` fuzz target), so it is left to the tolerant decoder to reject.
    let len = c.array_len().filter(|&n| n >= 1)?;
    let tag = c.str()?;
    // Fields after the tag that this function reads; the rest are skipped.
    let (event, read) = match tag {
        "BlockStored" if len >= 5 => stored(c, len - 1, tokens)?,
        "BlockRemoved" if len >= 2 => {
            let engine_hashes = c.hashes()?;
            let medium = if len >= 3 { c.medium()? } else { Medium::Gpu };
            (
                KvEvent::Removed {
                    engine_hashes,
                    medium,
                },
                (len - 1).min(2),
            )
        }
        "AllBlocksCleared" => (KvEvent::Cleared, 0),
        _ => return None,
    };
    c.skip_n(len - 1 - read, 0)?;
    Some(event)
}

impl<'a> Cursor<'a> {
    /// The entry count of a map, consumed only if a map is next.
    fn map_len(&mut self) -> Option<usize> {
        let start = self.pos;
        let n = match self.marker()? {
            Marker::FixMap(n) => Some(n as usize),
            Marker::Map16 => self.be().map(|b| u16::from_be_bytes(b) as usize),
            Marker::Map32 => self.be().map(|b| u32::from_be_bytes(b) as usize),
            _ => None,
        };
        if n.is_none() {
            self.pos = start;
        }
        n
    }

    fn hashes(&mut self) -> Option<Vec<u64>> {
        let n = self.array_len()?;
        (0..n).map(|_| self.hash()).collect()
    }

    /// `nil` or a block hash.
    fn parent(&mut self) -> Option<Option<u64>> {
        if self.nil() {
            Some(None)
        } else {
            self.hash().map(Some)
        }
    }

    /// Plain token ids into `tokens`; bigram pairs are arrays and left to the tolerant decoder.
    fn tokens(&mut self, tokens: &mut Vec<u32>) -> Option<()> {
        let n = self.array_len()?;
        // Every token takes at least one byte: a larger count is a lie, not a reason to allocate.
        if n > self.buf.len() - self.pos {
            return None;
        }
        tokens.clear();
        tokens.reserve(n);
        let mut left = n;
        // While eight bytes remain, every form fits in them: a tight loop of one load each. The
        // last few tokens, and from the first token in another form on, go through `token`.
        while left > 0 {
            let Some(word) = self.buf.get(self.pos..self.pos + 8) else {
                break;
            };
            let word = u64::from_be_bytes(word.try_into().expect("eight bytes"));
            let Some((token, width)) = token_form(word) else {
                break;
            };
            tokens.push(token);
            self.pos += width;
            left -= 1;
        }
        for _ in 0..left {
            tokens.push(self.token()?);
        }
        Some(())
    }

    /// One token id where the loop in [`tokens`](Self::tokens) stops: fewer than eight bytes
    /// left (read as the loop reads them, with zeros past the payload's end, so one table,
    /// [`token_form`], reads the forms), or a form other than the four, which goes through the
    /// general reader, as does a form the payload's end cuts short.
    fn token(&mut self) -> Option<u32> {
        let rest = self.buf.get(self.pos..)?;
        let mut word = [0; 8];
        let fits = rest.len().min(8);
        word[..fits].copy_from_slice(&rest[..fits]);
        match token_form(u64::from_be_bytes(word)) {
            Some((token, width)) if width <= rest.len() => {
                self.pos += width;
                Some(token)
            }
            _ => self.u32(),
        }
    }

    fn block_size(&mut self) -> Option<u32> {
        self.u32().filter(|&bs| bs > 0)
    }

    /// `nil` or an integer LoRA id, as the namespace string it becomes.
    fn lora_id(&mut self) -> Option<Option<String>> {
        if self.nil() {
            return Some(None);
        }
        Some(Some(match self.int()? {
            Int::Pos(v) => v.to_string(),
            Int::Neg(v) => v.to_string(),
        }))
    }

    /// `nil` or a LoRA name within the cap; anything else (SGLang's older metadata map, an
    /// oversize name) is left to the tolerant decoder.
    fn lora_name(&mut self) -> Option<Option<&'a str>> {
        if self.nil() {
            return Some(None);
        }
        self.str()
            .filter(|name| name.len() <= MAX_NAME_LEN)
            .map(Some)
    }

    /// `nil` or a string kind; any other value is left to the tolerant decoder.
    fn full_attention(&mut self) -> Option<bool> {
        if self.nil() {
            return Some(true);
        }
        self.str().map(is_full_attention_kind)
    }
}

/// The LoRA namespace: a non-empty name, else the id.
fn lora(lora_id: Option<String>, lora_name: Option<&str>) -> Option<String> {
    match lora_name.filter(|name| !name.is_empty()) {
        Some(name) => Some(name.to_owned()),
        None => lora_id,
    }
}

/// The stored event from its decoded fields: checks the token count and hashes each block.
fn stored_event(
    hashes: Vec<u64>,
    parent: Option<u64>,
    tokens: &[u32],
    block_size: u32,
    lora: Option<String>,
    medium: Medium,
    full_attention: bool,
) -> Option<KvEvent> {
    let bs = block_size as usize;
    if hashes.len().checked_mul(bs) != Some(tokens.len()) {
        return None;
    }
    let blocks = hashes
        .into_iter()
        .zip(tokens.chunks_exact(bs))
        .map(|(engine_hash, chunk)| StoredBlock {
            engine_hash,
            local: local_hash(chunk),
        })
        .collect();
    Some(KvEvent::Stored {
        parent,
        blocks,
        block_size,
        lora,
        medium,
        full_attention,
    })
}

/// `BlockStored` fields after the tag: `fields` of them are present (at least 4).
fn stored(c: &mut Cursor<'_>, fields: usize, tokens: &mut Vec<u32>) -> Option<(KvEvent, usize)> {
    let hashes = c.hashes()?;
    let parent = c.parent()?;
    c.tokens(tokens)?;
    let block_size = c.block_size()?;
    let lora_id = if fields >= 5 { c.lora_id()? } else { None };
    let medium = if fields >= 6 {
        c.medium()?
    } else {
        Medium::Gpu
    };
    let lora_name = if fields >= 7 { c.lora_name()? } else { None };
    let mut read = fields.min(7);
    let mut full_attention = true;
    if fields > SPEC_KIND_POS {
        c.skip_n(SPEC_KIND_POS - read, 0)?; // extra_keys, group_idx
        full_attention = c.full_attention()?;
        read = SPEC_KIND_POS + 1;
    }
    let event = stored_event(
        hashes,
        parent,
        tokens,
        block_size,
        lora(lora_id, lora_name),
        medium,
        full_attention,
    )?;
    Some((event, read))
}

/// A tagged-map event (`{"type": tag, name: value, ...}`, what vLLM 0.33 and SGLang 0.5.23
/// send), in one pass over its `entries`. The fields the tolerant decoder reads are read here
/// with its rules; every other key is skipped unread, as it ignores them. A repeated key (the
/// tolerant decoder takes the last one), a non-string key or anything unusual returns `None`.
fn map_event(c: &mut Cursor<'_>, entries: usize, tokens: &mut Vec<u32>) -> Option<KvEvent> {
    let mut tag = None;
    let mut hashes = None;
    let mut parent = None;
    let mut have_tokens = false;
    let mut block_size = None;
    let mut lora_id = None;
    let mut medium = None;
    let mut lora_name = None;
    let mut full_attention = None;
    let mut seen = 0u16;
    for _ in 0..entries {
        let key = c.str()?;
        let bit = match key {
            "type" => 1,
            "block_hashes" => 1 << 1,
            "parent_block_hash" => 1 << 2,
            "token_ids" => 1 << 3,
            "block_size" => 1 << 4,
            "lora_id" => 1 << 5,
            "medium" => 1 << 6,
            "lora_name" => 1 << 7,
            "kv_cache_spec_kind" => 1 << 8,
            _ => {
                c.skip(0)?;
                continue;
            }
        };
        if seen & bit != 0 {
            return None;
        }
        seen |= bit;
        match key {
            "type" => tag = Some(c.str()?),
            "block_hashes" => hashes = Some(c.hashes()?),
            "parent_block_hash" => parent = c.parent()?,
            "token_ids" => {
                c.tokens(tokens)?;
                have_tokens = true;
            }
            "block_size" => block_size = Some(c.block_size()?),
            "lora_id" => lora_id = c.lora_id()?,
            "medium" => medium = Some(c.medium()?),
            "lora_name" => lora_name = c.lora_name()?,
            _ => full_attention = Some(c.full_attention()?),
        }
    }
    match tag? {
        "BlockStored" if have_tokens => stored_event(
            hashes?,
            parent,
            tokens,
            block_size?,
            lora(lora_id, lora_name),
            medium.unwrap_or(Medium::Gpu),
            full_attention.unwrap_or(true),
        ),
        "BlockRemoved" => Some(KvEvent::Removed {
            engine_hashes: hashes?,
            medium: medium.unwrap_or(Medium::Gpu),
        }),
        "AllBlocksCleared" => Some(KvEvent::Cleared),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::decode_vllm_array;
    use crate::wire::kv::decode_tolerant;
    use crate::wire::{encode_vllm_batch, VllmEvent};

    /// Whatever the fast path accepts, the tolerant decoder accepts identically.
    fn agrees(payload: &[u8]) -> bool {
        match decode_vllm_array(payload) {
            Some(fast) => {
                assert_eq!(
                    decode_tolerant(payload).ok(),
                    Some(fast),
                    "the fast path decodes exactly as the tolerant decoder"
                );
                true
            }
            None => false,
        }
    }

    #[test]
    fn every_fixture_decodes_the_same_on_both_paths() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/kv_events");
        let mut fast = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "msgpack") {
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                let took_fast_path = agrees(&std::fs::read(&path).unwrap());
                let current_layout =
                    name.starts_with("vllm_0_33_") || name.starts_with("sglang_0_5_23_");
                assert!(
                    took_fast_path || !current_layout,
                    "{name}: the engines' current layouts take the fast path"
                );
                fast += took_fast_path as usize;
            }
        }
        assert!(
            fast >= 12,
            "vLLM's and SGLang's own layouts take the fast path ({fast} fixtures did)"
        );
    }

    fn event() -> impl Strategy<Value = VllmEvent> {
        let hash = prop_oneof![any::<u64>(), (0u64..8)];
        prop_oneof![
            (
                proptest::collection::vec(hash.clone(), 0..6),
                proptest::option::of(hash.clone()),
                1u32..5,
                proptest::option::of(-3i64..3),
                proptest::option::of(prop_oneof![
                    Just("GPU".to_string()),
                    Just("cpu".to_string())
                ]),
                proptest::option::of(prop_oneof![Just(String::new()), Just("sql".to_string())]),
                any::<u32>(),
            )
                .prop_map(
                    |(block_hashes, parent, bs, lora_id, medium, lora_name, seed)| {
                        let n = block_hashes.len() as u32 * bs;
                        VllmEvent::BlockStored {
                            token_ids: (0..n).map(|i| seed.wrapping_add(i * 7919)).collect(),
                            block_hashes,
                            parent_block_hash: parent,
                            block_size: bs,
                            lora_id,
                            medium,
                            lora_name,
                        }
                    }
                ),
            (
                proptest::collection::vec(hash, 0..6),
                proptest::option::of(Just("GPU".to_string()))
            )
                .prop_map(|(block_hashes, medium)| VllmEvent::BlockRemoved {
                    block_hashes,
                    medium
                }),
            Just(VllmEvent::AllBlocksCleared),
        ]
    }

    proptest! {
        #[test]
        fn batches_as_vllm_encodes_them_take_the_fast_path_and_agree(
            events in proptest::collection::vec(event(), 0..5),
            dp_rank in proptest::option::of(0u32..8),
        ) {
            let payload = encode_vllm_batch(1.5, &events, dp_rank);
            prop_assert!(agrees(&payload), "a vLLM-encoded batch takes the fast path");
            for cut in 0..payload.len() {
                prop_assert!(decode_vllm_array(&payload[..cut]).is_none(), "a truncated batch never decodes");
            }
        }

        #[test]
        fn arbitrary_bytes_never_decode_differently(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            agrees(&bytes);
        }
    }
}
