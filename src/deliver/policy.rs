//! The outcome policy: given what the subscriber (or the network) said on attempt `n`,
//! what happens next. A pure function, tested row by row.
//!
//! | subscriber says | gateway does |
//! | --- | --- |
//! | 2xx | delivered |
//! | 400, 401, 403, 404, 405, 410, 413, 415, 422 and other 4xx below | dead at once |
//! | 408, 425, 5xx, timeout, DNS, connect, TLS | retry with full-jitter backoff |
//! | 429 or 503 with `Retry-After` | retry at the time asked for (capped) |
//! | 3xx | not followed; retried like a 5xx, Location in the reason |
//! | forbidden address (egress refusal) | dead at once; not a circuit failure |
//! | anything else (1xx as a final answer, 600-999) | retried like a 5xx |
//!
//! Every retryable row counts as a failure of the endpoint for the circuit, and ends dead
//! once the attempt budget is spent. The property tests in `tests_props.rs` check this
//! table for every status code 100..=999.

use std::time::{Duration, SystemTime};

use rand::Rng;

use super::backoff;
use crate::egress::ErrorKind;

/// What an attempt observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// An HTTP response arrived.
    Response {
        /// Status code.
        status: u16,
        /// Raw `Retry-After` header, if any.
        retry_after: Option<String>,
        /// Raw `Location` header, if any.
        location: Option<String>,
    },
    /// No response: the network failed (`kind` is the egress error kind).
    Transport {
        /// `timeout`, `connect`, `dns`, `tls` or `other`.
        kind: ErrorKind,
        /// The whole error, e.g. `timeout: operation timed out`.
        message: String,
    },
    /// Egress policy refused the destination; nothing was sent.
    Refused {
        /// `forbidden_address`, `forbidden_scheme`, `invalid_url`.
        kind: ErrorKind,
        /// `forbidden_address: 169.254.169.254 is link-local`, ...
        message: String,
    },
}

/// The knobs of the policy.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Attempts per delivery (counted since the last manual redelivery).
    pub max_attempts: u32,
    /// Full-jitter backoff: the first window (doubling with each attempt).
    pub backoff_base: Duration,
    /// Full-jitter backoff: the largest window.
    pub backoff_cap: Duration,
    /// Longest honoured Retry-After.
    pub retry_after_cap: Duration,
}

/// Why the next attempt is when it is (`attempts.next_attempt_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NextReason {
    /// Full-jitter backoff.
    Backoff,
    /// The subscriber's `Retry-After`.
    RetryAfter,
}

crate::db::text_enum!(NextReason { Backoff => "backoff", RetryAfter => "retry_after" });

/// What happens next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Done.
    Delivered,
    /// Try again after `delay`.
    Retry {
        /// How long to wait.
        delay: Duration,
        /// Why that long.
        why: NextReason,
    },
    /// No more automatic attempts.
    Dead,
}

/// The verdict on one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// What happens next.
    pub decision: Decision,
    /// Human-readable reason, stored with the attempt (and as the dead reason).
    pub reason: String,
    /// Whether this counts as a failure of the endpoint for the circuit breaker
    /// (retryable failures do; permanent 4xx and egress refusals do not).
    pub endpoint_failure: bool,
}

/// Whether a 4xx is worth retrying: the request may succeed later unchanged.
fn retryable_4xx(status: u16) -> bool {
    matches!(status, 408 | 425 | 429)
}

