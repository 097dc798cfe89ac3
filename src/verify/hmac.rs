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
        _now_unix: i64,
    ) -> Result<Verified, VerifyError> {
        // `validate_spec` refuses this; failing closed covers a spec stored before it did.
        let scheme = spec.hmac.as_ref().ok_or_else(|| {
            VerifyError::InvalidSignature("source of kind hmac has no hmac settings".to_owned())
        })?;
        let header = required_header(headers, &scheme.header)?;
        let encoded = match scheme.prefix.as_deref().filter(|p| !p.is_empty()) {
            None => Some(header),
            // Case-insensitive: senders disagree on `sha256=` versus `SHA256=`.
            Some(prefix) => header
                .get(..prefix.len())
                .filter(|head| head.eq_ignore_ascii_case(prefix))
                .and_then(|_| header.get(prefix.len()..)),
        }
        .ok_or_else(|| {
            VerifyError::InvalidSignature(format!("{} lacks the configured prefix", scheme.header))
        })?;
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
        check_any(
            scheme.algorithm,
            &verbatim_keys(spec),
            &[body],
            &[signature],
        )?;

        let mut json = LazyJson::new(body);
        let dedupe_key =
            locate(&spec.dedupe, headers, &mut json).unwrap_or_else(|| body_sha256_hex(body));
        let event_type =
            locate(&spec.event_type, headers, &mut json).unwrap_or_else(unknown_event_type);
        Ok(Verified {
            dedupe_key,
            event_type,
            challenge: None,
        })
    }
}
