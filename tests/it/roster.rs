//! The fleet's roster (`GET /v1/admin/replicas`, `crate::roster`): every replica writes its
//! own row, so an operator sees which are running, in which role and on which release, and
//! which went away without stopping.

use std::time::Duration;

use serde_json::Value;

use crate::support::{GatewayProcess, TestDb, admin_get_at, eventually, wait_ready};

/// The roster as `base` answers it.
async fn roster(base: &str) -> Value {
    admin_get_at(base, "/v1/admin/replicas").await
}

/// The row of the replica in `role` (one per role here).
fn replica<'a>(roster: &'a Value, role: &str) -> &'a Value {
    let rows = roster["replicas"].as_array().expect("replicas");
    let mine: Vec<&Value> = rows.iter().filter(|r| r["role"] == role).collect();
    assert_eq!(mine.len(), 1, "one replica in role {role}: {roster}");
    mine[0]
}

/// Three replicas on one database, one per role, writing every second: all three listed
/// running, each with this release's version and schema version, the database's schema
/// version beside them, and each exporting the same as `webhook_gateway_build_info`. Then
/// the worker is killed (SIGKILL: it cannot say so) and the ingest replica stopped
/// cleanly: the first reads lost once three of its intervals pass, the second draining
/// during its drain and stopped after, the third still running. Then a later release's migration
/// is applied (a rolling deploy under way): the replica still running is marked behind the
/// schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_roster_lists_every_replica_running_draining_stopped_or_lost() {
    let db = TestDb::new().await;
    let every = ["--metrics-sample-secs", "1"];
    let all = GatewayProcess::start(&db.url, &every);
    let ingest =
        GatewayProcess::start(&db.url, &[&every[..], &["--role", "ingest", "--shutdown-drain-secs", "3"]].concat());
    let mut worker = GatewayProcess::start(&db.url, &[&every[..], &["--role", "worker"]].concat());
    for process in [&all, &ingest, &worker] {
        wait_ready(process.addr).await;
    }
    let base = format!("http://{}", all.addr);
    let newest: i64 = sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
        .fetch_one(&db.pool)
        .await
        .expect("the schema's version");

    let listed = eventually(Duration::from_secs(15), "three replicas running", || async {
        let listed = roster(&base).await;
        (listed["running"] == 3).then_some(listed)
    })
    .await;
    assert_eq!(listed["schema_version"], newest, "{listed}");
    for role in ["all", "ingest", "worker"] {
        let row = replica(&listed, role);
        assert_eq!(row["state"], "running", "{row}");
        assert_eq!(row["version"], env!("CARGO_PKG_VERSION"), "{row}");
        assert_eq!(row["schema_version"], newest, "{row}");
        assert_eq!(row["behind_schema"], false, "{row}");
        assert!(row["stopped_at"].is_null(), "{row}");
        assert!(row["clock_offset_ms"].as_f64().expect("offset").abs() < 1000.0, "{row}");
    }

    // Prometheus sees the same: each replica's release, by the gauge set at start-up.
    for (process, role) in [(&all, "all"), (&ingest, "ingest"), (&worker, "worker")] {
        let text = crate::support::scrape(process.addr).await;
        let line = text.lines().find(|l| l.starts_with("webhook_gateway_build_info{")).expect("build info");
        for label in [
            format!(r#"version="{}""#, env!("CARGO_PKG_VERSION")),
            format!(r#"schema_version="{newest}""#),
            format!(r#"role="{role}""#),
        ] {
            assert!(line.contains(&label), "{label} in {line}");
        }
        assert!(line.ends_with(" 1"), "{line}");
    }

    worker.kill();
    // A clean stop: draining first (3 s: still serving, /readyz 503).
    let stopping = tokio::task::spawn_blocking(move || {
        let mut ingest = ingest;
        ingest.terminate_within(Duration::from_secs(60))
    });
    let draining = eventually(Duration::from_secs(5), "the ingest replica draining", || async {
        let listed = roster(&base).await;
        (replica(&listed, "ingest")["state"] == "draining").then_some(listed)
    })
    .await;
    assert!(replica(&draining, "ingest")["draining_since"].is_string(), "{draining}");
    let status = stopping.await.expect("join").expect("stopped within 60 s");
    assert!(status.success(), "a clean stop: {status:?}");
    let after = eventually(Duration::from_secs(20), "the killed worker found lost", || async {
        let listed = roster(&base).await;
        (replica(&listed, "worker")["state"] == "lost").then_some(listed)
    })
    .await;
    assert_eq!(replica(&after, "ingest")["state"], "stopped", "{after}");
    assert!(replica(&after, "ingest")["stopped_at"].is_string(), "{after}");
    assert!(replica(&after, "worker")["stopped_at"].is_null(), "a killed replica did not say it stopped: {after}");
    assert_eq!(replica(&after, "all")["state"], "running", "{after}");
    assert_eq!(after["running"], 1, "{after}");
    assert_eq!(after["replicas"][0]["role"], "all", "running first: {after}");

    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99990101000000, 'a later release', true, '\\x00', 1)",
    )
    .execute(&db.pool)
    .await
    .expect("a later release's migration");
    let later = roster(&base).await;
    assert_eq!(later["schema_version"], 99990101000000_i64, "{later}");
    assert_eq!(replica(&later, "all")["behind_schema"], true, "an older release still running: {later}");
}

