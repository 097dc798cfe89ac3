//! `/v1/deliveries`: the state of every delivery and the story of its attempts.

use axum::Json;
use axum::extract::State;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::AppState;
use super::extract::{ApiQuery, Id, page_limit};
use super::openapi::AdminErrors;
use crate::error::{ApiError, ErrorBody};
use crate::ids::{DeliveryId, EndpointId, EventId};
use crate::queue::DeliveryStatus;
use crate::queue::read::{self, Delivery, Filter};
use crate::store;

/// A delivery as the API shows it.
#[derive(Debug, Serialize, ToSchema)]
pub struct DeliveryView {
    id: DeliveryId,
    /// The `webhook-id` / `Idempotency-Key` every attempt carries.
    #[schema(example = "msg_0190c7e0f4a97c3a9d5e3c1b2a4f6e8d")]
    webhook_id: String,
    event_id: EventId,
    endpoint_id: EndpointId,
    /// `pending`, `delivered` or `dead`.
    status: DeliveryStatus,
    /// Attempts made so far (over its whole life, redeliveries included).
    attempts: i32,
    /// When the next attempt is due (pending and not parked).
    next_attempt_at: Option<DateTime<Utc>>,
    /// An attempt is running now.
    in_flight: bool,
    /// Waiting for its endpoint's circuit to close (or the endpoint to resume).
    parked: bool,
    /// Its ordering key, when its subscription delivers in order (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    ordering_key: Option<String>,
    /// Waiting for the earlier deliveries of its ordering line.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    waiting: bool,
    /// Why it was dead-lettered (dead only).
    #[serde(skip_serializing_if = "Option::is_none")]
    dead_reason: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    /// When it was delivered or dead-lettered.
    #[serde(skip_serializing_if = "Option::is_none")]
    finished_at: Option<DateTime<Utc>>,
}

/// A page of deliveries.
#[derive(Debug, Serialize, ToSchema)]
pub struct DeliveryPage {
    /// Oldest first.
    data: Vec<DeliveryView>,
    /// Pass as `cursor` for the next page; `null` on the last page.
    next_cursor: Option<DeliveryId>,
}

// Fields in alphabetical order: the order this answer has always had.
/// A delivery and the story of its attempts.
#[derive(Debug, Serialize, ToSchema)]
pub struct AttemptTimeline {
    /// Its attempts, first to last.
    data: Vec<store::attempts::Attempt>,
    /// The delivery as it is now.
    delivery: DeliveryView,
}

