//! Scenarios 4, 6 and 7 (and the delivery half of 8): a backlog seeded straight into the
//! gateway's schema with `generate_series`, then drained by a `--role worker` gateway to
//! the sink. Claim latencies come from `pg_stat_statements` (mean, max, rows per claim)
//! and from the worker role's sampled statement log (p50, p99).

use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::PgPool;
use uuid::Uuid;

use crate::Ctx;
use crate::gateway::{Gateway, Role};
use crate::ingest::mib;
use crate::pg;
use crate::report::{Row, verdict};
use crate::stats::{CpuMark, CpuShare, Latency, fmt_dur, fmt_rate, thousands};

/// Rows per claim in the EXPLAIN of the claim (about what the workers claim at a time
/// under load; pg_stat_statements gives the real average).
const CLAIM_BATCH: i64 = 32;

/// A seeded scenario database.
pub(crate) struct Setup {
    /// Its name.
    pub db: String,
    /// A small pool on it.
    pub pool: PgPool,
    /// Endpoints that answer 200.
    pub healthy: usize,
    /// How long the seeding took.
    pub seeded_in: Duration,
}

/// Create the database, the source and the endpoints through a short-lived `--role
/// ingest` gateway (which also migrates), then seed `events` events with one pending
/// delivery per endpoint.
pub(crate) async fn prepare(ctx: &Ctx, db: &str, healthy: usize, failing: usize, events: u64) -> anyhow::Result<Setup> {
    let urls: Vec<String> =
        (0..healthy).map(|i| ctx.sink.ok_url(i)).chain((0..failing).map(|i| ctx.sink.failing_url(i))).collect();
    let (setup, _) = prepare_urls(ctx, db, &urls, events).await?;
    Ok(Setup { healthy, ..setup })
}

/// [`prepare`] for endpoints at these URLs (all subscribed to the bench source); also
/// returns the source's and the endpoints' ids, in the order of `urls`.
pub(crate) async fn prepare_urls(
    ctx: &Ctx,
    db: &str,
    urls: &[String],
    events: u64,
) -> anyhow::Result<(Setup, (Uuid, Vec<Uuid>))> {
    let url = ctx.server.create_db(db).await?;
    let log = ctx.work_dir.join(format!("gateway-{db}-setup.log"));
    let gw = Gateway::start(&ctx.gateway_bin, &url, Role::Ingest, &ctx.gateway_args(), &log).await?;
    let source = gw.admin_post("/v1/sources", crate::payload::source_spec()).await?;
    let source_id: Uuid = source["id"].as_str().context("source without id")?.parse()?;
    let mut endpoints = Vec::new();
    for url in urls {
        endpoints.push(gw.subscribe(url).await?.parse::<Uuid>()?);
    }
    gw.stop(Duration::from_secs(30)).await;
    let pool = pg::pool(&url, 4).await?;
    eprintln!("bench: seeding {} events × {} endpoints into {db} ...", thousands(events), endpoints.len());
    let seeded_in = pg::seed(&pool, source_id, &endpoints, events, &crate::payload::template()).await?;
    eprintln!("bench: seeded in {:.1} s", seeded_in.as_secs_f64());
    Ok((Setup { db: db.to_owned(), pool, healthy: urls.len(), seeded_in }, (source_id, endpoints)))
}

/// When a drain is over.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Until {
    /// `SELECT count(*) FROM deliveries WHERE status = 'pending'` is 0. Asked only once
    /// the sink has seen this many deliveries, so the harness does not load the database
    /// with counts meanwhile.
    NothingPending(u64),
    /// The sink has this many distinct healthy deliveries.
    Delivered(u64),
}

