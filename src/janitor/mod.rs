//! Retention and queue hygiene: the janitor deletes expired history in bounded batches.
//!
//! Every replica runs a janitor. Each pass first takes the `janitor` lease
//! ([`crate::lease`]), so exactly one replica does a pass at a time and the others skip
//! quietly. A pass is many short transactions (one per batch), and each of them holds the
//! lease in the same transaction as its deletes: a pass whose lease expired and was taken
//! over (a frozen process) cannot commit another batch beside its successor. The lease is
//! released at the end of every pass; a pass that dies leaves it to expire
//! ([`LEASE_TTL`]). Rows and transactions only, no session state (advisory locks, `SET`),
//! so it works the same behind a transaction pooler.
//!
//! A pass runs five phases, each as delete statements of at most `batch_size` rows (one
//! statement = one transaction, with a lock timeout and a statement timeout), a pause
//! between batches, and at most `max_batches_per_phase` batches per phase:
//!
//! 1. delivered deliveries whose `finished_at` is older than the delivered retention
//!    (their attempts with them);
//! 2. events older than the event retention with no pending delivery, together with their
//!    (delivered or dead) deliveries and attempts. Dead deliveries therefore stay
//!    inspectable until their event expires, and an event with a pending delivery is never
//!    deleted: its deliveries are locked and re-checked in the deleting statement, so a
//!    redelivery racing the janitor either commits first (the event is kept) or waits and
//!    finds the delivery gone;
//! 3. attempts older than the attempt retention, whatever their delivery's state;
//! 4. ordering lines with no head: deleted when idle (left by an earlier release: lines
//!    are now deleted by the outcome that empties them), given their next delivery as head
//!    when one waits behind none (a broken invariant, logged: that delivery and those
//!    after it would otherwise wait for ever);
//! 5. `janitor_runs` rows older than the event retention (one batch);
//! 6. audit log entries older than the audit retention (`crate::audit`).
//!
//! Each pass is recorded in `janitor_runs`; [`storage_report`] shows the latest one with
//! table and index sizes.

mod report;
mod sql;

use std::time::{Duration, Instant};

use crate::db::Pool;
use crate::lease::{self, Lease};
use chrono::{DateTime, Utc};
use rand::Rng;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument as _;
use uuid::Uuid;

pub use report::{IndexStorage, JanitorRun, StorageReport, TableStorage, storage_report};
pub use sql::{ATTEMPTS_BATCH, DELIVERED_BATCH, EVENTS_BATCH, HEADLESS_LINES_LOCK};

/// Default `--retention-events-days`.
pub const DEFAULT_RETENTION_EVENTS_DAYS: u32 = 30;
/// Default `--retention-attempts-days`.
pub const DEFAULT_RETENTION_ATTEMPTS_DAYS: u32 = 30;
/// Default `--retention-delivered-days`.
pub const DEFAULT_RETENTION_DELIVERED_DAYS: u32 = 7;
/// Default `--retention-audit-days`.
pub const DEFAULT_RETENTION_AUDIT_DAYS: u32 = 365;
/// Default `--janitor-interval-secs`.
pub const DEFAULT_INTERVAL_SECS: u64 = 300;
/// Default `--janitor-batch-size`.
pub const DEFAULT_BATCH_SIZE: u32 = 5000;

/// Name of the janitor's lease.
pub const LEASE_NAME: &str = "janitor";

/// How long the janitor's lease lasts without renewal: every batch renews it, and a batch
/// is bounded by its 60 s statement timeout, so a live pass never loses it; a pass that
/// died frees it after this.
pub const LEASE_TTL: Duration = Duration::from_secs(120);

