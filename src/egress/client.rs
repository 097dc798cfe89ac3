//! The egress HTTP client and the mapping of reqwest errors to [`SendError`].

use std::error::Error as StdError;
use std::io;
use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;
use ipnet::IpNet;
use url::Url;

use super::resolver::{PolicyResolver, ResolveError};
use super::{EgressConfig, HostResolver, Refusal, SendError, SystemResolver, check_url_static};

/// SSRF-safe HTTP client for webhook delivery. Cheap to clone: clones share the
/// connection pool.
#[derive(Clone)]
pub struct EgressClient {
    inner: Arc<Inner>,
}

struct Inner {
    http: reqwest::Client,
    allow: Arc<[IpNet]>,
    https_only: bool,
    request_timeout: std::time::Duration,
}

impl std::fmt::Debug for EgressClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressClient")
            .field("allow", &self.inner.allow)
            .field("https_only", &self.inner.https_only)
            .finish_non_exhaustive()
    }
}

impl EgressClient {
    /// A client resolving names with the operating system's resolver.
    pub fn new(cfg: EgressConfig) -> anyhow::Result<Self> {
        Self::with_resolver(cfg, Arc::new(SystemResolver))
    }

    /// How long an idle outbound connection is kept for reuse.
    pub const POOL_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

