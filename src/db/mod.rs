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
//! | no `lock_timeout` ([`NO_LOCK_TIMEOUT`], server side) | none | a database's or role's own (a guard some operators set for every session) does not cut short the claims' waits for an endpoint's row, which are by design; `statement_timeout` bounds them |
//! | `jit` off ([`NO_JIT`], server side) | none | a statement's own time: PostgreSQL compiles a statement whose estimated cost passes `jit_above_cost`, at every execution (50-80 ms). A cached generic plan is estimated from a whole table (its `LIMIT`s are parameters): the general claim's at 1,000,000 pending compiled 125 functions for each claim of 256 rows, 59 ms a claim against 6 ms (bench/PROFILE.md, "A claim compiled at every call") |
//!
//! Two settings are not bounds but what the design relies on, whatever the database or
//! role imposes: every transaction runs READ COMMITTED ([`ISOLATION`]), and when the
//! database's commits do not wait for the WAL's flush the gateway's do
//! ([`durable_commits`]); docs/production-postgres.md, "Settings the database imposes".
//!
//! The server-side settings travel as startup `options`; a setting already given in the
//! URL's `options` parameter wins (`?options=-c%20statement_timeout%3D120s`). A pooler in
//! front of PostgreSQL must pass `options` through (PgBouncer refuses unknown startup
//! parameters unless told to ignore them, and then they do not apply).

pub mod embedded;
mod failure;
pub mod hosts;
pub mod kept_plans;
mod pool;
pub mod tcp;
mod text_enum;
mod tx;
mod warm;
mod wire;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, Row};

pub use failure::{
    CONFLICT_TRIES, Health, REFUSAL_MEMORY, Refusal, Unavailable, classify, classify_sqlstate, is_conflict,
    is_unavailable, no_answer, retry_conflicts, unavailable,
};
pub use pool::{Pool, Pooler, built_as, built_scalar, named_statements, query, query_as, query_scalar, query_sized};
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

/// The statements of [`POOLED_BEGIN`] after its `BEGIN` (a macro, so that every `BEGIN`
/// of [`begin_sql`] is one literal built at compile time).
macro_rules! pooled_bounds {
    () => {
        "SET LOCAL statement_timeout = '30000ms'; SET LOCAL idle_in_transaction_session_timeout = '60000ms'; \
         SET LOCAL jit = off; SET LOCAL lock_timeout = 0"
    };
}

/// Every transaction's `BEGIN`, with the isolation the gateway's statements are written
/// for ([`ISOLATION`]) whatever the database's or role's default.
macro_rules! begin {
    () => {
        "BEGIN ISOLATION LEVEL READ COMMITTED"
    };
}

/// What a pooled `BEGIN` adds when the database's commits would not wait for the WAL's
/// flush ([`durable_commits`]).
macro_rules! durable {
    () => {
        "; SET LOCAL synchronous_commit = on"
    };
}

/// The isolation of every transaction of the gateway: READ COMMITTED, PostgreSQL's own
/// default, pinned because the design depends on it. A claim counts an endpoint's live
/// leases in a statement after the one that locks the endpoint, and only READ COMMITTED
/// gives that statement a snapshot taken after the lock (under REPEATABLE READ it would
/// miss a lease committed meanwhile, and the endpoint's `max_in_flight` could be passed);
/// and under SERIALIZABLE the claims and outcome writes of concurrent workers fail with
/// serialization errors (measured: 121 in 15 s of two replicas on one endpoint, the drain
/// slowed to a crawl by the retries). A database or role whose
/// `default_transaction_isolation` is stricter must not change what the gateway does:
/// direct sessions get it as a startup option (after the URL's own, so it wins), and every
/// `BEGIN` of the gateway names it.
pub const ISOLATION: &str = "read committed";

/// Whether this process found its database's commits not waiting for the WAL's flush
/// (`synchronous_commit = off`, set for the server, the database or the role) and waits
/// for it itself; see [`durable_commits`].
static COMMITS_MADE_DURABLE: AtomicBool = AtomicBool::new(false);

/// Whether the gateway's sessions let PostgreSQL compile statements (JIT): never. Every
/// statement of the gateway is small and bounded, and compiling one takes tens of
/// milliseconds at every execution; only an estimate inflated by a generic plan (a
/// `LIMIT` or an array it cannot see) makes PostgreSQL choose it. Set as a startup option
/// on a direct connection, by every transaction's `BEGIN` behind a pooler.
pub const NO_JIT: &str = "off";

