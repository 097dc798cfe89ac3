//! Many workers, many processes, one database: each delivery is sent once per attempt,
//! crashes are recovered by the lease, stale workers are fenced.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use webhook_gateway::queue::{self, Outcome};

use crate::support::sink::{Reply, Sink};
use crate::support::{
    GatewayProcess, TestApp, TestDb, attempt_record as record, count_status, eventually, insert_endpoint,
    record_committed, seed_deliveries,
};

/// Two gateway processes (separate pools, separate workers), 1,000 due deliveries: the
/// sink receives each webhook-id exactly once and every delivery ends delivered after
/// one attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_deliver_each_webhook_exactly_once() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::ok().await;
    let endpoint = app.endpoint_for(&sink.url("/"), Some("api")).await;
    seed_deliveries(&app.db.pool, &endpoint, 1000).await;

    let _a = GatewayProcess::start(&app.db.url, &["--role", "worker", "--workers", "16"]);
    let _b = GatewayProcess::start(&app.db.url, &["--role", "worker", "--workers", "16"]);
    eventually(Duration::from_secs(120), "1000 delivered", || async {
        (count_status(&app.db.pool, "delivered").await == 1000).then_some(())
    })
    .await;
    let mut per_id: HashMap<String, usize> = HashMap::new();
    for r in sink.received() {
        *per_id.entry(r.header("webhook-id")).or_default() += 1;
        assert_eq!(r.header("webhook-attempt"), "1");
    }
    assert_eq!(per_id.len(), 1000, "every delivery reached the sink");
    assert!(per_id.values().all(|&n| n == 1), "no webhook-id was sent twice");
    let max_attempts: i32 =
        sqlx::query_scalar("SELECT max(attempt_count) FROM deliveries").fetch_one(&app.db.pool).await.unwrap();
    assert_eq!(max_attempts, 1);
    assert_eq!(app.db.count("attempts").await, 1000);
}

/// Same, with a sink that fails the first attempt of each delivery: exactly two POSTs
/// each, attempt 1 then attempt 2, never more.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_retry_each_failed_delivery_exactly_once() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::start(|_, n| if n == 0 { Reply::status(500) } else { Reply::status(200) }).await;
    let endpoint = app.endpoint_for(&sink.url("/"), Some("api")).await;
    seed_deliveries(&app.db.pool, &endpoint, 1000).await;
    // Every delivery fails once, which would (rightly) open the endpoint's circuit; this
    // test is about retry bookkeeping, so the breaker is set out of reach.
    let fast_backoff = ["--backoff-base-ms", "20", "--backoff-cap-secs", "1", "--circuit-failure-threshold", "100000"];
    let _a =
        GatewayProcess::start(&app.db.url, &[&["--role", "worker", "--workers", "16"][..], &fast_backoff].concat());
    let _b =
        GatewayProcess::start(&app.db.url, &[&["--role", "worker", "--workers", "16"][..], &fast_backoff].concat());
    eventually(Duration::from_secs(120), "1000 delivered", || async {
        (count_status(&app.db.pool, "delivered").await == 1000).then_some(())
    })
    .await;
    let mut per_id: HashMap<String, Vec<String>> = HashMap::new();
    for r in sink.received() {
        per_id.entry(r.header("webhook-id")).or_default().push(r.header("webhook-attempt"));
    }
    assert_eq!(per_id.len(), 1000);
    for (id, attempts) in &per_id {
        assert_eq!(attempts, &["1", "2"], "{id}");
    }
    let counts: Vec<i32> =
        sqlx::query_scalar("SELECT DISTINCT attempt_count FROM deliveries").fetch_all(&app.db.pool).await.unwrap();
    assert_eq!(counts, [2]);
}

