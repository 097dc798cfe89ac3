//! A bad row fails alone: an outcome PostgreSQL refuses cannot drop, fail or delay
//! another delivery's outcome, and is itself never lost silently.
//!
//! The refusals are made real with triggers (a row the database will not take, whatever
//! the reason), so these tests prove the isolation itself, not one sanitizing rule.

use std::collections::HashMap;
use std::time::Duration;

use webhook_gateway::circuit::CircuitConfig;
use webhook_gateway::db::Pool;
use webhook_gateway::deliver::recorder;
use webhook_gateway::queue::{self, Outcome};

use crate::support::sink::{Reply, Sink};
use crate::support::{TestApp, TestDb, attempt_record, eventually, insert_endpoint, seed_deliveries};

/// A trigger on `attempts` that raises for rows matching `condition` (on `NEW`).
async fn refuse_attempts_where(pool: &Pool, condition: &str) {
    sqlx::query(&format!(
        "CREATE FUNCTION refuse_attempt() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF {condition} THEN RAISE EXCEPTION 'this attempt row is refused'; END IF;
             RETURN NEW;
         END $$"
    ))
    .execute(pool)
    .await
    .expect("trigger function");
    sqlx::query(
        "CREATE TRIGGER refuse_attempt BEFORE INSERT ON attempts FOR EACH ROW EXECUTE FUNCTION refuse_attempt()",
    )
    .execute(pool)
    .await
    .expect("trigger");
}

/// Healthy, not-probe attempts, as workers hand them to the recorder.
fn finished(records: Vec<queue::AttemptRecord>) -> Vec<recorder::Finished> {
    records
        .into_iter()
        .map(|record| recorder::Finished {
            record,
            signal: webhook_gateway::circuit::Signal::Healthy,
            probe_token: None,
            span: tracing::Span::none(),
        })
        .collect()
}

/// Two endpoints with two due deliveries each, all four claimed.
async fn four_claimed(db: &TestDb) -> (String, Vec<queue::Claimed>) {
    let poisoned = insert_endpoint(&db.pool, "http://127.0.0.1:9/poisoned").await;
    let healthy = insert_endpoint(&db.pool, "http://127.0.0.1:9/healthy").await;
    seed_deliveries(&db.pool, &poisoned, 2).await;
    sqlx::query(
        "WITH ev AS (
             INSERT INTO events (source_id, dedupe_key, event_type, headers, payload)
             SELECT (SELECT id FROM sources WHERE name = 'api'), 'other-' || g, 't', '{}', '\\x00'
             FROM generate_series(1, 2) g RETURNING id)
         INSERT INTO deliveries (event_id, endpoint_id) SELECT id, $1::uuid FROM ev",
    )
    .bind(&healthy)
    .execute(&db.pool)
    .await
    .expect("seed healthy");
    let claimed = queue::claim(&db.pool, 10, Duration::from_secs(60)).await.expect("claim");
    assert_eq!(claimed.len(), 4);
    (poisoned, claimed)
}

