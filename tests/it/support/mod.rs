//! Test support: a fresh PostgreSQL database per test, the gateway in-process on a free
//! port, and an HTTP client.
//!
//! Databases: with `DATABASE_URL` set, each test creates its own database on that server;
//! without it, one private throwaway cluster is started per test process (the same
//! embedded mechanism `serve` uses) and each test gets its own database there. Tests
//! never share state and run in parallel.

#![allow(dead_code)]

pub mod explain;
pub mod haproxy;
pub mod otlp;
pub mod pgbouncer;
pub mod producer;
pub mod proxy;
pub mod raw_sink;
pub mod replica;
pub mod signing;
pub mod sink;
pub mod standard_webhooks;
pub mod tls_front;

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;
use sqlx::{Connection, Executor, PgConnection};
use webhook_gateway::app::{self, Running, Settings};
use webhook_gateway::circuit::CircuitConfig;
use webhook_gateway::db::Pool;
use webhook_gateway::db::{self, embedded};
use webhook_gateway::deliver::DeliverySettings;
use webhook_gateway::egress::EgressConfig;
use webhook_gateway::janitor::JanitorSettings;
use webhook_gateway::role::Role;

/// Admin token used by every test gateway.
pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789";

enum Server {
    External(String),
    Embedded(embedded::Cluster),
}

static SERVER: OnceLock<Server> = OnceLock::new();

/// Base URL (without database) of the server tests use.
fn server_url(database: &str) -> String {
    let server = SERVER.get_or_init(|| match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => Server::External(url),
        _ => Server::Embedded(start_throwaway_cluster()),
    });
    match server {
        Server::External(url) => {
            let mut url = url::Url::parse(url).expect("DATABASE_URL is not a URL");
            url.set_path(database);
            url.to_string()
        }
        Server::Embedded(cluster) => cluster.url(database),
    }
}

/// A private cluster for this test process. Durability is off: these databases are
/// deleted when the process exits, and no test measures time.
pub fn start_throwaway_cluster() -> embedded::Cluster {
    embedded::Cluster::start(&throwaway_options()).expect("cannot start the embedded PostgreSQL for tests")
}

/// Options of a throwaway test cluster in a fresh temporary directory.
pub fn throwaway_options() -> embedded::ClusterOptions {
    let dir = std::env::temp_dir().join(format!("wg-test-{}-{}", std::process::id(), uuid::Uuid::new_v4().simple()));
    embedded::ClusterOptions {
        data_dir: dir,
        throwaway: true,
        port: None,
        settings: vec![
            ("fsync".into(), "off".into()),
            ("synchronous_commit".into(), "off".into()),
            ("full_page_writes".into(), "off".into()),
        ],
        env: Vec::new(),
    }
}

/// A fresh, migrated database.
pub struct TestDb {
    /// Its connection URL.
    pub url: String,
    /// A pool for the test's own queries.
    pub pool: Pool,
}

impl TestDb {
    /// Create and migrate a new database.
    pub async fn new() -> TestDb {
        let name = format!("wg_test_{}", uuid::Uuid::new_v4().simple());
        create_database(&server_url("postgres"), &name).await;
        let url = server_url(&name);
        let pool = db::connect(&url, 8).await.expect("connect to test database");
        db::migrate(&pool).await.expect("migrate test database");
        TestDb { url, pool }
    }

    /// Create a new database and leave it empty (not migrated): for tests whose gateways
    /// migrate it themselves.
    pub async fn empty() -> TestDb {
        let name = format!("wg_test_{}", uuid::Uuid::new_v4().simple());
        create_database(&server_url("postgres"), &name).await;
        let url = server_url(&name);
        let pool = db::connect(&url, 8).await.expect("connect to test database");
        TestDb { url, pool }
    }

    /// Its name.
    pub fn name(&self) -> String {
        url::Url::parse(&self.url).expect("test database URL").path().trim_start_matches('/').to_owned()
    }

