//! A leasing ingest statement meets an endpoint row that another transaction holds (a
//! claim, another writer's lease, an update of the endpoint): it does not wait for it.
//! That endpoint is granted nothing (its deliveries are stored pending and handed over by
//! id, as when no worker slot is free) and every other endpoint is leased as before, so
//! ingest answers while the row is held and the claim that follows waits in the
//! dispatcher instead (migration 0033).

use std::time::Duration;

use serde_json::json;
use webhook_gateway::ids::DeliveryId;
use webhook_gateway::queue::FreshClaim;
use webhook_gateway::store::events::{ClaimTerms, NewEvent, insert_and_claim, insert_batch_and_claim};

use crate::prelease::{lease_of, shop_event};
use crate::support::sink::Sink;
use crate::support::{TestApp, TestDb, count_status, eventually, owned_event, source_id};

const WAIT: Duration = Duration::from_secs(60);

/// A transaction holding the rows of `endpoints` as a claim holds them (`FOR NO KEY
/// UPDATE`, which leaves the foreign key checks of plain inserts free to pass).
pub(crate) async fn hold_as_a_claim(pool: &webhook_gateway::db::Pool, endpoints: &[&str]) -> webhook_gateway::db::Tx {
    let mut holder = pool.begin().await.expect("begin");
    let ids: Vec<uuid::Uuid> = endpoints.iter().map(|id| id.parse().expect("endpoint id")).collect();
    let held: i64 = sqlx::query_scalar(
        "WITH l AS (SELECT id FROM endpoints WHERE id = ANY($1) FOR NO KEY UPDATE) SELECT count(*) FROM l",
    )
    .bind(&ids)
    .fetch_one(&mut *holder)
    .await
    .expect("lock the endpoints");
    assert_eq!(held, ids.len() as i64, "every endpoint held");
    holder
}

/// A pool on `db` whose sessions give up any lock wait after a second (`lock_timeout`,
/// error 55P03): a statement that waited for a held row fails instead of passing. It
/// measures only time spent waiting for a lock, so a slow machine cannot trip it.
pub(crate) async fn pool_that_never_waits_for_locks(db: &TestDb) -> webhook_gateway::db::Pool {
    // In the URL: a database's own `lock_timeout` is not the gateway's (`server_settings`).
    let joiner = if db.url.contains('?') { '&' } else { '?' };
    let url = format!("{}{joiner}options=-c%20lock_timeout%3D1s", db.url);
    let pool = webhook_gateway::db::connect(&url, 4).await.expect("connect");
    let set: String = sqlx::query_scalar("SHOW lock_timeout").fetch_one(&pool).await.expect("lock_timeout");
    assert_eq!(set, "1s", "the URL's lock_timeout");
    pool
}

/// Whether `err` is PostgreSQL's "lock not available" (a lock wait past `lock_timeout`).
fn gave_up_waiting(err: &sqlx::Error) -> bool {
    err.as_database_error().and_then(|e| e.code()).as_deref() == Some("55P03")
}

/// The deliveries of `stored` that `fresh` did not lease.
fn unleased(stored: Vec<DeliveryId>, fresh: &FreshClaim) -> Vec<DeliveryId> {
    stored.into_iter().filter(|id| fresh.claimed.iter().all(|job| job.id != *id)).collect()
}

