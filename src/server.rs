//! The HTTP server: accepting connections under a cap, hyper's HTTP/1 with a timer (so
//! its header-read timeout works), and a shutdown bounded by the grace period.
//!
//! `axum::serve` runs hyper without a timer and without a connection cap, so a client
//! that sends half a header, or trickles a body, holds its connection (and then the
//! shutdown) for as long as it likes. Here:
//!
//! - **Headers** must be complete within [`HttpLimits::header_timeout`], counted from the
//!   moment the connection is ready for a request: hyper's header-read timeout, which on
//!   a keep-alive connection also bounds the idle time before the next request.
//! - **Bodies** are read, and the request answered, within
//!   [`HttpLimits::request_timeout`] (the `api` layer answers 408 in JSON past it).
//! - **Connections** are capped at [`HttpLimits::max_connections`]: at the cap the
//!   server stops accepting (new clients wait in the kernel's backlog) until one closes.
//! - **Shutdown** stops accepting, closes idle connections at once, lets requests in
//!   flight finish within the grace period, then closes whatever is left.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;

/// Most a connection buffers while reading a request (headers, and body chunks before the
/// handler takes them).
pub const READ_BUFFER_BYTES: usize = 64 * 1024;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

/// Limits on what one client can hold.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Time to send a request's headers, from when the connection is ready for one
    /// (`--http-header-timeout-secs`).
    pub header_timeout: Duration,
    /// Time to send the body and get the answer (`--http-request-timeout-secs`).
    pub request_timeout: Duration,
    /// Connections open at once (`--http-max-connections`).
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_connections: 1024,
        }
    }
}

/// Serve `router` on `listener` until `stop` says `true`, then drain within `grace`.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: HttpLimits,
    grace: Duration,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
    // A connection's read buffer: hyper's default lets it grow to about 400 KiB, which a
    // thousand clients sending large bodies turn into hundreds of MiB held outside the
    // ingest memory budget. Headers fit in far less (each value is bounded when stored).
    http.max_buf_size(READ_BUFFER_BYTES);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            _ = stop.wait_for(|s| *s) => break,
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|s| *s) => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, or a connection reset before it was accepted: pause
                // briefly rather than spin, and go on.
                tracing::warn!(error = %e, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        // The peer's address, for whoever asks (`ConnectInfo`: the audit log).
        let service = TowerToHyperService::new(tower::ServiceExt::map_request(
            router.clone(),
            move |mut request: http::Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(axum::extract::ConnectInfo(peer));
                request
            },
        ));
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        connections.spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    let open = connections.len();
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!(open, grace = ?grace, "connections still open after the shutdown grace; closing them");
    }
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// Raise this process's open-file limit to its hard limit: every connection (inbound,
/// outbound, to PostgreSQL) is a descriptor, and the usual soft limit of 1,024 is below
/// what the default connection cap and workers can use together. Returns the limit now
/// in force.
pub fn raise_open_file_limit() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return None;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
    }
    Some(limit.rlim_cur)
}
