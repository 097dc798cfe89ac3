//! A finished line head passes its lease on to its line's next delivery in the outcome
//! write's own transaction (`queue::lease_promoted`), and only where that cannot break
//! an endpoint's limits or its circuit: everything else is left to the claims, as before.

use std::time::Duration;

use webhook_gateway::circuit::{CircuitConfig, Signal};
use webhook_gateway::db::Pool;
use webhook_gateway::deliver::recorder::{self, Finished, LeaseTerms, Promoted};
use webhook_gateway::ids::DeliveryId;
use webhook_gateway::queue::{self, Claimed, Outcome};

use crate::support::sink::{Reply, Sink};
use crate::support::{GatewayProcess, TestDb, attempt_record, count_status, eventually, insert_endpoint};

const LEASE: Duration = Duration::from_secs(60);
const TERMS: LeaseTerms = LeaseTerms { lease: LEASE, default_max_in_flight: 8 };

/// `claims` answered 200.
fn delivered(claims: &[&Claimed]) -> Vec<Finished> {
    claims
        .iter()
        .map(|c| Finished {
            record: attempt_record(c, Outcome::Delivered),
            signal: Signal::Healthy,
            probe_token: None,
            span: tracing::Span::none(),
        })
        .collect()
}

/// Record `claims` as delivered with `terms`: the heads handed over by id, and those leased.
async fn write(pool: &Pool, claims: &[&Claimed], terms: Option<LeaseTerms>) -> (Vec<DeliveryId>, Vec<Claimed>) {
    let patience = recorder::Patience::of(LEASE);
    match recorder::write(pool, &delivered(claims), &CircuitConfig::default(), &patience, terms).await {
        Promoted::Known { heads, leased } => (heads, leased),
        Promoted::Unknown => panic!("the write was one clean batch"),
    }
}

/// The lines' heads now, in id order.
async fn line_heads(pool: &Pool) -> Vec<DeliveryId> {
    let ids: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT head_id FROM order_lines WHERE head_id IS NOT NULL ORDER BY head_id")
            .fetch_all(pool)
            .await
            .expect("line heads");
    ids.into_iter().map(DeliveryId).collect()
}

/// A database with `lines` lines of three deliveries to one endpoint, whose heads are
/// claimed, as workers hold them.
async fn claimed_heads(lines: i64) -> (TestDb, String, Vec<Claimed>) {
    let db = TestDb::new().await;
    let endpoint = insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    crate::support::seed_ordered_lines(&db.pool, &endpoint, lines).await;
    let mut heads = queue::claim(&db.pool, 10, LEASE).await.expect("claim");
    heads.sort_by_key(|c| c.id);
    assert_eq!(heads.len() as i64, lines, "every line's head, and only they, claimed");
    (db, endpoint, heads)
}

/// Two of three lines' heads delivered: the write makes each line's next delivery its
/// head and leases it as a claim would (a new token, the attempt counted, the lease
/// live), with everything its worker needs; no claim finds it. The leased heads' own
/// outcomes are fenced by their tokens and pass the lease on again.
#[tokio::test]
async fn a_delivered_head_passes_its_lease_to_its_line_s_next_delivery() {
    let (db, endpoint, heads) = claimed_heads(3).await;
    let pool = &db.pool;
    let (handed, leased) = write(pool, &[&heads[0], &heads[1]], Some(TERMS)).await;
    assert!(handed.is_empty(), "every promoted head was leased, none handed over: {handed:?}");
    let mut leased_ids: Vec<DeliveryId> = leased.iter().map(|c| c.id).collect();
    leased_ids.sort();
    let expected: Vec<DeliveryId> = line_heads(pool).await.into_iter().filter(|id| *id != heads[2].id).collect();
    assert_eq!(leased_ids, expected, "the two lines' new heads");
    for c in &leased {
        assert_eq!((c.attempt, c.claim_token, c.ordered, c.probe_token), (1, 1, true, None), "{c:?}");
        assert_eq!((c.endpoint_id.to_string(), &c.payload[..], c.payload_bytes), (endpoint.clone(), &b"{}"[..], 2));
    }
    let live: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deliveries WHERE id = ANY($1) AND status = 'pending' AND attempt_count = 1
           AND claim_token = 1 AND leased_until > now() + interval '50 seconds'",
    )
    .bind(&leased_ids)
    .fetch_one(pool)
    .await
    .expect("leases");
    assert_eq!(live, 2, "leased in the database as a claim leases");
    assert!(queue::claim(pool, 10, LEASE).await.expect("claim").is_empty(), "nothing is left for a claim");

    let (handed, third) = write(pool, &leased.iter().collect::<Vec<_>>(), Some(TERMS)).await;
    assert!(handed.is_empty(), "{handed:?}");
    assert_eq!(third.len(), 2, "the lines' third deliveries");
    assert_eq!(count_status(pool, "delivered").await, 4);
    // The last step: no delivery is left in those lines, so nothing is promoted or leased.
    let (handed, none) = write(pool, &third.iter().collect::<Vec<_>>(), Some(TERMS)).await;
    assert!(handed.is_empty() && none.is_empty(), "{handed:?} {none:?}");
    assert_eq!(line_heads(pool).await, vec![heads[2].id], "the finished lines are gone");
}

