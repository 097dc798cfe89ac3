//! The HTTP surface: admin API under `/v1` (bearer token), webhook ingest, health.
//!
//! Handlers are thin: parse, call the store or a pure function, map to JSON. Every error
//! goes through [`crate::error::ApiError`].

mod auth;
mod deliveries;
mod endpoints;
mod events;
pub mod extract;
mod health;
mod sources;
mod storage;
mod subscriptions;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::routing::{get, post};

use crate::app::AppState;
use crate::config::Role;
use crate::error::ApiError;

pub use endpoints::generate_secret;

/// The full router for a process of the given role.
pub fn router(state: AppState, role: Role) -> Router {
    let mut app = Router::new().route("/healthz", get(health::healthz)).route("/readyz", get(health::readyz));
    if role != Role::Worker {
        let admin = Router::new()
            .route("/sources", post(sources::create).get(sources::list))
            .route("/sources/{id}", get(sources::get))
            .route("/endpoints", post(endpoints::create).get(endpoints::list))
            .route("/endpoints/{id}", get(endpoints::get))
            .route("/endpoints/{id}/pause", post(endpoints::pause))
            .route("/endpoints/{id}/resume", post(endpoints::resume))
            .route("/subscriptions", post(subscriptions::create))
            .route("/events", post(events::publish))
            .route("/events/{id}", get(events::get))
            .route("/deliveries", get(deliveries::list))
            .route("/deliveries/{id}", get(deliveries::get))
            .route("/deliveries/{id}/attempts", get(deliveries::attempts))
            .route("/admin/storage", get(storage::get))
            .route_layer(middleware::from_fn_with_state(state.clone(), auth::require_admin));
        app = app.nest("/v1", admin).route("/ingest/{source}", post(crate::ingest::ingest));
    }
    app.fallback(not_found).layer(DefaultBodyLimit::max(state.max_body_bytes)).with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::not_found("route")
}
