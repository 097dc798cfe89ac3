//! Scenario 16: finding an event by its content. What the `events.search` index costs
//! unique-event ingest at the highest concurrency (rounds with the index and with it
//! dropped, alternating), what computing the terms costs the gateway per event, and how
//! long a search takes through `GET /v1/events` on 1,000,000 stored events, all inside
//! the one-day window searched.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use webhook_gateway::store::events::{OwnedEvent, insert_batch_with_fanout};

use crate::Ctx;
use crate::gateway::{Gateway, Role};
use crate::report::{Row, verdict};
use crate::stats::{Latency, fmt_dur, fmt_rate};

const DB: &str = "bench_search";
/// Events stored before the searches are timed.
const STORED: u64 = 1_000_000;
/// Fewest events [`searches`] stores itself, whatever the ingest rounds stored: the
/// searched-for event is among them.
const PROBED: u64 = 1_000;
/// Rounds of each ingest variant (alternating).
const ROUNDS: usize = 2;
/// Timed runs of each search.
const RUNS: usize = 5;

/// Run scenario 16.
pub async fn run(ctx: &Ctx) -> anyhow::Result<()> {
    let url = ctx.server.create_db(DB).await?;
    let result = run_on(ctx, &url).await;
    ctx.server.drop_db(DB).await;
    result
}

async fn run_on(ctx: &Ctx, url: &str) -> anyhow::Result<()> {
    let log = ctx.work_dir.join("gateway-search.log");
    let gw = Gateway::start(&ctx.gateway_bin, url, Role::Ingest, &ctx.gateway_args(), &log).await?;
    gw.admin_post("/v1/sources", crate::payload::source_spec()).await?;
    gw.subscribe(&ctx.sink.ok_url(0)).await?;
    // A second gateway on the same database, idle but for its own rounds: indexing keys
    // only (`--content-search=false`).
    let keys_only_args: Vec<String> =
        ctx.gateway_args().into_iter().chain(["--content-search=false".to_owned()]).collect();
    let keys_log = ctx.work_dir.join("gateway-search-keys-only.log");
    let keys_only = Gateway::start(&ctx.gateway_bin, url, Role::Ingest, &keys_only_args, &keys_log).await?;
    let pool = crate::pg::pool(url, 4).await?;
    let ingested = ingest_with_and_without_the_index(ctx, [&gw, &keys_only], &pool).await;
    keys_only.stop(Duration::from_secs(30)).await;
    ingested?;
    terms_cost(ctx);
    searches(ctx, &gw, &pool, url).await?;
    gw.stop(Duration::from_secs(30)).await;
    Ok(())
}

/// The shipped index (GIN with a 16 MB pending list, migration 0018).
const SHIPPED: &str = "CREATE INDEX events_search ON events USING gin (search) WITH (gin_pending_list_limit = 16384)";

/// The index variants the ingest rounds alternate between: the shipped one (merged by
/// the gateway every second), the shipped one with a gateway that indexes keys only
/// (`--content-search=false`, the only variant sent to the second gateway), the same
/// index under another name (so the gateway's merge does not find it: merged by
/// PostgreSQL alone, when an insert fills the list), GIN with the default 4 MB list, GIN
/// with every insert going into the tree at once, and none (always last).
const VARIANTS: [(&str, Option<&str>); 6] = [
    ("with the search index (16 MB pending list, as shipped)", Some(SHIPPED)),
    ("with the search index, content search off (`--content-search=false`: keys only)", Some(SHIPPED)),
    (
        "with the same index, its list merged by PostgreSQL alone (no background merge)",
        Some("CREATE INDEX events_search_unmerged ON events USING gin (search) WITH (gin_pending_list_limit = 16384)"),
    ),
    ("with the index, default 4 MB pending list", Some("CREATE INDEX events_search ON events USING gin (search)")),
    (
        "with the index, fastupdate off",
        Some("CREATE INDEX events_search ON events USING gin (search) WITH (fastupdate = off)"),
    ),
    ("search index dropped", None),
];

/// The variant of [`VARIANTS`] that the keys-only gateway ingests.
const KEYS_ONLY: usize = 1;

