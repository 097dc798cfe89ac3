//! Exactly once at the persistence boundary.

use std::sync::Arc;

use serde_json::json;
use tokio::sync::Barrier;

use webhook_gateway::store;

use crate::support::{TestApp, owned_event, source_id};

/// The centrepiece: 24 identical webhooks, each on its own HTTP connection (so its own
/// request task and its own database connection), released together by a barrier,
/// racing on one constraint. Ten rounds, so a lucky schedule can't pass it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_identical_webhooks_store_one_event_and_one_delivery() {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    let endpoint_a = app.endpoint_for("http://127.0.0.1:9/a", Some("shop")).await;
    let endpoint_b = app.endpoint_for("http://127.0.0.1:9/b", None).await;
    const RACERS: usize = 24;
    const ROUNDS: usize = 10;

    for round in 0..ROUNDS {
        let delivery_id = format!("dlv-{round}");
        let barrier = Arc::new(Barrier::new(RACERS));
        let mut tasks = Vec::new();
        for _ in 0..RACERS {
            let barrier = barrier.clone();
            // A client per racer: its own connection pool, so its own TCP connection.
            let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
            let url = app.url("/ingest/shop");
            let delivery_id = delivery_id.clone();
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let resp = client
                    .post(url)
                    .header("x-delivery-id", delivery_id)
                    .header("x-event-type", "order.created")
                    .header("content-type", "application/json")
                    .body(r#"{"order": 1}"#)
                    .send()
                    .await
                    .unwrap();
                (resp.status().as_u16(), resp.json::<serde_json::Value>().await.unwrap())
            }));
        }
        let mut winners = 0;
        let mut ids = std::collections::HashSet::new();
        for task in tasks {
            let (status, body) = task.await.unwrap();
            assert_eq!(status, 200, "round {round}: {body}");
            if body["duplicate"] == json!(false) {
                winners += 1;
            } else {
                assert_eq!(body["duplicate"], json!(true), "{body}");
            }
            ids.insert(body["event_id"].as_str().unwrap().to_owned());
        }
        assert_eq!(winners, 1, "round {round}: exactly one racer stores the event");
        assert_eq!(ids.len(), 1, "round {round}: every answer names the same event");
        let event_id = ids.into_iter().next().unwrap();

        let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE dedupe_key = $1")
            .bind(&delivery_id)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
        assert_eq!(events, 1, "round {round}: one event row");
        let per_endpoint: Vec<(String, i64)> = sqlx::query_as(
            "SELECT endpoint_id::text, count(*) FROM deliveries WHERE event_id = $1::uuid GROUP BY 1 ORDER BY 1",
        )
        .bind(&event_id)
        .fetch_all(&app.db.pool)
        .await
        .unwrap();
        let mut expected = vec![(endpoint_a.clone(), 1), (endpoint_b.clone(), 1)];
        expected.sort();
        assert_eq!(per_endpoint, expected, "round {round}: one delivery per subscribed endpoint");
    }
    assert_eq!(app.db.count("events").await, ROUNDS as i64);
    assert_eq!(app.db.count("deliveries").await, 2 * ROUNDS as i64);
}

