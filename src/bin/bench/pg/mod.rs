//! The PostgreSQL side: the server (a fresh embedded cluster at default durability, or
//! the one `DATABASE_URL` names), one fresh database per scenario, and reading
//! `pg_stat_statements` and the sampled statement log; pgbench running the gateway's own
//! ingest statement in [`pgbench`], SQL seeding of backlogs in [`seed`].

use std::path::{Path, PathBuf};

use anyhow::Context;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, Executor, PgConnection, PgPool};
use webhook_gateway::db::embedded;

mod pgbench;
mod seed;
mod standalone;
pub mod waits;
pub mod wal;
pub use pgbench::*;
pub use seed::*;
pub use standalone::*;

/// The role worker processes connect as: its statements (and only its) are sampled into
/// the server log, so claim latencies come with percentiles.
pub const WORKER_ROLE: &str = "wg_bench_worker";
/// Share of the worker's statements written to the log.
pub const LOG_SAMPLE_RATE: f64 = 0.25;

/// The database server of this run.
pub struct Server {
    embedded: Option<embedded::Cluster>,
    base: url::Url,
    /// Whether `pg_stat_statements` is loaded (shared_preload_libraries).
    pub stat_statements: bool,
    /// Whether the worker role exists with statement sampling (we can read the log).
    pub sampled_log: bool,
}

impl Server {
    /// Start a fresh embedded cluster at PostgreSQL's default durability, or use
    /// `database_url`.
    pub async fn start(database_url: Option<String>, data_dir: PathBuf, keep: bool) -> anyhow::Result<Server> {
        let (embedded, base) = match database_url {
            Some(url) => (None, url::Url::parse(&url).context("DATABASE_URL is not a URL")?),
            None => {
                let options = embedded::ClusterOptions {
                    data_dir,
                    throwaway: !keep,
                    port: None,
                    // Durability stays at the defaults (fsync, synchronous_commit and
                    // full_page_writes on): only the statistics extension is added, with
                    // planning tracked (a statement planned at every execution costs CPU
                    // that its execution time does not show).
                    settings: vec![
                        ("shared_preload_libraries".into(), "pg_stat_statements".into()),
                        ("pg_stat_statements.track_planning".into(), "on".into()),
                    ],
                    env: Vec::new(),
                };
                let cluster = tokio::task::spawn_blocking(move || embedded::Cluster::start(&options)).await??;
                let base = url::Url::parse(&cluster.url("postgres"))?;
                (Some(cluster), base)
            }
        };
        let mut server = Server { embedded, base, stat_statements: false, sampled_log: false };
        let mut conn = server.admin().await?;
        let libs: String = sqlx::query_scalar("SHOW shared_preload_libraries").fetch_one(&mut conn).await?;
        server.stat_statements = libs.contains("pg_stat_statements");
        if server.embedded.is_some() {
            // Statement sampling for the worker role only (PostgreSQL 13+). The embedded
            // cluster takes password logins only: the role gets the server user's.
            let password = server.base.password().unwrap_or_default().to_owned();
            let setup = format!(
                "CREATE ROLE {WORKER_ROLE} LOGIN SUPERUSER PASSWORD '{password}';
                 ALTER ROLE {WORKER_ROLE} SET log_min_duration_sample = 0;
                 ALTER ROLE {WORKER_ROLE} SET log_statement_sample_rate = {LOG_SAMPLE_RATE};
                 ALTER ROLE {WORKER_ROLE} SET log_parameter_max_length = 0;"
            );
            server.sampled_log = conn.execute(setup.as_str()).await.is_ok();
        }
        conn.close().await.ok();
        Ok(server)
    }

    /// URL of database `name` (as the server's own user).
    pub fn url(&self, name: &str) -> String {
        let mut u = self.base.clone();
        u.set_path(name);
        u.to_string()
    }

    /// URL of database `name` as the worker role (falls back to [`Server::url`]).
    pub fn worker_url(&self, name: &str) -> String {
        if !self.sampled_log {
            return self.url(name);
        }
        let mut u = self.base.clone();
        u.set_path(name);
        let _ = u.set_username(WORKER_ROLE);
        u.to_string()
    }

    async fn admin(&self) -> anyhow::Result<PgConnection> {
        let mut u = self.base.clone();
        if self.embedded.is_some() {
            u.set_path("postgres");
        }
        PgConnection::connect(u.as_str()).await.context("connecting to PostgreSQL")
    }

