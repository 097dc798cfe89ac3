//! Retention and queue hygiene: the janitor deletes exactly what expired, never an event
//! with a pending delivery, one replica at a time; the claim stays on its partial index.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sqlx::postgres::PgArguments;
use tokio::sync::Barrier;
use uuid::Uuid;
use webhook_gateway::app::Settings;
use webhook_gateway::db;
use webhook_gateway::db::Pool;
use webhook_gateway::janitor::{self, JanitorSettings, PassOutcome, PassReport, RunStatus};
use webhook_gateway::queue;

use crate::support::{TestApp, TestDb, eventually, test_settings};

/// Default retention (30 days events and attempts, 7 days delivered), small batches so
/// every phase takes several statements, short pauses.
fn settings(batch_size: u32) -> JanitorSettings {
    JanitorSettings { batch_size, batch_pause: Duration::from_millis(5), ..JanitorSettings::default() }
}

async fn endpoint(pool: &Pool) -> Uuid {
    sqlx::query_scalar(
        "INSERT INTO endpoints (url, secret) VALUES ('http://127.0.0.1:9/', 'whsec_dGVzdA==') RETURNING id",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// An event received `days` ago.
async fn event(pool: &Pool, days: i32) -> Uuid {
    sqlx::query_scalar(
        "INSERT INTO events (source_id, dedupe_key, event_type, headers, payload, received_at)
         VALUES ((SELECT id FROM sources WHERE name = 'api'), gen_random_uuid()::text, 't', '{}', '\\x00',
                 now() - make_interval(days => $1))
         RETURNING id",
    )
    .bind(days)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A delivery in `status`, finished `finished_days` ago (None: not finished).
async fn delivery(pool: &Pool, event: Uuid, endpoint: Uuid, status: &str, finished_days: Option<i32>) -> Uuid {
    sqlx::query_scalar(
        "INSERT INTO deliveries (event_id, endpoint_id, status, finished_at, dead_reason, parked)
         VALUES ($1, $2, $3, now() - make_interval(days => $4), CASE WHEN $3 = 'dead' THEN 'test' END, $3 = 'pending')
         RETURNING id",
    )
    .bind(event)
    .bind(endpoint)
    .bind(status)
    .bind(finished_days)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// An attempt recorded `days` ago.
async fn attempt(pool: &Pool, delivery: Uuid, days: i32) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO attempts (delivery_id, attempt_number, started_at, duration_ms, outcome, reason, recorded_at)
         VALUES ($1, (SELECT count(*) + 1 FROM attempts WHERE delivery_id = $1), now() - make_interval(days => $2),
                 10, 'retry', 'test', now() - make_interval(days => $2))
         RETURNING id",
    )
    .bind(delivery)
    .bind(days)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn ids(pool: &Pool, sql: &str) -> Vec<Uuid> {
    let mut ids: Vec<Uuid> = sqlx::query_scalar(sql).fetch_all(pool).await.unwrap();
    ids.sort();
    ids
}

fn sorted(mut v: Vec<Uuid>) -> Vec<Uuid> {
    v.sort();
    v
}

fn ran(outcome: PassOutcome) -> PassReport {
    match outcome {
        PassOutcome::Ran(report) => report,
        PassOutcome::Skipped => panic!("the pass was skipped"),
    }
}

/// Every retention rule at once, against exact counts: delivered deliveries go 7 days
/// after delivery (with their attempts), events 30 days after arrival with everything
/// under them, attempts after 30 days; dead deliveries of unexpired events stay; an
/// expired event with a pending delivery is untouched, even when it is the oldest (the
/// batches walk past it) and even though its sibling delivery is dead.
#[tokio::test]
async fn retention_deletes_exactly_the_expired_rows() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let (ep1, ep2) = (endpoint(pool).await, endpoint(pool).await);

    // Expired, but a delivery is pending: kept with both deliveries.
    let e_blocked = event(pool, 45).await;
    let d_pending = delivery(pool, e_blocked, ep1, "pending", None).await;
    attempt(pool, d_pending, 40).await; // expired attempt: deleted
    let a_recent = attempt(pool, d_pending, 1).await;
    let d_blocked_dead = delivery(pool, e_blocked, ep2, "dead", Some(35)).await;
    attempt(pool, d_blocked_dead, 35).await; // expired attempt: deleted
    // Expired, finished: deleted with its deliveries and attempts.
    let e_done = event(pool, 40).await;
    let d_done_delivered = delivery(pool, e_done, ep1, "delivered", Some(40)).await;
    attempt(pool, d_done_delivered, 40).await;
    attempt(pool, d_done_delivered, 40).await;
    let d_done_dead = delivery(pool, e_done, ep2, "dead", Some(39)).await;
    attempt(pool, d_done_dead, 39).await;
    // Expired, no deliveries: deleted.
    let e_empty = event(pool, 31).await;
    // Ten days old: the delivered delivery (8 days) goes, the dead one stays.
    let e_week = event(pool, 10).await;
    let d_week_delivered = delivery(pool, e_week, ep1, "delivered", Some(8)).await;
    attempt(pool, d_week_delivered, 8).await;
    let d_week_dead = delivery(pool, e_week, ep2, "dead", Some(9)).await;
    let a_week_dead = attempt(pool, d_week_dead, 9).await;
    // Fresh: everything stays.
    let e_fresh = event(pool, 1).await;
    let d_fresh = delivery(pool, e_fresh, ep1, "delivered", Some(1)).await;
    let a_fresh = attempt(pool, d_fresh, 1).await;
    let d_fresh_pending = delivery(pool, e_fresh, ep2, "pending", None).await;
    // 29 days: the event stays, its delivered delivery (and attempt) goes.
    let e_29 = event(pool, 29).await;
    let d_29 = delivery(pool, e_29, ep1, "delivered", Some(29)).await;
    attempt(pool, d_29, 29).await;
    let _ = (e_done, e_empty, d_done_delivered, d_done_dead, d_week_delivered, d_29);

    assert_eq!((db.count("events").await, db.count("deliveries").await, db.count("attempts").await), (6, 9, 10));

    let report = ran(janitor::run_pass(pool, &settings(2), "test").await.unwrap());
    assert_eq!(report.status, RunStatus::Complete, "{report:?}");
    assert_eq!((report.events_deleted, report.deliveries_deleted, report.attempts_deleted), (2, 4, 7), "{report:?}");
    // delivered: 2 + 1 (the last short), events: 2 + 0, attempts: 2 + 0, idle lines: 0.
    assert_eq!(report.batches, 7, "{report:?}");

    assert_eq!((db.count("events").await, db.count("deliveries").await, db.count("attempts").await), (4, 5, 3));
    assert_eq!(ids(pool, "SELECT id FROM events").await, sorted(vec![e_blocked, e_week, e_fresh, e_29]));
    assert_eq!(
        ids(pool, "SELECT id FROM deliveries").await,
        sorted(vec![d_pending, d_blocked_dead, d_week_dead, d_fresh, d_fresh_pending])
    );
    let mut attempts: Vec<i64> = sqlx::query_scalar("SELECT id FROM attempts").fetch_all(pool).await.unwrap();
    attempts.sort();
    assert_eq!(attempts, vec![a_recent, a_week_dead, a_fresh]);

    let run: (String, String, i64, i64, i64, i32, bool) = sqlx::query_as(
        "SELECT instance, status, events_deleted, deliveries_deleted, attempts_deleted, batches, finished_at IS NOT NULL
         FROM janitor_runs",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(run, ("test".into(), "complete".into(), 2, 4, 7, 7, true));

    // Nothing left to do: a second pass deletes nothing.
    let again = ran(janitor::run_pass(pool, &settings(2), "test").await.unwrap());
    assert_eq!((again.events_deleted, again.deliveries_deleted, again.attempts_deleted), (0, 0, 0));
    assert_eq!(again.status, RunStatus::Complete);
    assert_eq!((db.count("events").await, db.count("deliveries").await, db.count("attempts").await), (4, 5, 3));
}

/// A pass stops at its batch cap and says so; the following passes finish the job.
#[tokio::test]
async fn a_pass_is_bounded_by_its_batch_cap() {
    let db = TestDb::new().await;
    for _ in 0..5 {
        event(&db.pool, 40).await;
    }
    let capped = JanitorSettings { max_batches_per_phase: 1, ..settings(2) };
    let first = ran(janitor::run_pass(&db.pool, &capped, "test").await.unwrap());
    assert_eq!((first.status, first.events_deleted), (RunStatus::Capped, 2));
    let second = ran(janitor::run_pass(&db.pool, &capped, "test").await.unwrap());
    assert_eq!((second.status, second.events_deleted), (RunStatus::Capped, 2));
    let third = ran(janitor::run_pass(&db.pool, &capped, "test").await.unwrap());
    assert_eq!((third.status, third.events_deleted), (RunStatus::Complete, 1));
    assert_eq!(db.count("events").await, 0);
    let statuses: Vec<String> =
        sqlx::query_scalar("SELECT status FROM janitor_runs ORDER BY id").fetch_all(&db.pool).await.unwrap();
    assert_eq!(statuses, ["capped", "capped", "complete"]);
}

/// A dead letter stays inspectable for the retention from its death: an event older than
/// the retention whose delivery died two days ago (after an endpoint paused past the
/// retention, or a late redelivery that failed again) is kept with it; one whose delivery
/// died past the retention goes. (Before, that dead letter went at the next pass, minutes
/// after it died.)
#[tokio::test]
async fn a_dead_letter_stays_for_the_retention_from_its_death() {
    let db = TestDb::new().await;
    let ep = endpoint(&db.pool).await;
    let recent = event(&db.pool, 40).await;
    let died_recently = delivery(&db.pool, recent, ep, "dead", Some(2)).await;
    let long_ago = event(&db.pool, 40).await;
    delivery(&db.pool, long_ago, ep, "dead", Some(31)).await;
    let report = ran(janitor::run_pass(&db.pool, &settings(2), "test").await.unwrap());
    assert_eq!((report.events_deleted, report.deliveries_deleted), (1, 1), "{report:?}");
    assert_eq!(ids(&db.pool, "SELECT id FROM events").await, vec![recent]);
    assert_eq!(ids(&db.pool, "SELECT id FROM deliveries").await, vec![died_recently]);
}

/// Expired events kept for their pending deliveries, more of them than a capped pass
/// reaches, do not hide the expired event behind them from the passes that follow: each
/// goes on where the last one stopped, and starts from the oldest again once one has been
/// through them all. (Before, every pass started from the oldest: the event behind them
/// was never deleted, and every pass was capped.)
#[tokio::test]
async fn passes_capped_by_kept_events_go_on_where_the_last_one_stopped() {
    let db = TestDb::new().await;
    let ep = endpoint(&db.pool).await;
    for _ in 0..6 {
        let kept = event(&db.pool, 40).await;
        delivery(&db.pool, kept, ep, "pending", None).await;
    }
    let behind = event(&db.pool, 35).await;
    let capped = JanitorSettings { max_batches_per_phase: 1, ..settings(2) };
    let mut resume = janitor::Resume::default();
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(ran(janitor::run_pass_from(&db.pool, &capped, "test", &mut resume).await.unwrap()).status);
    }
    assert_eq!(statuses, [RunStatus::Capped, RunStatus::Capped, RunStatus::Capped, RunStatus::Complete]);
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM events WHERE id = $1").bind(behind).fetch_one(&db.pool).await.unwrap();
    assert_eq!(left, 0, "the expired event behind the kept ones is deleted");
    assert_eq!(db.count("events").await, 6, "the kept ones stay");
    // Through them all: the next pass starts from the oldest again.
    let again = ran(janitor::run_pass_from(&db.pool, &capped, "test", &mut resume).await.unwrap());
    assert_eq!(again.status, RunStatus::Capped, "back at the oldest kept events");
}

/// Expired events kept alive by a pending delivery do not stall a pass, even when more of
/// them than a batch share one timestamp (one multi-row insert): the batches step over
/// them and delete the expired events behind them, in one pass.
#[tokio::test]
async fn kept_events_do_not_stall_the_pass() {
    let db = TestDb::new().await;
    let ep = endpoint(&db.pool).await;
    sqlx::query(
        "WITH ev AS (
             INSERT INTO events (source_id, dedupe_key, event_type, headers, payload, received_at)
             SELECT (SELECT id FROM sources WHERE name = 'api'), 'blocked-' || g, 't', '{}', '\\x00',
                    now() - interval '40 days'
             FROM generate_series(1, 5) g
             RETURNING id)
         INSERT INTO deliveries (event_id, endpoint_id) SELECT id, $1 FROM ev",
    )
    .bind(ep)
    .execute(&db.pool)
    .await
    .unwrap();
    for _ in 0..3 {
        event(&db.pool, 35).await;
    }
    let report = ran(janitor::run_pass(&db.pool, &settings(2), "test").await.unwrap());
    assert_eq!((report.status, report.events_deleted, report.deliveries_deleted), (RunStatus::Complete, 3, 0));
    assert_eq!((db.count("events").await, db.count("deliveries").await), (5, 5));
}

/// A dead delivery of an expired event is redelivered (back to pending) while the janitor
/// is deleting that event: the redelivery's transaction holds the row when the janitor
/// reaches it, the janitor waits, sees the committed pending row, and keeps the event and
/// the delivery. (Deciding on the statement's snapshot instead would delete a delivery
/// that an operator was just told is pending again.)
#[tokio::test]
async fn a_redelivery_racing_the_janitor_keeps_its_event() {
    let db = TestDb::new().await;
    let ep = endpoint(&db.pool).await;
    let ev = event(&db.pool, 40).await;
    let dl = delivery(&db.pool, ev, ep, "dead", Some(39)).await;
    attempt(&db.pool, dl, 39).await;

    let mut redeliver = db.pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE deliveries SET status = 'pending', finished_at = NULL, dead_reason = NULL, next_attempt_at = now()
         WHERE id = $1",
    )
    .bind(dl)
    .execute(&mut *redeliver)
    .await
    .unwrap();

    let pool = db.pool.clone();
    let pass = tokio::spawn(async move { janitor::run_pass(&pool, &settings(100), "racer").await });
    eventually(Duration::from_secs(10), "the janitor waits on the redelivered row", || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = 'webhook-gateway janitor'
               AND wait_event_type = 'Lock'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        (waiting == 1).then_some(())
    })
    .await;
    redeliver.commit().await.unwrap();

    let report = ran(pass.await.unwrap().unwrap());
    assert_eq!(report.status, RunStatus::Complete, "{report:?}");
    assert_eq!(report.events_deleted, 0);
    assert_eq!(report.deliveries_deleted, 0);
    let status: String =
        sqlx::query_scalar("SELECT status FROM deliveries WHERE id = $1").bind(dl).fetch_one(&db.pool).await.unwrap();
    assert_eq!(status, "pending");
    assert_eq!(db.count("events").await, 1);
    // The attempt is 39 days old: attempt retention applies to it whatever its delivery.
    assert_eq!(report.attempts_deleted, 1);
}

