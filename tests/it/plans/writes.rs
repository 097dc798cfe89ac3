//! The writes' plans: the recorder's outcome write, ingest's statements, filtered batches
//! and a lone webhook's leasing statement cost the same at any table size, and the
//! gateway's sessions never compile a statement.

use super::*;

/// The parameter types of `queue::RECORD_SQL`, for `PREPARE`.
const RECORD_TYPES: &str = "uuid[], int8[], int4[], timestamptz[], int4[], int4[], text[], text[], text[], text[], \
     text[], timestamptz[], text[], text[]";

/// `queue::RECORD_SQL`'s arguments, as SQL literals, for the deliveries `claimed` (id,
/// claim token): each delivered at attempt 1.
fn delivered_outcomes(claimed: &[(Uuid, i64)]) -> String {
    let n = claimed.len();
    let ids = claimed.iter().map(|(id, _)| id.to_string()).collect::<Vec<_>>().join(",");
    let tokens = claimed.iter().map(|(_, t)| t.to_string()).collect::<Vec<_>>().join(",");
    format!(
        "'{{{ids}}}', '{{{tokens}}}', array_fill(1, ARRAY[{n}]), array_fill(now(), ARRAY[{n}]),
         array_fill(5, ARRAY[{n}]), array_fill(200, ARRAY[{n}]), array_fill(NULL::text, ARRAY[{n}]),
         array_fill('delivered'::text, ARRAY[{n}]), array_fill('delivered'::text, ARRAY[{n}]),
         array_fill('HTTP 200'::text, ARRAY[{n}]), array_fill(NULL::text, ARRAY[{n}]),
         array_fill(NULL::timestamptz, ARRAY[{n}]), array_fill(NULL::text, ARRAY[{n}]),
         array_fill(NULL::text, ARRAY[{n}])"
    )
}
/// `EXPLAIN (ANALYZE, BUFFERS)` of the recorder's outcome write (`queue::RECORD_SQL`,
/// prepared on `conn` as `record`) for the deliveries `claimed` (id, claim token): each
/// delivered at attempt 1, in a transaction that is rolled back.
async fn record_cost(conn: &mut sqlx::PgConnection, claimed: &[(Uuid, i64)]) -> (Cost, Value) {
    sqlx::raw_sql(webhook_gateway::db::begin_sql(Pooler::None, Some(Planning::Cached), false))
        .execute(&mut *conn)
        .await
        .unwrap();
    let (explain, buffers) = explain_measured(
        conn,
        sqlx::query_scalar(&format!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE record({})",
            delivered_outcomes(claimed)
        )),
    )
    .await;
    sqlx::query("ROLLBACK").execute(&mut *conn).await.unwrap();
    (cost_of(&explain, buffers, "deliveries"), explain)
}

/// Claim `n` of `endpoint`'s due deliveries for good (leased, as a worker holds them) and
/// return them with their tokens.
async fn claim_for_good(pool: &Pool, n: i64) -> Vec<(Uuid, i64)> {
    let fairness = queue::Fairness { default_max_in_flight: 1_000_000, sweep: false };
    let claimed = queue::claim_fair(pool, n, std::time::Duration::from_secs(600), fairness).await.unwrap();
    claimed.into_iter().map(|c| (c.id.0, c.claim_token)).collect()
}

