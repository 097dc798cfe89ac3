//! The pre-leased hand-off: the deliveries of a webhook written alone, or of a writer's
//! batch, leased by the statement that stores them.
//!
//! At low load a webhook cost two round trips before its attempt could start: ingest's
//! statement, then the claim by key of the deliveries it created, each its own commit
//! (bench/PROFILE.md). In a process that both ingests and delivers (role `all`), a
//! webhook that ingest writes alone (group commit's direct write, or a writer's batch of
//! one, `ingest::batcher`) is stored and its deliveries leased in one statement
//! ([`crate::store::events::insert_and_claim`]): each delivery whose endpoint has room is
//! inserted already leased (one row version), with the endpoint locks, in-flight count,
//! rate tokens and fencing token of any claim (`wg_lease_room_v5`, migrations 0028, 0031,
//! 0032 and 0033). The leased deliveries go to this process's dispatcher with a worker
//! slot each, reserved before the statement, so no lease waits for a slot.
//!
//! A writer's batch of two or more webhooks ([`store_batch`]) is leased the same way by
//! its batch statement ([`crate::store::events::insert_batch_and_claim`]): there one
//! endpoint may take several leases at once (`wg_lease_room_v6`, migrations 0029 and
//! 0033: its room, its whole rate tokens, an equal share of the slots held), with up to
//! [`MOST_LEASED_PER_WEBHOOK`] slots reserved per webhook. Only a small batch (at most
//! [`LARGEST_LEASED_BATCH`] webhooks: light or moderate load): a leasing statement holds
//! its endpoints' rows until its commit, and under load the claims waited behind ingest's
//! commits (bench/PROFILE.md). A batch holding an event with an ordering key is stored
//! plainly too (the reason below).
//!
//! A leasing statement does not wait for an endpoint row that another transaction holds
//! (a claim, another writer's lease, an update of the endpoint): it grants that endpoint
//! nothing, and its deliveries are handed over by id as below. Waiting, every write to
//! one endpoint went single file behind the commit of the one before it, and at 1,000/s
//! on a slow spell of the bench's host the delivery p50 rose to 14-15 ms
//! (bench/PROFILE.md, "Leasing skips a locked endpoint").
//!
//! It is not done (the deliveries are handed over by id, [`crate::wake::Handoff`], as
//! before) when the dispatcher has no free slot, when it owes a general claim (due work
//! older than this webhook may be waiting, and that goes first), once it has stopped, or
//! for an event with an ordering key (its line's row is locked by the fan-out, and the
//! lease would then lock the endpoint's after it, an order the recorder does not keep;
//! the statement leases no ordered delivery either way).
//!
//! A request that goes away meanwhile (its client gone, its deadline passed) does not
//! leave leases committed that no worker receives: the statement runs in the requester's
//! own task, and a requester that drops it before it ends hands what is left of it to a
//! task of its own, which finishes it ([`FinishOnDrop`]). (A task spawned for every
//! statement did the same, and its end woke the requester while the dispatcher's wake
//! was queued too: two tasks ready at once, for which the runtime wakes its other
//! thread.) A lease the dispatcher cannot take any more (it stopped meanwhile) is given
//! back at once ([`queue::release`], fenced by its token, the attempt not spent), not
//! left until the lease runs out.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use futures_util::FutureExt as _;
use opentelemetry::trace::SpanContext;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::DeliverySettings;
use crate::db::Pool;
use crate::ids::DeliveryId;
use crate::queue::{self, Claimed};
use crate::store::events::{self, ClaimTerms, NewEvent, Stored};

/// Most deliveries of one webhook leased by the statement that stores it: the worker
/// slots reserved before it, when that many are free (a webhook's fan-out is not known
/// before the statement; what it creates beyond them is handed over by id).
pub const MOST_LEASED_PER_WEBHOOK: usize = 8;

