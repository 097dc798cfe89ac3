//! Ordered delivery per key: the deliveries of one key to one endpoint are attempted one
//! at a time, in ingest order, across replicas, through failures and a replica's death.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use webhook_gateway::store::events::{OwnedEvent, insert_batch_with_fanout};

use crate::support::sink::{Received, Reply, Sink};
use crate::support::{GatewayProcess, TestApp, count_status, eventually};

const WAIT: Duration = Duration::from_secs(180);

/// A `none` source keyed by `X-Delivery-Id`, ordered by `X-Key`; an endpoint for `sink`
/// subscribed with ordered delivery (`on_dead`). Returns the endpoint id.
pub(crate) async fn ordered_setup(app: &TestApp, sink: &Sink, on_dead: &str) -> String {
    app.admin_post(
        "/v1/sources",
        json!({"name": "ord", "kind": "none", "dedupe": {"header": "X-Delivery-Id"},
               "ordering_key": {"header": "X-Key"}}),
        201,
    )
    .await;
    let ep = app.admin_post("/v1/endpoints", json!({"url": sink.url("/")}), 201).await;
    let id = ep["id"].as_str().unwrap().to_owned();
    let sub = app
        .admin_post(
            "/v1/subscriptions",
            json!({"endpoint_id": id, "source": "ord", "ordered": {"on_dead": on_dead}}),
            201,
        )
        .await;
    assert_eq!(sub["ordered"]["on_dead"], on_dead);
    id
}

/// Webhook `i` of line `key` posted to the `ord` source of [`ordered_setup`] (body
/// `{"key", "i"}`), answered 200.
pub(crate) async fn ingest(app: &TestApp, key: &str, i: u32) {
    let resp = app
        .http
        .post(app.url("/ingest/ord"))
        .header("x-delivery-id", format!("{key}-{i}"))
        .header("x-key", key)
        .body(json!({"key": key, "i": i}).to_string())
        .send()
        .await
        .expect("ingest");
    assert_eq!(resp.status().as_u16(), 200);
}

fn key_and_index(r: &Received) -> (String, u32) {
    let body: Value = serde_json::from_slice(&r.body).expect("json body");
    (body["key"].as_str().expect("key").to_owned(), body["i"].as_u64().expect("i") as u32)
}

/// Workers with a short backoff (so retries come quickly), a 15 s lease, and a circuit
/// that closes again within a second. A subscriber failing a fifth of requests at random
/// fails five in a row now and then, which opens the endpoint's circuit (in one of four
/// runs of the crash test, twice: 83 s instead of 20). With the default cool-down (30 s,
/// doubling after each failed probe) the lines then stood still for 30 s or more, and
/// after two failed probes for 210 s, past the test's wait: that happened once in CI (the
/// worker's log: opened, then two probes failed). The circuit still opens and closes
/// here, and the lines must keep their order through it.
fn worker(app: &TestApp) -> GatewayProcess {
    GatewayProcess::start(
        &app.db.url,
        &[
            "--role",
            "worker",
            "--poll-interval-ms",
            "20",
            "--backoff-base-ms",
            "20",
            "--backoff-cap-secs",
            "1",
            "--max-attempts",
            "50",
            "--request-timeout-secs",
            "5",
            "--lease-secs",
            "15",
            "--circuit-cooldown-ms",
            "200",
            "--circuit-cooldown-cap-secs",
            "1",
        ],
    )
}

/// Keys and events per key of the crash test: enough for every key's line to be moved on
/// by both replicas, by retries and across the crash, small enough to stay well inside
/// [`WAIT`] on a loaded 2-core machine (20 × 100 once ran out of it while a build ran).
const KEYS: usize = 20;
const EVENTS_PER_KEY: u32 = 50;

