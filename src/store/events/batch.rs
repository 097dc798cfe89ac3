//! The batch ingest statements: group commit's path (`ingest::batcher`) stores many
//! webhooks, each with its fan-out, in one statement and one commit; the leasing form
//! also leases their deliveries for the dispatcher of the same process
//! (`deliver::prelease`), as the lone webhook's statement does.

use std::sync::LazyLock;

use sqlx::Postgres;
use sqlx::postgres::PgRow;

use super::{ClaimTerms, OwnedEvent, Stored, insert_with_fanout};
use crate::ids::{DeliveryId, EventId, SourceId};
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

/// A batch's columns, one array element per distinct event, as the batch statements bind
/// them (`$1`-`$13`).
struct BatchColumns<'a> {
    source_ids: Vec<SourceId>,
    keys: Vec<&'a str>,
    types: Vec<&'a str>,
    content_types: Vec<Option<&'a str>>,
    headers: Vec<String>,
    payloads: Vec<&'a [u8]>,
    ords: Vec<i32>,
    ordering_keys: Vec<Option<&'a str>>,
    arrivals: Vec<i32>,
    traceparents: Vec<Option<&'a str>>,
    tracestates: Vec<Option<&'a str>>,
    terms: Vec<i64>,
    term_ends: Vec<i32>,
}

/// The parameters of the batch statements (`$1`-`$13`, [`BatchColumns::bound`]).
const BATCH_PARAMS: usize = 13;

/// The search terms a batch's column is first sized for, per event (the bench's webhook
/// has 17; a larger document grows the column once or twice).
const TERMS_PER_EVENT: usize = 32;

/// About the length of `headers` (an event's stored headers, a map of strings) as JSON
/// text: each member its quoted name and value, a colon and a comma, and an eighth more
/// for escapes; more escapes than that cost one growth.
pub(super) fn json_text_size(headers: &serde_json::Value) -> usize {
    let size = match headers {
        serde_json::Value::Object(map) => {
            2 + map.iter().map(|(k, v)| k.len() + v.as_str().map_or(16, str::len) + 6).sum::<usize>()
        }
        _ => 64,
    };
    size + size / 8
}

/// `headers` as JSON text, written into a string sized for it at once. (`to_string`
/// grew the string from empty through `Display`: five or six allocations for a
/// webhook's headers.)
fn json_text(headers: &serde_json::Value) -> String {
    let mut text = Vec::with_capacity(json_text_size(headers));
    match serde_json::to_writer(&mut text, headers) {
        // serde_json writes UTF-8 only.
        Ok(()) => String::from_utf8(text).unwrap_or_else(|_| headers.to_string()),
        Err(_) => headers.to_string(),
    }
}

impl<'a> BatchColumns<'a> {
    /// The columns of `events` at the indexes `unique` (each distinct key once, in the
    /// order the rows are inserted).
    fn of(events: &'a [OwnedEvent], unique: &[usize]) -> Self {
        let each = || unique.iter().map(|&i| &events[i]);
        // Each event's search terms, end to end in one array: event n's are
        // `terms[term_ends[n-1] + 1 : term_ends[n]]` (1-based, inclusive), since a
        // parameter cannot be an array of arrays of different lengths.
        let mut terms: Vec<i64> = Vec::with_capacity(unique.len() * TERMS_PER_EVENT);
        let mut term_ends: Vec<i32> = Vec::with_capacity(unique.len());
        for e in each() {
            terms.extend_from_slice(&e.as_new().search_terms());
            term_ends.push(i32::try_from(terms.len()).unwrap_or(i32::MAX));
        }
        BatchColumns {
            source_ids: each().map(|e| e.source_id).collect(),
            keys: each().map(|e| e.dedupe_key.as_str()).collect(),
            types: each().map(|e| e.event_type.as_str()).collect(),
            content_types: each().map(|e| e.content_type.as_deref()).collect(),
            headers: each().map(|e| json_text(&e.headers)).collect(),
            payloads: each().map(|e| &e.payload[..]).collect(),
            ords: (0..unique.len() as i32).collect(),
            ordering_keys: each().map(|e| e.ordering_key.as_deref()).collect(),
            // The order events arrived in (the batch's input order), which orders the
            // deliveries of one line; `ord` is the (source, key) order the rows are
            // inserted in.
            arrivals: unique.iter().map(|&i| i32::try_from(i).unwrap_or(i32::MAX)).collect(),
            traceparents: each().map(|e| e.trace.as_ref().map(|t| t.traceparent.as_str())).collect(),
            tracestates: each().map(|e| e.trace.as_ref().and_then(|t| t.tracestate.as_deref())).collect(),
            terms,
            term_ends,
        }
    }

    /// The bytes these columns take bound: PostgreSQL's binary array format, a header
    /// per array and a length before each element.
    fn encoded_bytes(&self) -> usize {
        const ARRAY_HEADER: usize = 24;
        const ELEMENT_LENGTH: usize = 4;
        let text = |column: &[&str]| column.iter().map(|s| s.len()).sum::<usize>();
        let optional = |column: &[Option<&str>]| column.iter().flatten().map(|s| s.len()).sum::<usize>();
        let events = self.ords.len();
        BATCH_PARAMS * ARRAY_HEADER
            + (BATCH_PARAMS - 1) * events * ELEMENT_LENGTH
            + events * (16 + 3 * 4)
            + text(&self.keys)
            + text(&self.types)
            + optional(&self.content_types)
            + self.headers.iter().map(String::len).sum::<usize>()
            + self.payloads.iter().map(|p| p.len()).sum::<usize>()
            + optional(&self.ordering_keys)
            + optional(&self.traceparents)
            + optional(&self.tracestates)
            + self.terms.len() * (ELEMENT_LENGTH + 8)
    }