    /// Count rows of a table.
    /// Rows in `table`. For `events`, the gateway's own operational events (source
    /// `_gateway`) are left out: a check may publish one at any tick of any test, and a
    /// test that counts what it stored must not flake on that. Tests of those events use
    /// [`TestDb::count_events_but_operational`] or query them by type.
    pub async fn count(&self, table: &str) -> i64 {
        let sql = if table == "events" {
            format!("SELECT count(*) FROM events WHERE source_id <> '{}'", webhook_gateway::operational::SOURCE_ID)
        } else {
            format!("SELECT count(*) FROM {table}")
        };
        sqlx::query_scalar(&sql).fetch_one(&self.pool).await.expect("count")
    }

    /// Events other than the gateway's own (`_gateway`, see `operational`), with the
    /// types of those own ones, for a message.
    pub async fn count_events_but_operational(&self) -> (i64, Vec<String>) {
        let (count, own): (i64, Vec<String>) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE s.name <> '_gateway'),
                    COALESCE(array_agg(e.event_type) FILTER (WHERE s.name = '_gateway'), '{}')
             FROM events e JOIN sources s ON s.id = e.source_id",
        )
        .fetch_one(&self.pool)
        .await
        .expect("count");
        (count, own)
    }
}

/// `CREATE DATABASE name` on the server behind `admin_url`.
pub async fn create_database(admin_url: &str, name: &str) {
    let mut conn = PgConnection::connect(admin_url).await.expect("connect to the test server");
    conn.execute(format!("CREATE DATABASE {name}").as_str()).await.expect("create test database");
    conn.close().await.ok();
}

/// Gateway settings for tests: loopback egress allowed, fast polling, short backoff.
pub fn test_settings() -> Settings {
    Settings {
        listen: "127.0.0.1:0".parse().expect("addr"),
        admin_token: ADMIN_TOKEN.into(),
        max_body_bytes: 64 * 1024,
        role: Role::All,
        delivery: DeliverySettings {
            workers: 8,
            lease: Duration::from_secs(60),
            max_attempts: 8,
            backoff_base: Duration::from_millis(50),
            backoff_cap: Duration::from_millis(200),
            retry_after_cap: Duration::from_secs(3600),
            poll_interval: Duration::from_millis(50),
            shutdown_grace: Duration::from_secs(5),
            endpoint_max_in_flight: webhook_gateway::queue::default_max_in_flight(8),
            circuit: CircuitConfig {
                failure_threshold: 5,
                cooldown: Duration::from_millis(500),
                cooldown_cap: Duration::from_secs(2),
                release_per_sec: 1000,
            },
            body_memory_bytes: 128 * 1024 * 1024,
        },
        egress: EgressConfig {
            allow: vec!["127.0.0.1/32".parse().expect("cidr")],
            request_timeout: Duration::from_secs(5),
            ..Default::default()
        },
        janitor: JanitorSettings::default(),
        ingest_memory_bytes: 256 * 1024 * 1024,
        indexing: webhook_gateway::search::Indexing::Content,
        // Fast checks and short windows, so tests see operational events within a second.
        operational: webhook_gateway::operational::OperationalSettings {
            tick: Duration::from_millis(100),
            dead_letter_window: Duration::from_millis(500),
            ..Default::default()
        },
        resolver: None,
        metrics: None,
        metrics_sample: Duration::from_secs(15),
        ingest_writers: 8,
        db_timeout: db::DEFAULT_REQUEST_TIMEOUT,
        drain: Duration::ZERO,
        http: webhook_gateway::server::HttpLimits::default(),
        secrets: webhook_gateway::secrets::Keyring::default(),
        console: true,
    }
}

/// A gateway running in this process against a test database.
pub struct TestApp {
    /// Its database.
    pub db: TestDb,
    /// Its address.
    pub addr: SocketAddr,
    /// HTTP client.
    pub http: reqwest::Client,
    running: Option<Running>,
}

impl TestApp {
    /// A gateway with default test settings on a fresh database.
    pub async fn spawn() -> TestApp {
        Self::spawn_with(TestDb::new().await, test_settings(), 32).await
    }

    /// A gateway that ingests but does not deliver (role `ingest`), for tests that look
    /// at freshly created deliveries.
    pub async fn ingest_only() -> TestApp {
        let settings = Settings { role: Role::Ingest, ..test_settings() };
        Self::spawn_with(TestDb::new().await, settings, 32).await
    }

