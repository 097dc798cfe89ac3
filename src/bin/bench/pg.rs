//! The PostgreSQL side: the server (a fresh embedded cluster at default durability, or
//! the one `DATABASE_URL` names), one fresh database per scenario, pgbench running the
//! gateway's own ingest statement, SQL seeding of backlogs, and reading
//! `pg_stat_statements` and the sampled statement log.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, Executor, PgConnection, PgPool};
use webhook_gateway::db::embedded;

use crate::stats::Latency;

/// The role worker processes connect as: its statements (and only its) are sampled into
/// the server log, so claim latencies come with percentiles.
pub const WORKER_ROLE: &str = "wg_bench_worker";
/// Share of the worker's statements written to the log.
pub const LOG_SAMPLE_RATE: f64 = 0.25;

/// The database server of this run.
pub struct Server {
    embedded: Option<embedded::Cluster>,
    base: url::Url,
    /// Whether `pg_stat_statements` is loaded (shared_preload_libraries).
    pub stat_statements: bool,
    /// Whether the worker role exists with statement sampling (we can read the log).
    pub sampled_log: bool,
}

impl Server {
    /// Start a fresh embedded cluster at PostgreSQL's default durability, or use
    /// `database_url`.
    pub async fn start(database_url: Option<String>, data_dir: PathBuf, keep: bool) -> anyhow::Result<Server> {
        let (embedded, base) = match database_url {
            Some(url) => (None, url::Url::parse(&url).context("DATABASE_URL is not a URL")?),
            None => {
                let options = embedded::ClusterOptions {
                    data_dir,
                    throwaway: !keep,
                    port: None,
                    // Durability stays at the defaults (fsync, synchronous_commit and
                    // full_page_writes on): only the statistics extension is added, with
                    // planning tracked (a statement planned at every execution costs CPU
                    // that its execution time does not show).
                    settings: vec![
                        ("shared_preload_libraries".into(), "pg_stat_statements".into()),
                        ("pg_stat_statements.track_planning".into(), "on".into()),
                    ],
                };
                let cluster = tokio::task::spawn_blocking(move || embedded::Cluster::start(&options)).await??;
                let base = url::Url::parse(&cluster.url("postgres"))?;
                (Some(cluster), base)
            }
        };
        let mut server = Server { embedded, base, stat_statements: false, sampled_log: false };
        let mut conn = server.admin().await?;
        let libs: String = sqlx::query_scalar("SHOW shared_preload_libraries").fetch_one(&mut conn).await?;
        server.stat_statements = libs.contains("pg_stat_statements");
        if server.embedded.is_some() {
            // Statement sampling for the worker role only (PostgreSQL 13+). The embedded
            // cluster takes password logins only: the role gets the server user's.
            let password = server.base.password().unwrap_or_default().to_owned();
            let setup = format!(
                "CREATE ROLE {WORKER_ROLE} LOGIN SUPERUSER PASSWORD '{password}';
                 ALTER ROLE {WORKER_ROLE} SET log_min_duration_sample = 0;
                 ALTER ROLE {WORKER_ROLE} SET log_statement_sample_rate = {LOG_SAMPLE_RATE};
                 ALTER ROLE {WORKER_ROLE} SET log_parameter_max_length = 0;"
            );
            server.sampled_log = conn.execute(setup.as_str()).await.is_ok();
        }
        conn.close().await.ok();
        Ok(server)
    }

    /// URL of database `name` (as the server's own user).
    pub fn url(&self, name: &str) -> String {
        let mut u = self.base.clone();
        u.set_path(name);
        u.to_string()
    }

    /// URL of database `name` as the worker role (falls back to [`Server::url`]).
    pub fn worker_url(&self, name: &str) -> String {
        if !self.sampled_log {
            return self.url(name);
        }
        let mut u = self.base.clone();
        u.set_path(name);
        let _ = u.set_username(WORKER_ROLE);
        u.to_string()
    }

