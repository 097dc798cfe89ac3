//! Property tests of the verifiers: hostile headers and bodies never panic, a request
//! signed with the kind's scheme always verifies, any single-byte change to what is
//! signed is refused, and the timestamp tolerance is exact at its boundaries.
//!
//! The requests are signed here, independently of the code under test, from each
//! provider's documented scheme (see the README's table of kinds).

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac};
use http::{HeaderMap, HeaderName, HeaderValue};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::{Index, select};
use serde_json::{Value, json};
use sha2::{Sha256, Sha512};

use super::extract::{Found, LazyJson, locate};
use super::{
    HmacAlgorithm, HmacScheme, Kind, Locator, SignatureEncoding, SourceSpec, Verified, VerifyError, validate_spec,
    verify,
};
use crate::props::{config, json_value};

/// Whether `key` can be stored as a dedupe or ordering key: not empty, no control
/// character, within the stored length.
fn storable(key: &str) -> bool {
    !key.is_empty() && !key.chars().any(char::is_control) && key.len() <= crate::sanitize::MAX_DEDUPE_KEY_BYTES
}

const ALL_KINDS: [Kind; 8] = [
    Kind::None,
    Kind::Internal,
    Kind::Stripe,
    Kind::Github,
    Kind::Shopify,
    Kind::Slack,
    Kind::StandardWebhooks,
    Kind::Hmac,
];

/// Every header name a verifier or a locator below reads, so garbage lands where it is
/// looked at.
const HEADER_NAMES: &[&str] = &[
    "stripe-signature",
    "x-hub-signature-256",
    "x-github-delivery",
    "x-github-event",
    "x-shopify-hmac-sha256",
    "x-shopify-webhook-id",
    "x-shopify-topic",
    "x-slack-signature",
    "x-slack-request-timestamp",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "x-signature",
    "x-id",
    "x-type",
];

/// Pieces the signature parsers split on or look for, and values near valid ones.
const TOKENS: &[&str] = &[
    "t=",
    "v1=",
    "v0=",
    "v1,",
    "v1a,",
    ",",
    "=",
    "==",
    " ",
    "\t",
    ";",
    ":",
    "t=,v1=,,",
    ",,=,",
    "sha256=",
    "SHA256=",
    "sha512=",
    "v0:",
    "whsec_",
    "1700000000",
    "0",
    "-1",
    "+1",
    "99999999999999999999",
    "9223372036854775807",
    "9223372036854775808",
    "deadbeef",
    "DEADBEEF",
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "zz",
    "YWJjZA",
    "g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
    "msg_",
    "é",
    "\u{fffd}",
];

/// A byte `HeaderValue::from_bytes` accepts: tab, visible ASCII and space, obs-text.
fn header_byte() -> impl Strategy<Value = u8> {
    prop_oneof![Just(b'\t'), 0x20u8..=0x7e, 0x80u8..=0xff]
}

/// A hostile header value: tokens and stray bytes glued together, raw bytes, or huge.
fn garbage_value() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        3 => select(TOKENS).prop_map(|t| t.as_bytes().to_vec()),
        1 => vec(header_byte(), 1..8),
    ];
    prop_oneof![
        8 => vec(piece, 0..12).prop_map(|pieces| pieces.concat()),
        3 => vec(header_byte(), 0..64),
        1 => (select(TOKENS), 1usize..=60).prop_map(|(t, kib)| t.as_bytes().repeat(kib * 1024 / t.len())),
    ]
}

/// Hostile headers: names the verifiers read (repeats allowed) and a few others.
fn garbage_headers() -> impl Strategy<Value = HeaderMap> {
    let known = (select(HEADER_NAMES).prop_map(str::to_owned), garbage_value());
    let other = ("[a-z0-9-]{1,12}", garbage_value());
    vec(prop_oneof![4 => known, 1 => other], 0..10).prop_map(|pairs| {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            let name = HeaderName::from_bytes(name.as_bytes()).expect("generated names are tokens");
            let value = HeaderValue::from_bytes(&value).expect("generated values are header bytes");
            map.append(name, value);
        }
        map
    })
}

/// Bodies: raw bytes, JSON of any shape, events the kinds understand, deep or huge.
pub(super) fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => vec(any::<u8>(), 0..512),
        6 => json_value().prop_map(|v| serde_json::to_vec(&v).expect("serialize")),
        6 => event_body(),
        1 => (1usize..20_000).prop_map(|depth| format!("{}1{}", "[".repeat(depth), "]".repeat(depth)).into_bytes()),
        1 => (1usize..20_000).prop_map(|depth| "{\"a\":".repeat(depth).into_bytes()),
        1 => (64usize..=1024).prop_map(|kib| vec![b'x'; kib * 1024]),
    ]
}