/// Ingest at the highest concurrency, rounds alternating between [`VARIANTS`]: through
/// `gateways[1]` (keys only) for [`KEYS_ONLY`], else through `gateways[0]`.
async fn ingest_with_and_without_the_index(
    ctx: &Ctx,
    gateways: [&Gateway; 2],
    pool: &sqlx::PgPool,
) -> anyhow::Result<()> {
    let c = ctx.args.concurrency.iter().copied().max().unwrap_or(64);
    let postmaster = ctx.server.postmaster();
    let mut rates: [Vec<f64>; VARIANTS.len()] = Default::default();
    for _ in 0..ROUNDS {
        for (i, (how, create)) in VARIANTS.iter().enumerate() {
            sqlx::query("DROP INDEX IF EXISTS events_search, events_search_unmerged").execute(pool).await?;
            if let Some(sql) = create {
                sqlx::query(sql).execute(pool).await?;
            }
            crate::ingest::checkpoint(pool).await;
            let gw = gateways[usize::from(i == KEYS_ONLY)];
            let (mut out, share) = crate::ingest::unique_window(ctx, gw, postmaster, c).await;
            let rate = out.rate();
            rates[i].push(rate);
            let latency = Latency::from_micros(&mut out.latencies);
            ctx.row(Row {
                id: "16".into(),
                scenario: format!("Ingest, unique events, {how}"),
                setting: format!("{c} conn, round {}", rates[i].len()),
                result: format!("{} accepted", fmt_rate(rate)),
                p50: fmt_dur(latency.p50),
                p99: fmt_dur(latency.p99),
                max: fmt_dur(latency.max),
                cpu: share.cell(),
                note: crate::report::notes([Some(share.per_item("webhook", rate)), Some(out.failure_note())]),
                ..Row::default()
            });
        }
    }
    sqlx::query("DROP INDEX IF EXISTS events_search, events_search_unmerged").execute(pool).await?;
    sqlx::query(SHIPPED).execute(pool).await?;
    // Each variant's rounds summed: a ratio of totals, steadier than one of medians of two.
    let total = |v: &[f64]| v.iter().sum::<f64>();
    let without = total(&rates[VARIANTS.len() - 1]).max(1e-9);
    for (i, (how, _)) in VARIANTS.iter().enumerate().take(VARIANTS.len() - 1) {
        let x = total(&rates[i]) / without;
        ctx.row(Row {
            id: "16".into(),
            scenario: format!("Ingest, {how}, of none"),
            setting: format!("{c} conn, {ROUNDS} rounds each"),
            result: format!("**×{x:.2}**"),
            target: match i {
                0 => verdict(x >= 0.90, "≥ ×0.90"),
                // What an operator who never searches by content can have.
                KEYS_ONLY => verdict(x >= 0.90, "≥ ×0.90 (keys only)"),
                _ => "—".into(),
            },
            ..Row::default()
        });
    }
    ctx.note(format!(
        "Row 16, ingest: unique-event ingest at {c} connections in {ROUNDS} alternating rounds of each index variant \
         (the gateway computes and stores the terms in every round; only the index differs, but for the second \
         variant, sent to a gateway that indexes keys only). The shipped index is \
         the first (GIN with its pending list, merged by the gateway every second); the third is the same index \
         under a name the gateway's merge does not look for (merged by PostgreSQL alone, by the insert that fills \
         the list); the goal is ≥ ×0.90 of the rounds without an index. The terms' own \
         cost to the gateway is the next line."
    ));
    Ok(())
}

/// What computing one bench event's terms costs, in this process, single-threaded.
fn terms_cost(ctx: &Ctx) {
    let body = crate::payload::body(42);
    let headers = serde_json::json!({"host": "127.0.0.1:1", "user-agent": "wg-bench", "content-type": "application/json",
        "content-length": body.len().to_string(), "x-request-id": "req-x-42", "x-signature": "[redacted]"});
    let n = 20_000;
    let started = Instant::now();
    let mut total = 0usize;
    for i in 0..n {
        total += webhook_gateway::search::terms(&format!("req-{i}"), &headers, body.as_bytes()).len();
    }
    let each = started.elapsed() / n;
    ctx.note(format!(
        "Row 16, terms: computing one bench event's search terms (parse of its {} bytes, {} terms hashed) takes {} \
         of one core in the gateway's code, measured in the bench process.",
        body.len(),
        total / n as usize,
        fmt_dur(each)
    ));
}

