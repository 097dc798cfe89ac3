//! A call its caller stopped waiting for (the 45 s bound of the background calls, an
//! admin call's deadline, a stop) leaves its connection fit for the next caller: never
//! inside a transaction that call began.
//!
//! The case that broke it: a `BEGIN` sent and not yet answered when its caller gave up (a
//! frozen database, a partition). sqlx 0.8.6 counts a transaction, which is what its
//! rollback guard keys on, only once the `BEGIN`'s answer is read, so nothing rolled it
//! back, and the pool's check on return read the late answer and handed the connection
//! on inside it. The next caller's statements ran in that transaction: PostgreSQL logged
//! `there is already a transaction in progress`, and a statement acknowledged as committed
//! was not (it went when the connection's next transaction rolled back, or its session
//! ended).
//!
//! Played with the suite's proxy: held bytes reach the server, in order, once it heals,
//! so the `BEGIN` arrives after its caller gave up, as after a freeze.

use std::time::Duration;

use webhook_gateway::db::{self, DbConfig, Pool, Pooler};

use crate::support::pgbouncer::PgBouncer;
use crate::support::proxy::{Proxy, server_addr};
use crate::support::{TestDb, eventually};

/// Sessions of the test database idle inside a transaction (what each last ran).
async fn idle_in_transaction(db: &TestDb) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT left(query, 80) FROM pg_stat_activity
         WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
    )
    .fetch_all(&db.pool)
    .await
    .expect("pg_stat_activity")
}

/// Abandon `call` on `pool` while `proxy` holds every byte, then heal: the call's bytes
/// reach the server after its caller gave up.
async fn abandon_in_flight<F: std::future::Future>(proxy: &Proxy, call: F) {
    proxy.blackhole();
    let ended = tokio::time::timeout(Duration::from_millis(300), call).await;
    assert!(ended.is_err(), "the caller's bound ended first");
    proxy.heal();
}

/// No session of the database stays idle in a transaction (within 5 s: the server and a
/// pooler see the connection closed).
async fn no_transaction_left_open(db: &TestDb) {
    eventually(Duration::from_secs(5), "no session idle in a transaction", || async {
        idle_in_transaction(db).await.is_empty().then_some(())
    })
    .await;
}

/// Direct (`--db-pooler none`), a pool of one connection: a transaction whose `BEGIN` was
/// abandoned on the wire (`pool.begin()`, as the recorder, the claims and the admin calls
/// begin theirs), then an autocommit statement on the pool (ingest's batch): committed,
/// and still there after the pool's next transaction rolls back.
#[tokio::test]
async fn a_begin_abandoned_on_the_wire_leaves_no_transaction_for_the_next_caller() {
    let test_db = TestDb::new().await;
    let proxy = Proxy::start(server_addr(&test_db.url)).await;
    let pool = db::connect(&proxy.url_for(&test_db.url), 1).await.expect("pool");
    db::query("CREATE TABLE acknowledged (n int)").execute(&pool).await.expect("table");

    abandon_in_flight(&proxy, pool.begin()).await;
    no_transaction_left_open(&test_db).await;

    db::query("INSERT INTO acknowledged VALUES (1)").execute(&pool).await.expect("an acknowledged insert");
    let stored = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM acknowledged").fetch_one(&test_db.pool).await.expect("count")
    };
    assert_eq!(stored().await, 1, "committed when acknowledged");
    pool.begin().await.expect("begin").rollback().await.expect("rollback");
    assert_eq!(stored().await, 1, "an unrelated rollback on the connection left it alone");
}

/// Behind PgBouncer in transaction mode, where every statement of the pool runs in its
/// own `BEGIN ... COMMIT` (`Pool::run`): a statement abandoned in its `BEGIN` leaves no
/// server connection pinned inside that transaction (before: idle in it until the
/// session's 60 s limit ended it, and the next statement on the client connection ran in
/// it, with the old transaction's `now()`).
#[tokio::test]
async fn a_pooled_statement_abandoned_in_its_begin_leaves_no_transaction_open() {
    let test_db = TestDb::new().await;
    let bouncer = PgBouncer::start(&test_db.url, 1);
    let proxy = Proxy::start(server_addr(&bouncer.url(&test_db.name(), &test_db.url))).await;
    let config = DbConfig {
        pooler: Pooler::Transaction,
        ..DbConfig::direct(&proxy.url_for(&bouncer.url(&test_db.name(), &test_db.url)), 1)
    };
    let pool: Pool = db::open(&config).await.expect("pool");
    db::query("SELECT 1").execute(&pool).await.expect("a first statement");

    abandon_in_flight(&proxy, db::query("SELECT 1").execute(&pool)).await;
    no_transaction_left_open(&test_db).await;
    let now_is_now: bool =
        db::query_scalar("SELECT now() > clock_timestamp() - interval '1 second'").fetch_one(&pool).await.expect("now");
    assert!(now_is_now, "the next statement ran in a transaction of its own");
}