impl From<Delivery> for DeliveryView {
    fn from(d: Delivery) -> Self {
        let pending = d.status == DeliveryStatus::Pending;
        DeliveryView {
            webhook_id: d.id.webhook_id(),
            id: d.id,
            event_id: d.event_id,
            endpoint_id: d.endpoint_id,
            in_flight: pending && d.leased_until.is_some_and(|t| t > crate::clock::now()),
            next_attempt_at: (pending && !d.parked && !d.waiting).then_some(d.next_attempt_at),
            parked: d.parked,
            ordering_key: d.ordering_key,
            waiting: d.waiting,
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
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only this event's deliveries.
    event_id: Option<EventId>,
    /// Only this endpoint's deliveries.
    endpoint_id: Option<EndpointId>,
    /// Only deliveries in this state (`dead` is the dead-letter queue).
    #[param(inline)]
    status: Option<DeliveryStatus>,
    /// Page size, 1-1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
    /// `next_cursor` of the previous page.
    cursor: Option<DeliveryId>,
}

/// `GET /v1/deliveries?event_id=&endpoint_id=&status=&limit=&cursor=`.
#[utoipa::path(
    get, path = "/v1/deliveries", tag = "deliveries", operation_id = "list_deliveries",
    summary = "List deliveries",
    params(ListQuery),
    responses(
        (status = 200, description = "A page of deliveries, oldest first", body = DeliveryPage),
        (status = 422, description = "Bad query parameter, named in the message (`validation_failed`)",
            body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn list(
    State(state): State<AppState>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<DeliveryPage>, ApiError> {
    let limit = page_limit(q.limit)?;
    let filter = Filter {
        event_id: q.event_id,
        endpoint_id: q.endpoint_id,
        status: q.status,
        after: q.cursor,
        ..Default::default()
    };
    let rows = read::list(&state.pool, &filter, limit).await?;
    let next_cursor = (rows.len() as i64 == limit).then(|| rows.last().map(|d| d.id)).flatten();
    let data = rows.into_iter().map(Into::into).collect();
    Ok(Json(DeliveryPage { data, next_cursor }))
}

/// `GET /v1/deliveries/{id}`.
#[utoipa::path(
    get, path = "/v1/deliveries/{id}", tag = "deliveries", operation_id = "get_delivery",
    summary = "Get a delivery",
    params(("id" = DeliveryId, Path, description = "Delivery id (anything else is 404)")),
    responses(
        (status = 200, description = "The delivery", body = DeliveryView),
        (status = 404, description = "No such delivery (`not_found`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn get(State(state): State<AppState>, Id(id): Id<DeliveryId>) -> Result<Json<DeliveryView>, ApiError> {
    let delivery = read::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("delivery"))?;
    Ok(Json(delivery.into()))
}

/// `GET /v1/deliveries/{id}/attempts`.
#[utoipa::path(
    get, path = "/v1/deliveries/{id}/attempts", tag = "deliveries", operation_id = "list_delivery_attempts",
    summary = "A delivery's attempts",
    params(("id" = DeliveryId, Path, description = "Delivery id (anything else is 404)")),
    responses(
        (status = 200, description = "The delivery and its attempts", body = AttemptTimeline),
        (status = 404, description = "No such delivery (`not_found`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn attempts(
    State(state): State<AppState>,
    axum::Extension(caller): axum::Extension<crate::tokens::Principal>,
    Id(id): Id<DeliveryId>,
) -> Result<Json<AttemptTimeline>, ApiError> {
    let delivery = read::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("delivery"))?;
    let data = crate::actions::delivery_attempts(&state, &caller, id).await?;
    Ok(Json(AttemptTimeline { data, delivery: delivery.into() }))
}

/// `POST /v1/deliveries/{id}/redeliver`.
///
/// A dead (or delivered) delivery goes back to pending, due now, with a fresh attempt
/// budget and the same `webhook-id`. Idempotent: while it is pending, calling again changes
/// nothing and returns the current state. (Re-ingesting a duplicate event never revives a
/// dead delivery; only this does.)
#[utoipa::path(
    post, path = "/v1/deliveries/{id}/redeliver", tag = "deliveries", operation_id = "redeliver",
    summary = "Redeliver a delivery",
    params(("id" = DeliveryId, Path, description = "Delivery id (anything else is 404)")),
    responses(
        (status = 200, description = "Pending again, due now (idempotent: a pending delivery is returned unchanged)",
            body = DeliveryView),
        (status = 404, description = "No such delivery (`not_found`)", body = ErrorBody),
        (status = 409, description = "Its endpoint was deleted (`conflict`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn redeliver(State(state): State<AppState>, Id(id): Id<DeliveryId>) -> Result<Json<DeliveryView>, ApiError> {
    Ok(Json(crate::actions::redeliver_one(&state, id).await?.into()))
}

/// `POST /v1/deliveries/{id}/unblock`.
///
/// A dead delivery of an ordered subscription that blocks on dead holds its key's line:
/// unblocking lets the line's next delivery go (the dead one stays in the dead-letter
/// queue; redeliver it instead to send it first).
#[utoipa::path(
    post, path = "/v1/deliveries/{id}/unblock", tag = "deliveries", operation_id = "unblock",
    summary = "Let an ordered line move past a dead delivery",
    params(("id" = DeliveryId, Path, description = "Delivery id (anything else is 404)")),
    responses(
        (status = 200, description = "The line moves on (the delivery is returned as it is)", body = DeliveryView),
        (status = 404, description = "No such delivery (`not_found`)", body = ErrorBody),
        (status = 409, description = "It is not a dead delivery blocking its line (`conflict`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn unblock(State(state): State<AppState>, Id(id): Id<DeliveryId>) -> Result<Json<DeliveryView>, ApiError> {
    Ok(Json(crate::actions::unblock(&state, id).await?.into()))
}
