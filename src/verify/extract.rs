//! Reading dedupe keys and event types out of headers and JSON bodies.

use http::HeaderMap;
use serde_json::Value;
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use super::pointer::{BodyScan, Probe};
use super::{Locator, VerifyError};

/// What begins the dedupe key of last resort, the body's hash ([`body_sha256_hex`]).
pub const BODY_HASH_PREFIX: &str = "sha256:";

/// Hex SHA-256 of the body, prefixed [`BODY_HASH_PREFIX`]. The dedupe key of last resort.
pub fn body_sha256_hex(body: &[u8]) -> String {
    format!("{BODY_HASH_PREFIX}{}", hex::encode(Sha256::digest(body)))
}

/// What a key or event type lookup found: `Ok(None)` when the value is absent (the
/// caller may fall back), an error when it is present but cannot be used as sent (the
/// request is refused: a present key is never silently replaced by a fallback).
pub(crate) type Found = Result<Option<String>, VerifyError>;

/// The body as JSON; values are read out of it by pointer without building a document
/// tree (see [`pointer`](super::pointer)). A body found not to be JSON is not read again.
///
/// With a [`BodyScan`], the first value looked up walks the body once for every pointer
/// declared ahead, and for the scan's own purpose (the search index's terms); a pointer
/// not declared is looked up by a pass of its own, as without a scan.
pub(crate) struct LazyJson<'a> {
    body: &'a [u8],
    /// The body's text once read: `None` when it is not JSON.
    text: Option<Option<&'a str>>,
    scan: Option<Scan<'a>>,
    /// Passes over the body made pointer by pointer (counted for tests only: telling a
    /// pointer that reads the body costs its tokens).
    #[cfg(test)]
    passes: usize,
}

/// A [`LazyJson`]'s walk of the whole body with its declared pointers.
struct Scan<'a> {
    scanner: &'a mut dyn BodyScan,
    probes: Vec<Probe<'a, 'a>>,
    /// `None` before the walk; then whether it answered.
    answered: Option<bool>,
}

impl<'a> LazyJson<'a> {
    pub(crate) fn new(body: &'a [u8]) -> Self {
        Self {
            body,
            text: None,
            scan: None,
            #[cfg(test)]
            passes: 0,
        }
    }

    /// A body read by `scanner`'s walk, which looks for `pointers` on its way.
    pub(crate) fn scanning(
        body: &'a [u8],
        pointers: impl IntoIterator<Item = &'a str>,
        scanner: &'a mut dyn BodyScan,
    ) -> Self {
        let mut probes: Vec<Probe<'a, 'a>> = Vec::new();
        for pointer in pointers {
            if !probes.iter().any(|p| p.pointer() == pointer)
                && let Some(probe) = Probe::new(pointer)
            {
                probes.push(probe);
            }
        }
        Self { scan: Some(Scan { scanner, probes, answered: None }), ..Self::new(body) }
    }

