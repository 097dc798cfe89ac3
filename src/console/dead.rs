//! Dead letters: filter by endpoint and time, redeliver one (the delivery's own button),
//! recover a window after a confirmation page that says how many.

use askama::Template;
use axum::extract::{Path, Query, State};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::events::DeliveryRow;
use super::session::Posted;
use super::{ConsoleError, Layout, PAGE, PageResult, Session, Ts, non_empty, or_empty, render};
use crate::actions;
use crate::api::AppState;
use crate::error::ApiError;
use crate::ids::{DeliveryId, EndpointId};
use crate::queue::{DeliveryStatus, read};
use crate::store;

/// The filter form (and the query string of its pages).
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct DeadQuery {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    endpoint: Option<String>,
    /// One of [`WINDOWS`] (default: the last 24 hours), by when they died.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    window: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cursor: Option<String>,
    /// How many a redelivery from this list queued (shown once).
    #[serde(default, skip_serializing)]
    redelivered: Option<usize>,
    /// A recovery window typed in and refused: what was typed, and why, shown again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    since: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    until: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    problem: Option<String>,
}

#[derive(Template)]
#[template(path = "console/dead.html")]
struct ListPage {
    layout: Layout,
    windows: Vec<super::Opt>,
    endpoints: Vec<super::Opt>,
    /// The endpoint filtered on (the recovery form needs one).
    endpoint: String,
    rows: Vec<DeliveryRow>,
    next: Option<String>,
    recover_since: String,
    recover_until: String,
    /// What a redelivery from this list did, once.
    notice: Option<String>,
    /// This list's address, to come back to after a redelivery.
    back: String,
    /// Why the recovery window typed was refused (empty: it was not).
    problem: String,
}

/// A time as the recovery form shows it (UTC, to the second).
fn form_time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S").to_string()
}

/// `GET /console/dead`: newest first, a keyset page of [`PAGE`].
pub async fn list(session: Session, State(state): State<AppState>, Query(q): Query<DeadQuery>) -> PageResult {
    let window = q.window.clone().unwrap_or_else(|| "24h".to_owned());
    let endpoint_id = match non_empty(q.endpoint.clone()) {
        Some(e) => Some(super::parse_id::<EndpointId>(&e, "endpoint")?),
        None => None,
    };
    let cursor = match non_empty(q.cursor.clone()) {
        Some(c) => Some(super::parse_id::<DeliveryId>(&c, "cursor")?),
        None => None,
    };
    let since = super::window_start(Some(&window));
    let filter = read::Filter {
        endpoint_id,
        status: Some(DeliveryStatus::Dead),
        finished_since: since,
        after: cursor,
        newest_first: true,
        ..Default::default()
    };
    let dead = read::list(&state.pool, &filter, PAGE).await?;
    let next = (dead.len() as i64 == PAGE).then(|| dead.last().map(|d| d.id.to_string())).flatten().and_then(|last| {
        let query = DeadQuery {
            endpoint: non_empty(q.endpoint.clone()),
            window: Some(window.clone()),
            cursor: Some(last),
            ..DeadQuery::default()
        };
        serde_urlencoded::to_string(&query).ok()
    });
    let mut rows: Vec<DeliveryRow> = dead.into_iter().map(Into::into).collect();
    super::events::name_endpoints(&state, &mut rows).await?;
    super::events::name_events(&state, &mut rows).await?;
    let endpoints = super::options(
        store::endpoints::list(&state.pool).await?.into_iter().map(|e| (e.id.to_string(), e.url)),
        q.endpoint.as_deref().unwrap_or(""),
    );
    let now = crate::clock::now();
    render(&ListPage {
        layout: Layout::new(&session, "dead"),
        endpoint: or_empty(&q.endpoint),
        windows: super::window_options(&window),
        endpoints,
        rows,
        next,
        recover_since: q.since.clone().unwrap_or_else(|| form_time(since.unwrap_or(now - chrono::Duration::hours(1)))),
        recover_until: q.until.clone().unwrap_or_else(|| form_time(now + chrono::Duration::minutes(1))),
        problem: q.problem.clone().unwrap_or_default(),
        back: q.clone_filters().href(),
        notice: q.redelivered.map(|n| match n {
            1 => "1 dead letter queued again: it goes out now, with a fresh attempt budget.".to_owned(),
            n => format!("{n} dead letters queued again: they go out now, each with a fresh attempt budget."),
        }),
    })
}

impl DeadQuery {
    /// This list's address.
    fn href(&self) -> String {
        format!("/console/dead?{}", serde_urlencoded::to_string(self).unwrap_or_default())
    }

    /// The same list (filters and page), without what was done.
    fn clone_filters(&self) -> DeadQuery {
        DeadQuery {
            endpoint: self.endpoint.clone(),
            window: self.window.clone(),
            cursor: self.cursor.clone(),
            ..DeadQuery::default()
        }
    }
}