    /// A gateway with the given settings and pool size.
    pub async fn spawn_with(db: TestDb, settings: Settings, pool_size: u32) -> TestApp {
        let pool = db::connect(&db.url, pool_size).await.expect("gateway pool");
        let running = app::start(pool, settings).await.expect("start gateway");
        TestApp { addr: running.addr, db, http: reqwest::Client::new(), running: Some(running) }
    }

    /// Stop the gateway gracefully.
    pub async fn shutdown(&mut self) {
        if let Some(running) = self.running.take() {
            running.shutdown().await.expect("shutdown");
        }
    }

    /// Full URL of a path on this gateway.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Authenticated admin call with a JSON body.
    pub async fn admin(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut req = self.http.request(method, self.url(path)).bearer_auth(ADMIN_TOKEN);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let resp = req.send().await.expect("admin request");
        let status = resp.status().as_u16();
        let body = resp.json::<Value>().await.unwrap_or(Value::Null);
        (status, body)
    }

    /// `POST` with the admin token; panics unless the status is as expected.
    pub async fn admin_post(&self, path: &str, body: Value, expect: u16) -> Value {
        let (status, json) = self.admin(reqwest::Method::POST, path, Some(body)).await;
        assert_eq!(status, expect, "POST {path}: {json}");
        json
    }

    /// `GET` with the admin token; panics unless 200.
    pub async fn admin_get(&self, path: &str) -> Value {
        let (status, json) = self.admin(reqwest::Method::GET, path, None).await;
        assert_eq!(status, 200, "GET {path}: {json}");
        json
    }

    /// Create a `none` source with a dedupe header, and return its name.
    pub async fn source_none(&self, name: &str) -> Value {
        self.admin_post(
            "/v1/sources",
            serde_json::json!({"name": name, "kind": "none", "dedupe": {"header": "X-Delivery-Id"},
                               "event_type": {"header": "X-Event-Type"}}),
            201,
        )
        .await
    }

    /// Create an endpoint for `url` subscribed to everything from `source`; returns its id.
    pub async fn endpoint_for(&self, url: &str, source: Option<&str>) -> String {
        self.endpoint_with(url, serde_json::json!({"source": source})).await
    }

    /// Create an endpoint at `url` and a subscription of it with the fields of
    /// `subscription` (its source, a filter, a transformation...); returns the endpoint's id.
    pub async fn endpoint_with(&self, url: &str, mut subscription: Value) -> String {
        let ep = self.admin_post("/v1/endpoints", serde_json::json!({"url": url}), 201).await;
        let id = ep["id"].as_str().expect("endpoint id").to_owned();
        subscription["endpoint_id"] = Value::from(id.as_str());
        self.admin_post("/v1/subscriptions", subscription, 201).await;
        id
    }

    /// Post a webhook to `/ingest/{source}` with a delivery id and event type.
    pub async fn ingest(&self, source: &str, delivery_id: &str, event_type: &str, body: &str) -> (u16, Value) {
        let resp = self
            .http
            .post(self.url(&format!("/ingest/{source}")))
            .header("content-type", "application/json")
            .header("x-delivery-id", delivery_id)
            .header("x-event-type", event_type)
            .body(body.to_owned())
            .send()
            .await
            .expect("ingest request");
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }
}

/// Poll `check` every 20 ms until it returns `Some`, or panic after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The gateway binary as a separate process (a real replica: its own pool, its own
/// workers), against `db_url`. Killed on drop unless waited for.
pub struct GatewayProcess {
    /// The child process.
    pub child: std::process::Child,
    /// Its HTTP address.
    pub addr: SocketAddr,
    /// Its stderr (the logs).
    pub log: std::path::PathBuf,
}

impl GatewayProcess {
    /// Start `webhook-gateway serve --database-url db_url <extra>` with test defaults
    /// (loopback egress allowed, fast polling); `extra` flags come last and win.
    pub fn start(db_url: &str, extra: &[&str]) -> GatewayProcess {
        Self::start_with_env(db_url, extra, &[])
    }

