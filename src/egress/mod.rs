//! SSRF-safe egress: the only way the gateway sends HTTP to user-supplied URLs.
//!
//! The gateway POSTs webhooks to URLs its users typed, with the network position of the
//! gateway: a confused deputy. This module makes sure such a request can only reach an
//! address that policy allows:
//!
//! * [`check_url`](EgressClient::check_url) / [`check_url_static`] refuse bad schemes and
//!   IP-literal hosts in forbidden ranges; reqwest never asks a resolver about IP
//!   literals, so this static check is the only gate for them.
//! * For host names, reqwest's connector asks our resolver once per new connection; it
//!   classifies every address and fails the lookup if any is forbidden. The connector
//!   then connects only to the addresses that passed, so there is no second resolution
//!   a DNS-rebinding attacker could answer differently.
//! * The URL is left untouched, so the Host header, TLS SNI and certificate verification
//!   all use the original host name.
//! * No redirects are followed (a 3xx goes back to the caller) and no proxy is taken
//!   from the environment: either would send the request somewhere we did not check.
//!
//! Policy: an address is allowed iff it is inside the operator allow-list or
//! [`classify()`] says [`AddressClass::Public`].

pub mod classify;
mod client;
mod resolver;

#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests_net;
#[cfg(test)]
mod tests_policy;
#[cfg(test)]
mod tests_tls;

use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use url::{Host, Url};

pub use classify::{AddressClass, classify};
pub use client::EgressClient;
pub use resolver::{HostResolver, SystemResolver};

/// Settings for [`EgressClient`].
#[derive(Debug, Clone)]
pub struct EgressConfig {
    /// Operator allow-list: addresses inside these networks are allowed whatever their
    /// class (e.g. `127.0.0.1/32` for a local receiver). Empty by default.
    pub allow: Vec<IpNet>,
    /// Refuse plain `http` URLs.
    pub https_only: bool,
    /// Bound on establishing a connection (resolution, TCP and TLS handshake).
    pub connect_timeout: Duration,
    /// Total deadline for a request, from connecting until the response body has been
    /// read (a body read after it expires fails as a timeout).
    pub request_timeout: Duration,
    /// Extra trusted CAs on top of the built-in web roots (private CAs, tests).
    pub extra_root_certs: Vec<reqwest::Certificate>,
    /// User-Agent header sent with every request.
    pub user_agent: String,
}

impl Default for EgressConfig {
    fn default() -> Self {
        Self {
            allow: Vec::new(),
            https_only: false,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(15),
            extra_root_certs: Vec::new(),
            user_agent: concat!("webhook-gateway/", env!("CARGO_PKG_VERSION")).to_owned(),
        }
    }
}

/// Why a URL or address is not allowed as a destination.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The host is, or resolved to, an address outside policy.
    #[error("forbidden_address: {addr} is {class}")]
    ForbiddenAddress {
        /// The offending address, as given or as resolved.
        addr: IpAddr,
        /// Why it is forbidden.
        class: AddressClass,
    },
    /// Not `http`/`https`, or `http` while `https_only` is set.
    #[error("forbidden_scheme: {0}")]
    Scheme(String),
    /// The URL cannot be a delivery target (e.g. no host).
    #[error("invalid_url: {0}")]
    InvalidUrl(String),
}

impl Refusal {
    /// Stable machine-readable reason: `forbidden_address`, `forbidden_scheme` or
    /// `invalid_url`.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Refusal::ForbiddenAddress { .. } => ErrorKind::ForbiddenAddress,
            Refusal::Scheme(_) => ErrorKind::ForbiddenScheme,
            Refusal::InvalidUrl(_) => ErrorKind::InvalidUrl,
        }
    }
}

/// Why an attempt got no response, as `attempts.error_kind` stores it: an egress refusal
/// (nothing was sent) or a transport failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Refused: a resolved address is not allowed (private, loopback, ...).
    ForbiddenAddress,
    /// Refused: the scheme is not allowed.
    ForbiddenScheme,
    /// Refused: the URL cannot be a delivery target.
    InvalidUrl,
    /// Name resolution failed or returned no address.
    Dns,
    /// Connect or request timeout.
    Timeout,
    /// Connection refused, reset or unreachable.
    Connect,
    /// TLS handshake or certificate verification failed.
    Tls,
    /// Anything else (protocol errors, body errors, ...).
    Other,
    /// Not sent: the subscription's transformation failed (threw, returned nothing, or
    /// broke a bound).
    Transform,
}

