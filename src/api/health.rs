//! `/healthz` (the process is alive) and `/readyz` (the database is reachable and
//! migrated: safe to send traffic here).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde_json::{Value, json};

use super::AppState;
use crate::db;

// Documentation only: `healthz` builds this body with `json!` (unchanged bytes: sorted keys);
// tests/it/openapi.rs checks real answers against the schema.
/// The process is alive.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct Health {
    /// Always `ok`.
    #[schema(example = "ok")]
    status: String,
}

// Documentation only: `readyz` builds this body with `json!` (unchanged bytes: sorted keys);
// tests/it/openapi.rs checks real answers against the schema.
/// Readiness: the answer for 200 and 503 alike (not the error body).
#[derive(serde::Serialize, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct Readiness {
    /// Why not ready (503 only).
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    /// `ready` or `not_ready`.
    #[schema(example = "ready")]
    status: String,
}

/// `GET /healthz`.
#[utoipa::path(
    get, path = "/healthz", tag = "operations", operation_id = "healthz",
    summary = "Liveness",
    responses((status = 200, description = "The process is alive", body = Health)),
)]
pub async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// `GET /readyz`.
#[utoipa::path(
    get, path = "/readyz", tag = "operations", operation_id = "readyz",
    summary = "Readiness",
    responses(
        (status = 200, description = "The database is reachable and migrated", body = Readiness),
        (status = 503, description = "Not ready (`reason` says why); no `Retry-After`", body = Readiness),
    ),
)]
pub async fn readyz(State(state): State<AppState>) -> axum::response::Response {
    use axum::response::IntoResponse;
    let not_ready = |reason: &str| {
        let retry = [(axum::http::header::RETRY_AFTER, "5")];
        (StatusCode::SERVICE_UNAVAILABLE, retry, Json(json!({"status": "not_ready", "reason": reason}))).into_response()
    };
    match db::migrations_applied(&state.pool).await {
        Ok(true) => (StatusCode::OK, Json(json!({"status": "ready"}))).into_response(),
        Ok(false) => not_ready("migrations not applied"),
        Err(e) => {
            // The details (host, port, error) go to the log, not to a public endpoint.
            tracing::warn!(error = %e, "readiness check: database unreachable");
            not_ready("database unreachable")
        }
    }
}

/// `GET /metrics`.
///
/// Prometheus text format.
#[utoipa::path(
    get, path = "/metrics", tag = "operations", operation_id = "metrics",
    summary = "Prometheus metrics",
    responses(
        (status = 200, description = "Prometheus text exposition format", body = String,
            content_type = "text/plain; version=0.0.4; charset=utf-8"),
        (status = 404, description = "Metrics are not enabled in this process (`not_found`)",
            body = crate::error::ErrorBody),
    ),
)]
pub async fn metrics(State(state): State<AppState>) -> axum::response::Response {
    use axum::response::IntoResponse;
    match &state.metrics {
        Some(handle) => {
            ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], handle.render())
                .into_response()
        }
        None => crate::error::ApiError::not_found("metrics (not enabled in this process)").into_response(),
    }
}
