//! The `none` kind (and `internal`): no signature, only extraction.

use http::HeaderMap;

use super::extract::{LazyJson, body_sha256_hex, locate};
use super::{SourceSpec, Verified, Verifier, VerifyError};

/// The verifier of kinds that check no signature.
pub(super) struct NoSignature;

impl Verifier for NoSignature {
    /// Accept the request; the dedupe key is the configured header or pointer, falling back
    /// to the body hash (so a producer that forgets the header is deduplicated by content
    /// rather than refused: refusing would lose the webhook).
    fn verify(
        &self,
        spec: &SourceSpec,
        headers: &HeaderMap,
        body: &[u8],
        json: &mut LazyJson,
        _now_unix: i64,
    ) -> Result<Verified, VerifyError> {
        let dedupe_key = locate(&spec.dedupe, headers, json)?.unwrap_or_else(|| body_sha256_hex(body));
        let event_type = locate(&spec.event_type, headers, json)?.unwrap_or_else(|| "unknown".to_owned());
        Ok(Verified { dedupe_key, event_type, challenge: None, ordering_key: None })
    }
}
