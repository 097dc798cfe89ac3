//! Scenario 18: PostgreSQL's instructions per statement. The gateway's hot statements
//! (the ingest of a lone webhook, with and without the lease of its deliveries, a batch
//! ingest, a claim by key, a batch of outcomes, an ordered line's step) run in a
//! stand-alone backend under callgrind ([`pg::Standalone`]): each kind is run `FEW` and
//! then `MANY` times, and the difference, divided by the webhooks or deliveries it
//! handled, is its count, with start-up and everything run once left out. The same
//! arguments sent to statements that do nothing (`SELECT 1`) are counted the same way
//! and taken off: reading the script and parsing its literals is this harness's cost,
//! not the gateway's, which binds its parameters in binary.
//!
//! What it leaves out: the network, the wire protocol, and work PostgreSQL does in other
//! processes (the WAL writer, autovacuum, the search index's background merge). What
//! it keeps: planning is done once per kind (`PREPARE`), as the gateway's cached
//! statements do, under the settings the gateway runs them with; each step commits on
//! its own, as a lone webhook does.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context;
use serde_json::json;
use webhook_gateway::db::embedded;

use crate::Ctx;
use crate::pg::{self, Standalone, array, bytes_lit, lit};
use crate::report::Row;

const DB: &str = "bench_statements";
/// Statements in the shorter run of a kind ...
const FEW: usize = 20;
/// ... and in the longer one: the count is their difference.
const MANY: usize = 100;
/// Delivered webhooks in the database before the count.
const HISTORY: u64 = 20_000;
/// Ordered lines (one per line step counted).
const LINES: usize = (FEW + MANY) * BATCH;
/// Webhooks or deliveries in a batch statement.
const BATCH: usize = 16;
/// The lease the claims take: a millisecond, so the claims of one run never fill the
/// endpoint's room (the harness records no outcome between its claims).
const LEASE_SECS: f64 = 0.001;

/// One kind of statement (or a few, run in one transaction).
struct Kind {
    /// Its row's label.
    name: &'static str,
    /// Names callgrind's files.
    tag: &'static str,
    /// The statements of one step, each prepared once.
    statements: Vec<Prepared>,
    /// Session settings the gateway runs them under (the recorder's transactions plan
    /// as `db::Planning::Cached` says: no plan that reads a table whole).
    settings: String,
    /// Webhooks or deliveries per statement.
    units: usize,
    /// What a unit is.
    unit: &'static str,
    /// A count (`SELECT count(*) AS n ...`) that each unit the statement handles adds
    /// one to: a statement that did nothing (a duplicate, a claim that found nothing, a
    /// fenced outcome) would be counted as cheap, so the count is required to grow by
    /// every unit.
    effect: &'static str,
}

/// The settings of the recorder's transactions (`db::begin_sql` with
/// `Planning::Cached`), for the stand-alone backend's session.
fn recorder_settings() -> String {
    use webhook_gateway::db::{Planning, Pooler, begin_sql};
    let begin = begin_sql(Pooler::None, Planning::Cached);
    format!("{};\n\n", begin.trim_start_matches("BEGIN; ").replace("SET LOCAL ", "SET "))
}

/// A statement, prepared once per run.
struct Prepared {
    /// `PREPARE` name.
    name: &'static str,
    /// Parameter types, in order.
    types: &'static [&'static str],
    /// The statement.
    sql: String,
}

