//! The batch ingest statements: group commit's path (`ingest::batcher`) stores many
//! webhooks, each with its fan-out, in one statement and one commit; the leasing form
//! also leases their deliveries for the dispatcher of the same process
//! (`deliver::prelease`), as the lone webhook's statement does.

use std::sync::LazyLock;

use sqlx::postgres::PgRow;

use super::columns::BatchColumns;
use super::{ClaimTerms, OwnedEvent, Stored, insert_with_fanout};
use crate::ids::{DeliveryId, EventId};
use crate::invariants::Broken;
use crate::queue::fanout::{
    FANOUT, FANOUT_BATCH_LEASED, FANOUT_LEAN_BATCH, FANOUT_LEAN_BATCH_LEASED, NEEDS_FULL_FANOUT_BATCH,
};

/// One event's answer in a batch statement's rows: `ord` (its place in the statement),
/// its id (the twin's for a duplicate; none when the twin was invisible to the
/// statement), whether it is a duplicate, and the deliveries it created.
type BatchAnswer = (i32, Option<EventId>, bool, Vec<DeliveryId>);

/// [`invariants::EACH_EVENT_ANSWERED_ONCE`](crate::invariants::EACH_EVENT_ANSWERED_ONCE)
/// for the answers of a batch statement of `events` distinct events: each `ord` is one
/// of the batch's and comes once, and new events' ids are distinct.
fn answers_are_one_per_event(rows: &[BatchAnswer], events: usize) -> Result<(), Broken> {
    use crate::invariants::{EACH_EVENT_ANSWERED_ONCE, distinct, ensure};
    ensure(rows.iter().all(|r| usize::try_from(r.0).is_ok_and(|ord| ord < events)), EACH_EVENT_ANSWERED_ONCE, || {
        format!("an answer for an event the batch of {events} does not have")
    })?;
    distinct(rows.iter().map(|r| r.0), EACH_EVENT_ANSWERED_ONCE)?;
    distinct(rows.iter().filter(|r| !r.2).filter_map(|r| r.1), EACH_EVENT_ANSWERED_ONCE)
}

/// The batch ingest statement ([`insert_batch_with_fanout`]: `$1`-`$11` and `$13` one
/// array element per event, `$12` every event's search terms end to end): public so that
/// tests can read its plan.
///
/// The duplicate lookup is a `LATERAL ... LIMIT 1` that runs only for an event the insert
/// skipped: one lookup by `events_dedupe` per duplicate, and none otherwise. Written as a
/// plain `LEFT JOIN events`, the generic plan built while `events` was small (a gateway's
/// first minute on a new database, before any `ANALYZE`) hashed the batch and scanned the
/// whole table for every batch, duplicates or not: 27,529 rows read for a batch of two in
/// the bench's 1,000/s run, the statement's mean 2.9 ms, growing with the table
/// (`tests/it/plans.rs`).
pub fn insert_batch_sql() -> &'static str {
    static SQL: LazyLock<String> =
        LazyLock::new(|| format!("{}\n        {}", batch_ctes(FANOUT, Form::Full), Form::Full.answer()));
    &SQL
}

/// The lean form of [`insert_batch_sql`] (the same parameters and answer), for a batch
/// whose sources no subscription filters, orders or transforms ([`FANOUT_LEAN_BATCH`]).
/// It decides for itself, as the lone webhook's lean statement does (`super::lean`):
/// where a subscription of one of the batch's sources needs the full fan-out, it stores
/// nothing, and its answer's fifth column, `needs_full`, is true (each row's answer then
/// says nothing). Public so that tests and the benchmark can run it.
pub fn lean_insert_batch_sql() -> &'static str {
    static SQL: LazyLock<String> =
        LazyLock::new(|| format!("{}\n        {}", batch_ctes(FANOUT_LEAN_BATCH, Form::Lean), Form::Lean.answer()));
    &SQL
}

