//! Secrets at rest: source verification secrets (`sources.spec -> secrets`) and endpoint
//! signing secrets (`endpoints.secret`, `endpoints.previous_secrets`), encrypted in the
//! database under an operator key.
//!
//! **Stored form.** `enc:v1:<key id>:<base64(nonce || ciphertext || tag)>`: XChaCha20-Poly1305
//! with a fresh random 24-byte nonce per value. The key id is the first 8 hex digits of the
//! SHA-256 of the key's 32 bytes (`base64 -d <<<"$KEY" | sha256sum | cut -c1-8`), so a value
//! written under another key is recognised as such instead of failing as "tampered". The
//! associated data binds each value to its [`Place`] and to its own header (version and key
//! id): a ciphertext copied from an endpoint column into a source's spec (or the reverse),
//! or relabelled with another key id, is refused. A value without the prefix is plaintext,
//! so databases written without a key keep working, and a key can be turned on at any time
//! (`webhook-gateway secrets reencrypt` then encrypts what is already stored).
//!
//! **[`Keyring`].** The current key (seals and opens), previous keys (open only: a rotation
//! restarts the replicas with the new key as current and the old one as previous, runs
//! [`reencrypt`], then drops the old key), and a cache of opened values keyed by their
//! stored text, per place, cleared past [`MAX_CACHED`] entries. The hot paths, each
//! claimed delivery's endpoint secrets and each refresh of the ingest source cache, so
//! decrypt a stored value once per process: afterwards an open is a hash lookup. Without a
//! key the keyring passes plaintext through and refuses to guess at encrypted values.
//!
//! **Start-up.** [`check_stored`] refuses to start a process that could not read a secret
//! in the database (a key id neither current nor previous, or encrypted values and no key),
//! rather than failing every webhook's verification or every delivery's signature later.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use base64::Engine;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use rand::RngCore;
use sha2::{Digest, Sha256};

/// The prefix of every encrypted value (version 1 of the format).
pub const PREFIX: &str = "enc:v1:";
/// Bytes of an operator key.
pub const KEY_BYTES: usize = 32;
/// Bytes of an XChaCha20-Poly1305 nonce.
const NONCE_BYTES: usize = 24;
/// Bytes of a Poly1305 tag.
const TAG_BYTES: usize = 16;
/// Hex digits of a key id.
const KEY_ID_LEN: usize = 8;
/// Most opened values cached per place; past it the cache is cleared (a deployment has
/// a few secrets per endpoint and source: this is a bound, not a working size).
pub const MAX_CACHED: usize = 10_000;

/// Where a secret is stored; part of the associated data, so a value only opens where it
/// was sealed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// `endpoints.secret` and `endpoints.previous_secrets` (a rotation moves the current
    /// value into the previous ones as it is, so both columns are one place).
    EndpointSecret,
    /// Each entry of `sources.spec -> secrets`.
    SourceSecret,
}

impl Place {
    /// The name used in the associated data and in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Place::EndpointSecret => "endpoint-secret",
            Place::SourceSecret => "source-secret",
        }
    }

    fn index(self) -> usize {
        match self {
            Place::EndpointSecret => 0,
            Place::SourceSecret => 1,
        }
    }
}

/// Why a stored value cannot be opened, or a plaintext cannot be stored. Messages name
/// key ids, never a key or a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// Encrypted under a key this process does not hold.
    #[error(
        "a secret is encrypted under key {0}, which is neither the current nor a previous secrets key of this process"
    )]
    UnknownKey(String),
    /// Encrypted, and this process has no key at all.
    #[error("a secret is encrypted under key {0}, but no secrets key is configured (--secrets-key)")]
    NoKey(String),
    /// The key is known but the value does not authenticate: altered, or moved from another
    /// place.
    #[error(
        "a stored {place} encrypted under key {key_id} fails authentication: it was altered, or moved from another column"
    )]
    Rejected {
        /// The key id in its header.
        key_id: String,
        /// Where it was read.
        place: &'static str,
    },
    /// Carries the prefix but is not a well-formed encrypted value.
    #[error("a stored secret starts with `{PREFIX}` but is not a well-formed encrypted value")]
    Malformed,
    /// A plaintext that would be read back as an encrypted value.
    #[error("must not start with `{PREFIX}` (reserved for encrypted values)")]
    ReservedPrefix,
}