/// `lock_timeout` of the gateway's sessions: none of its own. A database or role may set
/// one for every session (a guard against lock pile-ups); the gateway's claims wait for an
/// endpoint's row by design (a few milliseconds, longer in a burst, one claimer after
/// another), and with a database-wide `lock_timeout` of 2 ms two replicas on one endpoint
/// answered 29 of 2,400 webhooks 503 and failed claims (measured). Its waits are bounded by
/// [`STATEMENT_TIMEOUT`] and each caller's deadline; where it wants a shorter wait it sets
/// one itself (the janitor, the migrations). A URL that sets `lock_timeout` keeps it.
pub const NO_LOCK_TIMEOUT: &str = "0";

/// The `BEGIN` of every transaction behind a transaction pooler: the server-side bounds
/// of [`STATEMENT_TIMEOUT`] and [`IDLE_IN_TRANSACTION_TIMEOUT`], and [`NO_JIT`], for the
/// transaction (a direct connection gets them once, as startup options), in the same round
/// trip.
const POOLED_BEGIN: &str = concat!(begin!(), "; ", pooled_bounds!());

/// [`POOLED_BEGIN`] with the commit made to wait for the WAL's flush.
const POOLED_BEGIN_DURABLE: &str = concat!(begin!(), "; ", pooled_bounds!(), durable!());

/// The `BEGIN` of a transaction behind a transaction pooler: [`POOLED_BEGIN`], and its
/// commit made durable when the database's are not ([`durable_commits`]).
pub(crate) fn pooled_begin() -> &'static str {
    if COMMITS_MADE_DURABLE.load(Ordering::Relaxed) { POOLED_BEGIN_DURABLE } else { POOLED_BEGIN }
}

/// The `BEGIN` of a transaction on a direct connection, with [`ISOLATION`] (the connection's
/// own settings carry the rest).
pub(crate) const DIRECT_BEGIN: &str = begin!();

/// [`Planning::EachCall`]'s settings.
macro_rules! each_call {
    () => {
        "SET LOCAL plan_cache_mode = force_custom_plan"
    };
}

/// [`Planning::Cached`]'s settings: the generic plan, and no plan that reads a table
/// whole (no sequential scan, no hash or merge join), so the plan reaches its rows through
/// indexes even when it was built on an empty table.
macro_rules! cached {
    () => {
        "SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL enable_seqscan = off; \
         SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off"
    };
}

/// The `BEGIN` of a transaction whose statements are planned as `planning` says, behind
/// `pooler`: one round trip (the simple query protocol, which every pooler passes whole).
pub fn begin_sql(pooler: Pooler, planning: Planning) -> &'static str {
    let durable = COMMITS_MADE_DURABLE.load(Ordering::Relaxed);
    match (pooler, planning, durable) {
        (Pooler::None, Planning::EachCall, _) => concat!(begin!(), "; ", each_call!()),
        (Pooler::None, Planning::Cached, _) => concat!(begin!(), "; ", cached!()),
        (Pooler::Transaction, Planning::EachCall, false) => {
            concat!(begin!(), "; ", pooled_bounds!(), "; ", each_call!())
        }
        (Pooler::Transaction, Planning::Cached, false) => concat!(begin!(), "; ", pooled_bounds!(), "; ", cached!()),
        (Pooler::Transaction, Planning::EachCall, true) => {
            concat!(begin!(), "; ", pooled_bounds!(), durable!(), "; ", each_call!())
        }
        (Pooler::Transaction, Planning::Cached, true) => {
            concat!(begin!(), "; ", pooled_bounds!(), durable!(), "; ", cached!())
        }
    }
}

/// Asks a new connection whether its node takes writes, and whether its commits wait for
/// the WAL's flush (one round trip per connection, as the simple query protocol, which
/// every pooler passes whole).
const CONNECTION_STATE: &str = "SELECT NOT (pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'), \
                        current_setting('synchronous_commit') <> 'off'";

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
}

