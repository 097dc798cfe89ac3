//! Full-jitter backoff: `delay = random(0, min(cap, base * 2^attempt))`.
//!
//! Not "exponential plus a little noise": with full jitter, a herd of deliveries that
//! failed together spreads over the whole window instead of returning in lockstep and
//! re-killing the endpoint that just recovered.

use std::time::Duration;

use rand::Rng;

/// The upper bound of the window after `attempt` failed attempts: `min(cap, base * 2^attempt)`,
/// exactly, for any attempt number and any durations.
pub fn ceiling(attempt: u32, base: Duration, cap: Duration) -> Duration {
    if base.is_zero() {
        return Duration::ZERO;
    }
    // In nanoseconds: base < 2^94 ns, so the product saturates only where the cap
    // (< 2^94 ns) has long been reached; past 2^127 the factor saturates too.
    let factor = 1u128.checked_shl(attempt).unwrap_or(u128::MAX);
    let nanos = base.as_nanos().saturating_mul(factor);
    if nanos >= cap.as_nanos() {
        return cap;
    }
    // Below the cap, so the seconds fit a u64.
    Duration::new((nanos / 1_000_000_000) as u64, (nanos % 1_000_000_000) as u32)
}

/// A delay drawn uniformly from `[0, ceiling(attempt)]`.
pub fn full_jitter(attempt: u32, base: Duration, cap: Duration, rng: &mut impl Rng) -> Duration {
    let top = ceiling(attempt, base, cap).as_millis().min(u64::MAX as u128) as u64;
    Duration::from_millis(rng.random_range(0..=top))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    const BASE: Duration = Duration::from_secs(5);
    const CAP: Duration = Duration::from_secs(6 * 3600);

    #[test]
    fn ceiling_doubles_until_the_cap() {
        assert_eq!(ceiling(0, BASE, CAP), Duration::from_secs(5));
        assert_eq!(ceiling(1, BASE, CAP), Duration::from_secs(10));
        assert_eq!(ceiling(7, BASE, CAP), Duration::from_secs(640));
        assert_eq!(ceiling(20, BASE, CAP), CAP);
        assert_eq!(ceiling(u32::MAX, BASE, CAP), CAP);
        // The doubling goes on past 2^31 while the cap is above it (found by
        // deliver::tests_props: it used to stop at base * 2^31).
        let ms = Duration::from_millis(1);
        let year = Duration::from_secs(365 * 86_400);
        assert_eq!(ceiling(31, ms, year), Duration::from_millis(1 << 31));
        assert_eq!(ceiling(33, ms, year), Duration::from_millis(1 << 33));
        assert_eq!(ceiling(35, ms, year), year);
        assert_eq!(ceiling(7, Duration::ZERO, year), Duration::ZERO);
    }

    /// Over many draws the delays stay inside `[0, ceiling]` and cover the window
    /// evenly: every decile gets a share, and the mean sits near the middle (a
    /// "base * 2^n + small noise" scheme would cluster at the top and fail this).
    #[test]
    fn draws_are_bounded_and_spread_over_the_whole_window() {
        let mut rng = StdRng::seed_from_u64(7);
        for attempt in [1u32, 3, 6] {
            let top = ceiling(attempt, BASE, CAP).as_millis() as f64;
            let mut deciles = [0usize; 10];
            let n = 20_000;
            let mut sum = 0.0;
            for _ in 0..n {
                let d = full_jitter(attempt, BASE, CAP, &mut rng).as_millis() as f64;
                assert!(d <= top, "attempt {attempt}: {d} > {top}");
                sum += d;
                deciles[((d / top * 10.0) as usize).min(9)] += 1;
            }
            for (i, count) in deciles.iter().enumerate() {
                let share = *count as f64 / n as f64;
                assert!((0.08..0.12).contains(&share), "attempt {attempt}: decile {i} has {share}");
            }
            let mean = sum / n as f64 / top;
            assert!((0.47..0.53).contains(&mean), "attempt {attempt}: mean at {mean} of the window");
        }
    }
}
