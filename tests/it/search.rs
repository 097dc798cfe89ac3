//! Finding an event by its content: a value at a JSON path in its payload, a header's
//! value, or its key (`GET /v1/events?payload=&header=&dedupe_key=`, the console's event
//! search), through the `events.search` index written at ingest.

use std::time::Duration;

use serde_json::json;
use webhook_gateway::store::events::{OwnedEvent, insert_batch_with_fanout};

use crate::support::{TestApp, TestDb};

/// The dedupe keys of the events a search found, in the order listed.
async fn keys(app: &TestApp, query: &str) -> Vec<String> {
    let page = app.admin_get(&format!("/v1/events?{query}")).await;
    page["data"].as_array().expect("data").iter().map(|e| e["dedupe_key"].as_str().unwrap().to_owned()).collect()
}

fn q(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

#[tokio::test]
async fn an_event_is_found_by_a_value_at_a_path_by_a_header_and_by_its_key() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    app.source_none("billing").await;
    let bodies = [
        ("k-1", "charge.succeeded", json!({"data": {"object": {"id": "ch_123", "amount": 4200}}, "livemode": true})),
        ("k-2", "charge.succeeded", json!({"data": {"object": {"id": "ch_456", "amount": 4200}}, "livemode": false})),
        ("k-3", "order.paid", json!({"order": 42, "items": [{"sku": "TSHIRT"}, {"sku": "MUG"}]})),
        ("k-4", "order.paid", json!({"order": "42", "note": " spaced "})),
    ];
    for (key, ty, body) in &bodies {
        assert_eq!(app.ingest("shop", key, ty, &body.to_string()).await.0, 200);
    }
    // Not JSON: found by its headers and key, never by a path.
    assert_eq!(app.ingest("shop", "k-5", "form", "order=42&x=1").await.0, 200);
    // The same key in another source.
    assert_eq!(app.ingest("billing", "k-1", "invoice.paid", "{\"order\": 7}").await.0, 200);

    let cases: &[(&str, &[&str])] = &[
        ("/data/object/id=ch_123", &["k-1"]),
        ("data.object.id = ch_456", &["k-2"]),
        ("/data/object/amount=4200", &["k-1", "k-2"]),
        ("livemode=true", &["k-1"]),
        // The number 42 and the string "42" are one search; the form body is not JSON.
        ("order=42", &["k-3", "k-4"]),
        ("/items/1/sku=MUG", &["k-3"]),
        ("/items/0/sku=MUG", &[]),
        ("note=\" spaced \"", &["k-4"]),
        ("note=spaced", &[]),
        // A value at another path is not a match.
        ("/data/id=ch_123", &[]),
        ("/data/object/id=ch_12", &[]),
    ];
    for (condition, expected) in cases {
        assert_eq!(keys(&app, &format!("payload={}", q(condition))).await, *expected, "payload={condition}");
    }
    // Headers: the webhook's own (the test client sends X-Event-Type), any case of name.
    assert_eq!(keys(&app, &format!("header={}", q("X-Event-Type: order.paid"))).await, ["k-3", "k-4"]);
    assert_eq!(keys(&app, &format!("header={}", q("x-event-type:form"))).await, ["k-5"]);
    // A key without a source: every source's event with it; with one, that source's.
    assert_eq!(keys(&app, "dedupe_key=k-1").await, ["k-1", "k-1"]);
    let found = app.admin_get("/v1/events?dedupe_key=k-1&source=billing").await;
    assert_eq!(found["data"].as_array().unwrap().len(), 1);
    assert_eq!(found["data"][0]["event_type"], "invoice.paid");
    // Conditions combine with each other and with the other filters.
    assert_eq!(
        keys(&app, &format!("payload={}&header={}", q("order=42"), q("x-event-type:order.paid"))).await,
        ["k-3", "k-4"]
    );
    assert_eq!(keys(&app, &format!("payload={}&source=billing", q("order=7"))).await, ["k-1"]);
    assert_eq!(keys(&app, &format!("payload={}&source=shop", q("order=7"))).await, Vec::<String>::new());
    assert_eq!(keys(&app, &format!("payload={}&event_type=order.*", q("order=42"))).await, ["k-3", "k-4"]);

    // Within a window: the same search before the events arrived finds nothing.
    let earlier = "since=2020-01-01T00:00:00Z&until=2020-01-02T00:00:00Z";
    assert_eq!(keys(&app, &format!("payload={}&{earlier}", q("order=42"))).await, Vec::<String>::new());
    let today = format!("since={}", q(&(chrono::Utc::now() - chrono::Duration::days(1)).to_rfc3339()));
    assert_eq!(keys(&app, &format!("payload={}&{today}", q("order=42"))).await, ["k-3", "k-4"]);
}

