//! Behind a transaction pooler: the distribution's PgBouncer in transaction mode (which
//! hands a server connection to another client after every transaction, and is older than
//! the release that first carried prepared statements across transactions), with few
//! server connections so that every client's transactions land on each other's server
//! connections. An ingest process and worker processes, each its own pool; the pooler
//! killed and restarted under load.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;

use crate::support::pgbouncer::PgBouncer;
use crate::support::producer::{Seen, produce};
use crate::support::sink::Sink;
use crate::support::{ADMIN_TOKEN, GatewayProcess, TestDb, eventually, wait_ready};

/// Lines of a process log that say a statement met another client's session state.
fn session_state_errors(log: &str) -> Vec<&str> {
    log.lines().filter(|l| l.contains("prepared statement") || l.contains("portal")).collect()
}

/// Create something through the admin API at `base` (`path`, `body`): its answer, which
/// must be 201.
async fn create(http: &reqwest::Client, base: &str, path: &str, body: serde_json::Value) -> serde_json::Value {
    let answer =
        http.post(format!("{base}{path}")).bearer_auth(ADMIN_TOKEN).json(&body).send().await.expect("admin call");
    assert_eq!(answer.status(), 201, "{path}");
    answer.json::<serde_json::Value>().await.expect("admin answer")
}

