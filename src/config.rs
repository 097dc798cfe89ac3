//! Command line, environment and TOML configuration, validated once at start-up.
//!
//! Precedence: command line > environment > `--config FILE` > built-in default.
//! Every `serve` setting is declared once, in the `settings!` list below: its flag,
//! environment variable, default and `--help` text, and by its name its key in the TOML
//! file (the flag name with dashes replaced by underscores: `max_body_bytes = 2097152`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, Parser, Subcommand, ValueEnum};
use serde::Deserialize;

use crate::deliver::DeliverySettings;
use crate::janitor::{self, JanitorSettings};
use crate::role::Role;

/// Delivery workers per CPU core when `--workers` is not set. Outbound requests are async
/// tasks parked on sockets, so the limit is not the CPU but what subscribers and the
/// database see. A worker stays busy from claim to recorded outcome, so the workers one
/// endpoint needs are its rate × (its answer time + the claim and record round trips),
/// and under load the round trips grow. Measured on 2 cores (bench; peak RSS in
/// brackets):
/// - drain of 50,000 to one fast endpoint (which may use half the workers): 32 per core
///   2,840/s (16 MiB), 128 per core 5,958/s, 256 per core 8,773/s, 512 per core
///   11,246/s (27 MiB);
/// - sustained end to end (open loop, ingest and delivery in one process, bench
///   scenario 11): 256 per core held 4,000/s and fell behind at 5,000/s, where the one
///   endpoint sat at its limit of 256 in flight; 512 per core held 5,000/s (twice).
///
/// A worker costs memory only while it holds a delivery: the claimed row (body shared
/// with the request, not copied) and the connection's buffers. The bound is workers ×
/// the largest body (`--max-body-bytes`), reached only if every in-flight delivery
/// carries a maximum-size body; lower `--workers` where that matters.
pub const DEFAULT_WORKERS_PER_CORE: usize = 512;

/// The `webhook-gateway` command line.
#[derive(Debug, Parser)]
#[command(
    name = "webhook-gateway",
    version,
    about = "Durable webhook ingestion and delivery on PostgreSQL",
    after_help = "First run (no database to set up: a private PostgreSQL starts in ./.webhook-gateway):\n  \
                  webhook-gateway serve\n  \
                  # then in another terminal, in the same directory:\n  \
                  export WEBHOOK_GATEWAY_ADMIN_TOKEN=$(webhook-gateway admin-token show)\n  \
                  curl -sS http://127.0.0.1:8080/v1/sources -H \"Authorization: Bearer $WEBHOOK_GATEWAY_ADMIN_TOKEN\"\n\n\
                  `webhook-gateway serve --help` lists every setting (each also an environment variable and a \
                  --config file key).",
    args_override_self = true
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once at start-up; boxing buys nothing
pub enum Command {
    /// Run the gateway (ingest, admin API and delivery workers).
    Serve(ServeArgs),
    /// Apply database migrations to DATABASE_URL and exit.
    Migrate(MigrateArgs),
    /// Secrets at rest: `secrets reencrypt` rewrites every stored secret under the current key.
    Secrets(SecretsArgs),
    /// The generated admin token kept in --data-dir: `admin-token show` prints it, `admin-token rotate` replaces it.
    AdminToken(AdminTokenArgs),
}

/// `webhook-gateway admin-token`.
#[derive(Debug, Args)]
pub struct AdminTokenArgs {
    /// What to do.
    #[command(subcommand)]
    pub action: AdminTokenAction,

    /// The data directory `serve` uses (where the token is kept).
    #[arg(long, env = "WEBHOOK_GATEWAY_DATA_DIR", default_value = crate::db::DEFAULT_DATA_DIR, global = true)]
    pub data_dir: PathBuf,
}

/// `webhook-gateway admin-token ...` subcommands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Subcommand)]
pub enum AdminTokenAction {
    /// Print the token (only the token, for `export WEBHOOK_GATEWAY_ADMIN_TOKEN=$(webhook-gateway admin-token show)`).
    Show,
    /// Replace it with a fresh one and print it; a running gateway keeps the old one until it restarts.
    Rotate,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Pretty,
    /// One JSON object per line.
    Json,
}

/// `webhook-gateway migrate`.
#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// PostgreSQL connection URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
}

/// `webhook-gateway secrets`.
#[derive(Debug, Args)]
pub struct SecretsArgs {
    /// What to do.
    #[command(subcommand)]
    pub action: SecretsAction,
}

/// `webhook-gateway secrets ...` subcommands.
#[derive(Debug, Subcommand)]
pub enum SecretsAction {
    /// Rewrite every stored source and endpoint secret under the current key (plaintext ones
    /// and those under a previous key), in short transactions; safe to repeat and to run
    /// while the gateway serves (with the embedded database: stop the gateway first).
    Reencrypt(ReencryptArgs),
}

/// `webhook-gateway secrets reencrypt`.
#[derive(Debug, Args)]
pub struct ReencryptArgs {
    /// PostgreSQL connection URL. Unset: the embedded cluster in --data-dir (gateway stopped).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// Where the embedded PostgreSQL cluster lives (used only without a database URL).
    #[arg(long, env = "WEBHOOK_GATEWAY_DATA_DIR", default_value = crate::db::DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,

    /// Rows rewritten per transaction.
    #[arg(long, default_value_t = 100)]
    pub batch_size: u32,

    /// The keys: the current one encrypts, previous ones only decrypt.
    #[command(flatten)]
    pub keys: SecretsKeyArgs,
}