/// The batch statement that also leases the deliveries it creates
/// ([`insert_batch_and_claim`]; `$14` most leases, `$15` lease in seconds, `$16` default
/// max in flight): each event's answer with its columns named `stored_*`, then the
/// lease's columns (read by `crate::queue::fresh_lease_of`), one row per delivery leased
/// (or one whose lease columns are null when none of the event's was), and `candidates`:
/// the deliveries it created.
///
/// The deliveries are inserted leased ([`FANOUT_BATCH_LEASED`]: room granted by
/// `wg_lease_room_v6`, migrations 0029 and 0033, several leases per endpoint). The statement
/// returns the delivery's and the granted endpoint's columns (and the headers, for a
/// transformation's input); the event's own are the caller's: echoed back, with each
/// event's source joined for its name, they were about 35,000 instructions a webhook of
/// a batch of 8 (bench row 18).
pub fn insert_batch_and_claim_sql() -> &'static str {
    static SQL: LazyLock<String> = LazyLock::new(|| leasing_batch_statement(FANOUT_BATCH_LEASED, Form::Full));
    &SQL
}

/// The lean form of [`insert_batch_and_claim_sql`] (its parameters and answer, and
/// `stored_needs_full`, true when the batch needs the full fan-out and nothing was
/// stored, as [`lean_insert_batch_sql`]): no transformation to read.
pub fn lean_insert_batch_and_claim_sql() -> &'static str {
    static SQL: LazyLock<String> = LazyLock::new(|| leasing_batch_statement(FANOUT_LEAN_BATCH_LEASED, Form::Lean));
    &SQL
}

/// Which fan-out a batch statement runs: the full one, or the lean one behind its guard,
/// which answers `needs_full` beside each event's answer and reads no transformation (a
/// source with one needs the full fan-out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Full,
    Lean,
}

impl Form {
    /// The statement's answer: [`BATCH_ANSWER`], or the lean one's with its flag.
    fn answer(self) -> &'static str {
        match self {
            Form::Full => BATCH_ANSWER,
            Form::Lean => LEAN_BATCH_ANSWER,
        }
    }
}

/// A leasing batch statement of `fanout` in `form`: each event's answer (and
/// `stored_needs_full` for the lean form), then the lease's columns; in the full form a
/// delivery may carry a transformation, whose text and the event's headers are read.
fn leasing_batch_statement(fanout: &str, form: Form) -> String {
    let (ctes, answer) = (batch_ctes(fanout, form), form.answer());
    let (needs_full, transform, event_headers, joins) = match form {
        Form::Full => (
            "",
            "(SELECT tr.transform FROM subscriptions tr WHERE tr.id = f.transform_by)",
            "CASE WHEN f.transform_by IS NOT NULL THEN i.headers::jsonb::text END",
            " JOIN ev ON ev.id = f.event_id JOIN input i ON i.arrival = ev.ord",
        ),
        Form::Lean => (", a.needs_full AS stored_needs_full", "NULL::text", "NULL::text", ""),
    };
    format!(
        "{ctes}, answer AS (
            {answer}
        )
        SELECT a.ord AS stored_ord, a.id AS stored_id, a.duplicate AS stored_duplicate,
               a.deliveries AS stored_deliveries{needs_full}, c.*, (SELECT count(*) FROM fan)::int8 AS candidates
        FROM answer a LEFT JOIN (
            SELECT f.id, f.event_id, f.endpoint_id, f.attempt_count AS attempt, f.attempts_base, f.claim_token,
                   l.url, l.secret, l.previous_secrets, {transform} AS transform, {event_headers} AS event_headers
            FROM fan f JOIN leases l ON l.endpoint_id = f.endpoint_id{joins}
            WHERE f.leased
        ) c ON c.event_id = a.id AND NOT a.duplicate"
    )
}