/// The largest batch of group commit's whose deliveries its statement leases; a larger
/// one is stored plainly and its deliveries claimed after its commit. Batches grow with
/// the load (on the bench about 2-4 webhooks at 1,000-2,000/s, 8 at 3,000/s, 15-35 at
/// 4,000-5,000/s). A leasing statement holds its endpoints' rows until it commits, so
/// the claims of every process wait behind it. With every batch leasing, the bench's
/// highest sustained rate fell to 4,000/s or less (5,000/s held in none of six runs,
/// waiting for the rows or skipping those others held; the build before held it in five
/// of nine; bench/PROFILE.md, "Small batches lease too").
pub const LARGEST_LEASED_BATCH: usize = 8;

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

    /// Whether deliveries may be leased ahead of the dispatcher's claims now: it owes no
    /// general claim (due work older than theirs may be waiting otherwise, and that goes
    /// first) and has not stopped. The recorder asks this before it leases the next heads
    /// of the lines it moves on (`crate::deliver::recorder`).
    pub fn leases_ahead(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Whether ingest may lease the deliveries of `event` now. (A dispatcher that stops
    /// closes the hand-off first; one that is gone without doing so gets leases that are
    /// given back at once.)
    pub fn takes(&self, event: &NewEvent<'_>) -> bool {
        event.ordering_key.is_none() && self.open.load(Ordering::Acquire)
    }

    /// Whether ingest may lease the deliveries of a batch of `events` now: each of them
    /// as [`Prelease::takes`] would, and no more than [`LARGEST_LEASED_BATCH`] of them.
    /// (A batch with an ordered event is stored plainly: the fan-out locks its line's row
    /// before the lease would lock the endpoints'.)
    pub fn takes_batch(&self, events: &[events::OwnedEvent]) -> bool {
        events.len() <= LARGEST_LEASED_BATCH && events.iter().all(|event| self.takes(&event.as_new()))
    }

    /// Up to [`MOST_LEASED_PER_WEBHOOK`] free worker slots for each of `webhooks` (none
    /// when none is free).
    fn reserve(&self, webhooks: usize) -> Vec<OwnedSemaphorePermit> {
        std::iter::from_fn(|| self.slots.clone().try_acquire_owned().ok())
            .take(MOST_LEASED_PER_WEBHOOK * webhooks)
            .collect()
    }

    /// How a statement holding `slots` worker slots leases (ingest's, and the recorder's
    /// promotion).
    pub(super) fn terms(&self, slots: &[OwnedSemaphorePermit]) -> ClaimTerms {
        ClaimTerms { limit: slots.len() as i64, lease: self.lease, default_max_in_flight: self.default_max_in_flight }
    }

    /// Hand each of `leased` to the dispatcher with one of `slots` (the slots left over
    /// are freed); a lease it cannot take any more is given back. `by` names the leaser
    /// in the leases' metric (`ingest`, `promotion`).
    pub fn hand_over(
        &self,
        pool: &Pool,
        leased: Vec<Claimed>,
        slots: Vec<OwnedSemaphorePermit>,
        started: SystemTime,
        by: &'static str,
    ) {
        crate::metrics::leases(by, leased.len());
        let claim = crate::telemetry::claim_span(started, leased.len(), 0);
        let mut unsent = Vec::new();
        // At most `limit` were claimed, so each has a slot; one that had none would be
        // given back rather than left to run out.
        let mut slots = slots.into_iter();
        for job in leased {
            let Some(slot) = slots.next() else {
                tracing::error!(delivery_id = %job.id, "a lease beyond the slots reserved for it; giving it back");
                unsent.push((job.id, job.claim_token));
                continue;
            };
            if let Err(mpsc::error::SendError(back)) = self.jobs.send(Preleased { job, slot, claim: claim.clone() }) {
                unsent.push((back.job.id, back.job.claim_token));
            }
        }
        give_back(pool, unsent);
    }
}

/// Store `event` with its fan-out and, when [`Prelease::takes`] it and a worker slot is
/// free, lease its deliveries in the same statement and hand them to the dispatcher.
/// The answer's `deliveries` are those left to claim (not leased here): what ingest
/// hands over by id.
///
/// Finished even when the caller goes away meanwhile (see the module doc). A statement
/// the database refused for a reason that says nothing of its health has the webhook
/// stored the plain way (nothing of a refused statement committed); any other failure is
/// the answer (a statement that committed and then could not be read must not be written
/// again).
pub async fn store(pool: &Pool, event: events::OwnedEvent, prelease: Arc<Prelease>) -> Result<Stored, sqlx::Error> {
    let pool = pool.clone();
    carried_through("storing a webhook", async move {
        let event = event.as_new();
        match store_leasing(&pool, &event, &prelease).await {
            Err(e) if matches!(e, sqlx::Error::Database(_)) && !crate::db::is_unavailable(&e) => {
                tracing::warn!(error = %e, "storing a webhook with its deliveries leased failed; storing it alone");
                crate::db::retry_conflicts(|| events::insert_with_fanout(&pool, &event)).await
            }
            stored => stored,
        }
    })
    .await
}

/// `store`, run in the caller's task and finished even when the caller goes away
/// ([`FinishOnDrop`]); a panic in it is an error naming `what` (answered 500, as when the
/// statement had a task of its own), not the end of the requester's connection.
async fn carried_through<T: Send + 'static>(
    what: &str,
    store: impl Future<Output = Result<T, sqlx::Error>> + Send + 'static,
) -> Result<T, sqlx::Error> {
    AssertUnwindSafe(FinishOnDrop::new(store))
        .catch_unwind()
        .await
        .unwrap_or_else(|_| Err(sqlx::Error::Protocol(format!("{what} stopped: it panicked"))))
}

