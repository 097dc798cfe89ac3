//! `/healthz` (the process is alive) and `/readyz` (the database is reachable, migrated
//! and takes writes: safe to send traffic here).

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderName, StatusCode, header};
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use crate::db;
use crate::error::{ApiError, ErrorBody};

/// The answer of `GET /healthz`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// Always `ok`: a process that answers is alive.
    #[schema(example = "ok")]
    status: &'static str,
}

/// The answer of `GET /readyz`, for 200 and 503 alike (not the error body).
#[derive(Debug, Serialize, ToSchema)]
pub struct Readiness {
    /// Why the process is not ready (503 only): `draining` (it is stopping), `migrations not applied`, `database unreachable`,
    /// `database read-only` (a standby, a demoted primary), `database refusing writes` (a
    /// write was refused in the last few seconds: disk full, too many connections, shutting down)
    /// or `database commits waiting for a synchronous standby` (one that is gone).
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'static str>,
    /// `ready` or `not_ready`.
    #[schema(example = "ready")]
    status: &'static str,
}

/// `GET /healthz`.
#[utoipa::path(
    get, path = "/healthz", tag = "operations", operation_id = "healthz",
    summary = "Liveness",
    responses((status = 200, description = "The process is alive", body = Health)),
)]
pub async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

/// `GET /readyz`.
#[utoipa::path(
    get, path = "/readyz", tag = "operations", operation_id = "readyz",
    summary = "Readiness",
    responses(
        (status = 200, description = "The database is reachable, migrated and takes writes", body = Readiness),
        (status = 503, description = "Not ready (`reason` says why)", body = Readiness,
            headers(("Retry-After" = u32, description = "Seconds to wait"))),
    ),
)]
pub async fn readyz(
    State(state): State<AppState>,
) -> (StatusCode, Option<[(HeaderName, &'static str); 1]>, Json<Readiness>) {
    let not_ready = |reason: &'static str| {
        let retry = Some([(header::RETRY_AFTER, "5")]);
        (StatusCode::SERVICE_UNAVAILABLE, retry, Json(Readiness { reason: Some(reason), status: "not_ready" }))
    };
    if state.draining.load(std::sync::atomic::Ordering::Relaxed) {
        return not_ready("draining");
    }
    match db::readiness(&state.pool).await {
        Ok(Ok(())) => (StatusCode::OK, None, Json(Readiness { reason: None, status: "ready" })),
        Ok(Err(why)) => not_ready(why.reason()),
        Err(e) => {
            // The details (host, port, error) go to the log, not to a public endpoint;
            // throttled: every balancer and supervisor probes, and an outage would
            // otherwise be a line per probe, burying the lines that matter.
            static THROTTLE: crate::log_throttle::Throttle =
                crate::log_throttle::Throttle::new(crate::log_throttle::INTERVAL);
            if let Some(left_out) = THROTTLE.admit() {
                tracing::warn!(error = %e, left_out, "readiness check: database unreachable");
            }
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
            body = ErrorBody),
    ),
)]
pub async fn metrics(State(state): State<AppState>) -> Result<([(HeaderName, &'static str); 1], String), ApiError> {
    let handle = state.metrics.as_ref().ok_or_else(|| ApiError::not_found("metrics (not enabled in this process)"))?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], handle.render()))
}
