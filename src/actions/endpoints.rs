//! What an operator does to an endpoint, from the API or the console: pause and resume
//! it, rotate its signing secret, send it a test, recover its dead letters.

use base64::Engine;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::ids::{DeliveryId, EndpointId, EventId};
use crate::secrets::Place;
use crate::state::AppState;
use crate::store::{self, endpoints::Deleted, endpoints::Endpoint};

/// A fresh signing secret: 32 random bytes, Standard Webhooks format.
pub fn generate_secret() -> String {
    let bytes: [u8; 32] = rand::random();
    format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// The stored form of a signing secret (encrypted when a secrets key is set).
pub(crate) fn seal(state: &AppState, secret: &str) -> Result<crate::secrets::Sealed, ApiError> {
    state.secrets.seal(Place::EndpointSecret, secret).map_err(|e| ApiError::validation("secret", e))
}

/// Check a caller-supplied secret: `whsec_` + base64 of 24 to 64 bytes.
pub(crate) fn validate_secret(secret: &str) -> Result<(), ApiError> {
    let decoded =
        secret.strip_prefix("whsec_").and_then(|b64| base64::engine::general_purpose::STANDARD.decode(b64).ok());
    match decoded {
        Some(key) if (24..=64).contains(&key.len()) => Ok(()),
        _ => Err(ApiError::validation("secret", "must be `whsec_` followed by base64 of 24 to 64 bytes")),
    }
}

/// Pause or resume an endpoint (the API's `pause` / `resume` and the console's buttons).
/// Resuming releases the first batch of the parked backlog now (the rest follows with the
/// dispatchers' housekeeping) and wakes this process's workers. 404 when there is none.
///
/// A change (not a repeat) publishes `endpoint.paused` or `endpoint.resumed` in the same
/// transaction (`crate::operational`).
pub async fn set_paused(state: &AppState, id: EndpointId, paused: bool) -> Result<Endpoint, ApiError> {
    let mut tx = state.pool.begin().await?;
    let was = store::endpoints::paused_for_update(&mut *tx, id).await?;
    let endpoint =
        store::endpoints::set_paused(&mut *tx, id, paused).await?.ok_or_else(|| ApiError::not_found("endpoint"))?;
    if state.operational_events && was != Some(paused) {
        crate::operational::paused_changed(&mut tx, id, &endpoint.url, paused, crate::clock::now()).await?;
    }
    tx.commit().await?;
    if paused {
        tracing::info!(endpoint_id = %id, "endpoint paused");
    } else {
        // Resuming set `release_pending` (durable); the first batch goes now, the rest with
        // the dispatchers' housekeeping.
        let released = crate::queue::release_parked(&state.pool, state.release_per_sec, Some(id)).await?;
        state.wake.notify_one();
        tracing::info!(endpoint_id = %id, released, "endpoint resumed");
    }
    Ok(endpoint)
}

/// Body of `POST /v1/endpoints/{id}/rotate-secret` (optional: an empty body takes the defaults).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RotateSecret {
    /// The new secret (`whsec_...`); generated when absent.
    #[serde(default)]
    pub secret: Option<String>,
    /// How long the old secret keeps signing alongside the new one (default 24 h, at most 30 days).
    #[serde(default)]
    #[schema(maximum = 2592000)]
    pub grace_secs: Option<u64>,
}

/// Default grace period of a secret rotation.
pub const ROTATION_GRACE: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

// Fields in alphabetical order: the order this answer has always had.
/// A rotated secret.
#[derive(Debug, Serialize, ToSchema)]
pub struct RotatedSecret {
    /// The endpoint.
    pub id: EndpointId,
    /// Until then requests are also signed with the secret this rotation replaced.
    pub previous_secret_valid_until: DateTime<Utc>,
    /// The new secret (`whsec_...`), shown this once.
    pub secret: String,
}

/// Rotate an endpoint's signing secret (the API's `rotate-secret` and the console's
/// button): the new secret (given or generated) is returned, to be shown once.
pub async fn rotate(state: &AppState, id: EndpointId, body: RotateSecret) -> Result<RotatedSecret, ApiError> {
    let secret = match body.secret {
        Some(secret) => {
            validate_secret(&secret)?;
            secret
        }
        None => generate_secret(),
    };
    let grace = body.grace_secs.map(std::time::Duration::from_secs).unwrap_or(ROTATION_GRACE);
    if grace > std::time::Duration::from_secs(30 * 24 * 3600) {
        return Err(ApiError::validation("grace_secs", "at most 30 days"));
    }
    let endpoint = store::endpoints::rotate_secret(&state.pool, id, &seal(state, &secret)?, grace)
        .await?
        .ok_or_else(|| ApiError::not_found("endpoint"))?;
    tracing::info!(endpoint_id = %id, grace_secs = grace.as_secs(), "endpoint secret rotated");
    Ok(RotatedSecret {
        id: endpoint.id,
        previous_secret_valid_until: crate::clock::now() + chrono::Duration::from_std(grace).unwrap_or_default(),
        secret,
    })
}

