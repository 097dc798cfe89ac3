//! Group commit for ingest: concurrent webhooks share one statement and one commit.
//!
//! A durable ingest is bounded by commits (each waits for its WAL flush). Each writer
//! task takes whatever is queued when it becomes free (up to [`MAX_BATCH`]) and stores it
//! with one statement, so under load many webhooks share a commit, and at low load a
//! webhook is written alone at once: nothing waits for a timer. Every webhook still gets
//! its own exact answer (stored or duplicate, with its event id) and none is answered
//! before the commit that holds it.
//!
//! Adaptive batching: at moderate concurrency (16 producers, say) the answers of one
//! commit come back as a trickle of new requests, and a free writer would grab each as a
//! batch of one: two thirds of the commits at 16 connections held a single webhook in
//! the profile of bench/PROFILE.md. So a writer whose batch is not full, while
//! [`CONCURRENT_COMMITS`] commits are already in flight, keeps collecting until one of
//! them finishes (at most [`LINGER`]). The database is busy with those commits anyway;
//! the wait turns the trickle into one statement. With fewer commits in flight (one
//! producer, light load) nothing waits, so single-connection latency is unchanged.
//!
//! A lone webhook skips the writer tasks: when nothing is queued and no commit is in
//! flight, its requester writes it itself ([`Batcher::store`]), and counts as a commit in
//! flight while it does, so webhooks arriving meanwhile gather in the queue for the
//! next batch exactly as they would behind a writer's commit. That saves the two task
//! wake-ups of the hand-over (request to writer, writer back to request), which at one
//! connection are a visible part of a webhook's time. In role `all`, while the
//! process's dispatcher has free workers and owes no general claim, a webhook written
//! alone (directly, or as a writer's batch of one) has its deliveries leased for them by
//! the statement that stores it ([`crate::deliver::prelease`]; finished even when the
//! requester goes away, so that no lease is stranded), and so has a writer's batch of
//! two to [`crate::deliver::prelease::LARGEST_LEASED_BATCH`] webhooks, none of them with
//! an ordering key.
//!
//! If a batch fails for a reason other than the database being unreachable (say one
//! event trips a trigger), its events are retried one by one so each gets its own
//! verdict.
//!
//! Every event has a deadline (`--db-timeout-secs` after its request started): its
//! requester stops waiting then, and a writer stops waiting for a write once the last
//! deadline of its batch has passed. A writer does not write events whose requesters
//! have already gone.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::db::Pool;
use tokio::sync::{Mutex, Notify, mpsc, oneshot};
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::db;
use crate::deliver::prelease::{self, Prelease};
use crate::store::events::{self, OwnedEvent, Stored};

/// Most events in one statement.
pub const MAX_BATCH: usize = 128;

/// Commits in flight at which a free writer with a part-filled batch waits for one of
/// them to finish before starting its own (see the module docs). Measured on the bench
/// (16 / 64 connections, same run): 2 gave 4,436/s and 7,110/s, 1 gave 4,499/s and
/// 8,099/s with less PostgreSQL CPU per webhook (165 µs against 199 µs). The
/// [`LINGER`] bound keeps one slow commit from holding the next batch back for long.
pub const CONCURRENT_COMMITS: usize = 1;

/// The longest a writer lingers for that (a bound, not a timer every batch waits for).
pub const LINGER: Duration = Duration::from_millis(2);

/// Why an event was not stored, or not known to be (the detail has been logged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// The database is unreachable and nothing was written: answer 503, the producer
    /// retries.
    Unavailable,
    /// The write may have reached the database, which did not confirm it (connection
    /// lost, or no answer before the deadline): the event may be stored. Answer 503; the
    /// producer's retry is stored, or answered as a duplicate.
    Unconfirmed,
    /// Anything else: answer 500.
    Failed,
}

