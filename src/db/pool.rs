//! [`Pool`]: the handle every part of the gateway reaches PostgreSQL through, and what
//! lets it run behind a transaction pooler.
//!
//! # Transaction poolers
//!
//! PgBouncer in transaction mode (the default pooling of most managed PostgreSQL), pgcat,
//! Supavisor and RDS Proxy hand the server connection to another client after every
//! transaction. Nothing may then rely on session state outliving a transaction, and
//! sqlx relies on two kinds by default:
//!
//! - **Named prepared statements**, cached per connection (`sqlx_s_1`, ...): the next
//!   transaction may run on a server connection where another client prepared
//!   `sqlx_s_1` (`prepared statement "sqlx_s_1" already exists`) or where it was never
//!   prepared (`... does not exist`). With [`Pooler::Transaction`] every statement uses
//!   the unnamed statement ([`query`], [`query_as`], [`query_scalar`] mark them; the pool
//!   marks the rest) and the statement cache is off.
//! - **Two round trips per statement.** sqlx parses and describes a statement, waits for
//!   the server to be idle, then binds and executes it. Outside a transaction the pooler
//!   may hand the server connection to someone else in between: the bind then fails, or
//!   worse binds another client's unnamed statement. So with [`Pooler::Transaction`] a
//!   statement run on the pool (not inside a transaction the caller began) runs inside
//!   `BEGIN ... COMMIT`, which the pooler keeps on one server connection.
//!
//! The server-side bounds travel as the startup `options` parameter on a direct
//! connection; PgBouncer refuses unknown startup parameters, so behind a pooler every
//! transaction sets them with `SET LOCAL` in the same round trip as its `BEGIN`.
//!
//! Features that truly need a session (`LISTEN` for wake-ups across processes) use the
//! optional direct session URL ([`Pool::session_pool`]); without one they fall back
//! to what works without a session (polling), and say so once in the log.
//!
//! What it costs: benchmark row 12 (README, "Benchmarks").

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::future::BoxFuture;
use futures_util::stream::{self, BoxStream};
use futures_util::{FutureExt, StreamExt, TryStreamExt};
use serde::Deserialize;
use sqlx::postgres::{PgArguments, PgConnectOptions, PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::query::{Query, QueryAs, QueryScalar};
use sqlx::{Either, Execute, Executor, PgPool, Postgres};

use super::failure::{Health, Unavailable};
use super::tx::Tx;
use super::warm::{Warm, WarmConn};

/// What sits between the gateway and PostgreSQL (`--db-pooler`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooler {
    /// PostgreSQL itself, or a pooler in session mode: prepared statements are cached per
    /// connection (one round trip per statement).
    #[default]
    None,
    /// A pooler that hands the server connection to another client after each
    /// transaction (PgBouncer `pool_mode = transaction`, pgcat, Supavisor, RDS Proxy): no
    /// session state is relied on.
    Transaction,
}

/// Whether statements are prepared as named, cached statements. Off once this process
/// has opened a pool behind a transaction pooler (a process serves one database).
static NAMED_STATEMENTS: AtomicBool = AtomicBool::new(true);

/// Whether this process prepares its statements as named, cached ones: true until it
/// opens a pool behind a transaction pooler, after which every statement is a one-shot,
/// planned by PostgreSQL for the values it carries. (Read by tests that count a
/// session's prepared statements.)
pub fn named_statements() -> bool {
    NAMED_STATEMENTS.load(Ordering::Relaxed)
}

/// `sqlx::query`, prepared the way this process's database allows (see the module doc);
/// behind a transaction pooler, a statement whose plan is kept in a function
/// ([`super::kept_plans`]) calls that function instead. Every statement of the gateway is
/// built with this or its two siblings.
#[allow(clippy::disallowed_methods)]
pub fn query(sql: &str) -> Query<'_, Postgres, PgArguments> {
    sqlx::query(super::kept_plans::wrapped(sql).unwrap_or(sql)).persistent(named_statements())
}

