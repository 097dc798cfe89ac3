//! Warnings that come in floods, thinned out: during a database outage every request
//! fails the same way (the HA drill logged 18,800 lines in an 11 s failover), which buries
//! the lines that matter and costs I/O when it can least be afforded. A [`Throttle`]
//! admits the first occurrence, then at most one per interval, and says how many it left
//! out. The answers themselves and the metrics still count every one.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

static ORIGIN: LazyLock<Instant> = LazyLock::new(Instant::now);

/// At most one admitted occurrence per interval.
pub struct Throttle {
    interval_ms: u64,
    /// When the next occurrence may be admitted (ms since [`ORIGIN`]).
    next_ms: AtomicU64,
    skipped: AtomicU64,
}

impl Throttle {
    /// A throttle admitting at most one occurrence per `interval`.
    pub const fn new(interval: Duration) -> Throttle {
        Throttle { interval_ms: interval.as_millis() as u64, next_ms: AtomicU64::new(0), skipped: AtomicU64::new(0) }
    }

    /// `Some(n)` when this occurrence is to be logged, `n` being how many were left out
    /// since the last one logged; `None` when it is left out.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(ORIGIN.elapsed().as_millis() as u64)
    }

    fn admit_at(&self, now_ms: u64) -> Option<u64> {
        let next = self.next_ms.load(Ordering::Relaxed);
        if now_ms >= next
            && self
                .next_ms
                .compare_exchange(next, now_ms + self.interval_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.skipped.swap(0, Ordering::Relaxed));
        }
        self.skipped.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// The interval of the gateway's throttled warnings.
pub const INTERVAL: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_is_admitted_then_one_per_interval_with_the_count_left_out() {
        let throttle = Throttle::new(Duration::from_millis(1000));
        assert_eq!(throttle.admit_at(10), Some(0));
        assert_eq!(throttle.admit_at(20), None);
        assert_eq!(throttle.admit_at(999), None);
        assert_eq!(throttle.admit_at(1010), Some(2));
        assert_eq!(throttle.admit_at(1500), None);
        assert_eq!(throttle.admit_at(5000), Some(1));
    }

    #[test]
    fn racing_threads_admit_one_per_interval() {
        let throttle = std::sync::Arc::new(Throttle::new(Duration::from_secs(3600)));
        let admitted: usize = (0..8)
            .map(|_| {
                let throttle = throttle.clone();
                std::thread::spawn(move || (0..1000).filter(|_| throttle.admit_at(7).is_some()).count())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("thread"))
            .sum();
        assert_eq!(admitted, 1);
        assert_eq!(throttle.admit_at(3_600_007), Some(7999));
    }
}
