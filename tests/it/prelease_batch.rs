//! The pre-leased hand-off for group commit's batches (`deliver::prelease::store_batch`,
//! `store::events::insert_batch_and_claim`): a batch's deliveries leased by the statement
//! that stores it, several per endpoint, within every limit of a claim, and each lease
//! handed over with the event it belongs to.

use std::sync::Arc;
use std::time::Duration;

use webhook_gateway::deliver::DeliverySettings;
use webhook_gateway::deliver::prelease::{self, Prelease};
use webhook_gateway::ingest::batcher::{Batcher, StoreError};
use webhook_gateway::store::events::{ClaimTerms, OwnedEvent, Stored, insert_batch_and_claim};

use crate::prelease::{claim_the_rest, hold_source, leased_by_ingest, lock_waiters};
use crate::support::{TestApp, eventually, owned_event, source_id, test_settings};

const WAIT: Duration = Duration::from_secs(60);

/// An open hand-off with `workers` worker slots (an endpoint's default limit half of
/// them), whose dispatcher's end the test holds.
fn open_hand_off(workers: usize) -> (Arc<Prelease>, prelease::Received) {
    let endpoint_max_in_flight = webhook_gateway::queue::default_max_in_flight(workers);
    let settings = DeliverySettings { workers, endpoint_max_in_flight, ..test_settings().delivery };
    let (shared, received) = Prelease::new(&settings);
    shared.set_owed_general(false);
    (shared, received)
}

/// A gateway without delivery (role `ingest`) with a source `shop` and endpoints at
/// `paths` subscribed to it (their ids, in order).
async fn shop_with_endpoints(paths: &[&str]) -> (TestApp, Vec<String>) {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    let mut endpoints = Vec::new();
    for path in paths {
        endpoints.push(app.endpoint_for(&format!("http://127.0.0.1:9{path}"), Some("shop")).await);
    }
    (app, endpoints)
}

/// Events of the source `shop` keyed `{prefix}-0`, `{prefix}-1`, ...: each with its own
/// body (`{"k":"<key>"}`) and headers.
async fn shop_events(pool: &webhook_gateway::db::Pool, prefix: &str, count: usize) -> Vec<OwnedEvent> {
    let source = source_id(pool, "shop").await;
    (0..count).map(|i| owned_event(source, "shop", &format!("{prefix}-{i}"), &format!("order.{prefix}.{i}"))).collect()
}

/// Leased deliveries of `endpoint` (those whose lease is still on).
async fn leased_of(pool: &webhook_gateway::db::Pool, endpoint: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE endpoint_id = $1::uuid AND leased_until IS NOT NULL")
        .bind(endpoint)
        .fetch_one(pool)
        .await
        .expect("count")
}

/// How many transactions stored the events whose key is `LIKE` `pattern`.
async fn transactions_of(pool: &webhook_gateway::db::Pool, pattern: &str) -> i64 {
    sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM events WHERE dedupe_key LIKE $1")
        .bind(pattern)
        .fetch_one(pool)
        .await
        .expect("xmin")
}

