//! Every way PostgreSQL refuses or loses a write, produced for real against a gateway
//! process: a read-only server, a connection limit, sessions terminated under load, a
//! full disk, serialization failures. The answer is always 200 or 503 with
//! `Retry-After`, never a 500; `/readyz` says so while it lasts; the gateway heals by
//! itself once the database takes writes again; nothing acknowledged is lost.
//!
//! Each test has a private cluster (the server-wide settings it changes must not reach
//! other tests), except the serialization test, which changes one database.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::{Connection, Executor, PgConnection};
use webhook_gateway::db::embedded;

use crate::support::producer::{Seen, produce};
use crate::support::sink::Sink;
use crate::support::{ADMIN_TOKEN, TestApp, eventually, gateway_with_sink, start_throwaway_cluster};

/// A private cluster, its superuser connection, and a database `gw` owned by the login
/// role the gateway uses (`gw`, not a superuser: connection limits apply to it).
struct Private {
    cluster: embedded::Cluster,
    admin: PgConnection,
    /// The gateway's URL (role `gw`, database `gw`).
    gateway_url: String,
}

impl Private {
    async fn start() -> Private {
        let cluster = tokio::task::spawn_blocking(start_throwaway_cluster).await.expect("cluster");
        let mut admin = PgConnection::connect(&cluster.url("postgres")).await.expect("superuser connection");
        admin.execute("CREATE ROLE gw LOGIN PASSWORD 'gw-password'").await.expect("role");
        admin.execute("CREATE DATABASE gw OWNER gw").await.expect("database");
        let gateway_url = format!("postgres://gw:gw-password@127.0.0.1:{}/gw", cluster.port());
        Private { cluster, admin, gateway_url }
    }

