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

use crate::db::Pool;
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
    pub fn seal(&self, place: Place, plaintext: &str) -> Result<String, SecretError> {
        if plaintext.starts_with(PREFIX) {
            return Err(SecretError::ReservedPrefix);
        }
        let Some(inner) = &self.inner else {
            return Ok(plaintext.to_owned());
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
        Ok(stored)
    }

    /// The plaintext of a stored value read at `place`: plaintext as it is; an encrypted
    /// value from the cache, or decrypted and authenticated under the key its id names.
    pub fn open<'a>(&self, place: Place, stored: &'a str) -> Result<Cow<'a, str>, SecretError> {
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
    pub fn open_all(&self, place: Place, stored: &[String]) -> Result<Vec<String>, SecretError> {
        stored.iter().map(|s| self.open(place, s).map(Cow::into_owned)).collect()
    }

    /// Whether `stored` is already in the form this keyring writes: encrypted under the
    /// current key (plaintext, without a key). Says nothing about authenticity.
    pub fn is_current(&self, stored: &str) -> bool {
        match (self.current_key_id(), key_id_of(stored)) {
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

/// Every stored secret, as `(place, value)` rows: endpoints (deleted ones too: their
/// secrets are still at rest) and source specs.
const STORED_VALUES: &str = "
    SELECT 'endpoint' AS place, e.secret AS v FROM endpoints e
    UNION ALL
    SELECT 'endpoint', p.v FROM endpoints e, unnest(e.previous_secrets) AS p(v)
    UNION ALL
    SELECT 'source', s.v FROM sources src, jsonb_array_elements_text(
        CASE WHEN jsonb_typeof(src.spec -> 'secrets') = 'array' THEN src.spec -> 'secrets' ELSE '[]' END) AS s(v)";

/// Refuse to start when the database holds a secret this keyring cannot open by its key
/// id: encrypted under a key that is neither current nor previous, or encrypted at all
/// when there is no key. The message is one line naming the key ids and what to do.
pub async fn check_stored(pool: &Pool, keyring: &Keyring) -> anyhow::Result<()> {
    let found: Vec<(String, i64)> = crate::db::query_as(&format!(
        "SELECT split_part(v, ':', 3) AS key_id, count(*)::int8 FROM ({STORED_VALUES}) stored
         WHERE v LIKE 'enc:v1:%' GROUP BY 1 ORDER BY 1"
    ))
    .fetch_all(pool)
    .await?;
    let unknown: Vec<String> = found
        .iter()
        .filter(|(id, _)| !keyring.knows(id))
        .map(|(id, n)| format!("{n} under key {}", printable_id(id)))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    let held = match keyring.current_key_id() {
        None => "no secrets key is configured: set --secrets-key (WEBHOOK_GATEWAY_SECRETS_KEY) to the key they \
                 were written with"
            .to_owned(),
        Some(current) => {
            let previous = keyring.previous_key_ids();
            format!(
                "this process holds key {current} (current){}: add the key they were written with as \
                 --secrets-key-previous (WEBHOOK_GATEWAY_SECRETS_KEY_PREVIOUS)",
                if previous.is_empty() { String::new() } else { format!(" and {} (previous)", previous.join(", ")) }
            )
        }
    };
    anyhow::bail!(
        "the database holds encrypted secrets this process cannot read ({}); {held}. Refusing to start rather than \
         fail every webhook's verification and every delivery's signature",
        unknown.join(", ")
    )
}

/// A key id as read from the database, safe to print on one line.
fn printable_id(id: &str) -> String {
    if is_key_id(id) { id.to_owned() } else { format!("{:?} (malformed)", id.chars().take(16).collect::<String>()) }
}

/// What [`reencrypt`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reencrypted {
    /// Endpoint secrets (current and previous) rewritten.
    pub endpoint_values: u64,
    /// Source secrets rewritten.
    pub source_values: u64,
    /// Values already under the current key (checked, left as they were).
    pub unchanged: u64,
    /// Values that could not be opened, left as they were: `endpoint <id>: reason`
    /// (at most [`MAX_REPORTED`]; `unreadable` counts them all).
    pub problems: Vec<String>,
    /// How many values could not be opened.
    pub unreadable: u64,
}

/// Most unreadable values [`reencrypt`] lists.
pub const MAX_REPORTED: usize = 20;

impl Reencrypted {
    /// Values rewritten.
    pub fn rewritten(&self) -> u64 {
        self.endpoint_values + self.source_values
    }

    fn unreadable(&mut self, what: String) {
        self.unreadable += 1;
        if self.problems.len() < MAX_REPORTED {
            self.problems.push(what);
        }
    }
}

/// Rewrite every stored secret in the form `keyring` writes: plaintext and values under a
/// previous key are sealed under the current key; values already under it are opened (so
/// checked) and left alone. Rows are locked and rewritten `batch` at a time, each batch
/// its own transaction; running it again rewrites nothing. A value that cannot be opened
/// is left as it is and reported; the rest still proceed.
pub async fn reencrypt(pool: &Pool, keyring: &Keyring, batch: u32) -> Result<Reencrypted, sqlx::Error> {
    let mut done = Reencrypted::default();
    let batch = i64::from(batch.max(1));
    let mut after: Option<uuid::Uuid> = None;
    loop {
        let mut tx = pool.begin().await?;
        let rows: Vec<(uuid::Uuid, String, Vec<String>)> = crate::db::query_as(
            "SELECT id, secret, previous_secrets FROM endpoints
             WHERE $1::uuid IS NULL OR id > $1 ORDER BY id LIMIT $2 FOR UPDATE",
        )
        .bind(after)
        .bind(batch)
        .fetch_all(&mut *tx)
        .await?;
        for (id, secret, previous) in &rows {
            let values: Vec<String> = std::iter::once(secret).chain(previous).cloned().collect();
            let what = format!("endpoint {id}");
            if let Some((values, n)) = rewrite_row(keyring, Place::EndpointSecret, &values, &what, &mut done) {
                done.endpoint_values += n;
                crate::db::query("UPDATE endpoints SET secret = $2, previous_secrets = $3 WHERE id = $1")
                    .bind(id)
                    .bind(&values[0])
                    .bind(&values[1..])
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await?;
        match rows.last() {
            Some((id, ..)) if rows.len() as i64 == batch => after = Some(*id),
            _ => break,
        }
    }
    let mut after: Option<uuid::Uuid> = None;
    loop {
        let mut tx = pool.begin().await?;
        let rows: Vec<(uuid::Uuid, String, Option<sqlx::types::Json<serde_json::Value>>)> = crate::db::query_as(
            "SELECT id, name, spec -> 'secrets' FROM sources
             WHERE ($1::uuid IS NULL OR id > $1) ORDER BY id LIMIT $2 FOR UPDATE",
        )
        .bind(after)
        .bind(batch)
        .fetch_all(&mut *tx)
        .await?;
        for (id, name, secrets) in &rows {
            let what = format!("source {name}");
            // No list (e.g. the built-in `api` source): nothing to rewrite.
            let Some(values) = secrets.as_ref().and_then(|s| s.0.as_array()) else { continue };
            let Some(values) = values.iter().map(|v| v.as_str().map(str::to_owned)).collect::<Option<Vec<String>>>()
            else {
                done.unreadable(format!("{what}: its secrets are not a list of strings"));
                continue;
            };
            if let Some((values, n)) = rewrite_row(keyring, Place::SourceSecret, &values, &what, &mut done) {
                done.source_values += n;
                crate::db::query("UPDATE sources SET spec = jsonb_set(spec, '{secrets}', $2) WHERE id = $1")
                    .bind(id)
                    .bind(sqlx::types::Json(&values))
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await?;
        match rows.last() {
            Some((id, ..)) if rows.len() as i64 == batch => after = Some(*id),
            _ => break,
        }
    }
    Ok(done)
}

/// The new values of one row and how many of them changed, or `None` when none changes
/// (counted as unchanged) or one cannot be opened (reported; the row is left as it is, so
/// no value is lost).
fn rewrite_row(
    keyring: &Keyring,
    place: Place,
    values: &[String],
    what: &str,
    done: &mut Reencrypted,
) -> Option<(Vec<String>, u64)> {
    let mut out = Vec::with_capacity(values.len());
    let mut rewritten = 0u64;
    for (i, stored) in values.iter().enumerate() {
        // Opened even when current: the pass also proves every value authenticates.
        let sealed = keyring.open(place, stored).and_then(|plaintext| {
            if keyring.is_current(stored) { Ok(None) } else { keyring.seal(place, &plaintext).map(Some) }
        });
        match sealed {
            Ok(Some(new)) => {
                out.push(new);
                rewritten += 1;
            }
            Ok(None) => out.push(stored.clone()),
            Err(e) => {
                done.unreadable(format!("{what}, secret {i}: {e}"));
                return None;
            }
        }
    }
    done.unchanged += values.len() as u64 - rewritten;
    (rewritten > 0).then_some((out, rewritten))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ring() -> Keyring {
        Keyring::new(Key::generate(), Vec::new())
    }

    #[test]
    fn a_sealed_value_opens_where_it_was_sealed_and_looks_like_nothing_it_holds() {
        let keyring = ring();
        let id = keyring.current_key_id().unwrap().to_owned();
        for place in [Place::EndpointSecret, Place::SourceSecret] {
            let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
            let a = keyring.seal(place, secret).unwrap();
            let b = keyring.seal(place, secret).unwrap();
            assert!(a.starts_with(&format!("enc:v1:{id}:")), "{a}");
            assert_ne!(a, b, "a fresh nonce per value");
            assert!(!a.contains("MfKQ9r8G"), "{a}");
            assert_eq!(keyring.open(place, &a).unwrap(), secret);
            // A fresh keyring with the same key (no cache) decrypts too.
            assert_eq!(
                Keyring::new(keyring.inner.as_ref().unwrap().current.clone(), vec![]).open(place, &b).unwrap(),
                secret
            );
            assert_eq!(key_id_of(&a), Some(id.as_str()));
            assert!(keyring.is_current(&a));
        }
    }

    #[test]
    fn plaintext_passes_through_with_or_without_a_key() {
        for keyring in [Keyring::default(), ring()] {
            assert!(matches!(keyring.open(Place::SourceSecret, "plain-secret"), Ok(Cow::Borrowed("plain-secret"))));
        }
        let plain = Keyring::default();
        assert_eq!(plain.seal(Place::SourceSecret, "plain-secret").unwrap(), "plain-secret");
        assert!(plain.is_current("plain-secret"));
        assert!(!ring().is_current("plain-secret"));
        assert_eq!(key_id_of("plain-secret"), None);
        for keyring in [Keyring::default(), ring()] {
            assert_eq!(keyring.seal(Place::SourceSecret, "enc:v1:looks-encrypted"), Err(SecretError::ReservedPrefix));
        }
    }

    #[test]
    fn a_tampered_value_is_refused() {
        let keyring = ring();
        let sealed = keyring.seal(Place::SourceSecret, "a-github-secret").unwrap();
        let (head, payload) = sealed.rsplit_once(':').unwrap();
        let mut bytes = STANDARD.decode(payload).unwrap();
        // Every byte matters: nonce, ciphertext and tag.
        for i in [0, NONCE_BYTES, bytes.len() - 1] {
            bytes[i] ^= 1;
            let tampered = format!("{head}:{}", STANDARD.encode(&bytes));
            bytes[i] ^= 1;
            // A fresh keyring: the cache holds the genuine value, not this one.
            let fresh = Keyring::new(keyring.inner.as_ref().unwrap().current.clone(), vec![]);
            for k in [&keyring, &fresh] {
                let err = k.open(Place::SourceSecret, &tampered).unwrap_err();
                assert!(matches!(err, SecretError::Rejected { .. }), "byte {i}: {err}");
            }
        }
        // Truncated, not base64, no payload, a malformed key id.
        let cut = &sealed[..sealed.len() - 30];
        for bad in [cut, "enc:v1:", "enc:v1:0011aabb", "enc:v1:0011aabb:!!!", "enc:v1:XYZ:AAAA", "enc:v1:0011aabb:AAAA"]
        {
            assert!(keyring.open(Place::SourceSecret, bad).is_err(), "{bad}");
        }
        assert_eq!(
            keyring.open(Place::SourceSecret, "enc:v1:0011aabb:AAAA"),
            Err(SecretError::UnknownKey("0011aabb".into()))
        );
    }

    #[test]
    fn a_value_moved_to_the_other_column_is_refused() {
        let keyring = ring();
        let endpoint = keyring.seal(Place::EndpointSecret, "whsec_c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0").unwrap();
        let source = keyring.seal(Place::SourceSecret, "source-secret").unwrap();
        // Cached under its own place already (seal remembers): the other place still refuses.
        assert!(matches!(keyring.open(Place::SourceSecret, &endpoint), Err(SecretError::Rejected { .. })));
        assert!(matches!(keyring.open(Place::EndpointSecret, &source), Err(SecretError::Rejected { .. })));
        assert!(keyring.open(Place::EndpointSecret, &endpoint).is_ok());
        // Relabelled with another key's id: that key does not authenticate it either.
        let other = Key::generate();
        let both = Keyring::new(other.clone(), vec![keyring.inner.as_ref().unwrap().current.clone()]);
        let relabelled = source.replacen(keyring.current_key_id().unwrap(), other.id(), 1);
        assert!(matches!(both.open(Place::SourceSecret, &relabelled), Err(SecretError::Rejected { .. })));
        assert!(both.open(Place::SourceSecret, &source).is_ok());
    }

    #[test]
    fn previous_keys_open_and_only_the_current_one_seals() {
        let old = Key::generate();
        let new = Key::generate();
        let before = Keyring::new(old.clone(), vec![]);
        let stored = before.seal(Place::EndpointSecret, "whsec_old").unwrap();
        let rotating = Keyring::new(new.clone(), vec![old.clone(), new.clone(), old.clone()]);
        assert_eq!(rotating.previous_key_ids(), [old.id()], "duplicates and the current key dropped");
        assert_eq!(rotating.open(Place::EndpointSecret, &stored).unwrap(), "whsec_old");
        assert!(!rotating.is_current(&stored));
        assert!(rotating.seal(Place::EndpointSecret, "x").unwrap().starts_with(&format!("enc:v1:{}:", new.id())));
        let after = Keyring::new(new.clone(), vec![]);
        assert_eq!(after.open(Place::EndpointSecret, &stored), Err(SecretError::UnknownKey(old.id().to_owned())));
        assert_eq!(
            Keyring::default().open(Place::EndpointSecret, &stored),
            Err(SecretError::NoKey(old.id().to_owned()))
        );
    }

    #[test]
    fn keys_are_32_bytes_of_base64_and_errors_never_show_them() {
        let bytes = [7u8; KEY_BYTES];
        let text = encode_key(&bytes);
        let key = Key::from_base64(&format!("  {text}\n")).unwrap();
        assert_eq!(key.id(), &hex::encode(Sha256::digest(bytes))[..8]);
        assert_eq!(Key::from_base64(text.trim_end_matches('=')).unwrap().id(), key.id(), "padding optional");
        let short = STANDARD.encode([7u8; 31]);
        for bad in [short.as_str(), "not base64 at all!", ""] {
            let err = Key::from_base64(bad).unwrap_err().to_string();
            assert!(err.contains("32 bytes in base64"), "{err}");
            assert!(bad.is_empty() || !err.contains(bad), "{err}");
        }
        assert!(format!("{key:?}").contains(key.id()));
        assert!(!format!("{:?}", Keyring::new(key, vec![])).contains(&text));
    }

    #[test]
    fn keyring_settings_are_checked() {
        let text = encode_key(&[1u8; KEY_BYTES]);
        assert!(!keyring_from(None, None, &[], &[]).unwrap().encrypts());
        assert!(keyring_from(Some(&text), None, &[], &[]).unwrap().encrypts());
        let err = keyring_from(None, None, std::slice::from_ref(&text), &[]).unwrap_err();
        assert!(err.contains("needs a current"), "{err}");
        let err = keyring_from(Some(&text), Some(std::path::Path::new("/nonexistent")), &[], &[]).unwrap_err();
        assert!(err.contains("not both"), "{err}");
        let err = keyring_from(None, Some(std::path::Path::new("/nonexistent/key")), &[], &[]).unwrap_err();
        assert!(err.starts_with("secrets-key-file: cannot read /nonexistent/key"), "{err}");
        let err = keyring_from(Some(&text), None, &["short".into()], &[]).unwrap_err();
        assert!(err.starts_with("secrets-key-previous (entry 1): must be 32 bytes"), "{err}");
        let err = keyring_from(Some(&text), None, &[], &["/nonexistent/old".into()]).unwrap_err();
        assert!(err.starts_with("secrets-key-previous-file: cannot read /nonexistent/old"), "{err}");
    }

    #[test]
    fn the_cache_is_bounded() {
        let keyring = ring();
        let fresh = Keyring::new(keyring.inner.as_ref().unwrap().current.clone(), vec![]);
        let values: Vec<String> =
            (0..=MAX_CACHED).map(|i| keyring.seal(Place::SourceSecret, &format!("s{i}")).unwrap()).collect();
        assert!(keyring.cached(Place::SourceSecret) <= MAX_CACHED);
        for (i, v) in values.iter().enumerate() {
            assert_eq!(fresh.open(Place::SourceSecret, v).unwrap(), format!("s{i}"));
        }
        assert_eq!(fresh.cached(Place::SourceSecret), 1, "cleared at the bound, then one more");
        assert_eq!(fresh.cached(Place::EndpointSecret), 0);
    }

    /// What a claim pays to open an endpoint's secrets (current + one previous): run with
    /// `cargo test --release --lib secrets::tests::cost -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn cost_of_opening_a_claims_secrets() {
        use std::time::Instant;
        const N: u32 = 100_000;
        let keyring = ring();
        let secrets = [
            keyring.seal(Place::EndpointSecret, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap(),
            keyring.seal(Place::EndpointSecret, "whsec_c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0").unwrap(),
        ];
        let plain = Keyring::default();
        let plaintext = ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".to_owned(), "whsec_c2VjcmV0".to_owned()];
        let time = |label: &str, f: &mut dyn FnMut()| {
            let start = Instant::now();
            for _ in 0..N {
                f();
            }
            println!("{label}: {:.0} ns per claim", start.elapsed().as_nanos() as f64 / f64::from(N));
        };
        time("no key (plaintext)", &mut || {
            for s in &plaintext {
                std::hint::black_box(plain.open(Place::EndpointSecret, s).unwrap());
            }
        });
        time("key, cached", &mut || {
            for s in &secrets {
                std::hint::black_box(keyring.open(Place::EndpointSecret, s).unwrap());
            }
        });
        let current = keyring.inner.as_ref().unwrap().current.clone();
        time("key, uncached (decrypt both)", &mut || {
            let cold = Keyring::new(current.clone(), vec![]);
            for s in &secrets {
                std::hint::black_box(cold.open(Place::EndpointSecret, s).unwrap());
            }
        });
        time("seal one (write path)", &mut || {
            std::hint::black_box(keyring.seal(Place::SourceSecret, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap());
        });
    }
}
