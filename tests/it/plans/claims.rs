//! The claims' plans: the general claim, with the endpoint locked first, and the claim of
//! fresh deliveries by key (ingest's hand-off), at a small and a large backlog, with plans
//! planned for the call and with cached generic ones built on an empty queue.

use super::*;

/// endpoints at the head of the due index, here `endpoint` alone.
async fn lock_the_endpoint(conn: &mut sqlx::PgConnection, endpoint: Uuid) {
    let (locked, _head_rows): (Vec<Uuid>, i64) =
        sqlx::query_as(queue::CLAIM_LOCK_SQL).bind(CLAIM_ROWS * 2).bind(false).fetch_one(&mut *conn).await.unwrap();
    assert_eq!(locked, vec![endpoint], "the head of the due index is the one endpoint's");
}

/// Run the claim the workers run, prepared and executed in `mode`, inside a transaction
/// that is rolled back.
async fn claim_cost(pool: &Pool, mode: &str, endpoint: Uuid) -> Cost {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&format!("SET LOCAL plan_cache_mode = {mode}")).execute(&mut *tx).await.unwrap();
    lock_the_endpoint(&mut tx, endpoint).await;
    let (explain, buffers) = explain_prepared(
        &mut tx,
        queue::claim_sql(),
        "int8, float8, int4, uuid[]",
        &format!("{CLAIM_ROWS}, 60, {}, '{{{endpoint}}}'", queue::DEFAULT_MAX_IN_FLIGHT),
    )
    .await;
    tx.rollback().await.unwrap();
    cost_of(&explain, buffers, "deliveries")
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
/// One measured fresh claim (`queue::claim_fresh`) of `deliveries` on `conn`, whose prepared
/// `EXPLAIN (ANALYZE, BUFFERS)` of the claim of fresh deliveries as the workers run it
/// (the function `queue::CLAIM_FRESH_SQL` calls, whose plans the session keeps from their
/// first run), in a transaction that is rolled back; `custom` asks the session for plans
/// made for each call, which the function's own settings overrule.
async fn fresh_claim_cost(conn: &mut sqlx::PgConnection, deliveries: &[Uuid], custom: bool) -> (Cost, Value) {
    let array = format!("'{{{}}}'", deliveries.iter().map(Uuid::to_string).collect::<Vec<_>>().join(","));
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    if custom {
        sqlx::query("SET LOCAL plan_cache_mode = force_custom_plan").execute(&mut *conn).await.unwrap();
    }
    // The function's statements do not appear in the plan; their buffers are counted.
    let (explain, buffers) = explain_measured(
        conn,
        sqlx::query_scalar(&format!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM {}({array}, {CLAIM_ROWS}, 60, {})",
            queue::CLAIM_FRESH_FUNCTION,
            queue::DEFAULT_MAX_IN_FLIGHT,
        )),
    )
    .await;
    sqlx::query("ROLLBACK").execute(&mut *conn).await.unwrap();
    (top_cost(&explain, buffers), explain)
}

/// Seed `n` fresh pending deliveries to `endpoint` and return their ids.
async fn fresh_deliveries(pool: &Pool, endpoint: Uuid, n: i64) -> Vec<Uuid> {
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries").fetch_one(pool).await.unwrap();
    seed_deliveries(pool, &endpoint.to_string(), n).await;
    sqlx::query_scalar("SELECT id FROM deliveries ORDER BY id OFFSET $1").bind(before).fetch_all(pool).await.unwrap()
}

