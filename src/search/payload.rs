//! A JSON payload's terms, hashed while the document is parsed.
//!
//! Parsing into a `serde_json::Value` first allocated every key and string of the body
//! (its objects are B-tree maps) only to hash them and drop them, and glibc's allocator
//! was the largest part of the gateway's CPU at high load (bench/PROFILE.md, "The
//! gateway at high load"). Here each scalar is hashed as the parser reaches it, its path
//! kept in one buffer; a key or string without escapes is read where it lies. Only a
//! number is written out, into one reused buffer, exactly as `Value` writes it, so an
//! event's terms are what [`super::Condition::alternatives`] looks for.
//!
//! Scalars count in document order against the budget; past it the rest of the document
//! is still parsed to its end, so a body that is not one JSON document gives no payload
//! terms at all.

use std::fmt::{self, Write as _};

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use super::SEPARATOR;

/// The terms of one document while it is parsed.
struct Terms {
    /// The path so far: the kind byte, then `SEPARATOR` and a token per level.
    path: Vec<u8>,
    /// Scalars still to be indexed.
    budget: usize,
    out: Vec<i64>,
    /// Reused for writing a number.
    number: String,
    /// Reused for the path and a scalar, hashed in one call.
    term: Vec<u8>,
}

/// A scalar longer than this is hashed where it lies (streamed after its path) rather
/// than copied after the path and hashed in one call, which is cheaper for short ones.
pub(super) const COPIED_SCALAR_BYTES: usize = 256;

/// The path buffer's first size: the paths of most webhooks' documents fit.
const PATH_CAPACITY: usize = 128;

/// The hashes of the first `budget` scalars of the JSON document `payload`, each under
/// its path after `prefix`; `None` when `payload` is not one JSON document.
pub(super) fn document_terms(payload: &[u8], prefix: &[u8], budget: usize) -> Option<Vec<i64>> {
    // Sized for a usual document at once: grown from empty, the path and the term buffer
    // were reallocated four or five times a webhook.
    let mut path = Vec::with_capacity(PATH_CAPACITY);
    path.extend_from_slice(prefix);
    let mut terms = Terms {
        path,
        budget,
        out: Vec::with_capacity(budget.min(128)),
        number: String::new(),
        term: Vec::with_capacity(PATH_CAPACITY + COPIED_SCALAR_BYTES),
    };
    // JSON text is UTF-8: checked once for the whole body, rather than string by string
    // as a parser of bytes does.
    let text = std::str::from_utf8(payload).ok()?;
    let mut de = serde_json::Deserializer::from_str(text);
    Level(&mut terms).deserialize(&mut de).ok()?;
    de.end().ok()?;
    Some(terms.out)
}

impl Terms {
    /// Hash the scalar `text` under the path.
    fn scalar(&mut self, text: &str) {
        if self.budget == 0 {
            return;
        }
        self.budget -= 1;
        // Both ways give the same hash: XXH3 streamed is XXH3 of the whole input.
        let hash = if text.len() > COPIED_SCALAR_BYTES {
            let mut hasher = Xxh3::new();
            hasher.update(&self.path);
            hasher.update(&[SEPARATOR, SEPARATOR]);
            hasher.update(text.as_bytes());
            hasher.digest()
        } else {
            self.term.clear();
            self.term.extend_from_slice(&self.path);
            self.term.extend_from_slice(&[SEPARATOR, SEPARATOR]);
            self.term.extend_from_slice(text.as_bytes());
            xxh3_64(&self.term)
        };
        self.out.push(i64::from_ne_bytes(hash.to_ne_bytes()));
    }

    /// Hash a number, written as `serde_json` writes it.
    fn number(&mut self, n: serde_json::Number) {
        let mut written = std::mem::take(&mut self.number);
        written.clear();
        // Writing into a String cannot fail.
        let _ = write!(written, "{n}");
        self.scalar(&written);
        self.number = written;
    }
}

/// One value of the document at the current path: a scalar is hashed, an object's or
/// array's children are levels below it.
struct Level<'t>(&'t mut Terms);

impl<'de> DeserializeSeed<'de> for Level<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Level<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.0.scalar(if v { "true" } else { "false" });
        Ok(())
    }

    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.0.number(v.into());
        Ok(())
    }

    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.0.number(v.into());
        Ok(())
    }

    fn visit_f64<E>(self, v: f64) -> Result<(), E> {
        // JSON has no NaN or infinity; `Value` makes such a number null.
        match serde_json::Number::from_f64(v) {
            Some(n) => self.0.number(n),
            None => self.0.scalar("null"),
        }
        Ok(())
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.0.scalar(v);
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.0.scalar("null");
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let terms = self.0;
        let at = terms.path.len();
        let mut index = 0usize;
        while terms.budget > 0 {
            terms.path.push(SEPARATOR);
            // Writing into a Vec cannot fail.
            let _ = std::io::Write::write_fmt(&mut terms.path, format_args!("{index}"));
            let more = seq.next_element_seed(Level(terms))?;
            terms.path.truncate(at);
            if more.is_none() {
                return Ok(());
            }
            index += 1;
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let terms = self.0;
        let at = terms.path.len();
        while terms.budget > 0 {
            terms.path.push(SEPARATOR);
            let more = map.next_key_seed(Key(&mut terms.path))?;
            if more.is_none() {
                terms.path.truncate(at);
                return Ok(());
            }
            map.next_value_seed(Level(terms))?;
            terms.path.truncate(at);
        }
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(())
    }
}

/// An object's key, appended to the path.
struct Key<'p>(&'p mut Vec<u8>);

impl<'de> DeserializeSeed<'de> for Key<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.0.extend_from_slice(v.as_bytes());
        Ok(())
    }
}