/// A worker process is SIGKILLed while the subscriber holds its request. When the lease
/// runs out, another worker delivers it: same webhook-id and idempotency key, attempt 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_s_delivery_comes_back_after_the_lease() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::start(|_, n| if n == 0 { Reply::Hold(Duration::from_secs(60)) } else { Reply::status(200) }).await;
    let endpoint = app.endpoint_for(&sink.url("/"), Some("api")).await;
    seed_deliveries(&app.db.pool, &endpoint, 1).await;
    // The shortest lease the configuration allows: request timeout 1 s + 10 s margin.
    let lease = ["--request-timeout-secs", "1", "--lease-secs", "11"];
    let mut doomed = GatewayProcess::start(&app.db.url, &[&["--role", "worker"][..], &lease].concat());
    eventually(Duration::from_secs(30), "first attempt in flight", || async { (sink.count() == 1).then_some(()) })
        .await;
    doomed.kill();
    let (status, leased): (String, Option<chrono::DateTime<chrono::Utc>>) =
        sqlx::query_as("SELECT status, leased_until FROM deliveries").fetch_one(&app.db.pool).await.unwrap();
    assert_eq!(status, "pending", "nothing was recorded by the dead worker");
    assert!(leased.is_some(), "the lease is still held by the dead worker");

    let _survivor = GatewayProcess::start(&app.db.url, &[&["--role", "worker"][..], &lease].concat());
    eventually(Duration::from_secs(60), "redelivered after the lease", || async {
        (count_status(&app.db.pool, "delivered").await == 1).then_some(())
    })
    .await;
    let got = sink.received();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].header("webhook-id"), got[1].header("webhook-id"));
    assert_eq!(got[0].header("idempotency-key"), got[1].header("idempotency-key"));
    assert_eq!(got[0].header("webhook-attempt"), "1");
    assert_eq!(got[1].header("webhook-attempt"), "2");
    assert!(got[1].at.duration_since(got[0].at) >= Duration::from_secs(10), "not before the lease ran out");
    let recorded: Vec<i32> =
        sqlx::query_scalar("SELECT attempt_number FROM attempts").fetch_all(&app.db.pool).await.unwrap();
    assert_eq!(recorded, [2], "attempt 1's outcome is unknown, only attempt 2 is recorded");
}

/// A worker whose lease was taken over records nothing; the new holder records once.
#[tokio::test]
async fn a_stale_worker_is_fenced() {
    let db = TestDb::new().await;
    let endpoint = insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    seed_deliveries(&db.pool, &endpoint, 1).await;

    // Worker A claims with a lease that is already over; worker B takes the row over.
    let a = queue::claim(&db.pool, 10, Duration::ZERO).await.unwrap();
    assert_eq!(a.len(), 1);
    let b = queue::claim(&db.pool, 10, Duration::from_secs(60)).await.unwrap();
    assert_eq!(b.len(), 1);
    // A new token, grown by a random step (queue::NEXT_CLAIM_TOKEN).
    assert!(b[0].claim_token > a[0].claim_token, "{} then {}", a[0].claim_token, b[0].claim_token);
    assert_eq!((a[0].attempt, b[0].attempt), (1, 2));

    let stale = record_committed(&db.pool, &[record(&a[0], Outcome::Delivered)]).await.unwrap();
    assert_eq!(stale, queue::Recorded::default(), "A is fenced");
    let (status, attempts): (String, i32) =
        sqlx::query_as("SELECT status, attempt_count FROM deliveries").fetch_one(&db.pool).await.unwrap();
    assert_eq!((status.as_str(), attempts), ("pending", 2), "A changed nothing");
    assert_eq!(db.count("attempts").await, 0);
    assert!(!queue::release(&db.pool, a[0].id, a[0].claim_token, chrono::Utc::now()).await.unwrap());

    let fresh = record_committed(&db.pool, &[record(&b[0], Outcome::Delivered)]).await.unwrap();
    assert_eq!(fresh, queue::Recorded { fresh: vec![b[0].id], ..Default::default() });
    // Recording twice (a retried write) does not apply twice, and says so: it is not
    // mistaken for a fenced outcome.
    let again = record_committed(&db.pool, &[record(&b[0], Outcome::Delivered)]).await.unwrap();
    assert_eq!(again, queue::Recorded { already: vec![b[0].id], ..Default::default() });
    assert_eq!(db.count("attempts").await, 1);
}