/// Through PgBouncer in transaction mode (3 server connections shared by three gateway
/// processes): migrations by two processes at once, an ingest process and two worker
/// processes, one listening for wake-ups through a direct session URL and polling only
/// every minute (so its deliveries prove the wake-ups cross processes), one without a
/// session URL (polling, which it says once). 400 webhooks to a plain and an ordered
/// subscription, the pooler killed and restarted under load, then three over the claim's
/// inline body size (read by id by the worker that sends them). Every webhook is stored
/// once and delivered to both endpoints, no answer is a 500, every 503 carries
/// `Retry-After`, and no process ever meets another client's prepared statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fleet_behind_pgbouncer_in_transaction_mode_stores_once_and_delivers_everything() {
    let db = TestDb::empty().await;
    let mut bouncer = PgBouncer::start(&db.url, 3);
    let pooled = bouncer.url(&db.name(), &db.url);
    let pooler = ["--db-pooler", "transaction"];

    // Two processes start at once on the unmigrated database: both migrate through the
    // pooler, one waits for the other.
    let ingest = GatewayProcess::start(&pooled, &[&pooler[..], &["--role", "ingest"]].concat());
    // Leases of 20 s instead of 60: a claim that commits just as the pooler is killed below
    // is not seen by its worker, and its deliveries come back when the lease runs out (as
    // designed, `lost_claims`); an ordered line waits for its head meanwhile. With the
    // default 60 s that return raced the 60 s this test waits for the ordered endpoint
    // (it lost once, in a clean-clone run under the whole suite's load).
    let short_leases = ["--lease-secs", "20", "--request-timeout-secs", "10"];
    let listening = GatewayProcess::start(
        &pooled,
        &[
            &pooler[..],
            &short_leases[..],
            &["--role", "worker", "--db-session-url", &db.url, "--poll-interval-ms", "60000"],
        ]
        .concat(),
    );
    let base = format!("http://{}", ingest.addr);
    let http = reqwest::Client::new();
    for gw in [&ingest, &listening] {
        let url = format!("http://{}/readyz", gw.addr);
        eventually(Duration::from_secs(30), "both processes ready behind the pooler", || async {
            let ready = http.get(&url).send().await.ok()?;
            (ready.status() == 200).then_some(())
        })
        .await;
    }

    let plain = Sink::ok().await;
    let ordered = Sink::ok().await;
    let admin = |path: &'static str, body: serde_json::Value| create(&http, &base, path, body);
    admin(
        "/v1/sources",
        json!({"name": "shop", "kind": "none", "dedupe": {"header": "X-Delivery-Id"},
               "event_type": {"header": "X-Event-Type"}, "ordering_key": {"json_pointer": "/customer"}}),
    )
    .await;
    for (sink, ordered_on) in [(&plain, serde_json::Value::Null), (&ordered, json!({"on_dead": "block"}))] {
        let endpoint = admin("/v1/endpoints", json!({"url": sink.url("/hook")})).await;
        admin("/v1/subscriptions", json!({"endpoint_id": endpoint["id"], "source": "shop", "ordered": ordered_on}))
            .await;
    }

    // Wake-ups cross processes: the listening worker polls once a minute, yet delivers at once.
    let seen = Arc::new(Mutex::new(Seen::default()));
    let first: Vec<String> = (0..30).map(|i| format!("wake-{i}")).collect();
    produce(base.clone(), "shop", first, 4, seen.clone()).await;
    eventually(Duration::from_secs(20), "deliveries woken by NOTIFY through the pooler, LISTEN direct", || async {
        (plain.count() >= 30 && ordered.count() >= 30).then_some(())
    })
    .await;

    // A second worker without a session URL: it polls, and says so once.
    let polling = GatewayProcess::start(
        &pooled,
        &[&pooler[..], &short_leases[..], &["--role", "worker", "--poll-interval-ms", "200"]].concat(),
    );
    // Up before the pooler is restarted below: a start-up that meets the restart exits (the
    // supervisor's to restart), which is not what this test is about.
    wait_ready(polling.addr).await;

    // Load, and the pooler killed and restarted in the middle of it.
    let ids: Vec<String> = (0..400).map(|i| format!("load-{i}")).collect();
    let load = tokio::spawn(produce(base.clone(), "shop", ids, 8, seen.clone()));
    eventually(Duration::from_secs(60), "a third of the load acknowledged", || async {
        (seen.lock().unwrap().acknowledged.len() >= 30 + 130).then_some(())
    })
    .await;
    let restart = tokio::task::spawn_blocking(move || {
        bouncer.restart();
        bouncer
    });
    let bouncer = restart.await.expect("restart");
    load.await.expect("load");

    // Bodies over the claim's inline size: each worker reads them by id in a transaction
    // of their own, after reserving room (`deliver::bodies`), through the pooler too.
    let large: HashMap<String, String> = (0..3)
        .map(|i| {
            let id = format!("large-{i}");
            let body = json!({"order": id, "customer": "c1", "pad": "x".repeat(100_000 + i)}).to_string();
            (id, body)
        })
        .collect();
    for (id, body) in &large {
        eventually(Duration::from_secs(30), "a large webhook acknowledged through the pooler", || async {
            let answer = http
                .post(format!("{base}/ingest/shop"))
                .header("x-delivery-id", id)
                .header("x-event-type", "order.created")
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await
                .ok()?;
            answer.status().is_success().then_some(())
        })
        .await;
    }

    let produced: HashSet<String> =
        (0..30).map(|i| format!("wake-{i}")).chain((0..400).map(|i| format!("load-{i}"))).collect();
    let all: HashSet<String> = produced.iter().cloned().chain(large.keys().cloned()).collect();
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.acknowledged, produced, "every webhook acknowledged in the end");
        assert_eq!(seen.statuses.get(&500), None, "no 500 answer: {:?}", seen.statuses);
        assert_eq!(seen.without_retry_after, 0, "every 503 carries Retry-After: {:?}", seen.statuses);
        eprintln!("answers seen through the pooler restart: {:?}", seen.statuses);
    }
    assert_eq!(db.count("events").await, all.len() as i64, "each webhook stored once");

    for (name, sink) in [("plain", &plain), ("ordered", &ordered)] {
        eventually(Duration::from_secs(60), &format!("every webhook delivered to the {name} endpoint"), || async {
            let ids: HashSet<String> = sink.received().iter().map(|r| r.header("webhook-id")).collect();
            (ids.len() == all.len()).then_some(())
        })
        .await;
    }
    // The large bodies arrived whole at both endpoints.
    for sink in [&plain, &ordered] {
        for received in sink.received() {
            let order = serde_json::from_slice::<serde_json::Value>(&received.body).expect("JSON body")["order"]
                .as_str()
                .map(str::to_owned)
                .unwrap_or_default();
            if let Some(sent) = large.get(&order) {
                assert_eq!(received.body, sent.as_bytes(), "{order} arrived byte for byte");
            }
        }
    }
    // The ordered endpoint got each customer's webhooks in their line's order.
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    let seqs: HashMap<String, (String, i64)> = sqlx::query_as::<_, (String, String, i64)>(
        "SELECT 'msg_' || replace(d.id::text, '-', ''), d.ordering_key, d.line_seq
         FROM deliveries d WHERE d.ordering_key IS NOT NULL",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, key, seq)| (id, (key, seq)))
    .collect();
    let mut first_arrivals = HashSet::new();
    for received in ordered.received() {
        let delivery = received.header("idempotency-key");
        if !first_arrivals.insert(delivery.clone()) {
            continue; // a repeat after an unconfirmed record: at least once
        }
        let (key, seq) = seqs.get(&delivery).cloned().expect("an ordered delivery");
        let previous = last_seq.insert(key.clone(), seq).unwrap_or(i64::MIN);
        assert!(seq > previous, "customer {key}: delivery {seq} arrived after {previous}");
    }

    let mut processes = [ingest, listening, polling];
    for process in &mut processes {
        assert!(process.terminate(), "clean exit");
    }
    let logs: Vec<String> = processes.iter().map(|p| std::fs::read_to_string(&p.log).unwrap_or_default()).collect();
    for log in &logs {
        assert!(session_state_errors(log).is_empty(), "a statement met session state: {:?}", session_state_errors(log));
    }
    assert!(
        logs[2].contains("no LISTEN for wake-ups") && !logs[1].contains("no LISTEN for wake-ups"),
        "the worker without a session URL says it polls; the one with it does not"
    );
    drop(bouncer);
}

