//! The per-endpoint circuit breaker: shared by replicas, spends no attempts while open,
//! admits exactly one half-open probe, recovers, survives a crashed prober.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::sink::{Reply, Sink};
use crate::support::{GatewayProcess, TestApp, TestDb, count_status, eventually, seed_deliveries, test_settings};

async fn endpoint(app: &TestApp, id: &str) -> Value {
    app.admin_get(&format!("/v1/endpoints/{id}")).await
}

async fn in_flight(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE leased_until > now() AND status = 'pending'")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// 200 deliveries to an endpoint answering 503: it gets about `threshold` requests (plus
/// what was in flight), the circuit opens, and every other delivery still has
/// attempt_count 0: parked, not failed.
#[tokio::test]
async fn an_open_circuit_stops_sending_and_spends_no_attempts() {
    let mut settings = test_settings();
    settings.delivery.circuit.cooldown = Duration::from_secs(300);
    let workers = settings.delivery.workers;
    let threshold = settings.delivery.circuit.failure_threshold as usize;
    let app = TestApp::spawn_with(TestDb::new().await, settings, 16).await;
    let sink = Sink::start(|_, _| Reply::status(503)).await;
    let ep = app.endpoint_for(&sink.url("/"), Some("api")).await;
    seed_deliveries(&app.db.pool, &ep, 200).await;

    // The stable state: open, nothing in flight, and every delivery that was not sent is
    // parked (out of the claim's index: nothing can send it before the cool-down ends).
    let sent = eventually(Duration::from_secs(30), "circuit open, nothing in flight, the rest parked", || async {
        let e = endpoint(&app, &ep).await;
        let unsent_unparked: i64 =
            sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE attempt_count = 0 AND NOT parked")
                .fetch_one(&app.db.pool)
                .await
                .unwrap();
        let sent = sink.count();
        (e["circuit"]["state"] == "open" && in_flight(&app.db).await == 0 && unsent_unparked == 0).then_some(sent)
    })
    .await;
    assert!(sent >= threshold, "{sent} requests");
    assert!(sent <= threshold + workers, "{sent} requests: at most threshold + what was in flight");
    let untouched: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE attempt_count = 0")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(untouched, 200 - sent as i64, "every delivery not sent has spent no attempt");
    let parked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE parked").fetch_one(&app.db.pool).await.unwrap();
    assert!(parked >= untouched, "due deliveries of the open endpoint are parked ({parked})");
    assert_eq!(count_status(&app.db.pool, "dead").await, 0);
    let e = endpoint(&app, &ep).await;
    assert!(e["circuit"]["consecutive_failures"].as_i64().unwrap() >= threshold as i64);
    assert_eq!(e["circuit"]["open_count"], 1);
}

/// A subscriber that answers 503 with `Retry-After: 3600` opens the circuit (threshold 1)
/// with its one delivery waiting an hour. The half-open probe takes only a delivery that
/// is due: cool-down after cool-down passes (200 ms each) and nothing is sent, no attempt
/// spent. Before, the probe took the oldest pending delivery whatever its time, so the
/// subscriber that asked for an hour was called again at every cool-down, each call an
/// attempt of the budget (five within 15 s here, with the reviewer's settings).
#[tokio::test]
async fn a_probe_takes_only_a_delivery_that_is_due() {
    let mut settings = test_settings();
    settings.delivery.circuit.failure_threshold = 1;
    settings.delivery.circuit.cooldown = Duration::from_millis(200);
    settings.delivery.circuit.cooldown_cap = Duration::from_millis(400);
    let app = TestApp::spawn_with(TestDb::new().await, settings, 4).await;
    let sink = Sink::start(|_, _| Reply::Status(503, vec![("retry-after", "3600".into())], String::new())).await;
    let ep = app.endpoint_for(&sink.url("/"), Some("api")).await;
    seed_deliveries(&app.db.pool, &ep, 1).await;
    eventually(Duration::from_secs(30), "the circuit open after the first answer", || async {
        (endpoint(&app, &ep).await["circuit"]["state"] == "open").then_some(())
    })
    .await;
    // Many cool-downs.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(sink.count(), 1, "the subscriber asked for an hour and was called again");
    let (attempts, hour_away): (i32, bool) = sqlx::query_as(
        "SELECT attempt_count, next_attempt_at > now() + interval '50 minutes' FROM deliveries WHERE endpoint_id = $1::uuid",
    )
    .bind(&ep)
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert_eq!((attempts, hour_away), (1, true), "one attempt spent, the next an hour away");
}

/// Two instances, 16 hungry workers, a subscriber that keeps failing: exactly one request
/// per half-open window, counted at the subscriber. Then it recovers: the probe closes
/// the circuit and the whole backlog is delivered without any budget exhausted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn half_open_admits_exactly_one_probe_across_replicas_then_recovers() {
    let db = TestDb::new().await;
    let mut settings = test_settings();
    settings.delivery.circuit.cooldown = Duration::from_millis(500);
    settings.delivery.circuit.cooldown_cap = Duration::from_millis(1000);
    let healthy = Arc::new(AtomicBool::new(false));
    let flag = healthy.clone();
    let sink =
        Sink::start(move |_, _| if flag.load(Ordering::SeqCst) { Reply::status(200) } else { Reply::status(503) })
            .await;
    let a = TestApp::spawn_with(TestDb { url: db.url.clone(), pool: db.pool.clone() }, settings.clone(), 16).await;
    let _b = TestApp::spawn_with(TestDb { url: db.url.clone(), pool: db.pool.clone() }, settings, 16).await;
    let ep = a.endpoint_for(&sink.url("/"), Some("api")).await;
    seed_deliveries(&db.pool, &ep, 100).await;

    eventually(Duration::from_secs(30), "circuit opens", || async {
        (endpoint(&a, &ep).await["circuit"]["open_count"].as_i64() >= Some(1)).then_some(())
    })
    .await;
    eventually(Duration::from_secs(30), "in-flight requests drain", || async {
        (in_flight(&db).await <= 1).then_some(())
    })
    .await;
    let burst = sink.count();
    let opens_at_burst = endpoint(&a, &ep).await["circuit"]["open_count"].as_i64().unwrap();
    // Watch until three more windows have ended in a failed probe each. Every failed probe
    // re-opens the circuit once (a second probe in a window would be fenced by the probe
    // token and re-open nothing): the requests after the burst are the re-opens, plus at
    // most the one probe that may be in flight between the two reads.
    let opens = eventually(Duration::from_secs(60), "three failed probes", || async {
        let opens = endpoint(&a, &ep).await["circuit"]["open_count"].as_i64().unwrap();
        (opens >= opens_at_burst + 3).then_some(opens)
    })
    .await;
    let probes: Vec<Instant> = sink.received()[burst..].iter().map(|r| r.at).collect();
    let reopened = (opens - opens_at_burst) as usize;
    assert!(
        probes.len() == reopened || probes.len() == reopened + 1,
        "{} requests for {reopened} failed probes: more than one probe per window",
        probes.len()
    );
    for pair in probes.windows(2) {
        let gap = pair[1].duration_since(pair[0]);
        assert!(gap >= Duration::from_millis(400), "two requests {gap:?} apart: two probes in one window");
    }

    healthy.store(true, Ordering::SeqCst);
    eventually(Duration::from_secs(60), "backlog delivered", || async {
        (count_status(&db.pool, "delivered").await == 100).then_some(())
    })
    .await;
    assert_eq!(endpoint(&a, &ep).await["circuit"]["state"], "closed");
    let worst: i32 = sqlx::query_scalar("SELECT max(attempt_count) FROM deliveries").fetch_one(&db.pool).await.unwrap();
    assert!(worst < 8, "no delivery came near its budget (worst: {worst} attempts)");
    assert_eq!(count_status(&db.pool, "dead").await, 0);
}