/// Settings of each batch's transaction (`SET LOCAL`: they end with it, and never reach
/// a pooled connection's other users).
///
/// `lock_timeout`: longest a batch waits for a row lock (a recorder or a redelivery holding
/// a delivery of an expiring event); failing the pass and retrying at the next one beats
/// queueing behind, or in front of, the hot path. `statement_timeout`: longest one batch
/// may run; a batch takes a fraction of a second, this only stops a pathological one from
/// holding its locks.
///
/// `enable_seqscan`, `enable_bitmapscan`: every batch walks one index in key order, stops
/// after `batch_size` rows, and reaches the rows under them by index. When statistics lag
/// (a bulk load, autovacuum behind) the planner underestimates how many rows are expired
/// and instead reads every expired row through a bitmap and sorts them, or scans a whole
/// table for the deliveries of 5,000 events. Measured on a never-analyzed soak database
/// (300,000 deliveries, 600,000 dead tuples): a delivered batch 1.2 s instead of 0.09 s,
/// an events batch 1.8 s (up to 19 s with bitmaps alone off) instead of 0.21 s. Both are
/// only discouraged: without a usable index the planner still scans.
///
/// `application_name`: the batch shows as `webhook-gateway janitor` in `pg_stat_activity`.
const BATCH_SETTINGS: &str = "SELECT set_config('lock_timeout', '5s', true), \
     set_config('statement_timeout', '60s', true), set_config('enable_seqscan', 'off', true), \
     set_config('enable_bitmapscan', 'off', true), set_config('application_name', 'webhook-gateway janitor', true)";
/// On shutdown, longest a statement in progress may still run.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// Janitor settings.
#[derive(Debug, Clone)]
pub struct JanitorSettings {
    /// Events (with their remaining deliveries and attempts) are deleted this long after
    /// they were received, unless a delivery is still pending.
    pub events_retention: Duration,
    /// Attempts are deleted this long after they were recorded.
    pub attempts_retention: Duration,
    /// Delivered deliveries are deleted this long after they were delivered.
    pub delivered_retention: Duration,
    /// Audit log entries are deleted this long after they were written.
    pub audit_retention: Duration,
    /// How often each replica tries a pass.
    pub interval: Duration,
    /// Rows per delete statement.
    pub batch_size: u32,
    /// Pause between two batches, so deletes never run back to back against the hot path.
    pub batch_pause: Duration,
    /// Most batches per phase in one pass; a capped pass is followed by another one after
    /// `batch_pause` rather than after `interval`, with the lease released in between.
    pub max_batches_per_phase: u32,
}

impl Default for JanitorSettings {
    fn default() -> Self {
        const DAY: u64 = 24 * 3600;
        JanitorSettings {
            events_retention: Duration::from_secs(u64::from(DEFAULT_RETENTION_EVENTS_DAYS) * DAY),
            attempts_retention: Duration::from_secs(u64::from(DEFAULT_RETENTION_ATTEMPTS_DAYS) * DAY),
            delivered_retention: Duration::from_secs(u64::from(DEFAULT_RETENTION_DELIVERED_DAYS) * DAY),
            audit_retention: Duration::from_secs(u64::from(DEFAULT_RETENTION_AUDIT_DAYS) * DAY),
            interval: Duration::from_secs(DEFAULT_INTERVAL_SECS),
            batch_size: DEFAULT_BATCH_SIZE,
            batch_pause: Duration::from_millis(100),
            max_batches_per_phase: 100,
        }
    }
}

/// How a pass ended, as `janitor_runs.status` holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// Under way (or its instance died before it ended, until the next pass marks it
    /// abandoned).
    Running,
    /// Nothing expired is left.
    Complete,
    /// A phase hit `max_batches_per_phase`: more expired rows remain.
    Capped,
    /// Shutdown interrupted it between two batches.
    Stopped,
    /// A statement failed (the error is recorded).
    Failed,
    /// Its instance died while it ran: a later pass found it still running.
    Abandoned,
}

crate::db::text_enum!(RunStatus {
    Running => "running",
    Complete => "complete",
    Capped => "capped",
    Stopped => "stopped",
    Failed => "failed",
    Abandoned => "abandoned",
});

/// What one pass did.
#[derive(Debug, Clone)]
pub struct PassReport {
    /// Its `janitor_runs` row.
    pub run_id: i64,
    /// How it ended.
    pub status: RunStatus,
    /// Events deleted.
    pub events_deleted: i64,
    /// Deliveries deleted (delivered ones, and those of deleted events).
    pub deliveries_deleted: i64,
    /// Attempts deleted (expired ones, and those of deleted deliveries).
    pub attempts_deleted: i64,
    /// Idle ordering lines deleted (left by an earlier release).
    pub lines_deleted: i64,
    /// Delete statements executed.
    pub batches: u32,
    /// Wall time of the pass.
    pub duration: Duration,
    /// The failing statement's error, for [`RunStatus::Failed`].
    pub error: Option<String>,
}

