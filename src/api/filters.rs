//! `POST /v1/filters/test`: try a subscription filter on an event before saving it.

use super::AppState;
use super::extract::ApiJson;
use super::openapi::{AdminErrors, JsonBodyErrors};
use crate::error::{ApiError, ErrorBody};
use crate::filters::{FilterTest, Tried};
use axum::Json;
use axum::extract::State;

/// `POST /v1/filters/test`.
///
/// Evaluates the filter exactly as the fan-out does, on a stored event or a pasted one;
/// nothing is stored or sent.
#[utoipa::path(
    post, path = "/v1/filters/test", tag = "subscriptions", operation_id = "test_filter",
    summary = "Try a subscription filter on an event",
    request_body = FilterTest,
    responses(
        (status = 200, description = "Whether it matches, and the document it was evaluated on", body = Tried),
        (status = 404, description = "No such stored event (`not_found`)", body = ErrorBody),
        JsonBodyErrors,
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn test(State(state): State<AppState>, ApiJson(body): ApiJson<FilterTest>) -> Result<Json<Tried>, ApiError> {
    Ok(Json(crate::actions::try_filter(&state, body).await?))
}
