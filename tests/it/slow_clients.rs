//! Clients that are slow on purpose (or just slow): half-sent headers, trickled bodies,
//! too many connections. They are cut off in bounded time while good webhooks keep
//! flowing, and they cannot hold the shutdown hostage.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use webhook_gateway::app::Settings;
use webhook_gateway::server::HttpLimits;

use crate::support::{GatewayProcess, TestApp, TestDb, eventually, test_settings};

const WAIT: Duration = Duration::from_secs(60);

async fn app_with(limits: HttpLimits) -> TestApp {
    let settings = Settings { http: limits, role: webhook_gateway::role::Role::Ingest, ..test_settings() };
    TestApp::spawn_with(TestDb::new().await, settings, 16).await
}

/// A connection that sent half a request header and then nothing.
async fn stalled(addr: std::net::SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(b"POST /ingest/shop HTTP/1.1\r\nHost: gateway\r\nX-Delivery-Id: stal").await.expect("write");
    stream
}

/// A connection that sent full headers announcing 200 bytes, then trickles the body a
/// byte every 300 ms (in its own task) until the server closes it.
async fn trickler(addr: std::net::SocketAddr, n: usize) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /ingest/shop HTTP/1.1\r\nHost: gateway\r\nX-Delivery-Id: trickle-{n}\r\nContent-Type: application/json\r\n\
         Content-Length: 200\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    stream
}

/// Read until the server closes (or `within` passes); returns what was read, and whether
/// it closed.
async fn read_until_closed(stream: &mut TcpStream, within: Duration, trickle: bool) -> (String, bool) {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while Instant::now() < deadline {
        if trickle {
            // One more byte of body; a write error means the server is gone.
            if stream.write_all(b" ").await.is_err() {
                return (String::from_utf8_lossy(&got).into_owned(), true);
            }
        }
        match tokio::time::timeout(Duration::from_millis(300), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&got).into_owned(), true),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
    }
    (String::from_utf8_lossy(&got).into_owned(), false)
}

/// 100 half-sent headers and 20 trickled bodies: every one is cut off (the tricklers
/// with a 408 and its reason), nothing of theirs is stored, and 20 good webhooks sent
/// meanwhile are all answered 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stalled_headers_and_trickled_bodies_are_cut_off_while_good_webhooks_flow() {
    let limits = HttpLimits {
        header_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(3),
        ..HttpLimits::default()
    };
    let app = app_with(limits).await;
    app.source_none("shop").await;
    let mut slow = Vec::new();
    for _ in 0..100 {
        slow.push(tokio::spawn({
            let addr = app.addr;
            async move {
                let mut s = stalled(addr).await;
                read_until_closed(&mut s, WAIT, false).await
            }
        }));
    }
    let mut trickling = Vec::new();
    for n in 0..20 {
        trickling.push(tokio::spawn({
            let addr = app.addr;
            async move {
                let mut s = trickler(addr, n).await;
                read_until_closed(&mut s, WAIT, true).await
            }
        }));
    }
    for i in 0..20 {
        let (status, body) = app.ingest("shop", &format!("good-{i}"), "t", "{}").await;
        assert_eq!(status, 200, "{body}");
    }
    for task in slow {
        let (got, closed) = task.await.expect("join");
        assert!(closed, "a stalled header was never cut off");
        assert!(!got.contains("200 OK"), "{got}");
    }
    for task in trickling {
        let (got, closed) = task.await.expect("join");
        assert!(closed, "a trickled body was never cut off");
        assert!(got.starts_with("HTTP/1.1 408"), "{got}");
        assert!(got.contains("request_timeout"), "{got}");
    }
    assert_eq!(app.db.count("events").await, 20, "only the good webhooks are stored");
}

