//! `/v1/endpoints`: where deliveries go. This file: creating, reading, changing and
//! deleting them; `operate.rs`: the handlers of what an operator does to one (pause,
//! resume, rotate its secret, send a test, recover its dead letters), which call
//! `crate::actions` as the console does.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::AppState;
use super::extract::{ApiJson, ApiQuery, Id};
use super::openapi::{AdminErrors, JsonBodyErrors};
use crate::actions::{generate_secret, seal, validate_secret};
use crate::error::{ApiError, ErrorBody};
use crate::ids::EndpointId;
use crate::store::{self, endpoints::Deleted, endpoints::Endpoint};
/// Body of `POST /v1/endpoints`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateEndpoint {
    /// Subscriber URL (http or https; IP literals in private ranges are refused unless allowed).
    #[schema(example = "https://subscriber.example.com/hooks")]
    pub url: String,
    /// Standard Webhooks secret `whsec_<base64>`; generated when absent.
    #[serde(default)]
    pub secret: Option<String>,
    /// Free text for operators (shown by the API, never sent to the subscriber).
    #[serde(default)]
    pub description: Option<String>,
    /// Concurrent requests at most, across every replica (1-10000); absent: the gateway's
    /// default (`--endpoint-max-in-flight`).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 10000)]
    pub max_in_flight: Option<i32>,
    /// Requests per second at most, across every replica; absent: none.
    #[serde(default)]
    pub rate_limit: Option<RateLimit>,
}

/// A rate limit: a token bucket of `burst` requests refilled at `per_sec`.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    /// Requests per second (more than 0, at most 100000; fractions allowed: 0.5 is one
    /// request every two seconds).
    #[schema(example = 50.0)]
    pub per_sec: f64,
    /// Requests that may go at once after a quiet spell (1-100000); default: one
    /// second's worth, at least 1.
    #[serde(default)]
    pub burst: Option<i32>,
}

impl RateLimit {
    /// Validated `(per second, burst)`.
    fn checked(self) -> Result<(f64, i32), ApiError> {
        if !(self.per_sec > 0.0 && self.per_sec <= 100_000.0) {
            return Err(ApiError::validation("rate_limit.per_sec", "must be more than 0 and at most 100000"));
        }
        let burst = self.burst.unwrap_or_else(|| (self.per_sec.ceil() as i32).max(1));
        if !(1..=100_000).contains(&burst) {
            return Err(ApiError::validation("rate_limit.burst", "must be between 1 and 100000"));
        }
        Ok((self.per_sec, burst))
    }
}

/// A checked in-flight cap.
fn checked_max_in_flight(max: i32) -> Result<i32, ApiError> {
    if (1..=10_000).contains(&max) {
        Ok(max)
    } else {
        Err(ApiError::validation("max_in_flight", "must be between 1 and 10000"))
    }
}

/// An endpoint as the API shows it. The secret is shown only when it is created.
#[derive(Debug, Serialize, ToSchema)]
pub struct EndpointView {
    id: EndpointId,
    url: String,
    /// The signing secret (`whsec_...`): present only in the answer to `POST /v1/endpoints`.
    #[serde(skip_serializing_if = "Option::is_none")]
    secret: Option<String>,
    description: Option<String>,
    /// Paused by an operator: nothing is sent until resumed.
    paused: bool,
    circuit: CircuitView,
    /// Its delivery limits, as enforced now.
    limits: LimitsView,
    /// Requests in flight now (leased and not yet recorded), across every replica.
    in_flight: i64,
    created_at: DateTime<Utc>,
}

/// An endpoint's limits, as enforced.
#[derive(Debug, Serialize, ToSchema)]
struct LimitsView {
    /// Concurrent requests at most, across every replica.
    max_in_flight: i32,
    /// `max_in_flight` is the gateway's default (`--endpoint-max-in-flight`), not the
    /// endpoint's own.
    max_in_flight_is_default: bool,
    /// Requests per second at most; `null`: no rate limit.
    rate_limit: Option<RateLimit>,
}

/// The endpoint's circuit breaker, as operators see it.
#[derive(Debug, Serialize, ToSchema)]
struct CircuitView {
    /// `closed`, `open` or `half_open`.
    state: crate::circuit::CircuitDisplay,
    /// Retryable failures in a row since the last success; the circuit opens at
    /// `--circuit-failure-threshold`.
    consecutive_failures: i32,
    /// Opens since it was last closed (the cool-down doubles with each).
    open_count: i32,
    /// When the circuit opened; `null` unless it is open.
    opened_at: Option<DateTime<Utc>>,
    /// When an open circuit admits its next probe.
    reopen_at: Option<DateTime<Utc>>,
}

