//! Connection pool, migrations and the embedded PostgreSQL cluster.
//!
//! # Every database call is bounded
//!
//! A database that is down answers at once (connection refused or reset). One behind a
//! partition or a failover does not answer at all: the connection stays open, bytes stop
//! flowing, and an unbounded call waits for as long as the kernel keeps retransmitting
//! (about 15 minutes with Linux defaults). sqlx 0.8 has no per-statement timeout and no
//! socket options, and a call whose future is dropped hands its connection back to the
//! pool through a task that drains it and pings it with no time limit (the connection is
//! out of the pool meanwhile; it is closed if the drain fails). So the bounds are layered:
//!
//! | bound | value | what it bounds |
//! | --- | --- | --- |
//! | pool acquire ([`ACQUIRE_TIMEOUT`]) | 3 s | waiting for a connection, opening one included (TCP, TLS, startup). A call that fails here sent nothing: [`Unavailable::NotCommitted`] |
//! | the HTTP request (`--db-timeout-secs`, [`DEFAULT_REQUEST_TIMEOUT`]) | 5 s | ingest (its source lookup and its commit) and each admin request wait this long for the database, then answer 503; the abandoned call's connection stays out of the pool until the path answers again or the kernel gives up on it |
//! | TCP keepalive and `TCP_USER_TIMEOUT` ([`tcp`], Linux) | ≈ 20-25 s | every connection to the database (the pool's, the janitor's own), whatever it is doing (statement in flight, idle, `LISTEN`, the drain after an abandoned call) fails once its path is dead. This is the bound of the background loops (claim, outcome recorder, metrics, wake-ups): they wait for their connection's verdict instead of abandoning a write whose outcome they would then not know |
//! | `statement_timeout` ([`STATEMENT_TIMEOUT`], server side) | 30 s | work the server does for a statement nobody may be waiting for any more (the janitor sets its own; migrations run without one) |
//! | `idle_in_transaction_session_timeout` ([`IDLE_IN_TRANSACTION_TIMEOUT`], server side) | 60 s | a transaction whose client went silent holds its row locks no longer than this (no transaction of the gateway waits on anything but its own statements) |
//! | server TCP keepalives ([`SERVER_KEEPALIVE`]) | ≈ 25 s | the server notices a gateway it cannot reach and ends its sessions, releasing their locks |
//!
//! The server-side settings travel as startup `options`; a setting already given in the
//! URL's `options` parameter wins (`?options=-c%20statement_timeout%3D120s`). A pooler in
//! front of PostgreSQL must pass `options` through (PgBouncer refuses unknown startup
//! parameters unless told to ignore them, and then they do not apply).

pub mod embedded;
pub mod tcp;

use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

/// Default `--data-dir`: the embedded cluster lives in its `pg`, the generated admin
/// token in its `admin-token` (relative to the working directory, like a project's
/// `target/`).
pub const DEFAULT_DATA_DIR: &str = ".webhook-gateway";

/// The migrations in `migrations/`, embedded in the binary.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// How long a call waits for a pooled connection (opening one included) before failing
/// with `PoolTimedOut`: short, so a database outage turns into a prompt `503 Retry-After`
/// rather than a hung producer. Shorter than [`DEFAULT_REQUEST_TIMEOUT`], so that "nothing
/// could be sent" is told apart from "sent, but not confirmed".
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// Default of `--db-timeout-secs`: how long an HTTP request (ingest, admin) waits for the
/// database before it is answered 503. A commit normally takes milliseconds; this is
/// well above a loaded server's slow commit and well below a producer's own timeout
/// (typically 10-30 s), so the producer hears 503 and retries rather than timing out.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Server-side `statement_timeout` of the gateway's sessions. Every statement of the
/// gateway is bounded by design (batches of ≤ 1,000 rows, `LIMIT`s); this only stops
/// work nobody waits for.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Server-side `idle_in_transaction_session_timeout`: the gateway never leaves a
/// transaction open while it waits on anything else, so a session idle in a transaction
/// this long has lost its client.
pub const IDLE_IN_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(60);

