//! One attempt of one claimed delivery: open its secrets, send it, judge the answer,
//! schedule what follows, and hand the outcome (with its worker slot) to the recorder.

use std::time::{Duration, SystemTime};

use crate::db::Pool;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use opentelemetry::trace::SpanContext;
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tracing::Instrument as _;
use url::Url;

use super::DeliverySettings;
use super::policy::{self, Decision, NextReason, Observed, Policy, Verdict};
use super::recorder::{Done, Finished, Unsent, UnsentEnd};
use super::request;
use crate::circuit::Signal;
use crate::egress::{EgressClient, ErrorKind, SendError};
use crate::queue::{AttemptRecord, Claimed, Outcome};
use crate::sanitize;
use crate::secrets::{Keyring, Place};
use crate::telemetry;

/// Everything a worker needs.
#[derive(Clone)]
pub struct Context {
    /// The database.
    pub pool: Pool,
    /// The outbound client.
    pub egress: EgressClient,
    /// Delivery settings (budget, backoff, lease).
    pub settings: DeliverySettings,
    /// Where finished attempts go, each with its worker slot.
    pub outcomes: mpsc::Sender<(Done, OwnedSemaphorePermit)>,
    /// Opens the claimed endpoint secrets (encrypted at rest when a key is set).
    pub secrets: Keyring,
    /// Endpoint URLs, parsed once each.
    pub urls: super::urls::UrlCache,
    /// Room for the bodies held by attempts (`super::bodies`).
    pub bodies: crate::memory::MemoryBudget,
}

/// How long a delivery whose signing secret this process cannot open waits before it is
/// due again (no attempt spent: nothing was sent).
pub const UNREADABLE_SECRET_RETRY: chrono::Duration = chrono::Duration::seconds(30);

/// One attempt of one claimed delivery; the slot goes with the outcome to the recorder
/// and is freed once the outcome is written. `claim` is the claim's span context, linked
/// from the attempt's span (tracing on).
pub async fn run(ctx: Context, job: Claimed, slot: OwnedSemaphorePermit, claim: Option<SpanContext>) {
    let span = telemetry::attempt_span(&job, claim.as_ref());
    attempt(ctx, job, slot, span.clone()).instrument(span).await
}

/// An attempt's future on the heap, for `spawn`: the future holds the whole request in
/// flight (several KiB), and a task moved it by value into its cell more than once.
pub fn boxed(attempt: impl Future<Output = ()> + Send + 'static) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(attempt)
}