impl EndpointView {
    fn new(e: Endpoint, secret: Option<String>, default_max_in_flight: i32, in_flight: i64) -> Self {
        let limits = LimitsView {
            max_in_flight: e.limits.max_in_flight.unwrap_or(default_max_in_flight),
            max_in_flight_is_default: e.limits.max_in_flight.is_none(),
            rate_limit: e
                .limits
                .rate_limit_per_sec
                .map(|per_sec| RateLimit { per_sec, burst: e.limits.rate_limit_burst }),
        };
        let c = &e.circuit;
        let open = c.circuit_state == crate::circuit::CircuitState::Open;
        let circuit = CircuitView {
            state: c.display_state(crate::clock::now()),
            consecutive_failures: c.consecutive_failures,
            open_count: c.open_count,
            opened_at: if open { c.opened_at } else { None },
            reopen_at: if open { c.reopen_at } else { None },
        };
        EndpointView {
            id: e.id,
            url: e.url,
            secret,
            description: e.description,
            paused: e.paused,
            circuit,
            limits,
            in_flight,
            created_at: e.created_at,
        }
    }
}

/// The view of `endpoint` with its load now.
async fn view(state: &AppState, endpoint: Endpoint, secret: Option<String>) -> Result<EndpointView, ApiError> {
    let in_flight = crate::queue::read::in_flight_of(&state.pool, endpoint.id).await?;
    Ok(EndpointView::new(endpoint, secret, state.default_max_in_flight, in_flight))
}

/// All endpoints (not paginated).
#[derive(Debug, Serialize, ToSchema)]
pub struct EndpointList {
    /// Every endpoint not deleted, oldest first; secrets are not shown.
    data: Vec<EndpointView>,
}

/// `POST /v1/endpoints`.
#[utoipa::path(
    post, path = "/v1/endpoints", tag = "endpoints", operation_id = "create_endpoint",
    summary = "Create an endpoint",
    request_body = CreateEndpoint,
    responses(
        (status = 201, description = "Created; the answer shows the secret, this once", body = EndpointView),
        JsonBodyErrors,
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
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
    let rate = body.rate_limit.map(RateLimit::checked).transpose()?;
    let limits = store::endpoints::Limits {
        max_in_flight: body.max_in_flight.map(checked_max_in_flight).transpose()?,
        rate_limit_per_sec: rate.map(|r| r.0),
        rate_limit_burst: rate.map(|r| r.1),
    };
    let stored = seal(&state, &secret)?;
    let endpoint =
        store::endpoints::insert(&state.pool, url.as_str(), &stored, body.description.as_deref(), limits).await?;
    // The answer shows the secret as given or generated, never its stored form.
    Ok((StatusCode::CREATED, Json(view(&state, endpoint, Some(secret)).await?)))
}

/// `GET /v1/endpoints`.
#[utoipa::path(
    get, path = "/v1/endpoints", tag = "endpoints", operation_id = "list_endpoints",
    summary = "List endpoints",
    responses(
        (status = 200, description = "All endpoints (not paginated)", body = EndpointList),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn list(State(state): State<AppState>) -> Result<Json<EndpointList>, ApiError> {
    let endpoints = store::endpoints::list(&state.pool).await?;
    let loads: std::collections::HashMap<EndpointId, i64> =
        crate::queue::read::endpoint_loads(&state.pool, state.default_max_in_flight)
            .await?
            .into_iter()
            .map(|l| (l.endpoint_id, l.in_flight))
            .collect();
    let data = endpoints
        .into_iter()
        .map(|e| {
            let in_flight = loads.get(&e.id).copied().unwrap_or(0);
            EndpointView::new(e, None, state.default_max_in_flight, in_flight)
        })
        .collect();
    Ok(Json(EndpointList { data }))
}

/// `GET /v1/endpoints/{id}`.
#[utoipa::path(
    get, path = "/v1/endpoints/{id}", tag = "endpoints", operation_id = "get_endpoint",
    summary = "Get an endpoint",
    params(("id" = EndpointId, Path, description = "Endpoint id (anything else is 404)")),
    responses(
        (status = 200, description = "The endpoint (without its secret)", body = EndpointView),
        (status = 404, description = "No such endpoint (`not_found`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn get(State(state): State<AppState>, Id(id): Id<EndpointId>) -> Result<Json<EndpointView>, ApiError> {
    let endpoint = store::endpoints::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("endpoint"))?;
    Ok(Json(view(&state, endpoint, None).await?))
}

/// Body of `PATCH /v1/endpoints/{id}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateEndpoint {
    /// New URL (checked like at creation).
    #[serde(default)]
    pub url: Option<String>,
    /// New description; `null` clears it.
    #[serde(default, deserialize_with = "super::extract::double_option")]
    pub description: Option<Option<String>>,
    /// New in-flight cap (1-10000); `null`: back to the gateway's default.
    #[serde(default, deserialize_with = "super::extract::double_option")]
    #[schema(minimum = 1, maximum = 10000)]
    pub max_in_flight: Option<Option<i32>>,
    /// New rate limit (its bucket starts full); `null` removes it.
    #[serde(default, deserialize_with = "super::extract::double_option")]
    pub rate_limit: Option<Option<RateLimit>>,
}

