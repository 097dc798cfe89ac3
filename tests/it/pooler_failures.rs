//! Behind a transaction pooler when something fails that the pooler hides: PgBouncer at
//! its `max_client_conn`, refusing the connections a gateway's pool opens to grow under
//! load (a deploy's surge, or a pool sized above the pooler's limit); and a server gone
//! silent behind PgBouncer, whose socket to the gateway stays alive, so that none of the
//! gateway's TCP bounds can tell.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::pgbouncer::PgBouncer;
use crate::support::producer::{Seen, produce};
use crate::support::proxy::{Proxy, server_addr};
use crate::support::sink::Sink;
use crate::support::{TestDb, eventually, gateway_with_sink};

/// The pooler's client limit, below the gateway's pool of 8.
const CLIENT_LIMIT: usize = 4;

/// A gateway whose pool (8) is larger than PgBouncer lets it have (4 client connections),
/// under 16 concurrent producers: the connections the pool opens beyond the limit are
/// refused, and each refusal is a connection that never opened, not a database going
/// away. The pool's working connections stay open: PgBouncer sees about as many logins
/// as it allows clients. Before, every refused connect marked the pool's connections
/// stale, so each was closed when given back and opened again, only to be refused again
/// as the pool grew: the logins ran into the hundreds. Every webhook acknowledged is
/// stored and delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_refused_at_the_pooler_s_client_limit_leave_the_working_ones_open() {
    let db = TestDb::new().await;
    let limit = CLIENT_LIMIT.to_string();
    let bouncer = PgBouncer::start_configured(&db.url, 4, &[], "transaction", &[("max_client_conn", limit.as_str())]);
    let sink = Sink::ok().await;
    let pooled = bouncer.url(&db.name(), &db.url);
    let (_gateway, base) =
        gateway_with_sink(&pooled, &["--db-pooler", "transaction", "--db-pool-size", "8"], &sink).await;

    const WEBHOOKS: usize = 400;
    let ids: Vec<String> = (0..WEBHOOKS).map(|i| format!("limit-{i}")).collect();
    let seen = Arc::new(Mutex::new(Seen::default()));
    produce(base, "shop", ids.clone(), 16, seen.clone()).await;
    let seen = seen.lock().expect("seen").acknowledged.clone();
    assert_eq!(seen, ids.iter().cloned().collect::<HashSet<_>>(), "every webhook acknowledged in the end");
    eventually(Duration::from_secs(60), "every webhook delivered", || async {
        (sink.count() >= WEBHOOKS).then_some(())
    })
    .await;

    let log = bouncer.log_text();
    let refused = log.lines().filter(|l| l.contains("no more connections allowed")).count();
    let logins = log.lines().filter(|l| l.contains("login attempt")).count();
    eprintln!("pgbouncer: {logins} logins, {refused} connections refused at max_client_conn = {CLIENT_LIMIT}");
    assert!(refused > 0, "the pool reached the pooler's limit (else this test proves nothing)");
    // The working ones, the start-up's, and the pool's look at why it cannot open more
    // (`db::connect_gate`: one login per 5 s while refused).
    assert!(
        logins <= 4 * CLIENT_LIMIT,
        "{logins} logins for {CLIENT_LIMIT} client connections: working connections were closed and opened again"
    );
    let keys: HashSet<String> = sink.received().iter().map(|r| r.header("idempotency-key")).collect();
    assert_eq!((sink.count(), keys.len()), (WEBHOOKS, WEBHOOKS), "each webhook delivered once");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM events").fetch_one(&db.pool).await.expect("count");
    assert_eq!(stored, WEBHOOKS as i64, "each webhook stored once");
}

