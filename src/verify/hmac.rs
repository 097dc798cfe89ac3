//! The generic `hmac` kind: one header carrying an HMAC (SHA-256 or SHA-512, hex or
//! base64, after an optional prefix such as `sha256=`) of the raw body, keyed with the
//! secret's bytes as written. No timestamp, so no replay window: the dedupe key is what
//! stops a replay, which is why the source should point `dedupe` at a delivery id.

use http::HeaderMap;

use super::extract::{LazyJson, body_sha256_hex, locate, unknown_event_type};
use super::mac::{check_any, decode_base64, decode_hex, required_header, verbatim_keys};
use super::{SignatureEncoding, SourceSpec, Verified, Verifier, VerifyError};

/// The generic HMAC verifier.
pub(super) struct GenericHmac;

impl Verifier for GenericHmac {
    fn verify(
        &self,
        spec: &SourceSpec,
        headers: &HeaderMap,
        body: &[u8],
        json: &mut LazyJson,
        _now_unix: i64,
    ) -> Result<Verified, VerifyError> {
        // `validate_spec` refuses this; failing closed covers a spec stored before it did.
        let scheme = spec
            .hmac
            .as_ref()
            .ok_or_else(|| VerifyError::InvalidSignature("source of kind hmac has no hmac settings".to_owned()))?;
        let header = required_header(headers, &scheme.header)?;
        let encoded = match scheme.prefix.as_deref().filter(|p| !p.is_empty()) {
            None => Some(header),
            // Case-insensitive: senders disagree on `sha256=` versus `SHA256=`.
            Some(prefix) => header
                .get(..prefix.len())
                .filter(|head| head.eq_ignore_ascii_case(prefix))
                .and_then(|_| header.get(prefix.len()..)),
        }
        .ok_or_else(|| VerifyError::InvalidSignature(format!("{} lacks the configured prefix", scheme.header)))?;
        let signature = match scheme.encoding {
            SignatureEncoding::Hex => decode_hex(encoded),
            SignatureEncoding::Base64 => decode_base64(encoded),
        }
        .ok_or_else(|| {
            VerifyError::InvalidSignature(format!(
                "{} is not {}",
                scheme.header,
                match scheme.encoding {
                    SignatureEncoding::Hex => "hex",
                    SignatureEncoding::Base64 => "base64",
                }
            ))
        })?;
        check_any(scheme.algorithm, &verbatim_keys(spec), &[body], &[signature])?;

        let dedupe_key = locate(&spec.dedupe, headers, json)?.unwrap_or_else(|| body_sha256_hex(body));
        let event_type = locate(&spec.event_type, headers, json)?.unwrap_or_else(unknown_event_type);
        Ok(Verified { dedupe_key, event_type, challenge: None, ordering_key: None })
    }
}

#[cfg(test)]
mod tests {
    use crate::verify::test_util::{code, header_locator, headers, pointer_locator, spec};
    use crate::verify::{HmacAlgorithm, HmacScheme, Kind, SignatureEncoding, SourceSpec, body_sha256_hex, verify};

    // Computed outside this crate with OpenSSL and cross-checked with Python's hmac:
    //   printf '%s' "$BODY" | openssl dgst -sha512 -hmac 'generic-secret' -binary | base64 -w0
    //   printf '%s' "$BODY" | openssl dgst -sha256 -hmac 'generic-secret'
    const BODY: &str = r#"{"kind":"order.paid","id":"ord_42"}"#;
    const SECRET: &str = "generic-secret";
    const SHA512_B64: &str = "mQNXH0L/8I1fouFsLcGwHifq3kSmLVL4LYr/X7HES4Jf5+FSSBOe9toV7IxPwMPLBLPOV7taDA0YZYaD9I6Oww==";
    /// Same body, SHA-512 under `generic-secret-2`.
    const SHA512_B64_SECOND: &str =
        "ibZoXNWBVvctkCxe5JWNHIszjSxzg+Y50rW3gJ0yIN5CTJI4ijBZchveTsrAfj/G279a00jQI+PQ8+MdRbU3Lg==";
    const SHA256_HEX: &str = "a3ef716bd5de350d5a88c1f4b94d7dbdbbde535fd618daf5418f70eaddebe3f5";

    fn sha512_spec(secrets: &[&str]) -> SourceSpec {
        let mut s = spec(Kind::Hmac, secrets);
        s.hmac = Some(HmacScheme {
            header: "X-Signature".to_owned(),
            algorithm: HmacAlgorithm::Sha512,
            encoding: SignatureEncoding::Base64,
            prefix: Some("sha512=".to_owned()),
        });
        s
    }

    fn sha256_hex_spec() -> SourceSpec {
        let mut s = spec(Kind::Hmac, &[SECRET]);
        s.hmac = Some(HmacScheme {
            header: "X-Hook-Sig".to_owned(),
            algorithm: HmacAlgorithm::Sha256,
            encoding: SignatureEncoding::Hex,
            prefix: None,
        });
        s
    }

