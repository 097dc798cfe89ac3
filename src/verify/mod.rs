//! Inbound verification: one verifier kind per provider, behind one function.
//!
//! A source's [`SourceSpec`] says which kind verifies its webhooks, which secrets are
//! valid (several during a rotation), and where the dedupe key and the event type live.
//! Verification is a pure function of the spec, the request headers, the raw body bytes
//! and the current time: it never touches the database, so a forged request costs one
//! HMAC and nothing is stored (the ingest handler calls [`verify`] before any write).
//!
//! Layout: one file per kind (`stripe.rs`, `github.rs`, `shopify.rs`, `slack.rs`,
//! `standard.rs`, `hmac.rs`, `none.rs`), each a unit struct behind the private `Verifier`
//! trait; `mac.rs` holds what they share (constant-time check over all secrets, decoding,
//! timestamp tolerance), `extract.rs` the dedupe-key and event-type lookups, and
//! `validate.rs` the checks the admin API runs when a source is created. The README's
//! "Sources: receiving webhooks" section shows how to set up each kind.

mod extract;
mod github;
mod hmac;
mod mac;
mod none;
mod pointer;
mod shopify;
mod slack;
mod standard;
mod stripe;
#[cfg(test)]
mod test_util;
#[cfg(test)]
mod tests_props;
#[cfg(test)]
mod tests_scan;
mod validate;

use http::HeaderMap;

use crate::error::ErrorCode;
use serde::{Deserialize, Serialize};

pub use extract::{BODY_HASH_PREFIX, body_sha256_hex};
pub use pointer::{BodyScan, Probe};
pub use standard::decode_secret as decode_standard_secret;
pub use validate::{SpecError, ValidSpec, secret_fingerprint, validate_spec};

/// The verifier kinds a source can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// No verification at all (explicit opt-in, logged at start-up).
    None,
    /// Stripe: `Stripe-Signature: t=..,v1=..`.
    Stripe,
    /// GitHub: `X-Hub-Signature-256: sha256=<hex>`.
    Github,
    /// Shopify: `X-Shopify-Hmac-Sha256: <base64>`.
    Shopify,
    /// Slack: `X-Slack-Signature: v0=<hex>` over `v0:{ts}:{body}`.
    Slack,
    /// Standard Webhooks: `webhook-id` / `webhook-timestamp` / `webhook-signature`.
    StandardWebhooks,
    /// A configurable HMAC scheme (header, algorithm, encoding, prefix).
    Hmac,
    /// Events published through the authenticated admin API (`POST /v1/events`).
    Internal,
}

impl Kind {
    /// The name used in the API and the database.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::None => "none",
            Kind::Stripe => "stripe",
            Kind::Github => "github",
            Kind::Shopify => "shopify",
            Kind::Slack => "slack",
            Kind::StandardWebhooks => "standard-webhooks",
            Kind::Hmac => "hmac",
            Kind::Internal => "internal",
        }
    }

    /// Whether this kind checks a signature and so needs at least one secret.
    pub fn needs_secret(self) -> bool {
        !matches!(self, Kind::None | Kind::Internal)
    }
}

/// Where a value (dedupe key, event type) is read from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Locator {
    /// A request header name (case-insensitive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// An RFC 6901 JSON pointer into the body, e.g. `/data/id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_pointer: Option<String>,
}

impl Locator {
    /// True when neither a header nor a pointer is configured.
    pub fn is_empty(&self) -> bool {
        self.header.is_none() && self.json_pointer.is_none()
    }
}

/// Hash algorithm of the generic `hmac` kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum HmacAlgorithm {
    /// HMAC-SHA256.
    #[default]
    Sha256,
    /// HMAC-SHA512.
    Sha512,
}

/// Signature encoding of the generic `hmac` kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum SignatureEncoding {
    /// Lower- or upper-case hexadecimal.
    #[default]
    Hex,
    /// Standard base64 (padding optional).
    Base64,
}

/// Settings of the generic `hmac` kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HmacScheme {
    /// Header that carries the signature, e.g. `X-Signature`.
    pub header: String,
    /// Hash algorithm.
    #[serde(default)]
    pub algorithm: HmacAlgorithm,
    /// How the MAC is encoded in the header.
    #[serde(default)]
    pub encoding: SignatureEncoding,
    /// A prefix before the encoded MAC, e.g. `sha256=` (visible ASCII, compared without
    /// regard to case; it may not start with whitespace, which no header value keeps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}

/// Everything needed to verify one source's webhooks. `S` is the form of its secrets:
/// plaintext (`String`, the default: what verification and the API's bodies hold) or
/// [`Sealed`](crate::secrets::Sealed) (what the database stores); only the keyring turns
/// one into the other ([`SourceSpec::with_secrets`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceSpec<S = String> {
    /// Verifier kind.
    pub kind: Kind,
    /// Valid secrets; any one matching is accepted (rotation).
    #[serde(default = "Vec::new")]
    pub secrets: Vec<S>,
    /// Timestamp tolerance in seconds for kinds that sign a timestamp (default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerance_secs: Option<u64>,
    /// Override of where the dedupe key lives (kinds have their own default).
    #[serde(default)]
    pub dedupe: Locator,
    /// Override of where the event type lives (kinds have their own default).
    #[serde(default)]
    pub event_type: Locator,
    /// Where the ordering key lives (empty: none). Subscriptions that ask for ordered
    /// delivery deliver the events of one key to an endpoint one at a time, in order.
    #[serde(default, skip_serializing_if = "Locator::is_empty")]
    pub ordering_key: Locator,
    /// Settings of the `hmac` kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hmac: Option<HmacScheme>,
}