/// PgBouncer (two server connections) in front of a server whose open connections all go
/// silent for good while new ones work: the old primary gone without a word, the address
/// now leading to a live server. PgBouncer keeps no `query_timeout` (its default), so
/// nothing on its side ends a call sent on a silent connection. The gateway ends them
/// itself (its bounds on each call) and lets go of their connections: each is closed
/// within a bound instead of waiting for ever on sqlx's check as it goes back to the pool
/// (before, every abandoned call kept a slot of the gateway's pool of four, and once
/// they were all kept, the gateway answered 503 until restarted). Every webhook sent
/// after the silence is acknowledged in the end, stored once and delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gateway_recovers_by_itself_from_server_connections_gone_silent_behind_pgbouncer() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(server_addr(&db.url)).await;
    // As many server connections as the gateway's pool has connections: once the calls
    // sent on the silent ones have all been abandoned, each of the gateway's connections
    // may have met one.
    let bouncer = PgBouncer::start(&proxy.url_for(&db.url), 4);
    let sink = Sink::ok().await;
    let pooled = bouncer.url(&db.name(), &db.url);
    let (gateway, base) =
        gateway_with_sink(&pooled, &["--db-pooler", "transaction", "--poll-interval-ms", "100"], &sink).await;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().expect("client");
    let send = |id: String| {
        let request = http
            .post(format!("{base}/ingest/shop"))
            .header("x-delivery-id", id)
            .header("content-type", "application/json")
            .body("{}");
        async move { request.send().await.map(|a| a.status().as_u16()).unwrap_or(0) }
    };
    // Concurrent webhooks until PgBouncer has opened its four server connections.
    let mut before = 0;
    while proxy.accepted() < 4 {
        assert!(before < 400, "PgBouncer opened {} server connections", proxy.accepted());
        let wave = (before..before + 16).map(|i| send(format!("before-{i}")));
        for status in futures_util::future::join_all(wave).await {
            assert_eq!(status, 200);
        }
        before += 16;
    }
    eventually(Duration::from_secs(30), "the first webhooks delivered", || async {
        (sink.count() >= before).then_some(())
    })
    .await;
    eventually(Duration::from_secs(10), "no call in flight", || async { proxy.quiet().then_some(()) }).await;
    proxy.strand();

    const AFTER: usize = 20;
    let silenced = std::time::Instant::now();
    let patience = Duration::from_secs(240);
    let mut answers: std::collections::BTreeMap<u16, usize> = Default::default();
    for i in 0..AFTER {
        loop {
            let status = send(format!("after-{i}")).await;
            *answers.entry(status).or_default() += 1;
            if status == 200 {
                break;
            }
            assert!(
                silenced.elapsed() < patience,
                "webhook {i} not acknowledged {patience:?} after the silence; answers {answers:?}; log: {}",
                std::fs::read_to_string(&gateway.log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    eprintln!("after the silence: all {AFTER} acknowledged in {:?}; answers {answers:?}", silenced.elapsed());
    assert!(!answers.contains_key(&500), "no 500: {answers:?}");
    eventually(Duration::from_secs(120), "every webhook delivered", || async {
        (sink.count() >= before + AFTER).then_some(())
    })
    .await;
    let keys: HashSet<String> = sink.received().iter().map(|r| r.header("idempotency-key")).collect();
    assert_eq!(keys.len(), before + AFTER, "each webhook delivered");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM events").fetch_one(&db.pool).await.expect("count");
    assert_eq!(stored, (before + AFTER) as i64, "each webhook stored once");
}

/// PgBouncer paused (`PAUSE`, an operator's switchover step) under load for 15 s: the
/// gateway's calls wait, give up at their deadlines and answer 503, and its connection
/// attempts meanwhile stay few. PgBouncer logs a client in while paused and then does not
/// read from it, so a client that gives up (closes) keeps its slot until `RESUME`: every
/// connection the gateway opened and dropped at its 3 s checkout timeout was one slot of
/// `max_client_conn` gone, at about the request rate, and the pooler refused everyone
/// else's connections once they were all gone (a review filled 500 slots in 20 s with
/// three replicas). After `RESUME`, everything acknowledged is stored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_pgbouncer_is_not_filled_with_abandoned_connections() {
    use sqlx::Connection as _;
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start_configured(&db.url, 4, &[], "transaction", &[("admin_users", "postgres")]);
    let pooled = bouncer.url(&db.name(), &db.url);
    let admin_url = bouncer.url("pgbouncer", &db.url);
    let sink = Sink::ok().await;
    let (gw, base) = gateway_with_sink(&pooled, &["--db-pooler", "transaction", "--db-pool-size", "4"], &sink).await;
    // The console takes simple queries only, and no startup parameter sqlx sends by default.
    let console_options: sqlx::postgres::PgConnectOptions = admin_url.parse().expect("console URL");
    let mut console = sqlx::PgConnection::connect_with(&console_options.extra_float_digits(None))
        .await
        .expect("the pgbouncer console");
    sqlx::raw_sql("PAUSE").execute(&mut console).await.expect("PAUSE");
    // 30 webhooks a second, each posted by a producer of its own (as a provider's
    // fleet of senders does), for 15 s.
    let acknowledged = Arc::new(Mutex::new(Vec::new()));
    let mut posts = tokio::task::JoinSet::new();
    for n in 0..450 {
        let (base, acknowledged) = (base.clone(), acknowledged.clone());
        posts.spawn(async move {
            let id = format!("paused-{n}");
            if crate::support::post_to_shop(&base, &id, &serde_json::json!({"n": n})).await.0 == 200 {
                acknowledged.lock().unwrap().push(id);
            }
        });
        tokio::time::sleep(Duration::from_millis(33)).await;
    }
    let clients: Vec<sqlx::postgres::PgRow> =
        sqlx::raw_sql("SHOW CLIENTS").fetch_all(&mut console).await.expect("clients");
    let ours = clients
        .iter()
        .filter(|row| sqlx::Row::try_get::<String, _>(*row, "database").is_ok_and(|d| d == db.name()))
        .count();
    sqlx::raw_sql("RESUME").execute(&mut console).await.expect("RESUME");
    while posts.join_next().await.is_some() {}
    eprintln!("clients of the gateway's database at PgBouncer after 15 s paused: {ours}");
    // The pool's 4, a LISTEN-less worker's nothing, and a connection attempt every few
    // seconds at most.
    assert!(ours <= 16, "{ours} client connections held at PgBouncer after 15 s paused");
    let acknowledged = acknowledged.lock().unwrap().clone();
    eventually(Duration::from_secs(60), "every webhook acknowledged is stored", || async {
        let stored: Vec<String> =
            sqlx::query_scalar("SELECT dedupe_key FROM events").fetch_all(&db.pool).await.expect("events");
        let stored: HashSet<String> = stored.into_iter().collect();
        acknowledged.iter().all(|id| stored.contains(id)).then_some(())
    })
    .await;
    drop(gw);
}
