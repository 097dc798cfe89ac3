//! Read-side queries on the `deliveries` table, for the admin API.

use chrono::{DateTime, Utc};
use sqlx::{PgExecutor, Postgres, QueryBuilder};

use crate::ids::{DeliveryId, EndpointId, EventId};

/// A delivery as operators see it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Delivery {
    /// Its `webhook-id` derives from it.
    pub id: DeliveryId,
    /// The event delivered.
    pub event_id: EventId,
    /// Where it goes.
    pub endpoint_id: EndpointId,
    /// Pending, delivered or dead.
    pub status: super::DeliveryStatus,
    /// Attempts started over its whole life (claims counted, redeliveries included).
    pub attempt_count: i32,
    /// Next due time (or lease end while claimed).
    pub next_attempt_at: DateTime<Utc>,
    /// Set while a worker holds the lease.
    pub leased_until: Option<DateTime<Utc>>,
    /// Waiting for its endpoint (open circuit or paused), without spending attempts.
    pub parked: bool,
    /// Its ordering line's key, when its subscription delivers in order.
    pub ordering_key: Option<String>,
    /// Waiting for the earlier deliveries of its ordering line.
    pub waiting: bool,
    /// Why it is dead.
    pub dead_reason: Option<String>,
    /// When fan-out created it (the event's commit).
    pub created_at: DateTime<Utc>,
    /// When any of its columns last changed (claim, record, park, release).
    pub updated_at: DateTime<Utc>,
    /// When it reached delivered or dead.
    pub finished_at: Option<DateTime<Utc>>,
}

const COLUMNS: &str = "id, event_id, endpoint_id, status, attempt_count, next_attempt_at, leased_until, \
                       parked, ordering_key, waiting, dead_reason, created_at, updated_at, finished_at";

/// Filters for [`list`]; all optional.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Deliveries of one event.
    pub event_id: Option<EventId>,
    /// Deliveries to one endpoint.
    pub endpoint_id: Option<EndpointId>,
    /// Only deliveries in this state.
    pub status: Option<super::DeliveryStatus>,
    /// Finished (delivered or dead-lettered) at or after.
    pub finished_since: Option<DateTime<Utc>>,
    /// Finished before.
    pub finished_until: Option<DateTime<Utc>>,
    /// Keyset cursor: only ids after this one (before it with `newest_first`).
    pub after: Option<DeliveryId>,
    /// Newest first (the console) instead of oldest first (the API).
    pub newest_first: bool,
}

/// Deliveries matching `filter`, in id (creation) order, at most `limit`.
pub async fn list(db: impl PgExecutor<'_>, filter: &Filter, limit: i64) -> Result<Vec<Delivery>, sqlx::Error> {
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new(format!("SELECT {COLUMNS} FROM deliveries WHERE true"));
    if let Some(id) = filter.event_id {
        q.push(" AND event_id = ").push_bind(id);
    }
    if let Some(id) = filter.endpoint_id {
        q.push(" AND endpoint_id = ").push_bind(id);
    }
    if let Some(status) = &filter.status {
        q.push(" AND status = ").push_bind(*status);
    }
    if let Some(t) = filter.finished_since {
        q.push(" AND finished_at >= ").push_bind(t);
    }
    if let Some(t) = filter.finished_until {
        q.push(" AND finished_at < ").push_bind(t);
    }
    let (cmp, order) =
        if filter.newest_first { (" AND id < ", " ORDER BY id DESC") } else { (" AND id > ", " ORDER BY id") };
    if let Some(after) = filter.after {
        q.push(cmp).push_bind(after);
    }
    q.push(order).push(" LIMIT ").push_bind(limit);
    crate::db::built_as(&mut q).fetch_all(db).await
}

/// Where an event's deliveries stand, for listings.
#[derive(Debug, Clone, Copy, sqlx::FromRow)]
pub struct EventDeliveries {
    /// The event.
    pub event_id: EventId,
    /// Its deliveries.
    pub total: i64,
    /// Delivered.
    pub delivered: i64,
    /// Dead-lettered.
    pub dead: i64,
}

/// How the deliveries of the events `ids` stand (one probe of `deliveries_once` per
/// event; an event without deliveries is missing).
pub async fn by_event(db: impl PgExecutor<'_>, ids: &[EventId]) -> Result<Vec<EventDeliveries>, sqlx::Error> {
    crate::db::query_as(
        "SELECT event_id, count(*) AS total, count(*) FILTER (WHERE status = 'delivered') AS delivered,
                count(*) FILTER (WHERE status = 'dead') AS dead
         FROM deliveries WHERE event_id = ANY($1) GROUP BY event_id",
    )
    .bind(ids)
    .fetch_all(db)
    .await
}

