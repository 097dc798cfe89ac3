//! The gateway's own events (`operational`): published under the source `_gateway`,
//! delivered like any other event, each once, and never about themselves.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::sink::{Reply, Sink};
use crate::support::{TestApp, TestDb, eventually, seed_deliveries, test_settings};

/// The operational events a sink received, as (type, body), in arrival order.
fn received(sink: &Sink) -> Vec<(String, Value)> {
    sink.received()
        .iter()
        .filter(|r| r.replied == 200)
        .map(|r| {
            let body: Value = serde_json::from_slice(&r.body).expect("operational events are JSON");
            (body["type"].as_str().unwrap_or_default().to_owned(), body)
        })
        .collect()
}

/// How many stored operational events have type `event_type`.
async fn stored(db: &TestDb, event_type: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM events e JOIN sources s ON s.id = e.source_id WHERE s.name = '_gateway' AND e.event_type = $1",
    )
    .bind(event_type)
    .fetch_one(&db.pool)
    .await
    .expect("count")
}

/// Subscribe a new endpoint at `url` to the gateway's own events; its id.
async fn ops_endpoint(app: &TestApp, url: &str) -> String {
    app.endpoint_for(url, Some("_gateway")).await
}

#[tokio::test]
async fn a_circuit_that_opens_and_closes_and_a_pause_reach_the_subscriber_once_each_signed() {
    let app = TestApp::spawn().await;
    let ops = Sink::ok().await;
    ops_endpoint(&app, &ops.url("/ops")).await;
    // Subscribed to every source: webhooks, not the gateway's own events.
    let everything = Sink::ok().await;
    app.endpoint_for(&everything.url("/all"), None).await;
    let healthy = Arc::new(AtomicBool::new(false));
    let flag = healthy.clone();
    let shop =
        Sink::start(move |_, _| if flag.load(Ordering::SeqCst) { Reply::status(200) } else { Reply::status(503) })
            .await;
    let ep = app.endpoint_for(&shop.url("/hook?token=s3cret"), Some("api")).await;
    seed_deliveries(&app.db.pool, &ep, 10).await;

    let opened = eventually(Duration::from_secs(20), "endpoint.circuit.opened delivered", || async {
        received(&ops).into_iter().find(|(t, _)| t == "endpoint.circuit.opened")
    })
    .await
    .1;
    assert_eq!(opened["data"]["endpoint"]["id"], ep.as_str());
    // The URL without its query: a token in it stays out of the gateway's own events.
    assert_eq!(opened["data"]["endpoint"]["url"], shop.url("/hook?REDACTED"));
    assert!(opened["data"]["consecutive_failures"].as_i64().unwrap() >= 5, "{opened}");
    healthy.store(true, Ordering::SeqCst);
    eventually(Duration::from_secs(20), "endpoint.circuit.closed delivered", || async {
        received(&ops).into_iter().find(|(t, _)| t == "endpoint.circuit.closed")
    })
    .await;

    // Pausing twice is one change; resuming is another.
    for action in ["pause", "pause", "resume"] {
        app.admin_post(&format!("/v1/endpoints/{ep}/{action}"), json!({}), 200).await;
    }
    eventually(Duration::from_secs(20), "paused and resumed delivered", || async {
        let types: Vec<String> = received(&ops).into_iter().map(|(t, _)| t).collect();
        (types.contains(&"endpoint.paused".to_owned()) && types.contains(&"endpoint.resumed".to_owned())).then_some(())
    })
    .await;
    // Each event once, however many ticks ran meanwhile: stored once, sent once.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for t in ["endpoint.circuit.opened", "endpoint.circuit.closed", "endpoint.paused", "endpoint.resumed"] {
        assert_eq!(stored(&app.db, t).await, 1, "{t}");
        assert_eq!(received(&ops).iter().filter(|(got, _)| got == t).count(), 1, "{t}");
    }
    for r in ops.received() {
        assert!(r.header("webhook-signature").starts_with("v1,"), "signed like any delivery");
        assert!(!r.header("webhook-id").is_empty());
    }
    assert_eq!(everything.count(), 0, "a subscription to every source gets no operational event");
    // Findable like any event.
    let found = app.admin_get("/v1/events?source=_gateway&event_type=endpoint.circuit.*").await;
    assert_eq!(found["data"].as_array().unwrap().len(), 2, "{found}");
}