crate::db::text_enum!(ErrorKind {
    ForbiddenAddress => "forbidden_address",
    ForbiddenScheme => "forbidden_scheme",
    InvalidUrl => "invalid_url",
    Dns => "dns",
    Timeout => "timeout",
    Connect => "connect",
    Tls => "tls",
    Other => "other",
    Transform => "transform",
});

/// Why [`EgressClient::post`] did not produce a response.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// Policy refused the URL or a resolved address; nothing was sent.
    #[error(transparent)]
    Refused(Refusal),
    /// Name resolution failed or returned no address.
    #[error("dns: {0}")]
    Dns(String),
    /// Connect or request timeout.
    #[error("timeout: {0}")]
    Timeout(String),
    /// Connection refused, reset or unreachable.
    #[error("connect: {0}")]
    Connect(String),
    /// TLS handshake or certificate verification failed.
    #[error("tls: {0}")]
    Tls(String),
    /// Anything else (protocol errors, body errors, ...).
    #[error("request: {0}")]
    Other(String),
}

impl SendError {
    /// Stable machine-readable kind for delivery records: `forbidden_address`,
    /// `forbidden_scheme`, `invalid_url`, `dns`, `timeout`, `connect`, `tls` or `other`.
    pub fn kind(&self) -> ErrorKind {
        match self {
            SendError::Refused(r) => r.kind(),
            SendError::Dns(_) => ErrorKind::Dns,
            SendError::Timeout(_) => ErrorKind::Timeout,
            SendError::Connect(_) => ErrorKind::Connect,
            SendError::Tls(_) => ErrorKind::Tls,
            SendError::Other(_) => ErrorKind::Other,
        }
    }
}

/// Checks one address against policy: allowed iff inside `allow` or public.
///
/// An IPv4-mapped address (`::ffff:a.b.c.d`) also matches IPv4 allow-list entries,
/// because the connection goes to the IPv4 address it carries.
pub fn check_addr(addr: IpAddr, allow: &[IpNet]) -> Result<(), Refusal> {
    let canonical = addr.to_canonical();
    if allow.iter().any(|net| net.contains(&addr) || net.contains(&canonical)) {
        return Ok(());
    }
    match classify(addr) {
        AddressClass::Public => Ok(()),
        class => Err(Refusal::ForbiddenAddress { addr, class }),
    }
}

/// A static policy check usable without a client (endpoint creation in the admin API).
///
/// Checks the scheme (`http`/`https`, only `https` when `https_only`), that there is a
/// host, and classifies IP-literal hosts. Host names pass here: they are checked
/// address by address when they are resolved for a connection.
pub fn check_url_static(url: &Url, allow: &[IpNet], https_only: bool) -> Result<(), Refusal> {
    match url.scheme() {
        "https" => {}
        "http" if !https_only => {}
        "http" => return Err(Refusal::Scheme("http (only https is allowed)".to_owned())),
        other => return Err(Refusal::Scheme(other.to_owned())),
    }
    match url.host() {
        None => Err(Refusal::InvalidUrl("missing host".to_owned())),
        Some(Host::Ipv4(v4)) => check_addr(IpAddr::V4(v4), allow),
        Some(Host::Ipv6(v6)) => check_addr(IpAddr::V6(v6), allow),
        // `url` parses every IPv4 spelling of http(s) hosts, so an IP here would be a
        // parser gap; the connector would then skip our resolver, so check it here.
        Some(Host::Domain(name)) => match name.parse::<IpAddr>() {
            Ok(ip) => check_addr(ip, allow),
            Err(_) if name.is_empty() => Err(Refusal::InvalidUrl("empty host".to_owned())),
            Err(_) => Ok(()),
        },
    }
}