/// The prober is SIGKILLed mid-probe: the circuit is not wedged. When the probe lease
/// runs out another probe is admitted, succeeds, and the circuit closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_prober_does_not_wedge_the_circuit() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::start(|_, n| if n == 0 { Reply::Hold(Duration::from_secs(60)) } else { Reply::status(200) }).await;
    let ep = app.endpoint_for(&sink.url("/"), Some("api")).await;
    seed_deliveries(&app.db.pool, &ep, 3).await;
    sqlx::query("UPDATE endpoints SET circuit_state = 'open', open_count = 1, opened_at = now(), reopen_at = now()")
        .execute(&app.db.pool)
        .await
        .unwrap();
    let lease = ["--role", "worker", "--request-timeout-secs", "1", "--lease-secs", "11"];
    let mut prober = GatewayProcess::start(&app.db.url, &lease);
    eventually(Duration::from_secs(30), "probe in flight", || async { (sink.count() == 1).then_some(()) }).await;
    prober.kill();
    assert_eq!(endpoint(&app, &ep).await["circuit"]["state"], "half_open");

    let _next = GatewayProcess::start(&app.db.url, &lease);
    eventually(Duration::from_secs(60), "all delivered", || async {
        (count_status(&app.db.pool, "delivered").await == 3).then_some(())
    })
    .await;
    let got = sink.received();
    assert!(got[1].at.duration_since(got[0].at) >= Duration::from_secs(10), "the second probe waited for the lease");
    assert_eq!(endpoint(&app, &ep).await["circuit"]["state"], "closed");
}