    /// `sql` (a batch statement) with these columns bound as `$1`-`$13`.
    fn bound<'q>(&'q self, sql: &'q str) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
        crate::db::query_sized(sql, BATCH_PARAMS, self.encoded_bytes())
            .bind(&self.source_ids)
            .bind(&self.keys)
            .bind(&self.types)
            .bind(&self.content_types)
            .bind(&self.headers)
            .bind(&self.payloads)
            .bind(&self.ords)
            .bind(&self.ordering_keys)
            .bind(&self.arrivals)
            .bind(&self.traceparents)
            .bind(&self.tracestates)
            .bind(crate::db::Int8Array(&self.terms))
            .bind(&self.term_ends)
    }
}

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
    // duplicate lookup. Rare; settle each one on its own.
    for &i in unique {
        if stored[i].is_none() {
            stored[i] = Some(insert_with_fanout(pool, &events[i].as_new()).await?);
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
struct BatchPlan {
    /// Indexes of the first input of each distinct (source, key), in (source, key) order:
    /// concurrent batches then wait on the unique index in the same order and cannot
    /// deadlock.
    unique: Vec<usize>,
    /// For each input, the index of the input whose answer it takes (itself when sent;
    /// a later copy of a key is answered as a duplicate of the first).
    representative: Vec<usize>,
}

/// Plan a batch: sort by (source, key), keep the first input of each key (the sort is
/// stable, so the earliest arrival), point every copy at it.
fn plan_batch(events: &[OwnedEvent]) -> BatchPlan {
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
mod tests {
    use super::*;

    #[test]
    fn headers_are_written_as_to_string_writes_them() {
        let long = "v".repeat(5_000);
        let cases = [
            serde_json::json!({}),
            serde_json::json!({"content-type": "application/json", "user-agent": "Stripe/1.0"}),
            serde_json::json!({"x-quoted": "a \"b\" \\ c\n\u{0001} é ✓", "x-long": long}),
            serde_json::json!({"x-redacted": crate::ingest::REDACTED, "x-n": 3, "x-list": ["a", "b"]}),
            serde_json::json!(null),
            serde_json::json!("text"),
        ];
        for headers in cases {
            assert_eq!(json_text(&headers), headers.to_string(), "{headers}");
        }
    }

    /// The bytes `value` takes bound: its length, then what it encodes to.
    fn encoded<'q, T: sqlx::Encode<'q, Postgres>>(value: &T) -> usize {
        let mut buffer = sqlx::postgres::PgArgumentBuffer::default();
        let _ = value.encode_by_ref(&mut buffer);
        4 + buffer.len()
    }

    /// An event with every column filled, escapes in its headers and a trace.
    fn full_event(source: SourceId, key: &str) -> OwnedEvent {
        OwnedEvent {
            content_type: Some("application/json; charset=utf-8".to_owned()),
            headers: serde_json::json!({"user-agent": "Stripe/1.0", "x-quoted": "a \"b\" \\ c\n é", "x-n": "42"}),
            payload: bytes::Bytes::from(format!(r#"{{"id": "{key}", "items": [1, 2.5, null, "x"]}}"#)),
            ordering_key: Some("customer-7".to_owned()),
            trace: Some(crate::telemetry::EventTrace {
                traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
                tracestate: Some("vendor=value".to_owned()),
            }),
            ..event(source, key)
        }
    }

    /// The room reserved for a statement's parameters holds them as sqlx encodes them, so
    /// binding never grows the buffer, and is not far off (a column left out of the
    /// estimate, or counted twice, fails this).
    #[test]
    fn the_room_reserved_for_the_parameters_holds_them() {
        let source = SourceId(uuid::Uuid::from_u128(1));
        let events: Vec<OwnedEvent> = (0..5).map(|i| full_event(source, &format!("k{i}"))).collect();
        let columns = BatchColumns::of(&events, &plan_batch(&events).unique);
        let bound = encoded(&columns.source_ids)
            + encoded(&columns.keys)
            + encoded(&columns.types)
            + encoded(&columns.content_types)
            + encoded(&columns.headers)
            + encoded(&columns.payloads)
            + encoded(&columns.ords)
            + encoded(&columns.ordering_keys)
            + encoded(&columns.arrivals)
            + encoded(&columns.traceparents)
            + encoded(&columns.tracestates)
            + encoded(&crate::db::Int8Array(&columns.terms))
            + encoded(&columns.term_ends);
        let estimate = columns.encoded_bytes();
        assert!(estimate >= bound && estimate <= bound + bound / 8, "batch: estimate {estimate}, bound {bound}");

        let event = &events[0];
        let new = event.as_new();
        let terms = new.search_terms();
        let bound = encoded(&new.source_id)
            + encoded(&new.dedupe_key)
            + encoded(&new.event_type)
            + encoded(&new.content_type)
            + encoded(&sqlx::types::Json(new.headers))
            + encoded(&new.payload)
            + encoded(&new.ordering_key)
            + encoded(&new.trace.map(|t| t.traceparent.as_str()))
            + encoded(&new.trace.and_then(|t| t.tracestate.as_deref()))
            + encoded(&crate::db::Int8Array(&terms));
        let estimate = super::super::event_encoded_bytes(&new, &terms);
        assert!(estimate >= bound && estimate <= bound + bound / 8, "one event: estimate {estimate}, bound {bound}");
    }

    fn event(source: SourceId, key: &str) -> OwnedEvent {
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