/// [`query`] with room for `params` bind parameters of `bytes` encoded bytes in all, so
/// binding a large batch writes into one buffer instead of growing it from empty (a
/// batch's bodies were copied over again at every doubling: about 7,000 instructions an
/// ingest request; bench/PROFILE.md, "A batch's parameters bound into one buffer"). An
/// estimate off either way only changes how often the buffer grows.
#[allow(clippy::disallowed_methods)]
pub fn query_sized(sql: &str, params: usize, bytes: usize) -> Query<'_, Postgres, PgArguments> {
    let mut arguments = PgArguments::default();
    sqlx::Arguments::reserve(&mut arguments, params, bytes);
    sqlx::query_with(super::kept_plans::wrapped(sql).unwrap_or(sql), arguments).persistent(named_statements())
}

/// Run `sql`, a delete of at most `$2` rows older than `$1` (a retention batch, each
/// table's statement written beside its table's other SQL): how many rows went.
pub async fn delete_batch(
    db: impl sqlx::PgExecutor<'_>,
    sql: &str,
    before: chrono::DateTime<chrono::Utc>,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    Ok(query(sql).bind(before).bind(batch).execute(db).await?.rows_affected())
}

/// `sqlx::query_as`, prepared as [`query`] is.
#[allow(clippy::disallowed_methods)]
pub fn query_as<'q, O>(sql: &'q str) -> QueryAs<'q, Postgres, O, PgArguments>
where
    O: for<'r> sqlx::FromRow<'r, PgRow>,
{
    sqlx::query_as(super::kept_plans::wrapped(sql).unwrap_or(sql)).persistent(named_statements())
}

/// `sqlx::query_scalar`, prepared as [`query`] is.
#[allow(clippy::disallowed_methods)]
pub fn query_scalar<'q, O>(sql: &'q str) -> QueryScalar<'q, Postgres, O, PgArguments>
where
    (O,): for<'r> sqlx::FromRow<'r, PgRow>,
{
    sqlx::query_scalar(super::kept_plans::wrapped(sql).unwrap_or(sql)).persistent(named_statements())
}

/// `QueryBuilder::build_query_as`, prepared as [`query`] is (a built statement is named
/// and cached by default, which behind a transaction pooler meets another client's).
#[allow(clippy::disallowed_methods)]
pub fn built_as<'q, 'args, O>(
    builder: &'q mut sqlx::QueryBuilder<'args, Postgres>,
) -> QueryAs<'q, Postgres, O, PgArguments>
where
    O: for<'r> sqlx::FromRow<'r, PgRow>,
{
    builder.build_query_as().persistent(named_statements())
}

/// `QueryBuilder::build_query_scalar`, prepared as [`query`] is.
#[allow(clippy::disallowed_methods)]
pub fn built_scalar<'q, 'args, O>(
    builder: &'q mut sqlx::QueryBuilder<'args, Postgres>,
) -> QueryScalar<'q, Postgres, O, PgArguments>
where
    (O,): for<'r> sqlx::FromRow<'r, PgRow>,
{
    builder.build_query_scalar().persistent(named_statements())
}

/// The gateway's connection pool: sqlx's pool, the [`Health`] its failures report to,
/// and the way to reach PostgreSQL for what needs a session. Cheap to clone.
///
/// It is an executor (`query.fetch_one(&pool)`) like sqlx's pool; behind a transaction
/// pooler each such statement runs in its own transaction (see the module doc).
///
/// Every statement and transaction takes the connection returned last ([`super::warm`]),
/// and gives it back warm when it ends ([`Tx`]).
#[derive(Clone)]
pub struct Pool {
    inner: PgPool,
    warm: Arc<Warm>,
    health: Arc<Health>,
    pooler: Pooler,
    session: Option<Arc<PgConnectOptions>>,
    /// Whether this pool's connections found the database's commits not waiting for the
    /// WAL's flush, so that its pooled transactions' `BEGIN` makes them wait
    /// ([`super::session::durable_commits`]).
    made_durable: Arc<AtomicBool>,
    /// How long the start-up waits for a database that may come back by itself
    /// (`--db-start-wait-secs`; zero: it does not wait).
    start_wait: std::time::Duration,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("pooler", &self.pooler).field("size", &self.inner.size()).finish()
    }
}

