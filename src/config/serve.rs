//! From parsed `serve` arguments to checked settings: the `--config` file merged under
//! the command line and environment, every value validated once, and the settings each
//! subsystem is started with.

use clap::ArgMatches;
use clap::parser::ValueSource;

use super::*;

/// Widest `--egress-allow` prefix accepted without `--egress-allow-wide` (either family):
/// a /8 is a whole private network (`10.0.0.0/8`, `fd00::/8`); anything wider is most
/// likely a mistake that opens the metadata service and every internal host.
pub const EGRESS_ALLOW_WIDEST_PREFIX: u8 = 8;

/// IPv6 ranges whose addresses carry an IPv4 address that a connection may reach:
/// IPv4-mapped (`::ffff:a.b.c.d`, connected to as the IPv4 address), NAT64 (well-known
/// and local-use prefixes), 6to4 and Teredo. An allow entry inside or over one of them
/// opens IPv4 hosts under another spelling, whatever its prefix length: a "narrow"
/// `::ffff:0:0/96` is all of IPv4, metadata service included.
const IPV4_CARRYING: [&str; 5] = ["::ffff:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48", "2002::/16", "2001::/32"];

/// An allow-list entry with host bits set (`127.0.0.1/0`) silently means its whole
/// network: refused, with the two readings spelled out. A range wider than
/// [`EGRESS_ALLOW_WIDEST_PREFIX`], or one that reaches IPv4 hosts through an IPv6
/// spelling ([`IPV4_CARRYING`]), needs `wide` (`--egress-allow-wide`).
fn validate_egress_allow(allow: &[ipnet::IpNet], wide: bool) -> Result<(), ConfigError> {
    for net in allow {
        if let (ipnet::IpNet::V6(v6), false) = (net, wide) {
            let carrying = IPV4_CARRYING.iter().filter_map(|r| r.parse::<ipnet::Ipv6Net>().ok());
            if let Some(range) = carrying.into_iter().find(|r| r.contains(&v6.network()) || v6.contains(&r.network())) {
                let instead = match (v6.addr().to_ipv4_mapped(), v6.prefix_len().checked_sub(96)) {
                    (Some(v4), Some(len)) if range.prefix_len() == 96 && v6.prefix_len() >= 96 => {
                        format!("write the IPv4 range {}/{len} instead (a mapped address matches it too)", v4)
                    }
                    _ => "allow the IPv4 range you mean instead".to_owned(),
                };
                return Err(ConfigError(format!(
                    "egress-allow {net} covers IPv6 addresses that carry IPv4 addresses ({range}), so it would open IPv4 \
                     hosts under another spelling (cloud metadata included): {instead}, or confirm with \
                     --egress-allow-wide"
                )));
            }
        }
        if net.addr() != net.network() {
            return Err(ConfigError(format!(
                "egress-allow {net} has host bits set, so it would open all of {}: write {} for that network, or {}/{} \
                 for the one address",
                net.trunc(),
                net.trunc(),
                net.addr(),
                net.max_prefix_len()
            )));
        }
        if net.prefix_len() < EGRESS_ALLOW_WIDEST_PREFIX && !wide {
            return Err(ConfigError(format!(
                "egress-allow {net} is wider than /{EGRESS_ALLOW_WIDEST_PREFIX} and would open far more than one private \
                 network (cloud metadata included); narrow it, or confirm with --egress-allow-wide"
            )));
        }
    }
    Ok(())
}

/// What is wrong with a config file, where (the line and its key), and never the value:
/// a value written with the wrong type may be a secret (a key as a string where a list is
/// expected), and the message goes to a terminal or a journal. TOML's own message quotes
/// the value (`invalid type: string "...", expected a sequence`): that part is left out.
fn file_error(text: &str, error: &toml::de::Error) -> String {
    let message = error.message();
    let message = match (message.starts_with("invalid "), message.find(", expected ")) {
        (true, Some(expected)) => {
            let what = message.split(':').next().unwrap_or("invalid value");
            format!("{what} (the value is not shown){}", &message[expected..])
        }
        _ => message.to_owned(),
    };
    let Some(span) = error.span() else { return message };
    let line = text[..span.start.min(text.len())].lines().count().max(1);
    let key = text.lines().nth(line - 1).and_then(|l| l.split('=').next()).map(str::trim).filter(|k| !k.is_empty());
    match key {
        Some(key) => format!("line {line}, `{key}`: {message}"),
        None => format!("line {line}: {message}"),
    }
}

