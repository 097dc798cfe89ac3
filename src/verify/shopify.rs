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
        json: &mut LazyJson,
        _now_unix: i64,
    ) -> Result<Verified, VerifyError> {
        let header = required_header(headers, SIGNATURE_HEADER)?;
        let signature = decode_base64(header)
            .ok_or_else(|| VerifyError::InvalidSignature(format!("{SIGNATURE_HEADER} is not base64")))?;
        check_any(HmacAlgorithm::Sha256, &verbatim_keys(spec), &[body], &[signature])?;

        let dedupe_key = resolve(&spec.dedupe, headers, json, |_| header_string(headers, WEBHOOK_ID_HEADER))?
            .unwrap_or_else(|| body_sha256_hex(body));
        let event_type = resolve(&spec.event_type, headers, json, |_| header_string(headers, TOPIC_HEADER))?
            .unwrap_or_else(unknown_event_type);
        Ok(Verified { dedupe_key, event_type, challenge: None, ordering_key: None })
    }
}

#[cfg(test)]
mod tests {
    use crate::verify::test_util::{code, header_locator, headers, spec};
    use crate::verify::{Kind, verify};

    // Shopify publishes no signature vector. Computed outside this crate with
    //   printf '%s' "$BODY" | openssl dgst -sha256 -hmac 'shopify-test-secret' -binary | base64
    // and cross-checked with Python:
    //   base64.b64encode(hmac.new(key, body, hashlib.sha256).digest())
    const BODY: &str = r#"{"id":820982911946154508,"email":"jon@example.com"}"#;
    const SECRET: &str = "shopify-test-secret";
    const SIG: &str = "mNfrdp3JGPIAycLjYyaBMlDV8vLpLMGbKSueYfs6Poo=";
    const ROTATED_SECRET: &str = "shopify-rotated-secret";
    const ROTATED_SIG: &str = "5dD0p+tzUJgEJllB+q+s1Vy4Btb8RYVEb/QlRwVDAvs=";
    const EVENT_ID: &str = "98880550-7158-44d4-b7cd-2c97c8a091b5";

    fn request(signature: &str, webhook_id: &str) -> http::HeaderMap {
        headers(&[
            ("X-Shopify-Hmac-Sha256", signature),
            ("X-Shopify-Topic", "orders/create"),
            ("X-Shopify-Webhook-Id", webhook_id),
            ("X-Shopify-Event-Id", EVENT_ID),
            ("X-Shopify-Shop-Domain", "example.myshopify.com"),
        ])
    }

    #[test]
    fn valid_signature_is_accepted_and_event_extracted() {
        let h = request(SIG, "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043");
        let v = verify(&spec(Kind::Shopify, &[SECRET]), &h, BODY.as_bytes(), 0).unwrap();
        assert_eq!(v.dedupe_key, "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043");
        assert_eq!(v.event_type, "orders/create");
    }

    #[test]
    fn same_event_through_two_subscriptions_gives_two_keys() {
        let s = spec(Kind::Shopify, &[SECRET]);
        let a = verify(&s, &request(SIG, "webhook-a"), BODY.as_bytes(), 0).unwrap();
        let b = verify(&s, &request(SIG, "webhook-b"), BODY.as_bytes(), 0).unwrap();
        assert_ne!(a.dedupe_key, b.dedupe_key);
        // A retry of one delivery keeps its webhook id, so it stays a duplicate.
        let retry = verify(&s, &request(SIG, "webhook-a"), BODY.as_bytes(), 0).unwrap();
        assert_eq!(a.dedupe_key, retry.dedupe_key);
    }

    #[test]
    fn wrong_secret_and_tampered_body_are_invalid() {
        let h = request(SIG, "w");
        let wrong = spec(Kind::Shopify, &["wrong"]);
        assert_eq!(code(verify(&wrong, &h, BODY.as_bytes(), 0)), "invalid_signature");
        let right = spec(Kind::Shopify, &[SECRET]);
        let tampered = BODY.replace("jon", "eve");
        assert_eq!(code(verify(&right, &h, tampered.as_bytes(), 0)), "invalid_signature");
    }

    #[test]
    fn malformed_headers_are_invalid_and_absent_is_missing() {
        let s = spec(Kind::Shopify, &[SECRET]);
        // The right MAC in hex (openssl dgst as above, without -binary | base64): the
        // right bytes in the wrong encoding. Hex digits are base64 characters too, so
        // this decodes, to 48 bytes that cannot match.
        let hex = "98d7eb769dc918f200c9c2e36326813250d5f2f2e92cc19b292b9e61fb3a3e8a";
        for header in ["not base64!", &format!("sha256={SIG}"), hex, ""] {
            assert_eq!(code(verify(&s, &request(header, "w"), BODY.as_bytes(), 0)), "invalid_signature", "{header}");
        }
        let h = headers(&[("X-Shopify-Topic", "orders/create")]);
        assert_eq!(code(verify(&s, &h, BODY.as_bytes(), 0)), "missing_signature");
    }

    #[test]
    fn unpadded_base64_is_accepted() {
        let s = spec(Kind::Shopify, &[SECRET]);
        let h = request(SIG.trim_end_matches('='), "w");
        assert!(verify(&s, &h, BODY.as_bytes(), 0).is_ok());
    }

    #[test]
    fn either_of_two_rotated_secrets_is_accepted() {
        let s = spec(Kind::Shopify, &[SECRET, ROTATED_SECRET]);
        for sig in [SIG, ROTATED_SIG] {
            assert!(verify(&s, &request(sig, "w"), BODY.as_bytes(), 0).is_ok());
        }
    }

    #[test]
    fn locators_override_the_defaults() {
        let mut s = spec(Kind::Shopify, &[SECRET]);
        s.dedupe = header_locator("X-Shopify-Event-Id");
        s.event_type = header_locator("X-Shopify-Shop-Domain");
        let v = verify(&s, &request(SIG, "w"), BODY.as_bytes(), 0).unwrap();
        assert_eq!(v.dedupe_key, EVENT_ID);
        assert_eq!(v.event_type, "example.myshopify.com");
    }
}