/// What a drain produced.
#[derive(Debug, Default)]
pub(crate) struct Drained {
    /// Distinct deliveries the sink answered 200.
    pub delivered: u64,
    /// Worker start to the end condition.
    pub elapsed: Duration,
    /// First to last 200 at the sink.
    pub sink_span: Duration,
    /// 200s for a delivery already answered 200.
    pub redelivered: u64,
    /// 503s answered (failing endpoints).
    pub failed: u64,
    /// Every request the sink answered (200 or 503).
    pub attempts: u64,
    /// The end condition was not reached in time.
    pub timed_out: bool,
    /// Sampled claim durations.
    pub claim: Option<Latency>,
    /// pg_stat_statements' view of the claim.
    pub claim_stats: Option<pg::StatementStats>,
    /// And of the claims by key (the deliveries ingest or the recorder handed over).
    pub fresh_claim_stats: Option<pg::StatementStats>,
    /// Peak RSS of the worker.
    pub rss: Option<u64>,
    /// CPU split.
    pub cpu: CpuShare,
    /// Top statements (Markdown).
    pub statements: Option<String>,
    /// The claim's plan before the drain.
    pub plan: String,
    /// Where the drain began and ended in the WAL, for [`pg::wal::by_relation`] (read by
    /// the scenarios that want it: seconds for a large drain).
    pub wal_window: Option<(pg::wal::Lsn, pg::wal::Lsn)>,
    /// The worker's outcome writes by the drain's end: how many, and the seconds they took
    /// (`webhook_gateway_outcome_write_seconds`; none from a build without it).
    pub outcome_writes: Option<(f64, f64)>,
}

