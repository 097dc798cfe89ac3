//! Scenarios 5 and 11: end-to-end latency at steady offered loads, and the highest
//! offered load the gateway sustains. A `--role all` gateway (one process ingesting and
//! delivering, the default deployment) takes webhooks due at a fixed rate; each body
//! carries a sequence number, and the sink timestamps the first delivery of each.
//! Latency = sink receipt − the time the request was due (not when it was sent, so a
//! lagging generator cannot hide queueing).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::Ctx;
use crate::gateway::{Gateway, Role};
use crate::loadgen::{self, Ticket};
use crate::pg;
use crate::report::{Row, verdict};
use crate::stats::{self, CpuMark, CpuShare, Latency, fmt_dur, fmt_rate, thousands};

const DB: &str = "bench_e2e";
const SUSTAINED_DB: &str = "bench_sustained";

/// When each webhook of a run was due, and whether it is in the measured window.
type DueTimes = Arc<Mutex<Vec<Option<(Instant, bool)>>>>;

/// A sustained step holds when the gateway answered at least this share of the offered
/// rate ...
const KEEPS_PACE: f64 = 0.97;
/// ... and delivery kept up: every measured webhook arrived with a p99 within this (a
/// queue that grows through a 10 s window puts its p99 seconds behind).
const LAG_FLAT_P99: Duration = Duration::from_millis(500);

/// One offered load held for a warm-up and a measured window.
struct Step {
    rate: u64,
    /// Answered rate over the measured webhooks.
    accepted: f64,
    /// Commit-to-sink latency of the measured webhooks that arrived.
    e2e: Latency,
    delivered: usize,
    measured: usize,
    ingest: Latency,
    /// How late the load generator sent the measured webhooks (counted in both latencies).
    late: Latency,
    failures: String,
    cpu: CpuShare,
    /// Transactions PostgreSQL ran over the load's window, per accepted webhook.
    transactions: Option<f64>,
    /// WAL written over the load's window, per accepted webhook.
    wal: Option<pg::Wal>,
    /// Where the load's window begins and ends in the WAL, and the webhooks accepted over
    /// it, for [`pg::wal::by_relation`] (read after `pg_stat_statements`, which would
    /// count its reading otherwise).
    wal_window: Option<(pg::wal::Lsn, pg::wal::Lsn, f64)>,
    /// Context switches over the load's window per accepted webhook: the gateway's
    /// threads, and PostgreSQL's live processes (local cluster only).
    switches: (Option<f64>, Option<f64>),
    /// PostgreSQL's cores over the load's window by process kind (local cluster only),
    /// largest first.
    pg_split: Vec<(&'static str, f64)>,
    /// What PostgreSQL's client backends did in the measured window ([`pg::waits`]).
    waits: Option<String>,
    /// Who put the deliveries of the load's window on their leases ([`crate::leases`]).
    leases: Option<String>,
}

impl Step {
    /// `ingest answer p50 … / p99 …; N of M measured webhooks delivered[; failures]`.
    fn note(&self) -> String {
        format!(
            "ingest answer p50 {} / p99 {}; load generator late p50 {} / p99 {} (in both latencies); {} of {} \
             measured webhooks delivered{}",
            fmt_dur(self.ingest.p50),
            fmt_dur(self.ingest.p99),
            fmt_dur(self.late.p50),
            fmt_dur(self.late.p99),
            thousands(self.delivered as u64),
            thousands(self.measured as u64),
            match self.failures.as_str() {
                "" => String::new(),
                n => format!("; {n}"),
            }
        )
    }

    /// [`Step::note`] and, where measured, [`Step::cpu_note`], the backends' waits and
    /// who took the leases.
    fn full_note(&self) -> String {
        crate::report::notes([Some(self.note()), self.cpu_note(), self.waits.clone(), self.leases.clone()])
    }

    /// A process's CPU per accepted webhook (ingest + its delivery), in µs, from the cores
    /// it used over the window.
    fn us_per_webhook(&self, cores: f64) -> f64 {
        cores / self.accepted.max(1e-9) * 1e6
    }

