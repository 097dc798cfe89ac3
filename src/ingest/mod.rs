//! Taking events in: a webhook is looked up, verified and stored with its fan-out in one
//! transaction; an event published through the API is stored the same way. Nothing is
//! acknowledged before it is committed.
//!
//! [`Intake`] holds what this needs (the source cache, the group-commit writer, this
//! process's wake-up), so the HTTP handlers (`api::ingest`, `POST /v1/events`) only map
//! its outcomes to answers.

pub mod batcher;
pub mod budget;
pub mod cache;
mod headers;
pub mod rejections;

use std::sync::Arc;

use crate::db::Pool;
use bytes::Bytes;
use http::{HeaderMap, header};
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::secrets::Keyring;
use crate::store::events::{OwnedEvent, Stored};
use crate::verify::{self, Kind, VerifyError};

pub use batcher::{Batcher, StoreError};
pub use budget::MemoryBudget;
pub use cache::{LookupError, SourceCache};
pub use headers::{REDACTED, redacted_headers};

/// What a webhook became.
#[derive(Debug)]
pub enum Received {
    /// Stored with its deliveries (or recognised as a duplicate), committed.
    Stored(Stored),
    /// Slack's `url_verification`: answer with this challenge; nothing was stored.
    Challenge(String),
}

/// Why a webhook was not stored (or is not known to be).
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// No source has this name.
    #[error("no source named {0:?}")]
    UnknownSource(String),
    /// The built-in `api` source takes events only through `POST /v1/events`.
    #[error("this source takes events only through POST /v1/events")]
    NotIngestible,
    /// The source lookup failed (a read: nothing was stored either way).
    #[error(transparent)]
    Lookup(#[from] LookupError),
    /// The source lookup got no answer before the deadline (nothing was stored).
    #[error("the source lookup got no answer in time")]
    LookupNoAnswer,
    /// Verification refused the request (counted and logged under the source).
    #[error(transparent)]
    Verify(VerifyError),
    /// Storing failed, or was not confirmed.
    #[error("the event was not stored: {0:?}")]
    Store(StoreError),
}

/// The ingest side of a process: the source cache, the group-commit writer and the
/// wake-up of this process's workers. Cheap to clone.
#[derive(Clone)]
pub struct Intake {
    pool: Pool,
    sources: Arc<SourceCache>,
    batcher: Batcher,
    wake: Arc<Notify>,
    handoff: Option<Arc<crate::wake::Handoff>>,
    indexing: crate::search::Indexing,
}

impl Intake {
    /// Start `writers` group-commit writers on `pool`. Sources' secrets are opened with
    /// `secrets`. Whenever an event creates deliveries they are handed to this process's
    /// dispatcher through `handoff` when there is one (role `all`), else `wake` is
    /// signalled (role `ingest`: the notification to other processes). With `prelease`
    /// (role `all`), a webhook written alone has its deliveries leased by the statement
    /// that stores it and handed to that dispatcher (`crate::deliver::prelease`). Each
    /// event is indexed for searches as `indexing` says (`--content-search`).
    pub fn start(
        pool: Pool,
        writers: usize,
        secrets: Keyring,
        wake: Arc<Notify>,
        handoff: Option<Arc<crate::wake::Handoff>>,
        prelease: Option<Arc<crate::deliver::prelease::Prelease>>,
        indexing: crate::search::Indexing,
    ) -> Intake {
        Intake {
            sources: Arc::new(SourceCache::new(secrets)),
            batcher: Batcher::start(pool.clone(), writers, prelease),
            pool,
            wake,
            handoff,
            indexing,
        }
    }

    /// What this process indexes of each event it stores (`--content-search`): the
    /// searches it answers follow it.
    pub fn indexing(&self) -> crate::search::Indexing {
        self.indexing
    }

    /// The source cache, for admin changes to invalidate.
    pub fn sources(&self) -> &SourceCache {
        &self.sources
    }

    /// A webhook for the source called `source_name`: look the source up, verify the
    /// request on its raw body, and store it with its fan-out, all by `deadline`.
    pub async fn webhook(
        &self,
        source_name: &str,
        headers: &HeaderMap,
        body: Bytes,
        deadline: Instant,
    ) -> Result<Received, Refused> {
        let source = match tokio::time::timeout_at(deadline, self.sources.get(&self.pool, source_name)).await {
            Ok(found) => found?,
            Err(_) => return Err(Refused::LookupNoAnswer),
        }
        .ok_or_else(|| Refused::UnknownSource(source_name.to_owned()))?;
        let spec = &source.spec;
        if spec.kind == Kind::Internal {
            return Err(Refused::NotIngestible);
        }
        // The body's search terms are hashed by the walk that reads its event type. A
        // signed timestamp is judged by the fleet's one clock, the database's: a replica
        // whose host drifted judges as the others do.
        let mut scan = crate::search::PayloadScan::new(self.indexing);
        let verified = crate::telemetry::step("verify").in_scope(|| {
            verify::verify_scanning(spec, headers, &body, crate::clock::now().timestamp(), &mut scan).map_err(|e| {
                // Counted under the stored name (the source exists), logged rate-limited.
                rejections::record(&source.name, &e);
                Refused::Verify(e)
            })
        })?;
        if let Some(challenge) = verified.challenge {
            return Ok(Received::Challenge(challenge));
        }
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .map(|v| crate::sanitize::stored_text(v.as_bytes(), crate::sanitize::MAX_CONTENT_TYPE_BYTES));
        let headers_kept = redacted_headers(headers, spec.hmac.as_ref().map(|h| h.header.as_str()));
        let terms = scan.terms(&verified.dedupe_key, &headers_kept, &body);
        let event = OwnedEvent {
            source_id: source.id,
            source_name: source.name.clone(),
            indexing: self.indexing,
            dedupe_key: verified.dedupe_key,
            event_type: verified.event_type,
            content_type,
            headers: headers_kept,
            payload: body,
            ordering_key: verified.ordering_key,
            trace: crate::telemetry::EventTrace::for_request(headers),
            terms: Some(terms),
        };
        let stored = self.accept(event, deadline).await.map_err(Refused::Store)?;
        Ok(Received::Stored(stored))
    }

    /// Store an accepted event with its fan-out by `deadline`, and wake this process's
    /// workers when it created deliveries; counted under the event's source. Shared by
    /// webhooks and `POST /v1/events`.
    pub async fn accept(&self, mut event: OwnedEvent, deadline: Instant) -> Result<Stored, StoreError> {
        // The event goes to the writer; its source's name stays for the count.
        let source_name = event.source_name.clone();
        let producer = crate::telemetry::step("store");
        // With tracing on, the deliveries' attempts link to the producer span.
        if let Some(trace) = crate::telemetry::EventTrace::of_span(&producer) {
            event.trace = Some(trace);
        }
        let stored = self.batcher.store(event, deadline).instrument(producer).await?;
        if !stored.deliveries.is_empty() {
            match &self.handoff {
                Some(handoff) => handoff.push(&stored.deliveries),
                None => self.wake.notify_one(),
            }
        }
        crate::metrics::ingest(&source_name, if stored.duplicate { "duplicate" } else { "accepted" });
        Ok(stored)
    }
}
