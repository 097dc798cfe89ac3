//! Behind a transaction pooler: the distribution's PgBouncer in transaction mode (which
//! hands a server connection to another client after every transaction, and is older than
//! the release that first carried prepared statements across transactions), with few
//! server connections so that every client's transactions land on each other's server
//! connections. An ingest process and worker processes, each its own pool; the pooler
//! killed and restarted under load.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;

use crate::support::pgbouncer::PgBouncer;
use crate::support::producer::{Seen, produce};
use crate::support::sink::Sink;
use crate::support::{ADMIN_TOKEN, GatewayProcess, TestDb, eventually};

/// Lines of a process log that say a statement met another client's session state.
fn session_state_errors(log: &str) -> Vec<&str> {
    log.lines().filter(|l| l.contains("prepared statement") || l.contains("portal")).collect()
}

/// Through PgBouncer in transaction mode (3 server connections shared by three gateway
/// processes): migrations by two processes at once, an ingest process and two worker
/// processes, one listening for wake-ups through a direct session URL and polling only
/// every minute (so its deliveries prove the wake-ups cross processes), one without a
/// session URL (polling, which it says once). 400 webhooks to a plain and an ordered
/// subscription, the pooler killed and restarted under load. Every webhook is stored
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
    let listening = GatewayProcess::start(
        &pooled,
        &[&pooler[..], &["--role", "worker", "--db-session-url", &db.url, "--poll-interval-ms", "60000"]].concat(),
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
    let admin = |path: &'static str, body: serde_json::Value| {
        let request = http.post(format!("{base}{path}")).bearer_auth(ADMIN_TOKEN).json(&body);
        async move {
            let answer = request.send().await.expect("admin call");
            assert_eq!(answer.status(), 201, "{path}");
            answer.json::<serde_json::Value>().await.expect("admin answer")
        }
    };
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
    let polling =
        GatewayProcess::start(&pooled, &[&pooler[..], &["--role", "worker", "--poll-interval-ms", "200"]].concat());

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

    let all: HashSet<String> =
        (0..30).map(|i| format!("wake-{i}")).chain((0..400).map(|i| format!("load-{i}"))).collect();
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.acknowledged, all, "every webhook acknowledged in the end");
        assert_eq!(seen.statuses.get(&500), None, "no 500 answer: {:?}", seen.statuses);
        assert_eq!(seen.without_retry_after, 0, "every 503 carries Retry-After: {:?}", seen.statuses);
        eprintln!("answers seen through the pooler restart: {:?}", seen.statuses);
    }
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events").fetch_one(&db.pool).await.unwrap();
    assert_eq!(events, all.len() as i64, "each webhook stored once");

    for (name, sink) in [("plain", &plain), ("ordered", &ordered)] {
        eventually(Duration::from_secs(60), &format!("every webhook delivered to the {name} endpoint"), || async {
            let ids: HashSet<String> = sink.received().iter().map(|r| r.header("webhook-id")).collect();
            (ids.len() == all.len()).then_some(())
        })
        .await;
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
