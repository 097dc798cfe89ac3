//! Events (search, one event with its payload, headers and deliveries) and a delivery's
//! attempt timeline, with its redelivery.

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::response::Response;
use serde::{Deserialize, Serialize};

use super::session::{NoFields, Posted};
use super::{ConsoleError, Layout, PAGE, PageResult, Session, Ts, non_empty, or_empty, render, ts};
use crate::actions;
use crate::api::AppState;
use crate::error::ApiError;
use crate::ids::{DeliveryId, EventId};
use crate::queue::read::{self, Delivery};
use crate::store;

/// The search form's fields (also the query string of its pages).
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct SearchForm {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    event_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dedupe_key: Option<String>,
    /// `PATH=VALUE` in the payload (`crate::search`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    payload: Option<String>,
    /// `NAME:VALUE` of a header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    header: Option<String>,
    /// One of [`WINDOWS`] (default: the last 24 hours).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    window: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cursor: Option<String>,
}

/// A row of the events list.
struct Row {
    id: String,
    source: String,
    event_type: String,
    dedupe_key: String,
    received_at: Ts,
    payload_bytes: i32,
    /// Its deliveries in a word (`delivered`, `retrying`, `dead`, `no deliveries`).
    state: &'static str,
    /// The state's badge class.
    badge: &'static str,
}

#[derive(Template)]
#[template(path = "console/events.html")]
struct ListPage {
    layout: Layout,
    event_type: String,
    dedupe_key: String,
    payload: String,
    header: String,
    windows: Vec<super::Opt>,
    sources: Vec<super::Opt>,
    rows: Vec<Row>,
    next: Option<String>,
    /// Why the search could not run (a malformed condition), shown above the form.
    problem: String,
}

/// `GET /console/events`: newest first, a keyset page of [`PAGE`].
pub async fn list(session: Session, State(state): State<AppState>, Query(form): Query<SearchForm>) -> PageResult {
    let window = form.window.clone().unwrap_or_else(|| "24h".to_owned());
    let cursor = match non_empty(form.cursor.clone()) {
        Some(c) => Some(super::parse_id::<EventId>(&c, "cursor")?),
        None => None,
    };
    let search = actions::EventSearch {
        source: non_empty(form.source.clone()),
        event_type: non_empty(form.event_type.clone()),
        dedupe_key: non_empty(form.dedupe_key.clone()),
        payload: non_empty(form.payload.clone()),
        header: non_empty(form.header.clone()),
        since: super::window_start(Some(&window)),
        until: None,
        cursor,
        newest_first: true,
    };
    // A condition typed wrong (or refused: a payload condition for a token without
    // payloads) is said on the search page, with what was typed.
    let (found, problem) = match actions::search_events(&state, &session.principal(), search, PAGE).await {
        Ok(found) => (found, String::new()),
        Err(e) => (Vec::new(), super::shown(e)?),
    };
    let next =
        (found.len() as i64 == PAGE).then(|| found.last().map(|e| e.id.to_string())).flatten().and_then(|last| {
            let query = SearchForm { cursor: Some(last), window: Some(window.clone()), ..clone_filters(&form) };
            serde_urlencoded::to_string(&query).ok()
        });
    let sources = super::options(
        store::sources::list(&state.pool).await?.into_iter().map(|s| (s.name.clone(), s.name)),
        form.source.as_deref().unwrap_or(""),
    );
    let ids: Vec<EventId> = found.iter().map(|e| e.id).collect();
    let states: std::collections::HashMap<EventId, read::EventDeliveries> =
        read::by_event(&state.pool, &ids).await?.into_iter().map(|d| (d.event_id, d)).collect();
    let rows = found
        .into_iter()
        .map(|e| {
            let (state, badge) = delivery_state(states.get(&e.id));
            Row {
                id: e.id.to_string(),
                source: e.source,
                event_type: e.event_type,
                dedupe_key: e.dedupe_key,
                received_at: Ts(e.received_at),
                payload_bytes: e.payload_bytes,
                state,
                badge,
            }
        })
        .collect();
    render(&ListPage {
        layout: Layout::new(&session, "events"),
        event_type: or_empty(&form.event_type),
        dedupe_key: or_empty(&form.dedupe_key),
        payload: or_empty(&form.payload),
        header: or_empty(&form.header),
        windows: super::window_options(&window),
        sources,
        rows,
        next,
        problem,
    })
}