/// Two replicas, [`KEYS`] keys × [`EVENTS_PER_KEY`] events, a subscriber that fails 20 % of requests and
/// answers after 0-40 ms at random; one replica is killed mid-run. Every key's requests
/// arrive in order: a request for event i+1 only after event i was answered 200, and
/// every event arrives. The only repeats allowed are of an event whose 200 was answered
/// but not recorded when its replica died (the crash window at-least-once documents).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_key_s_deliveries_arrive_in_order_across_replicas_failures_and_a_crash() {
    let app = TestApp::ingest_only().await;
    let seed = AtomicU64::new(0x5eed_u64 ^ u64::from(std::process::id()));
    let sink = Sink::start(move |_, _| {
        // A small xorshift: the test sink needs no crate for its coin flips.
        let mut x = seed.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        seed.store(x, Ordering::Relaxed);
        let delay = Duration::from_millis(x % 41);
        if (x >> 8).is_multiple_of(5) { Reply::Delayed(delay, 503) } else { Reply::Delayed(delay, 200) }
    })
    .await;
    ordered_setup(&app, &sink, "block").await;
    let keys: Vec<String> = (0..KEYS).map(|k| format!("k{k:02}")).collect();
    let total = (KEYS as i64) * i64::from(EVENTS_PER_KEY);
    // The replicas deliver while the events arrive: a key's new delivery joins its line
    // while the recorder moves the same line on (the race `queue::lines` is built for).
    let mut a = worker(&app);
    let _b = worker(&app);
    let app = Arc::new(app);
    let producers: Vec<_> = keys
        .iter()
        .map(|key| {
            let (app, key) = (app.clone(), key.clone());
            tokio::spawn(async move {
                for i in 0..EVENTS_PER_KEY {
                    ingest(&app, &key, i).await;
                }
            })
        })
        .collect();
    eventually(WAIT, "a third delivered", || async {
        (count_status(&app.db.pool, "delivered").await >= total / 3).then_some(())
    })
    .await;
    a.kill();
    let _c = worker(&app);
    for p in producers {
        p.await.expect("producer");
    }
    eventually(WAIT, "every event delivered", || async {
        (count_status(&app.db.pool, "delivered").await == total).then_some(())
    })
    .await;

    let received = sink.received();
    let mut upto: HashMap<String, i64> = keys.iter().map(|k| (k.clone(), -1)).collect();
    let mut repeats = 0;
    for (n, r) in received.iter().enumerate() {
        let (key, i) = key_and_index(r);
        let done = upto[&key];
        let i = i64::from(i);
        assert!(i <= done + 1, "request {n}: {key} event {i} sent before event {} was delivered", done + 1);
        if i <= done {
            repeats += 1;
            continue;
        }
        if r.replied == 200 {
            upto.insert(key, i);
        }
    }
    for (key, done) in &upto {
        assert_eq!(*done, i64::from(EVENTS_PER_KEY) - 1, "{key}: delivered up to {done}");
    }
    eprintln!(
        "ordered: {total} deliveries over {KEYS} keys in {} requests ({} repeats after the crash); 503s: {}",
        received.len(),
        repeats,
        received.iter().filter(|r| r.replied == 503).count()
    );
    assert!(repeats <= KEYS, "{repeats} repeats: more than one per key");
    assert_eq!(app.db.count("order_lines").await, 0, "every line finished: none left behind");
    let waiting: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE waiting").fetch_one(&app.db.pool).await.unwrap();
    assert_eq!(waiting, 0);
}

