//! Scenario 14: what subscription filters cost at ingest. Unique-event ingest with ten
//! subscriptions of the bench source, side by side on one database: without filters
//! (ten deliveries per event), with a filter on each that every event matches (the same
//! ten deliveries, plus the document built and ten filters evaluated in the ingest
//! statement), and with a filter on each that no event matches (no delivery rows).

use crate::Ctx;
use crate::gateway::{Gateway, Role};
use crate::report::Row;
use crate::stats::{Latency, fmt_dur, fmt_rate};

const DB: &str = "bench_filters";
/// Subscriptions of the bench source.
const SUBSCRIPTIONS: usize = 10;
/// Rounds of the three variants, alternated.
const FILTER_ROUNDS: usize = 2;

/// One variant's measured window at one concurrency.
#[derive(Debug, Clone)]
struct Measured {
    rate: f64,
    latency: Latency,
    share: crate::stats::CpuShare,
    failures: String,
}

/// Run scenario 14.
pub async fn run(ctx: &Ctx) -> anyhow::Result<()> {
    let url = ctx.server.create_db(DB).await?;
    let result = run_on(ctx, &url).await;
    ctx.server.drop_db(DB).await;
    result
}

async fn run_on(ctx: &Ctx, url: &str) -> anyhow::Result<()> {
    let log = ctx.work_dir.join("gateway-filters.log");
    let gw = Gateway::start(&ctx.gateway_bin, url, Role::Ingest, &ctx.gateway_args(), &log).await?;
    gw.admin_post("/v1/sources", crate::payload::source_spec()).await?;
    let pool = crate::pg::pool(url, 1).await?;
    let postmaster = ctx.server.postmaster();
    let mut endpoints = Vec::new();
    for i in 0..SUBSCRIPTIONS {
        let ep = gw.admin_post("/v1/endpoints", serde_json::json!({"url": ctx.sink.ok_url(i)})).await?;
        endpoints.push(ep["id"].as_str().unwrap_or_default().to_owned());
    }
    let variants = [
        ("no filters", None),
        // Every bench event matches: the same deliveries, the filters' cost on top.
        ("a filter each, all match", Some("$.payload.data.object.amount_total > 1000 && $.type == \"order.paid\"")),
        // The bench's events are not live: nothing matches, no delivery row.
        ("a filter each, none match", Some("$.payload.livemode == true")),
    ];
    // Rounds alternate the variants: run once each in a fixed order, the later variants
    // met a larger `events` table and search index than the first (by a few hundred
    // thousand rows), and that, not the filters, was part of the difference.
    let conns = &ctx.args.concurrency;
    let mut rounds: Vec<Vec<Vec<Measured>>> = vec![vec![Vec::new(); conns.len()]; variants.len()];
    for _round in 0..FILTER_ROUNDS {
        for (v, (_, filter)) in variants.iter().enumerate() {
            sqlx::query("DELETE FROM subscriptions").execute(&pool).await?;
            for id in &endpoints {
                let mut sub = serde_json::json!({"endpoint_id": id, "source": crate::payload::SOURCE});
                if let Some(f) = filter {
                    sub["filter"] = serde_json::json!(f);
                }
                gw.admin_post("/v1/subscriptions", sub).await?;
            }
            for (k, &c) in conns.iter().enumerate() {
                crate::ingest::checkpoint(&pool).await;
                let (mut out, share) = crate::ingest::unique_window(ctx, &gw, postmaster, c).await;
                let latency = Latency::from_micros(&mut out.latencies);
                rounds[v][k].push(Measured { rate: out.rate(), latency, share, failures: out.failure_note() });
            }
        }
    }
    for (v, (how, filter)) in variants.iter().enumerate() {
        for (k, &c) in conns.iter().enumerate() {
            let measured = &rounds[v][k];
            let total = |m: &[Measured]| m.iter().map(|r| r.rate).sum::<f64>();
            let rate = total(measured) / measured.len().max(1) as f64;
            let of_base = filter.map(|_| total(measured) / total(&rounds[0][k]).max(1e-9));
            let each = measured.iter().map(|r| fmt_rate(r.rate)).collect::<Vec<_>>().join(", ");
            let last = measured.last().ok_or_else(|| anyhow::anyhow!("no round measured"))?;
            ctx.row(Row {
                id: "14".into(),
                scenario: format!("Ingest, {SUBSCRIPTIONS} subscriptions: {how}"),
                setting: format!("{c} conn, {FILTER_ROUNDS} rounds"),
                result: match of_base {
                    Some(x) => format!("{} accepted ({each}) · of no filters **{x:.2}**", fmt_rate(rate)),
                    None => format!("{} accepted ({each})", fmt_rate(rate)),
                },
                target: match (of_base, filter.is_some_and(|f| f.contains("amount_total"))) {
                    (Some(x), true) if c >= 16 => crate::report::verdict(x >= 0.90, "≥ 0.90"),
                    _ => "—".into(),
                },
                p50: fmt_dur(last.latency.p50),
                p99: fmt_dur(last.latency.p99),
                max: fmt_dur(last.latency.max),
                cpu: last.share.cell(),
                note: crate::report::notes([
                    Some(last.share.per_item("webhook", last.rate)),
                    Some(last.failures.clone()),
                ]),
            });
        }
    }
    gw.stop(std::time::Duration::from_secs(30)).await;
    ctx.note(
        "Row 14: unique-event ingest with ten subscriptions of the source, on one database: without filters, with a \
         filter on each that every event matches (the same ten deliveries per event; the event's document is built \
         once and the ten filters evaluated inside the ingest statement), and with a filter on each that no event \
         matches (no delivery row at all), in alternating rounds; each row's rate is its rounds' mean and its ratio \
         the ratio of their sums, its latency and CPU its last round's. The goal is the all-match row at ≥ 0.90 \
         of the unfiltered one.",
    );
    Ok(())
}