#[tokio::test]
async fn a_malformed_condition_is_a_422_that_says_what_is_wrong() {
    let app = TestApp::spawn().await;
    for (query, field) in [
        ("payload=no-equals-sign", "payload"),
        ("payload=%3D42", "payload"),
        ("payload=a..b%3D1", "payload"),
        ("payload=%2Fa~2%3D1", "payload"),
        ("header=no-colon", "header"),
        ("header=%3Av", "header"),
    ] {
        let (status, body) = app.admin(reqwest::Method::GET, &format!("/v1/events?{query}"), None).await;
        assert_eq!(status, 422, "{query}: {body}");
        assert_eq!(body["error"]["code"], "validation_failed", "{query}: {body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.starts_with(field), "{query}: {message}");
    }
}

/// The group-commit writer stores many events in one statement, their terms end to end
/// in one array: each event must get its own. Racing webhooks, each then found by its
/// own order id and by no other's.
#[tokio::test]
async fn events_stored_in_one_batch_are_each_found_by_their_own_values() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    const N: usize = 60;
    let sends = (0..N).map(|i| {
        let body = json!({"data": {"object": {"id": format!("ord_{i}"), "n": i}}}).to_string();
        let key = format!("key-{i}");
        let app = &app;
        async move { app.ingest("shop", &key, "order.paid", &body).await }
    });
    let answers = futures_util::future::join_all(sends).await;
    assert!(answers.iter().all(|(status, _)| *status == 200), "{answers:?}");
    let batched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT xmin FROM events GROUP BY xmin HAVING count(*) > 1) AS shared",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("transactions");
    for i in 0..N {
        assert_eq!(
            keys(&app, &format!("payload={}", q(&format!("/data/object/id=ord_{i}")))).await,
            [format!("key-{i}")]
        );
        assert_eq!(keys(&app, &format!("payload={}", q(&format!("data.object.n={i}")))).await, [format!("key-{i}")]);
    }
    eprintln!("transactions that stored more than one event: {batched}");
}

/// The batch statement directly, with batches far larger than a test's racing clients
/// make: neighbours with no terms of their own in common, a body that is not JSON
/// between them, and copies of one key (sent once).
#[tokio::test]
async fn each_event_of_a_large_batch_keeps_its_own_terms() {
    let db = TestDb::new().await;
    let source: webhook_gateway::ids::SourceId =
        sqlx::query_scalar("SELECT id FROM sources WHERE name = 'api'").fetch_one(&db.pool).await.expect("api");
    let event = |key: String, body: Vec<u8>| OwnedEvent {
        source_id: source,
        source_name: "api".into(),
        indexing: webhook_gateway::search::Indexing::Content,
        dedupe_key: key,
        event_type: "t".into(),
        content_type: None,
        headers: json!({"x-n": "h"}),
        payload: body.into(),
        ordering_key: None,
        trace: None,
        terms: None,
    };
    let mut batch = Vec::new();
    for i in 0..300 {
        let body = match i % 3 {
            0 => json!({"i": i, "deep": {"list": (0..i % 7).collect::<Vec<_>>()}}).to_string().into_bytes(),
            1 => format!("plain {i}").into_bytes(),
            _ => json!([i, {"i": i}]).to_string().into_bytes(),
        };
        // Every other event with its terms computed ahead, as ingest's requesters do
        // (`Batcher::store`): each keeps its own through the statement's reordering.
        let e = event(format!("b-{i}"), body);
        batch.push(if i % 2 == 0 { e.with_terms() } else { e });
    }
    batch.push(event("b-0".into(), b"{\"i\": -1}".to_vec()));
    insert_batch_with_fanout(&db.pool, &batch).await.expect("batch");
    let rows: Vec<(String, Vec<u8>, Vec<i64>)> =
        sqlx::query_as("SELECT dedupe_key, payload, search FROM events WHERE dedupe_key LIKE 'b-%'")
            .fetch_all(&db.pool)
            .await
            .expect("rows");
    assert_eq!(rows.len(), 300);
    for (key, payload, stored) in rows {
        let expected = webhook_gateway::search::terms(&key, &json!({"x-n": "h"}), &payload);
        assert_eq!(stored, expected, "{key}: {}", String::from_utf8_lossy(&payload));
    }
}