    /// Create a fresh database (dropping a leftover of the same name).
    pub async fn create_db(&self, name: &str) -> anyhow::Result<String> {
        let mut conn = self.admin().await?;
        conn.execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str()).await?;
        conn.execute(format!("CREATE DATABASE {name}").as_str()).await.context("CREATE DATABASE")?;
        conn.close().await.ok();
        Ok(self.url(name))
    }

    /// Drop a scenario's database.
    pub async fn drop_db(&self, name: &str) {
        if let Ok(mut conn) = self.admin().await {
            let _ = conn.execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str()).await;
            conn.close().await.ok();
        }
    }

    /// The postmaster's pid (embedded cluster only).
    pub fn postmaster(&self) -> Option<u32> {
        crate::stats::postmaster_pid(self.embedded.as_ref()?.data_dir())
    }

    /// The server log (embedded cluster only).
    pub fn log_path(&self) -> Option<PathBuf> {
        Some(self.embedded.as_ref()?.data_dir().join("server.log"))
    }

    /// Current length of the server log, to read only what a scenario adds.
    pub fn log_offset(&self) -> u64 {
        self.log_path().and_then(|p| std::fs::metadata(p).ok()).map(|m| m.len()).unwrap_or(0)
    }

    /// `host`, `port`, `user`, `password` for pgbench.
    fn libpq_env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("PGHOST", self.base.host_str().unwrap_or("127.0.0.1").to_owned()),
            ("PGPORT", self.base.port().unwrap_or(5432).to_string()),
        ];
        if !self.base.username().is_empty() {
            env.push(("PGUSER", self.base.username().to_owned()));
        }
        if let Some(p) = self.base.password() {
            env.push(("PGPASSWORD", p.to_owned()));
        }
        env
    }

    /// Stop the embedded cluster.
    pub async fn stop(self) {
        if let Some(mut cluster) = self.embedded {
            let _ = tokio::task::spawn_blocking(move || cluster.stop()).await;
        }
    }
}

/// A pool for the bench's own queries.
pub async fn pool(url: &str, size: u32) -> anyhow::Result<PgPool> {
    PgPoolOptions::new().max_connections(size).connect(url).await.with_context(|| "connecting to the bench database")
}

/// Settings for the machine line.
pub async fn server_facts(pool: &PgPool) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for name in ["server_version", "synchronous_commit", "fsync", "full_page_writes", "shared_buffers", "max_wal_size"]
    {
        let v: String = sqlx::query_scalar(&format!("SHOW {name}")).fetch_one(pool).await?;
        out.push((name.to_owned(), v));
    }
    Ok(out)
}

/// Create the extension in a scenario database and reset its counters. (Planning is
/// tracked on the embedded cluster; a server given by `DATABASE_URL` keeps its own
/// setting, and its plan columns read 0 unless it tracks planning.)
pub async fn reset_statements(pool: &PgPool) -> bool {
    pool.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").await.is_ok()
        && pool.execute("SELECT pg_stat_statements_reset()").await.is_ok()
}

/// One statement's totals from `pg_stat_statements`.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct StatementStats {
    /// Executions.
    pub calls: i64,
    /// Total execution time.
    pub total_ms: f64,
    /// Mean execution time.
    pub mean_ms: f64,
    /// Longest execution.
    pub max_ms: f64,
    /// Total planning time (0 when planning is not tracked).
    pub plan_ms: f64,
    /// Times it was planned.
    pub plans: i64,
    /// Rows returned or affected.
    pub rows: i64,
    /// The statement (as normalised by pg_stat_statements).
    pub query: String,
}

/// The statements of this database by total execution time, the bench's own reading of
/// the statistics and its sampler of waits ([`waits::TABLE`]) left out.
pub async fn top_statements(pool: &PgPool, limit: i64) -> Vec<StatementStats> {
    let rows: Result<Vec<StatementStats>, _> = sqlx::query_as(
        "SELECT calls, total_exec_time AS total_ms, mean_exec_time AS mean_ms, max_exec_time AS max_ms,
                total_plan_time AS plan_ms, plans, rows, query
         FROM pg_stat_statements
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND query NOT ILIKE '%pg_stat_statements%' AND query NOT ILIKE '%' || $2 || '%'
         ORDER BY total_exec_time DESC LIMIT $1",
    )
    .bind(limit)
    .bind(waits::TABLE)
    .fetch_all(pool)
    .await;
    rows.unwrap_or_default()
}

/// Whitespace collapsed, cut at `max` characters.
pub fn shorten(sql: &str, max: usize) -> String {
    let flat = sql.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max { flat } else { format!("{}…", flat.chars().take(max).collect::<String>()) }
}