impl<S> SourceSpec<S> {
    /// The same spec with `secrets` in place of its own (sealed ones after sealing,
    /// plaintext ones after opening).
    pub fn with_secrets<T>(self, secrets: Vec<T>) -> SourceSpec<T> {
        SourceSpec {
            kind: self.kind,
            secrets,
            tolerance_secs: self.tolerance_secs,
            dedupe: self.dedupe,
            event_type: self.event_type,
            ordering_key: self.ordering_key,
            hmac: self.hmac,
        }
    }
}

/// Default timestamp tolerance (Stripe, Slack and Standard Webhooks all use 5 minutes).
pub const DEFAULT_TOLERANCE_SECS: u64 = 300;

/// What verification extracted from an accepted request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The provider's unique delivery id (or the SHA-256 of the body as a fallback).
    pub dedupe_key: String,
    /// The event type, `unknown` when the request does not say.
    pub event_type: String,
    /// Set for Slack's `url_verification`: answer with this and store nothing.
    pub challenge: Option<String>,
    /// The ordering key, when the source says where it lives and the request has one.
    pub ordering_key: Option<String>,
}

/// Why a request was refused. Each maps to one HTTP status and error code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// The signature header (or a part of it, such as the timestamp) is absent.
    #[error("missing signature: {0}")]
    MissingSignature(String),
    /// A signature is present but none matches any secret, or it is malformed.
    #[error("invalid signature: {0}")]
    InvalidSignature(String),
    /// The signed timestamp is too old or too far in the future.
    #[error("timestamp out of tolerance: {0}")]
    TimestampOutOfTolerance(String),
    /// The body lacks something the kind requires (e.g. Stripe without `id`).
    #[error("malformed body: {0}")]
    MalformedBody(String),
}

impl VerifyError {
    /// Stable machine-readable code used in API errors and metrics labels.
    pub fn code(&self) -> ErrorCode {
        match self {
            VerifyError::MissingSignature(_) => ErrorCode::MissingSignature,
            VerifyError::InvalidSignature(_) => ErrorCode::InvalidSignature,
            VerifyError::TimestampOutOfTolerance(_) => ErrorCode::TimestampOutOfTolerance,
            VerifyError::MalformedBody(_) => ErrorCode::MalformedBody,
        }
    }
}

/// One provider's scheme: check the signature, then extract the dedupe key and event type.
///
/// Each kind lives in its own file as a unit struct; [`verify`] picks one by [`Kind`].
trait Verifier {
    /// Check the request, then read its values (from `json`, the same `body`, once the
    /// signature held).
    fn verify(
        &self,
        spec: &SourceSpec,
        headers: &HeaderMap,
        body: &[u8],
        json: &mut extract::LazyJson,
        now_unix: i64,
    ) -> Result<Verified, VerifyError>;

    /// The pointers this kind may read by default, declared so that a scan of the body
    /// takes them on its way ([`verify_scanning`]).
    fn pointers(&self) -> &'static [&'static str] {
        &[]
    }
}

fn verifier(kind: Kind) -> &'static dyn Verifier {
    match kind {
        Kind::None | Kind::Internal => &none::NoSignature,
        Kind::Stripe => &stripe::Stripe,
        Kind::Github => &github::Github,
        Kind::Shopify => &shopify::Shopify,
        Kind::Slack => &slack::Slack,
        Kind::StandardWebhooks => &standard::StandardWebhooks,
        Kind::Hmac => &hmac::GenericHmac,
    }
}

/// Verify one inbound request against its source's spec.
///
/// The signature is checked on the raw `body` bytes against every secret in
/// `spec.secrets` (any match is accepted, so a rotation needs no downtime), in constant
/// time; then the signed timestamp, where the kind has one, must be within
/// `spec.tolerance_secs` (default [`DEFAULT_TOLERANCE_SECS`]) of `now_unix` in either
/// direction. Only then is the body read for the dedupe key and event type: the spec's
/// `dedupe` / `event_type` locators, when set, replace the kind's defaults; the fallbacks
/// are [`body_sha256_hex`] and `"unknown"`.
///
/// `now_unix` is the current time in unix seconds (a parameter so tests can pin it).
///
/// The key and the event type are then made storable ([`crate::sanitize::dedupe_key`],
/// [`crate::sanitize::event_type`]): one that is present but empty, not UTF-8, or holds a
/// control character is refused as [`VerifyError::MalformedBody`], never replaced by a
/// fallback; a key over [`crate::sanitize::MAX_DEDUPE_KEY_BYTES`] is stored as its digest.
pub fn verify(spec: &SourceSpec, headers: &HeaderMap, body: &[u8], now_unix: i64) -> Result<Verified, VerifyError> {
    checked(spec, headers, body, now_unix, &mut extract::LazyJson::new(body))
}

