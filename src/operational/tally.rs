//! This process's refused webhooks per source and minute, for the `source.refusing` check.
//! Each replica counts what it refused itself (the counters live in memory, like the
//! rejection metrics); the event's dedupe key is the source and the minute, so the first
//! replica over the threshold reports it and the others' reports of that minute are
//! duplicates.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

/// Sources counted at most in one minute (a flood of unknown names is not counted: only
/// existing sources get here).
const MAX_SOURCES: usize = 1000;

/// Refusals of one source in one minute.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Refusals {
    /// Refused webhooks.
    pub total: u64,
    /// By reason (the verifier's error code: `signature_mismatch`, `timestamp_out_of_tolerance` ...).
    pub reasons: HashMap<&'static str, u64>,
}

/// Refusals per source in the current minute.
#[derive(Debug, Default)]
pub struct Tally(Mutex<Option<(i64, HashMap<String, Refusals>)>>);

/// This process's tally, fed by `ingest::rejections::record`.
pub static TALLY: Tally = Tally::new();

impl Tally {
    /// An empty tally.
    pub const fn new() -> Tally {
        Tally(Mutex::new(None))
    }

    /// Count a refusal of `source` for `reason`, in the minute `minute` (Unix minutes).
    pub fn refused(&self, source: &str, reason: &'static str, minute: i64) {
        let mut guard = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let (at, counts) = guard.get_or_insert_with(|| (minute, HashMap::new()));
        if *at != minute {
            // A new minute: the last one's counts are dropped unless taken already; the
            // publisher takes them every few seconds.
            *at = minute;
            counts.clear();
        }
        if counts.len() >= MAX_SOURCES && !counts.contains_key(source) {
            return;
        }
        let entry = counts.entry(source.to_owned()).or_default();
        entry.total += 1;
        *entry.reasons.entry(reason).or_default() += 1;
    }

    /// The counts of the minute `minute` (so far) with at least `threshold` refusals.
    pub fn over(&self, minute: i64, threshold: u64) -> Vec<(String, Refusals)> {
        let guard = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match guard.as_ref() {
            Some((at, counts)) if *at == minute => {
                counts.iter().filter(|(_, r)| r.total >= threshold).map(|(s, r)| (s.clone(), r.clone())).collect()
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_counted_per_source_and_minute() {
        let tally = Tally::new();
        let m = 29_000_000;
        for _ in 0..3 {
            tally.refused("tally-a", "signature_mismatch", m);
        }
        tally.refused("tally-a", "timestamp_out_of_tolerance", m);
        tally.refused("tally-b", "signature_mismatch", m);
        let over3 = tally.over(m, 3);
        assert_eq!(over3.len(), 1);
        assert_eq!(over3[0].0, "tally-a");
        assert_eq!(over3[0].1.total, 4);
        assert_eq!(over3[0].1.reasons["signature_mismatch"], 3);
        // A new minute starts afresh.
        tally.refused("tally-b", "signature_mismatch", m + 1);
        assert!(tally.over(m, 1).is_empty());
        assert_eq!(tally.over(m + 1, 1).len(), 1);
    }
}
