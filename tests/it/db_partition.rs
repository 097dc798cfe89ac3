//! A partition between the gateway and PostgreSQL (connections open, no byte flowing)
//! must not hang requests: ingest and the admin API answer 503 with Retry-After, and when
//! the path heals the gateway recovers by itself with nothing lost.

use std::time::{Duration, Instant};

use serde_json::Value;
use webhook_gateway::app::Settings;
use webhook_gateway::janitor::JanitorSettings;
use webhook_gateway::role::Role;

use crate::support::proxy::{Proxy, server_addr};
use crate::support::sink::Sink;
use crate::support::{TestApp, TestDb, eventually, test_settings};

/// Generous: the point is "it answered", not how fast (a shared 2-core machine).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);
const WAIT: Duration = Duration::from_secs(60);

/// What the gateway answers when it knows nothing reached the database.
const NOTHING_STORED: &str = "nothing was stored";
/// What it answers when the write may have reached the database.
const MAY_BE_STORED: &str = "may have been stored";

struct Answer {
    status: u16,
    retry_after: Option<String>,
    body: Value,
    took: Duration,
}

async fn ingest(app: &TestApp, key: &str) -> Answer {
    let started = Instant::now();
    let resp = app
        .http
        .post(app.url("/ingest/shop"))
        .timeout(CLIENT_TIMEOUT)
        .header("content-type", "application/json")
        .header("x-delivery-id", key)
        .header("x-event-type", "order.created")
        .body(format!(r#"{{"key":"{key}"}}"#))
        .send()
        .await
        .expect("ingest answered (did not hang)");
    answer(resp, started).await
}

async fn admin_get(app: &TestApp, path: &str) -> Answer {
    let started = Instant::now();
    let resp = app
        .http
        .get(app.url(path))
        .timeout(CLIENT_TIMEOUT)
        .bearer_auth(crate::support::ADMIN_TOKEN)
        .send()
        .await
        .expect("admin call answered (did not hang)");
    answer(resp, started).await
}

async fn answer(resp: reqwest::Response, started: Instant) -> Answer {
    let status = resp.status().as_u16();
    let retry_after = resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let body = resp.json().await.unwrap_or(Value::Null);
    Answer { status, retry_after, body, took: started.elapsed() }
}

fn assert_unavailable(a: &Answer, what: &str) {
    assert_eq!(a.status, 503, "{what}: {}", a.body);
    assert!(a.retry_after.is_some(), "{what}: 503 carries Retry-After");
    assert_eq!(a.body["error"]["code"], "database_unavailable", "{what}: {}", a.body);
}

fn message(a: &Answer) -> String {
    a.body["error"]["message"].as_str().unwrap_or_default().to_owned()
}

/// A gateway of `role` whose pool (4 connections) goes through `proxy`; the test's own
/// pool (`app.db.pool`) does not.
async fn gateway_behind(proxy: &Proxy, db: TestDb, role: Role) -> TestApp {
    let db = TestDb { url: proxy.url_for(&db.url), pool: db.pool };
    // No retention pass and no operational checks during the test: their own connections
    // would go through the proxy too, and the first of them into the partition would tell
    // the pool the database is gone before the call under test finds an idle connection.
    let janitor = JanitorSettings { interval: Duration::from_secs(86_400), ..JanitorSettings::default() };
    let mut settings = Settings { role, janitor, ..test_settings() };
    settings.operational.enabled = false;
    TestApp::spawn_with(db, settings, 4).await
}

/// Open the pool's connections, so that calls find some idle; with `proxy`, wait until
/// none awaits an answer (sqlx pings each connection it gets back before it is idle).
async fn warm_up(app: &TestApp, proxy: Option<&Proxy>) {
    let calls = (0..8).map(|_| admin_get(app, "/v1/endpoints"));
    for a in futures_util::future::join_all(calls).await {
        assert_eq!(a.status, 200, "{}", a.body);
    }
    if let Some(proxy) = proxy {
        eventually(WAIT, "the pool's connections idle", || async { proxy.quiet().then_some(()) }).await;
    }
}

#[tokio::test]
async fn a_partition_answers_503_and_the_gateway_recovers_with_nothing_lost() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(server_addr(&db.url)).await;
    let app = gateway_behind(&proxy, db, Role::All).await;
    let sink = Sink::ok().await;
    app.source_none("shop").await;
    app.endpoint_for(&sink.url("/hooks"), Some("shop")).await;

    // Healthy: stored (and delivered, before or after the partition). (The workers keep
    // claiming: the proxy is never quiet for long.)
    warm_up(&app, None).await;
    let before = ingest(&app, "before").await;
    assert_eq!(before.status, 200, "{}", before.body);
    // Its outcome written before the partition: the recorder's write (at most 25 ms after
    // the attempt) would otherwise go into the partition beside the ingest under test and
    // hold one of the pool's four connections there, and the ingest could find none idle
    // ("nothing was stored", seen once in a full CI run).
    eventually(WAIT, "the first webhook delivered and recorded", || async {
        (crate::support::count_status(&app.db.pool, "delivered").await == 1).then_some(())
    })
    .await;

    proxy.blackhole();
    let partition = Instant::now();

    // The source is still cached (1 s) and connections are idle in the pool: the first
    // write goes into the partition. It may have reached the server, and the answer says so.
    let first = ingest(&app, "during").await;
    assert_unavailable(&first, "ingest during the partition");
    assert!(message(&first).contains(MAY_BE_STORED), "{}", first.body);
    eprintln!("partition: first ingest answered 503 after {:?}: {}", first.took, message(&first));

    // Once the connections that went into the partition are out of the pool, a new
    // connection cannot be opened and nothing is sent: the answer says nothing was stored.
    let mut retries = Vec::new();
    let certain = loop {
        let again = ingest(&app, "during").await;
        assert_unavailable(&again, "ingest retried during the partition");
        let msg = message(&again);
        assert!(msg.contains(NOTHING_STORED) || msg.contains(MAY_BE_STORED), "{}", again.body);
        retries.push(again.took);
        if msg.contains(NOTHING_STORED) {
            break again;
        }
        assert!(retries.len() < 10, "never answered {NOTHING_STORED:?} during the partition");
    };
    eprintln!("partition: retries answered 503 after {retries:?}; last: {}", message(&certain));

    let admin = admin_get(&app, "/v1/endpoints").await;
    assert_unavailable(&admin, "admin GET during the partition");
    eprintln!("partition: admin GET answered 503 after {:?}: {}", admin.took, message(&admin));
    let partition_lasted = partition.elapsed();

    proxy.heal();
    let healed = Instant::now();

    // The producer retries until it gets its 200, as producers do.
    let stored = eventually(WAIT, "a 200 for the retried webhook", || async {
        let a = ingest(&app, "during").await;
        (a.status == 200).then_some(a)
    })
    .await;
    eprintln!(
        "healed after a {partition_lasted:?} partition: the retry was answered 200 (duplicate: {}) {:?} after the heal",
        stored.body["duplicate"],
        healed.elapsed()
    );
    let admin = admin_get(&app, "/v1/endpoints").await;
    assert_eq!(admin.status, 200, "{}", admin.body);

    // Exactly once at the persistence boundary: one event per key, whatever reached the
    // server during the partition.
    let keys: Vec<(String, i64)> =
        sqlx::query_as("SELECT dedupe_key, count(*) FROM events GROUP BY dedupe_key ORDER BY dedupe_key")
            .fetch_all(&app.db.pool)
            .await
            .expect("events by key");
    assert_eq!(keys, vec![("before".to_owned(), 1), ("during".to_owned(), 1)]);

    // And delivered, once.
    let delivered = eventually(WAIT, "the retried webhook delivered", || async {
        let got: Vec<_> =
            sink.received().into_iter().filter(|r| r.body.as_ref() == br#"{"key":"during"}"#.as_slice()).collect();
        (!got.is_empty()).then_some(got)
    })
    .await;
    eventually(WAIT, "both deliveries recorded as delivered", || async {
        (crate::support::count_status(&app.db.pool, "delivered").await == 2).then_some(())
    })
    .await;
    assert_eq!(delivered.len(), 1, "delivered once");
    assert_eq!(delivered[0].header("webhook-attempt"), "1");
    eprintln!("healed: delivered {:?} after the heal", healed.elapsed());
}

#[tokio::test]
async fn an_admin_call_sent_into_a_partition_is_answered_503_by_its_deadline() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(server_addr(&db.url)).await;
    // Ingest only: no worker takes connections during the partition.
    let app = gateway_behind(&proxy, db, Role::Ingest).await;
    // The calls below find a connection idle and send their statement into the
    // partition (rather than failing to open one).
    warm_up(&app, Some(&proxy)).await;

    proxy.blackhole();
    let read = admin_get(&app, "/v1/endpoints").await;
    assert_unavailable(&read, "admin GET sent into the partition");
    assert!(message(&read).contains("did not answer within 6 s; nothing was changed"), "{}", read.body);
    eprintln!("partition: admin GET answered 503 after {:?}: {}", read.took, message(&read));

    let started = Instant::now();
    let resp = app
        .http
        .post(app.url("/v1/endpoints"))
        .timeout(CLIENT_TIMEOUT)
        .bearer_auth(crate::support::ADMIN_TOKEN)
        .json(&serde_json::json!({"url": "https://subscriber.example.com/hooks"}))
        .send()
        .await
        .expect("admin POST answered (did not hang)");
    let write = answer(resp, started).await;
    assert_unavailable(&write, "admin POST during the partition");
    let msg = message(&write);
    assert!(msg.contains("may have been applied") || msg.contains(NOTHING_STORED), "{}", write.body);
    eprintln!("partition: admin POST answered 503 after {:?}: {msg}", write.took);

    proxy.heal();
    let healed = Instant::now();
    eventually(WAIT, "the admin API answering again", || async {
        (admin_get(&app, "/v1/endpoints").await.status == 200).then_some(())
    })
    .await;
    eprintln!("healed: admin API answered 200 {:?} after the heal", healed.elapsed());
}

#[tokio::test]
async fn the_pool_s_sockets_get_tcp_keepalive_and_a_user_timeout() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(server_addr(&db.url)).await;
    // Ingest only, no retention pass: nothing opens a connection while the sockets are
    // looked at (one caught between its TCP connect and `after_connect` has no options yet).
    let app = gateway_behind(&proxy, db, Role::Ingest).await;
    warm_up(&app, Some(&proxy)).await;
    // The only sockets of this process that lead to the proxy are the gateway's pool's.
    let sockets = webhook_gateway::db::tcp::inspect(&webhook_gateway::db::tcp::Target::port(proxy.addr.port()));
    if cfg!(target_os = "linux") {
        assert!(!sockets.is_empty(), "the pool has connections");
        let wanted = webhook_gateway::db::tcp::Applied::wanted();
        assert!(sockets.iter().all(|applied| *applied == wanted), "{sockets:?}");
    }
}