/// A batch of four webhooks fanned out to two endpoints: all eight deliveries are
/// inserted leased by the batch's own statement (one transaction with the events, attempt
/// 1, a token each, several per endpoint), none is left to claim, and each lease reaches
/// the dispatcher's end carrying its own event's type, body, content type and source.
#[tokio::test]
async fn a_batch_s_deliveries_are_leased_by_the_statement_that_stores_it() {
    let (app, endpoints) = shop_with_endpoints(&["/a", "/b"]).await;
    let pool = &app.db.pool;
    let (shared, mut received) = open_hand_off(64);
    let events = shop_events(pool, "batch", 4).await;
    assert!(shared.takes_batch(&events));

    let stored = prelease::store_batch_leasing(pool, &events, &shared).await.expect("stored");
    assert_eq!(stored.len(), 4);
    for (event, stored) in events.iter().zip(&stored) {
        assert!(!stored.duplicate);
        assert!(stored.deliveries.is_empty(), "{}: both deliveries leased, none left to claim", event.dedupe_key);
        assert_eq!(
            leased_by_ingest(pool, &event.dedupe_key).await,
            2,
            "{}: leased in its own commit",
            event.dedupe_key
        );
    }
    // The batch's own events only: the gateway stores events about itself too.
    assert_eq!(transactions_of(pool, "batch-%").await, 1, "one statement stored the batch");

    let mut handed = Vec::new();
    while let Ok(job) = received.try_recv() {
        handed.push(job.job);
    }
    assert_eq!(handed.len(), 8, "every lease handed over");
    let mut tokens: Vec<i64> = handed.iter().map(|job| job.claim_token).collect();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 8, "each lease its own token");
    for job in &handed {
        assert_eq!(job.attempt, 1);
        let event = stored.iter().position(|s| s.event_id == job.event_id).map(|i| &events[i]).expect("its event");
        assert_eq!(job.event_type, event.event_type);
        assert_eq!(job.payload, event.payload, "the body of its own event");
        assert_eq!(job.payload_bytes as usize, event.payload.len());
        assert_eq!(job.content_type.as_deref(), Some("application/json"));
        assert_eq!(job.source_name, "shop");
        assert!(!job.ordered && job.transform.is_none() && job.event_headers.is_none());
        assert!(endpoints.iter().any(|ep| ep == &job.endpoint_id.to_string()));
    }
    for endpoint in &endpoints {
        assert_eq!(
            handed.iter().filter(|job| &job.endpoint_id.to_string() == endpoint).count(),
            4,
            "four leases of one endpoint in one statement"
        );
    }

    // The same batch again: duplicates, nothing new stored or leased.
    let again = prelease::store_batch_leasing(pool, &events, &shared).await.expect("stored again");
    assert!(again.iter().all(|s| s.duplicate && s.deliveries.is_empty()));
    assert!(received.try_recv().is_err());
    assert_eq!(app.db.count("deliveries").await, 8);
}

/// A batch holding fewer worker slots than it creates deliveries (`limit` 4, six
/// webhooks to two endpoints: twelve deliveries) leases four, shared between the two
/// endpoints (two each: no endpoint takes the whole limit), the first arrivals of each;
/// the rest are stored pending and named in the answers, to be claimed after the commit.
#[tokio::test]
async fn a_batch_leases_no_more_than_its_slots_shared_between_its_endpoints() {
    let (app, endpoints) = shop_with_endpoints(&["/a", "/b"]).await;
    let pool = &app.db.pool;
    let events = shop_events(pool, "few", 6).await;
    let terms = ClaimTerms { limit: 4, lease: Duration::from_secs(300), default_max_in_flight: 100 };
    let (stored, fresh) = insert_batch_and_claim(pool, &events, terms).await.expect("stored");
    assert_eq!(fresh.claimed.len(), 4);
    assert!(!fresh.took_all, "eight deliveries left to claim");
    for endpoint in &endpoints {
        assert_eq!(leased_of(pool, endpoint).await, 2, "an equal share of the limit");
    }
    for (i, event) in events.iter().enumerate() {
        let leased = leased_by_ingest(pool, &event.dedupe_key).await;
        assert_eq!(leased, if i < 2 { 2 } else { 0 }, "{}: the first arrivals are leased", event.dedupe_key);
        assert_eq!(stored[i].deliveries.len(), 2, "the answer names every delivery it created");
    }
}

