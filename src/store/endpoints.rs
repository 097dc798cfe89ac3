//! The `endpoints` table.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use crate::circuit::Circuit;
use crate::ids::EndpointId;
use crate::secrets::Sealed;

/// An endpoint row.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Endpoint {
    /// Primary key, a UUIDv7: ids sort by creation time (listings are in id order).
    pub id: EndpointId,
    /// Where deliveries are POSTed.
    pub url: String,
    /// Standard Webhooks signing secret (`whsec_...`).
    pub secret: Sealed,
    /// Free text for operators.
    pub description: Option<String>,
    /// Paused by an operator: its due deliveries are parked until it is resumed.
    pub paused: bool,
    /// Its circuit breaker's columns (state, failures, cool-down, probe lease).
    #[sqlx(flatten)]
    pub circuit: Circuit,
    /// Its delivery limits.
    #[sqlx(flatten)]
    pub limits: Limits,
    /// When the endpoint was created (shown by the API).
    pub created_at: DateTime<Utc>,
}

/// An endpoint's delivery limits, enforced by the claim across every replica.
#[derive(Debug, Clone, Copy, Default, PartialEq, sqlx::FromRow)]
pub struct Limits {
    /// Concurrent requests at most; `None`: the gateway's default (`--endpoint-max-in-flight`).
    pub max_in_flight: Option<i32>,
    /// Requests per second at most (a token bucket); `None`: no rate limit.
    pub rate_limit_per_sec: Option<f64>,
    /// The bucket's size: how many requests may go at once after a quiet spell.
    pub rate_limit_burst: Option<i32>,
}

const COLUMNS: &str = "id, url, secret, description, paused, circuit_state, consecutive_failures, open_count, \
                       opened_at, reopen_at, probe_token, probe_until, max_in_flight, rate_limit_per_sec, \
                       rate_limit_burst, created_at";

/// Insert an endpoint.
pub async fn insert(
    db: impl PgExecutor<'_>,
    url: &str,
    secret: &Sealed,
    description: Option<&str>,
    limits: Limits,
) -> Result<Endpoint, sqlx::Error> {
    crate::db::query_as(&format!(
        "INSERT INTO endpoints (url, secret, description, max_in_flight, rate_limit_per_sec, rate_limit_burst)
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING {COLUMNS}"
    ))
    .bind(url)
    .bind(secret)
    .bind(description)
    .bind(limits.max_in_flight)
    .bind(limits.rate_limit_per_sec)
    .bind(limits.rate_limit_burst)
    .fetch_one(db)
    .await
}

/// An endpoint by id.
pub async fn by_id(db: impl PgExecutor<'_>, id: EndpointId) -> Result<Option<Endpoint>, sqlx::Error> {
    crate::db::query_as(&format!("SELECT {COLUMNS} FROM endpoints WHERE id = $1 AND deleted_at IS NULL"))
        .bind(id)
        .fetch_optional(db)
        .await
}

/// All endpoints, oldest first.
pub async fn list(db: impl PgExecutor<'_>) -> Result<Vec<Endpoint>, sqlx::Error> {
    crate::db::query_as(&format!("SELECT {COLUMNS} FROM endpoints WHERE deleted_at IS NULL ORDER BY id"))
        .fetch_all(db)
        .await
}

/// Whether endpoint `id` is paused, its row locked until the transaction ends; `None`
/// when there is no such endpoint.
pub async fn paused_for_update(db: impl PgExecutor<'_>, id: EndpointId) -> Result<Option<bool>, sqlx::Error> {
    crate::db::query_scalar("SELECT paused FROM endpoints WHERE id = $1 AND deleted_at IS NULL FOR UPDATE")
        .bind(id)
        .fetch_optional(db)
        .await
}

/// Pause or resume an endpoint; `None` if it does not exist.
pub async fn set_paused(
    db: impl PgExecutor<'_>,
    id: EndpointId,
    paused: bool,
) -> Result<Option<Endpoint>, sqlx::Error> {
    crate::db::query_as(&format!(
        "UPDATE endpoints SET paused = $2, release_pending = release_pending OR NOT $2, updated_at = now()
         WHERE id = $1 AND deleted_at IS NULL RETURNING {COLUMNS}"
    ))
    .bind(id)
    .bind(paused)
    .fetch_optional(db)
    .await
}

/// What [`update`] changes; `None` leaves a field as it is.
#[derive(Debug, Clone, Default)]
pub struct Changes<'a> {
    /// A new URL.
    pub url: Option<&'a str>,
    /// A new description, or `Some(None)` to clear it.
    pub description: Option<Option<&'a str>>,
    /// A new in-flight cap, or `Some(None)` for the gateway's default.
    pub max_in_flight: Option<Option<i32>>,
    /// A new rate limit `(per second, burst)`, or `Some(None)` for none.
    pub rate_limit: Option<Option<(f64, i32)>>,
}