impl From<&sqlx::Error> for StoreError {
    fn from(err: &sqlx::Error) -> Self {
        use crate::log_throttle::{INTERVAL, Throttle};
        static NOT_STORED: Throttle = Throttle::new(INTERVAL);
        static UNCONFIRMED: Throttle = Throttle::new(INTERVAL);
        match db::unavailable(err) {
            Some(db::Unavailable::NotCommitted) => {
                if let Some(left_out) = NOT_STORED.admit() {
                    tracing::warn!(error = %err, left_out, "database unavailable; nothing was stored");
                }
                StoreError::Unavailable
            }
            Some(db::Unavailable::Unconfirmed) => {
                if let Some(left_out) = UNCONFIRMED.admit() {
                    tracing::warn!(error = %err, left_out, "database connection failed before the write was confirmed");
                }
                StoreError::Unconfirmed
            }
            None => {
                tracing::error!(error = %err, "storing an event failed");
                StoreError::Failed
            }
        }
    }
}

struct Job {
    event: OwnedEvent,
    /// The requester's `store` span (none when tracing is off): the commit links to it.
    span: tracing::Span,
    deadline: Instant,
    reply: oneshot::Sender<Result<Stored, StoreError>>,
}

/// The handle ingest uses. Cheap to clone.
#[derive(Clone)]
pub struct Batcher {
    jobs: mpsc::Sender<Job>,
    writers: Arc<Writers>,
    pool: Pool,
    /// With a dispatcher in this process: a webhook written alone has its deliveries
    /// leased by the statement that stores it.
    prelease: Option<Arc<Prelease>>,
}

impl Batcher {
    /// Start `writers` writer tasks on `pool`. They end when every handle is dropped.
    /// With `prelease`, a webhook written alone also has its deliveries leased by its
    /// statement ([`crate::deliver::prelease`]).
    pub fn start(pool: Pool, writers: usize, prelease: Option<Arc<Prelease>>) -> Batcher {
        let (jobs, queue) = mpsc::channel::<Job>(MAX_BATCH * writers.max(1) * 4);
        let shared = Arc::new(Writers::new(queue));
        for _ in 0..writers.max(1) {
            tokio::spawn(write_loop(pool.clone(), shared.clone(), prelease.clone()));
        }
        Batcher { jobs, writers: shared, pool, prelease }
    }

    /// Webhooks queued for the writers now, not yet taken into a batch.
    pub fn queued(&self) -> usize {
        self.jobs.max_capacity() - self.jobs.capacity()
    }

    /// Store one event (with its fan-out); returns once it is committed, or at `deadline`
    /// with [`StoreError::Unconfirmed`] (or [`StoreError::Unavailable`] if it never got
    /// to a writer).
    pub async fn store(&self, event: OwnedEvent, deadline: Instant) -> Result<Stored, StoreError> {
        // In the requester's task, before it takes a direct pass or queues the event: a
        // writer stores one batch at a time while the next one waits for it, and
        // computing the terms there put a parse of every body of its batch between two
        // commits (with 12 KiB bodies, +8 % at 64 connections: bench/PROFILE.md).
        let event = event.with_terms();
        // Off: not even a clone of the current (request log) span.
        let span = if crate::telemetry::enabled() { tracing::Span::current() } else { tracing::Span::none() };
        if let Some(in_flight) = self.writers.write_directly(&self.jobs) {
            let span = crate::telemetry::commit_span(std::iter::once(&span), 1);
            let alone = write_alone(&self.pool, event, self.prelease.clone());
            let written = write_in_flight(1, alone, span, deadline, in_flight).await;
            return written.into_iter().next().unwrap_or(Err(StoreError::Failed));
        }
        let (reply, answer) = oneshot::channel();
        match tokio::time::timeout_at(deadline, self.jobs.send(Job { event, span, deadline, reply })).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                tracing::error!("ingest writers are gone");
                return Err(StoreError::Failed);
            }
            // Every writer busy until the deadline: never queued, nothing written.
            Err(_) => {
                tracing::warn!("no ingest writer free before the deadline; nothing was stored");
                return Err(StoreError::Unavailable);
            }
        }
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(result) => result.unwrap_or(Err(StoreError::Failed)),
            // Queued or being written: it may still be (or have been) committed.
            Err(_) => Err(StoreError::Unconfirmed),
        }
    }
}