#[tokio::test]
async fn an_unreachable_database_answers_that_nothing_was_stored() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(server_addr(&db.url)).await;
    let app = gateway_behind(&proxy, db, Role::All).await;
    app.source_none("shop").await;

    proxy.down().await;
    // Pooled connections that died with the server may first say "may have been stored"
    // (their statement met a closed socket); once none is left, nothing can be sent.
    let mut answers = Vec::new();
    loop {
        let a = ingest(&app, "while-down").await;
        assert_unavailable(&a, "ingest with the database gone");
        let msg = message(&a);
        answers.push((a.took, msg.clone()));
        if msg.contains(NOTHING_STORED) {
            break;
        }
        assert!(msg.contains(MAY_BE_STORED), "{}", a.body);
        assert!(answers.len() < 10, "never answered {NOTHING_STORED:?}: {answers:?}");
    }
    eprintln!("database gone: {answers:?}");
    // Likewise the admin API: a dead pooled connection says what it cannot know.
    let mut admin_answers = Vec::new();
    loop {
        let a = admin_get(&app, "/v1/endpoints").await;
        assert_unavailable(&a, "admin GET with the database gone");
        let msg = message(&a);
        admin_answers.push(msg.clone());
        if msg.contains(NOTHING_STORED) {
            break;
        }
        assert!(msg.contains("may have been applied"), "{}", a.body);
        assert!(admin_answers.len() < 10, "never answered {NOTHING_STORED:?}: {admin_answers:?}");
    }
    eprintln!("database gone, admin: {admin_answers:?}");

    proxy.up().await;
    let stored = eventually(WAIT, "a 200 once the database is back", || async {
        let a = ingest(&app, "while-down").await;
        (a.status == 200).then_some(a)
    })
    .await;
    assert_eq!(stored.body["duplicate"], false, "nothing was stored while it was down");
    assert_eq!(app.db.count("events").await, 1);
}

