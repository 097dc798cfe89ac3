//! `/v1/subscriptions`: which events go to which endpoint.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::extract::ApiJson;
use crate::app::AppState;
use crate::error::ApiError;
use crate::fanout;
use crate::ids::{EndpointId, SubscriptionId};
use crate::store::{self, subscriptions::Subscription};

/// Body of `POST /v1/subscriptions`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSubscription {
    /// Target endpoint.
    pub endpoint_id: EndpointId,
    /// Source name; absent means every source.
    #[serde(default)]
    pub source: Option<String>,
    /// Event-type patterns (`*` wildcard); absent means every type.
    #[serde(default)]
    pub event_types: Option<Vec<String>>,
}

/// A subscription as the API shows it.
#[derive(Debug, Serialize)]
pub struct SubscriptionView {
    id: SubscriptionId,
    endpoint_id: EndpointId,
    source: Option<String>,
    event_types: Option<Vec<String>>,
    created_at: DateTime<Utc>,
}

impl From<Subscription> for SubscriptionView {
    fn from(s: Subscription) -> Self {
        SubscriptionView {
            id: s.id,
            endpoint_id: s.endpoint_id,
            source: s.source_name,
            event_types: s.event_types,
            created_at: s.created_at,
        }
    }
}

/// `POST /v1/subscriptions`.
pub async fn create(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<CreateSubscription>,
) -> Result<(StatusCode, Json<SubscriptionView>), ApiError> {
    if let Some(types) = &body.event_types {
        if types.is_empty() {
            return Err(ApiError::validation("event_types", "must not be empty (omit it to match every type)"));
        }
        for t in types {
            fanout::validate_pattern(t).map_err(|e| ApiError::validation("event_types", e))?;
        }
    }
    if store::endpoints::by_id(&state.pool, body.endpoint_id).await?.is_none() {
        return Err(ApiError::validation("endpoint_id", "no such endpoint"));
    }
    let source_id = match &body.source {
        None => None,
        Some(name) => Some(
            store::sources::by_name(&state.pool, name)
                .await?
                .ok_or_else(|| ApiError::validation("source", format!("no source named {name:?}")))?
                .id,
        ),
    };
    let created = store::subscriptions::insert(&state.pool, body.endpoint_id, source_id, body.event_types.as_deref())
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