/// What the writer tasks share.
struct Writers {
    /// The queue; a writer holds the lock while it collects a batch.
    queue: Mutex<mpsc::Receiver<Job>>,
    /// Writes in flight.
    committing: AtomicUsize,
    /// Batches in hand, from the moment a writer takes its first job (or a requester its
    /// direct pass) until the write ends. A direct write needs none: one that overtook a
    /// writer's batch collected behind the last commit would split it in two commits.
    holding: AtomicUsize,
    /// Signalled when a write finishes.
    finished: Notify,
}

impl Writers {
    fn new(queue: mpsc::Receiver<Job>) -> Writers {
        Writers {
            queue: Mutex::new(queue),
            committing: AtomicUsize::new(0),
            holding: AtomicUsize::new(0),
            finished: Notify::new(),
        }
    }

    /// A pass to write one webhook in the requester's own task: given only while nothing
    /// is queued on `jobs` and no batch is in hand (collected or committing). While it is
    /// held it counts as a commit in flight, so arrivals queue up for the next batch.
    fn write_directly(self: &Arc<Self>, jobs: &mpsc::Sender<Job>) -> Option<InFlight> {
        if jobs.capacity() < jobs.max_capacity() {
            return None;
        }
        self.holding.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).ok()?;
        Some(InFlight::start(self))
    }

    /// Collect the next batch into `batch`; false when every handle is gone.
    async fn collect(&self, batch: &mut Vec<Job>) -> bool {
        let mut queue = self.queue.lock().await;
        match queue.recv().await {
            Some(job) => {
                // In the same poll that took the job off the queue: no direct write can
                // slip in between.
                self.holding.fetch_add(1, Ordering::AcqRel);
                batch.push(job);
            }
            None => return false,
        }
        take_queued(&mut queue, batch);
        let until = Instant::now() + LINGER;
        while batch.len() < MAX_BATCH {
            // Registered before the check, so a write finishing in between is not missed.
            let finished = self.finished.notified();
            tokio::pin!(finished);
            finished.as_mut().enable();
            if self.committing.load(Ordering::Acquire) < CONCURRENT_COMMITS {
                break;
            }
            tokio::select! {
                () = &mut finished => {}
                job = queue.recv() => match job {
                    Some(job) => {
                        batch.push(job);
                        take_queued(&mut queue, batch);
                    }
                    None => break,
                },
                () = tokio::time::sleep_until(until) => break,
            }
        }
        true
    }
}

/// A commit in flight, a writer's or a requester's direct one, whose batch is counted in
/// `holding`; ends both counts (and lets a lingering writer go) when dropped, also when
/// the requester is cancelled mid-write.
struct InFlight(Arc<Writers>);

