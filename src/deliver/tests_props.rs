//! Property tests of the pure delivery decisions: `Retry-After` parsing, the response
//! policy over every status code and every kind of observation, and the backoff window.

use std::time::{Duration, SystemTime};

use proptest::prelude::*;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::backoff::{ceiling, full_jitter};
use super::policy::{Decision, NextReason, Observed, Policy, decide, parse_retry_after};
use crate::egress::ErrorKind;
use crate::props::config;

/// Durations from nothing to `Duration::MAX`, biased towards realistic ones.
fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        4 => (0u64..=86_400_000).prop_map(Duration::from_millis),
        1 => any::<u64>().prop_map(Duration::from_secs),
        1 => (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
        1 => Just(Duration::ZERO),
        1 => Just(Duration::MAX),
        1 => (0u64..1_000).prop_map(Duration::from_nanos),
    ]
}

/// An instant between 1900 and 9999, whole seconds or not.
fn instant() -> impl Strategy<Value = SystemTime> {
    (-2_208_988_800i64..=253_402_300_799, 0u32..1_000_000_000).prop_map(|(secs, nanos)| {
        let base = if secs >= 0 {
            SystemTime::UNIX_EPOCH + Duration::from_secs(secs as u64)
        } else {
            SystemTime::UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
        };
        base + Duration::from_nanos(u64::from(nanos))
    })
}

/// `Retry-After` values: delta-seconds (small, huge, past `u64`), HTTP dates around
/// `now`, and garbage.
fn retry_after() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<u64>().prop_map(|n| n.to_string()),
        (0u64..100_000).prop_map(|n| n.to_string()),
        "[0-9]{1,60}",
        "[ \t]{0,3}[0-9]{1,25}[ \t]{0,3}",
        "[+-][0-9]{1,5}",
        "[0-9]{1,5}(\\.[0-9]{1,3}|e[0-9]|s| [0-9])",
        (-400_000_000i64..400_000_000).prop_map(|offset| {
            // Relative to a fixed instant; the tests pick `now` independently.
            let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
            let at = if offset >= 0 {
                at + Duration::from_secs(offset as u64)
            } else {
                at - Duration::from_secs(offset.unsigned_abs())
            };
            httpdate::fmt_http_date(at)
        }),
        "(Mon|Sun|Fri), [0-9]{1,2} (Jan|Feb|Dec|Xyz) [0-9]{1,5} [0-9]{2}:[0-9]{2}:[0-9]{2} (GMT|UTC)",
        "\\PC{0,40}",
        "[ -~]{0,40}",
        (1usize..64).prop_map(|kib| "9".repeat(kib * 1024)),
    ]
}

fn policy() -> impl Strategy<Value = Policy> {
    (prop_oneof![1u32..=20, Just(u32::MAX)], duration(), duration(), duration()).prop_map(
        |(max_attempts, backoff_base, backoff_cap, retry_after_cap)| Policy {
            max_attempts,
            backoff_base,
            backoff_cap,
            retry_after_cap,
        },
    )
}

/// `base * 2^attempt`, capped, computed exactly (the model of [`ceiling`]).
fn ceiling_model(attempt: u32, base: Duration, cap: Duration) -> Duration {
    let factor = if attempt >= 128 { u128::MAX } else { 1u128 << attempt };
    let nanos = base.as_nanos().saturating_mul(factor);
    if base.is_zero() {
        Duration::ZERO
    } else if nanos >= cap.as_nanos() {
        cap
    } else {
        Duration::new((nanos / 1_000_000_000) as u64, (nanos % 1_000_000_000) as u32)
    }
}