    /// The body's text, `None` when it is not JSON (as far as is known yet).
    fn text(&mut self) -> Option<&'a str> {
        let body = self.body;
        *self.text.get_or_insert_with(|| super::pointer::text(body).ok())
    }

    /// Walk the body with the scan now if it has not walked it, so that its own purpose
    /// is served even when no pointer was looked up.
    pub(crate) fn finish(&mut self) {
        self.walk();
    }

    /// Whether the scan's walk answered for its pointers: walked now if it has not been,
    /// when the scan walks this body (the body's text is read only then).
    fn walk(&mut self) -> bool {
        let pending = match &self.scan {
            Some(scan) => scan.answered.is_none().then(|| scan.scanner.walks(self.body, scan.probes.len())),
            None => return false,
        };
        if let Some(walks) = pending {
            let text = if walks { self.text() } else { None };
            if let Some(scan) = &mut self.scan {
                scan.answered = Some(text.is_some_and(|text| scan.scanner.scan(text, &mut scan.probes)));
            }
        }
        self.scan.as_ref().is_some_and(|scan| scan.answered == Some(true))
    }

    /// The value at an RFC 6901 pointer, parsed; `None` when the body is not JSON or the
    /// pointer finds nothing.
    pub(crate) fn value_at(&mut self, pointer: &str) -> Option<Value> {
        let text = self.text()?;
        let walked = self.walk();
        let raw = match self.scan.as_ref().filter(|_| walked).and_then(|scan| scan.answer(pointer)) {
            Some(found) => found?,
            None => {
                #[cfg(test)]
                {
                    self.passes += usize::from(super::pointer::reads(pointer));
                }
                match super::pointer::find(text, pointer) {
                    Ok(raw) => raw?,
                    Err(super::pointer::NotJson) => {
                        self.text = Some(None);
                        return None;
                    }
                }
            }
        };
        // Only the (small) value found is parsed. A value serde_json cannot hold (nested
        // past its recursion limit, a number out of range) is absent, as it was when
        // the whole body had to parse.
        serde_json::from_str(raw.get()).ok()
    }

    /// Passes over the body made for one pointer each (the scan's walk not counted).
    #[cfg(test)]
    pub(crate) fn passes(&self) -> usize {
        self.passes
    }

    /// A string (or number) at an RFC 6901 pointer. Absent when the body is not JSON or
    /// the pointer finds nothing or `null`; refused when it finds anything else that is
    /// not a non-empty string or a number.
    pub(crate) fn pointer(&mut self, pointer: &str) -> Found {
        match self.value_at(pointer) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s)),
            // Integers only: without arbitrary precision, serde_json parses an integer
            // past 64 bits as a float, so two different big ids would print as the same
            // `1.2345678901234568e22` and the second event would be a false duplicate.
            Some(Value::Number(n)) if !n.is_f64() => Ok(Some(n.to_string())),
            Some(Value::Number(_)) => Err(VerifyError::MalformedBody(format!(
                "the value at {pointer} is a number that is not an integer within 64 bits; send it as a string"
            ))),
            Some(other) => Err(VerifyError::MalformedBody(format!(
                "the value at {pointer} is {}, not a non-empty string or a number",
                json_kind(&other)
            ))),
        }
    }
}

impl<'a> Scan<'a> {
    /// The answer of a walk that answered for `pointer`: `None` when it was not declared,
    /// `Some(None)` when it names nothing in the body.
    fn answer(&self, pointer: &str) -> Option<Option<&'a RawValue>> {
        self.probes.iter().find(|p| p.pointer() == pointer).map(Probe::value)
    }
}

/// A JSON value's kind, for error messages (never the value: it may be large or secret).
fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(s) if s.is_empty() => "an empty string",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A header's trimmed value as a key: absent when the header is; refused when it is
/// empty, not UTF-8, or repeated with different values (which one would be the key?).
pub(crate) fn header_string(headers: &HeaderMap, name: &str) -> Found {
    let mut found: Option<String> = None;
    for value in headers.get_all(name) {
        let text = std::str::from_utf8(value.as_bytes())
            .map_err(|_| VerifyError::MalformedBody(format!("header {name} is not valid UTF-8")))?
            .trim();
        if text.is_empty() {
            return Err(VerifyError::MalformedBody(format!("header {name} is empty")));
        }
        match &found {
            Some(first) if first != text => {
                return Err(VerifyError::MalformedBody(format!(
                    "header {name} appears more than once, with different values"
                )));
            }
            Some(_) => {}
            None => found = Some(text.to_owned()),
        }
    }
    Ok(found)
}

/// The source's override when it configures one, else the kind's default. An override
/// that finds nothing does not fall back to the default: the operator chose that place,
/// and silently reading another would make two sources of one kind disagree on keys.
pub(crate) fn resolve<'a>(
    locator: &Locator,
    headers: &HeaderMap,
    json: &mut LazyJson<'a>,
    default: impl FnOnce(&mut LazyJson<'a>) -> Found,
) -> Found {
    if locator.is_empty() { default(json) } else { locate(locator, headers, json) }
}

