//! The body read once: a scan's walk (the search index's, `search::PayloadScan`) answers
//! every pointer it was given as a pass over the body for that pointer alone answers it,
//! its terms are the event's terms as computed on their own, and each kind declares the
//! pointers it reads, so that an accepted webhook's body is walked once.

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{Value, json};

use super::extract::LazyJson;
use super::tests_props::{body, locator, path_into, sign, sign_params};
use super::{Kind, Locator, checked, scanned, verify, verify_scanning};
use crate::props::{config, json_value};
use crate::search::{Indexing, PayloadScan};

/// What `pointers` find in `body` read by a scan's walk, and the passes made besides it.
fn by_scan(body: &[u8], pointers: &[&str]) -> (Vec<Option<Value>>, usize, Vec<i64>) {
    by_scan_indexing(body, pointers, Indexing::Content)
}

/// [`by_scan`], indexing as `indexing` says (the terms compared with its own).
fn by_scan_indexing(body: &[u8], pointers: &[&str], indexing: Indexing) -> (Vec<Option<Value>>, usize, Vec<i64>) {
    let mut scan = PayloadScan::new(indexing);
    let (found, passes) = {
        let mut json = LazyJson::scanning(body, pointers.iter().copied(), &mut scan);
        let found = pointers.iter().map(|p| json.value_at(p)).collect();
        json.finish();
        (found, json.passes())
    };
    let terms = scan.terms("key", &json!({"x-h": "v"}), body);
    (found, passes, terms)
}

/// What `pointers` find in `body`, a pass for each.
fn by_passes(body: &[u8], pointers: &[&str]) -> Vec<Option<Value>> {
    let mut json = LazyJson::new(body);
    pointers.iter().map(|p| json.value_at(p)).collect()
}

#[test]
fn repeated_keys_escapes_and_near_misses_are_found_as_a_pass_finds_them() {
    let body = r#" {"a": {"b/c": [10, {"d~e": "x"}], "": 1}, "a ": 2, "dup": 1, "dup": 2,
        "nest": {"k": 1}, "nest": {"j": 2}, "k\u0041": 3, "arr": [0, 1, [2]], "s": "text", "big": 18446744073709551615,
        "f": 1.50, "n": null} "#;
    let pointers = [
        "/a/b~1c/0",
        "/a/b~1c/1/d~0e",
        "/a/",
        "/a ",
        "/dup",
        "/dup/in",
        "/a ",
        "/nest/k",
        "/nest/j",
        "/kA",
        "/arr/1",
        "/arr/01",
        "/arr/+1",
        "/arr/3",
        "/arr/2/0",
        "/s/0",
        "/missing",
        "/big",
        "/f",
        "/n",
        "a",
    ];
    let (found, passes, terms) = by_scan(body.as_bytes(), &pointers);
    assert_eq!(found, by_passes(body.as_bytes(), &pointers));
    assert_eq!(found[4], Some(json!(2)), "the last repeated key wins");
    assert_eq!(found[7], None, "a later member of the same name replaces the whole value");
    assert_eq!(passes, 0, "every pointer names a scalar or nothing: the walk answered them all");
    assert_eq!(terms, crate::search::terms("key", &json!({"x-h": "v"}), body.as_bytes()));
}

#[test]
fn a_pointer_to_an_object_an_array_or_the_document_is_found_by_its_own_pass() {
    let body = br#"{"a": {"b": 1}, "l": [1, 2], "t": "x", "dup": {"in": 3}, "dup": 2}"#;
    // `/dup` ends with a scalar, but a member it met on the way held an object.
    for pointer in ["/a", "/l", "", "/dup"] {
        let pointers = ["/t", pointer];
        let (found, passes, terms) = by_scan(body, &pointers);
        assert_eq!(found, by_passes(body, &pointers), "{pointer:?}");
        assert_eq!(passes, 2, "the walk declined: a pass each ({pointer:?})");
        assert_eq!(terms, crate::search::terms("key", &json!({"x-h": "v"}), body), "computed on their own");
    }
}