/// Every condition under which passing the lease could break a limit, skip a circuit's
/// half-open probe or lease a head nobody runs: the write still makes the next delivery
/// its line's head, but leaves it to the claims (handed over by id, as before). The
/// control, with nothing in the way, leases it.
#[tokio::test]
async fn a_promoted_head_is_left_to_the_claims_whenever_its_lease_could_break_a_limit() {
    // (what, statement on the finished head `$1` or its endpoint `$2`, terms); the three
    // heads are claimed first.
    let cases: [(&str, &str, Option<LeaseTerms>); 9] = [
        ("nothing in the way (control)", "", Some(TERMS)),
        (
            "a limit lowered to the leases held, room for the one that ends (control)",
            "UPDATE endpoints SET max_in_flight = 3 WHERE id = $2::uuid AND $1::uuid IS NOT NULL",
            Some(TERMS),
        ),
        ("no terms: a stopping recorder", "", None),
        (
            "the finished head's lease had run out",
            "UPDATE deliveries SET leased_until = now() - interval '1 second' WHERE id = $1 AND $2::uuid IS NOT NULL",
            Some(TERMS),
        ),
        (
            "the finished head's lease ends within the margin",
            "UPDATE deliveries SET leased_until = clock_timestamp() + interval '1 second'
             WHERE id = $1 AND $2::uuid IS NOT NULL",
            Some(TERMS),
        ),
        (
            "a limit lowered below the leases held",
            "UPDATE endpoints SET max_in_flight = 2 WHERE id = $2::uuid AND $1::uuid IS NOT NULL",
            Some(TERMS),
        ),
        (
            "the circuit is open",
            "UPDATE endpoints SET circuit_state = 'open', opened_at = now(), reopen_at = now() + interval '1 minute'
             WHERE id = $2::uuid AND $1::uuid IS NOT NULL",
            Some(TERMS),
        ),
        (
            "the endpoint is paused",
            "UPDATE endpoints SET paused = true WHERE id = $2::uuid AND $1::uuid IS NOT NULL",
            Some(TERMS),
        ),
        (
            "the endpoint is rate-limited",
            "UPDATE endpoints SET rate_limit_per_sec = 100, rate_limit_burst = 100
             WHERE id = $2::uuid AND $1::uuid IS NOT NULL",
            Some(TERMS),
        ),
    ];
    for (what, change, terms) in cases {
        let (db, endpoint, heads) = claimed_heads(3).await;
        let pool = &db.pool;
        if !change.is_empty() {
            let changed = sqlx::query(change).bind(heads[0].id).bind(&endpoint).execute(pool).await.expect(what);
            assert_eq!(changed.rows_affected(), 1, "{what}");
        }
        let (handed, leased) = write(pool, &[&heads[0]], terms).await;
        let new_head: Vec<DeliveryId> =
            line_heads(pool).await.into_iter().filter(|id| !heads.iter().any(|h| h.id == *id)).collect();
        assert_eq!(new_head.len(), 1, "{what}: the line moved on");
        if what.contains("(control)") {
            assert_eq!((handed, leased.iter().map(|c| c.id).collect::<Vec<_>>()), (vec![], new_head), "{what}");
        } else {
            assert_eq!((handed, leased.len()), (new_head.clone(), 0), "{what}: handed over by id, not leased");
            let leased_now: i64 =
                sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE id = $1 AND leased_until IS NOT NULL")
                    .bind(new_head[0])
                    .fetch_one(pool)
                    .await
                    .expect("lease");
            assert_eq!(leased_now, 0, "{what}: not leased in the database either");
        }
    }
}

