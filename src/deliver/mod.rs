//! Delivery workers: claim due deliveries, POST them, record the outcome.
//!
//! One dispatcher per process owns `workers` slots (a semaphore). It claims only as many
//! deliveries as it has free slots, and starts each claimed delivery at once: nothing is
//! claimed and then left waiting (a claimed row that is not being worked on would sit
//! out its lease for nothing). The claim, the HTTP request and the record are three
//! separate steps with no transaction held across the request.

pub mod backoff;
pub mod policy;
pub mod recorder;
pub mod request;
pub mod sign;
#[cfg(test)]
mod tests_props;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use url::Url;

use crate::circuit::Signal;
use crate::config::DeliverySettings;
use crate::egress::{EgressClient, SendError};
use crate::queue::{self, AttemptRecord, Claimed, Outcome};
use crate::sanitize;
use crate::secrets::{Keyring, Place};
use policy::{Decision, Observed, Policy};

/// Most deliveries claimed by one statement.
pub const MAX_CLAIM_BATCH: usize = 128;

/// Everything a worker needs.
#[derive(Clone)]
struct Context {
    pool: PgPool,
    egress: EgressClient,
    settings: DeliverySettings,
    outcomes: mpsc::Sender<(AttemptRecord, OwnedSemaphorePermit)>,
    /// Opens the claimed endpoint secrets (encrypted at rest when a key is set).
    secrets: Keyring,
}

/// A running dispatcher. [`Dispatcher::shutdown`] stops claiming, lets in-flight requests
/// finish (up to the grace period), records them and returns.
pub struct Dispatcher {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Dispatcher {
    /// Start the dispatcher. `wake` is notified when new deliveries were created; `secrets`
    /// opens the endpoint secrets each claim returns.
    pub fn spawn(
        pool: PgPool,
        egress: EgressClient,
        settings: DeliverySettings,
        wake: Arc<Notify>,
        secrets: Keyring,
    ) -> Dispatcher {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run(pool, egress, settings, wake, secrets, stopped));
        Dispatcher { stop, task }
    }

    /// Graceful stop.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        if let Err(e) = self.task.await {
            tracing::error!(error = %e, "delivery dispatcher panicked");
        }
    }
}

