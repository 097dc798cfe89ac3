//! Outbound signatures, per Standard Webhooks: `webhook-signature: v1,<base64 HMAC-SHA256
//! of "{webhook-id}.{webhook-timestamp}.{body}">`, keyed with the base64-decoded part of
//! the endpoint's `whsec_` secret. Any Standard Webhooks library verifies it.

use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::verify::decode_standard_secret;

/// The `webhook-signature` value: one `v1,` entry per secret, space-separated (during a
/// secret rotation the request is signed with both, as the spec allows). Secrets that do
/// not decode are skipped; `None` if none does.
pub fn signature_header(secrets: &[&str], webhook_id: &str, timestamp: i64, body: &[u8]) -> Option<String> {
    let timestamp = timestamp.to_string();
    let mut header = String::new();
    for key in secrets.iter().filter_map(|secret| decode_standard_secret(secret)) {
        if !header.is_empty() {
            header.push(' ');
        }
        header.push_str("v1,");
        base64::engine::general_purpose::STANDARD.encode_string(sign(&key, webhook_id, &timestamp, body), &mut header);
    }
    (!header.is_empty()).then_some(header)
}

/// HMAC-SHA256 of `{webhook_id}.{timestamp}.{body}`.
fn sign(key: &[u8], webhook_id: &str, timestamp: &str, body: &[u8]) -> impl AsRef<[u8]> {
    #[allow(clippy::expect_used)]
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC accepts keys of any length");
    mac.update(webhook_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    mac.finalize().into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Standard Webhooks reference libraries' published test vector.
    #[test]
    fn reproduces_the_published_test_vector() {
        let header = signature_header(
            &["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"],
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(header.as_deref(), Some("v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="));
    }

    #[test]
    fn rotation_signs_with_every_secret_and_skips_broken_ones() {
        let header = signature_header(
            &["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_!!!", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"],
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        )
        .unwrap();
        let entries: Vec<&str> = header.split(' ').collect();
        assert_eq!(entries.len(), 2);
        assert!(entries.iter().all(|e| *e == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="));
        assert_eq!(signature_header(&["whsec_!!!"], "id", 1, b""), None);
    }
}
