//! Twenty replicas on one database, as a production fleet runs them: started at once on
//! an empty database (they race the migrations), each with a small pool, every one taking
//! webhooks and delivering. The guarantees are the fleet's, not a replica's: each webhook
//! stored once and delivered once, an endpoint's in-flight limit held across all of them,
//! and the database's connections within what the docs say a fleet opens.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;

use crate::support::pgbouncer::PgBouncer;
use crate::support::producer::{Seen, produce};
use crate::support::sink::{Reply, Sink};
use crate::support::{GatewayProcess, TestDb, count_status, eventually, shop_to, wait_ready};

/// Replicas in the fleet.
const REPLICAS: usize = 20;
/// Each replica's `--db-pool-size`: twenty replicas at the default (16) would open up to
/// 340 connections, past a default `max_connections` (docs/production-postgres.md,
/// "Connections").
const POOL: usize = 2;

/// The gateway's sessions on `database` now (behind PgBouncer: its server connections,
/// which carry their clients' `application_name`).
async fn gateway_sessions(conn: &mut sqlx::PgConnection, database: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE 'webhook-gateway%'",
    )
    .bind(database)
    .fetch_one(conn)
    .await
    .expect("sessions")
}

/// What a fleet run saw: the producers' answers, the subscriber, the most gateway sessions
/// on the database at once.
struct Run {
    seen: Arc<Mutex<Seen>>,
    sink: Sink,
    most_sessions: i64,
}

/// Twenty replicas started at once on `db` (empty: they race the migrations), each
/// reaching it through `url` with `extra` flags and a pool of [`POOL`]; 600 webhooks from
/// 20 producers spread over all of them, to one endpoint that takes 4 requests at a time
/// and holds each 60 ms (long enough for the deliveries to back up to that limit even
/// when a loaded machine ingests slowly: at 20 ms a CI run under load once saw 3 at once
/// at most). Checks what holds whatever sits between the fleet and the
/// database: the schema migrated once, every webhook acknowledged (200, or 503 with
/// `Retry-After` and then 200), stored once and delivered exactly once, never more than 4
/// requests in flight, every replica exits cleanly.
async fn twenty_replicas(db: &TestDb, url: &str, extra: &[&str]) -> Run {
    use sqlx::Connection as _;
    // The test's own queries on a plain session: the test database's pool is named like
    // the gateway's, and would be counted with the fleet's sessions.
    let mut own = sqlx::PgConnection::connect(&db.url).await.expect("a session of the test's");
    let pool = POOL.to_string();
    let args: Vec<&str> = ["--db-pool-size", pool.as_str()].into_iter().chain(extra.iter().copied()).collect();
    let replicas: Vec<GatewayProcess> = (0..REPLICAS).map(|_| GatewayProcess::start(url, &args)).collect();
    for replica in &replicas {
        wait_ready(replica.addr).await;
    }
    let (applied, failed): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(*) FILTER (WHERE NOT success) FROM _sqlx_migrations")
            .fetch_one(&mut own)
            .await
            .expect("the migrations");
    assert_eq!((applied, failed), (webhook_gateway::db::MIGRATOR.iter().count() as i64, 0), "migrated once");

    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_millis(60))).await;
    let bases: Vec<String> = replicas.iter().map(|r| format!("http://{}", r.addr)).collect();
    shop_to(&bases[0], json!({"url": sink.url("/hook"), "max_in_flight": 4})).await;

    let most_sessions = Arc::new(Mutex::new(0i64));
    let watching = {
        let (most, db_url, name) = (most_sessions.clone(), db.url.clone(), db.name());
        tokio::spawn(async move {
            let mut conn = sqlx::PgConnection::connect(&db_url).await.expect("a watcher");
            loop {
                let now = gateway_sessions(&mut conn, &name).await;
                {
                    let mut most = most.lock().unwrap();
                    *most = (*most).max(now);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    let seen = Arc::new(Mutex::new(Seen::default()));
    let producers = bases.iter().enumerate().map(|(r, base)| {
        let ids: Vec<String> = (0..600 / REPLICAS).map(|i| format!("fleet-{r}-{i}")).collect();
        produce(base.clone(), "shop", ids, 1, seen.clone())
    });
    futures_util::future::join_all(producers).await;
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.acknowledged.len(), 600, "every webhook acknowledged");
        assert!(seen.statuses.keys().all(|s| [200, 503].contains(s)), "answers: {:?}", seen.statuses);
        assert_eq!(seen.without_retry_after, 0, "every 503 with Retry-After");
    }
    eventually(Duration::from_secs(90), "every webhook delivered", || async {
        (sink.received().len() >= 600).then_some(())
    })
    .await;
    // A moment for a delivery sent twice to show.
    tokio::time::sleep(Duration::from_millis(500)).await;
    watching.abort();

    let mut per_id: HashMap<String, usize> = HashMap::new();
    for received in sink.received() {
        *per_id.entry(received.header("webhook-id")).or_default() += 1;
    }
    assert_eq!(per_id.len(), 600, "each webhook delivered");
    let twice: Vec<_> = per_id.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "delivered more than once: {twice:?}");
    assert!(sink.max_concurrent() <= 4, "the endpoint's limit held: {} at once", sink.max_concurrent());
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE dedupe_key LIKE 'fleet-%'")
        .fetch_one(&mut own)
        .await
        .expect("events");
    assert_eq!(events, 600, "stored once each");
    // The fleet's roster lists the twenty, running, and each clean stop is recorded.
    let roster = crate::support::admin_get_at(&bases[0], "/v1/admin/replicas").await;
    assert_eq!(roster["running"], REPLICAS, "{roster}");
    for mut replica in replicas {
        assert!(replica.terminate(), "clean exit");
        let log = std::fs::read_to_string(&replica.log).unwrap_or_default();
        assert!(!log.contains("panicked"), "a replica panicked: {log}");
    }
    let stopped: i64 = sqlx::query_scalar("SELECT count(*) FROM replicas WHERE stopped_at IS NOT NULL")
        .fetch_one(&mut own)
        .await
        .expect("the roster's rows");
    assert_eq!(stopped, REPLICAS as i64, "each clean stop recorded in the roster");
    let most_sessions = *most_sessions.lock().unwrap();
    Run { seen, sink, most_sessions }
}

/// Twenty replicas straight to PostgreSQL ([`twenty_replicas`]), and the fleet never
/// holds more than replicas × (pool + 1) sessions (the bound docs/production-postgres.md
/// gives).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_replicas_store_once_deliver_once_and_hold_an_endpoint_s_limit() {
    let db = TestDb::empty().await;
    let run = twenty_replicas(&db, &db.url, &[]).await;
    let most = run.most_sessions;
    assert!(most > REPLICAS as i64, "the watcher saw the fleet's sessions: {most}");
    assert!(most <= (REPLICAS * (POOL + 1)) as i64, "{most} sessions, more than {REPLICAS} × ({POOL} + 1)");
    eprintln!("fleet, direct: at most {most} sessions; answers {:?}", run.seen.lock().unwrap().statuses);
}