/// The batch statements' `WITH` list: the input, the events, their bodies and the fan-out
/// (`fanout`, [`FANOUT`] or [`FANOUT_BATCH_LEASED`], or a lean one), and `fanned`: each
/// new event's deliveries. In the lean `form`: first whether the batch needs the full
/// fan-out ([`NEEDS_FULL_FANOUT_BATCH`], read with the statement's snapshot), and the
/// events inserted only when it does not.
fn batch_ctes(fanout: &str, form: Form) -> String {
    let (guard, only_when) = match form {
        Form::Full => (String::new(), ""),
        Form::Lean => (
            format!("full_fanout AS MATERIALIZED (\n            {NEEDS_FULL_FANOUT_BATCH}\n        ), "),
            " WHERE NOT (SELECT needed FROM full_fanout)",
        ),
    };
    format!(
        "WITH {guard}input AS (
            SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bytea[], $7::int4[],
                                 $8::text[], $9::int4[], $10::text[], $11::text[], $13::int4[])
                AS i(source_id, dedupe_key, event_type, content_type, headers, payload, ord, ordering_key, arrival,
                     traceparent, tracestate, term_end)
        ), ins AS (
            INSERT INTO events (source_id, dedupe_key, event_type, content_type, headers, payload, ordering_key,
                                traceparent, tracestate, search)
            SELECT source_id, dedupe_key, event_type, content_type, headers::jsonb, payload, ordering_key,
                   traceparent, tracestate,
                   ($12::int8[])[COALESCE(lag(term_end) OVER (ORDER BY ord), 0) + 1 : term_end]
            FROM input{only_when} ORDER BY ord
            ON CONFLICT ON CONSTRAINT events_dedupe DO NOTHING
            RETURNING id, source_id, dedupe_key, event_type, ordering_key
        ), ev AS (
            SELECT ins.*, i.arrival AS ord
            FROM ins JOIN input i ON i.source_id = ins.source_id AND i.dedupe_key = ins.dedupe_key
        ), bodies AS (
            SELECT ins.id, i.headers::jsonb AS headers, i.payload
            FROM ins JOIN input i ON i.source_id = ins.source_id AND i.dedupe_key = ins.dedupe_key
        ), {fanout}, fanned AS (
            SELECT event_id, array_agg(id) AS ids FROM fan GROUP BY event_id
        )"
    )
}

/// The batch statements' answer, one row per event of the input: `ord`, the event's id
/// (or its stored twin's), whether it is a duplicate, its deliveries, and `$extra`
/// columns.
macro_rules! batch_answer {
    ($extra:literal) => {
        concat!(
            "SELECT i.ord, COALESCE(ev.id, old.id) AS id, ev.id IS NULL AS duplicate,
               COALESCE(fanned.ids, '{}'::uuid[]) AS deliveries",
            $extra,
            "
        FROM input i
        LEFT JOIN ev ON ev.source_id = i.source_id AND ev.dedupe_key = i.dedupe_key
        LEFT JOIN fanned ON fanned.event_id = ev.id
        LEFT JOIN LATERAL (
            SELECT o.id FROM events o
            WHERE ev.id IS NULL AND o.source_id = i.source_id AND o.dedupe_key = i.dedupe_key
            LIMIT 1
        ) old ON true"
        )
    };
}

/// [`batch_answer`] as the full batch statements answer.
const BATCH_ANSWER: &str = batch_answer!("");

/// [`batch_answer`] as the lean ones answer: with `needs_full`, whether the batch needs
/// the full fan-out (then nothing was stored, and the rows say nothing else). A flag
/// beside the answer: a row of its own put the answer under a `UNION ALL`, for the same
/// instructions (bench row 18) and a harder read.
const LEAN_BATCH_ANSWER: &str = batch_answer!(", (SELECT needed FROM full_fanout) AS needs_full");

/// Store many events, each with its fan-out, in one statement (one transaction, one
/// commit): the ingest batcher's path under load. Same guarantees as
/// [`insert_with_fanout`] for every event; copies of one key within the batch are sent
/// once and the others answered as duplicates. Rows go in (source, key) order so two
/// concurrent batches wait on the unique index in the same order and cannot deadlock.
/// Results come back in input order.
pub async fn insert_batch_with_fanout(
    pool: &crate::db::Pool,
    events: &[OwnedEvent],
) -> Result<Vec<Stored>, sqlx::Error> {
    use sqlx::Row as _;
    let plan = plan_batch(events);
    let columns = BatchColumns::of(events, &plan.unique);
    let answers_of = |rows: Vec<PgRow>| {
        rows.iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?, row.try_get(3)?)))
            .collect::<Result<Vec<BatchAnswer>, sqlx::Error>>()
    };
    let rows = super::lean::lean_first(
        events.iter().map(|event| event.source_id),
        (insert_batch_sql(), lean_insert_batch_sql()),
        |rows| said_needs_full(rows, "needs_full"),
        |sql| columns.bound(sql).fetch_all(pool),
    )
    .await?;
    answers_in_input_order(pool, events, &plan, answers_of(rows)?).await
}