/// The claim of fresh deliveries runs cached generic plans, built once per session (the
/// settings of `db::Planning::Cached`, which its function sets): plans built when the
/// queue was empty (a gateway's first minutes on a new database, before any `ANALYZE`)
/// must still reach the rows by key when 61,000 deliveries are pending and 20,000
/// delivered, whatever plan mode the session asks for. (Without the settings that keep
/// whole-table strategies out, the generic plan built here fetched 7,931 pages of the
/// tables at 61,000 pending, against 267 on the empty queue: it walked the due index and
/// scanned `deliveries` and `events`.)
#[tokio::test]
async fn a_fresh_claim_costs_the_same_at_any_backlog_with_a_plan_built_on_an_empty_queue() {
    use sqlx::Connection as _;
    for mode in MODES {
        let (db, endpoint, mut conn) = unanalyzed_queue().await;
        let pool = &db.pool;
        let small_events = fresh_deliveries(pool, endpoint, CLAIM_ROWS).await;
        // The first call builds the session's plans (on the empty queue), the second is
        // measured.
        fresh_claim_cost(&mut conn, &small_events, mode == MODES[0]).await;
        let (small, small_plan) = fresh_claim_cost(&mut conn, &small_events, mode == MODES[0]).await;
        // Claimed nothing for good: the measured claims were rolled back.
        sqlx::query("UPDATE deliveries SET status = 'delivered', finished_at = now() WHERE status = 'pending'")
            .execute(pool)
            .await
            .unwrap();

        add_history(pool, endpoint, 20_000).await;
        seed_deliveries(pool, &endpoint.to_string(), 60_000).await;
        let large_events = fresh_deliveries(pool, endpoint, CLAIM_ROWS).await;
        let (large, large_plan) = fresh_claim_cost(&mut conn, &large_events, mode == MODES[0]).await;
        conn.close().await.unwrap();
        eprintln!("fresh claim of {CLAIM_ROWS}, {mode}: on an empty queue {small:?}; at 61,000 pending {large:?}");
        assert_eq!((small.rows, large.rows), (CLAIM_ROWS, CLAIM_ROWS), "{mode}: each claim took its rows");
        assert!(
            large.buffers <= 2 * small.buffers + 100,
            "{mode}: a fresh claim of {CLAIM_ROWS} touched {} buffers on an empty queue and {} at 61,000 pending: \
             its plan walks the backlog\n{small_plan}\n{large_plan}",
            small.buffers,
            large.buffers
        );
    }
}

/// One measured general claim on `conn` as the dispatcher runs it (`queue::claim_batch`:
/// the endpoint locks, then the claim under `db::Planning::Cached`'s settings, prepared on
/// the session as `claim` the first time and kept), in a transaction that is rolled back.
async fn cached_claim_cost(conn: &mut sqlx::PgConnection, endpoint: Uuid) -> (Cost, Value) {
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    lock_the_endpoint(conn, endpoint).await;
    webhook_gateway::db::plan_cached(&mut *conn).await.unwrap();
    let prepared: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_prepared_statements WHERE name = 'claim')")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    if !prepared {
        sqlx::query(&format!("PREPARE claim(int8, float8, int4, uuid[]) AS {}", queue::claim_sql()))
            .execute(&mut *conn)
            .await
            .unwrap();
    }
    let (explain, buffers) = explain_measured(
        conn,
        sqlx::query_scalar(&format!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE claim({CLAIM_ROWS}, 60, {}, '{{{endpoint}}}')",
            queue::DEFAULT_MAX_IN_FLIGHT
        )),
    )
    .await;
    sqlx::query("ROLLBACK").execute(&mut *conn).await.unwrap();
    (cost_of(&explain, buffers, "deliveries"), explain)
}

/// The general claim runs a cached generic plan with no whole-table strategy
/// (`db::Planning::Cached`): one built when the queue was empty and never analysed, and
/// kept by the session, costs the same at 61,000 pending (with 20,000 delivered beside
/// them) as at 16. Planned at every call instead, the claim spent about 1 ms planning
/// (1.6 ms in a fleet of four) for 4-5 ms of work.
#[tokio::test]
async fn a_general_claim_costs_the_same_at_any_backlog_with_a_plan_built_on_an_empty_queue() {
    use sqlx::Connection as _;
    let (db, endpoint, mut conn) = unanalyzed_queue().await;
    let pool = &db.pool;
    // The first call builds the session's plan on the empty queue; the second is measured.
    seed_deliveries(pool, &endpoint.to_string(), CLAIM_ROWS).await;
    cached_claim_cost(&mut conn, endpoint).await;
    let (small, small_plan) = cached_claim_cost(&mut conn, endpoint).await;
    add_history(pool, endpoint, 20_000).await;
    seed_deliveries(pool, &endpoint.to_string(), 60_000).await;
    let (large, large_plan) = cached_claim_cost(&mut conn, endpoint).await;
    conn.close().await.unwrap();
    eprintln!("general claim of {CLAIM_ROWS}, cached plan: on an empty queue {small:?}; at 61,000 pending {large:?}");
    assert_eq!((small.rows, large.rows), (CLAIM_ROWS, CLAIM_ROWS), "each claim took its rows");
    assert!(
        large.buffers <= 2 * small.buffers + 100,
        "a general claim of {CLAIM_ROWS} touched {} buffers on an empty queue and {} at 61,000 pending: its plan \
         walks the backlog\n{small_plan}\n{large_plan}",
        small.buffers,
        large.buffers
    );
}
