//! RFC 6901 JSON pointers evaluated over the raw body, without building a document tree.
//!
//! Ingest reads one to three values (dedupe key, event type, ordering key) out of bodies
//! it otherwise stores as bytes. Parsing the whole body into a `serde_json::Value` to do
//! that was the largest single cost of ingest in the CPU profile (bench/PROFILE.md): a
//! tree of allocations per request, thrown away at once. Here each pointer is one pass of
//! serde_json's skipping parser over the body: it follows the pointer's path, skips every
//! sibling unparsed, and checks the whole body is JSON on the way (no allocation). A
//! check of the whole body first, then a walk, read the body twice per pointer.
//!
//! The answers are those of `serde_json::Value::pointer` on the parsed body (a property
//! test holds them to it): the last of repeated object keys wins, array indexes are
//! decimal without a sign or leading zero, `~1` is `/` and `~0` is `~`.

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// serde_json's recursion limit for a `Value`.
const MAX_DEPTH: usize = 128;

/// The body is not JSON: not UTF-8, a syntax error, or nested past serde_json's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NotJson;

/// The body as text when it is UTF-8 (JSON text always is).
pub(crate) fn text(body: &[u8]) -> Result<&str, NotJson> {
    std::str::from_utf8(body).map_err(|_| NotJson)
}

/// The value `pointer` names in `text`, if any, found in one pass that also checks that
/// the whole text is JSON (the members and elements off the path are skipped unparsed).
/// A pointer that cannot name anything (no leading `/`, deeper than serde_json's
/// recursion limit) finds nothing without reading the text.
pub(crate) fn find<'a>(text: &'a str, pointer: &str) -> Result<Option<&'a RawValue>, NotJson> {
    let Some(path) = tokens(pointer) else { return Ok(None) };
    let mut de = serde_json::Deserializer::from_str(text);
    let found = Follow { path: &path }.deserialize(&mut de).map_err(|_| NotJson)?;
    de.end().map_err(|_| NotJson)?;
    Ok(found)
}

/// Whether [`find`] reads the text for `pointer` (one that cannot name anything is
/// answered without it).
#[cfg(test)]
pub(crate) fn reads(pointer: &str) -> bool {
    tokens(pointer).is_some()
}

/// A pointer's reference tokens, unescaped; `None` when it cannot name anything (no
/// leading `/`, or deeper than serde_json's recursion limit).
fn tokens(pointer: &str) -> Option<Vec<Cow<'_, str>>> {
    if pointer.is_empty() {
        return Some(Vec::new());
    }
    let rest = pointer.strip_prefix('/')?;
    // Deeper than serde_json's recursion limit, a `Value` could not hold the document
    // either.
    if rest.split('/').count() > MAX_DEPTH {
        return None;
    }
    Some(
        rest.split('/')
            .map(|token| {
                if token.contains('~') {
                    Cow::Owned(token.replace("~1", "/").replace("~0", "~"))
                } else {
                    Cow::Borrowed(token)
                }
            })
            .collect(),
    )
}

/// A pointer whose value a walk of the whole body looks for on its way ([`BodyScan`]):
/// the value it names there is what [`find`] would find.
pub struct Probe<'p, 't> {
    /// The pointer as configured.
    pointer: &'p str,
    tokens: Vec<Cow<'p, str>>,
    found: Option<&'t RawValue>,
}

impl<'p, 't> Probe<'p, 't> {
    /// A probe for `pointer`; `None` when it cannot name anything (see [`find`]).
    pub(crate) fn new(pointer: &'p str) -> Option<Probe<'p, 't>> {
        Some(Probe { pointer, tokens: tokens(pointer)?, found: None })
    }

    /// The pointer as configured.
    pub(crate) fn pointer(&self) -> &str {
        self.pointer
    }

    /// How many levels down the value it names lies (0: the document itself).
    pub fn depth(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the member called `key`, at `depth` levels down, is on its path (the
    /// levels above it having been).
    pub fn names_member(&self, depth: usize, key: &[u8]) -> bool {
        self.tokens.get(depth).is_some_and(|token| token.as_bytes() == key)
    }

    /// Whether element `index` of an array at `depth` levels down is on its path.
    pub fn names_element(&self, depth: usize, index: usize) -> bool {
        self.tokens.get(depth).is_some_and(|token| array_index(token) == Some(index))
    }

    /// What the walk found at the end of its path so far: the last value it met there,
    /// as a document whose repeated keys keep their last value would hold (`None` clears
    /// it, when a later member of the same name replaces the one it was found under).
    pub fn found(&mut self, value: Option<&'t RawValue>) {
        self.found = value;
    }

    /// The value found.
    pub(crate) fn value(&self) -> Option<&'t RawValue> {
        self.found
    }
}

/// A walk of the whole body that something else needs anyway (the search index's terms),
/// taking the verifier's pointers on its way, so that the body is read once.
pub trait BodyScan {
    /// Whether this scan walks `body` when `probes` pointers are looked for, told without
    /// reading it: a body no walk is for is not even checked for UTF-8.
    fn walks(&self, body: &[u8], probes: usize) -> bool;