    /// Gateway and PostgreSQL CPU per webhook (ingest + its delivery), in µs, and the
    /// transactions per webhook.
    fn cpu_note(&self) -> Option<String> {
        let us = |cores: f64| self.us_per_webhook(cores);
        let transactions = self.transactions.map(|t| format!(" in {t:.2} transactions")).unwrap_or_default();
        let wal = self
            .wal
            .map(|w| {
                format!(
                    ", writing {:.1} kB of WAL ({:.2} full-page images) synced to disk {:.2} times",
                    w.bytes / 1000.0,
                    w.full_pages,
                    w.syncs
                )
            })
            .unwrap_or_default();
        let switches = match self.switches {
            (Some(gw), Some(pg)) => format!("; context switches per webhook: gateway {gw:.1}, PostgreSQL {pg:.1}"),
            (Some(gw), None) => format!("; context switches per webhook: gateway {gw:.1}"),
            _ => String::new(),
        };
        let split = self
            .pg_split
            .iter()
            .filter(|(_, secs)| *secs > 0.0)
            .map(|(kind, cores)| format!("{kind} {:.0} µs", us(*cores)))
            .collect::<Vec<_>>();
        let split = if split.is_empty() { String::new() } else { format!(" (by process: {})", split.join(", ")) };
        Some(format!(
            "server CPU per webhook, ingest and delivery: gateway {:.0} µs + PostgreSQL {:.0} µs{split}{transactions}{wal}{switches}",
            us(self.cpu.gateway?),
            us(self.cpu.postgres?)
        ))
    }

