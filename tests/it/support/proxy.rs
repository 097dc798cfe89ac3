//! A TCP proxy for tests, put between the gateway and PostgreSQL to play a network
//! partition.
//!
//! - **healthy**: bytes flow both ways.
//! - **blackhole** ([`Proxy::blackhole`]): every connection stays open but no byte moves in
//!   either direction; new connections are accepted and then left waiting, with nothing
//!   sent upstream. Neither side sees an error: this is a partition or a failover as the
//!   gateway sees it (the local kernel still acknowledges what the gateway sends, so only
//!   the gateway's own timers can notice).
//! - [`Proxy::heal`]: bytes held during the blackhole are let through in order, as TCP
//!   retransmission delivers them after a short partition.
//! - [`Proxy::cut`]: every open connection is closed (a partition long enough for either
//!   side to give up on its connections).
//! - [`Proxy::strand`]: every open connection goes silent for good (its bytes held and
//!   never passed on, neither side told), while new ones flow: a server gone without a
//!   word, its connections half-open, and the address now leading to a live one.
//! - [`Proxy::down`] / [`Proxy::up`]: connections closed and new ones refused (the server
//!   is gone), then accepted again on the same port.
//! - [`Proxy::retarget`]: the address leads to another server from now on (a failover
//!   behind a virtual IP or a DNS name); open connections are closed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// A running proxy; stops (closing every connection) when dropped.
pub struct Proxy {
    /// Where the gateway connects.
    pub addr: SocketAddr,
    upstream: Arc<std::sync::Mutex<SocketAddr>>,
    healthy: watch::Sender<bool>,
    connections: Arc<std::sync::Mutex<JoinSet<()>>>,
    accepted: Arc<AtomicU64>,
    awaiting: Arc<AtomicI64>,
    acceptor: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// While down: the port, bound but not listening, so connections to it are refused
    /// and no other socket of the machine takes it before [`Proxy::up`].
    held_port: std::sync::Mutex<Option<tokio::net::TcpSocket>>,
    /// Connections accepted before this many are stranded ([`Proxy::strand`]).
    stranded_below: Arc<AtomicU64>,
}

impl Proxy {
    /// Listen on a free loopback port and forward to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy listener");
        let addr = listener.local_addr().expect("proxy address");
        let (healthy, _) = watch::channel(true);
        let proxy = Proxy {
            addr,
            upstream: Arc::new(std::sync::Mutex::new(upstream)),
            healthy,
            connections: Arc::default(),
            accepted: Arc::default(),
            awaiting: Arc::default(),
            acceptor: std::sync::Mutex::new(None),
            held_port: std::sync::Mutex::new(None),
            stranded_below: Arc::default(),
        };
        proxy.accept_on(listener);
        proxy
    }

    fn accept_on(&self, listener: TcpListener) {
        let (healthy, connections, accepted) = (self.healthy.clone(), self.connections.clone(), self.accepted.clone());
        let (upstream, awaiting) = (self.upstream.clone(), self.awaiting.clone());
        let stranded_below = self.stranded_below.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else { continue };
                let number = accepted.fetch_add(1, Ordering::Relaxed);
                let state = Flowing { healthy: healthy.subscribe(), number, stranded_below: stranded_below.clone() };
                let turn = Turn { client_spoke_last: Arc::default(), awaiting: awaiting.clone() };
                let to = *upstream.lock().expect("proxy upstream");
                connections.lock().expect("proxy connections").spawn(relay(inbound, to, state, turn));
            }
        });
        if let Some(old) = self.acceptor.lock().expect("proxy acceptor").replace(task) {
            old.abort();
        }
    }

    /// The server is gone: every connection closed, new ones refused. The port stays
    /// this proxy's (bound, not listening): left free for the outage, it was once taken
    /// by another socket of the test suite within its 20 s, and [`Proxy::up`] could not
    /// listen on it again (`AddrInUse`).
    pub async fn down(&self) {
        let acceptor = self.acceptor.lock().expect("proxy acceptor").take();
        if let Some(task) = acceptor {
            task.abort();
            // The listener closes when the aborted task is dropped.
            let _ = task.await;
        }
        self.cut();
        let socket = tokio::net::TcpSocket::new_v4().expect("proxy socket");
        socket.set_reuseaddr(true).expect("SO_REUSEADDR");
        socket.bind(self.addr).expect("the proxy's port, held while down");
        *self.held_port.lock().expect("proxy port") = Some(socket);
    }

    /// Back after [`Proxy::down`], on the same port.
    pub async fn up(&self) {
        let socket = self.held_port.lock().expect("proxy port").take().expect("up after down");
        let listener = socket.listen(1024).expect("proxy listener, same port");
        self.accept_on(listener);
    }

    /// Stop forwarding, in both directions, on every connection, old and new.
    pub fn blackhole(&self) {
        self.healthy.send_replace(false);
    }

    /// Forward again, held bytes first.
    pub fn heal(&self) {
        self.healthy.send_replace(true);
    }

    /// Silence every open connection for good: what it holds or is sent is never passed
    /// on, and it stays open. Connections accepted from now on flow as usual.
    pub fn strand(&self) {
        self.stranded_below.store(self.accepted.load(Ordering::SeqCst), Ordering::SeqCst);
        // Wake every pump, so that each looks at its connection's state again.
        self.healthy.send_modify(|_| {});
    }

    /// Close every open connection (new ones are still accepted, and forwarded when healthy).
    pub fn cut(&self) {
        self.connections.lock().expect("proxy connections").abort_all();
    }

    /// Send new connections to `to` from now on, and close the open ones: the address
    /// moves to another server (a virtual IP or a DNS name after a failover).
    pub fn retarget(&self, to: SocketAddr) {
        *self.upstream.lock().expect("proxy upstream") = to;
        self.cut();
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Whether the server spoke last on every open connection: nothing the client sent
    /// awaits an answer (the gateway's connections are idle, or about to be without
    /// needing another byte).
    pub fn quiet(&self) -> bool {
        self.awaiting.load(Ordering::SeqCst) == 0
    }

    /// `url` (a PostgreSQL URL) pointed at this proxy instead of its own host and port.
    pub fn url_for(&self, url: &str) -> String {
        let mut url = url::Url::parse(url).expect("database URL");
        url.set_host(Some(&self.addr.ip().to_string())).expect("host");
        url.set_port(Some(self.addr.port())).expect("port");
        url.to_string()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(task) = self.acceptor.lock().expect("proxy acceptor").take() {
            task.abort();
        }
        self.cut();
    }
}