    /// Run `sql` as the superuser.
    async fn sql(&mut self, sql: &str) {
        self.admin.execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// End every session of role `gw` (the gateway's connections).
    async fn terminate_gateway_sessions(&mut self) -> i64 {
        sqlx::query_scalar("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = 'gw'")
            .fetch_one(&mut self.admin)
            .await
            .expect("terminate")
    }
}

/// One webhook, one try: its status and whether a 503 carried `Retry-After`.
async fn post_once(base: &str, id: &str, body: String) -> (u16, bool) {
    let answer = reqwest::Client::new()
        .post(format!("{base}/ingest/shop"))
        .header("x-delivery-id", id)
        .header("x-event-type", "order.created")
        .header("content-type", "application/json")
        .body(body)
        .timeout(Duration::from_secs(20))
        .send()
        .await
        .expect("the gateway answers");
    let status = answer.status().as_u16();
    (status, status != 503 || answer.headers().contains_key("retry-after"))
}

/// `/readyz`: status and reason.
async fn readiness(base: &str) -> (u16, String) {
    let answer = reqwest::get(format!("{base}/readyz")).await.expect("readyz");
    let status = answer.status().as_u16();
    let body: serde_json::Value = answer.json().await.unwrap_or_default();
    (status, body["reason"].as_str().unwrap_or_default().to_owned())
}

/// Post one webhook every 100 ms until one is answered 200; how long that took.
async fn time_to_recover(base: &str, prefix: &str) -> Duration {
    let started = Instant::now();
    for n in 0.. {
        let (status, _) = post_once(base, &format!("{prefix}-{n}"), "{}".into()).await;
        assert_ne!(status, 500, "a 500 while recovering");
        if status == 200 {
            return started.elapsed();
        }
        assert!(started.elapsed() < Duration::from_secs(30), "not recovered after 30 s (last {status})");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    unreachable!()
}

/// Every webhook the gateway acknowledged was delivered (by the `id` in its body).
async fn all_delivered(sink: &Sink, ids: &HashSet<String>) {
    eventually(Duration::from_secs(60), "every acknowledged webhook delivered", || async {
        let delivered: HashSet<String> = sink
            .received()
            .iter()
            .filter_map(|r| serde_json::from_slice::<serde_json::Value>(&r.body).ok())
            .filter_map(|body| body["id"].as_str().map(str::to_owned))
            .collect();
        ids.is_subset(&delivered).then_some(())
    })
    .await;
}

/// The server turns read-only under open connections (`default_transaction_read_only`,
/// as a demoted primary or a maintenance switch): every ingest answers 503 with
/// `Retry-After` ("nothing was stored"), `/readyz` answers 503 "database read-only", new
/// connections are refused at connect; once the server takes writes again the gateway
/// answers 200 within a couple of seconds, and everything acknowledged is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_server_answers_503_and_the_gateway_heals_when_it_takes_writes_again() {
    let mut db = Private::start().await;
    let sink = Sink::ok().await;
    let (gw, base) = gateway_with_sink(&db.gateway_url, &[], &sink).await;
    let began = std::time::Instant::now();
    let mut acknowledged = HashSet::new();
    for n in 0..10 {
        let id = format!("before-{n}");
        assert_eq!(post_once(&base, &id, json!({"id": id}).to_string()).await.0, 200);
        acknowledged.insert(id);
    }

    db.sql("ALTER SYSTEM SET default_transaction_read_only = on").await;
    db.sql("SELECT pg_reload_conf()").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut statuses = Vec::new();
    for n in 0..10 {
        let id = format!("read-only-{n}");
        let (status, retry_after) = post_once(&base, &id, json!({"id": id}).to_string()).await;
        assert!(retry_after, "503 without Retry-After");
        if status == 200 {
            acknowledged.insert(id);
        }
        statuses.push(status);
    }
    assert!(statuses.iter().all(|s| *s == 503), "read-only: every answer 503, got {statuses:?}");
    assert_eq!(readiness(&base).await, (503, "database read-only".to_owned()));
    // The admin API on the read-only server: the pool takes no connection to a node that
    // refuses writes (it may be a demoted primary, whose reads are stale), so reads and
    // changes alike (a search by content, tokens, the audit log; a token created, which
    // writes its audit row) are 503 with Retry-After, never a 500.
    let http = reqwest::Client::new();
    for (method, path) in [
        (reqwest::Method::GET, "/v1/events?payload=id=before-1"),
        (reqwest::Method::GET, "/v1/tokens"),
        (reqwest::Method::GET, "/v1/audit"),
        (reqwest::Method::POST, "/v1/tokens"),
    ] {
        let mut request = http.request(method.clone(), format!("{base}{path}")).bearer_auth(ADMIN_TOKEN);
        if method == reqwest::Method::POST {
            request = request.json(&json!({"name": "ro", "scope": "read"}));
        }
        let answer = request.send().await.expect("admin call");
        let (status, retry_after) = (answer.status().as_u16(), answer.headers().contains_key("retry-after"));
        assert_eq!((status, retry_after), (503, true), "{method} {path} on a read-only server");
    }
    // New sessions are read-only too: the pool's fresh connections are refused at connect.
    db.terminate_gateway_sessions().await;
    let (status, retry_after) = post_once(&base, "fresh-connection", "{}".into()).await;
    assert_eq!((status, retry_after), (503, true));

    db.sql("ALTER SYSTEM RESET default_transaction_read_only").await;
    db.sql("SELECT pg_reload_conf()").await;
    let recovery = time_to_recover(&base, "after").await;
    eprintln!("read-only server: healed {recovery:?} after the server took writes again");
    assert!(recovery < Duration::from_secs(10), "healed in {recovery:?}");
    assert_eq!(readiness(&base).await.0, 200);
    all_delivered(&sink, &acknowledged).await;
    // The refused connections are said, but not one line each: sqlx's pool logged every
    // one at ERROR (hundreds in a few seconds).
    let log = std::fs::read_to_string(&gw.log).expect("the gateway's log");
    let refused = log.lines().filter(|l| l.contains("a new connection was refused in its set-up")).count();
    let most = usize::try_from(began.elapsed().as_secs() / 5 + 1).unwrap_or(usize::MAX);
    assert!((1..=most).contains(&refused), "{refused} lines say a refused connection, at most {most} in its time");
    assert!(!log.contains("error returned from after_connect"), "sqlx's own lines are off by default");
}

/// A connection limit reached (role `CONNECTION LIMIT 0`: "too many connections") and
/// sessions terminated by an administrator, again and again, under a load of producers
/// that retry (and more arriving at the limit): answers are 200 or 503 (with
/// `Retry-After`), never a 500; every webhook is acknowledged in the end, stored once and
/// delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn terminated_sessions_and_a_connection_limit_under_load_are_503_never_500() {
    let mut db = Private::start().await;
    let sink = Sink::ok().await;
    let (_gw, base) = gateway_with_sink(&db.gateway_url, &[], &sink).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let ids: Vec<String> = (0..600).map(|n| format!("load-{n}")).collect();
    let load = tokio::spawn(produce(base.clone(), "shop", ids.clone(), 8, seen.clone()));

