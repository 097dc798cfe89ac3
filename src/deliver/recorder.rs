//! Writes attempt outcomes in batches: whatever finished while the previous write was in
//! flight goes into the next statement, so the commit rate stays far below the delivery
//! rate under load and an idle gateway records each outcome at once.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use crate::circuit::{self, CircuitConfig, Observation};
use crate::ids::{DeliveryId, EndpointId};
use crate::queue::{self, AttemptRecord};

/// Most outcomes in one statement.
pub const MAX_BATCH: usize = 256;
/// Tries per batch before giving up on it (the lease then brings the rows back).
const TRIES: u32 = 5;

/// Drain `rx` until every sender is gone, recording each batch (and its effect on the
/// endpoints' circuits, in the same transaction).
///
/// Each outcome arrives with its worker slot, which is released only once the outcome is
/// written: at most `workers` attempts are ever unrecorded, so a circuit that opens sees
/// at most that many requests it did not know about.
pub async fn run(pool: PgPool, mut rx: mpsc::Receiver<(AttemptRecord, OwnedSemaphorePermit)>, cfg: CircuitConfig) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut slots = Vec::with_capacity(MAX_BATCH);
    while let Some((first, slot)) = rx.recv().await {
        batch.push(first);
        slots.push(slot);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok((next, slot)) => {
                    batch.push(next);
                    slots.push(slot);
                }
                Err(_) => break,
            }
        }
        write(&pool, &batch, &cfg).await;
        batch.clear();
        slots.clear();
    }
}

/// One transaction: the fenced outcomes, then the circuits of their endpoints.
async fn write_once(
    pool: &PgPool,
    batch: &[AttemptRecord],
    cfg: &CircuitConfig,
) -> Result<(HashSet<DeliveryId>, Vec<EndpointId>), sqlx::Error> {
    let mut tx = pool.begin().await?;
    let recorded: HashSet<DeliveryId> = queue::record(&mut *tx, batch).await?.into_iter().collect();
    let mut observations: BTreeMap<EndpointId, Observation> = BTreeMap::new();
    for r in batch.iter().filter(|r| recorded.contains(&r.delivery_id)) {
        observations.entry(r.endpoint_id).or_default().add(r.signal, r.probe_token);
    }
    let closed = circuit::sql::observe(&mut tx, &observations, cfg).await?;
    tx.commit().await?;
    Ok((recorded, closed))
}

async fn write(pool: &PgPool, batch: &[AttemptRecord], cfg: &CircuitConfig) {
    let mut delay = Duration::from_millis(100);
    for attempt in 1..=TRIES {
        match write_once(pool, batch, cfg).await {
            Ok((recorded, closed)) => {
                for endpoint_id in closed {
                    let (pool, per_sec) = (pool.clone(), cfg.release_per_sec);
                    tokio::spawn(async move {
                        if let Err(e) = circuit::sql::release_backlog(&pool, endpoint_id, per_sec).await {
                            tracing::error!(endpoint_id = %endpoint_id, error = %e,
                                "releasing the parked backlog failed; an operator resume releases it");
                        }
                    });
                }
                if recorded.len() < batch.len() {
                    metrics::counter!(crate::metrics::FENCED).increment((batch.len() - recorded.len()) as u64);
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
