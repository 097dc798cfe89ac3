//! Finding events by what they hold: a value inside the payload at a JSON path, a
//! header's value, or the dedupe key ("the webhook for order 42").
//!
//! Each event is stored with `events.search`, the 64-bit hashes (XXH3) of its terms, one
//! per scalar in its JSON payload (path and value), one per kept header (name and value)
//! and one for its dedupe key, under a GIN index. A search asks for the events whose
//! terms hold the hash of each condition, inside the usual time window, so it reads only
//! the matching events whatever the window.
//!
//! Why hashes computed here rather than a GIN index over the payload as `jsonb`: the
//! payload is stored as the bytes received (a signature covers them), so an index over it
//! as JSON would parse every body inside PostgreSQL, the ingest path's bottleneck, under a
//! subtransaction for the bodies that are not JSON. Hashing here costs the ingest writer a
//! parse of a body it already holds, and gives PostgreSQL fixed 8-byte keys.
//!
//! What is indexed, and so what can be found:
//! - every scalar of a JSON payload (string, number, boolean, null) under its path, the
//!   first [`MAX_PAYLOAD_TERMS`] of them in document order, for payloads of at most
//!   [`MAX_INDEXED_PAYLOAD_BYTES`]; arrays by index (`/items/0/sku`);
//! - every header kept with the event, except redacted ones;
//! - the dedupe key.
//!
//! A value is compared as text: `42` finds the number 42 and the string "42"; a number
//! is found as JSON writes it after parsing (`1.50` finds 1.5). Events stored before
//! this index existed (migration 0018) are found by the other filters only.
//!
//! The index's pending list is merged in the background ([`pending`]), not by the insert
//! that happens to fill it. The column is stored without compression (migration 0025):
//! hashes do not compress, and PostgreSQL tried on every row past its TOAST threshold.

mod payload;
pub mod pending;

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

/// Scalars of one payload that are indexed; the rest of a larger document is not.
pub const MAX_PAYLOAD_TERMS: usize = 1000;

/// Largest payload whose values are indexed: a larger one is found by its headers and key
/// only. The terms are hashed while the body is parsed (`search::payload`), so a parse holds no
/// copy of the document; the bound keeps the CPU one webhook spends on them, and which
/// events are found, as they were when the parse built the whole document in memory.
pub const MAX_INDEXED_PAYLOAD_BYTES: usize = 256 * 1024;

/// Longest search condition accepted (path and value together).
pub const MAX_CONDITION_BYTES: usize = 4096;

/// Separates a path's tokens, and the path from the value, in a hashed term: 0xFF never
/// occurs in UTF-8, so no token or value can forge a boundary.
const SEPARATOR: u8 = 0xFF;

/// What a term is about, as its first byte.
#[derive(Clone, Copy)]
#[repr(u8)]
enum Kind {
    Payload = b'p',
    Header = b'h',
    Key = b'k',
}

/// A term's hash, as PostgreSQL's `int8` holds it.
fn hash(bytes: &[u8]) -> i64 {
    i64::from_ne_bytes(xxh3_64(bytes).to_ne_bytes())
}

/// What ingest indexes of each event (`--content-search`).
///
/// Indexing an event's content costs at every webhook: the gateway parses its body and
/// hashes its values, PostgreSQL writes an index entry per term and merges them in the
/// background. On the bench at 10,000/s that was about a third of PostgreSQL's CPU per
/// webhook (bench row 16). An operator who never searches by content can keep the key
/// alone: a search by dedupe key still reads only the matching events, and a search by
/// payload or header is refused with the reason (events stored meanwhile have no content
/// terms: turning it back on finds the events stored from then on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Indexing {
    /// Payload values, headers and the dedupe key (the default).
    #[default]
    Content,
    /// The dedupe key only.
    KeyOnly,
}

impl Indexing {
    /// The terms of an event to store in `events.search` ([`terms`], or the key's alone).
    pub fn terms(self, dedupe_key: &str, headers: &Value, payload: &[u8]) -> Vec<i64> {
        match self {
            Indexing::Content => terms(dedupe_key, headers, payload),
            Indexing::KeyOnly => vec![key_hash(&mut Vec::new(), dedupe_key)],
        }
    }

    /// Whether searches by payload and header find anything stored from now on.
    pub fn content(self) -> bool {
        self == Indexing::Content
    }
}