/// Two instances (separate pools, so separate sessions) released together by a barrier,
/// three rounds: each round exactly one does the pass and deletes everything, the other
/// skips; `janitor_runs` counts one pass per round.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_janitors_started_at_once_do_one_pass() {
    let db = TestDb::new().await;
    let other = db::connect(&db.url, 4).await.unwrap();
    // 30 expired events in batches of 5 with 50 ms pauses: a pass holds the lock for
    // about 300 ms, far longer than the two instances take to reach the lock.
    let settings = JanitorSettings { batch_pause: Duration::from_millis(50), ..settings(5) };
    for round in 1..=3_i64 {
        for _ in 0..30 {
            event(&db.pool, 40).await;
        }
        let barrier = Arc::new(Barrier::new(2));
        let racers = [("a", db.pool.clone()), ("b", other.clone())].map(|(name, pool)| {
            let (barrier, settings) = (barrier.clone(), settings.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                janitor::run_pass(&pool, &settings, name).await.unwrap()
            })
        });
        let mut reports = Vec::new();
        let mut skipped = 0;
        for racer in racers {
            match racer.await.unwrap() {
                PassOutcome::Ran(report) => reports.push(report),
                PassOutcome::Skipped => skipped += 1,
            }
        }
        assert_eq!((reports.len(), skipped), (1, 1), "round {round}: exactly one instance does the pass");
        assert_eq!(reports[0].events_deleted, 30);
        assert_eq!(db.count("events").await, 0);
        assert_eq!(db.count("janitor_runs").await, round);
    }
}

