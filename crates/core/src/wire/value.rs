//! Helpers shared by the decoders: reading one MessagePack value, naming value kinds in error
//! details, and field lookup that works for both msgspec layouts (positional arrays and maps).

use rmpv::ValueRef;

use crate::input::{RejectReason, Rejection};

/// Nesting limit for a payload. The deepest legitimate payload (a map batch holding map events
/// holding bigram token pairs or `extra_keys` tuples) nests about seven containers; rmpv counts
/// roughly two levels per container, so 64 leaves ample room while keeping recursion — and the
/// stack — shallow on hostile input.
const MAX_DEPTH: usize = 64;

/// Reads exactly one MessagePack value from `payload`.
///
/// Anything that is not a complete value, or a value followed by extra bytes, is
/// [`RejectReason::MalformedPayload`]: a NATS message (or ZMQ frame) carries exactly one value,
/// so trailing bytes mean a corrupted or mis-framed payload rather than something to skip.
pub(crate) fn read_single<'a>(payload: &'a [u8], what: &str) -> Result<ValueRef<'a>, Rejection> {
    let mut rd: &'a [u8] = payload;
    let value = rmpv::decode::read_value_ref_with_max_depth(&mut rd, MAX_DEPTH).map_err(|e| {
        Rejection::new(
            RejectReason::MalformedPayload,
            format!("{what}: not a MessagePack value ({e})"),
        )
    })?;
    if !rd.is_empty() {
        return Err(Rejection::new(
            RejectReason::MalformedPayload,
            format!(
                "{what}: {} trailing bytes after the MessagePack value",
                rd.len()
            ),
        ));
    }
    Ok(value)
}

/// The MessagePack kind of a value, for "expected X, got Y" details.
pub(crate) fn kind(v: &ValueRef<'_>) -> &'static str {
    match v {
        ValueRef::Nil => "nil",
        ValueRef::Boolean(_) => "boolean",
        ValueRef::Integer(i) if i.is_u64() => "integer",
        ValueRef::Integer(_) => "negative integer",
        ValueRef::F32(_) | ValueRef::F64(_) => "float",
        ValueRef::String(s) if s.is_str() => "string",
        ValueRef::String(_) => "string (invalid UTF-8)",
        ValueRef::Binary(_) => "binary",
        ValueRef::Array(_) => "array",
        ValueRef::Map(_) => "map",
        ValueRef::Ext(..) => "ext",
    }
}

/// The value stored under the string key `name`; the last one wins if a key repeats.
/// Keys that are not strings are never looked up, so they are ignored like unknown keys.
pub(crate) fn map_get<'v, 'a>(
    entries: &'v [(ValueRef<'a>, ValueRef<'a>)],
    name: &str,
) -> Option<&'v ValueRef<'a>> {
    entries
        .iter()
        .rev()
        .find(|(k, _)| matches!(k, ValueRef::String(s) if s.as_str() == Some(name)))
        .map(|(_, v)| v)
}

/// `None` for an absent field or an explicit nil: msgspec writes `None` as nil, and older or
/// newer publishers omit fields they do not have.
pub(crate) fn present<'v, 'a>(v: Option<&'v ValueRef<'a>>) -> Option<&'v ValueRef<'a>> {
    v.filter(|v| !matches!(v, ValueRef::Nil))
}

/// A UTF-8 string value, or `None` for any other kind.
pub(crate) fn as_str<'v>(v: &'v ValueRef<'_>) -> Option<&'v str> {
    match v {
        ValueRef::String(s) => s.as_str(),
        _ => None,
    }
}

/// A number as f64; integers are accepted where floats are expected (a publisher may well
/// write `kv_usage` 0 or 1 as an integer).
pub(crate) fn as_number(v: &ValueRef<'_>) -> Option<f64> {
    match v {
        ValueRef::F64(f) => Some(*f),
        ValueRef::F32(f) => Some(f64::from(*f)),
        ValueRef::Integer(i) => i.as_f64(),
        _ => None,
    }
}

/// Shortens a string for an error detail, so a hostile payload cannot blow up log lines.
pub(crate) fn shorten(s: &str) -> String {
    const MAX: usize = 64;
    if s.chars().count() <= MAX {
        s.to_owned()
    } else {
        let mut out: String = s.chars().take(MAX).collect();
        out.push('…');
        out
    }
}

/// An integer fitting u32, or `None` for any other value.
pub(crate) fn as_u32(v: &ValueRef<'_>) -> Option<u32> {
    match v {
        ValueRef::Integer(i) => i.as_u64().and_then(|n| u32::try_from(n).ok()),
        _ => None,
    }
}

/// "got ..." wording for details: the value itself for numbers, the kind otherwise.
pub(crate) fn got(v: &ValueRef<'_>) -> String {
    match v {
        ValueRef::Integer(i) => i.to_string(),
        ValueRef::F32(f) => f.to_string(),
        ValueRef::F64(f) => f.to_string(),
        ValueRef::Binary(b) => format!("binary of {} bytes", b.len()),
        other => kind(other).to_owned(),
    }
}
