//! Slack: `X-Slack-Signature: v0=<hex HMAC-SHA256 of "v0:{timestamp}:{body}">` with the
//! timestamp in `X-Slack-Request-Timestamp`, keyed with the app's signing secret.
//!
//! Body handling, decided here because Slack posts several kinds of body to one URL:
//! - `{"type":"url_verification","challenge":..}` (the Events API handshake): answered
//!   with the challenge, after the signature check, so nobody can use the gateway to
//!   claim a URL; nothing is stored.
//! - `{"type":"event_callback",..}` must carry `event_id` (the id Slack keeps across its
//!   retries, which add `X-Slack-Retry-Num`); without one it is `MalformedBody`, since
//!   deduplicating Events API retries is the point of the key.
//! - Anything else (slash commands and interactivity are form-encoded, other JSON types
//!   such as `app_rate_limited`) is accepted with the body-hash key; the event type is
//!   `event.type`, else the top-level `type`, else `unknown`.

use http::HeaderMap;

use super::extract::{LazyJson, body_sha256_hex, locate, resolve, unknown_event_type};
use super::mac::{
    check_any, check_tolerance, decode_hex, parse_timestamp, required_header, verbatim_keys,
};
use super::{HmacAlgorithm, SourceSpec, Verified, Verifier, VerifyError};

const SIGNATURE_HEADER: &str = "X-Slack-Signature";
const TIMESTAMP_HEADER: &str = "X-Slack-Request-Timestamp";

/// The Slack verifier.
pub(super) struct Slack;

impl Verifier for Slack {
    fn verify(
        &self,
        spec: &SourceSpec,
        headers: &HeaderMap,
        body: &[u8],
        now_unix: i64,
    ) -> Result<Verified, VerifyError> {
        let header = required_header(headers, SIGNATURE_HEADER)?;
        let raw_timestamp = required_header(headers, TIMESTAMP_HEADER)?;
        let signature = header
            .strip_prefix("v0=")
            .and_then(decode_hex)
            .ok_or_else(|| {
                VerifyError::InvalidSignature(format!("{SIGNATURE_HEADER} is not v0=<hex>"))
            })?;
        let timestamp = parse_timestamp(raw_timestamp, TIMESTAMP_HEADER)?;
        check_any(
            HmacAlgorithm::Sha256,
            &verbatim_keys(spec),
            &[b"v0:", raw_timestamp.as_bytes(), b":", body],
            &[signature],
        )?;
        check_tolerance(spec, timestamp, now_unix)?;

        let mut json = LazyJson::new(body);
        let body_type = json.pointer("/type");
        if body_type.as_deref() == Some("url_verification") {
            let challenge = json.pointer("/challenge").ok_or_else(|| {
                VerifyError::MalformedBody("url_verification has no challenge".to_owned())
            })?;
            return Ok(Verified {
                dedupe_key: body_sha256_hex(body),
                event_type: "url_verification".to_owned(),
                challenge: Some(challenge),
            });
        }

        let dedupe_key = if spec.dedupe.is_empty() {
            match json.pointer("/event_id") {
                Some(id) => id,
                None if body_type.as_deref() == Some("event_callback") => {
                    return Err(VerifyError::MalformedBody(
                        "Slack event_callback has no event_id".to_owned(),
                    ));
                }
                None => body_sha256_hex(body),
            }
        } else {
            locate(&spec.dedupe, headers, &mut json).unwrap_or_else(|| body_sha256_hex(body))
        };
        let event_type = resolve(&spec.event_type, headers, &mut json, |json| {
            json.pointer("/event/type").or(body_type)
        })
        .unwrap_or_else(unknown_event_type);
        Ok(Verified {
            dedupe_key,
            event_type,
            challenge: None,
        })
    }
}
