//! What storage looks like: table and index sizes, live and dead tuples (PostgreSQL's
//! statistics views), and the janitor's latest pass. Read-only and cheap: catalog and
//! statistics lookups, no table scans.

use crate::db::Pool;
use chrono::{DateTime, Utc};
use serde::Serialize;

/// Sizes and tuple counts of the gateway's tables, and the janitor's latest pass.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct StorageReport {
    /// Every table of the gateway's schema, largest first.
    pub tables: Vec<TableStorage>,
    /// The most recent janitor pass (possibly still running), if any.
    pub last_run: Option<JanitorRun>,
}

/// One table.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct TableStorage {
    /// Table name.
    pub table: String,
    /// Everything: heap, TOAST, free space and visibility maps, indexes.
    pub total_bytes: i64,
    /// Heap, TOAST and maps (`pg_table_size`).
    pub table_bytes: i64,
    /// All indexes (`pg_indexes_size`).
    pub index_bytes: i64,
    /// Each index.
    #[sqlx(skip)]
    pub indexes: Vec<IndexStorage>,
    /// Live rows (statistics estimate).
    pub live_tuples: i64,
    /// Dead row versions not yet vacuumed (statistics estimate).
    pub dead_tuples: i64,
    /// Row updates since statistics were reset.
    pub updates: i64,
    /// Of those, HOT updates (no index touched).
    pub hot_updates: i64,
    /// Last vacuum (manual or automatic).
    pub last_vacuum: Option<DateTime<Utc>>,
    /// Last analyze (manual or automatic).
    pub last_analyze: Option<DateTime<Utc>>,
}

/// One index.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct IndexStorage {
    /// Index name.
    pub index: String,
    /// Size on disk.
    pub bytes: i64,
    /// Scans since statistics were reset.
    pub scans: i64,
    #[serde(skip)]
    table: String,
}

/// A row of `janitor_runs`.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct JanitorRun {
    /// Run id.
    pub id: i64,
    /// The instance (host/pid/random) that ran it.
    pub instance: String,
    /// Start.
    pub started_at: DateTime<Utc>,
    /// End (none while running).
    pub finished_at: Option<DateTime<Utc>>,
    /// Wall time in milliseconds (none while running).
    pub duration_ms: Option<i64>,
    /// How it ended (or `running`).
    pub status: super::RunStatus,
    /// Events deleted.
    pub events_deleted: i64,
    /// Deliveries deleted.
    pub deliveries_deleted: i64,
    /// Attempts deleted.
    pub attempts_deleted: i64,
    /// Delete statements executed.
    pub batches: i32,
    /// Why it failed.
    pub error: Option<String>,
}

/// Report storage for the tables in the connection's current schema.
pub async fn storage_report(pool: &Pool) -> Result<StorageReport, sqlx::Error> {
    let mut tables: Vec<TableStorage> = crate::db::query_as(
        "SELECT s.relname::text AS table,
                pg_total_relation_size(s.relid) AS total_bytes,
                pg_table_size(s.relid) AS table_bytes,
                pg_indexes_size(s.relid) AS index_bytes,
                s.n_live_tup AS live_tuples,
                s.n_dead_tup AS dead_tuples,
                s.n_tup_upd AS updates,
                s.n_tup_hot_upd AS hot_updates,
                GREATEST(s.last_vacuum, s.last_autovacuum) AS last_vacuum,
                GREATEST(s.last_analyze, s.last_autoanalyze) AS last_analyze
         FROM pg_stat_user_tables s
         WHERE s.schemaname = current_schema()
         ORDER BY total_bytes DESC, s.relname",
    )
    .fetch_all(pool)
    .await?;
    let indexes: Vec<IndexStorage> = crate::db::query_as(
        "SELECT i.relname::text AS table, i.indexrelname::text AS index,
                pg_relation_size(i.indexrelid) AS bytes, i.idx_scan AS scans
         FROM pg_stat_user_indexes i
         WHERE i.schemaname = current_schema()
         ORDER BY bytes DESC, i.indexrelname",
    )
    .fetch_all(pool)
    .await?;
    for index in indexes {
        if let Some(table) = tables.iter_mut().find(|t| t.table == index.table) {
            table.indexes.push(index);
        }
    }
    let last_run = crate::db::query_as(
        "SELECT id, instance, started_at, finished_at,
                (extract(epoch FROM finished_at - started_at) * 1000)::int8 AS duration_ms,
                status, events_deleted, deliveries_deleted, attempts_deleted, batches, error
         FROM janitor_runs ORDER BY id DESC LIMIT 1",
    )
    .fetch_optional(pool)
    .await?;
    Ok(StorageReport { tables, last_run })
}
