//! Scenario 13: what a fleet costs PostgreSQL. 1, 4 and 8 replicas (`--role all`, the
//! defaults) on one database, idle and at 1,000 webhooks/s spread over them: PostgreSQL's
//! CPU, the replicas' CPU and the database's transactions per second. Housekeeping, the
//! metrics counts and the janitor are led by one replica, so idle PostgreSQL CPU should not
//! grow with the replicas; what each idle replica still costs is its claim poll (every
//! `--poll-interval-ms`, slowing to 4x while idle; one look at the due index when it finds
//! nothing).
//!
//! And 1, 2 and 4 worker processes draining one backlog (4 endpoints): the total rate,
//! PostgreSQL's CPU per delivery and the claim's mean time, to show that the claim does not
//! serialize the workers (on 2 cores the total cannot grow much; it must not fall).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::Ctx;
use crate::gateway::{Gateway, Role};
use crate::loadgen::{self, OpenLoop, Ticket};
use crate::pg;
use crate::report::Row;
use crate::stats::{cluster_cpu, fmt_rate, pid_cpu};

const DB: &str = "bench_fleet";
const REPLICAS: [usize; 3] = [1, 4, 8];
const RATE: f64 = 1000.0;
const WORKERS: [usize; 3] = [1, 2, 4];
/// The spread variant: this many replicas, their webhooks spread over this many sources,
/// each with an endpoint of its own (no endpoint shared by every replica's ingest).
const SPREAD: (usize, usize) = (4, 16);
/// The placed variant: these fleets again, PostgreSQL on cores of its own and the replicas
/// (and the load generator) on the others, as production places them ([`crate::pinning`]).
const PLACED: [usize; 2] = [1, 4];
/// Events of each worker drain (4 endpoints each: four times as many deliveries).
const DRAIN_EVENTS: u64 = 12_500;

/// What one window cost.
struct Window {
    pg_cores: Option<f64>,
    gw_cores: f64,
    tx_per_sec: f64,
    accepted: f64,
    /// The loaded window's statements by kind (empty when idle or without
    /// `pg_stat_statements`).
    statements: String,
}

/// Run scenario 13.
pub async fn run(ctx: &Ctx) -> anyhow::Result<()> {
    let url = ctx.server.create_db(DB).await?;
    let result = run_on(ctx, &url).await;
    ctx.server.drop_db(DB).await;
    result?;
    for n in WORKERS {
        let db = format!("bench_workers_{n}");
        let result = drain_by(ctx, &db, n).await;
        ctx.server.drop_db(&db).await;
        result?;
    }
    Ok(())
}

/// One backlog drained by `n` worker processes.
async fn drain_by(ctx: &Ctx, db: &str, n: usize) -> anyhow::Result<()> {
    let setup = crate::delivery::prepare(ctx, db, 4, 0, DRAIN_EVENTS).await?;
    let total = DRAIN_EVENTS * 4;
    let statements = ctx.server.stat_statements && pg::reset_statements(&setup.pool).await;
    ctx.sink.reset(false);
    let postmaster = ctx.server.postmaster();
    let pg_before = postmaster.and_then(cluster_cpu);
    let started = Instant::now();
    let mut workers = Vec::new();
    for i in 0..n {
        let log = ctx.work_dir.join(format!("gateway-workers-{n}-{i}.log"));
        let url = ctx.server.worker_url(db);
        workers.push(Gateway::start(&ctx.gateway_bin, &url, Role::Worker, &ctx.gateway_args(), &log).await?);
    }
    let deadline = Instant::now() + Duration::from_secs(ctx.args.drain_timeout_secs);
    while ctx.sink.counts().unique < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = started.elapsed();
    let pg_cores = postmaster.and_then(cluster_cpu).zip(pg_before).map(|(a, b)| a - b);
    let delivered = ctx.sink.counts().unique;
    let claim = if statements {
        pg::top_statements(&setup.pool, 20)
            .await
            .into_iter()
            .filter(|s| s.query.contains("claim_token + 1") && !s.query.contains("probe_token"))
            .max_by_key(|s| s.calls)
    } else {
        None
    };
    for gw in workers {
        gw.stop(Duration::from_secs(30)).await;
    }
    let rate = delivered as f64 / elapsed.as_secs_f64().max(1e-9);
    ctx.row(Row {
        id: "13".into(),
        scenario: "Workers draining one backlog (4 endpoints)".into(),
        setting: format!("{n} worker processes"),
        result: format!(
            "{} delivered ({} of {} in {:.1} s) · PostgreSQL {} per delivery",
            fmt_rate(rate),
            delivered,
            total,
            elapsed.as_secs_f64(),
            pg_cores.map(|c| format!("{:.0} µs", c / delivered.max(1) as f64 * 1e6)).unwrap_or_else(|| "n/a".into())
        ),
        note: claim
            .map(|c| {
                format!(
                    "{} claims, mean {:.2} ms, {:.1} rows each (pg_stat_statements)",
                    c.calls,
                    c.mean_ms,
                    c.rows as f64 / c.calls.max(1) as f64
                )
            })
            .unwrap_or_default(),
        ..Row::default()
    });
    Ok(())
}

