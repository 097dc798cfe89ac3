//! Scenario 12: what running behind a transaction pooler costs. Unique-event ingest at
//! each concurrency, straight to PostgreSQL and through the distribution's PgBouncer in
//! transaction mode (`--db-pooler transaction`: unnamed statements, each statement of
//! the pool in its own transaction), side by side on one database.

use crate::Ctx;
use crate::gateway::{Gateway, Role};
use crate::report::Row;
use crate::stats::{Latency, fmt_dur, fmt_rate};

// The test suite's PgBouncer launcher, shared rather than copied (std, url and libc only).
#[path = "../../../tests/it/support/pgbouncer.rs"]
#[allow(dead_code)]
mod pgbouncer;

const DB: &str = "bench_pooler";

/// Run scenario 12.
pub async fn run(ctx: &Ctx) -> anyhow::Result<()> {
    let url = ctx.server.create_db(DB).await?;
    let result = run_on(ctx, &url).await;
    ctx.server.drop_db(DB).await;
    result
}

async fn run_on(ctx: &Ctx, url: &str) -> anyhow::Result<()> {
    // As many server connections as the gateway's pool holds: the pooler adds its hop and
    // the gateway its extra round trips, nothing else.
    let server_url = url.to_owned();
    let bouncer = tokio::task::spawn_blocking(move || pgbouncer::PgBouncer::start(&server_url, 16)).await?;
    let pooled = bouncer.url(DB, url);
    let postmaster = ctx.server.postmaster();
    let mut rates: Vec<(usize, f64)> = Vec::new();
    for (how, database_url, extra) in [
        ("direct", url.to_owned(), Vec::new()),
        ("PgBouncer, transaction mode", pooled, vec!["--db-pooler".to_owned(), "transaction".to_owned()]),
    ] {
        let log = ctx.work_dir.join(format!("gateway-pooler-{}.log", rates.len()));
        let args: Vec<String> = ctx.gateway_args().into_iter().chain(extra).collect();
        let gw = Gateway::start(&ctx.gateway_bin, &database_url, Role::Ingest, &args, &log).await?;
        if rates.is_empty() {
            gw.admin_post("/v1/sources", crate::payload::source_spec()).await?;
            gw.subscribe(&ctx.sink.ok_url(0)).await?;
        }
        for &c in &ctx.args.concurrency {
            let (mut out, share) = crate::ingest::unique_window(ctx, &gw, postmaster, c).await;
            let rate = out.rate();
            let direct = rates.iter().find(|(conns, _)| *conns == c).map(|(_, r)| *r);
            let latency = Latency::from_micros(&mut out.latencies);
            ctx.row(Row {
                id: "12".into(),
                scenario: format!("Ingest, unique events: {how}"),
                setting: format!("{c} conn"),
                result: match direct {
                    Some(d) => format!("{} accepted · of direct **{:.2}**", fmt_rate(rate), rate / d.max(1e-9)),
                    None => format!("{} accepted", fmt_rate(rate)),
                },
                p50: fmt_dur(latency.p50),
                p99: fmt_dur(latency.p99),
                max: fmt_dur(latency.max),
                cpu: share.cell(),
                note: crate::report::notes([Some(share.per_item("webhook", rate)), Some(out.failure_note())]),
                ..Row::default()
            });
            if direct.is_none() {
                rates.push((c, rate));
            }
        }
        gw.stop(std::time::Duration::from_secs(30)).await;
    }
    ctx.note(
        "Row 12: the gateway behind the distribution's PgBouncer (1.18) in transaction mode, 16 server connections, \
         beside the same gateway straight to PostgreSQL on the same database. PgBouncer's own CPU is under `other`. \
         Behind the pooler every statement is parsed and planned for each call (unnamed statements) and a statement \
         outside a transaction gets its own BEGIN/COMMIT: two to four round trips instead of one.",
    );
    drop(bouncer);
    Ok(())
}