#[tokio::test]
async fn duplicate_is_200_with_the_original_event_id() {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    let (s1, first) = app.ingest("shop", "d-1", "order.created", r#"{"a":1}"#).await;
    let (s2, second) = app.ingest("shop", "d-1", "order.created", r#"{"a":1}"#).await;
    assert_eq!((s1, s2), (200, 200));
    assert_eq!(first["duplicate"], json!(false));
    assert_eq!(second["duplicate"], json!(true));
    assert_eq!(first["event_id"], second["event_id"]);

    let event = app.admin_get(&format!("/v1/events/{}", first["event_id"].as_str().unwrap())).await;
    assert_eq!(event["event_type"], "order.created");
    assert_eq!(event["source"], "shop");
    assert_eq!(event["payload"], json!({"a": 1}));
    assert_eq!(event["headers"]["x-delivery-id"], "d-1");
}

#[tokio::test]
async fn without_a_dedupe_header_the_body_hash_deduplicates() {
    let app = TestApp::ingest_only().await;
    app.admin_post("/v1/sources", json!({"name": "raw", "kind": "none"}), 201).await;
    let post = |body: &'static str| {
        let client = app.http.clone();
        let url = app.url("/ingest/raw");
        async move { client.post(url).body(body).send().await.unwrap().json::<serde_json::Value>().await.unwrap() }
    };
    let a = post("same body").await;
    let b = post("same body").await;
    let c = post("other body").await;
    assert_eq!(a["duplicate"], json!(false));
    assert_eq!(b["duplicate"], json!(true));
    assert_eq!(a["event_id"], b["event_id"]);
    assert_eq!(c["duplicate"], json!(false));
    let event = app.admin_get(&format!("/v1/events/{}", a["event_id"].as_str().unwrap())).await;
    assert_eq!(event["event_type"], "unknown");
    assert!(event["dedupe_key"].as_str().unwrap().starts_with("sha256:"));
}

/// Fan-out matches source and event-type patterns, in the ingest statement itself.
#[tokio::test]
async fn fanout_follows_subscriptions() {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    app.source_none("crm").await;
    let orders = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/orders"}), 201).await;
    let all = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/all"}), 201).await;
    app.admin_post(
        "/v1/subscriptions",
        json!({"endpoint_id": orders["id"], "source": "shop", "event_types": ["order.*", "refund.created"]}),
        201,
    )
    .await;
    app.admin_post("/v1/subscriptions", json!({"endpoint_id": all["id"]}), 201).await;
    // A second, overlapping subscription must not create a second delivery.
    app.admin_post("/v1/subscriptions", json!({"endpoint_id": all["id"], "source": "shop"}), 201).await;

    let cases = [
        ("shop", "order.created", 2),
        ("shop", "order.", 2),
        ("shop", "orders.created", 1),
        ("shop", "refund.created", 2),
        ("shop", "refund.updated", 1),
        ("crm", "order.created", 1),
    ];
    for (i, (source, event_type, expected)) in cases.into_iter().enumerate() {
        let (status, body) = app.ingest(source, &format!("f-{i}"), event_type, "{}").await;
        assert_eq!(status, 200);
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE event_id = $1::uuid")
            .bind(body["event_id"].as_str().unwrap())
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
        assert_eq!(n, expected, "{source} {event_type}");
    }
}

/// If the delivery insert fails, the event is not stored either, and the sender gets a
/// 5xx (so it retries): there is no event without its fan-out.
#[tokio::test]
async fn a_failing_fanout_stores_nothing_and_answers_5xx() {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    app.endpoint_for("http://127.0.0.1:9/x", None).await;
    sqlx::raw_sql(
        "CREATE FUNCTION refuse() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'fan-out refused by test'; END $$ LANGUAGE plpgsql;
         CREATE TRIGGER refuse BEFORE INSERT ON deliveries FOR EACH ROW EXECUTE FUNCTION refuse();",
    )
    .execute(&app.db.pool)
    .await
    .unwrap();
    let (status, body) = app.ingest("shop", "boom", "order.created", "{}").await;
    assert!((500..600).contains(&status), "{status} {body}");
    assert_eq!(body["error"]["code"], "internal");
    assert_eq!(app.db.count("events").await, 0, "the event rolled back with its fan-out");
    assert_eq!(app.db.count("deliveries").await, 0);

    sqlx::query("DROP TRIGGER refuse ON deliveries").execute(&app.db.pool).await.unwrap();
    let (status, body) = app.ingest("shop", "boom", "order.created", "{}").await;
    assert_eq!(status, 200);
    assert_eq!(body["duplicate"], json!(false), "the retry is the first stored copy");
    assert_eq!(app.db.count("deliveries").await, 1);
}

#[tokio::test]
async fn events_published_through_the_api_are_idempotent() {
    let app = TestApp::ingest_only().await;
    app.endpoint_for("http://127.0.0.1:9/x", Some("api")).await;
    let body = json!({"event_type": "user.created", "event_id": "u-1", "payload": {"id": 1}});
    let first = app.admin_post("/v1/events", body.clone(), 200).await;
    let second = app.admin_post("/v1/events", body, 200).await;
    assert_eq!(first["duplicate"], json!(false));
    assert_eq!(second["duplicate"], json!(true));
    assert_eq!(first["event_id"], second["event_id"]);
    let deliveries = app.admin_get(&format!("/v1/deliveries?event_id={}", first["event_id"].as_str().unwrap())).await;
    assert_eq!(deliveries["data"].as_array().unwrap().len(), 1);
    assert_eq!(deliveries["data"][0]["status"], "pending");
    assert_eq!(deliveries["data"][0]["attempts"], 0);

    // The built-in `api` source is not a webhook inbox.
    let resp = app.http.post(app.url("/ingest/api")).body("{}").send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 403);
}