impl DbConfig {
    /// A direct connection to `url` with `pool_size` connections.
    pub fn direct(url: &str, pool_size: u32) -> DbConfig {
        DbConfig { url: url.to_owned(), pool_size, pooler: Pooler::None, session_url: None }
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
    let first = first_connection(&hosts).await?;
    let targets: Vec<tcp::Target> = hosts.iter().map(tcp::Target::of).collect();
    let health = Arc::new(Health::default());
    let (stale, refusals) = (health.clone(), health.clone());
    let pooler = config.pooler;
    // A URL that sets `synchronous_commit` itself is its operator's choice.
    let url_sets_commit = hosts[first].get_options().is_some_and(|o| o.contains("synchronous_commit="));
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
            let (targets, refusals, pooler) = (targets.clone(), refusals.clone(), pooler);
            Box::pin(async move {
                for target in &targets {
                    tcp::harden(target);
                }
                let (writable, durable) = connection_state(conn).await?;
                if !writable {
                    refusals.note_refusal(Refusal::ReadOnly);
                    return Err(read_only_error());
                }
                if !durable {
                    durable_commits(conn, pooler, url_sets_commit).await?;
                }
                Ok(())
            })
        })
        .connect_lazy_with(hosts[first].clone());
    if hosts.len() > 1 {
        tokio::spawn(hosts::follow_writable(inner.clone(), health.clone(), hosts, first));
    }
    Ok(Pool::new(inner, health, config.pooler, session, config.pool_size))
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

/// The first connection, made by hand so that its failure says what is wrong: the first
/// host that takes writes (of several, in order).
async fn first_connection(hosts: &[PgConnectOptions]) -> anyhow::Result<usize> {
    if let [only] = hosts {
        check_first_connection(only).await?;
        return Ok(0);
    }
    hosts::first_writable(hosts).await.map_err(|reasons| {
        anyhow::anyhow!("cannot connect to PostgreSQL: no host takes writes ({})", reasons.join("; "))
    })
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

/// The first connection, made by hand so that its failure says what is wrong.
async fn check_first_connection(options: &PgConnectOptions) -> anyhow::Result<()> {
    let writable = tokio::time::timeout(ACQUIRE_TIMEOUT * 3, writable_at(options))
        .await
        .map_err(|_| anyhow::anyhow!("cannot connect to PostgreSQL: no answer within {:?}", ACQUIRE_TIMEOUT * 3))?
        .map_err(|e| {
            let hint = if e.to_string().contains("unsupported startup parameter") {
                " (a PgBouncer in front of PostgreSQL? set --db-pooler transaction)"
            } else {
                ""
            };
            anyhow::anyhow!("cannot connect to PostgreSQL: {e}{hint}")
        })?;
    if !writable {
        anyhow::bail!(
            "the PostgreSQL server at {}:{} does not take writes (a standby, or default_transaction_read_only is \
             on): the gateway needs the primary",
            options.get_host(),
            options.get_port()
        );
    }
    Ok(())
}

/// Connect to `options` with a connection of its own, ask whether its node takes writes,
/// close it.
async fn writable_at(options: &PgConnectOptions) -> Result<bool, sqlx::Error> {
    let mut conn = options.connect().await?;
    let answer = writable(&mut conn).await;
    let _ = conn.close().await;
    answer
}

/// Whether `conn`'s node takes writes.
async fn writable(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    Ok(connection_state(conn).await?.0)
}

/// Whether `conn`'s node takes writes, and whether its commits wait for the WAL's flush.
async fn connection_state(conn: &mut PgConnection) -> Result<(bool, bool), sqlx::Error> {
    use sqlx::Executor as _;
    let row = conn.fetch_one(sqlx::raw_sql(CONNECTION_STATE)).await?;
    Ok((row.try_get(0)?, row.try_get(1)?))
}

/// A new connection whose commits would not wait for the WAL's flush: the server, the
/// database or the role has `synchronous_commit = off`. Ingest answers 200 after its commit, and the promise
/// is that a webhook answered 200 survives a crash of PostgreSQL; with `off` it may not
/// (PostgreSQL may lose the last few hundred milliseconds of commits). So the gateway's own
/// commits wait for the flush (`on`, PostgreSQL's default) and the log says so once: on a
/// direct connection for the session, behind a transaction pooler in every transaction's
/// `BEGIN` (a session setting would stay on the server connection for the pooler's other
/// clients). Where the gateway commits without the flush on purpose (a claim, which a crash
/// only makes be claimed again), its statements say so themselves and still do. A URL whose
/// `options` set `synchronous_commit` is the operator's explicit choice and is kept.
async fn durable_commits(conn: &mut PgConnection, pooler: Pooler, url_sets_it: bool) -> Result<(), sqlx::Error> {
    use sqlx::Executor as _;
    if url_sets_it {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            tracing::warn!(
                "the database URL sets synchronous_commit = off: a webhook answered 200 may be lost if PostgreSQL \
                 crashes before its commit reaches the disk"
            );
        });
        return Ok(());
    }
    if !COMMITS_MADE_DURABLE.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "the database's synchronous_commit is off (set for the server, the database or the role): the \
             gateway's commits wait for the WAL's flush anyway (synchronous_commit = on), so a webhook answered \
             200 survives a crash"
        );
    }
    match pooler {
        Pooler::None => conn.execute(sqlx::raw_sql("SET synchronous_commit = on")).await.map(|_| ()),
        Pooler::Transaction => Ok(()),
    }
}