/// Eight batches of four webhooks stored at once, each by its own leasing statement on
/// its own connection, fanned out to four endpoints: one limited to three requests in
/// flight, one whose rate limit has a burst of two tokens, one paused, one whose circuit
/// is open. Each batch asks for four leases of each endpoint. The statements race for the
/// endpoint rows, and each reads the leases in flight only once it holds the row (one
/// that another statement holds is skipped): at most three deliveries of the first are
/// leased and two of the second, none of the paused or open one's; the rest are stored
/// pending. A claim by key of the rest, as the dispatcher's after the commits, fills each
/// limit exactly, and every lease has its own token.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_leasing_batches_fill_each_endpoint_s_limit_and_never_pass_it() {
    let (app, endpoints) = shop_with_endpoints(&["/capped", "/rated", "/paused", "/open"]).await;
    let pool = &app.db.pool;
    let [capped, rated, paused, open] = &endpoints[..] else { unreachable!("four endpoints") };
    for (sql, endpoint) in [
        ("UPDATE endpoints SET max_in_flight = 3 WHERE id = $1::uuid", capped),
        ("UPDATE endpoints SET rate_limit_per_sec = 0.001, rate_limit_burst = 2 WHERE id = $1::uuid", rated),
        ("UPDATE endpoints SET paused = true WHERE id = $1::uuid", paused),
        (
            "UPDATE endpoints SET circuit_state = 'open', open_count = 1, opened_at = now(),
                                  reopen_at = now() + interval '1 hour'
             WHERE id = $1::uuid",
            open,
        ),
    ] {
        sqlx::query(sql).bind(endpoint).execute(pool).await.expect("limit");
    }
    const BATCHES: usize = 8;
    let mut batches = Vec::new();
    for b in 0..BATCHES {
        batches.push(shop_events(pool, &format!("race{b}"), 4).await);
    }
    let terms = ClaimTerms { limit: 64, lease: Duration::from_secs(300), default_max_in_flight: 100 };
    let raced =
        futures_util::future::join_all(batches.iter().map(|batch| insert_batch_and_claim(pool, batch, terms))).await;
    let (mut tokens, mut all, mut by_statements) = (Vec::new(), Vec::new(), Vec::new());
    for result in raced {
        let (stored, fresh) = result.expect("stored");
        assert!(stored.iter().all(|s| !s.duplicate && s.deliveries.len() == 4), "one delivery per endpoint");
        tokens.extend(fresh.claimed.iter().map(|job| job.claim_token));
        by_statements.extend(fresh.claimed.iter().map(|job| job.id));
        all.extend(stored.into_iter().flat_map(|s| s.deliveries));
    }
    assert!(leased_of(pool, capped).await <= 3, "the in-flight limit not passed by the statements");
    assert!(leased_of(pool, rated).await <= 2, "nor the burst's tokens");
    tokens.extend(claim_the_rest(pool, all, &by_statements).await);
    assert_eq!(leased_of(pool, capped).await, 3, "the in-flight limit filled, not passed");
    assert_eq!(leased_of(pool, rated).await, 2, "the burst's tokens spent, no more");
    assert_eq!(leased_of(pool, paused).await, 0, "nothing leased for a paused endpoint");
    assert_eq!(leased_of(pool, open).await, 0, "nor for one whose circuit is open");
    assert_eq!(tokens.len(), 5, "the answers name each lease once");
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 5, "each lease its own token");
    let rate_tokens: f64 = sqlx::query_scalar("SELECT rate_tokens FROM endpoints WHERE id = $1::uuid")
        .bind(rated)
        .fetch_one(pool)
        .await
        .expect("tokens");
    assert!(rate_tokens < 1.0, "both tokens paid: {rate_tokens}");
    assert_eq!(app.db.count("deliveries").await, (4 * 4 * BATCHES) as i64);
}

/// Five webhooks of the source `shop` stored through group commit (one writer, the
/// hand-off `shared`) so that the last three go as one batch: the source's row is held
/// locked so that the first webhook's statement (a direct write) and the second's (a
/// writer's batch of one) wait on it (at their foreign key checks, their leases taken)
/// while three more queue up; once it is let go, the writer takes the three as one
/// batch. Each of the three parts goes to an endpoint of its own (a statement in flight
/// holds its endpoints' rows, and a lease skips a row another transaction holds). The
/// events and their answers, in order.
async fn three_queued_behind_two_commits(
    app: &TestApp,
    shared: Arc<Prelease>,
) -> (Vec<OwnedEvent>, Vec<Result<Stored, StoreError>>) {
    let pool = &app.db.pool;
    let events = shop_events(pool, "queued", 5).await;
    let kinds: Vec<&str> = events.iter().map(|event| event.event_type.as_str()).collect();
    for (path, kinds) in [("/first", &kinds[..1]), ("/second", &kinds[1..2]), ("/batch", &kinds[2..])] {
        let subscription = serde_json::json!({"source": "shop", "event_types": kinds});
        app.endpoint_with(&format!("http://127.0.0.1:9{path}"), subscription).await;
    }
    let batcher = Batcher::start(pool.clone(), 1, Some(shared));
    let store = |event: &OwnedEvent| {
        let (batcher, event) = (batcher.clone(), event.clone());
        tokio::spawn(async move { batcher.store(event, tokio::time::Instant::now() + WAIT).await })
    };

    let holder = hold_source(pool, "shop").await;
    let mut answers = vec![store(&events[0])];
    eventually(WAIT, "the direct write waits on the source", || async {
        (lock_waiters(pool).await == 1).then_some(())
    })
    .await;
    answers.push(store(&events[1]));
    eventually(WAIT, "the writer's batch of one waits on the source", || async {
        (lock_waiters(pool).await == 2).then_some(())
    })
    .await;
    answers.extend(events[2..].iter().map(store));
    eventually(WAIT, "three webhooks queued behind them", || async { (batcher.queued() == 3).then_some(()) }).await;
    holder.commit().await.expect("let the source go");

    let mut stored = Vec::new();
    for answer in answers {
        stored.push(answer.await.expect("task"));
    }
    let batch_transactions: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT xmin::text) FROM events WHERE dedupe_key = ANY(ARRAY['queued-2', 'queued-3', 'queued-4'])",
    )
    .fetch_one(pool)
    .await
    .expect("xmin");
    assert_eq!(batch_transactions, 1, "the three queued webhooks were written as one batch");
    (events, stored)
}

