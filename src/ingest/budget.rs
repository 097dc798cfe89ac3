//! Admission by bytes: the webhook bodies one process holds at once are bounded by a
//! memory budget (`--ingest-memory-mib`), so a burst of large webhooks cannot grow the
//! process until a container's memory limit kills it (and every replica with it, since
//! they all get the same burst).
//!
//! A request reserves its declared `Content-Length` (the body limit when it declares none)
//! before a byte of its body is read, and keeps the reservation until it is answered,
//! after its commit. When the budget has no room, it is answered at once with 503
//! `overloaded` and `Retry-After`, its body unread: senders retry webhooks, and nothing
//! was stored. Each body is counted [`COPIES`] times: what holding one costs, measured
//! (bench row 17): the chunks read and the body they are joined into, its parse when the
//! source takes the event type or key from it, and its copy in the statement that stores
//! it (with that statement's buffer growing by doubling).

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How many times a body's size is reserved (see the module's documentation).
pub const COPIES: u64 = 4;

/// Reservations are counted in KiB, so a budget may exceed what a `u32` of bytes holds.
const UNIT: u64 = 1024;

/// The budget: a semaphore of KiB.
#[derive(Debug, Clone)]
pub struct MemoryBudget {
    units: Arc<Semaphore>,
    bytes: u64,
}

impl MemoryBudget {
    /// A budget of `bytes` (at least one unit).
    pub fn new(bytes: u64) -> MemoryBudget {
        let units =
            usize::try_from((bytes / UNIT).max(1)).unwrap_or(Semaphore::MAX_PERMITS).min(Semaphore::MAX_PERMITS);
        MemoryBudget { units: Arc::new(Semaphore::new(units)), bytes }
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Reserve room for a body of `body_bytes`, or `None` when there is none now.
    pub fn admit(&self, body_bytes: u64) -> Option<OwnedSemaphorePermit> {
        let units = u32::try_from(body_bytes.saturating_mul(COPIES).div_ceil(UNIT).max(1)).unwrap_or(u32::MAX);
        self.units.clone().try_acquire_many_owned(units).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_admitted_while_their_copies_fit_and_room_comes_back_when_answered() {
        let budget = MemoryBudget::new(16 * 1024 * 1024);
        // 1 MiB bodies count 4 MiB each: four fit, the fifth does not.
        let held: Vec<_> = (0..4).map(|_| budget.admit(1024 * 1024).expect("room")).collect();
        assert!(budget.admit(1024 * 1024).is_none());
        // A small one does not fit either: the budget is spent.
        assert!(budget.admit(10).is_none());
        drop(held);
        assert!(budget.admit(3 * 1024 * 1024).is_some(), "room again once answered");
        // Larger than the whole budget: never admitted.
        assert!(budget.admit(5 * 1024 * 1024).is_none());
    }
}