async fn run(
    pool: PgPool,
    egress: EgressClient,
    settings: DeliverySettings,
    wake: Arc<Notify>,
    secrets: Keyring,
    mut stop: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(settings.workers));
    let (outcomes, records) = mpsc::channel(settings.workers.max(16));
    let patience = recorder::Patience { lease: settings.lease, stopping: stop.clone() };
    let recorder = tokio::spawn(recorder::run(pool.clone(), records, settings.circuit, patience));
    let ctx = Context { pool: pool.clone(), egress, settings: settings.clone(), outcomes, secrets };
    let mut in_flight = JoinSet::new();
    let mut claim_failures = 0u32;
    let mut last_probe_check = tokio::time::Instant::now() - PROBE_CHECK_INTERVAL;
    tracing::info!(workers = settings.workers, "delivery workers started");

    loop {
        // Wait for a free slot (or shutdown).
        let first = tokio::select! {
            permit = slots.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = stop.wait_for(|s| *s) => break,
        };
        while in_flight.try_join_next().is_some() {}
        let want = (1 + slots.available_permits()).min(MAX_CLAIM_BATCH);
        // Raced against stop: a claim sent into a network partition must not hold
        // shutdown until the connection gives up. A claim that committed unseen is a
        // crashed claim: its lease brings the rows back.
        let claimed = tokio::select! {
            claimed = claim(&pool, want, &settings, &mut last_probe_check) => claimed,
            _ = stop.wait_for(|s| *s) => break,
        };
        let claimed = match claimed {
            Ok(claimed) => {
                claim_failures = 0;
                claimed
            }
            Err(e) => {
                claim_failures += 1;
                let pause = Duration::from_millis(100 * 2u64.pow(claim_failures.min(6)));
                tracing::warn!(error = %e, retry_in = ?pause, "claiming deliveries failed");
                drop(first);
                if sleep_or_stop(pause, &mut stop).await {
                    break;
                }
                continue;
            }
        };
        // Fewer than asked: no more due work right now.
        let drained = claimed.len() < want;
        let mut permits = std::iter::once(first).chain(std::iter::from_fn(|| slots.clone().try_acquire_owned().ok()));
        for job in claimed {
            // Only this loop acquires slots, and it counted them: a permit is there.
            let Some(permit) = permits.next() else {
                tracing::error!(delivery_id = %job.id, "no free slot for a claimed delivery; its lease will bring it back");
                continue;
            };
            in_flight.spawn(attempt(ctx.clone(), job, permit));
        }
        drop(permits);
        if drained {
            // No more due work: sleep until woken by ingest, the poll interval, or stop.
            tokio::select! {
                () = wake.notified() => {}
                () = tokio::time::sleep(settings.poll_interval) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
    }

    let in_flight_now = in_flight.len();
    if in_flight_now > 0 {
        tracing::info!(in_flight = in_flight_now, grace = ?settings.shutdown_grace, "waiting for in-flight deliveries");
    }
    let finished =
        tokio::time::timeout(settings.shutdown_grace, async { while in_flight.join_next().await.is_some() {} }).await;
    if finished.is_err() {
        tracing::warn!(
            unfinished = in_flight.len(),
            "shutdown grace expired; unfinished deliveries will be retried when their leases end"
        );
        in_flight.abort_all();
        while in_flight.join_next().await.is_some() {}
    }
    drop(ctx);
    if let Err(e) = recorder.await {
        tracing::error!(error = %e, "outcome recorder panicked");
    }
    tracing::info!("delivery workers stopped");
}

/// How often a dispatcher parks blocked endpoints' due deliveries and looks for
/// half-open endpoints to probe.
const PROBE_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// Circuit housekeeping (at most every [`PROBE_CHECK_INTERVAL`]): park what blocked
/// endpoints have due, release the backlogs of endpoints that became runnable, admit
/// half-open probes. Then due deliveries, `want` in all.
async fn claim(
    pool: &PgPool,
    want: usize,
    settings: &DeliverySettings,
    last_probe_check: &mut tokio::time::Instant,
) -> Result<Vec<Claimed>, sqlx::Error> {
    let mut claimed = Vec::new();
    if last_probe_check.elapsed() >= PROBE_CHECK_INTERVAL {
        *last_probe_check = tokio::time::Instant::now();
        let parked = queue::park_blocked(pool).await?;
        if parked > 0 {
            tracing::debug!(parked, "parked due deliveries of blocked endpoints");
        }
        let released = queue::release_parked(pool, settings.circuit.release_per_sec, None).await?;
        if released > 0 {
            tracing::info!(released, "parked deliveries released (circuit closed or endpoint resumed)");
        }
        claimed = queue::claim_probes(pool, want.min(16) as i64, settings.lease).await?;
        for probe in &claimed {
            tracing::info!(endpoint_id = %probe.endpoint_id, delivery_id = %probe.id, "half-open probe admitted");
        }
    }
    let rest = want - claimed.len();
    if rest > 0 {
        claimed.extend(queue::claim(pool, rest as i64, settings.lease).await?);
    }
    Ok(claimed)
}

/// Sleep, unless stop arrives first; returns true on stop.
async fn sleep_or_stop(pause: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        () = tokio::time::sleep(pause) => false,
        _ = stop.wait_for(|s| *s) => true,
    }
}