    /// A client resolving names through `resolver` (tests, custom DNS).
    pub fn with_resolver(cfg: EgressConfig, resolver: Arc<dyn HostResolver>) -> anyhow::Result<Self> {
        let allow: Arc<[IpNet]> = cfg.allow.into();
        let mut builder = reqwest::Client::builder()
            .dns_resolver(Arc::new(PolicyResolver::new(resolver, Arc::clone(&allow))))
            // A redirect or an environment proxy would send the request to a
            // destination our resolver never validated.
            .redirect(reqwest::redirect::Policy::none())
            // One request per attempt: the attempt number on it is the truth. (reqwest's
            // default retries HTTP/2 refusals, which this HTTP/1 client never gets, and
            // copied every request's headers twice in case it would.)
            .retry(reqwest::retry::never().max_retries_per_request(0))
            .no_proxy()
            .https_only(cfg.https_only)
            .connect_timeout(cfg.connect_timeout)
            .timeout(cfg.request_timeout)
            // A subscriber that closes an idle keep-alive connection without saying so
            // (Node closes after 5 s, gunicorn after 2 s) makes the next request on it fail
            // before the subscriber reads it: an attempt spent and a circuit failure for
            // nothing. Reuse a connection only within a second of its last use.
            .pool_idle_timeout(Self::POOL_IDLE_TIMEOUT)
            .user_agent(cfg.user_agent)
            .referer(false);
        for cert in cfg.extra_root_certs {
            builder = builder.add_root_certificate(cert);
        }
        let http = builder.build().map_err(|e| anyhow::anyhow!("building egress HTTP client: {e}"))?;
        let inner = Inner { http, allow, https_only: cfg.https_only, request_timeout: cfg.request_timeout };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// The longest a request may take, connection included.
    pub fn request_timeout(&self) -> std::time::Duration {
        self.inner.request_timeout
    }

    /// Static check of a URL: scheme http/https (https only when configured), host
    /// present, IP-literal hosts classified against policy. Used at endpoint creation
    /// (422) and before each send.
    pub fn check_url(&self, url: &Url) -> Result<(), Refusal> {
        check_url_static(url, &self.inner.allow, self.inner.https_only)
    }

    /// POSTs `body` with `headers` to `url`.
    ///
    /// Validates statically, resolves through our resolver once per new connection,
    /// refuses if any resolved address is forbidden and connects only to the validated
    /// addresses. A `Host` entry in `headers` is dropped so the header always names the
    /// URL's host. Redirects are returned, not followed.
    pub async fn post(&self, url: &Url, mut headers: HeaderMap, body: Bytes) -> Result<reqwest::Response, SendError> {
        // reqwest skips the resolver for IP-literal hosts: this is their only check.
        self.check_url(url).map_err(SendError::Refused)?;
        headers.remove(http::header::HOST);
        if !url.username().is_empty() || url.password().is_some() {
            // Refused for new endpoints; one stored before that was refused is sent as it
            // always was: reqwest's builder moves the credentials into Basic auth.
            let request = self.inner.http.post(url.clone()).headers(headers).body(body);
            return request.send().await.map_err(SendError::from_reqwest);
        }
        // The request is built whole: a builder's `headers` copies them one by one into
        // the request's own map.
        let mut request = reqwest::Request::new(reqwest::Method::POST, url.clone());
        *request.headers_mut() = headers;
        *request.body_mut() = Some(body.into());
        self.inner.http.execute(request).await.map_err(SendError::from_reqwest)
    }
}

impl SendError {
    /// Maps a reqwest error (from [`EgressClient::post`], or from reading a response
    /// body later) to its [`SendError`] kind by looking through the source chain.
    ///
    /// The URL is left out of the message: webhook URLs often carry secrets in the
    /// path or query, and these messages end up in logs and delivery records.
    pub fn from_reqwest(err: reqwest::Error) -> SendError {
        let err = err.without_url();
        let msg = error_chain_message(&err);
        let mut refused = None;
        let mut dns = false;
        let mut tls = false;
        let mut io_kinds = Vec::new();
        for e in error_chain(&err) {
            if let Some(r) = e.downcast_ref::<ResolveError>() {
                match r {
                    ResolveError::Refused(refusal) => refused = Some(refusal.clone()),
                    ResolveError::Lookup { .. } | ResolveError::NoAddresses(_) => dns = true,
                }
            }
            if e.downcast_ref::<rustls::Error>().is_some() {
                tls = true;
            }
            if let Some(io) = e.downcast_ref::<io::Error>() {
                io_kinds.push(io.kind());
            }
        }
        if let Some(refusal) = refused {
            return SendError::Refused(refusal);
        }
        if dns {
            return SendError::Dns(msg);
        }
        if err.is_timeout() || io_kinds.contains(&io::ErrorKind::TimedOut) {
            return SendError::Timeout(msg);
        }
        if tls {
            return SendError::Tls(msg);
        }
        let connect_kind = io_kinds.iter().any(|kind| {
            matches!(
                kind,
                io::ErrorKind::ConnectionRefused
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::NotConnected
                    | io::ErrorKind::AddrNotAvailable
                    | io::ErrorKind::HostUnreachable
                    | io::ErrorKind::NetworkUnreachable
            )
        });
        if err.is_connect() || connect_kind {
            return SendError::Connect(msg);
        }
        SendError::Other(msg)
    }
}

impl From<reqwest::Error> for SendError {
    fn from(err: reqwest::Error) -> Self {
        SendError::from_reqwest(err)
    }
}

/// Every error in the source chain, descending into the payload of `io::Error`s:
/// their `source()` skips the wrapped error itself, which is where rustls errors live
/// (hyper-rustls nests them two `io::Error`s deep).
fn error_chain<'a>(err: &'a (dyn StdError + 'static)) -> Vec<&'a (dyn StdError + 'static)> {
    let mut out = Vec::new();
    let mut next = Some(err);
    while let Some(e) = next {
        out.push(e);
        // `io::Error::source()` is the payload's source, so following the payload
        // itself loses nothing.
        next = match e.downcast_ref::<io::Error>().and_then(|io| io.get_ref()) {
            Some(payload) => Some(payload as &(dyn StdError + 'static)),
            None => e.source(),
        };
    }
    out
}

/// "outer: inner: innermost", skipping repeats, since reqwest's own Display hides the
/// cause that operators need (connection refused, certificate name mismatch, ...).
fn error_chain_message(err: &reqwest::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for e in error_chain(err) {
        let s = e.to_string();
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    parts.join(": ")
}