/// A JSON event with the fields each kind reads (`id`, `type`, `event_id`, `event.type`,
/// `action`), with arbitrary values.
fn event_body() -> impl Strategy<Value = Vec<u8>> {
    ("\\PC{1,24}", "[a-z_./]{1,24}", any::<bool>()).prop_map(|(id, kind, callback)| {
        let top_type = if callback { "event_callback".to_owned() } else { kind.clone() };
        json!({"id": id, "type": top_type, "event_id": id, "event": {"type": kind}, "action": "opened"})
            .to_string()
            .into_bytes()
    })
}

pub(super) fn locator() -> impl Strategy<Value = Locator> {
    let header =
        prop_oneof![Just(None), select(HEADER_NAMES).prop_map(|h| Some(h.to_owned())), "\\PC{0,8}".prop_map(Some),];
    let pointer = prop_oneof![
        Just(None),
        "(/[a-z0-9~_-]{0,4}){0,4}".prop_map(Some),
        "\\PC{0,12}".prop_map(Some),
        select(vec!["", "/", "/id", "/event/type", "/~", "/~2", "/a~1b", "/0", "/-", "//"])
            .prop_map(|p| Some(p.to_owned())),
    ];
    (header, pointer).prop_map(|(header, json_pointer)| Locator { header, json_pointer })
}

/// The generic kind's settings. `wild` adds prefixes no operator should write (leading
/// whitespace, non-ASCII); without it, prefixes are visible ASCII a sender can send.
fn hmac_scheme(wild: bool) -> impl Strategy<Value = HmacScheme> {
    let header = prop_oneof![
        select(HEADER_NAMES).prop_map(str::to_owned),
        Just("X-Signature".to_owned()),
        "[A-Za-z0-9-]{1,16}",
    ];
    let algorithm = prop_oneof![Just(HmacAlgorithm::Sha256), Just(HmacAlgorithm::Sha512)];
    let encoding = prop_oneof![Just(SignatureEncoding::Hex), Just(SignatureEncoding::Base64)];
    let wild_prefix = if wild { "[ -~\t]{0,10}|\\PC{0,4}" } else { "[!-~][ -~\t]{0,9}" };
    let prefix = prop_oneof![
        Just(None),
        select(vec!["sha256=", "SHA512=", "v1=", "", "sig "]).prop_map(|p| Some(p.to_owned())),
        wild_prefix.prop_map(Some),
    ];
    (header, algorithm, encoding, prefix).prop_map(|(header, algorithm, encoding, prefix)| HmacScheme {
        header,
        algorithm,
        encoding,
        prefix,
    })
}

/// A Standard Webhooks secret: base64 key bytes, with or without `whsec_`.
fn standard_secret() -> impl Strategy<Value = String> {
    (vec(any::<u8>(), 1..64), any::<bool>()).prop_map(|(key, prefixed)| {
        let encoded = BASE64.encode(key);
        if prefixed { format!("whsec_{encoded}") } else { encoded }
    })
}

/// Secrets as the kind takes them (any non-empty string is an HMAC key for the others).
fn secrets_for(kind: Kind) -> BoxedStrategy<Vec<String>> {
    if kind == Kind::StandardWebhooks { vec(standard_secret(), 1..4).boxed() } else { vec("\\PC{1,40}", 1..4).boxed() }
}

fn tolerance() -> impl Strategy<Value = Option<u64>> {
    prop_oneof![Just(None), (1u64..=600).prop_map(Some), (1u64..=u64::MAX).prop_map(Some)]
}

/// A spec of any shape, including ones `validate_spec` would refuse.
fn any_spec() -> impl Strategy<Value = SourceSpec> {
    (
        select(ALL_KINDS.to_vec()),
        vec(prop_oneof!["\\PC{0,40}", standard_secret(), Just(String::new())], 0..4),
        tolerance(),
        locator(),
        locator(),
        locator(),
        prop::option::of(hmac_scheme(true)),
    )
        .prop_map(|(kind, secrets, tolerance_secs, dedupe, event_type, ordering_key, hmac)| SourceSpec {
            kind,
            secrets,
            tolerance_secs,
            dedupe,
            event_type,
            ordering_key,
            hmac,
        })
}

/// An instant anywhere an `i64` reaches, biased towards realistic ones.
fn any_now() -> impl Strategy<Value = i64> {
    prop_oneof![1_600_000_000i64..1_900_000_000, any::<i64>(), Just(i64::MIN), Just(i64::MAX), Just(0)]
}

// ---- Signing, independently of the verifiers ----

