//! The delivery path's batch statements cost the same whatever plan PostgreSQL caches for
//! them: a prepared statement may run with a custom plan (planned for its parameters) or
//! with the cached generic one (planned once, for any parameters), and PostgreSQL's
//! default switches between the two on its own. Each test runs a statement at a small
//! and at a large backlog, in both modes, and compares the buffers it touched: a plan that
//! scans or hashes a table grows with the backlog, one that follows indexes does not.

use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;
use webhook_gateway::queue;

use crate::support::{TestDb, insert_endpoint, seed_deliveries};

/// Rows each measured claim takes: small, so that a scan of the table would dwarf it.
const CLAIM_ROWS: i64 = 16;

/// The plan cache modes a prepared statement can run in.
const MODES: [&str; 2] = ["force_custom_plan", "force_generic_plan"];

/// What one run of a statement cost, from `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`.
#[derive(Debug, Clone, Copy)]
struct Cost {
    /// Shared buffers (hit + read) the whole plan touched.
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

fn cost_of(explain: &Value, table: &str) -> Cost {
    let top = &explain[0]["Plan"];
    let field = |k: &str| top[k].as_i64().unwrap_or_else(|| panic!("no {k} in plan: {explain}"));
    let update = find_update(top, table).unwrap_or_else(|| panic!("no UPDATE of {table} in plan: {explain}"));
    Cost {
        buffers: field("Shared Hit Blocks") + field("Shared Read Blocks"),
        rows: field("Actual Rows"),
        update_estimate: update["Plan Rows"].as_f64().unwrap_or_else(|| panic!("no estimate in {update}")),
    }
}

/// Run the claim the workers run, prepared and executed in `mode`, inside a transaction
/// that is rolled back.
async fn claim_cost(pool: &PgPool, mode: &str, endpoint: Uuid) -> Cost {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&format!("SET LOCAL plan_cache_mode = {mode}")).execute(&mut *tx).await.unwrap();
    // The first statement of the claim, as `claim_fair` runs it: it locks the endpoints.
    let (locked, _head_rows): (Vec<Uuid>, i64) =
        sqlx::query_as(queue::CLAIM_LOCK_SQL).bind(CLAIM_ROWS * 2).bind(false).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(locked, vec![endpoint], "the head of the due index is the one endpoint's");
    sqlx::query(&format!("PREPARE measured_claim(int8, float8, int4, uuid[]) AS {}", queue::claim_sql()))
        .execute(&mut *tx)
        .await
        .unwrap();
    let explain: Value = sqlx::query_scalar(&format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE measured_claim({CLAIM_ROWS}, 60, {}, '{{{endpoint}}}')",
        queue::DEFAULT_MAX_IN_FLIGHT
    ))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    // PREPARE outlives a rollback; the connection goes back to the pool.
    sqlx::query("DEALLOCATE measured_claim").execute(&mut *tx).await.unwrap();
    tx.rollback().await.unwrap();
    cost_of(&explain, "deliveries")
}

/// Add `n` delivered deliveries (history: finished, with one attempt each) to `endpoint`.
async fn add_history(pool: &PgPool, endpoint: Uuid, n: i64) {
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

/// At 1,000 pending and at 61,000 pending (with 20,000 delivered beside them), a claim of
/// 16 touches about the same number of buffers, with a custom plan and with the generic
/// one. A generic plan that hashes `deliveries` or `events` (as one did: 25.8 ms per
/// claim at 100,000 pending) touches thousands more at the larger backlog.
#[tokio::test]
async fn a_claim_costs_the_same_at_any_backlog_under_either_plan() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let endpoint: Uuid = insert_endpoint(pool, "http://127.0.0.1:9/").await.parse().unwrap();
    seed_deliveries(pool, &endpoint.to_string(), 1_000).await;
    sqlx::query("ANALYZE").execute(pool).await.unwrap();
    let mut small = Vec::new();
    for mode in MODES {
        small.push(claim_cost(pool, mode, endpoint).await);
    }

    add_history(pool, endpoint, 20_000).await;
    seed_deliveries(pool, &endpoint.to_string(), 60_000).await;
    sqlx::query("ANALYZE").execute(pool).await.unwrap();
    for (mode, small) in MODES.into_iter().zip(small) {
        let large = claim_cost(pool, mode, endpoint).await;
        eprintln!("claim of {CLAIM_ROWS}, {mode}: at 1,000 pending {small:?}; at 61,000 {large:?}");
        assert_eq!((small.rows, large.rows), (CLAIM_ROWS, CLAIM_ROWS), "{mode}: each claim took its rows");
        assert!(
            large.buffers <= 2 * small.buffers + 100,
            "{mode}: a claim of {CLAIM_ROWS} touched {} buffers at 1,000 pending and {} at 61,000: its plan \
             grows with the table",
            small.buffers,
            large.buffers
        );
        // What the planner expects to update must not follow the backlog either: at a
        // larger backlog than a test can seed, that estimate is what chooses a hash join.
        assert!(
            large.update_estimate <= 2.0 * small.update_estimate.max(CLAIM_ROWS as f64),
            "{mode}: the planner expects the claim to update {} rows at 1,000 pending and {} at 61,000",
            small.update_estimate,
            large.update_estimate
        );
    }
}
