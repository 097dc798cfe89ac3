//! Scenarios 1-3 (and the ingest half of 8): accepted webhooks/s and latency for unique
//! events and for duplicates at each concurrency, and pgbench running the gateway's own
//! ingest statement at the same concurrencies against the same database, interleaved so
//! both see the same table sizes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use sqlx::{Executor, PgPool};

use crate::Ctx;
use crate::gateway::{Gateway, Role};
use crate::loadgen::{self, Expect, MakeRequest};
use crate::pg::{self, PgbenchVars};
use crate::report::{Row, notes, verdict};
use crate::stats::{CpuMark, CpuShare, Latency, fmt_dur, fmt_rate};

/// Keys the duplicate scenario cycles through (each stored once beforehand).
const DUPLICATE_KEYS: u64 = 1000;
const DB: &str = "bench_ingest";

fn lat_cells(row: &mut Row, l: &Latency) {
    row.p50 = fmt_dur(l.p50);
    row.p99 = fmt_dur(l.p99);
    row.max = fmt_dur(l.max);
}

/// Run scenarios 1-3.
pub async fn run(ctx: &Ctx) -> anyhow::Result<()> {
    let url = ctx.server.create_db(DB).await?;
    let result = run_on(ctx, &url).await;
    ctx.server.drop_db(DB).await;
    result
}

