//! Settings a database or a role imposes on every session (`ALTER DATABASE ... SET`,
//! `ALTER ROLE ... SET`, as a managed PostgreSQL's operator may have done) must not change
//! what the gateway guarantees: its transactions run READ COMMITTED, which its claims are
//! written for, and its commits wait for the WAL's flush, so a webhook answered 200
//! survives a crash, and its waits for a row are not cut short by a `lock_timeout` meant
//! for others; directly and behind a transaction pooler. An operator's explicit
//! choice in the URL's `options` is kept, and a stronger setting than the gateway needs is
//! left alone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use webhook_gateway::db::{self, DbConfig, Pool, Pooler};

use crate::support::pgbouncer::PgBouncer;
use crate::support::producer::{Seen, produce};
use crate::support::sink::{Reply, Sink};
use crate::support::{GatewayProcess, TestDb, eventually, shop_to, wait_ready};

/// `setting` for the whole database (new sessions see it).
async fn impose(db: &TestDb, setting: &str, value: &str) {
    sqlx::query(&format!("ALTER DATABASE \"{}\" SET {setting} = '{value}'", db.name()))
        .execute(&db.pool)
        .await
        .expect("a database-wide setting");
}

/// `setting` as a statement run on `pool` outside a transaction sees it, and inside one
/// of the pool's transactions.
async fn seen_by(pool: &Pool, setting: &str) -> (String, String) {
    let show = format!("SHOW {setting}");
    let alone: String = sqlx::query_scalar(&show).fetch_one(pool).await.expect("shown alone");
    let mut tx = pool.begin().await.expect("a transaction");
    let inside: String = sqlx::query_scalar(&show).fetch_one(&mut *tx).await.expect("shown in a transaction");
    tx.commit().await.expect("commit");
    (alone, inside)
}

/// A plain session of `url`'s, not the gateway's: what the database imposes.
async fn plain_session_sees(url: &str, setting: &str) -> String {
    use sqlx::Connection as _;
    let mut conn = sqlx::PgConnection::connect(url).await.expect("a plain session");
    let value: String = sqlx::query_scalar(&format!("SHOW {setting}")).fetch_one(&mut conn).await.expect("shown");
    let _ = conn.close().await;
    value
}

/// A database whose sessions default to SERIALIZABLE and commit without waiting for the
/// flush: a plain session gets both (the control), the gateway's pool, direct and through
/// PgBouncer in transaction mode, gets READ COMMITTED and `synchronous_commit = on`,
/// outside and inside its transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_s_sessions_run_read_committed_and_commit_durably_whatever_the_database_imposes() {
    let db = TestDb::new().await;
    impose(&db, "default_transaction_isolation", "serializable").await;
    impose(&db, "synchronous_commit", "off").await;
    impose(&db, "lock_timeout", "2ms").await;
    assert_eq!(plain_session_sees(&db.url, "transaction_isolation").await, "serializable");
    assert_eq!(plain_session_sees(&db.url, "synchronous_commit").await, "off");
    assert_eq!(plain_session_sees(&db.url, "lock_timeout").await, "2ms");

    let direct = db::open(&DbConfig::direct(&db.url, 2)).await.expect("a direct pool");
    assert_eq!(seen_by(&direct, "transaction_isolation").await, ("read committed".into(), "read committed".into()));
    assert_eq!(seen_by(&direct, "synchronous_commit").await, ("on".into(), "on".into()));
    assert_eq!(seen_by(&direct, "lock_timeout").await, ("0".into(), "0".into()));
    assert!(direct.commits_made_durable());

    let bouncer = PgBouncer::start(&db.url, 2);
    let pooled_url = bouncer.url(&db.name(), &db.url);
    let pooled = db::open(&DbConfig { pooler: Pooler::Transaction, ..DbConfig::direct(&pooled_url, 2) })
        .await
        .expect("a pool behind PgBouncer");
    assert_eq!(seen_by(&pooled, "transaction_isolation").await, ("read committed".into(), "read committed".into()));
    assert_eq!(seen_by(&pooled, "synchronous_commit").await, ("on".into(), "on".into()));
    assert_eq!(seen_by(&pooled, "lock_timeout").await, ("0".into(), "0".into()));
    assert!(pooled.commits_made_durable());
    drop(bouncer);
}

/// The same settings imposed on the gateway's role instead (`ALTER ROLE ... SET`, a role of
/// this test's own): a plain session of the role gets them (the control), the gateway's
/// pool does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_imposed_on_the_gateway_s_role_are_not_taken_either() {
    let db = TestDb::new().await;
    let role = format!("wg_role_{}", uuid::Uuid::new_v4().simple());
    for statement in [
        format!("CREATE ROLE {role} LOGIN PASSWORD 'role-pw'"),
        format!("ALTER ROLE {role} SET default_transaction_isolation = 'repeatable read'"),
        format!("ALTER ROLE {role} SET synchronous_commit = 'off'"),
        format!("ALTER ROLE {role} SET lock_timeout = '5ms'"),
    ] {
        sqlx::query(&statement).execute(&db.pool).await.expect("the role");
    }
    let mut url = url::Url::parse(&db.url).expect("a database URL");
    url.set_username(&role).expect("user");
    url.set_password(Some("role-pw")).expect("password");
    let url = url.to_string();
    assert_eq!(plain_session_sees(&url, "transaction_isolation").await, "repeatable read");
    assert_eq!(plain_session_sees(&url, "synchronous_commit").await, "off");
    assert_eq!(plain_session_sees(&url, "lock_timeout").await, "5ms");

    let pool = db::open(&DbConfig::direct(&url, 2)).await.expect("a pool as the role");
    assert_eq!(seen_by(&pool, "transaction_isolation").await, ("read committed".into(), "read committed".into()));
    assert_eq!(seen_by(&pool, "synchronous_commit").await, ("on".into(), "on".into()));
    assert_eq!(seen_by(&pool, "lock_timeout").await, ("0".into(), "0".into()));
    pool.close().await;
    sqlx::query(&format!("DROP ROLE {role}")).execute(&db.pool).await.expect("drop the role");
}

