//! The pool hands out the connection returned last (`db::warm`): statements in a row run
//! on one PostgreSQL backend instead of going round every connection the pool holds, and
//! that never costs a caller its connection, a statement its answer, or a failover its
//! stale-connection check.

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use webhook_gateway::db::{self, Pool};

use crate::support::TestDb;

/// The backend that serves one statement.
async fn backend(pool: &Pool) -> i32 {
    db::query_scalar("SELECT pg_backend_pid()").fetch_one(pool).await.expect("backend pid")
}

/// A pool of 8 on a fresh database that has opened 4 connections at once (each statement
/// held its own for a moment), and the database.
async fn grown_pool() -> (TestDb, Pool) {
    let test_db = TestDb::new().await;
    let pool = db::connect(&test_db.url, 8).await.expect("pool");
    // Long enough that the four connections are open before any statement ends, on a
    // loaded machine too: a connection given back while another caller still waits for
    // sqlx's pool goes there, not warm (a clean-clone run once kept three).
    let sleeps = (0..4).map(|_| db::query("SELECT pg_sleep(1)").execute(&pool));
    for done in futures_util::future::join_all(sleeps).await {
        done.expect("sleep");
    }
    (test_db, pool)
}

/// The control: sqlx's own pool of 8 on `url`, grown the same way as [`grown_pool`].
async fn grown_sqlx_pool(url: &str) -> sqlx::PgPool {
    let plain = PgPoolOptions::new().max_connections(8).connect(url).await.expect("sqlx pool");
    let sleeps = (0..4).map(|_| sqlx::query("SELECT pg_sleep(1)").execute(&plain));
    for done in futures_util::future::join_all(sleeps).await {
        done.expect("sleep");
    }
    plain
}

/// How many distinct backends served `pids`.
fn distinct(mut pids: Vec<i32>) -> Vec<i32> {
    pids.sort_unstable();
    pids.dedup();
    pids
}

#[tokio::test]
async fn statements_in_a_row_run_on_the_connection_used_last() {
    let (test_db, pool) = grown_pool().await;
    assert!(pool.size() >= 4, "the pool opened {} connections", pool.size());
    let mut backends = Vec::new();
    for _ in 0..20 {
        backends.push(backend(&pool).await);
    }
    backends.dedup();
    assert_eq!(backends.len(), 1, "twenty statements in a row, one backend: {backends:?}");

    // Control: sqlx's pool alone, grown the same way, goes round its connections.
    let plain = grown_sqlx_pool(&test_db.url).await;
    let mut rotated = Vec::new();
    for _ in 0..20 {
        rotated.push(sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()").fetch_one(&plain).await.expect("pid"));
    }
    let rotated = distinct(rotated);
    assert!(rotated.len() >= 2, "sqlx's pool alone used {rotated:?}");
}

#[tokio::test]
async fn a_caller_waiting_for_sqlx_s_pool_gets_the_connection_given_back() {
    let test_db = TestDb::new().await;
    // Two connections: one held by a transaction, one by a slow statement; a third
    // caller has to wait for sqlx's pool, and the slow statement's connection, which
    // would otherwise be kept warm, must reach it.
    let pool = db::connect(&test_db.url, 2).await.expect("pool");
    let held = pool.begin().await.expect("a transaction holds one connection");
    let slow = {
        let pool = pool.clone();
        tokio::spawn(async move { db::query("SELECT pg_sleep(0.5)").execute(&pool).await })
    };
    crate::support::eventually(Duration::from_secs(10), "the slow statement running", || async {
        let running: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(0.5)' AND state = 'active'",
        )
        .fetch_one(&test_db.pool)
        .await
        .expect("activity");
        (running == 1).then_some(())
    })
    .await;
    assert_eq!(pool.num_idle(), 0, "both connections busy");
    // Within the pool's acquire timeout (3 s) of the slow statement's end; a connection
    // kept warm instead would leave this waiting until PoolTimedOut.
    let third = pool.begin().await.expect("the third caller gets the slow statement's connection");
    slow.await.expect("slow task").expect("slow statement");
    third.commit().await.expect("commit");
    held.commit().await.expect("commit");
}

