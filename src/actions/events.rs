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
    /// Exact dedupe key (with `source`, one probe of the unique index; without, through
    /// the content index).
    pub dedupe_key: Option<String>,
    /// A value in the payload, `PATH=VALUE` ([`crate::search::Condition::payload`]).
    pub payload: Option<String>,
    /// A header's value, `NAME:VALUE` ([`crate::search::Condition::header`]).
    pub header: Option<String>,
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
    use crate::search::Condition;
    let mut content = Vec::new();
    if let Some(text) = &search.payload {
        content.push(Condition::payload(text).map_err(|why| ApiError::validation("payload", why))?.alternatives());
    }
    if let Some(text) = &search.header {
        content.push(Condition::header(text).map_err(|why| ApiError::validation("header", why))?.alternatives());
    }
    let mut dedupe_key = search.dedupe_key;
    if source_id.is_none() {
        // Unique per source only: without one, found through the content index.
        if let Some(key) = dedupe_key.take() {
            content.push(Condition::Key(key).alternatives());
        }
    }
    let filter = store::events::Filter {
        source_id,
        event_type: search.event_type,
        dedupe_key,
        content,
        since: search.since,
        until: search.until,
        after: search.cursor,
        newest_first: search.newest_first,
    };
    Ok(store::events::list(&state.pool, &filter, limit).await?)
}

/// The event a filter or a transformation is tried on: a stored one or a pasted one.
struct TryEvent {
    source_id: Option<crate::ids::SourceId>,
    source_name: Option<String>,
    event_type: String,
    headers: serde_json::Value,
    payload: Vec<u8>,
}

impl TryEvent {
    /// The stored event `event_id`, or the pasted `event`: exactly one must be given.
    async fn of(
        state: &AppState,
        event_id: Option<EventId>,
        event: Option<crate::filters::PastedEvent>,
    ) -> Result<TryEvent, ApiError> {
        match (event_id, event) {
            (Some(id), None) => {
                let e = store::events::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("event"))?;
                Ok(TryEvent {
                    source_id: Some(e.source_id),
                    source_name: Some(e.source_name),
                    event_type: e.event_type,
                    headers: e.headers.0,
                    payload: e.payload,
                })
            }
            (None, Some(pasted)) => Ok(TryEvent {
                source_id: None,
                source_name: pasted.source,
                event_type: pasted.event_type,
                headers: serde_json::Value::Object(pasted.headers),
                payload: serde_json::to_vec(&pasted.payload).map_err(|_| ApiError::internal())?,
            }),
            _ => Err(ApiError::validation("event_id", "give exactly one of `event_id` (a stored event) and `event`")),
        }
    }
}

/// Try a subscription filter on a stored or a pasted event (the API's
/// `POST /v1/filters/test`): checked like a saved one, evaluated like the fan-out does.
pub async fn try_filter(state: &AppState, body: crate::filters::FilterTest) -> Result<crate::filters::Tried, ApiError> {
    use crate::filters::{EventFields, check, try_on};
    check(&state.pool, &body.filter).await?.map_err(|e| ApiError::validation("filter", e))?;
    let event = TryEvent::of(state, body.event_id, body.event).await?;
    let fields = EventFields {
        source_id: event.source_id,
        source_name: event.source_name.as_deref(),
        event_type: &event.event_type,
        headers: &event.headers,
        payload: &event.payload,
    };
    Ok(try_on(&state.pool, &body.filter, &fields).await?)
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
    let e = TryEvent::of(state, body.event_id, body.event).await?;
    let webhook =
        crate::transforms::webhook(&e.payload, Some(&e.headers.to_string()), &e.event_type, e.source_name.as_deref());
    Ok(match crate::transforms::run(&script, webhook).await {
        Ok(bytes) => crate::transforms::TriedTransform {
            body: Some(serde_json::from_slice(&bytes).map_err(|_| ApiError::internal())?),
            error: None,
        },
        Err(why) => crate::transforms::TriedTransform { body: None, error: Some(format!("transform: {why}")) },
    })
}
