//! Connection pool, migrations and the embedded PostgreSQL cluster.

pub mod embedded;

use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

/// The migrations in `migrations/`, embedded in the binary.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// How long a request waits for a pooled connection before answering 503: short, so a
/// database outage turns into a prompt `503 Retry-After` rather than a hung producer.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// Open a pool of at most `size` connections to `url`.
pub async fn connect(url: &str, size: u32) -> anyhow::Result<PgPool> {
    let options: PgConnectOptions = url.parse().map_err(|e| anyhow::anyhow!("invalid database URL: {e}"))?;
    // Statement logging at INFO would print every claim; keep it for slow statements only.
    let options = options
        .log_statements(log::LevelFilter::Trace)
        .log_slow_statements(log::LevelFilter::Warn, Duration::from_secs(1))
        .application_name("webhook-gateway");
    // No ping before every checkout (sqlx's default): it doubles the round trips of a
    // one-statement ingest. A connection that died is found by the statement that uses
    // it, which fails (503 at ingest: the producer retries) and drops the connection.
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .min_connections(0)
        .test_before_acquire(false)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect_with(options)
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to PostgreSQL: {e}"))?;
    Ok(pool)
}

/// Apply pending migrations.
pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    MIGRATOR.run(pool).await.map_err(|e| anyhow::anyhow!("migrations failed: {e}"))
}

/// Whether every embedded migration is applied (for `/readyz`).
pub async fn migrations_applied(pool: &PgPool) -> Result<bool, sqlx::Error> {
    let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    let applied: Option<i64> =
        sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success").fetch_one(pool).await?;
    Ok(applied.unwrap_or(0) >= latest)
}

/// Whether an error means "the database is not reachable right now" (answer 503 and let
/// the producer retry) rather than a bug or a constraint (answer 500).
pub fn is_unavailable(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(db) => {
            // Class 08 is connection exceptions; 57P01-57P03 are admin/crash shutdown and
            // "cannot connect now" (starting up); 53300 is too many connections.
            db.code().is_some_and(|c| c.starts_with("08") || c.starts_with("57P") || c == "53300")
        }
        _ => false,
    }
}