/// Group commit end to end: webhooks that queue behind a commit in flight are written by
/// a writer as one batch ([`three_queued_behind_two_commits`]), and their deliveries are
/// leased by that batch's statement: each of the five answers is stored with nothing
/// left to claim, each delivery leased by the transaction that stored its webhook.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn webhooks_queued_behind_a_commit_are_leased_by_their_batch_s_statement() {
    let (app, _) = shop_with_endpoints(&[]).await;
    let pool = &app.db.pool;
    let (shared, mut received) = open_hand_off(64);
    let (events, answers) = three_queued_behind_two_commits(&app, shared).await;
    for answer in answers {
        let stored = answer.expect("stored");
        assert!(!stored.duplicate && stored.deliveries.is_empty(), "leased, nothing left to claim: {stored:?}");
    }
    for event in &events {
        assert_eq!(
            leased_by_ingest(pool, &event.dedupe_key).await,
            1,
            "{}: leased in its own commit",
            event.dedupe_key
        );
    }
    let mut handed = 0;
    while received.try_recv().is_ok() {
        handed += 1;
    }
    assert_eq!(handed, 5, "every lease handed over");
}

/// A batch's leasing statement that the database refuses (here: the function that grants
/// its room is gone) stores nothing; the batch is then stored the plain way, one
/// transaction still, each webhook answered as new with its delivery left to claim.
/// Control: without the fallback the three are answered with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_leasing_batch_is_stored_the_plain_way() {
    let (app, _) = shop_with_endpoints(&[]).await;
    let pool = &app.db.pool;
    sqlx::query("DROP FUNCTION wg_lease_room_v6").execute(pool).await.expect("drop");
    let (shared, _received) = open_hand_off(64);
    let (events, answers) = three_queued_behind_two_commits(&app, shared).await;
    for (event, answer) in events.iter().zip(answers).skip(2) {
        let stored = answer.expect("stored the plain way");
        assert!(!stored.duplicate, "{}: stored once, as new", event.dedupe_key);
        assert_eq!(stored.deliveries.len(), 1, "{}: its delivery left to claim", event.dedupe_key);
        assert_eq!(leased_by_ingest(pool, &event.dedupe_key).await, 0);
    }
    // The test's own events only: the gateway stores events about itself too.
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE dedupe_key LIKE 'queued-%'")
        .fetch_one(pool)
        .await
        .expect("count");
    assert_eq!(stored, 5, "each stored once");
}

/// A batch with an event that has an ordering key is not leased by its statement (the
/// fan-out locks the line's row before the lease would lock the endpoint's), nor is one
/// of more than `LARGEST_LEASED_BATCH` webhooks (its statement would hold the endpoint
/// rows that claims need until its commit): the hand-off does not take them, and such a
/// batch is stored plainly, its deliveries left to claim.
#[tokio::test]
async fn an_ordered_or_large_batch_is_stored_plainly() {
    let (app, _) = shop_with_endpoints(&["/"]).await;
    let pool = &app.db.pool;
    let (shared, mut received) = open_hand_off(64);
    let mut events = shop_events(pool, "mixed", 3).await;
    assert!(shared.takes_batch(&events), "the control: without a key it is taken");
    events[1].ordering_key = Some("customer-1".into());
    assert!(!shared.takes_batch(&events));
    let stored = prelease::store_batch_leasing(pool, &events, &shared).await.expect("stored");
    assert!(stored.iter().all(|s| s.deliveries.len() == 1), "every delivery left to claim: {stored:?}");
    assert!(received.try_recv().is_err(), "nothing handed over");

    let largest = shop_events(pool, "largest", prelease::LARGEST_LEASED_BATCH).await;
    assert!(shared.takes_batch(&largest), "the control: the largest leased batch is taken");
    let large = shop_events(pool, "large", prelease::LARGEST_LEASED_BATCH + 1).await;
    assert!(!shared.takes_batch(&large));
    let stored = prelease::store_batch_leasing(pool, &large, &shared).await.expect("stored");
    assert!(stored.iter().all(|s| s.deliveries.len() == 1), "every delivery left to claim: {stored:?}");
    assert!(received.try_recv().is_err(), "nothing handed over");

    shared.set_owed_general(true);
    events[1].ordering_key = None;
    assert!(!shared.takes_batch(&events), "nor while the dispatcher owes a general claim");
}

