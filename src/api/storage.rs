//! `GET /v1/admin/storage`: table and index sizes, dead tuples, and the janitor's latest
//! pass, so an operator can see that storage stays bounded without SQL.

use axum::Json;
use axum::extract::State;

use crate::app::AppState;
use crate::error::ApiError;
use crate::janitor::{self, StorageReport};

/// `GET /v1/admin/storage`.
pub async fn get(State(state): State<AppState>) -> Result<Json<StorageReport>, ApiError> {
    Ok(Json(janitor::storage_report(&state.pool).await?))
}