impl ServeArgs {
    /// Fill in values from `--config FILE` for every key not given on the command line or
    /// in the environment.
    pub fn merge_file(&mut self, matches: &ArgMatches) -> Result<(), ConfigError> {
        let Some(path) = self.config.clone() else {
            return Ok(());
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| ConfigError(format!("cannot read config file {}: {e}", path.display())))?;
        let file: FileConfig = toml::from_str(&text)
            .map_err(|e| ConfigError(format!("config file {}: {}", path.display(), file_error(&text, &e))))?;
        let given =
            |id: &str| matches!(matches.value_source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable));
        // A key and its file are one setting written two ways: given either way on the
        // command line or in the environment, the file's is not taken (it would be two
        // keys, refused, where the command line should win).
        let spellings = [("secrets_key", "secrets_key_file"), ("secrets_key_previous", "secrets_key_previous_file")];
        let explicit = |id: &str| {
            given(id) || spellings.iter().any(|&(key, file)| (id == key && given(file)) || (id == file && given(key)))
        };
        self.take_file(file, explicit);
        Ok(())
    }

    /// Check cross-field rules. Called once at start-up.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |m: String| Err(ConfigError(m));
        if let Some(endpoint) = &self.otel_endpoint {
            match url::Url::parse(endpoint) {
                Ok(url) if matches!(url.scheme(), "http" | "https") && url.has_host() => {}
                _ => return fail(format!("otel-endpoint must be an http(s) URL, got {endpoint:?}")),
            }
        }
        if self.max_body_bytes == 0 {
            return fail("max-body-bytes must be at least 1".into());
        }
        if self.workers == Some(0) {
            return fail("workers must be at least 1".into());
        }
        if let Some(threads) = self.runtime_threads
            && !(1..=MAX_RUNTIME_THREADS).contains(&threads)
        {
            return fail(format!("runtime-threads must be between 1 and {MAX_RUNTIME_THREADS}"));
        }
        if self.max_attempts == 0 {
            return fail("max-attempts must be at least 1".into());
        }
        if self.request_timeout_secs == 0 || self.connect_timeout_secs == 0 {
            return fail("connect-timeout-secs and request-timeout-secs must be at least 1".into());
        }
        // A lease shorter than a request lets a second worker send the same delivery while
        // the first still waits on the subscriber: the margin covers recording the outcome.
        let needed = self.request_timeout_secs + LEASE_MARGIN_SECS;
        if self.lease_secs < needed {
            return fail(format!(
                "lease-secs ({}) must be at least request-timeout-secs ({}) + {LEASE_MARGIN_SECS} s margin = {needed}",
                self.lease_secs, self.request_timeout_secs
            ));
        }
        if self.backoff_base_ms == 0 || self.backoff_cap_secs == 0 {
            return fail("backoff-base-ms and backoff-cap-secs must be at least 1".into());
        }
        if self.poll_interval_ms == 0 {
            return fail("poll-interval-ms must be at least 1".into());
        }
        if self.endpoint_max_in_flight.is_some_and(|n| !(1..=10_000).contains(&n)) {
            return fail("endpoint-max-in-flight must be between 1 and 10000".into());
        }
        if self.circuit_failure_threshold == 0 || self.circuit_cooldown_ms == 0 || self.circuit_release_per_sec == 0 {
            return fail(
                "circuit-failure-threshold, circuit-cooldown-ms and circuit-release-per-sec must be at least 1".into(),
            );
        }
        if self.metrics_sample_secs == 0 {
            return fail("metrics-sample-secs must be at least 1".into());
        }
        if self.db_pool_size < 2 {
            return fail("db-pool-size must be at least 2".into());
        }
        // Above the pool's acquire timeout: an answer "nothing was stored" (no connection
        // could be had) must be able to come before the request's own deadline.
        let min_db_timeout = crate::db::ACQUIRE_TIMEOUT.as_secs() + 1;
        if !(min_db_timeout..=MAX_DB_TIMEOUT_SECS).contains(&self.db_timeout_secs) {
            return fail(format!(
                "db-timeout-secs must be between {min_db_timeout} (above the {} s pool acquire timeout) and \
                 {MAX_DB_TIMEOUT_SECS}",
                crate::db::ACQUIRE_TIMEOUT.as_secs()
            ));
        }
        if let Some(token) = &self.admin_token
            && token.len() < 16
        {
            return fail("admin-token must be at least 16 characters".into());
        }
        validate_egress_allow(&self.egress_allow, self.egress_allow_wide)?;
        if !(1..=3600).contains(&self.http_header_timeout_secs) || !(1..=3600).contains(&self.http_request_timeout_secs)
        {
            return fail("http-header-timeout-secs and http-request-timeout-secs must be between 1 and 3600".into());
        }
        // The request's own deadline wraps the database's: with it shorter, a database that
        // does not answer would be reported as a slow request (408) instead of 503 with
        // what may have been stored.
        let db_bound = self.db_timeout_secs + crate::api::ADMIN_MARGIN.as_secs();
        if self.http_request_timeout_secs <= db_bound {
            return fail(format!(
                "http-request-timeout-secs ({}) must be above db-timeout-secs ({}) + {} s ({db_bound}): a request's own \
                 deadline would otherwise answer 408 before the database deadline can answer 503 (docs/deadlines.md)",
                self.http_request_timeout_secs,
                self.db_timeout_secs,
                crate::api::ADMIN_MARGIN.as_secs()
            ));
        }
        if self.http_max_connections == 0 {
            return fail("http-max-connections must be at least 1".into());
        }
        self.secrets.keyring()?;
        self.validate_retention()
    }

    fn validate_retention(&self) -> Result<(), ConfigError> {
        let fail = |m: String| Err(ConfigError(m));
        for (name, days) in [
            ("retention-events-days", self.retention_events_days),
            ("retention-attempts-days", self.retention_attempts_days),
            ("retention-delivered-days", self.retention_delivered_days),
            ("retention-audit-days", self.retention_audit_days),
        ] {
            if !(1..=MAX_RETENTION_DAYS).contains(&days) {
                return fail(format!("{name} must be between 1 and {MAX_RETENTION_DAYS}"));
            }
        }
        // Deleting an event deletes its deliveries and attempts: a longer window for them
        // would silently not hold.
        for (name, days) in [
            ("retention-attempts-days", self.retention_attempts_days),
            ("retention-delivered-days", self.retention_delivered_days),
        ] {
            if days > self.retention_events_days {
                return fail(format!(
                    "{name} ({days}) must not exceed retention-events-days ({}): deleting an event deletes its \
                     deliveries and attempts",
                    self.retention_events_days
                ));
            }
        }
        // At most daily: a larger value would look like retention while barely running.
        if !(1..=86_400).contains(&self.janitor_interval_secs) {
            return fail("janitor-interval-secs must be between 1 and 86400".into());
        }
        // Larger batches mean longer transactions and more rows locked at once.
        // The largest body must fit, counted as the budget counts it.
        let smallest = (self.max_body_bytes as u64 * crate::ingest::budget::COPIES).div_ceil(1024 * 1024);
        if self.ingest_memory_mib < smallest || self.ingest_memory_mib > 1024 * 1024 {
            return fail(format!(
                "ingest-memory-mib must be between {smallest} (four times --max-body-bytes) and 1048576"
            ));
        }
        if !(1..=1024 * 1024).contains(&self.delivery_memory_mib) {
            return fail("delivery-memory-mib must be between 1 and 1048576".into());
        }
        if !(1..=86_400 * 7).contains(&self.backlog_alert_secs) {
            return fail("backlog-alert-secs must be between 1 and 604800".into());
        }
        if self.refusals_alert_per_minute == 0 {
            return fail("refusals-alert-per-minute must be at least 1".into());
        }
        if !(1..=86_400).contains(&self.dead_letter_alert_window_secs) {
            return fail("dead-letter-alert-window-secs must be between 1 and 86400".into());
        }
        if !(1..=MAX_JANITOR_BATCH).contains(&self.janitor_batch_size) {
            return fail(format!("janitor-batch-size must be between 1 and {MAX_JANITOR_BATCH}"));
        }
        Ok(())
    }

    /// Concurrent deliveries for this process.
    pub fn worker_count(&self) -> usize {
        self.workers.unwrap_or_else(|| {
            DEFAULT_WORKERS_PER_CORE * std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2)
        })
    }

    /// The outbound client settings derived from the flags.
    pub fn egress(&self) -> crate::egress::EgressConfig {
        crate::egress::EgressConfig {
            allow: self.egress_allow.clone(),
            https_only: self.egress_https_only,
            connect_timeout: Duration::from_secs(self.connect_timeout_secs),
            request_timeout: Duration::from_secs(self.request_timeout_secs),
            ..Default::default()
        }
    }

    /// How long a stopping process keeps serving while it fails its readiness (see
    /// `--shutdown-drain-secs`).
    pub fn shutdown_drain(&self) -> Duration {
        let default = if self.database_url.is_some() { DEFAULT_DRAIN_SECS } else { 0 };
        Duration::from_secs(self.shutdown_drain_secs.unwrap_or(default))
    }

    /// The inbound HTTP limits derived from the flags.
    pub fn http(&self) -> crate::server::HttpLimits {
        crate::server::HttpLimits {
            header_timeout: Duration::from_secs(self.http_header_timeout_secs),
            request_timeout: Duration::from_secs(self.http_request_timeout_secs),
            max_connections: self.http_max_connections,
        }
    }

    /// The janitor (retention) settings derived from the flags.
    pub fn janitor(&self) -> JanitorSettings {
        let days = |d: u32| Duration::from_secs(u64::from(d) * 24 * 3600);
        JanitorSettings {
            events_retention: days(self.retention_events_days),
            attempts_retention: days(self.retention_attempts_days),
            delivered_retention: days(self.retention_delivered_days),
            audit_retention: days(self.retention_audit_days),
            interval: Duration::from_secs(self.janitor_interval_secs),
            batch_size: self.janitor_batch_size,
            ..JanitorSettings::default()
        }
    }

    /// What ingest indexes of each event (`--content-search`).
    pub fn indexing(&self) -> crate::search::Indexing {
        if self.content_search.0 { crate::search::Indexing::Content } else { crate::search::Indexing::KeyOnly }
    }

    /// The operational events' settings derived from the flags.
    pub fn operational(&self) -> crate::operational::OperationalSettings {
        crate::operational::OperationalSettings {
            enabled: self.operational_events.0,
            backlog_after: Duration::from_secs(self.backlog_alert_secs),
            refusals_per_minute: self.refusals_alert_per_minute,
            dead_letter_window: Duration::from_secs(self.dead_letter_alert_window_secs),
            events_retention: self.janitor().events_retention,
            // Three passes late, and at least an hour.
            retention_grace: (Duration::from_secs(self.janitor_interval_secs) * 3).max(Duration::from_secs(3600)),
            ..crate::operational::OperationalSettings::default()
        }
    }

    /// The delivery settings derived from the flags.
    pub fn delivery(&self) -> DeliverySettings {
        DeliverySettings {
            workers: self.worker_count(),
            lease: Duration::from_secs(self.lease_secs),
            max_attempts: self.max_attempts,
            backoff_base: Duration::from_millis(self.backoff_base_ms),
            backoff_cap: Duration::from_secs(self.backoff_cap_secs),
            retry_after_cap: Duration::from_secs(self.retry_after_cap_secs),
            poll_interval: Duration::from_millis(self.poll_interval_ms),
            shutdown_grace: Duration::from_secs(self.shutdown_grace_secs),
            endpoint_max_in_flight: match self.endpoint_max_in_flight {
                // Validated to 1-10000.
                Some(n) => i32::try_from(n).unwrap_or(i32::MAX),
                None => crate::queue::default_max_in_flight(self.worker_count()),
            },
            circuit: crate::circuit::CircuitConfig {
                failure_threshold: self.circuit_failure_threshold,
                cooldown: Duration::from_millis(self.circuit_cooldown_ms),
                cooldown_cap: Duration::from_secs(self.circuit_cooldown_cap_secs),
                release_per_sec: self.circuit_release_per_sec,
            },
            body_memory_bytes: self.delivery_memory_mib * 1024 * 1024,
        }
    }
}

/// Default `--shutdown-drain-secs` with a database URL: a balancer checking every 2 s
/// that needs two failures (HAProxy's `inter 2s fall 2`) has stopped sending by then.
pub const DEFAULT_DRAIN_SECS: u64 = 5;

/// Most runtime threads (`--runtime-threads`): far more than any machine's cores; a typo
/// such as 10000 is refused rather than spawning that many threads.
pub const MAX_RUNTIME_THREADS: usize = 1024;

/// Longest accepted retention, in days (a century: a typo guard, not a policy).
pub const MAX_RETENTION_DAYS: u32 = 36_500;

/// Largest accepted `--db-timeout-secs`.
pub const MAX_DB_TIMEOUT_SECS: u64 = 300;

/// Largest accepted `--janitor-batch-size`.
pub const MAX_JANITOR_BATCH: u32 = 100_000;

/// Margin between the request timeout and the lease, for recording the outcome.
pub const LEASE_MARGIN_SECS: u64 = 10;
