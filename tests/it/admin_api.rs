//! Admin API: authentication, validation and the JSON shape of errors.

use serde_json::json;

use crate::support::{ADMIN_TOKEN, TestApp};

#[tokio::test]
async fn admin_api_needs_the_bearer_token() {
    let app = TestApp::ingest_only().await;
    let missing =
        app.http.post(app.url("/v1/endpoints")).json(&json!({"url": "https://example.com"})).send().await.unwrap();
    assert_eq!(missing.status().as_u16(), 401);
    let body: serde_json::Value = missing.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unauthorized");

    let wrong = app.http.get(app.url("/v1/endpoints")).bearer_auth(format!("{ADMIN_TOKEN}x")).send().await.unwrap();
    assert_eq!(wrong.status().as_u16(), 401);
    assert_eq!(app.db.count("endpoints").await, 0);
}

#[tokio::test]
async fn invalid_endpoint_urls_are_422_with_a_reason() {
    let app = TestApp::ingest_only().await;
    for url in [
        "not a url",
        "ftp://example.com/x",
        "file:///etc/passwd",
        "http://",
        "https://user:secret@example.com/hook",
        "https://user@example.com/hook",
        "https://:secret@example.com/hook",
    ] {
        let (status, body) = app.admin(reqwest::Method::POST, "/v1/endpoints", Some(json!({"url": url}))).await;
        assert_eq!(status, 422, "{url}: {body}");
        assert_eq!(body["error"]["code"], "validation_failed");
        assert!(body["error"]["message"].as_str().unwrap().starts_with("url:"), "{body}");
    }
    let (status, body) = app
        .admin(reqwest::Method::POST, "/v1/endpoints", Some(json!({"url": "https://example.com", "secret": "nope"})))
        .await;
    assert_eq!(status, 422, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().starts_with("secret:"));
    assert_eq!(app.db.count("endpoints").await, 0);
    // The same check on update.
    let created = app.admin_post("/v1/endpoints", json!({"url": "https://example.com/hook"}), 201).await;
    let path = format!("/v1/endpoints/{}", created["id"].as_str().unwrap());
    let (status, body) =
        app.admin(reqwest::Method::PATCH, &path, Some(json!({"url": "https://u:p@example.com/hook"}))).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(app.admin_get(&path).await["url"], "https://example.com/hook");
}

#[tokio::test]
async fn endpoint_creation_returns_a_standard_webhooks_secret_once() {
    let app = TestApp::ingest_only().await;
    let created = app.admin_post("/v1/endpoints", json!({"url": "https://example.com/hook"}), 201).await;
    assert!(created["secret"].as_str().unwrap().starts_with("whsec_"));
    let fetched = app.admin_get(&format!("/v1/endpoints/{}", created["id"].as_str().unwrap())).await;
    assert_eq!(fetched["url"], "https://example.com/hook");
    assert!(fetched.get("secret").is_none(), "the secret is shown only at creation: {fetched}");
}

#[tokio::test]
async fn malformed_json_is_400_and_wrong_shapes_are_422() {
    let app = TestApp::ingest_only().await;
    let resp = app
        .http
        .post(app.url("/v1/sources"))
        .bearer_auth(ADMIN_TOKEN)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "malformed_json");

    let (status, body) =
        app.admin(reqwest::Method::POST, "/v1/sources", Some(json!({"name": "x", "kind": "carrier-pigeon"}))).await;
    assert_eq!(status, 422, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("kind"), "{body}");
    let (status, _) =
        app.admin(reqwest::Method::POST, "/v1/sources", Some(json!({"name": "bad name!", "kind": "none"}))).await;
    assert_eq!(status, 422);
    let (status, body) =
        app.admin(reqwest::Method::POST, "/v1/subscriptions", Some(json!({"endpoint_id": uuid::Uuid::new_v4()}))).await;
    assert_eq!(status, 422, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().starts_with("endpoint_id:"));
    assert_eq!(app.db.count("sources").await, 3, "only the built-in api, _test and _gateway sources");
}

