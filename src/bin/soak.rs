//! Retention soak: push deliveries through the real claim and record statements with the
//! janitor running, and print table and index sizes and claim latency as it goes. Storage
//! and claim latency must level off once retention reaches a steady state, however many
//! deliveries have gone through.
//!
//! Not a test (it takes minutes and measures time): run it by hand, in release mode.
//!
//! ```sh
//! cargo run --release --bin soak                       # 1,000,000 deliveries, retention on
//! cargo run --release --bin soak -- --no-janitor       # the same without retention, to compare
//! ```
//!
//! Without `DATABASE_URL` it starts a throwaway embedded cluster at PostgreSQL's default
//! durability (fsync and synchronous_commit on); with it, it creates a fresh database on
//! that server and leaves it there for inspection.
//!
//! What runs: a producer inserting events with one delivery each (1 KiB payload, at most
//! 500 per transaction) at a fixed offered `--rate` (or, with `--rate 0`, as fast as the
//! workers drain, keeping at most `--backlog` pending); `--workers` tasks each claiming up
//! to 128 due deliveries with `queue::claim` and recording them with `queue::record` at
//! once (no HTTP: this measures the database side), 97% delivered, 2% retried after 2 s,
//! 1% dead; and the janitor with retention in seconds instead of days so that history
//! expires within the run. Claim latency is the wall time of `queue::claim` calls that
//! returned work (idle polls are left out).

// The soak inspects tables with its own statements, straight to the server.
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use clap::Parser;

use tokio::sync::Mutex;
use webhook_gateway::db::{self, embedded};
use webhook_gateway::ids::EndpointId;
use webhook_gateway::janitor::{Janitor, JanitorSettings};
use webhook_gateway::queue::{self, AttemptRecord, Outcome};

/// Retention soak for webhook-gateway (see the module documentation).
#[derive(Debug, Parser)]
struct Args {
    /// Deliveries to push through (finished: delivered or dead).
    #[arg(long, default_value_t = 1_000_000)]
    deliveries: u64,
    /// Print a sample row every this many finished deliveries.
    #[arg(long, default_value_t = 100_000)]
    sample_every: u64,
    /// Concurrent claim/record loops.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Offered load, deliveries per second; 0: as fast as the workers drain.
    #[arg(long, default_value_t = 2_000)]
    rate: u64,
    /// The producer keeps at most this many deliveries pending.
    #[arg(long, default_value_t = 20_000)]
    backlog: i64,
    /// Delivered deliveries are deleted this many seconds after delivery.
    #[arg(long, default_value_t = 20)]
    delivered_retention_secs: u64,
    /// Events (and attempts) are deleted this many seconds after arrival.
    #[arg(long, default_value_t = 60)]
    events_retention_secs: u64,
    /// Janitor interval, in seconds.
    #[arg(long, default_value_t = 5)]
    janitor_interval_secs: u64,
    /// Run without the janitor (to see what retention prevents).
    #[arg(long)]
    no_janitor: bool,
}

/// Rows per producer transaction.
const PRODUCE_BATCH: i64 = 500;
/// Claim batch per worker call (the dispatcher's own maximum).
const CLAIM_LIMIT: i64 = 128;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt().with_env_filter("warn").with_writer(std::io::stderr).init();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (url, mut cluster) = match std::env::var("DATABASE_URL") {
        Ok(server) if !server.is_empty() => {
            let name = format!("wg_soak_{}", uuid::Uuid::new_v4().simple());
            runtime.block_on(create_database(&server, &name))?;
            let mut url = url::Url::parse(&server).context("DATABASE_URL is not a URL")?;
            url.set_path(&name);
            (url.to_string(), None)
        }
        _ => {
            let options = embedded::ClusterOptions {
                data_dir: std::env::temp_dir().join(format!("wg-soak-{}", uuid::Uuid::new_v4().simple())),
                throwaway: true,
                port: None,
                settings: Vec::new(),
                env: Vec::new(),
            };
            let cluster = embedded::Cluster::start(&options)?;
            (cluster.url("postgres"), Some(cluster))
        }
    };
    let result = runtime.block_on(soak(&args, &url));
    if let Some(cluster) = cluster.as_mut() {
        cluster.stop();
    }
    result
}

async fn create_database(server: &str, name: &str) -> anyhow::Result<()> {
    let pool = db::connect(server, 1).await?;
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&pool).await?;
    pool.close().await;
    Ok(())
}