/// An operator key that is not 32 bytes of base64. Never contains the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("must be {KEY_BYTES} bytes in base64, e.g. the output of `openssl rand -base64 32` ({0})")]
pub struct KeyError(String);

/// One operator key: its id and its cipher. `Debug` shows the id only.
#[derive(Clone)]
pub struct Key {
    id: String,
    cipher: XChaCha20Poly1305,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Key").field("id", &self.id).finish_non_exhaustive()
    }
}

/// Standard base64, with or without padding.
const LENIENT_B64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

impl Key {
    /// A key from its base64 text (surrounding whitespace ignored: key files end with a
    /// newline).
    pub fn from_base64(text: &str) -> Result<Key, KeyError> {
        let bytes = LENIENT_B64.decode(text.trim()).map_err(|_| KeyError("not base64".into()))?;
        let bytes: [u8; KEY_BYTES] =
            bytes.as_slice().try_into().map_err(|_| KeyError(format!("it decodes to {} bytes", bytes.len())))?;
        Ok(Key::from_bytes(&bytes))
    }

    /// A key from its bytes.
    pub fn from_bytes(bytes: &[u8; KEY_BYTES]) -> Key {
        let id = hex::encode(&Sha256::digest(bytes)[..KEY_ID_LEN / 2]);
        Key { id, cipher: XChaCha20Poly1305::new(bytes.into()) }
    }

    /// A fresh random key (tests, benchmarks).
    pub fn generate() -> Key {
        let mut bytes = [0u8; KEY_BYTES];
        rand::rng().fill_bytes(&mut bytes);
        Key::from_bytes(&bytes)
    }

    /// Its id: the first 8 hex digits of the SHA-256 of its bytes.
    pub fn id(&self) -> &str {
        &self.id
    }
}

/// The keys of a process and its cache of opened values. Cheap to clone (shared).
/// The default holds no key: plaintext passes through, encrypted values are refused.
#[derive(Clone, Default)]
pub struct Keyring {
    inner: Option<Arc<Inner>>,
}

struct Inner {
    current: Key,
    previous: Vec<Key>,
    /// Opened values by stored text, one map per [`Place`].
    cache: [Mutex<HashMap<String, String>>; 2],
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            None => f.write_str("Keyring(plaintext)"),
            Some(inner) => f
                .debug_struct("Keyring")
                .field("current", &inner.current.id)
                .field("previous", &inner.previous.iter().map(|k| k.id.as_str()).collect::<Vec<_>>())
                .finish(),
        }
    }
}

impl Keyring {
    /// A keyring that seals under `current` and opens under it and each of `previous`
    /// (a previous key with the current key's id is dropped).
    pub fn new(current: Key, previous: Vec<Key>) -> Keyring {
        let mut kept: Vec<Key> = Vec::new();
        for key in previous {
            if key.id != current.id && !kept.iter().any(|k| k.id == key.id) {
                kept.push(key);
            }
        }
        Keyring { inner: Some(Arc::new(Inner { current, previous: kept, cache: Default::default() })) }
    }

    /// Whether values are encrypted when stored.
    pub fn encrypts(&self) -> bool {
        self.inner.is_some()
    }

    /// The current key's id, if there is a key.
    pub fn current_key_id(&self) -> Option<&str> {
        self.inner.as_ref().map(|i| i.current.id.as_str())
    }

