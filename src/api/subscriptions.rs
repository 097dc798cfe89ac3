//! `/v1/subscriptions`: which events go to which endpoint.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::AppState;
use super::extract::{ApiJson, ApiQuery, Id};
use super::openapi::{AdminErrors, JsonBodyErrors};
use crate::error::{ApiError, ErrorBody};
use crate::fanout;
use crate::ids::{EndpointId, SubscriptionId};
use crate::queue::OnDead;
use crate::store::{self, subscriptions::Subscription};

/// Body of `POST /v1/subscriptions`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSubscription {
    /// Where matching events are delivered (422 when there is no such endpoint).
    pub endpoint_id: EndpointId,
    /// Source name; absent means every source.
    #[serde(default)]
    pub source: Option<String>,
    /// Event-type patterns (`*` wildcard); absent means every type; must not be empty.
    #[serde(default)]
    #[schema(example = json!(["order.*"]))]
    pub event_types: Option<Vec<String>>,
    /// Deliver the events of one ordering key (the source's `ordering_key`) to this
    /// endpoint one at a time, in ingest order; absent: unordered.
    #[serde(default)]
    pub ordered: Option<Ordered>,
    /// Deliver only the events this SQL/JSON path predicate matches, evaluated on
    /// `{"payload", "headers", "type", "source"}` (docs/api.md, "Filters"); absent: every
    /// event. A syntax error is a 422 naming the character.
    #[serde(default)]
    #[schema(example = "$.payload.livemode == true")]
    pub filter: Option<String>,
    /// JavaScript defining `handler(webhook)`, whose result is the body sent (as JSON) to
    /// the endpoint (docs/api.md, "Transformations"); absent: the event's body as it is.
    #[serde(default)]
    #[schema(example = "function handler(w) { return {text: `Order ${w.payload.id} paid`}; }")]
    pub transform: Option<String>,
}

/// Ordered delivery: the events of one key go one at a time, in ingest order.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Ordered {
    /// What a dead delivery does to its key's line: `block` (the default: the line waits
    /// until an operator redelivers or unblocks it) or `skip` (the line moves on).
    #[serde(default)]
    pub on_dead: Option<OnDead>,
}

impl Ordered {
    fn on_dead(self) -> OnDead {
        self.on_dead.unwrap_or(OnDead::Block)
    }
}

/// A subscription as the API shows it.
#[derive(Debug, Serialize, ToSchema)]
pub struct SubscriptionView {
    id: SubscriptionId,
    endpoint_id: EndpointId,
    /// Source name; `null`: every source.
    source: Option<String>,
    /// Event-type patterns; `null`: every type.
    event_types: Option<Vec<String>>,
    /// Ordered delivery per ordering key; `null`: unordered.
    ordered: Option<Ordered>,
    /// Content filter, as PostgreSQL normalizes it; `null`: every event.
    filter: Option<String>,
    /// Transformation; `null`: the event's body is sent as it is.
    transform: Option<String>,
    created_at: DateTime<Utc>,
}

/// Subscriptions (not paginated).
#[derive(Debug, Serialize, ToSchema)]
pub struct SubscriptionList {
    /// Oldest first (ids are time-ordered).
    data: Vec<SubscriptionView>,
}

impl From<Subscription> for SubscriptionView {
    fn from(s: Subscription) -> Self {
        SubscriptionView {
            id: s.id,
            endpoint_id: s.endpoint_id,
            source: s.source_name,
            event_types: s.event_types,
            ordered: s.ordered.then_some(Ordered { on_dead: Some(s.ordered_on_dead) }),
            filter: s.filter,
            transform: s.transform,
            created_at: s.created_at,
        }
    }
}

fn validate_patterns(types: &[String]) -> Result<(), ApiError> {
    if types.is_empty() {
        return Err(ApiError::validation("event_types", "must not be empty (omit it to match every type)"));
    }
    for t in types {
        fanout::validate_pattern(t).map_err(|e| ApiError::validation("event_types", e))?;
    }
    Ok(())
}

/// A filter checked, or the 422 naming what is wrong (and where).
async fn check_filter(state: &AppState, filter: &str) -> Result<(), ApiError> {
    crate::filters::check(&state.pool, filter).await?.map_err(|e| ApiError::validation("filter", e))
}

/// A transformation checked (it compiles and defines `handler`, within the run bounds), or
/// the 422 naming what is wrong and where.
async fn check_transform(script: &str) -> Result<(), ApiError> {
    let script = script.to_owned();
    tokio::task::spawn_blocking(move || crate::transforms::check(&script))
        .await
        .map_err(|_| ApiError::internal())?
        .map_err(|e| ApiError::validation("transform", e))
}

async fn source_id_by_name(state: &AppState, name: &str) -> Result<crate::ids::SourceId, ApiError> {
    Ok(store::sources::by_name(&state.pool, name)
        .await?
        .ok_or_else(|| ApiError::validation("source", format!("no source named {name:?}")))?
        .id)
}

