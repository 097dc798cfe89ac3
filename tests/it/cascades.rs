//! What hangs under an event goes with it: deleting or truncating events takes their
//! deliveries, deleting deliveries takes their attempts, deleting a source takes all
//! three (migration 0035: statement-level cascades in place of two foreign keys whose
//! insert check could not fail). And no delivery or attempt is ever left without its
//! parent, with ingest, delivery and a source's deletion racing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use reqwest::Method;
use sqlx::{Connection as _, PgConnection};

use crate::support::sink::{Reply, Sink};
use webhook_gateway::db::Pool;

use crate::support::{TestApp, TestDb, eventually, insert_endpoint, seed_deliveries};

/// Deliveries whose event is gone, and attempts whose delivery is gone.
async fn orphans(pool: &Pool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM deliveries d WHERE NOT EXISTS (SELECT 1 FROM events e WHERE e.id = d.event_id)),
                (SELECT count(*) FROM attempts a WHERE NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.id = a.delivery_id))",
    )
    .fetch_one(pool)
    .await
    .expect("count orphans")
}

/// Rows in `events`, `deliveries` and `attempts`.
async fn counts(pool: &Pool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM deliveries), (SELECT count(*) FROM attempts)",
    )
    .fetch_one(pool)
    .await
    .expect("count rows")
}

/// Two failed attempts recorded for every delivery.
async fn two_attempts_each(pool: &Pool) {
    sqlx::query(
        "INSERT INTO attempts (delivery_id, attempt_number, started_at, duration_ms, outcome, reason)
         SELECT d.id, n, now(), 1, 'retry', 'HTTP 500' FROM deliveries d CROSS JOIN generate_series(1, 2) n",
    )
    .execute(pool)
    .await
    .expect("record attempts");
}

#[tokio::test]
async fn deleting_or_truncating_a_parent_takes_what_hangs_under_it() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let endpoint = insert_endpoint(pool, "http://127.0.0.1:9/a").await;
    seed_deliveries(pool, &endpoint, 6).await;
    two_attempts_each(pool).await;
    assert_eq!(counts(pool).await, (6, 6, 12));

    // Two events deleted by hand: their deliveries and those deliveries' attempts go.
    let gone = sqlx::query("DELETE FROM events WHERE id IN (SELECT event_id FROM deliveries ORDER BY id LIMIT 2)")
        .execute(pool)
        .await
        .expect("delete two events")
        .rows_affected();
    assert_eq!(gone, 2);
    assert_eq!(counts(pool).await, (4, 4, 8));

    // A delivery deleted: its attempts go, its event stays.
    sqlx::query("DELETE FROM deliveries WHERE id = (SELECT id FROM deliveries ORDER BY id LIMIT 1)")
        .execute(pool)
        .await
        .expect("delete a delivery");
    assert_eq!(counts(pool).await, (4, 3, 6));
    assert_eq!(orphans(pool).await, (0, 0));

    // From a session whose `search_path` leads to none of the gateway's tables (an
    // operator's, a tool's), naming the table by its schema: the cascade still finds
    // the children in the parent's schema.
    let mut elsewhere = PgConnection::connect(&db.url).await.expect("a session of its own");
    sqlx::query("SET search_path = pg_catalog").execute(&mut elsewhere).await.expect("set search_path");
    sqlx::query("DELETE FROM public.events WHERE id = (SELECT event_id FROM public.deliveries ORDER BY id LIMIT 1)")
        .execute(&mut elsewhere)
        .await
        .expect("delete an event from elsewhere");
    assert_eq!(counts(pool).await, (3, 2, 4));
    assert_eq!(orphans(pool).await, (0, 0));

    // The built-in source `api` deleted by hand: its events go by their own foreign key,
    // and everything under them with them.
    sqlx::query("DELETE FROM sources WHERE name = 'api'").execute(pool).await.expect("delete the source");
    assert_eq!(counts(pool).await, (0, 0, 0));

    // `TRUNCATE events` empties the tables under it too (it refused without CASCADE while
    // foreign keys pointed at it).
    sqlx::query("INSERT INTO sources (name, kind, spec) VALUES ('api', 'none', '{}')")
        .execute(pool)
        .await
        .expect("a source");
    seed_deliveries(pool, &endpoint, 3).await;
    two_attempts_each(pool).await;
    assert_eq!(counts(pool).await, (3, 3, 6));
    sqlx::query("TRUNCATE events").execute(pool).await.expect("truncate events");
    assert_eq!(counts(pool).await, (0, 0, 0));
    seed_deliveries(pool, &endpoint, 2).await;
    two_attempts_each(pool).await;
    sqlx::query("TRUNCATE deliveries").execute(pool).await.expect("truncate deliveries");
    assert_eq!(counts(pool).await, (2, 0, 0));
}