    /// The previous keys' ids.
    pub fn previous_key_ids(&self) -> Vec<&str> {
        self.inner.as_ref().map(|i| i.previous.iter().map(|k| k.id.as_str()).collect()).unwrap_or_default()
    }

    /// Whether a value under `key_id` can be opened.
    pub fn knows(&self, key_id: &str) -> bool {
        self.inner.as_ref().is_some_and(|i| i.key(key_id).is_some())
    }

    /// The stored form of `plaintext` at `place`: encrypted under the current key, or the
    /// plaintext itself without a key. A plaintext that starts with [`PREFIX`] is refused
    /// either way (it would be read back as an encrypted value).
    pub fn seal(&self, place: Place, plaintext: &str) -> Result<Sealed, SecretError> {
        if plaintext.starts_with(PREFIX) {
            return Err(SecretError::ReservedPrefix);
        }
        let Some(inner) = &self.inner else {
            return Ok(Sealed::new(plaintext.to_owned()));
        };
        let key = &inner.current;
        let mut nonce = [0u8; NONCE_BYTES];
        rand::rng().fill_bytes(&mut nonce);
        let aad = associated_data(place, &key.id);
        // Encryption fails only past 2^38 bytes of plaintext.
        let sealed = key
            .cipher
            .encrypt(&XNonce::from(nonce), Payload { msg: plaintext.as_bytes(), aad: &aad })
            .map_err(|_| SecretError::Malformed)?;
        let mut payload = Vec::with_capacity(NONCE_BYTES + sealed.len());
        payload.extend_from_slice(&nonce);
        payload.extend_from_slice(&sealed);
        let stored = format!("{PREFIX}{}:{}", key.id, STANDARD.encode(payload));
        // The next read of what was just written (the API's answer, the next claim) is a hit.
        inner.remember(place, &stored, plaintext);
        Ok(Sealed::new(stored))
    }

    /// The plaintext of a stored value read at `place`: plaintext as it is; an encrypted
    /// value from the cache, or decrypted and authenticated under the key its id names.
    pub fn open<'a>(&self, place: Place, sealed: &'a Sealed) -> Result<Cow<'a, str>, SecretError> {
        let stored = sealed.as_stored();
        let Some(rest) = stored.strip_prefix(PREFIX) else {
            return Ok(Cow::Borrowed(stored));
        };
        let (key_id, payload) = rest.split_once(':').ok_or(SecretError::Malformed)?;
        if !is_key_id(key_id) {
            return Err(SecretError::Malformed);
        }
        let Some(inner) = &self.inner else {
            return Err(SecretError::NoKey(key_id.to_owned()));
        };
        if let Some(hit) = inner.cache(place).get(stored) {
            return Ok(Cow::Owned(hit.clone()));
        }
        let key = inner.key(key_id).ok_or_else(|| SecretError::UnknownKey(key_id.to_owned()))?;
        let bytes = STANDARD.decode(payload).map_err(|_| SecretError::Malformed)?;
        if bytes.len() < NONCE_BYTES + TAG_BYTES {
            return Err(SecretError::Malformed);
        }
        let (nonce, sealed) = bytes.split_at(NONCE_BYTES);
        let nonce: [u8; NONCE_BYTES] = nonce.try_into().map_err(|_| SecretError::Malformed)?;
        let rejected = || SecretError::Rejected { key_id: key_id.to_owned(), place: place.as_str() };
        let opened = key
            .cipher
            .decrypt(&XNonce::from(nonce), Payload { msg: sealed, aad: &associated_data(place, key_id) })
            .map_err(|_| rejected())?;
        // Only this module seals, and only `&str`: authenticated bytes are UTF-8.
        let plaintext = String::from_utf8(opened).map_err(|_| rejected())?;
        inner.remember(place, stored, &plaintext);
        Ok(Cow::Owned(plaintext))
    }

    /// [`Keyring::open`] of each value.
    pub fn open_all(&self, place: Place, stored: &[Sealed]) -> Result<Vec<String>, SecretError> {
        stored.iter().map(|s| self.open(place, s).map(Cow::into_owned)).collect()
    }

    /// Whether `stored` is already in the form this keyring writes: encrypted under the
    /// current key (plaintext, without a key). Says nothing about authenticity.
    pub fn is_current(&self, stored: &Sealed) -> bool {
        match (self.current_key_id(), key_id_of(stored.as_stored())) {
            (Some(current), Some(id)) => id == current,
            (None, None) => true,
            _ => false,
        }
    }

    /// Opened values cached for `place` (tests).
    pub fn cached(&self, place: Place) -> usize {
        self.inner.as_ref().map(|i| i.cache(place).len()).unwrap_or(0)
    }
}