/// Whether a lean batch statement's `rows` say (in their column `flag`) that the batch
/// needs the full fan-out.
fn said_needs_full(rows: &[PgRow], flag: &str) -> Result<bool, sqlx::Error> {
    use sqlx::Row as _;
    rows.first().map_or(Ok(false), |row| row.try_get(flag))
}

/// [`insert_batch_with_fanout`], with the deliveries it creates leased in the same
/// statement where their endpoints have room ([`insert_batch_and_claim_sql`]): every
/// unordered delivery up to `terms.limit` in all, each endpoint within its in-flight
/// limit and rate tokens, each lease with its own fencing token. The stored events'
/// `deliveries` still list every delivery they created; the claim says which were
/// leased. An event settled after the statement (its twin was invisible to it) leases
/// nothing.
pub async fn insert_batch_and_claim(
    pool: &crate::db::Pool,
    events: &[OwnedEvent],
    terms: ClaimTerms,
) -> Result<(Vec<Stored>, crate::queue::FreshClaim), sqlx::Error> {
    let plan = plan_batch(events);
    let columns = BatchColumns::of(events, &plan.unique);
    let run = |sql: &'static str| {
        columns
            .bound(sql)
            .bind(terms.limit)
            .bind(terms.lease.as_secs_f64())
            .bind(terms.default_max_in_flight)
            .fetch_all(pool)
    };
    let rows = super::lean::lean_first(
        events.iter().map(|event| event.source_id),
        (insert_batch_and_claim_sql(), lean_insert_batch_and_claim_sql()),
        |rows| said_needs_full(rows, "stored_needs_full"),
        run,
    )
    .await?;
    let answers = answers_of_leasing_rows(&rows)?;
    let fresh = leases_of_batch(&rows, events, &plan)?;
    let stored = answers_in_input_order(pool, events, &plan, answers).await?;
    Ok((stored, fresh))
}

/// The leases in the leasing batch statement's `rows`, each completed with its event's
/// own columns from `events` (found by the row's `stored_ord`, its place in `plan`'s
/// distinct events): the statement returns only the lease's.
fn leases_of_batch(
    rows: &[PgRow],
    events: &[OwnedEvent],
    plan: &BatchPlan,
) -> Result<crate::queue::FreshClaim, sqlx::Error> {
    use sqlx::Row as _;
    let columns = plan
        .unique
        .iter()
        .map(|&i| events[i].as_new().lease_columns(Some(&events[i].payload)))
        .collect::<Result<Vec<_>, _>>()?;
    crate::queue::fresh_lease_of(rows, |row| {
        let ord: i32 = row.try_get("stored_ord")?;
        usize::try_from(ord).ok().and_then(|ord| columns.get(ord)).ok_or_else(|| {
            sqlx::Error::Protocol(format!("a lease for the batch's event {ord}, which it does not have"))
        })
    })
}

/// Each event's answer in the leasing batch statement's `rows`, once: an event with
/// several deliveries leased has a row for each, all with the same answer.
fn answers_of_leasing_rows(rows: &[PgRow]) -> Result<Vec<BatchAnswer>, sqlx::Error> {
    use crate::invariants::{EACH_EVENT_ANSWERED_ONCE, ensure};
    use sqlx::Row as _;
    let Some(first) = rows.first() else { return Ok(Vec::new()) };
    let at = |name: &str| first.try_column(name).map(sqlx::Column::ordinal);
    let (ord, id, duplicate, deliveries) =
        (at("stored_ord")?, at("stored_id")?, at("stored_duplicate")?, at("stored_deliveries")?);
    let mut answers: Vec<BatchAnswer> = Vec::new();
    for row in rows {
        let answer: BatchAnswer =
            (row.try_get(ord)?, row.try_get(id)?, row.try_get(duplicate)?, row.try_get(deliveries)?);
        match answers.iter().find(|seen| seen.0 == answer.0) {
            Some(seen) => ensure(seen == &answer, EACH_EVENT_ANSWERED_ONCE, || {
                format!("two answers for the batch's event {}", answer.0)
            })?,
            None => answers.push(answer),
        }
    }
    Ok(answers)
}

