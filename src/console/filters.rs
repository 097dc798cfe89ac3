//! Filters: try a subscription filter on a stored or a pasted event before saving it
//! (a GET form: trying changes nothing), with the document it was evaluated on.

use askama::Template;
use axum::extract::{Query, State};
use serde::Deserialize;

use super::{Layout, PageResult, Session, non_empty, render, shown, tried_event};
use crate::actions;
use crate::api::AppState;
use crate::filters::FilterTest;

/// The form's fields.
#[derive(Debug, Default, Deserialize)]
pub struct TryForm {
    filter: Option<String>,
    event_id: Option<String>,
    payload: Option<String>,
}

#[derive(Template)]
#[template(path = "console/filters.html")]
struct Page {
    layout: Layout,
    filter: String,
    event_id: String,
    payload: String,
    outcome: Option<(bool, String)>,
    error: Option<String>,
}

/// `GET /console/filters?filter=&event_id=&payload=`.
pub async fn page(session: Session, State(state): State<AppState>, Query(form): Query<TryForm>) -> PageResult {
    let mut page = Page {
        layout: Layout::new(&session, "filters"),
        filter: form.filter.clone().unwrap_or_default(),
        event_id: form.event_id.clone().unwrap_or_default(),
        payload: form.payload.clone().unwrap_or_default(),
        outcome: None,
        error: None,
    };
    if let Some(filter) = non_empty(form.filter) {
        match tried(&state, &session.principal(), filter, form.event_id, form.payload).await {
            Ok(Ok((matches, document))) => page.outcome = Some((matches, document)),
            Ok(Err(message)) => page.error = Some(message),
            Err(e) => return Err(e.into()),
        }
    }
    render(&page)
}

/// The outcome of trying, or what is wrong with the form (shown on the page), or a
/// failure (the error page).
async fn tried(
    state: &AppState,
    caller: &crate::tokens::Principal,
    filter: String,
    event_id: Option<String>,
    payload: Option<String>,
) -> Result<Result<(bool, String), String>, crate::error::ApiError> {
    let (event_id, event) = match tried_event(event_id, payload) {
        Ok(event) => event,
        Err(message) => return Ok(Err(message)),
    };
    match actions::try_filter(state, caller, FilterTest { filter, event_id, event }).await {
        Ok(t) => Ok(Ok((t.matches, serde_json::to_string_pretty(&t.document).unwrap_or_default()))),
        Err(e) => shown(e).map(Err),
    }
}
