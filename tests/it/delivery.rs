//! Delivery: the outbound request, the outcome policy row by row, graceful shutdown.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::sink::{Reply, Sink};
use crate::support::{TestApp, TestDb, count_status, eventually, standard_webhooks, test_settings};

const WAIT: Duration = Duration::from_secs(30);

/// The delivery selected by `filter` (a query string), once it is no longer pending.
async fn settled(app: &TestApp, filter: &str) -> Value {
    eventually(WAIT, "delivery settles", || async {
        let list = app.admin_get(&format!("/v1/deliveries?{filter}")).await;
        let d = list["data"][0].clone();
        (d["status"] != "pending" && !d.is_null()).then_some(d)
    })
    .await
}

async fn attempts(app: &TestApp, delivery_id: &str) -> Vec<Value> {
    app.admin_get(&format!("/v1/deliveries/{delivery_id}/attempts")).await["data"].as_array().unwrap().clone()
}

/// Create an endpoint for `url`, publish one event to it, and return a query string
/// selecting that one delivery, and the endpoint's secret.
async fn publish_to(app: &TestApp, url: &str) -> (String, String) {
    // A fresh event type per call, so each endpoint receives only its own event.
    let event_type = format!("invoice.paid.{}", uuid::Uuid::new_v4().simple());
    let ep = app.admin_post("/v1/endpoints", json!({"url": url}), 201).await;
    app.admin_post(
        "/v1/subscriptions",
        json!({"endpoint_id": ep["id"], "source": "api", "event_types": [event_type]}),
        201,
    )
    .await;
    let published = app
        .admin_post(
            "/v1/events",
            json!({"event_type": event_type, "event_id": uuid::Uuid::new_v4().to_string(), "payload": {"amount": 42}}),
            200,
        )
        .await;
    let filter =
        format!("event_id={}&endpoint_id={}", published["event_id"].as_str().unwrap(), ep["id"].as_str().unwrap());
    (filter, ep["secret"].as_str().unwrap().to_owned())
}