/// The batch's answers (`answers`, one per distinct event of `plan`) in the input order
/// of `events`: a copy of a key within the batch answered as a duplicate of its first
/// arrival, and an event whose twin the statement could not see settled on its own.
async fn answers_in_input_order(
    pool: &crate::db::Pool,
    events: &[OwnedEvent],
    plan: &BatchPlan,
    answers: Vec<BatchAnswer>,
) -> Result<Vec<Stored>, sqlx::Error> {
    let BatchPlan { unique, representative } = plan;
    answers_are_one_per_event(&answers, unique.len())?;
    let mut stored: Vec<Option<Stored>> = vec![None; events.len()];
    for (ord, id, duplicate, deliveries) in answers {
        let Some(&i) = unique.get(ord as usize) else { continue };
        if let Some(event_id) = id {
            stored[i] = Some(Stored { event_id, duplicate, deliveries });
        }
    }
    // A twin committed after our statement's snapshot: invisible to the statement's
    // duplicate lookup. Rare; settle each one on its own. The batch has committed by now:
    // a conflict here is tried again here (the caller's retry would run the whole batch
    // again, answering its new webhooks as duplicates), and any other failure reads as
    // "may have been stored" for the whole batch, never "nothing was stored".
    for &i in unique {
        if stored[i].is_none() {
            let event = events[i].as_new();
            let settled = crate::db::retry_conflicts(|| insert_with_fanout(pool, &event)).await;
            stored[i] = Some(settled.map_err(crate::db::after_commit)?);
        }
    }
    let mut out = Vec::with_capacity(events.len());
    for (i, &rep) in representative.iter().enumerate() {
        let Some(first) = stored[rep].clone() else {
            return Err(sqlx::Error::Protocol("batch insert left an event without an answer".into()));
        };
        out.push(if rep == i {
            first
        } else {
            Stored { event_id: first.event_id, duplicate: true, deliveries: Vec::new() }
        });
    }
    Ok(out)
}

/// Which events of a batch are sent to the database, and whose answer each one takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct BatchPlan {
    /// Indexes of the first input of each distinct (source, key), in (source, key) order:
    /// concurrent batches then wait on the unique index in the same order and cannot
    /// deadlock.
    pub(super) unique: Vec<usize>,
    /// For each input, the index of the input whose answer it takes (itself when sent;
    /// a later copy of a key is answered as a duplicate of the first).
    representative: Vec<usize>,
}

