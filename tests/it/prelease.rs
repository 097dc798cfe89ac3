//! The pre-leased hand-off (`deliver::prelease`): a lone webhook's deliveries leased by
//! the statement that stores them, within every limit of a claim, across replicas, and
//! given back when no worker receives them.

use std::time::Duration;

use serde_json::json;
use webhook_gateway::deliver::DeliverySettings;
use webhook_gateway::deliver::prelease::{self, Prelease};
use webhook_gateway::store::events::NewEvent;

use crate::support::sink::{Reply, Sink};
use crate::support::{TestApp, TestDb, count_status, eventually, source_id, test_settings};

const WAIT: Duration = Duration::from_secs(60);

/// Per delivery of `endpoint`, oldest event first: whether it was leased by the
/// transaction that inserted its event (its row version is that transaction's), its claim
/// token, its attempt count and whether it is leased.
pub(crate) async fn lease_of(pool: &webhook_gateway::db::Pool, endpoint: &str) -> Vec<(bool, i64, i32, bool)> {
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

/// How many deliveries of the event stored under `key` are still as the transaction that
/// stored it left them, leased (before their outcome is written).
pub(crate) async fn leased_by_ingest(pool: &webhook_gateway::db::Pool, key: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM deliveries d JOIN events e ON e.id = d.event_id
         WHERE e.dedupe_key = $1 AND d.xmin::text = e.xmin::text AND d.leased_until IS NOT NULL",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .expect("count")
}

/// An event of the source `shop` keyed `key`, to store without the HTTP front.
pub(crate) async fn shop_event<'a>(
    pool: &webhook_gateway::db::Pool,
    key: &'a str,
    headers: &'a serde_json::Value,
) -> NewEvent<'a> {
    NewEvent {
        source_id: source_id(pool, "shop").await,
        source_name: "shop",
        indexing: webhook_gateway::search::Indexing::Content,
        dedupe_key: key,
        event_type: "order.created",
        content_type: Some("application/json"),
        headers,
        payload: b"{}",
        ordering_key: None,
        trace: None,
        terms: None,
    }
}

/// Settings of a gateway (role `all`) that polls only every 10 s: once its first claim
/// found nothing, nothing but ingest's hand-offs wakes it during the test.
pub(crate) fn quiet() -> webhook_gateway::app::Settings {
    let mut settings = test_settings();
    settings.delivery.poll_interval = Duration::from_secs(10);
    settings
}

pub(crate) async fn quiet_gateway() -> TestApp {
    TestApp::spawn_with(TestDb::new().await, quiet(), 32).await
}

/// A source `shop` and an endpoint at `url` subscribed to it, limited to `max` requests in
/// flight; returns the endpoint's id once the dispatcher's first claim has run.
async fn capped_endpoint(app: &TestApp, url: &str, max: i32) -> String {
    app.source_none("shop").await;
    let ep = app.endpoint_for(url, Some("shop")).await;
    let (status, view) =
        app.admin(reqwest::Method::PATCH, &format!("/v1/endpoints/{ep}"), Some(json!({"max_in_flight": max}))).await;
    assert_eq!(status, 200, "{view}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    ep
}

/// Webhooks posted one at a time to a gateway with idle workers, fanned out to two
/// endpoints whose subscriber holds each request: every delivery is already leased
/// (attempt 1) by the transaction that stored its webhook when the producer gets its
/// answer, and each arrives once, on its first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lone_webhook_s_deliveries_are_leased_by_the_statement_that_stores_them() {
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
            let (same_transaction, token, attempt, leased) = leases[i];
            assert!(same_transaction && token > 0 && leased, "webhook {i}: leased in its own commit: {leases:?}");
            assert_eq!(attempt, 1);
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

/// A webhook fanned out to more endpoints than the dispatcher has free workers: the
/// statement leases one delivery per free worker, the rest are claimed by key after it,
/// and each arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fan_out_wider_than_the_free_workers_is_leased_up_to_them_and_the_rest_claimed_after() {
    let mut settings = quiet();
    settings.delivery.workers = 2;
    let app = TestApp::spawn_with(TestDb::new().await, settings, 32).await;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_millis(500))).await;
    app.source_none("shop").await;
    for path in ["/a", "/b", "/c"] {
        app.endpoint_for(&sink.url(path), Some("shop")).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, body) = app.ingest("shop", "wide-1", "order.created", "{}").await;
    assert_eq!(status, 200, "{body}");
    // The subscriber holds each request: no outcome is written yet.
    assert_eq!(leased_by_ingest(&app.db.pool, "wide-1").await, 2, "two workers free: two leased by the statement");
    eventually(WAIT, "all delivered", || async { (count_status(&app.db.pool, "delivered").await == 3).then_some(()) })
        .await;
    assert_eq!(sink.count(), 3, "each once");
    assert!(sink.max_concurrent() <= 2, "never more requests than workers");
}

