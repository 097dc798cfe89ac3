//! The `attempts` table (rows are written by the queue's fenced record statement).

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use crate::ids::DeliveryId;

/// One recorded attempt.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, utoipa::ToSchema)]
pub struct Attempt {
    /// Attempt number, 1-based (the `webhook-attempt` header sent).
    pub attempt_number: i32,
    /// When the request started.
    pub started_at: DateTime<Utc>,
    /// How long it took, in milliseconds.
    pub duration_ms: i32,
    /// HTTP status, when a response came back.
    pub status_code: Option<i32>,
    /// Why no response came back (null when one did): `dns`, `timeout`, `connect`, `tls`,
    /// `other`, or the egress refusal `forbidden_address`, `forbidden_scheme`, `invalid_url`.
    pub error_kind: Option<crate::egress::ErrorKind>,
    /// What the attempt led to: `delivered`, `retry` or `dead`.
    pub outcome: crate::queue::Outcome,
    /// Why the outcome, for operators (e.g. `HTTP 503`, `HTTP 404: permanent client error,
    /// not retried`, a transport error); at most 1 KiB.
    pub reason: String,
    /// The first 4 KiB of the response body, repaired to UTF-8; null without a response.
    pub response_excerpt: Option<String>,
    /// The start of the body sent when a transformation made it; null: the event's body
    /// was sent as it is.
    pub sent_excerpt: Option<String>,
    /// When the next attempt is due (retry outcomes).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// Where that time came from: `backoff` (our curve) or `retry_after` (the subscriber's
    /// `Retry-After`, capped); null unless the outcome is `retry`.
    pub next_attempt_reason: Option<crate::deliver::policy::NextReason>,
}

/// Attempts of one delivery, in order.
pub async fn for_delivery(db: impl PgExecutor<'_>, id: DeliveryId) -> Result<Vec<Attempt>, sqlx::Error> {
    crate::db::query_as(
        "SELECT attempt_number, started_at, duration_ms, status_code, error_kind, outcome, reason,
                response_excerpt, sent_excerpt, next_attempt_at, next_attempt_reason
         FROM attempts WHERE delivery_id = $1 ORDER BY id",
    )
    .bind(id)
    .fetch_all(db)
    .await
}

/// Attempts recorded at or after `since`, by outcome (`delivered`, `retry`, `dead`): one
/// range scan of `attempts_recorded_at`, meant for short windows (the console's overview).
pub async fn outcomes_since(
    db: impl PgExecutor<'_>,
    since: DateTime<Utc>,
) -> Result<Vec<(crate::queue::Outcome, i64)>, sqlx::Error> {
    crate::db::query_as(
        "SELECT outcome, count(*) FROM attempts WHERE recorded_at >= $1 GROUP BY outcome ORDER BY outcome",
    )
    .bind(since)
    .fetch_all(db)
    .await
}
