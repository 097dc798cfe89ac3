//! The queue's invariants, stated and checked at run time (TigerBeetle's habit), in
//! release builds too, where breaking one would lose or duplicate work:
//!
//! | invariant | checked in |
//! | --- | --- |
//! | [`ONE_OUTCOME_PER_CLAIM`]: a batch of outcomes holds each delivery once | `queue::record` |
//! | [`RECORDED_FROM_BATCH`]: what a record reports written or already written is the batch's, each once | `queue::record` |
//! | [`CLAIMED_ONCE`]: a claim leases each delivery once | `queue::claims` |
//! | [`EACH_EVENT_ANSWERED_ONCE`]: a stored batch answers each of its events once, with distinct new events | `store::events` |
//!
//! Each check is a pass over a batch already in memory. A broken invariant is a bug, not
//! an input: it is logged at error with its name, counted in
//! `webhook_gateway_invariant_violations_total{invariant}`, and the operation fails
//! instead of going on (a record rolls back and the leases bring its deliveries back; a
//! claim's deliveries wait for their leases to end; an ingest batch is answered as not
//! acknowledged, and the producer's retry is answered as a duplicate): work is done again,
//! never lost or done twice behind the gateway's back.

use std::collections::HashSet;
use std::hash::Hash;

/// A batch of outcomes holds each delivery once: two outcomes for one claim would be one
/// attempt recorded twice, or two attempts for one lease.
pub const ONE_OUTCOME_PER_CLAIM: &str = "one_outcome_per_claim";
/// A record reports only deliveries of its batch, each once, as written or as already
/// written, never both.
pub const RECORDED_FROM_BATCH: &str = "recorded_from_batch";
/// A claim leases each delivery once: two leases of one delivery would send it twice at
/// once.
pub const CLAIMED_ONCE: &str = "claimed_once";
/// A stored batch answers each of its events once, and no two new events share an id:
/// an event answered twice, or not at all, is a webhook acknowledged for another's write.
pub const EACH_EVENT_ANSWERED_ONCE: &str = "each_event_answered_once";

/// The metric counting broken invariants, by `invariant`.
pub const VIOLATIONS: &str = "webhook_gateway_invariant_violations_total";

/// A broken invariant: which, and what was seen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invariant `{invariant}` broken: {detail}")]
pub struct Broken {
    /// The invariant's name (one of this module's constants).
    pub invariant: &'static str,
    /// What was seen.
    pub detail: String,
}

/// Check `holds`: when it does not, log and count the broken `invariant` and return it.
pub fn ensure(holds: bool, invariant: &'static str, detail: impl FnOnce() -> String) -> Result<(), Broken> {
    if holds {
        return Ok(());
    }
    let broken = Broken { invariant, detail: detail() };
    tracing::error!(invariant, detail = %broken.detail, "a queue invariant is broken (a bug): the operation is refused");
    metrics::counter!(VIOLATIONS, "invariant" => invariant).increment(1);
    Err(broken)
}

/// Check that `items` holds no value twice, under `invariant`.
pub fn distinct<T: Hash + Eq + std::fmt::Debug>(
    items: impl IntoIterator<Item = T>,
    invariant: &'static str,
) -> Result<(), Broken> {
    distinct_set(items, invariant).map(drop)
}

/// [`distinct`], keeping the set it built (for a caller that looks values up next).
pub fn distinct_set<T: Hash + Eq + std::fmt::Debug>(
    items: impl IntoIterator<Item = T>,
    invariant: &'static str,
) -> Result<HashSet<T>, Broken> {
    // Sized for the items at once: their iterators (a batch's ids) know how many.
    let items = items.into_iter();
    let mut seen = HashSet::with_capacity(items.size_hint().0);
    for item in items {
        if seen.contains(&item) {
            ensure(false, invariant, || format!("{item:?} appears twice"))?;
        }
        seen.insert(item);
    }
    Ok(seen)
}

/// The message prefix a [`Broken`] carries as a database-layer error.
const PREFIX: &str = "invariant broken: ";

impl From<Broken> for sqlx::Error {
    /// As the error of the database call that found it: not a refusal of the database
    /// (never retried as one), and recognised by [`is_broken`].
    fn from(broken: Broken) -> Self {
        sqlx::Error::Protocol(format!("{PREFIX}{broken}"))
    }
}

/// Whether a database-layer error is a broken invariant ([`Broken`] converted).
pub fn is_broken(err: &sqlx::Error) -> bool {
    matches!(err, sqlx::Error::Protocol(message) if message.starts_with(PREFIX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holding_invariant_passes_and_a_broken_one_is_named() {
        assert_eq!(ensure(true, CLAIMED_ONCE, || unreachable!()), Ok(()));
        let broken = ensure(false, CLAIMED_ONCE, || "seen".into()).unwrap_err();
        assert_eq!(broken.invariant, CLAIMED_ONCE);
        assert!(broken.to_string().contains("claimed_once") && broken.to_string().contains("seen"));
    }

    #[test]
    fn distinct_finds_the_repeat() {
        assert_eq!(distinct([1, 2, 3], CLAIMED_ONCE), Ok(()));
        let broken = distinct([1, 2, 1], CLAIMED_ONCE).unwrap_err();
        assert_eq!(broken.detail, "1 appears twice");
    }

    #[test]
    fn a_broken_invariant_stays_recognisable_as_a_database_error() {
        let err: sqlx::Error = Broken { invariant: CLAIMED_ONCE, detail: "x".into() }.into();
        assert!(is_broken(&err));
        assert!(!crate::db::is_unavailable(&err), "never retried as a refusal");
        assert!(!is_broken(&sqlx::Error::Protocol("something else".into())));
    }
}