async fn run_on(ctx: &Ctx, url: &str) -> anyhow::Result<()> {
    let log = ctx.work_dir.join("gateway-ingest.log");
    let gw = Gateway::start(&ctx.gateway_bin, url, Role::Ingest, &ctx.gateway_args(), &log).await?;
    gw.admin_post("/v1/sources", crate::payload::source_spec()).await?;
    // Fan-out 1: the statement inserts the event and one delivery, like pgbench below.
    // The gateway runs as `--role ingest`, so nothing is delivered meanwhile.
    gw.subscribe(&ctx.sink.ok_url(0)).await?;
    let pool = pg::pool(url, 2).await?;
    let statements = ctx.server.stat_statements && pg::reset_statements(&pool).await;
    let postmaster = ctx.server.postmaster();
    let script = ctx.work_dir.join("ingest.pgbench");
    let host = gw.addr.to_string();

    let mut vars: Option<PgbenchVars> = None;
    let top_c = ctx.args.concurrency.iter().copied().max().unwrap_or(1);
    for &c in &ctx.args.concurrency {
        // 1. Unique events.
        checkpoint(&pool).await;
        if statements && c == top_c {
            pg::reset_statements(&pool).await;
        }
        let watching = pg::waits::watch(url, ctx.warmup(), ctx.measure());
        let (mut out, share) = unique_window(ctx, &gw, postmaster, c).await;
        let gateway_rate = out.rate();
        let gateway_share = share;
        let mut row = Row {
            id: "1".into(),
            scenario: "Ingest, unique events".into(),
            setting: format!("{c} conn"),
            result: format!("{} accepted", fmt_rate(gateway_rate)),
            cpu: share.cell(),
            note: notes([Some(out.failure_note()), pg::waits::note(watching, gateway_rate, "webhook").await]),
            ..Row::default()
        };
        lat_cells(&mut row, &Latency::from_micros(&mut out.latencies));
        ctx.row(row);
        if statements && c == top_c {
            ctx.appendix(
                format!("pg_stat_statements: gateway ingest, unique events, {c} connections"),
                statements_table(&pool).await,
            );
        }

        // 3. pgbench, same statement, same database, same concurrency.
        if vars.is_none() {
            let v = pgbench_vars(&pool).await?;
            std::fs::write(&script, pg::pgbench_script(v.fresh_terms)?)?;
            vars = Some(v);
        }
        let v = vars.as_ref().expect("set above");
        checkpoint(&pool).await;
        if statements && c == top_c {
            pg::reset_statements(&pool).await;
        }
        pg::pgbench(&ctx.server, DB, &script, v, c, ctx.args.warmup_secs, None, None).await?;
        let mark = CpuMark::now(None, postmaster);
        let pgb_dir = ctx.work_dir.join(format!("pgbench-{c}"));
        let watching = pg::waits::watch(url, Duration::ZERO, ctx.measure());
        let pgb = pg::pgbench(&ctx.server, DB, &script, v, c, ctx.args.measure_secs, None, Some(&pgb_dir)).await?;
        let share = mark.share(&CpuMark::now(None, postmaster), Some(pgb.cpu_secs));
        let ratio = gateway_rate / pgb.tps.max(1e-9);
        let mut row = Row {
            id: "3".into(),
            scenario: "Physical limit: pgbench, same statement".into(),
            setting: format!("{c} conn"),
            result: format!("{} · gateway/pgbench **{ratio:.3}**", fmt_rate(pgb.tps)),
            target: if c >= 16 { verdict(ratio >= 0.70, "≥ 0.70") } else { "—".into() },
            cpu: share.cell(),
            note: notes([
                cpu_per_webhook(&gateway_share, gateway_rate, &share, pgb.tps),
                failed_note(pgb.failed),
                pg::waits::note(watching, pgb.tps, "transaction").await,
            ]),
            ..Row::default()
        };
        lat_cells(&mut row, &pgb.latency);
        ctx.row(row);
        if statements && c == top_c {
            ctx.appendix(
                format!("pg_stat_statements: pgbench, same statement, {c} connections"),
                statements_table(&pool).await,
            );
        }
    }
    let rss_ingest = gw.peak_rss();

    // 2. Duplicates: every request repeats one of DUPLICATE_KEYS stored webhooks.
    let base = ctx.reserve(DUPLICATE_KEYS);
    let requests: Vec<Vec<u8>> =
        (0..DUPLICATE_KEYS).map(|i| crate::payload::http_request(&host, &ctx.run_id, base + i)).collect();
    store_all(gw.addr, requests).await.context("storing the originals of the duplicates")?;
    for &c in &ctx.args.concurrency {
        checkpoint(&pool).await;
        let (run, h) = (ctx.run_id.clone(), host.clone());
        let n = Arc::new(AtomicU64::new(0));
        let make: MakeRequest = Arc::new(move || {
            let i = n.fetch_add(1, Ordering::Relaxed);
            crate::payload::http_request(&h, &run, base + i % DUPLICATE_KEYS)
        });
        let mark = CpuMark::now(Some(gw.pid), postmaster);
        let mut out = loadgen::closed_loop(gw.addr, c, ctx.warmup(), ctx.measure(), make, Expect::Duplicate).await;
        let share = mark.share(&CpuMark::now(Some(gw.pid), postmaster), None);
        let mut row = Row {
            id: "2".into(),
            scenario: "Ingest, 100% duplicates".into(),
            setting: format!("{c} conn"),
            result: format!("{} accepted", fmt_rate(out.rate())),
            cpu: share.cell(),
            note: out.failure_note(),
            ..Row::default()
        };
        lat_cells(&mut row, &Latency::from_micros(&mut out.latencies));
        ctx.row(row);
    }
    let rss_all = gw.stop(std::time::Duration::from_secs(30)).await;

    ctx.row(Row {
        id: "8".into(),
        scenario: "Memory: gateway peak RSS".into(),
        setting: "during 1 (ingest, role ingest)".into(),
        result: rss_ingest.map(mib).unwrap_or_else(|| "n/a".into()),
        note: format!("{} after 2 as well", rss_all.map(mib).unwrap_or_else(|| "n/a".into())),
        ..Row::default()
    });
    Ok(())
}

/// Server-side CPU per webhook, which a noisy machine disturbs less than the rates: on a
/// CPU-bound machine the throughput ratio tends to the inverse ratio of these.
fn cpu_per_webhook(gateway: &CpuShare, gateway_rate: f64, pgbench: &CpuShare, pgbench_tps: f64) -> Option<String> {
    let us = |cores: f64, rate: f64| cores / rate.max(1e-9) * 1e6;
    let (gw, pg) = (gateway.gateway?, gateway.postgres?);
    let pg_alone = pgbench.postgres?;
    let ours = us(gw + pg, gateway_rate);
    let limit = us(pg_alone, pgbench_tps);
    Some(format!(
        "server CPU per webhook: gateway {:.0} µs + PostgreSQL {:.0} µs = {ours:.0} µs, vs PostgreSQL {limit:.0} µs for \
         pgbench's transaction (CPU-bound ratio {:.2})",
        us(gw, gateway_rate),
        us(pg, gateway_rate),
        limit / ours.max(1e-9)
    ))
}

fn failed_note(failed: u64) -> Option<String> {
    (failed > 0).then(|| format!("{failed} failed transactions"))
}