/// A storm of dead letters is reported in a few grouped events whose counts add up; the
/// operational events' own deliveries die too (their endpoint answers 400), and that
/// produces nothing more.
#[tokio::test]
async fn dead_letters_are_grouped_and_operational_events_never_feed_on_themselves() {
    let app = TestApp::spawn().await;
    let ops = Sink::start(|_, _| Reply::status(400)).await;
    ops_endpoint(&app, &ops.url("/ops")).await;
    let gone = Sink::start(|_, _| Reply::status(400)).await;
    let ep = app.endpoint_for(&gone.url("/"), Some("api")).await;
    seed_deliveries(&app.db.pool, &ep, 40).await;

    let reported = || async {
        let bodies: Vec<Value> = sqlx::query_scalar(
            "SELECT convert_from(payload, 'UTF8')::jsonb FROM events e JOIN sources s ON s.id = e.source_id
             WHERE s.name = '_gateway' AND e.event_type = 'deliveries.dead_lettered'",
        )
        .fetch_all(&app.db.pool)
        .await
        .expect("reports");
        bodies
    };
    eventually(Duration::from_secs(20), "all 40 dead letters reported", || async {
        let total: i64 = reported().await.iter().map(|b| b["data"]["dead"].as_i64().unwrap_or(0)).sum();
        (total == 40).then_some(())
    })
    .await;
    let events = reported().await;
    assert!(events.len() <= 10, "grouped: {} events for 40 dead letters", events.len());
    for e in &events {
        assert_eq!(e["data"]["endpoints"][0]["endpoint"]["id"], ep.as_str(), "{e}");
    }
    // The reports' own deliveries die at the ops endpoint; many windows later, nothing
    // more was reported, and no operational delivery is still pending.
    eventually(Duration::from_secs(20), "the reports' deliveries dead", || async {
        let pending: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM deliveries d JOIN events e ON e.id = d.event_id JOIN sources s ON s.id = e.source_id
             WHERE s.name = '_gateway' AND d.status = 'pending'",
        )
        .fetch_one(&app.db.pool)
        .await
        .expect("pending");
        (pending == 0 && ops.count() >= events.len()).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(reported().await.len(), events.len(), "dead operational deliveries are not reported");
    let total: i64 = reported().await.iter().map(|b| b["data"]["dead"].as_i64().unwrap_or(0)).sum();
    assert_eq!(total, 40);
}

/// A late backlog is raised once and cleared once, whichever of many racing replicas runs
/// the check (eight connections running every check at once, twice over).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_checks_publish_each_event_once() {
    let db = TestDb::new().await;
    let settings = webhook_gateway::operational::OperationalSettings {
        backlog_after: Duration::from_secs(60),
        ..Default::default()
    };
    let ep = crate::support::insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    seed_deliveries(&db.pool, &ep, 5).await;
    // Due two minutes ago; and a circuit that opened and closed.
    sqlx::query("UPDATE deliveries SET next_attempt_at = now() - interval '2 minutes'")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO circuit_transitions (endpoint_id, change, failures, open_count) VALUES ($1, 'opened', 5, 1), ($1, 'closed', 0, 1)",
    )
    .bind(uuid::Uuid::parse_str(&ep).unwrap())
    .execute(&db.pool)
    .await
    .unwrap();
    let race = || async {
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let pool = webhook_gateway::db::connect(&db.url, 1).await.expect("pool");
            let settings = settings.clone();
            tasks.push(tokio::spawn(async move { webhook_gateway::operational::check_fleet(&pool, &settings).await }));
        }
        let mut published = 0;
        for t in tasks {
            published += t.await.expect("task").expect("checks");
        }
        published
    };
    assert_eq!(race().await, 3, "backlog.delayed, circuit opened and closed");
    assert_eq!(race().await, 0, "nothing new");
    sqlx::query("UPDATE deliveries SET status = 'delivered', finished_at = now()").execute(&db.pool).await.unwrap();
    assert_eq!(race().await, 1, "backlog.recovered");
    for (t, n) in [
        ("backlog.delayed", 1),
        ("backlog.recovered", 1),
        ("endpoint.circuit.opened", 1),
        ("endpoint.circuit.closed", 1),
    ] {
        assert_eq!(stored(&db, t).await, n, "{t}");
    }
}

/// An idle fleet's checks find nothing to do and write nothing (no transaction, no WAL
/// every tick), and still publish what happens next.
#[tokio::test]
async fn checks_with_nothing_to_report_write_nothing() {
    let db = TestDb::new().await;
    let settings = webhook_gateway::operational::OperationalSettings::default();
    let pool = webhook_gateway::db::connect(&db.url, 2).await.expect("pool");
    let states = || async {
        sqlx::query_as::<_, (String, String)>("SELECT name, xmin::text FROM operational_state ORDER BY name")
            .fetch_all(&db.pool)
            .await
            .expect("states")
    };
    // The first round starts the windows.
    assert_eq!(webhook_gateway::operational::check_fleet(&pool, &settings).await.expect("checks"), 0);
    let after_first = states().await;
    for _ in 0..3 {
        assert_eq!(webhook_gateway::operational::check_fleet(&pool, &settings).await.expect("checks"), 0);
    }
    assert_eq!(states().await, after_first, "rounds with nothing to report changed no check's state");

    // What happens next is still published, once.
    let ep = crate::support::insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    sqlx::query(
        "INSERT INTO circuit_transitions (endpoint_id, change, failures, open_count) VALUES ($1, 'opened', 5, 1)",
    )
    .bind(uuid::Uuid::parse_str(&ep).expect("id"))
    .execute(&db.pool)
    .await
    .expect("transition");
    assert_eq!(webhook_gateway::operational::check_fleet(&pool, &settings).await.expect("checks"), 1, "circuit opened");
    assert_eq!(webhook_gateway::operational::check_fleet(&pool, &settings).await.expect("checks"), 0, "nothing new");
    assert_eq!(stored(&db, "endpoint.circuit.opened").await, 1);
}

