//! `GET /v1/admin/storage`: table and index sizes, dead tuples, and the janitor's latest
//! pass, so an operator can see that storage stays bounded without SQL.

use axum::Json;
use axum::extract::State;

use super::AppState;
use super::openapi::AdminErrors;
use crate::error::ApiError;
use crate::janitor::{self, StorageReport};

/// `GET /v1/admin/storage`.
#[utoipa::path(
    get, path = "/v1/admin/storage", tag = "storage", operation_id = "storage_report",
    summary = "Table and index sizes, dead tuples, the last retention pass",
    responses(
        (status = 200, description = "Every table of the gateway's schema (largest first) and the janitor's \
            latest pass (null before the first)", body = StorageReport),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn get(State(state): State<AppState>) -> Result<Json<StorageReport>, ApiError> {
    Ok(Json(janitor::storage_report(&state.pool).await?))
}
