//! Gateways in schemas of their own on one database: what an operator does to run two
//! environments (or two tenants) on one managed PostgreSQL, by the session's
//! `search_path` (the URL's `options` on a direct connection; behind PgBouncer, which
//! refuses startup options, the alias's `connect_query` or the role's setting). Each
//! gateway migrates, stores and delivers in its own schema only, and nothing of one is
//! taken for the other's: not its tables, not its deduplication, not the functions that
//! keep its statements' plans behind a transaction pooler (`db::kept_plans`).

use std::time::Duration;

use serde_json::json;

use crate::support::pgbouncer::{Alias, PgBouncer};
use crate::support::sink::Sink;
use crate::support::{GatewayProcess, TestDb, eventually, post_to_shop, shop_to, wait_ready};

/// Three gateways on one database, in schemas `gw_a` and `gw_b` through PgBouncer in
/// transaction mode (each alias sets its `search_path`) and `gw_c` directly (the URL's
/// `options`), each posted the same ten delivery ids: every gateway answers all ten as new
/// (200, not duplicates), delivers them to its own subscriber only, and keeps its events,
/// its schema's migrations and its kept plans in its schema; nothing lands in `public`.
/// Before kept plans were looked up in the session's schemas, the second pooled gateway
/// found the first's functions in `gw_a`, did not create its own, and could not call them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gateways_in_schemas_of_their_own_share_a_database_directly_and_behind_pgbouncer() {
    let db = TestDb::empty().await;
    let database = db.name();
    for schema in ["gw_a", "gw_b", "gw_c"] {
        sqlx::query(&format!("CREATE SCHEMA {schema}")).execute(&db.pool).await.expect("a schema");
    }
    let (query_a, query_b) = ("SET search_path = gw_a", "SET search_path = gw_b");
    let bouncer = PgBouncer::start_with(
        &db.url,
        2,
        &[
            Alias { name: "env_a", database: &database, connect_query: query_a },
            Alias { name: "env_b", database: &database, connect_query: query_b },
        ],
    );
    let pooled = ["--db-pooler", "transaction"];
    let direct_c = format!("{}?options=-c%20search_path%3Dgw_c", db.url);
    // One after the other, so that the second pooled gateway starts on a database where
    // the first has already kept its plans.
    let mut gateways = Vec::new();
    for (url, extra) in [
        (bouncer.url("env_a", &db.url), &pooled[..]),
        (bouncer.url("env_b", &db.url), &pooled[..]),
        (direct_c, &[][..]),
    ] {
        let gateway = GatewayProcess::start(&url, extra);
        wait_ready(gateway.addr).await;
        gateways.push(gateway);
    }

    let mut sinks = Vec::new();
    for gateway in &gateways {
        let base = format!("http://{}", gateway.addr);
        let sink = Sink::ok().await;
        shop_to(&base, json!({"url": sink.url("/hook")})).await;
        for i in 0..10 {
            let (status, body) = post_to_shop(&base, &format!("d-{i}"), &json!({"order": i})).await;
            assert_eq!((status, body["duplicate"].as_bool()), (200, Some(false)), "{base}: {body}");
        }
        sinks.push(sink);
    }
    for sink in &sinks {
        eventually(Duration::from_secs(30), "each gateway delivers its ten", || async {
            (sink.count() >= 10).then_some(())
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sinks.iter().map(Sink::count).collect::<Vec<_>>(), [10, 10, 10], "each its own, once");

    for schema in ["gw_a", "gw_b", "gw_c"] {
        let (events, migrations): (i64, i64) = sqlx::query_as(&format!(
            "SELECT (SELECT count(*) FROM {schema}.events WHERE dedupe_key LIKE 'd-%'),
                    (SELECT count(*) FROM {schema}._sqlx_migrations WHERE success)"
        ))
        .fetch_one(&db.pool)
        .await
        .expect("the schema's rows");
        assert_eq!(events, 10, "{schema}'s events");
        assert!(migrations > 30, "{schema} migrated: {migrations}");
    }
    let in_public: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("public's relations");
    assert_eq!(in_public, 0, "nothing in public");
    let kept_in: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT n.nspname::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE p.proname LIKE 'wg\\_plan\\_%' ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .expect("kept plans");
    assert_eq!(kept_in, ["gw_a", "gw_b"], "each pooled gateway keeps its plans in its own schema");

    for mut gateway in gateways {
        assert!(gateway.terminate(), "clean exit");
        let log = std::fs::read_to_string(&gateway.log).unwrap_or_default();
        assert!(!log.contains("does not exist"), "a statement missed its object: {log}");
        assert!(!log.contains("offset from the database's was not measured"), "the clock measured: {log}");
    }
    drop(bouncer);
}

/// Wake-ups stay in their schema. Split roles in schemas `gw_a` and `gw_b` of one
/// database, each worker polling every 60 s, so that only a notification wakes it: a
/// delivery made due in `gw_b` without one waits while `gw_a`'s ingest notifies (before
/// notifications named their schema, `gw_a`'s wake-ups woke `gw_b`'s worker, whose claim
/// then took the delivery); `gw_a`'s own worker is woken (the control); `gw_b`'s ingest
/// wakes `gw_b`'s worker; and an empty notification, what an older release sends during a
/// rolling deploy, still wakes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_notification_wakes_the_workers_of_its_own_schema_only() {
    let db = TestDb::empty().await;
    let mut processes = Vec::new();
    let mut ingest = Vec::new();
    let mut sinks = Vec::new();
    for schema in ["gw_a", "gw_b"] {
        sqlx::query(&format!("CREATE SCHEMA {schema}")).execute(&db.pool).await.expect("a schema");
        let url = format!("{}?options=-c%20search_path%3D{schema}", db.url);
        let front = GatewayProcess::start(&url, &["--role", "ingest"]);
        wait_ready(front.addr).await;
        let base = format!("http://{}", front.addr);
        let sink = Sink::ok().await;
        shop_to(&base, json!({"url": sink.url("/hook")})).await;
        let worker = GatewayProcess::start(&url, &["--role", "worker", "--poll-interval-ms", "60000"]);
        wait_ready(worker.addr).await;
        processes.push(front);
        processes.push(worker);
        ingest.push(base);
        sinks.push(sink);
    }
    // Let the workers finish their start-up claims and go idle.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let due_in_b_unannounced = |key: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(
                "WITH ev AS (
                     INSERT INTO gw_b.events (source_id, dedupe_key, event_type, content_type, headers, payload)
                     SELECT id, $1, 'order.paid', 'application/json', '{}'::jsonb, convert_to('{}', 'UTF8')
                     FROM gw_b.sources WHERE name = 'shop'
                     RETURNING id
                 )
                 INSERT INTO gw_b.deliveries (event_id, endpoint_id) SELECT ev.id, ep.id FROM ev, gw_b.endpoints ep",
            )
            .bind(key)
            .execute(&pool)
            .await
            .expect("a due delivery, no notification");
        }
    };
    due_in_b_unannounced("quiet-1").await;

    for i in 0..5 {
        let (status, body) = post_to_shop(&ingest[0], &format!("a-{i}"), &json!({"i": i})).await;
        assert_eq!(status, 200, "{body}");
    }
    eventually(Duration::from_secs(20), "gw_a's worker, woken by gw_a's ingest, delivers", || async {
        (sinks[0].count() >= 5).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(sinks[1].count(), 0, "gw_b's worker was woken by gw_a's ingest");

    let (status, body) = post_to_shop(&ingest[1], "b-0", &json!({"b": 0})).await;
    assert_eq!(status, 200, "{body}");
    eventually(Duration::from_secs(20), "gw_b's worker, woken by gw_b's ingest, delivers both", || async {
        (sinks[1].count() >= 2).then_some(())
    })
    .await;

    due_in_b_unannounced("quiet-2").await;
    sqlx::query("SELECT pg_notify('webhook_gateway_wake', '')").execute(&db.pool).await.expect("an old notification");
    eventually(Duration::from_secs(20), "an empty notification (an older release's) wakes gw_b's worker", || async {
        (sinks[1].count() >= 3).then_some(())
    })
    .await;
    assert_eq!(sinks[0].count(), 5, "gw_a's deliveries, once each");

    for mut process in processes {
        assert!(process.terminate(), "clean exit");
    }
}