/// Change an endpoint; `None` if it does not exist. A new rate limit starts with a full
/// bucket.
pub async fn update(
    db: impl PgExecutor<'_>,
    id: EndpointId,
    changes: &Changes<'_>,
) -> Result<Option<Endpoint>, sqlx::Error> {
    let rate = changes.rate_limit.flatten();
    crate::db::query_as(&format!(
        "UPDATE endpoints
         SET url = COALESCE($2, url),
             description = CASE WHEN $3 THEN $4 ELSE description END,
             max_in_flight = CASE WHEN $5 THEN $6 ELSE max_in_flight END,
             rate_limit_per_sec = CASE WHEN $7 THEN $8 ELSE rate_limit_per_sec END,
             rate_limit_burst = CASE WHEN $7 THEN $9 ELSE rate_limit_burst END,
             rate_tokens = CASE WHEN $7 THEN NULL ELSE rate_tokens END,
             rate_tokens_at = CASE WHEN $7 THEN NULL ELSE rate_tokens_at END,
             updated_at = now()
         WHERE id = $1 AND deleted_at IS NULL
         RETURNING {COLUMNS}"
    ))
    .bind(id)
    .bind(changes.url)
    .bind(changes.description.is_some())
    .bind(changes.description.flatten())
    .bind(changes.max_in_flight.is_some())
    .bind(changes.max_in_flight.flatten())
    .bind(changes.rate_limit.is_some())
    .bind(rate.map(|r| r.0))
    .bind(rate.map(|r| r.1))
    .fetch_optional(db)
    .await
}

/// Most previous secrets an endpoint keeps signing with at once.
pub const MAX_PREVIOUS_SECRETS: i64 = 10;

/// Make `secret` current; the old one keeps signing (alongside) until `grace` ends, and
/// so does every earlier one still inside its own grace period (up to
/// [`MAX_PREVIOUS_SECRETS`], the longest-lasting kept).
pub async fn rotate_secret(
    db: impl PgExecutor<'_>,
    id: EndpointId,
    secret: &Sealed,
    grace: std::time::Duration,
) -> Result<Option<Endpoint>, sqlx::Error> {
    crate::db::query_as(&format!(
        "WITH cur AS (
             SELECT id, secret, previous_secrets, previous_secrets_until FROM endpoints
             WHERE id = $1 AND deleted_at IS NULL
             FOR UPDATE
         ), kept AS (
             SELECT COALESCE(array_agg(s ORDER BY u DESC), '{{}}') AS secrets,
                    COALESCE(array_agg(u ORDER BY u DESC), '{{}}') AS untils
             FROM (
                 SELECT s, u FROM (
                     SELECT cur.secret AS s, now() + make_interval(secs => $3) AS u FROM cur
                     UNION ALL
                     SELECT p.s, p.u FROM cur, unnest(cur.previous_secrets, cur.previous_secrets_until) AS p(s, u)
                 ) all_secrets
                 WHERE u > now()
                 ORDER BY u DESC
                 LIMIT $4
             ) live
         )
         UPDATE endpoints e
         SET secret = $2, previous_secrets = kept.secrets, previous_secrets_until = kept.untils, updated_at = now()
         FROM cur, kept
         WHERE e.id = cur.id
         RETURNING {}",
        COLUMNS.split(", ").map(|c| format!("e.{c}")).collect::<Vec<_>>().join(", ")
    ))
    .bind(id)
    .bind(secret)
    .bind(grace.as_secs_f64())
    .bind(MAX_PREVIOUS_SECRETS)
    .fetch_optional(db)
    .await
}

/// The outcome of deleting an endpoint ([`crate::actions::delete_endpoint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// No such endpoint.
    NotFound,
    /// Refused: it still has this many pending deliveries (and `force` was not given).
    HasPending(i64),
    /// Deleted; this many pending deliveries were dead-lettered.
    Done(i64),
}

/// Lock a live (not deleted) endpoint's row until the transaction ends; false when there
/// is none.
pub async fn lock_live(conn: &mut sqlx::PgConnection, id: EndpointId) -> Result<bool, sqlx::Error> {
    let exists: Option<EndpointId> =
        crate::db::query_scalar("SELECT id FROM endpoints WHERE id = $1 AND deleted_at IS NULL FOR UPDATE")
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
    Ok(exists.is_some())
}

/// Mark an endpoint deleted (soft: its history stays inspectable); nothing is released
/// for it any more.
pub async fn mark_deleted(conn: &mut sqlx::PgConnection, id: EndpointId) -> Result<(), sqlx::Error> {
    crate::db::query(
        "UPDATE endpoints SET deleted_at = now(), release_pending = false, updated_at = now() WHERE id = $1",
    )
    .bind(id)
    .execute(&mut *conn)
    .await?;
    Ok(())
}
