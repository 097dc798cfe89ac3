//! Scenarios 9 and 10: how deliveries share the workers. 9: fairness (1,000 endpoints
//! sharing a backlog; a slow endpoint's backlog next to healthy endpoints' fresh
//! webhooks; what a delivery costs while a rate limit holds a backlog back). 10: ordered
//! delivery per key (the drain with 100 and with 10,000 keys next to the unordered drain
//! of the same backlog, in one run).

use std::time::{Duration, Instant};

use crate::Ctx;
use crate::delivery::{Drained, Until, drain_with_worker, not_available, prepare, prepare_urls};
use crate::gateway::{Gateway, Role};
use crate::pg;
use crate::report::{Row, verdict};
use crate::stats::{CpuMark, Latency, fmt_rate, thousands};

/// Endpoints sharing the backlog in 9a.
const ENDPOINTS: usize = 1000;
/// The slow endpoint's backlog in 9b.
const SLOW_BACKLOG: u64 = 1500;
/// Healthy endpoints next to it, waves of fresh webhooks, webhooks per endpoint per wave.
const HEALTHY: usize = 4;
const WAVES: u64 = 5;
const PER_WAVE: u64 = 50;
/// The rate-limited endpoint's limit in 9c (its burst the default, one second's worth),
/// its backlog (longer than the run), and the measured window.
const RATE_LIMIT: i32 = 200;
const RATE_BACKLOG: u64 = 10_000;
const RATE_WINDOW: Duration = Duration::from_secs(15);

/// 9c: one endpoint limited to [`RATE_LIMIT`] requests a second with a backlog longer
/// than the run: the rate it gets, and what each delivery costs while every claim finds a
/// few tokens and leaves the rest of the backlog due.
async fn rate_limited(ctx: &Ctx) -> anyhow::Result<()> {
    let setting = format!("{} pending to one endpoint limited to {RATE_LIMIT}/s", thousands(RATE_BACKLOG));
    let urls = [ctx.sink.ok_url(0)];
    let (setup, (_, endpoints)) = prepare_urls(ctx, "bench_fair_rate", &urls, RATE_BACKLOG).await?;
    sqlx::query("UPDATE endpoints SET rate_limit_per_sec = $1::float8, rate_limit_burst = $1 WHERE id = $2")
        .bind(RATE_LIMIT)
        .bind(endpoints[0])
        .execute(&setup.pool)
        .await?;
    ctx.sink.reset(false);
    let log = ctx.work_dir.join("gateway-bench_fair_rate-worker.log");
    let url = ctx.server.worker_url(&setup.db);
    let mut gw = Gateway::start(&ctx.gateway_bin, &url, Role::Worker, &ctx.gateway_args(), &log).await?;
    // Past the first second's burst.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (sent_before, tx_before) = (ctx.sink.counts().ok, pg::transactions(&setup.pool).await?);
    let mark = CpuMark::now(Some(gw.pid), ctx.server.postmaster());
    tokio::time::sleep(RATE_WINDOW).await;
    let cpu = mark.share(&CpuMark::now(Some(gw.pid), ctx.server.postmaster()), None);
    let (sent_after, tx_after) = (ctx.sink.counts().ok, pg::transactions(&setup.pool).await?);
    let alive = gw.alive();
    gw.stop(Duration::from_secs(10)).await;
    setup.pool.close().await;
    ctx.server.drop_db(&setup.db).await;
    let delivered = sent_after.saturating_sub(sent_before);
    if !alive || delivered == 0 {
        ctx.row(not_available("9", "Rate-limited backlog", &setting, "the worker stopped or delivered nothing"));
        return Ok(());
    }
    let rate = delivered as f64 / RATE_WINDOW.as_secs_f64();
    let limit = f64::from(RATE_LIMIT);
    ctx.row(Row {
        id: "9".into(),
        scenario: "Rate-limited backlog: the rate it gets, what a delivery costs".into(),
        setting,
        result: format!("{} deliveries", fmt_rate(rate)),
        target: verdict((0.95 * limit..=1.05 * limit).contains(&rate), "the limit, ± 5 %"),
        cpu: cpu.cell(),
        note: format!(
            "{}; {:.2} transactions per delivery, over {:.0} s after the first second's burst",
            cpu.per_item("delivery", rate),
            (tx_after - tx_before) / delivered as f64,
            RATE_WINDOW.as_secs_f64()
        ),
        ..Row::default()
    });
    Ok(())
}

