//! A short-lived cache of sources by name, so an ingest costs one database round trip
//! (the insert) instead of two.
//!
//! Entries live for [`TTL`]: a change made through another replica's admin API (a new
//! secret, a deleted source) is seen here within that time; changes made through this
//! process invalidate at once. Unknown names are cached too, so a flood of requests to a
//! made-up source does not become a flood of queries. Bounded: past [`MAX_ENTRIES`] the
//! cache is cleared.
//!
//! One lookup per name at a time: requests that miss while a lookup of their name is
//! under way wait for its answer instead of sending their own. Without that, a burst on a
//! cold (or just expired) entry sent one read per request, each on its own connection,
//! and a burst larger than the pool waited on the connections the others were opening
//! (60 webhooks at once opened 32 connections, and on a loaded machine some waited past
//! the pool's acquire timeout and were answered 503).
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
type Found = Result<Option<Arc<OpenSource>>, ()>;

/// One lookup of a name: the requests that ask while it is fresh or under way share it.
/// A lookup the database failed leaves the cell empty, so the next request to ask tries
/// again (one at a time).
#[derive(Debug)]
struct Entry {
    started: Instant,
    found: tokio::sync::OnceCell<Found>,
}

impl Entry {
    /// Whether a request arriving `now` shares this entry: it is fresh, or its lookup has
    /// not answered yet (a newer one would not answer sooner).
    fn serves(&self, now: Instant) -> bool {
        now.duration_since(self.started) < TTL || !self.found.initialized()
    }
}

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
    entries: Mutex<HashMap<String, Arc<Entry>>>,
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
        let entry = self.entry(name, Instant::now());
        let found = entry.found.get_or_try_init(|| self.lookup(pool, name)).await?;
        found.clone().map_err(|()| LookupError::Unreadable)
    }

    /// The entry a request for `name` shares: the current one, or a new one in its place.
    fn entry(&self, name: &str, now: Instant) -> Arc<Entry> {
        let mut entries = self.lock();
        if let Some(entry) = entries.get(name)
            && entry.serves(now)
        {
            return entry.clone();
        }
        if entries.len() >= MAX_ENTRIES {
            entries.clear();
        }
        let entry = Arc::new(Entry { started: now, found: tokio::sync::OnceCell::new() });
        entries.insert(name.to_owned(), entry.clone());
        entry
    }

    /// Read the source from the database and open its secrets.
    async fn lookup(&self, pool: &Pool, name: &str) -> Result<Found, LookupError> {
        let Some(source) = store::sources::by_name(pool, name).await? else {
            return Ok(Ok(None));
        };
        Ok(match self.secrets.open_all(Place::SourceSecret, &source.spec.0.secrets) {
            Ok(secrets) => {
                let spec = source.spec.0.with_secrets(secrets);
                Ok(Some(Arc::new(OpenSource { id: source.id, name: source.name, spec })))
            }
            Err(e) => {
                tracing::error!(source = %source.name, error = %e, "cannot read this source's secrets");
                Err(())
            }
        })
    }

    /// Forget everything (after an admin change to sources).
    pub fn invalidate(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Entry>>> {
        // The map holds no invariant a panicking holder could break.
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
