//! Shopify: `X-Shopify-Hmac-Sha256: <base64 HMAC-SHA256 of the body>`, keyed with the
//! app's client secret (or the store's webhook signing secret) as shown.
//!
//! The dedupe key is `X-Shopify-Webhook-Id`, not `X-Shopify-Event-Id`: Shopify sends one
//! webhook per subscription for the same event, all with one event id, and each of those
//! deliveries must be stored (they may feed different routes). The event type is the topic
//! (`orders/create`).

use http::HeaderMap;

use super::extract::{LazyJson, body_sha256_hex, header_string, resolve, unknown_event_type};
use super::mac::{check_any, decode_base64, required_header, verbatim_keys};
use super::{HmacAlgorithm, SourceSpec, Verified, Verifier, VerifyError};

const SIGNATURE_HEADER: &str = "X-Shopify-Hmac-Sha256";
const WEBHOOK_ID_HEADER: &str = "X-Shopify-Webhook-Id";
const TOPIC_HEADER: &str = "X-Shopify-Topic";

/// The Shopify verifier.
pub(super) struct Shopify;

impl Verifier for Shopify {
    fn verify(
        &self,
        spec: &SourceSpec,
        headers: &HeaderMap,
        body: &[u8],
        _now_unix: i64,
    ) -> Result<Verified, VerifyError> {
        let header = required_header(headers, SIGNATURE_HEADER)?;
        let signature = decode_base64(header).ok_or_else(|| {
            VerifyError::InvalidSignature(format!("{SIGNATURE_HEADER} is not base64"))
        })?;
        check_any(
            HmacAlgorithm::Sha256,
            &verbatim_keys(spec),
            &[body],
            &[signature],
        )?;

        let mut json = LazyJson::new(body);
        let dedupe_key = resolve(&spec.dedupe, headers, &mut json, |_| {
            header_string(headers, WEBHOOK_ID_HEADER)
        })
        .unwrap_or_else(|| body_sha256_hex(body));
        let event_type = resolve(&spec.event_type, headers, &mut json, |_| {
            header_string(headers, TOPIC_HEADER)
        })
        .unwrap_or_else(unknown_event_type);
        Ok(Verified {
            dedupe_key,
            event_type,
            challenge: None,
        })
    }
}
