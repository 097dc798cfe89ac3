//! The ordered lines' plans: the release of finished heads and the promotion of the next
//! ones handle the batch, not the tables, with statistics from before a drain and with a
//! plan cached among a few lines and run among many.

use super::*;

/// Lines in the ordered-lines test, and the batch of heads each measurement finishes.
const LINES: i64 = 2_000;
const LINE_BATCH: i64 = 16;

/// Finish the heads of the last [`LINE_BATCH`] lines (by key) and move their lines on with
/// the recorder's statements ([`lines::RELEASE_HEADS_SQL`], then [`lines::PROMOTE_SQL`]),
/// custom-planned as the recorder runs them, in a transaction that is rolled back. Returns
/// the rows each plan handled.
async fn move_lines_on(pool: &Pool, planning: Planning) -> (f64, f64) {
    use webhook_gateway::queue::lines;
    let mut tx = pool.begin().await.unwrap();
    plan_as(&mut tx, planning).await;
    let heads: Vec<Uuid> = sqlx::query_scalar(
        "SELECT head_id FROM order_lines WHERE head_id IS NOT NULL ORDER BY ordering_key DESC LIMIT $1",
    )
    .bind(LINE_BATCH)
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    assert_eq!(heads.len() as i64, LINE_BATCH);
    sqlx::query("UPDATE deliveries SET status = 'delivered', finished_at = now() WHERE id = ANY($1)")
        .bind(&heads)
        .execute(&mut *tx)
        .await
        .unwrap();
    let (release, _) = explain_prepared(
        &mut tx,
        lines::RELEASE_HEADS_SQL,
        "uuid[]",
        &sql_array(heads.iter().map(Uuid::to_string).collect()),
    )
    .await;
    assert_eq!(release[0]["Plan"]["Actual Rows"], LINE_BATCH, "every finished head released its line: {release}");
    let released: Vec<(Uuid, String)> =
        sqlx::query_as("SELECT endpoint_id, ordering_key FROM deliveries WHERE id = ANY($1)")
            .bind(&heads)
            .fetch_all(&mut *tx)
            .await
            .unwrap();
    let (endpoints, keys): (Vec<String>, Vec<String>) = released.into_iter().map(|(e, k)| (e.to_string(), k)).unzip();
    let (promote, _) = explain_prepared(
        &mut tx,
        lines::PROMOTE_SQL,
        "uuid[], text[]",
        &format!("{}, {}", sql_array(endpoints), sql_array(keys.clone())),
    )
    .await;
    let promoted: i64 =
        sqlx::query_scalar("SELECT count(*) FROM order_lines WHERE ordering_key = ANY($1) AND head_id IS NOT NULL")
            .bind(&keys)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    assert_eq!(promoted, LINE_BATCH, "every released line has its next head");
    tx.rollback().await.unwrap();
    (rows_handled(&release[0]["Plan"]), rows_handled(&promote[0]["Plan"]))
}