// Fields in alphabetical order: the order this answer has always had.
/// A queued test send.
#[derive(Debug, Serialize, ToSchema)]
pub struct TestSend {
    /// Follow it with `GET /v1/deliveries/{id}`.
    pub delivery_id: DeliveryId,
    /// The synthetic `webhook.test` event (never deduplicated against real events).
    pub event_id: EventId,
    /// The `webhook-id` the request carries.
    #[schema(example = "msg_0190c7e0f4a97c3a9d5e3c1b2a4f6e8d")]
    pub webhook_id: String,
}

/// Queue a synthetic `webhook.test` event for one endpoint (the API's `test` and the
/// console's button). 404 when there is no such endpoint.
pub async fn send_test(state: &AppState, id: EndpointId) -> Result<TestSend, ApiError> {
    if store::endpoints::by_id(&state.pool, id).await?.is_none() {
        return Err(ApiError::not_found("endpoint"));
    }
    let payload = serde_json::to_vec(&serde_json::json!({
        "type": "webhook.test",
        "endpoint_id": id,
        "sent_at": crate::clock::now(),
    }))
    .map_err(|_| ApiError::internal())?;
    let (event_id, delivery_id) = store::events::insert_test(&state.pool, id, &payload).await?;
    state.wake.notify_one();
    Ok(TestSend { delivery_id, event_id, webhook_id: delivery_id.webhook_id() })
}

/// Body of `POST /v1/endpoints/{id}/recover`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Recover {
    /// Dead-lettered at or after.
    pub since: DateTime<Utc>,
    /// Dead-lettered before (default: now).
    #[serde(default)]
    pub until: Option<DateTime<Utc>>,
}

/// The outcome of a recovery.
#[derive(Debug, Serialize, ToSchema)]
pub struct Recovered {
    /// Dead deliveries put back to pending.
    pub requeued: u64,
}

/// The window a recovery covers, checked: `[since, until)`, `until` defaulting to now.
pub fn recovery_window(body: &Recover) -> Result<(DateTime<Utc>, DateTime<Utc>), ApiError> {
    let until = body.until.unwrap_or_else(Utc::now);
    if until <= body.since {
        return Err(ApiError::validation("until", "must be after since"));
    }
    Ok((body.since, until))
}

/// Re-queue an endpoint's deliveries that died in the window (the API's `recover` and the
/// console's confirmed recovery). 404 when there is no such endpoint.
pub async fn recover_window(state: &AppState, id: EndpointId, body: Recover) -> Result<Recovered, ApiError> {
    if store::endpoints::by_id(&state.pool, id).await?.is_none() {
        return Err(ApiError::not_found("endpoint"));
    }
    let (since, until) = recovery_window(&body)?;
    let requeued = crate::queue::requeue_dead(&state.pool, id, since, until, state.release_per_sec).await?;
    if requeued > 0 {
        state.wake.notify_one();
    }
    tracing::info!(endpoint_id = %id, requeued, "dead deliveries recovered");
    Ok(Recovered { requeued })
}

/// Delete an endpoint, in one transaction: its subscriptions go (no new deliveries), it is
/// marked deleted (its history stays inspectable), and with `force` its pending
/// deliveries are dead-lettered with a reason; without `force`, pending deliveries refuse
/// the deletion.
pub async fn delete_endpoint(state: &AppState, id: EndpointId, force: bool) -> Result<Deleted, ApiError> {
    let mut tx = state.pool.begin().await?;
    if !store::endpoints::lock_live(&mut tx, id).await? {
        return Ok(Deleted::NotFound);
    }
    let pending = crate::queue::pending_of(&mut *tx, id).await?;
    if pending > 0 && !force {
        return Ok(Deleted::HasPending(pending));
    }
    crate::queue::bury_all_of_endpoint(&mut tx, id, "endpoint deleted").await?;
    store::subscriptions::delete_of_endpoint(&mut *tx, id).await?;
    store::endpoints::mark_deleted(&mut tx, id).await?;
    tx.commit().await?;
    tracing::info!(endpoint_id = %id, dead_lettered = pending, "endpoint deleted");
    Ok(Deleted::Done(pending))
}