/// [`verify`], reading the body in `scan`'s walk: once the request is accepted, the walk
/// has run (it is what ingest computes the search index's terms with), and every pointer
/// the kind and the spec name was taken on its way rather than by a pass over the body
/// each. A request refused before its body is read (a bad signature) is not walked.
pub fn verify_scanning(
    spec: &SourceSpec,
    headers: &HeaderMap,
    body: &[u8],
    now_unix: i64,
    scan: &mut dyn BodyScan,
) -> Result<Verified, VerifyError> {
    let mut json = scanned(spec, body, scan);
    let verified = checked(spec, headers, body, now_unix, &mut json)?;
    json.finish();
    Ok(verified)
}

/// `body` read by `scan`'s walk, which takes every pointer `spec` and its kind may read.
fn scanned<'a>(spec: &'a SourceSpec, body: &'a [u8], scan: &'a mut dyn BodyScan) -> extract::LazyJson<'a> {
    let declared = [&spec.dedupe, &spec.event_type, &spec.ordering_key]
        .into_iter()
        .filter_map(|locator| locator.json_pointer.as_deref())
        .chain(verifier(spec.kind).pointers().iter().copied());
    extract::LazyJson::scanning(body, declared, scan)
}

/// [`verify`] with the body read through `json`.
fn checked(
    spec: &SourceSpec,
    headers: &HeaderMap,
    body: &[u8],
    now_unix: i64,
    json: &mut extract::LazyJson,
) -> Result<Verified, VerifyError> {
    let verified = verifier(spec.kind).verify(spec, headers, body, json, now_unix)?;
    // The body's hash is the gateway's own key (no key in the webhook): stored as it is.
    // A sender's key spelled the same way is not that hash, and is digested.
    let own = verified.dedupe_key.starts_with(BODY_HASH_PREFIX) && verified.dedupe_key == body_sha256_hex(body);
    let dedupe_key = if own {
        verified.dedupe_key
    } else {
        crate::sanitize::dedupe_key(verified.dedupe_key)
            .map_err(|why| VerifyError::MalformedBody(format!("the dedupe key {why}")))?
    };
    let event_type = crate::sanitize::event_type(verified.event_type)
        .map_err(|why| VerifyError::MalformedBody(format!("the event type {why}")))?;
    // Read after the signature held, like the other values; absent is no key (the event
    // is then delivered unordered), present but unusable is refused.
    let ordering_key = extract::locate(&spec.ordering_key, headers, json)?
        .map(|key| {
            crate::sanitize::dedupe_key(key)
                .map_err(|why| VerifyError::MalformedBody(format!("the ordering key {why}")))
        })
        .transpose()?;
    Ok(Verified { dedupe_key, event_type, ordering_key, ..verified })
}

#[cfg(test)]
mod tests {
    use super::test_util::{header_locator, headers, spec};
    use super::*;

    #[test]
    fn none_and_internal_still_accept_and_extract() {
        for kind in [Kind::None, Kind::Internal] {
            let mut s = spec(kind, &[]);
            s.dedupe = header_locator("X-Id");
            let v = verify(&s, &headers(&[("x-id", "abc")]), b"{}", 0).unwrap();
            assert_eq!(v.dedupe_key, "abc");
            assert_eq!(v.event_type, "unknown");
        }
    }

    #[test]
    fn errors_never_echo_secrets_or_signatures() {
        let secret = "whsec_c2VjcmV0LXZhbHVlLXRoYXQtbXVzdC1ub3QtbGVhaw==";
        let signature = "deadbeefcafebabe";
        let cases = [
            (Kind::Stripe, vec![("Stripe-Signature", format!("t=1,v1={signature}"))]),
            (Kind::Stripe, vec![("Stripe-Signature", format!("v1={signature}"))]),
            (Kind::Github, vec![("X-Hub-Signature-256", format!("sha256={signature}"))]),
            (Kind::Github, vec![("X-Hub-Signature-256", signature.to_owned())]),
            (Kind::Shopify, vec![("X-Shopify-Hmac-Sha256", signature.to_owned())]),
            (
                Kind::Slack,
                vec![("X-Slack-Signature", format!("v0={signature}")), ("X-Slack-Request-Timestamp", "1".to_owned())],
            ),
            (
                Kind::StandardWebhooks,
                vec![
                    ("webhook-id", "msg_1".to_owned()),
                    ("webhook-timestamp", "1".to_owned()),
                    ("webhook-signature", format!("v1,{signature}")),
                ],
            ),
        ];
        for (kind, pairs) in cases {
            let pairs: Vec<(&str, &str)> = pairs.iter().map(|(n, v)| (*n, v.as_str())).collect();
            let err = verify(&spec(kind, &[secret]), &headers(&pairs), b"{}", 1).expect_err("forged request accepted");
            let text = err.to_string();
            assert!(!text.contains(secret) && !text.contains(signature), "{kind:?}: {text}");
        }
    }
}
