//! `/v1/events`: publishing from internal producers, and reading stored events.

use axum::extract::State;
use axum::{Extension, Json};
use base64::Engine;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::AppState;
use super::deliveries::DeliveryView;
use super::extract::{ApiJson, ApiQuery, Id, page_limit};
use super::ingest::{IngestResponse, store_error};
use super::openapi::{AdminErrors, JsonBodyErrors};
use crate::actions::{EventSearch, ShownEvent, event_with_deliveries, search_events};
use crate::error::{ApiError, ErrorBody};
use crate::ids::EventId;
use crate::sanitize;
use crate::store;
use crate::store::events::OwnedEvent;
use crate::tokens::Principal;

/// Longest caller event id (`POST /v1/events`).
const MAX_EVENT_ID_BYTES: usize = 255;

/// Body of `POST /v1/events`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PublishEvent {
    /// Source name (default `api`).
    #[serde(default)]
    pub source: Option<String>,
    /// Event type, matched against subscriptions (1-200 bytes, no control characters).
    #[schema(example = "order.created")]
    pub event_type: String,
    /// The caller's id for this event: publishing it twice stores it once (1-255 bytes, no control
    /// characters).
    #[schema(example = "order-42-created")]
    pub event_id: String,
    /// The body delivered to subscribers.
    pub payload: serde_json::Value,
    /// Events with the same key go, to each endpoint whose subscription asks for ordered
    /// delivery, one at a time and in the order they were published (no control
    /// characters; longer than 1024 bytes is stored as a digest).
    #[serde(default)]
    #[schema(example = "customer-42")]
    pub ordering_key: Option<String>,
}

/// `POST /v1/events`.
///
/// Idempotent on `(source, event_id)`; answers like ingest.
#[utoipa::path(
    post, path = "/v1/events", tag = "events", operation_id = "publish_event",
    summary = "Publish an event",
    request_body = PublishEvent,
    responses(
        (status = 200, description = "Stored (or already stored: `duplicate`), with its deliveries, before this answer",
            body = IngestResponse),
        JsonBodyErrors,
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn publish(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    // The payload is data, stored as bytes: NUL inside it is fine. The text fields are
    // checked here.
    ApiJson(body): ApiJson<PublishEvent, true>,
) -> Result<Json<IngestResponse>, ApiError> {
    use tracing::Instrument as _;
    let span = crate::telemetry::server_span("/v1/events", &headers);
    let answer = publish_traced(state, &headers, body).instrument(span.clone()).await;
    super::ingest::traced_answer(&span, &answer);
    answer
}

async fn publish_traced(
    state: AppState,
    headers: &axum::http::HeaderMap,
    body: PublishEvent,
) -> Result<Json<IngestResponse>, ApiError> {
    if body.event_id.len() > MAX_EVENT_ID_BYTES {
        return Err(ApiError::validation("event_id", format!("must be 1-{MAX_EVENT_ID_BYTES} bytes")));
    }
    // The same rules as a webhook's key and type: no control characters, never altered.
    let event_id = sanitize::dedupe_key(body.event_id).map_err(|why| ApiError::validation("event_id", why))?;
    let event_type = sanitize::event_type(body.event_type).map_err(|why| ApiError::validation("event_type", why))?;
    let ordering_key = body
        .ordering_key
        .map(|key| sanitize::dedupe_key(key).map_err(|why| ApiError::validation("ordering_key", why)))
        .transpose()?;
    let source_name = body.source.as_deref().unwrap_or("api");
    let no_such_source = || ApiError::validation("source", format!("no source named {source_name:?}"));
    // No source name holds a control character (the names' CHECK), and PostgreSQL
    // could not even compare one with NUL.
    if source_name.chars().any(char::is_control) {
        return Err(no_such_source());
    }
    let source = store::sources::by_name(&state.pool, source_name).await?.ok_or_else(no_such_source)?;
    let payload = serde_json::to_vec(&body.payload).map_err(|_| ApiError::internal())?;
    let deadline = tokio::time::Instant::now() + state.db_timeout;
    let stored = state
        .intake
        .accept(
            OwnedEvent {
                source_id: source.id,
                source_name: source.name.clone(),
                indexing: state.intake.indexing(),
                dedupe_key: event_id,
                event_type,
                content_type: Some("application/json".to_owned()),
                headers: serde_json::Value::Object(serde_json::Map::new()),
                payload: payload.into(),
                ordering_key,
                trace: crate::telemetry::EventTrace::for_request(headers),
                terms: None,
            },
            deadline,
        )
        .await
        .map_err(store_error)?;
    Ok(Json(stored.into()))
}

/// An event with its deliveries.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventView {
    id: EventId,
    /// Name of the source it arrived on (`api` for events published without one).
    source: String,
    event_type: String,
    /// What duplicates are recognised by (a delivery id, or `sha256:<hex of the body>`).
    dedupe_key: String,
    received_at: DateTime<Utc>,
    /// The request's Content-Type, replayed on delivery; `null` when it had none.
    content_type: Option<String>,
    /// The request headers kept with the event (lower-case names), signatures redacted.
    #[schema(value_type = Object)]
    headers: serde_json::Value,
    /// The body as JSON when it is JSON ...
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<serde_json::Value>)]
    payload: Option<serde_json::Value>,
    /// ... else as base64.
    #[serde(skip_serializing_if = "Option::is_none")]
    payload_base64: Option<String>,
    /// `true` when the token may not read payloads: neither `payload` nor
    /// `payload_base64` is given (`payload_bytes` of the event list still says its size).
    payload_withheld: bool,
    /// Its deliveries (at most 1,000).
    deliveries: Vec<DeliveryView>,
}