/// Whether this process makes its commits wait for the WAL's flush because its database's
/// do not ([`durable_commits`]).
pub fn commits_made_durable() -> bool {
    COMMITS_MADE_DURABLE.load(Ordering::Relaxed)
}

/// The error a connection to a read-only node is refused with (the pool logs it and
/// tries again until its acquire timeout).
fn read_only_error() -> sqlx::Error {
    sqlx::Error::Protocol("the server does not take writes (a standby, or default_transaction_read_only is on)".into())
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
        ("jit", NO_JIT.to_owned()),
        ("lock_timeout", NO_LOCK_TIMEOUT.to_owned()),
    ];
    let given = options.get_options().unwrap_or_default().to_owned();
    let missing: Vec<_> = wanted.into_iter().filter(|(name, _)| !given.contains(&format!("{name}="))).collect();
    let options = if missing.is_empty() { options } else { options.options(missing) };
    // Not a bound the URL may change: the statements are written for it ([`ISOLATION`]).
    // Last, so it wins over the URL's own; `\ ` is a space inside one option's value.
    options.options([("default_transaction_isolation", ISOLATION.replace(' ', "\\ "))])
}

/// How the statements of a transaction are planned: its `plan_cache_mode`, set in the
/// transaction's `BEGIN` ([`Pool::begin_planned`](pool::Pool::begin_planned)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Planning {
    /// Each statement for its parameters (`force_custom_plan`), never with a cached
    /// generic plan.
    ///
    /// The general claim ([`crate::queue::claim_batch`]) walks the due index of
    /// `deliveries`, a table that grows and churns fast. A generic plan is built once, from
    /// the statistics of the moment, and kept until they change: one built for an empty
    /// queue (a gateway starting on a fresh database) walked a whole index per claim at
    /// 61,000 pending (120,000 buffers for 16 rows, even with sequential scans ruled out),
    /// and one built with a backlog hashed the table (25.8 ms per claim at 100,000 pending,
    /// 3-5 ms planned for the call). Planning costs 0.5-1.5 ms per call; a plan that cannot
    /// go stale is worth it. bench/PROFILE.md has the figures.
    EachCall,
    /// The connection's cached generic plan (`force_generic_plan`), built once, with
    /// sequential scans, hash and merge joins ruled out: only for statements that reach
    /// every row by primary key from their parameters (the claim of fresh deliveries,
    /// `queue::claim_fresh`; the recorder's outcome write and the lines it moves on). A
    /// generic plan is built from the statistics of its first call and kept; one built on
    /// an empty table scanned tables once they had grown (and PostgreSQL's default, `auto`,
    /// switched the outcome write to such a plan mid-run: 18-44 ms per write against about
    /// 5 ms); with the whole-table strategies off every table is reached through an index.
    /// `tests/it/plans.rs` builds these plans on an empty queue and runs them at 61,000
    /// pending.
    Cached,
}

/// Plan the rest of the current transaction's statements [`Planning::Cached`] (when its
/// first statements keep the plans they have; otherwise set it in the `BEGIN`:
/// [`Pool::begin_planned`](pool::Pool::begin_planned)), in one round trip.
pub async fn plan_cached(tx: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    use sqlx::Executor as _;
    tx.execute(sqlx::raw_sql(cached!())).await.map(|_| ())
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

/// Key of the transaction-level advisory lock [`migrate`] holds ("wgmigrat").
const MIGRATION_LOCK_KEY: i64 = 0x7767_6d69_6772_6174;

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
    let fail = |e: &dyn std::fmt::Display| anyhow::anyhow!("migrations failed: {e}");
    let mut conn = PgConnection::connect_with(&pool.connect_options()).await.map_err(|e| fail(&e))?;
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
    .map_err(|e| fail(&e));
    let _ = conn.close().await;
    result
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
}