#[tokio::test]
async fn a_connection_kept_warm_is_let_go_once_the_pool_marks_its_connections_stale() {
    let test_db = TestDb::new().await;
    let pool = db::connect(&test_db.url, 4).await.expect("pool");
    let first = backend(&pool).await;
    assert_eq!(backend(&pool).await, first, "kept warm while nothing happened");
    // What a failover does (`db::hosts`): every connection opened until now is suspect.
    pool.health().mark_all_stale();
    let after = backend(&pool).await;
    assert_ne!(after, first, "a connection opened before the mark is not used again");
    crate::support::eventually(Duration::from_secs(10), "the stale backend closed", || async {
        let alive: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = $1")
            .bind(first)
            .fetch_one(&test_db.pool)
            .await
            .expect("activity");
        (alive == 0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_statement_abandoned_or_failed_leaves_no_answer_behind_for_the_next() {
    let test_db = TestDb::new().await;
    let pool = db::connect(&test_db.url, 4).await.expect("pool");

    // Abandoned mid-statement: its connection may still owe the statement's answer.
    let abandoned =
        tokio::time::timeout(Duration::from_millis(100), db::query("SELECT 41, pg_sleep(1)").fetch_one(&pool)).await;
    assert!(abandoned.is_err(), "the caller stopped waiting");
    for expected in 1..=20 {
        let got: i32 = db::query_scalar("SELECT $1::int4").bind(expected).fetch_one(&pool).await.expect("statement");
        assert_eq!(got, expected, "each statement reads its own answer");
    }

    // Failed: the error is the caller's, the next statement is unaffected.
    let failed = db::query_scalar::<i32>("SELECT 1 / 0").fetch_one(&pool).await;
    assert!(failed.is_err(), "division by zero fails");
    let got: i32 = db::query_scalar("SELECT 7").fetch_one(&pool).await.expect("statement after a failure");
    assert_eq!(got, 7);

    // A transaction rolled back by being dropped: nothing it wrote is seen.
    db::query("CREATE TABLE warm_probe (n int)").execute(&pool).await.expect("table");
    {
        let mut tx = pool.begin().await.expect("begin");
        db::query("INSERT INTO warm_probe VALUES (1)").execute(&mut *tx).await.expect("insert");
    }
    let rows: i64 = db::query_scalar("SELECT count(*) FROM warm_probe").fetch_one(&pool).await.expect("count");
    assert_eq!(rows, 0, "the dropped transaction was rolled back");
}

#[tokio::test]
async fn closing_the_pool_hands_back_the_connections_kept_warm() {
    let (_test_db, pool) = grown_pool().await;
    assert!(pool.num_idle() >= 4, "idle, kept warm or in sqlx's pool: {}", pool.num_idle());
    tokio::time::timeout(Duration::from_secs(20), pool.close())
        .await
        .expect("close does not wait for kept connections");
    assert_eq!(pool.size(), 0, "every connection closed");
}

#[tokio::test]
async fn connections_a_burst_left_warm_go_back_once_unused() {
    let (_test_db, pool) = grown_pool().await;
    assert_eq!(pool.num_warm(), 4, "the burst's four connections kept warm");
    tokio::time::sleep(db::WARM_UNUSED_FOR + Duration::from_secs(1)).await;
    // A trickle: one connection in use, each statement handing the oldest unused one back.
    for _ in 0..4 {
        backend(&pool).await;
    }
    assert_eq!(pool.num_warm(), 1, "only the connection the trickle uses stays warm");
    // Handed back through sqlx's release task (a ping each).
    crate::support::eventually(Duration::from_secs(10), "the others idle in sqlx's pool", || async {
        (pool.num_idle() >= 4).then_some(())
    })
    .await;
}

/// The backend that serves one transaction, ended by `commit` or else rolled back.
async fn transaction_backend(pool: &Pool, commit: bool) -> i32 {
    let mut tx = pool.begin().await.expect("begin");
    let pid = db::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *tx).await.expect("backend pid");
    if commit {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    pid
}

#[tokio::test]
async fn a_committed_transaction_s_connection_is_kept_warm() {
    let (test_db, pool) = grown_pool().await;
    let mut backends = Vec::new();
    for i in 0..20 {
        backends.push(transaction_backend(&pool, i % 3 != 0).await);
        backends.push(backend(&pool).await);
    }
    backends.dedup();
    assert_eq!(
        backends.len(),
        1,
        "twenty transactions (committed or rolled back) and statements, one backend: {backends:?}"
    );

    // Control: sqlx's own transactions hand their connection back through sqlx's pool,
    // which goes round its connections.
    let plain = grown_sqlx_pool(&test_db.url).await;
    let mut rotated = Vec::new();
    for _ in 0..20 {
        let mut tx = plain.begin().await.expect("begin");
        rotated.push(sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()").fetch_one(&mut *tx).await.expect("pid"));
        tx.commit().await.expect("commit");
    }
    let rotated = distinct(rotated);
    assert!(rotated.len() >= 2, "sqlx's transactions used {rotated:?}");
}

#[tokio::test]
async fn a_transaction_left_open_rolls_back_and_leaves_no_answer_behind() {
    let test_db = TestDb::new().await;
    let pool = db::connect(&test_db.url, 4).await.expect("pool");
    db::query("CREATE TABLE warm_probe (n int PRIMARY KEY)").execute(&pool).await.expect("table");
    let count = || async { db::query_scalar::<i64>("SELECT count(*) FROM warm_probe").fetch_one(&pool).await };

    // Dropped open: rolled back, and its connection is not kept warm with the rollback
    // still owed.
    assert_eq!(pool.num_warm(), 1, "the statement's connection kept warm");
    {
        let mut tx = pool.begin().await.expect("begin");
        db::query("INSERT INTO warm_probe VALUES (1)").execute(&mut *tx).await.expect("insert");
    }
    assert_eq!(pool.num_warm(), 0, "the open transaction's connection is not kept warm");
    assert_eq!(count().await.expect("count"), 0, "the dropped transaction was rolled back");

    // A statement failed inside: the transaction is aborted; dropped, rolled back, and the
    // next transaction on the pool begins clean.
    {
        let mut tx = pool.begin().await.expect("begin");
        db::query("INSERT INTO warm_probe VALUES (2)").execute(&mut *tx).await.expect("insert");
        let failed = db::query("SELECT 1 / 0").execute(&mut *tx).await;
        assert!(failed.is_err(), "division by zero fails");
    }
    let mut tx = pool.begin().await.expect("begin after an aborted transaction");
    db::query("INSERT INTO warm_probe VALUES (3)").execute(&mut *tx).await.expect("insert in a clean transaction");
    tx.commit().await.expect("commit");
    assert_eq!(count().await.expect("count"), 1, "only the committed row");

    // A failed COMMIT (a deferred key check): the caller hears the error, nothing of the
    // transaction stays, the next statements read their own answers.
    db::query("CREATE TABLE warm_child (n int REFERENCES warm_probe (n) DEFERRABLE INITIALLY DEFERRED)")
        .execute(&pool)
        .await
        .expect("table");
    let mut tx = pool.begin().await.expect("begin");
    db::query("INSERT INTO warm_child VALUES (99)").execute(&mut *tx).await.expect("deferred insert");
    assert!(tx.commit().await.is_err(), "the deferred key check fails the commit");
    for expected in 1..=10 {
        let got: i32 = db::query_scalar("SELECT $1::int4").bind(expected).fetch_one(&pool).await.expect("statement");
        assert_eq!(got, expected, "each statement reads its own answer");
    }

    // Abandoned mid-COMMIT (a deferred trigger makes it slow): the connection owes the
    // commit's answer and is not kept warm; the statements after it read their own.
    db::query(
        "CREATE FUNCTION warm_slow() RETURNS trigger LANGUAGE plpgsql AS
         $$ BEGIN PERFORM pg_sleep(1); RETURN NULL; END $$",
    )
    .execute(&pool)
    .await
    .expect("function");
    db::query(
        "CREATE CONSTRAINT TRIGGER warm_slow AFTER INSERT ON warm_probe DEFERRABLE INITIALLY DEFERRED
         FOR EACH ROW EXECUTE FUNCTION warm_slow()",
    )
    .execute(&pool)
    .await
    .expect("trigger");
    let mut tx = pool.begin().await.expect("begin");
    db::query("INSERT INTO warm_probe VALUES (4)").execute(&mut *tx).await.expect("insert");
    let abandoned = tokio::time::timeout(Duration::from_millis(100), tx.commit()).await;
    assert!(abandoned.is_err(), "the caller stopped waiting for the commit");
    for expected in 1..=20 {
        let got: i32 = db::query_scalar("SELECT $1::int4").bind(expected).fetch_one(&pool).await.expect("statement");
        assert_eq!(got, expected, "each statement reads its own answer");
    }
}