/// The admin surface behind PgBouncer in transaction mode, on two server connections:
/// scoped tokens (created, used, revoked), the audit log, a search by content (whose
/// transaction sets its own plan settings), an operational event published in the
/// transaction that pauses an endpoint, trying a filter and a transformation on a stored
/// event, and the console signed in with a scoped token. Nothing answers 500, and no
/// statement meets another client's session state.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_admin_surface_works_behind_pgbouncer_in_transaction_mode() {
    let db = TestDb::empty().await;
    let bouncer = PgBouncer::start(&db.url, 2);
    let pooled = bouncer.url(&db.name(), &db.url);
    let mut gateway = GatewayProcess::start(&pooled, &["--db-pooler", "transaction"]);
    let base = format!("http://{}", gateway.addr);
    let http = reqwest::Client::new();
    eventually(Duration::from_secs(30), "ready behind the pooler", || async {
        (http.get(format!("{base}/readyz")).send().await.ok()?.status() == 200).then_some(())
    })
    .await;
    let call = |method: reqwest::Method, path: String, token: &str, body: Option<serde_json::Value>| {
        let mut request = http.request(method, format!("{base}{path}")).bearer_auth(token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        async move {
            let answer = request.send().await.expect("call");
            let status = answer.status().as_u16();
            (status, answer.json::<serde_json::Value>().await.unwrap_or(serde_json::Value::Null))
        }
    };
    let post =
        |path: &str, token: &str, body: serde_json::Value| call(reqwest::Method::POST, path.into(), token, Some(body));
    let get = |path: String, token: &str| call(reqwest::Method::GET, path, token, None);

    let sink = Sink::ok().await;
    let (status, _) = post(
        "/v1/sources",
        ADMIN_TOKEN,
        json!({"name": "shop", "kind": "none", "dedupe": {"header": "X-Delivery-Id"}, "event_type": {"header": "X-Event-Type"}}),
    )
    .await;
    assert_eq!(status, 201);
    let (_, endpoint) = post("/v1/endpoints", ADMIN_TOKEN, json!({"url": sink.url("/hook")})).await;
    let endpoint_id = endpoint["id"].as_str().unwrap().to_owned();
    post("/v1/subscriptions", ADMIN_TOKEN, json!({"endpoint_id": endpoint_id, "source": "shop"})).await;
    let (status, on_call) = post("/v1/tokens", ADMIN_TOKEN, json!({"name": "on-call", "scope": "operate"})).await;
    assert_eq!(status, 201);
    let on_call = on_call["token"].as_str().unwrap().to_owned();
    let (_, dashboard) =
        post("/v1/tokens", ADMIN_TOKEN, json!({"name": "dashboard", "scope": "read", "payloads": false})).await;
    let dashboard = dashboard["token"].as_str().unwrap().to_owned();

    for i in 0..20 {
        let answer = http
            .post(format!("{base}/ingest/shop"))
            .header("x-delivery-id", format!("d-{i}"))
            .header("x-event-type", "order.paid")
            .json(&json!({"order": i, "customer": format!("c{}", i % 3)}))
            .send()
            .await
            .expect("ingest");
        assert_eq!(answer.status(), 200);
    }
    eventually(Duration::from_secs(30), "delivered", || async { (sink.count() >= 20).then_some(()) }).await;

    // A search by content: its transaction sets its own plan, and no setting leaks.
    let (status, found) = get("/v1/events?payload=order=7".into(), ADMIN_TOKEN).await;
    assert_eq!((status, found["data"].as_array().map(Vec::len)), (200, Some(1)), "{found}");
    let (status, found) = get("/v1/events?dedupe_key=d-3".into(), &dashboard).await;
    assert_eq!((status, found["data"].as_array().map(Vec::len)), (200, Some(1)), "{found}");
    assert_eq!(get("/v1/events?payload=order=7".into(), &dashboard).await.0, 403, "no payloads for it");
    let event_id = found["data"][0]["id"].as_str().unwrap().to_owned();

    // An operator pauses and resumes (each publishes an operational event in its own
    // transaction), tries a filter and a transformation; then loses its token.
    for action in ["pause", "resume"] {
        let (status, body) = post(&format!("/v1/endpoints/{endpoint_id}/{action}"), &on_call, json!({})).await;
        assert_eq!(status, 200, "{action}: {body}");
    }
    let (status, tried) =
        post("/v1/filters/test", &on_call, json!({"filter": "$.payload.order == 3", "event_id": event_id})).await;
    assert_eq!((status, tried["matches"].as_bool()), (200, Some(true)), "{tried}");
    let script = "function handler(w) { return {n: w.payload.order}; }";
    let (status, tried) =
        post("/v1/transforms/test", &on_call, json!({"transform": script, "event_id": event_id})).await;
    assert_eq!((status, &tried["body"]), (200, &json!({"n": 3})), "{tried}");
    let (status, _) = call(reqwest::Method::DELETE, "/v1/tokens/on-call".into(), ADMIN_TOKEN, None).await;
    assert_eq!(status, 200);
    assert_eq!(get("/v1/endpoints".into(), &on_call).await.0, 401, "revoked at once");

    let (_, own) = get("/v1/events?source=_gateway".into(), ADMIN_TOKEN).await;
    let types: Vec<&str> = own["data"].as_array().unwrap().iter().filter_map(|e| e["event_type"].as_str()).collect();
    assert!(types.contains(&"endpoint.paused") && types.contains(&"endpoint.resumed"), "{types:?}");
    let (status, audit) = get("/v1/audit?actor=on-call".into(), ADMIN_TOKEN).await;
    let actions: Vec<&str> = audit["data"].as_array().unwrap().iter().filter_map(|e| e["action"].as_str()).collect();
    assert_eq!(status, 200);
    assert_eq!(actions, ["POST /v1/endpoints/{id}/resume", "POST /v1/endpoints/{id}/pause"], "newest first");

    // The console, signed in with the read token, through the same pooler.
    let browser = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let signed_in = browser.post(format!("{base}/console/login")).form(&[("token", dashboard.as_str())]).send().await;
    let cookie =
        signed_in.expect("sign in").headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_owned();
    let page = browser.get(format!("{base}/console/events/{event_id}")).header("cookie", cookie).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("payload-withheld"));

    assert!(gateway.terminate(), "clean exit");
    let log = std::fs::read_to_string(&gateway.log).unwrap_or_default();
    assert!(session_state_errors(&log).is_empty(), "a statement met session state: {:?}", session_state_errors(&log));
    assert!(!log.contains("Status code: 500"), "no 500 answer");
    drop(bouncer);
}

