//! Fair delivery across endpoints: a slow endpoint's backlog does not hold up another
//! endpoint, and per-endpoint limits (in flight, rate) hold across replicas and survive
//! a replica's death. Real processes, real subscribers.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::sink::{Reply, Sink};
use crate::support::{GatewayProcess, TestApp, count_status, eventually, seed_deliveries};

const WAIT: Duration = Duration::from_secs(90);

/// Worker replicas polling fast, with a 15 s lease (5 s request timeout) so a dead
/// replica's leases run out within the test.
fn worker(app: &TestApp) -> GatewayProcess {
    GatewayProcess::start(
        &app.db.url,
        &["--role", "worker", "--poll-interval-ms", "50", "--request-timeout-secs", "5", "--lease-secs", "15"],
    )
}

/// Set an endpoint's limits through the API.
async fn set_limits(app: &TestApp, endpoint: &str, max_in_flight: Option<i32>, rate: Option<(f64, i32)>) {
    let rate_limit = rate.map(|(per_sec, burst)| json!({"per_sec": per_sec, "burst": burst}));
    let body = json!({"max_in_flight": max_in_flight, "rate_limit": rate_limit});
    let (status, view) = app.admin(reqwest::Method::PATCH, &format!("/v1/endpoints/{endpoint}"), Some(body)).await;
    assert_eq!(status, 200, "{view}");
}

/// One endpoint answers after 1.5 s and has 1,500 deliveries waiting; a second endpoint
/// then gets 50: they arrive within about a second, not after the slow backlog (before
/// fairness they waited a median 31 s: every worker was holding a slow request).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_endpoint_s_backlog_does_not_hold_up_a_fresh_endpoint() {
    let app = TestApp::ingest_only().await;
    let slow = Sink::start(|_, _| Reply::Hold(Duration::from_millis(1500))).await;
    let fast = Sink::ok().await;
    let slow_ep = app.endpoint_for(&slow.url("/"), None).await;
    let fast_ep = app.endpoint_for(&fast.url("/"), None).await;
    seed_deliveries(&app.db.pool, &slow_ep, 1500).await;
    let _worker = worker(&app);
    // The slow endpoint holds as many workers as it may (half of them, by default).
    eventually(WAIT, "the slow endpoint at its cap", || async { (slow.count() >= 16).then_some(()) }).await;

    let seeded = Instant::now();
    seed_deliveries(&app.db.pool, &fast_ep, 50).await;
    eventually(WAIT, "the fresh endpoint's 50 deliveries", || async { (fast.count() >= 50).then_some(()) }).await;
    let mut waits: Vec<Duration> = fast.received().iter().map(|r| r.at.duration_since(seeded)).collect();
    waits.sort();
    eprintln!(
        "fresh endpoint beside a slow backlog: p50 {:?}, max {:?} (slow endpoint: {} requests so far, at most {} at once)",
        waits[25],
        waits[49],
        slow.count(),
        slow.max_concurrent()
    );
    // Generous for a loaded 2-core machine; without fairness this is tens of seconds.
    assert!(waits[49] < Duration::from_secs(5), "the fresh endpoint waited {:?}", waits[49]);
    assert!(count_status(&app.db.pool, "pending").await > 1000, "the slow backlog is still being worked through");
}

/// Two replicas, an endpoint limited to 50 requests per second (burst 5): the subscriber
/// sees 50/s ± 10 % over 20 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rate_limit_holds_across_two_replicas() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::ok().await;
    let ep = app.endpoint_for(&sink.url("/"), None).await;
    set_limits(&app, &ep, None, Some((50.0, 5))).await;
    seed_deliveries(&app.db.pool, &ep, 3000).await;
    let _a = worker(&app);
    let _b = worker(&app);
    eventually(WAIT, "deliveries flowing", || async { (sink.count() >= 20).then_some(()) }).await;
    let start = sink.received()[19].at;
    tokio::time::sleep(Duration::from_secs(21)).await;
    let in_window = sink.received().iter().filter(|r| r.at > start && r.at <= start + Duration::from_secs(20)).count();
    eprintln!("rate limit 50/s across two replicas: {in_window} requests in 20 s ({:.1}/s)", in_window as f64 / 20.0);
    assert!((900..=1100).contains(&in_window), "{in_window} requests in 20 s");
}