/// One dead endpoint (it hangs until our timeout) and one healthy endpoint share the
/// workers: the breaker takes the dead one out and the healthy one's deliveries flow.
#[tokio::test]
async fn a_failing_endpoint_does_not_hold_up_a_healthy_one() {
    let mut settings = test_settings();
    settings.egress.request_timeout = Duration::from_secs(2);
    settings.delivery.circuit.cooldown = Duration::from_secs(300);
    let workers = settings.delivery.workers;
    let app = TestApp::spawn_with(TestDb::new().await, settings, 16).await;
    let dead = Sink::start(|_, _| Reply::Hold(Duration::from_secs(30))).await;
    let healthy = Sink::ok().await;
    let dead_ep = app.endpoint_for(&dead.url("/"), Some("api")).await;
    let healthy_ep = app.admin_post("/v1/endpoints", serde_json::json!({"url": healthy.url("/")}), 201).await;
    let healthy_ep = healthy_ep["id"].as_str().unwrap().to_owned();
    // The dead endpoint's deliveries are older: first in line.
    seed_deliveries(&app.db.pool, &dead_ep, 100).await;
    sqlx::query("INSERT INTO deliveries (event_id, endpoint_id) SELECT id, $1::uuid FROM events")
        .bind(&healthy_ep)
        .execute(&app.db.pool)
        .await
        .unwrap();
    let started = Instant::now();
    eventually(Duration::from_secs(60), "healthy endpoint's deliveries done", || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE endpoint_id = $1::uuid AND status = 'delivered'")
                .bind(&healthy_ep)
                .fetch_one(&app.db.pool)
                .await
                .unwrap();
        (n == 100).then_some(())
    })
    .await;
    println!(
        "healthy endpoint drained in {:?} beside a hanging one (request timeout 2 s, {workers} workers)",
        started.elapsed()
    );
    assert!(dead.count() <= 5 + 2 * workers, "the dead endpoint got {} requests", dead.count());
    assert_eq!(healthy.count(), 100);
}

/// Pause parks deliveries without sending or spending attempts; resume releases them.
#[tokio::test]
async fn pause_and_resume() {
    let app = TestApp::spawn().await;
    let sink = Sink::ok().await;
    let ep = app.endpoint_for(&sink.url("/"), Some("api")).await;
    let paused = app.admin_post(&format!("/v1/endpoints/{ep}/pause"), serde_json::json!({}), 200).await;
    assert_eq!(paused["paused"], true);
    seed_deliveries(&app.db.pool, &ep, 20).await;
    eventually(Duration::from_secs(30), "all parked", || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE parked").fetch_one(&app.db.pool).await.unwrap();
        (n == 20).then_some(())
    })
    .await;
    assert_eq!(sink.count(), 0);
    let resumed = app.admin_post(&format!("/v1/endpoints/{ep}/resume"), serde_json::json!({}), 200).await;
    assert_eq!(resumed["paused"], false);
    eventually(Duration::from_secs(30), "delivered after resume", || async {
        (count_status(&app.db.pool, "delivered").await == 20).then_some(())
    })
    .await;
    let attempts: i64 =
        sqlx::query_scalar("SELECT sum(attempt_count) FROM deliveries").fetch_one(&app.db.pool).await.unwrap();
    assert_eq!(attempts, 20, "one attempt each: the pause spent none");
    let (status, _) =
        app.admin(reqwest::Method::POST, &format!("/v1/endpoints/{}/pause", uuid::Uuid::new_v4()), None).await;
    assert_eq!(status, 404);
}