    fn signed(value: &str) -> http::HeaderMap {
        headers(&[("X-Signature", value)])
    }

    #[test]
    fn sha512_base64_with_prefix_is_accepted() {
        let h = signed(&format!("sha512={SHA512_B64}"));
        let v = verify(&sha512_spec(&[SECRET]), &h, BODY.as_bytes(), 0).unwrap();
        // No locators: content hash and unknown.
        assert_eq!(v.dedupe_key, body_sha256_hex(BODY.as_bytes()));
        assert_eq!(v.event_type, "unknown");
        // Prefix case does not matter, padding is optional.
        let h = signed(&format!("SHA512={}", SHA512_B64.trim_end_matches('=')));
        assert!(verify(&sha512_spec(&[SECRET]), &h, BODY.as_bytes(), 0).is_ok());
    }

    #[test]
    fn sha256_hex_without_prefix_is_accepted() {
        let h = headers(&[("X-Hook-Sig", SHA256_HEX)]);
        assert!(verify(&sha256_hex_spec(), &h, BODY.as_bytes(), 0).is_ok());
        let upper = headers(&[("X-Hook-Sig", &SHA256_HEX.to_uppercase())]);
        assert!(verify(&sha256_hex_spec(), &upper, BODY.as_bytes(), 0).is_ok());
    }

    #[test]
    fn wrong_secret_and_tampered_body_are_invalid() {
        let h = signed(&format!("sha512={SHA512_B64}"));
        assert_eq!(code(verify(&sha512_spec(&["wrong"]), &h, BODY.as_bytes(), 0)), "invalid_signature");
        assert_eq!(code(verify(&sha512_spec(&[SECRET]), &h, b"{}", 0)), "invalid_signature");
    }

    #[test]
    fn wrong_formats_are_invalid_and_absent_is_missing() {
        let s = sha512_spec(&[SECRET]);
        for value in [
            SHA512_B64.to_owned(),          // prefix missing
            format!("sha256={SHA512_B64}"), // another prefix
            "sha512=***".to_owned(),        // not base64
            format!("sha512={SHA256_HEX}"), // the SHA-256 MAC
            "sha512=".to_owned(),
        ] {
            assert_eq!(code(verify(&s, &signed(&value), BODY.as_bytes(), 0)), "invalid_signature", "{value}");
        }
        let h = headers(&[("X-Other", "sha512=x")]);
        assert_eq!(code(verify(&s, &h, BODY.as_bytes(), 0)), "missing_signature");
        let hex_given_base64 = headers(&[("X-Hook-Sig", SHA512_B64)]);
        assert_eq!(code(verify(&sha256_hex_spec(), &hex_given_base64, BODY.as_bytes(), 0)), "invalid_signature");
    }

    #[test]
    fn either_of_two_rotated_secrets_is_accepted() {
        let s = sha512_spec(&[SECRET, "generic-secret-2"]);
        for sig in [SHA512_B64, SHA512_B64_SECOND] {
            let h = signed(&format!("sha512={sig}"));
            assert!(verify(&s, &h, BODY.as_bytes(), 0).is_ok(), "{sig}");
        }
    }

    #[test]
    fn locators_give_the_key_and_type() {
        let mut s = sha512_spec(&[SECRET]);
        s.dedupe = header_locator("X-Request-Id");
        s.event_type = pointer_locator("/kind");
        let mut h = signed(&format!("sha512={SHA512_B64}"));
        h.insert("x-request-id", http::HeaderValue::from_static("req-9"));
        let v = verify(&s, &h, BODY.as_bytes(), 0).unwrap();
        assert_eq!(v.dedupe_key, "req-9");
        assert_eq!(v.event_type, "order.paid");
        // A configured header that is absent falls back to the body hash.
        let h = signed(&format!("sha512={SHA512_B64}"));
        let v = verify(&s, &h, BODY.as_bytes(), 0).unwrap();
        assert_eq!(v.dedupe_key, body_sha256_hex(BODY.as_bytes()));
    }

    #[test]
    fn missing_settings_or_secrets_fail_closed() {
        let h = signed(&format!("sha512={SHA512_B64}"));
        let no_settings = spec(Kind::Hmac, &[SECRET]);
        assert_eq!(code(verify(&no_settings, &h, BODY.as_bytes(), 0)), "invalid_signature");
        // An empty secret is never a key: anyone could sign with it. This is the body's
        // HMAC-SHA512 under the empty key, which must still be refused:
        //   python3 -c 'import hmac,hashlib,base64,sys; print(base64.b64encode(
        //     hmac.new(b"", sys.argv[1].encode(), hashlib.sha512).digest()).decode())' "$BODY"
        let empty_key_sig = "885036bTDlECOrBUCQ52B6dStrJPX7NYYplZPKPXKaK0ITw51/wUhOO1kFctoTr/EPfkwHC8g9dMICwA+oEaBg==";
        let h = signed(&format!("sha512={empty_key_sig}"));
        assert_eq!(code(verify(&sha512_spec(&[""]), &h, BODY.as_bytes(), 0)), "invalid_signature");
    }
}