impl Prepared {
    /// A kind's only statement.
    fn only(name: &'static str, types: &'static [&'static str], sql: &str) -> Vec<Prepared> {
        vec![Prepared { name, types, sql: sql.to_owned() }]
    }
}

/// The parameter types of the single-webhook ingest statements (`store::events::insert_sql`).
const SINGLE_TYPES: &[&str] = &["uuid", "text", "text", "text", "jsonb", "bytea", "text", "text", "text", "int8[]"];

/// The parameter types of the leasing ones (`store::events::insert_and_claim_sql`).
const LEASING_TYPES: &[&str] =
    &["uuid", "text", "text", "text", "jsonb", "bytea", "text", "text", "text", "int8[]", "int8", "float8", "int4"];

/// The parameter types of the batch ingest statement (`store::events::insert_batch_sql`).
const BATCH_TYPES: &[&str] = &[
    "uuid[]", "text[]", "text[]", "text[]", "text[]", "bytea[]", "int4[]", "text[]", "int4[]", "text[]", "text[]",
    "int8[]", "int4[]",
];

/// The parameter types of the leasing one (`store::events::insert_batch_and_claim_sql`).
const BATCH_LEASING_TYPES: &[&str] = &[
    "uuid[]", "text[]", "text[]", "text[]", "text[]", "bytea[]", "int4[]", "text[]", "int4[]", "text[]", "text[]",
    "int8[]", "int4[]", "int8", "float8", "int4",
];

/// The parameter types of the recorder's outcome statement (`queue::RECORD_SQL`).
const RECORD_TYPES: &[&str] = &[
    "uuid[]",
    "int8[]",
    "int4[]",
    "timestamptz[]",
    "int4[]",
    "int4[]",
    "text[]",
    "text[]",
    "text[]",
    "text[]",
    "text[]",
    "timestamptz[]",
    "text[]",
    "text[]",
];

/// Run scenario 18.
pub async fn run(ctx: &Ctx) -> anyhow::Result<()> {
    let valgrind = std::process::Command::new("valgrind").arg("--version").output();
    if !valgrind.is_ok_and(|o| o.status.success()) {
        ctx.note("Row 18 was not run: it needs valgrind (apt-get install valgrind).");
        return Ok(());
    }
    let dir = std::env::temp_dir().join(format!("wg-bench-statements-{}", std::process::id()));
    let result = run_in(ctx, &dir).await;
    // callgrind's files stay with the run's logs, for callgrind_annotate.
    let kept = ctx.work_dir.join("statements");
    if let Ok(files) = std::fs::read_dir(dir.join("callgrind")) {
        let _ = std::fs::create_dir_all(&kept);
        for f in files.flatten() {
            let _ = std::fs::copy(f.path(), kept.join(f.file_name()));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn run_in(ctx: &Ctx, dir: &Path) -> anyhow::Result<()> {
    let data_dir = dir.join("data");
    let seeded = prepare(&data_dir).await?;
    let source = seeded.source.clone();
    let pg = Standalone::new(&data_dir, DB, &dir.join("callgrind"));
    let seq = AtomicU64::new(1);
    let event = |kind: &str| -> Event {
        let n = seq.fetch_add(1, Ordering::Relaxed);
        Event::new(&format!("stmt-{kind}-{}-{n}", ctx.run_id), n)
    };
    let claim_args = format!("{BATCH}, {LEASE_SECS}, 1024");
    let mut counts = Vec::new();

    use webhook_gateway::store::events::{self, lean};
    // One webhook a statement: stored, or stored and leased; by the full fan-out and by
    // the lean one. (name, tag, SQL, whether it leases)
    let singles = [
        ("ingest, one webhook (`store::events::insert_sql`: the full fan-out)", "ingest", events::insert_sql(), false),
        (
            "ingest, one webhook, lean (`events::lean::insert_sql`: no subscription of the source filters, orders \
             or transforms)",
            "ingest_lean",
            lean::insert_sql(),
            false,
        ),
        (
            "ingest and lease, one webhook (`insert_and_claim_sql`: the full fan-out)",
            "ingest_lease",
            events::insert_and_claim_sql(),
            true,
        ),
        (
            "ingest and lease, one webhook, lean (`lean::insert_and_claim_sql`: a lone webhook's path for the bench's \
             source)",
            "ingest_lease_lean",
            lean::insert_and_claim_sql(),
            true,
        ),
    ];
    for (name, tag, sql, leases) in singles {
        let kind = Kind {
            name,
            tag,
            settings: String::new(),
            statements: Prepared::only(tag, if leases { LEASING_TYPES } else { SINGLE_TYPES }, sql),
            units: 1,
            unit: "webhook",
            effect: if leases {
                "SELECT count(*) AS n FROM deliveries WHERE leased_until IS NOT NULL"
            } else {
                "SELECT count(*) AS n FROM events"
            },
        };
        let args: Vec<Vec<String>> = (0..MANY + FEW)
            .map(|_| {
                let event = event(tag).single(&source);
                vec![if leases { format!("{event}, {claim_args}") } else { event }]
            })
            .collect();
        counts.push(count(ctx, &pg, &kind, &args)?);
    }

    // Each kind's events are labelled alike in length ("batch", "blean"): a bench
    // webhook's row lies near PostgreSQL's TOAST threshold, and five more bytes of key
    // took it across (about 100,000 instructions a webhook more).
    for (name, tag, label, sql) in [
        (
            "ingest, a batch of 16 (`insert_batch_sql`: the full fan-out)",
            "ingest_batch",
            "batch",
            events::insert_batch_sql(),
        ),
        (
            "ingest, a batch of 16, lean (`lean_insert_batch_sql`: group commit's path for the bench's source)",
            "ingest_batch_lean",
            "blean",
            events::lean_insert_batch_sql(),
        ),
    ] {
        let batch = Kind {
            name,
            tag,
            settings: String::new(),
            statements: Prepared::only(tag, BATCH_TYPES, sql),
            units: BATCH,
            unit: "webhook",
            effect: "SELECT count(*) AS n FROM events",
        };
        let args: Vec<Vec<String>> = (0..MANY + FEW)
            .map(|_| vec![batch_args(&(0..BATCH).map(|_| event(label)).collect::<Vec<_>>(), &source)])
            .collect();
        counts.push(count(ctx, &pg, &batch, &args)?);
    }

    // The claims take the deliveries the ingest kinds left unleased, 16 at a time.
    let due = pg::column(
        &pg.run("SELECT id FROM deliveries WHERE leased_until IS NULL AND status = 'pending' AND ordering_key IS NULL ORDER BY id;\n\n")?,
        "id",
    );
    let claim = Kind {
        name: "claim by key, 16 deliveries (`wg_claim_fresh_v2`: the hand-off from ingest)",
        tag: "claim",
        settings: String::new(),
        statements: Prepared::only(
            "claim",
            &["uuid[]", "int8", "float8", "int4"],
            &format!("SELECT * FROM {}($1, $2, $3, $4)", webhook_gateway::queue::CLAIM_FRESH_FUNCTION),
        ),
        units: BATCH,
        unit: "delivery",
        effect: "SELECT count(*) AS n FROM deliveries WHERE leased_until IS NOT NULL",
    };
    let args: Vec<Vec<String>> = due
        .chunks(BATCH)
        .filter(|c| c.len() == BATCH)
        .take(MANY + FEW)
        .map(|ids| vec![format!("{}, {claim_args}", array(ids.iter().map(|id| lit(id)), "uuid"))])
        .collect();
    anyhow::ensure!(args.len() == MANY + FEW, "only {} deliveries were left to claim", due.len());
    counts.push(count(ctx, &pg, &claim, &args)?);

    // The outcomes: delivered, for deliveries claimed above.
    let printed = pg.run(
        "SELECT id, claim_token, attempt_count FROM deliveries
         WHERE leased_until IS NOT NULL AND status = 'pending' ORDER BY id;\n\n",
    )?;
    let claimed: Vec<(String, String, String)> = pg::column(&printed, "id")
        .into_iter()
        .zip(pg::column(&printed, "claim_token"))
        .zip(pg::column(&printed, "attempt_count"))
        .map(|((id, token), attempt)| (id, token, attempt))
        .collect();
    let outcome = Kind {
        name: "outcomes, 16 deliveries (`queue::outcomes::RECORD_SQL`: the recorder's batch)",
        tag: "outcome",
        settings: recorder_settings(),
        statements: Prepared::only("outcome", RECORD_TYPES, webhook_gateway::queue::RECORD_SQL),
        units: BATCH,
        unit: "delivery",
        effect: "SELECT count(*) AS n FROM attempts WHERE response_excerpt IS NOT NULL",
    };
    let args: Vec<Vec<String>> =
        claimed.chunks(BATCH).filter(|c| c.len() == BATCH).take(MANY + FEW).map(|c| vec![outcome_args(c)]).collect();
    anyhow::ensure!(args.len() == MANY + FEW, "only {} deliveries were claimed", claimed.len());
    counts.push(count(ctx, &pg, &outcome, &args)?);

    // An outcome alone: the recorder's statement when nothing keeps it company (low
    // load), on leases the batches above left (those the leasing ingest kinds took).
    let alone = Kind {
        name: "an outcome alone (`RECORD_SQL` with 1 delivery: the recorder at low load, with no company)",
        tag: "outcome_alone",
        settings: recorder_settings(),
        statements: Prepared::only("outcome_alone", RECORD_TYPES, webhook_gateway::queue::RECORD_SQL),
        units: 1,
        unit: "delivery",
        effect: outcome.effect,
    };
    let used = (MANY + FEW) * BATCH;
    let args: Vec<Vec<String>> = claimed
        .iter()
        .skip(used)
        .take(MANY + FEW)
        .map(|lease| vec![outcome_args(std::slice::from_ref(lease))])
        .collect();
    anyhow::ensure!(args.len() == MANY + FEW, "only {} leases were left for outcomes alone", args.len());
    counts.push(count(ctx, &pg, &alone, &args)?);

    // An ordered line's step: its head finished, the line is released and the delivery
    // waiting behind it becomes the head, in the recorder's transaction.
    let printed = pg.run(&format!(
        "SELECT id, ordering_key FROM deliveries WHERE endpoint_id = '{}' AND status = 'delivered' ORDER BY id;\n\n",
        seeded.ordered_endpoint
    ))?;
    let heads: Vec<(String, String)> =
        pg::column(&printed, "id").into_iter().zip(pg::column(&printed, "ordering_key")).collect();
    let line_step = Kind {
        name: "an ordered line's step, 16 lines (`lines::RELEASE_HEADS_SQL` then `PROMOTE_SQL`: what the recorder adds for finished heads)",
        tag: "line_step",
        settings: recorder_settings(),
        statements: vec![
            Prepared {
                name: "release",
                types: &["uuid[]"],
                sql: webhook_gateway::queue::lines::RELEASE_HEADS_SQL.to_owned(),
            },
            Prepared {
                name: "promote",
                types: &["uuid[]", "text[]"],
                sql: webhook_gateway::queue::lines::PROMOTE_SQL.to_owned(),
            },
        ],
        units: BATCH,
        unit: "line step",
        effect: "SELECT count(*) AS n FROM deliveries WHERE ordering_key IS NOT NULL AND status = 'pending' AND NOT waiting",
    };
    let endpoint = lit(&seeded.ordered_endpoint);
    let steps: Vec<Vec<String>> = heads
        .chunks(BATCH)
        .filter(|c| c.len() == BATCH)
        .map(|c| {
            vec![
                array(c.iter().map(|(id, _)| lit(id)), "uuid"),
                format!(
                    "{}, {}",
                    array(c.iter().map(|_| endpoint.clone()), "uuid"),
                    array(c.iter().map(|(_, key)| lit(key)), "text")
                ),
            ]
        })
        .collect();
    anyhow::ensure!(steps.len() == MANY + FEW, "only {} line heads were seeded", heads.len());
    counts.push(count(ctx, &pg, &line_step, &steps)?);

    // A batch stored with its deliveries leased: group commit's path in role `all`, for
    // batches of up to `prelease::LARGEST_LEASED_BATCH`. Last, with an endpoint limit that
    // leaves every batch room for all of them: its leases stay in flight, and would leave
    // the claims above no room.
    const LEASED_BATCH: usize = webhook_gateway::deliver::prelease::LARGEST_LEASED_BATCH;
    for (name, tag, label, sql) in [
        (
            "ingest and lease, a batch of 8 (`insert_batch_and_claim_sql`: the full fan-out)",
            "ingest_batch_lease",
            "batch_lease",
            events::insert_batch_and_claim_sql(),
        ),
        (
            "ingest and lease, a batch of 8, lean (`lean_insert_batch_and_claim_sql`: group commit's path in role \
             `all` for the bench's source)",
            "ingest_batch_lease_lean",
            "blean_lease",
            events::lean_insert_batch_and_claim_sql(),
        ),
    ] {
        let batch_lease = Kind {
            name,
            tag,
            settings: String::new(),
            statements: Prepared::only(tag, BATCH_LEASING_TYPES, sql),
            units: LEASED_BATCH,
            unit: "webhook",
            effect: "SELECT count(*) AS n FROM deliveries WHERE leased_until IS NOT NULL",
        };
        let args: Vec<Vec<String>> = (0..MANY + FEW)
            .map(|_| {
                let batch = (0..LEASED_BATCH).map(|_| event(label)).collect::<Vec<_>>();
                let most = webhook_gateway::deliver::prelease::MOST_LEASED_PER_WEBHOOK * LEASED_BATCH;
                vec![format!("{}, {most}, {LEASE_SECS}, 1000000", batch_args(&batch, &source))]
            })
            .collect();
        counts.push(count(ctx, &pg, &batch_lease, &args)?);
    }

    ctx.appendix("PostgreSQL instructions per statement: where they go (row 18)", landmarks_table(&counts));
    ctx.note(
        "Row 18 counts PostgreSQL's instructions in a stand-alone backend under callgrind (bench/README.md): \
         repeatable for a build and a PostgreSQL, where CPU seconds are not. It leaves out the network, the wire \
         protocol and PostgreSQL's other processes; the harness's own reading of the script, and the printing of \
         the rows a stand-alone backend does where a server sends them, are taken off.",
    );
    Ok(())
}

/// What [`prepare`] made.
struct Seeded {
    /// The bench's source.
    source: String,
    /// The endpoint of the ordered lines.
    ordered_endpoint: String,
}

/// A new endpoint (never sent to: the count sends nothing) subscribed to every event of
/// `source`, in order when `ordered`.
async fn subscribed_endpoint(pool: &sqlx::PgPool, source: uuid::Uuid, ordered: bool) -> anyhow::Result<uuid::Uuid> {
    Ok(sqlx::query_scalar(
        "WITH ep AS (INSERT INTO endpoints (url, secret)
                     VALUES ('http://127.0.0.1:9/', 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw') RETURNING id)
         INSERT INTO subscriptions (endpoint_id, source_id, ordered) SELECT ep.id, $1, $2 FROM ep
         RETURNING endpoint_id",
    )
    .bind(source)
    .bind(ordered)
    .fetch_one(pool)
    .await?)
}

/// Lines of an ordered subscription on a source of their own: `LINES` ordering keys,
/// each with a head already delivered and one delivery waiting behind it, as the
/// fan-out makes them (the batch ingest statement). Returns the lines' endpoint.
async fn seed_lines(pool: &sqlx::PgPool) -> anyhow::Result<String> {
    let source: uuid::Uuid =
        sqlx::query_scalar("INSERT INTO sources (name, kind, spec) VALUES ('ordered', 'internal', '{}') RETURNING id")
            .fetch_one(pool)
            .await?;
    let endpoint = subscribed_endpoint(pool, source, true).await?;
    const PER_BATCH: usize = 256;
    for batch in 0..LINES * 2 / PER_BATCH {
        // Two webhooks per key in one batch: the first becomes the line's head.
        let n = PER_BATCH as i32;
        let keys: Vec<String> = (0..PER_BATCH).map(|i| format!("line-{batch}-{i}")).collect();
        let lines: Vec<Option<String>> = (0..PER_BATCH).map(|i| Some(format!("key-{batch}-{}", i / 2))).collect();
        let body = crate::payload::body(0).into_bytes();
        sqlx::query(webhook_gateway::store::events::insert_batch_sql())
            .bind(vec![source; PER_BATCH])
            .bind(&keys)
            .bind(vec![crate::payload::EVENT_TYPE; PER_BATCH])
            .bind(vec![Some("application/json"); PER_BATCH])
            .bind(vec!["{}"; PER_BATCH])
            .bind(vec![body; PER_BATCH])
            .bind((0..n).collect::<Vec<i32>>())
            .bind(&lines)
            .bind((0..n).collect::<Vec<i32>>())
            .bind(vec![None::<String>; PER_BATCH])
            .bind(vec![None::<String>; PER_BATCH])
            .bind(Vec::<i64>::new())
            .bind(vec![0i32; PER_BATCH])
            .execute(pool)
            .await?;
    }
    let done = sqlx::query(
        "UPDATE deliveries SET status = 'delivered', attempt_count = 1, finished_at = now()
         WHERE endpoint_id = $1 AND NOT waiting",
    )
    .bind(endpoint)
    .execute(pool)
    .await?;
    anyhow::ensure!(done.rows_affected() == LINES as u64, "{} heads for {LINES} lines", done.rows_affected());
    Ok(endpoint.to_string())
}

/// A cluster of its own with the schema, the bench's source, one endpoint subscribed to
/// it with a history of delivered webhooks, and ordered lines, then stopped (a
/// stand-alone backend needs the data directory to itself).
async fn prepare(data_dir: &Path) -> anyhow::Result<Seeded> {
    let options =
        embedded::ClusterOptions { data_dir: data_dir.to_owned(), throwaway: false, port: None, settings: vec![] };
    let mut cluster = tokio::task::spawn_blocking(move || embedded::Cluster::start(&options)).await??;
    let seeded = async {
        let admin = pg::pool(&cluster.url("postgres"), 1).await?;
        sqlx::query(&format!("CREATE DATABASE {DB}")).execute(&admin).await?;
        admin.close().await;
        let lib_pool = webhook_gateway::db::connect(&cluster.url(DB), 1).await?;
        webhook_gateway::db::migrate(&lib_pool).await?;
        let pool = pg::pool(&cluster.url(DB), 1).await?;
        let source: String =
            sqlx::query_scalar("INSERT INTO sources (name, kind, spec) VALUES ($1, 'hmac', $2) RETURNING id::text")
                .bind(crate::payload::SOURCE)
                .bind(crate::payload::source_spec())
                .fetch_one(&pool)
                .await?;
        let source_id: uuid::Uuid = source.parse()?;
        let endpoint = subscribed_endpoint(&pool, source_id, false).await?;
        // A history, delivered, with its attempts, and statistics on it: the plans of a
        // gateway that has run for a while, not of empty tables (where a scan of a whole
        // table is the cheapest plan and costs little, and would be counted as such).
        pg::seed(&pool, source_id, &[endpoint], HISTORY, &crate::payload::template()).await?;
        sqlx::query(
            "WITH done AS (
                 UPDATE deliveries SET status = 'delivered', attempt_count = 1, finished_at = now()
                 RETURNING id, created_at
             )
             INSERT INTO attempts (delivery_id, attempt_number, started_at, duration_ms, status_code, outcome, reason)
             SELECT id, 1, created_at, 12, 200, 'delivered', 'HTTP 200' FROM done",
        )
        .execute(&pool)
        .await?;
        let ordered_endpoint = seed_lines(&pool).await?;
        sqlx::query("VACUUM (ANALYZE)").execute(&pool).await?;
        pool.close().await;
        anyhow::Ok(Seeded { source, ordered_endpoint })
    }
    .await;
    tokio::task::spawn_blocking(move || cluster.stop()).await?;
    seeded.context("preparing the counted database")
}

/// Where a statement's instructions go: a function (inclusive, per unit) and what it is.
const LANDMARKS: &[(&str, &[&str])] = &[
    ("plan set-up and tear-down, each execution (ExecutorStart, ExecutorEnd)", &["ExecutorStart", "ExecutorEnd"]),
    ("a PL/pgSQL function's body (plpgsql_exec_function: the claim's; the lease's room)", &["plpgsql_exec_function"]),
    ("index entries (ExecInsertIndexTuples)", &["ExecInsertIndexTuples"]),
    ("— of which the search index (gininsert)", &["gininsert"]),
    ("foreign key checks (RI_FKey_check_ins, RI_FKey_check_upd)", &["RI_FKey_check_ins", "RI_FKey_check_upd"]),
    ("CHECK constraints (ExecConstraints)", &["ExecConstraints"]),
    ("the body's TOAST row (heap_toast_insert_or_update)", &["heap_toast_insert_or_update"]),
    ("WAL records (XLogInsert)", &["XLogInsert"]),
    ("commit (CommitTransactionCommand)", &["CommitTransactionCommand"]),
    ("the cached plan's check and its locks (GetCachedPlan)", &["GetCachedPlan"]),
];

/// The function a stand-alone backend prints result rows with: a server sends them on
/// the wire instead, so it is taken off.
const PRINTING: &str = "debugtup";

/// One kind's count.
struct Count {
    name: &'static str,
    unit: &'static str,
    /// Instructions per unit, the harness's share taken off.
    net: f64,
    /// Each landmark's instructions per unit.
    landmarks: Vec<f64>,
}

/// Count `kind` with `steps` (`FEW + MANY` of them, each one argument list per
/// statement of the kind): a row with its instructions per unit, net of the same
/// arguments through `SELECT 1` and of printing the rows.
fn count(ctx: &Ctx, pg: &Standalone, kind: &Kind, steps: &[Vec<String>]) -> anyhow::Result<Count> {
    eprintln!("bench: counting {} ...", kind.name);
    // The kind's statements, or (`echo`) statements of the same parameters that do nothing.
    let script = |echo: bool, steps: &[Vec<String>]| -> String {
        let name = |p: &Prepared| if echo { format!("echo_{}", p.name) } else { p.name.to_owned() };
        let mut s = kind.settings.clone();
        for p in &kind.statements {
            let sql = if echo { "SELECT 1" } else { p.sql.trim() };
            s.push_str(&format!("PREPARE {}({}) AS {sql};\n\n", name(p), p.types.join(", ")));
        }
        let several = kind.statements.len() > 1;
        for step in steps {
            if several {
                s.push_str("BEGIN;\n\n");
            }
            for (p, args) in kind.statements.iter().zip(step) {
                s.push_str(&format!("EXECUTE {}({args});\n\n", name(p)));
            }
            if several {
                s.push_str("COMMIT;\n\n");
            }
        }
        s
    };
    let (few, many) = steps.split_at(FEW);
    let units = ((MANY - FEW) * kind.units) as f64;
    let before = tally(pg, kind.effect)?;
    // The longer run less the shorter, per unit: start-up and everything done once
    // (planning, the first reads of the catalog) cancel out.
    let measure = |echo: bool, label: &str| -> anyhow::Result<(f64, HashMap<String, f64>)> {
        let a = pg.count(&script(echo, few), &format!("{label}-few"))?;
        let b = pg.count(&script(echo, &many[..MANY]), &format!("{label}-many"))?;
        let (fa, fb) = (pg::inclusive(&a.file)?, pg::inclusive(&b.file)?);
        let functions = fb
            .iter()
            .map(|(name, n)| (name.clone(), (*n as f64 - *fa.get(name).unwrap_or(&0) as f64) / units))
            .collect();
        Ok(((b.instructions as f64 - a.instructions as f64) / units, functions))
    };
    let (statement, functions) = measure(false, kind.tag)?;
    let done = tally(pg, kind.effect)? - before;
    anyhow::ensure!(
        done == ((FEW + MANY) * kind.units) as i64,
        "{}: its {} statements handled {done} {}s, not {} ({})",
        kind.name,
        FEW + MANY,
        kind.unit,
        (FEW + MANY) * kind.units,
        kind.effect
    );
    // The harness's share: the same arguments, read, parsed and bound, into nothing.
    let (echo, echo_functions) = measure(true, &format!("{}-echo", kind.tag))?;
    let printing =
        functions.get(PRINTING).copied().unwrap_or(0.0) - echo_functions.get(PRINTING).copied().unwrap_or(0.0);
    let net = statement - echo - printing;
    ctx.row(Row {
        id: "18".into(),
        scenario: format!("PostgreSQL instructions: {}", kind.name),
        setting: format!("{MANY} − {FEW} statements"),
        result: format!(
            "**{:.0} instructions per {}** (taken off: the harness's reading of the arguments, {:.0}; printing the rows, {:.0})",
            net, kind.unit, echo, printing
        ),
        ..Row::default()
    });
    let landmarks = LANDMARKS
        .iter()
        .map(|(_, names)| names.iter().map(|n| functions.get(*n).copied().unwrap_or(0.0)).sum())
        .collect();
    Ok(Count { name: kind.name, unit: kind.unit, net, landmarks })
}

/// The `n` that `sql` counts.
fn tally(pg: &Standalone, sql: &str) -> anyhow::Result<i64> {
    let printed = pg.run(&format!("{sql};\n\n"))?;
    let n = pg::column(&printed, "n");
    anyhow::ensure!(n.len() == 1, "{sql} printed {} rows", n.len());
    Ok(n[0].parse()?)
}

/// The appendix: where each kind's instructions go.
fn landmarks_table(counts: &[Count]) -> String {
    let mut t = String::from("| function (inclusive) |");
    for c in counts {
        t.push_str(&format!(" {} (per {}) |", c.name, c.unit));
    }
    t.push_str("\n|---|");
    t.push_str(&"---|".repeat(counts.len()));
    t.push_str("\n| **all, net** |");
    for c in counts {
        t.push_str(&format!(" **{:.0}** |", c.net));
    }
    for (i, (label, _)) in LANDMARKS.iter().enumerate() {
        t.push_str(&format!("\n| {label} |"));
        for c in counts {
            t.push_str(&format!(" {:.0} |", c.landmarks[i]));
        }
    }
    t.push('\n');
    t
}

/// One bench webhook as the gateway stores it.
struct Event {
    key: String,
    headers: serde_json::Value,
    body: String,
    terms: Vec<i64>,
}

impl Event {
    fn new(key: &str, seq: u64) -> Event {
        let body = crate::payload::body(seq);
        let headers = json!({
            "content-type": "application/json",
            "user-agent": "wg-bench",
            "x-request-id": key,
            "x-signature": "[redacted]",
        });
        let terms = webhook_gateway::search::terms(key, &headers, body.as_bytes());
        Event { key: key.to_owned(), headers, body, terms }
    }

    /// `insert_sql`'s ten arguments.
    fn single(&self, source: &str) -> String {
        format!(
            "{}, {}, {}, 'application/json', {}, {}, NULL, NULL, NULL, {}",
            lit(source),
            lit(&self.key),
            lit(crate::payload::EVENT_TYPE),
            lit(&self.headers.to_string()),
            bytes_lit(self.body.as_bytes()),
            array(self.terms.iter().map(i64::to_string), "int8")
        )
    }
}

/// `insert_batch_sql`'s thirteen arguments for `events`.
fn batch_args(events: &[Event], source: &str) -> String {
    let each =
        |f: &dyn Fn(usize, &Event) -> String, ty: &str| array(events.iter().enumerate().map(|(i, e)| f(i, e)), ty);
    let mut ends = Vec::new();
    let mut end = 0;
    for e in events {
        end += e.terms.len();
        ends.push(end.to_string());
    }
    [
        each(&|_, _| lit(source), "uuid"),
        each(&|_, e| lit(&e.key), "text"),
        each(&|_, _| lit(crate::payload::EVENT_TYPE), "text"),
        each(&|_, _| lit("application/json"), "text"),
        each(&|_, e| lit(&e.headers.to_string()), "text"),
        each(&|_, e| bytes_lit(e.body.as_bytes()), "bytea"),
        each(&|i, _| i.to_string(), "int4"),
        each(&|_, _| "NULL".into(), "text"),
        each(&|i, _| i.to_string(), "int4"),
        each(&|_, _| "NULL".into(), "text"),
        each(&|_, _| "NULL".into(), "text"),
        array(events.iter().flat_map(|e| e.terms.iter().map(i64::to_string)), "int8"),
        array(ends, "int4"),
    ]
    .join(", ")
}

/// `RECORD_SQL`'s fourteen arguments: each claimed delivery `(id, token, attempt)`
/// delivered (200 in 12 ms).
fn outcome_args(claimed: &[(String, String, String)]) -> String {
    let each = |f: &dyn Fn(&(String, String, String)) -> String, ty: &str| array(claimed.iter().map(f), ty);
    [
        each(&|c| lit(&c.0), "uuid"),
        each(&|c| c.1.clone(), "int8"),
        each(&|c| c.2.clone(), "int4"),
        each(&|_| "now()".into(), "timestamptz"),
        each(&|_| "12".into(), "int4"),
        each(&|_| "200".into(), "int4"),
        each(&|_| "NULL".into(), "text"),
        each(&|_| lit("delivered"), "text"),
        each(&|_| lit("delivered"), "text"),
        each(&|_| lit("HTTP 200"), "text"),
        each(&|_| lit("{\"ok\":true}"), "text"),
        each(&|_| "NULL".into(), "timestamptz"),
        each(&|_| "NULL".into(), "text"),
        each(&|_| "NULL".into(), "text"),
    ]
    .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_s_terms_end_where_each_event_s_do() {
        let events = [Event::new("a", 1), Event::new("b", 2)];
        let args = batch_args(&events, "00000000-0000-7000-8000-000000000001");
        let first = events[0].terms.len();
        let both = first + events[1].terms.len();
        assert!(first > 0 && both > first);
        assert!(args.ends_with(&format!("ARRAY[{first}, {both}]::int4[]")), "{args}");
        assert_eq!(args.matches("'::bytea,").count() + args.matches("'::bytea]").count(), 2);
    }

    #[test]
    fn the_recorder_s_settings_are_the_gateway_s_for_a_session() {
        let settings = recorder_settings();
        assert!(
            settings.starts_with("SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off"),
            "{settings}"
        );
        assert!(settings.contains("SET enable_hashjoin = off") && !settings.contains("LOCAL"), "{settings}");
        assert!(settings.ends_with(";\n\n") && !settings.contains("BEGIN"), "{settings}");
    }

    #[test]
    fn outcomes_carry_each_claim_s_token_and_attempt() {
        let claimed = [("id-1".to_owned(), "41".to_owned(), "1".to_owned()), ("id-2".into(), "97".into(), "2".into())];
        let args = outcome_args(&claimed);
        assert!(
            args.starts_with("ARRAY['id-1', 'id-2']::uuid[], ARRAY[41, 97]::int8[], ARRAY[1, 2]::int4[]"),
            "{args}"
        );
    }
}
