//! Per-endpoint circuit breaker, shared by every worker of every replica (the state is a
//! row in PostgreSQL).
//!
//! - **closed**: deliveries flow. `threshold` consecutive endpoint failures (retryable
//!   kinds only: permanent 4xx and egress refusals are not the endpoint being down) open
//!   it.
//! - **open**: nothing is sent. The claim parks the endpoint's due deliveries without
//!   spending an attempt. After the cool-down (`cooldown · 2^(opens-1)`, capped) the
//!   circuit is **half-open**.
//! - **half-open**: exactly one probe is admitted, by an atomic claim on the endpoint row
//!   with a lease (`probe_until`), so a crashed prober can't wedge the circuit. The
//!   probe's outcome is fenced by `probe_token`. Healthy: closed, counters reset, and the
//!   parked backlog is released at a bounded rate. Failed: open again, longer cool-down.
//!
//! This module is the pure transition function; `sql` holds its statements.

pub mod sql;

use std::time::Duration;

use crate::ids::EndpointId;
use chrono::{DateTime, Utc};

/// Breaker settings.
#[derive(Debug, Clone, Copy)]
pub struct CircuitConfig {
    /// Consecutive endpoint failures that open the circuit.
    pub failure_threshold: u32,
    /// First cool-down; doubles with each re-open.
    pub cooldown: Duration,
    /// Longest cool-down.
    pub cooldown_cap: Duration,
    /// Parked deliveries released per second after the circuit closes (or the endpoint
    /// resumes), so a recovering subscriber is not hit by its whole backlog at once.
    pub release_per_sec: u32,
}

impl Default for CircuitConfig {
    fn default() -> Self {
        CircuitConfig {
            failure_threshold: 5,
            cooldown: Duration::from_secs(30),
            cooldown_cap: Duration::from_secs(600),
            release_per_sec: 200,
        }
    }
}

impl CircuitConfig {
    /// The cool-down after the `opens`-th consecutive open (1-based).
    pub fn cooldown_for(&self, opens: u32) -> Duration {
        let factor = 1u32.checked_shl(opens.saturating_sub(1).min(31)).unwrap_or(u32::MAX);
        self.cooldown.saturating_mul(factor).min(self.cooldown_cap)
    }
}

/// The stored state of a circuit (`endpoints.circuit_state`). Half-open is not stored: it
/// is an open circuit whose cool-down has ended (see [`Circuit::display_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    /// Deliveries flow.
    Closed,
    /// Nothing is sent; due deliveries are parked.
    Open,
}

crate::db::text_enum!(CircuitState { Closed => "closed", Open => "open" });

/// A circuit as operators see it: half-open is an open circuit whose cool-down is over
/// (the next claim admits its one probe).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CircuitDisplay {
    /// Deliveries flow.
    Closed,
    /// Cooling down: nothing is sent.
    Open,
    /// One probe may be sent.
    HalfOpen,
}

impl CircuitDisplay {
    /// The Prometheus gauge value of `webhook_gateway_circuit_state`.
    pub fn gauge(self) -> f64 {
        match self {
            CircuitDisplay::Closed => 0.0,
            CircuitDisplay::Open => 1.0,
            CircuitDisplay::HalfOpen => 2.0,
        }
    }
}

/// The stored state of one endpoint's circuit.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Circuit {
    /// Closed or open.
    pub circuit_state: CircuitState,
    /// Consecutive endpoint failures.
    pub consecutive_failures: i32,
    /// Opens since last closed.
    pub open_count: i32,
    /// When it last opened.
    pub opened_at: Option<DateTime<Utc>>,
    /// End of the cool-down.
    pub reopen_at: Option<DateTime<Utc>>,
    /// Fencing token of the current probe.
    pub probe_token: i64,
    /// Lease of the current probe.
    pub probe_until: Option<DateTime<Utc>>,
}

impl Circuit {
    /// A closed circuit with no failures.
    pub fn closed() -> Circuit {
        Circuit {
            circuit_state: CircuitState::Closed,
            consecutive_failures: 0,
            open_count: 0,
            opened_at: None,
            reopen_at: None,
            probe_token: 0,
            probe_until: None,
        }
    }