/// A transaction holding the row of the source named `source` (`FOR UPDATE`): a statement
/// that stores a webhook of it waits until the transaction ends, at its foreign key
/// check, which runs at the statement's end, after its leases are taken. (Holding the
/// endpoint's row instead no longer makes a leasing statement wait: it leases nothing for
/// an endpoint another transaction holds, `prelease_locked`.)
pub(crate) async fn hold_source(pool: &webhook_gateway::db::Pool, source: &str) -> webhook_gateway::db::Tx {
    let mut holder = pool.begin().await.expect("begin");
    let held = sqlx::query("SELECT 1 FROM sources WHERE name = $1 FOR UPDATE")
        .bind(source)
        .execute(&mut *holder)
        .await
        .expect("lock the source");
    assert_eq!(held.rows_affected(), 1, "the source {source} held");
    holder
}

/// Claim by key, as the dispatcher does after a commit, the deliveries of `stored` that no
/// statement leased (`leased`, their claim tokens' owners); the tokens of what it took.
/// A leasing statement skips an endpoint row another transaction holds, so racing
/// statements may leave an endpoint's room unfilled; the claim after them fills it.
pub(crate) async fn claim_the_rest(
    pool: &webhook_gateway::db::Pool,
    stored: Vec<webhook_gateway::ids::DeliveryId>,
    leased: &[webhook_gateway::ids::DeliveryId],
) -> Vec<i64> {
    let rest: Vec<_> = stored.into_iter().filter(|id| !leased.contains(id)).collect();
    let claimed = webhook_gateway::queue::claim_fresh(pool, &rest, 1_000, Duration::from_secs(300), 100)
        .await
        .expect("claim by key");
    claimed.claimed.iter().map(|job| job.claim_token).collect()
}

/// Backends of this test's database waiting for a lock.
pub(crate) async fn lock_waiters(pool: &webhook_gateway::db::Pool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(pool)
    .await
    .expect("pg_stat_activity")
}

/// A webhook that arrives while another's commit is in flight is written by a writer
/// task, as a batch of one: its deliveries are leased by the statement that stores it
/// too, not claimed by key after its commit. Here the first webhook's statement waits on
/// its source's row, locked by another transaction, while the second arrives (for an
/// endpoint of its own: the first's statement holds its endpoint's row, which a second
/// lease would skip); then the lock is let go. Control: the writer's batch of one stored
/// plainly (as before), the second's delivery is leased by a claim after its commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_webhook_arriving_during_another_s_commit_is_leased_by_its_own_statement_too() {
    // Each statement reserves up to MOST_LEASED_PER_WEBHOOK worker slots while it runs:
    // enough workers that the first's reservation leaves some for the second.
    let mut settings = quiet();
    settings.delivery.workers = 4 * prelease::MOST_LEASED_PER_WEBHOOK;
    let app = TestApp::spawn_with(TestDb::new().await, settings, 32).await;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_secs(3))).await;
    app.source_none("shop").await;
    for kind in ["order.first", "order.second"] {
        app.endpoint_with(&sink.url("/"), json!({"source": "shop", "event_types": [kind]})).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pool = &app.db.pool;

    let holder = hold_source(pool, "shop").await;
    let first = app.ingest("shop", "during-0", "order.first", "{}");
    let second_then_let_go = async {
        eventually(WAIT, "the first webhook's statement waits on the source", || async {
            (lock_waiters(pool).await == 1).then_some(())
        })
        .await;
        let second = app.ingest("shop", "during-1", "order.second", "{}");
        let let_go = async {
            // The second's statement waits on the source too, after its lease.
            eventually(WAIT, "the second webhook's statement waits on the source", || async {
                (lock_waiters(pool).await == 2).then_some(())
            })
            .await;
            holder.commit().await.expect("let the source go");
        };
        tokio::join!(second, let_go).0
    };
    let (first, second) = tokio::join!(first, second_then_let_go);
    assert_eq!(first.0, 200, "{}", first.1);
    assert_eq!(second.0, 200, "{}", second.1);

    // The subscriber holds each request: no outcome is written yet.
    assert_eq!(leased_by_ingest(pool, "during-0").await, 1, "the first: leased by its statement");
    assert_eq!(leased_by_ingest(pool, "during-1").await, 1, "the second, written by a writer: leased by its statement");
    eventually(WAIT, "both delivered", || async { (count_status(pool, "delivered").await == 2).then_some(()) }).await;
    assert_eq!(sink.count(), 2, "each once");
    assert!(sink.received().iter().all(|r| r.header("webhook-attempt") == "1"), "each on its first attempt");
}