    /// [`GatewayProcess::start`] with environment variables set for the process. An OTLP
    /// endpoint in the test's own environment is never inherited: tracing is on only
    /// where a test asks for it.
    ///
    /// The process listens on a port of the kernel's choosing (`--listen 127.0.0.1:0`),
    /// read back from its log: a port picked here and bound there later could be taken in
    /// between (by another test's connection or gateway), and the test would then talk to
    /// whoever holds it.
    pub fn start_with_env(db_url: &str, extra: &[&str], env: &[(&str, &str)]) -> GatewayProcess {
        Self::start_at(SocketAddr::from(([127, 0, 0, 1], 0)), db_url, extra, env)
    }

    /// [`GatewayProcess::start_with_env`] listening on `addr` (a replica replaced by a new
    /// one at the same address, as a rolling deploy does).
    pub fn start_at(addr: SocketAddr, db_url: &str, extra: &[&str], env: &[(&str, &str)]) -> GatewayProcess {
        // No drain by default: these tests stop processes on purpose, with no balancer.
        let extra: Vec<&str> = ["--shutdown-drain-secs", "0"].into_iter().chain(extra.iter().copied()).collect();
        Self::start_binary(std::path::Path::new(env!("CARGO_BIN_EXE_webhook-gateway")), addr, db_url, &extra, env)
    }

