//! Which request headers are kept with an event, and redaction of the secret ones.

use std::sync::LazyLock;

use aho_corasick::AhoCorasick;
use axum::http::HeaderMap;
use serde_json::{Map, Value};

use crate::sanitize;

/// Replacement for a redacted header value.
pub const REDACTED: &str = "[redacted]";

/// Parts of a header name that mark a credential or a signature: any header whose
/// (lower-case) name contains one is stored redacted. A pattern list rather than a list
/// of names, because senders invent names (`x-api-key`, `api-key`, `x-auth-token`,
/// `x-session-id`, `x-client-password`, ...).
pub const SENSITIVE_NAME_PARTS: &[&str] =
    &["auth", "key", "token", "secret", "password", "passwd", "cookie", "session", "signature", "hmac", "credential"];

/// Whether a header carries a credential or a signature that must not be stored as-is.
/// One automaton for all the parts: a substring search per part and header was a
/// twentieth of ingest's instructions (bench/PROFILE.md).
fn is_sensitive(name: &str) -> bool {
    static PARTS: LazyLock<AhoCorasick> = LazyLock::new(|| {
        #[allow(clippy::expect_used)]
        AhoCorasick::new(SENSITIVE_NAME_PARTS).expect("a handful of short literal patterns always build")
    });
    PARTS.is_match(name)
}

/// Headers as a JSON object (lower-case names; repeated headers joined with ", "; each
/// value repaired and bounded by [`sanitize::MAX_HEADER_VALUE_BYTES`]), with
/// signatures and credentials redacted: once verified they are no longer needed, and
/// stored they would be a secret at rest.
///
/// `signature_header` is a source's own signature header (the `hmac` kind's configured
/// `header`, any name, e.g. `X-Hook-Sig`), redacted even when its name looks harmless: a
/// stored signature lets whoever reads it replay the body under a new delivery id.
pub fn redacted_headers(headers: &HeaderMap, signature_header: Option<&str>) -> Value {
    let mut out = Map::new();
    for name in headers.keys() {
        let key = name.as_str();
        let value = if is_sensitive(key) || signature_header.is_some_and(|h| h.trim().eq_ignore_ascii_case(key)) {
            REDACTED.to_owned()
        } else {
            let mut values = headers.get_all(name).iter().map(|v| String::from_utf8_lossy(v.as_bytes()));
            let first = values.next().unwrap_or_default();
            match values.next() {
                // The common case: one value, copied once.
                None => sanitize::bounded(&first, sanitize::MAX_HEADER_VALUE_BYTES),
                Some(second) => {
                    let mut joined = first.into_owned();
                    for value in std::iter::once(second).chain(values) {
                        joined.push_str(", ");
                        joined.push_str(&value);
                    }
                    sanitize::bounded(&joined, sanitize::MAX_HEADER_VALUE_BYTES)
                }
            }
        };
        out.insert(key.to_owned(), Value::String(value));
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_and_credentials_are_redacted() {
        let mut h = HeaderMap::new();
        h.insert("stripe-signature", "t=1,v1=abc".parse().unwrap());
        h.insert("x-hub-signature-256", "sha256=abc".parse().unwrap());
        h.insert("x-shopify-hmac-sha256", "abc".parse().unwrap());
        h.insert("authorization", "Bearer x".parse().unwrap());
        h.insert("x-github-event", "push".parse().unwrap());
        h.append("accept", "a".parse().unwrap());
        h.append("accept", "b".parse().unwrap());
        let v = redacted_headers(&h, None);
        assert_eq!(v["stripe-signature"], REDACTED);
        assert_eq!(v["x-hub-signature-256"], REDACTED);
        assert_eq!(v["x-shopify-hmac-sha256"], REDACTED);
        assert_eq!(v["authorization"], REDACTED);
        assert_eq!(v["x-github-event"], "push");
        assert_eq!(v["accept"], "a, b");
    }

    #[test]
    fn credential_like_names_are_redacted_whatever_the_sender_calls_them() {
        let mut h = HeaderMap::new();
        for name in [
            "api-key",
            "x-api-key",
            "x-apikey",
            "x-auth-token",
            "x-client-password",
            "x-session-id",
            "set-cookie",
            "cookie",
            "proxy-authorization",
            "x-credentials",
            "x-webhook-secret",
        ] {
            h.insert(axum::http::HeaderName::from_static(name), "sensitive-value".parse().unwrap());
        }
        h.insert("x-github-delivery", "d-1".parse().unwrap());
        h.insert("content-type", "application/json".parse().unwrap());
        h.insert("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().unwrap());
        let v = redacted_headers(&h, None);
        for (name, value) in v.as_object().unwrap() {
            let kept = ["x-github-delivery", "content-type", "traceparent"].contains(&name.as_str());
            assert_eq!(value != REDACTED, kept, "{name}: {value}");
        }
    }

    #[test]
    fn values_are_repaired_and_bounded() {
        let mut h = HeaderMap::new();
        h.insert("x-binary", axum::http::HeaderValue::from_bytes(b"a\xFFb").unwrap());
        let huge = "v".repeat(3 * sanitize::MAX_HEADER_VALUE_BYTES);
        h.insert("x-huge", huge.parse().unwrap());
        let v = redacted_headers(&h, None);
        assert_eq!(v["x-binary"], "a\u{FFFD}b");
        assert_eq!(v["x-huge"].as_str().map(str::len), Some(sanitize::MAX_HEADER_VALUE_BYTES));
    }

    #[test]
    fn a_configured_signature_header_is_redacted_whatever_its_name() {
        let mut h = HeaderMap::new();
        h.insert("x-hook-sig", "a3ef716b".parse().unwrap());
        h.insert("x-request-id", "req-1".parse().unwrap());
        assert_eq!(redacted_headers(&h, None)["x-hook-sig"], "a3ef716b");
        let v = redacted_headers(&h, Some("X-Hook-Sig"));
        assert_eq!(v["x-hook-sig"], REDACTED);
        assert_eq!(v["x-request-id"], "req-1");
    }
}