impl Drained {
    pub fn rate(&self) -> f64 {
        self.delivered as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub fn sink_rate(&self) -> f64 {
        self.delivered.saturating_sub(1) as f64 / self.sink_span.as_secs_f64().max(1e-9)
    }

    pub fn claim_cells(&self, row: &mut Row) {
        match &self.claim {
            Some(l) if l.n > 0 => {
                row.p50 = fmt_dur(l.p50);
                row.p99 = fmt_dur(l.p99);
                row.max = fmt_dur(l.max);
            }
            _ => {
                row.p50 = "n/a".into();
                row.p99 = "n/a".into();
                row.max = self.claim_stats.as_ref().map(|s| format!("{:.2} ms", s.max_ms)).unwrap_or("n/a".into());
            }
        }
    }

    pub fn claim_note(&self) -> String {
        let mut parts = Vec::new();
        if let Some(l) = &self.claim {
            parts.push(format!("claim latency from {} sampled claims", l.n));
        }
        let claims = |kind: &str, s: &pg::StatementStats| {
            format!(
                "{} {kind}, mean {:.2} ms, {:.1} rows each",
                thousands(s.calls as u64),
                s.mean_ms,
                s.rows as f64 / s.calls.max(1) as f64
            )
        };
        if let Some(s) = &self.claim_stats {
            parts.push(format!("{} (pg_stat_statements)", claims("claims", s)));
        }
        if let Some(s) = &self.fresh_claim_stats {
            parts.push(claims("claims by key", s));
        }
        if let Some((writes, seconds)) = self.outcome_writes.filter(|(writes, _)| *writes > 0.0) {
            parts.push(format!(
                "the recorder writing {:.0} % of the time ({} outcome writes, mean {:.2} ms)",
                100.0 * seconds / self.elapsed.as_secs_f64().max(1e-9),
                thousands(writes as u64),
                1e3 * seconds / writes
            ));
        }
        if self.redelivered > 0 {
            parts.push(format!("{} redeliveries", thousands(self.redelivered)));
        }
        if self.timed_out {
            parts.push("TIMED OUT: partial rate".into());
        }
        parts.join("; ")
    }
}

/// Start a worker on a seeded database and time it until `until`. `Ok(Err(why))` when
/// this gateway build cannot deliver (no delivery engine yet).
pub(crate) async fn drain_with_worker(
    ctx: &Ctx,
    setup: &Setup,
    until: Until,
) -> anyhow::Result<Result<Drained, String>> {
    // The claim's plan at this backlog, before the worker starts (one claim, rolled back).
    let plan = pg::explain_claim(&setup.pool, CLAIM_BATCH).await;
    let statements = ctx.server.stat_statements && pg::reset_statements(&setup.pool).await;
    let log_path = ctx.server.log_path().filter(|_| ctx.server.sampled_log);
    let log_offset = ctx.server.log_offset();
    let postmaster = ctx.server.postmaster();
    ctx.sink.reset(false);
    let log = ctx.work_dir.join(format!("gateway-{}-worker.log", setup.db));
    let started = Instant::now();
    let worker_url = ctx.server.worker_url(&setup.db);
    let mut gw = match Gateway::start(&ctx.gateway_bin, &worker_url, Role::Worker, &ctx.gateway_args(), &log).await {
        Ok(gw) => gw,
        Err(e) => return Ok(Err(format!("the gateway does not start with --role worker: {e:#}"))),
    };
    let mark = CpuMark::now(Some(gw.pid), postmaster);
    let wal_before = pg::wal::lsn(&setup.pool).await;
    let progress_timeout = Duration::from_secs(ctx.args.progress_timeout_secs);
    let timeout = Duration::from_secs(ctx.args.drain_timeout_secs);
    let mut out = Drained { plan, ..Drained::default() };
    let mut polls: u64 = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        polls += 1;
        let c = ctx.sink.counts();
        let delivered = if c.without_id > 0 { c.ok } else { c.unique };
        let done = match until {
            // Every 5 s regardless, should some delivery end dead instead of at the sink.
            Until::NothingPending(total) => {
                (delivered >= total || polls.is_multiple_of(50)) && pg::pending(&setup.pool).await? == 0
            }
            Until::Delivered(n) => delivered >= n,
        };
        if done {
            break;
        }
        if c.ok + c.failed == 0 && started.elapsed() > progress_timeout {
            gw.stop(Duration::from_secs(5)).await;
            return Ok(Err(format!(
                "the gateway runs with --role worker but delivered nothing in {} s (no delivery engine in this \
                 build?); its log: {}",
                progress_timeout.as_secs(),
                log.display()
            )));
        }
        if !gw.alive() {
            anyhow::bail!("the worker exited during the drain: {}", gw.log_tail(3));
        }
        if started.elapsed() > timeout {
            out.timed_out = true;
            break;
        }
    }
    out.elapsed = started.elapsed();
    out.cpu = mark.share(&CpuMark::now(Some(gw.pid), postmaster), None);
    if let Some(before) = wal_before {
        out.wal_window = pg::wal::lsn(&setup.pool).await.map(|after| (before, after));
    }
    let c = ctx.sink.counts();
    out.delivered = if c.without_id > 0 { c.ok } else { c.unique };
    out.redelivered = c.redelivered;
    out.failed = c.failed;
    out.attempts = c.ok + c.failed;
    if let (Some(a), Some(b)) = (c.first_ok, c.last_ok) {
        out.sink_span = b.duration_since(a);
    }
    out.outcome_writes = gw.metrics().await.as_deref().and_then(outcome_writes);
    out.rss = gw.stop(Duration::from_secs(40)).await;
    if let Some(path) = log_path {
        let mut d = pg::logged_claims(&path, log_offset);
        if !d.is_empty() {
            out.claim = Some(Latency::from_micros(&mut d));
        }
    }
    if statements {
        let top = pg::top_statements(&setup.pool, 50).await;
        out.fresh_claim_stats =
            top.iter().find(|s| s.query.contains(webhook_gateway::queue::CLAIM_FRESH_FUNCTION)).cloned();
        out.claim_stats = top.into_iter().find(|s| pg::is_claim(&s.query));
        out.statements = Some(crate::ingest::statements_table(&setup.pool).await);
    }
    Ok(Ok(out))
}

/// The outcome writes' count and seconds in a `/metrics` text (a process has one
/// recorder, writing one batch at a time: the seconds over a window are its busy share).
fn outcome_writes(metrics: &str) -> Option<(f64, f64)> {
    use webhook_gateway::metrics::OUTCOME_WRITE_DURATION;
    let value = |suffix: &str| {
        metrics.lines().find_map(|line| {
            line.strip_prefix(OUTCOME_WRITE_DURATION)?
                .strip_prefix(suffix)?
                .strip_prefix(' ')?
                .trim()
                .parse::<f64>()
                .ok()
        })
    };
    Some((value("_count")?, value("_sum")?))
}

pub(crate) fn not_available(id: &str, scenario: &str, setting: &str, why: &str) -> Row {
    Row {
        id: id.into(),
        scenario: scenario.into(),
        setting: setting.into(),
        result: "not available".into(),
        p50: "—".into(),
        p99: "—".into(),
        max: "—".into(),
        target: "—".into(),
        note: why.into(),
        ..Row::default()
    }
}

