//! A short-lived cache of sources by name, so an ingest costs one database round trip
//! (the insert) instead of two.
//!
//! Entries live for [`TTL`]: a change made through another replica's admin API (a new
//! secret, a deleted source) is seen here within that time; changes made through this
//! process invalidate at once. Unknown names are cached too, so a flood of requests to a
//! made-up source does not become a flood of queries. Bounded: past [`MAX_ENTRIES`] the
//! cache is cleared.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::store::{self, sources::Source};

/// How long an entry is trusted.
pub const TTL: Duration = Duration::from_secs(1);
/// Most names kept.
pub const MAX_ENTRIES: usize = 10_000;

type Entry = (Instant, Option<Arc<Source>>);

/// Sources by name, each entry trusted for [`TTL`].
#[derive(Debug, Default)]
pub struct SourceCache {
    entries: Mutex<HashMap<String, Entry>>,
}

impl SourceCache {
    /// The source called `name`, from the cache or the database.
    pub async fn get(&self, pool: &PgPool, name: &str) -> Result<Option<Arc<Source>>, sqlx::Error> {
        let now = Instant::now();
        if let Some((at, source)) = self.lock().get(name)
            && now.duration_since(*at) < TTL
        {
            return Ok(source.clone());
        }
        let source = store::sources::by_name(pool, name).await?.map(Arc::new);
        let mut entries = self.lock();
        if entries.len() >= MAX_ENTRIES {
            entries.clear();
        }
        entries.insert(name.to_owned(), (now, source.clone()));
        Ok(source)
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