    /// `bin serve` (another release's binary: only flags every release knows are added)
    /// on `addr` against `db_url`, with the test defaults, then `extra`. On port 0, the
    /// address the process bound is read from its log before this returns.
    pub fn start_binary(
        bin: &std::path::Path,
        addr: SocketAddr,
        db_url: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> GatewayProcess {
        static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let nth = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log_path = std::env::temp_dir().join(format!("wg-proc-{}-{nth}.log", std::process::id()));
        let log = std::fs::File::create(&log_path).expect("log file");
        let child = std::process::Command::new(bin)
            .args(["serve", "--database-url", db_url, "--listen", &addr.to_string(), "--admin-token", ADMIN_TOKEN])
            .args(["--egress-allow", "127.0.0.1/32", "--poll-interval-ms", "50", "--db-pool-size", "8"])
            .args(extra)
            // The gateway's own default filter, whatever the test runner's environment says.
            .env_remove("RUST_LOG")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start gateway process");
        let mut process = GatewayProcess { child, addr, log: log_path };
        if addr.port() == 0 {
            process.addr = process.bound_addr();
        }
        process
    }

    /// The address the process bound, from its log: the line this release writes as soon
    /// as it has bound, or an older release's `gateway listening` (after its start-up).
    /// Waits at most 60 s; a process that exits first fails the test with its log.
    fn bound_addr(&mut self) -> SocketAddr {
        let read = |log: &std::path::Path| {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            text.lines()
                .filter(|line| line.contains("listen address bound") || line.contains("gateway listening"))
                .find_map(|line| {
                    // `addr=...` in the text format, `"addr":"..."` in JSON.
                    let text = line.split_whitespace().find_map(|word| word.strip_prefix("addr="));
                    let json = || line.split("\"addr\":\"").nth(1)?.split('"').next();
                    text.or_else(json)?.parse().ok()
                })
        };
        let mut wait = || {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            loop {
                if let Some(addr) = read(&self.log) {
                    return addr;
                }
                if let Ok(Some(status)) = self.child.try_wait() {
                    let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                    panic!("the gateway exited ({status}) before it bound its address:\n{log}");
                }
                assert!(std::time::Instant::now() < deadline, "no bound address in {} after 60 s", self.log.display());
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        // The process binds before it does anything else, so this wait is short; on a
        // multi-threaded test runtime it is moved off the worker, which may be serving
        // the test's own sinks or proxies meanwhile.
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(wait),
            _ => wait(),
        }
    }

    /// SIGKILL: no shutdown, no cleanup, leases left behind.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then wait up to `limit` for the exit; `None` if it is still running then.
    pub fn terminate_within(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// SIGTERM, then wait; returns whether it exited 0.
    pub fn terminate(&mut self) -> bool {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.child.wait().map(|s| s.success()).unwrap_or(false)
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill();
        }
    }
}

/// A gateway process on `url` (with `extra` flags) with a source `shop` and an endpoint subscribed to it that
/// answers 200; its base URL.
pub async fn gateway_with_sink(url: &str, extra: &[&str], sink: &sink::Sink) -> (GatewayProcess, String) {
    let gw = GatewayProcess::start(url, extra);
    let base = format!("http://{}", gw.addr);
    wait_ready(gw.addr).await;
    shop_to_sink(&base, sink).await;
    (gw, base)
}

/// What the gateway at `addr` exports on `/metrics`.
pub async fn scrape(addr: SocketAddr) -> String {
    let answer = reqwest::get(format!("http://{addr}/metrics")).await.expect("metrics");
    answer.text().await.expect("metrics text")
}

/// `GET path` on the gateway at `base` with the admin token: its JSON answer, which must be
/// 200.
pub async fn admin_get_at(base: &str, path: &str) -> Value {
    let answer =
        reqwest::Client::new().get(format!("{base}{path}")).bearer_auth(ADMIN_TOKEN).send().await.expect("admin call");
    assert_eq!(answer.status(), 200, "{path}");
    answer.json().await.expect("admin answer")
}

/// `POST path` with `body` on the gateway at `base` with the admin token: its JSON
/// answer, which must be 201.
pub async fn admin_post_at(base: &str, path: &str, body: Value) -> Value {
    let answer = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&body)
        .send()
        .await
        .expect("admin call");
    assert_eq!(answer.status(), 201, "{path}");
    answer.json().await.expect("admin answer")
}

/// What `webhook-gateway <args>` prints to stderr and its exit code, run for at most 60 s
/// (a command that should have ended and did not is killed, and the test fails).
pub async fn run_to_exit(args: &[&str]) -> (Option<i32>, String) {
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_webhook-gateway"))
        .args(args)
        .env_remove("DATABASE_URL")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run).await.expect("ended within 60 s").expect("run");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Wait until the gateway at `addr` answers `/readyz` 200.
pub async fn wait_ready(addr: SocketAddr) {
    let http = reqwest::Client::new();
    eventually(Duration::from_secs(30), "the gateway is ready", || async {
        let ready = http.get(format!("http://{addr}/readyz")).send().await.ok()?;
        (ready.status() == 200).then_some(())
    })
    .await;
}

/// Through the admin API at `base`: a `none` source `shop` (dedupe on `X-Delivery-Id`,
/// event type from `X-Event-Type`) and an endpoint for `sink` subscribed to it; returns
/// the endpoint's id.
pub async fn shop_to_sink(base: &str, sink: &sink::Sink) -> String {
    shop_to(base, serde_json::json!({"url": sink.url("/hook")})).await
}

/// [`shop_to_sink`] with the endpoint created from `endpoint` (its URL and settings).
pub async fn shop_to(base: &str, endpoint: serde_json::Value) -> String {
    let http = reqwest::Client::new();
    let post = |path: &'static str, body: serde_json::Value| {
        let request = http.post(format!("{base}{path}")).bearer_auth(ADMIN_TOKEN).json(&body);
        async move {
            let answer = request.send().await.expect("admin call");
            assert_eq!(answer.status(), 201, "{path}");
            answer.json::<serde_json::Value>().await.expect("admin answer")
        }
    };
    post(
        "/v1/sources",
        serde_json::json!({"name": "shop", "kind": "none", "dedupe": {"header": "X-Delivery-Id"},
                           "event_type": {"header": "X-Event-Type"}}),
    )
    .await;
    let endpoint = post("/v1/endpoints", endpoint).await;
    let id = endpoint["id"].as_str().expect("endpoint id").to_owned();
    post("/v1/subscriptions", serde_json::json!({"endpoint_id": id, "source": "shop"})).await;
    id
}

/// Post `body` to the source [`shop_to`] made on the gateway at `base`, as delivery
/// `delivery_id` of an `order.paid`: the answer's status and JSON body.
pub async fn post_to_shop(base: &str, delivery_id: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let answer = reqwest::Client::new()
        .post(format!("{base}/ingest/shop"))
        .header("x-delivery-id", delivery_id)
        .header("x-event-type", "order.paid")
        .json(body)
        .send()
        .await
        .expect("ingest");
    let status = answer.status().as_u16();
    (status, answer.json().await.unwrap_or_default())
}