/// Terms computed ahead are the ones stored, by the batch statement and the lone one
/// alike: the writer does not compute them again (and so spends no time on them between
/// two commits).
#[tokio::test]
async fn terms_computed_ahead_are_the_ones_stored() {
    let db = TestDb::new().await;
    let source: webhook_gateway::ids::SourceId =
        sqlx::query_scalar("SELECT id FROM sources WHERE name = 'api'").fetch_one(&db.pool).await.expect("api");
    let event = |key: &str, terms: Option<Vec<i64>>| OwnedEvent {
        source_id: source,
        source_name: "api".into(),
        indexing: webhook_gateway::search::Indexing::Content,
        dedupe_key: key.into(),
        event_type: "t".into(),
        content_type: None,
        headers: json!({}),
        payload: json!({"a": 1}).to_string().into_bytes().into(),
        ordering_key: None,
        trace: None,
        terms,
    };
    // Marked terms, which no computation gives these events.
    let batch = vec![event("ahead-b1", Some(vec![-7, 7])), event("ahead-b2", None), event("ahead-b3", Some(vec![3]))];
    insert_batch_with_fanout(&db.pool, &batch).await.expect("batch");
    webhook_gateway::store::events::insert_with_fanout(&db.pool, &event("ahead-lone", Some(vec![11])).as_new())
        .await
        .expect("lone");
    let stored: Vec<(String, Vec<i64>)> =
        sqlx::query_as("SELECT dedupe_key, search FROM events WHERE dedupe_key LIKE 'ahead-%' ORDER BY dedupe_key")
            .fetch_all(&db.pool)
            .await
            .expect("rows");
    let computed = webhook_gateway::search::terms("ahead-b2", &json!({}), br#"{"a":1}"#);
    assert_eq!(
        stored,
        vec![
            ("ahead-b1".to_owned(), vec![-7, 7]),
            ("ahead-b2".to_owned(), computed),
            ("ahead-b3".to_owned(), vec![3]),
            ("ahead-lone".to_owned(), vec![11]),
        ]
    );
}

#[tokio::test]
async fn the_console_searches_by_content_and_keeps_a_mistyped_condition() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    app.ingest("shop", "k-1", "charge.succeeded", &json!({"data": {"object": {"id": "ch_123"}}}).to_string()).await;
    app.ingest("shop", "k-2", "charge.succeeded", &json!({"data": {"object": {"id": "ch_456"}}}).to_string()).await;
    let cookie = crate::console::sign_in(&app).await;
    let (status, html) =
        crate::console::page(&app, &cookie, &format!("/console/events?payload={}", q("/data/object/id = ch_123")))
            .await;
    assert_eq!(status, 200);
    assert!(html.contains("k-1") && !html.contains("k-2"), "{html}");
    let (status, html) =
        crate::console::page(&app, &cookie, &format!("/console/events?header={}", q("x-delivery-id: k-2"))).await;
    assert_eq!(status, 200);
    assert!(html.contains("k-2") && !html.contains(">k-1<"), "{html}");
    // Typed wrong: the page says why, with what was typed still in the field.
    let (status, html) = crate::console::page(&app, &cookie, "/console/events?payload=ch_123").await;
    assert_eq!(status, 200);
    assert!(html.contains("id=\"problem\"") && html.contains("PATH=VALUE"), "{html}");
    assert!(html.contains("value=\"ch_123\""), "{html}");
}

/// An `order.paid` event of `source` keyed `key`, with `payload` and no headers.
fn paid(source: webhook_gateway::ids::SourceId, key: String, payload: serde_json::Value) -> OwnedEvent {
    OwnedEvent {
        source_id: source,
        source_name: "api".into(),
        indexing: webhook_gateway::search::Indexing::Content,
        dedupe_key: key,
        event_type: "order.paid".into(),
        content_type: None,
        headers: json!({}),
        payload: payload.to_string().into_bytes().into(),
        ordering_key: None,
        terms: None,
        trace: None,
    }
}