async fn run_on(ctx: &Ctx, url: &str) -> anyhow::Result<()> {
    let pool = pg::pool(url, 2).await?;
    let mut idle_pg = Vec::new();
    for n in REPLICAS {
        let gateways = start_replicas(ctx, url, n, &format!("fleet-{n}")).await?;
        if n == REPLICAS[0] {
            gateways[0].admin_post("/v1/sources", crate::payload::source_spec()).await?;
            gateways[0].subscribe(&ctx.sink.ok_url(0)).await?;
        }
        // Past the start-up (first janitor and metrics looks, leaders settled).
        tokio::time::sleep(ctx.warmup().max(Duration::from_secs(5))).await;
        let idle = measure(ctx, &pool, &gateways, None, &[]).await?;
        let loaded = measure(ctx, &pool, &gateways, Some(RATE), &[]).await?;
        idle_pg.push((n, idle.pg_cores));
        ctx.row(Row {
            id: "13".into(),
            scenario: "Fleet on one database, idle".into(),
            setting: format!("{n} replicas"),
            result: format!(
                "PostgreSQL {} cores · replicas {:.3} cores · {:.0} transactions/s",
                idle.pg_cores.map(|c| format!("{c:.3}")).unwrap_or_else(|| "n/a".into()),
                idle.gw_cores,
                idle.tx_per_sec
            ),
            ..Row::default()
        });
        ctx.row(loaded_row(format!("{n} replicas"), &loaded));
        stop_replicas(gateways).await;
    }
    spread(ctx, url, &pool).await?;
    placed(ctx, url, &pool).await?;
    ctx.note(format!(
        "Row 13: {} replicas of `--role all` with the defaults on one database; idle is a {} s window with nothing \
         offered, loaded is 1,000 webhooks/s spread evenly over the replicas (delivered to the sink). Idle \
         PostgreSQL CPU by replicas: {}. What an idle replica still costs is its claim poll (every 250 ms, \
         slowing to 1 s, one look at the due index each) and, for the leaders, their lease renewals and the \
         housekeeping round (every 1 s while idle, one statement when no endpoint is blocked). The placed rows \
         run the loaded window again with PostgreSQL held to half the cores and the replicas and the load \
         generator to the other half (CPU affinity), as production places them: on the bench every process \
         shares every core.",
        REPLICAS.map(|n| n.to_string()).join(", "),
        ctx.args.measure_secs,
        idle_pg
            .iter()
            .map(|(n, c)| format!("{n}: {}", c.map(|c| format!("{c:.3}")).unwrap_or_else(|| "n/a".into())))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    pool.close().await;
    Ok(())
}

/// The loaded row of `setting`.
fn loaded_row(setting: String, loaded: &Window) -> Row {
    let per = |cores: Option<f64>, rate: f64| cores.map(|c| format!("{:.0} µs", c / rate.max(1e-9) * 1e6));
    Row {
        id: "13".into(),
        scenario: "Fleet on one database, 1,000/s offered".into(),
        setting,
        result: format!(
            "{} accepted · CPU per webhook: PostgreSQL {} · replicas {} · {:.0} transactions/s",
            fmt_rate(loaded.accepted),
            per(loaded.pg_cores, loaded.accepted).unwrap_or_else(|| "n/a".into()),
            per(Some(loaded.gw_cores), loaded.accepted).unwrap_or_default(),
            loaded.tx_per_sec
        ),
        note: if loaded.statements.is_empty() {
            String::new()
        } else {
            format!("statements (pg_stat_statements, the loaded window): {}", loaded.statements)
        },
        ..Row::default()
    }
}

/// [`SPREAD`]: the fleet's load over endpoints of their own (a source each), so that no
/// endpoint's row is wanted by every replica's leases and claims: what of the fleet's cost
/// is one endpoint shared by all.
async fn spread(ctx: &Ctx, url: &str, pool: &sqlx::PgPool) -> anyhow::Result<()> {
    let (n, endpoints) = SPREAD;
    let gateways = start_replicas(ctx, url, n, "fleet-spread").await?;
    let mut sources = Vec::new();
    for e in 0..endpoints {
        let name = format!("{}-{e}", crate::payload::SOURCE);
        gateways[0].admin_post("/v1/sources", crate::payload::source_spec_named(&name)).await?;
        gateways[0].subscribe_to(&name, &ctx.sink.ok_url(e + 1)).await?;
        sources.push(name);
    }
    tokio::time::sleep(ctx.warmup().max(Duration::from_secs(5))).await;
    let loaded = measure(ctx, pool, &gateways, Some(RATE), &sources).await?;
    ctx.row(loaded_row(format!("{n} replicas, {endpoints} endpoints (a source each)"), &loaded));
    stop_replicas(gateways).await;
    Ok(())
}

/// [`PLACED`]: the loaded window again with PostgreSQL held to cores of its own and
/// everything else to the rest, for what a fleet costs PostgreSQL when its replicas do not
/// run on the database's cores. Skipped on one core, or with a server the bench did not
/// start (its processes unknown).
async fn placed(ctx: &Ctx, url: &str, pool: &sqlx::PgPool) -> anyhow::Result<()> {
    let all = crate::pinning::current().unwrap_or_default();
    let (Some(postmaster), Some((pg_cores, rest))) = (ctx.server.postmaster(), crate::pinning::split(&all)) else {
        ctx.note("Row 13's placed variant skipped: it needs two cores and the bench's own PostgreSQL cluster.");
        return Ok(());
    };
    crate::pinning::hold_cluster(postmaster, &pg_cores);
    crate::pinning::hold_self(&rest);
    let result = placed_fleets(ctx, url, pool, &pg_cores, &rest).await;
    // Let everything go again, whatever happened: the scenarios after this one share the cores.
    crate::pinning::hold_cluster(postmaster, &all);
    crate::pinning::hold_self(&all);
    result
}

async fn placed_fleets(
    ctx: &Ctx,
    url: &str,
    pool: &sqlx::PgPool,
    pg_cores: &[usize],
    rest: &[usize],
) -> anyhow::Result<()> {
    let cores = |set: &[usize]| set.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(",");
    for n in PLACED {
        let gateways = start_replicas(ctx, url, n, &format!("fleet-placed-{n}")).await?;
        for gw in &gateways {
            crate::pinning::hold_process(gw.pid, rest);
        }
        tokio::time::sleep(ctx.warmup().max(Duration::from_secs(5))).await;
        let loaded = measure(ctx, pool, &gateways, Some(RATE), &[]).await?;
        let setting =
            format!("{n} replicas, placed: PostgreSQL on core {}, the rest on {}", cores(pg_cores), cores(rest));
        ctx.row(loaded_row(setting, &loaded));
        stop_replicas(gateways).await;
    }
    Ok(())
}

/// `n` replicas of `--role all` on `url`, their logs named `gateway-{label}-{i}.log`.
async fn start_replicas(ctx: &Ctx, url: &str, n: usize, label: &str) -> anyhow::Result<Vec<Gateway>> {
    let mut gateways = Vec::with_capacity(n);
    for i in 0..n {
        let log = ctx.work_dir.join(format!("gateway-{label}-{i}.log"));
        gateways.push(Gateway::start(&ctx.gateway_bin, url, Role::All, &ctx.gateway_args(), &log).await?);
    }
    Ok(gateways)
}

/// Stop `gateways`, each within 30 s.
async fn stop_replicas(gateways: Vec<Gateway>) {
    for gw in gateways {
        gw.stop(Duration::from_secs(30)).await;
    }
}

/// One measured window: idle (`rate` none) or with `rate` webhooks/s spread over the
/// gateways.
async fn measure(
    ctx: &Ctx,
    pool: &sqlx::PgPool,
    gateways: &[Gateway],
    rate: Option<f64>,
    sources: &[String],
) -> anyhow::Result<Window> {
    let postmaster = ctx.server.postmaster();
    let gw_cpu = || gateways.iter().filter_map(|g| pid_cpu(g.pid, false)).sum::<f64>();
    let statements = rate.is_some() && ctx.server.stat_statements && pg::reset_statements(pool).await;
    let pg_before = postmaster.and_then(cluster_cpu);
    let (gw_before, tx_before, started) = (gw_cpu(), pg::transactions(pool).await?, Instant::now());
    let accepted = match rate {
        None => {
            tokio::time::sleep(ctx.measure()).await;
            0.0
        }
        Some(rate) => {
            let share = rate / gateways.len() as f64;
            let mut loads = Vec::new();
            for gw in gateways {
                let per_gw = (share * ctx.measure().as_secs_f64()).ceil() as u64 + 1;
                let base = ctx.reserve(per_gw);
                let (h, run) = (gw.addr.to_string(), ctx.run_id.clone());
                let sources: Vec<String> = sources.to_vec();
                let make = Arc::new(move |seq: u64| match sources.len() {
                    0 => crate::payload::http_request(&h, &run, seq),
                    n => crate::payload::http_request_to(&h, &sources[seq as usize % n], &run, seq),
                });
                let plan = OpenLoop {
                    addr: gw.addr,
                    conns: 8,
                    rate: share,
                    warmup: Duration::ZERO,
                    measure: ctx.measure(),
                    first_seq: base,
                };
                loads.push(tokio::spawn(loadgen::open_loop(plan, make, Arc::new(|_: Ticket| {}))));
            }
            let mut accepted = 0.0;
            for load in loads {
                accepted += load.await?.rate();
            }
            accepted
        }
    };
    let secs = started.elapsed().as_secs_f64();
    let pg_after = postmaster.and_then(cluster_cpu);
    let tx_per_sec = (pg::transactions(pool).await? - tx_before) / secs;
    let statements = if statements { by_kind(&pg::top_statements(pool, 40).await, secs) } else { String::new() };
    Ok(Window {
        pg_cores: pg_before.zip(pg_after).map(|(b, a)| (a - b) / secs),
        gw_cores: (gw_cpu() - gw_before) / secs,
        tx_per_sec,
        accepted,
        statements,
    })
}

/// The gateway's statements of a window by kind ([`pg::statement_kind`]): calls a second,
/// mean execution (waits for locks included) and planning per call. A general claim is two
/// statements: the endpoint rows locked (its lock), then the claim.
fn by_kind(statements: &[pg::StatementStats], secs: f64) -> String {
    let mut kinds: Vec<(&str, i64, f64, f64)> = Vec::new();
    for s in statements {
        let kind = pg::statement_kind(&s.query);
        if kind.is_empty() {
            continue;
        }
        match kinds.iter_mut().find(|k| k.0 == kind) {
            Some(k) => {
                k.1 += s.calls;
                k.2 += s.total_ms;
                k.3 += s.plan_ms;
            }
            None => kinds.push((kind, s.calls, s.total_ms, s.plan_ms)),
        }
    }
    kinds
        .iter()
        .map(|(kind, calls, exec, plan)| {
            let per = |ms: f64| ms / (*calls).max(1) as f64;
            format!(
                "{kind} {:.0}/s, {:.2} ms executing + {:.2} ms planning a call",
                *calls as f64 / secs.max(1e-9),
                per(*exec),
                per(*plan)
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}
