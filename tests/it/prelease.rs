//! The pre-leased hand-off (`deliver::prelease`): a lone webhook's deliveries leased by
//! the statement that stores them, within every limit of a claim, across replicas, and
//! given back when no worker receives them.

use std::time::Duration;

use serde_json::json;
use webhook_gateway::deliver::DeliverySettings;
use webhook_gateway::deliver::prelease::{self, Prelease};
use webhook_gateway::store::events::NewEvent;

use crate::support::sink::{Reply, Sink};
use crate::support::{TestApp, TestDb, count_status, eventually, owned_event, source_id, test_settings};

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

/// A transaction holding `endpoint`'s row locked (`FOR UPDATE`): a leasing statement for
/// it waits until the transaction ends.
pub(crate) async fn lock_endpoint(
    pool: &webhook_gateway::db::Pool,
    endpoint: &str,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut holder = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM endpoints WHERE id = $1::uuid FOR UPDATE")
        .bind(endpoint)
        .execute(&mut *holder)
        .await
        .expect("lock the endpoint");
    holder
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
/// its endpoint's row, locked by another transaction, while the second arrives; then the
/// lock is let go. Control: the writer's batch of one stored plainly (as before), the
/// second's delivery is leased by a claim after its commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_webhook_arriving_during_another_s_commit_is_leased_by_its_own_statement_too() {
    // Each statement reserves up to MOST_LEASED_PER_WEBHOOK worker slots while it runs:
    // enough workers that the first's reservation leaves some for the second.
    let mut settings = quiet();
    settings.delivery.workers = 4 * prelease::MOST_LEASED_PER_WEBHOOK;
    let app = TestApp::spawn_with(TestDb::new().await, settings, 32).await;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_secs(3))).await;
    app.source_none("shop").await;
    let ep = app.endpoint_for(&sink.url("/"), Some("shop")).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pool = &app.db.pool;

    let holder = lock_endpoint(pool, &ep).await;
    let first = app.ingest("shop", "during-0", "order.created", "{}");
    let second_then_let_go = async {
        eventually(WAIT, "the first webhook's statement waits on the endpoint", || async {
            (lock_waiters(pool).await == 1).then_some(())
        })
        .await;
        let second = app.ingest("shop", "during-1", "order.created", "{}");
        let let_go = async {
            // The second's statement waits on the endpoint too (leasing, for its lock;
            // stored plainly, for its foreign key's share lock).
            eventually(WAIT, "the second webhook's statement waits on the endpoint", || async {
                (lock_waiters(pool).await == 2).then_some(())
            })
            .await;
            holder.commit().await.expect("let the endpoint go");
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
    sqlx::query("DROP FUNCTION wg_lease_room_v4").execute(&app.db.pool).await.expect("drop");
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
async fn hand_off_without_dispatcher() -> (TestApp, String, std::sync::Arc<Prelease>, prelease::Received) {
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

/// The statement that stores a lone webhook and leases its delivery writes one version of
/// the delivery's row: inserted leased (attempt 1, a token, the lease's end), never
/// updated after. A claim after the insert wrote a second version, and PostgreSQL ran its
/// foreign key checks, CHECK constraints and index entries again (bench row 18). Counted
/// in the statement's own transaction (the full fan-out's and the lean one's), which is
/// then rolled back. Control: the same webhook stored pending, then claimed by key in the
/// same transaction, counts an update.
#[tokio::test]
async fn a_delivery_leased_by_its_ingest_statement_is_written_once() {
    use sqlx::Connection as _;
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    app.endpoint_for("http://127.0.0.1:9/", Some("shop")).await;
    let db = &app.db;
    let headers = json!({});
    let event = shop_event(&db.pool, "once-1", &headers).await;
    let versions = "SELECT pg_stat_get_xact_tuples_inserted('deliveries'::regclass),
                           pg_stat_get_xact_tuples_updated('deliveries'::regclass)";

    use webhook_gateway::store::events::{insert_and_claim_sql, lean};
    for (fan_out, sql) in [("full", insert_and_claim_sql()), ("lean", lean::insert_and_claim_sql())] {
        // A connection each: a backend's counts of a transaction it rolled back last until
        // it reports them.
        let mut conn = sqlx::PgConnection::connect(&db.url).await.expect("connect");
        sqlx::query("BEGIN").execute(&mut conn).await.expect("begin");
        let rows = crate::support::bound_event(sql, &event)
            .bind(8_i64)
            .bind(60.0_f64)
            .bind(4_i32)
            .fetch_all(&mut conn)
            .await
            .expect("ingest and lease");
        let leased: Vec<(uuid::Uuid, i32, i64)> = rows
            .iter()
            .filter_map(|row| {
                use sqlx::Row as _;
                let id: Option<uuid::Uuid> = row.try_get("id").expect("id");
                Some((id?, row.try_get("attempt").expect("attempt"), row.try_get("claim_token").expect("token")))
            })
            .collect();
        assert_eq!(leased.len(), 1, "{fan_out}: its one delivery leased");
        assert_eq!(leased[0].1, 1, "{fan_out}: on its first attempt");
        assert!(leased[0].2 > 0, "{fan_out}: with a token");
        let (inserted, updated): (i64, i64) = sqlx::query_as(versions).fetch_one(&mut conn).await.expect("counts");
        assert_eq!((inserted, updated), (1, 0), "{fan_out}: one row version");
        sqlx::query("ROLLBACK").execute(&mut conn).await.expect("rollback");
    }

    // Control: stored pending, then claimed by key.
    let mut conn = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    sqlx::query("BEGIN").execute(&mut conn).await.expect("begin");
    let stored = webhook_gateway::store::events::insert_in(&mut conn, &event).await.expect("stored").expect("new");
    let claimed: i64 = sqlx::query_scalar(&format!(
        "SELECT count(id) FROM {}($1, 8, 60, 4)",
        webhook_gateway::queue::CLAIM_FRESH_FUNCTION
    ))
    .bind(&stored.deliveries)
    .fetch_one(&mut conn)
    .await
    .expect("claim");
    assert_eq!(claimed, 1);
    let (inserted, updated): (i64, i64) = sqlx::query_as(versions).fetch_one(&mut conn).await.expect("counts");
    assert_eq!((inserted, updated), (1, 1), "the control writes a second version");
    sqlx::query("ROLLBACK").execute(&mut conn).await.expect("rollback");
}

/// Sixteen lone webhooks stored at once, each by its own leasing statement on its own
/// connection, fanned out to four endpoints: one limited to three requests in flight,
/// one whose rate limit has a burst of two tokens, one paused, one whose circuit is open.
/// The statements race for the endpoint rows, and each reads the leases in flight only
/// after it holds the row: exactly three deliveries of the first are leased and two of
/// the second (never more, and each limit filled), none of the paused or open one's; the
/// rest are stored pending, and every lease has its own token.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_leasing_statements_fill_each_endpoint_s_limit_and_never_pass_it() {
    racing_leasing_statements_keep_the_limits(Fanned::ToAllFour).await;
}

/// The same race where each webhook goes to one endpoint (its event type names it), the
/// most common lone webhook: its room is granted by `wg_lease_room_v4`'s path for one
/// endpoint (migration 0032), and the same limits hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_leasing_statements_for_one_endpoint_each_fill_its_limit_and_never_pass_it() {
    racing_leasing_statements_keep_the_limits(Fanned::OneEach).await;
}

/// Where the racing webhooks of [`racing_leasing_statements_keep_the_limits`] go.
#[derive(Clone, Copy, PartialEq)]
enum Fanned {
    /// Every webhook to the four endpoints.
    ToAllFour,
    /// Each webhook to one of them, 16 webhooks each.
    OneEach,
}

/// 16 webhooks a endpoint, stored by leasing statements racing on their own connections,
/// for an endpoint capped at 3 in flight, one whose rate limit has a burst of 2, a paused
/// one and one whose circuit is open: the cap and the burst are filled and never passed,
/// nothing is leased for the other two, and each lease has a token of its own.
async fn racing_leasing_statements_keep_the_limits(fanned: Fanned) {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    let names = ["capped", "rated", "paused", "open"];
    let mut endpoints = Vec::new();
    for name in names {
        let url = format!("http://127.0.0.1:9/{name}");
        let subscription = match fanned {
            Fanned::ToAllFour => json!({"source": "shop"}),
            Fanned::OneEach => json!({"source": "shop", "event_types": [name]}),
        };
        endpoints.push(app.endpoint_with(&url, subscription).await);
    }
    let [capped, rated, paused, open] = [0, 1, 2, 3].map(|i| endpoints[i].clone());
    let pool = &app.db.pool;
    for (sql, endpoint) in [
        ("UPDATE endpoints SET max_in_flight = 3 WHERE id = $1::uuid", &capped),
        ("UPDATE endpoints SET rate_limit_per_sec = 0.001, rate_limit_burst = 2 WHERE id = $1::uuid", &rated),
        ("UPDATE endpoints SET paused = true WHERE id = $1::uuid", &paused),
        (
            "UPDATE endpoints SET circuit_state = 'open', open_count = 1, opened_at = now(),
                                  reopen_at = now() + interval '1 hour'
             WHERE id = $1::uuid",
            &open,
        ),
    ] {
        sqlx::query(sql).bind(endpoint).execute(pool).await.expect("limit");
    }
    const RACERS: usize = 16;
    let headers = json!({});
    let kinds: &[&str] = match fanned {
        Fanned::ToAllFour => &["order.created"],
        Fanned::OneEach => &names,
    };
    let keys: Vec<(String, &str)> =
        kinds.iter().flat_map(|kind| (0..RACERS).map(move |i| (format!("race-{kind}-{i}"), *kind))).collect();
    let mut events = Vec::new();
    for (key, kind) in &keys {
        events.push(NewEvent { event_type: kind, ..shop_event(pool, key, &headers).await });
    }
    let terms = webhook_gateway::store::events::ClaimTerms {
        limit: 8,
        lease: Duration::from_secs(300),
        default_max_in_flight: 100,
    };
    let stored = futures_util::future::join_all(
        events.iter().map(|event| webhook_gateway::store::events::insert_and_claim(pool, event, terms)),
    )
    .await;
    let each = if fanned == Fanned::OneEach { 1 } else { 4 };
    let mut tokens = Vec::new();
    for result in stored {
        let (stored, fresh) = result.expect("stored");
        assert!(!stored.duplicate);
        assert_eq!(stored.deliveries.len(), each, "one delivery per endpoint the webhook goes to");
        tokens.extend(fresh.claimed.iter().map(|job| job.claim_token));
    }
    let leased = |endpoint: &str| {
        let endpoint = endpoint.to_owned();
        async move { lease_of(pool, &endpoint).await.iter().filter(|lease| lease.3).count() }
    };
    assert_eq!(leased(&capped).await, 3, "the in-flight limit filled, not passed");
    assert_eq!(leased(&rated).await, 2, "the burst's tokens spent, no more");
    assert_eq!(leased(&paused).await, 0, "nothing leased for a paused endpoint");
    assert_eq!(leased(&open).await, 0, "nor for one whose circuit is open");
    assert_eq!(tokens.len(), 5, "the answers name each lease once");
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 5, "each lease its own token");
    assert_eq!(app.db.count("deliveries").await, 4 * RACERS as i64);
}