/// The claim by key (ingest's hand-off, `queue::claim_fresh`) and the recorder's
/// transaction set their planner settings in their `BEGIN` (`db::Planning::Cached`), and
/// the claim by key runs two statements in one transaction. Through PgBouncer in
/// transaction mode with one server connection, two pools interleave them: every
/// delivery is claimed once, and every outcome is recorded once, by key, with
/// nothing meeting another client's statement or settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_claim_by_key_and_the_recorder_work_through_pgbouncer_in_transaction_mode() {
    use webhook_gateway::db::{DbConfig, Planning, Pooler};
    use webhook_gateway::queue::{self, Outcome};
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db.url, 1);
    let pooled = bouncer.url(&db.name(), &db.url);
    let endpoint = crate::support::insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    crate::support::seed_deliveries(&db.pool, &endpoint, 60).await;
    let ids = Arc::new(crate::support::delivery_ids(&db.pool, &endpoint).await);
    let mut tasks = Vec::new();
    for n in 0..2usize {
        let config = DbConfig {
            url: pooled.clone(),
            pool_size: 3,
            pooler: Pooler::Transaction,
            session_url: None,
            start_wait: std::time::Duration::ZERO,
        };
        let pool = webhook_gateway::db::open(&config).await.unwrap();
        let ids = ids.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            // Both pools are handed every chunk (as two replicas could be, by a race).
            for chunk in ids.chunks(6).skip(n).chain(ids.chunks(6).take(n)) {
                let claim = queue::claim_fresh(&pool, chunk, 6, Duration::from_secs(60), 1000).await.unwrap();
                if claim.claimed.is_empty() {
                    continue;
                }
                let batch: Vec<_> =
                    claim.claimed.iter().map(|c| crate::support::attempt_record(c, Outcome::Delivered)).collect();
                let mut tx = pool.begin_planned(Planning::Cached).await.unwrap();
                let recorded = queue::record(&mut tx, &batch).await.unwrap();
                tx.commit().await.unwrap();
                assert_eq!(recorded.fresh.len(), batch.len(), "each outcome written once");
                mine.extend(claim.claimed.into_iter().map(|c| c.id));
            }
            mine
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let total = all.len();
    all.sort();
    all.dedup();
    assert_eq!((total, all.len()), (60, 60), "every delivery claimed once");
    let delivered: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE status = 'delivered' AND attempt_count = 1")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(delivered, 60);
    assert_eq!(db.count("attempts").await, 60);
}