/// The janitor is wired into every gateway: two instances on one database (an ingest-only
/// one and a full one) with a 1 s interval each run passes on their own, their passes
/// never overlap in time, and shutdown stops them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_instance_runs_the_janitor_and_passes_never_overlap() {
    let db = TestDb::new().await;
    for _ in 0..10 {
        event(&db.pool, 40).await;
    }
    let janitor = JanitorSettings { interval: Duration::from_secs(1), ..settings(3) };
    let second_db = TestDb { url: db.url.clone(), pool: db.pool.clone() };
    let mut a = TestApp::spawn_with(
        db,
        Settings { role: webhook_gateway::role::Role::Ingest, janitor: janitor.clone(), ..test_settings() },
        4,
    )
    .await;
    let mut b = TestApp::spawn_with(second_db, Settings { janitor, ..test_settings() }, 4).await;
    let pool = a.db.pool.clone();
    eventually(Duration::from_secs(30), "several passes by two instances", || async {
        let (passes, instances): (i64, i64) =
            sqlx::query_as("SELECT count(*), count(DISTINCT instance) FROM janitor_runs WHERE status = 'complete'")
                .fetch_one(&pool)
                .await
                .unwrap();
        (passes >= 4 && instances == 2).then_some(())
    })
    .await;
    a.shutdown().await;
    b.shutdown().await;
    // The gateway reported retention behind (40-day-old events) and then recovered: its own events.
    let (events, own) = a.db.count_events_but_operational().await;
    assert_eq!(events, 0, "the gateway's own events besides: {own:?}");
    let deleted: i64 =
        sqlx::query_scalar("SELECT sum(events_deleted)::int8 FROM janitor_runs").fetch_one(&pool).await.unwrap();
    assert_eq!(deleted, 10, "each expired event deleted once");
    let overlaps: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM janitor_runs r1 JOIN janitor_runs r2 ON r1.id < r2.id
         WHERE tstzrange(r1.started_at, r1.finished_at) && tstzrange(r2.started_at, r2.finished_at)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(overlaps, 0, "no two passes ran at the same time");
    let running: i64 = sqlx::query_scalar("SELECT count(*) FROM janitor_runs WHERE status = 'running'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(running, 0, "shutdown left no pass half-recorded");
}

