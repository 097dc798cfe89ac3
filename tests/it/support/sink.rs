//! A subscriber for tests: a real HTTP server on 127.0.0.1 that records every request
//! and answers as the test scripts it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

/// One request the sink received.
#[derive(Debug, Clone)]
pub struct Received {
    /// Request headers.
    pub headers: HeaderMap,
    /// Raw body.
    pub body: Bytes,
    /// Request path.
    pub path: String,
    /// When it arrived.
    pub at: std::time::Instant,
    /// The status the sink answered (or will answer, for a held request).
    pub replied: u16,
}

impl Received {
    /// A header as text ("" when absent).
    pub fn header(&self, name: &str) -> String {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned()
    }
}

/// What the sink answers.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A status with headers and a body.
    Status(u16, Vec<(&'static str, String)>, String),
    /// Hold the request open for this long before answering 200.
    Hold(Duration),
    /// Hold the request open for this long, then answer this status.
    Delayed(Duration, u16),
}

impl Reply {
    /// A bare status.
    pub fn status(code: u16) -> Reply {
        Reply::Status(code, Vec::new(), String::new())
    }
}

type Script = dyn Fn(&Received, usize) -> Reply + Send + Sync;

/// The sink: `script(request, n)` decides the reply, where `n` is how many requests with
/// the same `webhook-id` arrived before this one.
#[derive(Clone)]
pub struct Sink {
    /// Where it listens.
    pub addr: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
    /// Requests being answered now, and the most there ever were at once.
    concurrency: Arc<Mutex<(usize, usize)>>,
}

impl Sink {
    /// A sink that answers 200 to everything.
    pub async fn ok() -> Sink {
        Self::start(|_, _| Reply::status(200)).await
    }

    /// A sink driven by `script`.
    pub async fn start(script: impl Fn(&Received, usize) -> Reply + Send + Sync + 'static) -> Sink {
        let received: Arc<Mutex<Vec<Received>>> = Arc::default();
        let concurrency: Arc<Mutex<(usize, usize)>> = Arc::default();
        let counting = concurrency.clone();
        let seen: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let script: Arc<Script> = Arc::new(script);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind sink");
        let addr = listener.local_addr().expect("sink addr");
        let log = received.clone();
        let handler = move |uri: axum::http::Uri, headers: HeaderMap, body: Bytes| {
            let log = log.clone();
            let seen = seen.clone();
            let script = script.clone();
            let counting = counting.clone();
            async move {
                {
                    let mut c = counting.lock().expect("concurrency lock");
                    c.0 += 1;
                    c.1 = c.1.max(c.0);
                }
                let _done = Finished(counting);
                let mut req =
                    Received { headers, body, path: uri.path().to_owned(), at: std::time::Instant::now(), replied: 0 };
                let n = {
                    let mut seen = seen.lock().expect("seen lock");
                    let count = seen.entry(req.header("webhook-id")).or_insert(0);
                    *count += 1;
                    *count - 1
                };
                let reply = script(&req, n);
                req.replied = match &reply {
                    Reply::Status(code, ..) | Reply::Delayed(_, code) => *code,
                    Reply::Hold(_) => 200,
                };
                log.lock().expect("log lock").push(req);
                match reply {
                    Reply::Status(code, headers, body) => respond(code, headers, body),
                    Reply::Hold(d) => {
                        tokio::time::sleep(d).await;
                        respond(200, Vec::new(), String::new())
                    }
                    Reply::Delayed(d, code) => {
                        tokio::time::sleep(d).await;
                        respond(code, Vec::new(), String::new())
                    }
                }
            }
        };
        let app = axum::Router::new().fallback(handler);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Sink { addr, received, concurrency }
    }

    /// URL of a path on the sink.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Everything received so far.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().expect("log lock").clone()
    }

    /// The most requests the sink was answering at the same time.
    pub fn max_concurrent(&self) -> usize {
        self.concurrency.lock().expect("concurrency lock").1
    }

    /// How many requests arrived.
    pub fn count(&self) -> usize {
        self.received.lock().expect("log lock").len()
    }
}

/// Counts a request as answered when dropped (also when the client went away).
struct Finished(Arc<Mutex<(usize, usize)>>);

impl Drop for Finished {
    fn drop(&mut self) {
        if let Ok(mut c) = self.0.lock() {
            c.0 = c.0.saturating_sub(1);
        }
    }
}

fn respond(code: u16, headers: Vec<(&'static str, String)>, body: String) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, body).into_response();
    for (name, value) in headers {
        if let Ok(v) = value.parse() {
            response.headers_mut().insert(name, v);
        }
    }
    response
}
