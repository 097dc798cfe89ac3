//! Standard Webhooks (<https://www.standardwebhooks.com>): `webhook-id`,
//! `webhook-timestamp`, and `webhook-signature`, a space-separated list of
//! `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">` entries (several while the
//! sender rotates its key). Other versions, such as the asymmetric `v1a`, are ignored.
//!
//! The secret is `whsec_<base64>` and the HMAC key is the *decoded* bytes after the
//! prefix; a secret without the prefix is decoded too, as the reference libraries do.

use http::HeaderMap;

use super::extract::{LazyJson, body_sha256_hex, resolve, unknown_event_type};
use super::mac::{check_any, check_tolerance, decode_base64, parse_timestamp, required_header};
use super::{HmacAlgorithm, SourceSpec, Verified, Verifier, VerifyError};

const ID_HEADER: &str = "webhook-id";
const TIMESTAMP_HEADER: &str = "webhook-timestamp";
const SIGNATURE_HEADER: &str = "webhook-signature";

/// The Standard Webhooks verifier.
pub(super) struct StandardWebhooks;

/// The HMAC key of a Standard Webhooks secret, or `None` if it is not base64 (or empty).
pub(super) fn decode_secret(secret: &str) -> Option<Vec<u8>> {
    let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
    decode_base64(encoded).filter(|key| !key.is_empty())
}

impl Verifier for StandardWebhooks {
    fn verify(
        &self,
        spec: &SourceSpec,
        headers: &HeaderMap,
        body: &[u8],
        now_unix: i64,
    ) -> Result<Verified, VerifyError> {
        let id = required_header(headers, ID_HEADER)?;
        let raw_timestamp = required_header(headers, TIMESTAMP_HEADER)?;
        let header = required_header(headers, SIGNATURE_HEADER)?;
        if id.is_empty() {
            return Err(VerifyError::InvalidSignature(format!(
                "{ID_HEADER} is empty"
            )));
        }
        let timestamp = parse_timestamp(raw_timestamp, TIMESTAMP_HEADER)?;

        let mut v1_entries = 0usize;
        let mut signatures = Vec::new();
        for entry in header.split_whitespace() {
            if let Some(("v1", encoded)) = entry.split_once(',') {
                v1_entries += 1;
                signatures.extend(decode_base64(encoded));
            }
        }
        if v1_entries == 0 {
            return Err(VerifyError::InvalidSignature(format!(
                "{SIGNATURE_HEADER} has no v1 signature"
            )));
        }
        // A secret that does not decode was refused by `validate_spec`; skipping it here
        // keeps the others working rather than failing the whole source.
        let keys: Vec<Vec<u8>> = spec
            .secrets
            .iter()
            .filter_map(|s| decode_secret(s))
            .collect();
        check_any(
            HmacAlgorithm::Sha256,
            &keys,
            &[id.as_bytes(), b".", raw_timestamp.as_bytes(), b".", body],
            &signatures,
        )?;
        check_tolerance(spec, timestamp, now_unix)?;

        let mut json = LazyJson::new(body);
        let dedupe_key = resolve(&spec.dedupe, headers, &mut json, |_| Some(id.to_owned()))
            .unwrap_or_else(|| body_sha256_hex(body));
        let event_type = resolve(&spec.event_type, headers, &mut json, |j| j.pointer("/type"))
            .unwrap_or_else(unknown_event_type);
        Ok(Verified {
            dedupe_key,
            event_type,
            challenge: None,
        })
    }
}
