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
//! | TCP keepalive and `TCP_USER_TIMEOUT` ([`tcp`], Linux) | ≈ 20-25 s | every connection to the database (the pool's, the janitor's own), whatever it is doing (statement in flight, idle, `LISTEN`, the drain after an abandoned call) fails once its path is dead. On a direct connection this is what ends the background loops' calls (claim, outcome recorder, metrics, wake-ups): they wait for their connection's verdict rather than abandoning a write whose outcome they would then not know |
//! | the background loops' calls ([`BACKGROUND_DEADLINE`]) | 45 s | a claim, an outcome write, a claim given back: abandoned as unanswered when nothing, not even a dead socket, ends them first (behind a pooler, whose socket stays alive while the server behind it is silent); at a stop, the recorder is given 10 s after the deliveries' grace |
//! | `statement_timeout` ([`STATEMENT_TIMEOUT`], server side) | 30 s | work the server does for a statement nobody may be waiting for any more (the janitor sets its own; migrations run without one) |
//! | `idle_in_transaction_session_timeout` ([`IDLE_IN_TRANSACTION_TIMEOUT`], server side) | 60 s | a transaction whose client went silent holds its row locks no longer than this (no transaction of the gateway waits on anything but its own statements) |
//! | server TCP keepalives ([`SERVER_KEEPALIVE`]) | ≈ 25 s | the server notices a gateway it cannot reach and ends its sessions, releasing their locks |
//! | no `lock_timeout` ([`NO_LOCK_TIMEOUT`], server side) | none | a database's or role's own (a guard some operators set for every session) does not cut short the claims' waits for an endpoint's row, which are by design; `statement_timeout` bounds them |
//! | `jit` off ([`NO_JIT`], server side) | none | a statement's own time: PostgreSQL compiles a statement whose estimated cost passes `jit_above_cost`, at every execution (50-80 ms). A cached generic plan is estimated from a whole table (its `LIMIT`s are parameters): the general claim's at 1,000,000 pending compiled 125 functions for each claim of 256 rows, 59 ms a claim against 6 ms (bench/PROFILE.md, "A claim compiled at every call") |
//!
//! Two settings are not bounds but what the design relies on, whatever the database or
//! role imposes: every transaction runs READ COMMITTED ([`ISOLATION`]), and when the
//! database's commits do not wait for the WAL's flush the gateway's do
//! ([`session`]); docs/production-postgres.md, "Settings the database imposes".
//!
//! The server-side settings travel as startup `options`; a setting already given in the
//! URL's `options` parameter wins (`?options=-c%20statement_timeout%3D120s`). A pooler in
//! front of PostgreSQL must pass `options` through (PgBouncer refuses unknown startup
//! parameters unless told to ignore them, and then they do not apply).

#[macro_use]
mod session;
mod connect_gate;
pub mod embedded;
mod failure;
pub mod hosts;
pub mod kept_plans;
mod pool;
mod start;
pub mod tcp;
mod text_enum;
mod tx;
mod warm;
mod wire;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, Row};

pub use failure::{
    CONFLICT_TRIES, Health, REFUSAL_MEMORY, Refusal, Unavailable, after_commit, classify, classify_sqlstate,
    is_conflict, is_unavailable, no_answer, retry_conflicts, unavailable,
};
pub use pool::{
    Pool, Pooler, built_as, built_scalar, delete_batch, named_statements, query, query_as, query_scalar, query_sized,
};
pub(crate) use session::DIRECT_BEGIN;
pub use session::{
    IDLE_IN_TRANSACTION_TIMEOUT, ISOLATION, NO_JIT, NO_LOCK_TIMEOUT, Planning, SERVER_KEEPALIVE, STATEMENT_TIMEOUT,
    begin_sql, plan_cached,
};
use session::{connection_state, durable_commits, with_server_bounds};
pub use start::{DEFAULT_START_WAIT, OLDEST_SERVER_VERSION, waiting};
pub(crate) use text_enum::text_enum;
pub use tx::Tx;
pub use warm::UNUSED_FOR as WARM_UNUSED_FOR;
pub use wire::Int8Array;

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