/// The recorder leases a head but the dispatcher can no longer take it (it stopped and
/// closed its queue): the head is given back at once, its attempt not spent, so it is
/// claimable now rather than when the lease runs out.
#[tokio::test]
async fn a_head_leased_for_a_dispatcher_that_stopped_is_given_back_unspent() {
    use std::sync::Arc;
    use webhook_gateway::deliver::recorder::{Done, PassOn, Written};

    let (db, _endpoint, heads) = claimed_heads(1).await;
    let pool = &db.pool;
    let (jobs, closed) = tokio::sync::mpsc::unbounded_channel();
    drop(closed);
    let written = Written {
        due: Arc::new(tokio::sync::Notify::new()),
        heads: Arc::new(webhook_gateway::wake::Handoff::default()),
        room: Arc::new(tokio::sync::Notify::new()),
        leased: Some(PassOn { terms: TERMS, jobs }),
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let recorder =
        tokio::spawn(recorder::run(pool.clone(), rx, CircuitConfig::default(), recorder::Patience::of(LEASE), written));
    let slot = Arc::new(tokio::sync::Semaphore::new(1)).acquire_owned().await.expect("slot");
    let done = delivered(&[&heads[0]]).pop().expect("one");
    tx.send((Done::Attempted(done), slot)).await.expect("send");
    drop(tx);
    recorder.await.expect("recorder");

    let next: (i32, i64, Option<chrono::DateTime<chrono::Utc>>, bool) = sqlx::query_as(
        "SELECT attempt_count, claim_token, leased_until, next_attempt_at <= now() FROM deliveries
         WHERE line_seq = 2",
    )
    .fetch_one(pool)
    .await
    .expect("the next delivery");
    assert_eq!(next, (0, 1, None, true), "leased (token 1), then given back: no attempt spent, due now");
    let claimed = queue::claim(pool, 10, LEASE).await.expect("claim");
    assert_eq!(claimed.iter().map(|c| (c.attempt, c.claim_token)).collect::<Vec<_>>(), vec![(1, 2)]);
}

/// Two replicas deliver one endpoint limited to 4 requests in flight: 40 unordered
/// deliveries and 15 lines of three, to a subscriber that holds each request 100 ms.
/// Their recorders pass leases on while the other replica claims, for real: the
/// subscriber never sees more than 4 at once, every delivery arrives once, each line in
/// order, and the lines' steps were leased by the writes (the replicas' metrics say so).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passing_leases_on_keeps_the_endpoint_s_limit_across_replicas() {
    const WAIT: Duration = Duration::from_secs(90);
    const LINES: i64 = 15;
    let db = TestDb::new().await;
    let pool = &db.pool;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_millis(100))).await;
    let endpoint = insert_endpoint(pool, &sink.url("/")).await;
    sqlx::query("UPDATE endpoints SET max_in_flight = 4 WHERE id = $1::uuid")
        .bind(&endpoint)
        .execute(pool)
        .await
        .expect("limit");
    crate::support::seed_ordered_lines(pool, &endpoint, LINES).await;
    crate::support::seed_deliveries(pool, &endpoint, 40).await;
    let total = 40 + 3 * LINES;
    let args = ["--role", "all", "--poll-interval-ms", "50", "--request-timeout-secs", "5", "--lease-secs", "15"];
    let replicas = [GatewayProcess::start(&db.url, &args), GatewayProcess::start(&db.url, &args)];
    for r in &replicas {
        crate::support::wait_ready(r.addr).await;
    }
    eventually(WAIT, "all delivered", || async { (count_status(pool, "delivered").await == total).then_some(()) })
        .await;
    eprintln!("max_in_flight 4, leases passed on, two replicas: at most {} at once", sink.max_concurrent());
    assert!(sink.max_concurrent() <= 4, "{} requests at once", sink.max_concurrent());
    assert_eq!(sink.max_concurrent(), 4, "the cap was reached (the test exercised it)");
    let mut ids: Vec<String> = sink.received().iter().map(|r| r.header("webhook-id")).collect();
    ids.sort();
    ids.dedup();
    assert_eq!((sink.count(), ids.len()), (total as usize, total as usize), "each delivery once");
    // Each line in order: a delivery's attempt started only after its predecessor's ended.
    let out_of_order: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (
             SELECT a.started_at, lag(a.started_at + make_interval(secs => a.duration_ms / 1000.0))
                        OVER (PARTITION BY d.ordering_key ORDER BY d.line_seq) AS before_ended
             FROM deliveries d JOIN attempts a ON a.delivery_id = d.id WHERE d.ordering_key IS NOT NULL
         ) s WHERE s.started_at < s.before_ended",
    )
    .fetch_one(pool)
    .await
    .expect("order");
    assert_eq!(out_of_order, 0, "every line delivered in order");
    let http = reqwest::Client::new();
    let mut leased = 0.0;
    for r in &replicas {
        let text =
            http.get(format!("http://{}/metrics", r.addr)).send().await.expect("metrics").text().await.expect("text");
        leased += text
            .lines()
            .find_map(|l| l.strip_prefix("webhook_gateway_line_heads_leased_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0);
    }
    eprintln!("line steps leased by the writes: {leased} of {}", 2 * LINES);
    assert!(leased > 0.0, "the writes passed leases on (the test exercised it)");
}

/// A batch that also holds a failure on the same endpoint (which may open its circuit
/// in this very write) passes no lease on there: the next head is left to the claims,
/// which see the circuit as the write left it.
#[tokio::test]
async fn a_write_that_may_open_the_circuit_passes_no_lease_on_for_its_endpoint() {
    let (db, _endpoint, heads) = claimed_heads(2).await;
    let pool = &db.pool;
    let mut batch = delivered(&[&heads[0]]);
    let mut failed = attempt_record(&heads[1], Outcome::Retry);
    failed.status_code = Some(503);
    failed.next_attempt_at = Some(chrono::Utc::now() + chrono::Duration::seconds(600));
    batch.push(Finished { record: failed, signal: Signal::Failure, probe_token: None, span: tracing::Span::none() });
    let patience = recorder::Patience::of(LEASE);
    let Promoted::Known { heads: handed, leased } =
        recorder::write(pool, &batch, &CircuitConfig::default(), &patience, Some(TERMS)).await
    else {
        panic!("the write was one clean batch");
    };
    assert!(leased.is_empty(), "{leased:?}");
    assert_eq!(handed.len(), 1, "the delivered line moved on, its next head handed over by id");
}