/// A claim given back twice with its token (the release retried after a commit that went
/// unconfirmed) gives its attempt back once: the next claim is attempt 1 again, not 0, and
/// its outcome is recorded. (Before, the second release took a second attempt off: the
/// next send repeated an attempt number already recorded, its outcome broke
/// `attempts_once` and the delivery, answered 200 by its subscriber, was dead-lettered.)
#[tokio::test]
async fn giving_a_claim_back_twice_gives_its_attempt_back_once() {
    let db = TestDb::new().await;
    let endpoint = insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    seed_deliveries(&db.pool, &endpoint, 1).await;
    let attempt_count = || async {
        sqlx::query_scalar::<_, i32>("SELECT attempt_count FROM deliveries").fetch_one(&db.pool).await.unwrap()
    };

    // Attempt 1 is sent and fails; attempt 2 is claimed and given back unsent, twice.
    let first = queue::claim(&db.pool, 10, Duration::from_secs(60)).await.unwrap();
    let mut retry = record(&first[0], Outcome::Retry);
    retry.status_code = Some(503);
    retry.next_attempt_at = Some(chrono::Utc::now());
    retry.next_attempt_reason = Some(webhook_gateway::deliver::policy::NextReason::Backoff);
    record_committed(&db.pool, &[retry]).await.unwrap();
    let second = queue::claim(&db.pool, 10, Duration::from_secs(60)).await.unwrap();
    assert_eq!(second[0].attempt, 2);
    let now = chrono::Utc::now();
    assert!(queue::release(&db.pool, second[0].id, second[0].claim_token, now).await.unwrap());
    assert!(
        queue::release(&db.pool, second[0].id, second[0].claim_token, now).await.unwrap(),
        "the repeat finds the claim given back"
    );
    assert_eq!(attempt_count().await, 1, "one attempt given back, not two");

    let third = queue::claim(&db.pool, 10, Duration::from_secs(60)).await.unwrap();
    assert_eq!(third[0].attempt, 2, "attempt 2 is sent again, not attempt 1 twice");
    // The old token's release, late, is fenced.
    assert!(!queue::release(&db.pool, second[0].id, second[0].claim_token, now).await.unwrap());
    let recorded = record_committed(&db.pool, &[record(&third[0], Outcome::Delivered)]).await.unwrap();
    assert_eq!(recorded, queue::Recorded { fresh: vec![third[0].id], ..Default::default() });
    let numbers: Vec<i32> = sqlx::query_scalar("SELECT attempt_number FROM attempts ORDER BY attempt_number")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(numbers, [1, 2]);
}