/// Ingest's pre-leased hand-off behind PgBouncer in transaction mode (four server
/// connections), in one gateway process that ingests and delivers (role `all`): eight
/// producers at once (`LARGEST_LEASED_BATCH`), so that group commit writes batches whose
/// statement leases their deliveries (`wg_lease_room_v6`, run inside the pooled `BEGIN
/// ... COMMIT`), beside lone webhooks leased by theirs. The subscribers hold each first
/// request for eight seconds; deliveries of batches of two or more, leased by their
/// batch's own transaction, are watched for while the webhooks arrive (up to three rounds
/// of 240, until some are seen). Every webhook is stored once and delivered to both
/// endpoints, nothing answers
/// 500, and no statement meets another client's session state. Control: with no batch
/// leasing (`LARGEST_LEASED_BATCH` 1), no batch's delivery is found leased by its statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_leased_by_their_own_statement_work_behind_pgbouncer_in_transaction_mode() {
    let db = TestDb::empty().await;
    let bouncer = PgBouncer::start(&db.url, 4);
    let pooled = bouncer.url(&db.name(), &db.url);
    let gateway = GatewayProcess::start(&pooled, &["--db-pooler", "transaction"]);
    let base = format!("http://{}", gateway.addr);
    let http = reqwest::Client::new();
    eventually(Duration::from_secs(30), "the gateway ready behind the pooler", || async {
        let ready = http.get(format!("{base}/readyz")).send().await.ok()?;
        (ready.status() == 200).then_some(())
    })
    .await;
    let held = || {
        Sink::start(|_, n| {
            if n == 0 {
                crate::support::sink::Reply::Hold(Duration::from_secs(8))
            } else {
                crate::support::sink::Reply::status(200)
            }
        })
    };
    let sinks = [held().await, held().await];
    let admin = |path: &'static str, body: serde_json::Value| create(&http, &base, path, body);
    admin(
        "/v1/sources",
        json!({"name": "shop", "kind": "none", "dedupe": {"header": "X-Delivery-Id"},
               "event_type": {"header": "X-Event-Type"}}),
    )
    .await;
    for sink in &sinks {
        let endpoint = admin("/v1/endpoints", json!({"url": sink.url("/hook")})).await;
        admin("/v1/subscriptions", json!({"endpoint_id": endpoint["id"], "source": "shop"})).await;
    }

    let seen = Arc::new(Mutex::new(Seen::default()));
    // Deliveries inserted by a batch's statement (their row version is the batch's
    // transaction's) and leased: watched while the webhooks arrive, since a delivery sent
    // and recorded since is a new row version.
    const BATCH_LEASED: &str = "WITH batches AS (SELECT xmin::text AS tx FROM events WHERE dedupe_key LIKE 'pooled-%'
                          GROUP BY 1 HAVING count(*) >= 2)
         SELECT count(*) FROM deliveries d JOIN events e ON e.id = d.event_id
         WHERE e.xmin::text IN (SELECT tx FROM batches)
           AND d.xmin::text = e.xmin::text AND d.leased_until IS NOT NULL";
    const BATCHES: &str = "SELECT count(*) FROM (SELECT xmin::text FROM events WHERE dedupe_key LIKE 'pooled-%'
                           GROUP BY xmin::text HAVING count(*) >= 2) b";
    // Whether group commit makes batches depends on how the commits overlap: on a loaded
    // machine a round once made none that leased (a clean-clone run: 0 found). So up to
    // three rounds of 240 webhooks, until a batch's statement is seen leasing.
    let mut ids: Vec<String> = Vec::new();
    let mut batch_leased = 0;
    for round in 0..3 {
        let round_ids: Vec<String> = (0..240).map(|i| format!("pooled-{round}-{i}")).collect();
        ids.extend(round_ids.iter().cloned());
        let watching = Arc::new(AtomicBool::new(true));
        let watcher = {
            let (pool, watching) = (db.pool.clone(), watching.clone());
            tokio::spawn(async move {
                let mut most = 0i64;
                while watching.load(Ordering::Relaxed) {
                    if let Ok(n) = sqlx::query_scalar::<_, i64>(BATCH_LEASED).fetch_one(&pool).await {
                        most = most.max(n);
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                most
            })
        };
        // At most LARGEST_LEASED_BATCH (8) producers at once, so no batch is too large to
        // lease however slowly the machine runs (batches of 9 or more are stored plainly).
        let producers = webhook_gateway::deliver::prelease::LARGEST_LEASED_BATCH;
        produce(base.clone(), "shop", round_ids, producers, seen.clone()).await;
        watching.store(false, Ordering::Relaxed);
        let at_the_end: i64 = sqlx::query_scalar(BATCH_LEASED).fetch_one(&db.pool).await.expect("count");
        batch_leased = watcher.await.expect("the watcher").max(at_the_end);
        let batches: i64 = sqlx::query_scalar(BATCHES).fetch_one(&db.pool).await.expect("count");
        eprintln!(
            "round {round}: {batches} batches of two or more so far; deliveries leased by their batch's own statement \
             behind the pooler: at most {batch_leased} at once, {at_the_end} at the end"
        );
        if batch_leased > 0 {
            break;
        }
    }
    assert!(batch_leased > 0, "batches' deliveries leased by their own statement through the pooler");

    let produced: HashSet<String> = ids.into_iter().collect();
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.acknowledged, produced, "every webhook acknowledged");
        assert_eq!(seen.statuses.get(&500), None, "no 500 answer: {:?}", seen.statuses);
    }
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE dedupe_key LIKE 'pooled-%'")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(stored, produced.len() as i64, "each webhook stored once");
    for sink in &sinks {
        eventually(Duration::from_secs(60), "every webhook delivered to each endpoint", || async {
            let ids: HashSet<String> = sink.received().iter().map(|r| r.header("webhook-id")).collect();
            (ids.len() == produced.len()).then_some(())
        })
        .await;
    }
    let mut gateway = gateway;
    assert!(gateway.terminate(), "clean exit");
    let log = std::fs::read_to_string(&gateway.log).unwrap_or_default();
    assert!(session_state_errors(&log).is_empty(), "a statement met session state: {:?}", session_state_errors(&log));
    drop(bouncer);
}

