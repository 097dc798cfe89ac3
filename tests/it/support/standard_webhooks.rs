//! An independent Standard Webhooks verifier, written from the spec for the tests (it
//! shares no code with the gateway's signer), checked against the published vector.

use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Whether any `v1,` entry of `signature_header` is a valid signature of
/// `{id}.{timestamp}.{body}` under `secret` (`whsec_<base64 key>`).
pub fn verify(secret: &str, id: &str, timestamp: &str, body: &[u8], signature_header: &str) -> bool {
    let b64 = base64::engine::general_purpose::STANDARD;
    let Ok(key) = b64.decode(secret.trim_start_matches("whsec_")) else { return false };
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("hmac key");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    let expected = b64.encode(mac.finalize().into_bytes());
    signature_header.split(' ').filter_map(|entry| entry.strip_prefix("v1,")).any(|sig| sig == expected)
}

#[test]
fn the_test_verifier_accepts_the_published_vector() {
    assert!(verify(
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "1614265330",
        br#"{"test": 2432232314}"#,
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    ));
    assert!(!verify(
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "1614265331",
        br#"{"test": 2432232314}"#,
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    ));
}