/// The search reads the events that match, not the window: at 200 events and at 20,000
/// in the same window, finding one event touches about as many buffers (PostgreSQL's
/// own count, so no clock is involved). The bench's search row measures 1,000,000.
#[tokio::test]
async fn a_search_reads_the_matching_events_not_the_window() {
    let db = TestDb::new().await;
    let source: webhook_gateway::ids::SourceId =
        sqlx::query_scalar("SELECT id FROM sources WHERE name = 'api'").fetch_one(&db.pool).await.expect("api");
    let mut buffers = Vec::new();
    let mut stored = 0;
    for total in [200, 20_000] {
        while stored < total {
            let batch: Vec<OwnedEvent> = (stored..(stored + 1000).min(total))
                .map(|i| {
                    paid(
                        source,
                        format!("e-{i}"),
                        json!({"order": {"id": format!("ord_{i}"), "status": "paid", "n": i}}),
                    )
                })
                .collect();
            insert_batch_with_fanout(&db.pool, &batch).await.expect("batch");
            stored += batch.len();
        }
        sqlx::query("ANALYZE events").execute(&db.pool).await.expect("analyze");
        // New keys wait in the index's pending list (fastupdate) until autovacuum or the
        // list's size limit merges them; a search reads that list whole, a cost bounded
        // by the index's gin_pending_list_limit (16 MB), not by the window. Merged here, as autovacuum
        // would, to see the index itself.
        sqlx::query("SELECT gin_clean_pending_list('events_search')").execute(&db.pool).await.expect("merge");
        let wanted = webhook_gateway::search::Condition::payload(&format!("order.id=ord_{}", total / 2))
            .expect("condition")
            .alternatives();
        let mut tx = db.pool.begin().await.expect("begin");
        let (plan, touched) = crate::support::explain::explain_measured(
            &mut tx,
            sqlx::query_scalar(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
                 SELECT e.id FROM events e WHERE e.search && $1 AND e.received_at >= now() - interval '1 day'
                 ORDER BY e.id LIMIT 100",
            )
            .bind(&wanted),
        )
        .await;
        tx.rollback().await.expect("rollback");
        assert_eq!(plan[0]["Plan"]["Actual Rows"], 1, "{plan}");
        buffers.push(touched);
    }
    // A scan of the window would read ~100 times more pages at 20,000 than at 200.
    assert!(buffers[1] <= buffers[0] * 3 + 10, "buffers touched at 200 and at 20,000 events: {buffers:?}");
}

/// Forty webhooks from `from` on, at once: their answers' statuses.
async fn send(app: &TestApp, from: usize) -> Vec<u16> {
    let sends = (from..from + 40).map(|i| {
        let body = json!({"data": {"object": {"id": format!("ord_{i}")}}}).to_string();
        async move { app.ingest("shop", &format!("key-{i}"), "order.paid", &body).await.0 }
    });
    futures_util::future::join_all(sends).await
}

/// Tuples waiting in `events_search`'s pending list (its metapage, read with pageinspect).
async fn pending_tuples(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT n_pending_tuples FROM gin_metapage_info(get_raw_page('events_search', 0))")
        .fetch_one(&db.pool)
        .await
        .expect("metapage")
}