/// Leasing statements of every shape, run while the endpoint `held` is held as a claim
/// holds it, on sessions that fail any lock wait: a lone webhook to `held` alone (the
/// room function's path for one endpoint), one to `held` and `free` (its path for
/// several), and a batch of both (the batch's). None waits; `held` is granted nothing
/// (each of its deliveries stored pending, attempt not spent, and named among those left
/// to claim), `free` is leased by each statement. Once the holder lets go, a claim by key
/// takes what was left. Control: the room functions of the release before (`v4`, `v2`),
/// which waited for the row, fail on the same sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leasing_statement_does_not_wait_for_an_endpoint_row_another_transaction_holds() {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    let held = app.endpoint_for("http://127.0.0.1:9/held", Some("shop")).await;
    let free =
        app.endpoint_with("http://127.0.0.1:9/free", json!({"source": "shop", "event_types": ["order.both"]})).await;
    let pool = &app.db.pool;
    let impatient = pool_that_never_waits_for_locks(&app.db).await;
    let terms = ClaimTerms { limit: 8, lease: Duration::from_secs(300), default_max_in_flight: 100 };
    let headers = json!({});
    let holder = hold_as_a_claim(pool, &[&held]).await;

    let mut left = Vec::new();
    let one = NewEvent { event_type: "order.one", ..shop_event(pool, "lone-one", &headers).await };
    let (stored, fresh) = insert_and_claim(&impatient, &one, terms).await.expect("a lone webhook to the held endpoint");
    assert!(fresh.claimed.is_empty(), "nothing leased for the held endpoint");
    assert_eq!(stored.deliveries.len(), 1, "its delivery left to claim");
    left.extend(stored.deliveries);

    let both = NewEvent { event_type: "order.both", ..shop_event(pool, "lone-both", &headers).await };
    let (stored, fresh) = insert_and_claim(&impatient, &both, terms).await.expect("a lone webhook to both");
    let leased: Vec<String> = fresh.claimed.iter().map(|job| job.endpoint_id.to_string()).collect();
    assert_eq!(leased, vec![free.clone()], "the free endpoint leased, the held one not");
    assert!(!fresh.took_all, "the held endpoint's delivery left to claim");
    left.extend(unleased(stored.deliveries, &fresh));

    let source = source_id(pool, "shop").await;
    let batch = [
        owned_event(source, "shop", "batch-one", "order.one"),
        owned_event(source, "shop", "batch-both", "order.both"),
        owned_event(source, "shop", "batch-both-2", "order.both"),
    ];
    let (stored, fresh) = insert_batch_and_claim(&impatient, &batch, terms).await.expect("a batch");
    assert_eq!(fresh.claimed.len(), 2, "the free endpoint's two deliveries leased");
    assert!(fresh.claimed.iter().all(|job| job.endpoint_id.to_string() == free));
    let batch_left = unleased(stored.into_iter().flat_map(|s| s.deliveries).collect(), &fresh);
    assert_eq!(batch_left.len(), 3, "the held endpoint's three deliveries left to claim");
    left.extend(batch_left);

    let held_rows = lease_of(pool, &held).await;
    assert_eq!(held_rows.len(), 5);
    assert!(held_rows.iter().all(|row| (row.1, row.2, row.3) == (0, 0, false)), "pending, untouched: {held_rows:?}");
    let free_rows = lease_of(pool, &free).await;
    assert_eq!(free_rows.len(), 3);
    assert!(free_rows.iter().all(|row| row.0 && row.3), "each leased by its own statement: {free_rows:?}");

    // Control: the functions that waited for the row give up on these sessions.
    for (function, asked) in
        [("wg_lease_room_v4", vec![held.clone()]), ("wg_lease_room_v2", vec![held.clone(), held.clone()])]
    {
        let asked: Vec<uuid::Uuid> = asked.iter().map(|id| id.parse().expect("id")).collect();
        let err = sqlx::query(&format!("SELECT * FROM {function}($1, 8, 100)"))
            .bind(&asked)
            .fetch_all(&impatient)
            .await
            .expect_err("the previous room function waits for the held row");
        assert!(gave_up_waiting(&err), "{function}: {err}");
    }

    holder.commit().await.expect("let the endpoint go");
    let claimed =
        webhook_gateway::queue::claim_fresh(pool, &left, 8, Duration::from_secs(300), 100).await.expect("claim");
    assert_eq!(claimed.claimed.len(), 5, "a claim by key takes what the statements left");
    assert!(claimed.claimed.iter().all(|job| job.attempt == 1), "on their first attempt");
}

/// End to end (role `all`): a webhook posted while a claim holds its endpoint's row is
/// answered while the row is still held, is not sent meanwhile (the claim that takes it
/// waits for the row), and once the row is let go it is delivered once, on its first
/// attempt. Before, ingest's statement waited for the row, and the answer with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ingest_answers_while_a_claim_holds_the_endpoint_and_delivers_once_it_lets_go() {
    let app = TestApp::spawn().await;
    let sink = Sink::ok().await;
    app.source_none("shop").await;
    let ep = app.endpoint_for(&sink.url("/"), Some("shop")).await;
    // The dispatcher's first claim has run: it owes none, and leases at ingest.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pool = &app.db.pool;
    let holder = hold_as_a_claim(pool, &[&ep]).await;

    let (status, body) = tokio::time::timeout(WAIT, app.ingest("shop", "held-1", "order.created", "{}"))
        .await
        .expect("answered while the endpoint is held");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["duplicate"], false, "{body}");
    assert_eq!(app.db.count("events").await, 1, "stored");
    assert_eq!(lease_of(pool, &ep).await.iter().filter(|row| row.3).count(), 0, "not leased while held");
    assert_eq!(sink.count(), 0, "nothing sent while the row is held");

    holder.commit().await.expect("let the endpoint go");
    eventually(WAIT, "delivered", || async { (count_status(pool, "delivered").await == 1).then_some(()) }).await;
    assert_eq!(sink.count(), 1, "once");
    assert_eq!(sink.received()[0].header("webhook-attempt"), "1", "on its first attempt");
}