/// The recorder given, in one batch, the outcome of a claim whose lease ran out before it
/// was written and the outcome of the claim that took the delivery over (the recorder's
/// writes slower than a lease), beside another delivery's: the newer claim's outcome and
/// the other delivery's are recorded, the stale one fenced. (Before, the two outcomes of
/// one delivery were refused as a broken invariant and nothing of the batch was recorded:
/// every delivery in it was sent again.)
#[tokio::test]
async fn a_stale_outcome_beside_its_successor_s_in_one_batch_leaves_the_batch_recorded() {
    use webhook_gateway::deliver::recorder;
    let db = TestDb::new().await;
    let endpoint = insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    seed_deliveries(&db.pool, &endpoint, 1).await;
    let stale = queue::claim(&db.pool, 10, Duration::ZERO).await.unwrap();
    seed_deliveries(&db.pool, &endpoint, 1).await;
    let current = queue::claim(&db.pool, 10, Duration::from_secs(60)).await.unwrap();
    assert_eq!(current.len(), 2, "the lapsed claim's delivery taken over, and the new one");
    let finished = |c: &queue::Claimed| recorder::Finished {
        record: record(c, Outcome::Delivered),
        signal: webhook_gateway::circuit::Signal::Healthy,
        probe_token: None,
        span: tracing::Span::none(),
    };
    let batch: Vec<_> = std::iter::once(&stale[0]).chain(&current).map(finished).collect();
    let patience = recorder::Patience::of(Duration::from_secs(60));
    recorder::write(&db.pool, &batch, &webhook_gateway::circuit::CircuitConfig::default(), &patience).await;

    let recorded: Vec<(uuid::Uuid, String, i32)> = sqlx::query_as(
        "SELECT d.id, d.status, a.attempt_number FROM deliveries d JOIN attempts a ON a.delivery_id = d.id ORDER BY d.id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut expected: Vec<(uuid::Uuid, String, i32)> =
        current.iter().map(|c| (c.id.0, "delivered".to_owned(), c.attempt)).collect();
    expected.sort();
    assert_eq!(recorded, expected, "the taken-over delivery's attempt 2 and the other's attempt 1; the stale fenced");
}

/// A `retry` outcome written twice (the batch retried after an ambiguous commit: the
/// row is still pending under the same claim token) is recorded once, with the first
/// write's schedule.
#[tokio::test]
async fn recording_a_retry_twice_records_one_attempt() {
    let db = TestDb::new().await;
    let endpoint = insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    seed_deliveries(&db.pool, &endpoint, 2).await;
    let claimed = queue::claim(&db.pool, 10, Duration::from_secs(60)).await.unwrap();
    assert_eq!(claimed.len(), 2);
    let first_at = chrono::Utc::now() + chrono::Duration::seconds(30);
    let mut retry = record(&claimed[0], Outcome::Retry);
    retry.status_code = Some(503);
    retry.next_attempt_at = Some(first_at);
    retry.next_attempt_reason = Some(webhook_gateway::deliver::policy::NextReason::Backoff);
    let delivered = record(&claimed[1], Outcome::Delivered);
    let first = record_committed(&db.pool, &[retry.clone(), delivered.clone()]).await.unwrap();
    assert_eq!(first.fresh.len(), 2);
    // The same batch again, with a later schedule for the retry (a fresh draw).
    retry.next_attempt_at = Some(first_at + chrono::Duration::seconds(60));
    let second = record_committed(&db.pool, &[retry, delivered]).await.unwrap();
    assert!(second.fresh.is_empty(), "{second:?}");
    assert_eq!(second.already.len(), 2);
    let attempts: i64 = sqlx::query_scalar("SELECT count(*) FROM attempts WHERE delivery_id = $1")
        .bind(claimed[0].id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(attempts, 1);
    let due: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT next_attempt_at FROM deliveries WHERE id = $1")
        .bind(claimed[0].id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!((due - first_at).num_milliseconds().abs() < 5, "the first write's schedule stands: {due} vs {first_at}");
}

/// Claimers on separate connections racing for the same queue get disjoint rows, and
/// between them claim every row exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_are_disjoint() {
    let db = TestDb::new().await;
    let endpoint = insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    seed_deliveries(&db.pool, &endpoint, 2000).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let pool = webhook_gateway::db::connect(&db.url, 1).await.unwrap();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut mine = Vec::new();
            loop {
                // No endpoint limit in the way: this is about disjointness (nothing is
                // recorded, so every claimed row stays in flight).
                let fairness = queue::Fairness { default_max_in_flight: 1_000_000, sweep: false };
                let got = queue::claim_fair(&pool, 7, Duration::from_secs(60), fairness).await.unwrap();
                if got.is_empty() {
                    break;
                }
                mine.extend(got.into_iter().map(|c| c.id));
            }
            mine
        }));
    }
    let mut all = Vec::new();
    let mut workers_that_claimed = 0;
    for t in tasks {
        let mine = t.await.unwrap();
        workers_that_claimed += usize::from(!mine.is_empty());
        all.extend(mine);
    }
    let total = all.len();
    all.sort();
    all.dedup();
    assert_eq!(total, 2000, "every row claimed");
    assert_eq!(all.len(), 2000, "no row claimed twice");
    assert!(workers_that_claimed > 1, "the claimers really raced");
}

/// Ingest and delivery in separate processes: the ingest process NOTIFYs after commit
/// and the worker process LISTENs. With the worker's poll interval at 60 s, only the
/// notification can deliver within the 30 s this test waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_roles_wake_workers_by_notification() {
    let latencies = delivered_by_notification("worker", 5).await;
    println!("split roles, ingest-to-first-attempt via NOTIFY: {latencies:?}");
}