/// A source deleted while its webhooks are being ingested and delivered (half the
/// subscriber's answers to it are 500, so attempts are recorded and retried): when it is
/// over, nothing of the source is left, no delivery lacks its event, no attempt its
/// delivery, and another source's webhooks were all delivered.
#[tokio::test]
async fn no_row_outlives_its_parent_while_a_source_is_deleted_under_load() {
    let app = TestApp::spawn().await;
    let answered = Arc::new(AtomicUsize::new(0));
    // Half of shop's requests fail (their attempts recorded, retried); crm's all succeed.
    let sink =
        Sink::start(|got, n| if got.path == "/shop" && n % 2 == 0 { Reply::status(500) } else { Reply::status(200) })
            .await;
    app.source_none("shop").await;
    app.source_none("crm").await;
    app.endpoint_for(&sink.url("/shop"), Some("shop")).await;
    app.endpoint_for(&sink.url("/crm"), Some("crm")).await;
    let shop = app.admin_get("/v1/sources").await["data"]
        .as_array()
        .expect("sources")
        .iter()
        .find(|s| s["name"] == "shop")
        .expect("shop")["id"]
        .as_str()
        .expect("shop's id")
        .to_owned();

    let stop = Arc::new(AtomicBool::new(false));
    let mut producers = Vec::new();
    for p in 0..4 {
        let (http, base, stop, answered) = (app.http.clone(), app.url(""), stop.clone(), answered.clone());
        producers.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                // The source may be gone by now: any answer will do.
                let sent = http
                    .post(format!("{base}/ingest/shop"))
                    .header("x-delivery-id", format!("shop-{p}-{i}"))
                    .header("x-event-type", "order.paid")
                    .body("{}")
                    .send()
                    .await;
                if sent.is_ok() {
                    answered.fetch_add(1, Ordering::SeqCst);
                }
                i += 1;
            }
        }));
    }
    let mut crm = 0;
    while answered.load(Ordering::SeqCst) < 200 {
        let (status, body) = app.ingest("crm", &format!("crm-{crm}"), "lead.new", "{}").await;
        assert_eq!(status, 200, "{body}");
        crm += 1;
    }
    eventually(Duration::from_secs(30), "attempts recorded for shop's webhooks", || async {
        let recorded: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM attempts a JOIN deliveries d ON d.id = a.delivery_id
             JOIN events e ON e.id = d.event_id JOIN sources s ON s.id = e.source_id WHERE s.name = 'shop'",
        )
        .fetch_one(&app.db.pool)
        .await
        .expect("count shop's attempts");
        (recorded >= 20).then_some(())
    })
    .await;

    let (status, body) = app.admin(Method::DELETE, &format!("/v1/sources/{shop}?force=true"), None).await;
    assert_eq!(status, 204, "{body}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    for producer in producers {
        producer.await.expect("producer");
    }

    // Every crm webhook delivered.
    eventually(Duration::from_secs(60), "crm's webhooks delivered", || async {
        let delivered: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM deliveries d JOIN events e ON e.id = d.event_id JOIN sources s ON s.id = e.source_id
             WHERE s.name = 'crm' AND d.status = 'delivered'",
        )
        .fetch_one(&app.db.pool)
        .await
        .expect("count crm's deliveries");
        (delivered == crm).then_some(())
    })
    .await;
    let events_left: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE source_id = $1::uuid")
        .bind(&shop)
        .fetch_one(&app.db.pool)
        .await
        .expect("count shop's events");
    assert_eq!(events_left, 0, "the deleted source's events");
    assert_eq!(orphans(&app.db.pool).await, (0, 0), "deliveries without their event, attempts without their delivery");
    let (_, deliveries, attempts) = counts(&app.db.pool).await;
    assert!(deliveries >= crm, "crm's deliveries stay: {deliveries}");
    assert!(attempts >= crm, "crm's attempts stay: {attempts}");
}

