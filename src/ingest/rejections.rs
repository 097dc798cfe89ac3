//! Refused webhooks: counted per source and reason, and logged without flooding the logs.
//!
//! Every webhook refused by verification on an existing source is counted under
//! `(source name, reason code)` in a process-wide registry that a metrics exporter reads
//! with [`snapshot`]. Only names of stored sources reach it (the handler looks the source
//! up first, and unknown names answer 404 without being counted), and the codes are the
//! few of [`VerifyError::code`], so the key set is small; [`MAX_KEYS`] bounds it anyway.
//!
//! A flood of forged requests must not flood the logs: each key logs at most one warning
//! per [`LOG_INTERVAL`], and that line says how many refusals were suppressed since the
//! previous one. Lines carry the source, the reason code and the verifier's message, which
//! names headers and schemes but never a secret or a signature value.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::verify::VerifyError;

/// At most one log line per `(source, reason)` per this interval.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// At most this many `(source, reason)` pairs are counted separately; refusals under a new
/// pair beyond it are counted in [`Snapshot::overflow`] instead.
pub const MAX_KEYS: usize = 10_000;

/// The log rate limiter of one key: a pure state machine, the clock is passed in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogLimiter {
    last_logged: Option<Instant>,
    suppressed: u64,
}

impl LogLimiter {
    /// Account for one event at `now`. `Some(n)`: log a line now, saying that `n` events
    /// were suppressed since the previous line. `None`: stay quiet; the event is counted
    /// as suppressed and reported by the next line.
    ///
    /// The first event logs; later ones log once `interval` has passed since the last
    /// line. A `now` earlier than the last line (a clock that went back) counts as no
    /// time passed, so it never opens a burst.
    pub fn admit(&mut self, now: Instant, interval: Duration) -> Option<u64> {
        match self.last_logged {
            Some(last) if now.saturating_duration_since(last) < interval => {
                self.suppressed = self.suppressed.saturating_add(1);
                None
            }
            _ => {
                self.last_logged = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// One counter of a [`Snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RejectionCount {
    /// The refusing source's stored name (only existing sources are counted).
    pub source: String,
    /// Reason code (`invalid_signature`, `missing_signature`, ...).
    pub reason: &'static str,
    /// Refusals since the process started.
    pub count: u64,
}

/// The counters at one instant.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// One entry per `(source, reason)` seen, ordered by source then reason.
    pub counts: Vec<RejectionCount>,
    /// Refusals not counted per key because [`MAX_KEYS`] pairs were already in use.
    pub overflow: u64,
}

impl Snapshot {
    /// The count of one `(source, reason)`, 0 when never seen.
    pub fn count(&self, source: &str, reason: &str) -> u64 {
        self.counts.iter().find(|c| c.source == source && c.reason == reason).map_or(0, |c| c.count)
    }
}

#[derive(Debug, Default)]
struct Entry {
    count: u64,
    log: LogLimiter,
}

/// What [`Registry::record`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Recorded {
    /// `Some(suppressed)` when a line should be logged now.
    log: Option<u64>,
    /// The refusal went to the overflow counter.
    overflow: bool,
}

/// Counters and limiters by source, then reason (nested so that a lookup needs no
/// allocation: a flood of forged requests costs no more than the HMAC it fails).
#[derive(Debug)]
struct Registry {
    max_keys: usize,
    keys: usize,
    by_source: HashMap<String, HashMap<&'static str, Entry>>,
    overflow: Entry,
}

impl Registry {
    fn new(max_keys: usize) -> Self {
        Registry { max_keys, keys: 0, by_source: HashMap::new(), overflow: Entry::default() }
    }

    fn record(&mut self, source: &str, reason: &'static str, now: Instant, interval: Duration) -> Recorded {
        let known = self.by_source.get(source).is_some_and(|reasons| reasons.contains_key(reason));
        let slot = if known {
            self.by_source.get_mut(source).and_then(|reasons| reasons.get_mut(reason))
        } else if self.keys < self.max_keys {
            self.keys += 1;
            Some(self.by_source.entry(source.to_owned()).or_default().entry(reason).or_default())
        } else {
            None
        };
        // Past the cap every new pair shares one counter and one limiter: still counted,
        // still logged at most once per interval.
        let (entry, overflow) = match slot {
            Some(entry) => (entry, false),
            None => (&mut self.overflow, true),
        };
        entry.count = entry.count.saturating_add(1);
        Recorded { log: entry.log.admit(now, interval), overflow }
    }