/// Index names and node types anywhere in an `EXPLAIN (FORMAT JSON)` plan.
fn plan_nodes(plan: &Value, out: &mut Vec<(String, String, String)>) {
    let field = |k: &str| plan.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    if plan.get("Node Type").is_some() {
        out.push((field("Node Type"), field("Relation Name"), field("Index Name")));
    }
    for key in ["Plan", "Plans"] {
        match plan.get(key) {
            Some(Value::Array(children)) => children.iter().for_each(|c| plan_nodes(c, out)),
            Some(child @ Value::Object(_)) => plan_nodes(child, out),
            _ => {}
        }
    }
}

type Explain<'q> = sqlx::query::QueryScalar<'q, sqlx::Postgres, sqlx::types::Json<Value>, PgArguments>;

/// The plan nodes of an `EXPLAIN (FORMAT JSON)` query (bound by the caller).
async fn plan(pool: &Pool, explain: Explain<'_>) -> Vec<(String, String, String)> {
    let plan = explain.fetch_one(pool).await.unwrap();
    let mut nodes = Vec::new();
    for top in plan.0.as_array().unwrap() {
        plan_nodes(top, &mut nodes);
    }
    nodes
}

fn uses(nodes: &[(String, String, String)], index: &str) -> bool {
    nodes.iter().any(|(_, _, i)| i == index)
}

