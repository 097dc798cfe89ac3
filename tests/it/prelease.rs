//! The pre-leased hand-off (`deliver::prelease`): a lone webhook's deliveries leased in the
//! commit that stores them, within every limit of a claim, and given back when no worker
//! receives them.

use std::time::Duration;

use serde_json::json;
use webhook_gateway::deliver::DeliverySettings;
use webhook_gateway::deliver::prelease::{self, Prelease};
use webhook_gateway::ids::SourceId;
use webhook_gateway::store::events::NewEvent;

use crate::support::sink::{Reply, Sink};
use crate::support::{TestApp, count_status, eventually, test_settings};

const WAIT: Duration = Duration::from_secs(60);

/// Per delivery of `endpoint`: whether it was leased in the transaction that inserted its
/// event (its row version is that transaction's), its claim token and attempt count.
async fn lease_of(pool: &webhook_gateway::db::Pool, endpoint: &str) -> Vec<(bool, i64, i32, bool)> {
    sqlx::query_as(
        "SELECT d.xmin::text = e.xmin::text, d.claim_token, d.attempt_count, d.leased_until IS NOT NULL
         FROM deliveries d JOIN events e ON e.id = d.event_id
         WHERE d.endpoint_id = $1::uuid ORDER BY e.received_at",
    )
    .bind(endpoint)
    .fetch_all(pool)
    .await
    .expect("deliveries")
}

/// A gateway (role `all`) that polls only every 10 s: once its first claim found nothing,
/// nothing but ingest's hand-offs wakes it during the test.
async fn quiet_gateway() -> TestApp {
    let mut settings = test_settings();
    settings.delivery.poll_interval = Duration::from_secs(10);
    TestApp::spawn_with(crate::support::TestDb::new().await, settings, 32).await
}

/// Webhooks posted one at a time to a gateway with idle workers, fanned out to two
/// endpoints whose subscriber holds each request: every delivery is already leased
/// (token 1, attempt 1) by the transaction that stored its webhook when the producer gets
/// its answer, and each arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lone_webhook_s_deliveries_are_leased_in_the_commit_that_stores_them() {
    let app = quiet_gateway().await;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_secs(3))).await;
    app.source_none("shop").await;
    let a = app.endpoint_for(&sink.url("/a"), Some("shop")).await;
    let b = app.endpoint_for(&sink.url("/b"), Some("shop")).await;
    // The dispatcher's first (general) claim, which opens the hand-off, has run once the
    // gateway answers; give it a moment all the same.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..3 {
        let (status, body) = app.ingest("shop", &format!("lone-{i}"), "order.created", "{}").await;
        assert_eq!(status, 200, "{body}");
        for endpoint in [&a, &b] {
            let leases = lease_of(&app.db.pool, endpoint).await;
            assert_eq!(leases.len(), i + 1);
            assert_eq!(leases[i], (true, 1, 1, true), "webhook {i}: leased in its own commit");
        }
    }
    eventually(WAIT, "all delivered", || async { (count_status(&app.db.pool, "delivered").await == 6).then_some(()) })
        .await;
    let mut ids: Vec<String> = sink.received().iter().map(|r| r.header("webhook-id")).collect();
    ids.sort();
    ids.dedup();
    assert_eq!((sink.count(), ids.len()), (6, 6), "each delivery once");
    assert!(sink.received().iter().all(|r| r.header("webhook-attempt") == "1"), "each on its first attempt");
}

/// An endpoint limited to one request in flight, its subscriber holding each for a
/// second: the second and third lone webhooks find no room in their commits and are left
/// pending (not leased), the first's request is the only one in flight, and all three
/// arrive once, one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_in_the_ingest_commit_keeps_the_endpoint_s_limit() {
    let app = quiet_gateway().await;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_secs(1))).await;
    app.source_none("shop").await;
    let ep = app.endpoint_for(&sink.url("/"), Some("shop")).await;
    let (status, view) =
        app.admin(reqwest::Method::PATCH, &format!("/v1/endpoints/{ep}"), Some(json!({"max_in_flight": 1}))).await;
    assert_eq!(status, 200, "{view}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..3 {
        let (status, body) = app.ingest("shop", &format!("capped-{i}"), "order.created", "{}").await;
        assert_eq!(status, 200, "{body}");
    }
    let leases = lease_of(&app.db.pool, &ep).await;
    assert_eq!(leases[0], (true, 1, 1, true), "the first is leased in its own commit");
    for (i, lease) in leases.iter().enumerate().skip(1) {
        assert_eq!((lease.1, lease.3), (0, false), "webhook {i}: no room, so not leased (nor since): {lease:?}");
    }
    eventually(WAIT, "all delivered", || async { (count_status(&app.db.pool, "delivered").await == 3).then_some(()) })
        .await;
    assert_eq!(sink.max_concurrent(), 1, "one request in flight at most");
    assert_eq!(sink.count(), 3, "each once");
}

/// Leases that no worker receives (the dispatcher is gone) are given back at once,
/// fenced: pending again, the attempt not spent, their token used up; and the same
/// webhook stored again through the hand-off is a duplicate with nothing leased.
#[tokio::test]
async fn leases_that_no_worker_receives_are_given_back() {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    let ep = app.endpoint_for("http://127.0.0.1:9/", Some("shop")).await;
    let pool = &app.db.pool;
    let source: (uuid::Uuid,) =
        sqlx::query_as("SELECT id FROM sources WHERE name = 'shop'").fetch_one(pool).await.expect("source");
    let settings = DeliverySettings { workers: 4, ..test_settings().delivery };
    let (shared, received) = Prelease::new(&settings);
    shared.set_owed_general(false);
    drop(received);
    assert!(!shared.open(), "nothing is leased for a dispatcher that is gone");

    let headers = json!({});
    let event = NewEvent {
        source_id: SourceId(source.0),
        dedupe_key: "unsent-1",
        event_type: "order.created",
        content_type: Some("application/json"),
        headers: &headers,
        payload: b"{}",
        ordering_key: None,
        trace: None,
    };
    let stored = prelease::store(pool, &event, &shared).await.expect("stored");
    assert!(!stored.duplicate);
    eventually(WAIT, "the lease given back", || async {
        let rows = lease_of(pool, &ep).await;
        (rows.len() == 1 && !rows[0].3).then_some(rows)
    })
    .await;
    let (token, attempts, status): (i64, i32, String) =
        sqlx::query_as("SELECT claim_token, attempt_count, status::text FROM deliveries WHERE endpoint_id = $1::uuid")
            .bind(&ep)
            .fetch_one(pool)
            .await
            .expect("delivery");
    assert_eq!((token, attempts, status.as_str()), (1, 0, "pending"), "pending, attempt not spent, token used up");
    let leased = webhook_gateway::queue::claim(pool, 10, Duration::from_secs(60)).await.expect("claim");
    assert_eq!(leased.len(), 1, "due again at once");
    assert_eq!((leased[0].claim_token, leased[0].attempt), (2, 1), "a fresh token; the first attempt");

    let again = prelease::store(pool, &event, &shared).await.expect("stored again");
    assert!(again.duplicate);
    assert!(again.deliveries.is_empty());
    assert_eq!(app.db.count("deliveries").await, 1);
}