/// Moving ordering lines on handles the batch, not the tables, even when the statistics
/// are from before the queue changed (a drain changes it within seconds; autovacuum's
/// ANALYZE comes later). Measured right after an ANALYZE (2,000 lines, all with a head,
/// nothing delivered), then with autovacuum off after 20,000 deliveries were delivered
/// and 1,500 lines went idle. In the benchmark's ordered drain, stale statistics made the
/// release read every delivered row per batch (8-9 ms) and the promotion match each line
/// of a batch against every idle line (864 ms for 256 lines).
#[tokio::test]
async fn moving_lines_on_handles_the_batch_even_with_statistics_from_before_the_drain() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    for table in ["deliveries", "order_lines"] {
        sqlx::query(&format!("ALTER TABLE {table} SET (autovacuum_enabled = false)")).execute(pool).await.unwrap();
    }
    let endpoint: Uuid = insert_endpoint(pool, "http://127.0.0.1:9/").await.parse().unwrap();
    // Three deliveries per line, the first of each its head.
    crate::support::seed_ordered_lines(pool, &endpoint.to_string(), LINES).await;
    sqlx::query("ANALYZE").execute(pool).await.unwrap();
    let mut fresh = Vec::new();
    for planning in [Planning::EachCall, Planning::Cached] {
        fresh.push(move_lines_on(pool, planning).await);
    }

    add_history(pool, endpoint, 20_000).await;
    sqlx::query(
        "WITH drained AS (SELECT ordering_key FROM order_lines ORDER BY ordering_key LIMIT 1500),
              done AS (
                  UPDATE deliveries SET status = 'delivered', finished_at = now(), waiting = false
                  WHERE ordering_key IN (SELECT ordering_key FROM drained))
         UPDATE order_lines SET head_id = NULL WHERE ordering_key IN (SELECT ordering_key FROM drained)",
    )
    .execute(pool)
    .await
    .unwrap();
    for (planning, (release_fresh, promote_fresh)) in [Planning::EachCall, Planning::Cached].into_iter().zip(fresh) {
        let (release_stale, promote_stale) = move_lines_on(pool, planning).await;
        eprintln!(
            "lines moved on, batch of {LINE_BATCH}, {planning:?}: release handled {release_fresh} rows fresh, \
             {release_stale} stale; promote {promote_fresh} fresh, {promote_stale} stale"
        );
        for (statement, fresh, stale) in
            [("release", release_fresh, release_stale), ("promote", promote_fresh, promote_stale)]
        {
            assert!(
                stale <= 2.0 * fresh + 200.0,
                "{planning:?}: {statement} handled {fresh} rows for a batch of {LINE_BATCH} with fresh statistics \
                 and {stale} with stale ones: its plan reads the table, not the batch"
            );
        }
    }
}

/// Lines a cached promotion is planned on, and lines it then runs among.
const FEW_LINES: i64 = 4;
const MANY_LINES: i64 = 10_000;

/// Finish the heads of the lines whose keys start with `prefix` (the last
/// [`LINE_BATCH`] of them by key: a scan of the lines in key order reaches them last) and promote their next deliveries with the prepared
/// statement `promote` (or `promote_leasing`, which leases them too: [`PROMOTIONS`]) on
/// `conn`, under the recorder's settings, in a transaction that is rolled back. Returns
/// the `EXPLAIN (ANALYZE, BUFFERS)` of the promotion.
async fn promote_prepared(conn: &mut sqlx::PgConnection, prefix: &str, leasing: bool) -> Value {
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    plan_as(conn, Planning::Cached).await;
    let lines: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT endpoint_id, ordering_key FROM order_lines WHERE starts_with(ordering_key, $1)
         ORDER BY ordering_key DESC LIMIT $2",
    )
    .bind(prefix)
    .bind(LINE_BATCH)
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE deliveries d SET status = 'delivered', finished_at = now()
         FROM order_lines l WHERE d.id = l.head_id AND l.ordering_key = ANY($1)",
    )
    .bind(lines.iter().map(|(_, k)| k.clone()).collect::<Vec<_>>())
    .execute(&mut *conn)
    .await
    .unwrap();
    let endpoints = sql_array(lines.iter().map(|(e, _)| e.to_string()).collect());
    let keys = sql_array(lines.iter().map(|(_, k)| k.clone()).collect());
    let (explain, buffers) = explain_measured(
        conn,
        sqlx::query_scalar(&format!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {}({endpoints}::uuid[], {keys}::text[]{})",
            if leasing { "promote_leasing" } else { "promote" },
            if leasing { ", 64, 60, 64" } else { "" },
        )),
    )
    .await;
    eprintln!("promotion of {} lines ({prefix}, leasing: {leasing}): {buffers} buffers", lines.len());
    sqlx::query("ROLLBACK").execute(&mut *conn).await.unwrap();
    assert_eq!(explain[0]["Plan"]["Actual Rows"], lines.len(), "every line moved on: {explain}");
    explain
}

