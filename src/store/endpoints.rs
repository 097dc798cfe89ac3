//! The `endpoints` table.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use crate::circuit::Circuit;
use crate::ids::EndpointId;

/// An endpoint row.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Endpoint {
    /// Id.
    pub id: EndpointId,
    /// Where deliveries are POSTed.
    pub url: String,
    /// Standard Webhooks signing secret (`whsec_...`).
    pub secret: String,
    /// Free text for operators.
    pub description: Option<String>,
    /// Operator pause.
    pub paused: bool,
    /// Circuit breaker state.
    #[sqlx(flatten)]
    pub circuit: Circuit,
    /// Creation time.
    pub created_at: DateTime<Utc>,
}

const COLUMNS: &str = "id, url, secret, description, paused, circuit_state, consecutive_failures, open_count, \
                       opened_at, reopen_at, probe_token, probe_until, created_at";

/// Insert an endpoint.
pub async fn insert(
    db: impl PgExecutor<'_>,
    url: &str,
    secret: &str,
    description: Option<&str>,
) -> Result<Endpoint, sqlx::Error> {
    sqlx::query_as(&format!("INSERT INTO endpoints (url, secret, description) VALUES ($1, $2, $3) RETURNING {COLUMNS}"))
        .bind(url)
        .bind(secret)
        .bind(description)
        .fetch_one(db)
        .await
}

/// An endpoint by id.
pub async fn by_id(db: impl PgExecutor<'_>, id: EndpointId) -> Result<Option<Endpoint>, sqlx::Error> {
    sqlx::query_as(&format!("SELECT {COLUMNS} FROM endpoints WHERE id = $1")).bind(id).fetch_optional(db).await
}

/// All endpoints, oldest first.
pub async fn list(db: impl PgExecutor<'_>) -> Result<Vec<Endpoint>, sqlx::Error> {
    sqlx::query_as(&format!("SELECT {COLUMNS} FROM endpoints ORDER BY id")).fetch_all(db).await
}

/// Pause or resume an endpoint; `None` if it does not exist.
pub async fn set_paused(
    db: impl PgExecutor<'_>,
    id: EndpointId,
    paused: bool,
) -> Result<Option<Endpoint>, sqlx::Error> {
    sqlx::query_as(&format!("UPDATE endpoints SET paused = $2, updated_at = now() WHERE id = $1 RETURNING {COLUMNS}"))
        .bind(id)
        .bind(paused)
        .fetch_optional(db)
        .await
}