/// Who spoke last on one connection, and the proxy's count of connections where the
/// client did (awaiting an answer).
#[derive(Clone)]
struct Turn {
    client_spoke_last: Arc<AtomicBool>,
    awaiting: Arc<AtomicI64>,
}

impl Turn {
    fn spoke(&self, client: bool) {
        if self.client_spoke_last.swap(client, Ordering::SeqCst) != client {
            self.awaiting.fetch_add(if client { 1 } else { -1 }, Ordering::SeqCst);
        }
    }
}

/// Whether one connection may pass bytes on: the proxy is healthy and the connection is
/// not stranded.
#[derive(Clone)]
struct Flowing {
    healthy: watch::Receiver<bool>,
    number: u64,
    stranded_below: Arc<AtomicU64>,
}

impl Flowing {
    /// Wait until bytes may flow; `Err` once the proxy is gone.
    async fn wait(&mut self) -> Result<(), watch::error::RecvError> {
        let (number, stranded_below) = (self.number, self.stranded_below.clone());
        self.healthy.wait_for(|healthy| *healthy && number >= stranded_below.load(Ordering::SeqCst)).await.map(|_| ())
    }
}

/// One proxied connection: nothing is sent upstream, not even the connection attempt,
/// while the proxy is in blackhole.
async fn relay(inbound: TcpStream, upstream: SocketAddr, mut state: Flowing, turn: Turn) {
    // Ends the connection's turn however the task ends (aborted by `cut` included).
    struct Closed(Turn);
    impl Drop for Closed {
        fn drop(&mut self) {
            self.0.spoke(false);
        }
    }
    let _closed = Closed(turn.clone());
    if state.wait().await.is_err() {
        return;
    }
    let Ok(outbound) = TcpStream::connect(upstream).await else { return };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let (in_read, in_write) = inbound.into_split();
    let (out_read, out_write) = outbound.into_split();
    tokio::join!(
        pump(in_read, out_write, state.clone(), (turn.clone(), true)),
        pump(out_read, in_write, state, (turn, false))
    );
}

/// Copy one direction, holding every byte while the proxy is in blackhole.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut state: Flowing,
    (turn, from_client): (Turn, bool),
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if state.wait().await.is_err() {
            return;
        }
        let read = from.read(&mut buf).await;
        // Read just as the blackhole began: held (end of stream included) until it ends.
        if state.wait().await.is_err() {
            return;
        }
        match read {
            Ok(n) if n > 0 => {
                // The client's turn starts when it sends; the server's once its answer
                // has been passed on.
                if from_client {
                    turn.spoke(true);
                }
                if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
                if !from_client {
                    turn.spoke(false);
                }
            }
            _ => {
                let _ = to.shutdown().await;
                return;
            }
        }
    }
}

/// The address of the server a database URL names (what a [`Proxy`] forwards to).
pub fn server_addr(url: &str) -> SocketAddr {
    let url = url::Url::parse(url).expect("database URL");
    let host = url.host_str().expect("host");
    let port = url.port().unwrap_or(5432);
    std::net::ToSocketAddrs::to_socket_addrs(&(host, port)).expect("resolve").next().expect("an address")
}
