//! Command line, environment and TOML configuration, validated once at start-up.
//!
//! Precedence: command line > environment > `--config FILE` > built-in default.
//! Every `serve` setting is declared once, in the `settings!` list below: its flag,
//! environment variable, default and `--help` text, and by its name its key in the TOML
//! file (the flag name with dashes replaced by underscores: `max_body_bytes = 2097152`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
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
    /// Scoped API tokens: `tokens create`, `tokens list`, `tokens revoke` (audited as `cli`).
    Tokens(TokensArgs),
}

/// `webhook-gateway tokens`.
#[derive(Debug, Args)]
pub struct TokensArgs {
    /// What to do.
    #[command(subcommand)]
    pub action: TokensAction,

    /// PostgreSQL connection URL. Unset: the embedded cluster in --data-dir (gateway stopped).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    pub database_url: Option<String>,

    /// Where the embedded PostgreSQL cluster lives (used only without a database URL).
    #[arg(long, env = "WEBHOOK_GATEWAY_DATA_DIR", default_value = crate::db::DEFAULT_DATA_DIR, global = true)]
    pub data_dir: PathBuf,
}

/// `webhook-gateway tokens ...` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum TokensAction {
    /// Create a token and print it (only the token: it is shown this once).
    Create {
        /// Its unique name, the audit log's actor.
        #[arg(long, value_parser = token_name)]
        name: String,
        /// `read`, `operate` or `admin`.
        #[arg(long, value_parser = token_scope)]
        scope: crate::tokens::Scope,
        /// Days until it stops working; unset: until revoked.
        #[arg(long, value_parser = token_expiry_days)]
        expires_in_days: Option<u32>,
        /// Withhold the payloads of stored events from it (not for `admin`).
        #[arg(long)]
        no_payloads: bool,
    },
    /// List the tokens (never the tokens themselves), one per line.
    List,
    /// Revoke a token, by name or id, at once on every replica.
    Revoke {
        /// Its name or id.
        name: String,
    },
}

// A token's name, scope and expiry are checked as the command line is read, so a wrong
// one is a usage error (exit 2) before any database is started.

fn token_name(name: &str) -> Result<String, String> {
    match crate::tokens::name_problem(name) {
        Some(problem) => Err(problem.to_owned()),
        None => Ok(name.to_owned()),
    }
}

fn token_scope(name: &str) -> Result<crate::tokens::Scope, String> {
    crate::tokens::Scope::parse(name).ok_or_else(|| "must be read, operate or admin".to_owned())
}

fn token_expiry_days(days: &str) -> Result<u32, String> {
    let days = days.parse::<u32>().map_err(|e| e.to_string())?;
    crate::tokens::expiry_in(days).map(|_| days)
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

    /// What sits between the gateway and PostgreSQL (as for `serve`).
    #[arg(long, value_enum, env = "WEBHOOK_GATEWAY_DB_POOLER", default_value_t = crate::db::Pooler::None)]
    pub db_pooler: crate::db::Pooler,

    /// How long to wait for a database that may come back by itself (as for `serve`), seconds.
    #[arg(long, env = "WEBHOOK_GATEWAY_DB_START_WAIT_SECS", default_value_t = crate::db::DEFAULT_START_WAIT.as_secs())]
    pub db_start_wait_secs: u64,
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

    /// What sits between the gateway and PostgreSQL (as for `serve`).
    #[arg(long, value_enum, env = "WEBHOOK_GATEWAY_DB_POOLER", default_value_t = crate::db::Pooler::None)]
    pub db_pooler: crate::db::Pooler,

    /// The keys: the current one encrypts, previous ones only decrypt.
    #[command(flatten)]
    pub keys: SecretsKeyArgs,
}

