//! Delivery holds bodies by bytes in flight (`--delivery-memory-mib`), not by workers ×
//! the largest body: large bodies wait for room and are read only then, small ones pass
//! beside them, every body arrives byte for byte, and waiting spends no attempt.

use std::time::Duration;

use serde_json::json;

use crate::support::proxy::{Proxy, server_addr};
use crate::support::sink::{Reply, Sink};
use crate::support::{TestApp, TestDb, eventually, test_settings};

/// Webhook number `n`: a JSON body of a little over `bytes`, distinct from every other
/// number's and incompressible-looking (no two alike, so no dedupe).
fn large_body(n: usize, bytes: usize) -> String {
    let filler: String = (0..bytes).map(|i| char::from(b'a' + ((i * 7 + n * 13) % 26) as u8)).collect();
    json!({"n": n, "filler": filler}).to_string()
}

/// How long the sink holds each request: a request in progress at least this long.
const HOLD: Duration = Duration::from_millis(1000);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn large_bodies_are_sent_within_the_memory_budget_and_small_ones_pass_beside_them() {
    const LARGE: usize = 400 * 1024;
    let mut settings = test_settings();
    settings.max_body_bytes = 1024 * 1024;
    settings.delivery.workers = 16;
    settings.delivery.endpoint_max_in_flight = 16;
    // Each body counts twice: two 400 KiB bodies fit (1,600 KiB), a third does not.
    settings.delivery.body_memory_bytes = 2 * 1024 * 1024;
    let app = TestApp::spawn_with(TestDb::new().await, settings, 16).await;
    app.source_none("shop").await;
    let sink = Sink::start(|_, _| Reply::Hold(HOLD)).await;
    app.endpoint_for(&sink.url("/"), Some("shop")).await;

    let mut sent = Vec::new();
    for n in 0..6 {
        let body = large_body(n, LARGE);
        assert_eq!(app.ingest("shop", &format!("large-{n}"), "big", &body).await.0, 200);
        sent.push(body);
    }
    // Two large ones in flight (four waiting for room): now the small ones.
    eventually(Duration::from_secs(30), "two large in flight", || async { (sink.count() >= 2).then_some(()) }).await;
    for n in 0..4 {
        let body = json!({"n": n, "small": true}).to_string();
        assert_eq!(app.ingest("shop", &format!("small-{n}"), "small", &body).await.0, 200);
        sent.push(body);
    }
    eventually(Duration::from_secs(60), "every webhook delivered", || async { (sink.count() >= 10).then_some(()) })
        .await;

    let received = sink.received();
    let mut bodies: Vec<String> = received.iter().map(|r| String::from_utf8(r.body.to_vec()).unwrap()).collect();
    bodies.sort();
    sent.sort();
    assert_eq!(bodies, sent, "every body arrives once, byte for byte");

    // Each large request was in progress for at least HOLD after it arrived: three that
    // arrived within HOLD of one another were held at once, which the budget forbids.
    let mut large_arrivals: Vec<_> = received.iter().filter(|r| r.body.len() > LARGE).map(|r| r.at).collect();
    large_arrivals.sort();
    for three in large_arrivals.windows(3) {
        assert!(three[2] - three[0] >= HOLD, "three large bodies in flight at once: {:?}", three[2] - three[0]);
    }
    // The small ones did not queue behind the large ones waiting for room: each arrived
    // before the third large one (which waited for the first two to end).
    let third_large = large_arrivals[2];
    assert!(received.iter().filter(|r| r.body.len() < 1024).all(|r| r.at < third_large), "small ones passed");

    // Waiting for room spent no attempt.
    eventually(Duration::from_secs(30), "every outcome recorded", || async {
        (crate::support::count_status(&app.db.pool, "delivered").await == 10).then_some(())
    })
    .await;
    let attempts: Vec<i64> = sqlx::query_scalar("SELECT attempt_count::int8 FROM deliveries ORDER BY id")
        .fetch_all(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(attempts, vec![1; 10], "one attempt each");
}

/// A body the claim does not bring (over 64 KiB) is read before its transformation runs:
/// the handler sees the whole payload, and the endpoint receives what it returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_large_body_is_read_before_its_transformation_runs() {
    let mut settings = test_settings();
    settings.max_body_bytes = 1024 * 1024;
    let app = TestApp::spawn_with(TestDb::new().await, settings, 16).await;
    app.source_none("shop").await;
    let sink = Sink::ok().await;
    let script = "function handler(w) { return {n: w.payload.items.length, last: w.payload.items[w.payload.items.length - 1]}; }";
    app.endpoint_with(&sink.url("/"), json!({"source": "shop", "transform": script})).await;
    let items: Vec<String> = (0..20_000).map(|i| format!("item-{i}")).collect();
    let body = json!({"items": items}).to_string();
    assert!(body.len() > 200 * 1024, "{}", body.len());
    assert_eq!(app.ingest("shop", "big-1", "big", &body).await.0, 200);
    eventually(Duration::from_secs(30), "delivered", || async { (sink.count() >= 1).then_some(()) }).await;
    assert_eq!(&sink.received()[0].body[..], br#"{"n":20000,"last":"item-19999"}"#);
}

/// A large body that cannot be read when its room comes (the database is gone) is given
/// back without spending an attempt, and sent whole once the database is back: not left
/// to its lease, not lost, not counted as a try.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_large_body_that_cannot_be_read_is_given_back_and_sent_once_the_database_is_back() {
    const LARGE: usize = 200 * 1024;
    let db = TestDb::new().await;
    let proxy = Proxy::start(server_addr(&db.url)).await;
    let db = TestDb { url: proxy.url_for(&db.url), pool: db.pool };
    let mut settings = test_settings();
    settings.max_body_bytes = 1024 * 1024;
    settings.delivery.workers = 4;
    // Room for one large body (each counts twice), so the second waits for the first's.
    settings.delivery.body_memory_bytes = 2 * (LARGE as u64 + 16 * 1024);
    // No retention pass or operational checks: their connections would meet the outage too.
    settings.janitor.interval = Duration::from_secs(86_400);
    settings.operational.enabled = false;
    let lease = settings.delivery.lease;
    let app = TestApp::spawn_with(db, settings, 4).await;
    app.source_none("shop").await;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_millis(1500))).await;
    app.endpoint_for(&sink.url("/"), Some("shop")).await;

    let mut sent = Vec::new();
    for n in 0..2 {
        let body = large_body(n, LARGE);
        assert_eq!(app.ingest("shop", &format!("large-{n}"), "big", &body).await.0, 200);
        sent.push(body);
    }
    // Both claimed; the first in flight at the sink, the second waiting for its room.
    eventually(Duration::from_secs(30), "the first in flight, both leased", || async {
        let leased: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE leased_until IS NOT NULL")
            .fetch_one(&app.db.pool)
            .await
            .ok()?;
        (sink.count() >= 1 && leased == 2).then_some(())
    })
    .await;
    // The database goes away while the first is held: when its attempt ends, the second
    // gets the room and cannot read its body.
    proxy.down().await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    proxy.up().await;
    let back = std::time::Instant::now();

    eventually(Duration::from_secs(60), "both delivered and recorded", || async {
        (crate::support::count_status(&app.db.pool, "delivered").await == 2).then_some(())
    })
    .await;
    let received = sink.received();
    let mut bodies: Vec<String> = received.iter().map(|r| String::from_utf8(r.body.to_vec()).unwrap()).collect();
    bodies.sort();
    bodies.dedup();
    sent.sort();
    assert_eq!(bodies, sent, "both bodies arrive whole");
    let second = received.iter().map(|r| r.at).max().expect("arrivals");
    assert!(second > back, "the second was sent only once the database was back");
    assert!(
        second - back < lease / 2,
        "given back and claimed again, not left to its lease ({:?} after the database came back)",
        second - back
    );
    let attempts: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT d.attempt_count::int8, (SELECT count(*) FROM attempts a WHERE a.delivery_id = d.id)
         FROM deliveries d ORDER BY d.id",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(attempts, vec![(1, 1); 2], "the give-back spent no attempt");
}
