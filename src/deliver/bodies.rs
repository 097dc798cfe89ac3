//! Delivery bodies held by bytes in flight, not by workers × the largest body
//! (`--delivery-memory-mib`).
//!
//! A claim brings the bodies of events up to [`INLINE_BODY_BYTES`] with it (most webhooks:
//! one round trip, as before). A larger body stays in the database until its worker has
//! reserved room for it in the process's [`MemoryBudget`], then is read by id, and holds
//! its room until its attempt ends. So with 1,024 workers and 1 MiB webhooks, a worker
//! process holds at most the budget of large bodies plus workers × 64 KiB of small ones,
//! where it used to hold up to a claim of 256 large bodies at once, and every worker's.
//!
//! Small bodies reserve nothing: they are in memory already (the claim brought them), and
//! the budget's queue is first come, first served, so a small body behind a large one
//! waiting for room would wait with it. They pass beside the large ones instead.
//!
//! A worker that finds no room within [`patience`] gives its claim back without spending
//! an attempt (nothing was sent), due again shortly; so does one whose body cannot be
//! read. A body larger than the whole budget waits until it is the only one held.

use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;

use super::attempt::Context;
use crate::memory::MemoryBudget;
use crate::queue::Claimed;

/// Largest body a claim brings with it (the claim statement's `octet_length(e.payload) <=
/// 65536`; a unit test holds the two together).
pub const INLINE_BODY_BYTES: usize = 64 * 1024;

/// How many times a body's size is reserved: the body (shared by the request, not copied)
/// and the copy the TLS or HTTP stack, or a transformation, may make of it while it is sent.
pub const COPIES: u64 = 2;

/// How long a delivery waits when there was no room or its body could not be read.
pub const RETRY: chrono::Duration = chrono::Duration::seconds(1);

/// The delivery budget of `bytes`.
pub fn delivery_budget(bytes: u64) -> MemoryBudget {
    MemoryBudget::new(bytes, COPIES)
}

/// How long a worker waits for room: a quarter of its lease, so that a claim given back
/// is given back well before the lease would bring it back anyway.
pub fn patience(lease: Duration) -> Duration {
    lease / 4
}

/// Why a claimed delivery was not sent now.
#[derive(Debug)]
pub enum NotHeld {
    /// The budget had no room within [`patience`].
    NoRoom,
    /// Its body could not be read (the database).
    Unreadable(String),
}

impl NotHeld {
    /// The `reason` label of `webhook_gateway_delivery_bodies_given_back_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            NotHeld::NoRoom => "no_room",
            NotHeld::Unreadable(_) => "unreadable_body",
        }
    }
}

/// When the claim did not bring `job`'s body, reserve room for it and read it; the
/// reservation lasts as long as the returned permit (`None`: a small body, which the
/// claim brought and which reserves nothing).
pub async fn hold(ctx: &Context, job: &mut Claimed) -> Result<Option<OwnedSemaphorePermit>, NotHeld> {
    let size = u64::try_from(job.payload_bytes).unwrap_or(0);
    if job.payload.len() as u64 == size {
        return Ok(None);
    }
    let room = ctx.bodies.reserve(size, patience(ctx.settings.lease)).await.ok_or(NotHeld::NoRoom)?;
    let read = tokio::time::timeout(ctx.settings.lease / 4, crate::store::events::payload(&ctx.pool, job.event_id));
    match read.await {
        Ok(Ok(Some(body))) => job.payload = bytes::Bytes::from(body),
        Ok(Ok(None)) => return Err(NotHeld::Unreadable("its event is gone".to_owned())),
        Ok(Err(e)) => return Err(NotHeld::Unreadable(e.to_string())),
        Err(_) => return Err(NotHeld::Unreadable("the database did not answer in time".to_owned())),
    }
    Ok(Some(room))
}

#[cfg(test)]
mod tests {
    /// The claim statements (the general claim's columns, and the claim by key's functions
    /// of migrations 0022 and 0024) bring exactly the bodies this module says they do.
    #[test]
    fn the_claim_brings_bodies_up_to_the_inline_size() {
        let bound = format!("octet_length(e.payload) <= {}", super::INLINE_BODY_BYTES);
        let sql = crate::queue::claimed_columns();
        assert!(sql.contains(&bound), "{sql}");
        for function in [
            include_str!("../../migrations/0022_claim_fresh_in_one_round_trip.sql"),
            include_str!("../../migrations/0024_claim_tokens_a_lost_claim_cannot_repeat.sql"),
        ] {
            assert!(function.contains(&bound), "the claim by key's function inlines other bodies");
        }
    }
}