/// Declares the `serve` settings once. A setting is one field: its doc comment is its
/// `--help` text, its `#[arg]` its flag, environment variable and default, its name its
/// key in the `--config` file. From the one list this generates:
///
/// - the clap structs: `ServeArgs` (its first field, `config`, ended by `;`, is the file's
///   own path and no setting) and the group of settings it flattens last (the secrets keys,
///   also flattened into `secrets reencrypt`, which reads no file);
/// - `FileConfig`: every setting as an optional key, unknown keys refused;
/// - `ServeArgs::take_file`: the file's value of every setting given neither on the
///   command line nor in the environment;
/// - for the tests, `ServeArgs::settings`: every setting with a way to read it back
///   (`tests::every_setting_is_reachable_from_the_command_line_the_environment_and_the_file`).
macro_rules! settings {
    (
        $(#[$serve_meta:meta])*
        pub struct $serve:ident {
            $(#[$config_meta:meta])*
            pub config: Option<PathBuf>;
            $( $(#[$meta:meta])* pub $field:ident: $ty:ty, )+
        }

        $(#[$group_meta:meta])*
        pub struct $group_ty:ident flattened as $group:ident {
            $( $(#[$group_field_meta:meta])* pub $group_field:ident: $group_field_ty:ty, )+
        }
    ) => {
        $(#[$serve_meta])*
        pub struct $serve {
            $(#[$config_meta])*
            pub config: Option<PathBuf>,
            $( $(#[$meta])* pub $field: $ty, )+
            #[doc = concat!("The settings declared with [`", stringify!($group_ty), "`].")]
            #[command(flatten)]
            pub $group: $group_ty,
        }

        $(#[$group_meta])*
        pub struct $group_ty {
            $( $(#[$group_field_meta])* pub $group_field: $group_field_ty, )+
        }

        /// The `--config` file: every setting's name is a key, every key optional; unknown
        /// keys are an error (typos must not pass).
        #[derive(Debug, Default, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        struct FileConfig {
            $( $field: Option<$ty>, )+
            $( $group_field: Option<$group_field_ty>, )+
        }

        impl $serve {
            /// Take the file's value of every setting for which `explicit` (given on the
            /// command line or in the environment) is false.
            fn take_file(&mut self, file: FileConfig, explicit: impl Fn(&str) -> bool) {
                $(
                    if let Some(value) = file.$field
                        && !explicit(stringify!($field))
                    {
                        self.$field = value;
                    }
                )+
                $(
                    if let Some(value) = file.$group_field
                        && !explicit(stringify!($group_field))
                    {
                        self.$group.$group_field = value;
                    }
                )+
            }

            /// Every setting, as the reachability test drives it.
            #[cfg(test)]
            fn settings() -> Vec<tests::Setting> {
                vec![
                    $( tests::Setting::new::<$ty>(stringify!($field), |s| format!("{:?}", s.$field)), )+
                    $(
                        tests::Setting::new::<$group_field_ty>(stringify!($group_field), |s| {
                            format!("{:?}", s.$group.$group_field)
                        }),
                    )+
                ]
            }
        }
    };
}

settings! {
    /// `webhook-gateway serve`.
    #[derive(Debug, Clone, Args)]
    pub struct ServeArgs {
        /// TOML file with the same keys as the flags (underscores for dashes).
        #[arg(long, env = "WEBHOOK_GATEWAY_CONFIG")]
        pub config: Option<PathBuf>;

        /// Address to listen on.
        #[arg(long, env = "WEBHOOK_GATEWAY_LISTEN", default_value = "127.0.0.1:8080")]
        pub listen: SocketAddr,

        /// PostgreSQL connection URL. Unset: start a private PostgreSQL cluster in --data-dir.
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        pub database_url: Option<String>,

        /// Where the embedded PostgreSQL cluster (<data-dir>/pg, without a database URL) and the generated admin
        /// token (without --admin-token) are kept.
        #[arg(long, env = "WEBHOOK_GATEWAY_DATA_DIR", default_value = crate::db::DEFAULT_DATA_DIR)]
        pub data_dir: PathBuf,

        /// Bearer token for the admin API (16+ characters). Unset: one is generated on the first start and kept in
        /// <data-dir>/admin-token (0600); `webhook-gateway admin-token show` prints it.
        #[arg(long, env = "WEBHOOK_GATEWAY_ADMIN_TOKEN", hide_env_values = true)]
        pub admin_token: Option<String>,

        /// Largest accepted request body, in bytes.
        #[arg(long, env = "WEBHOOK_GATEWAY_MAX_BODY_BYTES", default_value_t = 1024 * 1024)]
        pub max_body_bytes: usize,

        /// Which parts to run.
        #[arg(long, env = "WEBHOOK_GATEWAY_ROLE", value_enum, default_value = "all")]
        pub role: Role,

        /// Concurrent outbound deliveries per process. Default: 512 per CPU core (each is an
        /// async task waiting on a socket, not a thread).
        #[arg(long, env = "WEBHOOK_GATEWAY_WORKERS")]
        pub workers: Option<usize>,

        /// Concurrent requests per endpoint across every replica, for endpoints without their
        /// own `max_in_flight`. Default: half of this process's workers.
        #[arg(long, env = "WEBHOOK_GATEWAY_ENDPOINT_MAX_IN_FLIGHT")]
        pub endpoint_max_in_flight: Option<u32>,

        /// Lease on a claimed delivery, in seconds; must exceed the request timeout plus margin.
        #[arg(long, env = "WEBHOOK_GATEWAY_LEASE_SECS", default_value_t = 60)]
        pub lease_secs: u64,

        /// Outbound connect timeout, in seconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_CONNECT_TIMEOUT_SECS", default_value_t = 5)]
        pub connect_timeout_secs: u64,

        /// Outbound whole-request timeout, in seconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_REQUEST_TIMEOUT_SECS", default_value_t = 15)]
        pub request_timeout_secs: u64,

        /// Attempts per delivery before it is dead-lettered.
        #[arg(long, env = "WEBHOOK_GATEWAY_MAX_ATTEMPTS", default_value_t = 8)]
        pub max_attempts: u32,

        /// Backoff base, in milliseconds (full jitter: random(0, min(cap, base * 2^attempt))).
        #[arg(long, env = "WEBHOOK_GATEWAY_BACKOFF_BASE_MS", default_value_t = 5_000)]
        pub backoff_base_ms: u64,

        /// Backoff cap, in seconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_BACKOFF_CAP_SECS", default_value_t = 6 * 3600)]
        pub backoff_cap_secs: u64,

        /// Longest Retry-After the gateway honours, in seconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_RETRY_AFTER_CAP_SECS", default_value_t = 24 * 3600)]
        pub retry_after_cap_secs: u64,

        /// How often idle workers look for due deliveries, in milliseconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_POLL_INTERVAL_MS", default_value_t = 250)]
        pub poll_interval_ms: u64,

        /// On shutdown, how long in-flight deliveries may take to finish, in seconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_SHUTDOWN_GRACE_SECS", default_value_t = 20)]
        pub shutdown_grace_secs: u64,

        /// Open an outbound address range (CIDR), e.g. 127.0.0.1/32. Repeatable; env is comma-separated.
        /// Host bits must be zero; ranges wider than /8 need --egress-allow-wide.
        #[arg(long = "egress-allow", env = "WEBHOOK_GATEWAY_EGRESS_ALLOW", value_delimiter = ',')]
        pub egress_allow: Vec<ipnet::IpNet>,

        /// Confirm --egress-allow ranges wider than /8 (e.g. 0.0.0.0/0 opens every address).
        #[arg(long, env = "WEBHOOK_GATEWAY_EGRESS_ALLOW_WIDE")]
        pub egress_allow_wide: bool,

        /// Refuse plain-http endpoints.
        #[arg(long, env = "WEBHOOK_GATEWAY_EGRESS_HTTPS_ONLY")]
        pub egress_https_only: bool,

        /// Consecutive retryable failures that open an endpoint's circuit.
        #[arg(long, env = "WEBHOOK_GATEWAY_CIRCUIT_FAILURE_THRESHOLD", default_value_t = 5)]
        pub circuit_failure_threshold: u32,

        /// First circuit cool-down, in milliseconds; doubles with each re-open.
        #[arg(long, env = "WEBHOOK_GATEWAY_CIRCUIT_COOLDOWN_MS", default_value_t = 30_000)]
        pub circuit_cooldown_ms: u64,

        /// Longest circuit cool-down, in seconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_CIRCUIT_COOLDOWN_CAP_SECS", default_value_t = 600)]
        pub circuit_cooldown_cap_secs: u64,

        /// Parked deliveries released per second when a circuit closes or an endpoint resumes.
        #[arg(long, env = "WEBHOOK_GATEWAY_CIRCUIT_RELEASE_PER_SEC", default_value_t = 200)]
        pub circuit_release_per_sec: u32,

        /// How often queue depth, lag and circuit gauges are sampled from the database, seconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_METRICS_SAMPLE_SECS", default_value_t = 15)]
        pub metrics_sample_secs: u64,

        /// PostgreSQL connections per process.
        #[arg(long, env = "WEBHOOK_GATEWAY_DB_POOL_SIZE", default_value_t = 16)]
        pub db_pool_size: u32,

        /// How long an HTTP request (ingest, admin API) waits for the database before it is
        /// answered 503 with Retry-After, in seconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_DB_TIMEOUT_SECS", default_value_t = crate::db::DEFAULT_REQUEST_TIMEOUT.as_secs())]
        pub db_timeout_secs: u64,

        /// Seconds a client has to send a request's headers, counted from when its connection is
        /// ready for a request (so also the keep-alive idle limit).
        #[arg(long, env = "WEBHOOK_GATEWAY_HTTP_HEADER_TIMEOUT_SECS", default_value_t = 10)]
        pub http_header_timeout_secs: u64,

        /// Seconds a request's body may take to arrive and the request to be answered (408 past it).
        #[arg(long, env = "WEBHOOK_GATEWAY_HTTP_REQUEST_TIMEOUT_SECS", default_value_t = 30)]
        pub http_request_timeout_secs: u64,

        /// Inbound connections open at once; at the cap new ones wait to be accepted.
        #[arg(long, env = "WEBHOOK_GATEWAY_HTTP_MAX_CONNECTIONS", default_value_t = 1024)]
        pub http_max_connections: usize,

        /// Log format (on stderr). `pretty` is coloured only on a terminal, and never with NO_COLOR set.
        #[arg(long, env = "WEBHOOK_GATEWAY_LOG_FORMAT", value_enum, default_value = "pretty")]
        pub log_format: LogFormat,

        /// OTLP/HTTP collector for traces, a base URL as OTEL_EXPORTER_OTLP_ENDPOINT takes it (spans go to
        /// <url>/v1/traces); wins over the OTEL_EXPORTER_OTLP_*ENDPOINT variables. Unset: traces only when those
        /// are set. The other OTEL_* variables apply either way.
        #[arg(long, env = "WEBHOOK_GATEWAY_OTEL_ENDPOINT")]
        pub otel_endpoint: Option<String>,

        /// Days an event is kept, with its deliveries and attempts; never while a delivery is pending.
        #[arg(long, env = "WEBHOOK_GATEWAY_RETENTION_EVENTS_DAYS", default_value_t = janitor::DEFAULT_RETENTION_EVENTS_DAYS)]
        pub retention_events_days: u32,

        /// Days an attempt record is kept.
        #[arg(long, env = "WEBHOOK_GATEWAY_RETENTION_ATTEMPTS_DAYS", default_value_t = janitor::DEFAULT_RETENTION_ATTEMPTS_DAYS)]
        pub retention_attempts_days: u32,

        /// Days a delivered delivery is kept (a dead one stays until its event expires).
        #[arg(long, env = "WEBHOOK_GATEWAY_RETENTION_DELIVERED_DAYS", default_value_t = janitor::DEFAULT_RETENTION_DELIVERED_DAYS)]
        pub retention_delivered_days: u32,

        /// How often each replica tries a retention pass (one replica at a time does it), in seconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_JANITOR_INTERVAL_SECS", default_value_t = janitor::DEFAULT_INTERVAL_SECS)]
        pub janitor_interval_secs: u64,

        /// Rows per retention delete statement (each its own short transaction).
        #[arg(long, env = "WEBHOOK_GATEWAY_JANITOR_BATCH_SIZE", default_value_t = janitor::DEFAULT_BATCH_SIZE)]
        pub janitor_batch_size: u32,

        /// Serve the web console at /console (sign in with the admin token); `--console=false`
        /// turns it off.
        #[arg(long, env = "WEBHOOK_GATEWAY_CONSOLE", default_value_t = Enabled(true), action = clap::ArgAction::Set)]
        pub console: Enabled,
    }

    /// The operator key that encrypts source and endpoint secrets at rest (see
    /// [`crate::secrets`]). Shared by `serve` and `secrets reencrypt`; `Debug` shows no key.
    #[derive(Clone, Default, Args)]
    pub struct SecretsKeyArgs flattened as secrets {
        /// Key that encrypts source and endpoint secrets in the database: 32 bytes in base64
        /// (`openssl rand -base64 32`). Unset: secrets are stored in plaintext.
        #[arg(long, env = "WEBHOOK_GATEWAY_SECRETS_KEY", hide_env_values = true)]
        pub secrets_key: Option<String>,

        /// File holding the secrets key (instead of --secrets-key).
        #[arg(long, env = "WEBHOOK_GATEWAY_SECRETS_KEY_FILE")]
        pub secrets_key_file: Option<PathBuf>,

        /// Earlier secrets key(s), decrypt only, during a rotation. Repeatable; env is comma-separated.
        #[arg(long, env = "WEBHOOK_GATEWAY_SECRETS_KEY_PREVIOUS", hide_env_values = true, value_delimiter = ',')]
        pub secrets_key_previous: Vec<String>,

        /// File(s) holding earlier secrets keys (instead of --secrets-key-previous). Repeatable; env is comma-separated.
        #[arg(long, env = "WEBHOOK_GATEWAY_SECRETS_KEY_PREVIOUS_FILE", value_delimiter = ',')]
        pub secrets_key_previous_file: Vec<PathBuf>,
    }
}

impl std::fmt::Debug for SecretsKeyArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretsKeyArgs")
            .field("secrets_key", &self.secrets_key.as_ref().map(|_| "<hidden>"))
            .field("secrets_key_file", &self.secrets_key_file)
            .field("secrets_key_previous", &self.secrets_key_previous.len())
            .field("secrets_key_previous_file", &self.secrets_key_previous_file)
            .finish()
    }
}

impl SecretsKeyArgs {
    /// The keyring these settings describe (reads the key file).
    pub fn keyring(&self) -> Result<crate::secrets::Keyring, ConfigError> {
        crate::secrets::keyring_from(
            self.secrets_key.as_deref(),
            self.secrets_key_file.as_deref(),
            &self.secrets_key_previous,
            &self.secrets_key_previous_file,
        )
        .map_err(ConfigError)
    }
}

/// Widest `--egress-allow` prefix accepted without `--egress-allow-wide` (either family):
/// a /8 is a whole private network (`10.0.0.0/8`, `fd00::/8`); anything wider is most
/// likely a mistake that opens the metadata service and every internal host.
pub const EGRESS_ALLOW_WIDEST_PREFIX: u8 = 8;

/// An allow-list entry with host bits set (`127.0.0.1/0`) silently means its whole
/// network: refused, with the two readings spelled out. A range wider than
/// [`EGRESS_ALLOW_WIDEST_PREFIX`] needs `wide` (`--egress-allow-wide`).
fn validate_egress_allow(allow: &[ipnet::IpNet], wide: bool) -> Result<(), ConfigError> {
    for net in allow {
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

/// An on/off setting whose default is on: written `--flag=false` on the command line,
/// `false` in the environment, `flag = false` in the file. (A plain `bool` setting is a
/// bare flag that can only turn something on.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Enabled(pub bool);

impl std::str::FromStr for Enabled {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "true" | "on" | "yes" | "1" => Ok(Enabled(true)),
            "false" | "off" | "no" | "0" => Ok(Enabled(false)),
            _ => Err(format!("expected true or false, not {s:?}")),
        }
    }
}

impl std::fmt::Display for Enabled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A configuration problem, reported as one line and a non-zero exit.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl ServeArgs {
    /// Fill in values from `--config FILE` for every key not given on the command line or
    /// in the environment.
    pub fn merge_file(&mut self, matches: &ArgMatches) -> Result<(), ConfigError> {
        let Some(path) = self.config.clone() else {
            return Ok(());
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| ConfigError(format!("cannot read config file {}: {e}", path.display())))?;
        let file: FileConfig = toml::from_str(&text).map_err(|e| {
            let msg = e.message().to_owned();
            ConfigError(format!("config file {}: {msg}", path.display()))
        })?;
        let explicit =
            |id: &str| matches!(matches.value_source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable));
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
            interval: Duration::from_secs(self.janitor_interval_secs),
            batch_size: self.janitor_batch_size,
            ..JanitorSettings::default()
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
        }
    }
}

/// Longest accepted retention, in days (a century: a typo guard, not a policy).
pub const MAX_RETENTION_DAYS: u32 = 36_500;

/// Largest accepted `--db-timeout-secs`.
pub const MAX_DB_TIMEOUT_SECS: u64 = 300;

/// Largest accepted `--janitor-batch-size`.
pub const MAX_JANITOR_BATCH: u32 = 100_000;

/// Margin between the request timeout and the lease, for recording the outcome.
pub const LEASE_MARGIN_SECS: u64 = 10;

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches};

    fn parse(args: &[&str]) -> Result<ServeArgs, String> {
        let matches = Cli::command().try_get_matches_from(args).map_err(|e| e.to_string())?;
        let cli = Cli::from_arg_matches(&matches).map_err(|e| e.to_string())?;
        let Command::Serve(mut serve) = cli.command else { return Err("not serve".into()) };
        let (_, sub) = matches.subcommand().ok_or("no subcommand")?;
        serve.merge_file(sub).map_err(|e| e.to_string())?;
        serve.validate().map_err(|e| e.to_string())?;
        Ok(serve)
    }

    #[test]
    fn defaults_are_valid() {
        let serve = parse(&["webhook-gateway", "serve"]).unwrap();
        assert_eq!(serve.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(serve.max_body_bytes, 1024 * 1024);
        assert_eq!(serve.lease_secs, 60);
        assert!(serve.egress_allow.is_empty());
    }

    #[test]
    fn egress_allow_refuses_host_bits_and_unconfirmed_wide_ranges() {
        let allow = |args: &[&str]| {
            let mut all = vec!["webhook-gateway", "serve"];
            all.extend_from_slice(args);
            parse(&all)
        };
        let err = allow(&["--egress-allow", "127.0.0.1/0"]).unwrap_err();
        assert!(err.contains("host bits") && err.contains("0.0.0.0/0") && err.contains("127.0.0.1/32"), "{err}");
        let err = allow(&["--egress-allow", "10.1.2.3/24"]).unwrap_err();
        assert!(err.contains("10.1.2.0/24") && err.contains("10.1.2.3/32"), "{err}");
        assert!(allow(&["--egress-allow", "fd00::1/8"]).unwrap_err().contains("fd00::/8"));
        for wide in ["0.0.0.0/0", "::/0", "8.0.0.0/7", "fc00::/7"] {
            let err = allow(&["--egress-allow", wide]).unwrap_err();
            assert!(err.contains("--egress-allow-wide"), "{wide}: {err}");
            allow(&["--egress-allow", wide, "--egress-allow-wide"]).unwrap();
        }
        for fine in ["10.0.0.0/8", "192.168.1.0/24", "127.0.0.1/32", "fd00::/8", "::1/128"] {
            allow(&["--egress-allow", fine]).unwrap();
        }
    }

    #[test]
    fn an_otel_endpoint_must_be_an_http_url() {
        assert!(parse(&["webhook-gateway", "serve", "--otel-endpoint", "http://collector:4318"]).is_ok());
        for bad in ["collector:4318", "grpc://collector:4317", "http://"] {
            let err = parse(&["webhook-gateway", "serve", "--otel-endpoint", bad]).unwrap_err();
            assert!(err.contains("otel-endpoint must be an http(s) URL"), "{bad}: {err}");
        }
    }

    #[test]
    fn lease_shorter_than_timeout_is_refused() {
        let err =
            parse(&["webhook-gateway", "serve", "--lease-secs", "20", "--request-timeout-secs", "15"]).unwrap_err();
        assert!(err.contains("lease-secs (20) must be at least"), "{err}");
    }

    #[test]
    fn file_fills_only_what_the_command_line_left_unset() {
        let dir = std::env::temp_dir().join(format!("wg-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gw.toml");
        std::fs::write(&path, "listen = \"127.0.0.1:9999\"\nmax_body_bytes = 42\negress_allow = [\"127.0.0.1/32\"]\n")
            .unwrap();
        let serve =
            parse(&["webhook-gateway", "serve", "--config", path.to_str().unwrap(), "--max-body-bytes", "7"]).unwrap();
        assert_eq!(serve.listen.to_string(), "127.0.0.1:9999");
        assert_eq!(serve.max_body_bytes, 7);
        assert_eq!(serve.egress_allow.len(), 1);

        std::fs::write(&path, "lisen = \"127.0.0.1:1\"\n").unwrap();
        let err = parse(&["webhook-gateway", "serve", "--config", path.to_str().unwrap()]).unwrap_err();
        assert!(err.contains("unknown field `lisen`"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn db_timeout_defaults_validates_and_comes_from_the_file() {
        let serve = parse(&["webhook-gateway", "serve"]).unwrap();
        assert_eq!(serve.db_timeout_secs, 5);
        let err = parse(&["webhook-gateway", "serve", "--db-timeout-secs", "3"]).unwrap_err();
        assert!(
            err.contains("db-timeout-secs must be between 4 (above the 3 s pool acquire timeout) and 300"),
            "{err}"
        );
        let err = parse(&["webhook-gateway", "serve", "--db-timeout-secs", "301"]).unwrap_err();
        assert!(err.contains("db-timeout-secs must be between"), "{err}");

        let dir = std::env::temp_dir().join(format!("wg-config-db-timeout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gw.toml");
        std::fs::write(&path, "db_timeout_secs = 10\n").unwrap();
        let serve = parse(&["webhook-gateway", "serve", "--config", path.to_str().unwrap()]).unwrap();
        assert_eq!(serve.db_timeout_secs, 10);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn retention_flags_default_validate_and_come_from_the_file() {
        let serve = parse(&["webhook-gateway", "serve"]).unwrap();
        let janitor = serve.janitor();
        assert_eq!(janitor.events_retention, Duration::from_secs(30 * 86_400));
        assert_eq!(janitor.attempts_retention, Duration::from_secs(30 * 86_400));
        assert_eq!(janitor.delivered_retention, Duration::from_secs(7 * 86_400));
        assert_eq!(janitor.interval, Duration::from_secs(300));
        assert_eq!(janitor.batch_size, 5000);

        let err = parse(&["webhook-gateway", "serve", "--retention-delivered-days", "31"]).unwrap_err();
        assert!(err.contains("retention-delivered-days (31) must not exceed retention-events-days (30)"), "{err}");
        let err = parse(&["webhook-gateway", "serve", "--retention-attempts-days", "0"]).unwrap_err();
        assert!(err.contains("retention-attempts-days must be between 1 and"), "{err}");
        let err = parse(&["webhook-gateway", "serve", "--janitor-batch-size", "0"]).unwrap_err();
        assert!(err.contains("janitor-batch-size must be between 1 and"), "{err}");
        let err = parse(&["webhook-gateway", "serve", "--janitor-interval-secs", "0"]).unwrap_err();
        assert!(err.contains("janitor-interval-secs must be between 1 and 86400"), "{err}");

        let dir = std::env::temp_dir().join(format!("wg-config-retention-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gw.toml");
        std::fs::write(
            &path,
            "retention_events_days = 90\nretention_attempts_days = 14\nretention_delivered_days = 3\n\
             janitor_interval_secs = 60\njanitor_batch_size = 1000\n",
        )
        .unwrap();
        let serve =
            parse(&["webhook-gateway", "serve", "--config", path.to_str().unwrap(), "--retention-delivered-days", "2"])
                .unwrap();
        assert_eq!(
            (serve.retention_events_days, serve.retention_attempts_days, serve.retention_delivered_days),
            (90, 14, 2)
        );
        assert_eq!((serve.janitor_interval_secs, serve.janitor_batch_size), (60, 1000));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_secrets_key_comes_from_a_flag_a_file_or_the_config_file_and_is_checked() {
        let key = crate::secrets::encode_key(&[3u8; crate::secrets::KEY_BYTES]);
        let serve = parse(&["webhook-gateway", "serve"]).unwrap();
        assert!(!serve.secrets.keyring().unwrap().encrypts(), "off by default");
        let serve = parse(&["webhook-gateway", "serve", "--secrets-key", &key]).unwrap();
        assert!(serve.secrets.keyring().unwrap().encrypts());
        assert!(!format!("{serve:?}").contains(&key), "Debug hides the key");

        let err = parse(&["webhook-gateway", "serve", "--secrets-key", "c2hvcnQ="]).unwrap_err();
        assert!(err.starts_with("secrets-key: must be 32 bytes in base64"), "{err}");
        let err = parse(&["webhook-gateway", "serve", "--secrets-key-previous", &key]).unwrap_err();
        assert!(err.contains("needs a current secrets-key"), "{err}");

        let dir = std::env::temp_dir().join(format!("wg-config-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key_file = dir.join("key");
        std::fs::write(&key_file, format!("{key}\n")).unwrap();
        let serve = parse(&["webhook-gateway", "serve", "--secrets-key-file", key_file.to_str().unwrap()]).unwrap();
        assert_eq!(
            serve.secrets.keyring().unwrap().current_key_id(),
            crate::secrets::Key::from_base64(&key).ok().as_ref().map(|k| k.id())
        );
        let err = parse(&[
            "webhook-gateway",
            "serve",
            "--secrets-key-file",
            key_file.to_str().unwrap(),
            "--secrets-key",
            &key,
        ])
        .unwrap_err();
        assert!(err.contains("not both"), "{err}");

        let path = dir.join("gw.toml");
        let previous = crate::secrets::encode_key(&[4u8; crate::secrets::KEY_BYTES]);
        std::fs::write(
            &path,
            format!("secrets_key_file = {:?}\nsecrets_key_previous = [{previous:?}]\n", key_file.to_str().unwrap()),
        )
        .unwrap();
        let serve = parse(&["webhook-gateway", "serve", "--config", path.to_str().unwrap()]).unwrap();
        let keyring = serve.secrets.keyring().unwrap();
        assert!(keyring.encrypts());
        assert_eq!(keyring.previous_key_ids().len(), 1);
        let old_file = dir.join("old.key");
        std::fs::write(&old_file, &previous).unwrap();
        let serve = parse(&[
            "webhook-gateway",
            "serve",
            "--secrets-key",
            &crate::secrets::encode_key(&[5u8; crate::secrets::KEY_BYTES]),
            "--secrets-key-previous-file",
            old_file.to_str().unwrap(),
            "--secrets-key-previous-file",
            key_file.to_str().unwrap(),
        ])
        .unwrap();
        assert_eq!(serve.secrets.keyring().unwrap().previous_key_ids().len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A setting of the `settings!` list, as the reachability test drives it.
    pub(super) struct Setting {
        /// Its name: the clap id and the key in the file.
        key: &'static str,
        /// Two different values (the first differs from the default), each as the command
        /// line, the environment and the file write it, and as it reads back.
        values: [Written; 2],
        /// Reads the setting back from parsed settings (its `Debug`).
        read: fn(&ServeArgs) -> String,
    }

    /// One value of a setting, written each way.
    struct Written {
        /// Command-line occurrences: `Some(v)` is `--flag=v`, `None` the bare `--flag`.
        occurrences: Vec<Option<String>>,
        env: String,
        toml: toml::Value,
        debug: String,
    }

    impl Setting {
        pub(super) fn new<T: Sample>(key: &'static str, read: fn(&ServeArgs) -> String) -> Setting {
            let values = T::samples().map(|v| Written {
                occurrences: v.occurrences(),
                env: v.text(),
                toml: v.toml(),
                debug: format!("{v:?}"),
            });
            Setting { key, values, read }
        }
    }

    /// The values a type of setting takes in the reachability test.
    pub(super) trait Sample: Sized + std::fmt::Debug {
        /// Two different values; the first must differ from the setting's default.
        fn samples() -> [Self; 2];
        /// As the environment (and a command-line value) writes it.
        fn text(&self) -> String;
        /// As the file writes it.
        fn toml(&self) -> toml::Value {
            toml::Value::String(self.text())
        }
        /// The command-line occurrences that give it.
        fn occurrences(&self) -> Vec<Option<String>> {
            vec![Some(self.text())]
        }
    }

    macro_rules! sample {
        ($($ty:ty: $a:expr, $b:expr;)+) => {$(
            impl Sample for $ty {
                fn samples() -> [Self; 2] {
                    [$a, $b]
                }
                fn text(&self) -> String {
                    self.to_string()
                }
            }
        )+};
    }
    sample! {
        String: "value-a-0123456789".into(), "value-b-0123456789".into();
        SocketAddr: SocketAddr::from(([127, 0, 0, 2], 4001)), "[::1]:4002".parse().unwrap();
        ipnet::IpNet: "10.1.0.0/16".parse().unwrap(), "fd00::/8".parse().unwrap();
    }

    macro_rules! sample_integer {
        ($($ty:ty),+) => {$(
            impl Sample for $ty {
                fn samples() -> [Self; 2] {
                    [4001, 4002]
                }
                fn text(&self) -> String {
                    self.to_string()
                }
                fn toml(&self) -> toml::Value {
                    toml::Value::Integer(i64::try_from(*self).unwrap())
                }
            }
        )+};
    }
    sample_integer!(u32, u64, usize);

    macro_rules! sample_value_enum {
        ($($ty:ty: $a:expr, $b:expr;)+) => {$(
            impl Sample for $ty {
                fn samples() -> [Self; 2] {
                    [$a, $b]
                }
                fn text(&self) -> String {
                    self.to_possible_value().unwrap().get_name().to_owned()
                }
            }
        )+};
    }
    sample_value_enum! {
        Role: Role::Worker, Role::Ingest;
        LogFormat: LogFormat::Json, LogFormat::Pretty;
    }

    impl Sample for PathBuf {
        fn samples() -> [Self; 2] {
            ["/tmp/wg-sample-a".into(), "/tmp/wg-sample-b".into()]
        }
        fn text(&self) -> String {
            self.display().to_string()
        }
    }

    /// A flag: `true` is the bare flag on the command line, `false` cannot be written there
    /// (so only the first value, `true`, is ever given on the command line).
    impl Sample for bool {
        fn samples() -> [Self; 2] {
            [true, false]
        }
        fn text(&self) -> String {
            self.to_string()
        }
        fn toml(&self) -> toml::Value {
            toml::Value::Boolean(*self)
        }
        fn occurrences(&self) -> Vec<Option<String>> {
            if *self { vec![None] } else { vec![] }
        }
    }

    /// An on-by-default setting: `--flag=false` (the first value differs from the default).
    impl Sample for Enabled {
        fn samples() -> [Self; 2] {
            [Enabled(false), Enabled(true)]
        }
        fn text(&self) -> String {
            self.to_string()
        }
        fn toml(&self) -> toml::Value {
            toml::Value::Boolean(self.0)
        }
    }

    impl<T: Sample> Sample for Option<T> {
        fn samples() -> [Self; 2] {
            T::samples().map(Some)
        }
        fn text(&self) -> String {
            self.as_ref().map(T::text).unwrap_or_default()
        }
        fn toml(&self) -> toml::Value {
            self.as_ref().map_or_else(|| toml::Value::String(String::new()), T::toml)
        }
        fn occurrences(&self) -> Vec<Option<String>> {
            self.as_ref().map(T::occurrences).unwrap_or_default()
        }
    }

    /// Two items (the flag repeated; comma-separated in the environment) and one.
    impl<T: Sample> Sample for Vec<T> {
        fn samples() -> [Self; 2] {
            let [a, b] = T::samples();
            let [_, b_again] = T::samples();
            [vec![a, b], vec![b_again]]
        }
        fn text(&self) -> String {
            self.iter().map(T::text).collect::<Vec<_>>().join(",")
        }
        fn toml(&self) -> toml::Value {
            toml::Value::Array(self.iter().map(T::toml).collect())
        }
        fn occurrences(&self) -> Vec<Option<String>> {
            self.iter().flat_map(T::occurrences).collect()
        }
    }

    /// Environment variables given to a child process.
    type Env<'a> = [(&'a str, &'a str)];

    /// Set in a child process (this test binary, this test): parse what the parent asks
    /// under the environment the parent gave it.
    const PROBE: &str = "WG_CONFIG_REACHABILITY_PROBE";

    /// The settings as the command line, the environment and the file give them, without
    /// validation; each setting's `Debug`, in the `settings!` order.
    fn parse_unvalidated(args: &[String]) -> Result<Vec<String>, String> {
        let matches = Cli::command().try_get_matches_from(args).map_err(|e| e.to_string())?;
        let cli = Cli::from_arg_matches(&matches).map_err(|e| e.to_string())?;
        let Command::Serve(mut serve) = cli.command else { return Err("not serve".into()) };
        let (_, sub) = matches.subcommand().ok_or("no subcommand")?;
        serve.merge_file(sub).map_err(|e| e.to_string())?;
        Ok(ServeArgs::settings().iter().map(|s| (s.read)(&serve)).collect())
    }

    /// Parses, in a child process whose environment is exactly `env` as far as settings
    /// go, each command line of `parses`.
    fn probe(env: &Env, parses: &[Vec<String>], dir: &std::path::Path) -> Vec<Result<Vec<String>, String>> {
        static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let job = dir.join(format!("probe-{n}.json"));
        let out = dir.join(format!("probe-{n}.out.json"));
        std::fs::write(&job, serde_json::to_vec(&(parses, &out)).unwrap()).unwrap();
        let test = concat!(
            module_path!(),
            "::",
            "every_setting_is_reachable_from_the_command_line_the_environment_and_the_file"
        );
        let test = test.split_once("::").unwrap().1;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap());
        child.args([test, "--exact", "--test-threads=1", "--nocapture"]);
        for arg in Cli::command().find_subcommand("serve").unwrap().get_arguments() {
            if let Some(name) = arg.get_env() {
                child.env_remove(name);
            }
        }
        let status = child.envs(env.iter().copied()).env(PROBE, &job).output().unwrap();
        assert!(status.status.success(), "probe {n}: {status:?}");
        let answers = std::fs::read(&out).unwrap_or_else(|e| panic!("probe {n} answered nothing ({e}): {status:?}"));
        serde_json::from_slice(&answers).unwrap()
    }

    /// The child's side of [`probe`].
    fn answer_probe(job: &std::ffi::OsStr) {
        let (parses, out): (Vec<Vec<String>>, PathBuf) = serde_json::from_slice(&std::fs::read(job).unwrap()).unwrap();
        let answers: Vec<_> = parses.iter().map(|args| parse_unvalidated(args)).collect();
        std::fs::write(out, serde_json::to_vec(&answers).unwrap()).unwrap();
    }

    /// Every `serve` flag is a setting of the `settings!` list with its environment variable
    /// and file key, and a value given only on the command line, only in the environment or
    /// only in the file arrives; command line > environment > file > default. Fails for a
    /// flag declared outside the list, or one whose environment variable or file key is
    /// missing or misnamed. The environment is a child process's (this test again, re-run
    /// with `PROBE` set), never this process's own.
    #[test]
    fn every_setting_is_reachable_from_the_command_line_the_environment_and_the_file() {
        if let Some(job) = std::env::var_os(PROBE) {
            return answer_probe(&job);
        }
        let settings = ServeArgs::settings();
        let command = Cli::command();
        let serve = command.find_subcommand("serve").unwrap();
        let mut problems = Vec::new();

        // The list is the whole command line, and names each path by the convention.
        let mut flags = std::collections::HashMap::new(); // key -> (flag, environment variable)
        for arg in serve.get_arguments() {
            let id = arg.get_id().as_str();
            if matches!(id, "help" | "version" | "config") {
                continue; // `config` names the file itself: command line and environment only
            }
            let long = id.replace('_', "-");
            let env = if id == "database_url" {
                "DATABASE_URL".to_owned()
            } else {
                format!("WEBHOOK_GATEWAY_{}", id.to_uppercase())
            };
            if arg.get_long() != Some(long.as_str()) {
                problems.push(format!("{id}: flag {:?}, expected --{long}", arg.get_long()));
            }
            if arg.get_env() != Some(std::ffi::OsStr::new(&env)) {
                problems.push(format!("{id}: environment variable {:?}, expected {env}", arg.get_env()));
            }
            if !settings.iter().any(|s| s.key == id) {
                problems.push(format!("{id}: a serve flag outside the settings! list (no file key)"));
            }
            flags.insert(id.to_owned(), (long, env));
        }
        for setting in &settings {
            if !flags.contains_key(setting.key) {
                problems.push(format!("{}: in the settings! list but no serve flag", setting.key));
            }
        }
        assert!(problems.is_empty(), "{problems:#?}");

        // Every setting at once, given its first or second value, each way.
        let command_line = |config: Option<&str>, value: Option<usize>| -> Vec<String> {
            let mut args = vec!["webhook-gateway".to_owned(), "serve".to_owned()];
            args.extend(config.map(|c| format!("--config={c}")));
            let Some(i) = value else { return args };
            for setting in &settings {
                let long = &flags[setting.key].0;
                args.extend(setting.values[i].occurrences.iter().map(|occurrence| match occurrence {
                    Some(v) => format!("--{long}={v}"),
                    None => format!("--{long}"),
                }));
            }
            args
        };
        let environment = |i: usize| -> Vec<(&str, &str)> {
            settings.iter().map(|s| (flags[s.key].1.as_str(), s.values[i].env.as_str())).collect()
        };
        let dir = std::env::temp_dir().join(format!("wg-config-reach-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |i: usize| -> String {
            let table: toml::Table = settings.iter().map(|s| (s.key.to_owned(), s.values[i].toml.clone())).collect();
            let path = dir.join(format!("gw-{i}.toml"));
            std::fs::write(&path, toml::to_string(&table).unwrap()).unwrap();
            path.to_str().unwrap().to_owned()
        };
        let (file_0, file_1) = (file(0), file(1));
        let (env_0, env_1) = (environment(0), environment(1));
        let config_env = vec![("WEBHOOK_GATEWAY_CONFIG", file_0.as_str())];
        struct Run<'a> {
            given: &'a str,
            env: &'a Env<'a>,
            args: Vec<String>,
            /// Which value arrives; `None`: the default (which the first value must not be).
            arrives: Option<usize>,
        }
        let run = |given, env, args, arrives| Run { given, env, args, arrives };
        let runs = [
            run("nothing", &[], command_line(None, None), None),
            run("command line only", &[], command_line(None, Some(0)), Some(0)),
            run("file only", &[], command_line(Some(&file_0), None), Some(0)),
            run("environment only", &env_0, command_line(None, None), Some(0)),
            run("file named by the environment", &config_env, command_line(None, None), Some(0)),
            run("command line over file", &[], command_line(Some(&file_1), Some(0)), Some(0)),
            run("environment over file", &env_1, command_line(Some(&file_0), None), Some(1)),
            run("command line over environment", &env_1, command_line(None, Some(0)), Some(0)),
            run("command line over environment and file", &env_1, command_line(Some(&file_1), Some(0)), Some(0)),
        ];
        // One child process per environment.
        let mut by_env: Vec<(&Env, Vec<&Run>)> = Vec::new();
        for run in &runs {
            match by_env.iter_mut().find(|(env, _)| *env == run.env) {
                Some((_, runs)) => runs.push(run),
                None => by_env.push((run.env, vec![run])),
            }
        }
        for (env, runs) in by_env {
            let parses: Vec<Vec<String>> = runs.iter().map(|run| run.args.clone()).collect();
            for (run, answer) in runs.into_iter().zip(probe(env, &parses, &dir)) {
                let read = match answer {
                    Ok(read) => read,
                    Err(e) => {
                        problems.push(format!("{}: {e}", run.given));
                        continue;
                    }
                };
                for (setting, read) in settings.iter().zip(read) {
                    match run.arrives {
                        Some(i) if read != setting.values[i].debug => problems.push(format!(
                            "{}: {}: read {read}, expected {}",
                            setting.key, run.given, setting.values[i].debug
                        )),
                        None if read == setting.values[0].debug => {
                            problems.push(format!("{}: its first sample value {read} is its default", setting.key))
                        }
                        _ => {}
                    }
                }
            }
        }
        std::fs::remove_dir_all(&dir).ok();
        assert!(problems.is_empty(), "{problems:#?}");
    }
}