/// Two replicas, an endpoint with max_in_flight 4 and a subscriber taking 300 ms: the
/// subscriber never sees more than 4 requests at once, and every delivery arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_in_flight_holds_across_two_replicas() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_millis(300))).await;
    let ep = app.endpoint_for(&sink.url("/"), None).await;
    set_limits(&app, &ep, Some(4), None).await;
    seed_deliveries(&app.db.pool, &ep, 120).await;
    let _a = worker(&app);
    let _b = worker(&app);
    eventually(WAIT, "all delivered", || async {
        (count_status(&app.db.pool, "delivered").await == 120).then_some(())
    })
    .await;
    eprintln!("max_in_flight 4 across two replicas: at most {} at once", sink.max_concurrent());
    assert!(sink.max_concurrent() <= 4, "{} requests at once", sink.max_concurrent());
    assert_eq!(sink.max_concurrent(), 4, "the cap was reached (the test exercised it)");
    assert_eq!(sink.count(), 120);
}

/// An endpoint limited to one request at a time gets its next request as soon as the
/// last one's outcome is written: the recorder does not linger for company (25 ms) while
/// a claim has left that endpoint's due work behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_endpoint_limited_to_one_request_at_a_time_is_not_held_back_by_the_recorders_linger() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::ok().await;
    let ep = app.endpoint_for(&sink.url("/"), None).await;
    set_limits(&app, &ep, Some(1), None).await;
    one_at_a_time_without_the_linger(&app, &sink, &ep, worker(&app)).await;
}

/// The same with one worker slot and no limit of the endpoint's own (the default, half
/// the workers, is then one too): each claim fills the one slot, so it leaves nothing
/// behind short of what it asked; the dispatcher waits for the slot, which the recorder
/// holds until the outcome is written. (Checked: with only the slot's signal removed,
/// every gap was 31-38 ms.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_single_worker_is_not_held_back_by_the_recorders_linger() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::ok().await;
    let ep = app.endpoint_for(&sink.url("/"), None).await;
    let one_worker =
        GatewayProcess::start(&app.db.url, &["--role", "worker", "--poll-interval-ms", "50", "--workers", "1"]);
    one_at_a_time_without_the_linger(&app, &sink, &ep, one_worker).await;
}

/// 41 deliveries seeded to `ep`, delivered one at a time by `worker`.
/// With the linger, every gap between two requests would be at least the linger, whatever
/// the machine; so the shortest of the 40 gaps must be under it.
async fn one_at_a_time_without_the_linger(app: &TestApp, sink: &Sink, ep: &str, worker: GatewayProcess) {
    seed_deliveries(&app.db.pool, ep, 41).await;
    eventually(WAIT, "all delivered", || async { (count_status(&app.db.pool, "delivered").await == 41).then_some(()) })
        .await;
    drop(worker);
    assert_eq!(sink.max_concurrent(), 1, "one request at a time");
    let received = sink.received();
    assert_eq!(received.len(), 41);
    let mut gaps: Vec<Duration> = received.windows(2).map(|w| w[1].at.duration_since(w[0].at)).collect();
    gaps.sort();
    eprintln!("one request at a time: gaps between requests min {:?}, p50 {:?}, max {:?}", gaps[0], gaps[20], gaps[39]);
    let linger = webhook_gateway::deliver::recorder::LINGER;
    assert!(
        gaps[0] < linger,
        "every request waited at least the recorder's linger ({linger:?}) after the last: {gaps:?}"
    );
}