/// A writer's leasing batch whose deadline passes while its statement is under way (here
/// it waits on its source's row, locked by another transaction): the three requesters
/// are answered at their deadline that their webhooks may be stored (503, nothing known
/// yet), and the statement is carried through all the same: once the row is let go the
/// batch commits, and each of its leases reaches the dispatcher's end, not left to run
/// out. The batch is made as in [`three_queued_behind_two_commits`], its three webhooks of
/// a second source whose row stays locked after the first's is let go. Control:
/// with the batch's statement awaited plainly by the writer (no finishing on drop), the
/// three leases are committed and nothing receives them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leasing_batch_past_its_deadline_mid_statement_still_hands_its_leases_over() {
    let (app, _) = shop_with_endpoints(&["/shop"]).await;
    app.source_none("late").await;
    let late_endpoint = app.endpoint_for("http://127.0.0.1:9/late", Some("late")).await;
    let pool = &app.db.pool;
    let (shared, mut received) = open_hand_off(64);
    let batcher = Batcher::start(pool.clone(), 1, Some(shared));
    let (shop, late) = (source_id(pool, "shop").await, source_id(pool, "late").await);
    let store = |event: OwnedEvent, deadline: tokio::time::Instant| {
        let batcher = batcher.clone();
        tokio::spawn(async move { batcher.store(event, deadline).await })
    };

    let shop_holder = hold_source(pool, "shop").await;
    let late_holder = hold_source(pool, "late").await;
    let patient = tokio::time::Instant::now() + WAIT;
    let mut ahead = vec![store(owned_event(shop, "shop", "ahead-0", "order.created"), patient)];
    eventually(WAIT, "the direct write waits on its source", || async {
        (lock_waiters(pool).await == 1).then_some(())
    })
    .await;
    ahead.push(store(owned_event(shop, "shop", "ahead-1", "order.created"), patient));
    eventually(WAIT, "the writer's batch of one waits on its source", || async {
        (lock_waiters(pool).await == 2).then_some(())
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let keys = ["late-0", "late-1", "late-2"];
    let answers: Vec<_> =
        keys.iter().map(|key| store(owned_event(late, "late", key, "order.late"), deadline)).collect();
    eventually(WAIT, "three webhooks queued behind them", || async { (batcher.queued() == 3).then_some(()) }).await;
    shop_holder.commit().await.expect("let the first source go");
    for answer in ahead {
        assert!(answer.await.expect("task").is_ok(), "the two ahead are stored");
    }
    eventually(WAIT, "the batch of three waits on its source", || async {
        (lock_waiters(pool).await == 1).then_some(())
    })
    .await;
    assert!(tokio::time::Instant::now() < deadline, "the batch's statement began before its deadline");

    for answer in answers {
        assert_eq!(
            answer.await.expect("task"),
            Err(StoreError::Unconfirmed),
            "answered at the deadline: may be stored"
        );
    }
    let stored = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM events WHERE dedupe_key LIKE 'late-%'")
            .fetch_one(pool)
            .await
            .expect("count")
    };
    assert_eq!(stored().await, 0, "answered while its statement still waited: nothing committed yet");
    late_holder.commit().await.expect("let the second source go");

    let mut handed = Vec::new();
    while handed.len() < keys.len() {
        let next = tokio::time::timeout(WAIT, received.recv()).await.expect("each lease reaches the dispatcher's end");
        let job = next.expect("the hand-off is open").job;
        if job.endpoint_id.to_string() == late_endpoint {
            handed.push(job);
        }
    }
    assert_eq!(stored().await, 3, "the batch committed after its requesters stopped waiting");
    assert_eq!(transactions_of(pool, "late-%").await, 1, "as one batch");
    for key in keys {
        assert_eq!(leased_by_ingest(pool, key).await, 1, "{key}: leased by the batch's statement");
    }
    let mut committed: Vec<i64> = crate::prelease::lease_of(pool, &late_endpoint).await.iter().map(|l| l.1).collect();
    let mut handed: Vec<i64> = handed.iter().map(|job| job.claim_token).collect();
    committed.sort_unstable();
    handed.sort_unstable();
    assert_eq!(handed, committed, "the leases handed over are the ones committed");
}