    /// Closed, open or half-open, as operators see it at `now`.
    pub fn display_state(&self, now: DateTime<Utc>) -> CircuitDisplay {
        match (self.circuit_state, self.reopen_at) {
            (CircuitState::Open, Some(at)) if at <= now => CircuitDisplay::HalfOpen,
            (CircuitState::Open, _) => CircuitDisplay::Open,
            (CircuitState::Closed, _) => CircuitDisplay::Closed,
        }
    }
}

/// How one attempt bears on its endpoint's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// The endpoint answered (2xx, or a permanent 4xx: it is up, just unhappy).
    Healthy,
    /// A retryable failure: 5xx, 408/425/429, timeout, connection or TLS failure, 3xx.
    Failure,
    /// Says nothing about the endpoint (egress refused to send).
    Neutral,
}

/// What a batch of outcomes observed for one endpoint, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observation {
    /// Whether any ordinary attempt was healthy.
    pub any_healthy: bool,
    /// Failures after the last healthy attempt (all of them when none was healthy).
    pub trailing_failures: u32,
    /// The probe's outcome and token, if this batch holds a probe.
    pub probe: Option<(i64, Signal)>,
}

impl Observation {
    /// Whether this can change even a circuit at rest (closed, no failures on record):
    /// it ends in failures, or holds a probe. Otherwise [`apply`] changes only a circuit
    /// that is not at rest (`sql::circuit_unsettled`).
    pub fn stirs(&self) -> bool {
        self.trailing_failures > 0 || self.probe.is_some()
    }

    /// Fold one attempt into the observation.
    pub fn add(&mut self, signal: Signal, probe_token: Option<i64>) {
        if let Some(token) = probe_token {
            self.probe = Some((token, signal));
            return;
        }
        match signal {
            Signal::Healthy => {
                self.any_healthy = true;
                self.trailing_failures = 0;
            }
            Signal::Failure => self.trailing_failures += 1,
            Signal::Neutral => {}
        }
    }
}

/// What changed, beyond the new state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Nothing to write.
    None,
    /// Counters changed.
    Updated,
    /// The circuit opened (from closed).
    Opened,
    /// A probe failed: open again, longer cool-down.
    Reopened,
    /// A probe succeeded: closed; release the parked backlog.
    Closed,
}

/// A change kept in the circuit's history (`circuit_transitions.change`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transitioned {
    /// It opened (from closed).
    Opened,
    /// A half-open probe failed: open again.
    Reopened,
    /// A half-open probe succeeded: closed.
    Closed,
}

crate::db::text_enum!(Transitioned { Opened => "opened", Reopened => "reopened", Closed => "closed" });

impl Change {
    /// What the circuit's history keeps of this change, if anything.
    pub fn recorded(self) -> Option<Transitioned> {
        match self {
            Change::Opened => Some(Transitioned::Opened),
            Change::Reopened => Some(Transitioned::Reopened),
            Change::Closed => Some(Transitioned::Closed),
            Change::Updated | Change::None => None,
        }
    }
}

/// Whether `observations` can change any circuit, given the endpoints among them whose
/// circuit is not at rest (`unsettled`, as the outcome write read them): when not, the
/// recorder skips [`sql::observe`] and its round trip.
pub fn can_change(
    observations: &std::collections::BTreeMap<EndpointId, Observation>,
    unsettled: &[EndpointId],
) -> bool {
    observations.iter().any(|(id, seen)| seen.stirs() || unsettled.contains(id))
}

