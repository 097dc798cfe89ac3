//! Stripe: `Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>...]`, each `v1` a hex
//! HMAC-SHA256 of `"{t}.{body}"` keyed with the endpoint secret string exactly as Stripe
//! shows it (`whsec_...`, prefix included, not decoded).
//!
//! Other schemes in the header (`v0`, Stripe's test-mode legacy) are ignored on purpose:
//! accepting them would let a downgrade around `v1`. Stripe sends several `v1` entries
//! while the endpoint's secret is being rolled, so any of them may match.

use http::HeaderMap;

use super::extract::{LazyJson, body_sha256_hex, locate, resolve, unknown_event_type};
use super::mac::{check_any, check_tolerance, decode_hex, parse_timestamp, required_header, verbatim_keys};
use super::{HmacAlgorithm, SourceSpec, Verified, Verifier, VerifyError};

const SIGNATURE_HEADER: &str = "Stripe-Signature";

/// The Stripe verifier.
pub(super) struct Stripe;

impl Verifier for Stripe {
    fn pointers(&self) -> &'static [&'static str] {
        &["/id", "/type"]
    }

    fn verify(
        &self,
        spec: &SourceSpec,
        headers: &HeaderMap,
        body: &[u8],
        json: &mut LazyJson,
        now_unix: i64,
    ) -> Result<Verified, VerifyError> {
        let header = required_header(headers, SIGNATURE_HEADER)?;
        let (t, signatures) = parse_header(header)?;
        let timestamp = parse_timestamp(t, "Stripe-Signature t")?;
        check_any(HmacAlgorithm::Sha256, &verbatim_keys(spec), &[t.as_bytes(), b".", body], &signatures)?;
        check_tolerance(spec, timestamp, now_unix)?;

        // Stripe's event id is the documented idempotency key and is in every event, so a
        // body without one is not an event we understand: refuse it rather than guess.
        let dedupe_key = if spec.dedupe.is_empty() {
            json.pointer("/id")?.ok_or_else(|| VerifyError::MalformedBody("Stripe event has no `id`".to_owned()))?
        } else {
            locate(&spec.dedupe, headers, json)?.unwrap_or_else(|| body_sha256_hex(body))
        };
        let event_type =
            resolve(&spec.event_type, headers, json, |j| j.pointer("/type"))?.unwrap_or_else(unknown_event_type);
        Ok(Verified { dedupe_key, event_type, challenge: None, ordering_key: None })
    }
}