impl NotReady {
    /// The reason `/readyz` gives.
    pub fn reason(self) -> &'static str {
        match self {
            NotReady::MigrationsNotApplied => "migrations not applied",
            NotReady::ReadOnly => "database read-only",
            NotReady::RefusingWrites => "database refusing writes",
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
                    pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'",
        )
        .fetch_one(pool),
    )
    .await
    .map_err(|_| no_answer("the readiness check"))??;
    let applied: Option<i64> = row.try_get(0)?;
    let read_only: bool = row.try_get(1)?;
    Ok(if applied.unwrap_or(0) < latest {
        Err(NotReady::MigrationsNotApplied)
    } else if read_only {
        Err(NotReady::ReadOnly)
    } else if pool.health().refusing_writes() == Some(Refusal::Resources) {
        // A full disk or exhausted memory does not show in a read: the last refusal does.
        Err(NotReady::RefusingWrites)
    } else {
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pooled_begin_sets_the_bounds_a_direct_connection_gets_at_start_up() {
        assert!(POOLED_BEGIN.starts_with("BEGIN ISOLATION LEVEL READ COMMITTED;"));
        assert!(POOLED_BEGIN.contains(&format!("statement_timeout = '{}ms'", STATEMENT_TIMEOUT.as_millis())));
        assert!(POOLED_BEGIN.contains(&format!(
            "idle_in_transaction_session_timeout = '{}ms'",
            IDLE_IN_TRANSACTION_TIMEOUT.as_millis()
        )));
        assert!(POOLED_BEGIN.contains(&format!("SET LOCAL jit = {NO_JIT}")));
        assert!(POOLED_BEGIN.contains(&format!("SET LOCAL lock_timeout = {NO_LOCK_TIMEOUT}")));
    }

    #[test]
    fn a_planned_begin_sets_its_plan_mode_and_behind_a_pooler_the_bounds_too() {
        for (planning, mode) in [(Planning::EachCall, "force_custom_plan"), (Planning::Cached, "force_generic_plan")] {
            let direct = begin_sql(Pooler::None, planning);
            assert!(direct.starts_with(&format!("{DIRECT_BEGIN}; SET LOCAL plan_cache_mode = {mode}")), "{direct}");
            let pooled = begin_sql(Pooler::Transaction, planning);
            assert!(pooled.starts_with(&format!("{POOLED_BEGIN}; SET LOCAL plan_cache_mode = {mode}")), "{pooled}");
            assert_eq!(&pooled[POOLED_BEGIN.len() + 1..], &direct[DIRECT_BEGIN.len() + 1..], "the same settings");
        }
        assert!(begin_sql(Pooler::None, Planning::Cached).contains("SET LOCAL enable_seqscan = off"));
    }

    #[test]
    fn a_durable_pooled_begin_is_the_plain_one_with_the_flush_waited_for() {
        assert_eq!(POOLED_BEGIN_DURABLE, format!("{POOLED_BEGIN}; SET LOCAL synchronous_commit = on"));
        assert!(DIRECT_BEGIN.contains(&ISOLATION.to_uppercase()));
    }

    #[test]
    fn server_bounds_are_added_unless_the_url_sets_them() {
        let options: PgConnectOptions = "postgres://u@h/db".parse().expect("url");
        let added = with_server_bounds(options);
        let added = added.get_options().expect("options");
        assert!(added.contains("-c statement_timeout=30000ms"), "{added}");
        assert!(added.contains("-c idle_in_transaction_session_timeout=60000ms"), "{added}");
        assert!(added.contains("-c tcp_keepalives_idle=10"), "{added}");
        assert!(added.contains("-c jit=off"), "{added}");
        assert!(added.contains("-c lock_timeout=0"), "{added}");
        assert!(added.ends_with("-c default_transaction_isolation=read\\ committed"), "{added}");

        let options: PgConnectOptions =
            "postgres://u@h/db?options=-c%20statement_timeout%3D120s".parse().expect("url with options");
        let kept = with_server_bounds(options);
        let kept = kept.get_options().expect("options");
        assert!(kept.contains("statement_timeout=120s"), "{kept}");
        assert!(!kept.contains("statement_timeout=30000ms"), "{kept}");
        assert!(kept.contains("-c idle_in_transaction_session_timeout=60000ms"), "{kept}");

        // A setting whose name holds another's is not taken for it.
        let options: PgConnectOptions =
            "postgres://u@h/db?options=-c%20jit_above_cost%3D500000".parse().expect("url with options");
        let kept = with_server_bounds(options);
        let kept = kept.get_options().expect("options");
        assert!(kept.contains("jit_above_cost=500000") && kept.contains("-c jit=off"), "{kept}");

        // The isolation is not the URL's to change: the gateway's comes last, and wins.
        let options: PgConnectOptions =
            "postgres://u@h/db?options=-c%20default_transaction_isolation%3Dserializable".parse().expect("url");
        let pinned = with_server_bounds(options);
        let pinned = pinned.get_options().expect("options");
        assert!(pinned.ends_with("-c default_transaction_isolation=read\\ committed"), "{pinned}");
    }
}
