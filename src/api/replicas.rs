//! `GET /v1/admin/replicas`: the fleet's roster, so an operator sees which replicas are
//! running, in which role and on which release (a rolling deploy's progress), and which
//! went away without stopping, without Prometheus or SQL.

use axum::Json;
use axum::extract::State;

use super::AppState;
use super::openapi::AdminErrors;
use crate::error::ApiError;
use crate::roster::{self, Roster};

/// `GET /v1/admin/replicas`.
#[utoipa::path(
    get, path = "/v1/admin/replicas", tag = "fleet", operation_id = "replicas_list",
    summary = "The fleet's replicas: running, draining, stopped or lost, their roles, releases and schema versions",
    responses(
        (status = 200, description = "Every replica that wrote its row within the last day, running first; \
            `behind_schema` marks a release older than the database's schema (a rolling deploy under way)",
            body = Roster),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn list(State(state): State<AppState>) -> Result<Json<Roster>, ApiError> {
    Ok(Json(roster::list(&state.pool).await?))
}