/// A requester that stops waiting while its leasing statement is under way (its client
/// gone, its deadline passed) drops the store; the statement is still carried through to
/// the hand-off: its lease reaches the dispatcher's end, not left to run out. Here the
/// statement waits on the endpoint's row, locked by another transaction, past the
/// requester's patience; the lock is then let go. Control: awaiting the statement plainly
/// in the requester (no finishing on drop), the lease is committed and nothing receives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leasing_statement_whose_requester_stops_waiting_still_hands_its_lease_over() {
    let (app, ep, shared, mut received) = hand_off_without_dispatcher().await;
    let pool = &app.db.pool;

    let holder = lock_endpoint(pool, &ep).await;
    let event = owned_event(source_id(pool, "shop").await, "shop", "impatient-1", "order.created");
    let waited = tokio::time::timeout(Duration::from_millis(500), prelease::store(pool, event, shared.clone())).await;
    assert!(waited.is_err(), "the statement waits on the locked endpoint past the requester's patience");
    assert_eq!(app.db.count("events").await, 0, "nothing committed yet");
    holder.commit().await.expect("let the endpoint go");

    let handed = tokio::time::timeout(WAIT, received.recv()).await.expect("the lease reaches the dispatcher's end");
    let handed = handed.expect("the hand-off is open");
    assert_eq!(handed.job.attempt, 1);
    let leases = lease_of(pool, &ep).await;
    assert_eq!(leases.len(), 1);
    assert_eq!(
        (leases[0].1, leases[0].3),
        (handed.job.claim_token, true),
        "the lease handed over is the one committed"
    );
}

