//! Test doubles: scripted resolvers and a tiny HTTP/1.1 server on loopback.
//!
//! The server is hand-rolled over raw sockets so tests can see exactly what arrived
//! (connection count, Host header, SNI) and can misbehave (hang, redirect) on demand.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::HostResolver;

/// Answers from a fixed table; unknown names fail like NXDOMAIN. Counts lookups.
#[derive(Default)]
pub(super) struct StaticResolver {
    pub answers: HashMap<String, Vec<IpAddr>>,
    pub calls: AtomicUsize,
}

impl StaticResolver {
    pub fn one(host: &str, ip: &str) -> Arc<Self> {
        let mut answers = HashMap::new();
        answers.insert(host.to_owned(), vec![ip.parse().unwrap()]);
        Arc::new(Self { answers, calls: AtomicUsize::new(0) })
    }
}

impl HostResolver for StaticResolver {
    fn lookup(&self, host: &str) -> BoxFuture<'static, io::Result<Vec<IpAddr>>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let answer = self.answers.get(host).cloned();
        let host = host.to_owned();
        Box::pin(async move {
            answer.ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no such host {host}")))
        })
    }
}

/// A rebinding attacker's DNS: call N gets `answers[N]` (the last one repeats).
pub(super) struct SequenceResolver {
    pub answers: Vec<Vec<IpAddr>>,
    pub calls: AtomicUsize,
}

impl SequenceResolver {
    pub fn new(answers: &[&[&str]]) -> Arc<Self> {
        let answers = answers.iter().map(|a| a.iter().map(|ip| ip.parse().unwrap()).collect()).collect();
        Arc::new(Self { answers, calls: AtomicUsize::new(0) })
    }
}

impl HostResolver for SequenceResolver {
    fn lookup(&self, _host: &str) -> BoxFuture<'static, io::Result<Vec<IpAddr>>> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        let answer = self.answers[n.min(self.answers.len() - 1)].clone();
        Box::pin(async move { Ok(answer) })
    }
}

/// What the test server answers to every request.
#[derive(Debug, Clone, Copy)]
pub(super) enum Reply {
    Ok,
    Redirect(&'static str),
    /// Read the request, never answer.
    Hang,
}

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub(super) struct Seen {
    pub request_line: String,
    pub host: Option<String>,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// TLS server name the client sent, for HTTPS servers.
    pub sni: Option<String>,
}

/// A running test server; aborted on drop.
pub(super) struct TestServer {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub connections: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl TestServer {
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn connection_count(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Binds a fresh loopback port.
pub(super) async fn loopback_listener() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").await.unwrap()
}

/// Serves plain HTTP/1.1 on `listener`.
pub(super) fn spawn_http(listener: TcpListener, reply: Reply) -> TestServer {
    spawn(listener, reply, None)
}

/// Serves HTTPS on `listener`, recording the SNI of each connection.
pub(super) fn spawn_https(listener: TcpListener, reply: Reply, acceptor: tokio_rustls::TlsAcceptor) -> TestServer {
    spawn(listener, reply, Some(acceptor))
}

fn spawn(listener: TcpListener, reply: Reply, tls: Option<tokio_rustls::TlsAcceptor>) -> TestServer {
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let connections = Arc::new(AtomicUsize::new(0));
    let (seen2, conns2) = (Arc::clone(&seen), Arc::clone(&connections));
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            conns2.fetch_add(1, Ordering::SeqCst);
            let seen = Arc::clone(&seen2);
            let tls = tls.clone();
            tokio::spawn(async move {
                match tls {
                    None => serve_conn(stream, None, reply, seen).await,
                    Some(acceptor) => {
                        // A failed handshake is an expected outcome in some tests.
                        if let Ok(tls_stream) = acceptor.accept(stream).await {
                            let sni = tls_stream.get_ref().1.server_name().map(str::to_owned);
                            serve_conn(tls_stream, sni, reply, seen).await;
                        }
                    }
                }
            });
        }
    });
    TestServer { addr, seen, connections, task }
}

/// Keep-alive request loop: parse head and Content-Length body, record, answer.
async fn serve_conn<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    sni: Option<String>,
    reply: Reply,
    seen: Arc<Mutex<Vec<Seen>>>,
) {
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break pos + 4;
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let mut lines = head.split("\r\n");
        let request_line = lines.next().unwrap_or_default().to_owned();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        let header = |name: &str| headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        let len: usize = header("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
        while buf.len() < head_end + len {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body = buf[head_end..head_end + len].to_vec();
        buf.drain(..head_end + len);
        seen.lock().unwrap().push(Seen {
            request_line,
            host: header("host"),
            headers: headers.clone(),
            body,
            sni: sni.clone(),
        });
        let response = match reply {
            Reply::Ok => "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_owned(),
            Reply::Redirect(location) => {
                format!("HTTP/1.1 302 Found\r\nlocation: {location}\r\ncontent-length: 0\r\n\r\n")
            }
            Reply::Hang => {
                std::future::pending::<()>().await;
                return;
            }
        };
        if stream.write_all(response.as_bytes()).await.is_err() || stream.flush().await.is_err() {
            return;
        }
    }
}
