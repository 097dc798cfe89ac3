//! `bench`: the webhook-gateway benchmark harness (issue 8).
//!
//! One command (`cargo run --release --bin bench -- all`, or `./bench/run`) starts
//! everything it needs: a fresh PostgreSQL (an embedded cluster at default durability,
//! or fresh databases on `DATABASE_URL`), the release gateway binary as a child process,
//! a subscriber sink and a load generator inside this process; runs the scenarios; and
//! prints a Markdown table with the machine line, also written to
//! `bench/results/<date>.md`. See `bench/README.md`.

// The bench measures PostgreSQL with its own statements (plain sqlx: they are not the
// gateway's, and run straight to the server).
#![allow(clippy::disallowed_methods)]

mod delivery;
mod e2e;
mod filters;
mod fleet;
mod gateway;
mod ingest;
mod leases;
mod loadgen;
mod memory;
mod neighbours;
mod payload;
mod pg;
mod pinning;
mod pooler;
mod report;
mod search;
mod sink;
mod statements;
mod stats;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, ValueEnum};

use crate::report::Report;

/// What to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
enum Scenario {
    /// Every scenario below, in this order.
    All,
    /// 1-3 and 8: ingest of unique events, of duplicates, and pgbench running the same statement.
    Ingest,
    /// 4 and 8: drain of a seeded backlog at fan-out 1 and 4.
    Drain,
    /// 5: producer-to-subscriber latency at steady offered loads.
    E2e,
    /// 6: claim latency and drain rate at a small and a large backlog.
    Scaling,
    /// 7: half the endpoints answer 503.
    Failing,
    /// 9: fairness: 1,000 endpoints sharing a backlog; a slow endpoint next to healthy ones;
    /// a backlog held back by its endpoint's rate limit.
    Fairness,
    /// 10: ordered delivery: the drain in 100 and in 10,000 keys next to the unordered one.
    Ordered,
    /// 11: the highest sustained end-to-end rate: open-loop steps until delivery falls behind.
    Sustained,
    /// 12: ingest behind PgBouncer in transaction mode, beside the same ingest straight to PostgreSQL.
    Pooler,
    /// 13: 1, 4 and 8 replicas on one database, idle and at 1,000/s: PostgreSQL's CPU.
    Fleet,
    /// 14: ingest with ten subscriptions, without filters, with filters that all match, and none.
    Filters,
    /// 15: drain of one endpoint's backlog, without and with a transformation.
    Transforms,
    /// 16: finding an event by its content: the index's cost at ingest, searches on 1,000,000 events.
    Search,
    /// 17: memory under big bodies: 1 MB webhooks from 512 connections, peak RSS.
    Memory,
    /// 18: PostgreSQL's instructions per statement (the ingest of a lone webhook, a batch, a claim by key, outcomes), counted under callgrind in a stand-alone backend (needs valgrind)
    Statements,
}