/// The transformation [`plain_and_shaped`]'s `shaped` subscription runs.
const SHAPING: &str = "function handler(w) { return w; }";

/// An ingest-only gateway with two sources, each subscribed by one endpoint: `shop`'s
/// plainly (stored by the lean statement), `shaped`'s with a transformation (the full
/// one); and terms that let a leasing statement lease what it creates.
async fn plain_and_shaped() -> (TestApp, webhook_gateway::store::events::ClaimTerms) {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    app.source_none("shaped").await;
    app.endpoint_for("http://127.0.0.1:9/plain", Some("shop")).await;
    app.endpoint_with("http://127.0.0.1:9/shaped", json!({"source": "shaped", "transform": SHAPING})).await;
    let terms = webhook_gateway::store::events::ClaimTerms {
        limit: 8,
        lease: Duration::from_secs(300),
        default_max_in_flight: 100,
    };
    (app, terms)
}

/// A lease taken by the statement that stores its webhook carries the event as a claim
/// would read it from the database. The statement returns only the delivery's and the
/// endpoint's columns; the event's own (type, source name, content type, body, trace
/// context) come from the webhook in hand. Checked for the lean statement (a source with
/// a plain subscription) and the full one (a source whose subscription transforms, which
/// also reads the transformation and the headers), with a body kept with the lease and
/// one over `INLINE_BODY_BYTES`, which the worker reads when it has room.
#[tokio::test]
async fn a_lease_taken_at_ingest_carries_its_event_as_the_database_holds_it() {
    use webhook_gateway::deliver::bodies::INLINE_BODY_BYTES;
    use webhook_gateway::store::events::{NewEvent, insert_and_claim};
    let (app, terms) = plain_and_shaped().await;
    let pool = &app.db.pool;
    let trace = webhook_gateway::telemetry::EventTrace {
        traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        tracestate: Some("vendor=1".into()),
    };
    let headers = json!({"x-request-id": "r-1"});
    let small = br#"{"order": 1}"#.to_vec();
    let large = format!(r#"{{"pad": "{}"}}"#, "x".repeat(INLINE_BODY_BYTES)).into_bytes();
    for (source, transformed) in [("shop", false), ("shaped", true)] {
        for (body, traced) in [(&small, true), (&large, false)] {
            let key = format!("{source}-{}", body.len());
            let event = NewEvent {
                source_id: source_id(pool, source).await,
                source_name: source,
                indexing: webhook_gateway::search::Indexing::Content,
                dedupe_key: &key,
                event_type: "order.created",
                content_type: Some("application/json; charset=utf-8"),
                headers: &headers,
                payload: body,
                ordering_key: None,
                terms: None,
                trace: traced.then_some(&trace),
            };
            let (stored, fresh) = insert_and_claim(pool, &event, terms).await.expect("stored");
            assert_eq!(fresh.claimed.len(), 1, "{key}: its one delivery leased");
            let job = &fresh.claimed[0];
            type Held = (String, String, Option<String>, Vec<u8>, Option<String>, Option<String>, i32, i64, String);
            let held: Held = sqlx::query_as(
                "SELECT e.event_type, s.name, e.content_type, e.payload, e.traceparent, e.tracestate,
                        d.attempt_count, d.claim_token, ep.url
                 FROM deliveries d JOIN events e ON e.id = d.event_id JOIN sources s ON s.id = e.source_id
                      JOIN endpoints ep ON ep.id = d.endpoint_id
                 WHERE d.id = $1",
            )
            .bind(job.id)
            .fetch_one(pool)
            .await
            .expect("the leased delivery");
            let (event_type, source_name, content_type, payload, traceparent, tracestate, attempt, token, url) = held;
            assert_eq!(job.event_id, stored.event_id, "{key}");
            assert_eq!(
                (job.event_type.as_str(), job.source_name.as_str()),
                (event_type.as_str(), source_name.as_str())
            );
            assert_eq!(job.content_type, content_type, "{key}");
            assert_eq!(job.payload_bytes as usize, payload.len(), "{key}");
            let inline = payload.len() <= INLINE_BODY_BYTES;
            assert_eq!(inline, !std::ptr::eq(body, &large), "{key}: one body of each kind");
            assert_eq!(
                job.payload.as_ref(),
                if inline { payload.as_slice() } else { &[] },
                "{key}: the body as stored"
            );
            assert_eq!((&job.traceparent, &job.tracestate), (&traceparent, &tracestate), "{key}");
            assert_eq!(job.traceparent.is_some(), traced, "{key}");
            assert_eq!((job.attempt, job.claim_token, &job.url), (attempt, token, &url), "{key}");
            assert!(!job.ordered && job.probe_token.is_none(), "{key}");
            assert_eq!(job.transform.as_deref(), transformed.then_some(SHAPING), "{key}");
            let stored_headers =
                job.event_headers.as_deref().map(|h| serde_json::from_str::<serde_json::Value>(h).expect("JSON"));
            assert_eq!(
                stored_headers,
                transformed.then(|| headers.clone()),
                "{key}: the headers with a transformation"
            );
        }
    }
}

/// Copies of one webhook on the leasing path: its statement answers a copy with no row
/// (it no longer looks the stored twin up itself), and the copy is answered from a second
/// lookup. Eight copies racing on their own connections, for a source stored by the lean
/// statement and one stored by the full one: exactly one is new, every answer names its
/// event, one delivery exists and it is leased once; a later copy is a duplicate too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn copies_racing_on_the_leasing_path_store_one_event_and_lease_it_once() {
    use webhook_gateway::store::events::insert_and_claim;
    let (app, terms) = plain_and_shaped().await;
    let pool = &app.db.pool;
    let headers = json!({});
    for source in ["shop", "shaped"] {
        let key = format!("copy-{source}");
        let mut event = shop_event(pool, &key, &headers).await;
        (event.source_id, event.source_name) = (source_id(pool, source).await, source);
        let racing = (0..8).map(|_| insert_and_claim(pool, &event, terms));
        let answers: Vec<_> = futures_util::future::join_all(racing)
            .await
            .into_iter()
            .map(|answer| answer.expect("stored or found"))
            .collect();
        let new: Vec<_> = answers.iter().filter(|(stored, _)| !stored.duplicate).collect();
        assert_eq!(new.len(), 1, "{source}: exactly one copy is new");
        let (original, fresh) = new[0];
        assert_eq!((original.deliveries.len(), fresh.claimed.len()), (1, 1), "{source}: its delivery leased");
        for (stored, fresh) in &answers {
            assert_eq!(stored.event_id, original.event_id, "{source}: every copy names the event");
            if stored.duplicate {
                assert!(stored.deliveries.is_empty() && fresh.claimed.is_empty(), "{source}: a copy leases nothing");
            }
        }
        let (later, fresh) = insert_and_claim(pool, &event, terms).await.expect("a later copy");
        assert!(later.duplicate && later.event_id == original.event_id && fresh.claimed.is_empty(), "{source}");
        let (events, deliveries, leased): (i64, i64, i64) = sqlx::query_as(
            "SELECT count(DISTINCT e.id), count(d.id), count(d.id) FILTER (WHERE d.leased_until IS NOT NULL)
             FROM events e LEFT JOIN deliveries d ON d.event_id = e.id WHERE e.dedupe_key = $1",
        )
        .bind(&key)
        .fetch_one(pool)
        .await
        .expect("counts");
        assert_eq!((events, deliveries, leased), (1, 1, 1), "{source}");
    }
}