/// Queue depth and lag, for the metrics sampler.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Pending and claimable (not parked), due or not.
    pub pending: i64,
    /// Pending, parked behind an open circuit or a pause.
    pub parked: i64,
    /// Pending, not parked, due now and not under a live lease (never leased, or its
    /// lease ran out: a worker that died): what a claim would take.
    pub due: i64,
    /// Dead-lettered.
    pub dead: i64,
    /// Age of the oldest due unleased delivery, seconds (`None`: nothing pending).
    pub oldest_due_age_secs: Option<f64>,
}

/// Sample [`Stats`]. The counts scan the pending rows (about 0.1 s per 100,000 pending).
pub async fn stats(pool: &crate::db::Pool) -> Result<Stats, sqlx::Error> {
    let (pending, parked, due): (i64, i64, i64) = crate::db::query_as(
        "SELECT count(*) FILTER (WHERE NOT parked),
                count(*) FILTER (WHERE parked),
                count(*) FILTER (WHERE NOT parked AND NOT waiting AND next_attempt_at <= now()
                                   AND (leased_until IS NULL OR leased_until <= now()))
         FROM deliveries WHERE status = 'pending'",
    )
    .fetch_one(pool)
    .await?;
    // The first entry of the claim index: leased rows sit at their lease's end, so the
    // oldest due unleased row is first whenever anything is overdue.
    let oldest_due_age_secs: Option<f64> = crate::db::query_scalar(
        "SELECT extract(epoch FROM now() - next_attempt_at)::float8 FROM deliveries
         WHERE status = 'pending' AND NOT parked AND NOT waiting ORDER BY next_attempt_at LIMIT 1",
    )
    .fetch_optional(pool)
    .await?;
    let dead: i64 =
        crate::db::query_scalar("SELECT count(*) FROM deliveries WHERE status = 'dead'").fetch_one(pool).await?;
    Ok(Stats { pending, parked, due, dead, oldest_due_age_secs })
}

/// An endpoint's load right now, for the API and the metrics sampler.
#[derive(Debug, Clone, Copy, PartialEq, sqlx::FromRow)]
pub struct EndpointLoad {
    /// The endpoint.
    pub endpoint_id: EndpointId,
    /// Deliveries leased to a worker and not yet recorded (live leases only).
    pub in_flight: i64,
    /// Whether it has a due delivery its limits hold back: at its in-flight cap, or out of
    /// rate-limit tokens.
    pub throttled: bool,
}

/// The load of every endpoint not deleted (`default_max_in_flight`: the cap of endpoints
/// without their own). One index probe or two per endpoint.
pub async fn endpoint_loads(
    db: impl PgExecutor<'_>,
    default_max_in_flight: i32,
) -> Result<Vec<EndpointLoad>, sqlx::Error> {
    crate::db::query_as(
        "SELECT id AS endpoint_id, in_flight,
                due AND (in_flight >= cap OR (tokens IS NOT NULL AND tokens < 1)) AS throttled
         FROM (
             SELECT ep.id, COALESCE(ep.max_in_flight, $1) AS cap,
                    (SELECT count(*) FROM deliveries f
                     WHERE f.endpoint_id = ep.id AND f.status = 'pending'
                       AND f.leased_until IS NOT NULL AND f.leased_until > now()) AS in_flight,
                    EXISTS (SELECT 1 FROM deliveries d
                            WHERE d.endpoint_id = ep.id AND d.status = 'pending' AND NOT d.parked AND NOT d.waiting
                              AND d.next_attempt_at <= now()) AS due,
                    CASE WHEN ep.rate_limit_per_sec IS NULL THEN NULL
                         ELSE LEAST(ep.rate_limit_burst::float8,
                                    COALESCE(ep.rate_tokens, ep.rate_limit_burst)
                                    + extract(epoch FROM now() - COALESCE(ep.rate_tokens_at, now()))
                                      * ep.rate_limit_per_sec) END AS tokens
             FROM endpoints ep WHERE ep.deleted_at IS NULL
         ) e
         ORDER BY id",
    )
    .bind(default_max_in_flight)
    .fetch_all(db)
    .await
}

/// Deliveries to `endpoint_id` in flight now (live leases).
pub async fn in_flight_of(db: impl PgExecutor<'_>, endpoint_id: EndpointId) -> Result<i64, sqlx::Error> {
    crate::db::query_scalar(
        "SELECT count(*) FROM deliveries
         WHERE endpoint_id = $1 AND status = 'pending' AND leased_until IS NOT NULL AND leased_until > now()",
    )
    .bind(endpoint_id)
    .fetch_one(db)
    .await
}

/// One delivery.
pub async fn by_id(db: impl PgExecutor<'_>, id: DeliveryId) -> Result<Option<Delivery>, sqlx::Error> {
    crate::db::query_as(&format!("SELECT {COLUMNS} FROM deliveries WHERE id = $1")).bind(id).fetch_optional(db).await
}

