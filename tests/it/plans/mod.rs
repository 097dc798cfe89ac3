//! The delivery path's batch statements cost the same whatever plan PostgreSQL caches for
//! them: a prepared statement may run with a custom plan (planned for its parameters) or
//! with the cached generic one (planned once, for any parameters), and PostgreSQL's
//! default switches between the two on its own. Each test runs a statement at a small
//! and at a large backlog, in both modes, and compares the buffers it touched: a plan that
//! scans or hashes a table grows with the backlog, one that follows indexes does not.

use serde_json::Value;
use uuid::Uuid;
use webhook_gateway::db::{Planning, Pool, Pooler};
use webhook_gateway::queue;

use crate::support::explain::explain_measured;
use crate::support::{TestDb, insert_endpoint, seed_deliveries};

mod claims;
mod lines;
mod writes;

/// Rows each measured claim takes: small, so that a scan of the table would dwarf it.
const CLAIM_ROWS: i64 = 16;

/// The plan cache modes a prepared statement can run in.
const MODES: [&str; 2] = ["force_custom_plan", "force_generic_plan"];

/// What one run of a statement cost, from `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`.
#[derive(Debug, Clone, Copy)]
struct Cost {
    /// Buffers (hit + read) of the test database's own tables and indexes the statement
    /// fetched ([`explain_measured`]).
    buffers: i64,
    /// Rows the statement returned.
    rows: i64,
    /// The planner's estimate of the rows the statement's `UPDATE` of `table` writes:
    /// the figure it chooses join strategies by.
    update_estimate: f64,
}

/// The `UPDATE` of `table` anywhere in a plan.
fn find_update<'a>(plan: &'a Value, table: &str) -> Option<&'a Value> {
    if plan["Node Type"] == "ModifyTable" && plan["Operation"] == "Update" && plan["Relation Name"] == table {
        return Some(plan);
    }
    plan["Plans"].as_array()?.iter().find_map(|child| find_update(child, table))
}

fn cost_of(explain: &Value, buffers: i64, table: &str) -> Cost {
    let update =
        find_update(&explain[0]["Plan"], table).unwrap_or_else(|| panic!("no UPDATE of {table} in plan: {explain}"));
    Cost {
        update_estimate: update["Plan Rows"].as_f64().unwrap_or_else(|| panic!("no estimate in {update}")),
        ..top_cost(explain, buffers)
    }
}

/// The `buffers` a plan fetched and the rows its top node returned; no estimate.
fn top_cost(explain: &Value, buffers: i64) -> Cost {
    let rows =
        explain[0]["Plan"]["Actual Rows"].as_i64().unwrap_or_else(|| panic!("no Actual Rows in plan: {explain}"));
    Cost { buffers, rows, update_estimate: f64::NAN }
}

/// `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` of `sql` run as a prepared statement
/// (parameter types `types`, arguments `args` as SQL literals), the way sqlx runs it, so
/// that the session's `plan_cache_mode` decides its plan. The statement runs: call it in
/// a transaction that is rolled back.
async fn explain_prepared(conn: &mut sqlx::PgConnection, sql: &str, types: &str, args: &str) -> (Value, i64) {
    sqlx::query(&format!("PREPARE measured({types}) AS {sql}")).execute(&mut *conn).await.unwrap();
    let measured = explain_measured(
        conn,
        sqlx::query_scalar(&format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE measured({args})")),
    )
    .await;
    // PREPARE outlives a rollback; the connection goes back to the pool.
    sqlx::query("DEALLOCATE measured").execute(&mut *conn).await.unwrap();
    measured
}

/// Add `n` delivered deliveries (history: finished, with one attempt each) to `endpoint`.
async fn add_history(pool: &Pool, endpoint: Uuid, n: i64) {
    sqlx::query(
        "WITH ev AS (
             INSERT INTO events (source_id, dedupe_key, event_type, headers, payload)
             SELECT (SELECT id FROM sources WHERE name = 'api'), 'old-' || g, 't', '{}', convert_to(repeat('x', 200), 'UTF8')
             FROM generate_series(1, $1) g
             RETURNING id),
         d AS (
             INSERT INTO deliveries (event_id, endpoint_id, status, finished_at, attempt_count, claim_token, recorded_token)
             SELECT id, $2, 'delivered', now(), 1, 1, 1 FROM ev
             RETURNING id)
         INSERT INTO attempts (delivery_id, attempt_number, started_at, duration_ms, outcome, reason)
         SELECT id, 1, now(), 5, 'delivered', 'HTTP 200' FROM d",
    )
    .bind(n)
    .bind(endpoint)
    .execute(pool)
    .await
    .unwrap();
}

/// Rows a plan handled: every node's output over all its loops, plus the rows its
/// filters and join filters read and dropped. A plan that follows indexes from the batch
/// handles about the batch; one that scans a table, or matches the batch against a whole
/// table in a nested loop, handles the table.
fn rows_handled(plan: &Value) -> f64 {
    let n = |k: &str| plan[k].as_f64().unwrap_or(0.0);
    let own = (n("Actual Rows") + n("Rows Removed by Filter") + n("Rows Removed by Join Filter"))
        * n("Actual Loops").max(1.0);
    own + plan["Plans"].as_array().map_or(0.0, |children| children.iter().map(rows_handled).sum())
}

/// A new database whose queue tables autovacuum never analyzes (their statistics stay
/// those of an empty queue, as on a new database in its first minute), an endpoint, and a
/// connection of its own, which keeps the plans prepared on it.
async fn unanalyzed_queue() -> (TestDb, Uuid, sqlx::PgConnection) {
    use sqlx::Connection as _;
    let db = TestDb::new().await;
    for table in ["deliveries", "events", "endpoints", "attempts"] {
        sqlx::query(&format!("ALTER TABLE {table} SET (autovacuum_enabled = false)")).execute(&db.pool).await.unwrap();
    }
    let endpoint: Uuid = insert_endpoint(&db.pool, "http://127.0.0.1:9/").await.parse().unwrap();
    let conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    (db, endpoint, conn)
}

/// `items` as an SQL array literal (`'{a,b}'`).
fn sql_array(items: Vec<String>) -> String {
    format!("'{{{}}}'", items.join(","))
}

/// Give the transaction on `conn` the plan settings of `planning`, as the recorder's
/// `BEGIN` does.
async fn plan_as(conn: &mut sqlx::PgConnection, planning: Planning) {
    let begin = webhook_gateway::db::begin_sql(Pooler::None, Some(planning), false);
    let (_, settings) = begin.split_once("; ").expect("a BEGIN with settings");
    sqlx::raw_sql(settings).execute(&mut *conn).await.unwrap();
}