/// A future run in its caller's task that, dropped before it ends, is finished in a task
/// of its own: what it has started (a statement that may commit leases) is carried
/// through to where it hands its work on, whoever stopped waiting for its answer.
struct FinishOnDrop<T: Send + 'static> {
    future: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
}

impl<T: Send + 'static> FinishOnDrop<T> {
    fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        FinishOnDrop { future: Some(Box::pin(future)) }
    }
}

impl<T: Send + 'static> Future for FinishOnDrop<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        // Taken out while it is polled: one that panics is gone with the unwinding, never
        // handed to a task to be polled again.
        let Some(mut future) = self.future.take() else {
            return Poll::Pending; // polled after it ended: never, as with any future
        };
        let polled = future.as_mut().poll(cx);
        if polled.is_pending() {
            self.future = Some(future);
        }
        polled
    }
}

impl<T: Send + 'static> Drop for FinishOnDrop<T> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else { return };
        // Outside a runtime (the process ending) there is nowhere to finish it: a lease
        // it may have committed runs out and its delivery is claimed again.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                future.await;
            });
        }
    }
}

/// [`store`], in the caller's task.
pub async fn store_leasing(pool: &Pool, event: &NewEvent<'_>, prelease: &Prelease) -> Result<Stored, sqlx::Error> {
    let slots = if prelease.takes(event) { prelease.reserve(1) } else { Vec::new() };
    if slots.is_empty() {
        return crate::db::retry_conflicts(|| events::insert_with_fanout(pool, event)).await;
    }
    let terms = prelease.terms(&slots);
    let started = SystemTime::now();
    let (mut stored, fresh) = crate::db::retry_conflicts(|| events::insert_and_claim(pool, event, terms)).await?;
    stored.deliveries.retain(|id| !fresh.claimed.iter().any(|job| job.id == *id));
    prelease.hand_over(pool, fresh.claimed, slots, started, "ingest");
    Ok(stored)
}