/// An endpoint limited to one request in flight, its subscriber holding each for a
/// second: the second and third lone webhooks find no room in their statements and are
/// left pending (not leased), the first's request is the only one in flight, and all
/// three arrive once, one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_in_the_ingest_statement_keeps_the_endpoint_s_limit() {
    let app = quiet_gateway().await;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_secs(1))).await;
    let ep = capped_endpoint(&app, &sink.url("/"), 1).await;
    for i in 0..3 {
        let (status, body) = app.ingest("shop", &format!("capped-{i}"), "order.created", "{}").await;
        assert_eq!(status, 200, "{body}");
    }
    let leases = lease_of(&app.db.pool, &ep).await;
    assert!(leases[0].0 && leases[0].3, "the first is leased in its own commit: {leases:?}");
    for (i, lease) in leases.iter().enumerate().skip(1) {
        assert_eq!((lease.1, lease.3), (0, false), "webhook {i}: no room, so not leased (nor since): {lease:?}");
    }
    eventually(WAIT, "all delivered", || async { (count_status(&app.db.pool, "delivered").await == 3).then_some(()) })
        .await;
    assert_eq!(sink.max_concurrent(), 1, "one request in flight at most");
    assert_eq!(sink.count(), 3, "each once");
}

/// Two replicas (role `all`) on one database, each storing lone webhooks one after
/// another for the same endpoint, limited to two requests in flight across the fleet:
/// the ingest statements of both race each other and both dispatchers' claims, and the
/// limit holds; every webhook arrives once, some of them leased by their own statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_leasing_in_their_ingest_statements_keep_the_fleet_s_limit() {
    let db = TestDb::new().await;
    let twin = TestDb { url: db.url.clone(), pool: db.pool.clone() };
    let first = TestApp::spawn_with(db, quiet(), 32).await;
    let second = TestApp::spawn_with(twin, quiet(), 32).await;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_millis(200))).await;
    capped_endpoint(&first, &sink.url("/"), 2).await;
    const EACH: usize = 15;
    let pool = first.db.pool.clone();
    let post = |app: &TestApp, name: &'static str| {
        let (http, url, pool) = (app.http.clone(), app.url("/ingest/shop"), pool.clone());
        async move {
            let mut leased = 0;
            for i in 0..EACH {
                let key = format!("{name}-{i}");
                let resp = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .header("x-delivery-id", &key)
                    .header("x-event-type", "order.created")
                    .body("{}")
                    .send()
                    .await
                    .expect("ingest");
                assert_eq!(resp.status().as_u16(), 200);
                // Held by the subscriber: a lease the statement took is still its own.
                leased += leased_by_ingest(&pool, &key).await;
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            leased
        }
    };
    let (one, two) = tokio::join!(post(&first, "one"), post(&second, "two"));
    eventually(WAIT, "all delivered", || async {
        (count_status(&first.db.pool, "delivered").await == 2 * EACH as i64).then_some(())
    })
    .await;
    assert!(sink.max_concurrent() <= 2, "at most two in flight across both replicas: {}", sink.max_concurrent());
    assert_eq!(sink.count(), 2 * EACH, "each once");
    assert!(one + two >= 1, "the ingest statements leased some ({one} and {two})");
}

/// A webhook with an ordering key is not leased by its ingest statement (its fan-out
/// locks the line's row, and the claim would lock the endpoint's after it); it is claimed
/// after its commit, and arrives. The same source's webhook without a key is leased by its
/// statement (the control).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_webhook_with_an_ordering_key_is_claimed_after_its_commit_not_by_its_statement() {
    let app = quiet_gateway().await;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_millis(500))).await;
    crate::ordering::ordered_setup(&app, &sink, "skip").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let post = |key: &'static str, line: Option<&'static str>| {
        let mut request = app
            .http
            .post(app.url("/ingest/ord"))
            .header("content-type", "application/json")
            .header("x-delivery-id", key)
            .body("{}");
        if let Some(line) = line {
            request = request.header("x-key", line);
        }
        async move { request.send().await.expect("ingest").status().as_u16() }
    };
    assert_eq!(post("keyed-1", Some("customer-1")).await, 200);
    assert_eq!(leased_by_ingest(&app.db.pool, "keyed-1").await, 0, "an ordered delivery is not leased by ingest");
    eventually(WAIT, "the ordered one delivered", || async {
        (count_status(&app.db.pool, "delivered").await == 1).then_some(())
    })
    .await;
    assert_eq!(post("plain-1", None).await, 200);
    assert_eq!(leased_by_ingest(&app.db.pool, "plain-1").await, 1, "without a key it is");
    eventually(WAIT, "both delivered", || async { (count_status(&app.db.pool, "delivered").await == 2).then_some(()) })
        .await;
    assert_eq!(sink.count(), 2, "each once");
}