/// Plan a batch: sort by (source, key), keep the first input of each key (the sort is
/// stable, so the earliest arrival), point every copy at it.
pub(super) fn plan_batch(events: &[OwnedEvent]) -> BatchPlan {
    let mut order: Vec<usize> = (0..events.len()).collect();
    order.sort_by(|&a, &b| {
        (events[a].source_id, &events[a].dedupe_key).cmp(&(events[b].source_id, &events[b].dedupe_key))
    });
    let mut representative = vec![0usize; events.len()];
    let mut unique: Vec<usize> = Vec::with_capacity(events.len());
    for &i in &order {
        match unique.last() {
            Some(&u) if events[u].source_id == events[i].source_id && events[u].dedupe_key == events[i].dedupe_key => {
                representative[i] = u;
            }
            _ => {
                representative[i] = i;
                unique.push(i);
            }
        }
    }
    BatchPlan { unique, representative }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::ids::SourceId;

    pub(in crate::store::events) fn event(source: SourceId, key: &str) -> OwnedEvent {
        OwnedEvent {
            source_id: source,
            source_name: "test".to_owned(),
            indexing: crate::search::Indexing::Content,
            dedupe_key: key.to_owned(),
            event_type: "t".to_owned(),
            content_type: None,
            headers: serde_json::json!({}),
            payload: bytes::Bytes::new(),
            ordering_key: None,
            trace: None,
            terms: None,
        }
    }

    #[test]
    fn a_batch_sends_each_key_once_in_key_order_and_copies_take_the_first_arrival() {
        let (a, b) = (SourceId(uuid::Uuid::from_u128(1)), SourceId(uuid::Uuid::from_u128(2)));
        let events = [event(b, "k1"), event(a, "k2"), event(a, "k1"), event(b, "k1"), event(a, "k2")];
        let plan = plan_batch(&events);
        // (a, k1) = 2, (a, k2) = 1, (b, k1) = 0: sorted by source, then key.
        assert_eq!(plan.unique, vec![2, 1, 0]);
        assert_eq!(plan.representative, vec![0, 1, 2, 0, 1]);
        assert_eq!(plan_batch(&[]), BatchPlan { unique: vec![], representative: vec![] });
    }

    /// Terms computed ahead (by ingest's requesters) are what the batch would compute,
    /// and go into the batch's columns as they are, at their event's place.
    #[test]
    fn terms_computed_ahead_are_what_the_batch_would_compute_and_stay_with_their_event() {
        let source = SourceId(uuid::Uuid::from_u128(1));
        let body =
            |e: OwnedEvent, b: &'static str| OwnedEvent { payload: bytes::Bytes::from_static(b.as_bytes()), ..e };
        let late = body(event(source, "k2"), r#"{"b": [1, 2]}"#);
        let ahead = body(event(source, "k1"), r#"{"a": "x"}"#).with_terms();
        let computed = crate::search::terms("k1", &serde_json::json!({}), br#"{"a": "x"}"#);
        assert_eq!(ahead.terms.as_deref(), Some(&computed[..]));
        let marked = OwnedEvent { terms: Some(vec![5]), ..event(source, "k0") };
        let events = [late, ahead, marked];
        let columns = BatchColumns::of(&events, &plan_batch(&events).unique);
        // In key order: k0 (marked), k1 (ahead), k2 (computed by the batch).
        let k2 = crate::search::terms("k2", &serde_json::json!({}), br#"{"b": [1, 2]}"#);
        assert_eq!(columns.terms, [vec![5], computed.clone(), k2.clone()].concat());
        let ends: Vec<i32> = [1, 1 + computed.len(), 1 + computed.len() + k2.len()].iter().map(|&n| n as i32).collect();
        assert_eq!(columns.term_ends, ends);
    }

    /// The two batch statements differ only in how they insert the deliveries and what
    /// they answer: the leasing one asks `wg_lease_room_v6` for room, binds its three
    /// claim terms after the batch's thirteen columns, and names its answer's columns.
    #[test]
    fn the_leasing_batch_statement_is_the_plain_one_with_leases() {
        let (plain, leasing) = (insert_batch_sql(), insert_batch_and_claim_sql());
        assert!(!plain.contains("wg_lease_room"), "{plain}");
        assert!(leasing.contains("wg_lease_room_v6(") && !leasing.contains("wg_lease_room_v5"), "{leasing}");
        for param in ["$14", "$15", "$16"] {
            assert!(!plain.contains(param) && leasing.contains(param), "{param}");
        }
        assert!(!leasing.contains("$17"));
        for column in ["stored_ord", "stored_id", "stored_duplicate", "stored_deliveries", "candidates"] {
            assert!(leasing.contains(column), "{column}");
        }
        assert!(plain.contains(BATCH_ANSWER) && leasing.contains(BATCH_ANSWER));
    }

    /// The lean batch statements guard their insert and leave out the full fan-out's
    /// parts, as the lone webhook's lean statements do; the leasing one is the plain one
    /// with leases, and reads no transformation.
    #[test]
    fn the_lean_batch_statements_keep_out_what_they_leave_to_the_full_one() {
        let (plain, leasing) = (lean_insert_batch_sql(), lean_insert_batch_and_claim_sql());
        for sql in [plain, leasing] {
            assert!(sql.contains("FROM input WHERE NOT (SELECT needed FROM full_fanout)"), "guarded: {sql}");
            assert!(sql.contains(NEEDS_FULL_FANOUT_BATCH) && sql.contains(LEAN_BATCH_ANSWER), "{sql}");
            for part in ["order_lines", "wg_event_doc", "jsonb_path_match", "transform_by IS NOT NULL", "tr.transform"]
            {
                let uses = sql.matches(part).count();
                let guard = NEEDS_FULL_FANOUT_BATCH.matches(part).count();
                assert_eq!(uses, guard, "{part} only in the guard: {sql}");
            }
        }
        assert!(!plain.contains("wg_lease_room"), "{plain}");
        assert!(leasing.contains("wg_lease_room_v6(") && !leasing.contains("$17"), "{leasing}");
        assert!(insert_batch_and_claim_sql().contains("tr.transform"), "the full one reads it");
    }
}