/// A dead delivery blocks its line (`block`): the key's later events wait until an
/// operator unblocks it, other keys go on; with `skip` the line moves past it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_delivery_blocks_or_skips_its_line_as_configured() {
    for on_dead in ["block", "skip"] {
        let app = TestApp::spawn().await;
        // Event 2 of key a is refused for good (410: dead at once).
        let sink = Sink::start(|r, _| {
            let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
            if body["key"] == "a" && body["i"] == 2 { Reply::status(410) } else { Reply::status(200) }
        })
        .await;
        ordered_setup(&app, &sink, on_dead).await;
        for i in 0..5 {
            ingest(&app, "a", i).await;
            ingest(&app, "b", i).await;
        }
        let expected_delivered = if on_dead == "block" { 2 + 5 } else { 4 + 5 };
        eventually(WAIT, "the unblocked deliveries", || async {
            (count_status(&app.db.pool, "delivered").await == expected_delivered).then_some(())
        })
        .await;
        let a_sent: Vec<u32> =
            sink.received().iter().map(key_and_index).filter(|(k, _)| k == "a").map(|(_, i)| i).collect();
        if on_dead == "skip" {
            assert_eq!(a_sent, [0, 1, 2, 3, 4], "{on_dead}");
            continue;
        }
        assert_eq!(a_sent, [0, 1, 2], "{on_dead}: the line waits behind the dead event 2");
        let dead: String = sqlx::query_scalar("SELECT id::text FROM deliveries WHERE status = 'dead'")
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
        let waiting: i64 =
            sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE waiting").fetch_one(&app.db.pool).await.unwrap();
        assert_eq!(waiting, 2, "events 3 and 4 of key a wait");
        let unblocked = app.admin_post(&format!("/v1/deliveries/{dead}/unblock"), json!({}), 200).await;
        assert_eq!(unblocked["status"], "dead");
        eventually(WAIT, "the rest of key a", || async {
            (count_status(&app.db.pool, "delivered").await == 9).then_some(())
        })
        .await;
        let a_sent: Vec<u32> =
            sink.received().iter().map(key_and_index).filter(|(k, _)| k == "a").map(|(_, i)| i).collect();
        assert_eq!(a_sent, [0, 1, 2, 3, 4]);
        let (status, _) = app.admin(reqwest::Method::POST, &format!("/v1/deliveries/{dead}/unblock"), None).await;
        assert_eq!(status, 409, "no longer blocking");
    }
}

/// Redelivering the dead delivery that blocks its line sends it first, then the rest of
/// the line, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redelivering_a_blocking_dead_delivery_sends_it_first_then_the_line() {
    let app = TestApp::spawn().await;
    let fixed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = fixed.clone();
    let sink = Sink::start(move |r, _| {
        let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        if body["i"] == 1 && !flag.load(Ordering::SeqCst) { Reply::status(422) } else { Reply::status(200) }
    })
    .await;
    ordered_setup(&app, &sink, "block").await;
    for i in 0..4 {
        ingest(&app, "a", i).await;
    }
    let dead: String = eventually(WAIT, "event 1 dead", || async {
        sqlx::query_scalar("SELECT id::text FROM deliveries WHERE status = 'dead'")
            .fetch_optional(&app.db.pool)
            .await
            .unwrap()
    })
    .await;
    fixed.store(true, Ordering::SeqCst);
    app.admin_post(&format!("/v1/deliveries/{dead}/redeliver"), json!({}), 200).await;
    eventually(WAIT, "all four delivered", || async {
        (count_status(&app.db.pool, "delivered").await == 4).then_some(())
    })
    .await;
    let sent: Vec<u32> = sink.received().iter().map(key_and_index).map(|(_, i)| i).collect();
    assert_eq!(sent, [0, 1, 1, 2, 3]);
}

/// Events of one key that reach the database in one group-commit batch keep the order
/// they arrived in, whatever order the batch inserts them in (it sorts by dedupe key).
#[tokio::test]
async fn a_batch_keeps_arrival_order_within_a_line() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::start(|_, _| Reply::status(200)).await;
    ordered_setup(&app, &sink, "skip").await;
    let source = crate::support::source_id(&app.db.pool, "ord").await;
    // Dedupe keys sort opposite to arrival: z-0 arrives first, a-3 last.
    let events: Vec<OwnedEvent> = ["z-0", "m-1", "c-2", "a-3"]
        .iter()
        .map(|dedupe| OwnedEvent {
            source_id: source,
            source_name: "ord".into(),
            indexing: webhook_gateway::search::Indexing::Content,
            dedupe_key: (*dedupe).to_owned(),
            event_type: "t".into(),
            content_type: None,
            headers: json!({}),
            payload: bytes::Bytes::from(dedupe.to_string()),
            ordering_key: Some("one".into()),
            trace: None,
            terms: None,
        })
        .collect();
    insert_batch_with_fanout(&app.db.pool, &events).await.expect("batch");
    let line: Vec<(String, bool)> = sqlx::query_as(
        "SELECT e.dedupe_key, d.waiting FROM deliveries d JOIN events e ON e.id = d.event_id ORDER BY d.line_seq",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    let expected: Vec<(String, bool)> =
        [("z-0", false), ("m-1", true), ("c-2", true), ("a-3", true)].iter().map(|(k, w)| ((*k).into(), *w)).collect();
    assert_eq!(line, expected, "line order and head");
    let head: String = sqlx::query_scalar(
        "SELECT e.dedupe_key FROM order_lines l JOIN deliveries d ON d.id = l.head_id JOIN events e ON e.id = d.event_id",
    )
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(head, "z-0");
}