/// `key`'s webhook `i` posted to source `source` (ordered by `X-Key`), answered 200.
async fn post_ordered(app: &TestApp, source: &str, key: &str, i: u32) {
    let resp = app
        .http
        .post(app.url(&format!("/ingest/{source}")))
        .header("x-delivery-id", format!("{source}-{key}-{i}"))
        .header("x-key", key)
        .body(serde_json::json!({"source": source, "key": key, "i": i}).to_string())
        .send()
        .await
        .expect("ingest");
    assert_eq!(resp.status().as_u16(), 200);
}

/// Deliveries of `source` in `status`.
async fn of_source(pool: &Pool, source: &str, status: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM deliveries d JOIN events e ON e.id = d.event_id JOIN sources s ON s.id = e.source_id
         WHERE s.name = $1 AND d.status = $2 AND NOT d.waiting",
    )
    .bind(source)
    .bind(status)
    .fetch_one(pool)
    .await
    .expect("count deliveries")
}

/// Two sources' webhooks ordered by one key to one endpoint share an ordering line. When
/// the source whose delivery heads the line is deleted (forced), the line moves on to the
/// other source's deliveries, in order. (Before, the line went on naming the deleted head:
/// every later delivery of the key, from any source, waited forever.) Without `force`,
/// the deleting statement itself refuses a source that holds events, whatever the
/// caller counted before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_source_moves_on_the_ordering_lines_its_deliveries_headed() {
    let app = TestApp::spawn().await;
    // Source `old`'s webhooks are refused with 500 (retried: its delivery stays the head).
    let sink = Sink::start(|r, _| {
        let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
        if body["source"] == "old" { Reply::status(500) } else { Reply::status(200) }
    })
    .await;
    let mut ids = Vec::new();
    for name in ["old", "new"] {
        let source = app
            .admin_post(
                "/v1/sources",
                serde_json::json!({"name": name, "kind": "none", "dedupe": {"header": "X-Delivery-Id"},
                                   "ordering_key": {"header": "X-Key"}}),
                201,
            )
            .await;
        ids.push(source["id"].as_str().expect("source id").to_owned());
    }
    let endpoint = app.admin_post("/v1/endpoints", serde_json::json!({"url": sink.url("/")}), 201).await;
    for name in ["old", "new"] {
        let sub = serde_json::json!({"endpoint_id": endpoint["id"], "source": name, "ordered": {"on_dead": "block"}});
        app.admin_post("/v1/subscriptions", sub, 201).await;
    }

    post_ordered(&app, "old", "k", 0).await;
    eventually(Duration::from_secs(30), "old's delivery tried and failed", || async {
        (!sink.received().is_empty()).then_some(())
    })
    .await;
    for i in 1..=3 {
        post_ordered(&app, "new", "k", i).await;
    }
    // Control: a key of its own, behind no one.
    post_ordered(&app, "new", "other", 0).await;
    eventually(Duration::from_secs(30), "the other key delivered", || async {
        (of_source(&app.db.pool, "new", "delivered").await == 1).then_some(())
    })
    .await;
    let waiting: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE waiting").fetch_one(&app.db.pool).await.unwrap();
    assert_eq!(waiting, 3, "new's k-1..3 wait behind old's k-0");

    let old: webhook_gateway::ids::SourceId = ids[0].parse().expect("source id");
    let refused = webhook_gateway::store::sources::delete(&app.db.pool, old, false).await.expect("delete");
    assert!(!refused, "a source holding events is not deleted without force");
    assert_eq!(counts(&app.db.pool).await.0, 5, "nothing deleted");

    let (status, body) = app.admin(Method::DELETE, &format!("/v1/sources/{}?force=true", ids[0]), None).await;
    assert_eq!(status, 204, "{body}");
    eventually(Duration::from_secs(30), "new's k-1..3 delivered", || async {
        (of_source(&app.db.pool, "new", "delivered").await == 4).then_some(())
    })
    .await;
    let sent: Vec<(String, u64)> = sink
        .received()
        .iter()
        .filter_map(|r| serde_json::from_slice::<serde_json::Value>(&r.body).ok())
        .filter(|b| b["source"] == "new" && b["key"] == "k")
        .map(|b| (b["key"].as_str().unwrap_or_default().to_owned(), b["i"].as_u64().unwrap_or_default()))
        .collect();
    assert_eq!(sent, [("k".to_owned(), 1), ("k".to_owned(), 2), ("k".to_owned(), 3)], "in order, once each");
    let lines: i64 = sqlx::query_scalar("SELECT count(*) FROM order_lines").fetch_one(&app.db.pool).await.unwrap();
    assert_eq!(lines, 0, "idle lines are deleted");
}
