//! The operator surface: CRUD, pagination, redelivery, recovery, test sends, rotation.

use std::collections::HashSet;
use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};

use crate::support::sink::{Reply, Sink};
use crate::support::{TestApp, count_status, eventually, seed_deliveries, standard_webhooks};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn sources_crud() {
    let app = TestApp::ingest_only().await;
    let created = app
        .admin_post("/v1/sources", json!({"name": "gh", "kind": "github", "secrets": ["old-secret-value"]}), 201)
        .await;
    let id = created["id"].as_str().unwrap();
    let listed = app.admin_get("/v1/sources").await;
    let names: Vec<&str> = listed["data"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"gh") && names.contains(&"api"), "{names:?}");

    // Rotation by PATCH: both secrets listed (as fingerprints only).
    let (status, patched) = app
        .admin(
            Method::PATCH,
            &format!("/v1/sources/{id}"),
            Some(json!({"secrets": ["old-secret-value", "new-secret-value"]})),
        )
        .await;
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["secret_fingerprints"].as_array().unwrap().len(), 2);
    assert!(!patched.to_string().contains("secret-value"));
    let (status, body) = app.admin(Method::PATCH, &format!("/v1/sources/{id}"), Some(json!({"secrets": []}))).await;
    assert_eq!(status, 422, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().starts_with("secrets"), "{body}");
    let (status, _) = app.admin(Method::PATCH, &format!("/v1/sources/{id}"), Some(json!({"kind": "none"}))).await;
    assert_eq!(status, 422, "the kind is fixed");

    // Delete: refused while it holds events, unless forced.
    let api = listed["data"].as_array().unwrap().iter().find(|s| s["name"] == "api").unwrap()["id"].clone();
    let (status, _) = app.admin(Method::DELETE, &format!("/v1/sources/{}", api.as_str().unwrap()), None).await;
    assert_eq!(status, 409, "built-in sources stay");
    app.admin_post("/v1/sources", json!({"name": "shop", "kind": "none"}), 201).await;
    let shop = app.admin_get("/v1/sources").await["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "shop")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    app.http.post(app.url("/ingest/shop")).body("x").send().await.unwrap();
    let (status, body) = app.admin(Method::DELETE, &format!("/v1/sources/{shop}"), None).await;
    assert_eq!(status, 409, "{body}");
    let (status, _) = app.admin(Method::DELETE, &format!("/v1/sources/{shop}?force=true"), None).await;
    assert_eq!(status, 204);
    let (events, own) = app.db.count_events_but_operational().await;
    assert_eq!(events, 0, "the gateway's own events besides: {own:?}");
    let (status, _) = app.admin(Method::GET, &format!("/v1/sources/{shop}"), None).await;
    assert_eq!(status, 404);
    let (status, _) = app.admin(Method::DELETE, &format!("/v1/sources/{id}"), None).await;
    assert_eq!(status, 204);
}