/// The transition function.
pub fn apply(current: &Circuit, seen: &Observation, now: DateTime<Utc>, cfg: &CircuitConfig) -> (Circuit, Change) {
    let mut next = current.clone();
    let open_until = |opens: i32| now + chrono::Duration::from_std(cfg.cooldown_for(opens as u32)).unwrap_or_default();

    if let Some((token, signal)) = seen.probe
        && current.circuit_state == CircuitState::Open
        && token == current.probe_token
    {
        next.probe_until = None;
        return match signal {
            Signal::Healthy => (Circuit { probe_token: current.probe_token, ..Circuit::closed() }, Change::Closed),
            Signal::Failure => {
                next.open_count = current.open_count + 1;
                next.opened_at = Some(now);
                next.reopen_at = Some(open_until(next.open_count));
                (next, Change::Reopened)
            }
            // Let another probe try at once.
            Signal::Neutral => (next, Change::Updated),
        };
    }

    let failures = if seen.any_healthy {
        seen.trailing_failures as i32
    } else {
        current.consecutive_failures.saturating_add(seen.trailing_failures as i32)
    };
    next.consecutive_failures = failures;
    if current.circuit_state == CircuitState::Closed && failures >= cfg.failure_threshold as i32 {
        next.circuit_state = CircuitState::Open;
        next.open_count = 1;
        next.opened_at = Some(now);
        next.reopen_at = Some(open_until(1));
        next.probe_until = None;
        return (next, Change::Opened);
    }
    let change = if next == *current { Change::None } else { Change::Updated };
    (next, change)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> CircuitConfig {
        CircuitConfig {
            failure_threshold: 5,
            cooldown: Duration::from_secs(30),
            cooldown_cap: Duration::from_secs(600),
            release_per_sec: 200,
        }
    }

    fn seen(signals: &[Signal]) -> Observation {
        let mut o = Observation::default();
        for s in signals {
            o.add(*s, None);
        }
        o
    }

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap()
    }

    /// What lets the recorder skip the circuit's update: every batch of up to six
    /// attempts that does not [`Observation::stirs`] leaves a circuit at rest as it is,
    /// under any threshold; and one that stirs, or a circuit not at rest, is looked at.
    #[test]
    fn only_a_stirring_batch_or_an_unsettled_circuit_can_change() {
        let signals = [Signal::Healthy, Signal::Failure, Signal::Neutral];
        let endpoint = EndpointId(uuid::Uuid::from_u128(1));
        let (mut quiet, mut stirring) = (0, 0);
        for len in 0..=6u32 {
            for code in 0..3usize.pow(len) {
                let batch: Vec<Signal> = (0..len).map(|i| signals[code / 3usize.pow(i) % 3]).collect();
                let seen = seen(&batch);
                let one = std::collections::BTreeMap::from([(endpoint, seen.clone())]);
                assert!(can_change(&one, &[endpoint]), "an unsettled circuit is always looked at");
                if seen.stirs() {
                    stirring += 1;
                    assert!(can_change(&one, &[]), "{batch:?}");
                    continue;
                }
                quiet += 1;
                assert!(!can_change(&one, &[]), "{batch:?}");
                for threshold in [1, 2, 5] {
                    let c = CircuitConfig { failure_threshold: threshold, ..cfg() };
                    let (_, change) = apply(&Circuit::closed(), &seen, now(), &c);
                    assert_eq!(change, Change::None, "{batch:?} changed a circuit at rest");
                }
            }
        }
        assert!(quiet > 0 && stirring > 0, "{quiet} quiet, {stirring} stirring batches");
        let mut probe = Observation::default();
        probe.add(Signal::Healthy, Some(7));
        assert!(probe.stirs(), "a probe is always looked at");
    }

    #[test]
    fn cooldown_doubles_up_to_the_cap() {
        let c = cfg();
        let secs: Vec<u64> = (1..=7).map(|n| c.cooldown_for(n).as_secs()).collect();
        assert_eq!(secs, [30, 60, 120, 240, 480, 600, 600]);
        assert_eq!(c.cooldown_for(u32::MAX).as_secs(), 600);
    }

    #[test]
    fn threshold_consecutive_failures_open_the_circuit() {
        let c = cfg();
        let (four, change) = apply(&Circuit::closed(), &seen(&[Signal::Failure; 4]), now(), &c);
        assert_eq!((four.consecutive_failures, change), (4, Change::Updated));
        assert_eq!(four.circuit_state, CircuitState::Closed);
        let (open, change) = apply(&four, &seen(&[Signal::Failure]), now(), &c);
        assert_eq!(change, Change::Opened);
        assert_eq!(open.circuit_state, CircuitState::Open);
        assert_eq!(open.open_count, 1);
        assert_eq!(open.reopen_at, Some(now() + chrono::Duration::seconds(30)));
        assert_eq!(open.display_state(now()), CircuitDisplay::Open);
        assert_eq!(open.display_state(now() + chrono::Duration::seconds(30)), CircuitDisplay::HalfOpen);
    }

    #[test]
    fn a_healthy_answer_resets_the_count_and_only_trailing_failures_count() {
        let c = cfg();
        let start = Circuit { consecutive_failures: 4, ..Circuit::closed() };
        let (after, _) = apply(&start, &seen(&[Signal::Failure, Signal::Healthy, Signal::Failure]), now(), &c);
        assert_eq!(after.consecutive_failures, 1);
        assert_eq!(after.circuit_state, CircuitState::Closed);
        let (same, change) = apply(&Circuit::closed(), &seen(&[Signal::Healthy, Signal::Neutral]), now(), &c);
        assert_eq!((same, change), (Circuit::closed(), Change::None));
    }

    #[test]
    fn neutral_signals_neither_count_nor_reset() {
        let c = cfg();
        let start = Circuit { consecutive_failures: 4, ..Circuit::closed() };
        let (after, change) = apply(&start, &seen(&[Signal::Neutral; 10]), now(), &c);
        assert_eq!((after.consecutive_failures, change), (4, Change::None));
    }

    fn half_open(token: i64, opens: i32) -> Circuit {
        Circuit {
            circuit_state: CircuitState::Open,
            consecutive_failures: 5,
            open_count: opens,
            opened_at: Some(now() - chrono::Duration::seconds(60)),
            reopen_at: Some(now() - chrono::Duration::seconds(1)),
            probe_token: token,
            probe_until: Some(now() + chrono::Duration::seconds(60)),
        }
    }

    #[test]
    fn a_healthy_probe_closes_the_circuit() {
        let mut o = Observation::default();
        o.add(Signal::Healthy, Some(7));
        let (closed, change) = apply(&half_open(7, 3), &o, now(), &cfg());
        assert_eq!(change, Change::Closed);
        assert_eq!(closed.circuit_state, CircuitState::Closed);
        assert_eq!((closed.consecutive_failures, closed.open_count), (0, 0));
        assert_eq!(closed.probe_until, None);
    }

    #[test]
    fn a_failed_probe_reopens_with_a_doubled_cooldown() {
        let mut o = Observation::default();
        o.add(Signal::Failure, Some(7));
        let (open, change) = apply(&half_open(7, 1), &o, now(), &cfg());
        assert_eq!(change, Change::Reopened);
        assert_eq!(open.open_count, 2);
        assert_eq!(open.reopen_at, Some(now() + chrono::Duration::seconds(60)));
        assert_eq!(open.probe_until, None);
    }

    #[test]
    fn a_stale_probe_is_fenced_and_a_neutral_probe_frees_the_slot() {
        let mut stale = Observation::default();
        stale.add(Signal::Healthy, Some(6));
        let (state, change) = apply(&half_open(7, 1), &stale, now(), &cfg());
        assert_eq!(state.circuit_state, CircuitState::Open, "an old probe's success does not close the circuit");
        assert_ne!(change, Change::Closed);

        let mut neutral = Observation::default();
        neutral.add(Signal::Neutral, Some(7));
        let (state, change) = apply(&half_open(7, 1), &neutral, now(), &cfg());
        assert_eq!((state.circuit_state, change), (CircuitState::Open, Change::Updated));
        assert_eq!(state.probe_until, None);
    }

    #[test]
    fn failures_while_open_do_not_reopen_or_extend() {
        let open = half_open(7, 2);
        let (after, change) = apply(&open, &seen(&[Signal::Failure; 3]), now(), &cfg());
        assert_eq!(after.reopen_at, open.reopen_at);
        assert_eq!(after.open_count, 2);
        assert_eq!(change, Change::Updated);
    }
}