/// Deliveries in each drain of scenario 15.
const TRANSFORM_DRAIN: u64 = 30_000;
/// Rounds of each variant in scenario 15.
const TRANSFORM_ROUNDS: usize = 3;

/// Run scenario 15: the drain of one endpoint's backlog, without and with a
/// transformation (a Slack-style message built from the bench's event).
pub async fn transform_drain(ctx: &Ctx) -> anyhow::Result<()> {
    use crate::delivery::{Until, drain_with_worker, prepare};
    let script = "function handler(w) {\n  const o = w.payload.data.object;\n  \
                  return {text: `Order ${o.id} paid: ${o.amount_total / 100} ${o.currency.toUpperCase()}`};\n}";
    let variants = [("no transformation", None), ("a transformation (Slack message)", Some(script))];
    // Rounds alternate the two variants, and each row reports its median round: on a
    // shared machine one drain of each moved by a third from run to run.
    let mut drains: [Vec<crate::delivery::Drained>; 2] = [Vec::new(), Vec::new()];
    for _round in 0..TRANSFORM_ROUNDS {
        for (i, (how, transform)) in variants.iter().enumerate() {
            let db = if transform.is_some() { "bench_transform_on" } else { "bench_transform_off" };
            let setup = prepare(ctx, db, 1, 0, TRANSFORM_DRAIN).await?;
            if let Some(t) = transform {
                // Seeded rows bypass the fan-out: point them at the subscription as it would.
                sqlx::query("UPDATE subscriptions SET transform = $1").bind(t).execute(&setup.pool).await?;
                sqlx::query("UPDATE deliveries SET transform_by = (SELECT id FROM subscriptions LIMIT 1)")
                    .execute(&setup.pool)
                    .await?;
            }
            let result = drain_with_worker(ctx, &setup, Until::NothingPending(TRANSFORM_DRAIN)).await;
            setup.pool.close().await;
            ctx.server.drop_db(&setup.db).await;
            match result? {
                Ok(d) => drains[i].push(d),
                Err(why) => {
                    ctx.row(crate::delivery::not_available("15", "Drain with a transformation", how, &why));
                    return Ok(());
                }
            }
        }
    }
    let mut plain_rate = None;
    for ((how, _), mut runs) in variants.into_iter().zip(drains) {
        runs.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
        let rates: Vec<String> = runs.iter().map(|d| fmt_rate(d.rate())).collect();
        let d = &runs[runs.len() / 2];
        let rate = d.rate();
        let of_plain = plain_rate.map(|p: f64| rate / p.max(1e-9));
        ctx.row(Row {
            id: "15".into(),
            scenario: format!("Delivery drain, one endpoint: {how}"),
            setting: format!("{} pending, median of {TRANSFORM_ROUNDS}", crate::stats::thousands(TRANSFORM_DRAIN)),
            result: match of_plain {
                Some(x) => format!("{} deliveries · of no transformation **{x:.2}**", fmt_rate(rate)),
                None => format!("{} deliveries", fmt_rate(rate)),
            },
            target: match of_plain {
                Some(x) => crate::report::verdict(x >= 0.85, "≥ 0.85"),
                None => "—".into(),
            },
            cpu: d.cpu.cell(),
            note: format!("{}; rounds: {}", d.cpu.per_item("delivery", rate), rates.join(", ")),
            ..Row::default()
        });
        plain_rate.get_or_insert(rate);
    }
    ctx.note(
        "Row 15: the same backlog of one endpoint drained by one worker process, without and with a transformation \
         on its subscription (QuickJS with a warm context per script and thread; a short run on the worker's own \
         thread, a slow script on the transformation threads), in alternating rounds; each row is its median \
         round. The goal is ≥ 0.85 of the drain without.",
    );
    Ok(())
}