/// Finished janitor passes, collected as they finish (the janitor prunes its own history
/// older than the event retention, which in a soak is a minute).
#[derive(Default)]
struct Runs {
    last_id: i64,
    passes: u64,
    capped: u64,
    stopped: u64,
    failed: u64,
    batches: i64,
    rows: i64,
    total_secs: f64,
    max_secs: f64,
}

impl Runs {
    async fn poll(&mut self, pool: &db::Pool) -> anyhow::Result<()> {
        let rows: Vec<(i64, String, i32, i64, f64)> = sqlx::query_as(
            "SELECT id, status, batches, events_deleted + deliveries_deleted + attempts_deleted,
                    extract(epoch FROM finished_at - started_at)::float8
             FROM janitor_runs WHERE id > $1 AND finished_at IS NOT NULL ORDER BY id",
        )
        .bind(self.last_id)
        .fetch_all(pool)
        .await?;
        for (id, status, batches, rows, secs) in rows {
            self.last_id = id;
            self.passes += 1;
            match status.as_str() {
                "capped" => self.capped += 1,
                "stopped" => self.stopped += 1,
                "failed" => self.failed += 1,
                _ => {}
            }
            self.batches += i64::from(batches);
            self.rows += rows;
            self.total_secs += secs;
            self.max_secs = self.max_secs.max(secs);
        }
        Ok(())
    }
}

/// Counters shared by the loops.
#[derive(Default)]
struct Shared {
    finished: AtomicU64,
    produced: AtomicU64,
    stop: AtomicBool,
    /// Claim latencies (microseconds) since the last sample.
    claims: Mutex<Vec<u64>>,
}

async fn soak(args: &Args, url: &str) -> anyhow::Result<()> {
    let pool = db::connect(url, (args.workers + 6) as u32).await?;
    db::migrate(&pool).await?;
    let endpoint: EndpointId = sqlx::query_scalar(
        "INSERT INTO endpoints (url, secret) VALUES ('https://soak.invalid/', 'whsec_c29haw==') RETURNING id",
    )
    .fetch_one(&pool)
    .await?;
    print_machine(&pool).await?;
    let janitor_settings = JanitorSettings {
        events_retention: Duration::from_secs(args.events_retention_secs),
        attempts_retention: Duration::from_secs(args.events_retention_secs),
        delivered_retention: Duration::from_secs(args.delivered_retention_secs),
        interval: Duration::from_secs(args.janitor_interval_secs),
        ..JanitorSettings::default()
    };
    println!(
        "\n{} deliveries offered at {}, {} workers, backlog <= {}, retention: {}",
        args.deliveries,
        if args.rate == 0 { "full speed".to_owned() } else { format!("{}/s", args.rate) },
        args.workers,
        args.backlog,
        if args.no_janitor {
            "off".to_owned()
        } else {
            format!(
                "delivered {} s, events and attempts {} s, pass every {} s, batch {}",
                args.delivered_retention_secs,
                args.events_retention_secs,
                args.janitor_interval_secs,
                janitor_settings.batch_size
            )
        }
    );
    let janitor = (!args.no_janitor)
        .then(|| Janitor::spawn(pool.clone(), janitor_settings, webhook_gateway::lease::instance_id()));

    let shared = Arc::new(Shared::default());
    let mut tasks = Vec::new();
    tasks.push(tokio::spawn(produce(pool.clone(), endpoint, args.rate, args.backlog, args.deliveries, shared.clone())));
    for _ in 0..args.workers {
        tasks.push(tokio::spawn(work(pool.clone(), endpoint, shared.clone())));
    }

    println!(
        "\n| finished | elapsed s | deliveries/s | deliveries heap MiB | deliveries indexes MiB | deliveries_due KiB | \
         deliveries live / dead | events MiB | attempts MiB | database MiB | claim p50 ms | claim p99 ms | \
         rows deleted (ev/del/att) | autovacuums (deliveries) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let started = Instant::now();
    let (mut last_finished, mut last_at) = (0u64, started);
    let mut next_sample = args.sample_every.min(args.deliveries);
    let mut first_row = true;
    let mut runs = Runs::default();
    let mut ticks = 0u64;
    // Bounded: ends when the target is reached, or fails after 10 minutes without progress.
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        ticks += 1;
        if ticks.is_multiple_of(5) {
            runs.poll(&pool).await?;
        }
        let finished = shared.finished.load(Ordering::Relaxed);
        if first_row || finished >= next_sample {
            let rate = (finished - last_finished) as f64 / last_at.elapsed().as_secs_f64().max(1e-3);
            sample(&pool, &shared, finished, started.elapsed(), rate).await?;
            (last_finished, last_at) = (finished, Instant::now());
            if !first_row {
                next_sample += args.sample_every;
            }
            first_row = false;
        }
        if finished >= args.deliveries {
            break;
        }
        if last_at.elapsed() > Duration::from_secs(600) {
            anyhow::bail!("no progress for 10 minutes");
        }
    }
    shared.stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await??;
    }
    if let Some(janitor) = janitor {
        janitor.shutdown().await;
    }
    let hot: (i64, i64) =
        sqlx::query_as("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'deliveries'")
            .fetch_one(&pool)
            .await?;
    println!("\ndeliveries updates: {}, of which HOT: {}", hot.0, hot.1);
    runs.poll(&pool).await?;
    println!(
        "janitor: {} passes ({} capped, {} stopped, {} failed), {} batches, {} rows deleted; pass time mean {:.1} s, \
         longest {:.1} s, {:.2} s per batch (pauses of 0.1 s included)",
        runs.passes,
        runs.capped,
        runs.stopped,
        runs.failed,
        runs.batches,
        runs.rows,
        runs.total_secs / (runs.passes.max(1) as f64),
        runs.max_secs,
        runs.total_secs / (runs.batches.max(1) as f64),
    );
    let indexes: Vec<(String, i64)> = sqlx::query_as(
        "SELECT indexrelname::text, pg_relation_size(indexrelid) FROM pg_stat_user_indexes
         WHERE relname = 'deliveries' ORDER BY indexrelname",
    )
    .fetch_all(&pool)
    .await?;
    let list: Vec<String> =
        indexes.iter().map(|(name, bytes)| format!("{name} {:.1} MiB", *bytes as f64 / 1048576.0)).collect();
    println!("deliveries indexes at the end: {}", list.join(", "));
    pool.close().await;
    Ok(())
}