/// A backlog that only its endpoint's rate limit holds back (20/s, burst 1) leaves the
/// recorder's linger on: each outcome waits up to the linger for company, as at low load,
/// because writing it sooner would free nothing that the claim waits for. (Before the
/// claim told rate tokens from room, every write here ended at once as `waiting`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rate_limited_backlog_leaves_the_recorders_linger_on() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::ok().await;
    let ep = app.endpoint_for(&sink.url("/"), None).await;
    set_limits(&app, &ep, None, Some((20.0, 1))).await;
    seed_deliveries(&app.db.pool, &ep, 30).await;
    let worker = worker(&app);
    eventually(WAIT, "all delivered", || async { (count_status(&app.db.pool, "delivered").await == 30).then_some(()) })
        .await;
    let metrics = format!("http://{}/metrics", worker.addr);
    let scraped = crate::metrics::parse(&reqwest::get(&metrics).await.unwrap().text().await.unwrap());
    let writes = |ended: &str| -> f64 {
        scraped.get(&format!(r#"webhook_gateway_outcome_writes_total{{ended="{ended}"}}"#)).copied().unwrap_or(0.0)
    };
    let (linger, waiting) = (writes("linger"), writes("waiting"));
    eprintln!("a rate-limited backlog: {linger} writes ended by the linger, {waiting} by a waiting dispatcher");
    assert!(linger + waiting >= 15.0, "one outcome a write, about: {linger} + {waiting}");
    assert!(waiting * 4.0 <= linger, "the linger was switched off: {waiting} writes ended at once, {linger} lingered");
}

/// An endpoint limited to 200 requests a second with a burst of one gets about its rate,
/// not one request per recorder write: the claim that spent its token is told when the
/// bucket is full again, and the dispatcher claims then rather than at its next poll or
/// wake-up (with only those, about 35 a second: one per 25 ms linger and delivery).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rate_limit_with_a_burst_of_one_gets_its_rate() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::ok().await;
    let ep = app.endpoint_for(&sink.url("/"), None).await;
    set_limits(&app, &ep, None, Some((200.0, 1))).await;
    seed_deliveries(&app.db.pool, &ep, 300).await;
    let _worker = worker(&app);
    eventually(WAIT, "all delivered", || async {
        (count_status(&app.db.pool, "delivered").await == 300).then_some(())
    })
    .await;
    let received = sink.received();
    assert_eq!(received.len(), 300);
    let took = received[299].at.duration_since(received[0].at);
    let rate = 299.0 / took.as_secs_f64();
    eprintln!("rate limit 200/s, burst 1: 300 requests in {took:?} ({rate:.0}/s)");
    // 299 requests after the first need 299 tokens: at 200/s, 1.495 s at the least.
    assert!(took >= Duration::from_millis(1490), "the limit was passed: {rate:.0}/s");
    assert!(rate >= 70.0, "{rate:.0}/s: claims came only with the recorder's writes or the poll");
}

/// A replica dies holding an endpoint's every slot: the endpoint is throttled only until
/// those leases run out, then the surviving replica delivers everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_replica_s_slots_free_themselves_when_their_leases_end() {
    let app = TestApp::ingest_only().await;
    // The first two requests hang (the replica holding them is killed); the rest answer.
    let sink = Sink::start(|_, _| Reply::status(200)).await;
    let hanging = Sink::start(|_, _| Reply::Hold(Duration::from_secs(120))).await;
    let ep = app.endpoint_for(&hanging.url("/"), None).await;
    set_limits(&app, &ep, Some(2), None).await;
    seed_deliveries(&app.db.pool, &ep, 20).await;
    let mut doomed = worker(&app);
    eventually(WAIT, "both slots taken", || async { (hanging.count() == 2).then_some(()) }).await;
    doomed.kill();
    let killed = Instant::now();
    // From now on the endpoint answers at once.
    sqlx::query("UPDATE endpoints SET url = $2 WHERE id = $1::uuid")
        .bind(&ep)
        .bind(sink.url("/"))
        .execute(&app.db.pool)
        .await
        .expect("point the endpoint at the answering sink");
    let _survivor = worker(&app);
    eventually(WAIT, "all delivered by the survivor", || async {
        (count_status(&app.db.pool, "delivered").await == 20).then_some(())
    })
    .await;
    let first = sink.received()[0].at.duration_since(killed);
    eprintln!("dead replica holding both slots: the survivor's first request {first:?} after the kill (lease 15 s)");
    assert!(first >= Duration::from_secs(10), "the dead replica's leases held the slots: {first:?}");
    assert!(first < Duration::from_secs(45), "the slots came back with their leases: {first:?}");
}