/// A fleet that mixes roles: `--role ingest` replicas in front, a `--role all` replica
/// that delivers. The `all` replica's own ingest hands its deliveries over in-process,
/// but the webhooks the ingest replica stores reach it only by the ingest replica's
/// NOTIFY, which it must LISTEN for as a worker does (before role `all` listened, each
/// of these webhooks waited for its 60 s poll and the test failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_all_role_replica_is_woken_by_an_ingest_replica_s_notification() {
    delivered_by_notification("all", 3).await;
}

/// `count` webhooks posted one at a time to an ingest-only gateway, each delivered by a
/// process of `role` whose poll interval is 60 s: only the ingest process's NOTIFY can
/// have it delivered within the 30 s each is waited for. What each took, from its post
/// to the sink's receipt.
async fn delivered_by_notification(role: &str, count: usize) -> Vec<Duration> {
    let app = TestApp::ingest_only().await;
    let sink = Sink::ok().await;
    app.source_none("shop").await;
    app.endpoint_for(&sink.url("/"), Some("shop")).await;
    let _delivering = GatewayProcess::start(&app.db.url, &["--role", role, "--poll-interval-ms", "60000"]);
    // Let it finish its start-up claim and go idle.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut latencies = Vec::new();
    for i in 0..count {
        let start = std::time::Instant::now();
        let (status, _) = app.ingest("shop", &format!("n-{i}"), "order.created", "{}").await;
        assert_eq!(status, 200);
        let at = eventually(Duration::from_secs(30), "the delivering process, woken, delivers", || async {
            (sink.count() > i).then(|| sink.received()[i].at)
        })
        .await;
        latencies.push(at.duration_since(start));
    }
    eventually(Duration::from_secs(10), "all recorded", || async {
        (count_status(&app.db.pool, "delivered").await == count as i64).then_some(())
    })
    .await;
    latencies
}

/// Claims of fresh deliveries by key (ingest's hand-off, `queue::claim_fresh`) racing
/// general claims on separate connections, for the rows of one endpoint: no row is
/// claimed twice, and the endpoint's in-flight limit holds across all of them (nothing
/// is recorded, so every claim stays in flight). Then, without a limit, every row is
/// claimed exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fresh_and_general_claims_racing_share_no_row_and_keep_the_limit() {
    let db = TestDb::new().await;
    let endpoint = insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    seed_deliveries(&db.pool, &endpoint, 600).await;
    let ids = Arc::new(crate::support::delivery_ids(&db.pool, &endpoint).await);
    for (limit, expected) in [(50, 50), (1_000_000, 550)] {
        let barrier = Arc::new(tokio::sync::Barrier::new(8));
        let mut tasks = Vec::new();
        for n in 0..8usize {
            let pool = webhook_gateway::db::connect(&db.url, 1).await.unwrap();
            let (barrier, ids) = (barrier.clone(), ids.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let mut mine = Vec::new();
                let mut chunks = ids.chunks(7).cycle().skip(n * 11).take(ids.len() / 7 + 1);
                loop {
                    let got = if n % 2 == 0 {
                        // Half the claimers are handed overlapping slices of the rows.
                        let Some(chunk) = chunks.next() else { break };
                        queue::claim_fresh(&pool, chunk, 7, Duration::from_secs(60), limit).await.unwrap().claimed
                    } else {
                        let fairness = queue::Fairness { default_max_in_flight: limit, sweep: false };
                        let got = queue::claim_fair(&pool, 7, Duration::from_secs(60), fairness).await.unwrap();
                        if got.is_empty() {
                            break;
                        }
                        got
                    };
                    mine.extend(got.into_iter().map(|c| c.id));
                }
                mine
            }));
        }
        let mut all = Vec::new();
        let mut fresh_claimed = 0;
        for (n, t) in tasks.into_iter().enumerate() {
            let mine = t.await.unwrap();
            if n % 2 == 0 {
                fresh_claimed += mine.len();
            }
            all.extend(mine);
        }
        let total = all.len();
        all.sort();
        all.dedup();
        eprintln!("limit {limit}: {total} claimed, {fresh_claimed} of them by key");
        assert_eq!(all.len(), total, "no row claimed twice");
        assert_eq!(total, expected, "limit {limit}: the limit held and was reached");
    }
    let leased: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE claim_token > 0 AND attempt_count = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(leased, 600, "every row claimed exactly once");
}