/// `123.4 MiB`.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1024.0 / 1024.0)
}

/// One measured window of unique-event ingest into `gw` at `c` connections (each request
/// a new webhook of the bench source, numbered from `ctx.seq`): what the load generator
/// saw, and who used the CPU meanwhile (`postmaster`: PostgreSQL's, when known).
pub async fn unique_window(ctx: &Ctx, gw: &Gateway, postmaster: Option<u32>, c: usize) -> (loadgen::Outcome, CpuShare) {
    let (seq, run, h) = (ctx.seq.clone(), ctx.run_id.clone(), gw.addr.to_string());
    let make: MakeRequest =
        Arc::new(move || crate::payload::http_request(&h, &run, seq.fetch_add(1, Ordering::Relaxed)));
    let mark = CpuMark::now(Some(gw.pid), postmaster);
    let out = loadgen::closed_loop(gw.addr, c, ctx.warmup(), ctx.measure(), make, Expect::New).await;
    let share = mark.share(&CpuMark::now(Some(gw.pid), postmaster), None);
    (out, share)
}

/// A checkpoint before each measured window, so none of them pays for the previous one's
/// dirty pages more than another.
pub async fn checkpoint(pool: &PgPool) {
    if let Err(e) = pool.execute("CHECKPOINT").await {
        eprintln!("bench: CHECKPOINT failed (not a superuser?): {e}");
    }
}

/// pgbench's variables, taken from a webhook the gateway stored: same source, type,
/// content type, headers and (one) body.
pub async fn pgbench_vars(pool: &PgPool) -> anyhow::Result<PgbenchVars> {
    #[allow(clippy::type_complexity)]
    let rows: Vec<(String, String, Option<String>, String, String, Vec<i64>)> = sqlx::query_as(
        "SELECT source_id::text, event_type, content_type, headers::text, '\\x' || encode(payload, 'hex'),
                COALESCE(search, '{}')
         FROM events WHERE source_id = (SELECT id FROM sources WHERE name = $1)
         ORDER BY received_at DESC LIMIT 2",
    )
    .bind(crate::payload::SOURCE)
    .fetch_all(pool)
    .await?;
    let mut rows = rows.into_iter();
    let (source, etype, ctype, headers, payload_hex, terms) =
        rows.next().context("no event stored by the gateway to copy pgbench's parameters from")?;
    // The terms this event shares with the one before it stay; the others are drawn per
    // transaction (`pg::pgbench_script`).
    let before: std::collections::HashSet<i64> = rows.next().map(|r| r.5.into_iter().collect()).unwrap_or_default();
    let shared: Vec<String> = terms.iter().filter(|t| before.contains(t)).map(i64::to_string).collect();
    let fresh_terms = terms.len() - shared.len();
    let terms = format!("{{{}}}", shared.join(","));
    Ok(PgbenchVars { source, etype, ctype: ctype.unwrap_or_default(), headers, payload_hex, terms, fresh_terms })
}

/// Send every request once over 8 connections; all must be answered 200.
async fn store_all(addr: std::net::SocketAddr, requests: Vec<Vec<u8>>) -> anyhow::Result<()> {
    let queue = Arc::new(std::sync::Mutex::new(requests));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let queue = queue.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = loadgen::Conn::new(addr);
            loop {
                let next = queue.lock().expect("queue lock").pop();
                let Some(req) = next else { return Ok::<(), anyhow::Error>(()) };
                let (status, body) = conn.send(&req).await?;
                anyhow::ensure!(status == 200, "HTTP {status}: {}", String::from_utf8_lossy(&body));
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// The top statements of a database as a Markdown table.
pub async fn statements_table(pool: &PgPool) -> String {
    let rows = pg::top_statements(pool, 6).await;
    if rows.is_empty() {
        return "(no statistics)".into();
    }
    let mut out = String::from(
        "| calls | total ms | mean ms | max ms | plans | plan ms | rows | what | statement |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for s in rows {
        out.push_str(&format!(
            "| {} | {:.0} | {:.3} | {:.1} | {} | {:.0} | {} | {} | `{}` |\n",
            s.calls,
            s.total_ms,
            s.mean_ms,
            s.max_ms,
            s.plans,
            s.plan_ms,
            s.rows,
            pg::statement_kind(&s.query),
            pg::shorten(&s.query, 110).replace('|', "\\|").replace('`', "'")
        ));
    }
    out
}
