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

use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::db;
use crate::store::events::{self, OwnedEvent, Stored};

/// Most events in one statement.
pub const MAX_BATCH: usize = 128;

/// Why an event was not stored (the detail has been logged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// The database is unreachable: answer 503, the producer retries.
    Unavailable,
    /// Anything else: answer 500.
    Failed,
}

impl From<&sqlx::Error> for StoreError {
    fn from(err: &sqlx::Error) -> Self {
        if db::is_unavailable(err) {
            tracing::warn!(error = %err, "database unavailable");
            StoreError::Unavailable
        } else {
            tracing::error!(error = %err, "storing an event failed");
            StoreError::Failed
        }
    }
}

type Job = (OwnedEvent, oneshot::Sender<Result<Stored, StoreError>>);

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

    /// Store one event (with its fan-out); returns once it is committed.
    pub async fn store(&self, event: OwnedEvent) -> Result<Stored, StoreError> {
        let (reply, answer) = oneshot::channel();
        if self.jobs.send((event, reply)).await.is_err() {
            tracing::error!("ingest writers are gone");
            return Err(StoreError::Failed);
        }
        answer.await.unwrap_or(Err(StoreError::Failed))
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
        let (events, replies): (Vec<OwnedEvent>, Vec<_>) = batch.drain(..).unzip();
        let results = write(&pool, &events).await;
        for (reply, result) in replies.into_iter().zip(results) {
            // The requester may have gone (client disconnected): the event is stored
            // either way, and a retry will be answered as a duplicate.
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