async fn status_of(pool: &Pool, id: webhook_gateway::ids::DeliveryId) -> (String, Option<String>, i64) {
    sqlx::query_as(
        "SELECT status, dead_reason, (SELECT count(*) FROM attempts WHERE delivery_id = d.id)
         FROM deliveries d WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .expect("delivery")
}

/// A batch where two outcomes cannot be written at all: the others are recorded as they
/// are, and the two are dead-lettered with a reason that says what happened, so they are
/// neither lost nor sent again by their lease.
#[tokio::test]
async fn an_unwritable_outcome_is_dead_lettered_and_the_rest_of_its_batch_recorded() {
    let db = TestDb::new().await;
    let (poisoned, claimed) = four_claimed(&db).await;
    refuse_attempts_where(&db.pool, "NEW.status_code = 299").await;
    let batch: Vec<_> = claimed
        .iter()
        .map(|c| {
            let mut r = attempt_record(c, Outcome::Delivered);
            if c.endpoint_id.to_string() == poisoned {
                r.status_code = Some(299);
                r.reason = "HTTP 299".into();
            }
            r
        })
        .collect();
    recorder::write(
        &db.pool,
        &finished(batch),
        &CircuitConfig::default(),
        &recorder::Patience::of(Duration::from_secs(60)),
    )
    .await;

    for c in &claimed {
        let (status, reason, attempts) = status_of(&db.pool, c.id).await;
        if c.endpoint_id.to_string() == poisoned {
            assert_eq!(status, "dead");
            let reason = reason.expect("dead reason");
            assert!(reason.contains("could not be recorded") && reason.contains("HTTP 299"), "{reason}");
            assert_eq!(attempts, 0);
        } else {
            assert_eq!((status.as_str(), reason, attempts), ("delivered", None, 1));
        }
    }
}

/// A batch where one outcome's details (the subscriber's excerpt) are refused: that
/// outcome is recorded without them, with its status; the others as they are.
#[tokio::test]
async fn an_outcome_whose_details_are_refused_is_recorded_without_them() {
    let db = TestDb::new().await;
    let (poisoned, claimed) = four_claimed(&db).await;
    refuse_attempts_where(&db.pool, "NEW.response_excerpt LIKE '%poison%'").await;
    let batch: Vec<_> = claimed
        .iter()
        .map(|c| {
            let mut r = attempt_record(c, Outcome::Delivered);
            r.response_excerpt =
                Some(if c.endpoint_id.to_string() == poisoned { "poison pill" } else { "fine" }.to_owned());
            r
        })
        .collect();
    recorder::write(
        &db.pool,
        &finished(batch),
        &CircuitConfig::default(),
        &recorder::Patience::of(Duration::from_secs(60)),
    )
    .await;

    for c in &claimed {
        let (status, _, attempts) = status_of(&db.pool, c.id).await;
        assert_eq!((status.as_str(), attempts), ("delivered", 1), "{}", c.id);
        let (code, reason, excerpt): (Option<i32>, String, Option<String>) =
            sqlx::query_as("SELECT status_code, reason, response_excerpt FROM attempts WHERE delivery_id = $1")
                .bind(c.id)
                .fetch_one(&db.pool)
                .await
                .expect("attempt");
        assert_eq!(code, Some(200));
        if c.endpoint_id.to_string() == poisoned {
            assert_eq!(excerpt, None);
            assert!(reason.starts_with("HTTP 200") && reason.contains("could not be stored"), "{reason}");
        } else {
            assert_eq!((reason.as_str(), excerpt.as_deref()), ("HTTP 200", Some("fine")));
        }
    }
}

/// The whole path, under load: one subscriber's replies cannot be stored, another's can.
/// The healthy subscriber receives each webhook exactly once and every one of its
/// deliveries ends delivered after one attempt; the poisoned subscriber also receives each
/// exactly once (its deliveries are dead-lettered with the reason, not resent by the
/// lease). Before isolation, each failed batch took the healthy outcomes with it and the
/// lease sent them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reply_that_cannot_be_stored_disturbs_no_other_delivery() {
    let app = TestApp::spawn().await;
    refuse_attempts_where(&app.db.pool, "NEW.status_code = 299").await;
    let poisoned = Sink::start(|_, _| Reply::status(299)).await;
    let healthy = Sink::ok().await;
    app.source_none("src").await;
    let poisoned_id = app.endpoint_for(&poisoned.url("/"), Some("src")).await;
    app.endpoint_for(&healthy.url("/"), Some("src")).await;
    const N: usize = 100;
    for i in 0..N {
        let (status, body) = app.ingest("src", &format!("d-{i}"), "t", "{}").await;
        assert_eq!(status, 200, "{body}");
    }
    eventually(Duration::from_secs(60), "every delivery finished", || async {
        let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE status = 'pending'")
            .fetch_one(&app.db.pool)
            .await
            .expect("count");
        (pending == 0).then_some(())
    })
    .await;
    for (name, sink) in [("healthy", &healthy), ("poisoned", &poisoned)] {
        let mut per_id: HashMap<String, usize> = HashMap::new();
        for r in sink.received() {
            *per_id.entry(r.header("webhook-id")).or_default() += 1;
        }
        assert_eq!(per_id.len(), N, "{name}: every webhook arrived");
        assert!(per_id.values().all(|&n| n == 1), "{name}: a webhook arrived twice: {per_id:?}");
    }
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT endpoint_id::text, status, (SELECT count(*) FROM attempts a WHERE a.delivery_id = d.id)
         FROM deliveries d",
    )
    .fetch_all(&app.db.pool)
    .await
    .expect("deliveries");
    assert_eq!(rows.len(), 2 * N);
    for (endpoint, status, attempts) in rows {
        if endpoint == poisoned_id {
            assert_eq!((status.as_str(), attempts), ("dead", 0));
        } else {
            assert_eq!((status.as_str(), attempts), ("delivered", 1));
        }
    }
}

/// Two outcomes for one claim in a batch (what a worker bug would send): the queue's
/// invariant check refuses the batch before anything is written, the recorder leaves the
/// deliveries to their leases (no attempt recorded, still pending), and the batch as it
/// should be then records each outcome once.
#[tokio::test]
async fn a_batch_with_two_outcomes_for_one_claim_is_refused_whole_and_nothing_is_written() {
    let db = TestDb::new().await;
    let endpoint = insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    seed_deliveries(&db.pool, &endpoint, 2).await;
    let claimed = queue::claim(&db.pool, 10, Duration::from_secs(60)).await.expect("claim");
    assert_eq!(claimed.len(), 2);
    let (one, other) =
        (attempt_record(&claimed[0], Outcome::Delivered), attempt_record(&claimed[1], Outcome::Delivered));
    let twice = vec![one.clone(), other.clone(), one.clone()];

    let mut tx = db.pool.begin().await.expect("begin");
    let err = queue::record(&mut tx, &twice).await.expect_err("refused");
    assert!(webhook_gateway::invariants::is_broken(&err), "{err}");
    assert!(err.to_string().contains("one_outcome_per_claim"), "{err}");
    drop(tx);

    let patience = recorder::Patience::of(Duration::from_secs(60));
    recorder::write(&db.pool, &finished(twice), &CircuitConfig::default(), &patience).await;
    for c in &claimed {
        assert_eq!(status_of(&db.pool, c.id).await, ("pending".into(), None, 0), "nothing written");
    }
    recorder::write(&db.pool, &finished(vec![one, other]), &CircuitConfig::default(), &patience).await;
    for c in &claimed {
        assert_eq!(status_of(&db.pool, c.id).await, ("delivered".into(), None, 1), "recorded once");
    }
}
