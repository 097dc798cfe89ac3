//! `GET /v1/admin/storage`: table and index sizes, dead tuples, and the janitor's latest
//! pass, so an operator can see that storage stays bounded without SQL.

use axum::Json;
use axum::extract::State;

use crate::app::AppState;
use crate::error::{ApiError, ErrorBody};
use crate::janitor::{self, StorageReport};

/// `GET /v1/admin/storage`.
#[utoipa::path(
    get, path = "/v1/admin/storage", tag = "storage", operation_id = "storage_report",
    summary = "Table and index sizes, dead tuples, the last retention pass",
    responses(
        (status = 200, description = "Every table of the gateway's schema (largest first) and the janitor's \
            latest pass (null before the first)", body = StorageReport),
        (status = 401, description = "Missing or wrong admin token (`unauthorized`)", body = ErrorBody),
        (status = 503, description = "Database unreachable (`database_unavailable`)", body = ErrorBody,
            headers(("Retry-After" = u32, description = "Seconds to wait"))),
    ),
    security(("admin_token" = [])),
)]
pub async fn get(State(state): State<AppState>) -> Result<Json<StorageReport>, ApiError> {
    Ok(Json(janitor::storage_report(&state.pool).await?))
}