async fn attempt(ctx: Context, mut job: Claimed, slot: OwnedSemaphorePermit, span: tracing::Span) {
    let began = std::time::Instant::now();
    let settings = &ctx.settings;
    // The budget counts attempts since the last manual redelivery.
    let budget_attempt = job.attempt - job.attempts_base;
    if budget_attempt > settings.max_attempts as i32 {
        // Every budgeted attempt was claimed, and the last one's worker died holding the
        // lease: its outcome is unknown and the budget is spent.
        let reason = format!(
            "attempt budget exhausted ({} attempts); the last attempt's outcome is unknown (its worker's lease expired)",
            settings.max_attempts
        );
        return hand_over(&ctx, &job, UnsentEnd::Bury { reason }, slot).await;
    }
    // The body, held by bytes in flight: reserved, and read when the claim did not bring
    // it. Without room (or readable body) nothing is sent and no attempt is spent.
    let _room = match super::bodies::hold(&ctx, &mut job).await {
        Ok(room) => room,
        Err(why) => {
            match &why {
                super::bodies::NotHeld::NoRoom => tracing::debug!(delivery_id = %job.id, bytes = job.payload_bytes,
                    "no room in the delivery memory budget; given back"),
                super::bodies::NotHeld::Unreadable(e) => tracing::warn!(delivery_id = %job.id, error = %e,
                    "cannot read the delivery's body; given back"),
            }
            crate::metrics::delivery_body_given_back(why.reason());
            let due = crate::clock::now() + super::bodies::RETRY;
            return hand_over(&ctx, &job, UnsentEnd::GiveBack { due }, slot).await;
        }
    };
    // Before the secrets are opened (they borrow the job): the body to sign and send.
    let transformed = transform(&mut job).await;
    // Opened just before signing: a lookup in the keyring's cache after the first claim
    // of an endpoint (no allocation at all without a key).
    let secrets: Result<Vec<_>, _> = std::iter::once(&job.secret)
        .chain(&job.previous_secrets)
        .map(|stored| ctx.secrets.open(Place::EndpointSecret, stored))
        .collect();
    let secrets = match secrets {
        Ok(secrets) => secrets,
        Err(e) => {
            // Never sent unsigned, and not the subscriber's doing: the claim's attempt is
            // given back and the delivery waits. The likely cause is a replica started
            // without the key a newer one wrote with (docs/security.md, "Secrets at rest").
            tracing::error!(delivery_id = %job.id, endpoint_id = %job.endpoint_id, error = %e,
                "cannot read the endpoint's signing secret; not sent, retried without spending an attempt");
            let due = crate::clock::now() + UNREADABLE_SECRET_RETRY;
            return hand_over(&ctx, &job, UnsentEnd::GiveBack { due }, slot).await;
        }
    };
    let secrets: Vec<&str> = secrets.iter().map(AsRef::as_ref).collect();
    if !fits_in_lease(began.elapsed(), ctx.egress.request_timeout(), settings.lease) {
        // The body's room, its read or the transformation took so long that the request
        // could outlast the lease: another worker could then take the delivery over and
        // send it beside this one. Given back unsent instead, due at once.
        tracing::warn!(delivery_id = %job.id, waited = ?began.elapsed(), lease = ?settings.lease,
            "too little of the lease left to send; given back");
        return hand_over(&ctx, &job, UnsentEnd::GiveBack { due: crate::clock::now() }, slot).await;
    }

    let started_at = crate::clock::now();
    let clock = std::time::Instant::now();
    let (observed, status_code, excerpt) = match transformed {
        Ok(()) => send(&ctx.egress, &ctx.urls, &job, &secrets, started_at.timestamp()).await,
        // Nothing sent: dead at once with the reason, not the endpoint's failure.
        Err(refused) => (refused, None, None),
    };
    let duration_ms = clock.elapsed().as_millis().min(i32::MAX as u128) as i32;
    let policy = Policy {
        max_attempts: settings.max_attempts,
        backoff_base: settings.backoff_base,
        backoff_cap: settings.backoff_cap,
        retry_after_cap: settings.retry_after_cap,
    };
    // At least 1: a budget count below it (never written by this release) must not wrap
    // into an attempt past any budget.
    // One clock for both: the database's. A `Retry-After` date is read against it, as the
    // delay it gives is then added to it (read against this host's clock, a retry came as
    // late, or as early, as this host is off).
    let now = crate::clock::now();
    let verdict =
        policy::decide(&policy, &observed, budget_attempt.max(1) as u32, SystemTime::from(now), &mut rand::rng());
    let (outcome, next_attempt_at, next_reason) = schedule(&verdict.decision, now);
    let judged = judge(&observed, &verdict);
    tracing::debug!(delivery_id = %job.id, attempt = job.attempt, outcome = outcome.as_str(), reason = %verdict.reason, "attempt finished");
    span.record("webhook.outcome", outcome.as_str());
    // The attempt's consumer span failed when its delivery is dead (a retry is still on course).
    if matches!(outcome, Outcome::Dead) {
        span.record("otel.status_code", "ERROR");
    }
    crate::metrics::attempt(outcome.as_str(), judged.class, clock.elapsed());
    let record = AttemptRecord {
        delivery_id: job.id,
        claim_token: job.claim_token,
        attempt: job.attempt,
        started_at,
        duration_ms,
        status_code,
        error_kind: judged.error_kind,
        outcome,
        reason: sanitize::bounded(&verdict.reason, sanitize::MAX_REASON_BYTES),
        response_excerpt: excerpt,
        sent_excerpt: job.transform.is_some().then(|| sanitize::stored_text(&job.payload, sanitize::MAX_EXCERPT_BYTES)),
        next_attempt_at,
        next_attempt_reason: next_reason,
        endpoint_id: job.endpoint_id,
        ordered: job.ordered,
    };
    // The span goes with the outcome: it ends once the outcome is recorded.
    let finished = Finished { record, signal: judged.signal, probe_token: job.probe_token, span };
    if ctx.outcomes.send((Done::Attempted(finished), slot)).await.is_err() {
        tracing::error!(delivery_id = %job.id, "outcome recorder is gone; the lease will bring this delivery back");
    }
}