/// Split the header into its raw timestamp and decoded `v1` signatures.
///
/// A `v1` that is not hex cannot match and is dropped; the request still passes if another
/// entry matches, as with Stripe's own libraries.
fn parse_header(header: &str) -> Result<(&str, Vec<Vec<u8>>), VerifyError> {
    let mut timestamp = None;
    let mut v1_entries = 0usize;
    let mut signatures = Vec::new();
    for item in header.split(',') {
        let Some((key, value)) = item.split_once('=') else {
            continue;
        };
        match key.trim() {
            // The first `t` wins, as in Stripe's libraries.
            "t" if timestamp.is_none() => timestamp = Some(value.trim()),
            "v1" => {
                v1_entries += 1;
                signatures.extend(decode_hex(value));
            }
            _ => {}
        }
    }
    let timestamp =
        timestamp.ok_or_else(|| VerifyError::InvalidSignature("Stripe-Signature has no t= timestamp".to_owned()))?;
    if v1_entries == 0 {
        return Err(VerifyError::InvalidSignature("Stripe-Signature has no v1 signature".to_owned()));
    }
    Ok((timestamp, signatures))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::test_util::{code, headers, pointer_locator, spec};
    use crate::verify::{Kind, verify};

    // Stripe publishes no signature vector, so these were computed outside this crate with
    // OpenSSL and cross-checked with Python's hmac module, e.g.
    //   printf '%s' "1700000000.$BODY" | openssl dgst -sha256 -hmac 'whsec_test_stripe_one'
    //   python3 -c 'import hmac,hashlib,sys; print(hmac.new(b"whsec_test_stripe_one",
    //     b"1700000000."+sys.argv[1].encode(), hashlib.sha256).hexdigest())' "$BODY"
    const BODY: &str = r#"{"id":"evt_1PqRsT2eZvKYlo2C","object":"event","type":"payment_intent.succeeded","data":{"object":{"id":"pi_3PqRsT"}}}"#;
    const T: i64 = 1_700_000_000;
    const SECRET_ONE: &str = "whsec_test_stripe_one";
    const SECRET_TWO: &str = "whsec_test_stripe_two";
    /// BODY at T under SECRET_ONE.
    const SIG_ONE: &str = "35684ab5be36309c699172eacc93d1bbde3dcd5e5c69ed9f46d1c445221e509b";
    /// BODY at T under SECRET_TWO.
    const SIG_TWO: &str = "3a0c19eb505c69a523dbc90fa10fe753a79230faf82c57851de7a3c9c22eef9c";
    /// BODY at T under `whsec_not_configured`.
    const SIG_OTHER: &str = "6728b115b2f317d333c20356f0379250f2ec50ff031112e6c74ebdbbbe1a4337";
    /// `{"object":"event","type":"charge.succeeded"}` at T under SECRET_ONE.
    const NO_ID_BODY: &str = r#"{"object":"event","type":"charge.succeeded"}"#;
    const NO_ID_SIG: &str = "fe0d6a3b7d3226b7e456aa36356f6af7e53b8ba6ebe2fed163dd415d99299eac";

    fn signed(header: &str) -> http::HeaderMap {
        headers(&[("Stripe-Signature", header)])
    }

    #[test]
    fn valid_signature_is_accepted_and_event_extracted() {
        let v = verify(
            &spec(Kind::Stripe, &[SECRET_ONE]),
            &signed(&format!("t={T},v1={SIG_ONE}")),
            BODY.as_bytes(),
            T + 10,
        )
        .unwrap();
        assert_eq!(v.dedupe_key, "evt_1PqRsT2eZvKYlo2C");
        assert_eq!(v.event_type, "payment_intent.succeeded");
        assert_eq!(v.challenge, None);
    }

    #[test]
    fn wrong_secret_and_tampered_body_are_invalid() {
        let header = signed(&format!("t={T},v1={SIG_ONE}"));
        let wrong = spec(Kind::Stripe, &["whsec_wrong"]);
        assert_eq!(code(verify(&wrong, &header, BODY.as_bytes(), T)), "invalid_signature");
        let right = spec(Kind::Stripe, &[SECRET_ONE]);
        let tampered = BODY.replace("succeeded", "failed");
        assert_eq!(code(verify(&right, &header, tampered.as_bytes(), T)), "invalid_signature");
        // The timestamp is signed too: changing it breaks the signature.
        let moved = signed(&format!("t={},v1={SIG_ONE}", T + 1));
        assert_eq!(code(verify(&right, &moved, BODY.as_bytes(), T)), "invalid_signature");
    }

    #[test]
    fn malformed_headers_are_invalid_and_absent_is_missing() {
        let s = spec(Kind::Stripe, &[SECRET_ONE]);
        for header in [
            format!("v1={SIG_ONE}"),             // no timestamp
            format!("t={T}"),                    // no v1
            format!("t={T},v0={SIG_ONE}"),       // only a scheme we ignore
            format!("t=yesterday,v1={SIG_ONE}"), // timestamp not a number
            format!("t={T},v1=not-hex"),         // signature not hex
            format!("sha256={SIG_ONE}"),         // another provider's format
            String::new(),
        ] {
            assert_eq!(code(verify(&s, &signed(&header), BODY.as_bytes(), T)), "invalid_signature", "{header}");
        }
        assert_eq!(code(verify(&s, &headers(&[]), BODY.as_bytes(), T)), "missing_signature");
    }

    #[test]
    fn stale_and_future_timestamps_are_refused() {
        let s = spec(Kind::Stripe, &[SECRET_ONE]);
        let h = signed(&format!("t={T},v1={SIG_ONE}"));
        assert!(verify(&s, &h, BODY.as_bytes(), T + 300).is_ok());
        assert!(verify(&s, &h, BODY.as_bytes(), T - 300).is_ok());
        assert_eq!(code(verify(&s, &h, BODY.as_bytes(), T + 301)), "timestamp_out_of_tolerance");
        assert_eq!(code(verify(&s, &h, BODY.as_bytes(), T - 301)), "timestamp_out_of_tolerance");
        let mut tight = s.clone();
        tight.tolerance_secs = Some(5);
        assert_eq!(code(verify(&tight, &h, BODY.as_bytes(), T + 6)), "timestamp_out_of_tolerance");
    }

    #[test]
    fn either_of_two_rotated_secrets_is_accepted() {
        let s = spec(Kind::Stripe, &[SECRET_ONE, SECRET_TWO]);
        for sig in [SIG_ONE, SIG_TWO] {
            let h = signed(&format!("t={T},v1={sig}"));
            assert!(verify(&s, &h, BODY.as_bytes(), T).is_ok(), "{sig}");
        }
    }

    #[test]
    fn any_v1_entry_may_match_and_other_schemes_are_ignored() {
        let s = spec(Kind::Stripe, &[SECRET_ONE]);
        let h = signed(&format!("t={T},v1={SIG_OTHER},v0={SIG_OTHER},v1={SIG_ONE}"));
        assert!(verify(&s, &h, BODY.as_bytes(), T).is_ok());
        let none_match = signed(&format!("t={T},v1={SIG_OTHER},v0={SIG_ONE}"));
        assert_eq!(code(verify(&s, &none_match, BODY.as_bytes(), T)), "invalid_signature");
    }

    #[test]
    fn body_without_id_is_malformed_unless_the_key_is_overridden() {
        let mut s = spec(Kind::Stripe, &[SECRET_ONE]);
        let h = signed(&format!("t={T},v1={NO_ID_SIG}"));
        assert_eq!(code(verify(&s, &h, NO_ID_BODY.as_bytes(), T)), "malformed_body");
        s.dedupe = pointer_locator("/data/object/id");
        let v = verify(&s, &h, NO_ID_BODY.as_bytes(), T).unwrap();
        assert_eq!(v.dedupe_key, body_sha256_hex(NO_ID_BODY.as_bytes()));
        assert_eq!(v.event_type, "charge.succeeded");
    }

    #[test]
    fn locators_override_the_defaults() {
        let mut s = spec(Kind::Stripe, &[SECRET_ONE]);
        s.dedupe = pointer_locator("/data/object/id");
        s.event_type = pointer_locator("/object");
        let h = signed(&format!("t={T},v1={SIG_ONE}"));
        let v = verify(&s, &h, BODY.as_bytes(), T).unwrap();
        assert_eq!(v.dedupe_key, "pi_3PqRsT");
        assert_eq!(v.event_type, "event");
    }
}