/// Behind the pooler the largest statements keep their plans in functions
/// (`db::kept_plans`): a gateway creates one function a statement at start-up, a second
/// one starting on the same schema finds them and creates none (they are named by their
/// content), and webhooks are stored, their outcomes written and their lines moved on
/// through those functions (`pg_stat_user_functions` counts the calls), each webhook
/// stored once and delivered in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_largest_statements_keep_their_plans_in_functions_behind_pgbouncer() {
    let db = TestDb::empty().await;
    sqlx::query(&format!("ALTER DATABASE \"{}\" SET track_functions = 'pl'", db.name()))
        .execute(&db.pool)
        .await
        .expect("count function calls");
    let bouncer = PgBouncer::start(&db.url, 3);
    let pooled = bouncer.url(&db.name(), &db.url);
    let first = GatewayProcess::start(&pooled, &["--db-pooler", "transaction"]);
    wait_ready(first.addr).await;
    let kept = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_proc WHERE proname LIKE 'wg\\_plan\\_%'")
            .fetch_one(&db.pool)
            .await
            .expect("count functions")
    };
    let functions = kept().await;
    assert_eq!(functions, 12, "one function for each kept statement");
    let second = GatewayProcess::start(&pooled, &["--db-pooler", "transaction", "--role", "worker"]);
    wait_ready(second.addr).await;
    assert_eq!(kept().await, functions, "the second process found them all");
    let log = std::fs::read_to_string(&second.log).unwrap_or_default();
    assert!(log.contains("wrapped=12") && log.contains("created=0"), "{log}");

    let sink = Sink::ok().await;
    let base = format!("http://{}", first.addr);
    let http = reqwest::Client::new();
    create(
        &http,
        &base,
        "/v1/sources",
        json!({"name": "shop", "kind": "none", "dedupe": {"header": "X-Delivery-Id"},
               "event_type": {"header": "X-Event-Type"}, "ordering_key": {"header": "X-Event-Type"}}),
    )
    .await;
    let endpoint = create(&http, &base, "/v1/endpoints", json!({"url": sink.url("/hook")})).await;
    create(
        &http,
        &base,
        "/v1/subscriptions",
        json!({"endpoint_id": endpoint["id"], "source": "shop", "ordered": {"on_dead": "block"}}),
    )
    .await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let ids: Vec<String> = (0..60).map(|i| format!("kept-{i:02}")).collect();
    produce(base.clone(), "shop", ids.clone(), 1, seen.clone()).await;
    assert_eq!(seen.lock().unwrap().acknowledged.len(), ids.len(), "every webhook acknowledged");
    eventually(Duration::from_secs(60), "every webhook delivered", || async {
        (sink.received().len() >= ids.len()).then_some(())
    })
    .await;
    let order = |r: &crate::support::sink::Received| {
        let body: serde_json::Value = serde_json::from_slice(&r.body).expect("a JSON body");
        body["order"].as_str().expect("the order's id").to_owned()
    };
    let mut once: Vec<String> = sink.received().iter().map(order).collect();
    once.dedup();
    // One producer task posts the ids from the last: that is the line's order.
    let posted: Vec<String> = ids.iter().rev().cloned().collect();
    assert_eq!(once, posted, "each once, in order (one line: one event type)");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE dedupe_key LIKE 'kept-%'")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(stored, ids.len() as i64, "each webhook stored once");

    // Each webhook's statement and each outcome write went through a function; the
    // server processes report their counts when they go idle.
    eventually(Duration::from_secs(30), "the functions' calls counted", || async {
        let calls: Option<i64> = sqlx::query_scalar(
            "SELECT sum(calls)::int8 FROM pg_stat_user_functions WHERE funcname LIKE 'wg\\_plan\\_%'",
        )
        .fetch_one(&db.pool)
        .await
        .expect("calls");
        (calls.unwrap_or(0) >= 2 * ids.len() as i64).then_some(())
    })
    .await;

    // The functions dropped under the running processes: the statement that meets one
    // missing fails once, and the processes go on with the statements as they are.
    sqlx::raw_sql(
        "DO $$ DECLARE f regprocedure; BEGIN
             FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname LIKE 'wg\\_plan\\_%' LOOP
                 EXECUTE 'DROP FUNCTION ' || f;
             END LOOP;
         END $$",
    )
    .execute(&db.pool)
    .await
    .expect("drop the functions");
    assert_eq!(kept().await, 0);
    let more: Vec<String> = (0..5).map(|i| format!("after-{i}")).collect();
    let after = Arc::new(Mutex::new(Seen::default()));
    produce(base.clone(), "shop", more.clone(), 1, after.clone()).await;
    {
        // The webhook that met the missing function is answered 503, retried: nothing was stored.
        let after = after.lock().unwrap();
        assert_eq!(after.statuses.get(&500), None, "no 500 answer: {:?}", after.statuses);
        assert_eq!(after.without_retry_after, 0, "every 503 carries Retry-After: {:?}", after.statuses);
    }
    eventually(Duration::from_secs(60), "the later webhooks delivered", || async {
        let received: HashSet<String> = sink.received().iter().map(order).collect();
        more.iter().all(|id| received.contains(id)).then_some(())
    })
    .await;
    let log = std::fs::read_to_string(&first.log).unwrap_or_default();
    assert!(log.contains("function is gone"), "the ingest process met a missing function and said so");

    for gateway in [first, second] {
        let mut gateway = gateway;
        assert!(gateway.terminate(), "clean exit");
        let log = std::fs::read_to_string(&gateway.log).unwrap_or_default();
        assert!(
            session_state_errors(&log).is_empty(),
            "a statement met session state: {:?}",
            session_state_errors(&log)
        );
    }
    drop(bouncer);
}

