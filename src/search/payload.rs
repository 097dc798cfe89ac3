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
//!
//! The same walk takes verification's JSON pointers on its way ([`probed_terms`]): ingest
//! reads the event type (and the dedupe and ordering keys, where a source names them by
//! pointer) out of the body it hashes, instead of a pass over the body for each.

use std::fmt::{self, Write as _};

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::verify::Probe;

use super::SEPARATOR;

/// The terms of one document while it is parsed, and the pointers looked for on the way.
struct Terms<'w, 'p, 't> {
    /// The path so far: the kind byte, then `SEPARATOR` and a token per level.
    path: Vec<u8>,
    /// Scalars still to be indexed.
    budget: usize,
    out: Vec<i64>,
    /// Reused for writing a number.
    number: String,
    /// Reused for the path and a scalar, hashed in one call.
    term: Vec<u8>,
    /// The pointers whose values the walk takes (at most [`MAX_PROBES`]).
    probes: &'w mut [Probe<'p, 't>],
}

/// A scalar longer than this is hashed where it lies (streamed after its path) rather
/// than copied after the path and hashed in one call, which is cheaper for short ones.
pub(super) const COPIED_SCALAR_BYTES: usize = 256;

/// The path buffer's first size: the paths of most webhooks' documents fit.
const PATH_CAPACITY: usize = 128;

/// Most pointers one walk looks for (a bit each in a level's mask); a source names three
/// at most, a kind four.
const MAX_PROBES: usize = 32;

/// The hashes of the first `budget` scalars of the JSON document `payload`, each under
/// its path after `prefix`; `None` when `payload` is not one JSON document.
pub(super) fn document_terms(payload: &[u8], prefix: &[u8], budget: usize) -> Option<Vec<i64>> {
    // JSON text is UTF-8: checked once for the whole body, rather than string by string
    // as a parser of bytes does.
    let text = std::str::from_utf8(payload).ok()?;
    probed_terms(text, prefix, budget, &mut [])
}

/// [`document_terms`] of `text`, and the value each probe's pointer names in it, in the
/// same walk. `None` when `text` is not one JSON document, or when a probe names an
/// object or an array or the document itself (their values are the pointer's own pass
/// to find, exactly; webhooks' keys and types are scalars): the probes' values are then
/// not to be read.
pub(super) fn probed_terms<'t>(
    text: &'t str,
    prefix: &[u8],
    budget: usize,
    probes: &mut [Probe<'_, 't>],
) -> Option<Vec<i64>> {
    if probes.len() > MAX_PROBES || probes.iter().any(|p| p.depth() == 0) {
        return None;
    }
    // Sized for a usual document at once: grown from empty, the path and the term buffer
    // were reallocated four or five times a webhook.
    let mut path = Vec::with_capacity(PATH_CAPACITY);
    path.extend_from_slice(prefix);
    let mask = if probes.is_empty() { 0 } else { u32::MAX >> (32 - probes.len()) };
    let mut terms = Terms {
        path,
        budget,
        out: Vec::with_capacity(budget.min(128)),
        number: String::new(),
        term: Vec::with_capacity(PATH_CAPACITY + COPIED_SCALAR_BYTES),
        probes,
    };
    let mut de = serde_json::Deserializer::from_str(text);
    Level { terms: &mut terms, mask, depth: 0 }.deserialize(&mut de).ok()?;
    de.end().ok()?;
    Some(terms.out)
}

/// The probes of `mask` for which `on_path` holds.
fn narrowed(probes: &[Probe], mask: u32, on_path: impl Fn(&Probe) -> bool) -> u32 {
    let mut narrowed = 0;
    for (i, probe) in probes.iter().enumerate() {
        if mask & (1 << i) != 0 && on_path(probe) {
            narrowed |= 1 << i;
        }
    }
    narrowed
}

impl Terms<'_, '_, '_> {
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