/// What a statement of `pg_stat_statements` (normalized text) is in the gateway's path,
/// for the appendices: the two lean ingest statements start alike and differ only in
/// whether they lease (`wg_lease_room_v5`, or `v4`/`v3`/`v1` for a release before; the
/// batch statements, `wg_lease_room_v6` or `v2`), and a table of truncated texts cannot
/// tell them apart. Empty for a statement it does not know.
pub fn statement_kind(sql: &str) -> &'static str {
    let leases = sql.contains("wg_lease_room_");
    let inserts_events = sql.contains("INSERT INTO events");
    if inserts_events && sql.contains("unnest($1::uuid[]") && leases {
        "ingest, batch, leasing"
    } else if inserts_events && sql.contains("unnest($1::uuid[]") {
        "ingest, batch, plain"
    } else if inserts_events && leases {
        "ingest, one webhook, leasing"
    } else if inserts_events {
        "ingest, one webhook, plain"
    } else if sql.contains("wg_claim_fresh_") {
        "claim by key"
    } else if sql.contains("INSERT INTO attempts") {
        "outcome write"
    } else if sql.contains("room_n AS") {
        "general claim"
    } else if sql.trim_start().starts_with("WITH head AS") {
        "general claim's lock"
    } else if sql.contains("gin_clean_pending_list") {
        "search index merge"
    } else {
        ""
    }
}

/// Whether a statement is the delivery claim.
pub fn is_claim(sql: &str) -> bool {
    let s = sql.to_ascii_uppercase();
    s.contains("SKIP LOCKED") && s.contains("UPDATE")
}

/// Durations of the claim statements the worker role logged since `offset` (sampled).
pub fn logged_claims(log: &Path, offset: u64) -> Vec<u64> {
    let Ok(bytes) = std::fs::read(log) else { return Vec::new() };
    let text = String::from_utf8_lossy(bytes.get(offset as usize..).unwrap_or_default()).into_owned();
    parse_claim_durations(&text)
}

/// Parse `duration: X ms  execute <name>: <statement>` entries (statements span lines
/// until the next line that starts with a timestamp) and keep the claims' durations (µs).
pub fn parse_claim_durations(text: &str) -> Vec<u64> {
    let mut out = Vec::new();
    let mut current: Option<(u64, String)> = None;
    let starts_entry =
        |l: &str| l.len() > 4 && l.as_bytes()[..4].iter().all(u8::is_ascii_digit) && l.as_bytes()[4] == b'-';
    let mut flush = |entry: Option<(u64, String)>| {
        if let Some((us, sql)) = entry
            && is_claim(&sql)
        {
            out.push(us);
        }
    };
    for line in text.lines() {
        if starts_entry(line) {
            flush(current.take());
            if let Some(at) = line.find("duration: ") {
                let rest = &line[at + "duration: ".len()..];
                let ms: Option<f64> = rest.split(' ').next().and_then(|v| v.parse().ok());
                if let (Some(ms), Some(stmt_at)) = (ms, rest.find("execute ")) {
                    current = Some(((ms * 1000.0).round() as u64, rest[stmt_at..].to_owned()));
                }
            }
        } else if let Some((_, sql)) = current.as_mut() {
            sql.push(' ');
            sql.push_str(line);
        }
    }
    flush(current.take());
    out
}