/// Longest a background loop's database call (a claim, an outcome write, a claim given
/// back) may take before it is abandoned as unanswered ([`no_answer`]: its commit unknown,
/// so the recorder's retry finds what it wrote; a claim's leases end by themselves).
/// Behind a transaction pooler the gateway's socket leads to the pooler, which stays
/// alive and acknowledges everything while the server behind it has gone silent, so
/// neither TCP keepalive nor `TCP_USER_TIMEOUT` ([`tcp`]) ever ends such a call: without
/// this bound the recorder and the claim loop waited for as long as the pooler's own
/// connection to the silent server lasted (about 15 minutes by default), through a
/// failover the pooler had already followed. Longer than the server's
/// `statement_timeout` ([`STATEMENT_TIMEOUT`]), so a statement that waits for a lock by
/// design is ended by the server first.
pub const BACKGROUND_DEADLINE: Duration = Duration::from_secs(STATEMENT_TIMEOUT.as_secs() + 15);

/// How to reach PostgreSQL.
#[derive(Debug, Clone)]
pub struct DbConfig {
    /// The connection URL (the pooler's, behind one).
    pub url: String,
    /// Connections in the pool.
    pub pool_size: u32,
    /// What sits between the gateway and PostgreSQL.
    pub pooler: Pooler,
    /// A direct URL for what needs a session behind a transaction pooler (`LISTEN`).
    pub session_url: Option<String>,
    /// How long the first connection is tried again while the database may come back by
    /// itself (starting, failing over, not reachable yet); zero: once
    /// (`--db-start-wait-secs`, [`start`]).
    pub start_wait: Duration,
}

impl DbConfig {
    /// A direct connection to `url` with `pool_size` connections.
    pub fn direct(url: &str, pool_size: u32) -> DbConfig {
        DbConfig { url: url.to_owned(), pool_size, pooler: Pooler::None, session_url: None, start_wait: Duration::ZERO }
    }
}

/// Open a pool of at most `size` connections straight to `url`, with the bounds above.
pub async fn connect(url: &str, size: u32) -> anyhow::Result<Pool> {
    open(&DbConfig::direct(url, size)).await
}