/// Store a batch of `events` (group commit's, `crate::ingest::batcher`) with their
/// fan-out and, when [`Prelease::takes_batch`] and a worker slot is free, lease their
/// deliveries in the same statement and hand them to the dispatcher, as [`store`] does
/// for one webhook: an answer per event, in order, whose `deliveries` are those left to
/// claim. Finished even when the caller goes away meanwhile. Any failure is the answer
/// (the caller knows how to store a batch the plain way, and when it may).
pub async fn store_batch(
    pool: &Pool,
    events: Arc<Vec<events::OwnedEvent>>,
    prelease: Arc<Prelease>,
) -> Result<Vec<Stored>, sqlx::Error> {
    let pool = pool.clone();
    carried_through("storing a batch of webhooks", async move { store_batch_leasing(&pool, &events, &prelease).await })
        .await
}

/// [`store_batch`], in the caller's task.
pub async fn store_batch_leasing(
    pool: &Pool,
    events: &[events::OwnedEvent],
    prelease: &Prelease,
) -> Result<Vec<Stored>, sqlx::Error> {
    let slots = if prelease.takes_batch(events) { prelease.reserve(events.len()) } else { Vec::new() };
    if slots.is_empty() {
        return crate::db::retry_conflicts(|| events::insert_batch_with_fanout(pool, events)).await;
    }
    let terms = prelease.terms(&slots);
    let started = SystemTime::now();
    let (mut stored, fresh) =
        crate::db::retry_conflicts(|| events::insert_batch_and_claim(pool, events, terms)).await?;
    let leased: std::collections::HashSet<DeliveryId> = fresh.claimed.iter().map(|job| job.id).collect();
    for one in &mut stored {
        one.deliveries.retain(|id| !leased.contains(id));
    }
    prelease.hand_over(pool, fresh.claimed, slots, started, "ingest");
    Ok(stored)
}

/// Give back, in the background (the producer's answer does not wait for it), the
/// leases `(delivery, claim token)` that no worker received.
fn give_back(pool: &Pool, leases: Vec<(DeliveryId, i64)>) {
    if leases.is_empty() {
        return;
    }
    let pool = pool.clone();
    tokio::spawn(async move {
        for (id, token) in leases {
            // Fenced: a lease taken since is left alone.
            if let Err(e) = queue::release(&pool, id, token, crate::clock::now()).await {
                tracing::warn!(delivery_id = %id, error = %e, "giving back an unsent lease failed; it ends by itself");
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::FinishOnDrop;
    use futures_util::FutureExt as _;
    use std::future::Future;
    use std::panic::AssertUnwindSafe;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Poll};
    use std::time::Duration;
    use tokio::sync::oneshot;

    /// Dropped while it waits, the future is finished in a task of its own: what it does
    /// after the wait still happens. Awaited to its end, it answers and nothing is left.
    #[tokio::test]
    async fn a_future_dropped_before_its_end_is_finished_all_the_same() {
        let (go, wait) = oneshot::channel::<()>();
        let (done, finished) = oneshot::channel::<&str>();
        let started = FinishOnDrop::new(async move {
            let _ = wait.await;
            let _ = done.send("finished");
        });
        assert!(tokio::time::timeout(Duration::from_millis(20), started).await.is_err(), "still waiting");
        go.send(()).expect("the dropped future still listens");
        assert_eq!(tokio::time::timeout(Duration::from_secs(5), finished).await, Ok(Ok("finished")));

        assert_eq!(FinishOnDrop::new(async { 7 }).await, 7);
    }

    /// Counts its polls and panics in the first.
    struct Panics(Arc<AtomicUsize>);

    impl Future for Panics {
        type Output = ();

        fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            panic!("a panic in the statement's future");
        }
    }

    /// A future that panics is caught where it is awaited, and is not handed to a task to
    /// be polled again when its wrapper is dropped.
    #[tokio::test]
    async fn a_future_that_panics_is_not_finished_again() {
        let polls = Arc::new(AtomicUsize::new(0));
        let caught = AssertUnwindSafe(FinishOnDrop::new(Panics(polls.clone()))).catch_unwind().await;
        assert!(caught.is_err());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(polls.load(Ordering::SeqCst), 1, "polled once, where it was awaited");
    }
}