fn seq_scans<'a>(nodes: &'a [(String, String, String)], table: &str) -> Vec<&'a (String, String, String)> {
    nodes.iter().filter(|(t, r, _)| t == "Seq Scan" && r == table).collect()
}

/// 50,000 delivered deliveries (with attempts, spread over 35 days) and 1,000 pending,
/// analyzed: the claim the workers run reads due work through the partial index
/// `deliveries_due` and never scans the table, so history does not enter the claim; the
/// janitor's batches each walk their own index rather than the tables.
#[tokio::test]
async fn the_claim_and_the_janitor_use_their_indexes() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let ep = endpoint(pool).await;
    sqlx::query(
        "WITH ev AS (
             INSERT INTO events (source_id, dedupe_key, event_type, headers, payload, received_at)
             SELECT (SELECT id FROM sources WHERE name = 'api'), 'k' || g, 't', '{}', '\\x00',
                    now() - make_interval(mins => 51000 - g)
             FROM generate_series(1, 51000) g
             RETURNING id, received_at, dedupe_key)
         INSERT INTO deliveries (event_id, endpoint_id, status, finished_at, attempt_count)
         SELECT id, $1, CASE WHEN substr(dedupe_key, 2)::int <= 50000 THEN 'delivered' ELSE 'pending' END,
                CASE WHEN substr(dedupe_key, 2)::int <= 50000 THEN received_at END,
                CASE WHEN substr(dedupe_key, 2)::int <= 50000 THEN 1 ELSE 0 END
         FROM ev",
    )
    .bind(ep)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO attempts (delivery_id, attempt_number, started_at, duration_ms, outcome, reason, recorded_at)
         SELECT id, 1, finished_at, 5, 'delivered', '200', finished_at FROM deliveries WHERE status = 'delivered'",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE events, deliveries, attempts").execute(pool).await.unwrap();
    assert_eq!(crate::support::count_status(pool, "pending").await, 1000);

    let sql = |statement: &str| format!("EXPLAIN (FORMAT JSON) {statement}");
    let claim_sql = sql(queue::claim_sql());
    let claim = plan(
        pool,
        sqlx::query_scalar(&claim_sql)
            .bind(128_i64)
            .bind(60.0_f64)
            .bind(queue::DEFAULT_MAX_IN_FLIGHT)
            .bind(sqlx::query_scalar::<_, uuid::Uuid>("SELECT id FROM endpoints").fetch_all(pool).await.unwrap()),
    )
    .await;
    // Per endpoint, its due rows through either pending-row index (the planner picks by
    // how many endpoints there are); never a scan of the table.
    assert!(uses(&claim, "deliveries_due") || uses(&claim, "deliveries_endpoint_unparked"), "claim plan: {claim:?}");
    assert!(seq_scans(&claim, "deliveries").is_empty(), "claim plan: {claim:?}");

    let retention = JanitorSettings::default();
    let secs = |d: Duration| d.as_secs_f64();
    let delivered_sql = sql(janitor::DELIVERED_BATCH);
    let delivered =
        plan(pool, sqlx::query_scalar(&delivered_sql).bind(secs(retention.delivered_retention)).bind(5000_i64)).await;
    assert!(uses(&delivered, "deliveries_delivered_finished"), "delivered batch plan: {delivered:?}");
    assert!(seq_scans(&delivered, "deliveries").is_empty(), "delivered batch plan: {delivered:?}");
    let attempts_sql = sql(janitor::ATTEMPTS_BATCH);
    let attempts =
        plan(pool, sqlx::query_scalar(&attempts_sql).bind(secs(retention.attempts_retention)).bind(5000_i64)).await;
    assert!(uses(&attempts, "attempts_recorded_at"), "attempts batch plan: {attempts:?}");
    assert!(seq_scans(&attempts, "attempts").is_empty(), "attempts batch plan: {attempts:?}");
    let events_sql = sql(janitor::EVENTS_BATCH);
    let events = plan(
        pool,
        sqlx::query_scalar(&events_sql)
            .bind(secs(retention.events_retention))
            .bind(5000_i64)
            .bind(None::<chrono::DateTime<chrono::Utc>>)
            .bind(None::<Uuid>),
    )
    .await;
    assert!(uses(&events, "events_received_at"), "events batch plan: {events:?}");
    for table in ["events", "deliveries", "attempts"] {
        assert!(seq_scans(&events, table).is_empty(), "events batch plan: {events:?}");
    }
}