proptest! {
    #![proptest_config(config(1024))]

    /// Any string at any instant: no panic, and a value only for delta-seconds (digits
    /// only, however many) or an HTTP date.
    #[test]
    fn retry_after_never_panics_and_accepts_only_its_two_forms(raw in retry_after(), now in instant()) {
        let parsed = parse_retry_after(&raw, now);
        let trimmed = raw.trim();
        let digits = !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit());
        let date = httpdate::parse_http_date(trimmed).is_ok();
        prop_assert_eq!(parsed.is_some(), digits || date, "{:?} -> {:?}", raw, parsed);
    }

    /// Delta-seconds come back as that many seconds, with surrounding whitespace; past
    /// `u64::MAX` they saturate (and the policy caps them) instead of being ignored.
    #[test]
    fn delta_seconds_round_trip_and_saturate(n in any::<u64>(), extra in "[0-9]{0,40}", ows in "[ \t]{0,2}", now in instant()) {
        let raw = format!("{ows}{n}{ows}");
        prop_assert_eq!(parse_retry_after(&raw, now), Some(Duration::from_secs(n)));
        let longer = format!("{n}{extra}");
        let expected = longer.parse::<u64>().map_or(Duration::from_secs(u64::MAX), Duration::from_secs);
        prop_assert_eq!(parse_retry_after(&longer, now), Some(expected));
        let padded = format!("{}{n}", "0".repeat(extra.len()));
        prop_assert_eq!(parse_retry_after(&padded, now), Some(Duration::from_secs(n)));
    }

    /// An HTTP date (IMF-fixdate or asctime) `d` seconds after a whole-second `now` comes
    /// back as `d`; a date in the past as zero.
    #[test]
    fn http_dates_round_trip(now_secs in 0u64..=250_000_000_000, d in 0u64..=400_000_000, past in any::<bool>(), asctime in any::<bool>()) {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(now_secs);
        let at = if past { now.checked_sub(Duration::from_secs(d)) } else { Some(now + Duration::from_secs(d)) };
        let Some(at) = at.filter(|t| *t >= SystemTime::UNIX_EPOCH && *t < SystemTime::UNIX_EPOCH + Duration::from_secs(253_402_300_800)) else {
            return Ok(());
        };
        let raw = if asctime {
            chrono::DateTime::<chrono::Utc>::from(at).format("%a %b %e %H:%M:%S %Y").to_string()
        } else {
            httpdate::fmt_http_date(at)
        };
        let expected = if past { Duration::ZERO } else { Duration::from_secs(d) };
        prop_assert_eq!(parse_retry_after(&raw, now), Some(expected), "{}", raw);
    }

    /// The policy table, for every status code 100..=999 and for transport failures and
    /// egress refusals, at any attempt, under any knobs:
    /// - 2xx: delivered, not an endpoint failure;
    /// - 4xx other than 408/425/429: dead at once, not an endpoint failure;
    /// - egress refusal: dead at once with its message, not an endpoint failure;
    /// - everything else (1xx, 3xx, 408, 425, 429, 5xx, 600-999, transport): retried
    ///   while the budget lasts, then dead; an endpoint failure either way;
    /// - `Retry-After` is honoured for 429 and 503 only, and capped; every other delay is
    ///   the backoff window's, never above its cap.
    #[test]
    fn the_policy_follows_its_table(
        policy in policy(),
        attempt in prop_oneof![0u32..=25, Just(u32::MAX)],
        retry_after in proptest::option::of(retry_after()),
        location in proptest::option::of("\\PC{0,64}"),
        now in instant(),
        seed in any::<u64>(),
        transport in ("timeout|connect|dns|tls|other", "\\PC{0,64}"),
        refusal in "\\PC{0,64}",
    ) {
        let mut rng = StdRng::seed_from_u64(seed);
        let budget_left = attempt < policy.max_attempts;
        let mut cases: Vec<Observed> = (100u16..=999)
            .map(|status| Observed::Response { status, retry_after: retry_after.clone(), location: location.clone() })
            .collect();
        let kind = [ErrorKind::Timeout, ErrorKind::Connect, ErrorKind::Dns, ErrorKind::Tls, ErrorKind::Other]
            .into_iter()
            .find(|k| k.as_str() == transport.0)
            .unwrap();
        cases.push(Observed::Transport { kind, message: transport.1.clone() });
        cases.push(Observed::Refused { kind: ErrorKind::ForbiddenAddress, message: refusal.clone() });
        for observed in &cases {
            let v = decide(&policy, observed, attempt, now, &mut rng);
            let status = match observed {
                Observed::Response { status, .. } => Some(*status),
                _ => None,
            };
            match (observed, status) {
                (_, Some(200..=299)) => {
                    prop_assert_eq!(&v.decision, &Decision::Delivered, "{:?}", observed);
                    prop_assert!(!v.endpoint_failure);
                    prop_assert_eq!(v.reason, format!("HTTP {}", status.unwrap()));
                }
                (_, Some(s @ 400..=499)) if !matches!(s, 408 | 425 | 429) => {
                    prop_assert_eq!(&v.decision, &Decision::Dead, "{}", s);
                    prop_assert!(!v.endpoint_failure);
                    prop_assert!(v.reason.contains("permanent"), "{}", v.reason);
                }
                (Observed::Refused { message, .. }, _) => {
                    prop_assert_eq!(&v.decision, &Decision::Dead);
                    prop_assert!(!v.endpoint_failure);
                    prop_assert_eq!(&v.reason, message);
                }
                _ => {
                    prop_assert!(v.endpoint_failure, "{:?}", observed);
                    if let Some(s @ 300..=399) = status {
                        let to = location.as_deref().unwrap_or("(none)");
                        prop_assert!(v.reason.contains(&format!("HTTP {s}: redirect not followed (Location: {to})")), "{}", v.reason);
                    }
                    if !budget_left {
                        prop_assert_eq!(&v.decision, &Decision::Dead, "{:?} at {} of {}", observed, attempt, policy.max_attempts);
                        prop_assert!(v.reason.starts_with("attempt budget exhausted"), "{}", v.reason);
                        continue;
                    }
                    let Decision::Retry { delay, why } = v.decision else {
                        return Err(TestCaseError::fail(format!("{observed:?} at {attempt}: {:?}", v.decision)));
                    };
                    let honoured = match (status, &retry_after) {
                        (Some(429 | 503), Some(raw)) => parse_retry_after(raw, now),
                        _ => None,
                    };
                    match honoured {
                        Some(asked) => {
                            prop_assert_eq!(why, NextReason::RetryAfter);
                            prop_assert_eq!(delay, asked.min(policy.retry_after_cap));
                        }
                        None => {
                            prop_assert_eq!(why, NextReason::Backoff, "{:?}", observed);
                            prop_assert!(delay <= ceiling(attempt, policy.backoff_base, policy.backoff_cap));
                            prop_assert!(delay <= policy.backoff_cap);
                        }
                    }
                }
            }
        }
    }

    /// The backoff window is `min(cap, base * 2^attempt)` exactly, for any attempt number
    /// and any durations, grows with the attempt, and every draw lies inside it.
    #[test]
    fn backoff_is_bounded_and_never_overflows(
        attempt in prop_oneof![0u32..=40, 40u32..=200, Just(u32::MAX)],
        base in duration(),
        cap in duration(),
        seed in any::<u64>(),
    ) {
        let top = ceiling(attempt, base, cap);
        prop_assert_eq!(top, ceiling_model(attempt, base, cap), "attempt {} base {:?} cap {:?}", attempt, base, cap);
        prop_assert!(top <= cap);
        prop_assert!(ceiling(attempt.saturating_add(1), base, cap) >= top);
        let mut rng = StdRng::seed_from_u64(seed);
        for _ in 0..16 {
            let d = full_jitter(attempt, base, cap, &mut rng);
            prop_assert!(d <= top, "{:?} > {:?}", d, top);
        }
    }
}