/// The search index's pending list is merged in the background by a replica whose role
/// owns the index, not by the insert that would fill it; a replica whose role may not
/// merge it keeps ingesting as before and leaves it to autovacuum. Autovacuum is off for
/// `events` here, so only a gateway can empty the list.
#[tokio::test]
async fn the_search_index_pending_list_is_merged_in_the_background_by_its_owner() {
    let db = TestDb::new().await;
    for sql in ["CREATE EXTENSION IF NOT EXISTS pageinspect", "ALTER TABLE events SET (autovacuum_enabled = false)"] {
        sqlx::query(sql).execute(&db.pool).await.expect(sql);
    }
    // A role that may read and write every table but owns none of them.
    let (role, not_owner_url) = crate::support::login_role(&db.pool, &db.url, "wg_not_owner").await;
    for sql in [
        format!("GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}"),
        format!("GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}"),
        format!("GRANT CREATE ON SCHEMA public TO {role}"),
    ] {
        sqlx::query(&sql).execute(&db.pool).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let not_owner = TestDb { url: not_owner_url, pool: db.pool.clone() };

    let mut app = TestApp::spawn_with(not_owner, crate::support::test_settings(), 8).await;
    app.source_none("shop").await;
    assert!(send(&app, 0).await.iter().all(|s| *s == 200));
    // Longer than the merge's idle tick: a replica that could merge would have.
    tokio::time::sleep(webhook_gateway::search::pending::IDLE_TICK * 2).await;
    let left = pending_tuples(&db).await;
    assert!(left > 0, "the list stays for autovacuum when the gateway's role does not own the index");
    app.shutdown().await;

    let app = TestApp::spawn_with(db, crate::support::test_settings(), 8).await;
    assert!(send(&app, 40).await.iter().all(|s| *s == 200));
    crate::support::eventually(Duration::from_secs(30), "the pending list merged", || async {
        (pending_tuples(&app.db).await == 0).then_some(())
    })
    .await;
    // Merged, every event is still found by its own values.
    for i in [0, 39, 40, 79] {
        let found = keys(&app, &format!("payload={}", q(&format!("/data/object/id=ord_{i}")))).await;
        assert_eq!(found, [format!("key-{i}")]);
    }
    sqlx::query(&format!("DROP OWNED BY {role}")).execute(&app.db.pool).await.expect("drop owned");
    let _ = sqlx::query(&format!("DROP ROLE {role}")).execute(&app.db.pool).await;
}

/// The search terms' `bigint[]`, written straight into the wire format
/// (`db::Int8Array`), reads back as what was bound, at the extremes and empty.
#[tokio::test]
async fn a_bigint_array_written_in_the_wire_format_reads_back_as_bound() {
    let db = TestDb::new().await;
    for values in
        [vec![], vec![0], vec![i64::MIN, -1, 0, 1, i64::MAX], (0..1000).map(|i| i * 7_919 - 3_000_000).collect()]
    {
        let (back, dims, n): (Vec<i64>, Option<String>, Option<i32>) =
            sqlx::query_as("SELECT $1::int8[], array_dims($1::int8[]), cardinality($1::int8[])")
                .bind(webhook_gateway::db::Int8Array(&values))
                .fetch_one(&db.pool)
                .await
                .expect("bind");
        assert_eq!(back, values);
        let expected_dims = (!values.is_empty()).then(|| format!("[1:{}]", values.len()));
        assert_eq!(dims, expected_dims, "one dimension from 1");
        assert_eq!(n, Some(values.len() as i32));
        let plain: Vec<i64> =
            sqlx::query_scalar("SELECT $1::int8[]").bind(&values).fetch_one(&db.pool).await.expect("bind plain");
        assert_eq!(plain, back, "as sqlx binds a slice");
    }
}

/// A content search plans its statements for the values it carries at every call, on a
/// connection that has run them many times: on a one-connection pool, ten searches for a
/// value every event holds and ten for a value one event holds, and every execution of
/// the count and of the page is custom-planned (`pg_prepared_statements`), none generic.
/// (In a test process that has opened a pool behind a transaction pooler, every statement
/// is a one-shot, planned for its values by PostgreSQL: there is nothing to count, and
/// the test says so.)
/// A generic plan assumes a hash is rare, so its count of a value every event holds
/// built a bitmap of every match before its `LIMIT` (71 ms at 1,000,000 events in bench
/// row 16). Control: in a transaction begun plainly, the connection's plan cache takes
/// the generic plan after its fifth execution, and the test fails.
#[tokio::test]
async fn a_search_is_planned_for_its_values_at_every_call() {
    use webhook_gateway::db::{DbConfig, Pooler};
    use webhook_gateway::search::Condition;
    use webhook_gateway::store::events::{Filter, list};
    let db = TestDb::new().await;
    let source: webhook_gateway::ids::SourceId =
        sqlx::query_scalar("SELECT id FROM sources WHERE name = 'api'").fetch_one(&db.pool).await.expect("api");
    let batch: Vec<OwnedEvent> = (0..3000)
        .map(|i| paid(source, format!("p-{i}"), json!({"order": {"id": format!("ord_{i}"), "livemode": false}})))
        .collect();
    for chunk in batch.chunks(1000) {
        insert_batch_with_fanout(&db.pool, chunk).await.expect("batch");
    }
    sqlx::query("ANALYZE events").execute(&db.pool).await.expect("analyze");
    let config = DbConfig {
        url: db.url.clone(),
        pool_size: 1,
        pooler: Pooler::None,
        session_url: None,
        start_wait: std::time::Duration::ZERO,
    };
    let one = webhook_gateway::db::open(&config).await.expect("one connection");
    for (condition, found) in [("order.livemode=false", 100), ("order.id=ord_1500", 1)] {
        let content = vec![Condition::payload(condition).expect("condition").alternatives()];
        let filter = Filter { content, ..Filter::default() };
        for _ in 0..10 {
            assert_eq!(list(&one, &filter, 100).await.expect("search").len(), found, "{condition}");
        }
    }
    if !webhook_gateway::db::named_statements() {
        // Another test of this process opened a pool behind a transaction pooler: every
        // statement here is then a one-shot, which PostgreSQL plans for its values at
        // each execution, and the session keeps none to count.
        eprintln!("this process prepares no named statements: the searches were one-shots, nothing to count");
        return;
    }
    let plans: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements
         WHERE statement LIKE '%e.search &&%' AND statement NOT LIKE '%pg_prepared_statements%'",
    )
    .fetch_all(&one)
    .await
    .expect("the connection's statements");
    assert_eq!(plans.len(), 2, "the count and the page: {plans:?}");
    for (statement, generic, custom) in &plans {
        assert_eq!((*generic, *custom), (0, 20), "planned for its values at each of 20 calls: {statement}");
    }
}