impl Pool {
    pub(super) fn new(
        inner: PgPool,
        health: Arc<Health>,
        pooler: Pooler,
        session: Option<PgConnectOptions>,
        pool_size: u32,
        made_durable: Arc<AtomicBool>,
    ) -> Pool {
        if pooler == Pooler::Transaction {
            NAMED_STATEMENTS.store(false, Ordering::Relaxed);
        }
        let warm = Arc::new(Warm::new(pool_size));
        Pool {
            inner,
            warm,
            health,
            pooler,
            session: session.map(Arc::new),
            made_durable,
            start_wait: std::time::Duration::ZERO,
        }
    }

    /// This pool, its start-up waiting up to `wait` for a database that may come back.
    pub(super) fn with_start_wait(mut self, wait: std::time::Duration) -> Pool {
        self.start_wait = wait;
        self
    }

    /// How long the start-up waits for a database that may come back by itself
    /// (`--db-start-wait-secs`), at each of its steps ([`super::start::waiting`]).
    pub fn start_wait(&self) -> std::time::Duration {
        self.start_wait
    }

    /// The `BEGIN` of this pool's transactions planned as `planning` says: read when the
    /// connection is there, as a new connection may have just found the database's
    /// commits not durable.
    fn begin_sql(&self, planning: Option<super::Planning>) -> &'static str {
        super::begin_sql(self.pooler, planning, self.commits_made_durable())
    }

    /// Whether this pool makes its commits wait for the WAL's flush because its
    /// database's do not (`synchronous_commit = off` for the server, the database or the
    /// role): on a direct connection for the session, behind a transaction pooler in every
    /// transaction's `BEGIN`.
    pub fn commits_made_durable(&self) -> bool {
        self.made_durable.load(Ordering::Relaxed)
    }

    /// The connection returned last, or one from sqlx's pool ([`super::warm`]).
    async fn take(&self) -> Result<WarmConn, sqlx::Error> {
        self.warm.take(&self.inner, &self.health).await
    }

    /// Keep `conn`, whose statement ran to the end, warm for the next caller.
    fn give_back(&self, conn: WarmConn) {
        self.warm.give_back(conn, &self.health);
    }

    /// A transaction on the connection returned last, planned as `planning` says (the
    /// connection's own way when `None`); committed or rolled back, its connection is kept
    /// warm ([`Tx`]). Its `BEGIN` is chosen once the connection is there: a new connection
    /// may have just found the database's commits not durable ([`Self::begin_sql`]), which
    /// a pooled `BEGIN` then makes up for.
    async fn begin_on_warm(&self, planning: Option<super::Planning>) -> Result<Tx, sqlx::Error> {
        let conn = self.take().await?;
        let begin = self.begin_sql(planning);
        Tx::begin(conn, Some(begin), self.warm.clone(), self.health.clone()).await
    }

    /// Run `query` to its end on a warm connection ([`Self::take`]), inside a transaction
    /// behind a transaction pooler; the whole answer is read before the connection is
    /// given back (every statement of the gateway returns a bounded number of rows). A
    /// failed statement's connection goes back to sqlx's pool (and its checks).
    async fn run<'q, E>(&self, query: E) -> Result<Vec<Item>, sqlx::Error>
    where
        E: 'q + Execute<'q, Postgres>,
    {
        let mut conn = self.take().await?;
        match self.pooler {
            Pooler::None => {
                let items: Vec<Item> = conn.conn().fetch_many(query).try_collect().await?;
                self.give_back(conn);
                Ok(items)
            }
            // A `Tx`: its `BEGIN` abandoned closes the connection (see `Tx::begin`); its
            // commit keeps the connection warm.
            Pooler::Transaction => {
                let begin = self.begin_sql(None);
                let mut tx = Tx::begin(conn, Some(begin), self.warm.clone(), self.health.clone()).await?;
                let items: Vec<Item> = (&mut *tx).fetch_many(Unnamed(query)).try_collect().await?;
                tx.commit().await?;
                Ok(items)
            }
        }
    }

    /// What sits between this pool and PostgreSQL.
    pub fn pooler(&self) -> Pooler {
        self.pooler
    }

    /// What failed calls have told this pool about its database.
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// Classify a failed call's error (as [`super::unavailable`]) and tell this pool's
    /// [`Health`] what it says about the node. The hot write paths (ingest, claim, outcome
    /// recorder) report their errors here; the pool's own statements do it themselves.
    pub fn note(&self, err: &sqlx::Error) -> Option<Unavailable> {
        self.health.note(err)
    }

    /// A pool to open connections that keep their session (`LISTEN`; sqlx's listener
    /// opens and reopens its connection through a pool): this pool itself when it reaches
    /// PostgreSQL directly (so a listener follows it to another host after a failover),
    /// a pool of one connection through the session URL behind a transaction pooler, and
    /// `None` behind a pooler without one.
    pub fn session_pool(&self) -> Option<PgPool> {
        match self.pooler {
            Pooler::None => Some(self.inner.clone()),
            Pooler::Transaction => self.session.as_deref().map(|options| super::single_session_pool(options.clone())),
        }
    }

    /// Options for a dedicated connection that runs ordinary transactions (not session
    /// state): the pool's own.
    pub fn connect_options(&self) -> Arc<PgConnectOptions> {
        self.inner.connect_options()
    }

    /// Begin a transaction on a pooled connection, at [`super::ISOLATION`]. Behind a
    /// transaction pooler its `BEGIN` also sets the server-side bounds for the transaction
    /// (same round trip).
    pub async fn begin(&self) -> Result<Tx, sqlx::Error> {
        self.begin_on_warm(None).await.inspect_err(|e| {
            self.note(e);
        })
    }

    /// Begin a transaction whose statements are planned as `planning` says, set in the
    /// same round trip as its `BEGIN` (with the pooler's bounds, behind one).
    pub async fn begin_planned(&self, planning: super::Planning) -> Result<Tx, sqlx::Error> {
        self.begin_on_warm(Some(planning)).await.inspect_err(|e| {
            self.note(e);
        })
    }

    /// Close every connection and refuse new calls.
    pub async fn close(&self) {
        self.warm.close();
        self.inner.close().await;
    }

    /// Open connections (idle and in use).
    pub fn size(&self) -> u32 {
        self.inner.size()
    }

    /// Idle connections (sqlx's and those kept warm).
    pub fn num_idle(&self) -> usize {
        self.inner.num_idle() + self.warm.len()
    }

    /// Idle connections kept warm ([`super::warm`]; counted in [`Self::num_idle`]).
    pub fn num_warm(&self) -> usize {
        self.warm.len()
    }
}