/// Most dead letters one post redelivers: a page of the list.
const MAX_SET: usize = PAGE as usize;

/// `POST /console/dead/redeliver`: redeliver the dead letter of the row's button (`one`),
/// or every one ticked (`id`, repeated), as the API's redelivery does each; then back to
/// the list, which says how many went. A delivery that is no longer dead (redelivered
/// meanwhile, in another tab) is skipped, not redelivered twice.
pub async fn redeliver(
    State(state): State<AppState>,
    Posted(_, fields): Posted<Vec<(String, String)>>,
) -> Result<axum::response::Response, ConsoleError> {
    let one = fields.iter().find(|(name, _)| name == "one").map(|(_, v)| v.as_str());
    let chosen: Vec<&str> = match one {
        Some(id) => vec![id],
        None => fields.iter().filter(|(name, _)| name == "id").map(|(_, v)| v.as_str()).collect(),
    };
    if chosen.is_empty() {
        return Err(ConsoleError(ApiError::validation("id", "tick the dead letters to redeliver")));
    }
    if chosen.len() > MAX_SET {
        return Err(ConsoleError(ApiError::validation("id", format!("at most {MAX_SET} at a time"))));
    }
    let mut queued = 0;
    for id in chosen {
        let id: DeliveryId = super::parse_id(id, "delivery")?;
        let Some(d) = read::by_id(&state.pool, id).await? else { continue };
        if d.status == DeliveryStatus::Dead {
            actions::redeliver_one(&state, id).await?;
            queued += 1;
        }
    }
    let back = fields
        .iter()
        .find(|(name, _)| name == "back")
        .and_then(|(_, v)| super::console_path(v))
        .filter(|path| *path == "/console/dead" || path.starts_with("/console/dead?"))
        .unwrap_or("/console/dead");
    let joiner = if back.contains('?') { '&' } else { '?' };
    Ok(super::see_other(&format!("{back}{joiner}redelivered={queued}")))
}

/// The recovery window, as typed (UTC or RFC 3339).
#[derive(Debug, Deserialize)]
pub struct WindowForm {
    since: Option<String>,
    until: Option<String>,
}

impl WindowForm {
    /// The window as the API's recovery body; checked like the API checks it.
    fn recover(&self) -> Result<actions::Recover, ConsoleError> {
        let since = super::parse_time("since", self.since.as_deref())?
            .ok_or_else(|| ConsoleError(ApiError::validation("since", "is required")))?;
        let until = super::parse_time("until", self.until.as_deref())?;
        let body = actions::Recover { since, until };
        actions::recovery_window(&body)?;
        Ok(body)
    }
}

#[derive(Template)]
#[template(path = "console/recover.html")]
struct ConfirmPage {
    layout: Layout,
    id: String,
    url: String,
    since: Ts,
    until: Ts,
    since_value: String,
    until_value: String,
    count: i64,
}

/// `GET /console/endpoints/{id}/recover?since=&until=`: how many would be re-queued, and
/// the button that does it.
pub async fn confirm_recover(
    session: Session,
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(form): Query<WindowForm>,
) -> PageResult {
    let id: EndpointId = super::parse_id(&id, "endpoint")?;
    let e =
        store::endpoints::by_id(&state.pool, id).await?.ok_or_else(|| ConsoleError(ApiError::not_found("endpoint")))?;
    let body = match form.recover() {
        Ok(body) => body,
        // A window typed wrong: back to the form, with what was typed and why.
        Err(ConsoleError(e)) if e.status() == axum::http::StatusCode::UNPROCESSABLE_ENTITY => {
            let back = DeadQuery {
                endpoint: Some(id.to_string()),
                window: Some("all".to_owned()),
                since: form.since.clone(),
                until: form.until.clone(),
                problem: Some(e.message),
                ..DeadQuery::default()
            };
            return Ok(super::see_other(&back.href()));
        }
        Err(e) => return Err(e),
    };
    let (since, until) = actions::recovery_window(&body)?;
    let count = read::dead_in_window(&state.pool, id, since, until).await?;
    render(&ConfirmPage {
        layout: Layout::new(&session, "dead"),
        id: id.to_string(),
        url: e.url,
        since: Ts(since),
        until: Ts(until),
        // The exact instants, so the count shown is the window recovered.
        since_value: since.to_rfc3339(),
        until_value: until.to_rfc3339(),
        count,
    })
}

#[derive(Template)]
#[template(path = "console/recovered.html")]
struct DonePage {
    layout: Layout,
    id: String,
    requeued: u64,
}

/// `POST /console/endpoints/{id}/recover`: the API's recovery.
pub async fn recover(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Posted(session, form): Posted<WindowForm>,
) -> PageResult {
    let id: EndpointId = super::parse_id(&id, "endpoint")?;
    let recovered = actions::recover_window(&state, id, form.recover()?).await?;
    render(&DonePage { layout: Layout::new(&session, "dead"), id: id.to_string(), requeued: recovered.requeued })
}