/// Two ways to put a pooler in front wrongly, each refused at start (`serve` and
/// `migrate`) with what to change, before anything is written: PgBouncer in transaction
/// mode without `--db-pooler transaction` (it refuses the startup `options` the direct
/// mode sends), and PgBouncer in statement mode, which allows no transaction (before, the
/// second failed at the migrations with PgBouncer's words alone). The database stays
/// unmigrated; the control, the same database through a transaction-mode PgBouncer with
/// the flag, migrates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooler_put_in_front_wrongly_is_refused_at_start_with_what_to_change() {
    let db = TestDb::empty().await;
    let transaction = PgBouncer::start(&db.url, 2);
    let statement = PgBouncer::start_in_mode(&db.url, 2, &[], "statement");
    let (via_transaction, via_statement) = (transaction.url(&db.name(), &db.url), statement.url(&db.name(), &db.url));
    let serve = ["serve", "--listen", "127.0.0.1:0", "--admin-token", ADMIN_TOKEN, "--database-url"];

    for command in [&serve[..], &["migrate", "--database-url"][..]] {
        let (code, stderr) = crate::support::run_to_exit(&[command, &[via_transaction.as_str()]].concat()).await;
        assert_eq!(code, Some(1), "{command:?} without --db-pooler behind PgBouncer: {stderr}");
        assert!(stderr.contains("set --db-pooler transaction"), "{command:?}: {stderr}");

        let flagged = [command, &[via_statement.as_str(), "--db-pooler", "transaction"]].concat();
        let (code, stderr) = crate::support::run_to_exit(&flagged).await;
        assert_eq!(code, Some(1), "{command:?} behind PgBouncer in statement mode: {stderr}");
        assert!(stderr.contains("statement pooling mode"), "{command:?}: {stderr}");
        assert!(stderr.contains("pool_mode = transaction"), "{command:?}: what to change: {stderr}");
    }
    let tables: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE tablename = '_sqlx_migrations'")
        .fetch_one(&db.pool)
        .await
        .expect("tables");
    assert_eq!(tables, 0, "nothing was migrated by a refused start");

    let (code, stderr) =
        crate::support::run_to_exit(&["migrate", "--database-url", &via_transaction, "--db-pooler", "transaction"])
            .await;
    assert_eq!(code, Some(0), "the control: migrate through a transaction-mode pooler with the flag: {stderr}");
}