/// Store events (through the gateway's own batch statement, so with its terms) until
/// there are [`STORED`], and at least [`PROBED`] more, and time searches through the API
/// within a one-day window.
async fn searches(ctx: &Ctx, gw: &Gateway, pool: &sqlx::PgPool, url: &str) -> anyhow::Result<()> {
    let source_id: webhook_gateway::ids::SourceId = sqlx::query_scalar("SELECT id FROM sources WHERE name = $1")
        .bind(crate::payload::SOURCE)
        .fetch_one(pool)
        .await?;
    let have: i64 = sqlx::query_scalar("SELECT count(*) FROM events").fetch_one(pool).await?;
    // At least `PROBED` of them stored here, so that the events searched for exist: the
    // ingest rounds above may have stored more than `STORED` already (at 10,000/s they
    // do), and a probe among keys never stored finds nothing.
    let wanted = STORED.saturating_sub(have as u64).max(PROBED);
    let base = ctx.reserve(wanted);
    let started = Instant::now();
    let lib_pool = webhook_gateway::db::connect(url, 2).await?;
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let (pool, next, run) = (lib_pool.clone(), next.clone(), ctx.run_id.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let from = next.fetch_add(1000, Ordering::Relaxed);
                if from >= wanted {
                    return Ok::<(), sqlx::Error>(());
                }
                let batch: Vec<OwnedEvent> = (from..(from + 1000).min(wanted))
                    .map(|i| {
                        let seq = base + i;
                        let key = crate::payload::request_id(&run, seq);
                        OwnedEvent {
                            source_id,
                            source_name: crate::payload::SOURCE.to_owned(),
                            indexing: webhook_gateway::search::Indexing::Content,
                            dedupe_key: key.clone(),
                            event_type: crate::payload::EVENT_TYPE.into(),
                            content_type: Some("application/json".into()),
                            headers: serde_json::json!({"user-agent": "wg-bench", "x-request-id": key,
                                                        "x-signature": "[redacted]"}),
                            payload: crate::payload::body(seq).into_bytes().into(),
                            ordering_key: None,
                            trace: None,
                            terms: None,
                        }
                    })
                    .collect();
                insert_batch_with_fanout(&pool, &batch).await?;
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    let seeded_in = started.elapsed();
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM events").fetch_one(pool).await?;
    let size: String =
        sqlx::query_scalar("SELECT pg_size_pretty(pg_relation_size('events_search'))").fetch_one(pool).await?;
    let table: String =
        sqlx::query_scalar("SELECT pg_size_pretty(pg_total_relation_size('events'))").fetch_one(pool).await?;

    let since = (chrono::Utc::now() - chrono::Duration::days(1)).to_rfc3339();
    let enc = |s: &str| url::form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
    let probe = base + wanted / 2;
    let key = crate::payload::request_id(&ctx.run_id, probe);
    let searches: [(&str, String, Option<usize>); 5] = [
        ("a value one event holds", format!("payload={}", enc(&format!("/data/object/id=ord_{probe}"))), Some(1)),
        ("a header value", format!("header={}", enc(&format!("x-request-id:{key}"))), Some(1)),
        ("a dedupe key, no source", format!("dedupe_key={}", enc(&key)), Some(1)),
        ("a value no event holds", format!("payload={}", enc("/data/object/id=ord_none")), Some(0)),
        ("a value every event holds (first page)", format!("payload={}", enc("livemode=false")), None),
    ];
    for state in ["pending list as ingest left it", "after VACUUM"] {
        if state == "after VACUUM" {
            sqlx::query("VACUUM ANALYZE events").execute(pool).await?;
        }
        for (what, query, expect) in &searches {
            let path = format!("/v1/events?{query}&since={}&limit=100", enc(&since));
            let mut times = Vec::with_capacity(RUNS);
            let mut found = 0;
            for _ in 0..RUNS {
                let t = Instant::now();
                let page = gw.admin_get(&path).await?;
                times.push(t.elapsed());
                found = page["data"].as_array().map_or(0, Vec::len);
            }
            times.sort();
            let (median, worst) = (times[RUNS / 2], times[RUNS - 1]);
            let right = expect.is_none_or(|n| n == found);
            ctx.row(Row {
                id: "16".into(),
                scenario: format!("Search {stored} events, one-day window: {what}"),
                setting: state.into(),
                result: format!("{found} found · median {}", fmt_dur(median)),
                target: verdict(right && worst <= Duration::from_secs(1), "≤ 1 s, right count"),
                p50: fmt_dur(median),
                max: fmt_dur(worst),
                note: format!("{RUNS} runs through GET /v1/events"),
                ..Row::default()
            });
        }
    }
    ctx.note(format!(
        "Row 16, search: {stored} events stored ({wanted} of them through the gateway's batch statement in {:.0} \
         s, the rest by the ingest rounds; all inside the one-day window searched, the hardest case for a window), \
         table with indexes {table}, search index {size}. Each search is {RUNS} calls of GET /v1/events with `since` one day back and `limit=100`, first while the \
         index's pending list holds what ingest left in it, then after VACUUM (what autovacuum does).",
        seeded_in.as_secs_f64()
    ));
    Ok(())
}