/// The recorder's transaction runs cached generic plans (`db::Planning::Cached`): its
/// outcome write, prepared and first run on an almost empty queue (no `ANALYZE`, as on a
/// new database), still reaches the batch's rows by key at 61,000 pending and 20,000
/// delivered.
#[tokio::test]
async fn the_outcome_write_costs_the_same_at_any_backlog_with_a_plan_built_on_an_empty_queue() {
    use sqlx::Connection as _;
    let (db, endpoint, mut conn) = unanalyzed_queue().await;
    let pool = &db.pool;
    sqlx::query(&format!("PREPARE record({RECORD_TYPES}) AS {}", queue::RECORD_SQL)).execute(&mut conn).await.unwrap();
    seed_deliveries(pool, &endpoint.to_string(), CLAIM_ROWS).await;
    let (small, small_plan) = record_cost(&mut conn, &claim_for_good(pool, CLAIM_ROWS).await).await;

    // The 16 stay leased (their outcomes were rolled back); the next claim takes the
    // oldest of the new backlog, as a worker would.
    add_history(pool, endpoint, 20_000).await;
    seed_deliveries(pool, &endpoint.to_string(), 60_000).await;
    let (large, large_plan) = record_cost(&mut conn, &claim_for_good(pool, CLAIM_ROWS).await).await;
    conn.close().await.unwrap();
    eprintln!("outcome write of {CLAIM_ROWS}: on an empty queue {small:?}; at 61,000 pending {large:?}");
    assert_eq!((small.rows, large.rows), (CLAIM_ROWS, CLAIM_ROWS), "each write recorded its batch");
    assert!(
        large.buffers <= 2 * small.buffers + 100,
        "an outcome write of {CLAIM_ROWS} touched {} buffers on an empty queue and {} at 61,000 pending: its \
         plan walks the table\n{small_plan}\n{large_plan}",
        small.buffers,
        large.buffers
    );
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of the prepared statement `ingest` run with `args`, in a
/// transaction that is rolled back.
async fn ingest_cost(conn: &mut sqlx::PgConnection, args: &str) -> (Cost, Value) {
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    let (explain, buffers) = explain_measured(
        conn,
        sqlx::query_scalar(&format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE ingest({args})")),
    )
    .await;
    sqlx::query("ROLLBACK").execute(&mut *conn).await.unwrap();
    (top_cost(&explain, buffers), explain)
}

/// The parameter types of the single-event ingest statement
/// ([`webhook_gateway::store::events::insert_sql`]) ...
const SINGLE_TYPES: &str = "uuid, text, text, text, jsonb, bytea, text, text, text, int8[]";

/// ... and of the one that leases ([`webhook_gateway::store::events::insert_and_claim_sql`]).
const LEASING_TYPES: &str = "uuid, text, text, text, jsonb, bytea, text, text, text, int8[], int8, float8, int4";

/// Subscribe `endpoint` to the built-in source `api`: its id.
async fn subscribe_to_api(pool: &Pool, endpoint: Uuid) -> Uuid {
    let source: Uuid = sqlx::query_scalar("SELECT id FROM sources WHERE name = 'api'").fetch_one(pool).await.unwrap();
    sqlx::query("INSERT INTO subscriptions (endpoint_id, source_id) VALUES ($1, $2)")
        .bind(endpoint)
        .bind(source)
        .execute(pool)
        .await
        .unwrap();
    source
}

/// The arguments of the batch ingest statement for two new events (their keys end in
/// `round`) and a copy of the stored event `dup`, from `source`.
fn batch_args(source: Uuid, round: usize) -> String {
    format!(
        "ARRAY['{source}', '{source}', '{source}']::uuid[], ARRAY['dup', 'new-a-{round}', 'new-b-{round}'],
         ARRAY['t', 't', 't'], ARRAY['application/json', 'application/json', 'application/json'],
         ARRAY['{{}}', '{{}}', '{{}}'],
         ARRAY[convert_to('{{}}', 'UTF8'), convert_to('{{}}', 'UTF8'), convert_to('{{}}', 'UTF8')],
         ARRAY[0, 1, 2], ARRAY[NULL, NULL, NULL]::text[], ARRAY[0, 1, 2],
         ARRAY[NULL, NULL, NULL]::text[], ARRAY[NULL, NULL, NULL]::text[],
         ARRAY[1, 2, 3]::int8[], ARRAY[1, 2, 3]"
    )
}

/// The arguments of the single-event ingest statement for a copy of the stored event
/// `dup` (`round` is not used: the copy is the same every time).
fn single_args(source: Uuid, _round: usize) -> String {
    format!(
        "'{source}', 'dup', 't', 'application/json', '{{}}', convert_to('{{}}', 'UTF8'), NULL, NULL, NULL, ARRAY[1]::int8[]"
    )
}

/// The arguments of the ingest statement that leases ([`webhook_gateway::store::events::insert_and_claim_sql`])
/// for a new event from `source` (its key ends in `round`): up to 8 leases of 60 s, 4 in
/// flight by default.
fn leasing_args(source: Uuid, round: usize) -> String {
    format!(
        "'{source}', 'lease-{round}', 't', 'application/json', '{{}}', convert_to('{{}}', 'UTF8'), NULL, NULL, NULL, \
         ARRAY[1]::int8[], 8, 60, 4"
    )
}

/// An ingest statement under test: what it is, its SQL, its parameter types, its
/// arguments (for a source and a round) and how many answers it gives.
type IngestStatement = (&'static str, &'static str, &'static str, fn(Uuid, usize) -> String, i64);

/// The ingest statements are prepared once per connection: under load a batch of
/// webhooks in one statement ([`webhook_gateway::store::events::insert_batch_sql`]), at
/// low load one webhook ([`webhook_gateway::store::events::insert_sql`]), or one webhook
/// with its delivery leased ([`webhook_gateway::store::events::insert_and_claim_sql`],
/// whose room function reads the endpoint's leases in flight), and the lean forms of the
/// batch and the last two (`store::events::lean` and `lean_insert_batch_sql`, whose
/// guard reads the sources' subscriptions). A plan, generic
/// or custom, built when `events` was nearly empty (a gateway's first minute on a new
/// database, before any `ANALYZE`) must still find a duplicate by key, and touch nothing
/// else of the table, when 30,000 events are stored. (The batch's duplicate lookup
/// written as a plain `LEFT JOIN events` got a generic plan that hashed the batch and
/// scanned all of `events` for every batch, duplicates or not: 1,219 pages of the tables
/// here at 30,000 events against 65 with one event stored; in the bench's 1,000/s run,
/// 27,529 rows read for a batch of two and the statement's mean 2.9 ms.)
#[tokio::test]
async fn ingest_costs_the_same_at_any_table_size_with_a_plan_built_on_an_empty_database() {
    use sqlx::Connection as _;
    use webhook_gateway::store::events::{
        insert_and_claim_sql, insert_batch_sql, insert_sql, lean, lean_insert_batch_sql,
    };
    const BATCH_TYPES: &str =
        "uuid[], text[], text[], text[], text[], bytea[], int4[], text[], int4[], text[], text[], int8[], int4[]";
    let statements: [IngestStatement; 6] = [
        ("batch of 2 new + 1 duplicate", insert_batch_sql(), BATCH_TYPES, batch_args, 3),
        ("batch of 2 new + 1 duplicate, lean", lean_insert_batch_sql(), BATCH_TYPES, batch_args, 3),
        ("one duplicate", insert_sql(), SINGLE_TYPES, single_args, 1),
        ("one new webhook, its delivery leased", insert_and_claim_sql(), LEASING_TYPES, leasing_args, 1),
        ("one duplicate, lean", lean::insert_sql(), SINGLE_TYPES, single_args, 1),
        ("one new webhook, lean, its delivery leased", lean::insert_and_claim_sql(), LEASING_TYPES, leasing_args, 1),
    ];
    for (what, sql, types, args, answers) in statements {
        for mode in MODES {
            let (db, endpoint, mut conn) = unanalyzed_queue().await;
            let pool = &db.pool;
            let source = subscribe_to_api(pool, endpoint).await;
            sqlx::query(
                "INSERT INTO events (source_id, dedupe_key, event_type, headers, payload)
                 VALUES ($1, 'dup', 't', '{}', convert_to('{}', 'UTF8'))",
            )
            .bind(source)
            .execute(pool)
            .await
            .unwrap();
            sqlx::query(&format!("SET plan_cache_mode = {mode}")).execute(&mut conn).await.unwrap();
            sqlx::query(&format!("PREPARE ingest({types}) AS {sql}")).execute(&mut conn).await.unwrap();
            // The first run builds the plan (the generic one is kept); the second is measured.
            ingest_cost(&mut conn, &args(source, 0)).await;
            let (small, small_plan) = ingest_cost(&mut conn, &args(source, 1)).await;

            add_history(pool, endpoint, 30_000).await;
            let (large, large_plan) = ingest_cost(&mut conn, &args(source, 2)).await;
            conn.close().await.unwrap();
            eprintln!("ingest, {what}, {mode}: with one event stored {small:?}; with 30,000 {large:?}");
            assert_eq!((small.rows, large.rows), (answers, answers), "{what}, {mode}: one answer per event");
            assert!(
                large.buffers <= 2 * small.buffers + 100,
                "{what}, {mode}: touched {} buffers with one event stored and {} with 30,000: its plan reads \
                 the table\n{small_plan}\n{large_plan}",
                small.buffers,
                large.buffers
            );
        }
    }
}

/// The recorder's statements handle each row of a full batch a bounded number of times.
/// The recorder plans without hash joins (`db::Planning::Cached`), so a join of two of a
/// statement's own CTEs is a nested loop that rescans one of them for every row of the
/// other: the attempts insert joined the `UPDATE`'s rows back to the batch (65,280 rows
/// dropped by the join filter for 256 outcomes, half the statement's time), and the
/// promotion anti-joined its idle lines to their next deliveries (32,640 rows for 256
/// lines). Each statement here runs on a batch of 256 (the recorder's largest; half the
/// lines then have nothing waiting and are deleted) and must handle at most 30 rows per
/// row of the batch: one pass handles 2,816 (outcomes) and 3,200 (promotion); the
/// self-joins, run here as a control, 133,888 and 52,416.
#[tokio::test]
async fn the_recorder_s_statements_handle_a_full_batch_in_one_pass() {
    use webhook_gateway::queue::lines;
    const BATCH: i64 = 256;
    let db = TestDb::new().await;
    let pool = &db.pool;
    let endpoint = insert_endpoint(pool, "http://127.0.0.1:9/").await;
    crate::support::seed_ordered_lines(pool, &endpoint, BATCH).await;
    let heads = claim_for_good(pool, BATCH).await;
    assert_eq!(heads.len() as i64, BATCH, "every line's head claimed");

    let mut tx = pool.begin().await.unwrap();
    plan_as(&mut tx, Planning::Cached).await;
    let (record, _) = explain_prepared(&mut tx, queue::RECORD_SQL, RECORD_TYPES, &delivered_outcomes(&heads)).await;
    // A row for each outcome written, and one for each line it released (each head
    // finished its line); the endpoint's circuit is at rest.
    assert_eq!(record[0]["Plan"]["Actual Rows"], 2 * BATCH, "every outcome recorded, every line released: {record}");
    assert!(record.to_string().contains("\"Index Name\":\"order_lines_pkey\""), "lines by their key: {record}");
    let finished: Vec<_> = heads.iter().map(|(id, _)| webhook_gateway::ids::DeliveryId(*id)).collect();
    // The release finds each line by its own key (the primary key), which the head
    // carries: the schema has no index on the head since migration 0026.
    let ids = sql_array(heads.iter().map(|(id, _)| id.to_string()).collect());
    let (release, _) = explain_prepared(&mut tx, lines::RELEASE_HEADS_SQL, "uuid[]", &ids).await;
    assert_eq!(release[0]["Plan"]["Actual Rows"], BATCH, "every line found: {release}");
    assert!(release.to_string().contains("\"Index Name\":\"order_lines_pkey\""), "by the line's key: {release}");
    assert!(!release.to_string().contains("order_lines_head"), "{release}");
    let release_rows = rows_handled(&release[0]["Plan"]);
    assert!(release_rows <= 30.0 * BATCH as f64, "the release handled {release_rows} rows for {BATCH}: {release}");
    let released = lines::release_heads(&mut tx, &finished).await.unwrap();
    assert_eq!(released.len() as i64, BATCH, "every line released");
    // Half the lines have nothing left waiting: the promotion deletes them.
    let emptied: Vec<String> = released.iter().take(BATCH as usize / 2).map(|(_, k)| k.clone()).collect();
    sqlx::query("UPDATE deliveries SET status = 'delivered', waiting = false WHERE waiting AND ordering_key = ANY($1)")
        .bind(&emptied)
        .execute(&mut *tx)
        .await
        .unwrap();
    let endpoints = sql_array(released.iter().map(|(e, _)| e.to_string()).collect());
    let keys = sql_array(released.iter().map(|(_, k)| k.clone()).collect());
    let (promote, _) =
        explain_prepared(&mut tx, lines::PROMOTE_SQL, "uuid[], text[]", &format!("{endpoints}, {keys}")).await;
    assert_eq!(promote[0]["Plan"]["Actual Rows"], BATCH / 2, "every line with a waiting delivery moved on: {promote}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM order_lines WHERE ordering_key = ANY($1)")
        .bind(&emptied)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(left, 0, "the lines with nothing waiting were deleted");
    tx.rollback().await.unwrap();

    let (record_rows, promote_rows) = (rows_handled(&record[0]["Plan"]), rows_handled(&promote[0]["Plan"]));
    eprintln!("a batch of {BATCH}: the outcome write handled {record_rows} rows, the promotion {promote_rows}");
    for (statement, rows, plan) in [("outcome write", record_rows, &record), ("promotion", promote_rows, &promote)] {
        assert!(
            rows <= 30.0 * BATCH as f64,
            "the {statement} handled {rows} rows for a batch of {BATCH}: it rescans the batch per row\n{plan}"
        );
    }
}

/// Webhooks in a filtered ingest batch, and the subscriptions (each with a filter every
/// webhook matches) they fan out to.
const FILTERED_BATCH: usize = 64;
const FILTERED_SUBSCRIPTIONS: usize = 10;

/// Rows the batch ingest statement `sql` handled (per [`rows_handled`]) storing
/// [`FILTERED_BATCH`] new webhooks fanned out to [`FILTERED_SUBSCRIPTIONS`] filtered
/// subscriptions, planned in `mode`, in a transaction that is rolled back.
async fn filtered_batch_rows(sql: &str, mode: &str) -> (f64, Value) {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let source: Uuid = sqlx::query_scalar("SELECT id FROM sources WHERE name = 'api'").fetch_one(pool).await.unwrap();
    for i in 0..FILTERED_SUBSCRIPTIONS {
        let endpoint = insert_endpoint(pool, &format!("http://127.0.0.1:9/{i}")).await;
        sqlx::query(
            "INSERT INTO subscriptions (endpoint_id, source_id, filter) VALUES ($1::uuid, $2, '$.payload.n >= 0')",
        )
        .bind(endpoint)
        .bind(source)
        .execute(pool)
        .await
        .unwrap();
    }
    let n = FILTERED_BATCH;
    let array = |items: Vec<String>, ty: &str| format!("ARRAY[{}]::{ty}", items.join(", "));
    let texts = |f: &dyn Fn(usize) -> String| array((0..n).map(|i| format!("'{}'", f(i))).collect(), "text[]");
    let numbers = |from: usize, ty: &str| array((from..from + n).map(|i| i.to_string()).collect(), ty);
    let nulls = || array(vec!["NULL".into(); n], "text[]");
    let args = [
        array(vec![format!("'{source}'"); n], "uuid[]"),
        texts(&|i| format!("filtered-{i}")),
        texts(&|_| "order.paid".into()),
        texts(&|_| "application/json".into()),
        texts(&|_| "{}".into()),
        array((0..n).map(|i| format!("convert_to('{{\"n\": {i}}}', 'UTF8')")).collect(), "bytea[]"),
        numbers(0, "int4[]"), // the order rows go in
        nulls(),              // ordering keys
        numbers(0, "int4[]"), // the order they arrived in
        nulls(),              // traceparents
        nulls(),              // tracestates
        numbers(1, "int8[]"), // a search term each
        numbers(1, "int4[]"), // where each event's terms end
    ]
    .join(", ");
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&format!("SET LOCAL plan_cache_mode = {mode}")).execute(&mut *tx).await.unwrap();
    let (plan, _) = explain_prepared(
        &mut tx,
        sql,
        "uuid[], text[], text[], text[], text[], bytea[], int4[], text[], int4[], text[], text[], int8[], int4[]",
        &args,
    )
    .await;
    let delivered: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries").fetch_one(&mut *tx).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(delivered as usize, n * FILTERED_SUBSCRIPTIONS, "every webhook matched every filter ({mode})");
    (rows_handled(&plan[0]["Plan"]), plan)
}

/// A batch's filters read each event's document once: the batch ingest statement, storing
/// 64 webhooks fanned out to ten filtered subscriptions, handles a bounded number of rows
/// per delivery (48: 24 and 37 under the custom and the generic plan on 2026-12-05) under
/// either plan. Control: the document looked up by a subquery in the filter's condition
/// (as before 2026-12-05), which scanned the batch's documents for every (event,
/// subscription) pair, handles more than that bound.
#[tokio::test]
async fn a_filtered_batch_reads_each_event_s_document_once() {
    use webhook_gateway::store::events::insert_batch_sql;
    let pairs = (FILTERED_BATCH * FILTERED_SUBSCRIPTIONS) as f64;
    let joined = "FROM ev LEFT JOIN docs d ON d.id = ev.id\n                 JOIN subscriptions s ON";
    assert!(insert_batch_sql().contains(joined), "the fan-out joins each event's document");
    let looked_up = insert_batch_sql()
        .replace(joined, "FROM ev JOIN subscriptions s ON")
        .replace("jsonb_path_match(d.doc,", "jsonb_path_match((SELECT d.doc FROM docs d WHERE d.id = ev.id),");
    for mode in MODES {
        let (rows, plan) = filtered_batch_rows(insert_batch_sql(), mode).await;
        let (control, _) = filtered_batch_rows(&looked_up, mode).await;
        eprintln!("{mode}: {rows} rows handled for {pairs} deliveries; with the document looked up per pair {control}");
        assert!(rows <= 48.0 * pairs, "{mode}: {rows} rows handled for {pairs} deliveries\n{plan}");
        assert!(control > 48.0 * pairs, "control, {mode}: the lookup per pair handled only {control} rows");
    }
}

/// Every node type in a plan, the plan's own first.
fn node_types(plan: &Value, out: &mut Vec<String>) {
    if let Some(kind) = plan["Node Type"].as_str() {
        out.push(kind.to_owned());
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        node_types(child, out);
    }
}

/// The node types of `sql` (a lone webhook's leasing statement, its parameters as
/// [`leasing_args`] gives them) planned in `mode` on `conn`, in a transaction rolled back.
async fn leasing_plan_nodes(conn: &mut sqlx::PgConnection, sql: &str, source: Uuid, mode: &str) -> Vec<String> {
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    sqlx::query(&format!("SET LOCAL plan_cache_mode = {mode}")).execute(&mut *conn).await.unwrap();
    let (plan, _) = explain_prepared(conn, sql, LEASING_TYPES, &leasing_args(source, 0)).await;
    sqlx::query("ROLLBACK").execute(&mut *conn).await.unwrap();
    let mut nodes = Vec::new();
    node_types(&plan[0]["Plan"], &mut nodes);
    nodes
}

/// A lone webhook's leasing statements join the endpoints the room function grants to
/// their deliveries by nested loops, and read the leased rows once per answer without
/// materializing them. PostgreSQL estimates a set-returning function at 1,000 rows unless
/// told otherwise, and for 1,000 rows it planned two hash joins and a `Materialize`: a
/// hash table built at every execution for the one endpoint a webhook most often goes to,
/// about 80,000 of the statement's 1,400,000 instructions (bench row 18). Migration 0030
/// says the function returns about one row, and the answer reads the leases through a
/// lateral subquery that is not pulled up. Checked with the custom and the generic plan,
/// on an empty database and with 30,000 delivered webhooks analyzed. Controls: with the
/// function's estimate back at 1,000 the plans build hash tables; with the subquery
/// pulled up (no `OFFSET 0`) they hash or materialize the leases.
#[tokio::test]
async fn a_lone_webhook_s_leasing_statement_builds_no_hash_table() {
    use webhook_gateway::store::events::{insert_and_claim_sql, lean};
    let (db, endpoint, mut conn) = unanalyzed_queue().await;
    let pool = &db.pool;
    let source = subscribe_to_api(pool, endpoint).await;
    let built = |nodes: &[String]| {
        nodes.iter().filter(|n| matches!(n.as_str(), "Hash" | "Hash Join" | "Materialize")).cloned().collect::<Vec<_>>()
    };
    let statements = [("full", insert_and_claim_sql()), ("lean", lean::insert_and_claim_sql())];
    for history in [false, true] {
        if history {
            add_history(pool, endpoint, 30_000).await;
            sqlx::query("ANALYZE").execute(pool).await.unwrap();
        }
        for (what, sql) in statements {
            for mode in MODES {
                let nodes = leasing_plan_nodes(&mut conn, sql, source, mode).await;
                eprintln!("{what}, {mode}, history {history}: {nodes:?}");
                assert!(nodes.iter().any(|n| n == "Nested Loop"), "{what}, {mode}: {nodes:?}");
                assert_eq!(built(&nodes), Vec::<String>::new(), "{what}, {mode}, history {history}: {nodes:?}");
            }
        }
    }

    // Controls, on the same database: each cause alone brings a hash table or a
    // materialized join back.
    let pulled_up = lean::insert_and_claim_sql().replace("OFFSET 0", "");
    assert_ne!(pulled_up, lean::insert_and_claim_sql(), "the answer's subquery is kept from being pulled up");
    for mode in MODES {
        let nodes = leasing_plan_nodes(&mut conn, &pulled_up, source, mode).await;
        assert!(!built(&nodes).is_empty(), "control, pulled up, {mode}: {nodes:?}");
    }
    sqlx::query("ALTER FUNCTION wg_lease_room_v5(uuid[], int8, int4) ROWS 1000").execute(pool).await.unwrap();
    for (what, sql) in statements {
        for mode in MODES {
            let nodes = leasing_plan_nodes(&mut conn, sql, source, mode).await;
            assert!(!built(&nodes).is_empty(), "control, 1,000 rows estimated, {what}, {mode}: {nodes:?}");
        }
    }
}

/// Whether `EXPLAIN (ANALYZE, FORMAT JSON)` of a count of `deliveries`, run on `db`, says
/// the statement was compiled (its `JIT` section).
async fn compiled<'c, E: sqlx::PgExecutor<'c>>(db: E) -> bool {
    let explain: Value =
        webhook_gateway::db::query_scalar("EXPLAIN (ANALYZE, FORMAT JSON) SELECT count(*) FROM deliveries")
            .fetch_one(db)
            .await
            .unwrap();
    explain[0].get("JIT").is_some()
}

/// PostgreSQL compiles a statement (JIT) whose estimated cost passes `jit_above_cost`, at
/// every execution: 50-80 ms. A cached generic plan is estimated from the whole table (its
/// `LIMIT`s are parameters), and the general claim's at 1,000,000 pending was compiled for
/// every claim of 256 rows (59 ms a claim against 6 ms, bench row 6). The gateway's
/// sessions never compile, whatever the estimate, straight to PostgreSQL (a startup
/// option) and behind a transaction pooler (each transaction's `BEGIN`): here the database
/// asks for every statement to be compiled (`jit_above_cost = 0`), and a plain session
/// does it where the server can.
#[tokio::test]
async fn the_gateway_s_sessions_never_compile_a_statement_whatever_its_estimate() {
    use sqlx::Connection as _;
    use webhook_gateway::db::DbConfig;
    let db = TestDb::new().await;
    sqlx::query(&format!("ALTER DATABASE {} SET jit_above_cost = 0", db.name())).execute(&db.pool).await.unwrap();
    let endpoint = insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    seed_deliveries(&db.pool, &endpoint, 100).await;

    let mut plain = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let available: bool = sqlx::query_scalar("SELECT pg_jit_available()").fetch_one(&mut plain).await.unwrap();
    let plain_compiles = compiled(&mut plain).await;
    plain.close().await.unwrap();
    eprintln!("JIT available on this server: {available}; a plain session compiled the count: {plain_compiles}");
    assert_eq!(plain_compiles, available, "the control: a plain session compiles where the server can");

    for pooler in [Pooler::None, Pooler::Transaction] {
        let config = DbConfig {
            url: db.url.clone(),
            pool_size: 2,
            pooler,
            session_url: None,
            start_wait: std::time::Duration::ZERO,
        };
        let pool = webhook_gateway::db::open(&config).await.unwrap();
        let setting: String =
            webhook_gateway::db::query_scalar("SELECT current_setting('jit')").fetch_one(&pool).await.unwrap();
        assert_eq!(setting, "off", "{pooler:?}");
        assert!(!compiled(&pool).await, "{pooler:?}: the gateway's session compiled a statement");
        let mut tx = pool.begin_planned(Planning::Cached).await.unwrap();
        assert!(!compiled(&mut *tx).await, "{pooler:?}: a planned transaction compiled a statement");
        tx.rollback().await.unwrap();
        pool.close().await;
    }
}
