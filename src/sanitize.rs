//! Text from outside, made safe and bounded before anything stores it: the one place that
//! decides what a sender's or a subscriber's bytes become in the database.
//!
//! PostgreSQL refuses NUL in `text` and `jsonb`, not every byte string is UTF-8, and a
//! string nobody bounded can outgrow an index row or a log line. So every stored string
//! that a peer controls passes through here:
//!
//! | what | from | stored as | bound |
//! | --- | --- | --- | --- |
//! | response excerpt | subscriber's body | [`stored_text`] | [`MAX_EXCERPT_BYTES`] |
//! | `Location` in a reason | subscriber's header | [`stored_text`] | [`MAX_LOCATION_BYTES`] |
//! | attempt reason, dead reason | built from the above and transport errors | [`bounded`] | [`MAX_REASON_BYTES`] |
//! | content type | sender's header | [`stored_text`] | [`MAX_CONTENT_TYPE_BYTES`] |
//! | kept request headers | sender's headers | [`stored_text`] | [`MAX_HEADER_VALUE_BYTES`] each |
//! | dedupe key | sender's header or body | [`dedupe_key`]: refused or digested, never altered | [`MAX_DEDUPE_KEY_BYTES`] |
//! | event type | sender's header or body | [`event_type`]: refused, never altered | [`MAX_EVENT_TYPE_BYTES`] |
//!
//! Free text (excerpts, reasons, headers) is repaired: invalid UTF-8 and NUL become
//! U+FFFD and the tail past the bound is cut at a character boundary. Keys and event types
//! are identities (dedupe and subscription matching depend on them byte for byte), so they
//! are never repaired: a control character is refused, and a key longer than the bound is
//! replaced by a digest of all of it, so the same long key is still the same event.

use sha2::{Digest, Sha256};

/// Stored response excerpt (the README promises 4 KiB).
pub const MAX_EXCERPT_BYTES: usize = 4 * 1024;
/// A redirect's `Location` as quoted in the attempt's reason.
pub const MAX_LOCATION_BYTES: usize = 512;
/// An attempt's reason and a delivery's dead reason.
pub const MAX_REASON_BYTES: usize = 1024;
/// A stored content type.
pub const MAX_CONTENT_TYPE_BYTES: usize = 255;
/// Each request header value kept with an event.
pub const MAX_HEADER_VALUE_BYTES: usize = 4 * 1024;
/// Longest dedupe key stored as sent; longer keys are stored as their digest.
pub const MAX_DEDUPE_KEY_BYTES: usize = 1024;
/// Longest event type accepted (ingest and `POST /v1/events` alike).
pub const MAX_EVENT_TYPE_BYTES: usize = 200;
/// Prefix of a digested dedupe key: `key-sha256:<64 hex>`. Distinct from the body-hash
/// fallback's `sha256:` so a long key can never equal a body's hash.
pub const DIGESTED_KEY_PREFIX: &str = "key-sha256:";

/// What replaces NUL and invalid UTF-8.
const REPLACEMENT: char = char::REPLACEMENT_CHARACTER;

/// Bytes from outside as storable text of at most `max` bytes: invalid UTF-8 and NUL
/// become U+FFFD, and the text is cut at the last character boundary within `max`.
pub fn stored_text(bytes: &[u8], max: usize) -> String {
    // Only `max` bytes can survive, and lossy decoding never shrinks text, so decoding
    // more than that is wasted (a cut UTF-8 sequence at the end becomes one U+FFFD,
    // which `bounded` may then cut).
    let head = &bytes[..bytes.len().min(max)];
    bounded(&String::from_utf8_lossy(head), max)
}

/// Text as storable text of at most `max` bytes: NUL becomes U+FFFD and the text is cut
/// at the last character boundary within `max`.
pub fn bounded(text: &str, max: usize) -> String {
    // The common case (every header of every webhook): already fine, one copy.
    if text.len() <= max && !text.contains('\0') {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len().min(max));
    for c in text.chars() {
        let c = if c == '\0' { REPLACEMENT } else { c };
        if out.len() + c.len_utf8() > max {
            break;
        }
        out.push(c);
    }
    out
}

/// Whether a JSON text holds a NUL character in a string (the escape `\u0000`; raw NUL
/// bytes are not JSON). An escaped backslash before `u0000` (`\\u0000`, the six
/// characters `\u0000`) is not one.
pub fn json_has_nul(json: &[u8]) -> bool {
    let mut backslashes = 0usize;
    for (i, &b) in json.iter().enumerate() {
        if b == b'\\' {
            backslashes += 1;
            continue;
        }
        if b == b'u' && backslashes % 2 == 1 && json[i + 1..].starts_with(b"0000") {
            return true;
        }
        backslashes = 0;
    }
    false
}

