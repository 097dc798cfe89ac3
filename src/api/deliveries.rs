//! `/v1/deliveries`: the state of every delivery and the story of its attempts.

use axum::Json;
use axum::extract::{Path, State};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::extract::{ApiQuery, page_limit, parse_id};
use crate::app::AppState;
use crate::error::ApiError;
use crate::ids::{DeliveryId, EndpointId, EventId};
use crate::queue::read::{self, Delivery, Filter};
use crate::store;

/// A delivery as the API shows it.
#[derive(Debug, Serialize)]
pub struct DeliveryView {
    id: DeliveryId,
    /// The `webhook-id` / `Idempotency-Key` every attempt carries.
    webhook_id: String,
    event_id: EventId,
    endpoint_id: EndpointId,
    status: String,
    attempts: i32,
    next_attempt_at: Option<DateTime<Utc>>,
    in_flight: bool,
    /// Waiting for its endpoint's circuit to close (or the endpoint to resume).
    parked: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    dead_reason: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    #[serde(skip_serializing_if = "Option::is_none")]
    finished_at: Option<DateTime<Utc>>,
}

impl From<Delivery> for DeliveryView {
    fn from(d: Delivery) -> Self {
        let pending = d.status == "pending";
        DeliveryView {
            webhook_id: d.id.webhook_id(),
            id: d.id,
            event_id: d.event_id,
            endpoint_id: d.endpoint_id,
            in_flight: pending && d.leased_until.is_some_and(|t| t > Utc::now()),
            next_attempt_at: (pending && !d.parked).then_some(d.next_attempt_at),
            parked: d.parked,
            status: d.status,
            attempts: d.attempt_count,
            dead_reason: d.dead_reason,
            created_at: d.created_at,
            updated_at: d.updated_at,
            finished_at: d.finished_at,
        }
    }
}

/// Query of `GET /v1/deliveries`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    event_id: Option<EventId>,
    endpoint_id: Option<EndpointId>,
    status: Option<Status>,
    /// Page size, 1-1000 (default 100).
    limit: Option<i64>,
    /// `next_cursor` of the previous page.
    cursor: Option<DeliveryId>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Status {
    Pending,
    Delivered,
    Dead,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Delivered => "delivered",
            Status::Dead => "dead",
        }
    }
}

/// `GET /v1/deliveries?event_id=&endpoint_id=&status=&limit=&cursor=`.
pub async fn list(
    State(state): State<AppState>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let limit = page_limit(q.limit)?;
    let filter = Filter {
        event_id: q.event_id,
        endpoint_id: q.endpoint_id,
        status: q.status.map(|s| s.as_str().to_owned()),
        after: q.cursor,
    };
    let rows = read::list(&state.pool, &filter, limit).await?;
    let next_cursor = (rows.len() as i64 == limit).then(|| rows.last().map(|d| d.id)).flatten();
    let data: Vec<DeliveryView> = rows.into_iter().map(Into::into).collect();
    Ok(Json(serde_json::json!({ "data": data, "next_cursor": next_cursor })))
}

/// `GET /v1/deliveries/{id}`.
pub async fn get(State(state): State<AppState>, Path(id): Path<String>) -> Result<Json<DeliveryView>, ApiError> {
    let id: DeliveryId = parse_id(&id, "delivery")?;
    let delivery = read::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("delivery"))?;
    Ok(Json(delivery.into()))
}

/// `GET /v1/deliveries/{id}/attempts`.
pub async fn attempts(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let id: DeliveryId = parse_id(&id, "delivery")?;
    let delivery = read::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("delivery"))?;
    let attempts = store::attempts::for_delivery(&state.pool, id).await?;
    Ok(Json(serde_json::json!({
        "delivery": DeliveryView::from(delivery),
        "data": attempts,
    })))
}

/// `POST /v1/deliveries/{id}/redeliver`: a dead (or delivered) delivery goes back to
/// pending, due now, with a fresh attempt budget and the same `webhook-id`. Idempotent:
/// while it is pending, calling again changes nothing and returns the current state.
/// (Re-ingesting a duplicate event never revives a dead delivery; only this does.)
pub async fn redeliver(State(state): State<AppState>, Path(id): Path<String>) -> Result<Json<DeliveryView>, ApiError> {
    let id: DeliveryId = parse_id(&id, "delivery")?;
    let changed = crate::queue::redeliver(&state.pool, id).await?;
    let delivery = read::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("delivery"))?;
    if changed {
        state.wake.notify_one();
        tracing::info!(delivery_id = %id, "manual redelivery");
    }
    Ok(Json(delivery.into()))
}