fn clone_filters(form: &SearchForm) -> SearchForm {
    SearchForm {
        source: non_empty(form.source.clone()),
        event_type: non_empty(form.event_type.clone()),
        dedupe_key: non_empty(form.dedupe_key.clone()),
        payload: non_empty(form.payload.clone()),
        header: non_empty(form.header.clone()),
        window: None,
        cursor: None,
    }
}

/// A delivery as a row.
pub struct DeliveryRow {
    /// Its id.
    pub id: String,
    /// Its event.
    pub event_id: String,
    /// Its endpoint.
    pub endpoint_id: String,
    /// Its endpoint's URL (the id until [`name_endpoints`] fills it in).
    pub endpoint: String,
    /// `pending`, `delivered`, `dead` (with `parked`, `waiting`, `in flight` qualifiers).
    pub status: String,
    /// The CSS class of the status badge.
    pub badge: &'static str,
    /// Attempts made.
    pub attempts: i32,
    /// Why it died.
    pub dead_reason: String,
    /// Created, finished.
    pub created_at: Ts,
    /// When it finished (or a dash).
    pub finished_at: String,
    /// Its ordering key (empty without one).
    pub ordering_key: String,
    /// Its event's type, source and dedupe key (empty until [`name_events`] fills them in).
    pub event_type: String,
    /// Its event's source.
    pub source: String,
    /// Its event's dedupe key.
    pub dedupe_key: String,
}

impl From<Delivery> for DeliveryRow {
    fn from(d: Delivery) -> Self {
        let (status, badge) = status_of(&d);
        DeliveryRow {
            id: d.id.to_string(),
            event_id: d.event_id.to_string(),
            endpoint_id: d.endpoint_id.to_string(),
            endpoint: d.endpoint_id.to_string(),
            status,
            badge,
            attempts: d.attempt_count,
            dead_reason: d.dead_reason.unwrap_or_default(),
            created_at: Ts(d.created_at),
            finished_at: ts(d.finished_at),
            ordering_key: d.ordering_key.unwrap_or_default(),
            event_type: String::new(),
            source: String::new(),
            dedupe_key: String::new(),
        }
    }
}

/// Show each row's event by its type, source and dedupe key (one query for the page).
pub async fn name_events(state: &AppState, rows: &mut [DeliveryRow]) -> Result<(), sqlx::Error> {
    let ids: Vec<EventId> = rows.iter().filter_map(|r| r.event_id.parse().ok()).collect();
    if ids.is_empty() {
        return Ok(());
    }
    let events: std::collections::HashMap<String, store::events::EventSummary> =
        store::events::summaries(&state.pool, &ids).await?.into_iter().map(|e| (e.id.to_string(), e)).collect();
    for row in rows {
        if let Some(e) = events.get(&row.event_id) {
            row.event_type.clone_from(&e.event_type);
            row.source.clone_from(&e.source);
            row.dedupe_key.clone_from(&e.dedupe_key);
        }
    }
    Ok(())
}

/// An event's deliveries in a word, and its badge class: dead if any is, retrying while any
/// is pending, delivered when all are.
fn delivery_state(d: Option<&read::EventDeliveries>) -> (&'static str, &'static str) {
    match d {
        None => ("no deliveries", "muted"),
        Some(d) if d.dead > 0 => ("dead", "bad"),
        Some(d) if d.delivered < d.total => ("retrying", "warn"),
        Some(_) => ("delivered", "ok"),
    }
}

/// Show each row's endpoint by its URL (endpoints are few: the store lists them whole, like
/// the API; a deleted endpoint keeps showing as its id).
pub async fn name_endpoints(state: &AppState, rows: &mut [DeliveryRow]) -> Result<(), sqlx::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let urls: std::collections::HashMap<String, String> =
        store::endpoints::list(&state.pool).await?.into_iter().map(|e| (e.id.to_string(), e.url)).collect();
    for row in rows {
        if let Some(url) = urls.get(&row.endpoint_id) {
            row.endpoint = url.clone();
        }
    }
    Ok(())
}