/// Decide what follows attempt number `attempt` (1-based).
pub fn decide(policy: &Policy, observed: &Observed, attempt: u32, now: SystemTime, rng: &mut impl Rng) -> Verdict {
    let (reason, retry_after) = match observed {
        Observed::Response { status, .. } if (200..300).contains(status) => {
            return Verdict {
                decision: Decision::Delivered,
                reason: format!("HTTP {status}"),
                endpoint_failure: false,
            };
        }
        Observed::Response { status, .. } if (400..500).contains(status) && !retryable_4xx(*status) => {
            return Verdict {
                decision: Decision::Dead,
                reason: format!("HTTP {status}: permanent client error, not retried"),
                endpoint_failure: false,
            };
        }
        Observed::Refused { message, .. } => {
            return Verdict { decision: Decision::Dead, reason: message.clone(), endpoint_failure: false };
        }
        Observed::Response { status, location, .. } if (300..400).contains(status) => {
            let to = location.as_deref().unwrap_or("(none)");
            (format!("HTTP {status}: redirect not followed (Location: {to})"), None)
        }
        Observed::Response { status, retry_after, .. } => {
            let honoured = if matches!(status, 429 | 503) {
                retry_after.as_deref().and_then(|raw| parse_retry_after(raw, now))
            } else {
                None
            };
            (format!("HTTP {status}"), honoured)
        }
        Observed::Transport { message, .. } => (message.clone(), None),
    };
    if attempt >= policy.max_attempts {
        return Verdict {
            decision: Decision::Dead,
            reason: format!("attempt budget exhausted ({} attempts); last: {reason}", policy.max_attempts),
            endpoint_failure: true,
        };
    }
    let (delay, why) = match retry_after {
        Some(asked) => (asked.min(policy.retry_after_cap), NextReason::RetryAfter),
        None => (backoff::full_jitter(attempt, policy.backoff_base, policy.backoff_cap, rng), NextReason::Backoff),
    };
    Verdict { decision: Decision::Retry { delay, why }, reason, endpoint_failure: true }
}

