//! A route body's `"tokens"` list, read without serde.
//!
//! A 4,096-token prompt is 25 KB of JSON digits, and serde_json spent about 40% of the daemon's
//! CPU per route on them (docs/performance.md). [`split_tokens`] finds the top-level `"tokens"`
//! array with a small structural walk and reads it with a digit scanner about three times as
//! fast; serde_json still parses (and validates) everything else, with the array replaced by
//! `null`.
//!
//! It only ever answers for bodies it reads exactly: anything unusual (escapes in a key, a
//! number that is not a plain `u32`, a malformed structure) gives `None`, and the caller parses
//! the whole body with serde_json, so results and error messages stay serde_json's.

/// The body with its top-level `"tokens"` array replaced by `null`, and the array's values.
pub fn split_tokens(body: &[u8]) -> Option<(Vec<u8>, Vec<u32>)> {
    let start = tokens_start(body)?;
    let (tokens, end) = scan_u32_array(body, start)?;
    let mut rest = Vec::with_capacity(body.len() - (end - start) + 4);
    rest.extend_from_slice(&body[..start]);
    rest.extend_from_slice(b"null");
    rest.extend_from_slice(&body[end..]);
    Some((rest, tokens))
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\n' | b'\r' | b'\t')) {
        i += 1;
    }
    i
}

