//! Endpoints: state at a glance (circuit, lag, success rate), one endpoint's recent
//! deliveries, and the operator's buttons: pause, resume, rotate the secret, send a test.

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::response::Response;
use serde::Deserialize;

use super::events::DeliveryRow;
use super::overview::human_secs;
use super::session::{NoFields, Posted};
use super::{ConsoleError, Layout, PAGE, PageResult, Session, Ts, non_empty, render, ts};
use crate::actions;
use crate::api::AppState;
use crate::circuit::CircuitDisplay;
use crate::error::ApiError;
use crate::ids::{DeliveryId, EndpointId};
use crate::queue::read;
use crate::store::{self, endpoints::Endpoint};

/// An endpoint as a row of the list, or the head of its page.
struct EndpointRow {
    id: String,
    url: String,
    description: String,
    paused: bool,
    circuit: &'static str,
    badge: &'static str,
    consecutive_failures: i32,
    open_count: i32,
    opened_at: String,
    reopen_at: String,
    in_flight: i64,
    max_in_flight: i32,
    rate_limit: String,
    lag: String,
    success: String,
    recent: i64,
}

async fn row(state: &AppState, e: Endpoint, in_flight: i64) -> Result<EndpointRow, sqlx::Error> {
    let health = read::endpoint_health(&state.pool, e.id).await?;
    let finished = health.delivered + health.dead;
    let (circuit, badge) = match e.circuit.display_state(crate::clock::now()) {
        CircuitDisplay::Closed => ("closed", "ok"),
        CircuitDisplay::Open => ("open", "bad"),
        CircuitDisplay::HalfOpen => ("half-open", "warn"),
    };
    let open = e.circuit.circuit_state == crate::circuit::CircuitState::Open;
    Ok(EndpointRow {
        id: e.id.to_string(),
        url: e.url,
        description: e.description.unwrap_or_default(),
        paused: e.paused,
        circuit,
        badge,
        consecutive_failures: e.circuit.consecutive_failures,
        open_count: e.circuit.open_count,
        opened_at: if open { ts(e.circuit.opened_at) } else { "—".into() },
        reopen_at: if open { ts(e.circuit.reopen_at) } else { "—".into() },
        in_flight,
        max_in_flight: e.limits.max_in_flight.unwrap_or(state.default_max_in_flight),
        rate_limit: e.limits.rate_limit_per_sec.map_or_else(|| "none".to_owned(), |r| format!("{r}/s")),
        lag: health.lag_secs.map_or_else(|| "none".to_owned(), human_secs),
        success: if finished == 0 {
            "—".to_owned()
        } else {
            format!("{:.0} %", 100.0 * health.delivered as f64 / finished as f64)
        },
        recent: finished + health.pending,
    })
}

#[derive(Template)]
#[template(path = "console/endpoints.html")]
struct ListPage {
    layout: Layout,
    rows: Vec<EndpointRow>,
    next: Option<String>,
    window: i64,
}

/// Query of the endpoints list: a keyset cursor.
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    #[serde(default)]
    after: Option<String>,
}

/// `GET /console/endpoints`: [`PAGE`] endpoints at a time, oldest first. (The store lists
/// endpoints whole, like the API: there are few; the page's per-endpoint reads are bounded.)
pub async fn list(session: Session, State(state): State<AppState>, Query(q): Query<ListQuery>) -> PageResult {
    let after = match non_empty(q.after) {
        Some(a) => Some(super::parse_id::<EndpointId>(&a, "cursor")?),
        None => None,
    };
    let loads: std::collections::HashMap<EndpointId, i64> =
        read::endpoint_loads(&state.pool, state.default_max_in_flight)
            .await?
            .into_iter()
            .map(|l| (l.endpoint_id, l.in_flight))
            .collect();
    let endpoints: Vec<Endpoint> = store::endpoints::list(&state.pool)
        .await?
        .into_iter()
        .filter(|e| after.is_none_or(|a| e.id.to_string() > a.to_string()))
        .take(PAGE as usize + 1)
        .collect();
    let more = endpoints.len() > PAGE as usize;
    let mut rows = Vec::new();
    for e in endpoints.into_iter().take(PAGE as usize) {
        let in_flight = loads.get(&e.id).copied().unwrap_or(0);
        rows.push(row(&state, e, in_flight).await?);
    }
    let next = if more { rows.last().map(|r| r.id.clone()) } else { None };
    render(&ListPage { layout: Layout::new(&session, "endpoints"), rows, next, window: read::HEALTH_WINDOW })
}

#[derive(Template)]
#[template(path = "console/endpoint.html")]
struct ShowPage {
    layout: Layout,
    e: EndpointRow,
    deliveries: Vec<DeliveryRow>,
    next: Option<String>,
    notice: Option<&'static str>,
    window: i64,
    /// The circuit's latest changes, newest first.
    history: Vec<TransitionRow>,
}

/// One change of the circuit, in words.
struct TransitionRow {
    at: super::Ts,
    what: &'static str,
    badge: &'static str,
    why: String,
    next_probe: String,
}

