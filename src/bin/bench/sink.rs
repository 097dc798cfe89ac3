//! The subscriber: an axum server in the bench process that answers at once (200 on
//! `/ok/...`, 503 on `/fail/...`) or slowly (200 on `/slow/...` after 1.5 s) and counts receipts by `webhook-id`, timestamping them
//! so drain rates and end-to-end latencies come from the receiving side.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};

use crate::payload;

/// How long `/slow/...` takes to answer 200: a subscriber that is slow but healthy.
pub const SLOW_ANSWER: std::time::Duration = std::time::Duration::from_millis(1500);

/// Counters of the current scenario.
#[derive(Debug, Default)]
struct Inner {
    /// Requests answered 200.
    ok: u64,
    /// Requests answered 503.
    failed: u64,
    /// Distinct `webhook-id`s answered 200.
    ids: HashSet<String>,
    /// 200s that repeated a `webhook-id` already answered 200 (at-least-once redeliveries).
    redelivered: u64,
    /// 200s without a `webhook-id` header.
    without_id: u64,
    first_ok: Option<Instant>,
    last_ok: Option<Instant>,
    /// First receipt per body `bench_seq`, when tracking (end-to-end scenario).
    track: bool,
    seen_at: HashMap<u64, Instant>,
}

/// A snapshot of the counters.
#[derive(Debug, Clone, Default)]
pub struct Counts {
    /// Requests answered 200.
    pub ok: u64,
    /// Requests answered 503.
    pub failed: u64,
    /// Distinct deliveries answered 200.
    pub unique: u64,
    /// Repeated deliveries answered 200.
    pub redelivered: u64,
    /// 200s without `webhook-id`.
    pub without_id: u64,
    /// First and last 200.
    pub first_ok: Option<Instant>,
    /// Last 200.
    pub last_ok: Option<Instant>,
}

/// The running sink.
#[derive(Clone)]
pub struct Sink {
    /// Where it listens.
    pub addr: SocketAddr,
    inner: Arc<Mutex<Inner>>,
}

impl Sink {
    /// Bind 127.0.0.1 on a free port and serve.
    pub async fn start() -> anyhow::Result<Sink> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let inner: Arc<Mutex<Inner>> = Arc::default();
        let app = axum::Router::new().fallback(receive).with_state(inner.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("bench: sink stopped: {e}");
            }
        });
        Ok(Sink { addr, inner })
    }

    /// URL of a healthy endpoint (answers 200).
    pub fn ok_url(&self, n: usize) -> String {
        format!("http://{}/ok/{n}", self.addr)
    }

    /// URL of a failing endpoint (answers 503).
    pub fn failing_url(&self, n: usize) -> String {
        format!("http://{}/fail/{n}", self.addr)
    }

    /// URL of a slow endpoint (answers 200 after [`SLOW_ANSWER`]).
    pub fn slow_url(&self, n: usize) -> String {
        format!("http://{}/slow/{n}", self.addr)
    }

    /// Forget everything; `track` records each body's `bench_seq` receipt time.
    pub fn reset(&self, track: bool) {
        let mut inner = self.inner.lock().expect("sink lock");
        *inner = Inner { track, ..Inner::default() };
    }

    /// Current counters.
    pub fn counts(&self) -> Counts {
        let i = self.inner.lock().expect("sink lock");
        Counts {
            ok: i.ok,
            failed: i.failed,
            unique: i.ids.len() as u64,
            redelivered: i.redelivered,
            without_id: i.without_id,
            first_ok: i.first_ok,
            last_ok: i.last_ok,
        }
    }

    /// Receipt time of the webhook with this `bench_seq`, if it arrived.
    pub fn seen_at(&self, seq: u64) -> Option<Instant> {
        self.inner.lock().expect("sink lock").seen_at.get(&seq).copied()
    }
}

async fn receive(State(inner): State<Arc<Mutex<Inner>>>, uri: Uri, headers: HeaderMap, body: Bytes) -> StatusCode {
    if uri.path().starts_with("/slow") {
        tokio::time::sleep(SLOW_ANSWER).await;
    }
    let now = Instant::now();
    let failing = uri.path().starts_with("/fail");
    // Parse outside the lock.
    let seq = payload::find_seq(&body);
    let id = headers.get("webhook-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let mut i = inner.lock().expect("sink lock");
    if failing {
        i.failed += 1;
        return StatusCode::SERVICE_UNAVAILABLE;
    }
    i.ok += 1;
    i.first_ok.get_or_insert(now);
    i.last_ok = Some(now);
    match id {
        Some(id) => {
            if !i.ids.insert(id) {
                i.redelivered += 1;
            }
        }
        None => i.without_id += 1,
    }
    if i.track
        && let Some(seq) = seq
    {
        i.seen_at.entry(seq).or_insert(now);
    }
    StatusCode::OK
}