/// Where the value of the top-level `"tokens"` member starts, if the body is an object that has
/// one. Values of other members are skipped, not validated: serde_json validates them later.
fn tokens_start(b: &[u8]) -> Option<usize> {
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
        match key {
            b"tokens" => return Some(i),
            // A body gives tokens or block keys, never both (the handler rejects both), so
            // there is no token list to find: skipping the keys would be wasted work.
            b"block_keys" => return None,
            _ => {}
        }
        i = skip_ws(b, value_end(b, i)?);
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

/// The JSON array at `b[start..]` if it holds only unsigned integers that each fit a `u32`,
/// written plainly (no sign, fraction, exponent or leading zero), and the index just past it;
/// `None` for anything else.
///
/// On x86-64, values are read a 64-byte window at a time ([`window::read`]): the window's bytes
/// are classified 16 at a time and its commas say where each value ends, so a value costs
/// little beyond its digits' arithmetic; one value after another, each found its own digit
/// count and delimiter first (`cargo bench --bench wire -- route_body`). A value the window
/// cannot vouch for (whitespace other than one space after a comma, a long number, the last
/// value, the body's last bytes) is read on its own ([`one_value`]), which also rejects what
/// is not a plain `u32`.
fn scan_u32_array(b: &[u8], start: usize) -> Option<(Vec<u32>, usize)> {
    if b.get(start) != Some(&b'[') {
        return None;
    }
    // Token ids average about 6 bytes each with their comma.
    let mut out = Vec::with_capacity((b.len() - start) / 5 + 1);
    let mut i = skip_ws(b, start + 1);
    if b.get(i) == Some(&b']') {
        return Some((out, i + 1));
    }
    loop {
        #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
        while let Some(next) = window::read(b, i, &mut out) {
            i = next;
        }
        let retry = i + ONE_AT_A_TIME_BYTES;
        loop {
            let (value, next) = one_value(b, i)?;
            out.push(value);
            match next {
                Next::Value(at) => i = at,
                Next::End(past) => return Some((out, past)),
            }
            if i >= retry {
                break;
            }
        }
    }
}

/// After a window could not read a value, how many bytes of values are read one at a time
/// before the next try: a body written a value per line leaves every window to fail, and a
/// failed try at every value made it 2.5 times as slow to read (`lines` in the wire bench).
const ONE_AT_A_TIME_BYTES: usize = 512;

/// Token ids read a 64-byte window at a time, with SSE2 (part of every x86-64 processor).
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
mod window {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_min_epu8, _mm_movemask_epi8, _mm_set1_epi8, _mm_set_epi64x,
        _mm_sub_epi8,
    };

    /// Bytes a window covers.
    const WINDOW: usize = 64;

    /// Reads into `out` every value that starts at or after `b[i]` and ends with a comma inside
    /// the 64 bytes from `i`, and returns where the next value starts; `None` when no value
    /// could be read that way (the caller reads one on its own). `i` is where a value starts:
    /// after the array's `[` or a comma, possibly at one space.
    pub(super) fn read(b: &[u8], i: usize, out: &mut Vec<u32>) -> Option<usize> {
        // The window, with the 8 bytes before it: a value's 8 bytes before its comma are read
        // whole.
        let span: &[u8; 8 + WINDOW] = b.get(i.checked_sub(8)?..i + WINDOW)?.try_into().ok()?;
        let classes = Classes::of(span[8..].try_into().expect("a whole window"));
        // Bytes from `i` up to the first that no plain list holds: a digit, a comma, a space
        // right after a comma (Python's `json.dumps` writes `", "`), or a space at `i`.
        let allowed =
            classes.digits | classes.commas | (classes.spaces & ((classes.commas << 1) | 1));
        let clean = (!allowed).trailing_zeros();
        let mut commas = classes.commas & low_bits(clean);
        // Values gathered here and appended at once, so the loop checks no vector's capacity.
        // Each value takes at least two bytes, a digit and its comma.
        let mut values = [0u32; WINDOW / 2];
        let mut found = 0;
        // Where the next value starts, from `i`.
        let mut at = 0;
        while commas != 0 && found < values.len() {
            let comma = commas.trailing_zeros() as usize;
            commas &= commas - 1;
            // Between `first` and `comma` every byte is a digit: the clean bytes hold a space
            // only right after a comma, or at `i`, and `at` is either.
            let first = at + ((classes.spaces >> at) & 1) as usize;
            let digits = comma - first;
            let leading_zero = digits > 1 && (classes.zeros >> first) & 1 == 1;
            if !(1..=7).contains(&digits) || leading_zero {
                break;
            }
            let before = u64::from_le_bytes(span[comma..comma + 8].try_into().expect("8 bytes"));
            // The digits are the word's top bytes: keep them, as numbers, below zeros.
            let padded = before & 0x0f0f_0f0f_0f0f_0f0f & (u64::MAX << (8 * (8 - digits)));
            values[found] = super::eight_digits(padded) as u32;
            found += 1;
            at = comma + 1;
        }
        out.extend_from_slice(&values[..found]);
        (at > 0).then_some(i + at)
    }

    /// `u64::MAX` below bit `n` (all of it for 64).
    fn low_bits(n: u32) -> u64 {
        u64::MAX.checked_shr(64 - n).unwrap_or(0)
    }

    /// Bit `k` set where byte `k` of a window is of the class.
    struct Classes {
        commas: u64,
        spaces: u64,
        digits: u64,
        zeros: u64,
    }

    impl Classes {
        fn of(window: &[u8; WINDOW]) -> Classes {
            let mut classes = Classes {
                commas: 0,
                spaces: 0,
                digits: 0,
                zeros: 0,
            };
            for (k, lane) in window.chunks_exact(16).enumerate() {
                let half = |h: usize| {
                    i64::from_le_bytes(lane[8 * h..8 * h + 8].try_into().expect("8 bytes"))
                };
                // SAFETY: these intrinsics only need SSE2, which the module's `cfg` guarantees
                // (every x86-64 processor has it); they read no memory.
                unsafe {
                    let bytes = _mm_set_epi64x(half(1), half(0));
                    let bits =
                        |matches: __m128i| u64::from(_mm_movemask_epi8(matches) as u16) << (16 * k);
                    classes.commas |= bits(_mm_cmpeq_epi8(bytes, _mm_set1_epi8(b',' as i8)));
                    classes.spaces |= bits(_mm_cmpeq_epi8(bytes, _mm_set1_epi8(b' ' as i8)));
                    classes.zeros |= bits(_mm_cmpeq_epi8(bytes, _mm_set1_epi8(b'0' as i8)));
                    // A digit is at most 9 above '0', unsigned: below '0' wraps to 0xd0 and up.
                    let above_zero = _mm_sub_epi8(bytes, _mm_set1_epi8(b'0' as i8));
                    let at_most_9 = _mm_min_epu8(above_zero, _mm_set1_epi8(9));
                    classes.digits |= bits(_mm_cmpeq_epi8(above_zero, at_most_9));
                }
            }
            classes
        }
    }
}