/// Changes of the circuit the endpoint page shows.
const HISTORY: i64 = 20;

impl From<crate::circuit::sql::Transition> for TransitionRow {
    fn from(t: crate::circuit::sql::Transition) -> Self {
        use crate::circuit::Transitioned;
        let (what, badge, why) = match t.change {
            Transitioned::Opened => ("opened", "bad", format!("{} failures in a row", t.failures)),
            Transitioned::Reopened => {
                ("opened again", "bad", format!("the half-open probe failed (open #{})", t.open_count))
            }
            Transitioned::Closed => {
                ("closed", "ok", format!("the half-open probe succeeded, after {} opening(s)", t.open_count))
            }
        };
        TransitionRow { at: super::Ts(t.at), what, badge, why, next_probe: super::ts(t.reopen_at) }
    }
}

/// Query of an endpoint's page: its deliveries' cursor, and what was just done.
#[derive(Debug, Default, Deserialize)]
pub struct ShowQuery {
    #[serde(default)]
    cursor: Option<String>,
    #[serde(default)]
    done: Option<String>,
}

async fn endpoint(state: &AppState, id: &str) -> Result<Endpoint, ConsoleError> {
    let id: EndpointId = super::parse_id(id, "endpoint")?;
    store::endpoints::by_id(&state.pool, id).await?.ok_or_else(|| ConsoleError(ApiError::not_found("endpoint")))
}

/// `GET /console/endpoints/{id}`.
pub async fn show(
    session: Session,
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<ShowQuery>,
) -> PageResult {
    let e = endpoint(&state, &id).await?;
    let id_of_page = e.id;
    let cursor = match non_empty(q.cursor) {
        Some(c) => Some(super::parse_id::<DeliveryId>(&c, "cursor")?),
        None => None,
    };
    let filter = read::Filter { endpoint_id: Some(e.id), after: cursor, newest_first: true, ..Default::default() };
    let deliveries = read::list(&state.pool, &filter, PAGE).await?;
    let next = (deliveries.len() as i64 == PAGE).then(|| deliveries.last().map(|d| d.id.to_string())).flatten();
    let in_flight = read::in_flight_of(&state.pool, e.id).await?;
    let notice = match q.done.as_deref() {
        Some("paused") => {
            Some("Paused: nothing is sent until it is resumed; due deliveries wait without spending attempts.")
        }
        Some("resumed") => Some("Resumed: the parked backlog is being released at the configured rate."),
        _ => None,
    };
    render(&ShowPage {
        layout: Layout::new(&session, "endpoints"),
        e: row(&state, e, in_flight).await?,
        deliveries: deliveries.into_iter().map(Into::into).collect(),
        next,
        notice,
        window: read::HEALTH_WINDOW,
        history: crate::circuit::sql::history(&state.pool, id_of_page, HISTORY)
            .await?
            .into_iter()
            .map(Into::into)
            .collect(),
    })
}

/// `POST /console/endpoints/{id}/pause`.
pub async fn pause(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Posted(_, NoFields {}): Posted<NoFields>,
) -> Result<Response, ConsoleError> {
    let id: EndpointId = super::parse_id(&id, "endpoint")?;
    actions::set_paused(&state, id, true).await?;
    Ok(super::see_other(&format!("/console/endpoints/{id}?done=paused")))
}

/// `POST /console/endpoints/{id}/resume`.
pub async fn resume(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Posted(_, NoFields {}): Posted<NoFields>,
) -> Result<Response, ConsoleError> {
    let id: EndpointId = super::parse_id(&id, "endpoint")?;
    actions::set_paused(&state, id, false).await?;
    Ok(super::see_other(&format!("/console/endpoints/{id}?done=resumed")))
}

#[derive(Template)]
#[template(path = "console/rotated.html")]
struct RotatedPage {
    layout: Layout,
    id: String,
    url: String,
    secret: String,
    previous_valid_until: Ts,
}

/// `POST /console/endpoints/{id}/rotate-secret`: a generated secret, the default grace;
/// the answer is the one page that shows the new secret (and `no-store` keeps it out of
/// caches).
pub async fn rotate(
    session: Session,
    State(state): State<AppState>,
    Path(id): Path<String>,
    Posted(_, NoFields {}): Posted<NoFields>,
) -> PageResult {
    let e = endpoint(&state, &id).await?;
    let rotated = actions::rotate(&state, e.id, actions::RotateSecret::default()).await?;
    render(&RotatedPage {
        layout: Layout::new(&session, "endpoints"),
        id: e.id.to_string(),
        url: e.url,
        secret: rotated.secret,
        previous_valid_until: Ts(rotated.previous_secret_valid_until),
    })
}

/// `POST /console/endpoints/{id}/test`: queue a `webhook.test` and show its delivery.
pub async fn test_send(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Posted(_, NoFields {}): Posted<NoFields>,
) -> Result<Response, ConsoleError> {
    let id: EndpointId = super::parse_id(&id, "endpoint")?;
    let sent = actions::send_test(&state, id).await?;
    Ok(super::see_other(&format!("/console/deliveries/{}", sent.delivery_id)))
}