/// `PATCH /v1/endpoints/{id}`.
///
/// Pending deliveries go to the new URL from their next attempt.
#[utoipa::path(
    patch, path = "/v1/endpoints/{id}", tag = "endpoints", operation_id = "update_endpoint",
    summary = "Update an endpoint",
    params(("id" = EndpointId, Path, description = "Endpoint id (anything else is 404)")),
    request_body = UpdateEndpoint,
    responses(
        (status = 200, description = "The updated endpoint", body = EndpointView),
        (status = 404, description = "No such endpoint (`not_found`)", body = ErrorBody),
        JsonBodyErrors,
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn update(
    State(state): State<AppState>,
    Id(id): Id<EndpointId>,
    ApiJson(body): ApiJson<UpdateEndpoint>,
) -> Result<Json<EndpointView>, ApiError> {
    let url = body.url.as_deref().map(|u| state.check_endpoint_url(u)).transpose()?;
    let changes = store::endpoints::Changes {
        url: url.as_ref().map(|u| u.as_str()),
        description: body.description.as_ref().map(|d| d.as_deref()),
        max_in_flight: body.max_in_flight.map(|m| m.map(checked_max_in_flight).transpose()).transpose()?,
        rate_limit: body.rate_limit.map(|r| r.map(RateLimit::checked).transpose()).transpose()?,
    };
    let endpoint =
        store::endpoints::update(&state.pool, id, &changes).await?.ok_or_else(|| ApiError::not_found("endpoint"))?;
    Ok(Json(view(&state, endpoint, None).await?))
}

/// Query of `DELETE /v1/endpoints/{id}`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeleteQuery {
    /// Dead-letter pending deliveries (reason `endpoint deleted`) instead of refusing.
    #[serde(default)]
    force: bool,
}

// Fields in alphabetical order: the order this answer has always had.
/// A deleted endpoint.
#[derive(Debug, Serialize, ToSchema)]
pub struct EndpointDeleted {
    /// Pending deliveries dead-lettered by `force` (reason `endpoint deleted`); 0 without it.
    dead_lettered: u64,
    /// Always true.
    deleted: bool,
    id: EndpointId,
}

/// `DELETE /v1/endpoints/{id}`.
///
/// 409 while deliveries are pending, unless `?force=true`. The endpoint's history
/// (deliveries, attempts, dead letters) stays inspectable.
#[utoipa::path(
    delete, path = "/v1/endpoints/{id}", tag = "endpoints", operation_id = "delete_endpoint",
    summary = "Delete an endpoint",
    params(("id" = EndpointId, Path, description = "Endpoint id (anything else is 404)"), DeleteQuery),
    responses(
        (status = 200, description = "Deleted (unlike sources and subscriptions, with a body)", body = EndpointDeleted),
        (status = 404, description = "No such endpoint (`not_found`)", body = ErrorBody),
        (status = 409, description = "Deliveries are pending and `force` is not set (`conflict`)", body = ErrorBody),
        (status = 422, description = "Bad query string (`validation_failed`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn delete(
    State(state): State<AppState>,
    Id(id): Id<EndpointId>,
    ApiQuery(q): ApiQuery<DeleteQuery>,
) -> Result<Json<EndpointDeleted>, ApiError> {
    match crate::actions::delete_endpoint(&state, id, q.force).await? {
        Deleted::NotFound => Err(ApiError::not_found("endpoint")),
        Deleted::HasPending(n) => Err(ApiError::conflict(format!(
            "endpoint has {n} pending deliveries: repeat with ?force=true to dead-letter them"
        ))),
        Deleted::Done(dead_lettered) => {
            // A row count: never negative.
            Ok(Json(EndpointDeleted { dead_lettered: dead_lettered.unsigned_abs(), deleted: true, id }))
        }
    }
}

mod operate;

pub use operate::*;
