//! `/healthz` (the process is alive) and `/readyz` (the database is reachable and
//! migrated: safe to send traffic here).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde_json::{Value, json};

use crate::app::AppState;
use crate::db;

/// `GET /healthz`.
pub async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// `GET /readyz`.
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Value>) {
    match db::migrations_applied(&state.pool).await {
        Ok(true) => (StatusCode::OK, Json(json!({"status": "ready"}))),
        Ok(false) => {
            (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "not_ready", "reason": "migrations not applied"})))
        }
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "not_ready", "reason": format!("database unreachable: {e}")})),
        ),
    }
}

/// `GET /metrics`: Prometheus text format.
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