#[tokio::test]
async fn duplicate_source_name_is_409() {
    let app = TestApp::ingest_only().await;
    let created = app.source_none("shop").await;
    assert_eq!(created["ingest_path"], "/ingest/shop");
    let (status, body) =
        app.admin(reqwest::Method::POST, "/v1/sources", Some(json!({"name": "shop", "kind": "none"}))).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "conflict");
}

#[tokio::test]
async fn unknown_source_and_oversized_bodies_store_nothing() {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    let resp = app.http.post(app.url("/ingest/nope")).body("{}").send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 404);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "not_found");

    // The test gateway's limit is 64 KiB.
    let big = "x".repeat(64 * 1024 + 1);
    let resp = app.http.post(app.url("/ingest/shop")).header("x-delivery-id", "big").body(big).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 413);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "payload_too_large");
    assert_eq!(app.db.count("events").await, 0);

    let resp = app.http.get(app.url("/no/such/route")).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 404);
}

#[tokio::test]
async fn health_and_readiness() {
    let app = TestApp::ingest_only().await;
    let health = app.http.get(app.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
    let ready = app.http.get(app.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 200);
    // Roll back the migration record: the gateway must say it is not ready.
    sqlx::query("DELETE FROM _sqlx_migrations").execute(&app.db.pool).await.unwrap();
    let ready = app.http.get(app.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 503);
}

/// NUL in any text the API takes (path, query, a JSON string of any route's body) is a
/// 4xx with a JSON reason, never a 500, and stores nothing. A NUL inside a published
/// event's payload is data, and is stored.
#[tokio::test]
async fn nul_characters_anywhere_are_refused_with_a_reason() {
    use reqwest::Method as M;
    let app = TestApp::ingest_only().await;
    let ep = app.endpoint_for("http://127.0.0.1:9/", None).await;
    let tables = ["sources", "endpoints", "subscriptions", "events", "deliveries"];
    let mut counts = Vec::new();
    for t in tables {
        counts.push(app.db.count(t).await);
    }
    let bodies: Vec<(M, String, serde_json::Value)> = vec![
        (M::POST, "/v1/sources".into(), json!({"name": "s", "kind": "none", "dedupe": {"json_pointer": "/a\u{0}"}})),
        (M::POST, "/v1/sources".into(), json!({"name": "s", "kind": "github", "secrets": ["a\u{0}b"]})),
        (M::POST, "/v1/endpoints".into(), json!({"url": "http://127.0.0.1:9/", "description": "a\u{0}b"})),
        (M::PATCH, format!("/v1/endpoints/{ep}"), json!({"description": "a\u{0}b"})),
        (M::POST, "/v1/subscriptions".into(), json!({"endpoint_id": ep, "event_types": ["a\u{0}"]})),
        (M::POST, "/v1/events".into(), json!({"source": "a\u{0}", "event_id": "x", "event_type": "t", "payload": {}})),
        (M::POST, format!("/v1/endpoints/{ep}/rotate-secret"), json!({"secret": "whsec_\u{0}"})),
    ];
    for (method, path, body) in bodies {
        let (status, answer) = app.admin(method.clone(), &path, Some(body)).await;
        assert!((400..500).contains(&status), "{method} {path}: {status} {answer}");
        assert!(answer["error"]["message"].is_string(), "{method} {path}: {answer}");
    }
    for path in [
        "/v1/events?event_type=a%00",
        "/v1/events?source=a%00",
        "/v1/sources/a%00",
        "/v1/endpoints/%00",
        "/v1/deliveries?endpoint_id=%00",
    ] {
        let (status, answer) = app.admin(M::GET, path, None).await;
        assert!((400..500).contains(&status), "GET {path}: {status} {answer}");
        assert!(answer["error"]["message"].is_string(), "GET {path}: {answer}");
    }
    let ingest = app.http.post(app.url("/ingest/a%00b")).body("{}").send().await.unwrap();
    assert_eq!(ingest.status().as_u16(), 400);
    for (t, before) in tables.iter().zip(counts) {
        assert_eq!(app.db.count(t).await, before, "{t}: something was stored");
    }
    let payload = json!({"event_id": "x", "event_type": "t", "payload": {"text": "a\u{0}b"}});
    let (status, answer) = app.admin(M::POST, "/v1/events", Some(payload)).await;
    assert_eq!(status, 200, "{answer}");
}

/// Every route that takes an id answers a malformed id (not a UUID, non-ASCII, huge) as it
/// answers an unknown one: 404 with a JSON reason naming the kind of resource, never a 400
/// from the framework or a 500.
#[tokio::test]
async fn a_malformed_id_is_a_json_404_on_every_id_route() {
    let app = TestApp::spawn().await;
    let routes: [(reqwest::Method, &str, &str); 13] = [
        (reqwest::Method::GET, "/v1/sources/{}", "source"),
        (reqwest::Method::DELETE, "/v1/sources/{}", "source"),
        (reqwest::Method::GET, "/v1/endpoints/{}", "endpoint"),
        (reqwest::Method::POST, "/v1/endpoints/{}/pause", "endpoint"),
        (reqwest::Method::POST, "/v1/endpoints/{}/resume", "endpoint"),
        (reqwest::Method::POST, "/v1/endpoints/{}/rotate-secret", "endpoint"),
        (reqwest::Method::GET, "/v1/subscriptions/{}", "subscription"),
        (reqwest::Method::DELETE, "/v1/subscriptions/{}", "subscription"),
        (reqwest::Method::GET, "/v1/events/{}", "event"),
        (reqwest::Method::GET, "/v1/deliveries/{}", "delivery"),
        (reqwest::Method::GET, "/v1/deliveries/{}/attempts", "delivery"),
        (reqwest::Method::POST, "/v1/deliveries/{}/redeliver", "delivery"),
        (reqwest::Method::POST, "/v1/deliveries/{}/unblock", "delivery"),
    ];
    let long = "a".repeat(5000);
    for (method, route, what) in routes {
        for bad in ["not-an-id", "%E2%82%AC", "00000000-0000-0000-0000", long.as_str()] {
            let path = route.replace("{}", bad);
            let (status, body) = app.admin(method.clone(), &path, None).await;
            assert_eq!(status, 404, "{method} {path}: {body}");
            assert_eq!(body["error"]["code"], "not_found", "{method} {path}: {body}");
            assert_eq!(body["error"]["message"], format!("{what} not found"), "{method} {path}");
        }
    }
}

/// A time chrono reads and PostgreSQL does not store (before 4713 BC) is a 422 with the
/// reason on every call that takes one (the events' and the audit log's `since` and
/// `until`, a recovery's `since`), never a 500.
#[tokio::test]
async fn a_time_postgresql_cannot_store_is_422() {
    let app = TestApp::spawn().await;
    let ep = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/hook"}), 201).await;
    let ep = ep["id"].as_str().unwrap().to_owned();
    let ancient = "-10000-01-01T00:00:00Z";
    let calls = [
        (reqwest::Method::GET, format!("/v1/events?since={ancient}"), None),
        (reqwest::Method::GET, format!("/v1/events?until={ancient}"), None),
        (reqwest::Method::GET, format!("/v1/audit?since={ancient}"), None),
        (reqwest::Method::POST, format!("/v1/endpoints/{ep}/recover"), Some(json!({"since": ancient}))),
    ];
    for (method, path, body) in calls {
        let (status, answer) = app.admin(method, &path, body).await;
        assert_eq!((status, answer["error"]["code"].as_str()), (422, Some("validation_failed")), "{path}: {answer}");
        assert!(answer["error"]["message"].as_str().unwrap_or_default().contains("4713 BC"), "{path}: {answer}");
    }
}