fn mac(algorithm: HmacAlgorithm, key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    match algorithm {
        HmacAlgorithm::Sha256 => {
            let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("any key length");
            parts.iter().for_each(|p| m.update(p));
            m.finalize().into_bytes().to_vec()
        }
        HmacAlgorithm::Sha512 => {
            let mut m = <Hmac<Sha512> as Mac>::new_from_slice(key).expect("any key length");
            parts.iter().for_each(|p| m.update(p));
            m.finalize().into_bytes().to_vec()
        }
    }
}

fn standard_key(secret: &str) -> Vec<u8> {
    let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
    BASE64.decode(encoded).expect("generated secrets are base64")
}

/// What a signed request is made of. The signature header's value is
/// `head + encode(mac) + tail`, so a test can re-encode a changed MAC.
#[derive(Debug, Clone)]
pub(super) struct Signed {
    pub(super) spec: SourceSpec,
    pub(super) body: Vec<u8>,
    pub(super) now: i64,
    signature_header: String,
    head: String,
    mac: Vec<u8>,
    encoding: SignatureEncoding,
    tail: String,
    /// Bytes of the signature header's value that are decoys (entries the scheme
    /// ignores): changing them changes nothing.
    decoys: Vec<std::ops::Range<usize>>,
    /// Other signed headers (id, timestamp), which must not change either.
    signed_headers: Vec<(String, String)>,
    /// Headers that are not signed (event type, delivery id).
    other_headers: Vec<(String, String)>,
}

impl Signed {
    fn encode(&self, mac: &[u8]) -> String {
        encode(self.encoding, mac)
    }

    fn signature_value(&self, mac: &[u8]) -> String {
        format!("{}{}{}", self.head, self.encode(mac), self.tail)
    }

