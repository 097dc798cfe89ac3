//! GitHub: `X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the body>`, keyed with the
//! webhook secret as typed. The legacy SHA-1 `X-Hub-Signature` is not accepted.
//!
//! The dedupe key is `X-GitHub-Delivery`, a GUID that GitHub keeps when a delivery is
//! redelivered. The event type is `X-GitHub-Event`, refined with the body's `action`
//! (`pull_request.opened`), because subscribers nearly always route on both.

use http::HeaderMap;
use serde_json::Value;

use super::extract::{LazyJson, body_sha256_hex, header_string, resolve, unknown_event_type};
use super::mac::{check_any, decode_hex, required_header, verbatim_keys};
use super::{HmacAlgorithm, SourceSpec, Verified, Verifier, VerifyError};

const SIGNATURE_HEADER: &str = "X-Hub-Signature-256";
const DELIVERY_HEADER: &str = "X-GitHub-Delivery";
const EVENT_HEADER: &str = "X-GitHub-Event";

/// The GitHub verifier.
pub(super) struct Github;

impl Verifier for Github {
    fn verify(
        &self,
        spec: &SourceSpec,
        headers: &HeaderMap,
        body: &[u8],
        _now_unix: i64,
    ) -> Result<Verified, VerifyError> {
        let header = required_header(headers, SIGNATURE_HEADER)?;
        let signature = header
            .strip_prefix("sha256=")
            .and_then(decode_hex)
            .ok_or_else(|| {
                VerifyError::InvalidSignature(format!("{SIGNATURE_HEADER} is not sha256=<hex>"))
            })?;
        check_any(
            HmacAlgorithm::Sha256,
            &verbatim_keys(spec),
            &[body],
            &[signature],
        )?;

        let mut json = LazyJson::new(body);
        let dedupe_key = resolve(&spec.dedupe, headers, &mut json, |_| {
            header_string(headers, DELIVERY_HEADER)
        })
        .unwrap_or_else(|| body_sha256_hex(body));
        let event_type = resolve(&spec.event_type, headers, &mut json, |json| {
            let event = header_string(headers, EVENT_HEADER)?;
            let action = json
                .get()
                .and_then(|v| v.get("action"))
                .and_then(Value::as_str)
                .filter(|a| !a.is_empty());
            Some(match action {
                Some(action) => format!("{event}.{action}"),
                None => event,
            })
        })
        .unwrap_or_else(unknown_event_type);
        Ok(Verified {
            dedupe_key,
            event_type,
            challenge: None,
        })
    }
}