/// Server-side TCP keepalives (idle seconds, interval seconds, probes): a session whose
/// gateway vanished ends after about 25 s.
pub const SERVER_KEEPALIVE: (u32, u32, u32) = (10, 5, 3);

/// Open a pool of at most `size` connections to `url`, with the bounds above.
pub async fn connect(url: &str, size: u32) -> anyhow::Result<PgPool> {
    let options: PgConnectOptions = url.parse().map_err(|e| anyhow::anyhow!("invalid database URL: {e}"))?;
    // Statement logging at INFO would print every claim; keep it for slow statements only.
    let options = with_server_bounds(options)
        .log_statements(log::LevelFilter::Trace)
        .log_slow_statements(log::LevelFilter::Warn, Duration::from_secs(1))
        .application_name("webhook-gateway");
    let target = tcp::Target::of(&options);
    // No ping before every checkout (sqlx's default): it doubles the round trips of a
    // one-statement ingest. A connection that died is found by the statement that uses
    // it, which fails (503 at ingest: the producer retries) and drops the connection.
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .min_connections(0)
        .test_before_acquire(false)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .after_connect(move |_conn, _meta| {
            let target = target.clone();
            Box::pin(async move {
                tcp::harden(&target);
                Ok(())
            })
        })
        .connect_with(options)
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to PostgreSQL: {e}"))?;
    Ok(pool)
}

/// `options` with the server-side bounds added, except those its URL already sets.
fn with_server_bounds(options: PgConnectOptions) -> PgConnectOptions {
    let (idle, interval, count) = SERVER_KEEPALIVE;
    let wanted = [
        ("statement_timeout", format!("{}ms", STATEMENT_TIMEOUT.as_millis())),
        ("idle_in_transaction_session_timeout", format!("{}ms", IDLE_IN_TRANSACTION_TIMEOUT.as_millis())),
        ("tcp_keepalives_idle", idle.to_string()),
        ("tcp_keepalives_interval", interval.to_string()),
        ("tcp_keepalives_count", count.to_string()),
    ];
    let given = options.get_options().unwrap_or_default().to_owned();
    let missing: Vec<_> = wanted.into_iter().filter(|(name, _)| !given.contains(name)).collect();
    if missing.is_empty() { options } else { options.options(missing) }
}

/// Make the rest of the current transaction plan each statement for its parameters
/// (`plan_cache_mode = force_custom_plan`), never with a cached generic plan.
///
/// The claim and the recorder's outcome write are batch statements over `deliveries`, a
/// table that grows and churns fast. A generic plan is built once, from the statistics of
/// the moment, and kept until they change: one built for an empty queue (a gateway
/// starting on a fresh database) walked a whole index per claim at 61,000 pending
/// (120,000 buffers for 16 rows, even with sequential scans ruled out), and one built with
/// a backlog hashed the table (25.8 ms per claim at 100,000 pending, 3-5 ms planned for
/// the call). PostgreSQL's default (`auto`) may switch a prepared statement to its generic
/// plan at any time, and did, mid-run, for the outcome write (18-44 ms per write against
/// about 5 ms). Planning costs ~0.3-1.2 ms per call; a plan that cannot go stale is worth
/// it. bench/PROFILE.md has the figures.
pub async fn plan_each_time(tx: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SET LOCAL plan_cache_mode = force_custom_plan").execute(tx).await.map(|_| ())
}

/// Apply pending migrations, on a connection without a statement timeout (building an
/// index on a large table may take longer than any statement of the running gateway).
pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    let mut conn = pool.acquire().await.map_err(|e| anyhow::anyhow!("migrations failed: {e}"))?;
    sqlx::query("SET statement_timeout = 0").execute(&mut *conn).await?;
    let result = MIGRATOR.run(&mut *conn).await.map_err(|e| anyhow::anyhow!("migrations failed: {e}"));
    // Not back into the pool with the session setting changed.
    let _ = conn.close().await;
    result
}

