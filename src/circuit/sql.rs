//! The circuit's statements: fold a batch of outcomes into the endpoints' circuits.

use chrono::Utc;
use sqlx::PgConnection;
use std::collections::BTreeMap;

use super::{Change, Circuit, CircuitConfig, Observation, apply};
use crate::ids::EndpointId;

const CIRCUIT_COLUMNS: &str =
    "circuit_state, consecutive_failures, open_count, opened_at, reopen_at, probe_token, probe_until";

/// Whether the endpoint aliased `$e` has a circuit that is not at rest: failures on
/// record, or open. Outcomes that saw only healthy attempts change no other circuit
/// ([`super::apply`]), so [`observe`] reads and locks only these and the endpoints a
/// batch saw fail or probe; the outcome write reports which of its endpoints are such
/// (`queue::RECORD_SQL`), so a healthy batch skips [`observe`] altogether.
macro_rules! circuit_unsettled {
    ($e:literal) => {
        concat!("(", $e, ".consecutive_failures > 0 OR ", $e, ".circuit_state = 'open')")
    };
}
pub(crate) use circuit_unsettled;

/// Apply each endpoint's observation, inside the caller's transaction (the one that
/// records the outcomes). Endpoints are locked in id order, so two recorders never
/// deadlock. Endpoints that only saw healthy attempts and have no failures on record
/// are not touched at all: a healthy endpoint costs the breaker no writes.
///
/// An endpoint whose circuit closes gets `release_pending` in this same transaction: its
/// parked backlog is then released by the dispatchers' housekeeping
/// ([`crate::queue::release_parked`]), durably, whatever happens to this process.
///
/// Returns the endpoints whose circuit closed.
pub async fn observe(
    conn: &mut PgConnection,
    observations: &BTreeMap<EndpointId, Observation>,
    cfg: &CircuitConfig,
) -> Result<Vec<EndpointId>, sqlx::Error> {
    let all: Vec<EndpointId> = observations.keys().copied().collect();
    let attention: Vec<EndpointId> = observations.iter().filter(|(_, o)| o.stirs()).map(|(id, _)| *id).collect();
    let rows: Vec<(EndpointId, Circuit)> = crate::db::query_as::<CircuitRow>(&format!(
        concat!(
            "SELECT id, {columns} FROM endpoints e
             WHERE id = ANY($1) AND (id = ANY($2) OR ",
            circuit_unsettled!("e"),
            ")
             ORDER BY id
             FOR UPDATE"
        ),
        columns = CIRCUIT_COLUMNS
    ))
    .bind(&all)
    .bind(&attention)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|r| (r.id, r.circuit))
    .collect();

    let mut closed = Vec::new();
    // The database's clock: it compares `reopen_at` with its own `now()`.
    let now = crate::clock::now();
    for (id, current) in rows {
        let Some(seen) = observations.get(&id) else { continue };
        let (next, change) = apply(&current, seen, now, cfg);
        if change == Change::None {
            continue;
        }
        crate::db::query(
            "UPDATE endpoints SET circuit_state = $2, consecutive_failures = $3, open_count = $4, opened_at = $5,
                                  reopen_at = $6, probe_until = $7, release_pending = release_pending OR $8,
                                  updated_at = now()
             WHERE id = $1",
        )
        .bind(id)
        .bind(next.circuit_state)
        .bind(next.consecutive_failures)
        .bind(next.open_count)
        .bind(next.opened_at)
        .bind(next.reopen_at)
        .bind(next.probe_until)
        .bind(change == Change::Closed)
        .execute(&mut *conn)
        .await?;
        if let Some(what) = change.recorded() {
            crate::db::query(
                "INSERT INTO circuit_transitions (endpoint_id, change, failures, open_count, reopen_at)
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(id)
            .bind(what)
            .bind(next.consecutive_failures.max(current.consecutive_failures))
            .bind(next.open_count.max(current.open_count))
            .bind(next.reopen_at)
            .execute(&mut *conn)
            .await?;
        }
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

/// One change of an endpoint's circuit, as the endpoint page shows it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Transition {
    /// When.
    pub at: chrono::DateTime<Utc>,
    /// What changed.
    pub change: super::Transitioned,
    /// Failures in a row that opened it, or that the probe ended.
    pub failures: i32,
    /// Times it had opened since it last closed.
    pub open_count: i32,
    /// When the next probe may go (open and reopened).
    pub reopen_at: Option<chrono::DateTime<Utc>>,
}

/// The latest `limit` changes of `endpoint`'s circuit, newest first.
pub async fn history(
    db: impl sqlx::PgExecutor<'_>,
    endpoint: EndpointId,
    limit: i64,
) -> Result<Vec<Transition>, sqlx::Error> {
    crate::db::query_as(
        "SELECT at, change, failures, open_count, reopen_at FROM circuit_transitions
         WHERE endpoint_id = $1 ORDER BY id DESC LIMIT $2",
    )
    .bind(endpoint)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Delete up to `batch` circuit changes older than `before`, oldest first (through
/// `circuit_transitions_at`): the janitor's, so that an endpoint that fails for ever (a
/// change every cool-down) does not grow the table for ever. Returns how many went.
pub async fn delete_transitions_older(
    db: impl sqlx::PgExecutor<'_>,
    before: chrono::DateTime<Utc>,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    crate::db::delete_batch(
        db,
        "DELETE FROM circuit_transitions WHERE id IN (
             SELECT id FROM circuit_transitions WHERE at < $1 ORDER BY at LIMIT $2)",
        before,
        batch,
    )
    .await
}

/// A circuit change, with its endpoint: what the operational events report.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct EndpointTransition {
    /// The row's id (increasing).
    pub id: i64,
    /// Whose circuit.
    pub endpoint_id: EndpointId,
    /// That endpoint's URL.
    pub url: String,
    /// The change.
    #[sqlx(flatten)]
    pub transition: Transition,
}

/// Whether any circuit transition happened at or after `since` (one probe of its index).
pub async fn any_transition_since(
    db: impl sqlx::PgExecutor<'_>,
    since: chrono::DateTime<Utc>,
) -> Result<bool, sqlx::Error> {
    crate::db::query_scalar("SELECT EXISTS (SELECT 1 FROM circuit_transitions WHERE at >= $1)")
        .bind(since)
        .fetch_one(db)
        .await
}

/// Changes of every circuit at or after `since`, oldest first, at most `limit`.
pub async fn transitions_since(
    db: impl sqlx::PgExecutor<'_>,
    since: chrono::DateTime<Utc>,
    limit: i64,
) -> Result<Vec<EndpointTransition>, sqlx::Error> {
    crate::db::query_as(
        "SELECT t.id, t.endpoint_id, e.url, t.at, t.change, t.failures, t.open_count, t.reopen_at
         FROM circuit_transitions t JOIN endpoints e ON e.id = t.endpoint_id
         WHERE t.at >= $1 ORDER BY t.id LIMIT $2",
    )
    .bind(since)
    .bind(limit)
    .fetch_all(db)
    .await
}

#[derive(sqlx::FromRow)]
struct CircuitRow {
    id: EndpointId,
    #[sqlx(flatten)]
    circuit: Circuit,
}