/// `GET /v1/admin/storage`: every table with its indexes, sizes and tuple counts, and the
/// janitor's latest pass with its instance; admin token required.
#[tokio::test]
async fn storage_report_shows_sizes_and_the_last_pass() {
    // A long interval: this gateway's own janitor stays out of the way.
    let janitor = JanitorSettings { interval: Duration::from_secs(3600), ..JanitorSettings::default() };
    let app = TestApp::spawn_with(TestDb::new().await, Settings { janitor, ..test_settings() }, 4).await;
    let ep = endpoint(&app.db.pool).await;
    let ev = event(&app.db.pool, 40).await;
    delivery(&app.db.pool, ev, ep, "delivered", Some(40)).await;

    let before = app.admin_get("/v1/admin/storage").await;
    assert!(before["last_run"].is_null(), "{before}");

    ran(janitor::run_pass(&app.db.pool, &settings(100), "report-test").await.unwrap());
    let report = app.admin_get("/v1/admin/storage").await;
    let run = &report["last_run"];
    assert_eq!(run["instance"], "report-test", "{report}");
    assert_eq!(run["status"], "complete");
    assert_eq!((run["events_deleted"].as_i64(), run["deliveries_deleted"].as_i64()), (Some(1), Some(1)));
    assert!(run["duration_ms"].as_i64().is_some_and(|ms| ms >= 0), "{run}");

    let tables = report["tables"].as_array().unwrap();
    let table = |name: &str| tables.iter().find(|t| t["table"] == name).unwrap_or_else(|| panic!("{name}: {report}"));
    for name in ["events", "deliveries", "attempts", "janitor_runs"] {
        let t = table(name);
        assert!(t["total_bytes"].as_i64().unwrap() > 0, "{t}");
        assert!(t["live_tuples"].is_i64() && t["dead_tuples"].is_i64(), "{t}");
    }
    let deliveries = table("deliveries");
    let index_names: Vec<&str> =
        deliveries["indexes"].as_array().unwrap().iter().map(|i| i["index"].as_str().unwrap()).collect();
    for index in ["deliveries_pkey", "deliveries_due", "deliveries_delivered_finished"] {
        assert!(index_names.contains(&index), "{index_names:?}");
    }
    let sum: i64 = deliveries["indexes"].as_array().unwrap().iter().map(|i| i["bytes"].as_i64().unwrap()).sum();
    assert_eq!(sum, deliveries["index_bytes"].as_i64().unwrap());
    assert_eq!(
        deliveries["total_bytes"].as_i64().unwrap(),
        deliveries["table_bytes"].as_i64().unwrap() + deliveries["index_bytes"].as_i64().unwrap()
    );

    let unauthenticated = app.http.get(app.url("/v1/admin/storage")).send().await.unwrap();
    assert_eq!(unauthenticated.status().as_u16(), 401);
}

