//! What the API and the console show of a source's secrets.

use crate::secrets::{Keyring, Place};
use crate::store::sources::Source;

/// `sha256:` + the first 8 hex digits of each of a source's secrets' SHA-256, never the
/// secret (`unreadable` for one this process cannot decrypt, logged). The API's source view
/// and the console's sources page.
pub fn fingerprints(s: &Source, secrets: &Keyring) -> Vec<String> {
    let fingerprint = |stored: &crate::secrets::Sealed| match secrets.open(Place::SourceSecret, stored) {
        Ok(plaintext) => crate::verify::secret_fingerprint(&plaintext),
        Err(e) => {
            tracing::warn!(source = %s.name, error = %e, "cannot read a secret of this source");
            "unreadable".to_owned()
        }
    };
    s.spec.0.secrets.iter().map(fingerprint).collect()
}