/// The limits through the API: set at creation, shown (with what is in flight), changed,
/// cleared back to the default; out-of-range values are a 422 naming the field.
#[tokio::test]
async fn limits_are_set_shown_changed_and_validated_through_the_api() {
    let app = TestApp::ingest_only().await;
    let created = app
        .admin_post(
            "/v1/endpoints",
            json!({"url": "https://subscriber.example.com/", "max_in_flight": 4, "rate_limit": {"per_sec": 2.5}}),
            201,
        )
        .await;
    let id = created["id"].as_str().unwrap();
    assert_eq!(created["limits"]["max_in_flight"], 4);
    assert_eq!(created["limits"]["max_in_flight_is_default"], false);
    assert_eq!(
        created["limits"]["rate_limit"],
        json!({"per_sec": 2.5, "burst": 3}),
        "burst defaults to a second's worth"
    );
    assert_eq!(created["in_flight"], 0);
    let path = format!("/v1/endpoints/{id}");
    let (status, changed) =
        app.admin(reqwest::Method::PATCH, &path, Some(json!({"max_in_flight": null, "rate_limit": null}))).await;
    assert_eq!(status, 200, "{changed}");
    assert_eq!(changed["limits"]["max_in_flight_is_default"], true);
    assert_eq!(changed["limits"]["max_in_flight"], webhook_gateway::queue::default_max_in_flight(8));
    assert_eq!(changed["limits"]["rate_limit"], serde_json::Value::Null);
    for (body, field) in [
        (json!({"max_in_flight": 0}), "max_in_flight"),
        (json!({"max_in_flight": 10_001}), "max_in_flight"),
        (json!({"rate_limit": {"per_sec": 0}}), "rate_limit.per_sec"),
        (json!({"rate_limit": {"per_sec": 5, "burst": 0}}), "rate_limit.burst"),
    ] {
        let (status, answer) = app.admin(reqwest::Method::PATCH, &path, Some(body.clone())).await;
        assert_eq!(status, 422, "{body}: {answer}");
        assert!(answer["error"]["message"].as_str().unwrap().starts_with(field), "{body}: {answer}");
    }
    let listed = app.admin_get("/v1/endpoints").await;
    assert_eq!(listed["data"][0]["limits"]["max_in_flight_is_default"], true);
}

/// A claim tells when it took every row that was due (the dispatcher then skips a second
/// look before it sleeps), and not when due rows are left behind it: a full head window,
/// an endpoint at its limit.
#[tokio::test]
async fn a_claim_tells_whether_it_took_everything_that_was_due() {
    use webhook_gateway::queue;
    let db = crate::support::TestDb::new().await;
    let pool = &db.pool;
    let lease = Duration::from_secs(60);
    let limit = |max| queue::Fairness { default_max_in_flight: max, sweep: false };

    let nothing = queue::claim_batch(pool, 16, lease, limit(100)).await.unwrap();
    assert_eq!((nothing.claimed.len(), nothing.head_rows), (0, 0));
    assert!(nothing.took_all_due(), "nothing due, nothing left");

    let a = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/a").await;
    seed_deliveries(pool, &a, 5).await;
    let few = queue::claim_batch(pool, 16, lease, limit(100)).await.unwrap();
    assert_eq!((few.claimed.len(), few.head_rows), (5, 5));
    assert!(few.took_all_due(), "five due, five claimed");

    // 40 due: a claim of 16 looks at a window of 32, full, so it cannot know what is behind.
    let b = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/b").await;
    seed_deliveries(pool, &b, 40).await;
    let window_full = queue::claim_batch(pool, 16, lease, limit(100)).await.unwrap();
    assert_eq!((window_full.claimed.len(), window_full.head_rows), (16, 32));
    assert!(!window_full.took_all_due(), "the window was full");
    let rest = queue::claim_batch(pool, 64, lease, limit(100)).await.unwrap();
    assert_eq!((rest.claimed.len(), rest.head_rows), (24, 24));
    assert!(rest.took_all_due());

    // An endpoint at its limit of 2: five due rows seen, two claimed, three left due.
    let c = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/c").await;
    seed_deliveries(pool, &c, 5).await;
    let capped = queue::claim_batch(pool, 16, lease, limit(2)).await.unwrap();
    assert_eq!((capped.claimed.len(), capped.head_rows), (2, 5));
    assert!(!capped.took_all_due(), "three rows of the capped endpoint are still due");
}

