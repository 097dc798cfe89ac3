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
//!
//! Here: the kinds and their arguments' order ([`run`]); the counted database
//! ([`seed`]); the arguments as literals ([`args`]); a kind's count and where its
//! instructions go ([`count`]).

mod args;
mod count;
mod seed;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::Ctx;
use crate::pg::{self, Standalone, array, lit};
use args::{Event, batch_args, outcome_args};
use count::{count, landmarks_table};
use seed::prepare;

const DB: &str = "bench_statements";
/// Statements in the shorter run of a kind ...
const FEW: usize = 20;
/// ... and in the longer one: the count is their difference.
const MANY: usize = 100;
/// Delivered webhooks in the database before the count.
const HISTORY: u64 = 20_000;
/// Ordered lines: one per line step counted, for each of the two kinds of line step.
const LINES: usize = 2 * (FEW + MANY) * BATCH;
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
    let begin = begin_sql(Pooler::None, Some(Planning::Cached), false);
    // What follows the `BEGIN` (whatever it names: the isolation), as session settings.
    let settings = begin.split_once("; ").map_or("", |(_, settings)| settings);
    format!("{};\n\n", settings.replace("SET LOCAL ", "SET "))
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
        name: "claim by key, 16 deliveries (`queue::CLAIM_FRESH_SQL`: the hand-off from ingest)",
        tag: "claim",
        settings: String::new(),
        statements: Prepared::only(
            "claim",
            &["uuid[]", "int8", "float8", "int4"],
            webhook_gateway::queue::CLAIM_FRESH_SQL,
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

    // An ordered line's step: its head finished, the line is released (in the recorder,
    // by its outcome statement: `queue::RECORD_SQL`; here by the same lookups in a
    // statement of their own, so that the step's cost stays apart from the outcome's)
    // and the delivery waiting behind it becomes the head, in the recorder's transaction.
    let printed = pg.run(&format!(
        "SELECT id, ordering_key FROM deliveries WHERE endpoint_id = '{}' AND status = 'delivered' ORDER BY id;\n\n",
        seeded.ordered_endpoint
    ))?;
    let heads: Vec<(String, String)> =
        pg::column(&printed, "id").into_iter().zip(pg::column(&printed, "ordering_key")).collect();
    // A line's step: the release, then a promotion (`promote`).
    let step_of = |name: &'static str, tag: &'static str, promote: Prepared| Kind {
        name,
        tag,
        settings: recorder_settings(),
        statements: vec![
            Prepared {
                name: "release",
                types: &["uuid[]"],
                sql: webhook_gateway::queue::lines::RELEASE_HEADS_SQL.to_owned(),
            },
            promote,
        ],
        units: BATCH,
        unit: "line step",
        effect: "SELECT count(*) AS n FROM deliveries WHERE ordering_key IS NOT NULL AND status = 'pending' AND NOT waiting",
    };
    let line_step = step_of(
        "an ordered line's step, 16 lines (the release, `lines::RELEASE_HEADS_SQL`, which the recorder's outcome statement does itself since 2026-12-06, then `PROMOTE_SQL`: what the recorder adds for finished heads)",
        "line_step",
        Prepared {
            name: "promote",
            types: &["uuid[]", "text[]"],
            sql: webhook_gateway::queue::lines::PROMOTE_SQL.to_owned(),
        },
    );
    // The same step with the next heads leased by the promotion's own `UPDATE` (the
    // recorder's while its dispatcher owes no general claim): against the step above, what
    // the lease adds; against the claim by key above, what it saves. Its own lines (the
    // second half): a line's head can be promoted once.
    let leased_step = step_of(
        "an ordered line's step, leased, 16 lines (the release, then `lines::promote_leasing_sql`: the next heads leased by the promotion's own `UPDATE`)",
        "line_step_leased",
        Prepared {
            name: "promote_leasing",
            types: &["uuid[]", "text[]", "int8", "float8", "int4"],
            sql: webhook_gateway::queue::lines::promote_leasing_sql().to_owned(),
        },
    );
    let endpoint = lit(&seeded.ordered_endpoint);
    let steps = |heads: &[(String, String)], extra: &str| -> Vec<Vec<String>> {
        heads
            .chunks(BATCH)
            .filter(|c| c.len() == BATCH)
            .map(|c| {
                vec![
                    array(c.iter().map(|(id, _)| lit(id)), "uuid"),
                    format!(
                        "{}, {}{extra}",
                        array(c.iter().map(|_| endpoint.clone()), "uuid"),
                        array(c.iter().map(|(_, key)| lit(key)), "text")
                    ),
                ]
            })
            .collect()
    };
    let (plain_heads, leased_heads) = heads.split_at(heads.len() / 2);
    let plain_steps = steps(plain_heads, "");
    anyhow::ensure!(plain_steps.len() == MANY + FEW, "only {} line heads were seeded", heads.len());
    counts.push(count(ctx, &pg, &line_step, &plain_steps)?);
    let leased_steps = steps(leased_heads, &format!(", {BATCH}, {LEASE_SECS}, {BATCH}"));
    anyhow::ensure!(leased_steps.len() == MANY + FEW, "only {} line heads were seeded", heads.len());
    counts.push(count(ctx, &pg, &leased_step, &leased_steps)?);

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
