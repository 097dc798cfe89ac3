//! Signature-checking kinds. Placeholder until the provider verifiers land (issue 6):
//! refuses every request, so a source of these kinds fails closed.

use http::HeaderMap;

use super::{SourceSpec, Verified, VerifyError};

pub(super) fn verify(spec: &SourceSpec, _headers: &HeaderMap, _body: &[u8], _now_unix: i64) -> Result<Verified, VerifyError> {
    Err(VerifyError::InvalidSignature(format!("kind {} is not supported yet", spec.kind.as_str())))
}