#[test]
fn a_body_that_is_not_json_is_read_pointer_by_pointer_and_one_not_indexed_is_walked_for_its_pointers() {
    let long = format!(r#"{{"t": "x", "pad": "{}"}}"#, "p".repeat(crate::search::MAX_INDEXED_PAYLOAD_BYTES));
    // Nested past the parser's limit off the pointers' path: the terms' walk fails there,
    // where a pointer's pass skips it.
    let deep = format!(r#"{{"t": "x", "d": {}1{}}}"#, "[".repeat(200), "]".repeat(200));
    // (body, passes made besides the walk): a body found not to be JSON is not read again.
    for (body, expected_passes) in [
        (r#"{"t": "x""#, 1),
        (r#"{"t": "x"} {"#, 1),
        ("t=x&u=y", 1),
        (deep.as_str(), 2),
        // Not indexed (not an object or an array; over the indexed size): walked for the
        // pointers alone.
        (r#""t""#, 0),
        (long.as_str(), 0),
    ] {
        let pointers = ["/t", "/u"];
        let (found, passes, terms) = by_scan(body.as_bytes(), &pointers);
        assert_eq!(found, by_passes(body.as_bytes(), &pointers), "{body:.40}");
        assert_eq!(passes, expected_passes, "{body:.40}");
        assert_eq!(terms, crate::search::terms("key", &json!({"x-h": "v"}), body.as_bytes()), "{body:.40}");
    }
    // Content search off: walked for the pointers, the key alone indexed.
    let body = br#"{"t": "x", "u": 1}"#;
    let mut scan = PayloadScan::new(Indexing::KeyOnly);
    let mut json = LazyJson::scanning(body, ["/t", "/u"], &mut scan);
    assert_eq!((json.value_at("/t"), json.value_at("/u")), (Some(json!("x")), Some(json!(1))));
    assert_eq!(json.passes(), 0);
    assert_eq!(scan.terms("key", &json!({}), body), Indexing::KeyOnly.terms("key", &json!({}), b"{}"));
}

/// A scan that walks nothing, counting the walks it was made to take.
#[derive(Default)]
struct WalksNothing {
    scanned: usize,
}

impl super::BodyScan for WalksNothing {
    fn walks(&self, _: &[u8], _: usize) -> bool {
        false
    }

    fn scan<'t>(&mut self, _: &'t str, _: &mut [super::Probe<'_, 't>]) -> bool {
        self.scanned += 1;
        true
    }
}

#[test]
fn a_body_no_walk_is_for_is_not_walked_and_its_pointers_are_read_by_their_passes() {
    let body = br#"{"t": "x"}"#;
    let mut scan = WalksNothing::default();
    let mut json = LazyJson::scanning(body, ["/t"], &mut scan);
    json.finish();
    assert_eq!(json.value_at("/t"), Some(json!("x")));
    assert_eq!(json.passes(), 1);
    drop(json);
    assert_eq!(scan.scanned, 0, "never walked");
    // Content search off and no pointer to read: nothing to walk for.
    let scan = PayloadScan::new(Indexing::KeyOnly);
    assert!(!super::BodyScan::walks(&scan, body, 0));
    assert!(super::BodyScan::walks(&scan, body, 1));
    // A body over the indexed size, with no pointer: not walked either.
    let long = vec![b'['; crate::search::MAX_INDEXED_PAYLOAD_BYTES + 1];
    assert!(!super::BodyScan::walks(&PayloadScan::new(Indexing::Content), &long, 0));
    assert!(super::BodyScan::walks(&PayloadScan::new(Indexing::Content), body, 0));
}

#[test]
fn past_the_term_budget_the_walk_still_finds_the_pointers() {
    let mut doc = serde_json::Map::new();
    for i in 0..crate::search::MAX_PAYLOAD_TERMS + 5 {
        doc.insert(format!("k{i:05}"), json!(i));
    }
    doc.insert("zz".to_owned(), json!({"type": "late"}));
    let body = serde_json::to_vec(&Value::Object(doc)).expect("serialize");
    let (found, passes, terms) = by_scan(&body, &["/zz/type", "/k00003"]);
    assert_eq!(found, vec![Some(json!("late")), Some(json!(3))]);
    assert_eq!(passes, 0);
    assert_eq!(terms, crate::search::terms("key", &json!({"x-h": "v"}), &body));
}

proptest! {
    #![proptest_config(config(256))]

    /// For any JSON document and pointers into it (paths that exist, near misses, garbage),
    /// with content search on or off, the walk finds what a pass for each finds; it
    /// answers without passes whenever no pointer names a container or the document
    /// itself; its terms are the event's.
    #[test]
    fn the_walk_finds_what_each_pointer_s_pass_finds(
        value in json_value(),
        choices in vec(vec(any::<Index>(), 0..6), 1..4),
        tweak in 0u8..6,
        garbage in "\\PC{0,12}",
        pretty in any::<bool>(),
        content in any::<bool>(),
    ) {
        let mut pointers: Vec<String> = choices.iter().map(|c| path_into(&value, c).0).collect();
        match tweak {
            1 => pointers[0].push_str("/0"),
            2 => pointers[0].push_str("/01"),
            3 => pointers[0].push('/'),
            4 => pointers[0] = garbage,
            _ => {}
        }
        let body = if pretty { serde_json::to_vec_pretty(&value) } else { serde_json::to_vec(&value) }.expect("serialize");
        let pointers: Vec<&str> = pointers.iter().map(String::as_str).collect();
        let indexing = if content { Indexing::Content } else { Indexing::KeyOnly };
        let (found, passes, terms) = by_scan_indexing(&body, &pointers, indexing);
        prop_assert_eq!(&found, &by_passes(&body, &pointers));
        prop_assert_eq!(terms, indexing.terms("key", &json!({"x-h": "v"}), &body));
        let scalars = pointers.iter().all(|p| {
            !p.is_empty() && !matches!(value.pointer(p), Some(Value::Object(_) | Value::Array(_)))
        });
        if scalars {
            prop_assert_eq!(passes, 0, "pointers {:?}", pointers);
        }
    }

    /// Any accepted or refused request, of any kind, with any locators: verification that
    /// reads the body in the scan's walk decides exactly as verification alone, and the
    /// walk's terms are the event's.
    #[test]
    fn verification_by_the_walk_decides_as_verification_alone(
        p in sign_params(),
        dedupe in locator(),
        event_type in locator(),
        ordering_key in locator(),
        other in body(),
    ) {
        let mut signed = sign(&p);
        signed.spec.dedupe = dedupe;
        signed.spec.event_type = event_type;
        signed.spec.ordering_key = ordering_key;
        let request = signed.headers();
        for body in [&signed.body, &other] {
            let alone = verify(&signed.spec, &request, body, signed.now);
            let mut scan = PayloadScan::new(Indexing::Content);
            let walked = verify_scanning(&signed.spec, &request, body, signed.now, &mut scan);
            prop_assert_eq!(&walked, &alone);
            if let Ok(verified) = alone {
                let expected = crate::search::terms(&verified.dedupe_key, &json!({}), body);
                prop_assert_eq!(scan.terms(&verified.dedupe_key, &json!({}), body), expected);
            }
        }
    }

    /// Every kind declares the pointers it reads: an accepted event whose values are
    /// scalars is walked once, with no pass of a pointer's own.
    #[test]
    fn every_kind_declares_the_pointers_it_reads(
        mut p in sign_params(),
        id in "\\PC{1,24}",
        kind in "[a-z_.]{1,24}",
        challenge in any::<bool>(),
    ) {
        // Slack reads `/challenge` only in a `url_verification`.
        let challenge = challenge && p.kind == Kind::Slack;
        p.body = if challenge {
            json!({"type": "url_verification", "challenge": id})
        } else {
            json!({"id": id, "type": "event_callback", "event_id": id, "event": {"type": kind}, "action": "opened"})
        }
        .to_string()
        .into_bytes();
        let kind = (!challenge).then_some(kind);
        let mut signed = sign(&p);
        signed.spec.ordering_key = Locator { header: None, json_pointer: Some("/event/type".into()) };
        let request = signed.headers();
        let mut scan = PayloadScan::new(Indexing::Content);
        let mut json = scanned(&signed.spec, &signed.body, &mut scan);
        let verified = checked(&signed.spec, &request, &signed.body, signed.now, &mut json);
        prop_assert_eq!(verified.as_ref().map(|v| v.ordering_key.clone()), Ok(kind), "{:?}", signed.spec.kind);
        prop_assert_eq!(json.passes(), 0, "{:?} read a pointer it does not declare", signed.spec.kind);
    }
}