/// A pending delivery to `ep` in line `key`, at `seq`, waiting for its line or not.
async fn ordered_delivery(pool: &Pool, ep: Uuid, key: &str, seq: i64, waiting: bool) -> Uuid {
    let ev = event(pool, 1).await;
    let id = delivery(pool, ev, ep, "pending", None).await;
    sqlx::query("UPDATE deliveries SET ordering_key = $2, line_seq = $3, waiting = $4 WHERE id = $1")
        .bind(id)
        .bind(key)
        .bind(seq)
        .bind(waiting)
        .execute(pool)
        .await
        .unwrap();
    id
}

/// Line `key` of `ep`, its head `head`.
async fn order_line(pool: &Pool, ep: Uuid, key: &str, head: Option<Uuid>) {
    sqlx::query("INSERT INTO order_lines (endpoint_id, ordering_key, head_id) VALUES ($1, $2, $3)")
        .bind(ep)
        .bind(key)
        .bind(head)
        .execute(pool)
        .await
        .unwrap();
}

/// Ordering lines an earlier release left idle (no head) are deleted by a pass, in
/// batches; a line with a head is kept. Lines with a delivery waiting behind no head (a
/// broken invariant: nothing would ever claim that delivery) are given it as their head,
/// more of them than a batch holds: the pass completes, where the old phase kept those
/// lines, picked the same batch of them every batch of every pass, and ended capped. So is
/// a line whose head names a delivery that no longer exists.
#[tokio::test]
async fn headless_ordering_lines_are_deleted_or_given_their_waiting_delivery() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let ep = endpoint(pool).await;
    sqlx::query(
        "INSERT INTO order_lines (endpoint_id, ordering_key, head_id)
         SELECT $1::uuid, 'idle-' || g, NULL FROM generate_series(1, 5) g",
    )
    .bind(ep)
    .execute(pool)
    .await
    .unwrap();
    // A line in use (its head), and three lines with no head but a waiting delivery each.
    let head = ordered_delivery(pool, ep, "busy", 1, false).await;
    order_line(pool, ep, "busy", Some(head)).await;
    let mut stranded = Vec::new();
    for key in ["odd-1", "odd-2", "odd-3"] {
        let waiting = ordered_delivery(pool, ep, key, 2, true).await;
        order_line(pool, ep, key, None).await;
        stranded.push((key, waiting));
    }

    // And a line whose head names a delivery that is gone, with one waiting behind it.
    let orphaned = ordered_delivery(pool, ep, "orphan", 2, true).await;
    order_line(pool, ep, "orphan", Some(Uuid::new_v4())).await;
    stranded.push(("orphan", orphaned));
    stranded.sort();

    let report = ran(janitor::run_pass(pool, &settings(2), "test").await.unwrap());
    assert_eq!(report.status, RunStatus::Complete, "{report:?}");
    assert_eq!(report.lines_deleted, 5, "{report:?}");
    let left: Vec<(String, Option<Uuid>)> =
        sqlx::query_as("SELECT ordering_key, head_id FROM order_lines ORDER BY 1").fetch_all(pool).await.unwrap();
    let mut expected = vec![("busy".to_owned(), Some(head))];
    expected.extend(stranded.iter().map(|(key, id)| (key.to_string(), Some(*id))));
    assert_eq!(left, expected, "the line in use kept, each stranded delivery its line's head");
    let still_waiting: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE waiting").fetch_one(pool).await.unwrap();
    assert_eq!(still_waiting, 0, "the new heads are claimable");
    let again = ran(janitor::run_pass(pool, &settings(2), "test").await.unwrap());
    assert_eq!((again.status, again.lines_deleted), (RunStatus::Complete, 0), "{again:?}");
}

