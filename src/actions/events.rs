//! What an operator looks for among events, from the API or the console.

use chrono::{DateTime, Utc};

use crate::error::{ApiError, ErrorCode};
use crate::ids::EventId;
use crate::queue;
use crate::state::AppState;
use crate::store;
use crate::tokens::Principal;

/// Deliveries shown with an event, at most.
pub const EVENT_DELIVERIES: i64 = 1000;

/// An event as its caller may see it, with its deliveries.
#[derive(Debug)]
pub struct ShownEvent {
    /// The event; its payload is empty when withheld.
    pub event: store::events::Event,
    /// The caller may not read payloads ([`Principal::payloads_refused`]): the payload was
    /// withheld (emptied here, so no view can show it by mistake).
    pub payload_withheld: bool,
    /// Its deliveries, oldest first.
    pub deliveries: Vec<queue::read::Delivery>,
}

/// An event and its deliveries (at most [`EVENT_DELIVERIES`], oldest first), its payload
/// withheld from a `caller` that may not read payloads; 404 when there is no such event.
/// `GET /v1/events/{id}` and the console's event page.
pub async fn event_with_deliveries(state: &AppState, caller: &Principal, id: EventId) -> Result<ShownEvent, ApiError> {
    let mut event = store::events::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("event"))?;
    let filter = queue::read::Filter { event_id: Some(id), ..Default::default() };
    let deliveries = queue::read::list(&state.pool, &filter, EVENT_DELIVERIES).await?;
    let payload_withheld = !caller.payloads;
    if payload_withheld {
        event.payload = Vec::new();
    }
    shown_key(caller, &mut event.dedupe_key);
    Ok(ShownEvent { event, payload_withheld, deliveries })
}

/// What a caller that may not read payloads is shown for a dedupe key that is the hash of
/// its event's body (the key of last resort, for a webhook that carries none).
pub const WITHHELD_BODY_HASH: &str = "sha256:withheld";

/// `key` as `caller` may see it: a body's hash withheld with the payload (it confirms a
/// guessed body as surely as the body would).
fn shown_key(caller: &Principal, key: &mut String) {
    if !caller.payloads && key.starts_with(crate::verify::BODY_HASH_PREFIX) {
        *key = WITHHELD_BODY_HASH.to_owned();
    }
}

/// A delivery's attempts, oldest first, as `caller` may see them: without the bodies a
/// transformation sent (they are made from the payload) when it may not read payloads.
/// `GET /v1/deliveries/{id}/attempts` and the console's delivery page.
pub async fn delivery_attempts(
    state: &AppState,
    caller: &Principal,
    id: crate::ids::DeliveryId,
) -> Result<Vec<store::attempts::Attempt>, ApiError> {
    let mut attempts = store::attempts::for_delivery(&state.pool, id).await?;
    if !caller.payloads {
        for a in &mut attempts {
            a.sent_excerpt = None;
        }
    }
    Ok(attempts)
}