/// The hashed terms of an event, sorted and without repeats: what `events.search` holds.
pub fn terms(dedupe_key: &str, headers: &Value, payload: &[u8]) -> Vec<i64> {
    let payload_terms = if indexed(payload) {
        payload::document_terms(payload, &[Kind::Payload as u8], MAX_PAYLOAD_TERMS).unwrap_or_default()
    } else {
        Vec::new()
    };
    with_payload_terms(payload_terms, dedupe_key, headers)
}

/// Whether a payload's values are indexed: one of at most [`MAX_INDEXED_PAYLOAD_BYTES`]
/// that may be JSON. Only a body that is JSON has paths; the cheap first-byte test spares
/// the parse of bodies that are plainly not (form posts, XML, binary).
fn indexed(payload: &[u8]) -> bool {
    let first = payload.iter().find(|b| !b.is_ascii_whitespace());
    payload.len() <= MAX_INDEXED_PAYLOAD_BYTES && matches!(first, Some(b'{' | b'['))
}

/// An event's terms: its payload's (`out`), its key's and its headers', sorted and
/// without repeats.
fn with_payload_terms(mut out: Vec<i64>, dedupe_key: &str, headers: &Value) -> Vec<i64> {
    // The payload's terms first: their vector, sized for them, takes the others too (the
    // order does not matter before the sort), where growing a vector of the key's and
    // the headers' terms reallocated it several times a webhook.
    // One buffer for the key's and every header's bytes, hashed in one call each.
    let mut buf = Vec::with_capacity(128);
    out.push(key_hash(&mut buf, dedupe_key));
    if let Value::Object(headers) = headers {
        for (name, value) in headers {
            match value {
                Value::String(v) if v != crate::ingest::REDACTED => out.push(header_hash(&mut buf, name, v)),
                _ => {}
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// An event's payload terms hashed by the walk verification reads the body with
/// (`verify::verify_scanning`): ingest then reads a body once for its event type and its
/// terms, where it read it once for each.
#[derive(Debug)]
pub struct PayloadScan {
    indexing: Indexing,
    /// The payload's terms, once a walk that answered computed them.
    payload_terms: Option<Vec<i64>>,
}

impl PayloadScan {
    /// A scan for an event indexed as `indexing` says.
    pub fn new(indexing: Indexing) -> PayloadScan {
        PayloadScan { indexing, payload_terms: None }
    }

    /// The event's terms, as [`Indexing::terms`] computes them: the payload's from the
    /// walk when it ran and answered, else computed now.
    pub fn terms(self, dedupe_key: &str, headers: &Value, payload: &[u8]) -> Vec<i64> {
        match (self.indexing, self.payload_terms) {
            (Indexing::Content, Some(payload_terms)) => with_payload_terms(payload_terms, dedupe_key, headers),
            (indexing, _) => indexing.terms(dedupe_key, headers, payload),
        }
    }
}

impl PayloadScan {
    /// Whether `payload`'s values are to be hashed by this scan's walk.
    fn hashes(&self, payload: &[u8]) -> bool {
        self.indexing.content() && indexed(payload)
    }
}

impl crate::verify::BodyScan for PayloadScan {
    /// A payload whose values are not indexed (content search off, a body over the size)
    /// is still walked once for the pointers, hashing nothing: one pass where a kind that
    /// reads several (Stripe two, Slack up to four) made one each; with no pointer, not at
    /// all.
    fn walks(&self, body: &[u8], probes: usize) -> bool {
        probes > 0 || self.hashes(body)
    }

    fn scan<'t>(&mut self, text: &'t str, probes: &mut [crate::verify::Probe<'_, 't>]) -> bool {
        let prefix = [Kind::Payload as u8];
        if self.hashes(text.as_bytes()) {
            self.payload_terms = payload::probed_terms(text, &prefix, MAX_PAYLOAD_TERMS, probes);
            self.payload_terms.is_some()
        } else {
            payload::probed_terms(text, &prefix, 0, probes).is_some()
        }
    }
}

/// The dedupe key's term, its bytes written into `buf` (the payload's path has a buffer
/// of its own, `payload`).
fn key_hash(buf: &mut Vec<u8>, dedupe_key: &str) -> i64 {
    buf.clear();
    buf.push(Kind::Key as u8);
    buf.extend_from_slice(dedupe_key.as_bytes());
    hash(buf)
}

/// A header's term, its bytes written into `buf`.
fn header_hash(buf: &mut Vec<u8>, name: &str, value: &str) -> i64 {
    buf.clear();
    buf.push(Kind::Header as u8);
    buf.extend_from_slice(name.as_bytes());
    buf.push(SEPARATOR);
    buf.extend_from_slice(value.as_bytes());
    hash(buf)
}

/// One thing to look for in an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    /// A scalar in the payload at `path` (its tokens) whose text is `value`.
    Payload {
        /// The path's tokens, unescaped (`["data", "object", "id"]`).
        path: Vec<String>,
        /// The value, as typed (see [`Condition::alternatives`]).
        value: String,
    },
    /// A kept header (lower-case name) with exactly this value.
    Header {
        /// Lower-case header name.
        name: String,
        /// The value as stored (repeated headers joined with ", ").
        value: String,
    },
    /// The event with this dedupe key, in any source.
    Key(String),
}

impl Condition {
    /// `PATH=VALUE`: a JSON Pointer (`/data/object/id=ch_123`, RFC 6901 escapes) or a
    /// dotted path (`data.object.id=ch_123`, `order=42`). Spaces around either side are
    /// ignored; a value in double quotes is taken as a JSON string (`note=" a b "`).
    pub fn payload(text: &str) -> Result<Condition, String> {
        check_size(text)?;
        let (path, value) =
            text.split_once('=').ok_or("expected PATH=VALUE, such as /data/object/id=ch_123 or order=42")?;
        let path = path.trim();
        let tokens: Vec<String> = if let Some(pointer) = path.strip_prefix('/') {
            pointer.split('/').map(unescape_pointer).collect::<Result<_, _>>()?
        } else {
            path.split('.').map(str::to_owned).collect()
        };
        if path.is_empty() || (!path.starts_with('/') && tokens.iter().any(String::is_empty)) {
            return Err(format!(
                "{path:?} is not a path: use a JSON Pointer (/data/object/id) or dots (data.object.id)"
            ));
        }
        Ok(Condition::Payload { path: tokens, value: unquote(value.trim())? })
    }

    /// `NAME:VALUE`, such as `x-github-event:push` (the name in any case).
    pub fn header(text: &str) -> Result<Condition, String> {
        check_size(text)?;
        let (name, value) = text.split_once(':').ok_or("expected NAME:VALUE, such as x-github-event:push")?;
        let name = name.trim().to_ascii_lowercase();
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!("{name:?} is not a header name"));
        }
        Ok(Condition::Header { name, value: unquote(value.trim())? })
    }

    /// The hashes any one of which an event's terms must hold to match: a payload value
    /// that is a number is also looked for as JSON writes it (`1.50` as `1.5`).
    pub fn alternatives(&self) -> Vec<i64> {
        match self {
            Condition::Key(key) => vec![key_hash(&mut Vec::new(), key)],
            Condition::Header { name, value } => vec![header_hash(&mut Vec::new(), name, value)],
            Condition::Payload { path, value } => {
                let mut buf = vec![Kind::Payload as u8];
                for token in path {
                    buf.push(SEPARATOR);
                    buf.extend_from_slice(token.as_bytes());
                }
                buf.push(SEPARATOR);
                buf.push(SEPARATOR);
                let at = buf.len();
                let mut out = Vec::with_capacity(2);
                buf.extend_from_slice(value.as_bytes());
                out.push(hash(&buf));
                if let Ok(n @ Value::Number(_)) = serde_json::from_str::<Value>(value) {
                    let written = n.to_string();
                    if written != *value {
                        buf.truncate(at);
                        buf.extend_from_slice(written.as_bytes());
                        out.push(hash(&buf));
                    }
                }
                out
            }
        }
    }
}