/// The database goes away while a subscriber is answering, and comes back 20 s later
/// (longer than a handful of quick retries): the outcome is recorded once it is back, the
/// delivery ends delivered after its one attempt, and the subscriber is not sent it again
/// when the lease ends.
#[tokio::test]
async fn an_outcome_is_recorded_when_the_database_comes_back_not_resent() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(server_addr(&db.url)).await;
    let app = gateway_behind(&proxy, db, Role::All).await;
    let sink =
        crate::support::sink::Sink::start(|_, _| crate::support::sink::Reply::Hold(Duration::from_secs(2))).await;
    app.source_none("shop").await;
    app.endpoint_for(&sink.url("/hooks"), Some("shop")).await;
    warm_up(&app, None).await;
    let stored = ingest(&app, "held").await;
    assert_eq!(stored.status, 200, "{}", stored.body);
    eventually(WAIT, "the subscriber holds the request", || async { (sink.count() == 1).then_some(()) }).await;

    proxy.down().await;
    tokio::time::sleep(Duration::from_secs(20)).await;
    proxy.up().await;

    eventually(WAIT, "the outcome recorded", || async {
        (crate::support::count_status(&app.db.pool, "delivered").await == 1).then_some(())
    })
    .await;
    let (attempts, recorded): (i32, Vec<i32>) = sqlx::query_as(
        "SELECT d.attempt_count, ARRAY(SELECT attempt_number FROM attempts a WHERE a.delivery_id = d.id)
         FROM deliveries d",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("delivery");
    assert_eq!((attempts, recorded), (1, vec![1]), "recorded as the first attempt, not resent");
    assert_eq!(sink.count(), 1);
}