/// 403 when `caller` may not read payloads and `what` would reveal them.
fn payloads_allowed(caller: &Principal, what: &str) -> Result<(), ApiError> {
    match caller.payloads_refused(what) {
        Some(why) => Err(ApiError::new(ErrorCode::Forbidden, why)),
        None => Ok(()),
    }
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

/// Why a search by payload or header is refused on a gateway that indexes only keys.
pub const CONTENT_SEARCH_OFF: &str = "content search is off on this gateway (--content-search=false): events are \
     indexed by their dedupe key only; search by dedupe_key, or turn content search on (it finds the events stored \
     from then on)";

/// One page of events matching `search`, at most `limit` (a keyset page: no offset, no
/// count). `GET /v1/events` and the console's event search. A search by payload or
/// header on a gateway that indexes only keys is refused ([`CONTENT_SEARCH_OFF`]).
pub async fn search_events(
    state: &AppState,
    caller: &Principal,
    search: EventSearch,
    limit: i64,
) -> Result<Vec<store::events::EventSummary>, ApiError> {
    if search.payload.is_some() {
        // Which events hold a value is the value, a guess at a time.
        payloads_allowed(caller, "a search by payload content")?;
    }
    if search.dedupe_key.as_deref().is_some_and(|k| k.starts_with(crate::verify::BODY_HASH_PREFIX)) {
        // A body's hash found is a guessed body confirmed.
        payloads_allowed(caller, "a search by a body's hash")?;
    }
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
    if !state.intake.indexing().content() {
        // Refused rather than answered empty: an empty page would say no event holds it.
        for (field, given) in [("payload", search.payload.is_some()), ("header", search.header.is_some())] {
            if given {
                return Err(ApiError::validation(field, CONTENT_SEARCH_OFF));
            }
        }
    }
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
    let mut found = store::events::list(&state.pool, &filter, limit).await?;
    for event in &mut found {
        shown_key(caller, &mut event.dedupe_key);
    }
    Ok(found)
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
        caller: &Principal,
        event_id: Option<EventId>,
        event: Option<crate::filters::PastedEvent>,
    ) -> Result<TryEvent, ApiError> {
        match (event_id, event) {
            (Some(id), None) => {
                // A filter's verdict or a transformation's output is the payload, read back.
                payloads_allowed(caller, "trying an expression on a stored event")?;
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
                // Stored headers' names are in lower case: a pasted `X-Foo` must read as
                // the stored event's `x-foo` does.
                headers: serde_json::Value::Object(
                    pasted.headers.into_iter().map(|(name, value)| (name.to_ascii_lowercase(), value)).collect(),
                ),
                payload: pasted.payload.map_or_else(|| b"null".to_vec(), |raw| raw.get().as_bytes().to_vec()),
            }),
            _ => Err(ApiError::validation("event_id", "give exactly one of `event_id` (a stored event) and `event`")),
        }
    }
}

/// Trying an expression runs the caller's code (a jsonpath in PostgreSQL, JavaScript on
/// the threads deliveries transform on): the `operate` scope, as the API's routes ask,
/// wherever it is tried from (the console's pages are GETs, which `read` may open).
fn may_try(caller: &Principal, what: &str) -> Result<(), ApiError> {
    if caller.scope >= crate::tokens::Scope::Operate {
        return Ok(());
    }
    Err(ApiError::new(
        crate::error::ErrorCode::Forbidden,
        format!("the token {:?} has the scope {}; trying {what} needs operate", caller.name, caller.scope.as_str()),
    ))
}

/// Try a subscription filter on a stored or a pasted event (the API's
/// `POST /v1/filters/test`): checked like a saved one, evaluated like the fan-out does.
pub async fn try_filter(
    state: &AppState,
    caller: &Principal,
    body: crate::filters::FilterTest,
) -> Result<crate::filters::Tried, ApiError> {
    use crate::filters::{EventFields, check, try_on};
    may_try(caller, "a filter")?;
    check(&state.pool, &body.filter).await?.map_err(|e| ApiError::validation("filter", e))?;
    let event = TryEvent::of(state, caller, body.event_id, body.event).await?;
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
    caller: &Principal,
    body: crate::transforms::TransformTest,
) -> Result<crate::transforms::TriedTransform, ApiError> {
    may_try(caller, "a transformation")?;
    let script = body.transform;
    let checked = script.clone();
    tokio::task::spawn_blocking(move || crate::transforms::check(&checked))
        .await
        .map_err(|_| ApiError::internal())?
        .map_err(|e| ApiError::validation("transform", e))?;
    let e = TryEvent::of(state, caller, body.event_id, body.event).await?;
    let webhook =
        crate::transforms::Webhook::new(e.payload.into(), Some(e.headers.to_string()), e.event_type, e.source_name);
    Ok(match crate::transforms::run_apart(&script, webhook).await {
        Ok(bytes) => {
            // The engine's own JSON: read as it is (a parse into a document stops at 128
            // levels, which a handler's result may pass).
            let text = String::from_utf8(bytes).map_err(|_| ApiError::internal())?;
            let body = serde_json::value::RawValue::from_string(text).map_err(|_| ApiError::internal())?;
            crate::transforms::TriedTransform { body: Some(body), error: None }
        }
        Err(why) => crate::transforms::TriedTransform { body: None, error: Some(format!("transform: {why}")) },
    })
}