/// The webhook-gateway benchmark harness.
#[derive(Debug, Parser)]
#[command(name = "bench", about = "Benchmark webhook-gateway against the physical limit of its database")]
pub struct Args {
    /// Scenarios to run.
    #[arg(value_enum, default_values_t = vec![Scenario::All])]
    scenarios: Vec<Scenario>,
    /// Warm-up before each measured window, seconds.
    #[arg(long, default_value_t = 3)]
    pub warmup_secs: u64,
    /// Measured window, seconds.
    #[arg(long, default_value_t = 10)]
    pub measure_secs: u64,
    /// Concurrent connections for the ingest scenarios and pgbench.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 16, 64])]
    pub concurrency: Vec<usize>,
    /// Extra line items in every webhook's body (six scalars, about 110 bytes each); 0
    /// sends the 1-2 KiB event as it is.
    #[arg(long, default_value_t = 0)]
    pub body_extra_items: usize,
    /// Pending deliveries for the drain and failing-subscriber scenarios.
    #[arg(long, default_value_t = 100_000)]
    pub drain_deliveries: u64,
    /// Pending deliveries for each drain of the ordered scenario.
    #[arg(long, default_value_t = 50_000)]
    pub ordered_deliveries: u64,
    /// Offered loads (webhooks/s) for the end-to-end scenario.
    #[arg(long, value_delimiter = ',', default_values_t = vec![300, 500, 1000, 2000])]
    pub rates: Vec<u64>,
    /// Offered loads (webhooks/s) the sustained scenario steps through, until one does not hold.
    #[arg(long, value_delimiter = ',', default_values_t = vec![2000, 3000, 4000, 5000, 6000, 7000, 8000, 10000])]
    pub sustained_rates: Vec<u64>,
    /// Connections the sustained scenario's load generator may use: enough that the
    /// generator's own concurrency never caps the offered rate (64 connections at a 15 ms
    /// answer carry at most ~4,300/s).
    #[arg(long, default_value_t = 256)]
    pub sustained_conns: usize,
    /// Connections the end-to-end load generator may use.
    #[arg(long, default_value_t = 64)]
    pub e2e_conns: usize,
    /// Backlogs for the scaling scenario: the first is also how many deliveries are timed at each.
    #[arg(long, value_delimiter = ',', default_values_t = vec![10_000, 1_000_000])]
    pub backlog: Vec<u64>,
    /// A worker that delivers nothing for this long is taken as "no delivery engine in this build".
    #[arg(long, default_value_t = 20)]
    pub progress_timeout_secs: u64,
    /// Give up a drain after this long (the row then shows the partial rate).
    #[arg(long, default_value_t = 600)]
    pub drain_timeout_secs: u64,
    /// Extra argument for every gateway process (repeat: `--gateway-arg=--workers --gateway-arg=64`).
    #[arg(long = "gateway-arg", allow_hyphen_values = true)]
    pub gateway_args: Vec<String>,
    /// Use this gateway binary instead of building target/release/webhook-gateway.
    #[arg(long)]
    gateway_bin: Option<PathBuf>,
    /// A PostgreSQL server to create the scenario databases on (else an embedded cluster).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// Where the embedded cluster lives (deleted afterwards unless --keep-cluster).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Keep the embedded cluster's directory.
    #[arg(long)]
    keep_cluster: bool,
    /// Where the results file goes.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/results"))]
    results_dir: PathBuf,
    /// Print only; write no results file.
    #[arg(long)]
    no_write: bool,
    /// Leave out row 5's physical floor (pgbench after the gateway), so that what the
    /// server did over a run is the gateway's alone (PostgreSQL counted under callgrind:
    /// PROFILE.md, "Where a webhook's WAL and PostgreSQL's instructions go").
    #[arg(long)]
    no_floor: bool,
}

/// What every scenario shares.
pub struct Ctx {
    /// The command line.
    pub args: Args,
    /// The database server.
    pub server: pg::Server,
    /// The subscriber.
    pub sink: sink::Sink,
    /// The gateway binary.
    pub gateway_bin: PathBuf,
    /// Unique per run: part of every dedupe key.
    pub run_id: String,
    /// Next webhook sequence number (shared with load-generator tasks).
    pub seq: Arc<AtomicU64>,
    /// Gateway logs, pgbench logs and scripts of this run.
    pub work_dir: PathBuf,
    /// The results so far.
    pub report: Mutex<Report>,
    /// Deliveries/s of the all-healthy fan-out-4 drain, to compare the failing scenario with.
    pub healthy_fanout4_rate: Mutex<Option<f64>>,
}

impl Ctx {
    /// Reserve `n` consecutive webhook sequence numbers; returns the first.
    pub fn reserve(&self, n: u64) -> u64 {
        self.seq.fetch_add(n, Ordering::Relaxed)
    }

    /// Add a row.
    pub fn row(&self, row: report::Row) {
        self.report.lock().expect("report lock").push(row);
    }

    /// Add a note under the table.
    pub fn note(&self, note: impl Into<String>) {
        self.report.lock().expect("report lock").notes.push(note.into());
    }

    /// Add an appendix section.
    pub fn appendix(&self, title: impl Into<String>, body: impl Into<String>) {
        self.report.lock().expect("report lock").appendix.push((title.into(), body.into()));
    }

    /// Extra gateway flags from the command line.
    pub fn gateway_args(&self) -> Vec<String> {
        self.args.gateway_args.clone()
    }