#[tokio::test]
async fn endpoints_and_subscriptions_crud() {
    let app = TestApp::ingest_only().await;
    let ep =
        app.admin_post("/v1/endpoints", json!({"url": "https://a.example.com/h", "description": "first"}), 201).await;
    let id = ep["id"].as_str().unwrap();
    let (status, patched) = app
        .admin(
            Method::PATCH,
            &format!("/v1/endpoints/{id}"),
            Some(json!({"url": "https://b.example.com/h", "description": null})),
        )
        .await;
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["url"], "https://b.example.com/h");
    assert!(patched["description"].is_null());
    assert_eq!(patched["circuit"]["state"], "closed");
    let (status, body) =
        app.admin(Method::PATCH, &format!("/v1/endpoints/{id}"), Some(json!({"url": "gopher://x"}))).await;
    assert_eq!(status, 422, "{body}");

    let sub = app.admin_post("/v1/subscriptions", json!({"endpoint_id": id, "event_types": ["a.*"]}), 201).await;
    let sub_id = sub["id"].as_str().unwrap();
    let (status, patched) = app
        .admin(
            Method::PATCH,
            &format!("/v1/subscriptions/{sub_id}"),
            Some(json!({"source": "api", "event_types": null})),
        )
        .await;
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["source"], "api");
    assert!(patched["event_types"].is_null());
    let (status, body) = app
        .admin(Method::PATCH, &format!("/v1/subscriptions/{sub_id}"), Some(json!({"event_types": ["has space"]})))
        .await;
    assert_eq!(status, 422, "{body}");
    let listed = app.admin_get(&format!("/v1/subscriptions?endpoint_id={id}")).await;
    assert_eq!(listed["data"].as_array().unwrap().len(), 1);
    assert_eq!(app.admin_get(&format!("/v1/subscriptions/{sub_id}")).await["id"], sub["id"]);

    // Deleting an endpoint with pending deliveries needs ?force=true, which dead-letters them.
    app.admin_post("/v1/events", json!({"event_type": "a.b", "event_id": "e1", "payload": {}}), 200).await;
    let (status, body) = app.admin(Method::DELETE, &format!("/v1/endpoints/{id}"), None).await;
    assert_eq!(status, 409, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("1 pending"));
    let (status, body) = app.admin(Method::DELETE, &format!("/v1/endpoints/{id}?force=true"), None).await;
    assert_eq!((status, body["dead_lettered"].as_i64()), (200, Some(1)), "{body}");
    let dead = app.admin_get("/v1/deliveries?status=dead").await;
    assert_eq!(dead["data"][0]["dead_reason"], "endpoint deleted");
    let (status, _) = app.admin(Method::GET, &format!("/v1/endpoints/{id}"), None).await;
    assert_eq!(status, 404);
    // A deleted endpoint's dead letters can't be redelivered: there is nowhere to send them.
    let (status, body) = app
        .admin(Method::POST, &format!("/v1/deliveries/{}/redeliver", dead["data"][0]["id"].as_str().unwrap()), None)
        .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(count_status(&app.db.pool, "dead").await, 1);
    let (status, body) = app.admin(Method::PUT, "/v1/endpoints", None).await;
    assert_eq!((status, body["error"]["code"].as_str()), (405, Some("method_not_allowed")));
    let (status, _) = app.admin(Method::GET, &format!("/v1/subscriptions/{sub_id}"), None).await;
    assert_eq!(status, 404, "subscriptions go with their endpoint");
    let (status, _) = app.admin(Method::DELETE, &format!("/v1/subscriptions/{sub_id}"), None).await;
    assert_eq!(status, 404);
    let (status, _) = app.admin(Method::GET, "/v1/endpoints/not-an-id", None).await;
    assert_eq!(status, 404);
}

async fn delivery_of(app: &TestApp, filter: &str) -> Value {
    app.admin_get(&format!("/v1/deliveries?{filter}")).await["data"][0].clone()
}

/// Dead -> redeliver -> pending -> delivered, same webhook-id; redelivering a pending
/// delivery changes nothing; re-ingesting the duplicate event revives nothing.
#[tokio::test]
async fn redeliver_revives_a_dead_delivery_with_its_webhook_id() {
    let app = TestApp::spawn().await;
    let fixed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = fixed.clone();
    let sink = Sink::start(move |_, _| {
        if flag.load(std::sync::atomic::Ordering::SeqCst) { Reply::status(200) } else { Reply::status(410) }
    })
    .await;
    app.source_none("shop").await;
    app.endpoint_for(&sink.url("/"), Some("shop")).await;
    let (_, ev) = app.ingest("shop", "d1", "order.created", "{}").await;
    let filter = format!("event_id={}", ev["event_id"].as_str().unwrap());
    let dead = eventually(WAIT, "dead", || async {
        let d = delivery_of(&app, &filter).await;
        (d["status"] == "dead").then_some(d)
    })
    .await;
    // A duplicate webhook does not revive it: the ingest statement (the only writer it
    // runs) has committed when it answers, and the delivery row was not written at all.
    let written = |app: &TestApp| {
        let pool = app.db.pool.clone();
        async move {
            let (updated, attempts): (chrono::DateTime<chrono::Utc>, i32) =
                sqlx::query_as("SELECT updated_at, attempt_count FROM deliveries").fetch_one(&pool).await.unwrap();
            (updated, attempts)
        }
    };
    let before = written(&app).await;
    let (_, dup) = app.ingest("shop", "d1", "order.created", "{}").await;
    assert_eq!(dup["duplicate"], true);
    assert_eq!(written(&app).await, before, "the duplicate wrote nothing to the delivery");
    assert_eq!(delivery_of(&app, &filter).await["status"], "dead");
    assert_eq!(sink.count(), 1);

    fixed.store(true, std::sync::atomic::Ordering::SeqCst);
    // Stop the workers from racing the second call: pause, redeliver twice, resume.
    let ep = dead["endpoint_id"].as_str().unwrap();
    app.admin_post(&format!("/v1/endpoints/{ep}/pause"), json!({}), 200).await;
    let path = format!("/v1/deliveries/{}/redeliver", dead["id"].as_str().unwrap());
    let first = app.admin_post(&path, json!({}), 200).await;
    assert_eq!(first["status"], "pending");
    let second = app.admin_post(&path, json!({}), 200).await;
    assert_eq!(second["status"], "pending");
    assert_eq!(second["attempts"], first["attempts"], "idempotent");
    app.admin_post(&format!("/v1/endpoints/{ep}/resume"), json!({}), 200).await;
    let delivered = eventually(WAIT, "delivered", || async {
        let d = delivery_of(&app, &filter).await;
        (d["status"] == "delivered").then_some(d)
    })
    .await;
    let got = sink.received();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].header("webhook-id"), got[1].header("webhook-id"));
    assert_eq!(got[1].header("webhook-id"), delivered["webhook_id"].as_str().unwrap());
    assert_eq!(got[1].header("webhook-attempt"), "2", "attempt numbers keep counting");
    let (status, _) =
        app.admin(Method::POST, &format!("/v1/deliveries/{}/redeliver", uuid::Uuid::new_v4()), None).await;
    assert_eq!(status, 404);
}