/// Why a key or an event type cannot be used as sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unusable {
    /// Empty.
    #[error("is empty")]
    Empty,
    /// Holds a control character (NUL, newline, DEL, C1 ...).
    #[error("contains a control character (U+{0:04X} at byte {1})")]
    Control(u32, usize),
    /// Longer than its bound (event types only; long keys are digested).
    #[error("is {0} bytes long; at most {1} are accepted")]
    TooLong(usize, usize),
}

/// The first control character in `text`, if any.
fn control(text: &str) -> Result<(), Unusable> {
    match text.char_indices().find(|(_, c)| c.is_control()) {
        Some((at, c)) => Err(Unusable::Control(u32::from(c), at)),
        None => Ok(()),
    }
}

/// Beginnings of the keys the gateway makes itself: a body's hash
/// (`crate::verify::BODY_HASH_PREFIX`, the key of a webhook that carries none) and a long
/// key's digest ([`DIGESTED_KEY_PREFIX`]).
const RESERVED_KEY_PREFIXES: [&str; 2] = ["sha256:", DIGESTED_KEY_PREFIX];

/// A sender's dedupe key, ready to store: refused when empty or holding a control
/// character; longer than [`MAX_DEDUPE_KEY_BYTES`], or beginning as a key the gateway
/// makes itself ([`RESERVED_KEY_PREFIXES`]), replaced by
/// `key-sha256:<hex of SHA-256 of the key>` (deterministic: the same key always maps to
/// the same stored key, so duplicates are still recognised; and a sender's key never
/// equals a key the gateway made for another webhook, which answered that one a
/// duplicate of it). The gateway's own body-hash key does not come through here.
pub fn dedupe_key(key: String) -> Result<String, Unusable> {
    if key.is_empty() {
        return Err(Unusable::Empty);
    }
    control(&key)?;
    if key.len() <= MAX_DEDUPE_KEY_BYTES && !RESERVED_KEY_PREFIXES.iter().any(|p| key.starts_with(p)) {
        return Ok(key);
    }
    Ok(format!("{DIGESTED_KEY_PREFIX}{}", hex::encode(Sha256::digest(key.as_bytes()))))
}

