//! RFC 6901 JSON pointers evaluated over the raw body, without building a document tree.
//!
//! Ingest reads one to three values (dedupe key, event type, ordering key) out of bodies
//! it otherwise stores as bytes. Parsing the whole body into a `serde_json::Value` to do
//! that was the largest single cost of ingest in the CPU profile (bench/PROFILE.md): a
//! tree of allocations per request, thrown away at once. Here the body is checked once
//! as JSON (serde_json's skipping parser, no allocation), then each pointer walks down
//! through borrowed [`RawValue`] slices, skipping every sibling it does not follow.
//!
//! The answers are those of `serde_json::Value::pointer` on the parsed body (a property
//! test holds them to it): the last of repeated object keys wins, array indexes are
//! decimal without a sign or leading zero, `~1` is `/` and `~0` is `~`.

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// serde_json's recursion limit for a `Value`.
const MAX_DEPTH: usize = 128;

/// The body as one JSON value, or `None` when it is not JSON.
pub(crate) fn root(body: &[u8]) -> Option<&RawValue> {
    serde_json::from_slice(body).ok()
}

/// The value `pointer` names under `root`, if any.
pub(crate) fn lookup<'a>(root: &'a RawValue, pointer: &str) -> Option<&'a RawValue> {
    if pointer.is_empty() {
        return Some(root);
    }
    let rest = pointer.strip_prefix('/')?;
    // Deeper than serde_json's recursion limit, a `Value` could not hold the document
    // either; and each step re-reads its subtree, so the depth bounds the work.
    if rest.split('/').count() > MAX_DEPTH {
        return None;
    }
    let mut at = root;
    for token in rest.split('/') {
        let token = if token.contains('~') {
            Cow::Owned(token.replace("~1", "/").replace("~0", "~"))
        } else {
            Cow::Borrowed(token)
        };
        at = child(at, &token)?;
    }
    Some(at)
}

/// The member or element of `parent` that one unescaped token names.
fn child<'a>(parent: &'a RawValue, token: &str) -> Option<&'a RawValue> {
    let text = parent.get();
    let mut de = serde_json::Deserializer::from_str(text);
    match text.as_bytes().first()? {
        b'{' => de.deserialize_map(Member { name: token }).ok().flatten(),
        b'[' => de.deserialize_seq(Element { index: array_index(token)? }).ok().flatten(),
        _ => None,
    }
}

/// An array index as RFC 6901 spells it: `0`, or digits without a leading zero.
fn array_index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

/// Finds the (last) member called `name`, skipping the others' values unparsed.
struct Member<'t> {
    name: &'t str,
}

impl<'de> Visitor<'de> for Member<'_> {
    type Value = Option<&'de RawValue>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            if key == self.name {
                found = Some(map.next_value::<&'de RawValue>()?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
}

/// Finds element `index`, skipping the others unparsed.
struct Element {
    index: usize,
}

impl<'de> Visitor<'de> for Element {
    type Value = Option<&'de RawValue>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON array")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        let mut i = 0usize;
        loop {
            if i == self.index {
                match seq.next_element::<&'de RawValue>()? {
                    Some(value) => found = Some(value),
                    None => break,
                }
            } else if seq.next_element::<IgnoredAny>()?.is_none() {
                break;
            }
            i += 1;
        }
        Ok(found)
    }
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
        let root = root(body.as_bytes())?;
        lookup(root, pointer).map(|raw| serde_json::from_str(raw.get()).expect("a raw value is JSON"))
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
        for body in ["", "  ", "{", "{\"a\":1} x", "{\"a\":\"\u{0}\"}", "nul"] {
            assert!(root(body.as_bytes()).is_none(), "{body:?}");
        }
        assert!(root(b"{\"a\":\"\xff\"}").is_none(), "invalid UTF-8 in a string");
    }
}