/// An ingest statement with a lease that the database refuses (here: the function that
/// grants its room is gone) stores nothing; the webhook is then stored the plain way, answered as new, and
/// delivered once by the general claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_leasing_statement_falls_back_to_the_plain_write() {
    let app = quiet_gateway().await;
    let sink = Sink::ok().await;
    app.source_none("shop").await;
    app.endpoint_for(&sink.url("/"), Some("shop")).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query("DROP FUNCTION wg_lease_room_v5").execute(&app.db.pool).await.expect("drop");
    let (status, body) = app.ingest("shop", "refused-1", "order.created", "{}").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["duplicate"], false, "stored once, by the plain write: {body}");
    eventually(WAIT, "delivered", || async { (count_status(&app.db.pool, "delivered").await == 1).then_some(()) })
        .await;
    assert_eq!(app.db.count("events").await, 1);
    assert_eq!(sink.count(), 1);
}

/// A process that dies right after its leasing statement committed (here: the statement
/// is run and its answer thrown away, as if the connection or the process went at that
/// instant): nobody holds the leases, and when they run out the delivery is claimed again
/// and sent once, as its second attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_stranded_by_a_death_after_the_commit_are_claimed_again_when_they_run_out() {
    let app = TestApp::spawn().await;
    let sink = Sink::ok().await;
    app.source_none("shop").await;
    app.endpoint_for(&sink.url("/"), Some("shop")).await;
    let pool = &app.db.pool;
    let headers = json!({});
    let event = shop_event(pool, "stranded-1", &headers).await;
    let terms = webhook_gateway::store::events::ClaimTerms {
        limit: 8,
        lease: Duration::from_secs(2),
        default_max_in_flight: 4,
    };
    let (stored, fresh) = webhook_gateway::store::events::insert_and_claim(pool, &event, terms).await.expect("stored");
    assert_eq!((stored.deliveries.len(), fresh.claimed.len()), (1, 1), "stored and leased");
    drop(fresh);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(sink.count(), 0, "nobody sends while the stranded lease lasts");
    eventually(WAIT, "delivered after the lease ran out", || async {
        (count_status(pool, "delivered").await == 1).then_some(())
    })
    .await;
    assert_eq!(sink.count(), 1, "sent once");
    assert_eq!(sink.received()[0].header("webhook-attempt"), "2", "the stranded lease spent the first attempt");
}

/// A gateway without delivery (role `ingest`) with a source `shop` and an endpoint
/// subscribed to it, and an open hand-off of 4 worker slots whose dispatcher's end the
/// test holds: what a leasing statement hands over is seen there.
pub(crate) async fn hand_off_without_dispatcher() -> (TestApp, String, std::sync::Arc<Prelease>, prelease::Received) {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    let ep = app.endpoint_for("http://127.0.0.1:9/", Some("shop")).await;
    let settings = DeliverySettings { workers: 4, ..test_settings().delivery };
    let (shared, received) = Prelease::new(&settings);
    shared.set_owed_general(false);
    (app, ep, shared, received)
}

/// Leases that no worker receives (the dispatcher is gone without closing the hand-off)
/// are given back at once, fenced: pending again, the attempt not spent; the next claim
/// gets it with a new token, on its first attempt; and the same webhook stored again is a
/// duplicate with nothing leased.
#[tokio::test]
async fn leases_that_no_worker_receives_are_given_back() {
    let (app, ep, shared, received) = hand_off_without_dispatcher().await;
    let pool = &app.db.pool;
    drop(received);

    let headers = json!({});
    let event = shop_event(pool, "unsent-1", &headers).await;
    assert!(shared.takes(&event));
    let stored = prelease::store_leasing(pool, &event, &shared).await.expect("stored");
    assert!(!stored.duplicate);
    assert!(stored.deliveries.is_empty(), "its one delivery was leased by the statement");
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
    assert!(token > 0, "the lease's token is used up");
    assert_eq!((attempts, status.as_str()), (0, "pending"), "pending, attempt not spent");
    let leased = webhook_gateway::queue::claim(pool, 10, Duration::from_secs(60)).await.expect("claim");
    assert_eq!(leased.len(), 1, "due again at once");
    assert!(leased[0].claim_token > token, "a new token");
    assert_eq!(leased[0].attempt, 1, "the first attempt");

    let again = prelease::store_leasing(pool, &event, &shared).await.expect("stored again");
    assert!(again.duplicate);
    assert!(again.deliveries.is_empty());
    assert_eq!(app.db.count("deliveries").await, 1);
}