#[tokio::test]
async fn delivered_request_carries_body_signature_and_stable_ids() {
    let app = TestApp::spawn().await;
    let sink = Sink::ok().await;
    let (event_id, secret) = publish_to(&app, &sink.url("/hooks")).await;
    let delivery = settled(&app, &event_id).await;
    assert_eq!(delivery["status"], "delivered");
    assert_eq!(delivery["attempts"], 1);

    let got = sink.received();
    assert_eq!(got.len(), 1);
    let req = &got[0];
    assert_eq!(req.path, "/hooks");
    assert_eq!(&req.body[..], br#"{"amount":42}"#);
    assert_eq!(req.header("content-type"), "application/json");
    assert_eq!(req.header("webhook-id"), delivery["webhook_id"].as_str().unwrap());
    assert_eq!(req.header("idempotency-key"), req.header("webhook-id"));
    assert_eq!(req.header("webhook-attempt"), "1");
    assert!(req.header("webhook-event-type").starts_with("invoice.paid."));
    assert_eq!(req.header("webhook-source"), "api");
    assert!(req.header("user-agent").starts_with("webhook-gateway/"), "{}", req.header("user-agent"));
    let ts: i64 = req.header("webhook-timestamp").parse().unwrap();
    assert!((chrono::Utc::now().timestamp() - ts).abs() < 60);
    assert!(
        standard_webhooks::verify(
            &secret,
            &req.header("webhook-id"),
            &req.header("webhook-timestamp"),
            &req.body,
            &req.header("webhook-signature")
        ),
        "an independent Standard Webhooks verifier accepts the signature"
    );
    assert!(!standard_webhooks::verify(
        &secret,
        &req.header("webhook-id"),
        &req.header("webhook-timestamp"),
        b"tampered",
        &req.header("webhook-signature")
    ));

    let timeline = attempts(&app, delivery["id"].as_str().unwrap()).await;
    assert_eq!(timeline.len(), 1);
    assert_eq!(timeline[0]["outcome"], "delivered");
    assert_eq!(timeline[0]["status_code"], 200);
    assert_eq!(timeline[0]["reason"], "HTTP 200");
}

/// Ingest wakes the workers: time from the producer's request to the sink's receipt on
/// an idle gateway. Printed, not asserted (timed assertions are flaky on shared
/// machines); the benchmark harness reports it properly.
#[tokio::test]
async fn ingest_wakes_idle_workers() {
    // Workers that would poll only once an hour: every delivery below is claimed because
    // ingest woke them, or not at all.
    let mut settings = test_settings();
    settings.delivery.poll_interval = Duration::from_secs(3600);
    let app = TestApp::spawn_with(TestDb::new().await, settings, 16).await;
    let sink = Sink::ok().await;
    app.source_none("shop").await;
    app.endpoint_for(&sink.url("/"), Some("shop")).await;
    let mut latencies = Vec::new();
    for i in 0..20 {
        let start = std::time::Instant::now();
        let (status, _) = app.ingest("shop", &format!("w-{i}"), "order.created", "{}").await;
        assert_eq!(status, 200);
        let arrived =
            eventually(WAIT, "sink receipt", || async { (sink.count() > i).then(|| sink.received()[i].at) }).await;
        latencies.push(arrived.duration_since(start));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    latencies.sort();
    println!("ingest-to-first-attempt: p50 {:?}, max {:?} (poll interval 1 h)", latencies[10], latencies[19]);
    assert_eq!(count_status(&app.db.pool, "delivered").await, 20);
}

#[tokio::test]
async fn permanent_4xx_is_dead_at_once() {
    for status in [400u16, 404, 410, 422] {
        let app = TestApp::spawn().await;
        let sink = Sink::start(move |_, _| Reply::Status(status, vec![], "contract changed".into())).await;
        let (event_id, _) = publish_to(&app, &sink.url("/")).await;
        let d = settled(&app, &event_id).await;
        assert_eq!(d["status"], "dead", "{status}");
        assert_eq!(d["attempts"], 1);
        let reason = format!("HTTP {status}: permanent client error, not retried");
        assert_eq!(d["dead_reason"], reason);
        let timeline = attempts(&app, d["id"].as_str().unwrap()).await;
        assert_eq!(timeline.len(), 1);
        assert_eq!(timeline[0]["status_code"], status);
        assert_eq!(timeline[0]["outcome"], "dead");
        assert_eq!(timeline[0]["response_excerpt"], "contract changed");
        assert_eq!(sink.count(), 1, "never retried");
    }
}

/// 500 on every attempt: retried with full-jitter backoff until the budget is spent.
#[tokio::test]
async fn server_errors_retry_with_backoff_until_the_budget_is_spent() {
    let mut settings = test_settings();
    settings.delivery.max_attempts = 4;
    let app = TestApp::spawn_with(TestDb::new().await, settings.clone(), 16).await;
    let sink = Sink::start(|_, _| Reply::status(500)).await;
    let (event_id, _) = publish_to(&app, &sink.url("/")).await;
    let d = settled(&app, &event_id).await;
    assert_eq!(d["status"], "dead");
    assert_eq!(d["attempts"], 4);
    assert_eq!(d["dead_reason"], "attempt budget exhausted (4 attempts); last: HTTP 500");
    let got = sink.received();
    let numbers: Vec<String> = got.iter().map(|r| r.header("webhook-attempt")).collect();
    assert_eq!(numbers, ["1", "2", "3", "4"]);
    assert!(got.iter().all(|r| r.header("webhook-id") == got[0].header("webhook-id")), "stable webhook-id");

    let timeline = attempts(&app, d["id"].as_str().unwrap()).await;
    assert_eq!(timeline.len(), 4);
    for (i, a) in timeline.iter().enumerate().take(3) {
        assert_eq!(a["outcome"], "retry");
        assert_eq!(a["next_attempt_reason"], "backoff");
        let started: chrono::DateTime<chrono::Utc> = serde_json::from_value(a["started_at"].clone()).unwrap();
        let next: chrono::DateTime<chrono::Utc> = serde_json::from_value(a["next_attempt_at"].clone()).unwrap();
        let ceiling = webhook_gateway::deliver::backoff::ceiling(
            i as u32 + 1,
            settings.delivery.backoff_base,
            settings.delivery.backoff_cap,
        );
        let window = next - started;
        assert!(window >= chrono::Duration::zero(), "attempt {i}: next attempt before this one");
        assert!(window.to_std().unwrap() <= ceiling + Duration::from_secs(1), "attempt {i}: {window} > {ceiling:?}");
    }
    assert_eq!(timeline[3]["outcome"], "dead");
}

/// 503 and 429 with Retry-After: the next attempt is at the asked time, not our curve.
#[tokio::test]
async fn retry_after_is_honoured_in_seconds_and_as_an_http_date() {
    let app = TestApp::spawn().await;
    let date = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(3600));
    let cases = [(503u16, "120".to_owned(), 120i64), (429, date, 3600)];
    for (status, retry_after, expect_secs) in cases {
        let ra = retry_after.clone();
        let sink =
            Sink::start(move |_, _| Reply::Status(status, vec![("retry-after", ra.clone())], String::new())).await;
        let (event_id, _) = publish_to(&app, &sink.url("/")).await;
        let d = eventually(WAIT, "first attempt recorded", || async {
            let list = app.admin_get(&format!("/v1/deliveries?{event_id}")).await;
            let d = list["data"][0].clone();
            (d["attempts"] == 1 && d["in_flight"] == false).then_some(d)
        })
        .await;
        assert_eq!(d["status"], "pending");
        let timeline = attempts(&app, d["id"].as_str().unwrap()).await;
        assert_eq!(timeline.len(), 1);
        assert_eq!(timeline[0]["next_attempt_reason"], "retry_after");
        assert_eq!(timeline[0]["reason"], format!("HTTP {status}"));
        let started: chrono::DateTime<chrono::Utc> = serde_json::from_value(timeline[0]["started_at"].clone()).unwrap();
        let next: chrono::DateTime<chrono::Utc> = serde_json::from_value(d["next_attempt_at"].clone()).unwrap();
        let secs = (next - started).num_seconds();
        assert!((expect_secs - 3..=expect_secs + 3).contains(&secs), "{status}: next attempt in {secs} s");
        assert_eq!(sink.count(), 1);
    }
}

#[tokio::test]
async fn redirects_are_not_followed() {
    let mut settings = test_settings();
    settings.delivery.max_attempts = 2;
    let app = TestApp::spawn_with(TestDb::new().await, settings, 16).await;
    let target = Sink::ok().await;
    let location = target.url("/stolen");
    let sink = Sink::start(move |_, _| Reply::Status(302, vec![("location", location.clone())], String::new())).await;
    let (event_id, _) = publish_to(&app, &sink.url("/")).await;
    let d = settled(&app, &event_id).await;
    assert_eq!(d["status"], "dead");
    let timeline = attempts(&app, d["id"].as_str().unwrap()).await;
    assert_eq!(timeline[0]["status_code"], 302);
    assert_eq!(timeline[0]["reason"], format!("HTTP 302: redirect not followed (Location: {})", target.url("/stolen")));
    assert_eq!(target.count(), 0, "the redirect target was never contacted");
}

#[tokio::test]
async fn timeouts_and_refused_connections_are_retried() {
    let mut settings = test_settings();
    settings.delivery.max_attempts = 2;
    settings.egress.request_timeout = Duration::from_millis(500);
    let app = TestApp::spawn_with(TestDb::new().await, settings, 16).await;

    let slow = Sink::start(|_, _| Reply::Hold(Duration::from_secs(5))).await;
    let (slow_event, _) = publish_to(&app, &slow.url("/")).await;
    let closed_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (refused_event, _) = publish_to(&app, &format!("http://127.0.0.1:{closed_port}/")).await;

    for (event_id, kind) in [(slow_event, "timeout"), (refused_event, "connect")] {
        let d = settled(&app, &event_id).await;
        assert_eq!(d["status"], "dead", "{kind}");
        assert_eq!(d["attempts"], 2);
        let timeline = attempts(&app, d["id"].as_str().unwrap()).await;
        assert_eq!(timeline.len(), 2);
        assert_eq!(timeline[0]["error_kind"], kind);
        assert_eq!(timeline[0]["outcome"], "retry");
        assert!(timeline[0]["status_code"].is_null());
        assert!(timeline[0]["reason"].as_str().unwrap().starts_with(&format!("{kind}:")), "{}", timeline[0]["reason"]);
        assert!(d["dead_reason"].as_str().unwrap().starts_with("attempt budget exhausted (2 attempts); last: "));
    }
    assert_eq!(slow.count(), 2);
}

/// A subscriber that streams a huge body costs a bounded read, and the stored excerpt is
/// truncated.
#[tokio::test]
async fn response_bodies_are_read_and_stored_with_bounds() {
    let app = TestApp::spawn().await;
    let sink = Sink::start(|_, _| Reply::Status(200, vec![], "y".repeat(1024 * 1024))).await;
    let (event_id, _) = publish_to(&app, &sink.url("/")).await;
    let d = settled(&app, &event_id).await;
    assert_eq!(d["status"], "delivered");
    let timeline = attempts(&app, d["id"].as_str().unwrap()).await;
    assert_eq!(timeline[0]["response_excerpt"].as_str().unwrap().len(), 4096);
}

/// Shutdown stops claiming but lets the in-flight request finish and records it.
#[tokio::test]
async fn graceful_shutdown_finishes_and_records_in_flight_deliveries() {
    let mut app = TestApp::spawn().await;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_millis(1500))).await;
    publish_to(&app, &sink.url("/")).await;
    eventually(WAIT, "request in flight", || async { (sink.count() == 1).then_some(()) }).await;
    app.shutdown().await;
    let (status, attempts): (String, i32) =
        sqlx::query_as("SELECT status, attempt_count FROM deliveries").fetch_one(&app.db.pool).await.unwrap();
    assert_eq!((status.as_str(), attempts), ("delivered", 1), "recorded before shutdown returned");
    assert_eq!(app.db.count("attempts").await, 1);
}