/// A claim tells an endpoint that took all its room allowed (its due rows wait for
/// leases to end, which the recorder's writes do) from one short only of rate tokens (its
/// rows wait for time): the dispatcher ends the recorder's linger for the first, not for
/// the second.
#[tokio::test]
async fn a_claim_tells_an_endpoint_at_its_limit_from_one_out_of_rate_tokens() {
    use webhook_gateway::queue;
    let db = crate::support::TestDb::new().await;
    let pool = &db.pool;
    let lease = Duration::from_secs(60);
    let claim = || queue::claim_batch(pool, 16, lease, queue::Fairness { default_max_in_flight: 100, sweep: false });

    // A burst of 3 tokens that refill once in 1,000 s: three of five, two left for time.
    let r = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/r").await;
    crate::support::set_endpoint(pool, &r, "rate_limit_per_sec = 0.001, rate_limit_burst = 3").await;
    seed_deliveries(pool, &r, 5).await;
    let rated = claim().await.unwrap();
    assert_eq!((rated.claimed.len(), rated.head_rows), (3, 5));
    assert!(!rated.took_all_due(), "two rows are still due");
    assert!(!rated.held_by_room, "only the rate tokens held them back");
    let full_in = rated.next_token_in.expect("it spent the last tokens: it is told when the bucket is full");
    assert!((2990.0..=3000.0).contains(&full_in.as_secs_f64()), "3 tokens at 0.001/s: {full_in:?}");
    let spent = claim().await.unwrap();
    assert_eq!((spent.claimed.len(), spent.head_rows), (0, 2));
    assert!(!spent.held_by_room, "still only the rate tokens");
    assert_eq!(spent.next_token_in, None, "it spent no token: the claimer that did is told");

    // A rate-limited endpoint that took everything it had due, beside the one out of tokens.
    let s = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/s").await;
    crate::support::set_endpoint(pool, &s, "rate_limit_per_sec = 0.001, rate_limit_burst = 10").await;
    seed_deliveries(pool, &s, 2).await;
    let all = claim().await.unwrap();
    assert_eq!(all.claimed.len(), 2);
    assert!(!all.held_by_room, "one took all it had, the other is out of tokens");
    assert_eq!(all.next_token_in, None, "eight tokens are left");

    // Ten a second, a burst of two: both taken, the bucket full again 0.2 s after the
    // claim's transaction began, so told from its statement's end: 0.2 s less at most the
    // whole call (on a loaded machine the statement alone took 13 ms).
    let t = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/t").await;
    crate::support::set_endpoint(pool, &t, "rate_limit_per_sec = 10, rate_limit_burst = 2").await;
    seed_deliveries(pool, &t, 4).await;
    let called = std::time::Instant::now();
    let burst = claim().await.unwrap();
    let call = called.elapsed();
    assert_eq!(burst.claimed.len(), 2);
    let full_in = burst.next_token_in.expect("told when the bucket is full");
    let refill = Duration::from_millis(200);
    assert!(
        full_in <= refill && full_in + call >= refill,
        "two tokens at 10/s: {full_in:?}, the claim call took {call:?}"
    );
    sqlx::query("UPDATE deliveries SET status = 'delivered' WHERE endpoint_id = $1::uuid")
        .bind(&t)
        .execute(pool)
        .await
        .unwrap();

    // Tokens to spare, but one request in flight at a time: one of three, two left for
    // its lease to end.
    let m = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/m").await;
    crate::support::set_endpoint(pool, &m, "max_in_flight = 1, rate_limit_per_sec = 1000, rate_limit_burst = 100")
        .await;
    seed_deliveries(pool, &m, 3).await;
    let capped = claim().await.unwrap();
    assert_eq!(capped.claimed.len(), 1);
    assert!(capped.held_by_room, "its in-flight limit held two rows back");
    let full = claim().await.unwrap();
    assert_eq!(full.claimed.len(), 0);
    assert!(full.held_by_room, "the lease still holds its limit");

    // A claim that fills its share of the batch leaves rows the next claim can take.
    let b = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/b").await;
    seed_deliveries(pool, &b, 20).await;
    let shared = claim().await.unwrap();
    assert_eq!(shared.claimed.len(), 16);
    assert!(shared.held_by_room, "the batch was full");

    // Nothing due anywhere: nothing held back.
    sqlx::query("UPDATE deliveries SET status = 'delivered', leased_until = NULL").execute(pool).await.unwrap();
    let none = claim().await.unwrap();
    assert_eq!((none.claimed.len(), none.head_rows, none.held_by_room), (0, 0, false));
}