/// At the connection cap nothing more is accepted: a good request waits until the held
/// connections go, then is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_the_connection_cap_new_clients_wait_for_a_free_slot() {
    let limits = HttpLimits { header_timeout: Duration::from_secs(30), max_connections: 4, ..HttpLimits::default() };
    let mut app = app_with(limits).await;
    // No idle keep-alive connection may take a slot unseen: one connection per request.
    app.http = reqwest::Client::builder().pool_max_idle_per_host(0).build().expect("client");
    app.source_none("shop").await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(stalled(app.addr).await);
    }
    let waiting = tokio::spawn({
        let (http, url) = (app.http.clone(), app.url("/ingest/shop"));
        async move {
            let started = Instant::now();
            let answer = http.post(url).header("x-delivery-id", "waits").body("{}").send().await;
            (answer.map(|r| r.status().as_u16()), started.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!waiting.is_finished(), "served beyond the cap");
    assert_eq!(app.db.count("events").await, 0);
    drop(held);
    let (status, waited) = waiting.await.expect("join");
    assert_eq!(status.expect("answered once a slot was free"), 200);
    assert!(waited >= Duration::from_secs(2), "{waited:?}");
    assert_eq!(app.db.count("events").await, 1);
}

/// SIGTERM with stalled and trickling clients connected: the process stops within its
/// grace period (plus the rest of the shutdown), and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_stalled_clients_exits_within_the_grace() {
    let db = TestDb::new().await;
    let mut gateway = GatewayProcess::start(&db.url, &["--role", "ingest", "--shutdown-grace-secs", "2"]);
    let addr = gateway.addr;
    eventually(WAIT, "the gateway listens", || async { TcpStream::connect(addr).await.ok().map(|_| ()) }).await;
    let mut clients = Vec::new();
    for _ in 0..50 {
        clients.push(stalled(addr).await);
    }
    for n in 0..10 {
        clients.push(trickler(addr, n).await);
    }
    let signalled = Instant::now();
    let status =
        tokio::task::spawn_blocking(move || gateway.terminate_within(Duration::from_secs(30))).await.expect("join");
    let took = signalled.elapsed();
    eprintln!("SIGTERM with 60 slow clients: exited after {took:?}");
    let status = status.unwrap_or_else(|| panic!("still running {took:?} after SIGTERM"));
    assert!(status.success(), "{status:?}");
    drop(clients);
}

/// The ingest memory budget: webhooks whose bodies are still arriving hold their room;
/// with none left, the next webhook is answered 503 `overloaded` with `Retry-After` at
/// once and nothing of it is stored; when the held requests end, webhooks are taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_memory_budget_sheds_webhooks_at_once_and_stores_nothing_of_them() {
    const BODY: usize = 64 * 1024;
    const HELD: usize = 8;
    // Room for exactly HELD bodies of BODY bytes (each counted COPIES times).
    let held_bytes = HELD as u64 * BODY as u64 * webhook_gateway::ingest::budget::COPIES;
    let settings = Settings { max_body_bytes: BODY, ingest_memory_bytes: held_bytes, ..test_settings() };
    let app = TestApp::spawn_with(TestDb::new().await, settings, 8).await;
    app.source_none("shop").await;
    // Whether a small probe is admitted: 404 (no such source) once in, 503 when shed.
    let probe = || async {
        app.http.post(app.url("/ingest/no-such-source")).body("{}").send().await.expect("probe").status().as_u16()
    };
    assert_eq!(probe().await, 404);
    // Requests that declare a full body and send none of it hold their reservations.
    let hold = |i: usize| async move {
        let mut stream = TcpStream::connect(app.addr).await.expect("connect");
        let head = format!(
            "POST /ingest/shop HTTP/1.1\r\nHost: x\r\nContent-Length: {BODY}\r\nX-Delivery-Id: held-{i}\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).await.expect("head");
        stream
    };
    let mut held = Vec::new();
    for i in 0..HELD {
        held.push(hold(i).await);
    }
    // A held request the server reaches while a probe holds its own small reservation finds
    // the budget a KiB short and is answered 503 at once (or, on a slow machine, one is
    // abandoned at the request deadline): then it holds nothing, the budget never fills,
    // and it is held again.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut next = HELD;
    loop {
        for stream in &mut held {
            let mut answer = [0u8; 1024];
            match stream.try_read(&mut answer) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                _ => {
                    *stream = hold(next).await;
                    next += 1;
                }
            }
        }
        if probe().await == 503 {
            break;
        }
        assert!(Instant::now() < deadline, "the budget never filled with {HELD} held requests");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Answered while the held requests still hold their room: shed, not queued behind them.
    let response = app
        .http
        .post(app.url("/ingest/shop"))
        .header("x-delivery-id", "shed-1")
        .header("x-event-type", "t")
        .body(vec![b' '; 1000])
        .send()
        .await
        .expect("shed");
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "1");
    let body: serde_json::Value = response.json().await.expect("json");
    assert_eq!(body["error"]["code"], "overloaded", "{body}");
    // The held requests end (their clients go away): room again.
    drop(held);
    eventually(Duration::from_secs(10), "room again", || async { (probe().await == 404).then_some(()) }).await;
    assert_eq!(app.ingest("shop", "taken-1", "t", "{}").await.0, 200);
    let keys: Vec<String> = sqlx::query_scalar(
        "SELECT dedupe_key FROM events e JOIN sources s ON s.id = e.source_id WHERE s.name = 'shop'",
    )
    .fetch_all(&app.db.pool)
    .await
    .expect("keys");
    assert_eq!(keys, ["taken-1"], "nothing of the shed or the held webhooks was stored");
}
