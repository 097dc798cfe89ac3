//! A hostile subscriber for tests: a raw TCP listener on 127.0.0.1 that reads each
//! request (head, then a `Content-Length` body) and answers with whatever bytes the test
//! scripts, including ones no HTTP library would produce: odd status codes, huge or
//! non-UTF-8 headers, NUL bytes, bodies cut mid-stream, connections closed early.
//!
//! Every connection serves one request and is then closed.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest request head the sink reads.
const MAX_HEAD: usize = 64 * 1024;
/// How long the sink waits for the parts of a request, and for the peer to close.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// One request the sink received (its head in full; its body if the script read it).
#[derive(Debug, Clone)]
pub struct RawRequest {
    /// The request line.
    pub request_line: String,
    /// Header names (lower case) and values, in order.
    pub headers: Vec<(String, String)>,
    /// The body, complete when the reply was scripted to read it first.
    pub body: Vec<u8>,
}

impl RawRequest {
    /// The first value of a header, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// What happens after the reply's bytes are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    /// Drop the socket at once (with unread request bytes, the kernel sends a reset).
    Close,
    /// Shut down the write side, then read until the peer closes (or a timeout).
    Linger,
}

/// The scripted answer to one request.
#[derive(Debug, Clone)]
pub struct RawReply {
    /// Read the request body before answering (otherwise answer right after the head).
    pub read_body_first: bool,
    /// Bytes to write, in separate writes (a pause of `pause` between them).
    pub writes: Vec<Vec<u8>>,
    /// Pause between writes.
    pub pause: Duration,
    /// How the connection ends.
    pub then: Then,
}

impl RawReply {
    /// These bytes after reading the whole request, then a graceful close.
    pub fn bytes(bytes: impl Into<Vec<u8>>) -> RawReply {
        RawReply { read_body_first: true, writes: vec![bytes.into()], pause: Duration::ZERO, then: Then::Linger }
    }
}

type Script = dyn Fn(&RawRequest) -> RawReply + Send + Sync;

/// The raw subscriber.
#[derive(Clone)]
pub struct RawSink {
    /// Where it listens.
    pub addr: SocketAddr,
    received: Arc<Mutex<Vec<RawRequest>>>,
    errors: Arc<Mutex<Vec<String>>>,
}

impl RawSink {
    /// A sink answering each request with `script(request)`.
    pub async fn start(script: impl Fn(&RawRequest) -> RawReply + Send + Sync + 'static) -> RawSink {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind raw sink");
        let addr = listener.local_addr().expect("raw sink addr");
        let script: Arc<Script> = Arc::new(script);
        let received: Arc<Mutex<Vec<RawRequest>>> = Arc::default();
        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let (log, errs) = (received.clone(), errors.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (script, log, errs) = (script.clone(), log.clone(), errs.clone());
                tokio::spawn(async move {
                    if let Err(e) = serve(stream, &*script, &log).await {
                        errs.lock().expect("errors lock").push(e);
                    }
                });
            }
        });
        RawSink { addr, received, errors }
    }

    /// URL of a path on the sink.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Every request whose head arrived, in order of arrival.
    pub fn received(&self) -> Vec<RawRequest> {
        self.received.lock().expect("log lock").clone()
    }

    /// Connections that ended before a whole request head arrived (and why).
    pub fn errors(&self) -> Vec<String> {
        self.errors.lock().expect("errors lock").clone()
    }
}

/// One connection: read the head, log the request, maybe read the body, answer.
async fn serve(mut stream: TcpStream, script: &Script, log: &Mutex<Vec<RawRequest>>) -> Result<(), String> {
    let mut buf = Vec::with_capacity(4096);
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > MAX_HEAD {
            return Err("request head too large".to_owned());
        }
        let mut chunk = [0u8; 8192];
        match tokio::time::timeout(READ_TIMEOUT, stream.read(&mut chunk)).await {
            Ok(Ok(0)) if buf.is_empty() => return Ok(()), // a connection opened and closed unused
            Ok(Ok(0)) => return Err(format!("peer closed after {} bytes of a head", buf.len())),
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Ok(Err(e)) => return Err(format!("reading the head: {e}")),
            Err(_) => return Err("timed out reading the head".to_owned()),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default().to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let length: usize =
        headers.iter().find(|(n, _)| n == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
    let mut request = RawRequest { request_line, headers, body: buf[head_end..].to_vec() };
    let reply = script(&request);
    if reply.read_body_first {
        while request.body.len() < length {
            let mut chunk = vec![0u8; (length - request.body.len()).min(64 * 1024)];
            match tokio::time::timeout(READ_TIMEOUT, stream.read(&mut chunk)).await {
                Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
                Ok(Ok(n)) => request.body.extend_from_slice(&chunk[..n]),
            }
        }
    }
    log.lock().expect("log lock").push(request);

    for (i, bytes) in reply.writes.iter().enumerate() {
        if i > 0 && !reply.pause.is_zero() {
            tokio::time::sleep(reply.pause).await;
        }
        // The gateway stops reading a huge answer early: a failed write is expected.
        if stream.write_all(bytes).await.is_err() {
            return Ok(());
        }
    }
    let _ = stream.flush().await;
    if reply.then == Then::Linger {
        let _ = stream.shutdown().await;
        let mut sink = [0u8; 8192];
        let _ = tokio::time::timeout(READ_TIMEOUT, async {
            while let Ok(n) = stream.read(&mut sink).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
    }
    Ok(())
}