/// How an endpoint has been doing lately, for the console.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EndpointHealth {
    /// Of its last [`HEALTH_WINDOW`] deliveries: delivered ...
    pub delivered: i64,
    /// ... dead-lettered ...
    pub dead: i64,
    /// ... and still pending.
    pub pending: i64,
    /// Age of its oldest due, claimable delivery, seconds (`None`: nothing due).
    pub lag_secs: Option<f64>,
}

/// Deliveries [`endpoint_health`] looks at: the most recent ones, so its cost does not
/// grow with history.
pub const HEALTH_WINDOW: i64 = 200;

/// [`EndpointHealth`] of one endpoint: two bounded index reads (`deliveries_endpoint`,
/// newest first, and `deliveries_endpoint_unparked`).
pub async fn endpoint_health(pool: &crate::db::Pool, endpoint_id: EndpointId) -> Result<EndpointHealth, sqlx::Error> {
    let (delivered, dead, pending): (i64, i64, i64) = crate::db::query_as(
        "SELECT count(*) FILTER (WHERE status = 'delivered'), count(*) FILTER (WHERE status = 'dead'),
                count(*) FILTER (WHERE status = 'pending')
         FROM (SELECT status FROM deliveries WHERE endpoint_id = $1 ORDER BY id DESC LIMIT $2) recent",
    )
    .bind(endpoint_id)
    .bind(HEALTH_WINDOW)
    .fetch_one(pool)
    .await?;
    let lag_secs: Option<f64> = crate::db::query_scalar(
        "SELECT extract(epoch FROM now() - next_attempt_at)::float8 FROM deliveries
         WHERE endpoint_id = $1 AND status = 'pending' AND NOT parked AND NOT waiting AND next_attempt_at <= now()
         ORDER BY next_attempt_at LIMIT 1",
    )
    .bind(endpoint_id)
    .fetch_optional(pool)
    .await?;
    Ok(EndpointHealth { delivered, dead, pending, lag_secs })
}

/// How many of an endpoint's deliveries died in `[since, until)` and are still dead: what
/// [`super::requeue_dead`] would re-queue now (the same predicate).
pub async fn dead_in_window(
    db: impl PgExecutor<'_>,
    endpoint_id: EndpointId,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
) -> Result<i64, sqlx::Error> {
    crate::db::query_scalar(
        "SELECT count(*) FROM deliveries
         WHERE endpoint_id = $1 AND status = 'dead' AND finished_at >= $2 AND finished_at < $3",
    )
    .bind(endpoint_id)
    .bind(since)
    .bind(until)
    .fetch_one(db)
    .await
}

/// Deliveries that died at or after `since` and are still dead, however they died (an
/// attempt's answer, a budget spent by dead workers, an endpoint deleted with `force`):
/// one range scan of `deliveries_dead_finished`.
pub async fn dead_since(db: impl PgExecutor<'_>, since: DateTime<Utc>) -> Result<i64, sqlx::Error> {
    crate::db::query_scalar("SELECT count(*) FROM deliveries WHERE status = 'dead' AND finished_at >= $1")
        .bind(since)
        .fetch_one(db)
        .await
}

/// Deliveries of one endpoint that died in a window.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct DeadCount {
    /// The endpoint.
    pub endpoint_id: EndpointId,
    /// Its URL.
    pub url: String,
    /// Deliveries that died.
    pub dead: i64,
}

/// Per endpoint, deliveries that died in `[since, until)` (and are still dead), of events
/// from any source but `except_source`; most first.
pub async fn dead_between(
    db: impl PgExecutor<'_>,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
    except_source: crate::ids::SourceId,
) -> Result<Vec<DeadCount>, sqlx::Error> {
    crate::db::query_as(
        "SELECT d.endpoint_id, e.url, count(*) AS dead
         FROM deliveries d JOIN endpoints e ON e.id = d.endpoint_id JOIN events ev ON ev.id = d.event_id
         WHERE d.status = 'dead' AND d.finished_at >= $1 AND d.finished_at < $2 AND ev.source_id <> $3
         GROUP BY d.endpoint_id, e.url ORDER BY dead DESC, d.endpoint_id",
    )
    .bind(since)
    .bind(until)
    .bind(except_source)
    .fetch_all(db)
    .await
}

/// When the longest-waiting claimable delivery (pending, due, not parked, not waiting
/// for its line) of an event from any source but `except_source` fell due; `None` when
/// none is due.
pub async fn oldest_due(
    db: impl PgExecutor<'_>,
    except_source: crate::ids::SourceId,
) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    crate::db::query_scalar(
        "SELECT d.next_attempt_at FROM deliveries d JOIN events ev ON ev.id = d.event_id
         WHERE d.status = 'pending' AND NOT d.parked AND NOT d.waiting AND d.next_attempt_at <= now()
           AND ev.source_id <> $1
         ORDER BY d.next_attempt_at LIMIT 1",
    )
    .bind(except_source)
    .fetch_optional(db)
    .await
}