impl InFlight {
    fn start(writers: &Arc<Writers>) -> InFlight {
        writers.committing.fetch_add(1, Ordering::AcqRel);
        InFlight(writers.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.committing.fetch_sub(1, Ordering::AcqRel);
        self.0.holding.fetch_sub(1, Ordering::AcqRel);
        self.0.finished.notify_waiters();
    }
}

/// Run `write` of `events` events as the commit `in_flight` by `deadline`, under `span`:
/// a verdict for each, in order. Used by the writers and by a requester's direct write
/// alike.
async fn write_in_flight(
    events: usize,
    write: impl Future<Output = Vec<Result<Stored, StoreError>>>,
    span: tracing::Span,
    deadline: Instant,
    in_flight: InFlight,
) -> Vec<Result<Stored, StoreError>> {
    let started = Instant::now();
    let written = tokio::time::timeout_at(deadline, write.instrument(span)).await;
    drop(in_flight);
    crate::metrics::ingest_write(events, started.elapsed());
    written.unwrap_or_else(|_| {
        // The statement may have reached the server. The connection goes back through
        // sqlx's drain, out of the pool until the path answers or the kernel gives up on
        // it (db::tcp).
        tracing::warn!(events, "no answer from the database before the ingest deadline");
        vec![Err(StoreError::Unconfirmed); events]
    })
}

/// A webhook written alone (a requester's direct write, or a writer's batch of one): with
/// its deliveries leased by the same statement when the dispatcher of this process takes
/// them now, else stored plainly.
async fn write_alone(
    pool: &Pool,
    event: OwnedEvent,
    prelease: Option<Arc<Prelease>>,
) -> Vec<Result<Stored, StoreError>> {
    match prelease.filter(|p| p.takes(&event.as_new())) {
        Some(prelease) => vec![prelease::store(pool, event, prelease).await.map_err(|e| StoreError::from(&e))],
        None => write(pool, std::slice::from_ref(&event)).await,
    }
}

/// A writer's batch of two or more webhooks: with their deliveries leased by the same
/// statement when the dispatcher of this process takes them now (a small batch,
/// [`Prelease::takes_batch`]), else stored plainly. A
/// leasing statement the database refused (nothing of it committed) has the batch stored
/// the plain way.
async fn write_many(
    pool: &Pool,
    events: Vec<OwnedEvent>,
    prelease: Option<Arc<Prelease>>,
) -> Vec<Result<Stored, StoreError>> {
    let Some(prelease) = prelease.filter(|p| p.takes_batch(&events)) else { return write(pool, &events).await };
    let events = Arc::new(events);
    match prelease::store_batch(pool, events.clone(), prelease).await {
        Ok(stored) => stored.into_iter().map(Ok).collect(),
        Err(e) if matches!(e, sqlx::Error::Database(_)) && !db::is_unavailable(&e) => {
            tracing::warn!(error = %e, events = events.len(), "storing a batch with its deliveries leased failed; storing it plainly");
            write(pool, &events).await
        }
        Err(e) => {
            let verdict = StoreError::from(&e);
            events.iter().map(|_| Err(verdict)).collect()
        }
    }
}

/// Move what is queued now into `batch`, up to [`MAX_BATCH`].
fn take_queued(queue: &mut mpsc::Receiver<Job>, batch: &mut Vec<Job>) {
    while batch.len() < MAX_BATCH {
        match queue.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
}

async fn write_loop(pool: Pool, writers: Arc<Writers>, prelease: Option<Arc<Prelease>>) {
    let mut batch: Vec<Job> = Vec::with_capacity(MAX_BATCH);
    loop {
        if !writers.collect(&mut batch).await {
            return;
        }
        // Nobody waits for these any more (deadline passed, client gone): the requester
        // was not told they are stored, and the producer retries.
        batch.retain(|job| !job.reply.is_closed());
        let Some(deadline) = batch.iter().map(|job| job.deadline).max() else {
            writers.holding.fetch_sub(1, Ordering::AcqRel);
            continue;
        };
        let span = crate::telemetry::commit_span(batch.iter().map(|job| &job.span), batch.len());
        let (events, replies): (Vec<OwnedEvent>, Vec<_>) = batch.drain(..).map(|job| (job.event, job.reply)).unzip();
        let in_flight = InFlight::start(&writers);
        // A batch of one is written as a requester writes its webhook alone, its
        // deliveries leased by its statement: at a few hundred webhooks a second, many
        // arrive while another's commit is in flight and are written here.
        let results = match <[OwnedEvent; 1]>::try_from(events) {
            Ok([event]) => {
                write_in_flight(1, write_alone(&pool, event, prelease.clone()), span, deadline, in_flight).await
            }
            Err(events) => {
                let count = events.len();
                write_in_flight(count, write_many(&pool, events, prelease.clone()), span, deadline, in_flight).await
            }
        };
        for (reply, result) in replies.into_iter().zip(results) {
            // The requester may have gone meanwhile: the event is stored either way,
            // and a retry will be answered as a duplicate.
            let _ = reply.send(result);
        }
    }
}

async fn write(pool: &Pool, events: &[OwnedEvent]) -> Vec<Result<Stored, StoreError>> {
    if events.len() == 1 {
        let event = events[0].as_new();
        let stored = db::retry_conflicts(|| events::insert_with_fanout(pool, &event)).await;
        return vec![stored.map_err(|e| StoreError::from(&e))];
    }
    match db::retry_conflicts(|| events::insert_batch_with_fanout(pool, events)).await {
        Ok(stored) => stored.into_iter().map(Ok).collect(),
        Err(e) if db::is_unavailable(&e) => {
            let verdict = StoreError::from(&e);
            events.iter().map(|_| Err(verdict)).collect()
        }
        Err(e) => {
            tracing::warn!(error = %e, events = events.len(), "batch insert failed; storing its events one by one");
            let mut out = Vec::with_capacity(events.len());
            for event in events {
                out.push(events::insert_with_fanout(pool, &event.as_new()).await.map_err(|e| StoreError::from(&e)));
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writers() -> (mpsc::Sender<Job>, Arc<Writers>) {
        let (jobs, queue) = mpsc::channel(MAX_BATCH * 2);
        (jobs, Arc::new(Writers::new(queue)))
    }

    async fn send(jobs: &mpsc::Sender<Job>, key: &str) {
        let (reply, _) = oneshot::channel();
        let event = OwnedEvent {
            source_id: crate::ids::SourceId(uuid::Uuid::nil()),
            source_name: "test".to_owned(),
            indexing: crate::search::Indexing::Content,
            dedupe_key: key.to_owned(),
            event_type: "t".to_owned(),
            content_type: None,
            headers: serde_json::Value::Null,
            payload: bytes::Bytes::new(),
            ordering_key: None,
            trace: None,
            terms: None,
        };
        let job = Job { event, span: tracing::Span::none(), deadline: Instant::now() + Duration::from_secs(60), reply };
        jobs.send(job).await.expect("queue open");
    }

    /// A writer collecting its next batch, in a task of its own.
    fn collect_in_background(writers: &Arc<Writers>) -> tokio::task::JoinHandle<Vec<Job>> {
        let writers = writers.clone();
        tokio::spawn(async move {
            let mut batch = Vec::new();
            writers.collect(&mut batch).await;
            batch
        })
    }

    fn keys(batch: &[Job]) -> Vec<&str> {
        batch.iter().map(|job| job.event.dedupe_key.as_str()).collect()
    }

    /// One producer, nothing else committing: the webhook is written at once, without
    /// any linger (virtual time does not move).
    #[tokio::test(start_paused = true)]
    async fn with_no_commit_in_flight_a_batch_of_one_goes_at_once() {
        let (jobs, writers) = writers();
        send(&jobs, "a").await;
        let start = Instant::now();
        let mut batch = Vec::new();
        assert!(writers.collect(&mut batch).await);
        assert_eq!(keys(&batch), ["a"]);
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    /// A commit in flight: the free writer keeps collecting what arrives until that
    /// commit finishes, then goes with all of it.
    #[tokio::test(start_paused = true)]
    async fn while_a_commit_is_in_flight_arrivals_join_the_next_batch() {
        let (jobs, writers) = writers();
        writers.committing.store(1, Ordering::Release);
        send(&jobs, "a").await;
        let collecting = collect_in_background(&writers);
        tokio::task::yield_now().await;
        send(&jobs, "b").await;
        send(&jobs, "c").await;
        tokio::task::yield_now().await;
        assert!(!collecting.is_finished(), "it waits while the other commit is in flight");
        writers.committing.store(0, Ordering::Release);
        writers.finished.notify_waiters();
        let batch = collecting.await.expect("collect");
        assert_eq!(keys(&batch), ["a", "b", "c"]);
    }

    /// The wait is bounded: a commit that takes long does not hold the next batch back
    /// for more than LINGER.
    #[tokio::test(start_paused = true)]
    async fn the_linger_is_bounded() {
        let (jobs, writers) = writers();
        writers.committing.store(1, Ordering::Release);
        send(&jobs, "a").await;
        let start = Instant::now();
        let mut batch = Vec::new();
        assert!(writers.collect(&mut batch).await);
        assert_eq!(keys(&batch), ["a"]);
        assert_eq!(start.elapsed(), LINGER);
    }

    /// A full batch never waits.
    #[tokio::test(start_paused = true)]
    async fn a_full_batch_goes_at_once() {
        let (jobs, writers) = writers();
        writers.committing.store(1, Ordering::Release);
        for i in 0..MAX_BATCH + 1 {
            send(&jobs, &format!("k{i}")).await;
        }
        let start = Instant::now();
        let mut batch = Vec::new();
        assert!(writers.collect(&mut batch).await);
        assert_eq!(batch.len(), MAX_BATCH);
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    /// A lone webhook is written by its requester only while nothing is queued and
    /// nothing is committing; while it is, the next arrivals gather for one batch.
    #[tokio::test(start_paused = true)]
    async fn a_lone_webhook_is_written_directly_and_counts_as_a_commit_in_flight() {
        let (jobs, writers) = writers();
        let in_flight = writers.write_directly(&jobs).expect("idle: the requester writes itself");
        assert!(writers.write_directly(&jobs).is_none(), "one direct write at a time");
        send(&jobs, "b").await;
        send(&jobs, "c").await;
        let collecting = collect_in_background(&writers);
        tokio::task::yield_now().await;
        assert!(!collecting.is_finished(), "a writer lingers behind the direct write");
        drop(in_flight);
        let batch = collecting.await.expect("collect");
        assert_eq!(keys(&batch), ["b", "c"]);
        assert!(writers.write_directly(&jobs).is_none(), "the writer holds a batch");
        writers.holding.fetch_sub(1, Ordering::AcqRel);
        assert!(writers.write_directly(&jobs).is_some(), "idle again");
    }

    /// Webhooks already queued, or a batch in a writer's hands: a new one queues behind
    /// them rather than overtaking. The second case is the race at the end of a commit:
    /// the writer lingering behind it holds its batch while `committing` is already 0.
    #[tokio::test(start_paused = true)]
    async fn no_direct_write_past_a_queue_or_a_collected_batch() {
        let (jobs, writers) = writers();
        writers.committing.store(1, Ordering::Release);
        send(&jobs, "a").await;
        assert!(writers.write_directly(&jobs).is_none(), "something is queued");
        let collecting = collect_in_background(&writers);
        tokio::task::yield_now().await;
        // The other commit ends; the lingering writer has not run since.
        writers.committing.store(0, Ordering::Release);
        assert!(writers.write_directly(&jobs).is_none(), "the writer holds a batch");
        assert_eq!(writers.committing.load(Ordering::Acquire), 0, "a refused pass changes nothing");
        writers.finished.notify_waiters();
        assert_eq!(keys(&collecting.await.expect("collect")), ["a"]);
    }

    /// A request cancelled in the middle of its direct write (its client went away, the
    /// server shut down) gives the pass back: no writer lingers behind a commit that no
    /// longer exists, and the next lone webhook writes directly again.
    #[tokio::test(start_paused = true)]
    async fn a_cancelled_direct_write_gives_its_pass_back() {
        let (jobs, writers) = writers();
        let in_flight = writers.write_directly(&jobs).expect("idle");
        let request = tokio::spawn(async move {
            let _in_flight = in_flight;
            std::future::pending::<()>().await;
        });
        tokio::task::yield_now().await;
        assert!(writers.write_directly(&jobs).is_none(), "the pass is held");
        request.abort();
        assert!(request.await.expect_err("aborted").is_cancelled());
        assert_eq!(writers.committing.load(Ordering::Acquire), 0);
        assert_eq!(writers.holding.load(Ordering::Acquire), 0);
        send(&jobs, "a").await;
        let start = Instant::now();
        let mut batch = Vec::new();
        assert!(writers.collect(&mut batch).await);
        assert_eq!((keys(&batch), start.elapsed()), (vec!["a"], Duration::ZERO), "no linger");
    }

    #[test]
    fn a_failure_says_whether_the_event_may_be_stored() {
        assert_eq!(StoreError::from(&sqlx::Error::PoolTimedOut), StoreError::Unavailable);
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(StoreError::from(&sqlx::Error::Io(reset)), StoreError::Unconfirmed);
        assert_eq!(StoreError::from(&db::no_answer("a test")), StoreError::Unconfirmed);
        assert_eq!(StoreError::from(&sqlx::Error::RowNotFound), StoreError::Failed);
    }
}
