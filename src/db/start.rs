//! A process's first connection: made by hand so that its failure says what is wrong, and
//! tried again while the database may come back by itself.
//!
//! A replica (re)started while its database restarts, fails over or is not reachable yet
//! (a pod scheduled before the database's service answers, a standby not promoted yet)
//! waits for it, up to `--db-start-wait-secs` ([`DEFAULT_START_WAIT`]), saying so in the
//! log, instead of exiting at once and being restarted by its supervisor with a growing
//! back-off. What waiting cannot mend fails at once: authentication, an unknown database,
//! TLS, a pooler's refusal of the startup parameters or of transactions, a server too old.
//!
//! Tested: `first_run::a_gateway_started_before_its_database_waits_for_it` and the tests of
//! each refusal (`pooler`, `tls_database`).

use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions as _, Row as _};
use tokio::time::Instant;

use super::{ACQUIRE_TIMEOUT, hosts, writable};

/// How long a process waits, by default, for a database that may come back by itself.
/// Covers a PostgreSQL restart and a failover under Patroni's defaults (about 30 s).
pub const DEFAULT_START_WAIT: Duration = Duration::from_secs(60);

/// How often the first connection is tried again while it may pass.
const TRY_EVERY: Duration = Duration::from_secs(1);

/// How often the log says the process is still waiting.
const SAY_EVERY: Duration = Duration::from_secs(10);

/// The oldest PostgreSQL whose SQL the gateway uses, as `server_version_num`: 13 put
/// `gen_random_uuid()` in core, which the first migration calls. Nothing newer is used but
/// what a migration guards (lz4 column compression, 14); 15 is what the tests run on.
pub const OLDEST_SERVER_VERSION: i32 = 130_000;

/// The server's version, as a number and as it prints it.
const SERVER_VERSION: &str = "SELECT current_setting('server_version_num')::int, current_setting('server_version')";

/// Why a first connection failed, and whether waiting may mend it.
struct Failure {
    error: anyhow::Error,
    may_pass: bool,
}

/// The first host of `hosts` that takes writes (of several, in order), tried again every
/// [`TRY_EVERY`] for up to `wait` while what keeps it may pass.
pub(super) async fn first_connection(hosts: &[PgConnectOptions], wait: Duration) -> anyhow::Result<usize> {
    retrying(
        wait,
        "first connection",
        "database: not available yet; trying again every second (--db-start-wait-secs)",
        || look(hosts),
    )
    .await
}