/// An endpoint's circuit history goes with the attempts' retention (30 days by default):
/// an endpoint that fails for ever adds a change every cool-down, so the table must not
/// grow with time alone. Changes older than the retention go, newer ones stay, and the
/// console's history still reads the kept ones.
#[tokio::test]
async fn circuit_history_older_than_the_attempts_retention_is_deleted() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let (failing, other) = (endpoint(pool).await, endpoint(pool).await);
    for (endpoint, days) in [(failing, 45), (failing, 31), (failing, 29), (failing, 1), (other, 40), (other, 0)] {
        sqlx::query(
            "INSERT INTO circuit_transitions (endpoint_id, at, change, failures, open_count)
             VALUES ($1, now() - make_interval(days => $2), 'reopened', 5, 2)",
        )
        .bind(endpoint)
        .bind(days)
        .execute(pool)
        .await
        .unwrap();
    }
    assert_eq!(db.count("circuit_transitions").await, 6);
    ran(janitor::run_pass(pool, &settings(2), "test").await.unwrap());
    let kept: Vec<(Uuid, i32)> =
        sqlx::query_as("SELECT endpoint_id, extract(day FROM now() - at)::int4 FROM circuit_transitions ORDER BY at")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(kept, [(failing, 29), (failing, 1), (other, 0)]);
    let history =
        webhook_gateway::circuit::sql::history(pool, webhook_gateway::ids::EndpointId(failing), 10).await.unwrap();
    assert_eq!(history.len(), 2);
}

/// The fleet's roster: each restart of a replica adds a row (a new instance), so rows not
/// written for a day go, in batches (here of 2, five to delete); a row written within the
/// day stays, whatever it says (stopped, lost), and so does a running replica's.
#[tokio::test]
async fn a_replica_s_row_is_deleted_a_day_after_it_was_last_written() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    for (instance, hours, stopped) in [
        ("a", 30, true),
        ("b", 26, false),
        ("c", 25, true),
        ("d", 48, false),
        ("e", 72, true),
        ("f", 23, true),
        ("g", 0, false),
    ] {
        sqlx::query(
            "INSERT INTO replicas (instance, role, version, schema_version, started_at, seen_at, every_secs, stopped_at)
             VALUES ($1, 'all', '0.1.0', 1, now() - make_interval(hours => $2 + 1), now() - make_interval(hours => $2),
                     15, CASE WHEN $3 THEN now() - make_interval(hours => $2) END)",
        )
        .bind(instance)
        .bind(hours)
        .bind(stopped)
        .execute(pool)
        .await
        .unwrap();
    }
    ran(janitor::run_pass(pool, &settings(2), "test").await.unwrap());
    let kept: Vec<String> =
        sqlx::query_scalar("SELECT instance FROM replicas ORDER BY instance").fetch_all(pool).await.unwrap();
    assert_eq!(kept, ["f", "g"]);
}