/// Run the delivery's transformation, if it has one, on the transformation threads: the
/// body (and `application/json`) it sends instead of the event's, or why there is none.
async fn transform(job: &mut Claimed) -> Result<(), Observed> {
    let Some(script) = job.transform.as_deref() else {
        // The event's headers come with a delivery made with a transformation (they are
        // its input): one that finds none now lost it with its subscription, deleted
        // since (a cleared transformation lets its deliveries go, `store::subscriptions::
        // update`). Sent as it is, a redaction would be undone: dead-lettered instead.
        if job.event_headers.is_some() {
            return Err(Observed::Refused {
                kind: ErrorKind::Transform,
                message: "transform: the subscription this delivery was made for, and its transformation, were \
                          deleted; not sent untransformed"
                    .to_owned(),
            });
        }
        return Ok(());
    };
    let webhook = crate::transforms::Webhook::new(
        job.payload.clone(),
        job.event_headers.take(),
        job.event_type.clone(),
        Some(job.source_name.clone()),
    );
    match crate::transforms::run(script, webhook).await {
        Ok(body) => {
            job.payload = Bytes::from(body);
            job.content_type = Some("application/json".to_owned());
            Ok(())
        }
        Err(why) => Err(Observed::Refused { kind: ErrorKind::Transform, message: format!("transform: {why}") }),
    }
}

/// What of a lease must be left after the request for its outcome to be recorded.
const RECORD_MARGIN: Duration = Duration::from_secs(5);

/// Whether a request sent `waited` into a claim's `lease` ends, at worst (its whole
/// `request_timeout`), with [`RECORD_MARGIN`] of the lease still left. (`--lease-secs`
/// is at least the request timeout and 10 s, so at the shortest lease this allows 5 s
/// between the claim and the send.)
fn fits_in_lease(waited: Duration, request_timeout: Duration, lease: Duration) -> bool {
    waited + request_timeout + RECORD_MARGIN <= lease
}

/// Hand a claim that sent nothing to the recorder, which ends it (`end`) without spending
/// its attempt.
async fn hand_over(ctx: &Context, job: &Claimed, end: UnsentEnd, slot: OwnedSemaphorePermit) {
    let unsent = Unsent { delivery_id: job.id, claim_token: job.claim_token, end };
    if ctx.outcomes.send((Done::Unsent(unsent), slot)).await.is_err() {
        tracing::error!(delivery_id = %job.id, "outcome recorder is gone; the lease will bring this delivery back");
    }
}

/// What an attempt says beyond the verdict: about the endpoint, and for the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Judgement {
    /// What the attempt says about the endpoint's health (for its circuit).
    pub signal: Signal,
    /// The error kind stored with the attempt (no response came back).
    pub error_kind: Option<ErrorKind>,
    /// The metrics class: `2xx` ... `5xx`, or the error kind. A static label: the
    /// metrics registry then keys the counter without allocating (a `format!` and a
    /// clone of it at every attempt before).
    pub class: &'static str,
}

/// A status code's class, `1xx` to `9xx` (the codes HTTP can carry, 100 to 999).
fn status_class(status: u16) -> &'static str {
    const CLASSES: [&str; 10] = ["other", "1xx", "2xx", "3xx", "4xx", "5xx", "6xx", "7xx", "8xx", "9xx"];
    CLASSES.get(usize::from(status / 100)).copied().unwrap_or("other")
}