/// The result of trying a pass.
#[derive(Debug, Clone)]
pub enum PassOutcome {
    /// This instance took the lease and did the pass.
    Ran(PassReport),
    /// Another instance holds the lease (its pass is running): nothing done.
    Skipped,
}

/// A running janitor task. [`Janitor::shutdown`] stops it between two batches.
pub struct Janitor {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Janitor {
    /// Start the janitor of this process (`instance`: its name in `janitor_runs` and as the
    /// lease's holder, see [`crate::lease::instance_id`]). The first pass comes at a random point within
    /// the first interval (replicas deployed together do not all try at once), then one
    /// pass per interval, or sooner while a capped pass left work behind.
    pub fn spawn(pool: Pool, settings: JanitorSettings, instance: String) -> Janitor {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run(pool, settings, instance, stopped));
        Janitor { stop, task }
    }

    /// Stop: an ongoing pass finishes its current batch, records itself as stopped and
    /// releases the lease; a batch still running after 5 s is abandoned (rolled back).
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        if let Err(e) = self.task.await {
            tracing::error!(error = %e, "janitor task panicked");
        }
    }
}

async fn run(pool: Pool, settings: JanitorSettings, instance: String, mut stop: watch::Receiver<bool>) {
    let mut next = settings.interval.mul_f64(rand::rng().random_range(0.1..1.0));
    let mut resume = Resume::default();
    tracing::info!(%instance, interval = ?settings.interval, first_pass_in = ?next, "janitor started");
    loop {
        tokio::select! {
            () = tokio::time::sleep(next) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        next = settings.interval;
        // On shutdown the pass stops at its next pause; a statement still running after
        // SHUTDOWN_WAIT is abandoned (its batch rolls back, the lease expires by itself,
        // and the next pass marks the run abandoned).
        let mut stopping = stop.clone();
        let span = crate::telemetry::janitor_span();
        let outcome = tokio::select! {
            outcome = pass(&pool, &settings, &instance, &stop, &mut resume).instrument(span.clone()) => outcome,
            () = async {
                let _ = stopping.wait_for(|s| *s).await;
                tokio::time::sleep(SHUTDOWN_WAIT).await;
            } => {
                tracing::warn!("janitor: abandoning the statement in progress at shutdown");
                break;
            }
        };
        traced_pass(&span, &outcome);
        match outcome {
            Ok(PassOutcome::Skipped) => tracing::debug!("janitor pass skipped: another instance holds the lease"),
            Ok(PassOutcome::Ran(report)) => {
                let fields = (report.events_deleted, report.deliveries_deleted, report.attempts_deleted);
                match report.status {
                    RunStatus::Failed => tracing::warn!(
                        error = report.error.as_deref().unwrap_or(""),
                        deleted = ?fields,
                        "janitor pass failed; retrying at the next interval"
                    ),
                    status => tracing::info!(
                        status = status.as_str(),
                        events = fields.0,
                        deliveries = fields.1,
                        attempts = fields.2,
                        idle_lines = report.lines_deleted,
                        batches = report.batches,
                        duration = ?report.duration,
                        "janitor pass"
                    ),
                }
                if report.status == RunStatus::Capped {
                    next = settings.batch_pause;
                }
            }
            Err(e) => tracing::warn!(error = %e, "janitor pass failed; retrying at the next interval"),
        }
    }
}

/// The pass's result on its span (nothing when tracing is off).
fn traced_pass(span: &tracing::Span, outcome: &Result<PassOutcome, sqlx::Error>) {
    if span.is_none() {
        return;
    }
    match outcome {
        Ok(PassOutcome::Skipped) => {
            span.record("webhook.janitor.status", "skipped");
        }
        Ok(PassOutcome::Ran(report)) => {
            span.record("webhook.janitor.status", report.status.as_str());
            span.record("webhook.janitor.events", report.events_deleted);
            span.record("webhook.janitor.deliveries", report.deliveries_deleted);
            span.record("webhook.janitor.attempts", report.attempts_deleted);
        }
        Err(_) => {
            span.record("webhook.janitor.status", "error");
        }
    }
}

/// Try one pass now, as instance `instance`: [`PassOutcome::Skipped`] if another instance
/// holds the lease. Errors are those before the pass was recorded (no connection, lease
/// query failed); a statement failing during the pass is a [`RunStatus::Failed`] report.
pub async fn run_pass(pool: &Pool, settings: &JanitorSettings, instance: &str) -> Result<PassOutcome, sqlx::Error> {
    run_pass_from(pool, settings, instance, &mut Resume::default()).await
}

/// [`run_pass`], its events phase starting where `resume` says and leaving there where
/// the next pass should start, as the janitor's own passes do one after another.
pub async fn run_pass_from(
    pool: &Pool,
    settings: &JanitorSettings,
    instance: &str,
    resume: &mut Resume,
) -> Result<PassOutcome, sqlx::Error> {
    // Never signalled: an explicit pass runs to its end (its bounds still apply).
    let (_keep, stop) = watch::channel(false);
    pass(pool, settings, instance, &stop, resume).await
}

/// Where the next pass's events phase starts: after the last event a capped pass looked
/// at, or from the oldest once a pass went through them all. Without it every pass
/// started from the oldest expired event, and expired events kept for their pending
/// deliveries (an endpoint paused past the retention, a blocked line), when they filled
/// the phase's batch cap, hid every expired event behind them from the janitor for good,
/// and made every pass a capped one, taken again at once.
#[derive(Debug, Default, Clone, Copy)]
pub struct Resume {
    events_after: Option<(DateTime<Utc>, Uuid)>,
}

async fn pass(
    pool: &Pool,
    settings: &JanitorSettings,
    instance: &str,
    stop: &watch::Receiver<bool>,
    resume: &mut Resume,
) -> Result<PassOutcome, sqlx::Error> {
    let Some(lease) = lease::acquire(pool, LEASE_NAME, instance, LEASE_TTL).await? else {
        return Ok(PassOutcome::Skipped);
    };
    let result = leased_pass(pool, &lease, settings, instance, stop, resume).await;
    // A release that fails leaves the lease to expire.
    if let Err(e) = lease.release(pool).await {
        tracing::debug!(error = %e, "releasing the janitor lease");
    }
    result
}

async fn leased_pass(
    pool: &Pool,
    lease: &Lease,
    settings: &JanitorSettings,
    instance: &str,
    stop: &watch::Receiver<bool>,
    resume: &mut Resume,
) -> Result<PassOutcome, sqlx::Error> {
    let started = Instant::now();
    // We hold the lease, so a run still marked running belongs to a process that died.
    crate::db::query("UPDATE janitor_runs SET status = $1 WHERE status = $2")
        .bind(RunStatus::Abandoned)
        .bind(RunStatus::Running)
        .execute(pool)
        .await?;
    let run_id: i64 = crate::db::query_scalar("INSERT INTO janitor_runs (instance) VALUES ($1) RETURNING id")
        .bind(instance)
        .fetch_one(pool)
        .await?;

    let mut tally = Tally::default();
    let (status, error) = match phases(pool, lease, settings, stop, &mut tally, resume).await {
        Ok(status) => (status, None),
        Err(e) => (RunStatus::Failed, Some(e.to_string())),
    };
    crate::db::query(
        "UPDATE janitor_runs
         SET finished_at = now(), status = $2, events_deleted = $3, deliveries_deleted = $4,
             attempts_deleted = $5, batches = $6, error = $7
         WHERE id = $1",
    )
    .bind(run_id)
    .bind(status)
    .bind(tally.events)
    .bind(tally.deliveries)
    .bind(tally.attempts)
    .bind(tally.batches as i32)
    .bind(&error)
    .execute(pool)
    .await?;
    Ok(PassOutcome::Ran(PassReport {
        run_id,
        status,
        events_deleted: tally.events,
        deliveries_deleted: tally.deliveries,
        attempts_deleted: tally.attempts,
        lines_deleted: tally.lines,
        batches: tally.batches,
        duration: started.elapsed(),
        error,
    }))
}

#[derive(Debug, Default)]
struct Tally {
    events: i64,
    deliveries: i64,
    attempts: i64,
    lines: i64,
    batches: u32,
}

/// What one batch found and did.
struct Batch {
    /// Rows selected for deletion (fewer than the batch size: the phase is done).
    candidates: i64,
    events: i64,
    deliveries: i64,
    attempts: i64,
    lines: i64,
    /// Events phase: where the next batch resumes (see [`EVENTS_BATCH`]).
    resume_at: Option<(DateTime<Utc>, Uuid)>,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    Delivered,
    Events,
    Attempts,
    IdleLines,
}

async fn phases(
    pool: &Pool,
    lease: &Lease,
    settings: &JanitorSettings,
    stop: &watch::Receiver<bool>,
    tally: &mut Tally,
    resume: &mut Resume,
) -> Result<RunStatus, sqlx::Error> {
    let mut capped = false;
    for phase in [Phase::Delivered, Phase::Events, Phase::Attempts, Phase::IdleLines] {
        let mut resume_at = if matches!(phase, Phase::Events) { resume.events_after } else { None };
        let mut done = false;
        // Bounded: at most max_batches_per_phase statements per phase per pass.
        for _ in 0..settings.max_batches_per_phase {
            if tally.batches > 0 {
                // The pause doubles as the place where shutdown is noticed.
                let mut stop = stop.clone();
                let stopped = tokio::select! {
                    () = tokio::time::sleep(settings.batch_pause) => false,
                    _ = stop.wait_for(|s| *s) => true,
                };
                if stopped || *stop.borrow() {
                    return Ok(RunStatus::Stopped);
                }
            }
            let batch = run_batch(pool, lease, phase, settings, resume_at).await?;
            tally.batches += 1;
            tally.events += batch.events;
            tally.deliveries += batch.deliveries;
            tally.attempts += batch.attempts;
            tally.lines += batch.lines;
            resume_at = batch.resume_at.or(resume_at);
            if batch.candidates < i64::from(settings.batch_size) {
                done = true;
                break;
            }
        }
        capped |= !done;
        if matches!(phase, Phase::Events) {
            // Capped: the next pass goes on from here; through: from the oldest again.
            resume.events_after = if done { None } else { resume_at };
        }
    }
    // The pass's own history, one bounded statement: a pass every few minutes over the
    // event retention is a few thousand rows at most.
    crate::db::query(
        "DELETE FROM janitor_runs WHERE id IN (
             SELECT id FROM janitor_runs WHERE started_at < now() - make_interval(secs => $1)
             ORDER BY started_at LIMIT $2)",
    )
    .bind(settings.events_retention.as_secs_f64())
    .bind(i64::from(settings.batch_size))
    .execute(pool)
    .await?;
    // The audit log, and circuits' histories kept as long as the attempts that made them:
    // an endpoint that fails for ever adds a change every cool-down, so without this the
    // table grew with time alone.
    let batch = i64::from(settings.batch_size);
    let before = |retention: Duration| {
        crate::clock::now() - chrono::Duration::from_std(retention).unwrap_or(chrono::Duration::MAX)
    };
    let audit_before = before(settings.audit_retention);
    delete_older_in_batches(settings, || crate::audit::delete_older(pool, audit_before, batch)).await?;
    let transitions_before = before(settings.attempts_retention);
    delete_older_in_batches(settings, || {
        crate::circuit::sql::delete_transitions_older(pool, transitions_before, batch)
    })
    .await?;
    // The fleet's roster: a restart adds a row, so rows of replicas gone a day go.
    let replicas_before = before(crate::roster::RETENTION);
    delete_older_in_batches(settings, || crate::roster::delete_older(pool, replicas_before, batch)).await?;
    Ok(if capped { RunStatus::Capped } else { RunStatus::Complete })
}