/// `Retry-After` as delta-seconds or an HTTP date (RFC 9110 §10.2.3), relative to `now`.
/// A date in the past means "now".
///
/// Delta-seconds are digits only (`1*DIGIT`: no sign). More seconds than a `u64` holds
/// saturate, so the caller's cap applies: a subscriber asking for a very long pause gets
/// the longest one we honour, not an immediate backoff retry.
pub fn parse_retry_after(raw: &str, now: SystemTime) -> Option<Duration> {
    let raw = raw.trim();
    if !raw.is_empty() && raw.bytes().all(|b| b.is_ascii_digit()) {
        // All digits, so parsing fails only on overflow.
        return Some(Duration::from_secs(raw.parse::<u64>().unwrap_or(u64::MAX)));
    }
    let at = httpdate::parse_http_date(raw).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    const POLICY: Policy = Policy {
        max_attempts: 8,
        backoff_base: Duration::from_secs(5),
        backoff_cap: Duration::from_secs(3600),
        retry_after_cap: Duration::from_secs(86_400),
    };

    fn response(status: u16) -> Observed {
        Observed::Response { status, retry_after: None, location: None }
    }

    fn verdict(observed: &Observed, attempt: u32) -> Verdict {
        decide(
            &POLICY,
            observed,
            attempt,
            SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000),
            &mut StdRng::seed_from_u64(1),
        )
    }

    #[test]
    fn two_hundreds_are_delivered() {
        for status in [200, 201, 202, 204, 299] {
            assert_eq!(verdict(&response(status), 1).decision, Decision::Delivered, "{status}");
        }
    }

    #[test]
    fn permanent_client_errors_die_at_once_and_are_not_endpoint_failures() {
        for status in [400, 401, 403, 404, 405, 409, 410, 413, 415, 422, 451] {
            let v = verdict(&response(status), 1);
            assert_eq!(v.decision, Decision::Dead, "{status}");
            assert!(v.reason.contains("permanent"), "{}", v.reason);
            assert!(!v.endpoint_failure);
        }
    }

    #[test]
    fn transient_failures_retry_within_the_backoff_window() {
        let cases = [
            response(408),
            response(425),
            response(429),
            response(500),
            response(502),
            response(503),
            Observed::Transport { kind: ErrorKind::Timeout, message: "operation timed out".into() },
            Observed::Transport { kind: ErrorKind::Connect, message: "connection refused".into() },
            Observed::Transport { kind: ErrorKind::Dns, message: "no address".into() },
            Observed::Transport { kind: ErrorKind::Tls, message: "bad certificate".into() },
        ];
        for observed in cases {
            for attempt in 1..8 {
                let v = verdict(&observed, attempt);
                let Decision::Retry { delay, why } = v.decision else { panic!("{observed:?} -> {v:?}") };
                assert_eq!(why, NextReason::Backoff);
                assert!(delay <= backoff::ceiling(attempt, POLICY.backoff_base, POLICY.backoff_cap));
                assert!(v.endpoint_failure);
            }
        }
    }

    #[test]
    fn redirects_are_not_followed_and_name_the_location() {
        let v = verdict(
            &Observed::Response { status: 302, retry_after: None, location: Some("http://127.0.0.1/".into()) },
            1,
        );
        assert!(matches!(v.decision, Decision::Retry { .. }));
        assert_eq!(v.reason, "HTTP 302: redirect not followed (Location: http://127.0.0.1/)");
    }

    #[test]
    fn retry_after_is_honoured_for_429_and_503_only() {
        let with = |status, raw: &str| Observed::Response { status, retry_after: Some(raw.into()), location: None };
        assert_eq!(
            verdict(&with(503, "120"), 1).decision,
            Decision::Retry { delay: Duration::from_secs(120), why: NextReason::RetryAfter }
        );
        // 1_000_000 s after the epoch is Mon, 12 Jan 1970 13:46:40 GMT.
        assert_eq!(
            verdict(&with(429, "Mon, 12 Jan 1970 13:48:40 GMT"), 1).decision,
            Decision::Retry { delay: Duration::from_secs(120), why: NextReason::RetryAfter }
        );
        assert_eq!(
            verdict(&with(429, "Thu, 01 Jan 1970 00:00:00 GMT"), 1).decision,
            Decision::Retry { delay: Duration::ZERO, why: NextReason::RetryAfter }
        );
        let capped = verdict(&with(503, "9999999"), 1).decision;
        assert_eq!(capped, Decision::Retry { delay: POLICY.retry_after_cap, why: NextReason::RetryAfter });
        // More seconds than a u64 holds is still a (very long) Retry-After, capped; found
        // by deliver::tests_props (it used to fall back to the backoff curve).
        let huge = verdict(&with(429, "123456789012345678901234567890"), 1).decision;
        assert_eq!(huge, Decision::Retry { delay: POLICY.retry_after_cap, why: NextReason::RetryAfter });
        // Delta-seconds are digits only.
        assert!(matches!(verdict(&with(503, "+120"), 1).decision, Decision::Retry { why: NextReason::Backoff, .. }));
        assert!(matches!(verdict(&with(500, "120"), 1).decision, Decision::Retry { why: NextReason::Backoff, .. }));
        assert!(matches!(verdict(&with(503, "soon"), 1).decision, Decision::Retry { why: NextReason::Backoff, .. }));
    }

    #[test]
    fn the_budget_ends_in_dead_with_the_last_reason() {
        let v = verdict(&response(500), 8);
        assert_eq!(v.decision, Decision::Dead);
        assert_eq!(v.reason, "attempt budget exhausted (8 attempts); last: HTTP 500");
        assert!(matches!(verdict(&response(500), 7).decision, Decision::Retry { .. }));
    }

    #[test]
    fn egress_refusals_die_and_do_not_count_against_the_endpoint() {
        let v = verdict(
            &Observed::Refused {
                kind: ErrorKind::ForbiddenAddress,
                message: "forbidden_address: 169.254.169.254 is link-local".into(),
            },
            1,
        );
        assert_eq!(v.decision, Decision::Dead);
        assert_eq!(v.reason, "forbidden_address: 169.254.169.254 is link-local");
        assert!(!v.endpoint_failure);
    }
}