/// A replica whose clean stop lasts longer than three of its roster intervals (a delivery
/// in flight that its subscriber holds 6 s, the row written every second, no drain) reads
/// draining for the whole stop, never lost, then stopped. (Before, its row stopped being
/// written at the stop signal: it read lost after three intervals while it was still
/// finishing its deliveries.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_stop_outlasts_three_intervals_reads_draining_not_lost() {
    let db = TestDb::new().await;
    let sink =
        crate::support::sink::Sink::start(|_, _| crate::support::sink::Reply::Hold(Duration::from_secs(6))).await;
    let every = ["--metrics-sample-secs", "1"];
    let watcher = GatewayProcess::start(&db.url, &[&every[..], &["--role", "ingest"]].concat());
    let stopping = GatewayProcess::start(&db.url, &[&every[..], &["--role", "worker"]].concat());
    for process in [&watcher, &stopping] {
        wait_ready(process.addr).await;
    }
    let base = format!("http://{}", watcher.addr);
    let admin = |path: &'static str, body: Value| crate::support::admin_post_at(&base, path, body);
    admin("/v1/sources", serde_json::json!({"name": "shop", "kind": "none"})).await;
    let endpoint = admin("/v1/endpoints", serde_json::json!({"url": sink.url("/hook")})).await;
    admin("/v1/subscriptions", serde_json::json!({"endpoint_id": endpoint["id"], "source": "shop"})).await;
    let answer = reqwest::Client::new().post(format!("{base}/ingest/shop")).body("{}").send().await.expect("ingest");
    assert_eq!(answer.status(), 200);
    eventually(Duration::from_secs(30), "the delivery at the subscriber", || async {
        (sink.count() == 1).then_some(())
    })
    .await;

    let stopped = tokio::task::spawn_blocking(move || {
        let mut stopping = stopping;
        stopping.terminate_within(Duration::from_secs(60))
    });
    let mut seen = Vec::new();
    while !stopped.is_finished() {
        let state = replica(&roster(&base).await, "worker")["state"].as_str().unwrap_or_default().to_owned();
        if seen.last() != Some(&state) {
            seen.push(state);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let status = stopped.await.expect("join").expect("stopped within 60 s");
    assert!(status.success(), "a clean stop: {status:?}");
    let last = replica(&roster(&base).await, "worker")["state"].clone();
    assert!(!seen.iter().any(|s| s == "lost"), "read lost while stopping: {seen:?}");
    assert!(seen.iter().any(|s| s == "draining"), "read draining while stopping: {seen:?}");
    assert_eq!(last, "stopped", "{seen:?}");
}
