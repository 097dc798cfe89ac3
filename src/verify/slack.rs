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
use super::mac::{check_any, check_tolerance, decode_hex, parse_timestamp, required_header, verbatim_keys};
use super::{HmacAlgorithm, SourceSpec, Verified, Verifier, VerifyError};

const SIGNATURE_HEADER: &str = "X-Slack-Signature";
const TIMESTAMP_HEADER: &str = "X-Slack-Request-Timestamp";

/// The Slack verifier.
pub(super) struct Slack;

impl Verifier for Slack {
    fn pointers(&self) -> &'static [&'static str] {
        &["/type", "/challenge", "/event_id", "/event/type"]
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
        let raw_timestamp = required_header(headers, TIMESTAMP_HEADER)?;
        let signature = header
            .strip_prefix("v0=")
            .and_then(decode_hex)
            .ok_or_else(|| VerifyError::InvalidSignature(format!("{SIGNATURE_HEADER} is not v0=<hex>")))?;
        let timestamp = parse_timestamp(raw_timestamp, TIMESTAMP_HEADER)?;
        check_any(
            HmacAlgorithm::Sha256,
            &verbatim_keys(spec),
            &[b"v0:", raw_timestamp.as_bytes(), b":", body],
            &[signature],
        )?;
        check_tolerance(spec, timestamp, now_unix)?;

        let body_type = json.pointer("/type")?;
        if body_type.as_deref() == Some("url_verification") {
            let challenge = json
                .pointer("/challenge")?
                .ok_or_else(|| VerifyError::MalformedBody("url_verification has no challenge".to_owned()))?;
            return Ok(Verified {
                dedupe_key: body_sha256_hex(body),
                event_type: "url_verification".to_owned(),
                challenge: Some(challenge),
                ordering_key: None,
            });
        }

        let dedupe_key = if spec.dedupe.is_empty() {
            match json.pointer("/event_id")? {
                Some(id) => id,
                None if body_type.as_deref() == Some("event_callback") => {
                    return Err(VerifyError::MalformedBody("Slack event_callback has no event_id".to_owned()));
                }
                None => body_sha256_hex(body),
            }
        } else {
            locate(&spec.dedupe, headers, json)?.unwrap_or_else(|| body_sha256_hex(body))
        };
        let event_type =
            resolve(&spec.event_type, headers, json, |json| Ok(json.pointer("/event/type")?.or(body_type)))?
                .unwrap_or_else(unknown_event_type);
        Ok(Verified { dedupe_key, event_type, challenge: None, ordering_key: None })
    }
}

#[cfg(test)]
mod tests {
    use crate::verify::test_util::{code, header_locator, headers, pointer_locator, spec};
    use crate::verify::{Kind, body_sha256_hex, verify};

    // Slack's worked example ("Verifying requests from Slack"): a slash command,
    // form-encoded, signed at 1531420618 with the signing secret below.
    const DOC_SECRET: &str = "8f742231b10e8888abcd99yyyzzz85a5";
    const DOC_TS: &str = "1531420618";
    const DOC_BODY: &str = "token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
    const DOC_SIG: &str = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503";

    // The rest were computed outside this crate, e.g.
    //   printf '%s' "v0:1700000000:$BODY" | openssl dgst -sha256 -hmac "$SECRET"
    // and cross-checked with Python's hmac.new(secret, msg, hashlib.sha256).hexdigest().
    const TS: i64 = 1_700_000_000;
    const EVENT_BODY: &str =
        r#"{"type":"event_callback","event_id":"Ev08MFMKH6","event":{"type":"app_mention","text":"hi"}}"#;
    /// EVENT_BODY at TS under DOC_SECRET.
    const EVENT_SIG: &str = "v0=cd2ffc598068a4be92af3ee11f41e74da36af896879f9200f9f2356580811471";
    /// EVENT_BODY at TS under `second-slack-signing-secret`.
    const EVENT_SIG_SECOND: &str = "v0=de7a126bdf76785dbaaed21e052e7205ba92621d6b61ea7090c59e0a25e2c9c6";
    /// Slack's documented url_verification body, at TS under DOC_SECRET.
    const CHALLENGE_BODY: &str = r#"{"token":"Jhj5dZrVaK7ZwHHjRyZWjbDl","challenge":"3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P","type":"url_verification"}"#;
    const CHALLENGE_SIG: &str = "v0=76c303eba32e8ec5639c84f822b2c64cdb1ea7e94fdd6d7b0b958d8e40c0959f";
    /// An event_callback without event_id, at TS under DOC_SECRET.
    const NO_ID_BODY: &str = r#"{"type":"event_callback","event":{"type":"app_mention"}}"#;
    const NO_ID_SIG: &str = "v0=a26c279d1cb3398a35a4c509f20523b2c5e109184463f759ec2abd4017d47bf7";

    fn request(signature: &str, timestamp: &str) -> http::HeaderMap {
        headers(&[("X-Slack-Signature", signature), ("X-Slack-Request-Timestamp", timestamp)])
    }

    fn ts() -> String {
        TS.to_string()
    }

    #[test]
    fn published_example_is_accepted() {
        let s = spec(Kind::Slack, &[DOC_SECRET]);
        let now = 1_531_420_618 + 60;
        let v = verify(&s, &request(DOC_SIG, DOC_TS), DOC_BODY.as_bytes(), now).unwrap();
        // A slash command has no event id: deduplicated by content.
        assert_eq!(v.dedupe_key, body_sha256_hex(DOC_BODY.as_bytes()));
        assert_eq!(v.event_type, "unknown");
        assert_eq!(v.challenge, None);
    }

