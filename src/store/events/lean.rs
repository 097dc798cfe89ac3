//! The lean ingest statements: a lone webhook whose source no subscription filters,
//! orders or transforms is stored with a fan-out that leaves those parts out
//! ([`crate::queue::fanout::FANOUT_LEAN`]).
//!
//! At one webhook a statement, PostgreSQL spends more on setting up the plan's nodes at
//! each execution than on anything else (bench row 18), and the full fan-out carries the
//! nodes of filters, ordered lines and transformations whether a webhook needs them or
//! not. The lean statement decides for itself whether it may run: it reads the source's
//! subscriptions with its own snapshot, as the full fan-out would
//! ([`crate::queue::fanout::NEEDS_FULL_FANOUT`]), and when one of them filters, orders or
//! transforms it stores nothing and answers so; the caller then runs the full statement.
//! What a source needs is only remembered to choose which statement to try first: a
//! source found to need the full fan-out is tried lean again after
//! [`TRY_LEAN_AGAIN_AFTER`], and a stale memory costs a statement, never a wrong fan-out.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::PgRow;

use super::Transforms;
use crate::ids::SourceId;
use crate::queue::fanout::{FANOUT_LEAN, FANOUT_LEAN_LEASED, NEEDS_FULL_FANOUT};

/// How long a source found to need the full fan-out is stored with it without trying the
/// lean statement first.
pub const TRY_LEAN_AGAIN_AFTER: Duration = Duration::from_secs(30);

/// Sources whose lean statement found they need the full fan-out, and when.
static NEED_FULL: LazyLock<Mutex<HashMap<SourceId, Instant>>> = LazyLock::new(Default::default);

/// Whether to try the lean statement first for an event of `source`.
pub(super) fn worth_trying(source: SourceId) -> bool {
    let Ok(mut found) = NEED_FULL.lock() else { return false };
    match found.get(&source) {
        Some(at) if at.elapsed() < TRY_LEAN_AGAIN_AFTER => false,
        Some(_) => {
            found.remove(&source);
            true
        }
        None => true,
    }
}

/// A lean statement found that `source` needs the full fan-out.
pub(super) fn needs_full(source: SourceId) {
    if let Ok(mut found) = NEED_FULL.lock() {
        found.insert(source, Instant::now());
    }
}

/// Run one of an ingest's `statements` (full, lean) with `run`, for events of `sources`:
/// the lean one first where every source is [`worth_trying`], and the full one when the
/// lean one's rows say (`said_needs_full`) that a source needs it, each source then
/// remembered ([`needs_full`]). The rows of the statement that ran last. Shared by the
/// lone webhook's statements and group commit's batches.
pub(super) async fn lean_first<F, Fut>(
    sources: impl Iterator<Item = SourceId> + Clone,
    (full, lean): (&'static str, &'static str),
    said_needs_full: impl Fn(&[PgRow]) -> Result<bool, sqlx::Error>,
    mut run: F,
) -> Result<Vec<PgRow>, sqlx::Error>
where
    F: FnMut(&'static str) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<PgRow>, sqlx::Error>>,
{
    if sources.clone().all(worth_trying) {
        let rows = run(lean).await?;
        if !said_needs_full(&rows)? {
            return Ok(rows);
        }
        sources.for_each(needs_full);
    }
    run(full).await
}

/// The lean statement's `WITH` list: whether the source needs the full fan-out, the event
/// (inserted only when it does not) and the lean `fanout`. The same parameters as the
/// full statement's (`super::insert_sql`), typed here: in an `INSERT ... SELECT` they
/// take no type from the columns. `ev` returns the event's id alone: the lean fan-out
/// reads the source and the type from the parameters, and each column returned is one
/// more to set up in every node that reads `ev` (bench row 18).
fn lean_ctes(fanout: &str) -> String {
    format!(
        "WITH full_fanout AS MATERIALIZED (
            {NEEDS_FULL_FANOUT}
        ), ev AS (
            INSERT INTO events (source_id, dedupe_key, event_type, content_type, headers, payload, ordering_key,
                                traceparent, tracestate, search)
            SELECT $1::uuid, $2::text, $3::text, $4::text, $5::jsonb, $6::bytea, $7::text, $8::text, $9::text,
                   $10::int8[]
            FROM full_fanout WHERE NOT full_fanout.needed
            ON CONFLICT ON CONSTRAINT events_dedupe DO NOTHING
            RETURNING id
        ), {fanout}"
    )
}

/// The lean statement's answer: `answer` (the full statement's), and a row whose id is
/// null when the source needs the full fan-out (then nothing was stored).
fn lean_answer(answer: &str) -> String {
    format!(
        "{answer}
        UNION ALL
        SELECT NULL::uuid, false, '{{}}'::uuid[] FROM full_fanout WHERE full_fanout.needed"
    )
}

/// The lean form of [`super::insert_sql`] (the same parameters and answer, and the row
/// that says the source needs the full fan-out): public so the benchmark's pgbench runs
/// exactly what the gateway runs for the bench's source.
pub fn insert_sql() -> &'static str {
    static SQL: LazyLock<String> =
        LazyLock::new(|| format!("{}\n        {}", lean_ctes(FANOUT_LEAN), lean_answer(super::INSERT_ANSWER)));
    &SQL
}

/// The lean form of [`super::insert_and_claim_sql`] (its parameters and answer; a null
/// `stored_id` says the source needs the full fan-out).
pub fn insert_and_claim_sql() -> &'static str {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        super::leasing_statement(&lean_ctes(FANOUT_LEAN_LEASED), &lean_answer(super::LEASING_ANSWER), Transforms::None)
    });
    &SQL
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_found_to_need_the_full_fan_out_is_tried_lean_again_later() {
        let source = SourceId(uuid::Uuid::now_v7());
        assert!(worth_trying(source), "unknown: lean first");
        needs_full(source);
        assert!(!worth_trying(source), "just found to need the full fan-out");
        let long_ago = Instant::now().checked_sub(TRY_LEAN_AGAIN_AFTER + Duration::from_secs(1));
        if let Some(at) = long_ago {
            NEED_FULL.lock().expect("lock").insert(source, at);
            assert!(worth_trying(source), "remembered too long ago: lean again");
            assert!(worth_trying(source), "and forgotten");
        }
    }

    #[test]
    fn the_lean_statements_keep_out_what_they_leave_to_the_full_one() {
        for sql in [insert_sql(), insert_and_claim_sql()] {
            assert!(sql.contains("FROM full_fanout WHERE NOT full_fanout.needed"), "guarded: {sql}");
            for part in ["order_lines", "wg_event_doc", "jsonb_path_match", "transform IS NOT NULL)"] {
                let uses = sql.matches(part).count();
                let guard = NEEDS_FULL_FANOUT.matches(part).count();
                assert_eq!(uses, guard, "{part} only in the guard: {sql}");
            }
        }
        assert!(insert_and_claim_sql().contains("wg_lease_room_v5"));
        assert!(!insert_and_claim_sql().contains("tr.transform"), "no transformation to read");
        assert!(super::super::insert_and_claim_sql().contains("tr.transform"), "the full one reads it");
    }
}