impl Inner {
    fn key(&self, id: &str) -> Option<&Key> {
        std::iter::once(&self.current).chain(&self.previous).find(|k| k.id == id)
    }

    fn cache(&self, place: Place) -> MutexGuard<'_, HashMap<String, String>> {
        // The map holds no invariant a panicking holder could break.
        self.cache[place.index()].lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn remember(&self, place: Place, stored: &str, plaintext: &str) {
        let mut cache = self.cache(place);
        if cache.len() >= MAX_CACHED {
            cache.clear();
        }
        cache.insert(stored.to_owned(), plaintext.to_owned());
    }
}

fn associated_data(place: Place, key_id: &str) -> Vec<u8> {
    format!("webhook-gateway|{}|{PREFIX}{key_id}", place.as_str()).into_bytes()
}

fn is_key_id(s: &str) -> bool {
    s.len() == KEY_ID_LEN && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The key id of an encrypted value (`None` for plaintext). The id is not checked.
pub fn key_id_of(stored: &str) -> Option<&str> {
    stored.strip_prefix(PREFIX).map(|rest| rest.split_once(':').map_or(rest, |(id, _)| id))
}

/// The operator key settings shared by `serve` and `secrets reencrypt`, as given: the
/// current key (text or file) and previous keys (texts and files). Messages name the
/// setting, never a key.
pub fn keyring_from(
    key: Option<&str>,
    key_file: Option<&std::path::Path>,
    previous: &[String],
    previous_files: &[std::path::PathBuf],
) -> Result<Keyring, String> {
    let read = |setting: &str, path: &std::path::Path| {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("{setting}: cannot read {}: {e}", path.display()))?;
        Key::from_base64(&text).map_err(|e| format!("{setting} {}: {e}", path.display()))
    };
    let current = match (key, key_file) {
        (Some(_), Some(_)) => return Err("give secrets-key or secrets-key-file, not both".into()),
        (Some(text), None) => Some(Key::from_base64(text).map_err(|e| format!("secrets-key: {e}"))?),
        (None, Some(path)) => Some(read("secrets-key-file", path)?),
        (None, None) => None,
    };
    let mut keys = previous
        .iter()
        .enumerate()
        .map(|(i, text)| Key::from_base64(text).map_err(|e| format!("secrets-key-previous (entry {}): {e}", i + 1)))
        .collect::<Result<Vec<_>, _>>()?;
    for path in previous_files {
        keys.push(read("secrets-key-previous-file", path)?);
    }
    match current {
        Some(current) => Ok(Keyring::new(current, keys)),
        None if keys.is_empty() => Ok(Keyring::default()),
        None => Err("secrets-key-previous needs a current secrets-key (or secrets-key-file)".into()),
    }
}

/// Base64 of a key's bytes, as an operator writes it (`openssl rand -base64 32`).
pub fn encode_key(bytes: &[u8; KEY_BYTES]) -> String {
    STANDARD.encode(bytes)
}

mod sealed;
mod stored;
#[cfg(test)]
mod tests;

pub use sealed::Sealed;
pub use stored::{MAX_REPORTED, Reencrypted, check_stored, reencrypt};