/// An endpoint subscribed twice to a source gets one delivery of each webhook, leased
/// once, from the lean leasing statement: its fan-out lists the endpoint once per
/// subscription and leaves the second to `deliveries_once` (`ON CONFLICT DO NOTHING`)
/// instead of sorting the pairs to drop it. The answer names the one delivery, and it
/// took every candidate.
#[tokio::test]
async fn an_endpoint_subscribed_twice_is_delivered_and_leased_once() {
    use webhook_gateway::store::events::insert_and_claim;
    let (app, terms) = plain_and_shaped().await;
    let pool = &app.db.pool;
    let twice = app.endpoint_for("http://127.0.0.1:9/twice", Some("shop")).await;
    let again = json!({"endpoint_id": twice, "source": "shop", "event_types": ["order.*"]});
    app.admin_post("/v1/subscriptions", again, 201).await;
    let headers = json!({});
    let event = shop_event(pool, "twice-1", &headers).await;
    let (stored, fresh) = insert_and_claim(pool, &event, terms).await.expect("stored");
    assert_eq!(stored.deliveries.len(), 2, "the plain endpoint and the one subscribed twice: {stored:?}");
    assert_eq!(fresh.claimed.len(), 2, "each leased");
    assert!(fresh.took_all, "every candidate leased");
    let (deliveries, leased): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE leased_until IS NOT NULL) FROM deliveries
         WHERE event_id = $1 AND endpoint_id = $2::uuid",
    )
    .bind(stored.event_id)
    .bind(&twice)
    .fetch_one(pool)
    .await
    .expect("counts");
    assert_eq!((deliveries, leased), (1, 1), "one delivery to the endpoint subscribed twice, leased once");
}
