//! The load generator: keep-alive HTTP/1.1 connections written by hand over tokio TCP
//! streams. A request is a pre-built byte string; a response is read up to its
//! Content-Length. No client library between us and the socket, so the generator's CPU
//! per request is little more than building and signing the body (and it is measured).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One keep-alive connection.
pub struct Conn {
    addr: SocketAddr,
    stream: Option<TcpStream>,
    buf: Vec<u8>,
}

impl Conn {
    /// A connection to `addr`, opened on first use.
    pub fn new(addr: SocketAddr) -> Conn {
        Conn { addr, stream: None, buf: Vec::with_capacity(4096) }
    }

    /// Send one request and read its response: (status, body).
    pub async fn send(&mut self, request: &[u8]) -> anyhow::Result<(u16, Vec<u8>)> {
        let result = self.exchange(request).await;
        if result.is_err() {
            // Whatever went wrong, the next request starts on a fresh connection.
            self.stream = None;
            self.buf.clear();
        }
        result
    }

    async fn exchange(&mut self, request: &[u8]) -> anyhow::Result<(u16, Vec<u8>)> {
        if self.stream.is_none() {
            let s = TcpStream::connect(self.addr).await.with_context(|| format!("connecting to {}", self.addr))?;
            s.set_nodelay(true)?;
            self.stream = Some(s);
            self.buf.clear();
        }
        let stream = self.stream.as_mut().expect("connected above");
        stream.write_all(request).await?;
        loop {
            if let Some(head_end) = find(&self.buf, b"\r\n\r\n") {
                let head = std::str::from_utf8(&self.buf[..head_end]).context("response head is not UTF-8")?;
                let status: u16 = head
                    .split(' ')
                    .nth(1)
                    .and_then(|s| s.parse().ok())
                    .with_context(|| format!("bad status line: {:?}", head.lines().next()))?;
                let length = head
                    .lines()
                    .skip(1)
                    .find_map(|l| {
                        let (name, value) = l.split_once(':')?;
                        name.trim()
                            .eq_ignore_ascii_case("content-length")
                            .then(|| value.trim().parse::<usize>().ok())?
                    })
                    .context("response without Content-Length")?;
                let close = head.lines().any(|l| l.eq_ignore_ascii_case("connection: close"));
                let total = head_end + 4 + length;
                while self.buf.len() < total {
                    self.read_more().await?;
                }
                let body = self.buf[head_end + 4..total].to_vec();
                self.buf.drain(..total);
                if close {
                    self.stream = None;
                }
                return Ok((status, body));
            }
            self.read_more().await?;
        }
    }

    async fn read_more(&mut self) -> anyhow::Result<()> {
        let stream = self.stream.as_mut().expect("connected");
        let mut chunk = [0u8; 8192];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            bail!("connection closed by the server");
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// What a run produced.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Responses that were 200 with the expected `duplicate` flag, completed in the window.
    pub ok: u64,
    /// 200 answers whose `duplicate` flag was not the expected one.
    pub unexpected: u64,
    /// Non-200 answers and transport errors, by status (0 = transport error).
    pub failures: BTreeMap<u16, u64>,
    /// One transport error message, for the report.
    pub first_error: Option<String>,
    /// Latencies (µs) of the `ok` responses.
    pub latencies: Vec<u64>,
    /// Open loop: how late (µs) each measured webhook's request began against the time it
    /// was due. Latencies are counted from the due time, so this is the load generator's
    /// own share of them.
    pub lateness: Vec<u64>,
    /// Length of the measured window.
    pub window: Duration,
    /// Open loop: from the start of the window to the last answer to a measured webhook
    /// (longer than the window when the gateway falls behind the offered rate).
    pub span: Option<Duration>,
}

impl Outcome {
    fn merge(&mut self, other: Outcome) {
        self.ok += other.ok;
        self.unexpected += other.unexpected;
        for (k, v) in other.failures {
            *self.failures.entry(k).or_default() += v;
        }
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        self.latencies.extend(other.latencies);
        self.lateness.extend(other.lateness);
        self.span = self.span.max(other.span);
    }

    /// Accepted per second over the window (or, open loop, until the last measured
    /// webhook was answered).
    pub fn rate(&self) -> f64 {
        self.ok as f64 / self.span.unwrap_or(self.window).max(self.window).as_secs_f64()
    }