/// 50 dead deliveries over a window; recovering a sub-window re-queues exactly those,
/// and calling again re-queues nothing new.
#[tokio::test]
async fn recover_requeues_exactly_the_window() {
    let app = TestApp::ingest_only().await;
    let ep = app.endpoint_for("https://subscriber.example.com/", Some("api")).await;
    seed_deliveries(&app.db.pool, &ep, 50).await;
    // Delivery i died i minutes ago.
    sqlx::query(
        "UPDATE deliveries d SET status = 'dead', dead_reason = 'HTTP 503', attempt_count = 8,
                finished_at = now() - (n.i * interval '1 minute')
         FROM (SELECT id, row_number() OVER (ORDER BY id) - 1 AS i FROM deliveries) n WHERE n.id = d.id",
    )
    .execute(&app.db.pool)
    .await
    .unwrap();
    let since = chrono::Utc::now() - chrono::Duration::seconds(20 * 60 + 30);
    let until = chrono::Utc::now() - chrono::Duration::seconds(9 * 60 + 30);
    let body = json!({"since": since, "until": until});
    let first = app.admin_post(&format!("/v1/endpoints/{ep}/recover"), body.clone(), 200).await;
    assert_eq!(first["requeued"], 11, "minutes 10..=20");
    assert_eq!(count_status(&app.db.pool, "pending").await, 11);
    let budgets: Vec<(i32, i32)> =
        sqlx::query_as("SELECT attempt_count, attempts_base FROM deliveries WHERE status = 'pending'")
            .fetch_all(&app.db.pool)
            .await
            .unwrap();
    assert!(budgets.iter().all(|&(count, base)| count == 8 && base == 8), "fresh budget: {budgets:?}");
    let again = app.admin_post(&format!("/v1/endpoints/{ep}/recover"), body, 200).await;
    assert_eq!(again["requeued"], 0);
    assert_eq!(count_status(&app.db.pool, "dead").await, 39);
    let (status, b) = app
        .admin(Method::POST, &format!("/v1/endpoints/{ep}/recover"), Some(json!({"since": until, "until": since})))
        .await;
    assert_eq!(status, 422, "{b}");
}

#[tokio::test]
async fn test_sends_are_never_deduplicated() {
    let app = TestApp::spawn().await;
    let sink = Sink::ok().await;
    let ep = app.admin_post("/v1/endpoints", json!({"url": sink.url("/")}), 201).await;
    let id = ep["id"].as_str().unwrap();
    let a = app.admin_post(&format!("/v1/endpoints/{id}/test"), json!({}), 202).await;
    let b = app.admin_post(&format!("/v1/endpoints/{id}/test"), json!({}), 202).await;
    assert_ne!(a["delivery_id"], b["delivery_id"]);
    eventually(WAIT, "both delivered", || async { (sink.count() == 2).then_some(()) }).await;
    let got = sink.received();
    assert_eq!(got[0].header("webhook-event-type"), "webhook.test");
    assert_eq!(got[0].header("webhook-source"), "_test");
    assert_ne!(got[0].header("webhook-id"), got[1].header("webhook-id"));
    let body: Value = serde_json::from_slice(&got[0].body).unwrap();
    assert_eq!(body["type"], "webhook.test");
}