/// Whether every embedded migration is applied (for `/readyz`); at most
/// [`DEFAULT_REQUEST_TIMEOUT`], then an error.
pub async fn migrations_applied(pool: &PgPool) -> Result<bool, sqlx::Error> {
    let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    let applied = tokio::time::timeout(
        DEFAULT_REQUEST_TIMEOUT,
        sqlx::query_scalar::<_, Option<i64>>("SELECT max(version) FROM _sqlx_migrations WHERE success").fetch_one(pool),
    )
    .await
    .map_err(|_| no_answer("the readiness check"))??;
    Ok(applied.unwrap_or(0) >= latest)
}

/// The error of a call abandoned by its caller's timeout: classified
/// [`Unavailable::Unconfirmed`], since the statement may have reached the server.
pub fn no_answer(what: &str) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{what}: no answer from the database")))
}

/// What a call that failed because the database was not reachable can have left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unavailable {
    /// Nothing of it was committed: no connection could be had (pool timeout, connect
    /// refused, server not accepting connections), or the server answered that it
    /// cancelled the statement.
    NotCommitted,
    /// The connection failed, or went silent, after the statement may have reached the
    /// server: it may have been committed. A retry must be idempotent.
    Unconfirmed,
}

/// Whether an error means "the database is not reachable right now" (answer 503 and let
/// the producer retry) rather than a bug or a constraint (answer 500), and if so, what
/// the failed call can have committed.
pub fn unavailable(err: &sqlx::Error) -> Option<Unavailable> {
    match err {
        // Raised before a statement is sent: by the pool, or while opening a connection.
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Tls(_) => Some(Unavailable::NotCommitted),
        // A socket error can end a statement whose commit the server already made.
        sqlx::Error::Io(_) => Some(Unavailable::Unconfirmed),
        sqlx::Error::Database(db) => {
            let code = db.code()?;
            match &*code {
                // Refused before a session existed: too many connections, starting up or
                // shutting down, connection rejected; the statement was cancelled
                // (statement_timeout) and its transaction rolled back.
                "53300" | "57P03" | "08001" | "08004" | "57014" => Some(Unavailable::NotCommitted),
                // Class 08 is connection exceptions (08007: transaction resolution unknown);
                // 57P01/57P02 end the session, possibly after a local commit (a wait for a
                // synchronous standby cut short).
                c if c.starts_with("08") || c.starts_with("57P") => Some(Unavailable::Unconfirmed),
                _ => None,
            }
        }
        _ => None,
    }
}

/// Whether an error means the database is not reachable right now (see [`unavailable`]).
pub fn is_unavailable(err: &sqlx::Error) -> bool {
    unavailable(err).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_failure_can_have_committed() {
        assert_eq!(unavailable(&sqlx::Error::PoolTimedOut), Some(Unavailable::NotCommitted));
        assert_eq!(unavailable(&sqlx::Error::PoolClosed), Some(Unavailable::NotCommitted));
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(unavailable(&sqlx::Error::Io(reset)), Some(Unavailable::Unconfirmed));
        assert_eq!(unavailable(&no_answer("a test")), Some(Unavailable::Unconfirmed));
        assert_eq!(unavailable(&sqlx::Error::RowNotFound), None);
        assert_eq!(unavailable(&sqlx::Error::Protocol("bug".into())), None);
    }

    #[test]
    fn server_bounds_are_added_unless_the_url_sets_them() {
        let options: PgConnectOptions = "postgres://u@h/db".parse().expect("url");
        let added = with_server_bounds(options);
        let added = added.get_options().expect("options");
        assert!(added.contains("-c statement_timeout=30000ms"), "{added}");
        assert!(added.contains("-c idle_in_transaction_session_timeout=60000ms"), "{added}");
        assert!(added.contains("-c tcp_keepalives_idle=10"), "{added}");

        let options: PgConnectOptions =
            "postgres://u@h/db?options=-c%20statement_timeout%3D120s".parse().expect("url with options");
        let kept = with_server_bounds(options);
        let kept = kept.get_options().expect("options");
        assert!(kept.contains("statement_timeout=120s"), "{kept}");
        assert!(!kept.contains("statement_timeout=30000ms"), "{kept}");
        assert!(kept.contains("-c idle_in_transaction_session_timeout=60000ms"), "{kept}");
    }
}
