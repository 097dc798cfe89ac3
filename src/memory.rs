//! Memory budgets for message bodies: the bytes of bodies one process holds at once are
//! bounded, so a burst of large webhooks cannot grow it until a container's memory limit
//! kills it (and every replica with it, since they all get the same burst).
//!
//! A budget is a semaphore of KiB. Each body reserves its size times the copies of it
//! that holding it costs (measured per use: [`crate::ingest::budget`] for ingest,
//! [`crate::deliver::bodies`] for delivery) and gives the room back when it is dropped.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Reservations are counted in KiB, so a budget may exceed what a `u32` of bytes holds.
const UNIT: u64 = 1024;

/// A budget of bytes for bodies, each counted `copies` times.
#[derive(Debug, Clone)]
pub struct MemoryBudget {
    units: Arc<Semaphore>,
    /// The budget's size in units.
    total: u32,
    bytes: u64,
    copies: u64,
}

impl MemoryBudget {
    /// A budget of `bytes` (at least one unit) for bodies counted `copies` times each.
    pub fn new(bytes: u64, copies: u64) -> MemoryBudget {
        let total = u32::try_from((bytes / UNIT).max(1))
            .unwrap_or(u32::MAX)
            .min(u32::try_from(Semaphore::MAX_PERMITS).unwrap_or(u32::MAX));
        MemoryBudget { units: Arc::new(Semaphore::new(total as usize)), total, bytes, copies: copies.max(1) }
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The units a body of `body_bytes` reserves.
    fn units_of(&self, body_bytes: u64) -> u32 {
        u32::try_from(body_bytes.saturating_mul(self.copies).div_ceil(UNIT).max(1)).unwrap_or(u32::MAX)
    }

    /// Reserve room for a body of `body_bytes` now, or `None` when there is none now (a
    /// body larger than the whole budget never fits).
    pub fn admit(&self, body_bytes: u64) -> Option<OwnedSemaphorePermit> {
        self.units.clone().try_acquire_many_owned(self.units_of(body_bytes)).ok()
    }

    /// Reserve room for a body of `body_bytes`, waiting up to `patience` for it; `None`
    /// when none came. A body larger than the whole budget reserves all of it: it waits
    /// until it is the only one held, so it is delivered, alone.
    pub async fn reserve(&self, body_bytes: u64, patience: Duration) -> Option<OwnedSemaphorePermit> {
        let units = self.units_of(body_bytes).min(self.total);
        tokio::time::timeout(patience, self.units.clone().acquire_many_owned(units)).await.ok()?.ok()
    }

    /// Bytes reserved now (counted copies included).
    pub fn reserved_bytes(&self) -> u64 {
        u64::from(self.total).saturating_sub(self.units.available_permits() as u64) * UNIT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_admitted_while_their_copies_fit_and_room_comes_back_when_dropped() {
        let budget = MemoryBudget::new(16 * 1024 * 1024, 4);
        // 1 MiB bodies count 4 MiB each: four fit, the fifth does not.
        let held: Vec<_> = (0..4).map(|_| budget.admit(1024 * 1024).expect("room")).collect();
        assert!(budget.admit(1024 * 1024).is_none());
        // A small one does not fit either: the budget is spent.
        assert!(budget.admit(10).is_none());
        assert_eq!(budget.reserved_bytes(), 16 * 1024 * 1024);
        drop(held);
        assert!(budget.admit(3 * 1024 * 1024).is_some(), "room again once dropped");
        // Larger than the whole budget: never admitted at once.
        assert!(budget.admit(5 * 1024 * 1024).is_none());
    }

    #[tokio::test]
    async fn a_reservation_waits_for_room_and_a_body_over_the_budget_waits_to_be_alone() {
        let budget = MemoryBudget::new(4 * 1024 * 1024, 1);
        let held = budget.admit(3 * 1024 * 1024).expect("room");
        let short = Duration::from_millis(20);
        assert!(budget.reserve(2 * 1024 * 1024, short).await.is_none(), "no room within its patience");
        let waiting = {
            let budget = budget.clone();
            tokio::spawn(async move { budget.reserve(2 * 1024 * 1024, Duration::from_secs(5)).await.is_some() })
        };
        tokio::time::sleep(short).await;
        drop(held);
        assert!(waiting.await.expect("task"), "room came back, and the waiter got it");
        let huge = budget.reserve(64 * 1024 * 1024, short).await.expect("alone, it fits");
        assert_eq!(budget.reserved_bytes(), 4 * 1024 * 1024);
        assert!(budget.admit(1).is_none());
        drop(huge);
    }
}