/// The compression set on `events`' body and headers, as `headers=<method>,payload=<method>`
/// (`l` lz4, `p` pglz, empty the server's default): what migration 0023 changes.
pub async fn events_compression(pool: &Pool) -> String {
    sqlx::query_scalar(
        "SELECT string_agg(attname::text || '=' || attcompression::text, ',' ORDER BY attname)
         FROM pg_attribute WHERE attrelid = 'events'::regclass AND attname IN ('payload', 'headers')",
    )
    .fetch_one(pool)
    .await
    .expect("events' compression")
}

/// Insert `n` events of source `api`, each with one delivery to `endpoint_id`, due now.
/// Each call's dedupe keys are its own, so one endpoint can be seeded more than once.
pub async fn seed_deliveries(pool: &Pool, endpoint_id: &str, n: i64) {
    sqlx::query(
        "WITH ev AS (
             INSERT INTO events (source_id, dedupe_key, event_type, content_type, headers, payload)
             SELECT (SELECT id FROM sources WHERE name = 'api'), 'seed-' || $3 || '-' || g, 'seed.created', 'application/json',
                    '{}'::jsonb, convert_to('{\"n\": ' || g || '}', 'UTF8')
             FROM generate_series(1, $1) g
             RETURNING id)
         INSERT INTO deliveries (event_id, endpoint_id) SELECT id, $2::uuid FROM ev",
    )
    .bind(n)
    .bind(endpoint_id)
    .bind(uuid::Uuid::new_v4().to_string())
    .execute(pool)
    .await
    .expect("seed deliveries");
}

/// `lines` ordering lines of three deliveries each to `endpoint_id` (keys `k0`, `k1`, ...;
/// event `line-g` is member `g`, `line_seq` g): the first of each line is its head, the
/// others wait.
pub async fn seed_ordered_lines(pool: &Pool, endpoint_id: &str, lines: i64) {
    sqlx::query(
        "WITH ev AS (
             INSERT INTO events (source_id, dedupe_key, event_type, headers, payload, ordering_key)
             SELECT (SELECT id FROM sources WHERE name = 'api'), 'line-' || g, 't', '{}', '\\x7b7d', 'k' || (g % $1)
             FROM generate_series(1, $1 * 3) g
             RETURNING id, dedupe_key, ordering_key)
         INSERT INTO deliveries (event_id, endpoint_id, ordering_key, line_seq, waiting)
         SELECT id, $2::uuid, ordering_key, substr(dedupe_key, 6)::int8, substr(dedupe_key, 6)::int8 > $1 FROM ev",
    )
    .bind(lines)
    .bind(endpoint_id)
    .execute(pool)
    .await
    .expect("seed ordered deliveries");
    sqlx::query(
        "INSERT INTO order_lines (endpoint_id, ordering_key, head_id)
         SELECT endpoint_id, ordering_key, id FROM deliveries WHERE ordering_key IS NOT NULL AND NOT waiting",
    )
    .execute(pool)
    .await
    .expect("seed order lines");
}

/// The ids of `endpoint_id`'s deliveries, in id order (what ingest would hand to its
/// workers for them).
pub async fn delivery_ids(pool: &Pool, endpoint_id: &str) -> Vec<webhook_gateway::ids::DeliveryId> {
    let ids: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM deliveries WHERE endpoint_id = $1::uuid ORDER BY id")
        .bind(endpoint_id)
        .fetch_all(pool)
        .await
        .expect("delivery ids");
    ids.into_iter().map(webhook_gateway::ids::DeliveryId).collect()
}

/// Count deliveries by status.
pub async fn count_status(pool: &Pool, status: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE status = $1")
        .bind(status)
        .fetch_one(pool)
        .await
        .expect("count by status")
}

