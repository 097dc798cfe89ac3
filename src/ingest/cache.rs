//! A short-lived cache of sources by name, so an ingest costs one database round trip
//! (the insert) instead of two.
//!
//! Entries live for [`TTL`]: a change made through another replica's admin API (a new
//! secret, a deleted source) is seen here within that time; changes made through this
//! process invalidate at once. Unknown names are cached too, so a flood of requests to a
//! made-up source does not become a flood of queries. Bounded: past [`MAX_ENTRIES`] the
//! cache is cleared.
//!
//! Entries hold the source with its secrets opened (decrypted when a secrets key is set),
//! so verification never decrypts: each refresh opens the stored values, which the
//! keyring's own cache makes a lookup after the first time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::db::Pool;

use crate::ids::SourceId;
use crate::secrets::{Keyring, Place};
use crate::store;
use crate::verify::SourceSpec;

/// A source as verification needs it: its secrets opened.
#[derive(Debug)]
pub struct OpenSource {
    /// The source's id (events refer to it).
    pub id: SourceId,
    /// Its name (metrics and logs).
    pub name: String,
    /// Its spec, with plaintext secrets.
    pub spec: SourceSpec,
}

/// How long an entry is trusted.
pub const TTL: Duration = Duration::from_secs(1);
/// Most names kept (known or not); past it the cache is cleared.
pub const MAX_ENTRIES: usize = 10_000;

/// A source, no such source, or a source whose secrets cannot be opened (cached too, so
/// a flood of webhooks to it logs once per [`TTL`], not once per request).
type Entry = (Instant, Result<Option<Arc<OpenSource>>, ()>);

/// Why [`SourceCache::get`] has no answer.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    /// The database failed the read (nothing was written either way).
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The source exists but this process cannot open its secrets (logged).
    #[error("this source's secrets cannot be read with the configured secrets key")]
    Unreadable,
}

/// Sources by name, each entry trusted for `TTL` (1 s).
#[derive(Debug, Default)]
pub struct SourceCache {
    entries: Mutex<HashMap<String, Entry>>,
    secrets: Keyring,
}

impl SourceCache {
    /// An empty cache whose entries' secrets are opened with `secrets`.
    pub fn new(secrets: Keyring) -> SourceCache {
        SourceCache { entries: Mutex::default(), secrets }
    }

    /// The source called `name`, from the cache or the database, its secrets in plaintext.
    /// A source whose secrets this process cannot open is an error (logged; the sender
    /// gets a 500 and retries), never a source that refuses every signature.
    pub async fn get(&self, pool: &Pool, name: &str) -> Result<Option<Arc<OpenSource>>, LookupError> {
        let now = Instant::now();
        if let Some((at, source)) = self.lock().get(name)
            && now.duration_since(*at) < TTL
        {
            return source.clone().map_err(|()| LookupError::Unreadable);
        }
        let source = match store::sources::by_name(pool, name).await? {
            Some(source) => match self.secrets.open_all(Place::SourceSecret, &source.spec.0.secrets) {
                Ok(secrets) => {
                    let spec = source.spec.0.with_secrets(secrets);
                    Ok(Some(Arc::new(OpenSource { id: source.id, name: source.name, spec })))
                }
                Err(e) => {
                    tracing::error!(source = %source.name, error = %e, "cannot read this source's secrets");
                    Err(())
                }
            },
            None => Ok(None),
        };
        let mut entries = self.lock();
        if entries.len() >= MAX_ENTRIES {
            entries.clear();
        }
        entries.insert(name.to_owned(), (now, source.clone()));
        source.map_err(|()| LookupError::Unreadable)
    }

    /// Forget everything (after an admin change to sources).
    pub fn invalidate(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // The map holds no invariant a panicking holder could break.
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
