//! What an operator does to a delivery, from the API or the console: redeliver it, or let
//! the ordering line it blocks move on.

use crate::error::ApiError;
use crate::ids::DeliveryId;
use crate::queue::DeliveryStatus;
use crate::queue::read::{self, Delivery};
use crate::state::AppState;

/// Redeliver one delivery (the API's `POST /v1/deliveries/{id}/redeliver` and the
/// console's button): pending again, due now, this process's workers woken; idempotent
/// while pending. 404 when there is no such delivery, 409 when its endpoint was deleted.
pub async fn redeliver_one(state: &AppState, id: DeliveryId) -> Result<Delivery, ApiError> {
    let changed = crate::queue::redeliver(&state.pool, id).await?;
    let delivery = read::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("delivery"))?;
    if changed {
        state.wake.notify_one();
        tracing::info!(delivery_id = %id, "manual redelivery");
    } else if delivery.status != DeliveryStatus::Pending {
        return Err(ApiError::conflict("its endpoint was deleted: there is nowhere to redeliver it"));
    }
    Ok(delivery)
}

/// Let the ordering line a dead delivery blocks move on (the API's `unblock` and the
/// console's button); the delivery is returned as it is. 404 when there is no such
/// delivery, 409 when it is not a dead delivery blocking its line.
pub async fn unblock(state: &AppState, id: DeliveryId) -> Result<Delivery, ApiError> {
    let mut tx = state.pool.begin().await?;
    let unblocked = crate::queue::lines::unblock(&mut tx, id).await?;
    tx.commit().await?;
    let delivery = read::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("delivery"))?;
    if !unblocked {
        return Err(ApiError::conflict("it is not a dead delivery blocking its ordering line"));
    }
    state.wake.notify_one();
    tracing::info!(delivery_id = %id, "ordering line unblocked");
    Ok(delivery)
}