/// One attempt of one claimed delivery; the slot goes with the outcome to the recorder
/// and is freed once the outcome is written.
async fn attempt(ctx: Context, job: Claimed, slot: OwnedSemaphorePermit) {
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
        match queue::bury(&ctx.pool, job.id, job.claim_token, &reason, queue::Burial::Unsent).await {
            Ok(true) => tracing::warn!(delivery_id = %job.id, "dead: {reason}"),
            Ok(false) => tracing::warn!(delivery_id = %job.id, "fenced while dead-lettering"),
            Err(e) => tracing::error!(delivery_id = %job.id, error = %e, "dead-lettering failed; lease will retry"),
        }
        return;
    }

    let started_at = Utc::now();
    let clock = std::time::Instant::now();
    let (observed, status_code, excerpt) = send(&ctx, &job, started_at.timestamp()).await;
    let duration_ms = clock.elapsed().as_millis().min(i32::MAX as u128) as i32;
    let policy = Policy {
        max_attempts: settings.max_attempts,
        backoff_base: settings.backoff_base,
        backoff_cap: settings.backoff_cap,
        retry_after_cap: settings.retry_after_cap,
    };
    let verdict = policy::decide(&policy, &observed, budget_attempt as u32, SystemTime::now(), &mut rand::rng());
    let (outcome, next_attempt_at, next_reason) = match verdict.decision {
        Decision::Delivered => (Outcome::Delivered, None, None),
        Decision::Dead => (Outcome::Dead, None, None),
        Decision::Retry { delay, why } => {
            // Bounded by the configured caps; checked anyway, so an absurd cap cannot panic
            // the worker and lose the outcome (a century is "never" for a retry).
            let century = chrono::Duration::days(36_500);
            let delay = chrono::Duration::from_std(delay).unwrap_or(century).min(century);
            let at = Utc::now().checked_add_signed(delay).unwrap_or(DateTime::<Utc>::MAX_UTC);
            (Outcome::Retry, Some(at), Some(why.as_str().to_owned()))
        }
    };
    tracing::debug!(delivery_id = %job.id, attempt = job.attempt, outcome = outcome.as_str(), reason = %verdict.reason, "attempt finished");
    let signal = match (&observed, verdict.endpoint_failure) {
        (Observed::Refused { .. }, _) => Signal::Neutral,
        (_, true) => Signal::Failure,
        (_, false) => Signal::Healthy,
    };
    let error_kind = match &observed {
        Observed::Transport { kind, .. } => Some((*kind).to_owned()),
        Observed::Refused { message } => message.split(':').next().map(str::to_owned),
        Observed::Response { .. } => None,
    };
    let class = match (&observed, &error_kind) {
        (Observed::Response { status, .. }, _) => format!("{}xx", status / 100),
        (_, Some(kind)) => kind.clone(),
        (_, None) => "other".to_owned(),
    };
    crate::metrics::attempt(outcome.as_str(), class, clock.elapsed());
    let record = AttemptRecord {
        delivery_id: job.id,
        claim_token: job.claim_token,
        attempt: job.attempt,
        started_at,
        duration_ms,
        status_code,
        error_kind,
        outcome,
        reason: sanitize::bounded(&verdict.reason, sanitize::MAX_REASON_BYTES),
        response_excerpt: excerpt,
        next_attempt_at,
        next_attempt_reason: next_reason,
        endpoint_id: job.endpoint_id,
        signal,
        probe_token: job.probe_token,
    };
    if ctx.outcomes.send((record, slot)).await.is_err() {
        tracing::error!(delivery_id = %job.id, "outcome recorder is gone; the lease will bring this delivery back");
    }
}

/// Send one attempt; never fails: every way it can go wrong is an [`Observed`].
async fn send(ctx: &Context, job: &Claimed, timestamp: i64) -> (Observed, Option<i32>, Option<String>) {
    let url = match Url::parse(&job.url) {
        Ok(url) => url,
        Err(e) => return (Observed::Refused { message: format!("invalid_url: {e}") }, None, None),
    };
    // Opened here, just before signing: a lookup in the keyring's cache after the first
    // claim of an endpoint (no allocation at all without a key).
    let opened: Result<Vec<_>, _> = std::iter::once(&job.secret)
        .chain(&job.previous_secrets)
        .map(|stored| ctx.secrets.open(Place::EndpointSecret, stored))
        .collect();
    let opened = match opened {
        Ok(opened) => opened,
        // Never sent unsigned. Retried like a network failure: the likely cause is a replica
        // started without the key a newer one wrote with (see README, Secrets at rest).
        Err(e) => {
            tracing::error!(delivery_id = %job.id, endpoint_id = %job.endpoint_id, error = %e, "cannot read the endpoint's signing secret; not sent");
            return (Observed::Transport { kind: "secret", message: format!("secret_unreadable: {e}") }, None, None);
        }
    };
    let secrets: Vec<&str> = opened.iter().map(AsRef::as_ref).collect();
    let headers = request::headers(job, &secrets, timestamp);
    match ctx.egress.post(&url, headers, Bytes::copy_from_slice(&job.payload)).await {
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
        Err(SendError::Refused(refusal)) => (Observed::Refused { message: refusal.to_string() }, None, None),
        Err(e) => (Observed::Transport { kind: e.kind(), message: e.to_string() }, None, None),
    }
}