/// Scenario 4: drain the backlog at fan-out 1 and fan-out 4.
pub async fn drain(ctx: &Ctx) -> anyhow::Result<()> {
    let total = ctx.args.drain_deliveries;
    let mut memory = Vec::new();
    for fanout in [1usize, 4] {
        let db = format!("bench_drain_f{fanout}");
        let setting = format!("{} pending, fan-out {fanout}", thousands(total));
        let events = total / fanout as u64;
        let seeded = events * fanout as u64;
        let setup = prepare(ctx, &db, fanout, 0, events).await?;
        let result = drain_with_worker(ctx, &setup, Until::NothingPending(seeded)).await;
        setup.pool.close().await;
        ctx.server.drop_db(&setup.db).await;
        let d = match result? {
            Ok(d) => d,
            Err(why) => {
                ctx.row(not_available("4", "Delivery drain", &setting, &why));
                memory.push(not_available(
                    "8",
                    "Memory: gateway peak RSS",
                    &format!("during 4, fan-out {fanout}"),
                    "no delivery engine",
                ));
                continue;
            }
        };
        if fanout == 4 {
            *ctx.healthy_fanout4_rate.lock().expect("lock") = Some(d.rate());
        }
        let mut row = Row {
            id: "4".into(),
            scenario: "Delivery drain (claim latency in p50/p99/max)".into(),
            setting,
            result: format!("{} deliveries", fmt_rate(d.rate())),
            target: if fanout == 1 { verdict(d.rate() >= 5000.0, "≥ 5,000/s") } else { "—".into() },
            cpu: d.cpu.cell(),
            note: format!(
                "{} delivered in {:.1} s from worker start to 0 pending (sink-side {}); seeded in {:.1} s; {}",
                thousands(d.delivered),
                d.elapsed.as_secs_f64(),
                fmt_rate(d.sink_rate()),
                setup.seeded_in.as_secs_f64(),
                d.claim_note()
            ),
            ..Row::default()
        };
        d.claim_cells(&mut row);
        ctx.row(row);
        if let Some(s) = &d.statements {
            ctx.appendix(format!("pg_stat_statements: delivery drain, fan-out {fanout}"), s.clone());
        }
        memory.push(Row {
            id: "8".into(),
            scenario: "Memory: gateway peak RSS".into(),
            setting: format!("during 4, fan-out {fanout} (role worker)"),
            result: d.rss.map(mib).unwrap_or_else(|| "n/a".into()),
            ..Row::default()
        });
    }
    for r in memory {
        ctx.row(r);
    }
    Ok(())
}

/// Scenario 6: the same timed stretch of work at each backlog size.
pub async fn scaling(ctx: &Ctx) -> anyhow::Result<()> {
    let mut sizes = ctx.args.backlog.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let Some(&measured) = sizes.first() else { return Ok(()) };
    let mut first_p50: Option<Duration> = None;
    for &size in &sizes {
        let db = format!("bench_scale_{size}");
        let setting = format!("{} pending", thousands(size));
        let setup = prepare(ctx, &db, 1, 0, size).await?;
        let result = drain_with_worker(ctx, &setup, Until::Delivered(measured)).await;
        setup.pool.close().await;
        ctx.server.drop_db(&setup.db).await;
        let d = match result? {
            Ok(d) => d,
            Err(why) => {
                ctx.row(not_available("6", "Backlog scaling", &setting, &why));
                continue;
            }
        };
        let p50 = d.claim.as_ref().filter(|l| l.n > 0).map(|l| l.p50);
        let target = match (first_p50, p50) {
            (Some(a), Some(b)) if size != measured => {
                let ratio = b.as_secs_f64() / a.as_secs_f64().max(1e-9);
                verdict(ratio <= 1.5, &format!("claim p50 ×{ratio:.2} of {} (≤ 1.5)", thousands(measured)))
            }
            _ => "—".into(),
        };
        if size == measured {
            first_p50 = p50;
        }
        let mut row = Row {
            id: "6".into(),
            scenario: "Backlog scaling (claim latency in p50/p99/max)".into(),
            setting,
            result: format!("{} deliveries (first {})", fmt_rate(d.sink_rate()), thousands(measured)),
            target,
            cpu: d.cpu.cell(),
            note: format!(
                "drain rate at the sink, first to last receipt; seeded in {:.1} s; {}",
                setup.seeded_in.as_secs_f64(),
                d.claim_note()
            ),
            ..Row::default()
        };
        d.claim_cells(&mut row);
        ctx.row(row);
        if let Some(s) = &d.statements {
            ctx.appendix(format!("pg_stat_statements: backlog scaling, {} pending", thousands(size)), s.clone());
        }
        ctx.appendix(
            format!(
                "Claim plan at {} pending (EXPLAIN ANALYZE, BUFFERS; {CLAIM_BATCH} rows, rolled back)",
                thousands(size)
            ),
            d.plan.clone(),
        );
    }
    Ok(())
}