/// The state a crash leaves right after the transaction that closed a circuit committed
/// (circuit closed, `release_pending` set, the whole backlog still parked) and before
/// anything released it. A fresh process releases it at the configured rate and delivers
/// every delivery once; nothing stays parked on the closed endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_left_parked_by_a_crash_after_the_circuit_closed_is_released_by_a_fresh_process() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::ok().await;
    let ep = app.endpoint_for(&sink.url("/"), Some("api")).await;
    seed_deliveries(&app.db.pool, &ep, 300).await;
    sqlx::query("UPDATE deliveries SET parked = true").execute(&app.db.pool).await.unwrap();
    sqlx::query("UPDATE endpoints SET circuit_state = 'closed', release_pending = true")
        .execute(&app.db.pool)
        .await
        .unwrap();

    let _fresh = GatewayProcess::start(&app.db.url, &["--role", "worker", "--circuit-release-per-sec", "100"]);
    eventually(Duration::from_secs(60), "the parked backlog delivered", || async {
        (count_status(&app.db.pool, "delivered").await == 300).then_some(())
    })
    .await;
    let got = sink.received();
    let ids: std::collections::HashSet<String> = got.iter().map(|r| r.header("webhook-id")).collect();
    assert_eq!((got.len(), ids.len()), (300, 300), "each delivered exactly once");
    // 300 rows at 100/s are due over 3 s: they cannot arrive faster than that.
    let span = got.last().unwrap().at.duration_since(got[0].at);
    assert!(span >= Duration::from_millis(2500), "released at the configured rate, not at once: {span:?}");
    let (parked, flagged): (i64, bool) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM deliveries WHERE parked), (SELECT release_pending FROM endpoints WHERE id = $1::uuid)",
    )
    .bind(&ep)
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert_eq!((parked, flagged), (0, false));
}

/// A release step never un-parks an endpoint that is still blocked (open or paused), and
/// keeps the flag so the release happens once it is runnable.
#[tokio::test]
async fn a_pending_release_waits_for_its_endpoint_to_be_runnable() {
    let db = TestDb::new().await;
    let ep = crate::support::insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    seed_deliveries(&db.pool, &ep, 5).await;
    sqlx::query("UPDATE deliveries SET parked = true").execute(&db.pool).await.unwrap();
    for blocked in ["circuit_state = 'open', paused = false", "circuit_state = 'closed', paused = true"] {
        sqlx::query(&format!(
            "UPDATE endpoints SET release_pending = true, reopen_at = now() + interval '1 hour', {blocked}"
        ))
        .execute(&db.pool)
        .await
        .unwrap();
        let released = webhook_gateway::queue::release_parked(&db.pool, 100, None).await.unwrap();
        assert_eq!(released, 0, "{blocked}");
        let flagged: bool =
            sqlx::query_scalar("SELECT release_pending FROM endpoints").fetch_one(&db.pool).await.unwrap();
        assert!(flagged, "{blocked}: the flag stays until the release is done");
    }
    sqlx::query("UPDATE endpoints SET circuit_state = 'closed', paused = false").execute(&db.pool).await.unwrap();
    assert_eq!(webhook_gateway::queue::release_parked(&db.pool, 100, None).await.unwrap(), 5);
    let (parked, flagged): (i64, bool) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM deliveries WHERE parked), (SELECT release_pending FROM endpoints)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((parked, flagged), (0, false));
}

