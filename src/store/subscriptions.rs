//! The `subscriptions` table.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use crate::fanout;
use crate::ids::{EndpointId, SourceId, SubscriptionId};

/// A subscription row, with its source's name.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Subscription {
    /// Primary key, a UUIDv7: ids sort by creation time (listings are in id order).
    pub id: SubscriptionId,
    /// Where matching events are delivered.
    pub endpoint_id: EndpointId,
    /// Source filter (None: every source).
    pub source_id: Option<SourceId>,
    /// Name of that source (joined for the API, which shows names, not ids).
    pub source_name: Option<String>,
    /// Event-type patterns (None: every type).
    pub event_types: Option<Vec<String>>,
    /// Deliver the events of one ordering key one at a time, in ingest order.
    pub ordered: bool,
    /// With `ordered`: what a dead delivery does to its key's line.
    pub ordered_on_dead: crate::queue::OnDead,
    /// Content filter (`crate::filters`): only events it matches are delivered; None:
    /// every event.
    pub filter: Option<String>,
    /// Transformation (`crate::transforms`): the JavaScript whose result is the body sent;
    /// None: the event's body as it is.
    pub transform: Option<String>,
    /// When the subscription was created (shown by the API).
    pub created_at: DateTime<Utc>,
}

/// Insert a subscription; patterns and filter must already be checked. `ordered`: deliver
/// in order per ordering key, with what a dead delivery does to its line.
pub async fn insert(
    db: impl PgExecutor<'_>,
    endpoint_id: EndpointId,
    source_id: Option<SourceId>,
    event_types: Option<&[String]>,
    ordered: Option<crate::queue::OnDead>,
    filter: Option<&str>,
    transform: Option<&str>,
) -> Result<Subscription, sqlx::Error> {
    let likes: Option<Vec<String>> = event_types.map(|ts| ts.iter().map(|t| fanout::to_like(t)).collect());
    crate::db::query_as(
        "WITH s AS (
             INSERT INTO subscriptions (endpoint_id, source_id, event_types, event_type_likes, ordered, ordered_on_dead,
                                        filter, transform)
             VALUES ($1, $2, $3, $4, $5, COALESCE($6, 'block'), $7::jsonpath, $8)
             RETURNING id, endpoint_id, source_id, event_types, ordered, ordered_on_dead, filter::text AS filter,
                       transform, created_at)
         SELECT s.*, src.name AS source_name FROM s LEFT JOIN sources src ON src.id = s.source_id",
    )
    .bind(endpoint_id)
    .bind(source_id)
    .bind(event_types)
    .bind(likes)
    .bind(ordered.is_some())
    .bind(ordered)
    .bind(filter)
    .bind(transform)
    .fetch_one(db)
    .await
}

const SELECT: &str = "SELECT s.id, s.endpoint_id, s.source_id, s.event_types, s.ordered, s.ordered_on_dead,
                             s.filter::text AS filter, s.transform, s.created_at, src.name AS source_name
                      FROM subscriptions s LEFT JOIN sources src ON src.id = s.source_id";

/// Subscriptions, optionally of one endpoint, in creation order.
pub async fn list(db: impl PgExecutor<'_>, endpoint_id: Option<EndpointId>) -> Result<Vec<Subscription>, sqlx::Error> {
    crate::db::query_as(&format!("{SELECT} WHERE $1::uuid IS NULL OR s.endpoint_id = $1 ORDER BY s.id"))
        .bind(endpoint_id)
        .fetch_all(db)
        .await
}

/// One subscription.
pub async fn by_id(db: impl PgExecutor<'_>, id: SubscriptionId) -> Result<Option<Subscription>, sqlx::Error> {
    crate::db::query_as(&format!("{SELECT} WHERE s.id = $1")).bind(id).fetch_optional(db).await
}

/// Change a subscription's source, patterns, ordering and/or content filter; `Some(None)`
/// clears one (every source, every type, unordered, no filter). Deliveries already
/// created keep how they were made, but for the transformation: its pending deliveries
/// made with one run the one it has at their next attempt, and a cleared one lets them go
/// untransformed (the operator's choice, made here: a delivery made with a
/// transformation that finds none is otherwise never sent, `deliver::attempt`).
pub async fn update(
    db: impl PgExecutor<'_>,
    id: SubscriptionId,
    source_id: Option<Option<SourceId>>,
    event_types: Option<Option<&[String]>>,
    ordered: Option<Option<crate::queue::OnDead>>,
    filter: Option<Option<&str>>,
    transform: Option<Option<&str>>,
) -> Result<Option<Subscription>, sqlx::Error> {
    let types: Option<Vec<String>> = event_types.flatten().map(<[String]>::to_vec);
    let likes: Option<Vec<String>> = types.as_ref().map(|ts| ts.iter().map(|t| fanout::to_like(t)).collect());
    crate::db::query_as(
        "WITH s AS (
             UPDATE subscriptions
             SET source_id = CASE WHEN $2 THEN $3 ELSE source_id END,
                 event_types = CASE WHEN $4 THEN $5 ELSE event_types END,
                 event_type_likes = CASE WHEN $4 THEN $6 ELSE event_type_likes END,
                 ordered = CASE WHEN $7 THEN $8 IS NOT NULL ELSE ordered END,
                 ordered_on_dead = CASE WHEN $7 THEN COALESCE($8, 'block') ELSE ordered_on_dead END,
                 filter = CASE WHEN $9 THEN $10::jsonpath ELSE filter END,
                 transform = CASE WHEN $11 THEN $12 ELSE transform END
             WHERE id = $1
             RETURNING id, endpoint_id, source_id, event_types, ordered, ordered_on_dead, filter::text AS filter,
                       transform, created_at
         ), untransformed AS (
             UPDATE deliveries SET transform_by = NULL
             WHERE $11 AND $12::text IS NULL AND transform_by = $1 AND status = 'pending'
               AND EXISTS (SELECT 1 FROM s)
         )
         SELECT s.*, src.name AS source_name FROM s LEFT JOIN sources src ON src.id = s.source_id",
    )
    .bind(id)
    .bind(source_id.is_some())
    .bind(source_id.flatten())
    .bind(event_types.is_some())
    .bind(types)
    .bind(likes)
    .bind(ordered.is_some())
    .bind(ordered.flatten())
    .bind(filter.is_some())
    .bind(filter.flatten())
    .bind(transform.is_some())
    .bind(transform.flatten())
    .fetch_optional(db)
    .await
}

/// Delete a subscription. Existing deliveries are not affected, but those made with its
/// transformation: they are never sent untransformed (dead-lettered at their next attempt,
/// `deliver::attempt`).
pub async fn delete(db: impl PgExecutor<'_>, id: SubscriptionId) -> Result<bool, sqlx::Error> {
    Ok(crate::db::query("DELETE FROM subscriptions WHERE id = $1").bind(id).execute(db).await?.rows_affected() == 1)
}

/// Delete every subscription of an endpoint (it is being deleted: no new deliveries).
pub async fn delete_of_endpoint(db: impl PgExecutor<'_>, endpoint_id: EndpointId) -> Result<u64, sqlx::Error> {
    let done =
        crate::db::query("DELETE FROM subscriptions WHERE endpoint_id = $1").bind(endpoint_id).execute(db).await?;
    Ok(done.rows_affected())
}