/// Judge an attempt: an egress refusal says nothing about the endpoint; otherwise the
/// verdict says whether the endpoint failed.
pub fn judge(observed: &Observed, verdict: &Verdict) -> Judgement {
    let signal = match (observed, verdict.endpoint_failure) {
        (Observed::Refused { .. }, _) => Signal::Neutral,
        (_, true) => Signal::Failure,
        (_, false) => Signal::Healthy,
    };
    let error_kind = match observed {
        Observed::Transport { kind, .. } | Observed::Refused { kind, .. } => Some(*kind),
        Observed::Response { .. } => None,
    };
    let class = match (observed, error_kind) {
        (Observed::Response { status, .. }, _) => status_class(*status),
        (_, Some(kind)) => kind.as_str(),
        (_, None) => "other",
    };
    Judgement { signal, error_kind, class }
}

/// What follows a decision taken at `now`: the outcome to record and, for a retry, when
/// and why the next attempt is due. The delay is bounded by the configured caps; the add
/// is checked anyway, so an absurd cap cannot panic the worker and lose the outcome (a
/// century is "never" for a retry).
pub fn schedule(decision: &Decision, now: DateTime<Utc>) -> (Outcome, Option<DateTime<Utc>>, Option<NextReason>) {
    match decision {
        Decision::Delivered => (Outcome::Delivered, None, None),
        Decision::Dead => (Outcome::Dead, None, None),
        Decision::Retry { delay, why } => {
            let century = chrono::Duration::days(36_500);
            let delay = chrono::Duration::from_std(*delay).unwrap_or(century).min(century);
            let at = now.checked_add_signed(delay).unwrap_or(DateTime::<Utc>::MAX_UTC);
            (Outcome::Retry, Some(at), Some(*why))
        }
    }
}

/// Send one attempt signed with `secrets`; never fails: every way it can go wrong is an
/// [`Observed`].
async fn send(
    egress: &EgressClient,
    urls: &super::urls::UrlCache,
    job: &Claimed,
    secrets: &[&str],
    timestamp: i64,
) -> (Observed, Option<i32>, Option<String>) {
    let url = match urls.parse(&job.url) {
        Ok(url) => url,
        Err(e) => {
            return (
                Observed::Refused { kind: ErrorKind::InvalidUrl, message: format!("invalid_url: {e}") },
                None,
                None,
            );
        }
    };
    let span = telemetry::client_span(&url);
    let mut headers = request::headers(job, secrets, timestamp);
    // Tracing off: no trace headers at all (see README, Tracing).
    if let Some(traceparent) = telemetry::traceparent_of(&span) {
        headers.insert(http::HeaderName::from_static("traceparent"), traceparent);
    }
    let (observed, status, excerpt) =
        exchange(egress, &url, headers, job.payload.clone()).instrument(span.clone()).await;
    if !span.is_none() {
        match (&observed, status) {
            (_, Some(status)) => {
                span.record("http.response.status_code", i64::from(status));
                // The HTTP conventions: a client span with a 4xx or 5xx answer failed.
                if status >= 400 {
                    span.record("error.type", status.to_string());
                    span.record("otel.status_code", "ERROR");
                }
            }
            (Observed::Transport { kind, .. } | Observed::Refused { kind, .. }, None) => {
                span.record("error.type", kind.as_str());
                span.record("otel.status_code", "ERROR");
            }
            _ => {}
        }
    }
    (observed, status, excerpt)
}