/// The circuit's history: an endpoint that fails long enough to open its circuit, fails
/// a probe, then recovers has each change recorded (opened, opened again, closed, with
/// the failures and opens behind it), and its console page shows them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_circuit_s_openings_and_closing_are_kept_and_shown_on_the_endpoint_page() {
    let mut settings = test_settings();
    settings.delivery.circuit.cooldown_cap = Duration::from_millis(1000);
    let threshold = settings.delivery.circuit.failure_threshold as usize;
    let app = TestApp::spawn_with(TestDb::new().await, settings, 16).await;
    let healthy = Arc::new(AtomicBool::new(false));
    let flag = healthy.clone();
    let sink =
        Sink::start(move |_, _| if flag.load(Ordering::SeqCst) { Reply::status(200) } else { Reply::status(503) })
            .await;
    let ep = app.endpoint_for(&sink.url("/"), Some("api")).await;
    seed_deliveries(&app.db.pool, &ep, 40).await;
    // Opened, then a probe failed (opened again); then the endpoint recovers.
    eventually(Duration::from_secs(30), "opened and a probe failed", || async {
        (endpoint(&app, &ep).await["circuit"]["open_count"].as_i64() >= Some(2)).then_some(())
    })
    .await;
    healthy.store(true, Ordering::SeqCst);
    eventually(Duration::from_secs(60), "backlog delivered", || async {
        (count_status(&app.db.pool, "delivered").await == 40).then_some(())
    })
    .await;
    let changes: Vec<(String, i32, i32)> = sqlx::query_as(
        "SELECT change, failures, open_count FROM circuit_transitions WHERE endpoint_id = $1::uuid ORDER BY id",
    )
    .bind(&ep)
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    let names: Vec<&str> = changes.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(names.first(), Some(&"opened"), "{changes:?}");
    assert_eq!(names.last(), Some(&"closed"), "{changes:?}");
    assert!(names[1..names.len() - 1].iter().all(|n| *n == "reopened"), "{changes:?}");
    assert!(changes[0].1 >= threshold as i32 && changes[0].2 == 1, "opened after the threshold: {changes:?}");

    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let login =
        http.post(app.url("/console/login")).form(&[("token", crate::support::ADMIN_TOKEN)]).send().await.unwrap();
    let cookie = login.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_owned();
    let page = http.get(app.url(&format!("/console/endpoints/{ep}"))).header("cookie", cookie).send().await.unwrap();
    let html = page.text().await.unwrap();
    let table = html.split(r#"id="circuit-history""#).nth(1).expect("the circuit's history on the page");
    assert!(table.contains(">opened<") && table.contains(">closed<"), "{table}");
    assert!(table.contains(&format!("{} failures in a row", changes[0].1)), "{table}");
}

/// The recorder skips the circuit's read and update for a batch that only saw healthy
/// attempts, unless an endpoint of it has a circuit not at rest, which the outcome write
/// reports (`Recorded::unsettled`). Here: one endpoint at rest, one with failures that
/// another replica recorded, one whose circuit opened while its delivery was in flight.
/// A healthy batch to all three reports exactly the two, resets their failures, and
/// leaves the settled endpoint's row unwritten (its `xmin` unchanged). An outcome already
/// on record reports nothing.
#[tokio::test]
async fn a_healthy_batch_settles_the_circuits_another_replica_stirred_and_writes_no_other() {
    use webhook_gateway::circuit::{CircuitConfig, Signal};
    use webhook_gateway::deliver::recorder;
    use webhook_gateway::queue::{self, Outcome};

    let db = TestDb::new().await;
    let pool = &db.pool;
    let settled = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/settled").await;
    let failing = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/failing").await;
    let opened = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/opened").await;
    for endpoint in [&settled, &failing, &opened] {
        seed_deliveries(pool, endpoint, 2).await;
    }
    let claimed = queue::claim(pool, 10, Duration::from_secs(60)).await.expect("claim");
    assert_eq!(claimed.len(), 6, "two deliveries of each endpoint claimed");
    // What other replicas' recorders wrote meanwhile.
    sqlx::query("UPDATE endpoints SET consecutive_failures = 3 WHERE id = $1::uuid")
        .bind(&failing)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE endpoints SET circuit_state = 'open', consecutive_failures = 5, open_count = 1, opened_at = now(),
                              reopen_at = now() + interval '1 hour'
         WHERE id = $1::uuid",
    )
    .bind(&opened)
    .execute(pool)
    .await
    .unwrap();
    let endpoint_row = |id: String| async move {
        sqlx::query_as::<_, (String, String, i32)>(
            "SELECT xmin::text, circuit_state, consecutive_failures FROM endpoints WHERE id = $1::uuid",
        )
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
    };
    let settled_before = endpoint_row(settled.clone()).await;

    // The outcome write reports the unsettled endpoints of what it wrote.
    let mut first: Vec<&queue::Claimed> = Vec::new();
    for c in &claimed {
        if !first.iter().any(|f| f.endpoint_id == c.endpoint_id) {
            first.push(c);
        }
    }
    assert_eq!(first.len(), 3, "one delivery of each endpoint");
    let rows: Vec<_> = first.iter().map(|c| crate::support::attempt_record(c, Outcome::Delivered)).collect();
    let mut tx = pool.begin().await.unwrap();
    let recorded = queue::record(&mut tx, &rows).await.expect("record");
    let mut unsettled: Vec<String> = recorded.unsettled.iter().map(ToString::to_string).collect();
    unsettled.sort();
    let mut expected = vec![failing.clone(), opened.clone()];
    expected.sort();
    assert_eq!(unsettled, expected, "the stirred endpoints, and only those");
    let again = queue::record(&mut tx, &rows).await.expect("record again");
    assert_eq!((again.already.len(), again.unsettled.len()), (3, 0), "already on record: nothing to observe");
    tx.rollback().await.unwrap();

    // The recorder: healthy attempts, no probe.
    let batch: Vec<_> = claimed
        .iter()
        .map(|c| recorder::Finished {
            record: crate::support::attempt_record(c, Outcome::Delivered),
            signal: Signal::Healthy,
            probe_token: None,
            span: tracing::Span::none(),
        })
        .collect();
    recorder::write(pool, &batch, &CircuitConfig::default(), &recorder::Patience::of(Duration::from_secs(60))).await;
    assert_eq!(count_status(pool, "delivered").await, 6, "every outcome recorded");
    let (_, state, failures) = endpoint_row(failing).await;
    assert_eq!((state.as_str(), failures), ("closed", 0), "the failures another replica recorded are reset");
    let (_, state, failures) = endpoint_row(opened).await;
    assert_eq!((state.as_str(), failures), ("open", 0), "open until its probe, its failures reset");
    assert_eq!(endpoint_row(settled).await, settled_before, "the settled endpoint's row was not written");
}

