//! Reading dedupe keys and event types out of headers and JSON bodies.

use http::HeaderMap;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::Locator;

/// Hex SHA-256 of the body, prefixed `sha256:` so a hash can never collide with a
/// provider's own delivery id. The dedupe key of last resort.
pub fn body_sha256_hex(body: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(body)))
}

/// A header's value as text, if present and valid visible ASCII.
pub(crate) fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// The body parsed as JSON, computed at most once per request.
pub(crate) struct LazyJson<'a> {
    body: &'a [u8],
    parsed: Option<Option<Value>>,
}

impl<'a> LazyJson<'a> {
    pub(crate) fn new(body: &'a [u8]) -> Self {
        Self { body, parsed: None }
    }

    /// The parsed body, or `None` when it is not JSON.
    pub(crate) fn get(&mut self) -> Option<&Value> {
        let body = self.body;
        self.parsed.get_or_insert_with(|| serde_json::from_slice(body).ok()).as_ref()
    }

    /// A string (or number) at an RFC 6901 pointer.
    pub(crate) fn pointer(&mut self, pointer: &str) -> Option<String> {
        scalar_to_string(self.get()?.pointer(pointer)?)
    }
}

/// Non-empty string or number as text; other JSON values are not keys.
pub(crate) fn scalar_to_string(value: &Value) -> Option<String> {
    match value {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// A header's trimmed value as an owned key, if present and non-empty.
pub(crate) fn header_string(headers: &HeaderMap, name: &str) -> Option<String> {
    header_str(headers, name).filter(|v| !v.is_empty()).map(str::to_owned)
}

/// The source's override when it configures one, else the kind's default. An override
/// that finds nothing does not fall back to the default: the operator chose that place,
/// and silently reading another would make two sources of one kind disagree on keys.
pub(crate) fn resolve<'a>(
    locator: &Locator,
    headers: &HeaderMap,
    json: &mut LazyJson<'a>,
    default: impl FnOnce(&mut LazyJson<'a>) -> Option<String>,
) -> Option<String> {
    if locator.is_empty() { default(json) } else { locate(locator, headers, json) }
}

/// The event type of last resort.
pub(crate) fn unknown_event_type() -> String {
    "unknown".to_owned()
}

/// Resolve a locator: header first, then JSON pointer.
pub(crate) fn locate(locator: &Locator, headers: &HeaderMap, json: &mut LazyJson) -> Option<String> {
    if let Some(name) = &locator.header
        && let Some(v) = header_str(headers, name).filter(|v| !v.is_empty())
    {
        return Some(v.to_owned());
    }
    if let Some(pointer) = &locator.json_pointer {
        return json.pointer(pointer);
    }
    None
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
        let body = br#"{"data": {"id": "from-body", "n": 7}}"#;
        let both = Locator { header: Some("X-Id".into()), json_pointer: Some("/data/id".into()) };
        assert_eq!(locate(&both, &headers, &mut LazyJson::new(body)).as_deref(), Some("from-header"));
        let pointer_only = Locator { header: Some("x-missing".into()), json_pointer: Some("/data/n".into()) };
        assert_eq!(locate(&pointer_only, &headers, &mut LazyJson::new(body)).as_deref(), Some("7"));
        let nothing = Locator { header: None, json_pointer: Some("/data".into()) };
        assert_eq!(locate(&nothing, &headers, &mut LazyJson::new(body)), None);
        assert_eq!(locate(&both, &HeaderMap::new(), &mut LazyJson::new(b"not json")), None);
    }
}