/// Open the pool `config` describes.
///
/// The first connection is made here, and start-up fails with a clear message when the
/// server cannot be reached or does not take writes (a standby). Every connection the
/// pool opens later is checked the same way and refused when its node is read-only (the
/// pool then tries again until its acquire timeout); and a connection opened before the
/// pool's [`Health`] heard of a read-only or departing node is discarded when it is next
/// taken, so a failover heals by itself.
pub async fn open(config: &DbConfig) -> anyhow::Result<Pool> {
    let hosts = hosts::split(&config.url)?
        .iter()
        .map(|url| url.parse::<PgConnectOptions>().map(|o| configure(o, config.pooler)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("invalid database URL: {e}"))?;
    let session = match &config.session_url {
        Some(url) => Some(with_server_bounds(
            url.parse::<PgConnectOptions>()
                .map_err(|e| anyhow::anyhow!("invalid session database URL: {e}"))?
                .application_name("webhook-gateway session"),
        )),
        None => None,
    };
    let first = start::first_connection(&hosts, config.start_wait).await?;
    let targets: Vec<tcp::Target> = hosts.iter().map(tcp::Target::of).collect();
    let health = Arc::new(Health::default());
    let (stale, refusals) = (health.clone(), health.clone());
    let pooler = config.pooler;
    // A URL that sets `synchronous_commit` itself is its operator's choice.
    let url_sets_commit = hosts[first].get_options().is_some_and(|o| o.contains("synchronous_commit="));
    // Set by the first connection that finds the database's commits not durable.
    let made_durable = Arc::new(AtomicBool::new(false));
    let durable_for_pool = made_durable.clone();
    // No ping before every checkout (sqlx's default): it doubles the round trips of a
    // one-statement ingest. A connection that died is found by the statement that uses
    // it, which fails (503 at ingest: the producer retries), drops the connection and
    // marks the older ones stale (`before_acquire`).
    let inner = PgPoolOptions::new()
        .max_connections(config.pool_size)
        .min_connections(0)
        .test_before_acquire(false)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        // sqlx warns of every acquire slower than 2 s: during a failover that is every
        // request (234 of the HA drill's 271 warnings). The pool gauges show a starved pool.
        .acquire_slow_level(log::LevelFilter::Debug)
        .before_acquire(move |_conn, meta| {
            let keep = !stale.is_stale(meta.age);
            Box::pin(async move { Ok(keep) })
        })
        .after_connect(move |conn, _meta| {
            let (targets, refusals, made_durable) = (targets.clone(), refusals.clone(), made_durable.clone());
            Box::pin(async move {
                for target in &targets {
                    tcp::harden(target);
                }
                let (writable, durable) = connection_state(conn).await.inspect_err(connect_refused)?;
                // It answered: opening connections works (`connect_gate`).
                refusals.gate.opened();
                if !writable {
                    refusals.note_refusal(Refusal::ReadOnly);
                    let refused = read_only_error();
                    connect_refused(&refused);
                    return Err(refused);
                }
                if !durable {
                    durable_commits(conn, pooler, url_sets_commit, &made_durable).await?;
                }
                Ok(())
            })
        })
        .connect_lazy_with(hosts[first].clone());
    if hosts.len() > 1 {
        tokio::spawn(hosts::follow_writable(inner.clone(), health.clone(), hosts, first));
    }
    Ok(Pool::new(inner, health, config.pooler, session, config.pool_size, durable_for_pool)
        .with_start_wait(config.start_wait))
}

/// A host's options as the gateway connects with them.
fn configure(options: PgConnectOptions, pooler: Pooler) -> PgConnectOptions {
    // Statement logging at INFO would print every claim; keep it for slow statements only.
    // No `extra_float_digits` startup parameter: PgBouncer refuses it unless configured to
    // ignore it, and PostgreSQL 12+ prints floats exactly without it (the gateway reads
    // its values in binary anyway).
    let options = options
        .extra_float_digits(None)
        .log_statements(log::LevelFilter::Trace)
        .log_slow_statements(log::LevelFilter::Warn, Duration::from_secs(1))
        .application_name("webhook-gateway");
    match pooler {
        Pooler::None => with_server_bounds(options),
        // No startup `options` (PgBouncer refuses them; POOLED_BEGIN sets the bounds) and
        // no statement cache (see `pool`).
        Pooler::Transaction => options.statement_cache_capacity(0),
    }
}

/// A pool of at most one connection to `options` (a direct session URL), hardened like
/// the pool's own connections.
fn single_session_pool(options: PgConnectOptions) -> sqlx::PgPool {
    let target = tcp::Target::of(&options);
    PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .after_connect(move |_conn, _meta| {
            let target = target.clone();
            Box::pin(async move {
                tcp::harden(&target);
                Ok(())
            })
        })
        .connect_lazy_with(options)
}

/// Say that a new connection was refused in its set-up, at most once per
/// [`crate::log_throttle::INTERVAL`]. The pool tries again at once and logs every refusal
/// at ERROR itself (`sqlx_core::pool::inner`, which the default log filter turns off): a
/// read-only node met 288 such lines in 10 s from one replica.
fn connect_refused(error: &sqlx::Error) {
    static REFUSED: crate::log_throttle::Throttle = crate::log_throttle::Throttle::new(crate::log_throttle::INTERVAL);
    if let Some(left_out) = REFUSED.admit() {
        tracing::warn!(%error, left_out, "database: a new connection was refused in its set-up; the pool tries again");
    }
}

/// Whether `conn`'s node takes writes.
async fn writable(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    Ok(connection_state(conn).await?.0)
}

/// The error a connection to a read-only node is refused with (the pool logs it and
/// tries again until its acquire timeout).
fn read_only_error() -> sqlx::Error {
    sqlx::Error::Protocol("the server does not take writes (a standby, or default_transaction_read_only is on)".into())
}

/// The migrations, applied by [`migrate`] under its own transaction-level lock.
///
/// Migrations applied by a later release, which this binary does not know, are left as
/// they are (`ignore_missing`): during a rolling deploy release N runs on the schema
/// release N+1 migrated, which the migration policy keeps compatible (expand now,
/// contract a release later: docs/upgrades.md). sqlx's default refuses to start then.
static UNLOCKED_MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.set_locking(false);
    migrator.set_ignore_missing(true);
    migrator
});