/// Adaptive group commit over real connections: 16 producers, each sending its next
/// webhook as soon as the last is answered, share commits (events per inserting
/// transaction, read from `xmin`), and every webhook is stored exactly once and
/// answered with its own event id. One producer alone gets a commit per webhook.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_producers_share_commits_and_one_producer_does_not_wait_for_company() {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    const PRODUCERS: usize = 16;
    const EACH: usize = 30;
    let mut tasks = Vec::new();
    for p in 0..PRODUCERS {
        let client = reqwest::Client::new();
        let url = app.url("/ingest/shop");
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for i in 0..EACH {
                let resp = client
                    .post(url.clone())
                    .header("x-delivery-id", format!("p{p}-{i}"))
                    .header("x-event-type", "t")
                    .body("{}")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                let body: serde_json::Value = resp.json().await.unwrap();
                assert_eq!(body["duplicate"], json!(false), "{body}");
                ids.push(body["event_id"].as_str().unwrap().to_owned());
            }
            ids
        }));
    }
    let mut ids = std::collections::HashSet::new();
    for task in tasks {
        ids.extend(task.await.unwrap());
    }
    assert_eq!(ids.len(), PRODUCERS * EACH, "each webhook its own event id");
    assert_eq!(app.db.count("events").await, (PRODUCERS * EACH) as i64);
    let commits: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM events").fetch_one(&app.db.pool).await.unwrap();
    let per_commit = (PRODUCERS * EACH) as f64 / commits as f64;
    println!("{} events in {commits} commits ({per_commit:.1} per commit)", PRODUCERS * EACH);
    // Measured: 5.2 with the linger, 2.1 without it (a free writer takes each arrival alone).
    assert!(per_commit >= 3.0, "16 producers should share commits: {per_commit:.1} events per commit");

    sqlx::query("TRUNCATE events CASCADE").execute(&app.db.pool).await.unwrap();
    for i in 0..10 {
        let (status, body) = app.ingest("shop", &format!("alone-{i}"), "t", "{}").await;
        assert_eq!(status, 200, "{body}");
    }
    let commits: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM events").fetch_one(&app.db.pool).await.unwrap();
    assert_eq!(commits, 10, "one producer: each webhook is committed on its own");
}

