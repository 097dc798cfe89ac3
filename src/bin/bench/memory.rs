//! Scenario 17: memory under big bodies. 512 connections each posting 1 MB JSON webhooks
//! as fast as they are answered, against an ingest-role gateway with the defaults (its
//! memory budget included): what is accepted, what is shed (503 `overloaded`), and the
//! gateway's peak RSS.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::Ctx;
use crate::gateway::{Gateway, Role};
use crate::loadgen::{self, Expect, MakeRequest};
use crate::report::{Row, verdict};
use crate::stats::{CpuMark, fmt_rate};

const DB: &str = "bench_memory";
/// Connections of the flood.
const CONNS: usize = 512;
/// Body size.
const BODY: usize = 1_000_000;
/// The goal for the gateway's peak RSS.
const GOAL_MIB: f64 = 512.0;

/// Run scenario 17.
pub async fn run(ctx: &Ctx) -> anyhow::Result<()> {
    let url = ctx.server.create_db(DB).await?;
    let result = run_on(ctx, &url).await;
    ctx.server.drop_db(DB).await;
    result
}

async fn run_on(ctx: &Ctx, url: &str) -> anyhow::Result<()> {
    let log = ctx.work_dir.join("gateway-memory.log");
    let gw = Gateway::start(&ctx.gateway_bin, url, Role::Ingest, &ctx.gateway_args(), &log).await?;
    gw.admin_post("/v1/sources", crate::payload::source_spec()).await?;
    gw.subscribe(&ctx.sink.ok_url(0)).await?;
    let idle = gw.peak_rss().unwrap_or(0);
    let (body, sig) = crate::payload::big_body(BODY);
    let (body, sig) = (Arc::new(body), Arc::new(sig));
    let (seq, run, host) = (ctx.seq.clone(), ctx.run_id.clone(), gw.addr.to_string());
    let make: MakeRequest =
        Arc::new(move || crate::payload::request_with(&host, &run, seq.fetch_add(1, Ordering::Relaxed), &body, &sig));
    let mark = CpuMark::now(Some(gw.pid), ctx.server.postmaster());
    let measure = Duration::from_secs(15);
    let out = loadgen::closed_loop(gw.addr, CONNS, Duration::from_secs(2), measure, make, Expect::New).await;
    let share = mark.share(&CpuMark::now(Some(gw.pid), ctx.server.postmaster()), None);
    let peak = gw.stop(Duration::from_secs(30)).await.unwrap_or(0);
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let shed = out.failures.get(&503).copied().unwrap_or(0);
    ctx.row(Row {
        id: "17".into(),
        scenario: "Memory: 1 MB JSON webhooks from 512 connections, defaults".into(),
        setting: format!("{CONNS} conn, {} s", measure.as_secs()),
        result: format!(
            "peak RSS **{:.0} MiB** (idle {:.0} MiB); {} accepted ({:.0} MB/s), {} answered 503 overloaded/s",
            mib(peak),
            mib(idle),
            fmt_rate(out.rate()),
            out.rate() * BODY as f64 / 1e6,
            fmt_rate(shed as f64 / measure.as_secs_f64()),
        ),
        target: verdict(mib(peak) <= GOAL_MIB, "≤ 512 MiB"),
        cpu: share.cell(),
        note: out.failure_note(),
        ..Row::default()
    });
    deliver_them(ctx, url).await?;
    ctx.note(format!(
        "Row 17: {CONNS} keep-alive connections each send a {BODY}-byte signed JSON webhook (a fresh key each time) \
         as soon as the last is answered, for {} s after a 2 s warm-up, to an ingest-role gateway with the default \
         memory budget (`--ingest-memory-mib 256`: bodies counted four times, so about 64 MB of bodies in flight). Peak \
         RSS is the kernel's high-water mark (VmHWM) of the gateway process for the whole run. Row 17b: a \
         worker-role gateway with the defaults (1,024 workers, `--delivery-memory-mib 128`) then delivers what row \
         17 stored to the bench's sink, for up to {} s; its peak RSS the same way.",
        measure.as_secs(),
        DELIVER_FOR.as_secs(),
    ));
    Ok(())
}

/// Longest row 17b delivers.
const DELIVER_FOR: Duration = Duration::from_secs(60);

/// Row 17b: a worker gateway delivers the 1 MB webhooks row 17 stored.
async fn deliver_them(ctx: &Ctx, url: &str) -> anyhow::Result<()> {
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(url).await?;
    let pending = crate::pg::pending(&pool).await?;
    let log = ctx.work_dir.join("gateway-memory-worker.log");
    let gw = Gateway::start(&ctx.gateway_bin, url, Role::Worker, &ctx.gateway_args(), &log).await?;
    let mark = CpuMark::now(Some(gw.pid), ctx.server.postmaster());
    let started = std::time::Instant::now();
    let mut left = pending;
    while left > 0 && started.elapsed() < DELIVER_FOR {
        tokio::time::sleep(Duration::from_millis(250)).await;
        left = crate::pg::pending(&pool).await?;
    }
    let took = started.elapsed();
    let share = mark.share(&CpuMark::now(Some(gw.pid), ctx.server.postmaster()), None);
    let peak = gw.stop(Duration::from_secs(30)).await.unwrap_or(0);
    pool.close().await;
    let delivered = pending - left;
    let mib = peak as f64 / (1024.0 * 1024.0);
    ctx.row(Row {
        id: "17b".into(),
        scenario: "Memory: delivering those 1 MB webhooks, defaults".into(),
        setting: format!("{} pending, 1,024 workers", crate::stats::thousands(pending as u64)),
        result: format!(
            "peak RSS **{mib:.0} MiB**; {} delivered in {:.1} s ({})",
            crate::stats::thousands(delivered as u64),
            took.as_secs_f64(),
            fmt_rate(delivered as f64 / took.as_secs_f64().max(1e-9)),
        ),
        target: verdict(mib <= GOAL_MIB, "≤ 512 MiB"),
        cpu: share.cell(),
        note: if left > 0 { format!("{left} still pending after {} s", DELIVER_FOR.as_secs()) } else { String::new() },
        ..Row::default()
    });
    Ok(())
}