/// Scenario 9: fairness.
pub async fn fairness(ctx: &Ctx) -> anyhow::Result<()> {
    shared_backlog(ctx).await?;
    slow_neighbour(ctx).await?;
    rate_limited(ctx).await
}

/// 9a: the drain with the backlog spread over 1,000 endpoints (every claim serves many
/// endpoints: the fair claim's per-endpoint work at its largest).
async fn shared_backlog(ctx: &Ctx) -> anyhow::Result<()> {
    let per_endpoint = (ctx.args.drain_deliveries / ENDPOINTS as u64).max(1);
    let total = per_endpoint * ENDPOINTS as u64;
    let setting = format!("{} pending over {} endpoints", thousands(total), thousands(ENDPOINTS as u64));
    let setup = prepare(ctx, "bench_fair_shared", ENDPOINTS, 0, per_endpoint).await?;
    let result = drain_with_worker(ctx, &setup, Until::NothingPending(total)).await;
    setup.pool.close().await;
    ctx.server.drop_db(&setup.db).await;
    let d = match result? {
        Ok(d) => d,
        Err(why) => {
            ctx.row(not_available("9", "Fair drain", &setting, &why));
            return Ok(());
        }
    };
    let mut row = Row {
        id: "9".into(),
        scenario: "Fair drain, many endpoints (claim latency in p50/p99/max)".into(),
        setting,
        result: format!("{} deliveries", fmt_rate(d.rate())),
        target: "— (compare row 4, fan-out 1)".into(),
        cpu: d.cpu.cell(),
        note: format!(
            "{} delivered in {:.1} s from worker start to 0 pending; seeded in {:.1} s; {}",
            thousands(d.delivered),
            d.elapsed.as_secs_f64(),
            setup.seeded_in.as_secs_f64(),
            d.claim_note()
        ),
        ..Row::default()
    };
    d.claim_cells(&mut row);
    ctx.row(row);
    if let Some(s) = &d.statements {
        ctx.appendix(format!("pg_stat_statements: fair drain, {ENDPOINTS} endpoints"), s.clone());
    }
    Ok(())
}

