//! The fleet's roster: which replicas are running, in which role, on which release.
//!
//! Each replica writes its own row of `replicas` at start-up and every
//! `--metrics-sample-secs` after (one upsert: a row the janitor deleted while the replica
//! was cut off comes back), marks it draining when a clean stop begins, and stopped when
//! it ends. A row not written
//! for three of its intervals is a replica that went away without stopping (killed,
//! partitioned from the database, its host gone). During a rolling deploy, two releases on
//! one schema, the roster tells them apart by the newest migration each carries.
//! `GET /v1/admin/replicas` reads it; the janitor deletes a row a day after it was last
//! written ([`RETENTION`]).
//!
//! Tested: `roster` (replicas of every role listed running, one draining then stopped,
//! one killed found lost), `janitor::a_replica_s_row_is_deleted_a_day_after_it_was_last_written`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::watch;

use crate::db::Pool;
use crate::role::Role;

/// How long a replica's row is kept after it was last written.
pub const RETENTION: Duration = Duration::from_secs(24 * 3600);

/// The longest a stopping replica waits to mark its row draining or stopped: a database
/// that does not answer does not hold the shutdown (the row then reads lost, three
/// intervals later).
const STOP_WRITE: Duration = Duration::from_secs(2);

/// What a replica is, as the roster reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReplicaState {
    /// Written within the last three of its intervals.
    Running,
    /// Stopping cleanly: in its drain (`--shutdown-drain-secs`), still serving while its
    /// `/readyz` answers 503, then finishing its deliveries.
    Draining,
    /// Stopped cleanly (it said so).
    Stopped,
    /// Not written for three of its intervals, and it did not say it stopped: killed,
    /// cut off from the database, or its host gone.
    Lost,
}

impl ReplicaState {
    /// A row's state: whether it says it `stopped`, whether it was `heard` from within three
    /// of its intervals, whether it said it is `draining`.
    fn of(stopped: bool, heard: bool, draining: bool) -> ReplicaState {
        match (stopped, heard, draining) {
            (true, _, _) => ReplicaState::Stopped,
            (false, false, _) => ReplicaState::Lost,
            (false, true, true) => ReplicaState::Draining,
            (false, true, false) => ReplicaState::Running,
        }
    }
}

/// A replica's row.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Replica {
    /// Host, process id and a random suffix (`lease::instance_id`), as in leases and
    /// janitor runs.
    pub instance: String,
    /// `all`, `ingest` or `worker`.
    pub role: String,
    /// The release's version.
    pub version: String,
    /// The newest migration its release carries.
    pub schema_version: i64,
    /// Whether the database's schema is newer than its release knows: an older release
    /// still running during a rolling deploy (docs/upgrades.md).
    pub behind_schema: bool,
    /// Running, stopped or lost.
    pub state: ReplicaState,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// When it last wrote its row.
    pub seen_at: DateTime<Utc>,
    /// When it began to stop cleanly (its drain).
    pub draining_since: Option<DateTime<Utc>>,
    /// When it stopped cleanly.
    pub stopped_at: Option<DateTime<Utc>>,
    /// The database's clock less its host's, milliseconds, as it last measured (alert
    /// `WebhookGatewayClockOffset` past a second).
    pub clock_offset_ms: f64,
}

/// The roster as `GET /v1/admin/replicas` answers it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Roster {
    /// The newest migration applied to the database.
    pub schema_version: i64,
    /// Replicas running now.
    pub running: usize,
    /// Every replica written within the last day: running first, then the most recently
    /// started.
    pub replicas: Vec<Replica>,
}

/// The first pause before a failed roster write is tried again.
const RETRY_FIRST: Duration = Duration::from_secs(1);

/// Longest a roster write may wait (for a connection, a pooler's queue, an answer) before
/// it is tried again: a write stuck at start left the replica out of the roster.
const WRITE_BOUND: Duration = Duration::from_secs(5);

/// This replica in the roster: what [`Member::run`] keeps written and
/// [`Member::draining`] marks.
#[derive(Debug, Clone)]
pub struct Member {
    pool: Pool,
    instance: String,
    role: Role,
    every: Duration,
}

impl Member {
    /// This replica, named `instance`, in `role`, writing its row every `every`.
    pub fn new(pool: Pool, instance: String, role: Role, every: Duration) -> Member {
        Member { pool, instance, role, every }
    }

