//! A route body's `"tokens"` list, read without serde.
//!
//! A 4,096-token prompt is 25 KB of JSON digits, and serde_json spent about 40% of the daemon's
//! CPU per route on them (docs/performance.md). [`split_tokens`] finds the top-level `"tokens"`
//! array with a small structural walk and reads it with a digit scanner about twice as fast;
//! serde_json still parses (and validates) everything else, with the array replaced by `null`.
//!
//! It only ever answers for bodies it reads exactly: anything unusual (escapes in a key, a
//! number that is not a plain `u32`, a malformed structure) gives `None`, and the caller parses
//! the whole body with serde_json, so results and error messages stay serde_json's.

use std::ops::Range;

/// The body with its top-level `"tokens"` array replaced by `null`, and the array's values.
pub fn split_tokens(body: &[u8]) -> Option<(Vec<u8>, Vec<u32>)> {
    let span = tokens_span(body)?;
    let tokens = scan_u32_array(&body[span.clone()])?;
    let mut rest = Vec::with_capacity(body.len() - span.len() + 4);
    rest.extend_from_slice(&body[..span.start]);
    rest.extend_from_slice(b"null");
    rest.extend_from_slice(&body[span.end..]);
    Some((rest, tokens))
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\n' | b'\r' | b'\t')) {
        i += 1;
    }
    i
}

/// Where the value of the top-level `"tokens"` member lies, if the body is an object that has
/// one. Values of other members are skipped, not validated: serde_json validates them later.
fn tokens_span(b: &[u8]) -> Option<Range<usize>> {
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = skip_ws(b, i);
        let key_end = string_end(b, i)?;
        let key = &b[i + 1..key_end - 1];
        if key.contains(&b'\\') {
            return None; // an escaped key could spell "tokens"
        }
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(b, i + 1);
        let value_end = value_end(b, i)?;
        if key == b"tokens" {
            return Some(i..value_end);
        }
        i = skip_ws(b, value_end);
        if b.get(i) != Some(&b',') {
            return None; // the end of the object (no tokens), or not an object
        }
        i += 1;
    }
}

/// The index just past the string starting at `i` (its closing quote).
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    if b.get(i) != Some(&b'"') {
        return None;
    }
    let mut j = i + 1;
    loop {
        match b.get(j)? {
            b'"' => return Some(j + 1),
            b'\\' => j += 2,
            _ => j += 1,
        }
    }
}

