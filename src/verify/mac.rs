//! Pieces shared by the signature-checking kinds: reading signature headers, decoding
//! signatures, the constant-time MAC check over several secrets, and timestamp tolerance.
//!
//! Error messages name headers and schemes, never a secret or a signature value: they end
//! up in API responses and logs that a forger can read.

use base64::Engine as _;
use base64::alphabet;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use hmac::digest::KeyInit;
use hmac::{Hmac, Mac};
use http::HeaderMap;
use sha2::{Sha256, Sha512};

use super::{DEFAULT_TOLERANCE_SECS, HmacAlgorithm, SourceSpec, VerifyError};

/// Standard-alphabet base64 that accepts input with or without padding: senders differ and
/// the padding carries no information.
const BASE64_LENIENT: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Decode standard base64, padding optional.
pub(crate) fn decode_base64(text: &str) -> Option<Vec<u8>> {
    BASE64_LENIENT.decode(text.trim()).ok()
}

/// Decode hexadecimal, either case.
pub(crate) fn decode_hex(text: &str) -> Option<Vec<u8>> {
    hex::decode(text.trim()).ok()
}

/// A signature header's value. Absent is `MissingSignature`; present but not visible ASCII
/// is `InvalidSignature` (it cannot hold any signature format we know).
pub(crate) fn required_header<'a>(headers: &'a HeaderMap, name: &str) -> Result<&'a str, VerifyError> {
    let value = headers.get(name).ok_or_else(|| VerifyError::MissingSignature(format!("header {name} is absent")))?;
    value
        .to_str()
        .map(str::trim)
        .map_err(|_| VerifyError::InvalidSignature(format!("header {name} is not visible ASCII")))
}

/// The spec's secrets as key bytes, used verbatim. Empty secrets are skipped: an empty
/// HMAC key is one every forger knows.
pub(crate) fn verbatim_keys(spec: &SourceSpec) -> Vec<&[u8]> {
    spec.secrets.iter().filter(|s| !s.is_empty()).map(|s| s.as_bytes()).collect()
}

/// Accept when the MAC of `message` (the concatenation of its parts) under any key equals
/// any candidate signature.
///
/// Each comparison is constant-time (`Mac::verify_slice`); trying keys and candidates in
/// turn only reveals which one matched, which is no secret. No usable key fails closed.
pub(crate) fn check_any<K: AsRef<[u8]>>(
    algorithm: HmacAlgorithm,
    keys: &[K],
    message: &[&[u8]],
    candidates: &[Vec<u8>],
) -> Result<(), VerifyError> {
    if keys.is_empty() {
        return Err(VerifyError::InvalidSignature("source has no usable secret".to_owned()));
    }
    let matched = keys.iter().any(|key| match algorithm {
        HmacAlgorithm::Sha256 => matches::<Hmac<Sha256>>(key.as_ref(), message, candidates),
        HmacAlgorithm::Sha512 => matches::<Hmac<Sha512>>(key.as_ref(), message, candidates),
    });
    if matched { Ok(()) } else { Err(VerifyError::InvalidSignature("no signature matches any secret".to_owned())) }
}

fn matches<M: Mac + KeyInit + Clone>(key: &[u8], message: &[&[u8]], candidates: &[Vec<u8>]) -> bool {
    // HMAC takes keys of any length, so this only fails for MACs we do not use.
    let Ok(mut mac) = <M as KeyInit>::new_from_slice(key) else {
        return false;
    };
    for part in message {
        mac.update(part);
    }
    candidates.iter().any(|candidate| mac.clone().verify_slice(candidate).is_ok())
}

/// Parse a signed unix timestamp. Only ASCII digits: a sign or spaces inside would let two
/// spellings of one instant carry different signatures.
pub(crate) fn parse_timestamp(raw: &str, what: &str) -> Result<i64, VerifyError> {
    if raw.is_empty() || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return Err(VerifyError::InvalidSignature(format!("{what} is not a unix timestamp")));
    }
    raw.parse().map_err(|_| VerifyError::InvalidSignature(format!("{what} is out of range")))
}

/// Refuse a timestamp further than the spec's tolerance from `now_unix`, in either
/// direction: a far-future timestamp would stay replayable for that long.
pub(crate) fn check_tolerance(spec: &SourceSpec, timestamp: i64, now_unix: i64) -> Result<(), VerifyError> {
    let tolerance = spec.tolerance_secs.unwrap_or(DEFAULT_TOLERANCE_SECS);
    // i128 so that no pair of i64 values can overflow the difference.
    let skew = i128::from(now_unix) - i128::from(timestamp);
    if skew.unsigned_abs() <= u128::from(tolerance) {
        return Ok(());
    }
    let direction = if skew > 0 { "old" } else { "in the future" };
    Err(VerifyError::TimestampOutOfTolerance(format!(
        "signed timestamp is {} s {direction}; tolerance is {tolerance} s",
        skew.unsigned_abs()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::{Kind, Locator};

    fn spec(tolerance: Option<u64>) -> SourceSpec {
        SourceSpec {
            kind: Kind::Hmac,
            secrets: vec![],
            tolerance_secs: tolerance,
            dedupe: Locator::default(),
            event_type: Locator::default(),
            ordering_key: Locator::default(),
            hmac: None,
        }
    }

    #[test]
    fn tolerance_is_inclusive_and_symmetric() {
        let s = spec(None);
        assert!(check_tolerance(&s, 1000, 1300).is_ok());
        assert!(check_tolerance(&s, 1300, 1000).is_ok());
        assert!(matches!(check_tolerance(&s, 1000, 1301), Err(VerifyError::TimestampOutOfTolerance(_))));
        assert!(matches!(check_tolerance(&s, 1301, 1000), Err(VerifyError::TimestampOutOfTolerance(_))));
        assert!(check_tolerance(&spec(Some(10)), 1000, 1011).is_err());
        // Extreme values must not overflow.
        assert!(check_tolerance(&s, i64::MAX, i64::MIN).is_err());
    }

    #[test]
    fn timestamps_are_plain_digits() {
        assert_eq!(parse_timestamp("1700000000", "t"), Ok(1_700_000_000));
        for bad in ["", "+1700000000", "-1", "17e8", "1 7", "99999999999999999999"] {
            assert!(matches!(parse_timestamp(bad, "t"), Err(VerifyError::InvalidSignature(_))), "{bad:?}");
        }
    }

    #[test]
    fn base64_padding_is_optional() {
        assert_eq!(decode_base64("YWJjZA==").as_deref(), Some(&b"abcd"[..]));
        assert_eq!(decode_base64("YWJjZA").as_deref(), Some(&b"abcd"[..]));
        assert_eq!(decode_base64("not base64!"), None);
    }

    #[test]
    fn no_usable_key_fails_closed() {
        let keys: [&[u8]; 0] = [];
        assert!(matches!(
            check_any(HmacAlgorithm::Sha256, &keys, &[b"x"], &[vec![0; 32]]),
            Err(VerifyError::InvalidSignature(_))
        ));
    }
}