/// The terms each event of the sources `shop` and `api` holds, by dedupe key (not the
/// gateway's own events, which its endpoint's failures may publish meanwhile).
async fn term_counts(app: &TestApp) -> Vec<(String, i32)> {
    sqlx::query_as(
        "SELECT e.dedupe_key, cardinality(e.search) FROM events e JOIN sources s ON s.id = e.source_id
         WHERE s.name IN ('shop', 'api') ORDER BY e.dedupe_key",
    )
    .fetch_all(&app.db.pool)
    .await
    .expect("terms")
}

/// With content search off (`--content-search=false`) every event is indexed by its
/// dedupe key alone, whichever way it was stored: a webhook written alone (its delivery
/// leased by its statement), webhooks racing into group commit's batches, an event
/// published through the API. A search by key finds each; a search by payload or header
/// is a 422 that names the field and says content search is off, not an empty page.
/// Control: the same webhooks on a gateway with the default store their content's terms
/// and are found by payload and header.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_content_search_off_events_are_found_by_key_and_content_searches_are_refused() {
    use webhook_gateway::search::Indexing;
    for indexing in [Indexing::KeyOnly, Indexing::Content] {
        let settings = webhook_gateway::app::Settings { indexing, ..crate::support::test_settings() };
        let app = TestApp::spawn_with(TestDb::new().await, settings, 16).await;
        app.source_none("shop").await;
        app.endpoint_for("http://127.0.0.1:9/shop", Some("shop")).await;
        let body = |i: usize| json!({"order": {"id": format!("ord_{i}")}, "status": "paid"}).to_string();
        assert_eq!(app.ingest("shop", "alone", "order.paid", &body(0)).await.0, 200);
        let racing = (1..=16).map(|i| {
            let (app, body) = (&app, body(i));
            async move { app.ingest("shop", &format!("race-{i:02}"), "order.paid", &body).await.0 }
        });
        assert!(futures_util::future::join_all(racing).await.iter().all(|status| *status == 200));
        let published = json!({"event_type": "user.created", "event_id": "published", "payload": {"id": "u_1"}});
        app.admin_post("/v1/events", published, 200).await;

        let counts = term_counts(&app).await;
        assert_eq!(counts.len(), 18, "{counts:?}");
        for (key, terms) in &counts {
            assert_eq!(*terms == 1, indexing == Indexing::KeyOnly, "{indexing:?}: {key} holds {terms} terms");
        }
        for key in ["alone", "race-07", "published"] {
            assert_eq!(keys(&app, &format!("dedupe_key={key}")).await, [key], "{indexing:?}");
        }
        let searches = [
            ("payload", format!("payload={}", q("order.id=ord_7"))),
            ("header", format!("header={}", q("x-delivery-id:race-07"))),
            ("payload", format!("payload={}&header={}", q("id=u_1"), q("x-event-type:order.paid"))),
        ];
        for (field, query) in &searches {
            let (status, answer) = app.admin(reqwest::Method::GET, &format!("/v1/events?{query}"), None).await;
            match indexing {
                Indexing::KeyOnly => {
                    assert_eq!(status, 422, "{query}: {answer}");
                    assert_eq!(answer["error"]["code"], "validation_failed", "{answer}");
                    let message = answer["error"]["message"].as_str().unwrap_or_default();
                    assert!(message.starts_with(field) && message.contains("content search is off"), "{message}");
                }
                Indexing::Content => assert_eq!(status, 200, "control, {query}: {answer}"),
            }
        }
        if indexing == Indexing::Content {
            assert_eq!(keys(&app, &searches[0].1).await, ["race-07"], "control: found by payload");
            assert_eq!(keys(&app, &searches[1].1).await, ["race-07"], "control: found by header");
        }
    }
}
