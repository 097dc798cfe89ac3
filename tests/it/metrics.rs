//! Prometheus metrics, scraped from a real gateway process (the recorder is per process,
//! so the counts are exactly this test's).

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;

use crate::support::sink::{Reply, Sink};
use crate::support::{
    ADMIN_TOKEN, GatewayProcess, TestDb, count_status, eventually, insert_endpoint, seed_deliveries, wait_ready,
};
use webhook_gateway::queue;

/// `name{labels} value` lines, keyed by name plus sorted labels.
pub(crate) fn parse(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        let key = match series.split_once('{') {
            Some((name, labels)) => {
                let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
                labels.sort();
                format!("{name}{{{}}}", labels.join(","))
            }
            None => series.to_owned(),
        };
        out.insert(key, value.parse().unwrap_or(f64::NAN));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraped_counters_match_a_scripted_sequence() {
    let db = TestDb::new().await;
    let sink = Sink::start(|r, _| if r.path == "/bad" { Reply::status(400) } else { Reply::status(200) }).await;
    let gw = GatewayProcess::start(&db.url, &["--metrics-sample-secs", "1"]);
    wait_ready(gw.addr).await;
    let base = format!("http://{}", gw.addr);
    let http = reqwest::Client::new();
    let admin = |path: &str, body: serde_json::Value| {
        http.post(format!("{base}{path}")).bearer_auth(ADMIN_TOKEN).json(&body).send()
    };
    let src = json!({"name": "shop", "kind": "none", "dedupe": {"header": "x-id"}, "event_type": {"header": "x-type"}});
    assert_eq!(admin("/v1/sources", src).await.unwrap().status(), 201);
    let gh = json!({"name": "gh", "kind": "github", "secrets": ["s3cret-value"]});
    assert_eq!(admin("/v1/sources", gh).await.unwrap().status(), 201);
    for (path, pattern) in [("/ok", "ok.*"), ("/bad", "bad.*")] {
        let ep: serde_json::Value =
            admin("/v1/endpoints", json!({"url": sink.url(path)})).await.unwrap().json().await.unwrap();
        let sub = json!({"endpoint_id": ep["id"], "source": "shop", "event_types": [pattern]});
        assert_eq!(admin("/v1/subscriptions", sub).await.unwrap().status(), 201);
    }
    let ingest = |id: &'static str, t: &'static str| {
        http.post(format!("{base}/ingest/shop")).header("x-id", id).header("x-type", t).body("{}").send()
    };
    assert_eq!(ingest("d1", "ok.created").await.unwrap().status(), 200);
    assert_eq!(ingest("d1", "ok.created").await.unwrap().status(), 200);
    let forged = http
        .post(format!("{base}/ingest/gh"))
        .header("x-hub-signature-256", format!("sha256={}", "0".repeat(64)))
        .header("x-github-event", "push")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 401);
    let unknown = http.post(format!("{base}/ingest/nowhere")).body("{}").send().await.unwrap();
    assert_eq!(unknown.status(), 404);
    // A name that is not UTF-8 names no source either, and is counted as such.
    let not_utf8 = http.post(format!("{base}/ingest/%FF")).body("{}").send().await.unwrap();
    assert_eq!(not_utf8.status(), 404);
    assert_eq!(ingest("d2", "bad.created").await.unwrap().status(), 200);
    eventually(Duration::from_secs(30), "one delivered, one dead", || async {
        (count_status(&db.pool, "delivered").await == 1 && count_status(&db.pool, "dead").await == 1).then_some(())
    })
    .await;

    // Counters are recorded as things happen; the queue gauges are sampled (every second here).
    let scraped = eventually(Duration::from_secs(15), "sampled gauges caught up", || async {
        let text = http.get(format!("{base}/metrics")).send().await.ok()?.text().await.ok()?;
        let m = parse(&text);
        // Each write is counted and timed once it has ended: both, or neither yet.
        let writes: f64 =
            m.iter().filter(|(k, _)| k.starts_with("webhook_gateway_outcome_writes_total{")).map(|(_, v)| *v).sum();
        let timed = m.get("webhook_gateway_outcome_write_seconds_count").copied().unwrap_or(0.0);
        (m.get(r#"webhook_gateway_queue_deliveries{state="dead"}"#) == Some(&1.0) && writes >= 1.0 && timed == writes)
            .then_some(m)
    })
    .await;
    let get = |k: &str| scraped.get(k).copied().unwrap_or_else(|| panic!("{k} missing from {scraped:#?}"));
    assert_eq!(get(r#"webhook_gateway_ingest_requests_total{outcome="accepted",source="shop"}"#), 2.0);
    assert_eq!(get(r#"webhook_gateway_ingest_requests_total{outcome="duplicate",source="shop"}"#), 1.0);
    assert_eq!(get(r#"webhook_gateway_ingest_requests_total{outcome="rejected",source="gh"}"#), 1.0);
    assert_eq!(get(r#"webhook_gateway_ingest_rejected_total{reason="invalid_signature",source="gh"}"#), 1.0);
    // What senders saw, refusals that stored nothing included.
    assert_eq!(get(r#"webhook_gateway_ingest_responses_total{status="200"}"#), 3.0);
    assert_eq!(get(r#"webhook_gateway_ingest_responses_total{status="401"}"#), 1.0);
    assert_eq!(get(r#"webhook_gateway_ingest_responses_total{status="404"}"#), 2.0);
    assert_eq!(get(r#"webhook_gateway_attempts_total{class="2xx",outcome="delivered"}"#), 1.0);
    assert_eq!(get(r#"webhook_gateway_attempts_total{class="4xx",outcome="dead"}"#), 1.0);
    assert_eq!(get("webhook_gateway_attempt_duration_seconds_count"), 2.0);
    // One request at a time: each webhook that reached the database was written alone
    // (the duplicate may have been answered from the cache of recent keys).
    let alone = get(r#"webhook_gateway_ingest_writes_total{kind="alone"}"#);
    assert!((2.0..=3.0).contains(&alone), "writes alone: {alone}");
    assert_eq!(get(r#"webhook_gateway_ingest_write_webhooks_total{kind="alone"}"#), alone);
    assert_eq!(get(r#"webhook_gateway_ingest_write_seconds_count{kind="alone"}"#), alone);
    assert!(!scraped.contains_key(r#"webhook_gateway_ingest_writes_total{kind="batch"}"#), "{scraped:#?}");
    // The two outcomes took one write or two, each counted once with why its batch ended.
    let writes: Vec<(&String, &f64)> =
        scraped.iter().filter(|(k, _)| k.starts_with("webhook_gateway_outcome_writes_total{")).collect();
    let total: f64 = writes.iter().map(|(_, v)| **v).sum();
    assert!((1.0..=2.0).contains(&total), "outcome writes: {writes:?}");
    for (series, _) in &writes {
        let known = ["full", "urgent", "waiting", "linger", "closed"]
            .iter()
            .any(|e| **series == format!(r#"webhook_gateway_outcome_writes_total{{ended="{e}"}}"#));
        assert!(known, "an unknown reason: {series}");
    }
    // Each write timed once.
    assert_eq!(get("webhook_gateway_outcome_write_seconds_count"), total);
    assert!(get("webhook_gateway_outcome_write_seconds_sum") > 0.0);
    assert_eq!(get(r#"webhook_gateway_queue_deliveries{state="dead"}"#), 1.0);
    assert_eq!(get(r#"webhook_gateway_queue_deliveries{state="pending"}"#), 0.0);
    assert!(scraped.keys().any(|k| k.starts_with("webhook_gateway_circuit_state{")));
    assert!(scraped.contains_key(r#"webhook_gateway_db_pool_connections{state="idle"}"#));
    // The counts come from the fleet's one sample (this process leads it), and say how old.
    let age = get("webhook_gateway_stats_age_seconds");
    assert!((0.0..5.0).contains(&age), "stats age {age}");
    // The server's connections against what it takes, as the server itself says.
    let (max, reserved): (String, String) =
        sqlx::query_as("SELECT current_setting('max_connections'), current_setting('superuser_reserved_connections')")
            .fetch_one(&db.pool)
            .await
            .expect("the server's settings");
    let limit = get("webhook_gateway_database_connections_limit");
    assert_eq!(limit, max.parse::<f64>().unwrap() - reserved.parse::<f64>().unwrap());
    let (all, ours) = (
        get(r#"webhook_gateway_database_connections{of="all"}"#),
        get(r#"webhook_gateway_database_connections{of="gateway"}"#),
    );
    assert!(ours >= 1.0 && all >= ours, "connections: {ours} of {all}, limit {limit}");
    let accepted_series = scraped.keys().filter(|k| k.starts_with("webhook_gateway_ingest_requests_total")).count();
    assert_eq!(accepted_series, 3, "no other label values (bounded cardinality)");
}

/// Group commit's writes are counted with the webhooks they held: every accepted webhook
/// of a burst in exactly one write, each batch of two or more, each write timed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_webhook_of_a_burst_is_counted_in_one_write() {
    const BURST: usize = 48;
    let db = TestDb::new().await;
    let gw = GatewayProcess::start(&db.url, &["--role", "ingest"]);
    wait_ready(gw.addr).await;
    let base = format!("http://{}", gw.addr);
    let http = reqwest::Client::new();
    let src = json!({"name": "shop", "kind": "none", "dedupe": {"header": "x-id"}});
    let created = http.post(format!("{base}/v1/sources")).bearer_auth(ADMIN_TOKEN).json(&src).send().await.unwrap();
    assert_eq!(created.status(), 201);
    let sends = (0..BURST).map(|i| {
        let request = http.post(format!("{base}/ingest/shop")).header("x-id", format!("burst-{i}")).body("{}");
        async move { request.send().await.map(|r| r.status().as_u16()) }
    });
    let statuses = futures_util::future::join_all(sends).await;
    assert!(statuses.iter().all(|s| matches!(s, Ok(200))), "{statuses:?}");

    let scraped = parse(&http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap());
    let get = |k: String| scraped.get(&k).copied().unwrap_or(0.0);
    let mut webhooks = 0.0;
    for kind in ["alone", "batch"] {
        let writes = get(format!(r#"webhook_gateway_ingest_writes_total{{kind="{kind}"}}"#));
        let held = get(format!(r#"webhook_gateway_ingest_write_webhooks_total{{kind="{kind}"}}"#));
        let timed = get(format!(r#"webhook_gateway_ingest_write_seconds_count{{kind="{kind}"}}"#));
        assert_eq!(timed, writes, "{kind}: each write timed once");
        let least = if kind == "alone" { 1.0 } else { 2.0 };
        assert!(held >= least * writes, "{kind}: {held} webhooks in {writes} writes");
        webhooks += held;
    }
    assert_eq!(webhooks, BURST as f64, "{scraped:#?}");
}

/// Every lease is counted once, by what took it: a webhook posted to an idle `role all`
/// gateway is leased by the statement that stores it (`ingest`) once the dispatcher has
/// opened the hand-off (its first claims at start-up keep it closed for a moment, so
/// webhooks are posted one at a time until one is); one posted while a claim holds its
/// endpoint's row is not (its statement skips the row) and is leased by the dispatcher
/// after the row is let go (`claim_by_key`, or `claim` when the dispatcher owed a general
/// claim). The leases add up to the attempts, under the five known labels only. Control:
/// the dispatcher's leases counted under `ingest` fail it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lease_is_counted_once_by_what_took_it() {
    let db = TestDb::new().await;
    let sink = Sink::ok().await;
    let gw = GatewayProcess::start(&db.url, &[]);
    wait_ready(gw.addr).await;
    let base = format!("http://{}", gw.addr);
    let http = reqwest::Client::new();
    let admin = |path: &str, body: serde_json::Value| {
        http.post(format!("{base}{path}")).bearer_auth(ADMIN_TOKEN).json(&body).send()
    };
    let src = json!({"name": "shop", "kind": "none", "dedupe": {"header": "x-id"}});
    assert_eq!(admin("/v1/sources", src).await.unwrap().status(), 201);
    let ep: serde_json::Value =
        admin("/v1/endpoints", json!({"url": sink.url("/")})).await.unwrap().json().await.unwrap();
    let ep = ep["id"].as_str().expect("endpoint id").to_owned();
    let sub = json!({"endpoint_id": ep, "source": "shop"});
    assert_eq!(admin("/v1/subscriptions", sub).await.unwrap().status(), 201);
    let ingest = |id: String| http.post(format!("{base}/ingest/shop")).header("x-id", id).body("{}").send();
    // The counter's series, one for each thing that takes a lease.
    let series = ["ingest", "claim_by_key", "claim", "probe", "promotion"]
        .map(|by| format!(r#"webhook_gateway_leases_total{{by="{by}"}}"#));
    let leases = || async {
        let scraped = parse(&http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap());
        let by = series.clone().map(|name| scraped.get(&name).copied().unwrap_or(0.0));
        (by, scraped)
    };
    let delivered = |n: i64| {
        let pool = db.pool.clone();
        async move {
            eventually(Duration::from_secs(30), "delivered", || async {
                (count_status(&pool, "delivered").await == n).then_some(())
            })
            .await
        }
    };

    // One at a time until ingest leases one itself: each webhook is leased once.
    let mut sent = 0;
    loop {
        sent += 1;
        assert_eq!(ingest(format!("lease-{sent}")).await.unwrap().status(), 200);
        delivered(sent).await;
        let ([by_ingest, by_key, by_claim, probes, by_promotion], _) = leases().await;
        assert_eq!(by_ingest + by_key + by_claim + probes + by_promotion, sent as f64, "each webhook leased once");
        if by_ingest >= 1.0 {
            break;
        }
        assert!(sent < 50, "no webhook leased by its own statement in {sent}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (before, _) = leases().await;

    let holder = crate::prelease_locked::hold_as_a_claim(&db.pool, &[&ep]).await;
    assert_eq!(ingest("held".to_owned()).await.unwrap().status(), 200, "answered while the row is held");
    holder.commit().await.expect("let the endpoint go");
    delivered(sent + 1).await;

    let (after, scraped) = leases().await;
    let taken = |i: usize| after[i] - before[i];
    assert_eq!(taken(0), 0.0, "the held endpoint's webhook not leased by its own statement: {scraped:#?}");
    assert_eq!(taken(1) + taken(2), 1.0, "but by the dispatcher: {scraped:#?}");
    assert_eq!(after[3], 0.0, "no probe");
    assert_eq!(after[4], 0.0, "no line, so no next head leased by an outcome write");
    let unknown: Vec<&String> =
        scraped.keys().filter(|k| k.starts_with("webhook_gateway_leases_total{") && !series.contains(k)).collect();
    assert!(unknown.is_empty(), "no other label values: {unknown:?}");
    assert_eq!(
        after.iter().sum::<f64>(),
        scraped.get(r#"webhook_gateway_attempts_total{class="2xx",outcome="delivered"}"#).copied().unwrap_or(0.0),
        "one lease an attempt"
    );
}

/// `--log-format json`: one JSON object per line, and a log line caused by a request
/// carries that request's id (which the response echoes).
#[tokio::test]
async fn json_logs_carry_the_request_id() {
    let db = TestDb::new().await;
    let gw = GatewayProcess::start(&db.url, &["--log-format", "json", "--role", "ingest"]);
    let base = format!("http://{}", gw.addr);
    let http = reqwest::Client::new();
    eventually(Duration::from_secs(30), "gateway ready", || async {
        let r = http.get(format!("{base}/readyz")).send().await.ok()?;
        r.status().is_success().then_some(())
    })
    .await;
    let ep: serde_json::Value = http
        .post(format!("{base}/v1/endpoints"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"url": "https://example.com/hook"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let resp = http
        .post(format!("{base}/v1/endpoints/{}/pause", ep["id"].as_str().unwrap()))
        .bearer_auth(ADMIN_TOKEN)
        .header("x-request-id", "req-from-caller-42")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-request-id"], "req-from-caller-42");
    let generated = http.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(generated.headers()["x-request-id"].len(), 36, "a UUID when the caller sends none");

    let line = eventually(Duration::from_secs(10), "the pause log line", || async {
        let text = std::fs::read_to_string(&gw.log).ok()?;
        text.lines().find(|l| l.contains("endpoint paused")).map(str::to_owned)
    })
    .await;
    let parsed: serde_json::Value = serde_json::from_str(&line).expect("JSON log line");
    assert_eq!(parsed["span"]["request_id"], "req-from-caller-42", "{parsed}");
    let text = std::fs::read_to_string(&gw.log).unwrap();
    for l in text.lines().filter(|l| !l.trim().is_empty()) {
        serde_json::from_str::<serde_json::Value>(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
    }
    assert!(!text.contains(ADMIN_TOKEN), "the admin token is never logged");
    assert!(!text.contains(ep["secret"].as_str().unwrap()), "secrets are never logged");
}

/// A transaction left open on the gateway's database (a report in `psql`, a `pg_dump`)
/// holds PostgreSQL's cleanup back: the sampled gauges show how long it has been open and
/// how many transactions old the horizon grows while the gateway works; once it ends, the
/// oldest open transaction is the gateway's own (milliseconds). Before it was opened (the
/// control), nothing was that old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_that_holds_the_database_s_cleanup_back_is_seen() {
    use sqlx::Connection as _;
    let db = TestDb::new().await;
    let gw = GatewayProcess::start(&db.url, &["--metrics-sample-secs", "1"]);
    wait_ready(gw.addr).await;
    let base = format!("http://{}", gw.addr);
    let http = reqwest::Client::new();
    let gauges = || async {
        let m = parse(&http.get(format!("{base}/metrics")).send().await.ok()?.text().await.ok()?);
        Some((
            *m.get("webhook_gateway_database_oldest_transaction_seconds")?,
            *m.get("webhook_gateway_database_horizon_age_transactions")?,
        ))
    };
    let (before, _) = eventually(Duration::from_secs(15), "the horizon sampled", gauges).await;
    assert!(before < 2.0, "nothing held the horizon yet: {before} s");

    // As pg_dump does: a snapshot held for the whole transaction.
    let mut report = sqlx::PgConnection::connect(&db.url).await.expect("a session of its own");
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM events")
        .execute(&mut report)
        .await
        .expect("a transaction left open");
    let sink = Sink::ok().await;
    crate::support::shop_to(&base, json!({"url": sink.url("/hook")})).await;
    for i in 0..20 {
        assert_eq!(crate::support::post_to_shop(&base, &format!("d-{i}"), &json!({"order": i})).await.0, 200);
    }
    let (held, age) = eventually(Duration::from_secs(30), "the held horizon seen", || async {
        let (held, age) = gauges().await?;
        (held >= 3.0 && age >= 20.0).then_some((held, age))
    })
    .await;
    assert!(held < 60.0 && age < 1e6, "{held} s, {age} transactions");

    sqlx::raw_sql("COMMIT").execute(&mut report).await.expect("the report ends");
    eventually(Duration::from_secs(15), "the horizon released", || async {
        let (held, _) = gauges().await?;
        (held < 1.0).then_some(())
    })
    .await;
}

/// The queue's "due" count (`webhook_gateway_queue_due`, the console's) is what a claim
/// would take now: rows never leased and rows whose lease ran out (a worker that died),
/// not rows under a live lease. Before, it counted only rows never leased, so right after
/// a crash, when an operator looks, it read 0 while the lag grew.
#[tokio::test]
async fn the_due_count_is_what_a_claim_would_take() {
    let db = TestDb::new().await;
    let endpoint = insert_endpoint(&db.pool, "http://127.0.0.1:9/due").await;
    seed_deliveries(&db.pool, &endpoint, 7).await;
    // Two left by a dead worker (their lease over: due at its end), two under a live
    // lease, three never leased and due.
    sqlx::query(
        "UPDATE deliveries d SET leased_until = now() - interval '1 second', next_attempt_at = now() - interval '1 second'
         FROM (SELECT id FROM deliveries ORDER BY id LIMIT 2) dead WHERE d.id = dead.id",
    )
    .execute(&db.pool)
    .await
    .expect("expired leases");
    sqlx::query(
        "UPDATE deliveries d SET leased_until = now() + interval '1 minute', next_attempt_at = now() + interval '1 minute'
         FROM (SELECT id FROM deliveries WHERE leased_until IS NULL ORDER BY id LIMIT 2) live WHERE d.id = live.id",
    )
    .execute(&db.pool)
    .await
    .expect("live leases");
    let stats = queue::read::stats(&db.pool).await.expect("stats");
    let claimed = queue::claim(&db.pool, 100, Duration::from_secs(60)).await.expect("claim");
    assert_eq!((stats.due, claimed.len()), (5, 5), "{stats:?}");
}

/// An endpoint deleted while its circuit is open leaves no open circuit exported: its
/// per-endpoint gauges go to rest at the next sample (before, their last values stayed
/// exported until every replica restarted, and the open-circuit alert never resolved).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_endpoint_s_gauges_are_set_to_rest() {
    let db = TestDb::new().await;
    let sink = Sink::start(|_, _| Reply::status(503)).await;
    let gw = GatewayProcess::start(
        &db.url,
        &["--metrics-sample-secs", "1", "--circuit-failure-threshold", "1", "--circuit-cooldown-ms", "600000"],
    );
    wait_ready(gw.addr).await;
    let base = format!("http://{}", gw.addr);
    let endpoint = crate::support::shop_to_sink(&base, &sink).await;
    let (status, _) = crate::support::post_to_shop(&base, "d-1", &json!({"order": 1})).await;
    assert_eq!(status, 200);
    let series = format!("webhook_gateway_circuit_state{{endpoint_id=\"{endpoint}\"}}");
    let state = |text: String| text.lines().find_map(|l| l.strip_prefix(series.as_str()).map(|v| v.trim().to_owned()));
    eventually(Duration::from_secs(30), "the circuit exported open", || async {
        (state(crate::support::scrape(gw.addr).await).as_deref() == Some("1")).then_some(())
    })
    .await;
    let deleted = reqwest::Client::new()
        .delete(format!("{base}/v1/endpoints/{endpoint}?force=true"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .expect("delete");
    assert_eq!(deleted.status(), 200);
    eventually(Duration::from_secs(30), "the deleted endpoint's circuit exported at rest", || async {
        (state(crate::support::scrape(gw.addr).await).as_deref() == Some("0")).then_some(())
    })
    .await;
}
