//! What every session and transaction of the gateway is told, whatever the database, the
//! role or a pooler would give it: the server-side bounds (module [`super`]'s table), the
//! isolation its statements are written for, commits that wait for the WAL's flush, and
//! how a transaction's statements are planned. A direct connection gets the session's
//! settings as startup options ([`with_server_bounds`]); behind a transaction pooler every
//! transaction's `BEGIN` sets them for the transaction ([`begin_sql`]), in the same round
//! trip.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{PgConnection, Row};

use super::Pooler;

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

/// The `BEGIN` of a transaction behind `pooler` whose statements are planned as `planning`
/// says (the connection's own way when `None`), its commit made to wait for the WAL's flush
/// when `made_durable` ([`durable_commits`]; a direct connection's session already does):
/// one round trip (the simple query protocol, which every pooler passes whole), one literal
/// built at compile time.
pub fn begin_sql(pooler: Pooler, planning: Option<Planning>, made_durable: bool) -> &'static str {
    match (pooler, planning, made_durable) {
        (Pooler::None, None, _) => DIRECT_BEGIN,
        (Pooler::None, Some(Planning::EachCall), _) => concat!(begin!(), "; ", each_call!()),
        (Pooler::None, Some(Planning::Cached), _) => concat!(begin!(), "; ", cached!()),
        (Pooler::Transaction, None, false) => POOLED_BEGIN,
        (Pooler::Transaction, None, true) => POOLED_BEGIN_DURABLE,
        (Pooler::Transaction, Some(Planning::EachCall), false) => {
            concat!(begin!(), "; ", pooled_bounds!(), "; ", each_call!())
        }
        (Pooler::Transaction, Some(Planning::Cached), false) => {
            concat!(begin!(), "; ", pooled_bounds!(), "; ", cached!())
        }
        (Pooler::Transaction, Some(Planning::EachCall), true) => {
            concat!(begin!(), "; ", pooled_bounds!(), durable!(), "; ", each_call!())
        }
        (Pooler::Transaction, Some(Planning::Cached), true) => {
            concat!(begin!(), "; ", pooled_bounds!(), durable!(), "; ", cached!())
        }
    }
}

/// Asks a new connection whether its node takes writes, and whether its commits wait for
/// the WAL's flush (one round trip per connection, as the simple query protocol, which
/// every pooler passes whole).
const CONNECTION_STATE: &str = "SELECT NOT (pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'), \
                        current_setting('synchronous_commit') <> 'off'";

/// Whether `conn`'s node takes writes, and whether its commits wait for the WAL's flush.
pub(super) async fn connection_state(conn: &mut PgConnection) -> Result<(bool, bool), sqlx::Error> {
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
///
/// `made_durable` is the pool's: a pool behind a transaction pooler reads it for every
/// `BEGIN` ([`begin_sql`]). Per pool, not per process: a pool on a database whose commits
/// already wait adds nothing to its transactions whatever another pool found.
pub(super) async fn durable_commits(
    conn: &mut PgConnection,
    pooler: Pooler,
    url_sets_it: bool,
    made_durable: &AtomicBool,
) -> Result<(), sqlx::Error> {
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
    if !made_durable.swap(true, Ordering::Relaxed) {
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

/// `options` with the server-side bounds added, except those its URL already sets.
pub(super) fn with_server_bounds(options: PgConnectOptions) -> PgConnectOptions {
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
            let direct = begin_sql(Pooler::None, Some(planning), false);
            assert!(direct.starts_with(&format!("{DIRECT_BEGIN}; SET LOCAL plan_cache_mode = {mode}")), "{direct}");
            assert_eq!(begin_sql(Pooler::None, Some(planning), true), direct, "a direct session is durable already");
            for (made_durable, begin) in [(false, POOLED_BEGIN), (true, POOLED_BEGIN_DURABLE)] {
                let pooled = begin_sql(Pooler::Transaction, Some(planning), made_durable);
                assert!(pooled.starts_with(&format!("{begin}; SET LOCAL plan_cache_mode = {mode}")), "{pooled}");
                assert_eq!(&pooled[begin.len() + 1..], &direct[DIRECT_BEGIN.len() + 1..], "the same settings");
            }
        }
        assert!(begin_sql(Pooler::None, Some(Planning::Cached), false).contains("SET LOCAL enable_seqscan = off"));
    }

    #[test]
    fn a_durable_pooled_begin_is_the_plain_one_with_the_flush_waited_for() {
        assert_eq!(POOLED_BEGIN_DURABLE, format!("{POOLED_BEGIN}; SET LOCAL synchronous_commit = on"));
        assert_eq!(begin_sql(Pooler::Transaction, None, false), POOLED_BEGIN);
        assert_eq!(begin_sql(Pooler::Transaction, None, true), POOLED_BEGIN_DURABLE);
        for made_durable in [false, true] {
            assert_eq!(begin_sql(Pooler::None, None, made_durable), DIRECT_BEGIN);
        }
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
