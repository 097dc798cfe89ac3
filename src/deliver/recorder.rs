//! Writes attempt outcomes in batches: whatever finished while the previous write was in
//! flight goes into the next statement, so the commit rate stays far below the delivery
//! rate under load and an idle gateway records each outcome at once.

use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::mpsc;

use crate::queue::{self, AttemptRecord};

/// Most outcomes in one statement.
pub const MAX_BATCH: usize = 256;
/// Tries per batch before giving up on it (the lease then brings the rows back).
const TRIES: u32 = 5;

/// Drain `rx` until every sender is gone, recording each batch.
pub async fn run(pool: PgPool, mut rx: mpsc::Receiver<AttemptRecord>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        write(&pool, &batch).await;
        batch.clear();
    }
}

async fn write(pool: &PgPool, batch: &[AttemptRecord]) {
    let mut delay = Duration::from_millis(100);
    for attempt in 1..=TRIES {
        match queue::record(pool, batch).await {
            Ok(recorded) => {
                if recorded.len() < batch.len() {
                    for fenced in batch.iter().filter(|r| !recorded.contains(&r.delivery_id)) {
                        tracing::warn!(
                            delivery_id = %fenced.delivery_id,
                            attempt = fenced.attempt,
                            outcome = fenced.outcome.as_str(),
                            "outcome dropped: the lease was taken over by a newer claim (fenced)"
                        );
                    }
                }
                return;
            }
            Err(e) if attempt < TRIES => {
                tracing::warn!(error = %e, batch = batch.len(), attempt, "recording outcomes failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            Err(e) => {
                for r in batch {
                    tracing::error!(
                        delivery_id = %r.delivery_id,
                        error = %e,
                        "outcome not recorded; the delivery will be attempted again when its lease ends"
                    );
                }
            }
        }
    }
}