/// SIGTERM during a partition: the process exits within its grace (and a few seconds for
/// the rest of the shutdown), instead of waiting for a claim sent into the partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_partition_exits_in_bounded_time() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(server_addr(&db.url)).await;
    let gateway = crate::support::GatewayProcess::start(
        &proxy.url_for(&db.url),
        &["--role", "worker", "--shutdown-grace-secs", "2", "--poll-interval-ms", "20"],
    );
    eventually(WAIT, "the worker connected", || async { (proxy.accepted() > 0).then_some(()) }).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.blackhole();
    // Let the next claims go into the partition.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let exited = sigterm_and_wait(gateway, "during a partition").await;
    assert!(exited.is_some(), "still running 40 s after SIGTERM during a partition");
    proxy.heal();
}

/// SIGTERM while the start-up waits on the database (here: its migration check waits for
/// a lock another session holds, as behind a deploy's long migration; a partition at
/// start-up looks the same): the process exits at once, 0, without waiting for the
/// database. It used to wait for the start-up to finish, which a partition or a held lock
/// can delay forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_the_start_up_waits_on_the_database_exits_at_once() {
    let db = TestDb::new().await;
    let mut blocker = db.pool.begin().await.expect("begin");
    sqlx::query("LOCK TABLE _sqlx_migrations IN ACCESS EXCLUSIVE MODE").execute(&mut *blocker).await.expect("lock");
    let mut gateway =
        crate::support::GatewayProcess::start(&db.url, &["--role", "worker", "--shutdown-grace-secs", "2"]);
    eventually(WAIT, "the gateway's start-up waits for the lock", || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = 'webhook-gateway' AND wait_event_type = 'Lock'",
        )
        .fetch_one(&db.pool)
        .await
        .expect("pg_stat_activity");
        (waiting > 0).then_some(())
    })
    .await;
    let signalled = Instant::now();
    let exited =
        tokio::task::spawn_blocking(move || gateway.terminate_within(Duration::from_secs(30))).await.expect("join");
    let took = signalled.elapsed();
    blocker.rollback().await.expect("rollback");
    eprintln!("SIGTERM during start-up: exited after {took:?} ({exited:?})");
    let status = exited.unwrap_or_else(|| panic!("still running {took:?} after SIGTERM during start-up"));
    assert!(status.success(), "a stop during start-up is a clean exit: {status:?}");
}