/// A statement that waits for one of its lines takes its line sequence numbers only once
/// it holds every line of the statement: a batch for keys k0 and k1 that waits for k0's
/// line (held here) must not have numbered its k1 delivery before a later webhook of k1
/// that meanwhile found k1's line idle and became its head. Numbered before the wait, the
/// batch's k1 delivery sat behind that head with a lower number, and the line delivered
/// out of its own order (seen behind a pooler, whose stalls make such waits common).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_statement_that_waits_for_a_line_takes_its_place_after_the_line_s_head() {
    let app = TestApp::ingest_only().await;
    let sink = Sink::start(|_, _| Reply::status(200)).await;
    ordered_setup(&app, &sink, "skip").await;
    let source = crate::support::source_id(&app.db.pool, "ord").await;
    ingest(&app, "k0", 0).await;

    let mut holder = app.db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM order_lines WHERE ordering_key = 'k0' FOR UPDATE").execute(&mut *holder).await.unwrap();
    let event = |dedupe: &str, key: &str, i: u32| OwnedEvent {
        source_id: source,
        source_name: "ord".into(),
        indexing: webhook_gateway::search::Indexing::Content,
        dedupe_key: dedupe.to_owned(),
        event_type: "t".into(),
        content_type: None,
        headers: json!({}),
        payload: bytes::Bytes::from(json!({"key": key, "i": i}).to_string()),
        ordering_key: Some(key.to_owned()),
        terms: None,
        trace: None,
    };
    let batch = [event("k0-1", "k0", 1), event("k1-0", "k1", 0)];
    let pool = app.db.pool.clone();
    let waiting_batch = tokio::spawn(async move { insert_batch_with_fanout(&pool, &batch).await.map(|_| ()) });
    eventually(Duration::from_secs(30), "the batch waiting for k0's line", || async {
        let waits: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE 'WITH input AS%'",
        )
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
        (waits == 1).then_some(())
    })
    .await;
    // k1's line is idle: this later webhook becomes its head and is acknowledged first.
    ingest(&app, "k1", 1).await;
    holder.commit().await.unwrap();
    waiting_batch.await.unwrap().expect("the batch stored once k0's line is free");

    let line: Vec<(String, bool)> = sqlx::query_as(
        "SELECT e.dedupe_key, d.waiting FROM deliveries d JOIN events e ON e.id = d.event_id
         WHERE d.ordering_key = 'k1' ORDER BY d.line_seq",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    let expected: Vec<(String, bool)> = vec![("k1-1".into(), false), ("k1-0".into(), true)];
    assert_eq!(line, expected, "k1's line numbers its deliveries in the order they joined it");

    // Delivered in that order.
    let _worker = worker(&app);
    eventually(WAIT, "all four delivered", || async { (sink.count() >= 4).then_some(()) }).await;
    let k1: Vec<u32> =
        sink.received().iter().map(key_and_index).filter(|(key, _)| key == "k1").map(|(_, i)| i).collect();
    assert_eq!(k1, [1, 0], "k1's line delivers its head, then the batch's delivery");
}