fn check_size(text: &str) -> Result<(), String> {
    if text.len() > MAX_CONDITION_BYTES {
        return Err(format!("longer than {MAX_CONDITION_BYTES} bytes"));
    }
    Ok(())
}

/// An RFC 6901 reference token: `~1` is `/`, `~0` is `~`, any other `~` is an error.
fn unescape_pointer(token: &str) -> Result<String, String> {
    let mut out = String::with_capacity(token.len());
    let mut chars = token.chars();
    while let Some(c) = chars.next() {
        match (c, c == '~') {
            (_, false) => out.push(c),
            (_, true) => match chars.next() {
                Some('0') => out.push('~'),
                Some('1') => out.push('/'),
                _ => return Err(format!("{token:?}: in a JSON Pointer, ~ is written ~0 and / is written ~1")),
            },
        }
    }
    Ok(out)
}

/// A value in double quotes is a JSON string (so it may hold spaces at its ends or
/// escapes); anything else is taken as typed.
fn unquote(value: &str) -> Result<String, String> {
    if value.len() >= 2 && value.starts_with('"') && value.ends_with('"') {
        return serde_json::from_str::<String>(value)
            .map_err(|e| format!("the quoted value is not a JSON string: {e}"));
    }
    Ok(value.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn found(doc: &Value, condition: &str) -> bool {
        let terms = terms("k", &json!({}), doc.to_string().as_bytes());
        let condition = Condition::payload(condition).expect("condition");
        condition.alternatives().iter().any(|h| terms.contains(h))
    }

    #[test]
    fn paths_are_pointers_or_dots_and_values_compare_as_text() {
        let doc = json!({"data": {"object": {"id": "ch_123", "amount": 1.5, "tags": ["a", "b"]}},
                         "order": 42, "live": true, "a/b": {"~x": null}, "note": " spaced "});
        assert!(found(&doc, "/data/object/id=ch_123"));
        assert!(found(&doc, " data.object.id = ch_123 "));
        assert!(found(&doc, "order=42"));
        assert!(found(&doc, "/data/object/amount=1.50"), "a number as JSON writes it");
        assert!(found(&doc, "/data/object/tags/1=b"));
        assert!(found(&doc, "live=true"));
        assert!(found(&doc, "/a~1b/~0x=null"));
        assert!(found(&doc, "note=\" spaced \""));
        assert!(!found(&doc, "note=spaced"));
        assert!(!found(&doc, "/data/object/id=ch_12"));
        assert!(!found(&doc, "/data/id=ch_123"), "the path matters, not only the value");
        assert!(!found(&doc, "id=ch_123"));
        assert!(!found(&doc, "/data/object/tags/0=b"));
        // "42" the string and 42 the number are one search.
        assert!(found(&json!({"order": "42"}), "order=42"));
    }

    #[test]
    fn headers_and_keys_are_terms_and_redacted_headers_are_not() {
        let headers = json!({"x-github-event": "push", "x-hub-signature-256": crate::ingest::REDACTED});
        let t = terms("delivery-1", &headers, b"not json");
        let has = |c: Condition| c.alternatives().iter().any(|h| t.contains(h));
        assert!(has(Condition::header("X-GitHub-Event: push").unwrap()));
        assert!(!has(Condition::header("x-github-event:pull").unwrap()));
        assert!(!has(Condition::header(&format!("x-hub-signature-256:{}", crate::ingest::REDACTED)).unwrap()));
        assert!(has(Condition::Key("delivery-1".into())));
        assert!(!has(Condition::Key("delivery-2".into())));
        assert_eq!(t.len(), 2, "no payload terms for a body that is not JSON: {t:?}");
    }

    #[test]
    fn without_content_search_an_event_is_found_by_its_key_alone() {
        let headers = json!({"x-github-event": "push"});
        let body = br#"{"order": {"id": 42}}"#;
        let all = Indexing::Content.terms("delivery-1", &headers, body);
        let key_only = Indexing::KeyOnly.terms("delivery-1", &headers, body);
        let finds = |t: &[i64], c: Condition| c.alternatives().iter().any(|h| t.contains(h));
        for (t, content) in [(&all, true), (&key_only, false)] {
            assert!(finds(t, Condition::Key("delivery-1".into())));
            assert_eq!(finds(t, Condition::payload("order.id=42").unwrap()), content);
            assert_eq!(finds(t, Condition::header("x-github-event:push").unwrap()), content);
        }
        assert_eq!(key_only.len(), 1, "{key_only:?}");
        assert_eq!(all, terms("delivery-1", &headers, body), "the default is the full set");
    }

    #[test]
    fn malformed_conditions_say_what_is_wrong() {
        for bad in ["no equals sign", "=42", "a..b=1", "/a~2=1", "x=\"unterminated\\\""] {
            assert!(Condition::payload(bad).is_err(), "{bad}");
        }
        assert!(Condition::header("no colon").is_err());
        assert!(Condition::header(":v").is_err());
        assert!(Condition::payload(&format!("a={}", "x".repeat(MAX_CONDITION_BYTES))).is_err());
        // The empty pointer token is a key of "", which JSON allows.
        assert_eq!(
            Condition::payload("/=1").unwrap(),
            Condition::Payload { path: vec![String::new()], value: "1".into() }
        );
    }

    #[test]
    fn a_payload_over_the_indexed_size_is_found_by_its_key_and_headers_only() {
        let big = json!({"id": "ord_1", "pad": "x".repeat(MAX_INDEXED_PAYLOAD_BYTES)});
        let t = terms("k", &json!({"x-a": "b"}), big.to_string().as_bytes());
        assert_eq!(t.len(), 2, "the key and the header");
        let small = json!({"id": "ord_1", "pad": "x".repeat(MAX_INDEXED_PAYLOAD_BYTES - 100)});
        assert!(found(&small, "id=ord_1"));
    }

    #[test]
    fn a_large_document_indexes_its_first_scalars_only() {
        let doc = Value::Array((0..MAX_PAYLOAD_TERMS + 500).map(|i| json!(i)).collect());
        let t = terms("k", &json!({}), doc.to_string().as_bytes());
        assert_eq!(t.len(), MAX_PAYLOAD_TERMS + 1);
        assert!(found(&doc, &format!("/{}={}", MAX_PAYLOAD_TERMS - 1, MAX_PAYLOAD_TERMS - 1)));
        assert!(!found(&doc, &format!("/{0}={0}", MAX_PAYLOAD_TERMS)));
    }

    use xxhash_rust::xxh3::Xxh3;

    /// The payload terms of `doc` by the reference walk over the parsed `Value`.
    fn walked(doc: &Value, budget: usize) -> Vec<i64> {
        let (mut buf, mut budget, mut out) = (vec![Kind::Payload as u8], budget, Vec::new());
        walk(doc, &mut buf, &mut budget, &mut out);
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The payload terms of `text` hashed while parsing.
    fn streamed(text: &str, budget: usize) -> Option<Vec<i64>> {
        let mut out = payload::document_terms(text.as_bytes(), &[Kind::Payload as u8], budget)?;
        out.sort_unstable();
        out.dedup();
        Some(out)
    }

    #[test]
    fn hashing_while_parsing_gives_the_terms_of_the_parsed_document() {
        for text in [
            r#"{"id":"evt_1","type":"charge.succeeded","data":{"object":{"amount":1050,"currency":"usd","paid":true,
                "refunded":false,"failure":null,"fee":-12,"rate":1.50,"big":18446744073709551615,"huge":1e300,
                "tiny":1e-7,"neg0":-0,"neg0f":-0.0,"over":123456789012345678901234567890,
                "items":[{"sku":"a\/b\u00e9\n"},[],{},[1,[2,[3]]]]}}}"#,
            r#"[1, "two", 3.0, null, {"k\u0000ey": "v\"al\\"}]"#,
            r#"{}"#,
            r#"[]"#,
            r#"{"a":{"b":{"c":{"d":[[[["deep"]]]]}}}}"#,
        ] {
            let doc: Value = serde_json::from_str(text).expect("valid");
            assert_eq!(streamed(text, MAX_PAYLOAD_TERMS), Some(walked(&doc, MAX_PAYLOAD_TERMS)), "{text}");
        }
        // Scalars on both sides of the length past which a scalar is hashed where it lies.
        for len in [payload::COPIED_SCALAR_BYTES, payload::COPIED_SCALAR_BYTES + 1, 5_000] {
            let doc = json!({"short": "s", "long": "é".repeat(len / 2) + &"x".repeat(len % 2)});
            let text = doc.to_string();
            assert_eq!(streamed(&text, MAX_PAYLOAD_TERMS), Some(walked(&doc, MAX_PAYLOAD_TERMS)), "{len}");
        }
        assert_eq!(streamed("[\"\u{ff}\"]", MAX_PAYLOAD_TERMS).map(|t| t.len()), Some(1));
    }

    #[test]
    fn a_body_that_is_not_one_json_document_has_no_payload_terms() {
        for text in [r#"{"a":1"#, r#"{"a":1} {"b":2}"#, r#"[1,2,]"#, r#"{"a":1}x"#, "[\"\\x\"]"] {
            assert_eq!(streamed(text, MAX_PAYLOAD_TERMS), None, "{text}");
            assert_eq!(terms("k", &json!({}), text.as_bytes()).len(), 1, "only the key: {text}");
        }
        assert_eq!(
            payload::document_terms(b"[\"\xff\"]", &[Kind::Payload as u8], MAX_PAYLOAD_TERMS),
            None,
            "not UTF-8"
        );
    }

    #[test]
    fn a_document_nested_past_the_parser_s_depth_limit_has_no_payload_terms_and_no_overflow() {
        let deep = format!("{}1{}", "[".repeat(10_000), "]".repeat(10_000));
        assert_eq!(streamed(&deep, MAX_PAYLOAD_TERMS), None);
        assert!(serde_json::from_str::<Value>(&deep).is_err(), "the parse into a Value refused it too");
        let within = format!("{}1{}", "[".repeat(100), "]".repeat(100));
        assert_eq!(streamed(&within, MAX_PAYLOAD_TERMS).map(|t| t.len()), Some(1));
    }

    #[test]
    fn past_the_budget_the_document_is_still_read_to_its_end() {
        let doc = json!([[1, 2, 3], {"a": [4, 5]}, 6]);
        let mut text = doc.to_string();
        assert_eq!(streamed(&text, 2).map(|t| t.len()), Some(2));
        assert_eq!(streamed(&text, 2), Some(walked(&json!([[1, 2]]), 2)), "the first two in document order");
        text.push(']');
        assert_eq!(streamed(&text, 2), None, "malformed after the budget ran out");
    }

    /// The terms of a parsed document as the gateway computed them before it hashed while
    /// parsing ([`payload`]): each scalar under `value` hashed with the path in `buf`
    /// (restored on return). The reference the streamed hashes must equal.
    fn walk(value: &Value, buf: &mut Vec<u8>, budget: &mut usize, out: &mut Vec<i64>) {
        let at = buf.len();
        match value {
            Value::Object(map) => {
                for (key, child) in map {
                    if *budget == 0 {
                        return;
                    }
                    buf.push(SEPARATOR);
                    buf.extend_from_slice(key.as_bytes());
                    walk(child, buf, budget, out);
                    buf.truncate(at);
                }
            }
            Value::Array(items) => {
                for (i, child) in items.iter().enumerate() {
                    if *budget == 0 {
                        return;
                    }
                    buf.push(SEPARATOR);
                    buf.extend_from_slice(i.to_string().as_bytes());
                    walk(child, buf, budget, out);
                    buf.truncate(at);
                }
            }
            scalar => {
                *budget = budget.saturating_sub(1);
                buf.push(SEPARATOR);
                buf.push(SEPARATOR);
                // Streamed: a long value is hashed where it is, not copied after the path.
                let mut hasher = Xxh3::new();
                hasher.update(buf);
                hasher.update(scalar_text(scalar).as_bytes());
                out.push(i64::from_ne_bytes(hasher.digest().to_ne_bytes()));
                buf.truncate(at);
            }
        }
    }

    /// A scalar as searched for: a string's own text, anything else as JSON writes it.
    fn scalar_text(v: &Value) -> std::borrow::Cow<'_, str> {
        match v {
            Value::String(s) => s.as_str().into(),
            other => other.to_string().into(),
        }
    }

    /// Every scalar of a document, as (JSON Pointer, value text).
    fn leaves(v: &Value, path: String, out: &mut Vec<(String, Value)>) {
        match v {
            Value::Object(m) => {
                for (k, c) in m {
                    leaves(c, format!("{path}/{}", k.replace('~', "~0").replace('/', "~1")), out);
                }
            }
            Value::Array(a) => {
                for (i, c) in a.iter().enumerate() {
                    leaves(c, format!("{path}/{i}"), out);
                }
            }
            s => out.push((path, s.clone())),
        }
    }

    proptest! {
        #![proptest_config(crate::props::config(64))]

        /// Any document's terms hashed while parsing are those of the parsed document.
        #[test]
        fn hashing_while_parsing_equals_walking_the_parsed_document(doc in crate::props::json_value()) {
            let text = doc.to_string();
            prop_assert_eq!(streamed(&text, MAX_PAYLOAD_TERMS), Some(walked(&doc, MAX_PAYLOAD_TERMS)));
        }

        /// Any scalar of any (small) document is found at its own path, with its value
        /// quoted as a JSON string when it is one; and a value it does not hold is not.
        #[test]
        fn every_scalar_is_found_at_its_path(doc in crate::props::json_value()) {
            let mut all = Vec::new();
            leaves(&doc, String::new(), &mut all);
            let wrapped = json!({"w": doc});
            // Two limits of the PATH=VALUE form (documented): the first `=` ends the path, and
            // spaces around the path are not part of it.
            let searchable = |p: &str| !p.contains('=') && p.trim_end() == p;
            for (path, value) in all.into_iter().filter(|(p, _)| searchable(p)).take(50) {
                let text = match &value { Value::String(_) => value.to_string(), other => other.to_string() };
                prop_assert!(found(&wrapped, &format!("/w{path}={text}")), "/w{}={}", path, text);
                let absent = format!("/w{path}=\"\\u0001never\"");
                prop_assert!(!found(&wrapped, &absent), "{}", absent);
            }
        }
    }
}