/// Run `step` (named `what` in the log) again every [`TRY_EVERY`] for up to `wait` while
/// its failure may pass, saying `say` every [`SAY_EVERY`] meanwhile; when it gives up
/// after saying so, its last error says how long it waited.
async fn retrying<T, F, Fut>(wait: Duration, what: &str, say: &str, mut step: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Failure>>,
{
    let started = Instant::now();
    let mut said: Option<Instant> = None;
    loop {
        let failure = match step().await {
            Ok(done) => {
                if said.is_some() {
                    tracing::info!(waited = ?started.elapsed(), step = what, "database: reached; starting");
                }
                return Ok(done);
            }
            Err(failure) => failure,
        };
        let waited = started.elapsed();
        if !failure.may_pass || waited + TRY_EVERY > wait {
            return Err(if said.is_some() {
                failure.error.context(format!("waited {}s for the database (--db-start-wait-secs)", waited.as_secs()))
            } else {
                failure.error
            });
        }
        if said.is_none_or(|at| at.elapsed() >= SAY_EVERY) {
            tracing::warn!(
                error = %format!("{:#}", failure.error),
                step = what,
                waited_secs = waited.as_secs(),
                wait_secs = wait.as_secs(),
                "{say}"
            );
            said = Some(Instant::now());
        }
        tokio::time::sleep(TRY_EVERY).await;
    }
}

/// One look at `hosts`.
async fn look(hosts: &[PgConnectOptions]) -> Result<usize, Failure> {
    if let [only] = hosts {
        return check(only).await.map(|()| 0);
    }
    hosts::choose(hosts, None, None).await.map(|(found, _)| found).map_err(|(reasons, may_pass)| Failure {
        error: anyhow::anyhow!("cannot connect to PostgreSQL: no host takes writes ({})", reasons.join("; ")),
        may_pass,
    })
}

/// One look at a single host, its failure said with what to change where that is known.
async fn check(options: &PgConnectOptions) -> Result<(), Failure> {
    let writable = match tokio::time::timeout(ACQUIRE_TIMEOUT * 3, writable_at(options)).await {
        Err(_) => {
            let error = anyhow::anyhow!("cannot connect to PostgreSQL: no answer within {:?}", ACQUIRE_TIMEOUT * 3);
            return Err(Failure { error, may_pass: true });
        }
        Ok(Err(e)) => {
            let may_pass = may_pass(&e);
            let said = e.to_string();
            let hint = if said.contains("unsupported startup parameter") {
                " (a PgBouncer in front of PostgreSQL? set --db-pooler transaction)"
            } else if said.contains("statement pooling mode") {
                " (a pooler in statement mode allows no transaction, and every write of the gateway is one: use \
                 pool_mode = transaction with --db-pooler transaction, or session mode)"
            } else {
                ""
            };
            return Err(Failure { error: anyhow::anyhow!("cannot connect to PostgreSQL: {said}{hint}"), may_pass });
        }
        Ok(Ok(writable)) => writable,
    };
    if !writable {
        let error = anyhow::anyhow!(
            "the PostgreSQL server at {}:{} does not take writes (a standby, or default_transaction_read_only is \
             on): the gateway needs the primary",
            options.get_host(),
            options.get_port()
        );
        // A standby may be promoted: a failover under way.
        return Err(Failure { error, may_pass: true });
    }
    Ok(())
}

/// Connect to `options` with a connection of its own, ask whether its node takes writes,
/// close it.
///
/// Asked in a transaction, as every write of the gateway is made: a pooler that allows none
/// (PgBouncer in statement mode) is refused here with its reason, not at the migrations.
/// A server older than [`OLDEST_SERVER_VERSION`] is refused too.
pub(super) async fn writable_at(options: &PgConnectOptions) -> anyhow::Result<bool> {
    Ok(state_at(options, false).await?.is_some())
}

/// As [`writable_at`]: `None` when the node does not take writes, else its [`Lineage`]
/// when `lineage` is asked for and the node tells it (`None` inside: unknown).
pub(super) async fn state_at(
    options: &PgConnectOptions,
    lineage: bool,
) -> anyhow::Result<Option<Option<super::hosts::Lineage>>> {
    use sqlx::{Connection as _, Executor as _};
    let mut conn = options.connect().await?;
    let answer = async {
        let mut tx = conn.begin().await?;
        let version = tx.fetch_one(sqlx::raw_sql(SERVER_VERSION)).await?;
        let answer = writable(&mut tx).await?;
        tx.commit().await?;
        Ok::<_, sqlx::Error>((version.try_get::<i32, _>(0)?, version.try_get::<String, _>(1)?, answer))
    }
    .await;
    let found = match answer {
        Ok((_, _, true)) if lineage => super::hosts::lineage(&mut conn).await,
        _ => None,
    };
    let _ = conn.close().await;
    let (number, version, writable) = answer?;
    anyhow::ensure!(
        number >= OLDEST_SERVER_VERSION,
        "PostgreSQL {version} is older than the gateway needs (13 or later; tested on 15, docs/production-postgres.md)"
    );
    Ok(writable.then_some(found))
}

/// Whether waiting may mend a first connection's failure `err`: the server or the path to
/// it not there yet, starting, shutting down or out of connections, or a pooler saying so
/// of its server. Not: whatever the server or pooler refuses of who we are or what we ask.
pub(super) fn may_pass(err: &anyhow::Error) -> bool {
    err.downcast_ref::<sqlx::Error>().is_some_and(may_pass_sqlx)
}

/// [`may_pass`] for a `sqlx::Error`; also the pool's checkout timing out (a start-up step
/// after the first connection: the pool could not open one in time).
fn may_pass_sqlx(err: &sqlx::Error) -> bool {
    match err {
        // Refused, reset, unreachable, a name not resolved yet; marked by `failure` (no
        // connection opened, held back, no answer in time).
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => true,
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // Starting up or in recovery; too many connections; shut down; the connection
            // failed or was rejected.
            Some("57P03" | "53300" | "57P01" | "57P02" | "08000" | "08001" | "08004" | "08006") => true,
            // PgBouncer's own errors carry 08P01 whatever they say: only those about its
            // server or its clients pass by themselves (not "unsupported startup
            // parameter", not "transaction blocks not allowed in statement pooling mode").
            Some("08P01") => {
                ["cannot connect to server", "server login has been failing", "max_client_conn", "shutting down"]
                    .iter()
                    .any(|passing| db.message().contains(passing))
            }
            _ => false,
        },
        _ => false,
    }
}

/// Run the start-up step `step` (named `what` in the log), trying it again every
/// [`TRY_EVERY`] for up to `wait` while it fails because the database is unavailable
/// (out of connections, restarting, failing over; the pool's checkout timing out): the
/// first connection waited the same way, and a slot it found free may be taken by
/// another replica before the steps after it run. A fleet started at once on a database
/// near its `max_connections` had replicas exit 1 three seconds in (a review saw 6 of 16).
/// Any other failure (a migration's own error, a secret that does not open) ends it.
pub async fn waiting<T, F, Fut>(wait: Duration, what: &str, mut step: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    const SAY: &str = "database: not available for a start-up step; trying again every second (--db-start-wait-secs)";
    retrying(wait, what, SAY, || {
        let attempt = step();
        async move {
            attempt.await.map_err(|error| {
                // What may pass by itself, as for the first connection: not what the
                // database answers the step itself (a migration's own error, a pooler in
                // statement mode).
                let may_pass =
                    error.chain().any(|cause| cause.downcast_ref::<sqlx::Error>().is_some_and(may_pass_sqlx));
                Failure { error, may_pass }
            })
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io(kind: std::io::ErrorKind) -> anyhow::Error {
        sqlx::Error::Io(std::io::Error::new(kind, "x")).into()
    }

    #[test]
    fn what_may_pass_by_itself_is_waited_for_and_nothing_else() {
        assert!(may_pass(&io(std::io::ErrorKind::ConnectionRefused)), "the server not listening yet");
        assert!(may_pass(&io(std::io::ErrorKind::ConnectionReset)));
        assert!(!may_pass(&sqlx::Error::Tls("bad certificate".into()).into()), "TLS is configuration");
        assert!(!may_pass(&sqlx::Error::Configuration("bad URL".into()).into()));
        assert!(!may_pass(&anyhow::anyhow!("PostgreSQL 12.1 is older than the gateway needs")), "the version");
    }
}
