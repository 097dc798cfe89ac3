//! An independent signer per provider scheme, for tests that post signed webhooks.
//!
//! Signatures are computed with the `hmac`, `sha2` and `base64` crates used directly,
//! following each provider's documented scheme: an implementation independent of
//! `src/verify` (whose unit tests cover the providers' published fixed vectors). Bodies
//! are bytes: hostile-input tests sign bodies that are not UTF-8.

use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac};
use sha2::{Sha256, Sha512};

/// HMAC-SHA256.
pub fn hmac_sha256(key: &[u8], message: &[u8]) -> Vec<u8> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(message);
    mac.finalize().into_bytes().to_vec()
}

/// HMAC-SHA512.
pub fn hmac_sha512(key: &[u8], message: &[u8]) -> Vec<u8> {
    let mut mac = <Hmac<Sha512> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(message);
    mac.finalize().into_bytes().to_vec()
}

/// Unix seconds now: the timestamped kinds must be signed for the present.
pub fn now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_secs() as i64
}

fn concat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// `Stripe-Signature`: `t=<ts>,v1=<hex HMAC-SHA256 of "{ts}.{body}">`, key = secret as written.
pub fn stripe_header(secret: &str, ts: i64, body: impl AsRef<[u8]>) -> String {
    let signed = concat(&[ts.to_string().as_bytes(), b".", body.as_ref()]);
    format!("t={ts},v1={}", hex::encode(hmac_sha256(secret.as_bytes(), &signed)))
}

/// `X-Hub-Signature-256`: `sha256=<hex HMAC-SHA256 of the body>`.
pub fn github_header(secret: &str, body: impl AsRef<[u8]>) -> String {
    format!("sha256={}", hex::encode(hmac_sha256(secret.as_bytes(), body.as_ref())))
}

/// `X-Shopify-Hmac-Sha256`: base64 HMAC-SHA256 of the body.
pub fn shopify_header(secret: &str, body: impl AsRef<[u8]>) -> String {
    BASE64.encode(hmac_sha256(secret.as_bytes(), body.as_ref()))
}

/// `X-Slack-Signature`: `v0=<hex HMAC-SHA256 of "v0:{ts}:{body}">`.
pub fn slack_header(secret: &str, ts: i64, body: impl AsRef<[u8]>) -> String {
    let signed = concat(&[b"v0:", ts.to_string().as_bytes(), b":", body.as_ref()]);
    format!("v0={}", hex::encode(hmac_sha256(secret.as_bytes(), &signed)))
}

/// One `webhook-signature` entry: `v1,<base64 HMAC-SHA256 of "{id}.{ts}.{body}">`, keyed
/// with the base64-decoded part of `whsec_<base64>`.
pub fn standard_entry(secret: &str, id: &str, ts: i64, body: impl AsRef<[u8]>) -> String {
    let key = BASE64.decode(secret.trim_start_matches("whsec_")).expect("test secret is base64");
    let signed = concat(&[id.as_bytes(), b".", ts.to_string().as_bytes(), b".", body.as_ref()]);
    format!("v1,{}", BASE64.encode(hmac_sha256(&key, &signed)))
}

/// A `whsec_` secret from raw key bytes.
pub fn whsec(key: &[u8]) -> String {
    format!("whsec_{}", BASE64.encode(key))
}