/// The same twenty replicas through PgBouncer in transaction mode with 8 server
/// connections for the whole fleet (60 clients): the same guarantees, the endpoint's
/// limit reached and held, and never more than PgBouncer's 8 server sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_replicas_behind_pgbouncer_store_once_deliver_once_and_hold_an_endpoint_s_limit() {
    let db = TestDb::empty().await;
    let bouncer = PgBouncer::start(&db.url, 8);
    let pooled = bouncer.url(&db.name(), &db.url);
    let run = twenty_replicas(&db, &pooled, &["--db-pooler", "transaction"]).await;
    assert_eq!(run.sink.max_concurrent(), 4, "the limit reached");
    eprintln!(
        "fleet, PgBouncer: at most {} server sessions; answers {:?}",
        run.most_sessions,
        run.seen.lock().unwrap().statuses
    );
    assert!(run.most_sessions <= 8, "{} server sessions, PgBouncer lends 8", run.most_sessions);
    drop(bouncer);
}

/// Post `ids` to the fleet at `bases`, the `n`-th to replica `first + n` and on failure to
/// the next ones in turn until one answers 2xx, as a load balancer in front of the fleet
/// spreads and retries: the ids acknowledged, and every answer's status (0: no answer).
async fn post_through_the_fleet(bases: Arc<Vec<String>>, first: usize, ids: Vec<String>) -> (Vec<String>, Vec<u16>) {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().expect("client");
    let (mut acknowledged, mut statuses) = (Vec::new(), Vec::new());
    for (n, id) in ids.into_iter().enumerate() {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        for attempt in first + n.. {
            let base = &bases[attempt % bases.len()];
            let answer = http
                .post(format!("{base}/ingest/shop"))
                .header("x-delivery-id", &id)
                .header("x-event-type", "order.paid")
                .json(&json!({"order": id}))
                .send()
                .await;
            let status = answer.map(|a| a.status().as_u16()).unwrap_or(0);
            statuses.push(status);
            if (200..300).contains(&status) {
                acknowledged.push(id);
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "{id} never acknowledged (last {status})");
        }
    }
    (acknowledged, statuses)
}