/// The event type of last resort.
pub(crate) fn unknown_event_type() -> String {
    "unknown".to_owned()
}

/// Resolve a locator: the header when it is present, else the JSON pointer.
pub(crate) fn locate(locator: &Locator, headers: &HeaderMap, json: &mut LazyJson) -> Found {
    if let Some(name) = &locator.header
        && let Some(v) = header_string(headers, name)?
    {
        return Ok(Some(v));
    }
    match &locator.json_pointer {
        Some(pointer) => json.pointer(pointer),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_hash_is_prefixed_and_matches_a_known_digest() {
        // sha256("abc") from FIPS 180-2, appendix B.1.
        assert_eq!(body_sha256_hex(b"abc"), "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn locator_prefers_header_then_pointer() {
        let mut headers = HeaderMap::new();
        headers.insert("x-id", "from-header".parse().unwrap());
        let body = br#"{"data": {"id": "from-body", "n": 7, "none": null}}"#;
        let both = Locator { header: Some("X-Id".into()), json_pointer: Some("/data/id".into()) };
        assert_eq!(locate(&both, &headers, &mut LazyJson::new(body)), Ok(Some("from-header".into())));
        let pointer_only = Locator { header: Some("x-missing".into()), json_pointer: Some("/data/n".into()) };
        assert_eq!(locate(&pointer_only, &headers, &mut LazyJson::new(body)), Ok(Some("7".into())));
        let absent = Locator { header: None, json_pointer: Some("/data/missing".into()) };
        assert_eq!(locate(&absent, &headers, &mut LazyJson::new(body)), Ok(None));
        let null = Locator { header: None, json_pointer: Some("/data/none".into()) };
        assert_eq!(locate(&null, &headers, &mut LazyJson::new(body)), Ok(None));
        assert_eq!(locate(&both, &HeaderMap::new(), &mut LazyJson::new(b"not json")), Ok(None));
    }

    #[test]
    fn a_present_value_that_cannot_be_used_is_refused_not_replaced() {
        let body = br#"{"data": {"id": "", "obj": {"a": 1}, "list": [1], "flag": true, "big": 12345678901234567890123, "float": 1.5}}"#;
        for pointer in ["/data/id", "/data/obj", "/data/list", "/data/flag", "/data", "/data/big", "/data/float"] {
            let locator = Locator { header: None, json_pointer: Some(pointer.into()) };
            let found = locate(&locator, &HeaderMap::new(), &mut LazyJson::new(body));
            assert!(matches!(found, Err(VerifyError::MalformedBody(_))), "{pointer}: {found:?}");
        }
        let header = Locator { header: Some("X-Id".into()), json_pointer: Some("/data/flag".into()) };
        let mut empty = HeaderMap::new();
        empty.insert("x-id", "  ".parse().unwrap());
        let mut binary = HeaderMap::new();
        binary.insert("x-id", http::HeaderValue::from_bytes(b"ab\xFFcd").unwrap());
        let mut twice = HeaderMap::new();
        twice.append("x-id", "a".parse().unwrap());
        twice.append("x-id", "b".parse().unwrap());
        for (what, headers) in [("empty", empty), ("not UTF-8", binary), ("repeated", twice)] {
            let found = locate(&header, &headers, &mut LazyJson::new(b"{}"));
            assert!(matches!(found, Err(VerifyError::MalformedBody(_))), "{what}: {found:?}");
        }
        let mut same_twice = HeaderMap::new();
        same_twice.append("x-id", "a".parse().unwrap());
        same_twice.append("x-id", "a".parse().unwrap());
        assert_eq!(locate(&header, &same_twice, &mut LazyJson::new(b"{}")), Ok(Some("a".into())));
        let mut utf8 = HeaderMap::new();
        utf8.insert("x-id", http::HeaderValue::from_bytes("clé-1".as_bytes()).unwrap());
        assert_eq!(locate(&header, &utf8, &mut LazyJson::new(b"{}")), Ok(Some("clé-1".into())));
    }
}