/// Run `delete_batch` (a delete of at most `settings.batch_size` rows older than a
/// cut-off, returning how many went) until a batch comes back short, at most
/// `settings.max_batches_per_phase` times.
async fn delete_older_in_batches<F, Fut>(settings: &JanitorSettings, mut delete_batch: F) -> Result<(), sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<u64, sqlx::Error>>,
{
    for _ in 0..settings.max_batches_per_phase {
        if delete_batch().await? < u64::from(settings.batch_size) {
            break;
        }
    }
    Ok(())
}

/// One batch: its own transaction, which holds the lease (or fails: taken over), sets the
/// batch's bounds and runs the phase's statement.
async fn run_batch(
    pool: &Pool,
    lease: &Lease,
    phase: Phase,
    settings: &JanitorSettings,
    resume_at: Option<(DateTime<Utc>, Uuid)>,
) -> Result<Batch, sqlx::Error> {
    let (sql, retention) = match phase {
        Phase::Delivered => (DELIVERED_BATCH, settings.delivered_retention),
        Phase::Events => (EVENTS_BATCH, settings.events_retention),
        Phase::Attempts => (ATTEMPTS_BATCH, settings.attempts_retention),
        Phase::IdleLines => return headless_lines_batch(pool, lease, settings).await,
    };
    type Row = (i64, i64, i64, i64, i64, Option<DateTime<Utc>>, Option<Uuid>);
    let mut query = crate::db::query_as::<Row>(sql).bind(retention.as_secs_f64()).bind(i64::from(settings.batch_size));
    if let Phase::Events = phase {
        // None: the first batch starts at the oldest event.
        query = query.bind(resume_at.map(|(at, _)| at)).bind(resume_at.map(|(_, id)| id));
    }
    let mut tx = begin_batch(pool, lease).await?;
    let (candidates, events, deliveries, attempts, lines, at, id) = query.fetch_one(&mut *tx).await?;
    tx.commit().await?;
    Ok(Batch { candidates, events, deliveries, attempts, lines, resume_at: at.zip(id) })
}