    async fn admin(&self) -> anyhow::Result<PgConnection> {
        let mut u = self.base.clone();
        if self.embedded.is_some() {
            u.set_path("postgres");
        }
        PgConnection::connect(u.as_str()).await.context("connecting to PostgreSQL")
    }

    /// Create a fresh database (dropping a leftover of the same name).
    pub async fn create_db(&self, name: &str) -> anyhow::Result<String> {
        let mut conn = self.admin().await?;
        conn.execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str()).await?;
        conn.execute(format!("CREATE DATABASE {name}").as_str()).await.context("CREATE DATABASE")?;
        conn.close().await.ok();
        Ok(self.url(name))
    }

    /// Drop a scenario's database.
    pub async fn drop_db(&self, name: &str) {
        if let Ok(mut conn) = self.admin().await {
            let _ = conn.execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str()).await;
            conn.close().await.ok();
        }
    }

    /// The postmaster's pid (embedded cluster only).
    pub fn postmaster(&self) -> Option<u32> {
        crate::stats::postmaster_pid(self.embedded.as_ref()?.data_dir())
    }

    /// The server log (embedded cluster only).
    pub fn log_path(&self) -> Option<PathBuf> {
        Some(self.embedded.as_ref()?.data_dir().join("server.log"))
    }

    /// Current length of the server log, to read only what a scenario adds.
    pub fn log_offset(&self) -> u64 {
        self.log_path().and_then(|p| std::fs::metadata(p).ok()).map(|m| m.len()).unwrap_or(0)
    }

    /// `host`, `port`, `user`, `password` for pgbench.
    fn libpq_env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("PGHOST", self.base.host_str().unwrap_or("127.0.0.1").to_owned()),
            ("PGPORT", self.base.port().unwrap_or(5432).to_string()),
        ];
        if !self.base.username().is_empty() {
            env.push(("PGUSER", self.base.username().to_owned()));
        }
        if let Some(p) = self.base.password() {
            env.push(("PGPASSWORD", p.to_owned()));
        }
        env
    }

    /// Stop the embedded cluster.
    pub async fn stop(self) {
        if let Some(mut cluster) = self.embedded {
            let _ = tokio::task::spawn_blocking(move || cluster.stop()).await;
        }
    }
}

/// A pool for the bench's own queries.
pub async fn pool(url: &str, size: u32) -> anyhow::Result<PgPool> {
    PgPoolOptions::new().max_connections(size).connect(url).await.with_context(|| "connecting to the bench database")
}

/// Settings for the machine line.
pub async fn server_facts(pool: &PgPool) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for name in ["server_version", "synchronous_commit", "fsync", "full_page_writes", "shared_buffers", "max_wal_size"]
    {
        let v: String = sqlx::query_scalar(&format!("SHOW {name}")).fetch_one(pool).await?;
        out.push((name.to_owned(), v));
    }
    Ok(out)
}

/// Create the extension in a scenario database and reset its counters. (Planning is
/// tracked on the embedded cluster; a server given by `DATABASE_URL` keeps its own
/// setting, and its plan columns read 0 unless it tracks planning.)
pub async fn reset_statements(pool: &PgPool) -> bool {
    pool.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").await.is_ok()
        && pool.execute("SELECT pg_stat_statements_reset()").await.is_ok()
}

/// One statement's totals from `pg_stat_statements`.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct StatementStats {
    /// Executions.
    pub calls: i64,
    /// Total execution time.
    pub total_ms: f64,
    /// Mean execution time.
    pub mean_ms: f64,
    /// Longest execution.
    pub max_ms: f64,
    /// Total planning time (0 when planning is not tracked).
    pub plan_ms: f64,
    /// Times it was planned.
    pub plans: i64,
    /// Rows returned or affected.
    pub rows: i64,
    /// The statement (as normalised by pg_stat_statements).
    pub query: String,
}

