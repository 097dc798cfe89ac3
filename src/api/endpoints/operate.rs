//! What an operator does to an endpoint: pause and resume it, rotate its secret, send it a
//! test, recover its dead letters. The handlers; the actions they call, which the console
//! calls too, are in `crate::actions`.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;

use super::{EndpointView, view};
use crate::actions::{self, Recover, Recovered, RotateSecret, RotatedSecret, TestSend};
use crate::api::AppState;
use crate::api::extract::{ApiJson, Id};
use crate::api::openapi::{AdminErrors, JsonBodyErrors};
use crate::error::{ApiError, ErrorBody};
use crate::ids::EndpointId;

/// `POST /v1/endpoints/{id}/pause`.
///
/// Nothing is sent until resumed; due deliveries are parked without spending attempts (like
/// an open circuit that only an operator closes).
#[utoipa::path(
    post, path = "/v1/endpoints/{id}/pause", tag = "endpoints", operation_id = "pause_endpoint",
    summary = "Pause an endpoint",
    params(("id" = EndpointId, Path, description = "Endpoint id (anything else is 404)")),
    responses(
        (status = 200, description = "Paused (idempotent)", body = EndpointView),
        (status = 404, description = "No such endpoint (`not_found`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn pause(State(state): State<AppState>, Id(id): Id<EndpointId>) -> Result<Json<EndpointView>, ApiError> {
    let endpoint = actions::set_paused(&state, id, true).await?;
    Ok(Json(view(&state, endpoint, None).await?))
}

/// `POST /v1/endpoints/{id}/resume`.
///
/// Deliveries flow again; the parked backlog is released at the configured rate.
#[utoipa::path(
    post, path = "/v1/endpoints/{id}/resume", tag = "endpoints", operation_id = "resume_endpoint",
    summary = "Resume an endpoint",
    params(("id" = EndpointId, Path, description = "Endpoint id (anything else is 404)")),
    responses(
        (status = 200, description = "Resumed (idempotent)", body = EndpointView),
        (status = 404, description = "No such endpoint (`not_found`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn resume(State(state): State<AppState>, Id(id): Id<EndpointId>) -> Result<Json<EndpointView>, ApiError> {
    let endpoint = actions::set_paused(&state, id, false).await?;
    Ok(Json(view(&state, endpoint, None).await?))
}

/// `POST /v1/endpoints/{id}/rotate-secret`.
///
/// Returns the new secret. Until the grace period ends every request carries a `v1,`
/// signature per secret still in its grace period (earlier rotations' included), so a
/// subscriber can switch at its own pace.
#[utoipa::path(
    post, path = "/v1/endpoints/{id}/rotate-secret", tag = "endpoints", operation_id = "rotate_endpoint_secret",
    summary = "Rotate an endpoint's signing secret",
    params(("id" = EndpointId, Path, description = "Endpoint id (anything else is 404)")),
    request_body(content = RotateSecret, content_type = "application/json",
        description = "Optional: an empty body takes the defaults. The Content-Type is not checked."),
    responses(
        (status = 200, description = "Rotated", body = RotatedSecret),
        (status = 400, description = "Malformed JSON (`malformed_json`)", body = ErrorBody),
        (status = 404, description = "No such endpoint (`not_found`)", body = ErrorBody),
        (status = 413, description = "Body over the size limit (plain text, not the JSON error body)"),
        (status = 422, description = "Invalid field, named in the message (`validation_failed`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn rotate_secret(
    State(state): State<AppState>,
    Id(id): Id<EndpointId>,
    body: axum::body::Bytes,
) -> Result<Json<RotatedSecret>, ApiError> {
    let body: RotateSecret = super::super::extract::json_or_default(&body)?;
    Ok(Json(actions::rotate(&state, id, body).await?))
}

/// `POST /v1/endpoints/{id}/test`.
///
/// A synthetic `webhook.test` event delivered to this endpoint only, like any other
/// delivery (signed, retried, recorded).
#[utoipa::path(
    post, path = "/v1/endpoints/{id}/test", tag = "endpoints", operation_id = "test_endpoint",
    summary = "Send a test event to an endpoint",
    params(("id" = EndpointId, Path, description = "Endpoint id (anything else is 404)")),
    responses(
        (status = 202, description = "Queued for delivery", body = TestSend),
        (status = 404, description = "No such endpoint (`not_found`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn test_send(
    State(state): State<AppState>,
    Id(id): Id<EndpointId>,
) -> Result<(StatusCode, Json<TestSend>), ApiError> {
    Ok((StatusCode::ACCEPTED, Json(actions::send_test(&state, id).await?)))
}

/// `POST /v1/endpoints/{id}/recover`.
///
/// After an outage, re-queue the endpoint's dead deliveries that died in the window (fresh
/// budget, same `webhook-id`), released at the configured rate. Safe to call twice: only
/// dead deliveries qualify.
#[utoipa::path(
    post, path = "/v1/endpoints/{id}/recover", tag = "endpoints", operation_id = "recover_endpoint",
    summary = "Re-queue an endpoint's dead deliveries",
    params(("id" = EndpointId, Path, description = "Endpoint id (anything else is 404)")),
    request_body = Recover,
    responses(
        (status = 200, description = "Re-queued (0 when called again)", body = Recovered),
        (status = 404, description = "No such endpoint (`not_found`)", body = ErrorBody),
        JsonBodyErrors,
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn recover(
    State(state): State<AppState>,
    Id(id): Id<EndpointId>,
    ApiJson(body): ApiJson<Recover>,
) -> Result<Json<Recovered>, ApiError> {
    Ok(Json(actions::recover_window(&state, id, body).await?))
}
