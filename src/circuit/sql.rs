//! The circuit's statements: fold a batch of outcomes into the endpoints' circuits, and
//! release a parked backlog at a bounded rate.

use chrono::Utc;
use sqlx::{PgConnection, PgPool};
use std::collections::BTreeMap;

use super::{Change, Circuit, CircuitConfig, Observation, apply};
use crate::ids::EndpointId;

const CIRCUIT_COLUMNS: &str =
    "circuit_state, consecutive_failures, open_count, opened_at, reopen_at, probe_token, probe_until";

/// Apply each endpoint's observation, inside the caller's transaction (the one that
/// records the outcomes). Endpoints are locked in id order, so two recorders never
/// deadlock. Endpoints that only saw healthy attempts and have no failures on record
/// are not touched at all: a healthy endpoint costs the breaker no writes.
///
/// Returns the endpoints whose circuit closed (their parked backlog should be released).
pub async fn observe(
    conn: &mut PgConnection,
    observations: &BTreeMap<EndpointId, Observation>,
    cfg: &CircuitConfig,
) -> Result<Vec<EndpointId>, sqlx::Error> {
    let all: Vec<EndpointId> = observations.keys().copied().collect();
    let attention: Vec<EndpointId> =
        observations.iter().filter(|(_, o)| o.trailing_failures > 0 || o.probe.is_some()).map(|(id, _)| *id).collect();
    let rows: Vec<(EndpointId, Circuit)> = sqlx::query_as::<_, CircuitRow>(&format!(
        "SELECT id, {CIRCUIT_COLUMNS} FROM endpoints
         WHERE id = ANY($1) AND (id = ANY($2) OR consecutive_failures > 0 OR circuit_state = 'open')
         ORDER BY id
         FOR UPDATE"
    ))
    .bind(&all)
    .bind(&attention)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|r| (r.id, r.circuit))
    .collect();

    let mut closed = Vec::new();
    let now = Utc::now();
    for (id, current) in rows {
        let Some(seen) = observations.get(&id) else { continue };
        let (next, change) = apply(&current, seen, now, cfg);
        if change == Change::None {
            continue;
        }
        sqlx::query(
            "UPDATE endpoints SET circuit_state = $2, consecutive_failures = $3, open_count = $4, opened_at = $5,
                                  reopen_at = $6, probe_until = $7, updated_at = now()
             WHERE id = $1",
        )
        .bind(id)
        .bind(&next.circuit_state)
        .bind(next.consecutive_failures)
        .bind(next.open_count)
        .bind(next.opened_at)
        .bind(next.reopen_at)
        .bind(next.probe_until)
        .execute(&mut *conn)
        .await?;
        match change {
            Change::Opened => tracing::warn!(endpoint_id = %id, failures = next.consecutive_failures,
                reopen_at = ?next.reopen_at, "circuit opened: deliveries to this endpoint are parked"),
            Change::Reopened => tracing::warn!(endpoint_id = %id, opens = next.open_count,
                reopen_at = ?next.reopen_at, "half-open probe failed: circuit open again"),
            Change::Closed => {
                tracing::info!(endpoint_id = %id, "half-open probe succeeded: circuit closed");
                closed.push(id);
            }
            Change::Updated | Change::None => {}
        }
    }
    Ok(closed)
}

#[derive(sqlx::FromRow)]
struct CircuitRow {
    id: EndpointId,
    #[sqlx(flatten)]
    circuit: Circuit,
}

/// Un-park an endpoint's parked deliveries, oldest first, spaced `1/per_sec` apart from
/// now: a recovering subscriber sees its backlog at a bounded rate, not all at once.
/// Returns how many were released.
pub async fn release_backlog(pool: &PgPool, endpoint_id: EndpointId, per_sec: u32) -> Result<u64, sqlx::Error> {
    let released = crate::queue::requeue_spread(pool, endpoint_id, crate::queue::Requeue::Parked, per_sec).await?;
    if released > 0 {
        tracing::info!(endpoint_id = %endpoint_id, released, per_sec, "parked deliveries released");
    }
    Ok(released)
}