/// Keys that come back: 12 keys, each sent in four waves with pauses long enough for its
/// line to empty between them (and, with random delays at the subscriber, sometimes not
/// quite), delivered by two replicas. Each key's deliveries arrive in ingest order across
/// the waves, and an idle line costs no row: none is left at the end, and between waves
/// the table holds at most the keys that still have deliveries.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_lines_are_removed_and_a_key_that_comes_back_keeps_its_order() {
    const KEYS: u32 = 12;
    const WAVES: u32 = 4;
    const PER_WAVE: u32 = 5;
    let app = TestApp::ingest_only().await;
    let sink = Sink::start(|_, _| Reply::Delayed(Duration::from_millis(rand::random_range(0..15)), 200)).await;
    ordered_setup(&app, &sink, "block").await;
    let _workers = [worker(&app), worker(&app)];
    let mut most_lines = 0;
    for wave in 0..WAVES {
        let mut sends = Vec::new();
        for k in 0..KEYS {
            let app = &app;
            sends.push(async move {
                for i in 0..PER_WAVE {
                    ingest(app, &format!("k{k}"), wave * PER_WAVE + i).await;
                }
            });
        }
        futures_util::future::join_all(sends).await;
        let expected = (wave + 1) * KEYS * PER_WAVE;
        eventually(WAIT, "the wave delivered", || async {
            (count_status(&app.db.pool, "delivered").await == i64::from(expected)).then_some(())
        })
        .await;
        most_lines = most_lines.max(app.db.count("order_lines").await);
        assert_eq!(app.db.count("order_lines").await, 0, "wave {wave}: every line emptied and removed");
    }
    let mut next: HashMap<String, u32> = HashMap::new();
    for r in sink.received() {
        let (key, i) = key_and_index(&r);
        let expected = next.entry(key.clone()).or_default();
        assert_eq!(i, *expected, "{key}: got {i}, expected {expected}");
        *expected += 1;
    }
    assert_eq!(next.len(), KEYS as usize);
    assert!(next.values().all(|n| *n == WAVES * PER_WAVE));
    let _ = most_lines;
}

/// The recorder names the deliveries its write made their lines' heads and hands them to
/// the dispatcher, which claims them by key (not through the general claim, planned at
/// every call); a head's retry promotes nothing and hands nothing over.
#[tokio::test]
async fn the_recorder_hands_each_line_s_next_head_to_the_claim_by_key() {
    use webhook_gateway::deliver::recorder::{self, Done, Finished, Written};
    use webhook_gateway::queue::{self, Outcome};
    use webhook_gateway::wake::Handoff;

    const LINES: i64 = 3;
    let db = crate::support::TestDb::new().await;
    let pool = &db.pool;
    let endpoint = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/").await;
    // Three deliveries per line, in line order; the first of each is its head.
    crate::support::seed_ordered_lines(pool, &endpoint, LINES).await;
    // The first of each line (`line_seq` 1 to LINES): its head.
    let first: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM deliveries WHERE line_seq <= $1 ORDER BY id")
        .bind(LINES)
        .fetch_all(pool)
        .await
        .expect("line heads");

    let heads = queue::claim(pool, 10, Duration::from_secs(60)).await.expect("claim");
    let mut claimed: Vec<_> = heads.iter().map(|c| c.id.0).collect();
    claimed.sort();
    assert_eq!(claimed, first, "only the heads are claimable");
    assert!(heads.iter().all(|c| c.ordered));

    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let written = Written {
        due: Arc::new(tokio::sync::Notify::new()),
        heads: Arc::new(Handoff::default()),
        room: Arc::new(tokio::sync::Notify::new()),
        leases: None,
    };
    let (due, handed, room) = (written.due.clone(), written.heads.clone(), written.room.clone());
    let patience = recorder::Patience::of(Duration::from_secs(60));
    let recorder =
        tokio::spawn(recorder::run(pool.clone(), rx, Default::default(), patience, written, Default::default()));
    let slots = Arc::new(tokio::sync::Semaphore::new(16));
    let done = |claim: &queue::Claimed, outcome: Outcome| {
        let mut record = crate::support::attempt_record(claim, outcome);
        if outcome == Outcome::Retry {
            record.next_attempt_at = Some(chrono::Utc::now() + chrono::Duration::seconds(600));
        }
        Done::Attempted(Finished {
            record,
            signal: webhook_gateway::circuit::Signal::Healthy,
            probe_token: None,
            span: tracing::Span::none(),
        })
    };

    // A retry of one head: its line stays where it is, and nothing is handed over.
    let retried = &heads[0];
    tx.send((done(retried, Outcome::Retry), slots.clone().acquire_owned().await.expect("slot"))).await.expect("send");
    tokio::time::timeout(WAIT, room.notified()).await.expect("the retry's write tells only of room");
    assert_eq!(handed.take(), Some(Vec::new()), "a retry promotes nothing");

    // The two other heads delivered: each of their lines' next delivery is handed over.
    for claim in &heads[1..] {
        tx.send((done(claim, Outcome::Delivered), slots.clone().acquire_owned().await.expect("slot")))
            .await
            .expect("send");
    }
    let mut got = Vec::new();
    while got.len() < 2 {
        tokio::time::timeout(WAIT, handed.arrived()).await.expect("heads handed over");
        got.extend(handed.take().expect("within the hand-off's bound"));
    }
    got.sort();
    // The lines' heads now: the retried one, and the second of each other line.
    let now_heads: Vec<(uuid::Uuid, i64)> = sqlx::query_as(
        "SELECT d.id, d.line_seq FROM order_lines l JOIN deliveries d ON d.id = l.head_id WHERE d.id <> $1 ORDER BY d.id",
    )
    .bind(retried.id)
    .fetch_all(pool)
    .await
    .expect("heads");
    assert!(now_heads.iter().all(|(_, seq)| (LINES + 1..=2 * LINES).contains(seq)), "{now_heads:?}");
    let now_heads: Vec<_> = now_heads.into_iter().map(|(id, _)| webhook_gateway::ids::DeliveryId(id)).collect();
    assert_eq!(got, now_heads, "the new heads, and only they, were handed over");
    let asked = tokio::time::timeout(Duration::ZERO, due.notified()).await;
    assert!(asked.is_err(), "the heads were named: no general claim was asked for");

    // The claim by key takes exactly them.
    let fresh = queue::claim_fresh(pool, &got, 10, Duration::from_secs(60), 8).await.expect("claim by key");
    let mut taken: Vec<_> = fresh.claimed.iter().map(|c| c.id).collect();
    taken.sort();
    assert_eq!(taken, got);
    assert!(fresh.took_all);
    drop(tx);
    recorder.await.expect("recorder");
}