/// What the gateway does not override: a database whose commits already wait locally
/// (`local`, here stronger than nothing and the operator's choice) keeps it, directly and
/// through PgBouncer in transaction mode, whatever another pool of the same process found
/// (the test cluster's own databases commit with `synchronous_commit = off`, and a pool
/// on one of them is opened first, so a flag kept per process would be set), and a URL
/// that sets `synchronous_commit` itself is obeyed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_setting_that_waits_or_that_the_url_names_is_kept() {
    let not_durable = TestDb::new().await;
    impose(&not_durable, "synchronous_commit", "off").await;
    let elsewhere = db::open(&DbConfig::direct(&not_durable.url, 1)).await.expect("a pool on another database");
    assert_eq!(seen_by(&elsewhere, "synchronous_commit").await.0, "on");
    assert!(elsewhere.commits_made_durable());

    let db = TestDb::new().await;
    impose(&db, "synchronous_commit", "local").await;
    let direct = db::open(&DbConfig::direct(&db.url, 2)).await.expect("a direct pool");
    assert_eq!(seen_by(&direct, "synchronous_commit").await, ("local".into(), "local".into()));
    assert!(!direct.commits_made_durable());
    let bouncer = PgBouncer::start(&db.url, 2);
    let pooled =
        db::open(&DbConfig { pooler: Pooler::Transaction, ..DbConfig::direct(&bouncer.url(&db.name(), &db.url), 2) })
            .await
            .expect("a pool behind PgBouncer");
    assert_eq!(seen_by(&pooled, "synchronous_commit").await, ("local".into(), "local".into()));
    assert!(!pooled.commits_made_durable());
    drop(bouncer);

    let explicit = format!("{}?options=-c%20synchronous_commit%3Doff", db.url);
    let chosen = db::open(&DbConfig::direct(&explicit, 2)).await.expect("a pool with the URL's choice");
    assert_eq!(seen_by(&chosen, "synchronous_commit").await.0, "off");
}

/// Two gateway processes on a database whose sessions default to SERIALIZABLE with a
/// `lock_timeout` of 2 ms, 400 webhooks from 16 producers for one endpoint that takes two
/// requests at a time: every webhook is answered 200 at once (no 503) and delivered once,
/// the endpoint never has more than two requests in flight, and no claim or outcome write
/// fails for serialization or a lock timeout (before the isolation was pinned: 77-121
/// serialization failures in 15 s, the drain slowed by their retries; before the lock
/// timeout was: 29 answers of 2,400 were 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fleet_on_a_serializable_database_claims_and_records_without_serialization_failures() {
    let db = TestDb::new().await;
    impose(&db, "default_transaction_isolation", "serializable").await;
    impose(&db, "lock_timeout", "2ms").await;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_millis(20))).await;
    let first = GatewayProcess::start(&db.url, &[]);
    let second = GatewayProcess::start(&db.url, &[]);
    wait_ready(first.addr).await;
    wait_ready(second.addr).await;
    let base = format!("http://{}", first.addr);
    shop_to(&base, json!({"url": sink.url("/hook"), "max_in_flight": 2})).await;

    let seen = Arc::new(Mutex::new(Seen::default()));
    let ids: Vec<String> = (0..400).map(|i| format!("iso-{i}")).collect();
    let (a, b) = ids.split_at(200);
    tokio::join!(
        produce(base.clone(), "shop", a.to_vec(), 8, seen.clone()),
        produce(format!("http://{}", second.addr), "shop", b.to_vec(), 8, seen.clone()),
    );
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.acknowledged.len(), 400, "every webhook answered 2xx");
        assert_eq!(seen.statuses.keys().copied().collect::<Vec<_>>(), [200], "every answer: {:?}", seen.statuses);
    }
    eventually(Duration::from_secs(60), "every webhook delivered", || async {
        (sink.received().len() >= 400).then_some(())
    })
    .await;
    let mut per_id: HashMap<String, usize> = HashMap::new();
    for received in sink.received() {
        *per_id.entry(received.header("webhook-id")).or_default() += 1;
    }
    assert_eq!(per_id.len(), 400, "each webhook delivered");
    assert!(per_id.values().all(|&n| n == 1), "none twice");
    assert!(sink.max_concurrent() <= 2, "the endpoint's limit held: {} at once", sink.max_concurrent());
    for process in [first, second] {
        let log = std::fs::read_to_string(&process.log).unwrap_or_default();
        let failures = log.lines().filter(|l| l.contains("could not serialize") || l.contains("lock timeout")).count();
        assert_eq!(failures, 0, "serialization failures or lock timeouts in {}", process.log.display());
    }
}