    /// Whether the gateway sustained this step (see [`KEEPS_PACE`], [`LAG_FLAT_P99`]).
    fn sustained(&self) -> bool {
        self.failures.is_empty()
            && self.accepted >= KEEPS_PACE * self.rate as f64
            && self.delivered == self.measured
            && self.e2e.p99 <= LAG_FLAT_P99
    }
}

/// Run scenario 5 at each offered rate.
pub async fn run(ctx: &Ctx) -> anyhow::Result<()> {
    let url = ctx.server.create_db(DB).await?;
    let result = run_on(ctx, &url).await;
    ctx.server.drop_db(DB).await;
    result
}

/// Scenario 11: step the offered rate up until a step is not sustained.
pub async fn sustained(ctx: &Ctx) -> anyhow::Result<()> {
    let url = ctx.server.create_db(SUSTAINED_DB).await?;
    let result = sustained_on(ctx, &url).await;
    ctx.server.drop_db(SUSTAINED_DB).await;
    result
}

async fn start(ctx: &Ctx, url: &str, log: &str) -> anyhow::Result<(Gateway, PgPool)> {
    let gw = Gateway::start(&ctx.gateway_bin, url, Role::All, &ctx.gateway_args(), &ctx.work_dir.join(log)).await?;
    gw.admin_post("/v1/sources", crate::payload::source_spec()).await?;
    gw.subscribe(&ctx.sink.ok_url(0)).await?;
    Ok((gw, pg::pool(url, 2).await?))
}

async fn run_on(ctx: &Ctx, url: &str) -> anyhow::Result<()> {
    let (gw, pool) = start(ctx, url, "gateway-e2e.log").await?;
    let statements = ctx.server.stat_statements && pg::reset_statements(&pool).await;
    for &rate in &ctx.args.rates {
        if statements {
            pg::reset_statements(&pool).await;
        }
        let step = offer(ctx, &gw, &pool, url, rate, ctx.args.e2e_conns, WalByRelation::Read).await?;
        if statements {
            let table = crate::ingest::statements_table(&pool).await;
            ctx.appendix(format!("pg_stat_statements: end to end, {}/s offered", thousands(rate)), table);
        }
        if let Some((from, to, accepted)) = &step.wal_window
            && let Ok(rows) = pg::wal::by_relation(&pool, from, to, *accepted).await
        {
            ctx.appendix(
                format!("WAL per webhook by relation (pg_walinspect): end to end, {}/s offered", thousands(rate)),
                pg::wal::table(&rows),
            );
        }
        let setting = format!("{}/s offered", thousands(rate));
        if step.delivered == 0 {
            ctx.row(Row {
                id: "5".into(),
                scenario: "End-to-end latency (producer → sink)".into(),
                setting,
                result: "not available".into(),
                p50: "—".into(),
                p99: "—".into(),
                max: "—".into(),
                target: "—".into(),
                cpu: step.cpu.cell(),
                note: format!("nothing reached the sink (no delivery engine in this build?); {}", step.note()),
            });
            continue;
        }
        // Open loop: the answers to the window's webhooks came in over a longer span when
        // the gateway could not keep up: the offered rate is above what it sustains.
        let overload = if step.accepted < 0.95 * rate as f64 { " (overloaded: falls behind)" } else { "" };
        // µs per webhook, ingest and delivery, by process (absent without a CPU reading).
        let (gw_us, pg_us) =
            (step.cpu.gateway.map(|c| step.us_per_webhook(c)), step.cpu.postgres.map(|c| step.us_per_webhook(c)));
        let target = match rate {
            // Issue 31's goals at a trickle: what a user billed by CPU pays per webhook.
            300 => verdict(
                step.e2e.p50 <= Duration::from_micros(1200) && gw_us.zip(pg_us).is_some_and(|(g, p)| g + p <= 600.0),
                "p50 ≤ 1.2 ms, gateway + PostgreSQL ≤ 600 µs a webhook",
            ),
            500 => verdict(
                step.e2e.p50 < Duration::from_millis(50) && pg_us.is_some_and(|p| p <= 300.0),
                "p50 < 50 ms, PostgreSQL ≤ 300 µs a webhook",
            ),
            1000 => verdict(
                step.e2e.p50 <= Duration::from_millis(10) && step.e2e.p99 <= Duration::from_millis(50),
                "p50 ≤ 10 ms, p99 ≤ 50 ms",
            ),
            _ => "—".into(),
        };
        ctx.row(Row {
            id: "5".into(),
            scenario: "End-to-end latency (producer → sink)".into(),
            setting,
            result: format!("{} accepted{overload}", fmt_rate(step.accepted)),
            p50: fmt_dur(step.e2e.p50),
            p99: fmt_dur(step.e2e.p99),
            max: fmt_dur(step.e2e.max),
            target,
            cpu: step.cpu.cell(),
            note: step.full_note(),
        });
    }
    gw.stop(Duration::from_secs(40)).await;
    if ctx.args.no_floor {
        return Ok(());
    }
    let vars = crate::ingest::pgbench_vars(&pool).await?;
    let ingest = ctx.work_dir.join("e2e-floor.pgbench");
    std::fs::write(&ingest, pg::pgbench_script(vars.fresh_terms)?)?;
    let commit = ctx.work_dir.join("e2e-floor-commit.pgbench");
    std::fs::write(&commit, format!("INSERT INTO {COMMIT_FLOOR_TABLE} DEFAULT VALUES;\n"))?;
    sqlx::query(&format!("CREATE TABLE {COMMIT_FLOOR_TABLE} (id bigserial PRIMARY KEY)")).execute(&pool).await?;
    for &rate in &ctx.args.rates {
        floor(ctx, &pool, Floor::IngestStatement, &ingest, &vars, rate).await?;
        floor(ctx, &pool, Floor::OneRowCommit, &commit, &vars, rate).await?;
    }
    sqlx::query(&format!("DROP TABLE {COMMIT_FLOOR_TABLE}")).execute(&pool).await?;
    Ok(())
}

/// The table of [`Floor::OneRowCommit`]: a `bigserial` key and nothing else.
const COMMIT_FLOOR_TABLE: &str = "bench_commit_floor";

/// What a row 5 floor runs.
#[derive(Clone, Copy)]
enum Floor {
    /// The gateway's ingest statement alone (the lean one: the bench's source neither
    /// filters, orders nor transforms).
    IngestStatement,
    /// A one-row `INSERT` of a key alone, each its own commit: what any design that
    /// commits each webhook before answering pays at this rate, whatever it writes.
    OneRowCommit,
}

/// pgbench's connections for [`floor`].
const FLOOR_CLIENTS: usize = 4;

/// Row 5's physical floors: pgbench at the same rate, on the same database (the gateway
/// stopped), running the ingest statement alone, then a one-row commit. At a low rate
/// PostgreSQL's CPU per commit is partly waking an idle backend and flushing the WAL,
/// whatever the statement does; a lone webhook costs the gateway its ingest commit (which
/// leases its deliveries) and a share of an outcome commit: these say what each part
/// costs on this machine.
async fn floor(
    ctx: &Ctx,
    pool: &PgPool,
    kind: Floor,
    script: &std::path::Path,
    vars: &pg::PgbenchVars,
    rate: u64,
) -> anyhow::Result<()> {
    crate::ingest::checkpoint(pool).await;
    let postmaster = ctx.server.postmaster();
    let secs = ctx.args.measure_secs;
    let mark = CpuMark::now(None, postmaster);
    // The per-transaction log gives the floor's latency: with `-R` each transaction's time
    // counts from its scheduled start, as the gateway's answer counts from the producer's
    // send, so the two are side by side.
    let log_dir = ctx.work_dir.join("e2e-floor-log");
    let wal_before = pg::wal(pool).await.ok();
    let run = pg::pgbench(&ctx.server, DB, script, vars, FLOOR_CLIENTS, secs, Some(rate), Some(&log_dir)).await?;
    let cpu = mark.share(&CpuMark::now(None, postmaster), Some(run.cpu_secs));
    // After pgbench's backends have gone (they report their counts as they exit).
    let wal = wal_before.zip(pg::wal(pool).await.ok()).map(|(before, after)| before.per(&after, run.tps * secs as f64));
    let us = |cores: Option<f64>| {
        cores.map_or_else(|| "n/a".to_owned(), |c| format!("{:.0} µs", c / run.tps.max(1e-9) * 1e6))
    };
    let (scenario, what) = match kind {
        Floor::IngestStatement => (
            "Physical floor: pgbench, the ingest statement alone at the same rate",
            "one commit of the event and its delivery",
        ),
        Floor::OneRowCommit => (
            "Physical floor: pgbench, a one-row commit at the same rate",
            "one commit of a row holding only its key: the least a commit per webhook costs",
        ),
    };
    ctx.row(Row {
        id: "5".into(),
        scenario: scenario.into(),
        setting: format!("{}/s offered, {FLOOR_CLIENTS} connections", thousands(rate)),
        result: format!("{} transactions", fmt_rate(run.tps)),
        p50: fmt_dur(run.latency.p50),
        p99: fmt_dur(run.latency.p99),
        max: fmt_dur(run.latency.max),
        target: "—".into(),
        cpu: cpu.cell(),
        note: format!(
            "CPU per transaction ({what}): PostgreSQL {}, pgbench {}{}; a lone webhook costs the gateway its \
             ingest commit (which leases its deliveries) and a share of an outcome commit (the recorder's batch); the \
             latency columns are one commit's, from its scheduled start (compare the ingest answer above){}",
            us(cpu.postgres),
            us(cpu.pgbench),
            wal.map(|w| format!(
                "; WAL {:.1} kB per transaction ({:.2} full-page images; the run starts right after a checkpoint)",
                w.bytes / 1000.0,
                w.full_pages
            ))
            .unwrap_or_default(),
            if run.failed > 0 { format!("; {} failed transactions", thousands(run.failed)) } else { String::new() }
        ),
    });
    Ok(())
}

async fn sustained_on(ctx: &Ctx, url: &str) -> anyhow::Result<()> {
    let (gw, pool) = start(ctx, url, "gateway-sustained.log").await?;
    let statements = ctx.server.stat_statements && pg::reset_statements(&pool).await;
    let mut best: Option<Step> = None;
    let mut first_failed: Option<Step> = None;
    for &rate in &ctx.args.sustained_rates {
        if statements {
            pg::reset_statements(&pool).await;
        }
        let step = offer(ctx, &gw, &pool, url, rate, ctx.args.sustained_conns, WalByRelation::Skip).await?;
        if statements {
            let table = crate::ingest::statements_table(&pool).await;
            ctx.appendix(format!("pg_stat_statements: sustained end to end, {}/s offered", thousands(rate)), table);
        }
        let holds = step.sustained();
        eprintln!(
            "bench: sustained {rate}/s: accepted {:.0}/s, e2e p99 {}, {}/{} delivered: {}",
            step.accepted,
            fmt_dur(step.e2e.p99),
            step.delivered,
            step.measured,
            if holds { "holds" } else { "does not hold" }
        );
        ctx.row(step_row(&step, if holds { "holds" } else { "❌ falls behind" }));
        if holds {
            best = Some(step);
        } else {
            first_failed = Some(step);
            break;
        }
    }
    let summary = match (&best, &first_failed) {
        (Some(b), Some(f)) => {
            format!("highest step held: {}/s; {}/s did not hold", thousands(b.rate), thousands(f.rate))
        }
        (Some(b), None) => {
            format!("every step held, up to {}/s: step higher with --sustained-rates", thousands(b.rate))
        }
        (None, _) => "no step held".into(),
    };
    ctx.row(Row {
        id: "11".into(),
        scenario: "Highest sustained end to end (open loop)".into(),
        setting: "summary".into(),
        result: best.as_ref().map(|b| format!("{}/s", thousands(b.rate))).unwrap_or_else(|| "none".into()),
        target: verdict(best.as_ref().is_some_and(|b| b.rate >= 6000), "≥ 6,000/s"),
        note: format!(
            "{summary}. A step holds when ≥ {:.0} % of the offered rate is answered 200, every measured webhook is \
             delivered and the delivery p99 stays ≤ {} (a backlog that grows through the window pushes it to seconds)",
            KEEPS_PACE * 100.0,
            fmt_dur(LAG_FLAT_P99)
        ),
        ..Row::default()
    });
    gw.stop(Duration::from_secs(40)).await;
    Ok(())
}

fn step_row(step: &Step, verdict_cell: &str) -> Row {
    Row {
        id: "11".into(),
        scenario: "Highest sustained end to end (open loop)".into(),
        setting: format!("{}/s offered", thousands(step.rate)),
        result: format!("{} accepted", fmt_rate(step.accepted)),
        p50: fmt_dur(step.e2e.p50),
        p99: fmt_dur(step.e2e.p99),
        max: fmt_dur(step.e2e.max),
        target: verdict_cell.into(),
        cpu: step.cpu.cell(),
        note: step.full_note(),
    }
}

/// A counter's growth between two readings, per one of `per`.
fn per_webhook(before: Option<u64>, after: Option<u64>, per: f64) -> Option<f64> {
    Some(after?.saturating_sub(before?) as f64 / per.max(1.0))
}

/// Whether [`offer`] reads the window's WAL record by record (seconds at high rates, so
/// row 5 does and row 11's steps do not).
#[derive(Clone, Copy, PartialEq, Eq)]
enum WalByRelation {
    Read,
    Skip,
}

/// Offer `rate` webhooks/s for the warm-up and the measured window, wait for the
/// measured ones to arrive (30 s at most), and leave the queue empty for the next step.
async fn offer(
    ctx: &Ctx,
    gw: &Gateway,
    pool: &PgPool,
    url: &str,
    rate: u64,
    conns: usize,
    wal_by_relation: WalByRelation,
) -> anyhow::Result<Step> {
    let (warmup, measure) = (ctx.warmup(), ctx.measure());
    crate::ingest::checkpoint(pool).await;
    ctx.sink.reset(true);
    let n = (rate as f64 * (warmup + measure).as_secs_f64()).ceil() as u64 + 1;
    let base = ctx.reserve(n);
    let due: DueTimes = Arc::new(Mutex::new(vec![None; n as usize]));
    let (h, run) = (gw.addr.to_string(), ctx.run_id.clone());
    let make = Arc::new(move |seq: u64| crate::payload::http_request(&h, &run, seq));
    let record = due.clone();
    let on_due = Arc::new(move |t: Ticket| {
        if let Some(slot) = record.lock().expect("due lock").get_mut((t.seq - base) as usize) {
            *slot = Some((t.due, t.measured));
        }
    });
    let postmaster = ctx.server.postmaster();
    let plan = loadgen::OpenLoop { addr: gw.addr, conns, rate: rate as f64, warmup, measure, first_seq: base };
    // The CPU window is the load's: ingest and the delivery that keeps pace with it.
    let mark = CpuMark::now(Some(gw.pid), postmaster);
    let processes_before = postmaster.map(stats::PgProcesses::now);
    let switches_before = (stats::context_switches(gw.pid), postmaster.map(stats::children_context_switches));
    // Backends report their counts at most once a second: over a window of 10 s or more
    // the edges roughly cancel.
    let transactions_before = pg::transactions(pool).await.ok();
    let wal_before = pg::wal(pool).await.ok();
    let lsn_before = if wal_by_relation == WalByRelation::Read { pg::wal::lsn(pool).await } else { None };
    let watching = pg::waits::watch(url, warmup, measure);
    let leases_before = crate::leases::scrape(gw).await;
    let mut out = loadgen::open_loop(plan, make, on_due).await;
    let cpu = mark.share(&CpuMark::now(Some(gw.pid), postmaster), None);
    let window = mark.elapsed().as_secs_f64().max(1e-6);
    let pg_split = processes_before
        .zip(postmaster.map(stats::PgProcesses::now))
        .map(|(before, after)| before.split(&after).into_iter().map(|(kind, secs)| (kind, secs / window)).collect())
        .unwrap_or_default();
    let switches_after = (stats::context_switches(gw.pid), postmaster.map(stats::children_context_switches));
    let transactions_after = pg::transactions(pool).await.ok();
    let wal_after = pg::wal(pool).await.ok();
    let lsn_after = if lsn_before.is_some() { pg::wal::lsn(pool).await } else { None };
    let measured: Vec<(u64, Instant)> = due
        .lock()
        .expect("due lock")
        .iter()
        .enumerate()
        .filter_map(|(i, d)| d.filter(|(_, m)| *m).map(|(at, _)| (base + i as u64, at)))
        .collect();
    // Let the tail of the run arrive.
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && measured.iter().any(|(s, _)| ctx.sink.seen_at(*s).is_none()) {
        if ctx.sink.counts().ok == 0 && Instant::now() + Duration::from_secs(20) > deadline {
            break; // nothing at all arrives: no delivery engine
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut e2e: Vec<u64> = measured
        .iter()
        .filter_map(|(s, at)| Some(ctx.sink.seen_at(*s)?.saturating_duration_since(*at).as_micros() as u64))
        .collect();
    // Webhooks accepted over the window the counters above span (the per-webhook divisor).
    let accepted = (out.rate() * (warmup + measure).as_secs_f64()).max(1.0);
    let waits = pg::waits::note(watching, out.rate(), "webhook").await;
    // Start the next rate on an empty queue.
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline && pg::pending(pool).await? > 0 {
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Read once the queue is empty: the window's webhooks and their deliveries, all leased.
    let leases = leases_before.zip(crate::leases::scrape(gw).await).and_then(|(before, after)| before.note(&after));
    Ok(Step {
        rate,
        accepted: out.rate(),
        delivered: e2e.len(),
        measured: measured.len(),
        e2e: Latency::from_micros(&mut e2e),
        ingest: Latency::from_micros(&mut out.latencies),
        late: Latency::from_micros(&mut out.lateness),
        transactions: transactions_before.zip(transactions_after).map(|(before, after)| (after - before) / accepted),
        wal: wal_before.zip(wal_after).map(|(before, after)| before.per(&after, accepted)),
        wal_window: lsn_before.zip(lsn_after).map(|(from, to)| (from, to, accepted)),
        switches: (
            per_webhook(switches_before.0, switches_after.0, accepted),
            per_webhook(switches_before.1, switches_after.1, accepted),
        ),
        failures: out.failure_note(),
        cpu,
        pg_split,
        waits,
        leases,
    })
}