    /// Walk `text` (a body [`BodyScan::walks`] said it walks), filling in each probe's
    /// value. `false` when it cannot answer exactly, or finds the text is not JSON: the
    /// pointers are then looked up one by one, as without a scan.
    fn scan<'t>(&mut self, text: &'t str, probes: &mut [Probe<'_, 't>]) -> bool;
}

/// Reads one value, keeping the part of it that `path` names (the whole value when the
/// path is empty) and skipping the rest.
struct Follow<'p> {
    path: &'p [Cow<'p, str>],
}

impl<'de> DeserializeSeed<'de> for Follow<'_> {
    type Value = Option<&'de RawValue>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        match self.path.split_first() {
            None => <&'de RawValue>::deserialize(de).map(Some),
            Some((token, rest)) => de.deserialize_any(Step { token, rest }),
        }
    }
}

/// One step of a path: the member or element `token` names, followed by `rest`.
struct Step<'p> {
    token: &'p str,
    rest: &'p [Cow<'p, str>],
}

impl<'de> Visitor<'de> for Step<'_> {
    type Value = Option<&'de RawValue>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    /// The (last) member the token names, as in a parsed object where a repeated key's
    /// last value wins.
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            if key == self.token {
                found = map.next_value_seed(Follow { path: self.rest })?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let index = array_index(self.token);
        let mut found = None;
        let mut i = 0usize;
        loop {
            if Some(i) == index {
                match seq.next_element_seed(Follow { path: self.rest })? {
                    Some(value) => found = value,
                    None => break,
                }
            } else if seq.next_element::<IgnoredAny>()?.is_none() {
                break;
            }
            i += 1;
        }
        Ok(found)
    }

    // A scalar has no members: the path goes no further.
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// An array index as RFC 6901 spells it: `0`, or digits without a leading zero.
fn array_index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

/// An object key: borrowed from the body unless it holds escapes.
struct Key<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        de.deserialize_str(KeyVisitor)
    }
}

struct KeyVisitor;

impl<'de> Visitor<'de> for KeyVisitor {
    type Value = Key<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_borrowed_str<E>(self, key: &'de str) -> Result<Self::Value, E> {
        Ok(Key(Cow::Borrowed(key)))
    }

    fn visit_str<E>(self, key: &str) -> Result<Self::Value, E> {
        Ok(Key(Cow::Owned(key.to_owned())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn at(body: &str, pointer: &str) -> Option<Value> {
        let raw = find(text(body.as_bytes()).ok()?, pointer).ok()??;
        Some(serde_json::from_str(raw.get()).expect("a raw value is JSON"))
    }

    #[test]
    fn finds_what_value_pointer_finds() {
        let body = r#" {"a": {"b/c": [10, {"d~e": "x"}], "": 1}, "a ": 2, "dup": 1, "dup": 2, "k\u0041": 3} "#;
        let value: Value = serde_json::from_str(body).expect("json");
        for pointer in [
            "",
            "/a",
            "/a/b~1c",
            "/a/b~1c/0",
            "/a/b~1c/1/d~0e",
            "/a/",
            "/a ",
            "/dup",
            "/kA",
            "/a/b~1c/01",
            "/a/b~1c/+1",
            "/a/b~1c/2",
            "/missing",
            "a",
            "/a/b~1c/1/d~0e/x",
        ] {
            assert_eq!(at(body, pointer), value.pointer(pointer).cloned(), "{pointer}");
        }
        assert_eq!(at(body, "/dup"), Some(json!(2)), "the last repeated key wins, as in serde_json");
    }

    #[test]
    fn not_json_has_no_values() {
        for body in ["", "  ", "{", "{\"a\":1} x", "{\"a\":\"\u{0}\"}", "nul", "{\"a\":1,\"b\":[1,}"] {
            for pointer in ["", "/a", "/b"] {
                assert!(matches!(find(body, pointer), Err(NotJson)), "{body:?} {pointer:?}");
            }
        }
        assert_eq!(text(b"{\"a\":\"\xff\"}"), Err(NotJson), "invalid UTF-8 in a string");
    }
}