/// SIGTERM while the very first connection hangs (the partition is there before the
/// process starts: connections are accepted and never answered): the process exits 0 at
/// once instead of waiting for the connection to time out and failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_the_first_connection_hangs_exits_at_once() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(server_addr(&db.url)).await;
    proxy.blackhole();
    let mut gateway = crate::support::GatewayProcess::start(
        &proxy.url_for(&db.url),
        &["--role", "worker", "--shutdown-grace-secs", "2"],
    );
    eventually(WAIT, "the gateway is connecting", || async { (proxy.accepted() > 0).then_some(()) }).await;
    let signalled = Instant::now();
    let exited =
        tokio::task::spawn_blocking(move || gateway.terminate_within(Duration::from_secs(30))).await.expect("join");
    let took = signalled.elapsed();
    eprintln!("SIGTERM while connecting: exited after {took:?} ({exited:?})");
    let status = exited.unwrap_or_else(|| panic!("still running {took:?} after SIGTERM while connecting"));
    assert!(status.success(), "a stop while connecting is a clean exit, not a connection error: {status:?}");
    proxy.heal();
}

/// SIGTERM while outcomes are owed to a database gone silent behind PgBouncer in
/// transaction mode (the path from PgBouncer to PostgreSQL blackholed; PgBouncer's own
/// socket to the gateway stays alive and acknowledges everything, so no TCP bound of the
/// gateway ever fires): the process exits within its grace and the recorder's stop bound
/// (`deliver::recorder::STOP_BOUND`). Before, the stop waited for the outcome write sent
/// into the silence for as long as the silence lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_outcomes_owed_to_a_database_silent_behind_a_pooler_exits_in_bounded_time() {
    use crate::support::pgbouncer::PgBouncer;
    let db = TestDb::new().await;
    let proxy = Proxy::start(server_addr(&db.url)).await;
    let bouncer = PgBouncer::start(&proxy.url_for(&db.url), 4);
    let gateway = crate::support::GatewayProcess::start(
        &bouncer.url(&db.name(), &db.url),
        &["--db-pooler", "transaction", "--shutdown-grace-secs", "2"],
    );
    crate::support::wait_ready(gateway.addr).await;
    let base = format!("http://{}", gateway.addr);
    let http = reqwest::Client::new();
    // Each request held 2 s: the outcomes are owed when the path goes silent.
    let sink = Sink::start(|_, _| crate::support::sink::Reply::Hold(Duration::from_secs(2))).await;
    let admin = |path: &'static str, body: Value| crate::support::admin_post_at(&base, path, body);
    admin("/v1/sources", serde_json::json!({"name": "shop", "kind": "none", "dedupe": {"header": "X-Delivery-Id"}}))
        .await;
    let endpoint = admin("/v1/endpoints", serde_json::json!({"url": sink.url("/hook")})).await;
    admin("/v1/subscriptions", serde_json::json!({"endpoint_id": endpoint["id"], "source": "shop"})).await;
    const WEBHOOKS: usize = 10;
    for i in 0..WEBHOOKS {
        let answer = http
            .post(format!("{base}/ingest/shop"))
            .header("x-delivery-id", format!("silent-{i}"))
            .body("{}")
            .send()
            .await
            .expect("ingest");
        assert_eq!(answer.status(), 200);
    }
    eventually(WAIT, "every request at the subscriber", || async { (sink.count() >= WEBHOOKS).then_some(()) }).await;
    // The deliveries' rows held, so that the outcome write, once the subscriber answers,
    // is in flight at the server when the path goes silent; its answer then never comes.
    let mut holder = db.pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM deliveries FOR UPDATE").execute(&mut *holder).await.expect("hold the rows");
    eventually(WAIT, "the outcome write waiting for the rows", || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&db.pool)
        .await
        .expect("pg_stat_activity");
        (waiting > 0).then_some(())
    })
    .await;
    proxy.blackhole();
    holder.rollback().await.expect("let the rows go");
    tokio::time::sleep(Duration::from_secs(1)).await;

    let exited = sigterm_and_wait(gateway, "with outcomes owed to a silent database").await;
    proxy.heal();
    assert!(exited.is_some(), "still running 40 s after SIGTERM");
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE status = 'pending'")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(pending, WEBHOOKS as i64, "the write never committed (its answer was lost): the leases bring them back");
}

/// SIGTERM `gateway` and wait up to 40 s for it to exit (`None`: still running); says how
/// long it took.
async fn sigterm_and_wait(mut gateway: crate::support::GatewayProcess, when: &str) -> Option<std::process::ExitStatus> {
    let signalled = Instant::now();
    let exited =
        tokio::task::spawn_blocking(move || gateway.terminate_within(Duration::from_secs(40))).await.expect("join");
    eprintln!("SIGTERM {when}: exited after {:?} ({exited:?})", signalled.elapsed());
    exited
}
