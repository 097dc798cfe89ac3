//! Standard Webhooks (<https://www.standardwebhooks.com>): `webhook-id`,
//! `webhook-timestamp`, and `webhook-signature`, a space-separated list of
//! `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">` entries (several while the
//! sender rotates its key). Other versions, such as the asymmetric `v1a`, are ignored.
//!
//! The secret is `whsec_<base64>` and the HMAC key is the *decoded* bytes after the
//! prefix; a secret without the prefix is decoded too, as the reference libraries do.
//!
//! Svix, and the providers that send through it (Clerk, Resend and others), sign the same
//! way and name the headers `svix-id`, `svix-timestamp` and `svix-signature`: a request
//! without `webhook-id` and with `svix-id` is read by those names.

use http::HeaderMap;

use super::extract::{LazyJson, body_sha256_hex, resolve, unknown_event_type};
use super::mac::{check_any, check_tolerance, decode_base64, parse_timestamp, required_header};
use super::{HmacAlgorithm, SourceSpec, Verified, Verifier, VerifyError};

/// The three headers (id, timestamp, signature) by Standard Webhooks' names, then Svix's.
const HEADER_NAMES: [[&str; 3]; 2] =
    [["webhook-id", "webhook-timestamp", "webhook-signature"], ["svix-id", "svix-timestamp", "svix-signature"]];

/// The names `headers` use: Svix's when it sends `svix-id` and no `webhook-id`, otherwise
/// Standard Webhooks' (whose names the errors then give).
fn header_names(headers: &HeaderMap) -> [&'static str; 3] {
    let [standard, svix] = HEADER_NAMES;
    if !headers.contains_key(standard[0]) && headers.contains_key(svix[0]) { svix } else { standard }
}

/// The Standard Webhooks verifier.
pub(super) struct StandardWebhooks;

/// The HMAC key of a Standard Webhooks secret, or `None` if it is not base64 (or empty).
pub fn decode_secret(secret: &str) -> Option<Vec<u8>> {
    let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
    decode_base64(encoded).filter(|key| !key.is_empty())
}