/// A half-open probe claimed by a dispatcher whose next statement in the same turn fails
/// (the general claim, here blocked on a locked endpoint row and its session terminated,
/// as a failover or an administrator would) is still sent: each claim commits on its own,
/// and what an earlier one took is leased to the process. (Before, the failure dropped
/// the probe: it waited out its lease with an attempt counted and nothing sent, and the
/// endpoint's half-open slot was held for that whole lease.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_claimed_before_a_failing_statement_is_still_sent() {
    use sqlx::{Connection as _, Executor as _};
    let db = TestDb::new().await;
    let sink = Sink::ok().await;
    let busy = crate::support::insert_endpoint(&db.pool, &sink.url("/busy")).await;
    let open = crate::support::insert_endpoint(&db.pool, &sink.url("/open")).await;
    seed_deliveries(&db.pool, &busy, 1).await;
    seed_deliveries(&db.pool, &open, 1).await;
    crate::support::set_endpoint(&db.pool, &open, "circuit_state = 'open', reopen_at = now()").await;
    sqlx::query("UPDATE deliveries SET parked = true WHERE endpoint_id = $1::uuid")
        .bind(&open)
        .execute(&db.pool)
        .await
        .unwrap();
    // The busy endpoint's row is held: a general claim that reaches it waits.
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    holder.execute("BEGIN").await.unwrap();
    sqlx::query("SELECT 1 FROM endpoints WHERE id = $1::uuid FOR UPDATE")
        .bind(&busy)
        .execute(&mut holder)
        .await
        .unwrap();

    let _app = TestApp::spawn_with(TestDb { url: db.url.clone(), pool: db.pool.clone() }, test_settings(), 16).await;
    eventually(Duration::from_secs(30), "the probe sent", || async {
        // Every claim that waits for the held row fails, as a terminated session does.
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        sink.received().iter().any(|r| r.path == "/open").then_some(())
    })
    .await;
    let attempts: i32 = sqlx::query_scalar("SELECT attempt_count FROM deliveries WHERE endpoint_id = $1::uuid")
        .bind(&open)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(attempts, 1, "the probe is attempt 1");
    holder.execute("ROLLBACK").await.unwrap();
    eventually(Duration::from_secs(30), "both delivered once the row is let go", || async {
        (count_status(&db.pool, "delivered").await == 2).then_some(())
    })
    .await;
}