/// A statement run as the unnamed statement, whatever its builder asked for.
struct Unnamed<E>(E);

impl<'q, E: Execute<'q, Postgres>> Execute<'q, Postgres> for Unnamed<E> {
    fn sql(&self) -> &'q str {
        self.0.sql()
    }

    fn statement(&self) -> Option<&PgStatement<'q>> {
        self.0.statement()
    }

    fn take_arguments(&mut self) -> Result<Option<PgArguments>, sqlx::error::BoxDynError> {
        self.0.take_arguments()
    }

    fn persistent(&self) -> bool {
        false
    }
}

type Item = Either<PgQueryResult, PgRow>;

impl<'p> Executor<'p> for &'_ Pool {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Result<Item, sqlx::Error>>
    where
        'p: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let pool = self.clone();
        stream::once(async move {
            pool.run(query).await.inspect_err(|e| {
                pool.health.note(e);
            })
        })
        .map_ok(|items| stream::iter(items.into_iter().map(Ok)))
        .try_flatten()
        .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'p: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let pool = self.clone();
        async move {
            let items = pool.run(query).await.inspect_err(|e| {
                pool.health.note(e);
            })?;
            Ok(items.into_iter().find_map(|item| item.right()))
        }
        .boxed()
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'p: 'e,
    {
        self.inner.prepare_with(sql, parameters)
    }

    fn describe<'e, 'q: 'e>(self, sql: &'q str) -> BoxFuture<'e, Result<sqlx::Describe<Postgres>, sqlx::Error>>
    where
        'p: 'e,
    {
        self.inner.describe(sql)
    }
}