/// Twenty replicas, five of them killed (SIGKILL: no drain, leases left behind) while 20
/// producers post 600 webhooks through the fleet and the subscriber holds each request a
/// second (so every replica has deliveries in flight when the five die): every webhook
/// acknowledged is stored once and its delivery recorded delivered (a 2xx answered, not a
/// request that arrived: those the killed replicas were sending had no answer recorded,
/// and are sent again after their lease, 25 s, under the same id, as a later attempt; the
/// control: some were).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_replicas_five_killed_mid_flight_lose_nothing() {
    use sqlx::Connection as _;
    let db = TestDb::new().await;
    let pool = POOL.to_string();
    let args = ["--db-pool-size", pool.as_str(), "--lease-secs", "25"];
    let mut replicas: Vec<GatewayProcess> = (0..REPLICAS).map(|_| GatewayProcess::start(&db.url, &args)).collect();
    for replica in &replicas {
        wait_ready(replica.addr).await;
    }
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_secs(1))).await;
    let bases: Arc<Vec<String>> = Arc::new(replicas.iter().map(|r| format!("http://{}", r.addr)).collect());
    shop_to(&bases[0], json!({"url": sink.url("/hook")})).await;

    let producers: Vec<_> = (0..REPLICAS)
        .map(|p| {
            let ids: Vec<String> = (0..600 / REPLICAS).map(|i| format!("crash-{p}-{i}")).collect();
            // Each producer starts at its own replica: every replica takes webhooks (and
            // sends their deliveries) from the start, the five to be killed included.
            tokio::spawn(post_through_the_fleet(bases.clone(), p, ids))
        })
        .collect();
    eventually(Duration::from_secs(60), "deliveries under way", || async { (sink.count() >= 150).then_some(()) }).await;
    for replica in replicas.iter_mut().skip(REPLICAS - 5) {
        replica.kill();
    }
    let mut acknowledged = Vec::new();
    let mut refused = 0;
    for producer in producers {
        let (ids, statuses) = producer.await.expect("producer");
        acknowledged.extend(ids);
        refused += statuses.iter().filter(|s| !(200..300).contains(*s)).count();
    }
    assert_eq!(acknowledged.len(), 600, "every webhook acknowledged by some replica");
    // Delivered means a 2xx recorded, not a request that arrived: a request in flight
    // from a replica that died has no recorded answer, and is sent again after its lease.
    let mut own = sqlx::PgConnection::connect(&db.url).await.expect("a session of the test's");
    let count = "SELECT count(*) FILTER (WHERE status = 'delivered'), count(*) FROM deliveries";
    eventually(Duration::from_secs(90), "every acknowledged webhook's delivery recorded delivered", || async {
        (count_status(&db.pool, "delivered").await >= 600).then_some(())
    })
    .await;
    let (delivered, all): (i64, i64) = sqlx::query_as(count).fetch_one(&mut own).await.expect("deliveries");
    assert_eq!((delivered, all), (600, 600), "one delivery each, every one delivered");
    let (events, keys): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT dedupe_key) FROM events WHERE dedupe_key LIKE 'crash-%'")
            .fetch_one(&mut own)
            .await
            .expect("events");
    assert_eq!((events, keys), (600, 600), "stored once each");
    let received = sink.received();
    let ids: std::collections::HashSet<String> = received.iter().map(|r| r.header("webhook-id")).collect();
    assert_eq!(ids.len(), 600, "the subscriber saw each webhook");
    let again: Vec<String> =
        received.iter().filter(|r| r.header("webhook-attempt") != "1").map(|r| r.header("webhook-attempt")).collect();
    eprintln!(
        "fleet, five killed: {refused} answers not 2xx (retried on another replica), {} requests for 600 webhooks, \
         {} of them later attempts",
        received.len(),
        again.len()
    );
    // The control: the crash hit deliveries in flight (sent again, or first sent after the
    // lease of a claim that died with its replica: either way a later attempt).
    assert!(!again.is_empty(), "no delivery was in flight in the killed replicas");
    for mut replica in replicas.into_iter().take(REPLICAS - 5) {
        assert!(replica.terminate(), "clean exit");
    }
}