    /// Write this replica's row every `every` until `stop`, which a clean stop sends when
    /// everything else has finished, just before it marks the row stopped
    /// ([`Member::stopped`]): a replica finishing its deliveries reads draining, not lost.
    pub async fn run(self, mut stop: watch::Receiver<bool>) {
        let started_at = crate::clock::now();
        // After a failed write, the next try comes sooner (a second, doubling up to the
        // interval): a replica whose first write met a busy pool or a pooler's queue was
        // otherwise missing from the roster for a whole interval.
        let mut retry = RETRY_FIRST;
        loop {
            let mut next = self.every;
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                written = tokio::time::timeout(WRITE_BOUND, self.write(started_at)) => match written
                    .unwrap_or_else(|_| Err(crate::db::no_answer("the roster's row")))
                {
                    Ok(()) => retry = RETRY_FIRST,
                    Err(e) => {
                        // The database being away is reported by the calls that need it.
                        self.pool.note(&e);
                        tracing::debug!(error = %e, retry_in = ?retry, "the roster's row was not written");
                        next = retry.min(self.every);
                        retry = (retry * 2).min(self.every);
                    }
                },
            }
            if !crate::lease::pause(next, &mut stop).await {
                break;
            }
        }
    }

    /// Mark this replica stopped: its clean stop has finished (deliveries recorded).
    pub async fn stopped(&self) {
        self.mark("UPDATE replicas SET stopped_at = now(), seen_at = now() WHERE instance = $1", "stopped").await;
    }

    /// Mark this replica draining: a clean stop begins.
    pub async fn draining(&self) {
        self.mark("UPDATE replicas SET draining_since = now(), seen_at = now() WHERE instance = $1", "draining").await;
    }

    /// Run `sql` on this replica's row, waiting at most [`STOP_WRITE`].
    async fn mark(&self, sql: &str, what: &str) {
        let marked = crate::db::query(sql).bind(&self.instance).execute(&self.pool);
        if tokio::time::timeout(STOP_WRITE, marked).await.map_or(true, |done| done.is_err()) {
            tracing::debug!("the roster's row was not marked {what}");
        }
    }

    /// Insert or refresh this replica's row (a row deleted meanwhile comes back).
    async fn write(&self, started_at: DateTime<Utc>) -> Result<(), sqlx::Error> {
        crate::db::query(
            "INSERT INTO replicas (instance, role, version, schema_version, started_at, seen_at, every_secs,
                                   clock_offset_ms)
             VALUES ($1, $2, $3, $4, $5, now(), $6, $7)
             ON CONFLICT (instance) DO UPDATE
                 SET seen_at = now(), every_secs = EXCLUDED.every_secs,
                     clock_offset_ms = EXCLUDED.clock_offset_ms, stopped_at = NULL",
        )
        .bind(&self.instance)
        .bind(self.role.name())
        .bind(env!("CARGO_PKG_VERSION"))
        .bind(crate::db::newest_migration())
        .bind(started_at)
        .bind(self.every.as_secs_f64())
        .bind(crate::clock::offset().num_microseconds().unwrap_or(0) as f64 / 1000.0)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

/// Most rows the roster answers with (a crash loop adds a row a restart).
const LISTED: i64 = 1000;

/// A row of `replicas` as [`list`] reads it.
#[derive(sqlx::FromRow)]
struct Row {
    instance: String,
    role: String,
    version: String,
    schema_version: i64,
    behind_schema: bool,
    /// Written within the last three of its intervals.
    heard: bool,
    started_at: DateTime<Utc>,
    seen_at: DateTime<Utc>,
    draining_since: Option<DateTime<Utc>>,
    stopped_at: Option<DateTime<Utc>>,
    clock_offset_ms: f64,
}

/// The roster: every replica written within [`RETENTION`], running first.
pub async fn list(pool: &Pool) -> Result<Roster, sqlx::Error> {
    let (schema_version,): (Option<i64>,) =
        crate::db::query_as("SELECT max(version) FROM _sqlx_migrations WHERE success").fetch_one(pool).await?;
    let schema_version = schema_version.unwrap_or(0);
    let rows: Vec<Row> = crate::db::query_as(
        "SELECT instance, role, version, schema_version, schema_version < $1 AS behind_schema, heard,
                started_at, seen_at, draining_since, stopped_at, clock_offset_ms
         FROM replicas, LATERAL (SELECT seen_at >= now() - make_interval(secs => 3 * every_secs) AS heard) h
         WHERE seen_at >= now() - make_interval(secs => $2)
         ORDER BY stopped_at IS NULL AND heard DESC, started_at DESC, instance
         LIMIT $3",
    )
    .bind(schema_version)
    .bind(RETENTION.as_secs_f64())
    .bind(LISTED)
    .fetch_all(pool)
    .await?;
    let replicas: Vec<Replica> = rows
        .into_iter()
        .map(|row| Replica {
            state: ReplicaState::of(row.stopped_at.is_some(), row.heard, row.draining_since.is_some()),
            instance: row.instance,
            role: row.role,
            version: row.version,
            schema_version: row.schema_version,
            behind_schema: row.behind_schema,
            started_at: row.started_at,
            seen_at: row.seen_at,
            draining_since: row.draining_since,
            stopped_at: row.stopped_at,
            clock_offset_ms: row.clock_offset_ms,
        })
        .collect();
    let running = replicas.iter().filter(|r| r.state == ReplicaState::Running).count();
    Ok(Roster { schema_version, running, replicas })
}

/// Delete at most `batch` rows last written before `before` (the janitor's).
pub async fn delete_older(pool: &Pool, before: DateTime<Utc>, batch: i64) -> Result<u64, sqlx::Error> {
    crate::db::delete_batch(
        pool,
        "DELETE FROM replicas WHERE instance IN (
             SELECT instance FROM replicas WHERE seen_at < $1 ORDER BY seen_at LIMIT $2)",
        before,
        batch,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::ReplicaState;

    #[test]
    fn a_row_s_state_says_stopped_over_lost_and_lost_over_draining() {
        assert_eq!(ReplicaState::of(true, false, true), ReplicaState::Stopped, "it said so: not lost");
        assert_eq!(ReplicaState::of(false, false, true), ReplicaState::Lost, "went silent while draining");
        assert_eq!(ReplicaState::of(false, true, true), ReplicaState::Draining);
        assert_eq!(ReplicaState::of(false, true, false), ReplicaState::Running);
    }
}