/// A sender's event type, ready to store: refused when empty, longer than
/// [`MAX_EVENT_TYPE_BYTES`] or holding a control character (subscriptions match it byte
/// for byte, so it is never altered).
pub fn event_type(event_type: String) -> Result<String, Unusable> {
    if event_type.is_empty() {
        return Err(Unusable::Empty);
    }
    if event_type.len() > MAX_EVENT_TYPE_BYTES {
        return Err(Unusable::TooLong(event_type.len(), MAX_EVENT_TYPE_BYTES));
    }
    control(&event_type)?;
    Ok(event_type)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nul_and_invalid_utf8_are_replaced() {
        assert_eq!(stored_text(b"ok\0done", 100), "ok\u{FFFD}done");
        assert_eq!(stored_text(b"a\xFFb", 100), "a\u{FFFD}b");
        assert_eq!(bounded("x\0", 100), "x\u{FFFD}");
    }

    #[test]
    fn text_is_cut_at_a_character_boundary() {
        // "é" is two bytes: a bound of 3 keeps "aé", a bound of 2 keeps "a".
        assert_eq!(bounded("aéb", 3), "aé");
        assert_eq!(bounded("aéb", 2), "a");
        assert_eq!(stored_text("aéb".as_bytes(), 2), "a");
        assert_eq!(stored_text(&[b'x'; 10_000], MAX_EXCERPT_BYTES).len(), MAX_EXCERPT_BYTES);
        // Every byte invalid: each becomes a 3-byte U+FFFD, still within the bound.
        let replaced = stored_text(&[0xFF; 10_000], 100);
        assert!(replaced.len() <= 100 && replaced.len() >= 97, "{}", replaced.len());
    }

    #[test]
    fn long_keys_are_digested_deterministically_and_short_ones_kept() {
        let short = "x".repeat(MAX_DEDUPE_KEY_BYTES);
        assert_eq!(dedupe_key(short.clone()), Ok(short));
        let long = "y".repeat(MAX_DEDUPE_KEY_BYTES + 1);
        let digested = dedupe_key(long.clone()).expect("long key accepted");
        assert!(digested.starts_with(DIGESTED_KEY_PREFIX));
        assert_eq!(digested.len(), DIGESTED_KEY_PREFIX.len() + 64);
        assert_eq!(dedupe_key(long.clone()), Ok(digested.clone()), "same key, same digest");
        let mut other = long;
        other.push('z');
        assert_ne!(dedupe_key(other).expect("accepted"), digested, "different keys, different digests");
        // A key spelled as one the gateway makes is digested: it cannot meet that one.
        for made in [format!("sha256:{}", "ab".repeat(32)), digested.clone()] {
            let stored = dedupe_key(made.clone()).expect("accepted");
            assert!(stored != made && stored.starts_with(DIGESTED_KEY_PREFIX), "{made} stored as {stored}");
        }
    }

    #[test]
    fn control_characters_and_empty_values_are_refused() {
        assert_eq!(dedupe_key("a\0b".into()), Err(Unusable::Control(0, 1)));
        assert_eq!(dedupe_key("a\nb".into()), Err(Unusable::Control(10, 1)));
        assert_eq!(dedupe_key("\u{7F}".into()), Err(Unusable::Control(0x7F, 0)));
        assert_eq!(dedupe_key("é\u{85}".into()), Err(Unusable::Control(0x85, 2)));
        assert_eq!(dedupe_key(String::new()), Err(Unusable::Empty));
        // A long key with a control character is refused, not digested.
        assert!(matches!(dedupe_key(format!("{}\0", "k".repeat(5000))), Err(Unusable::Control(0, 5000))));
        assert_eq!(event_type("order\0.created".into()), Err(Unusable::Control(0, 5)));
        assert_eq!(event_type(String::new()), Err(Unusable::Empty));
        assert_eq!(
            event_type("t".repeat(MAX_EVENT_TYPE_BYTES + 1)),
            Err(Unusable::TooLong(MAX_EVENT_TYPE_BYTES + 1, MAX_EVENT_TYPE_BYTES))
        );
        assert_eq!(event_type("invoice.paid".into()), Ok("invoice.paid".into()));
        assert_eq!(dedupe_key("évt_1 ünïcode".into()), Ok("évt_1 ünïcode".into()));
    }

    #[test]
    fn nul_escapes_in_json_are_found_and_escaped_backslashes_are_not() {
        assert!(json_has_nul(br#"{"a": "x\u0000y"}"#));
        assert!(json_has_nul(br#"{"a\u0000": 1}"#));
        assert!(json_has_nul(br#"["\\\u0000"]"#), "an escaped backslash, then a NUL");
        assert!(!json_has_nul(br#"{"a": "x\\u0000y"}"#), "the text \\u0000, no NUL");
        assert!(!json_has_nul(br#"{"a": "\u00001"}"#[..9].as_ref()), "cut short");
        assert!(!json_has_nul(br#"{"a": "\u0001"}"#));
        for text in ["x\0y", "\0", "plain", "\\u0000", "back\\slash\0"] {
            let json = serde_json::to_vec(&serde_json::json!({ "k": text })).unwrap();
            assert_eq!(json_has_nul(&json), text.contains('\0'), "{text:?}");
        }
    }

    proptest! {
        #[test]
        fn json_has_nul_agrees_with_the_parsed_strings(text in any::<String>()) {
            let json = serde_json::to_vec(&serde_json::json!({ "k": [text.clone()] })).unwrap();
            prop_assert_eq!(json_has_nul(&json), text.contains('\0'));
        }
    }

    proptest! {
        #[test]
        fn stored_text_is_always_storable_and_bounded(bytes in proptest::collection::vec(any::<u8>(), 0..2000),
                                                      max in 0usize..1500) {
            let text = stored_text(&bytes, max);
            prop_assert!(text.len() <= max);
            prop_assert!(!text.contains('\0'));
            // A prefix of the lossy decoding: nothing invented, nothing reordered.
            let full = String::from_utf8_lossy(&bytes).replace('\0', "\u{FFFD}");
            let cut = text.trim_end_matches('\u{FFFD}');
            prop_assert!(full.starts_with(cut));
        }

        #[test]
        fn accepted_keys_are_storable_and_bounded(key in any::<String>()) {
            if let Ok(stored) = dedupe_key(key.clone()) {
                prop_assert!(!stored.is_empty() && stored.len() <= MAX_DEDUPE_KEY_BYTES);
                prop_assert!(!stored.chars().any(char::is_control));
                if key.len() <= MAX_DEDUPE_KEY_BYTES { prop_assert_eq!(stored, key); }
            } else {
                prop_assert!(key.is_empty() || key.chars().any(char::is_control));
            }
        }
    }
}
