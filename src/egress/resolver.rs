//! Name resolution with the address policy applied inside reqwest's connector.
//!
//! reqwest's connector calls [`PolicyResolver`] once per new connection and connects to
//! exactly the addresses it returns; validating here, rather than before the request,
//! is what pins the connection to the addresses that passed (no rebinding window).

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use futures_util::future::BoxFuture;
use ipnet::IpNet;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

use super::{Refusal, check_addr};

/// Our resolver abstraction, injectable for tests.
pub trait HostResolver: Send + Sync + 'static {
    /// Resolves `host` (a name, never an IP literal in practice) to its addresses.
    fn lookup(&self, host: &str) -> BoxFuture<'static, io::Result<Vec<IpAddr>>>;
}

/// The operating system's resolver, through `tokio::net::lookup_host`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl HostResolver for SystemResolver {
    fn lookup(&self, host: &str) -> BoxFuture<'static, io::Result<Vec<IpAddr>>> {
        let host = host.to_owned();
        Box::pin(async move {
            let addrs = tokio::net::lookup_host((host.as_str(), 0)).await?;
            Ok(addrs.map(|sa| sa.ip()).collect())
        })
    }
}

/// Error returned to reqwest from [`PolicyResolver`]; recovered from the
/// `reqwest::Error` source chain to tell a refusal from a DNS failure.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ResolveError {
    #[error(transparent)]
    Refused(Refusal),
    #[error("lookup of {host} failed: {source}")]
    Lookup { host: String, source: io::Error },
    #[error("{0} has no addresses")]
    NoAddresses(String),
}

/// reqwest [`Resolve`] implementation: look up, then refuse the whole answer if any
/// address is forbidden. Refusing on any (not filtering) keeps a mixed answer from
/// being used to probe which internal addresses are reachable.
pub(crate) struct PolicyResolver {
    inner: Arc<dyn HostResolver>,
    allow: Arc<[IpNet]>,
}

impl PolicyResolver {
    pub(crate) fn new(inner: Arc<dyn HostResolver>, allow: Arc<[IpNet]>) -> Self {
        Self { inner, allow }
    }
}

impl Resolve for PolicyResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_owned();
        let lookup = self.inner.lookup(&host);
        let allow = Arc::clone(&self.allow);
        Box::pin(async move {
            let ips = lookup.await.map_err(|source| ResolveError::Lookup { host: host.clone(), source })?;
            if ips.is_empty() {
                return Err(ResolveError::NoAddresses(host).into());
            }
            for ip in &ips {
                check_addr(*ip, &allow).map_err(ResolveError::Refused)?;
            }
            tracing::debug!(%host, addrs = ?ips, "egress: resolved and validated");
            // Port 0 is replaced by the connector with the URL's (or scheme's) port.
            let addrs: Addrs = Box::new(ips.into_iter().map(|ip| SocketAddr::new(ip, 0)));
            Ok(addrs)
        })
    }
}