/// A source refusing many webhooks (bad signatures) is reported once per minute, with the
/// reasons; a few refusals are not.
#[tokio::test]
async fn a_source_refusing_many_webhooks_is_reported_once() {
    let app = TestApp::spawn().await;
    app.admin_post(
        "/v1/sources",
        json!({"name": "signed", "kind": "hmac", "secrets": ["s3cret-s3cret-s3cret"],
               "hmac": {"header": "X-Signature", "algorithm": "sha256", "encoding": "hex"}}),
        201,
    )
    .await;
    app.admin_post(
        "/v1/sources",
        json!({"name": "quiet", "kind": "hmac", "secrets": ["s3cret-s3cret-s3cret"],
                                         "hmac": {"header": "X-Signature", "algorithm": "sha256", "encoding": "hex"}}),
        201,
    )
    .await;
    let post = |source: &'static str| {
        let http = reqwest::Client::new();
        let url = app.url(&format!("/ingest/{source}"));
        async move { http.post(url).header("x-signature", "00".repeat(32)).body("{}").send().await.expect("post").status() }
    };
    for _ in 0..25 {
        assert_eq!(post("signed").await, 401);
    }
    for _ in 0..3 {
        assert_eq!(post("quiet").await, 401);
    }
    let event = eventually(Duration::from_secs(10), "source.refusing stored", || async {
        let body: Option<Value> = sqlx::query_scalar(
            "SELECT convert_from(payload, 'UTF8')::jsonb FROM events WHERE event_type = 'source.refusing'",
        )
        .fetch_optional(&app.db.pool)
        .await
        .expect("event");
        body
    })
    .await;
    assert_eq!(event["data"]["source"], "signed", "{event}");
    assert!(event["data"]["refused"].as_u64().unwrap() >= 20, "{event}");
    assert!(event["data"]["reasons"].as_object().is_some_and(|r| !r.is_empty()), "{event}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(stored(&app.db, "source.refusing").await, 1, "once for the minute, never for the quiet source");
}

/// Turned off, nothing is published.
#[tokio::test]
async fn operational_events_can_be_turned_off() {
    let mut settings = test_settings();
    settings.operational.enabled = false;
    let app = TestApp::spawn_with(TestDb::new().await, settings, 8).await;
    let ep = app.endpoint_for("http://127.0.0.1:9/", Some("api")).await;
    app.admin_post(&format!("/v1/endpoints/{ep}/pause"), json!({}), 200).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let all: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM events e JOIN sources s ON s.id = e.source_id WHERE s.name = '_gateway'",
    )
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(all, 0);
}

/// An event retention should have deleted, still stored past the grace, raises
/// `retention.behind` once; once it is gone, `retention.recovered`. An old event whose
/// delivery is still pending is kept on purpose and raises nothing.
#[tokio::test]
async fn retention_behind_is_raised_once_and_cleared_once() {
    let db = TestDb::new().await;
    let pool = webhook_gateway::db::connect(&db.url, 2).await.expect("pool");
    let settings = webhook_gateway::operational::OperationalSettings {
        events_retention: Duration::from_secs(86_400),
        retention_grace: Duration::from_secs(3600),
        ..Default::default()
    };
    let ep = crate::support::insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    let old_event = |key: &'static str| {
        sqlx::query_scalar::<_, uuid::Uuid>(
            "INSERT INTO events (source_id, dedupe_key, event_type, headers, payload, received_at)
             VALUES ((SELECT id FROM sources WHERE name = 'api'), $1, 't', '{}', '\\x7b7d', now() - interval '2 days')
             RETURNING id",
        )
        .bind(key)
        .fetch_one(&db.pool)
    };
    // Kept on purpose: its delivery is pending.
    let kept = old_event("kept").await.unwrap();
    sqlx::query("INSERT INTO deliveries (event_id, endpoint_id) VALUES ($1, $2::uuid)")
        .bind(kept)
        .bind(&ep)
        .execute(&db.pool)
        .await
        .unwrap();
    let checks = || webhook_gateway::operational::check_fleet(&pool, &settings);
    checks().await.unwrap();
    assert_eq!(stored(&db, "retention.behind").await, 0, "a pending delivery keeps its event");
    let expired = old_event("expired").await.unwrap();
    checks().await.unwrap();
    checks().await.unwrap();
    assert_eq!(stored(&db, "retention.behind").await, 1);
    sqlx::query("DELETE FROM events WHERE id = $1").bind(expired).execute(&db.pool).await.unwrap();
    checks().await.unwrap();
    checks().await.unwrap();
    assert_eq!(stored(&db, "retention.recovered").await, 1);
    assert_eq!(stored(&db, "retention.behind").await, 1);
}
