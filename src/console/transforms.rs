//! Transformations: try a subscription transformation on a stored or a pasted event before
//! saving it (a GET form: trying changes nothing), with the body it would send or why
//! there is none.

use askama::Template;
use axum::extract::{Query, State};
use serde::Deserialize;

use super::{Layout, PageResult, Session, non_empty, render};
use crate::actions;
use crate::api::AppState;
use crate::error::ErrorCode;
use crate::filters::PastedEvent;
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
        match tried(&state, transform, non_empty(form.event_id), non_empty(form.payload)).await {
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
    transform: String,
    event_id: Option<String>,
    payload: Option<String>,
) -> Result<Result<String, String>, crate::error::ApiError> {
    let body = match (event_id, payload) {
        (Some(id), _) => match id.parse() {
            Ok(id) => TransformTest { transform, event_id: Some(id), event: None },
            Err(_) => return Ok(Err(format!("{id:?} is not an event id"))),
        },
        (None, Some(payload)) => match serde_json::from_str(&payload) {
            Ok(payload) => TransformTest {
                transform,
                event_id: None,
                event: Some(PastedEvent {
                    payload,
                    headers: serde_json::Map::new(),
                    event_type: String::new(),
                    source: None,
                }),
            },
            Err(e) => return Ok(Err(format!("the pasted payload is not JSON: {e}"))),
        },
        (None, None) => return Ok(Err("give a stored event's id, or paste a payload".into())),
    };
    match actions::try_transform(state, body).await {
        Ok(tried) => Ok(match (tried.body, tried.error) {
            (Some(body), _) => Ok(serde_json::to_string_pretty(&body).unwrap_or_default()),
            (None, Some(error)) => Err(error),
            (None, None) => Err("no body".into()),
        }),
        Err(e) if matches!(e.code, ErrorCode::ValidationFailed | ErrorCode::NotFound) => Ok(Err(e.message)),
        Err(e) => Err(e),
    }
}