impl Verifier for StandardWebhooks {
    fn pointers(&self) -> &'static [&'static str] {
        &["/type"]
    }

    fn verify(
        &self,
        spec: &SourceSpec,
        headers: &HeaderMap,
        body: &[u8],
        json: &mut LazyJson,
        now_unix: i64,
    ) -> Result<Verified, VerifyError> {
        let [id_header, timestamp_header, signature_header] = header_names(headers);
        let id = required_header(headers, id_header)?;
        let raw_timestamp = required_header(headers, timestamp_header)?;
        let header = required_header(headers, signature_header)?;
        if id.is_empty() {
            return Err(VerifyError::InvalidSignature(format!("{id_header} is empty")));
        }
        let timestamp = parse_timestamp(raw_timestamp, timestamp_header)?;

        let mut v1_entries = 0usize;
        let mut signatures = Vec::new();
        for entry in header.split_whitespace() {
            if let Some(("v1", encoded)) = entry.split_once(',') {
                v1_entries += 1;
                signatures.extend(decode_base64(encoded));
            }
        }
        if v1_entries == 0 {
            return Err(VerifyError::InvalidSignature(format!("{signature_header} has no v1 signature")));
        }
        // A secret that does not decode was refused by `validate_spec`; skipping it here
        // keeps the others working rather than failing the whole source.
        let keys: Vec<Vec<u8>> = spec.secrets.iter().filter_map(|s| decode_secret(s)).collect();
        check_any(
            HmacAlgorithm::Sha256,
            &keys,
            &[id.as_bytes(), b".", raw_timestamp.as_bytes(), b".", body],
            &signatures,
        )?;
        check_tolerance(spec, timestamp, now_unix)?;

        let dedupe_key =
            resolve(&spec.dedupe, headers, json, |_| Ok(Some(id.to_owned())))?.unwrap_or_else(|| body_sha256_hex(body));
        let event_type =
            resolve(&spec.event_type, headers, json, |j| j.pointer("/type"))?.unwrap_or_else(unknown_event_type);
        Ok(Verified { dedupe_key, event_type, challenge: None, ordering_key: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::test_util::{code, header_locator, headers, spec};
    use crate::verify::{Kind, verify};

    // The Standard Webhooks reference libraries' test vector (also used by Svix's
    // libraries' tests): this secret, id, timestamp and body give this signature.
    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TS: &str = "1614265330";
    const NOW: i64 = 1_614_265_330;
    const BODY: &str = r#"{"test": 2432232314}"#;
    const SIG: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    // A body with a `type`, the spec's example id and timestamp, under SECRET and under a
    // second secret, computed outside this crate with
    //   printf '%s' "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W.1674087231.$BODY" |
    //     openssl dgst -sha256 -mac HMAC -macopt hexkey:$(printf '%s' "${SECRET#whsec_}" |
    //     base64 -d | xxd -p -c 256) -binary | base64 -w0
    // and cross-checked with Python: base64.b64encode(hmac.new(base64.b64decode(s), msg,
    // hashlib.sha256).digest()).
    const TYPED_ID: &str = "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W";
    const TYPED_TS: &str = "1674087231";
    const TYPED_NOW: i64 = 1_674_087_231;
    const TYPED_BODY: &str = r#"{"type":"user.created","data":{"id":"u_1"}}"#;
    const TYPED_SIG: &str = "v1,37tRBK/7bFRN7J3T4PRYNrJS9vxOWiUN4IE+iXFXFfw=";
    /// `printf '%s' 'another-test-secret-key!' | base64`
    const SECOND_SECRET: &str = "whsec_YW5vdGhlci10ZXN0LXNlY3JldC1rZXkh";
    const TYPED_SIG_SECOND: &str = "v1,iqFHzjtK5x9PnzRAjOd9oAHkFXwJVH9QsuECyBuqoWo=";

    fn request(id: &str, ts: &str, signature: &str) -> http::HeaderMap {
        headers(&[("webhook-id", id), ("webhook-timestamp", ts), ("webhook-signature", signature)])
    }

    #[test]
    fn published_vector_is_accepted_with_or_without_the_prefix() {
        for secret in [SECRET, SECRET.trim_start_matches("whsec_")] {
            let v =
                verify(&spec(Kind::StandardWebhooks, &[secret]), &request(ID, TS, SIG), BODY.as_bytes(), NOW).unwrap();
            assert_eq!(v.dedupe_key, ID);
            assert_eq!(v.event_type, "unknown");
        }
    }

    #[test]
    fn svix_s_header_names_are_read_too() {
        let s = spec(Kind::StandardWebhooks, &[SECRET]);
        let svix = headers(&[("svix-id", ID), ("svix-timestamp", TS), ("svix-signature", SIG)]);
        let v = verify(&s, &svix, BODY.as_bytes(), NOW).unwrap();
        assert_eq!(v.dedupe_key, ID);
        // Forged under Svix's names: refused as under the standard ones.
        let forged = headers(&[("svix-id", ID), ("svix-timestamp", TS), ("svix-signature", "v1,bm9wZQ==")]);
        assert_eq!(code(verify(&s, &forged, BODY.as_bytes(), NOW)), "invalid_signature");
        // Neither: the standard names are asked for.
        let err = verify(&s, &headers(&[]), BODY.as_bytes(), NOW).unwrap_err().to_string();
        assert!(err.contains("webhook-id"), "{err}");
    }

    #[test]
    fn typed_body_gives_its_event_type() {
        let s = spec(Kind::StandardWebhooks, &[SECRET]);
        let h = request(TYPED_ID, TYPED_TS, TYPED_SIG);
        let v = verify(&s, &h, TYPED_BODY.as_bytes(), TYPED_NOW).unwrap();
        assert_eq!(v.dedupe_key, TYPED_ID);
        assert_eq!(v.event_type, "user.created");
    }

    #[test]
    fn other_versions_and_bad_entries_in_the_list_are_skipped() {
        let s = spec(Kind::StandardWebhooks, &[SECRET]);
        let list = format!("v1a,hnO3f9T8Ytu9HwrXslvumlUpqtNVqkhqw== v1,bm9wZQ== v1,!!! {SIG}");
        assert!(verify(&s, &request(ID, TS, &list), BODY.as_bytes(), NOW).is_ok());
        let only_v1a = "v1a,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
        assert_eq!(code(verify(&s, &request(ID, TS, only_v1a), BODY.as_bytes(), NOW)), "invalid_signature");
    }

    #[test]
    fn wrong_secret_and_tampered_content_are_invalid() {
        let h = request(ID, TS, SIG);
        let wrong = spec(Kind::StandardWebhooks, &[SECOND_SECRET]);
        assert_eq!(code(verify(&wrong, &h, BODY.as_bytes(), NOW)), "invalid_signature");
        let right = spec(Kind::StandardWebhooks, &[SECRET]);
        let tampered = br#"{"test": 2432232315}"#;
        assert_eq!(code(verify(&right, &h, tampered, NOW)), "invalid_signature");
        // The id and the timestamp are signed too.
        let other_id = request("msg_other", TS, SIG);
        assert_eq!(code(verify(&right, &other_id, BODY.as_bytes(), NOW)), "invalid_signature");
        let other_ts = request(ID, "1614265331", SIG);
        assert_eq!(code(verify(&right, &other_ts, BODY.as_bytes(), NOW)), "invalid_signature");
    }

    #[test]
    fn malformed_headers_are_invalid_and_absent_are_missing() {
        let s = spec(Kind::StandardWebhooks, &[SECRET]);
        let bare = SIG.trim_start_matches("v1,");
        for (ts, sig) in [
            (TS, bare.to_owned()),
            (TS, format!("v1={bare}")),
            (TS, format!("v2,{bare}")),
            (TS, String::new()),
            ("2021-02-26T00:00:00Z", SIG.to_owned()),
        ] {
            assert_eq!(
                code(verify(&s, &request(ID, ts, &sig), BODY.as_bytes(), NOW)),
                "invalid_signature",
                "{ts} {sig}"
            );
        }
        for missing in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
            let pairs: Vec<(&str, &str)> = [("webhook-id", ID), ("webhook-timestamp", TS), ("webhook-signature", SIG)]
                .into_iter()
                .filter(|(name, _)| *name != missing)
                .collect();
            assert_eq!(code(verify(&s, &headers(&pairs), BODY.as_bytes(), NOW)), "missing_signature", "{missing}");
        }
    }

    #[test]
    fn stale_and_future_timestamps_are_refused() {
        let s = spec(Kind::StandardWebhooks, &[SECRET]);
        let h = request(ID, TS, SIG);
        assert!(verify(&s, &h, BODY.as_bytes(), NOW - 300).is_ok());
        assert_eq!(code(verify(&s, &h, BODY.as_bytes(), NOW + 301)), "timestamp_out_of_tolerance");
        assert_eq!(code(verify(&s, &h, BODY.as_bytes(), NOW - 301)), "timestamp_out_of_tolerance");
    }

    #[test]
    fn either_of_two_rotated_secrets_is_accepted() {
        let s = spec(Kind::StandardWebhooks, &[SECRET, SECOND_SECRET]);
        for sig in [TYPED_SIG, TYPED_SIG_SECOND] {
            let h = request(TYPED_ID, TYPED_TS, sig);
            assert!(verify(&s, &h, TYPED_BODY.as_bytes(), TYPED_NOW).is_ok(), "{sig}");
        }
        // A sender signing with both keys at once is accepted by either.
        let both = format!("{TYPED_SIG_SECOND} {TYPED_SIG}");
        let only_first = spec(Kind::StandardWebhooks, &[SECRET]);
        let h = request(TYPED_ID, TYPED_TS, &both);
        assert!(verify(&only_first, &h, TYPED_BODY.as_bytes(), TYPED_NOW).is_ok());
    }

    #[test]
    fn secrets_decode_to_key_bytes() {
        assert_eq!(decode_secret(SECOND_SECRET).as_deref(), Some(&b"another-test-secret-key!"[..]));
        assert_eq!(decode_secret("whsec_"), None);
        assert_eq!(decode_secret("whsec_***"), None);
    }

    #[test]
    fn locators_override_the_defaults() {
        let mut s = spec(Kind::StandardWebhooks, &[SECRET]);
        s.dedupe = header_locator("X-Request-Id");
        s.event_type = header_locator("X-Event");
        let mut h = request(TYPED_ID, TYPED_TS, TYPED_SIG);
        h.insert("x-request-id", http::HeaderValue::from_static("req-1"));
        h.insert("x-event", http::HeaderValue::from_static("custom.type"));
        let v = verify(&s, &h, TYPED_BODY.as_bytes(), TYPED_NOW).unwrap();
        assert_eq!(v.dedupe_key, "req-1");
        assert_eq!(v.event_type, "custom.type");
    }
}