/// A worker whose `LISTEN` session cannot be had at start (its direct session URL down,
/// as a database out of connections is) polls meanwhile, tries again, and once it listens
/// is woken by the ingest process's notifications: its deliveries come at once though it
/// polls once a minute. Before, one failure at start left it polling for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_whose_listen_session_fails_at_start_listens_once_it_can() {
    use crate::support::proxy::{Proxy, server_addr};
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(&db.url, 3);
    let pooled = bouncer.url(&db.name(), &db.url);
    let session = Proxy::start(server_addr(&db.url)).await;
    session.down().await;
    let ingest = GatewayProcess::start(&pooled, &["--db-pooler", "transaction", "--role", "ingest"]);
    let worker = GatewayProcess::start(
        &pooled,
        &[
            "--db-pooler",
            "transaction",
            "--role",
            "worker",
            "--db-session-url",
            &session.url_for(&db.url),
            "--poll-interval-ms",
            "60000",
        ],
    );
    wait_ready(ingest.addr).await;
    wait_ready(worker.addr).await;
    let base = format!("http://{}", ingest.addr);
    let sink = Sink::ok().await;
    crate::support::shop_to_sink(&base, &sink).await;
    eventually(Duration::from_secs(20), "the worker says it cannot LISTEN", || async {
        std::fs::read_to_string(&worker.log).ok()?.contains("cannot LISTEN for wake-ups").then_some(())
    })
    .await;
    session.up().await;
    eventually(Duration::from_secs(20), "the worker listens again", || async {
        std::fs::read_to_string(&worker.log).ok()?.contains("listening for wake-ups again").then_some(())
    })
    .await;
    for n in 0..5 {
        let (status, answer) = crate::support::post_to_shop(&base, &format!("woken-{n}"), &json!({"order": n})).await;
        assert_eq!(status, 200, "{answer}");
    }
    // Within a poll's minute only if a notification woke the worker.
    eventually(Duration::from_secs(20), "deliveries woken by NOTIFY", || async { (sink.count() >= 5).then_some(()) })
        .await;
}