    fn headers_with(&self, signature: &[u8], signed: &[(String, String)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        let mut add = |name: &str, value: &[u8]| {
            map.append(
                HeaderName::from_bytes(name.as_bytes()).expect("header name"),
                HeaderValue::from_bytes(value).expect("header value"),
            );
        };
        add(&self.signature_header, signature);
        for (name, value) in signed.iter().chain(&self.other_headers) {
            add(name, value.as_bytes());
        }
        map
    }

    pub(super) fn headers(&self) -> HeaderMap {
        self.headers_with(self.signature_value(&self.mac).as_bytes(), &self.signed_headers)
    }

    fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<Verified, VerifyError> {
        verify(&self.spec, headers, body, self.now)
    }
}

/// Everything a signed request is generated from.
#[derive(Debug, Clone)]
pub(super) struct SignParams {
    pub(super) kind: Kind,
    secrets: Vec<String>,
    signer: Index,
    pub(super) body: Vec<u8>,
    timestamp: i64,
    skew: Index,
    tolerance: Option<u64>,
    id: String,
    scheme: HmacScheme,
    /// A second, unrelated signature listed before the valid one (kinds with lists).
    decoy: bool,
}

const SIGNING_KINDS: [Kind; 6] =
    [Kind::Stripe, Kind::Github, Kind::Shopify, Kind::Slack, Kind::StandardWebhooks, Kind::Hmac];

pub(super) fn sign_params() -> impl Strategy<Value = SignParams> {
    sign_params_with(&SIGNING_KINDS, false)
}

/// Kinds that sign a timestamp (and, for Standard Webhooks, an id) in separate headers.
const TIMESTAMP_KINDS: [Kind; 3] = [Kind::Stripe, Kind::Slack, Kind::StandardWebhooks];

/// Requests of one of `kinds`. `wild`: the generic kind's prefix may be one
/// `validate_spec` should refuse.
fn sign_params_with(kinds: &[Kind], wild: bool) -> impl Strategy<Value = SignParams> + use<> {
    select(kinds.to_vec()).prop_flat_map(move |kind| {
        (
            secrets_for(kind),
            any::<Index>(),
            body(),
            prop_oneof![1_600_000_000i64..1_900_000_000, 0..=i64::MAX],
            any::<Index>(),
            tolerance(),
            "[!-~]{1,40}",
            hmac_scheme(wild),
            any::<bool>(),
        )
            .prop_map(move |(secrets, signer, body, timestamp, skew, tolerance, id, scheme, decoy)| {
                SignParams { kind, secrets, signer, body, timestamp, skew, tolerance, id, scheme, decoy }
            })
    })
}

/// Sign `p.body` with one of `p.secrets` per the kind's scheme, at `p.timestamp`, and pick
/// a `now` inside the tolerance.
pub(super) fn sign(p: &SignParams) -> Signed {
    let secret = p.secrets[p.signer.index(p.secrets.len())].as_str();
    let ts = p.timestamp.to_string();
    let body = p.body.as_slice();
    let tolerance = p.tolerance.unwrap_or(super::DEFAULT_TOLERANCE_SECS);
    // A skew in [-tolerance, tolerance], kept inside i64.
    let width = u128::from(tolerance) * 2 + 1;
    let skew = (p.skew.index(usize::MAX) as u128 % width) as i128 - i128::from(tolerance);
    let now = (i128::from(p.timestamp) + skew).clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
    let spec = SourceSpec {
        kind: p.kind,
        secrets: p.secrets.clone(),
        tolerance_secs: p.tolerance,
        dedupe: Locator::default(),
        event_type: Locator::default(),
        ordering_key: Locator::default(),
        hmac: (p.kind == Kind::Hmac).then(|| p.scheme.clone()),
    };
    let sha256 = HmacAlgorithm::Sha256;
    let mut decoys = Vec::new();
    let plain = |name: &str, head: &str, mac: Vec<u8>, encoding| Signed {
        spec: spec.clone(),
        body: p.body.clone(),
        now,
        signature_header: name.to_owned(),
        head: head.to_owned(),
        mac,
        encoding,
        tail: String::new(),
        decoys: Vec::new(),
        signed_headers: Vec::new(),
        other_headers: Vec::new(),
    };
    let header = |name: &str, value: &str| (name.to_owned(), value.to_owned());
    let mut signed = match p.kind {
        Kind::Stripe => {
            let head = if p.decoy {
                let before = format!("t={ts},");
                let entries = format!("v0={},v1={}", "ab".repeat(32), "cd".repeat(32));
                decoys.push(before.len()..before.len() + entries.len());
                format!("{before}{entries},v1=")
            } else {
                format!("t={ts},v1=")
            };
            let mac = mac(sha256, secret.as_bytes(), &[ts.as_bytes(), b".", body]);
            plain("stripe-signature", &head, mac, SignatureEncoding::Hex)
        }
        Kind::Github => Signed {
            other_headers: vec![header("x-github-delivery", &p.id), header("x-github-event", "push")],
            ..plain("x-hub-signature-256", "sha256=", mac(sha256, secret.as_bytes(), &[body]), SignatureEncoding::Hex)
        },
        Kind::Shopify => Signed {
            other_headers: vec![header("x-shopify-webhook-id", &p.id)],
            ..plain("x-shopify-hmac-sha256", "", mac(sha256, secret.as_bytes(), &[body]), SignatureEncoding::Base64)
        },
        Kind::Slack => Signed {
            signed_headers: vec![header("x-slack-request-timestamp", &ts)],
            ..plain(
                "x-slack-signature",
                "v0=",
                mac(sha256, secret.as_bytes(), &[b"v0:", ts.as_bytes(), b":", body]),
                SignatureEncoding::Hex,
            )
        },
        Kind::StandardWebhooks => {
            let head = if p.decoy {
                let entries = format!("v1a,{} v1,{}", "A".repeat(43), "B".repeat(43));
                decoys.push(0..entries.len());
                format!("{entries} v1,")
            } else {
                "v1,".to_owned()
            };
            let mac = mac(sha256, &standard_key(secret), &[p.id.as_bytes(), b".", ts.as_bytes(), b".", body]);
            Signed {
                tail: if p.decoy { " v2,xyz".to_owned() } else { String::new() },
                signed_headers: vec![header("webhook-id", &p.id), header("webhook-timestamp", &ts)],
                ..plain("webhook-signature", &head, mac, SignatureEncoding::Base64)
            }
        }
        Kind::Hmac => plain(
            &p.scheme.header,
            p.scheme.prefix.as_deref().unwrap_or_default(),
            mac(p.scheme.algorithm, secret.as_bytes(), &[body]),
            p.scheme.encoding,
        ),
        Kind::None | Kind::Internal => unreachable!("not a signing kind"),
    };
    if !signed.tail.is_empty() {
        // After the separator that ends the valid entry.
        let start = signed.head.len() + signed.encode(&signed.mac).len() + 1;
        decoys.push(start..start + signed.tail.len() - 1);
    }
    signed.decoys = decoys;
    signed
}

fn encode(encoding: SignatureEncoding, mac: &[u8]) -> String {
    match encoding {
        SignatureEncoding::Hex => hex::encode(mac),
        SignatureEncoding::Base64 => BASE64.encode(mac),
    }
}

/// The refusal a correctly signed request may still get: a body that lacks what the kind
/// requires (Stripe's `id`, Slack's `event_id` / `challenge`).
fn acceptable(result: &Result<Verified, VerifyError>) -> bool {
    match result {
        Ok(v) => {
            !v.dedupe_key.is_empty()
                && !v.event_type.is_empty()
                && v.ordering_key.as_ref().is_none_or(|k| !k.is_empty())
        }
        // The signature held, but the body lacks what the kind requires (Stripe's id,
        // Slack's event_id) or holds a key or type that cannot be used as sent (any
        // kind: a present key is refused, never replaced by a fallback).
        Err(VerifyError::MalformedBody(_)) => true,
        Err(_) => false,
    }
}

fn is_invalid_signature<T>(result: &Result<T, VerifyError>) -> bool {
    matches!(result, Err(VerifyError::InvalidSignature(_)))
}

/// The alphabet of an encoding, to replace one character of an encoded MAC with another.
fn alphabet(encoding: SignatureEncoding) -> &'static [u8] {
    match encoding {
        SignatureEncoding::Hex => b"0123456789abcdef",
        SignatureEncoding::Base64 => b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/",
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Garbage headers and bodies under any spec, at any instant: never a panic; an
    /// accepted request has a key and a type; a signing kind accepts nothing here (no
    /// header below is a signature of anything).
    #[test]
    fn hostile_requests_never_panic_and_forgeries_are_refused(
        spec in any_spec(),
        headers in garbage_headers(),
        body in body(),
        now in any_now(),
    ) {
        let result = verify(&spec, &headers, &body, now);
        match (&result, spec.kind) {
            (Ok(v), _) => {
                prop_assert!(matches!(spec.kind, Kind::None | Kind::Internal), "{:?} accepted a forgery: {v:?}", spec.kind);
                prop_assert!(!v.dedupe_key.is_empty() && !v.event_type.is_empty(), "{v:?}");
                // An ordering key, when there is one, is as storable as the dedupe key.
                prop_assert!(v.ordering_key.as_ref().is_none_or(|k| storable(k)), "{v:?}");
                prop_assert!(storable(&v.dedupe_key), "{v:?}");
                prop_assert!(v.challenge.is_none());
            }
            // Unsigned kinds refuse only a key or type that is present but unusable.
            (Err(e), Kind::None | Kind::Internal) => {
                prop_assert!(matches!(e, VerifyError::MalformedBody(_)), "kind none refused: {e}");
            }
            (Err(e), _) => {
                // Errors never echo what the sender sent (secrets are not in headers,
                // but signatures are, and the message reaches the sender).
                let text = e.to_string();
                for value in headers.values() {
                    if value.len() >= 16 {
                        prop_assert!(!text.as_bytes().windows(value.len()).any(|w| w == value.as_bytes()), "{text}");
                    }
                }
            }
        }
    }

    /// A request signed per the kind's scheme (with any of the source's secrets, a decoy
    /// signature beside it where the scheme lists several, at any instant inside the
    /// tolerance) verifies.
    #[test]
    fn a_correctly_signed_request_verifies(p in sign_params()) {
        let s = sign(&p);
        let result = s.verify(&s.headers(), &s.body);
        prop_assert!(acceptable(&result), "{:?}: {result:?}", p.kind);
    }

    /// A valid spec (one `validate_spec` accepts) can be satisfied: some request verifies.
    /// Catches settings the admin API accepts but no sender could ever match.
    #[test]
    fn every_valid_spec_accepts_its_signed_requests(p in sign_params_with(&SIGNING_KINDS, true)) {
        let s = sign(&p);
        prop_assume!(validate_spec(&s.spec).is_ok());
        let result = s.verify(&s.headers(), &s.body);
        prop_assert!(acceptable(&result), "{:?} {:?}: {result:?}", p.kind, s.spec.hmac);
    }

    /// Changing, inserting or deleting one byte of the body is refused.
    #[test]
    fn any_single_byte_change_to_the_body_is_refused(
        p in sign_params(),
        at in any::<Index>(),
        byte in any::<u8>(),
        how in 0u8..3,
    ) {
        let s = sign(&p);
        prop_assume!(acceptable(&s.verify(&s.headers(), &s.body)));
        let mut body = s.body.clone();
        match how {
            0 if !body.is_empty() => {
                let i = at.index(body.len());
                body[i] = if body[i] == byte { byte.wrapping_add(1) } else { byte };
            }
            1 if !body.is_empty() => {
                body.remove(at.index(body.len()));
            }
            _ => body.insert(at.index(body.len() + 1), byte),
        }
        let result = s.verify(&s.headers(), &body);
        prop_assert!(is_invalid_signature(&result), "{:?}: {result:?}", p.kind);
    }

    /// Flipping any bit of the MAC, or replacing one character of its encoding with
    /// another of the alphabet, is refused.
    #[test]
    fn any_change_to_the_signature_is_refused(
        p in sign_params(),
        at in any::<Index>(),
        bit in 0u8..8,
        replacement in any::<Index>(),
    ) {
        let s = sign(&p);
        prop_assume!(acceptable(&s.verify(&s.headers(), &s.body)));
        let mut flipped = s.mac.clone();
        let i = at.index(flipped.len());
        flipped[i] ^= 1 << bit;
        let result = s.verify(&s.headers_with(s.signature_value(&flipped).as_bytes(), &s.signed_headers), &s.body);
        prop_assert!(is_invalid_signature(&result), "bit flip: {:?}: {result:?}", p.kind);

        let mut encoded = s.encode(&s.mac).into_bytes();
        let letters = alphabet(s.encoding);
        // Only the characters that carry bits ('=' padding aside).
        let carrying = encoded.iter().take_while(|&&c| c != b'=').count();
        let j = at.index(carrying);
        let original = encoded[j].to_ascii_lowercase();
        let others: Vec<u8> = letters.iter().copied().filter(|&c| c != encoded[j] && !(s.encoding == SignatureEncoding::Hex && c == original)).collect();
        encoded[j] = others[replacement.index(others.len())];
        let value = format!("{}{}{}", s.head, String::from_utf8(encoded).expect("ascii"), s.tail);
        let result = s.verify(&s.headers_with(value.as_bytes(), &s.signed_headers), &s.body);
        prop_assert!(is_invalid_signature(&result), "character {j} replaced: {value}: {result:?}");
    }

    /// Any byte of the signature header's value replaced by any header byte: never a
    /// panic, and if it still verifies the change was one the scheme ignores (letter
    /// case, whitespace, base64 padding).
    #[test]
    fn any_byte_of_the_signature_header_changed_is_refused_or_equivalent(
        p in sign_params(),
        at in any::<Index>(),
        byte in header_byte(),
    ) {
        let s = sign(&p);
        prop_assume!(acceptable(&s.verify(&s.headers(), &s.body)));
        let mut value = s.signature_value(&s.mac).into_bytes();
        prop_assume!(!value.is_empty());
        let i = at.index(value.len());
        let original = value[i];
        prop_assume!(original != byte);
        prop_assume!(!s.decoys.iter().any(|d| d.contains(&i)));
        value[i] = byte;
        let result = s.verify(&s.headers_with(&value, &s.signed_headers), &s.body);
        if result.is_ok() {
            let benign = |c: u8| c == b' ' || c == b'\t' || c == b'=';
            prop_assert!(
                original.eq_ignore_ascii_case(&byte) || benign(original) || benign(byte),
                "{:?}: byte {i} {:?} -> {:?} still verifies: {}",
                p.kind, original as char, byte as char, String::from_utf8_lossy(&value)
            );
        }
    }

    /// The other signed headers (Slack's timestamp, Standard Webhooks' id and timestamp):
    /// one byte changed, removed or added is refused.
    #[test]
    fn any_change_to_a_signed_header_is_refused(
        p in sign_params_with(&[Kind::Slack, Kind::StandardWebhooks], false),
        which in any::<Index>(),
        at in any::<Index>(),
        byte in header_byte(),
        how in 0u8..3,
    ) {
        let s = sign(&p);
        prop_assume!(!s.signed_headers.is_empty());
        prop_assume!(acceptable(&s.verify(&s.headers(), &s.body)));
        let mut signed = s.signed_headers.clone();
        let k = which.index(signed.len());
        let mut value = signed[k].1.clone().into_bytes();
        match how {
            0 => {
                let i = at.index(value.len());
                prop_assume!(value[i] != byte);
                value[i] = byte;
            }
            1 => {
                value.remove(at.index(value.len()));
            }
            _ => value.insert(at.index(value.len() + 1), byte),
        }
        // Whitespace added at either end is trimmed away like any header's: not a change.
        prop_assume!(value.trim_ascii() != signed[k].1.as_bytes());
        let mut headers = s.headers_with(s.signature_value(&s.mac).as_bytes(), &[]);
        for (i, (name, v)) in signed.iter_mut().enumerate() {
            let v = if i == k { value.clone() } else { v.clone().into_bytes() };
            headers.append(HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_bytes(&v).unwrap());
        }
        let result = s.verify(&headers, &s.body);
        prop_assert!(
            matches!(result, Err(VerifyError::InvalidSignature(_) | VerifyError::MissingSignature(_))),
            "{:?} {}: {:?}: {result:?}", p.kind, signed[k].0, String::from_utf8_lossy(&value)
        );
    }

    /// A signed request is accepted exactly when `|now - t| <= tolerance`, at the
    /// boundaries and anywhere in the `i64` range.
    #[test]
    fn timestamp_tolerance_is_exact(
        p in sign_params_with(&TIMESTAMP_KINDS, false),
        edge in prop_oneof![Just(0i128), Just(1), Just(-1)],
        sign_of in any::<bool>(),
        far in any::<i64>(),
        use_far in prop::bool::weighted(0.2),
    ) {
        // A body every kind accepts.
        let mut p = p.clone();
        p.body = br#"{"id":"evt_1","type":"t","event_id":"Ev1"}"#.to_vec();
        let mut s = sign(&p);
        let tolerance = i128::from(p.tolerance.unwrap_or(super::DEFAULT_TOLERANCE_SECS));
        let skew = if use_far {
            i128::from(far)
        } else {
            let boundary = tolerance + edge;
            if sign_of { boundary } else { -boundary }
        };
        let now = i128::from(p.timestamp) + skew;
        prop_assume!(now >= i128::from(i64::MIN) && now <= i128::from(i64::MAX));
        s.now = now as i64;
        let result = s.verify(&s.headers(), &s.body);
        if skew.abs() <= tolerance {
            prop_assert!(result.is_ok(), "skew {skew} within {tolerance}: {result:?}");
        } else {
            prop_assert!(matches!(result, Err(VerifyError::TimestampOutOfTolerance(_))), "skew {skew} beyond {tolerance}: {result:?}");
        }
    }

    /// A forged request (signed with a secret the source does not have) is refused,
    /// whatever the body.
    #[test]
    fn a_request_signed_with_another_secret_is_refused(
        (p, other_secrets, other_signer) in sign_params().prop_flat_map(|p| {
            let kind = p.kind;
            (Just(p), secrets_for(kind), any::<Index>())
        }),
    ) {
        let s = sign(&p);
        let mut forged = p.clone();
        forged.secrets = other_secrets;
        forged.signer = other_signer;
        let f = sign(&forged);
        let signer = &forged.secrets[forged.signer.index(forged.secrets.len())];
        prop_assume!(!p.secrets.contains(signer));
        // Standard Webhooks: one key may be spelled with and without `whsec_`.
        // HMAC pads keys with zeros, so trailing zero bytes do not make another key.
        let key = |k: &str| {
            let mut bytes = if p.kind == Kind::StandardWebhooks { standard_key(k) } else { k.as_bytes().to_vec() };
            while bytes.last() == Some(&0) {
                bytes.pop();
            }
            bytes
        };
        prop_assume!(!p.secrets.iter().any(|k| key(k) == key(signer)));
        let result = s.verify(&f.headers(), &s.body);
        prop_assert!(is_invalid_signature(&result), "{:?}: {result:?}", p.kind);
    }
}

/// What a pointer that lands on `at` must answer: absent for `null`, the text of a
/// non-empty string or of an integer, refused for anything else.
fn expected_at(at: &Value) -> Found {
    match at {
        Value::Null => Ok(None),
        Value::String(s) if !s.is_empty() => Ok(Some(s.clone())),
        Value::Number(n) if !n.is_f64() => Ok(Some(n.to_string())),
        _ => Err(VerifyError::MalformedBody(String::new())),
    }
}

/// Walk `value` by `choices` (an element of an array, a member of an object, until a
/// scalar or an empty container): the RFC 6901 pointer of the path, escaped, and the
/// value it leads to.
pub(super) fn path_into<'v>(value: &'v Value, choices: &[Index]) -> (String, &'v Value) {
    let mut at = value;
    let mut pointer = String::new();
    for choice in choices {
        match at {
            Value::Array(items) if !items.is_empty() => {
                let i = choice.index(items.len());
                pointer.push_str(&format!("/{i}"));
                at = &items[i];
            }
            Value::Object(map) if !map.is_empty() => {
                let (key, next) = map.iter().nth(choice.index(map.len())).expect("in range");
                pointer.push('/');
                pointer.push_str(&key.replace('~', "~0").replace('/', "~1"));
                at = next;
            }
            _ => break,
        }
    }
    (pointer, at)
}

