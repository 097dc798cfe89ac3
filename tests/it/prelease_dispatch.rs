//! The dispatcher's end of the pre-leased hand-off (`deliver::dispatcher`): what ingest
//! leases starts at once, whatever the dispatcher is doing meanwhile.

use std::time::Duration;

use webhook_gateway::deliver::dispatcher::MAX_CLAIM_BATCH;
use webhook_gateway::deliver::prelease::MOST_LEASED_PER_WEBHOOK;

use crate::prelease::{leased_by_ingest, lock_waiters, quiet};
use crate::support::sink::Sink;
use crate::support::{TestApp, TestDb, eventually};

/// A claim waits for an endpoint's row (here: held by a transaction of the test, as a
/// burst of ingest commits holds it in production) while ingest leases another
/// endpoint's delivery: that delivery is sent at once, not when the claim returns.
/// The claim is the claim by key of an ordered webhook's delivery (ingest stores an
/// ordered one without leasing it and hands it over by id). Control: with the leases
/// started only between claims, the second endpoint hears nothing until the row is let
/// go, and the test fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_handed_over_during_a_claim_starts_before_the_claim_returns() {
    // A claim holds the free worker slots it may fill (up to MAX_CLAIM_BATCH) while it
    // runs: enough workers that some are left for ingest's lease, as with the defaults.
    let mut settings = quiet();
    settings.delivery.workers = MAX_CLAIM_BATCH + 2 * MOST_LEASED_PER_WEBHOOK;
    let app = TestApp::spawn_with(TestDb::new().await, settings, 32).await;
    let sink = Sink::ok().await;
    let held = crate::ordering::ordered_setup(&app, &sink, "skip").await;
    app.source_none("shop").await;
    app.endpoint_for(&sink.url("/free"), Some("shop")).await;
    // The dispatcher's first (general) claim, which opens the hand-off, has run.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pool = &app.db.pool;

    // Held as a claim holds it: the ingest statement's foreign key check still passes.
    let mut holder = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM endpoints WHERE id = $1::uuid FOR NO KEY UPDATE")
        .bind(&held)
        .execute(&mut *holder)
        .await
        .expect("hold the endpoint");
    crate::ordering::ingest(&app, "customer-1", 1).await;
    eventually(Duration::from_secs(30), "the claim by key waits for the held row", || async {
        (lock_waiters(pool).await == 1).then_some(())
    })
    .await;

    let (status, body) = app.ingest("shop", "free-1", "order.created", "{}").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(leased_by_ingest(pool, "free-1").await, 1, "leased by its ingest statement");
    eventually(Duration::from_secs(10), "the leased delivery sent while the claim still waits", || async {
        sink.received().iter().any(|r| r.path == "/free").then_some(())
    })
    .await;
    assert_eq!(lock_waiters(pool).await, 1, "the claim was still waiting");

    holder.commit().await.expect("let go");
    eventually(Duration::from_secs(60), "both delivered", || async { (sink.count() == 2).then_some(()) }).await;
}