async fn exchange(
    egress: &EgressClient,
    url: &Url,
    headers: http::HeaderMap,
    payload: Bytes,
) -> (Observed, Option<i32>, Option<String>) {
    match egress.post(url, headers, payload).await {
        Ok(response) => {
            let status = response.status().as_u16();
            let retry_after = response.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned);
            // Quoted in the stored reason: repaired and bounded like any subscriber text.
            let location = response
                .headers()
                .get("location")
                .map(|v| sanitize::stored_text(v.as_bytes(), sanitize::MAX_LOCATION_BYTES));
            let excerpt = request::read_excerpt(response).await;
            let excerpt = (!excerpt.is_empty()).then_some(excerpt);
            (Observed::Response { status, retry_after, location }, Some(status as i32), excerpt)
        }
        Err(SendError::Refused(refusal)) => {
            (Observed::Refused { kind: refusal.kind(), message: refusal.to_string() }, None, None)
        }
        Err(e) => (Observed::Transport { kind: e.kind(), message: e.to_string() }, None, None),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_request_is_sent_only_when_it_ends_within_the_lease_with_room_to_record() {
        let s = Duration::from_secs;
        // The shortest lease the configuration allows: 5 s between claim and send.
        assert!(fits_in_lease(s(0), s(15), s(25)));
        assert!(fits_in_lease(s(5), s(15), s(25)));
        assert!(!fits_in_lease(s(6), s(15), s(25)));
        // The defaults (60 s lease): waits for the body's room and its read (a quarter of
        // the lease each) still send.
        assert!(fits_in_lease(s(30), s(15), s(60)));
        assert!(!fits_in_lease(s(41), s(15), s(60)));
    }

    fn verdict(decision: Decision, endpoint_failure: bool) -> Verdict {
        Verdict { decision, reason: String::new(), endpoint_failure }
    }

    #[test]
    fn judgement_follows_what_was_observed() {
        let response = |status| Observed::Response { status, retry_after: None, location: None };
        let ok = judge(&response(204), &verdict(Decision::Delivered, false));
        assert_eq!(ok, Judgement { signal: Signal::Healthy, error_kind: None, class: "2xx" });
        let down = judge(&response(503), &verdict(Decision::Dead, true));
        assert_eq!((down.signal, down.class), (Signal::Failure, "5xx"));
        // Every class is the status's first digit and `xx`, as `format!` wrote it.
        for status in [100, 199, 200, 302, 404, 500, 599, 600, 999] {
            assert_eq!(judge(&response(status), &verdict(Decision::Dead, true)).class, format!("{}xx", status / 100));
        }
        let timeout = Observed::Transport { kind: ErrorKind::Timeout, message: "timeout: slow".into() };
        let t = judge(&timeout, &verdict(Decision::Dead, true));
        assert_eq!(t, Judgement { signal: Signal::Failure, error_kind: Some(ErrorKind::Timeout), class: "timeout" });
        // A refusal is not the endpoint's doing, whatever the verdict says.
        let refused =
            Observed::Refused { kind: ErrorKind::ForbiddenAddress, message: "forbidden_address: 10.0.0.1".into() };
        let r = judge(&refused, &verdict(Decision::Dead, true));
        assert_eq!(
            r,
            Judgement {
                signal: Signal::Neutral,
                error_kind: Some(ErrorKind::ForbiddenAddress),
                class: "forbidden_address"
            }
        );
    }

    #[test]
    fn a_retry_is_due_after_its_delay_and_never_overflows() {
        let now = Utc::now();
        let retry = Decision::Retry { delay: Duration::from_secs(90), why: NextReason::RetryAfter };
        assert_eq!(
            schedule(&retry, now),
            (Outcome::Retry, Some(now + chrono::Duration::seconds(90)), Some(NextReason::RetryAfter))
        );
        assert_eq!(schedule(&Decision::Delivered, now), (Outcome::Delivered, None, None));
        assert_eq!(schedule(&Decision::Dead, now), (Outcome::Dead, None, None));
        let absurd = Decision::Retry { delay: Duration::MAX, why: NextReason::Backoff };
        let (_, at, _) = schedule(&absurd, now);
        assert_eq!(at, Some(now + chrono::Duration::days(36_500)));
        let (_, at, _) = schedule(&absurd, DateTime::<Utc>::MAX_UTC - chrono::Duration::days(1));
        assert_eq!(at, Some(DateTime::<Utc>::MAX_UTC));
    }
}