/// The newest migration this release carries (its schema version): what the fleet's
/// roster shows beside each replica, to tell two releases on one schema apart.
pub fn newest_migration() -> i64 {
    UNLOCKED_MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0)
}

/// Key of the transaction-level advisory lock [`migrate`] holds ("wgmigrat").
pub const MIGRATION_LOCK_KEY: i64 = 0x7767_6d69_6772_6174;

/// Apply pending migrations: all of them in one transaction, on a connection of their
/// own, without a statement timeout (building an index on a large table may take longer
/// than any statement of the running gateway).
///
/// One transaction, so it works behind a transaction pooler too: two replicas starting
/// at once serialize on a transaction-level advisory lock (sqlx's own lock is a session
/// lock, which a pooler would leave on a server connection), and a failed migration
/// leaves nothing half-applied. sqlx's migrator prepares named statements: they are
/// deallocated before the commit, and any left on the server connection by a migration
/// that died are deallocated first, so none survives on a pooled server connection.
pub async fn migrate(pool: &Pool) -> anyhow::Result<()> {
    // The causes are kept (not only their text): a start-up that meets the database out
    // of connections tells it by them, and waits (`start::waiting`).
    let fail = |e: anyhow::Error| e.context("migrations failed");
    let mut conn = PgConnection::connect_with(&pool.connect_options()).await.map_err(|e| fail(e.into()))?;
    let result = async {
        let mut tx = conn.begin_with(concat!(begin!(), "; DEALLOCATE ALL; SET LOCAL statement_timeout = 0")).await?;
        query("SELECT pg_advisory_xact_lock($1)").bind(MIGRATION_LOCK_KEY).execute(&mut *tx).await?;
        UNLOCKED_MIGRATOR.run(&mut *tx).await?;
        let known = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
        let newer: Vec<i64> =
            query_scalar("SELECT version FROM _sqlx_migrations WHERE version > $1 AND success ORDER BY version")
                .bind(known)
                .fetch_all(&mut *tx)
                .await?;
        if !newer.is_empty() {
            tracing::info!(
                ?newer,
                "the schema is newer than this release (migrations of a later release applied): running on it, as a \
                 rolling deploy does"
            );
        }
        sqlx::raw_sql("DEALLOCATE ALL").execute(&mut *tx).await?;
        tx.commit().await?;
        anyhow::Ok(())
    }
    .await
    .map_err(fail);
    let _ = conn.close().await;
    result
}

/// Fails, naming the command to run, unless every migration this release knows is
/// applied: the CLI's commands that read or write the gateway's tables (`tokens`,
/// `secrets reencrypt`) on a database that `serve` or `migrate` never set up.
pub async fn require_migrated(pool: &Pool) -> anyhow::Result<()> {
    let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    let known: bool = query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL").fetch_one(pool).await?;
    let applied: Option<i64> = if known {
        query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success").fetch_one(pool).await?
    } else {
        None
    };
    match applied {
        Some(applied) if applied >= latest => Ok(()),
        Some(applied) => anyhow::bail!(
            "the database's schema is at migration {applied}, this release needs {latest}: run `webhook-gateway \
             migrate` (or start `serve`, which migrates) first"
        ),
        None => anyhow::bail!(
            "the database has no gateway schema: run `webhook-gateway migrate` (or start `serve`, which migrates) first"
        ),
    }
}

