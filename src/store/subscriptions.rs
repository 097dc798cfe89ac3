//! The `subscriptions` table.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use crate::fanout;
use crate::ids::{EndpointId, SourceId, SubscriptionId};

/// A subscription row, with its source's name.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Subscription {
    /// Id.
    pub id: SubscriptionId,
    /// Target endpoint.
    pub endpoint_id: EndpointId,
    /// Source filter (None: every source).
    pub source_id: Option<SourceId>,
    /// Name of that source.
    pub source_name: Option<String>,
    /// Event-type patterns (None: every type).
    pub event_types: Option<Vec<String>>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
}

/// Insert a subscription; patterns must already be validated.
pub async fn insert(
    db: impl PgExecutor<'_>,
    endpoint_id: EndpointId,
    source_id: Option<SourceId>,
    event_types: Option<&[String]>,
) -> Result<Subscription, sqlx::Error> {
    let likes: Option<Vec<String>> = event_types.map(|ts| ts.iter().map(|t| fanout::to_like(t)).collect());
    sqlx::query_as(
        "WITH s AS (
             INSERT INTO subscriptions (endpoint_id, source_id, event_types, event_type_likes)
             VALUES ($1, $2, $3, $4)
             RETURNING id, endpoint_id, source_id, event_types, created_at)
         SELECT s.*, src.name AS source_name FROM s LEFT JOIN sources src ON src.id = s.source_id",
    )
    .bind(endpoint_id)
    .bind(source_id)
    .bind(event_types)
    .bind(likes)
    .fetch_one(db)
    .await
}

/// Subscriptions of one endpoint.
pub async fn for_endpoint(db: impl PgExecutor<'_>, endpoint_id: EndpointId) -> Result<Vec<Subscription>, sqlx::Error> {
    sqlx::query_as(
        "SELECT s.id, s.endpoint_id, s.source_id, s.event_types, s.created_at, src.name AS source_name
         FROM subscriptions s LEFT JOIN sources src ON src.id = s.source_id
         WHERE s.endpoint_id = $1 ORDER BY s.id",
    )
    .bind(endpoint_id)
    .fetch_all(db)
    .await
}