    let mut terminated = 0;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        terminated += db.terminate_gateway_sessions().await;
    }
    db.sql("ALTER ROLE gw CONNECTION LIMIT 0").await;
    terminated += db.terminate_gateway_sessions().await;
    // Webhooks that arrive while no connection can be had (the first load may be over by
    // now on a fast run): they are refused, and the limit stays until a refusal was seen.
    let at_limit: Vec<String> = (0..40).map(|n| format!("at-limit-{n}")).collect();
    let late_load = tokio::spawn(produce(base.clone(), "shop", at_limit.clone(), 4, seen.clone()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let during = readiness(&base).await;
    eventually(Duration::from_secs(30), "a webhook refused while no connection can be had", || async {
        seen.lock().unwrap().statuses.get(&503).is_some_and(|n| *n > 0).then_some(())
    })
    .await;
    db.sql("ALTER ROLE gw CONNECTION LIMIT -1").await;
    load.await.expect("load");
    late_load.await.expect("load at the limit");

    let all: HashSet<String> = ids.into_iter().chain(at_limit).collect();
    {
        let seen = seen.lock().unwrap();
        eprintln!("terminated {terminated} sessions; answers {:?}; /readyz at the limit: {during:?}", seen.statuses);
        assert!(terminated >= 5, "sessions were terminated under load");
        assert_eq!(seen.statuses.get(&500), None, "no 500: {:?}", seen.statuses);
        assert!(seen.statuses.get(&503).is_some_and(|n| *n > 0), "the refusals were seen: {:?}", seen.statuses);
        assert_eq!(seen.without_retry_after, 0);
        assert_eq!(during.0, 503, "not ready while no connection can be had");
        assert_eq!(seen.acknowledged, all);
    }
    let events: i64 =
        sqlx::query_scalar("SELECT count(*) FROM events").fetch_one(&mut db.admin_on("gw").await).await.unwrap();
    assert_eq!(events, all.len() as i64, "each stored once");
    eventually(Duration::from_secs(60), "every webhook delivered", || async {
        let delivered: HashSet<String> = sink.received().iter().map(|r| r.header("webhook-id")).collect();
        (delivered.len() == all.len()).then_some(())
    })
    .await;
}

impl Drop for Private {
    fn drop(&mut self) {
        self.cluster.stop();
    }
}

impl Private {
    /// A superuser connection to `database`.
    async fn admin_on(&self, database: &str) -> PgConnection {
        PgConnection::connect(&self.cluster.url(database)).await.expect("superuser connection")
    }
}

/// A filesystem of a few megabytes mounted for the test (root only); unmounted on drop.
struct SmallDisk {
    path: std::path::PathBuf,
}

impl SmallDisk {
    fn mount(megabytes: u32) -> Option<SmallDisk> {
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        let path = std::env::temp_dir().join(format!("wg-small-disk-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&path).expect("mount point");
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={megabytes}m,mode=0700,uid=postgres,gid=postgres"), "tmpfs"])
            .arg(&path)
            .status()
            .is_ok_and(|s| s.success());
        assert!(mounted, "mount -t tmpfs failed (as root)");
        Some(SmallDisk { path })
    }

    fn grow(&self, megabytes: u32) {
        let grown = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={megabytes}m"), "tmpfs"])
            .arg(&self.path)
            .status()
            .is_ok_and(|s| s.success());
        assert!(grown, "remount failed");
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.path).status();
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// The events table on a 3 MB filesystem that fills up ("could not extend file: No space
/// left on device"): ingest answers 503 with `Retry-After`, never a 500, `/readyz`
/// answers 503 "database refusing writes"; once space is freed the gateway answers 200
/// again by itself, and everything acknowledged is delivered. Needs root (a tmpfs mount);
/// elsewhere it says so and checks nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_answers_503_and_the_gateway_heals_when_space_is_freed() {
    let Some(disk) = SmallDisk::mount(3) else {
        eprintln!("SKIPPED: a_full_disk_... needs root to mount a small filesystem");
        return;
    };
    let mut db = Private::start().await;
    let sink = Sink::ok().await;
    let (_gw, base) = gateway_with_sink(&db.gateway_url, &[], &sink).await;
    db.sql(&format!("CREATE TABLESPACE small LOCATION '{}'", disk.path.display())).await;
    let mut gw_db = db.admin_on("gw").await;
    gw_db.execute("ALTER TABLE events SET TABLESPACE small").await.expect("events on the small disk");

    // Incompressible 30 KB bodies until the disk is full.
    let mut acknowledged = HashSet::new();
    let mut refused = None;
    for n in 0..400 {
        let id = format!("fill-{n}");
        let noise: String = (0..30_000).map(|_| char::from(b'a' + rand::random_range(0..26u8))).collect();
        let (status, retry_after) = post_once(&base, &id, json!({"id": id, "noise": noise}).to_string()).await;
        assert_ne!(status, 500, "a full disk answered 500");
        assert!(retry_after);
        match status {
            200 => {
                acknowledged.insert(id);
            }
            503 => {
                refused = Some(n);
                break;
            }
            other => panic!("unexpected {other}"),
        }
    }
    let refused = refused.expect("the disk filled up");
    let (status, reason) = readiness(&base).await;
    eprintln!("full disk after {refused} webhooks of 30 KB; /readyz {status} {reason:?}");
    assert_eq!((status, reason.as_str()), (503, "database refusing writes"));
    // (A small webhook may still fit in a page with room; one that needs a new page fails.)
    for n in 0..5 {
        let noise: String = (0..30_000).map(|_| char::from(b'a' + rand::random_range(0..26u8))).collect();
        let (status, retry_after) =
            post_once(&base, &format!("full-{n}"), json!({"id": n, "noise": noise}).to_string()).await;
        assert_eq!((status, retry_after), (503, true), "still full");
    }

    disk.grow(64);
    let recovery = time_to_recover(&base, "freed").await;
    eprintln!("full disk: healed {recovery:?} after space was freed");
    assert!(recovery < Duration::from_secs(10));
    all_delivered(&sink, &acknowledged).await;
    drop(gw_db);
    // The tablespace must be empty before the disk goes: the cluster is deleted first.
    drop(db);
}

/// Serialization failures and deadlocks are retried inside: a trigger fails every other
/// ingest statement with SQLSTATE 40001 for real, and every webhook is still answered 200
/// (never 503 or 500) and stored once.
#[tokio::test]
async fn serialization_failures_are_retried_inside_and_never_reach_the_producer() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    sqlx::raw_sql(
        "CREATE SEQUENCE flaky;
         CREATE FUNCTION flaky() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('flaky') % 2 = 1 THEN
                 RAISE EXCEPTION 'could not serialize access (test)' USING ERRCODE = '40001';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER flaky BEFORE INSERT ON events FOR EACH STATEMENT EXECUTE FUNCTION flaky();",
    )
    .execute(&app.db.pool)
    .await
    .unwrap();
    for n in 0..20 {
        let (status, body) = app.ingest("shop", &format!("s-{n}"), "order.created", "{}").await;
        assert_eq!(status, 200, "{body}");
    }
    let fired: i64 = sqlx::query_scalar("SELECT last_value FROM flaky").fetch_one(&app.db.pool).await.unwrap();
    assert!(fired >= 40, "each webhook failed once and was retried ({fired} statements)");
    let (events, own) = app.db.count_events_but_operational().await;
    assert_eq!(events, 20, "the gateway's own events besides: {own:?}");
}

/// The claim by key (deliveries handed over by ingest or by the recorder) on a server that
/// turns read-only under its open connections: refused as a read-only refusal that
/// committed nothing (what the dispatcher answers with its pause and an owed general
/// claim, as for the general claim), nothing leased; once the server takes writes again,
/// the same hand-off is claimed whole, each delivery on its first lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_by_key_on_a_server_turned_read_only_takes_nothing_and_takes_all_once_it_writes() {
    use webhook_gateway::db::{self, Refusal, Unavailable};
    use webhook_gateway::queue;

    const LEASE: Duration = Duration::from_secs(60);
    let mut server = Private::start().await;
    // One connection: the one that sees the switch is the one that claims.
    let pool = db::connect(&server.gateway_url, 1).await.expect("connect");
    db::migrate(&pool).await.expect("migrate");
    let endpoint = crate::support::insert_endpoint(&pool, "http://127.0.0.1:9/").await;
    crate::support::seed_deliveries(&pool, &endpoint, 5).await;
    let handed = crate::support::delivery_ids(&pool, &endpoint).await;
    // The claim's connections are open and its plan cached before the switch.
    let none = queue::claim_fresh(&pool, &[], 10, LEASE, 10).await.expect("warm-up claim");
    assert!(none.claimed.is_empty());

    server.sql("ALTER SYSTEM SET default_transaction_read_only = on").await;
    server.sql("SELECT pg_reload_conf()").await;
    eventually(Duration::from_secs(10), "the open connection turned read-only", || async {
        let setting: Option<String> =
            sqlx::query_scalar("SHOW default_transaction_read_only").fetch_one(&pool).await.ok();
        (setting.as_deref() == Some("on")).then_some(())
    })
    .await;
    let refused = queue::claim_fresh(&pool, &handed, 10, LEASE, 10).await.expect_err("refused on a read-only server");
    assert_eq!(db::unavailable(&refused), Some(Unavailable::NotCommitted), "{refused}");
    pool.note(&refused);
    assert_eq!(pool.health().refusing_writes(), Some(Refusal::ReadOnly), "{refused}");
    let mut reader = PgConnection::connect(&server.cluster.url("gw")).await.expect("superuser connection to gw");
    let leased: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE claim_token <> 0 OR attempt_count <> 0")
            .fetch_one(&mut reader)
            .await
            .expect("leases");
    assert_eq!(leased, 0, "a refused claim leases nothing");

    server.sql("ALTER SYSTEM RESET default_transaction_read_only").await;
    server.sql("SELECT pg_reload_conf()").await;
    let fresh = eventually(Duration::from_secs(10), "the claim by key taking writes again", || async {
        queue::claim_fresh(&pool, &handed, 10, LEASE, 10).await.ok()
    })
    .await;
    assert!(fresh.took_all, "the whole hand-off is claimed");
    let mut claimed: Vec<_> = fresh.claimed.iter().map(|c| c.id).collect();
    claimed.sort_by_key(|id| id.0);
    assert_eq!(claimed, handed);
    assert!(fresh.claimed.iter().all(|c| c.attempt == 1 && c.claim_token > 0), "first leases");
}

/// The database out of connections for the gateway's role just after its first
/// connection (another replica took the slot it found free): the start-up's later steps
/// wait, as the first connection does (`--db-start-wait-secs`), and the replica starts
/// once connections can be had. Before, it exited 1 three seconds in, when its pool gave
/// up (a review saw 6 of 16 replicas started at once on a nearly full server exit so).
/// The test holds the migrations' lock so that the limit is set between the first
/// connection and the steps after the migrations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_finds_no_connection_after_its_first_waits_and_starts() {
    use webhook_gateway::db::MIGRATION_LOCK_KEY;
    let mut db = Private::start().await;
    // Advisory locks are the database's: held in `gw`, where the gateway migrates.
    let mut holder = PgConnection::connect(&db.cluster.url("gw")).await.expect("a connection to gw");
    holder.execute(format!("SELECT pg_advisory_lock({MIGRATION_LOCK_KEY})").as_str()).await.expect("lock");
    let mut gw = crate::support::GatewayProcess::start(&db.gateway_url, &[]);
    let watcher = sqlx::PgPool::connect(&db.cluster.url("postgres")).await.expect("watcher");
    eventually(Duration::from_secs(30), "the migrations wait for their lock", || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = 'gw' AND wait_event_type = 'Lock'",
        )
        .fetch_one(&watcher)
        .await
        .expect("activity");
        (waiting == 1).then_some(())
    })
    .await;
    watcher.close().await;
    db.sql("ALTER ROLE gw CONNECTION LIMIT 0").await;
    holder.execute(format!("SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})").as_str()).await.expect("unlock");
    // Past the pool's checkout timeout (3 s), with room to spare: still starting.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(gw.child.try_wait().expect("state").is_none(), "the replica waits instead of exiting");
    db.sql("ALTER ROLE gw CONNECTION LIMIT -1").await;
    crate::support::wait_ready(gw.addr).await;
    let base = format!("http://{}", gw.addr);
    let sink = Sink::ok().await;
    crate::support::shop_to_sink(&base, &sink).await;
    assert_eq!(post_once(&base, "after-the-wait", json!({"id": 1}).to_string()).await.0, 200);
    let log = std::fs::read_to_string(&gw.log).expect("log");
    assert!(log.contains("not available for a start-up step"), "the wait is said in the log");
}
