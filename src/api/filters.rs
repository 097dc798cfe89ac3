//! `POST /v1/filters/test`: try a subscription filter on an event before saving it.

use super::AppState;
use super::extract::ApiJson;
use super::openapi::{AdminErrors, JsonBodyErrors};
use crate::error::{ApiError, ErrorBody};
use crate::filters::{FilterTest, Tried};
use crate::tokens::Principal;
use axum::extract::State;
use axum::{Extension, Json};

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
        (status = 403, description = "A stored event, for a token that may not read payloads (`forbidden`)",
            body = ErrorBody),
        JsonBodyErrors,
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn test(
    State(state): State<AppState>,
    Extension(caller): Extension<Principal>,
    ApiJson(body): ApiJson<FilterTest>,
) -> Result<Json<Tried>, ApiError> {
    Ok(Json(crate::actions::try_filter(&state, &caller, body).await?))
}