/// During the grace period each request carries both signatures: a Standard Webhooks
/// verifier holding either secret accepts it.
#[tokio::test]
async fn secret_rotation_signs_with_both_secrets_during_the_grace_period() {
    let app = TestApp::spawn().await;
    let sink = Sink::ok().await;
    let ep = app.admin_post("/v1/endpoints", json!({"url": sink.url("/")}), 201).await;
    let id = ep["id"].as_str().unwrap();
    let old = ep["secret"].as_str().unwrap().to_owned();
    let rotated = app.admin_post(&format!("/v1/endpoints/{id}/rotate-secret"), json!({}), 200).await;
    let new = rotated["secret"].as_str().unwrap().to_owned();
    assert_ne!(old, new);
    app.admin_post(&format!("/v1/endpoints/{id}/test"), json!({}), 202).await;
    eventually(WAIT, "delivered", || async { (sink.count() == 1).then_some(()) }).await;
    let req = &sink.received()[0];
    let sig = req.header("webhook-signature");
    assert_eq!(sig.split(' ').count(), 2, "{sig}");
    for secret in [&old, &new] {
        assert!(standard_webhooks::verify(
            secret,
            &req.header("webhook-id"),
            &req.header("webhook-timestamp"),
            &req.body,
            &sig
        ));
    }
    // A second rotation within the first one's grace period: all three sign (rotating
    // twice must not drop the first old secret while subscribers may still use it).
    let third = app.admin_post(&format!("/v1/endpoints/{id}/rotate-secret"), json!({}), 200).await;
    let third = third["secret"].as_str().unwrap().to_owned();
    app.admin_post(&format!("/v1/endpoints/{id}/test"), json!({}), 202).await;
    eventually(WAIT, "delivered", || async { (sink.count() == 2).then_some(()) }).await;
    let req = &sink.received()[1];
    let sig = req.header("webhook-signature");
    assert_eq!(sig.split(' ').count(), 3, "{sig}");
    for secret in [&old, &new, &third] {
        let verified = standard_webhooks::verify(
            secret,
            &req.header("webhook-id"),
            &req.header("webhook-timestamp"),
            &req.body,
            &sig,
        );
        assert!(verified, "{secret} no longer signs");
    }
    // A rotation with no grace retires the current secret at once; the others keep their
    // own grace. Once every grace period is over only the current secret signs.
    app.admin_post(&format!("/v1/endpoints/{id}/rotate-secret"), json!({"grace_secs": 0}), 200).await;
    let current: String = sqlx::query_scalar("SELECT secret FROM endpoints").fetch_one(&app.db.pool).await.unwrap();
    let kept: Vec<String> =
        sqlx::query_scalar("SELECT unnest(previous_secrets) FROM endpoints").fetch_all(&app.db.pool).await.unwrap();
    assert_eq!(kept, [new.clone(), old.clone()], "newest expiry first; the secret retired with no grace is gone");
    sqlx::query("UPDATE endpoints SET previous_secrets_until = array_fill(now() - interval '1 s', ARRAY[cardinality(previous_secrets)])")
        .execute(&app.db.pool)
        .await
        .unwrap();
    app.admin_post(&format!("/v1/endpoints/{id}/test"), json!({}), 202).await;
    eventually(WAIT, "delivered", || async { (sink.count() == 3).then_some(()) }).await;
    let req = &sink.received()[2];
    let sig = req.header("webhook-signature");
    assert_eq!(sig.split(' ').count(), 1, "{sig}");
    assert!(standard_webhooks::verify(
        &current,
        &req.header("webhook-id"),
        &req.header("webhook-timestamp"),
        &req.body,
        &sig
    ));
}

/// Walking every page of 1,000 deliveries with limit=37 returns each exactly once, in order.
#[tokio::test]
async fn pagination_walks_every_row_once() {
    let app = TestApp::ingest_only().await;
    let ep = app.endpoint_for("https://subscriber.example.com/", Some("api")).await;
    seed_deliveries(&app.db.pool, &ep, 1000).await;
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/deliveries?endpoint_id={ep}&limit=37&cursor={c}"),
            None => format!("/v1/deliveries?endpoint_id={ep}&limit=37"),
        };
        let page = app.admin_get(&path).await;
        pages += 1;
        seen.extend(page["data"].as_array().unwrap().iter().map(|d| d["id"].as_str().unwrap().to_owned()));
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
        assert!(pages < 100, "pagination does not end");
    }
    assert_eq!(seen.len(), 1000);
    assert_eq!(seen.iter().collect::<HashSet<_>>().len(), 1000, "no row twice");
    let mut sorted = seen.clone();
    sorted.sort();
    assert_eq!(seen, sorted, "stable order");

    // Events paginate the same way, and filter.
    let page = app.admin_get("/v1/events?source=api&event_type=seed.created&limit=1000").await;
    assert_eq!(page["data"].as_array().unwrap().len(), 1000);
    let none = app.admin_get("/v1/events?event_type=other").await;
    assert_eq!(none["data"].as_array().unwrap().len(), 0);
    let (status, _) = app.admin(Method::GET, "/v1/deliveries?limit=0", None).await;
    assert_eq!(status, 422);
    let (status, _) = app.admin(Method::GET, "/v1/deliveries?status=lost", None).await;
    assert_eq!(status, 422);
}
