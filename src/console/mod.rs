//! stub
use crate::api::AppState;
use axum::Router;
pub fn router(_s: &AppState) -> Router<AppState> {
    Router::new()
}