/// An ordered batch recorded in the caller's transaction (the recorder's) moves its lines
/// on without a savepoint of its own (which cost two round trips of every ordered write):
/// the rows it wrote carry the caller's transaction id, where a savepoint's would carry its
/// subtransaction's. Outside a transaction the call opens one and commits it.
#[tokio::test]
async fn an_ordered_record_in_the_caller_s_transaction_takes_no_savepoint() {
    use sqlx::Connection as _;
    use webhook_gateway::queue::{self, Outcome};

    let db = crate::support::TestDb::new().await;
    let pool = &db.pool;
    let endpoint = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/").await;
    crate::support::seed_ordered_lines(pool, &endpoint, 2).await;
    let heads = queue::claim(pool, 10, Duration::from_secs(60)).await.expect("claim");
    assert_eq!(heads.len(), 2, "one head per line");
    // Lines whose head is past the first delivery of each (`line_seq` 1 and 2).
    let moved = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM order_lines l JOIN deliveries d ON d.id = l.head_id WHERE d.line_seq > 2",
        )
        .fetch_one(pool)
        .await
        .expect("lines")
    };

    let mut tx = pool.begin().await.expect("begin");
    let recorded =
        queue::record(&mut tx, &[crate::support::attempt_record(&heads[0], Outcome::Delivered)]).await.expect("record");
    assert_eq!((recorded.fresh.len(), recorded.promoted.len()), (1, 1), "{recorded:?}");
    // Rows written in a subtransaction carry its id, not the transaction's.
    let (written_by, top): (i64, i64) = sqlx::query_as(
        "SELECT xmin::text::int8, pg_current_xact_id()::text::int8 % 4294967296 FROM deliveries WHERE id = $1",
    )
    .bind(heads[0].id)
    .fetch_one(&mut *tx)
    .await
    .expect("xmin");
    assert_eq!(written_by, top, "the outcome was written by the caller's transaction, not a subtransaction");
    assert_eq!(moved().await, 0, "nothing visible before the caller commits");
    tx.commit().await.expect("commit");
    assert_eq!(moved().await, 1);

    let mut alone = sqlx::PgConnection::connect_with(&pool.connect_options()).await.expect("connect");
    let recorded = queue::record(&mut alone, &[crate::support::attempt_record(&heads[1], Outcome::Delivered)])
        .await
        .expect("record");
    assert_eq!(recorded.promoted.len(), 1);
    assert!(!alone.is_in_transaction(), "the transaction it opened is over");
    assert_eq!(moved().await, 2, "and committed");
}