/// Why a process is not ready for traffic (`/readyz`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotReady {
    /// The schema is older than this binary.
    MigrationsNotApplied,
    /// The node the pool reaches does not take writes (a standby, a demoted primary,
    /// `default_transaction_read_only`).
    ReadOnly,
    /// Writes were refused within [`REFUSAL_MEMORY`] (a full disk, too many
    /// connections, a server shutting down).
    RefusingWrites,
    /// Commits of this gateway's user have waited for a synchronous standby for longer
    /// than [`STANDBY_PATIENCE`]: the standby is gone and every write hangs (a read
    /// still answers, so nothing else shows it).
    WaitingForStandby,
}

/// How long a commit may wait for a synchronous standby before `/readyz` says the
/// database is not taking writes: ingest gives up on a commit after 5 s.
pub const STANDBY_PATIENCE: Duration = Duration::from_secs(5);

impl NotReady {
    /// The reason `/readyz` gives.
    pub fn reason(self) -> &'static str {
        match self {
            NotReady::MigrationsNotApplied => "migrations not applied",
            NotReady::ReadOnly => "database read-only",
            NotReady::RefusingWrites => "database refusing writes",
            NotReady::WaitingForStandby => "database commits waiting for a synchronous standby",
        }
    }
}

/// How long `/readyz` waits for the database: a load balancer's health check gives up
/// after a second or two, and a database that takes longer to answer a trivial read is
/// not ready anyway.
pub const READINESS_TIMEOUT: Duration = Duration::from_secs(1);

/// Whether the database can take this process's traffic (for `/readyz`): reachable,
/// migrated, writable, and no write refused lately. At most [`READINESS_TIMEOUT`], then
/// an error, unless the error is the pool refusing read-only connections (a standby
/// reached during a failover), which is [`NotReady::ReadOnly`].
pub async fn readiness(pool: &Pool) -> Result<Result<(), NotReady>, sqlx::Error> {
    match ready_now(pool).await {
        Err(e) => match pool.health().refusing_writes() {
            Some(Refusal::ReadOnly) => Ok(Err(NotReady::ReadOnly)),
            Some(_) => Ok(Err(NotReady::RefusingWrites)),
            None => Err(e),
        },
        ready => ready,
    }
}

async fn ready_now(pool: &Pool) -> Result<Result<(), NotReady>, sqlx::Error> {
    let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    let row = tokio::time::timeout(
        READINESS_TIMEOUT,
        query(
            "SELECT (SELECT max(version) FROM _sqlx_migrations WHERE success),
                    pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on',
                    EXISTS (SELECT 1 FROM pg_stat_activity
                             WHERE wait_event = 'SyncRep' AND usename = current_user
                               AND query_start < now() - make_interval(secs => $1))",
        )
        .bind(STANDBY_PATIENCE.as_secs_f64())
        .fetch_one(pool),
    )
    .await
    .map_err(|_| no_answer("the readiness check"))??;
    let applied: Option<i64> = row.try_get(0)?;
    let read_only: bool = row.try_get(1)?;
    let waiting_for_standby: bool = row.try_get(2)?;
    Ok(if applied.unwrap_or(0) < latest {
        Err(NotReady::MigrationsNotApplied)
    } else if read_only {
        Err(NotReady::ReadOnly)
    } else if waiting_for_standby {
        Err(NotReady::WaitingForStandby)
    } else if pool.health().refusing_writes() == Some(Refusal::Resources) {
        // A full disk or exhausted memory does not show in a read: the last refusal does.
        Err(NotReady::RefusingWrites)
    } else {
        Ok(())
    })
}