/// A rate the API accepts but so small that the bucket's refill time passes what a float
/// can hold (100 tokens at 1e-307 a second): the claim still succeeds, takes the burst,
/// and says the bucket is full again only in the far future. (Before the time was
/// bounded, the division overflowed and every claim that served the endpoint failed,
/// holding up every endpoint those claims served.)
#[tokio::test]
async fn a_rate_too_small_to_refill_in_any_time_a_float_holds_does_not_fail_the_claim() {
    use webhook_gateway::queue;
    let db = crate::support::TestDb::new().await;
    let pool = &db.pool;
    let e = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/e").await;
    crate::support::set_endpoint(pool, &e, "rate_limit_per_sec = 1e-307, rate_limit_burst = 100").await;
    seed_deliveries(pool, &e, 101).await;
    let fairness = queue::Fairness { default_max_in_flight: 1000, sweep: false };
    let claim = queue::claim_batch(pool, 128, Duration::from_secs(60), fairness).await.expect("the claim succeeds");
    assert_eq!(claim.claimed.len(), 100, "the burst");
    let full_in = claim.next_token_in.expect("it spent the last tokens");
    assert!(full_in > Duration::from_secs(86_400 * 365), "full again only in the far future: {full_in:?}");
}

/// The claim of deliveries this process just stored (`queue::claim_fresh`, ingest's
/// hand-off to its own workers) keeps every rule of the general claim: an endpoint's
/// in-flight limit and rate tokens, a paused endpoint, a line's waiting delivery, a row
/// another claim holds; and it says when it left claimable work behind, so that the
/// dispatcher looks the general way next.
#[tokio::test]
async fn a_fresh_claim_keeps_every_limit_and_says_what_it_left() {
    use webhook_gateway::ids::DeliveryId;
    use webhook_gateway::queue;
    let db = crate::support::TestDb::new().await;
    let pool = &db.pool;
    let lease = Duration::from_secs(60);
    let fresh =
        |ids: Vec<DeliveryId>, max: i32| async move { queue::claim_fresh(pool, &ids, 64, lease, max).await.unwrap() };

    let a = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/a").await;
    seed_deliveries(pool, &a, 5).await;
    let took = fresh(crate::support::delivery_ids(pool, &a).await, 100).await;
    assert_eq!(took.claimed.len(), 5);
    assert!(took.took_all);
    // A first lease: attempt 1, a token past the row's initial 0 (the step is random).
    assert!(took.claimed.iter().all(|c| c.attempt == 1 && c.claim_token > 0), "leased like any claim");
    let again = fresh(crate::support::delivery_ids(pool, &a).await, 100).await;
    assert_eq!(again.claimed.len(), 0, "a row another claim holds is not claimed twice");
    assert!(again.took_all, "nothing claimable was left: they are leased");

    // At its limit of 2 (in flight across the fleet): two of five, three left due.
    let c = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/c").await;
    seed_deliveries(pool, &c, 5).await;
    let capped = fresh(crate::support::delivery_ids(pool, &c).await, 2).await;
    assert_eq!(capped.claimed.len(), 2);
    assert!(!capped.took_all, "three are still due");
    assert_eq!(
        fresh(crate::support::delivery_ids(pool, &c).await, 2).await.claimed.len(),
        0,
        "the two in flight hold the limit"
    );

    // Rate-limited to a burst of 3: three now, and the tokens are spent.
    let r = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/r").await;
    crate::support::set_endpoint(pool, &r, "rate_limit_per_sec = 0.001, rate_limit_burst = 3").await;
    seed_deliveries(pool, &r, 5).await;
    let rated = fresh(crate::support::delivery_ids(pool, &r).await, 100).await;
    assert_eq!(rated.claimed.len(), 3);
    assert!(!rated.took_all);
    assert_eq!(
        fresh(crate::support::delivery_ids(pool, &r).await, 100).await.claimed.len(),
        0,
        "the burst was paid for"
    );

    // Paused: nothing, and the rows are left for the general claim to account for.
    let p = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/p").await;
    crate::support::set_endpoint(pool, &p, "paused = true").await;
    seed_deliveries(pool, &p, 2).await;
    let paused = fresh(crate::support::delivery_ids(pool, &p).await, 100).await;
    assert_eq!(paused.claimed.len(), 0);
    assert!(!paused.took_all);

    // A delivery waiting in its line is not claimable: nothing is left behind.
    let w = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/w").await;
    seed_deliveries(pool, &w, 1).await;
    sqlx::query("UPDATE deliveries SET waiting = true WHERE endpoint_id = $1::uuid")
        .bind(&w)
        .execute(pool)
        .await
        .unwrap();
    let waiting = fresh(crate::support::delivery_ids(pool, &w).await, 100).await;
    assert_eq!(waiting.claimed.len(), 0);
    assert!(waiting.took_all);
}