/// Scenario 7: fan-out 4 where two of the four endpoints answer 503.
pub async fn failing(ctx: &Ctx) -> anyhow::Result<()> {
    let events = ctx.args.drain_deliveries / 4;
    let setting = format!("{} pending, 2 of 4 endpoints 503", thousands(events * 4));
    let setup = prepare(ctx, "bench_failing", 2, 2, events).await?;
    let healthy_total = events * setup.healthy as u64;
    let result = drain_with_worker(ctx, &setup, Until::Delivered(healthy_total)).await;
    let still_pending = pg::pending(&setup.pool).await.unwrap_or(-1);
    setup.pool.close().await;
    ctx.server.drop_db(&setup.db).await;
    let d = match result? {
        Ok(d) => d,
        Err(why) => {
            ctx.row(not_available("7", "Failing subscriber", &setting, &why));
            return Ok(());
        }
    };
    let healthy_rate = d.rate();
    let attempt_rate = d.attempts as f64 / d.elapsed.as_secs_f64().max(1e-9);
    let baseline = *ctx.healthy_fanout4_rate.lock().expect("lock");
    let compared = match baseline {
        Some(b) => format!(
            " · all attempts (200 + 503) {} = ×{:.2} of the all-healthy fan-out-4 drain ({})",
            fmt_rate(attempt_rate),
            attempt_rate / b,
            fmt_rate(b)
        ),
        None => format!(" · all attempts (200 + 503) {}", fmt_rate(attempt_rate)),
    };
    let mut row = Row {
        id: "7".into(),
        scenario: "Failing subscriber (claim latency in p50/p99/max)".into(),
        setting,
        result: format!("{} to the healthy half{compared}", fmt_rate(healthy_rate)),
        target: "— (healthy rate should not drop)".into(),
        cpu: d.cpu.cell(),
        note: format!(
            "{} healthy deliveries in {:.1} s from worker start; {} 503 answers meanwhile; {} still pending after \
             (failing endpoints' retries); {}",
            thousands(d.delivered),
            d.elapsed.as_secs_f64(),
            thousands(d.failed),
            thousands(still_pending.max(0) as u64),
            d.claim_note()
        ),
        ..Row::default()
    };
    d.claim_cells(&mut row);
    ctx.row(row);
    if let Some(s) = &d.statements {
        ctx.appendix("pg_stat_statements: failing subscriber", s.clone());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The count and sum are read from their own lines, not from a bucket's or another
    /// metric's whose name they start.
    #[test]
    fn outcome_writes_are_read_from_the_histogram_s_count_and_sum() {
        let text = "# TYPE webhook_gateway_outcome_write_seconds histogram
webhook_gateway_outcome_write_seconds_bucket{le=\"0.005\"} 3
webhook_gateway_outcome_write_seconds_sum 0.125
webhook_gateway_outcome_write_seconds_count 40
webhook_gateway_outcome_writes_total{ended=\"full\"} 40
";
        assert_eq!(super::outcome_writes(text), Some((40.0, 0.125)));
        assert_eq!(super::outcome_writes("webhook_gateway_outcome_writes_total{ended=\"full\"} 40\n"), None);
    }
}
