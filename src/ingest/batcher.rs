//! Group commit for ingest: concurrent webhooks share one statement and one commit.
//!
//! A durable ingest is bounded by commits (each waits for its WAL flush). Each writer
//! task takes whatever is queued when it becomes free (up to [`MAX_BATCH`]) and stores it
//! with one statement, so under load many webhooks share a commit, and at low load a
//! webhook is written alone at once: nothing waits for a timer. Every webhook still gets
//! its own exact answer (stored or duplicate, with its event id) and none is answered
//! before the commit that holds it.
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

use sqlx::PgPool;
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::db;
use crate::store::events::{self, OwnedEvent, Stored};

/// Most events in one statement.
pub const MAX_BATCH: usize = 128;

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
        match db::unavailable(err) {
            Some(db::Unavailable::NotCommitted) => {
                tracing::warn!(error = %err, "database unavailable; nothing was stored");
                StoreError::Unavailable
            }
            Some(db::Unavailable::Unconfirmed) => {
                tracing::warn!(error = %err, "database connection failed before the write was confirmed");
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
}

impl Batcher {
    /// Start `writers` writer tasks on `pool`. They end when every handle is dropped.
    pub fn start(pool: PgPool, writers: usize) -> Batcher {
        let (jobs, queue) = mpsc::channel::<Job>(MAX_BATCH * writers.max(1) * 4);
        let queue = Arc::new(Mutex::new(queue));
        for _ in 0..writers.max(1) {
            tokio::spawn(write_loop(pool.clone(), queue.clone()));
        }
        Batcher { jobs }
    }

    /// Store one event (with its fan-out); returns once it is committed, or at `deadline`
    /// with [`StoreError::Unconfirmed`] (or [`StoreError::Unavailable`] if it never got
    /// to a writer).
    pub async fn store(&self, event: OwnedEvent, deadline: Instant) -> Result<Stored, StoreError> {
        let (reply, answer) = oneshot::channel();
        // Off: not even a clone of the current (request log) span.
        let span = if crate::telemetry::enabled() { tracing::Span::current() } else { tracing::Span::none() };
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

async fn write_loop(pool: PgPool, queue: Arc<Mutex<mpsc::Receiver<Job>>>) {
    let mut batch: Vec<Job> = Vec::with_capacity(MAX_BATCH);
    loop {
        {
            let mut queue = queue.lock().await;
            match queue.recv().await {
                Some(job) => batch.push(job),
                None => return,
            }
            while batch.len() < MAX_BATCH {
                match queue.try_recv() {
                    Ok(job) => batch.push(job),
                    Err(_) => break,
                }
            }
        }
        // Nobody waits for these any more (deadline passed, client gone): the requester
        // was not told they are stored, and the producer retries.
        batch.retain(|job| !job.reply.is_closed());
        let Some(deadline) = batch.iter().map(|job| job.deadline).max() else { continue };
        let span = crate::telemetry::commit_span(batch.iter().map(|job| &job.span), batch.len());
        let (events, replies): (Vec<OwnedEvent>, Vec<_>) = batch.drain(..).map(|job| (job.event, job.reply)).unzip();
        let results = match tokio::time::timeout_at(deadline, write(&pool, &events).instrument(span)).await {
            Ok(results) => results,
            Err(_) => {
                // The statement may have reached the server. The connection goes back
                // through sqlx's drain, out of the pool until the path answers or the
                // kernel gives up on it (db::tcp).
                tracing::warn!(events = events.len(), "no answer from the database before the ingest deadline");
                events.iter().map(|_| Err(StoreError::Unconfirmed)).collect()
            }
        };
        for (reply, result) in replies.into_iter().zip(results) {
            // The requester may have gone meanwhile: the event is stored either way,
            // and a retry will be answered as a duplicate.
            let _ = reply.send(result);
        }
    }
}

async fn write(pool: &PgPool, events: &[OwnedEvent]) -> Vec<Result<Stored, StoreError>> {
    if events.len() == 1 {
        return vec![events::insert_with_fanout(pool, &events[0].as_new()).await.map_err(|e| StoreError::from(&e))];
    }
    match events::insert_batch_with_fanout(pool, events).await {
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

    #[test]
    fn a_failure_says_whether_the_event_may_be_stored() {
        assert_eq!(StoreError::from(&sqlx::Error::PoolTimedOut), StoreError::Unavailable);
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(StoreError::from(&sqlx::Error::Io(reset)), StoreError::Unconfirmed);
        assert_eq!(StoreError::from(&db::no_answer("a test")), StoreError::Unconfirmed);
        assert_eq!(StoreError::from(&sqlx::Error::RowNotFound), StoreError::Failed);
    }
}
