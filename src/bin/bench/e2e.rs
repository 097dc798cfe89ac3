//! Scenario 5: end-to-end latency at a steady offered load. A `--role all` gateway (one
//! process ingesting and delivering, the default deployment) takes webhooks due at a
//! fixed rate; each body carries a sequence number, and the sink timestamps the first
//! delivery of each. Latency = sink receipt − the time the request was due (not when it
//! was sent, so a lagging generator cannot hide queueing).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::Ctx;
use crate::gateway::{Gateway, Role};
use crate::loadgen::{self, Ticket};
use crate::pg;
use crate::report::{Row, verdict};
use crate::stats::{CpuMark, Latency, fmt_dur, fmt_rate, thousands};

const DB: &str = "bench_e2e";

/// When each webhook of a run was due, and whether it is in the measured window.
type DueTimes = Arc<Mutex<Vec<Option<(Instant, bool)>>>>;

/// Run scenario 5 at each offered rate.
pub async fn run(ctx: &Ctx) -> anyhow::Result<()> {
    let url = ctx.server.create_db(DB).await?;
    let result = run_on(ctx, &url).await;
    ctx.server.drop_db(DB).await;
    result
}

async fn run_on(ctx: &Ctx, url: &str) -> anyhow::Result<()> {
    let log = ctx.work_dir.join("gateway-e2e.log");
    let gw = Gateway::start(&ctx.gateway_bin, url, Role::All, &ctx.gateway_args(), &log).await?;
    gw.admin_post("/v1/sources", crate::payload::source_spec()).await?;
    gw.subscribe(&ctx.sink.ok_url(0)).await?;
    let pool = pg::pool(url, 2).await?;
    let postmaster = ctx.server.postmaster();
    let host = gw.addr.to_string();
    let (warmup, measure) = (ctx.warmup(), ctx.measure());
    for &rate in &ctx.args.rates {
        let setting = format!("{}/s offered", thousands(rate));
        crate::ingest::checkpoint(&pool).await;
        ctx.sink.reset(true);
        let n = (rate as f64 * (warmup + measure).as_secs_f64()).ceil() as u64 + 1;
        let base = ctx.reserve(n);
        let due: DueTimes = Arc::new(Mutex::new(vec![None; n as usize]));
        let (h, run) = (host.clone(), ctx.run_id.clone());
        let make = Arc::new(move |seq: u64| crate::payload::http_request(&h, &run, seq));
        let record = due.clone();
        let on_due = Arc::new(move |t: Ticket| {
            if let Some(slot) = record.lock().expect("due lock").get_mut((t.seq - base) as usize) {
                *slot = Some((t.due, t.measured));
            }
        });
        let mark = CpuMark::now(Some(gw.pid), postmaster);
        let plan = loadgen::OpenLoop {
            addr: gw.addr,
            conns: ctx.args.e2e_conns,
            rate: rate as f64,
            warmup,
            measure,
            first_seq: base,
        };
        let mut out = loadgen::open_loop(plan, make, on_due).await;
        let share = mark.share(&CpuMark::now(Some(gw.pid), postmaster), None);
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
        let delivered = e2e.len();
        let e2e = Latency::from_micros(&mut e2e);
        let ingest = Latency::from_micros(&mut out.latencies);
        let ingest_note = format!(
            "ingest answer p50 {} / p99 {}; {} of {} measured webhooks delivered{}",
            fmt_dur(ingest.p50),
            fmt_dur(ingest.p99),
            thousands(delivered as u64),
            thousands(measured.len() as u64),
            match out.failure_note() {
                n if n.is_empty() => String::new(),
                n => format!("; {n}"),
            }
        );
        if delivered == 0 {
            ctx.row(Row {
                id: "5".into(),
                scenario: "End-to-end latency (producer → sink)".into(),
                setting,
                result: "not available".into(),
                p50: "—".into(),
                p99: "—".into(),
                max: "—".into(),
                target: "—".into(),
                cpu: share.cell(),
                note: format!("nothing reached the sink (no delivery engine in this build?); {ingest_note}"),
            });
            continue;
        }
        // Open loop: the answers to the window's webhooks came in over a longer span when
        // the gateway could not keep up: the offered rate is above what it sustains.
        let overload = if out.rate() < 0.95 * rate as f64 { " (overloaded: falls behind)" } else { "" };
        ctx.row(Row {
            id: "5".into(),
            scenario: "End-to-end latency (producer → sink)".into(),
            setting,
            result: format!("{} accepted{overload}", fmt_rate(out.rate())),
            p50: fmt_dur(e2e.p50),
            p99: fmt_dur(e2e.p99),
            max: fmt_dur(e2e.max),
            target: if rate == 500 {
                verdict(e2e.p50 < Duration::from_millis(50), "p50 < 50 ms")
            } else {
                "—".into()
            },
            cpu: share.cell(),
            note: ingest_note,
        });
        // Start the next rate on an empty queue.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline && pg::pending(&pool).await? > 0 {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    gw.stop(Duration::from_secs(40)).await;
    Ok(())
}
