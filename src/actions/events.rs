//! What an operator looks for among events, from the API or the console.

use chrono::{DateTime, Utc};

use crate::error::ApiError;
use crate::ids::EventId;
use crate::queue;
use crate::state::AppState;
use crate::store;

/// Deliveries shown with an event, at most.
pub const EVENT_DELIVERIES: i64 = 1000;

/// An event and its deliveries (at most [`EVENT_DELIVERIES`], oldest first); 404 when
/// there is no such event. `GET /v1/events/{id}` and the console's event page.
pub async fn event_with_deliveries(
    state: &AppState,
    id: EventId,
) -> Result<(store::events::Event, Vec<queue::read::Delivery>), ApiError> {
    let event = store::events::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("event"))?;
    let filter = queue::read::Filter { event_id: Some(id), ..Default::default() };
    let deliveries = queue::read::list(&state.pool, &filter, EVENT_DELIVERIES).await?;
    Ok((event, deliveries))
}

/// What to look for among events: the API's query and the console's search form.
#[derive(Debug, Clone, Default)]
pub struct EventSearch {
    /// Source name (422 when there is none).
    pub source: Option<String>,
    /// Exact event type.
    pub event_type: Option<String>,
    /// Exact dedupe key; needs `source` (the key is unique per source, and without one the
    /// search would read every event).
    pub dedupe_key: Option<String>,
    /// Received at or after.
    pub since: Option<DateTime<Utc>>,
    /// Received before.
    pub until: Option<DateTime<Utc>>,
    /// Keyset cursor: the last id of the previous page.
    pub cursor: Option<EventId>,
    /// Newest first instead of oldest first.
    pub newest_first: bool,
}

/// One page of events matching `search`, at most `limit` (a keyset page: no offset, no
/// count). `GET /v1/events` and the console's event search.
pub async fn search_events(
    state: &AppState,
    search: EventSearch,
    limit: i64,
) -> Result<Vec<store::events::EventSummary>, ApiError> {
    let source_id = match &search.source {
        None => None,
        Some(name) => Some(
            store::sources::by_name(&state.pool, name)
                .await?
                .ok_or_else(|| ApiError::validation("source", format!("no source named {name:?}")))?
                .id,
        ),
    };
    if search.dedupe_key.is_some() && source_id.is_none() {
        return Err(ApiError::validation("dedupe_key", "needs `source`: dedupe keys are unique per source"));
    }
    let filter = store::events::Filter {
        source_id,
        event_type: search.event_type,
        dedupe_key: search.dedupe_key,
        since: search.since,
        until: search.until,
        after: search.cursor,
        newest_first: search.newest_first,
    };
    Ok(store::events::list(&state.pool, &filter, limit).await?)
}

/// Try a subscription filter on a stored or a pasted event (the API's
/// `POST /v1/filters/test`): checked like a saved one, evaluated like the fan-out does.
pub async fn try_filter(state: &AppState, body: crate::filters::FilterTest) -> Result<crate::filters::Tried, ApiError> {
    use crate::filters::{EventFields, check, try_on};
    check(&state.pool, &body.filter).await?.map_err(|e| ApiError::validation("filter", e))?;
    match (body.event_id, body.event) {
        (Some(id), None) => {
            let event = store::events::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("event"))?;
            let source = store::sources::by_id(&state.pool, event.source_id).await?;
            let fields = EventFields {
                source_id: Some(event.source_id),
                source_name: source.as_ref().map(|s| s.name.as_str()),
                event_type: &event.event_type,
                headers: &event.headers.0,
                payload: &event.payload,
            };
            Ok(try_on(&state.pool, &body.filter, &fields).await?)
        }
        (None, Some(pasted)) => {
            let payload = serde_json::to_vec(&pasted.payload).map_err(|_| ApiError::internal())?;
            let headers = serde_json::Value::Object(pasted.headers);
            let fields = EventFields {
                source_id: None,
                source_name: pasted.source.as_deref(),
                event_type: &pasted.event_type,
                headers: &headers,
                payload: &payload,
            };
            Ok(try_on(&state.pool, &body.filter, &fields).await?)
        }
        _ => Err(ApiError::validation("event_id", "give exactly one of `event_id` (a stored event) and `event`")),
    }
}

/// Try a subscription transformation on a stored or a pasted event (the API's
/// `POST /v1/transforms/test`): checked like a saved one, run like the worker runs it;
/// nothing is stored or sent.
pub async fn try_transform(
    state: &AppState,
    body: crate::transforms::TransformTest,
) -> Result<crate::transforms::TriedTransform, ApiError> {
    let script = body.transform;
    let checked = script.clone();
    tokio::task::spawn_blocking(move || crate::transforms::check(&checked))
        .await
        .map_err(|_| ApiError::internal())?
        .map_err(|e| ApiError::validation("transform", e))?;
    let webhook = match (body.event_id, body.event) {
        (Some(id), None) => {
            let event = store::events::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("event"))?;
            let source = store::sources::by_id(&state.pool, event.source_id).await?;
            crate::transforms::webhook(
                &event.payload,
                Some(&event.headers.0),
                &event.event_type,
                source.as_ref().map(|s| s.name.as_str()),
            )
        }
        (None, Some(pasted)) => {
            let payload = serde_json::to_vec(&pasted.payload).map_err(|_| ApiError::internal())?;
            let headers = serde_json::Value::Object(pasted.headers);
            crate::transforms::webhook(&payload, Some(&headers), &pasted.event_type, pasted.source.as_deref())
        }
        _ => {
            return Err(ApiError::validation(
                "event_id",
                "give exactly one of `event_id` (a stored event) and `event`",
            ));
        }
    };
    let ran = tokio::task::spawn_blocking(move || crate::transforms::apply(&script, &webhook))
        .await
        .map_err(|_| ApiError::internal())?;
    Ok(match ran {
        Ok(bytes) => crate::transforms::TriedTransform {
            body: Some(serde_json::from_slice(&bytes).map_err(|_| ApiError::internal())?),
            error: None,
        },
        Err(why) => crate::transforms::TriedTransform { body: None, error: Some(format!("transform: {why}")) },
    })
}
