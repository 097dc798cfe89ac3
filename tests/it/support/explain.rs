//! Measuring what a statement's plan costs, robustly under a busy server.

use serde_json::Value;
use sqlx::postgres::{PgArguments, PgConnection, Postgres};
use sqlx::query::QueryScalar;

/// Run `explain` (an `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`, with its arguments bound)
/// on `conn`, inside the caller's transaction, and return its plan and the buffers (hit
/// or read) its statement fetched from the test database's own tables and indexes.
///
/// Not the plan's own buffer counts: those also count catalog pages (all of a function's,
/// whose statements are planned inside its scan; a foreign-key check's; an index's support
/// functions looked up on first use), and a session whose caches were reset rereads some
/// 2,000 of them on its next statement. Another test's migrations (thousands of
/// invalidation messages in one commit) reset idle sessions at any time: a claim counted
/// 2,623 buffers against its usual 537. A plan that walks a table inflates that table's
/// pages, which are what is counted here: the session's per-relation counters, which it
/// reports only outside a transaction, read before and after.
pub async fn explain_measured(
    conn: &mut PgConnection,
    explain: QueryScalar<'_, Postgres, Value, PgArguments>,
) -> (Value, i64) {
    const FETCHED: &str = "SELECT COALESCE(sum(pg_stat_get_xact_blocks_fetched(c.oid)), 0)::int8 FROM pg_class c
         WHERE c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = 'events'::regclass)";
    // In a transaction block the transaction began with an earlier statement (`BEGIN`);
    // outside one, each statement is its own transaction and starts it.
    let in_block: bool = sqlx::query_scalar("SELECT now() <> statement_timestamp()")
        .fetch_one(&mut *conn)
        .await
        .expect("transaction state");
    assert!(in_block, "explain_measured outside a transaction: the counters it reads are reported between statements");
    let before: i64 = sqlx::query_scalar(FETCHED).fetch_one(&mut *conn).await.expect("counters before");
    let plan = explain.fetch_one(&mut *conn).await.expect("explain");
    let after: i64 = sqlx::query_scalar(FETCHED).fetch_one(&mut *conn).await.expect("counters after");
    (plan, after - before)
}