/// The group-commit statement: new keys, keys already stored, and copies of one key in
/// the same batch each get the right answer, in input order, with one event per key and
/// the fan-out of each new one.
#[tokio::test]
async fn a_batch_stores_each_key_once_and_answers_each_event() {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    app.source_none("crm").await;
    app.endpoint_for("http://127.0.0.1:9/all", None).await;
    let (shop, crm) = (source_id(&app.db.pool, "shop").await, source_id(&app.db.pool, "crm").await);
    let (_, existing) = app.ingest("shop", "old", "t", "{}").await;

    let batch = vec![
        owned_event(shop, "shop", "b", "t"),
        owned_event(shop, "shop", "old", "t"),
        owned_event(crm, "crm", "b", "t"),
        owned_event(shop, "shop", "a", "t"),
        owned_event(shop, "shop", "b", "t"),
    ];
    let stored = store::events::insert_batch_with_fanout(&app.db.pool, &batch).await.unwrap();
    let flags: Vec<bool> = stored.iter().map(|s| s.duplicate).collect();
    assert_eq!(flags, [false, true, false, false, true]);
    assert_eq!(stored[1].event_id.to_string(), existing["event_id"].as_str().unwrap());
    assert_eq!(stored[4].event_id, stored[0].event_id, "the in-batch copy names the stored event");
    assert_ne!(stored[2].event_id, stored[0].event_id, "same key, other source: another event");
    let deliveries: Vec<usize> = stored.iter().map(|s| s.deliveries.len()).collect();
    assert_eq!(deliveries, [1, 0, 1, 1, 0]);
    // Each answer names the deliveries its event made (ingest hands them to its workers).
    for s in stored.iter().filter(|s| !s.duplicate) {
        let made: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM deliveries WHERE event_id = $1")
            .bind(s.event_id)
            .fetch_all(&app.db.pool)
            .await
            .unwrap();
        assert_eq!(made, s.deliveries.iter().map(|d| d.0).collect::<Vec<_>>());
    }
    assert_eq!(app.db.count("events").await, 4);
    assert_eq!(app.db.count("deliveries").await, 4);
    let payload: Vec<u8> = sqlx::query_scalar("SELECT payload FROM events WHERE id = $1")
        .bind(stored[3].event_id)
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(payload, br#"{"k":"a"}"#);
}

/// A body large enough to be compressed in its row is compressed with lz4 (migration
/// 0023: several times cheaper than PostgreSQL's default pglz, which was 6 % of its CPU
/// in the bench's ingest) and reads back byte for byte, as do its headers.
#[tokio::test]
async fn a_large_body_is_stored_compressed_with_lz4_and_read_back_exactly() {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    let items: Vec<String> =
        (0..200).map(|i| format!(r#"{{"sku":"item-{i}","qty":{i},"note":"same words again"}}"#)).collect();
    let body = format!(r#"{{"type":"order.created","items":[{}]}}"#, items.join(","));
    assert!(body.len() > 8_000, "the body passes the TOAST threshold");
    let (status, answer) = app.ingest("shop", "big", "order.created", &body).await;
    assert_eq!(status, 200, "{answer}");
    let event_id: uuid::Uuid = answer["event_id"].as_str().unwrap().parse().unwrap();
    let (method, stored, stored_len): (Option<String>, Vec<u8>, i32) = sqlx::query_as(
        "SELECT pg_column_compression(payload), payload, pg_column_size(payload) FROM events WHERE id = $1",
    )
    .bind(event_id)
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(method.as_deref(), Some("lz4"), "the body is compressed with lz4");
    assert!((stored_len as usize) < body.len() / 2, "compressed to {stored_len} bytes of {}", body.len());
    assert_eq!(stored, body.as_bytes(), "the body reads back byte for byte");
    let payload = webhook_gateway::store::events::payload(&app.db.pool, webhook_gateway::ids::EventId(event_id))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(payload, body.as_bytes(), "and through the store");
    assert_eq!(
        crate::support::events_compression(&app.db.pool).await,
        "headers=l,payload=l",
        "both columns are set to lz4"
    );
}

/// Many webhooks at once are batched by the writers; one that the database refuses
/// does not take the others down: each is answered on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_event_in_a_batch_fails_alone() {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    app.endpoint_for("http://127.0.0.1:9/x", None).await;
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_poison() RETURNS trigger AS $$
         BEGIN IF (SELECT event_type FROM events WHERE id = NEW.event_id) = 'poison' THEN
             RAISE EXCEPTION 'refused by test'; END IF; RETURN NEW; END $$ LANGUAGE plpgsql;
         CREATE TRIGGER refuse_poison BEFORE INSERT ON deliveries FOR EACH ROW EXECUTE FUNCTION refuse_poison();",
    )
    .execute(&app.db.pool)
    .await
    .unwrap();
    let mut tasks = Vec::new();
    for i in 0..64 {
        let client = app.http.clone();
        let url = app.url("/ingest/shop");
        let event_type = if i == 17 { "poison" } else { "fine" };
        tasks.push(tokio::spawn(async move {
            let resp = client
                .post(url)
                .header("x-delivery-id", format!("k-{i}"))
                .header("x-event-type", event_type)
                .body("{}")
                .send()
                .await
                .unwrap();
            (i, resp.status().as_u16())
        }));
    }
    for task in tasks {
        let (i, status) = task.await.unwrap();
        assert_eq!(status, if i == 17 { 500 } else { 200 }, "webhook {i}");
    }
    assert_eq!(app.db.count("events").await, 63);
    assert_eq!(app.db.count("deliveries").await, 63);
}

/// A burst of webhooks to a source the cache does not hold (a cold start, or every `TTL`
/// under load) shares one lookup of the source: each miss that sent its own read took
/// its own connection, and a burst larger than the pool waited on the connections the
/// others were opening, up to the acquire timeout (503). The pool here has room for every
/// request; it opens no more connections than there are names, because one read of each
/// name is made at a time, of a source and of a name no source has alike.
#[tokio::test]
async fn a_burst_of_misses_shares_one_source_lookup() {
    use webhook_gateway::ingest::{SourceCache, cache};
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let pool = webhook_gateway::db::connect(&app.db.url, 64).await.expect("pool");
    let sources = SourceCache::new(webhook_gateway::secrets::Keyring::default());
    for round in 0..2 {
        if round == 1 {
            // Past the entry's life: the next burst refreshes it, again with one read.
            tokio::time::sleep(cache::TTL + std::time::Duration::from_millis(100)).await;
        }
        let burst = (0..100).map(|n| {
            let (name, exists) = if n % 2 == 0 { ("shop", true) } else { ("no-such-source", false) };
            let sources = &sources;
            let pool = &pool;
            async move { (name, exists, sources.get(pool, name).await) }
        });
        for (name, exists, found) in futures_util::future::join_all(burst).await {
            let found = found.expect("lookup");
            assert_eq!(found.is_some(), exists, "{name}");
            if let Some(source) = found {
                assert_eq!(source.name, "shop");
            }
        }
        // One read of each name at a time: two connections at most, however many ask.
        assert!(pool.size() <= 2, "round {round}: {} connections opened for 100 lookups of two names", pool.size());
    }
}

/// A lookup the database failed is not remembered: the next request for the name reads
/// again, though the failed entry is younger than an entry's life (here the first read is
/// refused at once: its role may not read `sources`).
#[tokio::test]
async fn a_failed_source_lookup_is_read_again_by_the_next_request() {
    use webhook_gateway::ingest::{LookupError, SourceCache};
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let (role, refused_url) = crate::support::login_role(&app.db.pool, &app.db.url, "wg_no_sources").await;
    let refused = webhook_gateway::db::connect(&refused_url, 1).await.expect("pool of the role");
    let allowed = webhook_gateway::db::connect(&app.db.url, 1).await.expect("pool");
    let sources = SourceCache::new(webhook_gateway::secrets::Keyring::default());

    let failed = sources.get(&refused, "shop").await;
    assert!(matches!(failed, Err(LookupError::Database(_))), "{failed:?}");
    let found = sources.get(&allowed, "shop").await.expect("read again").expect("the source");
    assert_eq!(found.name, "shop");
    // And what was found is what the next request shares, whatever its pool can read.
    let shared = sources.get(&refused, "shop").await.expect("shared").expect("the source");
    assert!(Arc::ptr_eq(&found, &shared));

    refused.close().await;
    let _ = sqlx::query(&format!("DROP ROLE {role}")).execute(&app.db.pool).await;
}

/// A read sent into a partition does not hold its name: the request that made it gives up
/// at its deadline, and the next request for the name reads again instead of waiting for
/// an answer that will not come.
#[tokio::test]
async fn a_source_lookup_abandoned_in_a_partition_does_not_hold_its_name() {
    use crate::support::proxy::{Proxy, server_addr};
    use webhook_gateway::ingest::SourceCache;
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let proxy = Proxy::start(server_addr(&app.db.url)).await;
    let behind = webhook_gateway::db::connect(&proxy.url_for(&app.db.url), 1).await.expect("pool behind the proxy");
    let direct = webhook_gateway::db::connect(&app.db.url, 1).await.expect("pool");
    let sources = SourceCache::new(webhook_gateway::secrets::Keyring::default());

    proxy.blackhole();
    let stuck = tokio::time::timeout(std::time::Duration::from_millis(300), sources.get(&behind, "shop")).await;
    assert!(stuck.is_err(), "a read into a partition has no answer: {stuck:?}");
    // Bounded so that a wait for the abandoned read fails here instead of hanging.
    let found = tokio::time::timeout(std::time::Duration::from_secs(10), sources.get(&direct, "shop"))
        .await
        .expect("the next request reads again")
        .expect("read")
        .expect("the source");
    assert_eq!(found.name, "shop");
    proxy.heal();
}
