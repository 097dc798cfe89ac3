//! The audit log (`audit_log`): every change made through the API, the console or the
//! CLI, and every refused attempt, with who (the token's name), when, what (the action
//! and its target), from where (the peer address and the request id) and the outcome
//! (the HTTP status). It holds no secret and no payload: the action is the route
//! template, the target the request's path.

use chrono::{DateTime, Utc};
use sqlx::{PgExecutor, Postgres, QueryBuilder};

/// Where a change came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The admin API.
    Api,
    /// The web console.
    Console,
    /// The command line (`webhook-gateway tokens ...`).
    Cli,
}

impl Via {
    fn as_str(self) -> &'static str {
        match self {
            Via::Api => "api",
            Via::Console => "console",
            Via::Cli => "cli",
        }
    }
}

/// One entry to record.
#[derive(Debug, Clone)]
pub struct Entry<'a> {
    /// Who: a token's name, `admin` for the bootstrap token, `unknown` when the caller
    /// could not be identified.
    pub actor: &'a str,
    /// Through what.
    pub via: Via,
    /// What: `POST /v1/endpoints/{id}/pause`.
    pub action: &'a str,
    /// On what: the request's path (`/v1/endpoints/0193.../pause`).
    pub target: &'a str,
    /// The outcome: the answer's status.
    pub status: u16,
    /// The peer address.
    pub address: Option<String>,
    /// The request id (also on every log line of the request).
    pub request_id: Option<&'a str>,
}

/// Record `entry`.
pub async fn record(db: impl PgExecutor<'_>, entry: &Entry<'_>) -> Result<(), sqlx::Error> {
    crate::db::query(
        "INSERT INTO audit_log (actor, via, action, target, status, address, request_id)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(crate::sanitize::bounded(entry.actor, 200))
    .bind(entry.via.as_str())
    .bind(crate::sanitize::bounded(entry.action, 300))
    .bind(crate::sanitize::bounded(entry.target, 1000))
    .bind(i32::from(entry.status))
    .bind(&entry.address)
    .bind(entry.request_id.map(|r| crate::sanitize::bounded(r, 200)))
    .execute(db)
    .await?;
    Ok(())
}

/// Record `entry` after its call was answered, giving up after `within` (in a partition
/// from the database an answer must not wait for its audit row): a gap is logged, loudly.
pub async fn record_within(pool: &crate::db::Pool, within: std::time::Duration, entry: &Entry<'_>) {
    match tokio::time::timeout(within, record(pool, entry)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(error = %e, action = entry.action, target = entry.target,
            actor = entry.actor, "the audit log could not record a change"),
        Err(_) => tracing::error!(
            action = entry.action,
            target = entry.target,
            actor = entry.actor,
            "the audit log could not record a change: the database did not answer in time"
        ),
    }
}

/// A recorded entry.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, utoipa::ToSchema)]
pub struct Recorded {
    /// Increasing id (the cursor).
    pub id: i64,
    /// When.
    pub at: DateTime<Utc>,
    /// Who.
    pub actor: String,
    /// `api`, `console` or `cli`.
    pub via: String,
    /// What.
    pub action: String,
    /// On what.
    pub target: String,
    /// The answer's status (403: refused for its scope; 401: not identified).
    pub status: i32,
    /// The peer address.
    pub address: Option<String>,
    /// The request id.
    pub request_id: Option<String>,
}

/// What to look for in the audit log; all optional.
#[derive(Debug, Clone, Default)]
pub struct Query {
    /// At or after.
    pub since: Option<DateTime<Utc>>,
    /// Before.
    pub until: Option<DateTime<Utc>>,
    /// Exactly this actor.
    pub actor: Option<String>,
    /// Targets starting with this (`/v1/endpoints/0193...`).
    pub target: Option<String>,
    /// Entries older than this id (the previous page's last).
    pub before_id: Option<i64>,
}

/// Entries matching `q`, newest first, at most `limit`.
pub async fn list(db: impl PgExecutor<'_>, q: &Query, limit: i64) -> Result<Vec<Recorded>, sqlx::Error> {
    let mut b: QueryBuilder<Postgres> = QueryBuilder::new(
        "SELECT id, at, actor, via, action, target, status, address, request_id FROM audit_log WHERE true",
    );
    if let Some(t) = q.since {
        b.push(" AND at >= ").push_bind(t);
    }
    if let Some(t) = q.until {
        b.push(" AND at < ").push_bind(t);
    }
    if let Some(a) = &q.actor {
        b.push(" AND actor = ").push_bind(a.clone());
    }
    if let Some(t) = &q.target {
        b.push(" AND starts_with(target, ").push_bind(t.clone()).push(")");
    }
    if let Some(id) = q.before_id {
        b.push(" AND id < ").push_bind(id);
    }
    b.push(" ORDER BY id DESC LIMIT ").push_bind(limit);
    crate::db::built_as(&mut b).fetch_all(db).await
}

/// Delete up to `batch` entries older than `before`; how many.
pub async fn delete_older(db: impl PgExecutor<'_>, before: DateTime<Utc>, batch: i64) -> Result<u64, sqlx::Error> {
    crate::db::delete_batch(
        db,
        "DELETE FROM audit_log WHERE id IN (SELECT id FROM audit_log WHERE at < $1 ORDER BY at LIMIT $2)",
        before,
        batch,
    )
    .await
}