/// `POST /v1/subscriptions`.
#[utoipa::path(
    post, path = "/v1/subscriptions", tag = "subscriptions", operation_id = "create_subscription",
    summary = "Create a subscription",
    request_body = CreateSubscription,
    responses(
        (status = 201, description = "Created", body = SubscriptionView),
        JsonBodyErrors,
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn create(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<CreateSubscription>,
) -> Result<(StatusCode, Json<SubscriptionView>), ApiError> {
    if let Some(types) = &body.event_types {
        validate_patterns(types)?;
    }
    if let Some(filter) = &body.filter {
        check_filter(&state, filter).await?;
    }
    if let Some(transform) = &body.transform {
        check_transform(transform).await?;
    }
    if store::endpoints::by_id(&state.pool, body.endpoint_id).await?.is_none() {
        return Err(ApiError::validation("endpoint_id", "no such endpoint"));
    }
    let source_id = match &body.source {
        None => None,
        Some(name) => Some(source_id_by_name(&state, name).await?),
    };
    let ordered = body.ordered.map(Ordered::on_dead);
    let types = body.event_types.as_deref();
    let created = store::subscriptions::insert(
        &state.pool,
        body.endpoint_id,
        source_id,
        types,
        ordered,
        body.filter.as_deref(),
        body.transform.as_deref(),
    )
    .await
    .map_err(|e| {
        // The endpoint or source was deleted between our check and the insert.
        if store::is_foreign_key_violation(&e) {
            ApiError::validation("endpoint_id", "no such endpoint or source")
        } else {
            e.into()
        }
    })?;
    Ok((StatusCode::CREATED, Json(created.into())))
}

/// Query of `GET /v1/subscriptions`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only this endpoint's subscriptions.
    endpoint_id: Option<EndpointId>,
}

/// `GET /v1/subscriptions?endpoint_id=`.
#[utoipa::path(
    get, path = "/v1/subscriptions", tag = "subscriptions", operation_id = "list_subscriptions",
    summary = "List subscriptions",
    params(ListQuery),
    responses(
        (status = 200, description = "The subscriptions (not paginated)", body = SubscriptionList),
        (status = 422, description = "Bad query string (`validation_failed`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn list(
    State(state): State<AppState>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<SubscriptionList>, ApiError> {
    let data = store::subscriptions::list(&state.pool, q.endpoint_id).await?.into_iter().map(Into::into).collect();
    Ok(Json(SubscriptionList { data }))
}

/// `GET /v1/subscriptions/{id}`.
#[utoipa::path(
    get, path = "/v1/subscriptions/{id}", tag = "subscriptions", operation_id = "get_subscription",
    summary = "Get a subscription",
    params(("id" = SubscriptionId, Path, description = "Subscription id (anything else is 404)")),
    responses(
        (status = 200, description = "The subscription", body = SubscriptionView),
        (status = 404, description = "No such subscription (`not_found`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn get(
    State(state): State<AppState>,
    Id(id): Id<SubscriptionId>,
) -> Result<Json<SubscriptionView>, ApiError> {
    let sub = store::subscriptions::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("subscription"))?;
    Ok(Json(sub.into()))
}

/// Body of `PATCH /v1/subscriptions/{id}`; `null` clears a filter (match everything).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateSubscription {
    /// Source name, or `null` for every source.
    #[serde(default, deserialize_with = "super::extract::double_option")]
    pub source: Option<Option<String>>,
    /// Patterns, or `null` for every type.
    #[serde(default, deserialize_with = "super::extract::double_option")]
    pub event_types: Option<Option<Vec<String>>>,
    /// Ordered delivery, or `null` to turn it off (deliveries already created keep how they
    /// were made).
    #[serde(default, deserialize_with = "super::extract::double_option")]
    pub ordered: Option<Option<Ordered>>,
    /// Content filter, or `null` to deliver every event.
    #[serde(default, deserialize_with = "super::extract::double_option")]
    pub filter: Option<Option<String>>,
    /// Transformation, or `null` to send the event's body as it is.
    #[serde(default, deserialize_with = "super::extract::double_option")]
    pub transform: Option<Option<String>>,
}

/// `PATCH /v1/subscriptions/{id}`.
///
/// Applies to events stored from now on.
#[utoipa::path(
    patch, path = "/v1/subscriptions/{id}", tag = "subscriptions", operation_id = "update_subscription",
    summary = "Update a subscription",
    params(("id" = SubscriptionId, Path, description = "Subscription id (anything else is 404)")),
    request_body = UpdateSubscription,
    responses(
        (status = 200, description = "The updated subscription", body = SubscriptionView),
        (status = 404, description = "No such subscription (`not_found`)", body = ErrorBody),
        JsonBodyErrors,
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn update(
    State(state): State<AppState>,
    Id(id): Id<SubscriptionId>,
    ApiJson(body): ApiJson<UpdateSubscription>,
) -> Result<Json<SubscriptionView>, ApiError> {
    if let Some(Some(types)) = &body.event_types {
        validate_patterns(types)?;
    }
    if let Some(Some(filter)) = &body.filter {
        check_filter(&state, filter).await?;
    }
    if let Some(Some(transform)) = &body.transform {
        check_transform(transform).await?;
    }
    let source_id = match &body.source {
        None => None,
        Some(None) => Some(None),
        Some(Some(name)) => Some(Some(source_id_by_name(&state, name).await?)),
    };
    let types = body.event_types.as_ref().map(|t| t.as_deref());
    let ordered = body.ordered.map(|o| o.map(Ordered::on_dead));
    let filter = body.filter.as_ref().map(|f| f.as_deref());
    let transform = body.transform.as_ref().map(|t| t.as_deref());
    let sub = store::subscriptions::update(&state.pool, id, source_id, types, ordered, filter, transform)
        .await?
        .ok_or_else(|| ApiError::not_found("subscription"))?;
    Ok(Json(sub.into()))
}

/// `DELETE /v1/subscriptions/{id}`.
///
/// No new deliveries; existing ones are unaffected.
#[utoipa::path(
    delete, path = "/v1/subscriptions/{id}", tag = "subscriptions", operation_id = "delete_subscription",
    summary = "Delete a subscription",
    params(("id" = SubscriptionId, Path, description = "Subscription id (anything else is 404)")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such subscription (`not_found`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn delete(State(state): State<AppState>, Id(id): Id<SubscriptionId>) -> Result<StatusCode, ApiError> {
    if store::subscriptions::delete(&state.pool, id).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found("subscription"))
    }
}