/// A delivery's state in words, and its badge class.
fn status_of(d: &Delivery) -> (String, &'static str) {
    use crate::queue::DeliveryStatus;
    match d.status {
        DeliveryStatus::Delivered => ("delivered".into(), "ok"),
        DeliveryStatus::Dead => ("dead".into(), "bad"),
        DeliveryStatus::Pending if d.leased_until.is_some_and(|t| t > crate::clock::now()) => {
            ("in flight".into(), "warn")
        }
        DeliveryStatus::Pending if d.waiting => ("waiting (ordered)".into(), "warn"),
        DeliveryStatus::Pending if d.parked => ("parked".into(), "warn"),
        DeliveryStatus::Pending => ("pending".into(), "warn"),
    }
}

#[derive(Template)]
#[template(path = "console/event.html")]
struct EventPage {
    layout: Layout,
    id: String,
    source: String,
    event_type: String,
    dedupe_key: String,
    received_at: Ts,
    content_type: String,
    /// Pretty-printed JSON, or the body as text (lossy UTF-8), or a note for binary.
    payload: String,
    payload_is_json: bool,
    /// The token may not read payloads: `payload` is empty.
    payload_withheld: bool,
    payload_bytes: usize,
    headers: Vec<(String, String)>,
    deliveries: Vec<DeliveryRow>,
    deliveries_capped: bool,
}

/// The body as operators read it: pretty JSON when it parses, else text.
fn readable_payload(bytes: &[u8]) -> (String, bool) {
    match serde_json::from_slice::<serde_json::Value>(bytes) {
        Ok(value) => (serde_json::to_string_pretty(&value).unwrap_or_default(), true),
        Err(_) => (String::from_utf8_lossy(bytes).into_owned(), false),
    }
}

/// `GET /console/events/{id}`.
pub async fn show(session: Session, State(state): State<AppState>, Path(id): Path<String>) -> PageResult {
    let id: EventId = super::parse_id(&id, "event")?;
    let actions::ShownEvent { event, payload_withheld, deliveries } =
        actions::event_with_deliveries(&state, &session.principal(), id).await?;
    let (payload, payload_is_json) = readable_payload(&event.payload);
    // Stored headers are already redacted (signatures) by ingest.
    let headers = match &event.headers.0 {
        serde_json::Value::Object(map) => {
            map.iter().map(|(k, v)| (k.clone(), v.as_str().map_or_else(|| v.to_string(), str::to_owned))).collect()
        }
        _ => Vec::new(),
    };
    let mut deliveries_rows: Vec<DeliveryRow> = deliveries.into_iter().map(Into::into).collect();
    name_endpoints(&state, &mut deliveries_rows).await?;
    render(&EventPage {
        layout: Layout::new(&session, "events"),
        id: event.id.to_string(),
        source: event.source_name,
        event_type: event.event_type,
        dedupe_key: event.dedupe_key,
        received_at: Ts(event.received_at),
        content_type: event.content_type.unwrap_or_else(|| "none".to_owned()),
        payload_bytes: event.payload.len(),
        payload,
        payload_is_json,
        payload_withheld,
        headers,
        deliveries_capped: deliveries_rows.len() as i64 == actions::EVENT_DELIVERIES,
        deliveries: deliveries_rows,
    })
}

/// One attempt of the timeline.
struct AttemptRow {
    number: i32,
    started_at: Ts,
    duration_ms: i32,
    result: String,
    badge: &'static str,
    outcome: &'static str,
    reason: String,
    excerpt: String,
    next: String,
    next_reason: &'static str,
}

#[derive(Template)]
#[template(path = "console/delivery.html")]
struct DeliveryPage {
    layout: Layout,
    d: DeliveryRow,
    webhook_id: String,
    endpoint_url: String,
    next_attempt_at: String,
    waiting: bool,
    parked: bool,
    can_redeliver: bool,
    /// It was delivered: redelivering sends it again, so the button asks first.
    delivered: bool,
    attempts: Vec<AttemptRow>,
    notice: Option<&'static str>,
}