/// 9b: a slow endpoint (1.5 s per answer) with a backlog, and healthy endpoints that get
/// fresh webhooks in waves once the slow one has taken its share of the workers: how long
/// the fresh ones wait, from their commit to their receipt.
async fn slow_neighbour(ctx: &Ctx) -> anyhow::Result<()> {
    let setting = format!(
        "{} pending to a 1.5 s endpoint; {} waves × {} × {HEALTHY} endpoints fresh",
        thousands(SLOW_BACKLOG),
        WAVES,
        PER_WAVE
    );
    let urls: Vec<String> =
        std::iter::once(ctx.sink.slow_url(0)).chain((0..HEALTHY).map(|i| ctx.sink.ok_url(i))).collect();
    let (setup, (source, endpoints)) = prepare_urls(ctx, "bench_fair_slow", &urls, 0).await?;
    let template = crate::payload::template();
    pg::seed(&setup.pool, source, &endpoints[..1], SLOW_BACKLOG, &template).await?;
    ctx.sink.reset(true);
    let log = ctx.work_dir.join("gateway-bench_fair_slow-worker.log");
    let url = ctx.server.worker_url(&setup.db);
    let mut gw = Gateway::start(&ctx.gateway_bin, &url, Role::Worker, &ctx.gateway_args(), &log).await?;
    let mark = CpuMark::now(Some(gw.pid), ctx.server.postmaster());
    // The slow endpoint takes its share of the workers within a claim cycle or two.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut sent: Vec<(u64, Instant)> = Vec::new();
    let mut next_seq: u64 = 1_000_000_001;
    for _ in 0..WAVES {
        for endpoint in &endpoints[1..] {
            let range = (next_seq, next_seq + PER_WAVE - 1);
            let at = Instant::now();
            pg::insert_due(&setup.pool, source, std::slice::from_ref(endpoint), range, &template).await?;
            sent.extend((range.0..=range.1).map(|seq| (seq, at)));
            next_seq += PER_WAVE;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let waits: Option<Vec<u64>> = loop {
        let seen: Vec<Option<Instant>> = sent.iter().map(|(seq, _)| ctx.sink.seen_at(*seq)).collect();
        if seen.iter().all(Option::is_some) {
            break Some(
                sent.iter()
                    .zip(seen)
                    .filter_map(|((_, at), seen)| Some(seen?.saturating_duration_since(*at).as_micros() as u64))
                    .collect(),
            );
        }
        if Instant::now() > deadline || !gw.alive() {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let slow_done = ctx.sink.counts().ok.saturating_sub(sent.len() as u64);
    let cpu = mark.share(&CpuMark::now(Some(gw.pid), ctx.server.postmaster()), None);
    gw.stop(Duration::from_secs(10)).await;
    setup.pool.close().await;
    ctx.server.drop_db(&setup.db).await;
    let Some(mut waits) = waits else {
        ctx.row(not_available("9", "Slow neighbour", &setting, "the fresh webhooks did not all arrive within 120 s"));
        return Ok(());
    };
    let l = Latency::from_micros(&mut waits);
    ctx.row(Row {
        id: "9".into(),
        scenario: "Slow neighbour: fresh webhooks' wait, commit to receipt".into(),
        setting,
        result: format!("{} fresh deliveries all arrived", thousands(sent.len() as u64)),
        p50: crate::stats::fmt_dur(l.p50),
        p99: crate::stats::fmt_dur(l.p99),
        max: crate::stats::fmt_dur(l.max),
        target: verdict(l.p99 <= Duration::from_secs(1), "p99 ≤ 1 s (about one claim cycle)"),
        cpu: cpu.cell(),
        note: format!(
            "the slow endpoint answered {} of its backlog meanwhile (at most its max_in_flight at a time: \
             --endpoint-max-in-flight, default half the workers); without the fair claim the fresh webhooks \
             waited behind its backlog (31 s median in the issue's measurement)",
            thousands(slow_done)
        ),
    });
    Ok(())
}

/// Scenario 10: the same backlog drained unordered, in 100 lines and in 10,000 lines.
pub async fn ordered(ctx: &Ctx) -> anyhow::Result<()> {
    let total = ctx.args.ordered_deliveries;
    let mut unordered_rate: Option<f64> = None;
    for keys in [None, Some(100u64), Some(10_000)] {
        let (db, setting) = match keys {
            None => ("bench_ordered_none".to_owned(), format!("{} pending, unordered", thousands(total))),
            Some(k) => (format!("bench_ordered_{k}"), format!("{} pending in {} keys", thousands(total), thousands(k))),
        };
        let setup = prepare(ctx, &db, 1, 0, total).await?;
        if let Some(k) = keys {
            pg::make_ordered(&setup.pool, k).await?;
        }
        let result = drain_with_worker(ctx, &setup, Until::NothingPending(total)).await;
        // What a line step writes, beside the unordered drain's (read before the database
        // goes).
        let wal = match &result {
            Ok(Ok(Drained { wal_window: Some((from, to)), delivered, .. })) => {
                pg::wal::by_relation(&setup.pool, from, to, *delivered as f64).await.ok()
            }
            _ => None,
        };
        setup.pool.close().await;
        ctx.server.drop_db(&setup.db).await;
        if let Some(rows) = wal {
            ctx.appendix(
                format!("WAL per delivery by relation (pg_walinspect): ordered drain, {setting}"),
                pg::wal::table(&rows),
            );
        }
        let d = match result? {
            Ok(d) => d,
            Err(why) => {
                ctx.row(not_available("10", "Ordered drain", &setting, &why));
                continue;
            }
        };
        let compared = match (keys, unordered_rate) {
            (None, _) => {
                unordered_rate = Some(d.rate());
                String::new()
            }
            (Some(_), Some(u)) => format!(" = ×{:.2} of unordered", d.rate() / u),
            (Some(_), None) => String::new(),
        };
        let line =
            keys.map_or(String::new(), |k| format!("each key's {} deliveries one at a time; ", thousands(total / k)));
        let mut row = Row {
            id: "10".into(),
            scenario: "Ordered drain, one endpoint (claim latency in p50/p99/max)".into(),
            setting,
            result: format!("{} deliveries{compared}", fmt_rate(d.rate())),
            target: "—".into(),
            cpu: d.cpu.cell(),
            note: format!(
                "{line}{} delivered in {:.1} s from worker start to 0 pending; {}",
                thousands(d.delivered),
                d.elapsed.as_secs_f64(),
                d.claim_note()
            ),
            ..Row::default()
        };
        d.claim_cells(&mut row);
        ctx.row(row);
        if let Some(s) = &d.statements {
            ctx.appendix(
                format!(
                    "pg_stat_statements: ordered drain, {}",
                    keys.map_or("unordered".into(), |k| format!("{k} keys"))
                ),
                s.clone(),
            );
        }
    }
    Ok(())
}
