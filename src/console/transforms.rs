//! Transformations: try a subscription transformation on a stored or a pasted event before
//! saving it (a GET form: trying changes nothing), with the body it would send or why
//! there is none.

use askama::Template;
use axum::extract::{Query, State};
use serde::Deserialize;

use super::{Layout, PageResult, Session, non_empty, render, shown, tried_event};
use crate::actions;
use crate::api::AppState;
use crate::transforms::TransformTest;

/// The form's fields.
#[derive(Debug, Default, Deserialize)]
pub struct TryForm {
    transform: Option<String>,
    event_id: Option<String>,
    payload: Option<String>,
}

#[derive(Template)]
#[template(path = "console/transforms.html")]
struct Page {
    layout: Layout,
    transform: String,
    event_id: String,
    payload: String,
    body: Option<String>,
    error: Option<String>,
}

/// `GET /console/transforms?transform=&event_id=&payload=`.
pub async fn page(session: Session, State(state): State<AppState>, Query(form): Query<TryForm>) -> PageResult {
    let mut page = Page {
        layout: Layout::new(&session, "transforms"),
        transform: form.transform.clone().unwrap_or_default(),
        event_id: form.event_id.clone().unwrap_or_default(),
        payload: form.payload.clone().unwrap_or_default(),
        body: None,
        error: None,
    };
    if let Some(transform) = non_empty(form.transform) {
        match tried(&state, &session.principal(), transform, form.event_id, form.payload).await {
            Ok(Ok(body)) => page.body = Some(body),
            Ok(Err(message)) => page.error = Some(message),
            Err(e) => return Err(e.into()),
        }
    }
    render(&page)
}

/// The body it would send (pretty JSON), or what is wrong (shown on the page), or a
/// failure (the error page).
async fn tried(
    state: &AppState,
    caller: &crate::tokens::Principal,
    transform: String,
    event_id: Option<String>,
    payload: Option<String>,
) -> Result<Result<String, String>, crate::error::ApiError> {
    let (event_id, event) = match tried_event(event_id, payload) {
        Ok(event) => event,
        Err(message) => return Ok(Err(message)),
    };
    match actions::try_transform(state, caller, TransformTest { transform, event_id, event }).await {
        Ok(tried) => Ok(match (tried.body, tried.error) {
            (Some(body), _) => Ok(serde_json::from_str::<serde_json::Value>(body.get())
                .and_then(|document| serde_json::to_string_pretty(&document))
                .unwrap_or_else(|_| body.get().to_owned())),
            (None, Some(error)) => Err(error),
            (None, None) => Err("no body".into()),
        }),
        Err(e) => shown(e).map(Err),
    }
}
