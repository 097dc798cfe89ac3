//! `/v1/endpoints`: where deliveries go.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use base64::Engine;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::extract::{ApiJson, parse_id};
use crate::app::AppState;
use crate::error::ApiError;
use crate::ids::EndpointId;
use crate::store::{self, endpoints::Endpoint};

/// Body of `POST /v1/endpoints`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateEndpoint {
    /// Subscriber URL (http or https).
    pub url: String,
    /// Standard Webhooks secret `whsec_<base64>`; generated when absent.
    #[serde(default)]
    pub secret: Option<String>,
    /// Free text.
    #[serde(default)]
    pub description: Option<String>,
}

/// An endpoint as the API shows it. The secret is shown only when it is created.
#[derive(Debug, Serialize)]
pub struct EndpointView {
    id: EndpointId,
    url: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    secret: Option<String>,
    description: Option<String>,
    paused: bool,
    circuit: CircuitView,
    created_at: DateTime<Utc>,
}

/// The endpoint's circuit breaker, as operators see it.
#[derive(Debug, Serialize)]
struct CircuitView {
    /// closed | open | half_open
    state: &'static str,
    consecutive_failures: i32,
    /// Opens since it was last closed (the cool-down doubles with each).
    open_count: i32,
    opened_at: Option<DateTime<Utc>>,
    /// When an open circuit admits its next probe.
    reopen_at: Option<DateTime<Utc>>,
}

impl EndpointView {
    fn new(e: Endpoint, show_secret: bool) -> Self {
        let c = &e.circuit;
        let open = c.circuit_state == "open";
        let circuit = CircuitView {
            state: c.display_state(Utc::now()),
            consecutive_failures: c.consecutive_failures,
            open_count: c.open_count,
            opened_at: if open { c.opened_at } else { None },
            reopen_at: if open { c.reopen_at } else { None },
        };
        EndpointView {
            id: e.id,
            url: e.url,
            secret: show_secret.then_some(e.secret),
            description: e.description,
            paused: e.paused,
            circuit,
            created_at: e.created_at,
        }
    }
}

/// A fresh signing secret: 32 random bytes, Standard Webhooks format.
pub fn generate_secret() -> String {
    let bytes: [u8; 32] = rand::random();
    format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// Check a caller-supplied secret: `whsec_` + base64 of 24 to 64 bytes.
fn validate_secret(secret: &str) -> Result<(), ApiError> {
    let decoded =
        secret.strip_prefix("whsec_").and_then(|b64| base64::engine::general_purpose::STANDARD.decode(b64).ok());
    match decoded {
        Some(key) if (24..=64).contains(&key.len()) => Ok(()),
        _ => Err(ApiError::validation("secret", "must be `whsec_` followed by base64 of 24 to 64 bytes")),
    }
}

/// `POST /v1/endpoints`.
pub async fn create(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<CreateEndpoint>,
) -> Result<(StatusCode, Json<EndpointView>), ApiError> {
    let url = state.check_endpoint_url(&body.url)?;
    let secret = match body.secret {
        Some(secret) => {
            validate_secret(&secret)?;
            secret
        }
        None => generate_secret(),
    };
    let endpoint = store::endpoints::insert(&state.pool, url.as_str(), &secret, body.description.as_deref()).await?;
    Ok((StatusCode::CREATED, Json(EndpointView::new(endpoint, true))))
}

/// `GET /v1/endpoints`.
pub async fn list(State(state): State<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    let endpoints = store::endpoints::list(&state.pool).await?;
    let data: Vec<EndpointView> = endpoints.into_iter().map(|e| EndpointView::new(e, false)).collect();
    Ok(Json(serde_json::json!({ "data": data })))
}

/// `GET /v1/endpoints/{id}`.
pub async fn get(State(state): State<AppState>, Path(id): Path<String>) -> Result<Json<EndpointView>, ApiError> {
    let id: EndpointId = parse_id(&id, "endpoint")?;
    let endpoint = store::endpoints::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("endpoint"))?;
    Ok(Json(EndpointView::new(endpoint, false)))
}

/// `POST /v1/endpoints/{id}/pause`: nothing is sent until resumed; due deliveries are
/// parked without spending attempts (like an open circuit that only an operator closes).
pub async fn pause(State(state): State<AppState>, Path(id): Path<String>) -> Result<Json<EndpointView>, ApiError> {
    let id: EndpointId = parse_id(&id, "endpoint")?;
    let endpoint =
        store::endpoints::set_paused(&state.pool, id, true).await?.ok_or_else(|| ApiError::not_found("endpoint"))?;
    tracing::info!(endpoint_id = %id, "endpoint paused");
    Ok(Json(EndpointView::new(endpoint, false)))
}

/// `POST /v1/endpoints/{id}/resume`: deliveries flow again; the parked backlog is
/// released at the configured rate.
pub async fn resume(State(state): State<AppState>, Path(id): Path<String>) -> Result<Json<EndpointView>, ApiError> {
    let id: EndpointId = parse_id(&id, "endpoint")?;
    let endpoint =
        store::endpoints::set_paused(&state.pool, id, false).await?.ok_or_else(|| ApiError::not_found("endpoint"))?;
    let released = crate::circuit::sql::release_backlog(&state.pool, id, state.release_per_sec).await?;
    tracing::info!(endpoint_id = %id, released, "endpoint resumed");
    Ok(Json(EndpointView::new(endpoint, false)))
}
