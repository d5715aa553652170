//! Block keys (docs/architecture.md, "Block keys").
//!
//! A prompt is cut into full blocks of `block_size` tokens; a partial tail block is not keyed.
//! Each block's tokens hash to a *local* hash, and keys chain the locals so that a key names the
//! whole prefix up to and including its block:
//!
//! ```text
//! local_i = xxh3_64(tokens of block i as u32 little-endian, seed 1337)
//! key_0   = local_0
//! key_i   = xxh3_64(key_{i-1} LE ‖ local_i LE, seed 0)
//! ```
//!
//! Hashing tokens into locals is the expensive, parallel part and happens in the adapters (HTTP
//! handlers, NATS consumers). Chaining is cheap and happens wherever the parent key is known: for a
//! route request that is the adapter, for a KV event it is the core, which knows the parent block.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Seed of the per-block token hash.
pub const LOCAL_SEED: u64 = 1337;

/// Hash of one block's tokens, independent of its position: xxh3 of the tokens' little-endian
/// bytes.
pub fn local_hash(tokens: &[u32]) -> u64 {
    if cfg!(target_endian = "little") {
        // The tokens' in-memory bytes are their little-endian bytes: hashed where they lie, with
        // no copy (and no allocation for blocks past 64 tokens, such as 512-token blocks).
        return xxh3_64_with_seed(zerocopy::IntoBytes::as_bytes(tokens), LOCAL_SEED);
    }
    // Elsewhere the bytes are copied in little-endian order, into a small stack buffer for the
    // usual block sizes.
    let mut buf = [0u8; 4 * 64];
    if tokens.len() <= 64 {
        for (chunk, t) in buf.chunks_exact_mut(4).zip(tokens) {
            chunk.copy_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(&buf[..tokens.len() * 4], LOCAL_SEED)
    } else {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, LOCAL_SEED)
    }
}

/// Key of a block given the key of the block before it (`None` at the start of a chain).
///
/// Inline (also across crates), so a loop over a prompt's blocks chains each key in about
/// twenty instructions rather than a call apiece.
#[inline]
pub fn chain(parent: Option<u64>, local: u64) -> u64 {
    match parent {
        None => local,
        Some(parent) => {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&parent.to_le_bytes());
            buf[8..].copy_from_slice(&local.to_le_bytes());
            xxh3_64(&buf)
        }
    }
}

/// Local hashes of every full block of `tokens`.
pub fn local_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    assert!(block_size > 0, "block size must be positive");
    tokens.chunks_exact(block_size).map(local_hash).collect()
}

/// Chains local hashes into keys onto `parent`'s key (`None`: a new chain), lazily: a caller
/// that stops early (a walk at the first block no worker holds) chains no further.
pub fn chained(
    mut parent: Option<u64>,
    locals: impl IntoIterator<Item = u64>,
) -> impl Iterator<Item = u64> {
    locals.into_iter().map(move |local| {
        let key = chain(parent, local);
        parent = Some(key);
        key
    })
}

/// Chains local hashes into keys, starting a new chain.
pub fn chain_locals(locals: impl IntoIterator<Item = u64>) -> Vec<u64> {
    chained(None, locals).collect()
}

/// Keys of every full block of `tokens`: what a gateway sends as `block_keys`.
pub fn block_keys(tokens: &[u32], block_size: usize) -> Vec<u64> {
    chain_locals(local_hashes(tokens, block_size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn design_test_vector_holds() {
        assert_eq!(
            local_hash(&[1, 2, 3, 4]),
            14643705804678351452,
            "the published block-key test vector: tokens [1,2,3,4] hash to 14643705804678351452"
        );
        assert_eq!(block_keys(&[1, 2, 3, 4], 4), vec![14643705804678351452]);
    }

    #[test]
    fn partial_tail_block_is_not_keyed() {
        assert_eq!(block_keys(&[1, 2, 3, 4, 5, 6], 4).len(), 1);
        assert!(block_keys(&[1, 2, 3], 4).is_empty());
    }

    #[test]
    fn keys_name_the_whole_prefix() {
        let a = block_keys(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let b = block_keys(&[9, 9, 9, 9, 5, 6, 7, 8], 4);
        assert_eq!(local_hash(&[5, 6, 7, 8]), local_hash(&[5, 6, 7, 8]));
        assert_ne!(
            a[1], b[1],
            "the same block after a different prefix has a different key"
        );
    }

    #[test]
    fn a_block_hashes_its_tokens_little_endian_bytes_at_every_length() {
        // Token ids of every width, so each byte of a token counts.
        let tokens: Vec<u32> = (0..600u32).map(|t| t.wrapping_mul(0x9E37_79B9)).collect();
        for len in 0..=tokens.len() {
            let block = &tokens[..len];
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            assert_eq!(
                local_hash(block),
                xxh3_64_with_seed(&bytes, LOCAL_SEED),
                "a block of {len} tokens hashes as its tokens' little-endian bytes"
            );
        }
    }
}