/// Two replicas that both ingest and deliver (role `all`), each handing what it stores
/// to its own workers, and an endpoint limited to 4 requests in flight with a subscriber
/// taking 300 ms: the limit holds across both, and each webhook arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_in_flight_holds_across_two_replicas_that_hand_off_what_they_ingest() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::start(|_, _| Reply::Hold(Duration::from_millis(300))).await;
    app.source_none("shop").await;
    let ep = app.endpoint_for(&sink.url("/"), Some("shop")).await;
    set_limits(&app, &ep, Some(4), None).await;
    let replicas = [
        GatewayProcess::start(&app.db.url, &["--role", "all"]),
        GatewayProcess::start(&app.db.url, &["--role", "all"]),
    ];
    for r in &replicas {
        crate::support::wait_ready(r.addr).await;
    }
    let http = reqwest::Client::new();
    let mut posts = Vec::new();
    for i in 0..40 {
        let url = format!("http://{}/ingest/shop", replicas[i % 2].addr);
        let http = http.clone();
        posts.push(tokio::spawn(async move {
            // One at a time per replica would never reach the limit; 40 at once do.
            http.post(url)
                .header("content-type", "application/json")
                .header("x-delivery-id", format!("n-{i}"))
                .header("x-event-type", "order.created")
                .body("{}")
                .send()
                .await
                .map(|r| r.status().as_u16())
        }));
    }
    for p in posts {
        assert_eq!(p.await.unwrap().unwrap(), 200);
    }
    eventually(WAIT, "all delivered", || async { (count_status(&app.db.pool, "delivered").await == 40).then_some(()) })
        .await;
    eprintln!("max_in_flight 4 across two ingesting replicas: at most {} at once", sink.max_concurrent());
    assert!(sink.max_concurrent() <= 4, "{} requests at once", sink.max_concurrent());
    assert_eq!(sink.max_concurrent(), 4, "the cap was reached (the test exercised it)");
    let mut ids: Vec<String> = sink.received().iter().map(|r| r.header("webhook-id")).collect();
    ids.sort();
    ids.dedup();
    assert_eq!((sink.count(), ids.len()), (40, 40), "each webhook once");
}