    fn snapshot(&self) -> Snapshot {
        let mut counts: Vec<RejectionCount> = self
            .by_source
            .iter()
            .flat_map(|(source, reasons)| {
                reasons.iter().map(|(reason, entry)| RejectionCount {
                    source: source.clone(),
                    reason,
                    count: entry.count,
                })
            })
            .collect();
        counts.sort_by(|a, b| (&a.source, a.reason).cmp(&(&b.source, b.reason)));
        Snapshot { counts, overflow: self.overflow.count }
    }
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(|| Mutex::new(Registry::new(MAX_KEYS)));

/// Count a webhook refused by verification on source `source`, and log it unless this
/// `(source, reason)` already logged within [`LOG_INTERVAL`].
///
/// `source` must be the name of an existing source (it becomes a metrics label).
pub fn record(source: &str, error: &VerifyError) {
    let reason = error.code().as_str();
    // A panic elsewhere while holding the lock leaves plain counters, still usable.
    let recorded =
        REGISTRY.lock().unwrap_or_else(PoisonError::into_inner).record(source, reason, Instant::now(), LOG_INTERVAL);
    crate::metrics::rejected(if recorded.overflow { "_overflow" } else { source }, reason);
    crate::operational::tally::TALLY.refused(source, reason, crate::clock::now().timestamp().div_euclid(60));
    // Logged after the lock is released. The message is the verifier's, which by its
    // contract never contains a secret or a signature.
    if let Some(suppressed) = recorded.log {
        if recorded.overflow {
            tracing::warn!(source, reason, suppressed, detail = %error,
                "webhook refused (rejection counters full: counted as overflow)");
        } else {
            tracing::warn!(source, reason, suppressed, detail = %error, "webhook refused");
        }
    }
}

/// The current counters, for a metrics exporter.
pub fn snapshot() -> Snapshot {
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner).snapshot()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEN: Duration = LOG_INTERVAL;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn first_event_logs_then_the_interval_suppresses() {
        let t0 = Instant::now();
        let mut l = LogLimiter::default();
        assert_eq!(l.admit(t0, TEN), Some(0));
        assert_eq!(l.admit(t0, TEN), None);
        assert_eq!(l.admit(t0 + Duration::from_millis(9_999), TEN), None);
        // Exactly one interval after the last line: log, reporting the two suppressed.
        assert_eq!(l.admit(t0 + TEN, TEN), Some(2));
        // The interval restarts at that line, not at the first one.
        assert_eq!(l.admit(t0 + secs(19), TEN), None);
        assert_eq!(l.admit(t0 + secs(20), TEN), Some(1));
        // After a quiet spell, the next event logs at once with nothing suppressed.
        assert_eq!(l.admit(t0 + secs(3_600), TEN), Some(0));
    }

    #[test]
    fn a_clock_going_back_never_opens_a_burst() {
        let t0 = Instant::now() + secs(100);
        let mut l = LogLimiter::default();
        assert_eq!(l.admit(t0, TEN), Some(0));
        assert_eq!(l.admit(t0 - secs(50), TEN), None);
        assert_eq!(l.admit(t0 + TEN, TEN), Some(1));
    }

    #[test]
    fn a_flood_logs_once_per_interval_and_loses_no_count() {
        // One forged request per millisecond for a minute.
        let t0 = Instant::now();
        let mut l = LogLimiter::default();
        let mut lines = Vec::new();
        for ms in 0..60_000u64 {
            if let Some(suppressed) = l.admit(t0 + Duration::from_millis(ms), TEN) {
                lines.push((ms, suppressed));
            }
        }
        assert_eq!(
            lines,
            vec![(0, 0), (10_000, 9_999), (20_000, 9_999), (30_000, 9_999), (40_000, 9_999), (50_000, 9_999)]
        );
        // Every event is either a line or counted in one: 6 lines + 49,995 reported + the
        // 9,999 since the last line, which the next line will report.
        let reported: u64 = lines.iter().map(|(_, s)| s).sum();
        assert_eq!(lines.len() as u64 + reported + l.suppressed, 60_000);
    }

    #[test]
    fn keys_are_counted_and_limited_independently() {
        let t0 = Instant::now();
        let mut r = Registry::new(100);
        let logged = |r: &mut Registry, source, reason, at| r.record(source, reason, at, TEN).log;
        assert_eq!(logged(&mut r, "shop", "invalid_signature", t0), Some(0));
        assert_eq!(logged(&mut r, "shop", "invalid_signature", t0), None);
        // Another reason on the same source, and the same reason on another source, have
        // their own limiters: one noisy pair does not hide another.
        assert_eq!(logged(&mut r, "shop", "timestamp_out_of_tolerance", t0), Some(0));
        assert_eq!(logged(&mut r, "crm", "invalid_signature", t0), Some(0));
        assert_eq!(logged(&mut r, "shop", "invalid_signature", t0 + TEN), Some(1));
        let snap = r.snapshot();
        assert_eq!(
            snap.counts,
            vec![
                RejectionCount { source: "crm".into(), reason: "invalid_signature", count: 1 },
                RejectionCount { source: "shop".into(), reason: "invalid_signature", count: 3 },
                RejectionCount { source: "shop".into(), reason: "timestamp_out_of_tolerance", count: 1 },
            ]
        );
        assert_eq!(snap.count("shop", "invalid_signature"), 3);
        assert_eq!(snap.count("shop", "missing_signature"), 0);
        assert_eq!(snap.overflow, 0);
    }

    #[test]
    fn keys_beyond_the_cap_share_the_overflow_counter() {
        let t0 = Instant::now();
        let mut r = Registry::new(2);
        r.record("a", "invalid_signature", t0, TEN);
        r.record("a", "missing_signature", t0, TEN);
        let first = r.record("b", "invalid_signature", t0, TEN);
        assert_eq!(first, Recorded { log: Some(0), overflow: true });
        let second = r.record("c", "invalid_signature", t0, TEN);
        assert_eq!(second, Recorded { log: None, overflow: true }, "the overflow is rate-limited too");
        // Keys already known keep counting.
        assert_eq!(r.record("a", "invalid_signature", t0, TEN), Recorded { log: None, overflow: false });
        let snap = r.snapshot();
        assert_eq!(snap.counts.len(), 2);
        assert_eq!(snap.count("a", "invalid_signature"), 2);
        assert_eq!(snap.count("b", "invalid_signature"), 0);
        assert_eq!(snap.overflow, 2);
    }

    #[test]
    fn the_global_registry_counts_what_record_sees() {
        // A name no other test uses: the registry is process-wide.
        let source = "rejections-unit-test-source";
        let before = snapshot().count(source, "missing_signature");
        for _ in 0..3 {
            record(source, &VerifyError::MissingSignature("header X is absent".into()));
        }
        assert_eq!(snapshot().count(source, "missing_signature"), before + 3);
    }
}
