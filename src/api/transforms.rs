//! `POST /v1/transforms/test`: try a subscription transformation on an event before
//! saving it.

use axum::extract::State;
use axum::{Extension, Json};

use super::AppState;
use super::extract::ApiJson;
use super::openapi::{AdminErrors, JsonBodyErrors};
use crate::error::{ApiError, ErrorBody};
use crate::tokens::Principal;
use crate::transforms::{TransformTest, TriedTransform};

/// `POST /v1/transforms/test`.
///
/// Runs the transformation exactly as the worker does, on a stored event or a pasted one;
/// nothing is stored or sent. A script that fails on this event answers 200 with the
/// `error` its delivery would be dead with.
#[utoipa::path(
    post, path = "/v1/transforms/test", tag = "subscriptions", operation_id = "test_transform",
    summary = "Try a subscription transformation on an event",
    request_body = TransformTest,
    responses(
        (status = 200, description = "The body it would send, or why there is none", body = TriedTransform),
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
    ApiJson(body): ApiJson<TransformTest>,
) -> Result<Json<TriedTransform>, ApiError> {
    Ok(Json(crate::actions::try_transform(&state, &caller, body).await?))
}
