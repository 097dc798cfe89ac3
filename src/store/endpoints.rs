//! The `endpoints` table.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

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
    /// Creation time.
    pub created_at: DateTime<Utc>,
}

const COLUMNS: &str = "id, url, secret, description, created_at";

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
