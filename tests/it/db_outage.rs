//! Never acknowledge what is not committed: with the database down, ingest answers 503
//! with Retry-After; when it is back, the producer's retry is stored exactly once.

use serde_json::json;
use webhook_gateway::db::embedded::{Cluster, ClusterOptions};

use crate::support::{self, TestApp, TestDb, create_database, test_settings};

#[tokio::test]
async fn database_outage_answers_503_then_the_retry_is_stored_once() {
    // A cluster of its own: stopping the shared one would break every other test.
    let options = ClusterOptions { throwaway: false, ..support::throwaway_options() };
    let mut cluster = tokio::task::spawn_blocking({
        let options = options.clone();
        move || Cluster::start(&options).unwrap()
    })
    .await
    .unwrap();
    create_database(&cluster.url("postgres"), "outage").await;
    let url = cluster.url("outage");
    let pool = webhook_gateway::db::connect(&url, 4).await.unwrap();
    webhook_gateway::db::migrate(&pool).await.unwrap();
    let db = TestDb { url, pool };
    let settings = webhook_gateway::app::Settings { role: webhook_gateway::role::Role::Ingest, ..test_settings() };
    let app = TestApp::spawn_with(db, settings, 4).await;
    app.source_none("shop").await;
    let port = cluster.port();

    tokio::task::spawn_blocking(move || cluster.stop()).await.unwrap();
    let resp = app
        .http
        .post(app.url("/ingest/shop"))
        .header("x-delivery-id", "during-outage")
        .body(r#"{"n":1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 503);
    assert!(resp.headers().get("retry-after").is_some(), "503 carries Retry-After");
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "database_unavailable");
    let ready = app.http.get(app.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 503);

    // Same directory, same port: the gateway's pool reconnects by itself.
    let restart = ClusterOptions { throwaway: true, port: Some(port), ..options };
    let mut cluster = tokio::task::spawn_blocking(move || Cluster::start(&restart).unwrap()).await.unwrap();
    // The producer retries as it would in life: a pooled connection that died with the
    // old server fails its first statement (another 503, nothing stored) and is dropped.
    let mut statuses = Vec::new();
    for _ in 0..10 {
        let resp = app
            .http
            .post(app.url("/ingest/shop"))
            .header("x-delivery-id", "during-outage")
            .body(r#"{"n":1}"#)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let body = resp.json::<serde_json::Value>().await.unwrap();
        if status == 503 && statuses.is_empty() {
            continue;
        }
        statuses.push((status, body["duplicate"].clone()));
        if statuses.len() == 2 {
            break;
        }
    }
    assert_eq!(statuses, vec![(200, json!(false)), (200, json!(true))]);
    // A fresh connection: the test's own pooled ones died with the old server.
    let fresh = TestDb { url: app.db.url.clone(), pool: webhook_gateway::db::connect(&app.db.url, 1).await.unwrap() };
    assert_eq!(fresh.count("events").await, 1);
    tokio::task::spawn_blocking(move || cluster.stop()).await.unwrap();
}

/// A gateway started before its database answers (nothing listening yet: a pod scheduled
/// before the database's service, a server restarting) waits for it, trying every second
/// and saying so in its log, and starts when it comes: it answers, stores and delivers.
/// Before, it exited at the first refused connection and left the retry to its supervisor.
/// What waiting cannot mend fails at once (a database that does not exist), and the wait
/// has its bound (`--db-start-wait-secs`: 0 gives up at the first failure; 2 gives up
/// after trying, and says how long it waited).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_started_before_its_database_waits_for_it() {
    use crate::support::proxy::{Proxy, server_addr};
    use crate::support::{eventually, run_to_exit};
    use std::time::Duration;

    let db = TestDb::new().await;
    let proxy = Proxy::start(server_addr(&db.url)).await;
    proxy.down().await;
    let through = proxy.url_for(&db.url);
    let sink = crate::support::sink::Sink::ok().await;
    let gateway = support::GatewayProcess::start(&through, &[]);
    eventually(Duration::from_secs(20), "the gateway says it waits", || async {
        let log = std::fs::read_to_string(&gateway.log).unwrap_or_default();
        log.contains("database: not available yet").then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.up().await;
    support::wait_ready(gateway.addr).await;
    let base = format!("http://{}", gateway.addr);
    support::shop_to_sink(&base, &sink).await;
    let (status, body) = support::post_to_shop(&base, "w-1", &json!({"order": 1})).await;
    assert_eq!(status, 200, "{body}");
    eventually(Duration::from_secs(20), "delivered", || async { (sink.count() == 1).then_some(()) }).await;
    let log = std::fs::read_to_string(&gateway.log).unwrap_or_default();
    assert!(log.contains("database: reached; starting"), "{log}");

    let unknown = format!("{}_no_such_database", db.url);
    let (code, stderr) = run_to_exit(&["migrate", "--database-url", &unknown]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("does not exist") && !stderr.contains("waited"), "at once: {stderr}");

    proxy.down().await;
    let (code, stderr) = run_to_exit(&["migrate", "--database-url", &through, "--db-start-wait-secs", "0"]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("cannot connect to PostgreSQL") && !stderr.contains("waited"), "{stderr}");
    let (code, stderr) = run_to_exit(&["migrate", "--database-url", &through, "--db-start-wait-secs", "2"]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("waited") && stderr.contains("cannot connect to PostgreSQL"), "{stderr}");

    // The running gateway, its database gone: every readiness probe answers 503, and the
    // log says so once per interval, not once per probe (balancers and supervisors probe
    // every replica every few seconds; before, an outage was a line per probe).
    let logged = |log: &str| log.matches("readiness check: database unreachable").count();
    let before = logged(&std::fs::read_to_string(&gateway.log).unwrap_or_default());
    let http = reqwest::Client::new();
    let probing = std::time::Instant::now();
    for _ in 0..20 {
        let probe = http.get(format!("{base}/readyz")).send().await.expect("readyz");
        assert_eq!(probe.status(), 503);
    }
    let intervals = probing.elapsed().as_secs() / webhook_gateway::log_throttle::INTERVAL.as_secs() + 1;
    let lines = logged(&std::fs::read_to_string(&gateway.log).unwrap_or_default()) - before;
    assert!(lines >= 1 && lines as u64 <= intervals, "{lines} lines for 20 probes over {:?}", probing.elapsed());
}