/// The outcome a worker would record for `claim`: `HTTP 200`, healthy, no excerpt.
pub fn attempt_record(
    claim: &webhook_gateway::queue::Claimed,
    outcome: webhook_gateway::queue::Outcome,
) -> webhook_gateway::queue::AttemptRecord {
    webhook_gateway::queue::AttemptRecord {
        delivery_id: claim.id,
        claim_token: claim.claim_token,
        attempt: claim.attempt,
        endpoint_id: claim.endpoint_id,
        started_at: chrono::Utc::now(),
        duration_ms: 5,
        status_code: Some(200),
        error_kind: None,
        outcome,
        reason: "HTTP 200".into(),
        response_excerpt: None,
        sent_excerpt: None,
        next_attempt_at: None,
        next_attempt_reason: None,
        ordered: claim.ordered,
    }
}

/// `queue::record` in a transaction of its own, committed.
pub async fn record_committed(
    pool: &Pool,
    rows: &[webhook_gateway::queue::AttemptRecord],
) -> Result<webhook_gateway::queue::Recorded, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let recorded = webhook_gateway::queue::record(&mut tx, rows).await?;
    tx.commit().await?;
    Ok(recorded)
}

/// A new login role on the test server, named `prefix` and a unique suffix, with no
/// privileges of its own: its name, and `url` (the test database's) logging in as it.
pub async fn login_role(pool: &Pool, url: &str, prefix: &str) -> (String, String) {
    let role = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
    sqlx::query(&format!("CREATE ROLE {role} LOGIN PASSWORD 'pw'")).execute(pool).await.expect("create role");
    let mut url = url::Url::parse(url).expect("database URL");
    url.set_username(&role).expect("user");
    url.set_password(Some("pw")).expect("password");
    (role, url.to_string())
}

/// Insert an endpoint row directly (no API, no validation); returns its id.
pub async fn insert_endpoint(pool: &Pool, url: &str) -> String {
    sqlx::query_scalar("INSERT INTO endpoints (url, secret) VALUES ($1, 'whsec_c2VjcmV0') RETURNING id::text")
        .bind(url)
        .fetch_one(pool)
        .await
        .expect("insert endpoint")
}

/// Set columns of an endpoint's row straight in the table (`assignments`, e.g.
/// `"rate_limit_per_sec = 10, rate_limit_burst = 2"`), including values the API refuses.
pub async fn set_endpoint(pool: &Pool, endpoint: &str, assignments: &str) {
    sqlx::query(&format!("UPDATE endpoints SET {assignments} WHERE id = $1::uuid"))
        .bind(endpoint)
        .execute(pool)
        .await
        .expect("update endpoint");
}

/// `sql` (an ingest statement with `store::events::insert_sql`'s ten parameters, and
/// whatever the caller binds after them) with `event` bound, without trace context or
/// search terms: for tests that run an ingest statement on a connection of their own.
pub fn bound_event<'q>(
    sql: &'q str,
    event: &'q webhook_gateway::store::events::NewEvent<'q>,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(event.source_id)
        .bind(event.dedupe_key)
        .bind(event.event_type)
        .bind(event.content_type)
        .bind(sqlx::types::Json(event.headers))
        .bind(event.payload)
        .bind(event.ordering_key)
        .bind(None::<&str>)
        .bind(None::<&str>)
        .bind(Vec::<i64>::new())
}

/// The id of the source named `name`.
pub async fn source_id(pool: &Pool, name: &str) -> webhook_gateway::ids::SourceId {
    webhook_gateway::ids::SourceId(
        sqlx::query_scalar("SELECT id FROM sources WHERE name = $1").bind(name).fetch_one(pool).await.expect("source"),
    )
}

/// An event of `source` keyed `key`, to store without the HTTP front: a JSON body and a
/// header that name the key.
pub fn owned_event(
    source: webhook_gateway::ids::SourceId,
    source_name: &str,
    key: &str,
    event_type: &str,
) -> webhook_gateway::store::events::OwnedEvent {
    webhook_gateway::store::events::OwnedEvent {
        source_id: source,
        source_name: source_name.to_owned(),
        indexing: webhook_gateway::search::Indexing::Content,
        dedupe_key: key.to_owned(),
        event_type: event_type.to_owned(),
        content_type: Some("application/json".to_owned()),
        headers: serde_json::json!({"x": key}),
        payload: format!("{{\"k\":\"{key}\"}}").into_bytes().into(),
        ordering_key: None,
        trace: None,
        terms: None,
    }
}