/// The statements of this database by total execution time.
pub async fn top_statements(pool: &PgPool, limit: i64) -> Vec<StatementStats> {
    let rows: Result<Vec<StatementStats>, _> = sqlx::query_as(
        "SELECT calls, total_exec_time AS total_ms, mean_exec_time AS mean_ms, max_exec_time AS max_ms,
                total_plan_time AS plan_ms, plans, rows, query
         FROM pg_stat_statements
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND query NOT ILIKE '%pg_stat_statements%'
         ORDER BY total_exec_time DESC LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await;
    rows.unwrap_or_default()
}

/// Whitespace collapsed, cut at `max` characters.
pub fn shorten(sql: &str, max: usize) -> String {
    let flat = sql.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max { flat } else { format!("{}…", flat.chars().take(max).collect::<String>()) }
}

/// Whether a statement is the delivery claim.
pub fn is_claim(sql: &str) -> bool {
    let s = sql.to_ascii_uppercase();
    s.contains("SKIP LOCKED") && s.contains("UPDATE")
}

/// Durations of the claim statements the worker role logged since `offset` (sampled).
pub fn logged_claims(log: &Path, offset: u64) -> Vec<u64> {
    let Ok(bytes) = std::fs::read(log) else { return Vec::new() };
    let text = String::from_utf8_lossy(bytes.get(offset as usize..).unwrap_or_default()).into_owned();
    parse_claim_durations(&text)
}

/// Parse `duration: X ms  execute <name>: <statement>` entries (statements span lines
/// until the next line that starts with a timestamp) and keep the claims' durations (µs).
pub fn parse_claim_durations(text: &str) -> Vec<u64> {
    let mut out = Vec::new();
    let mut current: Option<(u64, String)> = None;
    let starts_entry =
        |l: &str| l.len() > 4 && l.as_bytes()[..4].iter().all(u8::is_ascii_digit) && l.as_bytes()[4] == b'-';
    let mut flush = |entry: Option<(u64, String)>| {
        if let Some((us, sql)) = entry
            && is_claim(&sql)
        {
            out.push(us);
        }
    };
    for line in text.lines() {
        if starts_entry(line) {
            flush(current.take());
            if let Some(at) = line.find("duration: ") {
                let rest = &line[at + "duration: ".len()..];
                let ms: Option<f64> = rest.split(' ').next().and_then(|v| v.parse().ok());
                if let (Some(ms), Some(stmt_at)) = (ms, rest.find("execute ")) {
                    current = Some(((ms * 1000.0).round() as u64, rest[stmt_at..].to_owned()));
                }
            }
        } else if let Some((_, sql)) = current.as_mut() {
            sql.push(' ');
            sql.push_str(line);
        }
    }
    flush(current.take());
    out
}

/// The gateway's single-event ingest statement, taken from the library so pgbench
/// always runs exactly what the gateway runs for one event.
pub fn ingest_statement() -> anyhow::Result<String> {
    let sql = webhook_gateway::store::events::insert_sql();
    if !sql.contains("INSERT INTO events")
        || !sql.contains("INSERT INTO deliveries")
        || !sql.contains("$10")
        || sql.contains("$11")
    {
        bail!("store::events::insert_sql() no longer looks like the event + fan-out statement with 10 parameters");
    }
    Ok(sql.to_owned())
}

/// The gateway's claim statement (`$1` = how many, `$2` = lease in seconds, `$3` default
/// max in flight, `$4` the endpoints served), exactly as the workers run it.
pub fn claim_statement() -> Option<String> {
    let sql = webhook_gateway::queue::claim_sql().to_owned();
    (is_claim(&sql) && sql.contains("$4") && !sql.contains("$5")).then_some(sql)
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of one claim of `limit` rows, rolled back.
pub async fn explain_claim(pool: &PgPool, limit: i64) -> String {
    let Some(sql) = claim_statement() else {
        return "(the claim statement was not found in src/queue/mod.rs)".into();
    };
    let run = async {
        let mut tx = pool.begin().await?;
        let lines: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN (ANALYZE, BUFFERS) {sql}"))
            .bind(limit)
            .bind(60.0_f64)
            .bind(webhook_gateway::queue::DEFAULT_MAX_IN_FLIGHT)
            .bind(sqlx::query_scalar::<_, uuid::Uuid>("SELECT id FROM endpoints").fetch_all(&mut *tx).await?)
            .fetch_all(&mut *tx)
            .await?;
        tx.rollback().await?;
        Ok::<_, sqlx::Error>(lines.join("\n"))
    };
    match run.await {
        Ok(plan) => format!("```\n{plan}\n```"),
        Err(e) => format!("(EXPLAIN failed: {e})"),
    }
}

/// The pgbench script: a random dedupe key per transaction and the ingest statement with
/// its parameters as pgbench variables (sent as bind parameters with `-M prepared`).
///
/// The search terms are the stored event's, except `fresh_terms` of them drawn at random
/// per transaction: the terms that differ from one bench event to the next (its ids,
/// sequence number and dedupe key). With one fixed array every transaction added the same
/// keys to the GIN index, a cheaper merge than the gateway's events cause, so the
/// "physical limit" did less index work than the gateway's statement.
pub fn pgbench_script(fresh_terms: usize) -> anyhow::Result<String> {
    // The gateway binds NULL as the ordering key and trace context of an event without
    // them (the bench's: its requests carry no traceparent).
    let mut sql = ingest_statement()?;
    for n in [9, 8, 7] {
        sql = sql.replace(&format!("${n}"), "NULL::text");
    }
    for (n, var) in [(10, "terms"), (6, "payload"), (5, "headers"), (4, "ctype"), (3, "etype"), (2, "k"), (1, "source")]
    {
        sql = sql.replace(&format!("${n}"), &format!(":{var}"));
    }
    let fresh: Vec<String> = (1..=fresh_terms).map(|i| format!(":t{i}")).collect();
    if !fresh.is_empty() {
        sql = sql.replace(":terms", &format!("(:terms::int8[] || ARRAY[{}]::int8[])", fresh.join(", ")));
    }
    let draws: String = (1..=fresh_terms).map(|i| format!("\\set t{i} random(1, 9000000000000000000)\n")).collect();
    Ok(format!("\\set k random(1, 1000000000000000)\n{draws}{};\n", sql.trim()))
}

/// One pgbench run.
#[derive(Debug, Default)]
pub struct PgbenchRun {
    /// Transactions per second (pgbench's own figure, without connection time).
    pub tps: f64,
    /// Per-transaction latencies.
    pub latency: Latency,
    /// pgbench's CPU seconds.
    pub cpu_secs: f64,
    /// Failed transactions.
    pub failed: u64,
}

/// What the script's variables are bound to.
pub struct PgbenchVars {
    /// Source id.
    pub source: String,
    /// Event type.
    pub etype: String,
    /// Content type.
    pub ctype: String,
    /// Headers JSON.
    pub headers: String,
    /// Body, as bytea hex (`\x...`).
    pub payload_hex: String,
    /// Search terms, as an `int8[]` literal (`{1,2}`): those the stored event shares with
    /// the one stored before it.
    pub terms: String,
    /// How many of its terms it does not share (drawn at random per transaction).
    pub fresh_terms: usize,
}

/// Transactions committed and rolled back in the cluster so far.
pub async fn transactions(pool: &sqlx::PgPool) -> anyhow::Result<f64> {
    // The statistics are flushed by each backend at most once a second: good enough over
    // a 10 s window.
    let n: i64 = sqlx::query_scalar("SELECT sum(xact_commit + xact_rollback)::int8 FROM pg_stat_database")
        .fetch_one(pool)
        .await?;
    Ok(n as f64)
}

/// Run pgbench with `script` on `db` for `secs` seconds at `clients` connections, as fast
/// as it can or, with `rate`, at that many transactions a second (`-R`); with `log_dir`,
/// per-transaction latencies are logged there and summarised.
#[allow(clippy::too_many_arguments)]
pub async fn pgbench(
    server: &Server,
    db: &str,
    script: &Path,
    vars: &PgbenchVars,
    clients: usize,
    secs: u64,
    rate: Option<u64>,
    log_dir: Option<&Path>,
) -> anyhow::Result<PgbenchRun> {
    let mut cmd = Command::new("pgbench");
    cmd.args(["-n", "-M", "prepared"]);
    if let Some(rate) = rate {
        cmd.args(["-R", &rate.to_string()]);
    }
    cmd.args(["-c", &clients.to_string(), "-j", &clients.min(2).to_string(), "-T", &secs.to_string()])
        .arg("-f")
        .arg(script)
        .args(["-D", &format!("source={}", vars.source)])
        .args(["-D", &format!("etype={}", vars.etype)])
        .args(["-D", &format!("ctype={}", vars.ctype)])
        .args(["-D", &format!("headers={}", vars.headers)])
        .args(["-D", &format!("payload={}", vars.payload_hex)])
        .args(["-D", &format!("terms={}", vars.terms)])
        .envs(server.libpq_env());
    if let Some(dir) = log_dir {
        std::fs::create_dir_all(dir)?;
        for e in std::fs::read_dir(dir)?.flatten() {
            let _ = std::fs::remove_file(e.path());
        }
        cmd.arg("-l").arg(format!("--log-prefix={}", dir.join("pgb").display()));
    }
    cmd.arg(db).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().context("starting pgbench (is it installed? Debian: postgresql-client)")?;
    let (out, cpu_secs) = tokio::task::spawn_blocking(move || wait_with_rusage(child)).await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("pgbench failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    let tps = stdout
        .lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l["tps = ".len()..].split(' ').next()?.parse::<f64>().ok())
        .with_context(|| format!("no tps in pgbench output: {stdout}"))?;
    let failed = stdout
        .lines()
        .find(|l| l.starts_with("number of failed transactions: "))
        .and_then(|l| l.split(':').nth(1)?.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let mut run = PgbenchRun { tps, cpu_secs, failed, ..PgbenchRun::default() };
    if let Some(dir) = log_dir {
        let mut lat = Vec::new();
        for e in std::fs::read_dir(dir)?.flatten() {
            let text = std::fs::read_to_string(e.path())?;
            // client_id transaction_no time script_no time_epoch time_us: `time` is µs.
            lat.extend(text.lines().filter_map(|l| l.split(' ').nth(2)?.parse::<u64>().ok()));
        }
        run.latency = Latency::from_micros(&mut lat);
    }
    Ok(run)
}

/// Wait for a child, collecting its output and its CPU time (wait4's rusage).
fn wait_with_rusage(mut child: std::process::Child) -> anyhow::Result<(std::process::Output, f64)> {
    use std::io::Read;
    let mut stdout = child.stdout.take().context("stdout")?;
    let mut stderr = child.stderr.take().context("stderr")?;
    let err_thread = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stderr.read_to_end(&mut buf);
        buf
    });
    let mut out_buf = Vec::new();
    stdout.read_to_end(&mut out_buf)?;
    let err_buf = err_thread.join().unwrap_or_default();
    let pid = child.id() as libc::pid_t;
    let mut status: libc::c_int = 0;
    // SAFETY: zeroed rusage is valid; wait4 on our own unreaped child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    if r != pid {
        bail!("wait4 failed: {}", std::io::Error::last_os_error());
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    use std::os::unix::process::ExitStatusExt;
    let status = std::process::ExitStatus::from_raw(status);
    // The std handle must not wait again: it would reap nothing and report an error.
    std::mem::forget(child);
    Ok((std::process::Output { status, stdout: out_buf, stderr: err_buf }, tv(ru.ru_utime) + tv(ru.ru_stime)))
}

/// Insert events `lo..=hi` (payload `bench_seq` = the number) with one delivery due now
/// per endpoint, and wake the workers (`wake::CHANNEL`) as the ingest path does.
pub async fn insert_due(
    pool: &PgPool,
    source_id: uuid::Uuid,
    endpoints: &[uuid::Uuid],
    (lo, hi): (u64, u64),
    template: &str,
) -> anyhow::Result<()> {
    sqlx::query(
        "WITH ev AS (
             INSERT INTO events (source_id, dedupe_key, event_type, content_type, headers, payload)
             SELECT $1, 'due-' || g, $2, 'application/json', '{}'::jsonb,
                    convert_to(replace($3, '__SEQ__', g::text), 'UTF8')
             FROM generate_series($4::int8, $5::int8) AS g
             RETURNING id
         )
         INSERT INTO deliveries (event_id, endpoint_id)
         SELECT ev.id, ep.id FROM ev CROSS JOIN unnest($6::uuid[]) AS ep(id)",
    )
    .bind(source_id)
    .bind(crate::payload::EVENT_TYPE)
    .bind(template)
    .bind(lo as i64)
    .bind(hi as i64)
    .bind(endpoints)
    .execute(pool)
    .await?;
    sqlx::query("SELECT pg_notify($1, '')").bind(webhook_gateway::wake::CHANNEL).execute(pool).await?;
    Ok(())
}