/// What follows a value in the array.
enum Next {
    /// Another value, starting at this index (past the comma and any whitespace).
    Value(usize),
    /// The array's end: the index just past its `]`.
    End(usize),
}

/// The value at `b[i..]` (after any whitespace) and what follows it, or `None` when it is not
/// a plain `u32` followed by `,` or `]`.
fn one_value(b: &[u8], i: usize) -> Option<(u32, Next)> {
    let i = skip_ws(b, i);
    let (value, digits) = match parse_up_to_7_digits(b, i) {
        Some(parsed) => parsed,
        None => {
            // Near the end of the body, or a long number: byte by byte. Up to 11 bytes are
            // looked at: 10 digits fit u32::MAX, an 11th means too large.
            let rest = &b[i..b.len().min(i + 11)];
            let digits = rest.iter().take_while(|c| c.is_ascii_digit()).count();
            let value = rest[..digits]
                .iter()
                .fold(0u64, |v, &c| v * 10 + u64::from(c - b'0'));
            (value, digits)
        }
    };
    if digits == 0 || digits > 10 || (digits > 1 && b[i] == b'0') {
        return None;
    }
    let value = u32::try_from(value).ok()?;
    let after = skip_ws(b, i + digits);
    match b.get(after) {
        Some(b',') => Some((value, Next::Value(skip_ws(b, after + 1)))),
        Some(b']') => Some((value, Next::End(after + 1))),
        _ => None,
    }
}

/// The number at `b[i..]` when 8 bytes can be read there and it has at most 7 digits (token ids
/// do), as (value, digit count); `None` otherwise. Eight bytes at a time ("SWAR"): no branch per
/// digit, which is what made a byte-by-byte loop slow on ids of varying length.
fn parse_up_to_7_digits(b: &[u8], i: usize) -> Option<(u64, usize)> {
    let chunk = u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?);
    let values = chunk.wrapping_sub(0x3030_3030_3030_3030);
    // The high bit of each byte that is not an ASCII digit: below '0' wraps around (0x80 set
    // via the borrow), above '9' overflows past 0x7f when 0x76 is added.
    let not_digit = (values | values.wrapping_add(0x7676_7676_7676_7676)) & 0x8080_8080_8080_8080;
    let digits = (not_digit.trailing_zeros() / 8) as usize;
    if digits == 8 {
        return None;
    }
    if digits == 0 {
        return Some((0, 0));
    }
    // Keep the digits and move them to the top bytes, so the number reads as 8 digits with
    // leading zeros.
    let padded = (values << (8 * (8 - digits))) & 0x0f0f_0f0f_0f0f_0f0f;
    Some((eight_digits(padded), digits))
}