/// One value of the document at the current path, `depth` levels down: a scalar is
/// hashed, an object's or array's children are levels below it. `mask` holds the probes
/// whose paths lead through it.
struct Level<'s, 'w, 'p, 't> {
    terms: &'s mut Terms<'w, 'p, 't>,
    mask: u32,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for Level<'_, '_, '_, 'de> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

/// A member or element `depth` levels down on the path of `mask`'s probes (not empty:
/// the others are [`Level`]s, or skipped past the budget).
struct Child<'s, 'w, 'p, 't>(Level<'s, 'w, 'p, 't>);

impl<'de> DeserializeSeed<'de> for Child<'_, '_, '_, 'de> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        let Level { terms, mask, depth } = self.0;
        // A later member of the same name replaces what an earlier one held.
        for i in 0..terms.probes.len() {
            if mask & (1 << i) != 0 {
                terms.probes[i].found(None);
            }
        }
        let ends = narrowed(terms.probes, mask, |p| p.depth() == depth);
        if ends == 0 {
            return Level { terms, mask, depth }.deserialize(deserializer);
        }
        let raw = <&'de RawValue>::deserialize(deserializer)?;
        if raw.get().trim_start().starts_with(['{', '[']) {
            return Err(de::Error::custom("a pointer names an object or an array"));
        }
        for i in 0..terms.probes.len() {
            if ends & (1 << i) != 0 {
                terms.probes[i].found(Some(raw));
            }
        }
        // A scalar: hashed as the walk would have hashed it in place (no probe goes
        // deeper than a scalar).
        Level { terms, mask: 0, depth }
            .deserialize(&mut serde_json::Deserializer::from_str(raw.get()))
            .map_err(de::Error::custom)
    }
}

impl<'de> Visitor<'de> for Level<'_, '_, '_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.terms.scalar(if v { "true" } else { "false" });
        Ok(())
    }

    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.terms.number(v.into());
        Ok(())
    }

    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.terms.number(v.into());
        Ok(())
    }

    fn visit_f64<E>(self, v: f64) -> Result<(), E> {
        // JSON has no NaN or infinity; `Value` makes such a number null.
        match serde_json::Number::from_f64(v) {
            Some(n) => self.terms.number(n),
            None => self.terms.scalar("null"),
        }
        Ok(())
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.terms.scalar(v);
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.terms.scalar("null");
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Level { terms, mask, depth } = self;
        let at = terms.path.len();
        let mut index = 0usize;
        loop {
            if terms.budget == 0 && mask == 0 {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                return Ok(());
            }
            terms.path.push(SEPARATOR);
            // Writing into a Vec cannot fail.
            let _ = std::io::Write::write_fmt(&mut terms.path, format_args!("{index}"));
            let child = if mask == 0 { 0 } else { narrowed(terms.probes, mask, |p| p.names_element(depth, index)) };
            let more = if child != 0 {
                seq.next_element_seed(Child(Level { terms: &mut *terms, mask: child, depth: depth + 1 }))?
            } else if terms.budget == 0 {
                seq.next_element::<IgnoredAny>()?.map(|_| ())
            } else {
                seq.next_element_seed(Level { terms: &mut *terms, mask: 0, depth: depth + 1 })?
            };
            terms.path.truncate(at);
            if more.is_none() {
                return Ok(());
            }
            index += 1;
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let Level { terms, mask, depth } = self;
        let at = terms.path.len();
        loop {
            if terms.budget == 0 && mask == 0 {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                return Ok(());
            }
            terms.path.push(SEPARATOR);
            if map.next_key_seed(Key(&mut terms.path))?.is_none() {
                terms.path.truncate(at);
                return Ok(());
            }
            let key = &terms.path[at + 1..];
            let child = if mask == 0 { 0 } else { narrowed(terms.probes, mask, |p| p.names_member(depth, key)) };
            if child != 0 {
                map.next_value_seed(Child(Level { terms: &mut *terms, mask: child, depth: depth + 1 }))?;
            } else if terms.budget == 0 {
                map.next_value::<IgnoredAny>()?;
            } else {
                map.next_value_seed(Level { terms: &mut *terms, mask: 0, depth: depth + 1 })?;
            }
            terms.path.truncate(at);
        }
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