/// The index just past the value starting at `i`: a string, an array or object (brackets
/// counted outside strings), or a scalar (up to the next delimiter).
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => string_end(b, i),
        b'[' | b'{' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match b.get(j)? {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'[' | b'{' => depth += 1,
                    b']' | b'}' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while !matches!(
                b.get(j),
                None | Some(b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t')
            ) {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// A JSON array of unsigned integers that each fit a `u32`, written plainly (no sign, fraction,
/// exponent or leading zero); `None` for anything else.
fn scan_u32_array(b: &[u8]) -> Option<Vec<u32>> {
    // Token ids average about 6 bytes each with their comma.
    let mut out = Vec::with_capacity(b.len() / 5 + 1);
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'[') {
        return None;
    }
    i = skip_ws(b, i + 1);
    if b.get(i) == Some(&b']') {
        return (skip_ws(b, i + 1) == b.len()).then_some(out);
    }
    loop {
        let start = i;
        let mut value: u64 = 0;
        while let Some(&c) = b.get(i) {
            let digit = c.wrapping_sub(b'0');
            if digit > 9 {
                break;
            }
            // At most 11 digits are accumulated before the length check below, so no overflow.
            value = value * 10 + digit as u64;
            i += 1;
            if i - start > 10 {
                return None;
            }
        }
        let digits = i - start;
        if digits == 0 || (digits > 1 && b[start] == b'0') || value > u32::MAX as u64 {
            return None;
        }
        out.push(value as u32);
        i = skip_ws(b, i);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b']') => return (skip_ws(b, i + 1) == b.len()).then_some(out),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Deserialize)]
    struct Body {
        model: Option<String>,
        tokens: Option<Vec<u32>>,
        #[serde(default)]
        exclude: Vec<String>,
    }

    /// What the fast path answers: the split, then serde_json on the rest.
    fn fast(body: &str) -> Option<Body> {
        let (rest, tokens) = split_tokens(body.as_bytes())?;
        let parsed: Body = serde_json::from_slice(&rest).ok()?;
        parsed.tokens.is_none().then_some(Body {
            tokens: Some(tokens),
            ..parsed
        })
    }

    #[test]
    fn tokens_are_read_wherever_the_member_stands() {
        let body = r#" { "model" : "m,]}\"x" , "exclude":["a",{"b":[1,"]"]}] ,
            "tokens" : [ 0, 7 ,4294967295 ] } "#;
        assert_eq!(
            split_tokens(body.as_bytes()).map(|(_, t)| t),
            Some(vec![0, 7, u32::MAX]),
            "the top-level tokens array is found past strings and nested values"
        );
        assert!(
            fast(body).is_none(),
            "exclude holds a non-string, so serde_json rejects the rest"
        );
        let body = r#"{"tokens":[1,2],"model":"m"}"#;
        assert_eq!(fast(body), serde_json::from_str(body).ok());
    }

    #[test]
    fn anything_but_plain_u32_values_is_left_to_serde_json() {
        for tokens in [
            "[1.0]",
            "[1e3]",
            "[-1]",
            "[01]",
            "[4294967296]",
            "[99999999999]",
            "[1,]",
            "[,1]",
            "[1 2]",
            "[\"1\"]",
            "[[1]]",
            "null",
            "{}",
        ] {
            let body = format!(r#"{{"tokens":{tokens}}}"#);
            assert_eq!(
                split_tokens(body.as_bytes()).map(|(_, t)| t),
                None,
                "{tokens} is not a plain u32 list"
            );
        }
        assert_eq!(
            split_tokens(br#"{"tok\u0065ns":[1]}"#),
            None,
            "an escaped key may spell tokens"
        );
        assert_eq!(split_tokens(br#"{"model":"m"}"#), None, "no tokens member");
    }

    #[test]
    fn a_repeated_tokens_member_is_an_error_as_with_serde_json() {
        let body = r#"{"tokens":[1],"tokens":[2]}"#;
        assert!(serde_json::from_str::<Body>(body).is_err());
        assert!(
            fast(body).is_none(),
            "the second member makes the rest fail"
        );
    }

    fn fragment() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("{".to_string()),
            Just("}".to_string()),
            Just("[".to_string()),
            Just("]".to_string()),
            Just(",".to_string()),
            Just(":".to_string()),
            Just(" ".to_string()),
            Just("\"tokens\"".to_string()),
            Just("\"model\"".to_string()),
            Just("\"exclude\"".to_string()),
            Just("\"m\\\"]\"".to_string()),
            Just("null".to_string()),
            Just("-1".to_string()),
            Just("1.5".to_string()),
            any::<u32>().prop_map(|n| n.to_string()),
            (0u64..1 << 34).prop_map(|n| n.to_string()),
        ]
    }

    proptest! {
        /// Whenever the fast path answers, serde_json on the whole body agrees.
        #[test]
        fn fast_path_agrees_with_serde_json(parts in proptest::collection::vec(fragment(), 0..24)) {
            let body = parts.concat();
            if let Some(parsed) = fast(&body) {
                prop_assert_eq!(Some(parsed), serde_json::from_str::<Body>(&body).ok());
            }
        }

        #[test]
        fn well_formed_bodies_take_the_fast_path(
            tokens in proptest::collection::vec(any::<u32>(), 0..64),
            model_first in any::<bool>(),
        ) {
            let list = serde_json::to_string(&tokens).unwrap();
            let body = if model_first {
                format!(r#"{{"model":"a,b","tokens":{list}}}"#)
            } else {
                format!(r#"{{"tokens":{list},"exclude":["w1"]}}"#)
            };
            let parsed = fast(&body);
            prop_assert!(parsed.is_some(), "a plain body takes the fast path");
            prop_assert_eq!(parsed, serde_json::from_str::<Body>(&body).ok());
        }
    }
}