/// The number whose 8 decimal digits are the bytes of `padded` (each 0 to 9), the most
/// significant in the lowest byte, as text is read into a little-endian word: pairs, then
/// quads, then the octet are combined with one multiplication each.
fn eight_digits(padded: u64) -> u64 {
    let pairs = (padded.wrapping_mul(1 + (10 << 8))) >> 8;
    let quads = ((pairs & 0x00ff_00ff_00ff_00ff).wrapping_mul(1 + (100 << 16))) >> 16;
    ((quads & 0x0000_ffff_0000_ffff).wrapping_mul(1 + (10_000 << 32))) >> 32
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
        assert_eq!(
            split_tokens(br#"{"block_keys":[1,2],"tokens":[1]}"#),
            None,
            "a body with block keys goes to serde_json, which reports both members"
        );
    }

    #[test]
    fn eight_byte_reads_agree_with_byte_by_byte_reads() {
        for n in [
            0u64, 1, 9, 10, 99, 100, 12_345, 999_999, 1_000_000, 9_999_999,
        ] {
            for tail in [",", "]", " ,", "e"] {
                let text = format!("{n}{tail}........");
                assert_eq!(
                    parse_up_to_7_digits(text.as_bytes(), 0),
                    (n < 10_000_000).then(|| (n, n.to_string().len())),
                    "{text}"
                );
            }
        }
        assert_eq!(parse_up_to_7_digits(b"12345678,", 0), None, "8 digits");
        assert_eq!(parse_up_to_7_digits(b"12,", 0), None, "fewer than 8 bytes");
        assert_eq!(parse_up_to_7_digits(b"/:-.]1234", 0), Some((0, 0)));
    }

    /// The windows are what make the reader fast, so they must read what they can vouch for,
    /// not leave it all to the value-at-a-time path (whose answers would be the same).
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    #[test]
    fn a_window_reads_every_value_that_ends_in_it() {
        for separator in [",", ", "] {
            let ids: Vec<String> = (0..40).map(|k| (k * 7_919 % 128_000).to_string()).collect();
            let body = format!(r#"{{"tokens":[{}]}}"#, ids.join(separator));
            let start = body.find('[').unwrap() + 1;
            let mut out = Vec::new();
            let next = window::read(body.as_bytes(), start, &mut out).expect("a value is read");
            let window = &body[start..start + 64];
            let ended = window.matches(',').count();
            assert_eq!(
                out.len(),
                ended,
                "{separator:?}: every value ending in the window"
            );
            let expected: Vec<u32> = ids[..ended].iter().map(|id| id.parse().unwrap()).collect();
            assert_eq!(out, expected, "{separator:?}: the values as written");
            assert_eq!(
                next,
                start + window.rfind(',').unwrap() + 1,
                "{separator:?}: the next value starts past the last comma"
            );
        }
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

        /// Long lists, whose values the 64-byte windows read, with every separator JSON allows
        /// and values of every length: read exactly as serde_json reads them.
        #[test]
        fn long_lists_are_read_as_serde_json_reads_them(
            values in proptest::collection::vec(
                prop_oneof![0u32..128_000, 0u32..10, any::<u32>()], 0..600),
            separators in proptest::collection::vec(
                prop_oneof![
                    Just(","), Just(", "), Just(" ,"), Just(",  "), Just(",\n    "),
                    Just(",\n\t"), Just(",\r\n")], 1..8),
        ) {
            let mut list = String::from("[");
            for (k, value) in values.iter().enumerate() {
                if k > 0 {
                    list.push_str(separators[k % separators.len()]);
                }
                list.push_str(&value.to_string());
            }
            list.push(']');
            let body = format!(r#"{{"tokens":{list},"model":"m"}}"#);
            let parsed = fast(&body);
            prop_assert_eq!(parsed.as_ref().and_then(|p| p.tokens.as_ref()), Some(&values));
            prop_assert_eq!(parsed, serde_json::from_str::<Body>(&body).ok());
        }

        /// A long list with one byte changed anywhere: whenever the fast path answers, it
        /// answers what serde_json does (a stray byte inside the windows is never read past).
        #[test]
        fn a_changed_byte_in_a_long_list_never_passes_unnoticed(
            values in proptest::collection::vec(0u32..128_000, 1..400),
            at in any::<proptest::sample::Index>(),
            byte in prop_oneof![
                Just(b','), Just(b' '), Just(b']'), Just(b'['), Just(b'-'), Just(b'.'),
                Just(b'0'), Just(b'e'), Just(b'"'), Just(b'x'), any::<u8>()],
        ) {
            let list = serde_json::to_string(&values).unwrap();
            let mut body = format!(r#"{{"tokens":{list}}}"#).into_bytes();
            let at = at.index(body.len());
            body[at] = byte;
            if let Ok(body) = std::str::from_utf8(&body) {
                if let Some(parsed) = fast(body) {
                    prop_assert_eq!(Some(parsed), serde_json::from_str::<Body>(body).ok());
                }
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