/// The recorder's promotion keeps the generic plan its connection built at its first
/// call (`db::Planning::Cached`), perhaps when there were a few lines and the statistics
/// said so: run among 10,000 lines, that plan still reaches each line by its key. One
/// that joined the batch to `order_lines` scanned every line for each of the batch's
/// (a plan built on 4 lines: 42,414 rows dropped by the join filter, 2,415 buffers and
/// 14 ms for 16 lines at 10,004, against 0.9 ms and ~180 buffers planned for them), until
/// an `ANALYZE` of `order_lines` made the connection plan it again. The same for the
/// promotion that leases the new heads (the recorder's while its dispatcher owes no
/// general claim).
#[tokio::test]
async fn a_promotion_planned_among_a_few_lines_handles_the_batch_among_many() {
    use sqlx::Connection as _;
    use webhook_gateway::queue::lines;
    let db = TestDb::new().await;
    let pool = &db.pool;
    for table in ["deliveries", "order_lines", "events"] {
        sqlx::query(&format!("ALTER TABLE {table} SET (autovacuum_enabled = false)")).execute(pool).await.unwrap();
    }
    let endpoint = insert_endpoint(pool, "http://127.0.0.1:9/").await;
    crate::support::seed_ordered_lines(pool, &endpoint, FEW_LINES).await;
    sqlx::query("ANALYZE").execute(pool).await.unwrap();
    let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query(&format!("PREPARE promote(uuid[], text[]) AS {}", lines::PROMOTE_SQL))
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query(&format!(
        "PREPARE promote_leasing(uuid[], text[], int8, float8, int4) AS {}",
        lines::promote_leasing_sql()
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    let mut few = Vec::new();
    for leasing in PROMOTIONS {
        few.push(rows_handled(&promote_prepared(&mut conn, "k", leasing).await[0]["Plan"]));
    }

    // Many more lines, each a head and one delivery waiting, the statistics untouched.
    sqlx::query(
        "WITH ev AS (
             INSERT INTO events (source_id, dedupe_key, event_type, headers, payload, ordering_key)
             SELECT (SELECT id FROM sources WHERE name = 'api'), 'many-' || g, 't', '{}', '\\x7b7d',
                    'm' || lpad((g % $1)::text, 5, '0')
             FROM generate_series(0, 2 * $1 - 1) g
             RETURNING id, dedupe_key, ordering_key)
         INSERT INTO deliveries (event_id, endpoint_id, ordering_key, line_seq, waiting)
         SELECT id, $2::uuid, ordering_key, 1000000 + substr(dedupe_key, 6)::int8, substr(dedupe_key, 6)::int8 >= $1
         FROM ev",
    )
    .bind(MANY_LINES)
    .bind(&endpoint)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO order_lines (endpoint_id, ordering_key, head_id)
         SELECT endpoint_id, ordering_key, id FROM deliveries WHERE starts_with(ordering_key, 'm') AND NOT waiting",
    )
    .execute(pool)
    .await
    .unwrap();
    for (leasing, few) in PROMOTIONS.into_iter().zip(few) {
        let plan = promote_prepared(&mut conn, "m", leasing).await;
        let many = rows_handled(&plan[0]["Plan"]);
        eprintln!(
            "a promotion (leasing: {leasing}) of {LINE_BATCH} lines planned among {FEW_LINES}: {few} rows there, \
             {many} among {MANY_LINES}"
        );
        // Rows a line: the leasing statement also joins its heads to the room, reads the
        // leased rows' event, endpoint and source (33 a line, measured: 138 for 4 and 534
        // for 16); a plan that read every line handled 330,156.
        let per_line = if leasing { 40.0 } else { 30.0 };
        assert!(
            many <= per_line * LINE_BATCH as f64,
            "the promotion (leasing: {leasing}) of {LINE_BATCH} lines handled {many} rows among {MANY_LINES} lines \
             ({few} among {FEW_LINES}): its cached plan reads every line\n{plan}"
        );
    }
    conn.close().await.unwrap();
}

/// The promotions [`promote_prepared`] runs: the plain one (`lines::PROMOTE_SQL`), and the
/// recorder's, which leases the new heads too (`lines::promote_leasing_sql`).
const PROMOTIONS: [bool; 2] = [false, true];