/// A page of events.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventPage {
    /// Oldest first.
    data: Vec<store::events::EventSummary>,
    /// Pass as `cursor` for the next page; `null` on the last page.
    next_cursor: Option<EventId>,
}

/// `GET /v1/events/{id}`.
#[utoipa::path(
    get, path = "/v1/events/{id}", tag = "events", operation_id = "get_event",
    summary = "Get an event with its deliveries",
    params(("id" = EventId, Path, description = "Event id (anything else is 404)")),
    responses(
        (status = 200, description = "The event with its payload and deliveries", body = EventView),
        (status = 404, description = "No such event (`not_found`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn get(
    State(state): State<AppState>,
    Extension(caller): Extension<Principal>,
    Id(id): Id<EventId>,
) -> Result<Json<EventView>, ApiError> {
    let ShownEvent { event, payload_withheld, deliveries } = event_with_deliveries(&state, &caller, id).await?;
    let (parsed, payload_base64) = if payload_withheld {
        (None, None)
    } else {
        let parsed: Option<serde_json::Value> = serde_json::from_slice(&event.payload).ok();
        let base64 = parsed.is_none().then(|| base64::engine::general_purpose::STANDARD.encode(&event.payload));
        (parsed, base64)
    };
    Ok(Json(EventView {
        id: event.id,
        source: event.source_name,
        event_type: event.event_type,
        dedupe_key: event.dedupe_key,
        received_at: event.received_at,
        content_type: event.content_type,
        headers: event.headers.0,
        payload: parsed,
        payload_base64,
        payload_withheld,
        deliveries: deliveries.into_iter().map(Into::into).collect(),
    }))
}

/// Query of `GET /v1/events`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only events of the source with this name (422 when there is none).
    source: Option<String>,
    /// Only events of this type, or matching this pattern when it has a `*`, as a
    /// subscription's `event_types` (`order.*`).
    event_type: Option<String>,
    /// Only the event(s) with exactly this dedupe key (in any source without `source`).
    dedupe_key: Option<String>,
    /// Only events whose JSON payload holds this value at this path: `PATH=VALUE`, the
    /// path a JSON Pointer (`/data/object/id=ch_123`) or dotted (`order=42`); the value
    /// compared as text (`42` finds the number and the string), in double quotes for a
    /// JSON string with spaces at its ends or escapes. Indexed: fast in any window (422 on
    /// a gateway whose content search is off, `--content-search=false`).
    #[param(example = "/data/object/id=ch_123")]
    payload: Option<String>,
    /// Only events that arrived with this header value: `NAME:VALUE` (any case for the
    /// name; the value exactly as stored, repeated headers joined with ", "; redacted
    /// headers cannot be searched; 422 with content search off, as `payload`).
    #[param(example = "x-github-event:push")]
    header: Option<String>,
    /// Received at or after (RFC 3339).
    since: Option<DateTime<Utc>>,
    /// Received before (RFC 3339).
    until: Option<DateTime<Utc>>,
    /// Page size, 1-1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
    /// `next_cursor` of the previous page.
    cursor: Option<EventId>,
}

/// `GET /v1/events?source=&event_type=&dedupe_key=&payload=&header=&since=&until=&limit=&cursor=`.
///
/// Oldest first.
#[utoipa::path(
    get, path = "/v1/events", tag = "events", operation_id = "list_events",
    summary = "List events",
    params(ListQuery),
    responses(
        (status = 200, description = "A page of events, oldest first", body = EventPage),
        (status = 422, description = "Bad query parameter, unknown source, or a malformed `payload` or `header` \
            condition, or one on a gateway whose content search is off, named (`validation_failed`)",
            body = ErrorBody),
        (status = 403, description = "A `payload` condition, for a token that may not read payloads (`forbidden`)",
            body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn list(
    State(state): State<AppState>,
    Extension(caller): Extension<Principal>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<EventPage>, ApiError> {
    let limit = page_limit(q.limit)?;
    let search = EventSearch {
        source: q.source,
        event_type: q.event_type,
        dedupe_key: q.dedupe_key,
        payload: q.payload,
        header: q.header,
        since: q.since,
        until: q.until,
        cursor: q.cursor,
        newest_first: false,
    };
    let data = search_events(&state, &caller, search, limit).await?;
    let next_cursor = (data.len() as i64 == limit).then(|| data.last().map(|e| e.id)).flatten();
    Ok(Json(EventPage { data, next_cursor }))
}