/// Query of the delivery page: what was just done (a fixed message, never echoed text).
#[derive(Debug, Default, Deserialize)]
pub struct Done {
    #[serde(default)]
    done: Option<String>,
}

/// `GET /console/deliveries/{id}`: the attempt timeline.
pub async fn delivery(
    session: Session,
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(done): Query<Done>,
) -> PageResult {
    let id: DeliveryId = super::parse_id(&id, "delivery")?;
    let d = read::by_id(&state.pool, id).await?.ok_or_else(|| ConsoleError(ApiError::not_found("delivery")))?;
    let attempts = store::attempts::for_delivery(&state.pool, id).await?;
    let endpoint_url =
        store::endpoints::by_id(&state.pool, d.endpoint_id).await?.map_or_else(|| "(deleted)".to_owned(), |e| e.url);
    let pending = d.status == crate::queue::DeliveryStatus::Pending;
    let next_attempt_at = if pending && !d.parked && !d.waiting { ts(Some(d.next_attempt_at)) } else { "—".into() };
    let attempts = attempts
        .into_iter()
        .map(|a| {
            let (result, badge) = match (a.status_code, &a.error_kind) {
                (Some(code), _) => (format!("HTTP {code}"), if (200..300).contains(&code) { "ok" } else { "bad" }),
                (None, Some(kind)) => (kind.as_str().to_owned(), "bad"),
                (None, None) => ("—".to_owned(), "bad"),
            };
            AttemptRow {
                number: a.attempt_number,
                started_at: Ts(a.started_at),
                duration_ms: a.duration_ms,
                result,
                badge,
                outcome: a.outcome.as_str(),
                reason: a.reason,
                excerpt: a.response_excerpt.unwrap_or_default(),
                next: ts(a.next_attempt_at),
                next_reason: a.next_attempt_reason.map(|why| why.as_str()).unwrap_or_default(),
            }
        })
        .collect();
    let notice = match done.done.as_deref() {
        Some("redelivered") => Some("Redelivery queued: it goes out now, with a fresh attempt budget."),
        _ => None,
    };
    let webhook_id = d.id.webhook_id();
    let delivered = d.status == crate::queue::DeliveryStatus::Delivered;
    let (waiting, parked) = (d.waiting, d.parked);
    let mut row = [DeliveryRow::from(d)];
    name_events(&state, &mut row).await?;
    let [d] = row;
    render(&DeliveryPage {
        layout: Layout::new(&session, "events"),
        webhook_id,
        endpoint_url,
        next_attempt_at,
        waiting,
        parked,
        can_redeliver: !pending,
        delivered,
        attempts,
        notice,
        d,
    })
}

/// `POST /console/deliveries/{id}/redeliver`: the API's redelivery, then back to the
/// timeline.
pub async fn redeliver(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Posted(_, NoFields {}): Posted<NoFields>,
) -> Result<Response, ConsoleError> {
    let id: DeliveryId = super::parse_id(&id, "delivery")?;
    actions::redeliver_one(&state, id).await?;
    Ok(super::see_other(&format!("/console/deliveries/{id}?done=redelivered")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dead wins over pending (it needs a human), retrying while any is pending.
    #[test]
    fn an_event_s_deliveries_in_a_word() {
        let event_id: EventId = "00000000-0000-0000-0000-000000000000".parse().expect("an id");
        let of = |total, delivered, dead| {
            delivery_state(Some(&read::EventDeliveries { event_id, total, delivered, dead })).0
        };
        assert_eq!(delivery_state(None).0, "no deliveries");
        assert_eq!(of(3, 3, 0), "delivered");
        assert_eq!(of(3, 2, 0), "retrying");
        assert_eq!(of(3, 2, 1), "dead");
        assert_eq!(of(3, 0, 1), "dead");
    }

    #[test]
    fn payloads_are_pretty_json_or_text() {
        let (text, json) = super::readable_payload(br#"{"a":[1,2]}"#);
        assert!(json);
        assert!(text.contains("\n"), "{text}");
        let (text, json) = super::readable_payload(b"plain \xff body");
        assert!(!json);
        assert_eq!(text, "plain \u{fffd} body");
    }
}