    /// `"3 × 503, 1 transport error"`, or empty.
    pub fn failure_note(&self) -> String {
        let mut parts: Vec<String> = self
            .failures
            .iter()
            .map(|(s, n)| if *s == 0 { format!("{n} transport errors") } else { format!("{n} × HTTP {s}") })
            .collect();
        if self.unexpected > 0 {
            parts.push(format!("{} with an unexpected duplicate flag", self.unexpected));
        }
        if let Some(e) = &self.first_error {
            parts.push(format!("first error: {e}"));
        }
        parts.join(", ")
    }
}

/// Which `duplicate` flag a 200 must carry.
#[derive(Debug, Clone, Copy)]
pub enum Expect {
    /// `"duplicate":false`.
    New,
    /// `"duplicate":true`.
    Duplicate,
}

impl Expect {
    fn holds(self, body: &[u8]) -> bool {
        match self {
            Expect::New => find(body, b"\"duplicate\":false").is_some(),
            Expect::Duplicate => find(body, b"\"duplicate\":true").is_some(),
        }
    }
}

/// Builds the request for the i-th send of a run.
pub type MakeRequest = Arc<dyn Fn() -> Vec<u8> + Send + Sync>;

/// Closed loop: `conns` connections, each sending its next request as soon as the last
/// one is answered, for `warmup` and then `measure`. Counts responses completed inside
/// the measured window.
pub async fn closed_loop(
    addr: SocketAddr,
    conns: usize,
    warmup: Duration,
    measure: Duration,
    make: MakeRequest,
    expect: Expect,
) -> Outcome {
    let t0 = Instant::now();
    let from = t0 + warmup;
    let end = from + measure;
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let make = make.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = Conn::new(addr);
            let mut out = Outcome::default();
            loop {
                let start = Instant::now();
                if start >= end {
                    break;
                }
                let request = make();
                let result = conn.send(&request).await;
                let done = Instant::now();
                let counted = done >= from && done <= end;
                match result {
                    Ok((200, body)) if expect.holds(&body) => {
                        if counted {
                            out.ok += 1;
                            out.latencies.push(done.duration_since(start).as_micros() as u64);
                        }
                    }
                    Ok((200, _)) => out.unexpected += u64::from(counted),
                    Ok((status, _)) => *out.failures.entry(status).or_default() += u64::from(counted),
                    Err(e) => {
                        *out.failures.entry(0).or_default() += 1;
                        out.first_error.get_or_insert_with(|| format!("{e:#}"));
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            out
        }));
    }
    let mut total = Outcome { window: measure, ..Outcome::default() };
    for t in tasks {
        if let Ok(out) = t.await {
            total.merge(out);
        }
    }
    total
}

/// One scheduled send of an open-loop run.
#[derive(Debug, Clone, Copy)]
pub struct Ticket {
    /// Sequence number of the webhook.
    pub seq: u64,
    /// When it was due to be sent: latencies are measured from here, so a generator that
    /// falls behind shows up as latency instead of hiding it.
    pub due: Instant,
    /// Inside the measured window.
    pub measured: bool,
}

/// An open-loop run.
#[derive(Debug, Clone, Copy)]
pub struct OpenLoop {
    /// Gateway address.
    pub addr: SocketAddr,
    /// Connections that take the due webhooks in order.
    pub conns: usize,
    /// Webhooks due per second.
    pub rate: f64,
    /// Before the measured window.
    pub warmup: Duration,
    /// The measured window.
    pub measure: Duration,
    /// Sequence number of the first webhook (the run uses `rate × (warmup + measure)`).
    pub first_seq: u64,
}

/// Open loop: webhooks are due at a steady rate whatever the answers. `make(seq)` builds
/// the request; `on_due` is told each ticket before it is sent.
pub async fn open_loop(
    plan: OpenLoop,
    make: Arc<dyn Fn(u64) -> Vec<u8> + Send + Sync>,
    on_due: Arc<dyn Fn(Ticket) + Send + Sync>,
) -> Outcome {
    let OpenLoop { addr, conns, rate, warmup, measure, first_seq } = plan;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Ticket>();
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let t0 = Instant::now();
    let from = t0 + warmup;
    let end = from + measure;
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let rx = rx.clone();
        let make = make.clone();
        let on_due = on_due.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = Conn::new(addr);
            let mut out = Outcome::default();
            loop {
                let Some(ticket) = rx.lock().await.recv().await else { break };
                on_due(ticket);
                let request = make(ticket.seq);
                if ticket.measured {
                    out.lateness.push(Instant::now().saturating_duration_since(ticket.due).as_micros() as u64);
                }
                let result = conn.send(&request).await;
                let done = Instant::now();
                let counted = ticket.measured;
                match result {
                    Ok((200, _)) => {
                        if counted {
                            out.ok += 1;
                            out.latencies.push(done.duration_since(ticket.due).as_micros() as u64);
                            out.span = out.span.max(Some(done.duration_since(from)));
                        }
                    }
                    Ok((status, _)) => *out.failures.entry(status).or_default() += 1,
                    Err(e) => {
                        *out.failures.entry(0).or_default() += 1;
                        out.first_error.get_or_insert_with(|| format!("{e:#}"));
                    }
                }
            }
            out
        }));
    }
    // The tickets are issued by a thread of their own sleeping with the kernel's timer
    // (about 50 µs of slack), not by tokio's, whose sleeps end on the next millisecond
    // tick: that put up to a millisecond of the generator's lateness into every latency,
    // which at a few hundred webhooks a second is half the figure being measured.
    let period = Duration::from_secs_f64(1.0 / rate);
    let scheduler = tokio::task::spawn_blocking(move || {
        let mut i: u32 = 0;
        loop {
            let due = t0 + period * i;
            if due >= end {
                break;
            }
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if tx.send(Ticket { seq: first_seq + u64::from(i), due, measured: due >= from }).is_err() {
                break;
            }
            i += 1;
        }
    });
    let _ = scheduler.await;
    let mut total = Outcome { window: measure, ..Outcome::default() };
    for t in tasks {
        if let Ok(out) = t.await {
            total.merge(out);
        }
    }
    total
}