/// Egress refusals dead-letter with the address class, at send time (DNS changes).
#[tokio::test]
async fn forbidden_destinations_are_dead_lettered_with_the_reason() {
    let mut settings = test_settings();
    settings.egress.allow.clear();
    let app = TestApp::spawn_with(TestDb::new().await, settings, 16).await;
    // Creation refuses IP literals at once ...
    let (status, body) =
        app.admin(reqwest::Method::POST, "/v1/endpoints", Some(json!({"url": "http://169.254.169.254/latest"}))).await;
    assert_eq!(status, 422);
    assert_eq!(body["error"]["message"], "url: forbidden_address: 169.254.169.254 is link-local");
    // ... and names are checked when sending: `localhost` resolves to loopback.
    let (event_id, _) = publish_to(&app, "http://localhost:9/hook").await;
    let d = settled(&app, &event_id).await;
    assert_eq!(d["status"], "dead");
    assert!(d["dead_reason"].as_str().unwrap().starts_with("forbidden_address: "), "{d}");
    assert!(d["dead_reason"].as_str().unwrap().ends_with("is loopback"), "{d}");
    let timeline = attempts(&app, d["id"].as_str().unwrap()).await;
    assert_eq!(timeline[0]["error_kind"], "forbidden_address");
}

/// Every budgeted attempt claimed and the last one's worker gone (its lease ran out, its
/// outcome unknown): the next claim sends nothing and the recorder dead-letters the
/// delivery with the reason, giving the unsent claim's attempt back.
#[tokio::test]
async fn a_budget_spent_by_dead_workers_is_dead_lettered_without_sending() {
    let db = TestDb::new().await;
    let sink = Sink::ok().await;
    let endpoint = crate::support::insert_endpoint(&db.pool, &sink.url("/")).await;
    crate::support::seed_deliveries(&db.pool, &endpoint, 1).await;
    // A worker claims attempt 1 and dies: its lease (1 s) runs out.
    let claimed = webhook_gateway::queue::claim(&db.pool, 1, Duration::from_secs(1)).await.expect("claim");
    assert_eq!(claimed.len(), 1);
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let mut settings = test_settings();
    settings.delivery.max_attempts = 1;
    let app = TestApp::spawn_with(db, settings, 8).await;
    eventually(Duration::from_secs(30), "dead-lettered", || async {
        (count_status(&app.db.pool, "dead").await == 1).then_some(())
    })
    .await;
    let (reason, attempt_count): (String, i32) =
        sqlx::query_as("SELECT dead_reason, attempt_count FROM deliveries").fetch_one(&app.db.pool).await.unwrap();
    assert!(
        reason.starts_with("attempt budget exhausted (1 attempts); the last attempt's outcome is unknown"),
        "{reason}"
    );
    assert_eq!(attempt_count, 1, "the unsent claim's attempt is given back");
    assert_eq!(app.db.count("attempts").await, 0, "nothing recorded as an attempt");
    assert_eq!(sink.count(), 0, "nothing sent");
}