    /// The warm-up.
    pub fn warmup(&self) -> Duration {
        Duration::from_secs(self.args.warmup_secs)
    }

    /// The measured window.
    pub fn measure(&self) -> Duration {
        Duration::from_secs(self.args.measure_secs)
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    payload::set_extra_items(args.body_extra_items);
    match run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    if cfg!(debug_assertions) {
        eprintln!("bench: WARNING: this is a debug build of the harness; run it with --release (./bench/run does)");
    }
    let started = Instant::now();
    let cpu_at_start = stats::self_cpu();
    let mut scenarios: Vec<Scenario> = args.scenarios.clone();
    if scenarios.contains(&Scenario::All) {
        scenarios = vec![
            Scenario::Ingest,
            Scenario::Drain,
            Scenario::E2e,
            Scenario::Scaling,
            Scenario::Failing,
            Scenario::Fairness,
            Scenario::Ordered,
            Scenario::Sustained,
            Scenario::Pooler,
            Scenario::Fleet,
            Scenario::Filters,
            Scenario::Transforms,
            Scenario::Search,
            Scenario::Memory,
            Scenario::Statements,
        ];
    }
    scenarios.dedup();

    let gateway_bin = match &args.gateway_bin {
        Some(p) => p.clone(),
        None => tokio::task::spawn_blocking(gateway::build).await??,
    };
    let stamp = chrono::Local::now();
    let run_id = stamp.format("%Y%m%d%H%M%S").to_string();
    let work_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target").join("bench").join(&run_id);
    std::fs::create_dir_all(&work_dir)?;
    let data_dir = args.data_dir.clone().unwrap_or_else(|| {
        // Under /var/tmp: as root the cluster runs as `postgres`, which must reach it.
        std::env::temp_dir().join(format!("wg-bench-{}-{run_id}", std::process::id()))
    });
    eprintln!("bench: starting PostgreSQL ...");
    let server = pg::Server::start(args.database_url.clone(), data_dir, args.keep_cluster).await?;
    let sink = sink::Sink::start().await?;
    let command =
        format!("cargo run --release --bin bench -- {}", std::env::args().skip(1).collect::<Vec<_>>().join(" "));
    let ctx = Ctx {
        args,
        server,
        sink,
        gateway_bin,
        run_id,
        seq: Arc::new(AtomicU64::new(1)),
        work_dir,
        report: Mutex::new(Report { command: command.trim().to_owned(), ..Report::default() }),
        healthy_fanout4_rate: Mutex::new(None),
    };
    let machine = machine_line(&ctx).await.unwrap_or_else(|e| format!("machine: (could not read: {e:#})"));
    eprintln!("bench: {machine}");
    ctx.report.lock().expect("report lock").machine = machine;

    let mut failure = None;
    for s in scenarios {
        let result = match s {
            Scenario::Ingest => ingest::run(&ctx).await,
            Scenario::Drain => delivery::drain(&ctx).await,
            Scenario::E2e => e2e::run(&ctx).await,
            Scenario::Scaling => delivery::scaling(&ctx).await,
            Scenario::Failing => delivery::failing(&ctx).await,
            Scenario::Fairness => neighbours::fairness(&ctx).await,
            Scenario::Ordered => neighbours::ordered(&ctx).await,
            Scenario::Sustained => e2e::sustained(&ctx).await,
            Scenario::Pooler => pooler::run(&ctx).await,
            Scenario::Fleet => fleet::run(&ctx).await,
            Scenario::Filters => filters::run(&ctx).await,
            Scenario::Transforms => filters::transform_drain(&ctx).await,
            Scenario::Search => search::run(&ctx).await,
            Scenario::Memory => memory::run(&ctx).await,
            Scenario::Statements => statements::run(&ctx).await,
            Scenario::All => Ok(()),
        };
        if let Err(e) = result {
            eprintln!("bench: scenario {s:?} failed: {e:#}");
            ctx.note(format!("Scenario {s:?} stopped with an error: {e:#}"));
            failure = Some(e);
        }
    }

    let wall = started.elapsed();
    let bench_cpu = stats::self_cpu() - cpu_at_start;
    ctx.note(format!(
        "Load generator: the bench's own async HTTP/1.1 client (keep-alive, hand-written requests, HMAC-signed per \
         request); the subscriber sink (axum) runs in the same process. That process used {:.0} CPU-s in {:.0} s of \
         wall time ({:.2} cores on average, of the 2 that the load generator, the gateway, PostgreSQL and the sink \
         share); each row's CPU column splits its measured window: bench (load generator + sink), gw (gateway), \
         pg (all PostgreSQL processes), other (everything else on the machine, e.g. a concurrent build).",
        bench_cpu,
        wall.as_secs_f64(),
        bench_cpu / wall.as_secs_f64()
    ));
    let noisy: Vec<String> = {
        let report = ctx.report.lock().expect("report lock");
        report
            .rows
            .iter()
            .filter(|r| other_cores(&r.cpu) > NOISY_CORES)
            .map(|r| format!("{} ({})", r.id, r.setting))
            .collect()
    };
    if !noisy.is_empty() {
        ctx.note(format!(
            "Noisy rows (other processes on the machine used more than {NOISY_CORES} cores during the window, see the \
             CPU column): {}. Their absolute figures are low; the ratios measured side by side suffer less.",
            noisy.join("; ")
        ));
    }
    let report = ctx.report.into_inner().expect("report lock");
    let title = format!("webhook-gateway benchmark, {}", stamp.format("%Y-%m-%d %H:%M"));
    let md = report.markdown(&title);
    println!("{md}");
    if !ctx.args.no_write {
        std::fs::create_dir_all(&ctx.args.results_dir)?;
        let day = stamp.format("%Y-%m-%d").to_string();
        let mut path = ctx.args.results_dir.join(format!("{day}.md"));
        if path.exists() {
            path = ctx.args.results_dir.join(format!("{day}-{}.md", stamp.format("%H%M")));
        }
        std::fs::write(&path, &md).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("bench: results written to {}", path.display());
    }
    eprintln!("bench: logs of this run in {}", ctx.work_dir.display());
    ctx.server.stop().await;
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Above this many cores used by other processes, a row is flagged as noisy.
const NOISY_CORES: f64 = 0.25;

/// The `other` figure of a CPU cell.
fn other_cores(cpu: &str) -> f64 {
    cpu.split(" · ").find_map(|p| p.strip_prefix("other ")?.parse().ok()).unwrap_or(0.0)
}

/// The gateway binary a run measured: its path and the start of its SHA-256, so that two
/// runs meant to compare builds show whether they ran two binaries (the checkout's commit
/// says nothing of a binary given with `--gateway-bin`).
fn binary_fingerprint(path: &std::path::Path) -> String {
    use sha2::{Digest, Sha256};
    match std::fs::read(path) {
        Ok(bytes) => {
            let digest = Sha256::digest(&bytes);
            let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
            format!("{} (sha256 {hex}…)", path.display())
        }
        Err(e) => format!("{} (unreadable: {e})", path.display()),
    }
}

/// `machine: CPU ... · 2 cores · 23.4 GiB · PostgreSQL 15.x · synchronous_commit=on · fsync=on · ...`
async fn machine_line(ctx: &Ctx) -> anyhow::Result<String> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kb: f64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0.0);
    let db = ctx.server.create_db("bench_facts").await?;
    let pool = pg::pool(&db, 1).await?;
    let facts = pg::server_facts(&pool).await?;
    pool.close().await;
    ctx.server.drop_db("bench_facts").await;
    let fact = |n: &str| facts.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()).unwrap_or_default();
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into());
    let server = if ctx.args.database_url.is_some() { "DATABASE_URL server" } else { "embedded cluster" };
    let binary = binary_fingerprint(&ctx.gateway_bin);
    Ok(format!(
        "machine: CPU {model} · {cores} cores · {:.1} GiB RAM · PostgreSQL {} ({server}) · synchronous_commit={} · \
         fsync={} · full_page_writes={} · shared_buffers={} · max_wal_size={} · bench checkout {commit} · \
         gateway binary {binary} (release build)",
        mem_kb / 1024.0 / 1024.0,
        fact("server_version"),
        fact("synchronous_commit"),
        fact("fsync"),
        fact("full_page_writes"),
        fact("shared_buffers"),
        fact("max_wal_size"),
    ))
}