proptest! {
    #![proptest_config(config(512))]

    /// Any pointer into any JSON: no panic, and what comes back is a non-empty scalar.
    #[test]
    fn pointers_never_panic(body in body(), pointer in prop_oneof!["\\PC{0,24}", "(/[a-z0-9~_-]{0,4}){0,8}"]) {
        let mut json = LazyJson::new(&body);
        match json.pointer(&pointer) {
            Ok(Some(found)) => prop_assert!(!found.is_empty()),
            Ok(None) => {}
            Err(e) => prop_assert!(matches!(e, VerifyError::MalformedBody(_)), "{e:?}"),
        }
    }

    /// A pointer built (with RFC 6901 escaping) from a path that exists finds exactly the
    /// value at that path, for keys with `~`, `/`, control characters and any Unicode.
    #[test]
    fn an_escaped_path_finds_its_value(value in json_value(), choices in vec(any::<Index>(), 0..6)) {
        let (pointer, at) = path_into(&value, &choices);
        let body = serde_json::to_vec(&value).expect("serialize");
        let found = LazyJson::new(&body).pointer(&pointer);
        match (found, expected_at(at)) {
            (Err(VerifyError::MalformedBody(_)), Err(_)) => {}
            (found, expected) => prop_assert_eq!(found, expected, "pointer {:?} into {}", pointer, value),
        }
    }

    /// The raw walk (verify/pointer.rs) answers what `serde_json::Value::pointer` answers
    /// on the parsed body, for any body that parses and any pointer: paths that exist
    /// (with escapes), near misses (an index past the end, a leading zero, a sign, a
    /// trailing slash) and garbage.
    #[test]
    fn the_raw_walk_agrees_with_value_pointer(
        value in json_value(),
        choices in vec(any::<Index>(), 0..6),
        tweak in 0u8..6,
        garbage in "\\PC{0,12}",
    ) {
        let (mut pointer, _) = path_into(&value, &choices);
        match tweak {
            1 => pointer.push_str("/0"),
            2 => pointer.push_str("/01"),
            3 => pointer.push_str("/+0"),
            4 => pointer.push('/'),
            5 => pointer = garbage,
            _ => {}
        }
        let body = serde_json::to_vec_pretty(&value).expect("serialize");
        let parsed: Value = serde_json::from_slice(&body).expect("round trip");
        prop_assert_eq!(LazyJson::new(&body).value_at(&pointer), parsed.pointer(&pointer).cloned(), "pointer {:?}", pointer);
    }

    /// Over arbitrary bodies (most not JSON), wherever serde_json parses the body the raw
    /// walk agrees with it, and where it does not, the walk finds nothing.
    #[test]
    fn the_raw_walk_agrees_on_arbitrary_bodies(body in body(), pointer in prop_oneof!["\\PC{0,24}", "(/[a-z0-9~_-]{0,4}){0,8}"]) {
        let found = LazyJson::new(&body).value_at(&pointer);
        match serde_json::from_slice::<Value>(&body) {
            Ok(parsed) => prop_assert_eq!(found, parsed.pointer(&pointer).cloned()),
            Err(_) => {
                // Only what serde_json refuses for its own limits (nesting, number range)
                // may still be read; a syntax error never is.
                if found.is_some() {
                    prop_assert!(serde_json::from_slice::<serde::de::IgnoredAny>(&body).is_ok(), "found {:?} in a body that is not JSON", found);
                }
            }
        }
    }

    /// Arrays nested far past serde_json's recursion limit: no stack overflow, and the
    /// leaf is found while the depth is within the limit.
    #[test]
    fn deep_nesting_is_refused_not_overflowed(depth in 1usize..50_000) {
        let body = format!("{}7{}", "[".repeat(depth), "]".repeat(depth));
        let pointer = "/0".repeat(depth);
        let found = LazyJson::new(body.as_bytes()).pointer(&pointer);
        let found = found.expect("a number is a usable key");
        if depth <= 100 {
            prop_assert_eq!(found.as_deref(), Some("7"));
        } else {
            prop_assert!(found.is_none() || found.as_deref() == Some("7"));
        }
    }

    /// Locators over hostile headers and bodies: a present header wins, as its trimmed
    /// UTF-8 text, and is refused when it cannot be used as sent (empty, not UTF-8,
    /// repeated with different values); an absent one defers to the pointer; never an
    /// empty key.
    #[test]
    fn locate_prefers_a_usable_header_then_the_pointer(
        locator in locator(),
        headers in garbage_headers(),
        body in body(),
    ) {
        let found = locate(&locator, &headers, &mut LazyJson::new(&body));
        if let Ok(Some(v)) = &found {
            prop_assert!(!v.is_empty());
        }
        let present: Vec<&[u8]> = locator
            .header
            .as_deref()
            .map(|name| headers.get_all(name).iter().map(|v| v.as_bytes()).collect())
            .unwrap_or_default();
        if !present.is_empty() {
            let texts: Option<Vec<&str>> =
                present.iter().map(|b| std::str::from_utf8(b).ok().map(str::trim).filter(|t| !t.is_empty())).collect();
            match texts {
                Some(texts) if texts.iter().all(|t| *t == texts[0]) => {
                    prop_assert_eq!(found, Ok(Some(texts[0].to_owned())));
                }
                _ => prop_assert!(matches!(found, Err(VerifyError::MalformedBody(_))), "{found:?}"),
            }
        } else if let Some(pointer) = &locator.json_pointer {
            prop_assert_eq!(found, LazyJson::new(&body).pointer(pointer));
        } else {
            prop_assert_eq!(found, Ok(None));
        }
    }
}