// The `settings!` macro (`declare.rs`) must be in scope before its one use below.
#[macro_use]
mod declare;

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

        /// Threads of the async runtime that serves requests and runs deliveries. Default: one per CPU core. One
        /// thread halves the gateway's context switches at low load and costs it latency under heavy load (see
        /// docs/configuration.md, Runtime threads).
        #[arg(long, env = "WEBHOOK_GATEWAY_RUNTIME_THREADS")]
        pub runtime_threads: Option<usize>,

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

        /// On a stop signal, how long the process keeps serving with /readyz answering 503 (and every answer
        /// closing its connection) before it stops accepting, so that load balancers stop sending to it first; in
        /// seconds, at least the balancer's health-check interval times its failure count. Default: 5 with a
        /// database URL, 0 with the embedded database (nothing balances a local gateway).
        #[arg(long, env = "WEBHOOK_GATEWAY_SHUTDOWN_DRAIN_SECS")]
        pub shutdown_drain_secs: Option<u64>,

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

        /// How often queue depth, lag and circuit gauges are sampled from the database, and
        /// how often this replica writes its row of the fleet's roster, seconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_METRICS_SAMPLE_SECS", default_value_t = 15)]
        pub metrics_sample_secs: u64,

        /// PostgreSQL connections per process.
        #[arg(long, env = "WEBHOOK_GATEWAY_DB_POOL_SIZE", default_value_t = 16)]
        pub db_pool_size: u32,

        /// What sits between the gateway and PostgreSQL: `none` (PostgreSQL itself, or a pooler in session mode) or
        /// `transaction` (a pooler that hands the server connection to another client after each transaction:
        /// PgBouncer pool_mode=transaction, pgcat, Supavisor, RDS Proxy). With `transaction` no session state is
        /// relied on: unnamed statements, every statement in a transaction.
        #[arg(long, value_enum, env = "WEBHOOK_GATEWAY_DB_POOLER", default_value_t = crate::db::Pooler::None)]
        pub db_pooler: crate::db::Pooler,

        /// Behind a transaction pooler: a URL that reaches PostgreSQL directly (or through a session-mode pooler),
        /// for the one feature that needs a session of its own: LISTEN, which wakes worker processes at once when an
        /// ingest process stores a webhook. Unset: workers find new deliveries by polling (--poll-interval-ms).
        #[arg(long, env = "WEBHOOK_GATEWAY_DB_SESSION_URL", hide_env_values = true)]
        pub db_session_url: Option<String>,

        /// At start-up, how long to wait for a database that may come back by itself (not listening yet,
        /// starting, restarting, failing over: a standby not promoted yet, out of connections), trying every
        /// second and saying so in the log, before giving up, in seconds; 0: give up at the first failure. What
        /// waiting cannot mend (authentication, an unknown database, TLS, a pooler's refusal) fails at once.
        #[arg(long, env = "WEBHOOK_GATEWAY_DB_START_WAIT_SECS", default_value_t = crate::db::DEFAULT_START_WAIT.as_secs())]
        pub db_start_wait_secs: u64,

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
        #[arg(long, env = "WEBHOOK_GATEWAY_OTEL_ENDPOINT", hide_env_values = true)]
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

        /// Days an audit log entry is kept.
        #[arg(long, env = "WEBHOOK_GATEWAY_RETENTION_AUDIT_DAYS", default_value_t = janitor::DEFAULT_RETENTION_AUDIT_DAYS)]
        pub retention_audit_days: u32,

        /// How often each replica tries a retention pass (one replica at a time does it), in seconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_JANITOR_INTERVAL_SECS", default_value_t = janitor::DEFAULT_INTERVAL_SECS)]
        pub janitor_interval_secs: u64,

        /// Rows per retention delete statement (each its own short transaction).
        #[arg(long, env = "WEBHOOK_GATEWAY_JANITOR_BATCH_SIZE", default_value_t = janitor::DEFAULT_BATCH_SIZE)]
        pub janitor_batch_size: u32,

        /// Memory budget for webhook bodies held at once, in MiB (each counted four times: read, parsed, in its insert);
        /// a webhook that does not fit is answered 503 `overloaded` with Retry-After, unread.
        #[arg(long, env = "WEBHOOK_GATEWAY_INGEST_MEMORY_MIB", default_value_t = 256)]
        pub ingest_memory_mib: u64,

        /// Memory budget for the bodies delivery attempts hold at once, in MiB (each counted twice); a body over
        /// 64 KiB is read only once there is room for it, and a delivery that finds none is retried shortly,
        /// no attempt spent.
        #[arg(long, env = "WEBHOOK_GATEWAY_DELIVERY_MEMORY_MIB", default_value_t = 128)]
        pub delivery_memory_mib: u64,

        /// Publish the gateway's own events (circuit opened and closed, endpoint paused and resumed, dead
        /// letters, a late backlog, a source refusing webhooks, retention behind) under the source `_gateway`;
        /// `--operational-events=false` turns them off.
        #[arg(long, env = "WEBHOOK_GATEWAY_OPERATIONAL_EVENTS", default_value_t = Enabled(true), action = clap::ArgAction::Set)]
        pub operational_events: Enabled,

        /// Index each event's payload values and headers, so that `GET /v1/events?payload=` and `?header=`
        /// find it; `--content-search=false` indexes only its dedupe key (searches by key still work, by
        /// payload or header are refused), which saves the body's parse and about a third of PostgreSQL's
        /// work per webhook under load. Set it the same on every replica that ingests.
        #[arg(long, env = "WEBHOOK_GATEWAY_CONTENT_SEARCH", default_value_t = Enabled(true), action = clap::ArgAction::Set)]
        pub content_search: Enabled,

        /// `backlog.delayed` once the longest-waiting due delivery has waited this many seconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_BACKLOG_ALERT_SECS", default_value_t = 300)]
        pub backlog_alert_secs: u64,

        /// `source.refusing` once one replica refused this many of a source's webhooks in a minute.
        #[arg(long, env = "WEBHOOK_GATEWAY_REFUSALS_ALERT_PER_MINUTE", default_value_t = 20)]
        pub refusals_alert_per_minute: u64,

        /// Dead letters are reported in one `deliveries.dead_lettered` event per window of this many seconds.
        #[arg(long, env = "WEBHOOK_GATEWAY_DEAD_LETTER_ALERT_WINDOW_SECS", default_value_t = 60)]
        pub dead_letter_alert_window_secs: u64,

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

mod serve;
#[cfg(test)]
mod tests;

pub use serve::*;
