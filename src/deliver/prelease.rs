//! The pre-leased hand-off: a lone webhook's deliveries leased in the commit that stores
//! them.
//!
//! At low load a webhook costs three commits: ingest's, the claim's and the outcome's
//! (bench/PROFILE.md, "What one commit costs at low load"). In a process that both ingests
//! and delivers (role `all`), a webhook that ingest writes alone (group commit's direct
//! write, `ingest::batcher`) is stored and its deliveries claimed in one transaction:
//! the ingest statement, then the claim by key ([`queue::claim_fresh_in`]) with the same
//! endpoint locks, room, rate tokens, lease and fencing token as any claim. The leased
//! deliveries go to this process's dispatcher with a worker slot each, reserved before the
//! claim, so no lease waits for a slot.
//!
//! It is not done (the deliveries are handed over by id, [`crate::wake::Handoff`], as
//! before) when the dispatcher has no free slots, when it owes a general claim (due work
//! older than this webhook may be waiting, and that goes first), or once it has stopped.
//!
//! A lease the dispatcher never receives (the request cancelled or timed out between the
//! claim and the hand-over, the dispatcher gone meanwhile) is given back at once
//! ([`queue::release`], fenced by its token, the attempt not spent), not left until the
//! lease runs out.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use opentelemetry::trace::SpanContext;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::DeliverySettings;
use crate::db::{Planning, Pool};
use crate::ids::DeliveryId;
use crate::queue::{self, Claimed};
use crate::store::events::{self, NewEvent, Stored};

/// What ingest and the dispatcher of one process share for the hand-off.
#[derive(Debug)]
pub struct Prelease {
    /// The dispatcher's worker slots.
    slots: Arc<Semaphore>,
    /// Leased deliveries, each with its slot, on their way to the dispatcher.
    jobs: mpsc::UnboundedSender<Preleased>,
    /// Set by the dispatcher while its last claim left nothing due behind (it owes no
    /// general claim): only then may a fresh delivery be leased ahead of it.
    open: AtomicBool,
    lease: Duration,
    default_max_in_flight: i32,
}

/// A delivery leased by ingest, with the worker slot reserved for it.
#[derive(Debug)]
pub struct Preleased {
    /// The claimed delivery.
    pub job: Claimed,
    /// Its worker slot.
    pub slot: OwnedSemaphorePermit,
    /// The claim's span (with tracing on).
    pub claim: Option<SpanContext>,
}

/// The dispatcher's end of the hand-off.
pub type Received = mpsc::UnboundedReceiver<Preleased>;

impl Prelease {
    /// The hand-off for a dispatcher with `settings`; the receiver goes to the dispatcher.
    pub fn new(settings: &DeliverySettings) -> (Arc<Prelease>, Received) {
        let (jobs, received) = mpsc::unbounded_channel();
        let shared = Prelease {
            slots: Arc::new(Semaphore::new(settings.workers)),
            jobs,
            open: AtomicBool::new(false),
            lease: settings.lease,
            default_max_in_flight: settings.endpoint_max_in_flight,
        };
        (Arc::new(shared), received)
    }

    /// The dispatcher's worker slots.
    pub fn slots(&self) -> Arc<Semaphore> {
        self.slots.clone()
    }

    /// The dispatcher says whether it owes a general claim (then nothing is leased
    /// ahead of it).
    pub fn set_owed_general(&self, owed: bool) {
        self.open.store(!owed, Ordering::Release);
    }

    /// Whether ingest may lease now.
    pub fn open(&self) -> bool {
        self.open.load(Ordering::Acquire) && !self.jobs.is_closed()
    }

    /// A free worker slot for each of `n` deliveries, or none.
    fn reserve(&self, n: usize) -> Option<Vec<OwnedSemaphorePermit>> {
        let mut slots = Vec::with_capacity(n);
        for _ in 0..n {
            slots.push(self.slots.clone().try_acquire_owned().ok()?);
        }
        Some(slots)
    }
}

/// Store `event` with its fan-out and, when `prelease` has a slot for each, lease its
/// deliveries in the same transaction and hand them to the dispatcher. The answer's
/// `deliveries` are those left to claim (not leased here): what ingest hands over by id.
pub async fn store(pool: &Pool, event: &NewEvent<'_>, prelease: &Prelease) -> Result<Stored, sqlx::Error> {
    // The transaction's statements bypass the pool's own accounting: what a failure says
    // about the node (read-only, full, gone) reaches its health here, as the plain
    // write's does.
    store_leasing(pool, event, prelease).await.inspect_err(|e| {
        pool.note(e);
    })
}

async fn store_leasing(pool: &Pool, event: &NewEvent<'_>, prelease: &Prelease) -> Result<Stored, sqlx::Error> {
    let mut tx = pool.begin_planned(Planning::Cached).await?;
    let Some(mut stored) = events::insert_in(&mut tx, event).await? else {
        // A twin committed after this statement's snapshot: the plain write finds it.
        drop(tx);
        return events::insert_with_fanout(pool, event).await;
    };
    let slots = match stored.deliveries.len() {
        0 => None,
        n => prelease.reserve(n),
    };
    let Some(slots) = slots else {
        tx.commit().await?;
        return Ok(stored);
    };
    let started = SystemTime::now();
    let fresh = queue::claim_fresh_in(
        &mut tx,
        &stored.deliveries,
        stored.deliveries.len() as i64,
        prelease.lease,
        prelease.default_max_in_flight,
    )
    .await?;
    // Armed before the commit: from here a lease may exist that nobody works on.
    let mut unsent = Unsent { pool: pool.clone(), leases: fresh.claimed };
    tx.commit().await?;
    stored.deliveries.retain(|id| !unsent.leases.iter().any(|job| job.id == *id));
    let claim = crate::telemetry::claim_span(started, unsent.leases.len(), 0);
    for (job, slot) in std::mem::take(&mut unsent.leases).into_iter().zip(slots) {
        if let Err(mpsc::error::SendError(back)) = prelease.jobs.send(Preleased { job, slot, claim: claim.clone() }) {
            unsent.leases.push(back.job);
        }
    }
    Ok(stored)
}

/// Leases taken that no worker has received; given back when dropped.
struct Unsent {
    pool: Pool,
    leases: Vec<Claimed>,
}

impl Drop for Unsent {
    fn drop(&mut self) {
        if self.leases.is_empty() {
            return;
        }
        let leases: Vec<(DeliveryId, i64)> = self.leases.iter().map(|job| (job.id, job.claim_token)).collect();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(deliveries = leases.len(), "leases not handed to a worker; they end by themselves");
            return;
        };
        let pool = self.pool.clone();
        runtime.spawn(async move {
            for (id, token) in leases {
                // Fenced: a lease that never committed, or was taken since, is left alone.
                if let Err(e) = queue::release(&pool, id, token, chrono::Utc::now()).await {
                    tracing::warn!(delivery_id = %id, error = %e, "giving back an unsent lease failed; it ends by itself");
                }
            }
        });
    }
}
