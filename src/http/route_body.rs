//! A `POST /v1/route` body as received, JSON or MessagePack, parsed into [`RouteBody`]: the
//! first thing the daemon does with bytes from the network, so it is fuzzed.
//!
//! Pure serde code (with the token-list fast reader beside it), so the fuzz target compiles
//! these two files alone, without the daemon's runtime, storage or HTTP dependencies.

use serde::Deserialize;

use super::token_list;

/// A route request as the gateway sent it, before validation.
#[derive(Debug, PartialEq, Deserialize)]
pub struct RouteBody {
    pub model: Option<String>,
    pub tokens: Option<Vec<u32>>,
    pub block_keys: Option<Vec<u64>>,
    pub prompt_tokens: Option<u64>,
    pub max_output_tokens: Option<u64>,
    #[serde(default)]
    pub exclude: Vec<String>,
    pub request_id: Option<String>,
    pub lora: Option<String>,
    #[serde(default)]
    pub explain: bool,
}

/// Parses a route body (`msgpack`: the request says `application/msgpack`). JSON token lists
/// take [`token_list::split_tokens`]; anything it does not read exactly goes through serde_json
/// whole, so results and error messages are serde_json's either way.
pub fn parse(msgpack: bool, body: &[u8]) -> Result<RouteBody, String> {
    if msgpack {
        return rmp_serde::from_slice(body).map_err(|e| e.to_string());
    }
    if let Some((rest, tokens)) = token_list::split_tokens(body) {
        if let Ok(parsed @ RouteBody { tokens: None, .. }) = serde_json::from_slice(&rest) {
            return Ok(RouteBody {
                tokens: Some(tokens),
                ..parsed
            });
        }
    }
    serde_json::from_slice(body).map_err(|e| e.to_string())
}

/// The fuzzing entry point (`fuzz/fuzz_targets/route_body.rs`, replayed on stable by the tests
/// below): any bytes in, a panic only when an invariant breaks. Both encodings must return
/// without panicking, and for JSON the fast path must change nothing: the same body, or the
/// same error, as serde_json reading the whole body.
pub fn fuzz(data: &[u8]) {
    let _ = parse(true, data);
    let whole: Result<RouteBody, String> =
        serde_json::from_slice(data).map_err(|e: serde_json::Error| e.to_string());
    assert_eq!(
        parse(false, data),
        whole,
        "the token-list fast path parses a JSON body exactly as serde_json does"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_body_corpus_input_passes_the_fuzz_target() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/route_body");
        let mut replayed = 0;
        for entry in std::fs::read_dir(&dir).expect("fuzz/corpus/route_body holds a seed corpus") {
            let path = entry.unwrap().path();
            fuzz(&std::fs::read(&path).unwrap());
            replayed += 1;
        }
        assert!(
            replayed >= 10,
            "the seed corpus was replayed ({replayed} inputs)"
        );
    }

    #[test]
    fn a_fast_path_token_list_gives_the_same_body_as_serde_json() {
        let body = br#"{"model": "m", "tokens": [1, 22, 333, 4294967295], "exclude": ["w-1"]}"#;
        let parsed = parse(false, body).unwrap();
        assert!(
            token_list::split_tokens(body).is_some(),
            "the fast path reads this body"
        );
        assert_eq!(parsed.tokens, Some(vec![1, 22, 333, u32::MAX]));
        assert_eq!(
            Ok(parsed),
            serde_json::from_slice::<RouteBody>(body).map_err(|e| e.to_string())
        );
    }
}