/// The gateway's claim statement (`$1` = how many, `$2` = lease in seconds, `$3` default
/// max in flight, `$4` the endpoints served), exactly as the workers run it.
pub fn claim_statement() -> Option<String> {
    let sql = webhook_gateway::queue::claim_sql().to_owned();
    (is_claim(&sql) && sql.contains("$4") && !sql.contains("$5")).then_some(sql)
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of one claim of `limit` rows, rolled back.
pub async fn explain_claim(pool: &PgPool, limit: i64) -> String {
    let Some(sql) = claim_statement() else {
        return "(the claim statement was not found in src/queue/mod.rs)".into();
    };
    let run = async {
        let mut tx = pool.begin().await?;
        let lines: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN (ANALYZE, BUFFERS) {sql}"))
            .bind(limit)
            .bind(60.0_f64)
            .bind(webhook_gateway::queue::DEFAULT_MAX_IN_FLIGHT)
            .bind(sqlx::query_scalar::<_, uuid::Uuid>("SELECT id FROM endpoints").fetch_all(&mut *tx).await?)
            .fetch_all(&mut *tx)
            .await?;
        tx.rollback().await?;
        Ok::<_, sqlx::Error>(lines.join("\n"))
    };
    match run.await {
        Ok(plan) => format!("```\n{plan}\n```"),
        Err(e) => format!("(EXPLAIN failed: {e})"),
    }
}

/// Transactions committed and rolled back in the cluster so far.
pub async fn transactions(pool: &sqlx::PgPool) -> anyhow::Result<f64> {
    // The statistics are flushed by each backend at most once a second: good enough over
    // a 10 s window.
    let n: i64 = sqlx::query_scalar("SELECT sum(xact_commit + xact_rollback)::int8 FROM pg_stat_database")
        .fetch_one(pool)
        .await?;
    Ok(n as f64)
}

/// PostgreSQL's WAL counters (`pg_stat_wal`, PostgreSQL 14 and later): bytes, full-page
/// images and syncs to disk, cluster-wide since the last reset.
#[derive(Debug, Clone, Copy)]
pub struct Wal {
    /// Bytes of WAL written.
    pub bytes: f64,
    /// Full-page images among them (the first change of a page after a checkpoint).
    pub full_pages: f64,
    /// Times the WAL was synced to disk (a flush, which commits wait for).
    pub syncs: f64,
}

impl Wal {
    /// What was written between `self` and `later`, per one of `per` (webhooks, say).
    pub fn per(&self, later: &Wal, per: f64) -> Wal {
        let per = per.max(1.0);
        Wal {
            bytes: (later.bytes - self.bytes) / per,
            full_pages: (later.full_pages - self.full_pages) / per,
            syncs: (later.syncs - self.syncs) / per,
        }
    }
}

/// The WAL counters now (flushed by each backend at most once a second, like
/// [`transactions`]); an error before PostgreSQL 14.
pub async fn wal(pool: &sqlx::PgPool) -> anyhow::Result<Wal> {
    let (bytes, full_pages, syncs): (f64, i64, i64) =
        sqlx::query_as("SELECT wal_bytes::float8, wal_fpi, wal_sync FROM pg_stat_wal").fetch_one(pool).await?;
    Ok(Wal { bytes, full_pages: full_pages as f64, syncs: syncs as f64 })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each statement of the gateway's hot path is named by the text it runs (the markers
    /// are table and function names, which `pg_stat_statements` keeps as they are).
    #[test]
    fn the_gateway_s_statements_are_named_by_what_they_do() {
        use webhook_gateway::{queue, store::events};
        let named = [
            (events::lean::insert_and_claim_sql(), "ingest, one webhook, leasing"),
            (events::insert_and_claim_sql(), "ingest, one webhook, leasing"),
            (events::lean::insert_sql(), "ingest, one webhook, plain"),
            (events::insert_sql(), "ingest, one webhook, plain"),
            (events::insert_batch_and_claim_sql(), "ingest, batch, leasing"),
            (events::insert_batch_sql(), "ingest, batch, plain"),
            (queue::CLAIM_FRESH_SQL, "claim by key"),
            (queue::RECORD_SQL, "outcome write"),
            (queue::CLAIM_LOCK_SQL, "general claim's lock"),
            (queue::claim_sql(), "general claim"),
            ("SELECT gin_clean_pending_list($1::regclass)", "search index merge"),
        ];
        for (sql, kind) in named {
            assert_eq!(statement_kind(sql), kind, "{}", shorten(sql, 80));
        }
        assert_eq!(statement_kind("SELECT 1"), "");
    }

    #[test]
    fn the_claim_statement_is_found() {
        let sql = claim_statement().expect("claim statement");
        assert!(sql.contains("SKIP LOCKED") && sql.contains("LIMIT $1"), "{sql}");
        assert!(!sql.contains('{') && !sql.contains('\\'), "{sql}");
    }

    #[test]
    fn claim_durations_come_from_execute_entries_spanning_lines() {
        let log = "2026-11-29 10:00:00.100 UTC [42] LOG:  duration: 0.512 ms  execute sqlx_s_1: WITH due AS (\n\
                   \t SELECT id FROM deliveries WHERE status = 'pending'\n\
                   \t FOR UPDATE SKIP LOCKED\n\
                   \t) UPDATE deliveries d SET x = 1\n\
                   2026-11-29 10:00:00.200 UTC [42] LOG:  duration: 1.250 ms  execute sqlx_s_2: WITH o AS (SELECT 1) INSERT INTO attempts\n\
                   2026-11-29 10:00:00.300 UTC [42] LOG:  duration: 2.000 ms  execute sqlx_s_1: WITH due AS (\n\
                   \t SELECT id FROM deliveries FOR UPDATE SKIP LOCKED) UPDATE deliveries d SET x = 1\n";
        assert_eq!(parse_claim_durations(log), vec![512, 2000]);
    }
}