    #[test]
    fn event_callback_is_accepted_and_event_extracted() {
        let s = spec(Kind::Slack, &[DOC_SECRET]);
        let v = verify(&s, &request(EVENT_SIG, &ts()), EVENT_BODY.as_bytes(), TS).unwrap();
        assert_eq!(v.dedupe_key, "Ev08MFMKH6");
        assert_eq!(v.event_type, "app_mention");
        assert_eq!(v.challenge, None);
    }

    #[test]
    fn url_verification_returns_the_challenge_after_the_signature_check() {
        let s = spec(Kind::Slack, &[DOC_SECRET]);
        let v = verify(&s, &request(CHALLENGE_SIG, &ts()), CHALLENGE_BODY.as_bytes(), TS).unwrap();
        assert_eq!(v.challenge.as_deref(), Some("3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"));
        assert_eq!(v.event_type, "url_verification");
        // Unsigned, it is refused like anything else.
        let forged = request(EVENT_SIG, &ts());
        assert_eq!(code(verify(&s, &forged, CHALLENGE_BODY.as_bytes(), TS)), "invalid_signature");
    }

    #[test]
    fn event_callback_without_event_id_is_malformed() {
        let s = spec(Kind::Slack, &[DOC_SECRET]);
        let h = request(NO_ID_SIG, &ts());
        assert_eq!(code(verify(&s, &h, NO_ID_BODY.as_bytes(), TS)), "malformed_body");
    }

    #[test]
    fn wrong_secret_and_tampered_body_are_invalid() {
        let h = request(EVENT_SIG, &ts());
        let wrong = spec(Kind::Slack, &["wrong"]);
        assert_eq!(code(verify(&wrong, &h, EVENT_BODY.as_bytes(), TS)), "invalid_signature");
        let right = spec(Kind::Slack, &[DOC_SECRET]);
        let tampered = EVENT_BODY.replace("hi", "ho");
        assert_eq!(code(verify(&right, &h, tampered.as_bytes(), TS)), "invalid_signature");
        // The timestamp is signed: moving it breaks the signature.
        let moved = request(EVENT_SIG, &(TS + 1).to_string());
        assert_eq!(code(verify(&right, &moved, EVENT_BODY.as_bytes(), TS)), "invalid_signature");
    }

    #[test]
    fn malformed_headers_are_invalid_and_absent_is_missing() {
        let s = spec(Kind::Slack, &[DOC_SECRET]);
        let bare = EVENT_SIG.trim_start_matches("v0=");
        for (sig, timestamp) in [
            (bare.to_owned(), ts()),
            (format!("v1={bare}"), ts()),
            ("v0=xyz".to_owned(), ts()),
            (EVENT_SIG.to_owned(), "soon".to_owned()),
            (EVENT_SIG.to_owned(), "-1700000000".to_owned()),
        ] {
            assert_eq!(
                code(verify(&s, &request(&sig, &timestamp), EVENT_BODY.as_bytes(), TS)),
                "invalid_signature",
                "{sig} {timestamp}"
            );
        }
        let no_sig = headers(&[("X-Slack-Request-Timestamp", "1700000000")]);
        let no_ts = headers(&[("X-Slack-Signature", EVENT_SIG)]);
        for h in [no_sig, no_ts] {
            assert_eq!(code(verify(&s, &h, EVENT_BODY.as_bytes(), TS)), "missing_signature");
        }
    }

    #[test]
    fn stale_and_future_timestamps_are_refused() {
        let s = spec(Kind::Slack, &[DOC_SECRET]);
        let h = request(EVENT_SIG, &ts());
        let body = EVENT_BODY.as_bytes();
        assert!(verify(&s, &h, body, TS + 300).is_ok());
        assert_eq!(code(verify(&s, &h, body, TS + 301)), "timestamp_out_of_tolerance");
        assert_eq!(code(verify(&s, &h, body, TS - 301)), "timestamp_out_of_tolerance");
        // The published example is years old by now.
        let doc = request(DOC_SIG, DOC_TS);
        assert_eq!(code(verify(&s, &doc, DOC_BODY.as_bytes(), TS)), "timestamp_out_of_tolerance");
    }

    #[test]
    fn either_of_two_rotated_secrets_is_accepted() {
        let s = spec(Kind::Slack, &["second-slack-signing-secret", DOC_SECRET]);
        for sig in [EVENT_SIG, EVENT_SIG_SECOND] {
            assert!(verify(&s, &request(sig, &ts()), EVENT_BODY.as_bytes(), TS).is_ok());
        }
    }

    #[test]
    fn locators_override_the_defaults() {
        let mut s = spec(Kind::Slack, &[DOC_SECRET]);
        s.dedupe = header_locator("X-Slack-Request-Timestamp");
        s.event_type = pointer_locator("/type");
        let v = verify(&s, &request(EVENT_SIG, &ts()), EVENT_BODY.as_bytes(), TS).unwrap();
        assert_eq!(v.dedupe_key, ts());
        assert_eq!(v.event_type, "event_callback");
        // With the key overridden, a missing event_id is no longer an error.
        let h = request(NO_ID_SIG, &ts());
        assert!(verify(&s, &h, NO_ID_BODY.as_bytes(), TS).is_ok());
    }
}
