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
    fn pointers(&self) -> &'static [&'static str] {
        &["/action"]
    }

    fn verify(
        &self,
        spec: &SourceSpec,
        headers: &HeaderMap,
        body: &[u8],
        json: &mut LazyJson,
        _now_unix: i64,
    ) -> Result<Verified, VerifyError> {
        let header = required_header(headers, SIGNATURE_HEADER)?;
        let signature = header
            .strip_prefix("sha256=")
            .and_then(decode_hex)
            .ok_or_else(|| VerifyError::InvalidSignature(format!("{SIGNATURE_HEADER} is not sha256=<hex>")))?;
        check_any(HmacAlgorithm::Sha256, &verbatim_keys(spec), &[body], &[signature])?;

        let dedupe_key = resolve(&spec.dedupe, headers, json, |_| header_string(headers, DELIVERY_HEADER))?
            .unwrap_or_else(|| body_sha256_hex(body));
        let event_type = resolve(&spec.event_type, headers, json, |json| {
            let Some(event) = header_string(headers, EVENT_HEADER)? else { return Ok(None) };
            let action = json.value_at("/action");
            let action = action.as_ref().and_then(Value::as_str).filter(|a| !a.is_empty());
            Ok(Some(match action {
                Some(action) => format!("{event}.{action}"),
                None => event,
            }))
        })?
        .unwrap_or_else(unknown_event_type);
        Ok(Verified { dedupe_key, event_type, challenge: None, ordering_key: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::test_util::{code, header_locator, headers, pointer_locator, spec};
    use crate::verify::{Kind, verify};

    // GitHub's published test values ("Validating webhook deliveries", section "Testing
    // the webhook payload validation"): secret `It's a Secret to Everybody`, payload
    // `Hello, World!`.
    const DOC_SECRET: &str = "It's a Secret to Everybody";
    const DOC_BODY: &str = "Hello, World!";
    const DOC_HEADER: &str = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
    // DOC_BODY under a second secret, computed outside this crate:
    //   printf '%s' 'Hello, World!' | openssl dgst -sha256 -hmac 'second-github-secret'
    // (same result from Python's hmac.new(key, msg, hashlib.sha256).hexdigest()).
    const SECOND_SECRET: &str = "second-github-secret";
    const SECOND_HEADER: &str = "sha256=08337244a1549aec6ebd0646b85fa58adb5eccd8e299f6f70b0d4df6d86ccfef";
    // printf '%s' '{"action":"opened","number":7}' |
    //   openssl dgst -sha256 -hmac "It's a Secret to Everybody"
    const PR_BODY: &str = r#"{"action":"opened","number":7}"#;
    const PR_HEADER: &str = "sha256=34fd4221cb1c8b95d142c6dc81775bb15fcd403d46608fdf114c11b6a0f525c5";
    const DELIVERY: &str = "72d3162e-cc78-11e3-81ab-4c9367dc0958";

    fn request(signature: &str, event: &str) -> http::HeaderMap {
        headers(&[("X-Hub-Signature-256", signature), ("X-GitHub-Event", event), ("X-GitHub-Delivery", DELIVERY)])
    }

    #[test]
    fn published_example_is_accepted() {
        let v =
            verify(&spec(Kind::Github, &[DOC_SECRET]), &request(DOC_HEADER, "ping"), DOC_BODY.as_bytes(), 0).unwrap();
        assert_eq!(v.dedupe_key, DELIVERY);
        // Not JSON, so there is no action to add.
        assert_eq!(v.event_type, "ping");
    }

    #[test]
    fn action_refines_the_event_header() {
        let v = verify(&spec(Kind::Github, &[DOC_SECRET]), &request(PR_HEADER, "pull_request"), PR_BODY.as_bytes(), 0)
            .unwrap();
        assert_eq!(v.event_type, "pull_request.opened");
    }

    #[test]
    fn wrong_secret_and_tampered_body_are_invalid() {
        let h = request(DOC_HEADER, "ping");
        let wrong = spec(Kind::Github, &["not the secret"]);
        assert_eq!(code(verify(&wrong, &h, DOC_BODY.as_bytes(), 0)), "invalid_signature");
        let right = spec(Kind::Github, &[DOC_SECRET]);
        assert_eq!(code(verify(&right, &h, b"Hello, World?", 0)), "invalid_signature");
    }

    #[test]
    fn malformed_headers_are_invalid_and_absent_is_missing() {
        let s = spec(Kind::Github, &[DOC_SECRET]);
        let bare = DOC_HEADER.trim_start_matches("sha256=");
        for header in [
            bare.to_owned(),        // no prefix
            format!("sha1={bare}"), // the legacy algorithm's prefix
            "sha256=zz".to_owned(), // not hex
            "sha256=".to_owned(),   // empty
        ] {
            assert_eq!(
                code(verify(&s, &request(&header, "ping"), DOC_BODY.as_bytes(), 0)),
                "invalid_signature",
                "{header}"
            );
        }
        // The SHA-1 header alone does not count.
        let legacy = headers(&[("X-Hub-Signature", "sha1=0123")]);
        assert_eq!(code(verify(&s, &legacy, DOC_BODY.as_bytes(), 0)), "missing_signature");
    }

    #[test]
    fn either_of_two_rotated_secrets_is_accepted() {
        let s = spec(Kind::Github, &[SECOND_SECRET, DOC_SECRET]);
        for header in [DOC_HEADER, SECOND_HEADER] {
            assert!(verify(&s, &request(header, "ping"), DOC_BODY.as_bytes(), 0).is_ok());
        }
    }

    #[test]
    fn missing_delivery_and_event_fall_back() {
        let s = spec(Kind::Github, &[DOC_SECRET]);
        let h = headers(&[("X-Hub-Signature-256", PR_HEADER)]);
        let v = verify(&s, &h, PR_BODY.as_bytes(), 0).unwrap();
        assert_eq!(v.dedupe_key, body_sha256_hex(PR_BODY.as_bytes()));
        assert_eq!(v.event_type, "unknown");
    }

    #[test]
    fn locators_override_the_defaults() {
        let mut s = spec(Kind::Github, &[DOC_SECRET]);
        s.dedupe = pointer_locator("/number");
        s.event_type = header_locator("X-GitHub-Hook-Installation-Target-Type");
        let mut h = request(PR_HEADER, "pull_request");
        h.insert("X-GitHub-Hook-Installation-Target-Type", http::HeaderValue::from_static("repository"));
        let v = verify(&s, &h, PR_BODY.as_bytes(), 0).unwrap();
        assert_eq!(v.dedupe_key, "7");
        assert_eq!(v.event_type, "repository");
    }
}