/// Turn the seeded backlog (events `seed-1` ... `seed-N`, see [`seed`]) into ordered
/// lines: event g gets ordering key `k{g mod keys}`, its deliveries join their lines in
/// seed order, and each line's first delivery is its head; what the fan-out does when
/// ordered events arrive one by one (`store::events`).
pub async fn make_ordered(pool: &PgPool, keys: u64) -> anyhow::Result<()> {
    sqlx::query(
        "UPDATE events SET ordering_key = 'k' || (substr(dedupe_key, 6)::int8 % $1)
         WHERE dedupe_key LIKE 'seed-%'",
    )
    .bind(keys as i64)
    .execute(pool)
    .await?;
    sqlx::query(
        "UPDATE deliveries d
         SET ordering_key = e.ordering_key, line_seq = substr(e.dedupe_key, 6)::int8,
             waiting = substr(e.dedupe_key, 6)::int8 > $1
         FROM events e WHERE e.id = d.event_id AND e.ordering_key IS NOT NULL",
    )
    .bind(keys as i64)
    .execute(pool)
    .await?;
    pool.execute(
        "INSERT INTO order_lines (endpoint_id, ordering_key, head_id)
         SELECT endpoint_id, ordering_key, id FROM deliveries WHERE ordering_key IS NOT NULL AND NOT waiting",
    )
    .await?;
    pool.execute("SELECT setval('deliveries_line_seq', (SELECT max(line_seq) FROM deliveries))").await?;
    pool.execute("VACUUM (ANALYZE) deliveries").await?;
    pool.execute("ANALYZE order_lines").await?;
    pool.execute("CHECKPOINT").await?;
    Ok(())
}