async fn print_machine(pool: &db::Pool) -> anyhow::Result<()> {
    let version: String = sqlx::query_scalar("SHOW server_version").fetch_one(pool).await?;
    let fsync: String = sqlx::query_scalar("SHOW fsync").fetch_one(pool).await?;
    let sync_commit: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(pool).await?;
    let naptime: String = sqlx::query_scalar("SHOW autovacuum_naptime").fetch_one(pool).await?;
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let mem_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse::<u64>().ok()))
        .unwrap_or(0);
    println!(
        "machine: {cpu}, {cores} cores, {} GiB; PostgreSQL {version}, fsync={fsync}, synchronous_commit={sync_commit}, \
         autovacuum_naptime={naptime}",
        mem_kib / (1024 * 1024)
    );
    Ok(())
}

/// Produce `total` deliveries at `rate` per second (0: whenever fewer than `backlog` are
/// pending).
async fn produce(
    pool: db::Pool,
    endpoint: EndpointId,
    rate: u64,
    backlog: i64,
    total: u64,
    shared: Arc<Shared>,
) -> anyhow::Result<()> {
    let payload = vec![b'x'; 1024];
    let source: uuid::Uuid = sqlx::query_scalar("SELECT id FROM sources WHERE name = 'api'").fetch_one(&pool).await?;
    let started = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        let produced = shared.produced.load(Ordering::Relaxed);
        if produced >= total {
            break;
        }
        // Pending = produced and not finished yet (a retried delivery stays pending); no
        // count(*) query, so the producer's cost does not depend on the table.
        let pending = produced.saturating_sub(shared.finished.load(Ordering::Relaxed)) as i64;
        let due = if rate == 0 { total } else { (started.elapsed().as_secs_f64() * rate as f64) as u64 };
        if pending >= backlog || due <= produced {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let n = PRODUCE_BATCH.min((due.min(total) - produced) as i64);
        sqlx::query(
            "WITH ev AS (
                 INSERT INTO events (source_id, dedupe_key, event_type, content_type, headers, payload)
                 SELECT $1, 'soak-' || ($2 + g), 'soak.created', 'application/json', '{}'::jsonb, $3
                 FROM generate_series(1, $4) g
                 RETURNING id)
             INSERT INTO deliveries (event_id, endpoint_id) SELECT id, $5 FROM ev",
        )
        .bind(source)
        .bind(produced as i64)
        .bind(&payload)
        .bind(n)
        .bind(endpoint)
        .execute(&pool)
        .await?;
        shared.produced.fetch_add(n as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// Claim and record at once, like a worker whose subscriber answers instantly.
async fn work(pool: db::Pool, endpoint: EndpointId, shared: Arc<Shared>) -> anyhow::Result<()> {
    let mut n: u64 = 0;
    while !shared.stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        let claim = queue::claim(&pool, CLAIM_LIMIT, Duration::from_secs(60)).await?;
        let took = t.elapsed().as_micros() as u64;
        if !claim.is_empty() {
            shared.claims.lock().await.push(took);
        }
        if claim.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let now = Utc::now();
        let batch: Vec<AttemptRecord> = claim
            .iter()
            .map(|c| {
                n += 1;
                let outcome = match n % 100 {
                    0 => Outcome::Dead,
                    1 | 2 => Outcome::Retry,
                    _ => Outcome::Delivered,
                };
                AttemptRecord {
                    delivery_id: c.id,
                    claim_token: c.claim_token,
                    attempt: c.attempt,
                    started_at: now,
                    duration_ms: 3,
                    status_code: Some(match outcome {
                        Outcome::Delivered => 200,
                        Outcome::Retry => 503,
                        Outcome::Dead => 410,
                    }),
                    error_kind: None,
                    outcome,
                    reason: "soak".into(),
                    response_excerpt: Some("ok".into()),
                    sent_excerpt: None,
                    next_attempt_at: (outcome == Outcome::Retry).then(|| now + chrono::Duration::seconds(2)),
                    next_attempt_reason: (outcome == Outcome::Retry)
                        .then_some(webhook_gateway::deliver::policy::NextReason::Backoff),
                    endpoint_id: endpoint,
                    ordered: false,
                }
            })
            .collect();
        let finished = batch.iter().filter(|r| r.outcome != Outcome::Retry).count() as u64;
        let mut tx = pool.begin().await?;
        queue::record(&mut tx, &batch).await?;
        tx.commit().await?;
        shared.finished.fetch_add(finished, Ordering::Relaxed);
    }
    Ok(())
}

async fn sample(pool: &db::Pool, shared: &Shared, finished: u64, elapsed: Duration, rate: f64) -> anyhow::Result<()> {
    const MIB: f64 = 1024.0 * 1024.0;
    let mut claims = std::mem::take(&mut *shared.claims.lock().await);
    claims.sort_unstable();
    let pct = |p: f64| {
        if claims.is_empty() { f64::NAN } else { claims[((claims.len() - 1) as f64 * p) as usize] as f64 / 1000.0 }
    };
    let row: (i64, i64, i64, i64, i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT pg_table_size('deliveries'), pg_indexes_size('deliveries'), pg_relation_size('deliveries_due'),
                (SELECT n_live_tup FROM pg_stat_user_tables WHERE relname = 'deliveries'),
                (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'deliveries'),
                pg_total_relation_size('events'), pg_total_relation_size('attempts'),
                pg_database_size(current_database()),
                (SELECT autovacuum_count FROM pg_stat_user_tables WHERE relname = 'deliveries')",
    )
    .fetch_one(pool)
    .await?;
    // The statistics' own delete counters: janitor_runs is pruned by the janitor itself.
    let deleted: (i64, i64, i64) = sqlx::query_as(
        "SELECT sum(n_tup_del) FILTER (WHERE relname = 'events')::int8,
                sum(n_tup_del) FILTER (WHERE relname = 'deliveries')::int8,
                sum(n_tup_del) FILTER (WHERE relname = 'attempts')::int8
         FROM pg_stat_user_tables",
    )
    .fetch_one(pool)
    .await?;
    println!(
        "| {finished} | {:.0} | {rate:.0} | {:.1} | {:.1} | {:.0} | {} / {} | {:.1} | {:.1} | {:.0} | {:.2} | {:.2} | {} / {} / {} | {} |",
        elapsed.as_secs_f64(),
        row.0 as f64 / MIB,
        row.1 as f64 / MIB,
        row.2 as f64 / 1024.0,
        row.3,
        row.4,
        row.5 as f64 / MIB,
        row.6 as f64 / MIB,
        row.7 as f64 / MIB,
        pct(0.5),
        pct(0.99),
        deleted.0,
        deleted.1,
        deleted.2,
        row.8,
    );
    Ok(())
}
