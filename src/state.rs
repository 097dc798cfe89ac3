//! What every handler (the admin API's and the console's) shares: [`AppState`].

use std::sync::Arc;
use std::time::Duration;

use crate::db::Pool;
use ipnet::IpNet;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::Notify;
use url::Url;

use crate::egress;
use crate::error::ApiError;
use crate::ingest::Intake;
use crate::secrets::Keyring;

/// State shared by every handler: one reference count to clone. Every request clones it
/// once per middleware layer and again for its handler (axum's `State`); as a struct of
/// reference-counted fields that was about twenty atomic increments and decrements per
/// clone, shared by both cores (bench/PROFILE.md, "The gateway at high load").
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl AppState {
    /// The state of `shared`.
    pub fn new(shared: Shared) -> AppState {
        AppState(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// What [`AppState`] holds.
pub struct Shared {
    /// The database, for the admin API's reads and writes.
    pub pool: Pool,
    /// The bearer token every `/v1` call must present (`--admin-token`).
    pub admin_token: Arc<str>,
    /// Largest accepted request body in bytes (`--max-body-bytes`), also named in 413s.
    pub max_body_bytes: usize,
    /// Signalled when an admin call makes deliveries due (resume, test, recover,
    /// redeliver), so this process's idle workers claim at once.
    pub wake: Arc<Notify>,
    /// Operator-opened outbound ranges (`--egress-allow`): endpoint URLs that are IP
    /// literals in them are accepted.
    pub egress_allow: Arc<[IpNet]>,
    /// Refuse plain-http endpoint URLs (`--egress-https-only`).
    pub egress_https_only: bool,
    /// Parked deliveries released per second when an endpoint is resumed or recovered
    /// (`--circuit-release-per-sec`).
    pub release_per_sec: u32,
    /// The Prometheus exporter `GET /metrics` renders; `None`: that route answers 404.
    pub metrics: Option<PrometheusHandle>,
    /// Webhooks and published events go in through this (source cache, group commit).
    pub intake: Intake,
    /// How long a request waits for the database before answering 503 (`--db-timeout-secs`).
    pub db_timeout: Duration,
    /// How long a request's body may take to arrive and the request to be answered
    /// (`--http-request-timeout-secs`), else 408.
    pub request_timeout: Duration,
    /// Seals source and endpoint secrets before they are stored, opens them when read.
    pub secrets: Keyring,
    /// The in-flight cap of endpoints without their own (`--endpoint-max-in-flight`).
    pub default_max_in_flight: i32,
    /// Set when the process begins to stop: `/readyz` answers 503 and every answer closes
    /// its connection, while requests are still served (the drain).
    pub draining: Arc<std::sync::atomic::AtomicBool>,
    /// Whether the gateway publishes its own events (`crate::operational`).
    pub operational_events: bool,
    /// The webhook bodies this process may hold at once (`crate::ingest::budget`).
    pub ingest_budget: crate::ingest::MemoryBudget,
}

impl Shared {
    /// Validate an endpoint URL as typed by an operator: parseable, http(s), with a host,
    /// and not an IP literal in a forbidden range. Host names are checked at send time,
    /// because DNS changes.
    pub fn check_endpoint_url(&self, raw: &str) -> Result<Url, ApiError> {
        let url = Url::parse(raw).map_err(|e| ApiError::validation("url", format!("not a valid URL: {e}")))?;
        // Credentials in a URL would be stored, shown by every GET and list, logged with
        // transport errors, and sent as Basic auth: refused.
        if !url.username().is_empty() || url.password().is_some() {
            return Err(ApiError::validation(
                "url",
                "must not carry credentials (user:password@host); subscribers authenticate the gateway by its \
                 signature",
            ));
        }
        egress::check_url_static(&url, &self.egress_allow, self.egress_https_only)
            .map_err(|refusal| ApiError::validation("url", refusal))?;
        Ok(url)
    }
}