/// Insert `events` events (ids `first..first+events`) with one pending delivery per
/// endpoint each, straight into the gateway's schema, in chunks over two connections.
/// Arrival times are spread 1 ms apart into the past so the queue has a realistic order.
pub async fn seed(
    pool: &PgPool,
    source_id: uuid::Uuid,
    endpoints: &[uuid::Uuid],
    events: u64,
    template: &str,
) -> anyhow::Result<Duration> {
    const CHUNK: u64 = 50_000;
    let started = Instant::now();
    let chunks: Vec<(u64, u64)> =
        (0..events.div_ceil(CHUNK)).map(|i| (i * CHUNK + 1, ((i + 1) * CHUNK).min(events))).collect();
    let next = std::sync::Arc::new(std::sync::Mutex::new(chunks.into_iter()));
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let pool = pool.clone();
        let next = next.clone();
        let endpoints = endpoints.to_vec();
        let template = template.to_owned();
        tasks.push(tokio::spawn(async move {
            loop {
                let chunk = next.lock().expect("chunk lock").next();
                let Some((lo, hi)) = chunk else { return Ok::<(), sqlx::Error>(()) };
                sqlx::query(
                    "WITH ev AS (
                         INSERT INTO events (source_id, dedupe_key, event_type, content_type, headers, payload, received_at)
                         SELECT $1, 'seed-' || g, $2, 'application/json',
                                jsonb_build_object('host', '127.0.0.1', 'user-agent', 'wg-bench',
                                                   'content-type', 'application/json',
                                                   'content-length', length($3)::text,
                                                   'x-request-id', 'seed-' || g, 'x-signature', '[redacted]'),
                                convert_to(replace($3, '__SEQ__', g::text), 'UTF8'),
                                now() - make_interval(secs => ($4 - g) / 1000.0)
                         FROM generate_series($5::int8, $6::int8) AS g
                         RETURNING id, received_at
                     )
                     INSERT INTO deliveries (event_id, endpoint_id, next_attempt_at, created_at, updated_at)
                     SELECT ev.id, ep.id, ev.received_at, ev.received_at, ev.received_at
                     FROM ev CROSS JOIN unnest($7::uuid[]) AS ep(id)",
                )
                .bind(source_id)
                .bind(crate::payload::EVENT_TYPE)
                .bind(&template)
                .bind(events as i64)
                .bind(lo as i64)
                .bind(hi as i64)
                .bind(&endpoints)
                .execute(&pool)
                .await?;
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    // What autovacuum would have done to a queue that filled up gradually: statistics,
    // and a vacuumed (all-visible, hinted) deliveries table. Then a checkpoint, so the
    // drain does not pay for the seeding's dirty pages.
    pool.execute("VACUUM (ANALYZE) deliveries").await?;
    pool.execute("ANALYZE events").await?;
    pool.execute("CHECKPOINT").await?;
    Ok(started.elapsed())
}

/// Pending deliveries.
pub async fn pending(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE status = 'pending'").fetch_one(pool).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ingest_statement_is_found_and_parameterised() {
        let script = pgbench_script(0).unwrap();
        assert!(script.starts_with("\\set k random("));
        let fresh = pgbench_script(2).unwrap();
        assert!(fresh.contains("\\set t2 random("), "{fresh}");
        assert!(fresh.contains("(:terms::int8[] || ARRAY[:t1, :t2]::int8[]))"), "{fresh}");
        assert!(
            script.contains(
                "VALUES (:source, :k, :etype, :ctype, :headers, :payload, NULL::text, NULL::text, NULL::text, :terms)"
            ),
            "{script}"
        );
        assert!(!script.contains('$'), "{script}");
    }

    #[test]
    fn the_claim_statement_is_found() {
        let sql = claim_statement().expect("claim statement");
        assert!(sql.contains("SKIP LOCKED") && sql.contains("LIMIT $1"), "{sql}");
        assert!(!sql.contains('{') && !sql.contains('\\'), "{sql}");
    }

    #[test]
    fn claim_durations_come_from_execute_entries_spanning_lines() {
        let log = "2026-11-29 10:00:00.100 UTC [42] LOG:  duration: 0.512 ms  execute sqlx_s_1: WITH due AS (\n\
                   \t SELECT id FROM deliveries WHERE status = 'pending'\n\
                   \t FOR UPDATE SKIP LOCKED\n\
                   \t) UPDATE deliveries d SET x = 1\n\
                   2026-11-29 10:00:00.200 UTC [42] LOG:  duration: 1.250 ms  execute sqlx_s_2: WITH o AS (SELECT 1) INSERT INTO attempts\n\
                   2026-11-29 10:00:00.300 UTC [42] LOG:  duration: 2.000 ms  execute sqlx_s_1: WITH due AS (\n\
                   \t SELECT id FROM deliveries FOR UPDATE SKIP LOCKED) UPDATE deliveries d SET x = 1\n";
        assert_eq!(parse_claim_durations(log), vec![512, 2000]);
    }
}