/// A batch's transaction: begun, the lease held (or an error: taken over) and the batch's
/// bounds set.
async fn begin_batch(pool: &Pool, lease: &Lease) -> Result<crate::db::Tx, sqlx::Error> {
    let mut tx = pool.begin().await?;
    if !lease.hold(&mut tx).await? {
        return Err(sqlx::Error::Protocol(format!(
            "the janitor lease of {} was taken over by another instance (this pass stalled past {LEASE_TTL:?})",
            lease.holder()
        )));
    }
    crate::db::query(BATCH_SETTINGS).execute(&mut *tx).await?;
    Ok(tx)
}

/// The lines phase's batch: lines with no head, locked ([`HEADLESS_LINES_LOCK`]) and then
/// moved on by the outcome path's own promotion, in one transaction that holds the lease.
/// Every line it locks leaves the set it selects from (deleted, or given a head), so a
/// batch of lines with deliveries waiting behind no head cannot be selected pass after
/// pass (the old statement kept such lines and picked them again, every batch and every
/// pass, capped for ever).
async fn headless_lines_batch(pool: &Pool, lease: &Lease, settings: &JanitorSettings) -> Result<Batch, sqlx::Error> {
    let mut tx = begin_batch(pool, lease).await?;
    let lines: Vec<crate::queue::lines::Line> =
        crate::db::query_as(HEADLESS_LINES_LOCK).bind(i64::from(settings.batch_size)).fetch_all(&mut *tx).await?;
    // A later statement than the lock, as the promotion requires.
    let heads = crate::queue::lines::promote(&mut tx, &lines).await?;
    tx.commit().await?;
    if !heads.is_empty() {
        tracing::warn!(
            lines = heads.len(),
            deliveries = ?heads,
            "ordering lines had deliveries waiting behind no head (nothing would have claimed them); each was given \
             its next delivery as head"
        );
    }
    let candidates = i64::try_from(lines.len()).unwrap_or(i64::MAX);
    let restored = i64::try_from(heads.len()).unwrap_or(i64::MAX);
    Ok(Batch { candidates, events: 0, deliveries: 0, attempts: 0, lines: candidates - restored, resume_at: None })
}
