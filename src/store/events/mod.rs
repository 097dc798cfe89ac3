//! The `events` table, including the ingest statement that stores an event and its
//! fan-out together. Reading events back (by id, listed, searched): the `read` module.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{PgExecutor, Postgres};

use crate::ids::{DeliveryId, EndpointId, EventId, SourceId};
use crate::invariants::Broken;
use crate::queue::fanout::{FANOUT, FANOUT_LEASED};

pub mod lean;
mod read;
pub use read::*;

/// An event about to be stored.
#[derive(Debug)]
pub struct NewEvent<'a> {
    /// Source it arrived on.
    pub source_id: SourceId,
    /// What duplicates are recognised by within the source: the provider's delivery id,
    /// the caller's event id, or a hash of the body.
    pub dedupe_key: &'a str,
    /// Event type used for subscription matching.
    pub event_type: &'a str,
    /// Content type of the body, replayed on delivery.
    pub content_type: Option<&'a str>,
    /// Request headers (signatures already redacted).
    pub headers: &'a serde_json::Value,
    /// The body exactly as received (signatures were checked on these bytes); delivered as is.
    pub payload: &'a [u8],
    /// The ordering key, when the source defines one and the request carried it.
    pub ordering_key: Option<&'a str>,
    /// The trace context the deliveries link to (`crate::telemetry::EventTrace`).
    pub trace: Option<&'a crate::telemetry::EventTrace>,
}

/// The result of storing an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The event's id (the original one for a duplicate).
    pub event_id: EventId,
    /// True when an event with this dedupe key already existed: nothing new was stored.
    pub duplicate: bool,
    /// The deliveries created by this call (none for a duplicate): what ingest hands to
    /// its own dispatcher (`crate::wake::Handoff`).
    pub deliveries: Vec<DeliveryId>,
}

/// The single-event ingest statement (`$1` source id, `$2` dedupe key, `$3` event type,
/// `$4` content type, `$5` headers, `$6` payload, `$7` ordering key, `$8` traceparent,
/// `$9` tracestate, `$10` search terms): public so the benchmark's pgbench runs exactly
/// this.
pub fn insert_sql() -> &'static str {
    &INSERT_SQL
}

/// [`insert_sql`]'s text, built once: every lone webhook runs it.
static INSERT_SQL: LazyLock<String> = LazyLock::new(|| format!("{}\n        {INSERT_ANSWER}", insert_ctes(FANOUT)));

/// The ingest statement's `WITH` list: the event, its bodies and the fan-out (`fanout`,
/// [`FANOUT`] or [`FANOUT_LEASED`]).
fn insert_ctes(fanout: &str) -> String {
    format!(
        "WITH ev AS (
            INSERT INTO events (source_id, dedupe_key, event_type, content_type, headers, payload, ordering_key,
                                traceparent, tracestate, search)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
            ON CONFLICT ON CONSTRAINT events_dedupe DO NOTHING
            RETURNING id, source_id, event_type, ordering_key, 0 AS ord
        ), bodies AS (
            SELECT ev.id, $5::jsonb AS headers, $6::bytea AS payload FROM ev
        ), {fanout}"
    )
}

/// The ingest statement's answer: the new event with its deliveries, or the stored twin.
///
/// The duplicate branch usually answers in the same round trip. It reads the statement's
/// snapshot, so a twin committed after our statement began is invisible there (ON
/// CONFLICT still saw it): then zero rows come back and we look again.
const INSERT_ANSWER: &str = "SELECT id, false AS duplicate, ARRAY(SELECT id FROM fan) AS deliveries FROM ev
        UNION ALL
        SELECT id, true, '{}'::uuid[] FROM events
        WHERE source_id = $1 AND dedupe_key = $2 AND NOT EXISTS (SELECT 1 FROM ev)";

/// The ingest statement that also leases the deliveries it creates ([`insert_and_claim`];
/// `$11` most leases, `$12` lease in seconds, `$13` default max in flight): the answer's
/// columns renamed `stored_*`, then the claim's columns (`crate::queue::Claimed`), one
/// row per delivery leased (or one whose claim columns are null when none was), and
/// `candidates`: the deliveries it created.
///
/// The deliveries are inserted leased ([`FANOUT_LEASED`]: room granted by
/// `wg_lease_room_v1`, migration 0028, with the endpoint locks, in-flight count, rate
/// tokens and fencing token of any claim), so the worker's columns come from the
/// statement's own parameters, the granted endpoint rows and the source.
pub fn insert_and_claim_sql() -> &'static str {
    static SQL: LazyLock<String> =
        LazyLock::new(|| leasing_statement(&insert_ctes(FANOUT_LEASED), INSERT_ANSWER, Transforms::Read));
    &SQL
}

/// Whether a leasing statement's fan-out may name transformations.
#[derive(Clone, Copy)]
enum Transforms {
    /// It may (the full fan-out): the answer reads each leased delivery's.
    Read,
    /// It names none (the lean fan-out): the answer's columns are null, without the
    /// lookups' plan nodes, which are set up at every execution whether they run or not.
    None,
}

/// A leasing ingest statement ([`insert_and_claim_sql`]) from its `WITH` list `ctes`
/// (which defines `fan` and `leases`) and its `answer` (the event's row, or the
/// duplicate's).
fn leasing_statement(ctes: &str, answer: &str, transforms: Transforms) -> String {
    let (transform, event_headers) = match transforms {
        Transforms::Read => (
            "(SELECT tr.transform FROM subscriptions tr WHERE tr.id = f.transform_by)",
            "CASE WHEN f.transform_by IS NOT NULL THEN $5::jsonb::text END",
        ),
        Transforms::None => ("NULL::text", "NULL::text"),
    };
    format!(
        "{ctes}, answer AS (
            {answer}
        )
        SELECT a.id AS stored_id, a.duplicate AS stored_duplicate, a.deliveries AS stored_deliveries, c.*,
               cardinality(a.deliveries)::int8 AS candidates
        FROM answer a LEFT JOIN (
            SELECT f.id, f.event_id, f.endpoint_id, f.attempt_count AS attempt, f.attempts_base, f.claim_token,
                   l.url, l.secret, l.previous_secrets, $3::text AS event_type,
                   (SELECT s.name FROM sources s WHERE s.id = $1) AS source_name, $4::text AS content_type,
                   COALESCE(CASE WHEN octet_length($6::bytea) <= {inline} THEN $6::bytea END, ''::bytea) AS payload,
                   octet_length($6::bytea) AS payload_bytes, false AS ordered,
                   $8::text AS traceparent, $9::text AS tracestate,
                   {transform} AS transform, {event_headers} AS event_headers, NULL::int8 AS probe_token
            FROM fan f JOIN leases l ON l.endpoint_id = f.endpoint_id
            WHERE f.leased
        ) c ON true",
        inline = crate::deliver::bodies::INLINE_BODY_BYTES,
    )
}

/// `sql` (the ingest statement, [`insert_sql`] or [`insert_and_claim_sql`]) with `event`
/// and its search `terms` bound, in the statement's order.
fn bound_event<'q>(
    sql: &'q str,
    event: &'q NewEvent<'q>,
    terms: &'q [i64],
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    crate::db::query(sql)
        .bind(event.source_id)
        .bind(event.dedupe_key)
        .bind(event.event_type)
        .bind(event.content_type)
        .bind(Json(event.headers))
        .bind(event.payload)
        .bind(event.ordering_key)
        .bind(event.trace.map(|t| t.traceparent.as_str()))
        .bind(event.trace.and_then(|t| t.tracestate.as_deref()))
        .bind(terms)
}

/// What an ingest statement's rows say: the event's answer (its own row or its stored
/// twin's), that its source needs the full fan-out (a lean statement, which then stored
/// nothing), or nothing (a twin committed after the statement's snapshot).
enum Answer {
    Stored(Stored),
    NeedsFull,
    Unseen,
}

/// The [`Answer`] in an ingest statement's `rows`, whose answer columns are named
/// `{prefix}id`, `{prefix}duplicate` and `{prefix}deliveries`.
fn answer_of(rows: &[sqlx::postgres::PgRow], prefix: &str) -> Result<Answer, sqlx::Error> {
    use sqlx::Row as _;
    let Some(first) = rows.first() else { return Ok(Answer::Unseen) };
    let at = |name: &str| first.try_column(format!("{prefix}{name}").as_str()).map(sqlx::Column::ordinal);
    let (id, duplicate, deliveries) = (at("id")?, at("duplicate")?, at("deliveries")?);
    for row in rows {
        if let Some(event_id) = row.try_get::<Option<EventId>, _>(id)? {
            return Ok(Answer::Stored(Stored {
                event_id,
                duplicate: row.try_get(duplicate)?,
                deliveries: row.try_get(deliveries)?,
            }));
        }
    }
    Ok(Answer::NeedsFull)
}

/// Run one of a lone webhook's ingest `statements` (full, lean) with `run`: the lean one
/// first where [`lean::worth_trying`] says so, the full one when the lean one answers that
/// the source needs it (remembered: [`lean::needs_full`]). The answer and the rows it
/// came in (columns named as [`answer_of`] reads them with `prefix`); `None` when the
/// statement saw no twin it could answer with (a twin committed after its snapshot).
async fn lean_first<F, Fut>(
    source: SourceId,
    (full, lean_sql): (&'static str, &'static str),
    prefix: &str,
    mut run: F,
) -> Result<Option<(Stored, Vec<sqlx::postgres::PgRow>)>, sqlx::Error>
where
    F: FnMut(&'static str) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<sqlx::postgres::PgRow>, sqlx::Error>>,
{
    let mut lean = lean::worth_trying(source);
    loop {
        let rows = run(if lean { lean_sql } else { full }).await?;
        match answer_of(&rows, prefix)? {
            Answer::Stored(stored) => return Ok(Some((stored, rows))),
            // Only a lean statement answers so (the full one always stores or finds).
            Answer::NeedsFull if lean => {
                lean::needs_full(source);
                lean = false;
            }
            Answer::NeedsFull | Answer::Unseen => return Ok(None),
        }
    }
}

/// The twin an ingest statement did not see (committed after its snapshot), as a
/// duplicate's answer; `None` when there is none (it was deleted meanwhile).
async fn find_twin<'c>(db: impl PgExecutor<'c>, event: &NewEvent<'_>) -> Result<Option<Stored>, sqlx::Error> {
    let existing: Option<EventId> =
        crate::db::query_scalar("SELECT id FROM events WHERE source_id = $1 AND dedupe_key = $2")
            .bind(event.source_id)
            .bind(event.dedupe_key)
            .fetch_optional(db)
            .await?;
    Ok(existing.map(|event_id| Stored { event_id, duplicate: true, deliveries: Vec::new() }))
}

/// Store an event and one delivery per matching subscription's endpoint, atomically.
///
/// One statement, so one transaction: there is no state with the event but not its
/// fan-out. Dedupe is the `events_dedupe` constraint with `ON CONFLICT DO NOTHING`: a
/// concurrent twin waits on the constraint for our commit and then finds our row, so any
/// number of racing copies store exactly one event.
pub async fn insert_with_fanout<'c, E>(db: E, event: &NewEvent<'_>) -> Result<Stored, sqlx::Error>
where
    E: PgExecutor<'c> + Copy,
{
    let terms = crate::search::terms(event.dedupe_key, event.headers, event.payload);
    // Bounded: the only way round again is a twin that committed and was then deleted
    // (retention) between our two statements.
    for _ in 0..3 {
        let statements = (insert_sql(), lean::insert_sql());
        let run = |sql| bound_event(sql, event, &terms).fetch_all(db);
        if let Some((stored, _)) = lean_first(event.source_id, statements, "", run).await? {
            return Ok(stored);
        }
        if let Some(twin) = find_twin(db, event).await? {
            return Ok(twin);
        }
    }
    Err(sqlx::Error::Protocol("event neither inserted nor found after 3 tries (concurrent deletion)".into()))
}

/// How [`insert_and_claim`] leases: as [`crate::queue::claim_fresh`] would.
#[derive(Debug, Clone, Copy)]
pub struct ClaimTerms {
    /// Most deliveries to claim (the worker slots the caller holds for them).
    pub limit: i64,
    /// The lease.
    pub lease: std::time::Duration,
    /// An endpoint's in-flight limit when it sets none.
    pub default_max_in_flight: i32,
}

/// [`insert_with_fanout`], with the deliveries it creates leased in the same statement
/// (one round trip, one commit, one row version each): every unordered delivery whose
/// endpoint has room, within the endpoint locks, in-flight limit, rate tokens and fencing
/// token of any claim ([`insert_and_claim_sql`]). The stored event's `deliveries` still
/// lists every delivery it created; the claim says which were leased.
pub async fn insert_and_claim(
    pool: &crate::db::Pool,
    event: &NewEvent<'_>,
    terms: ClaimTerms,
) -> Result<(Stored, crate::queue::FreshClaim), sqlx::Error> {
    let search = crate::search::terms(event.dedupe_key, event.headers, event.payload);
    // Bounded as in `insert_with_fanout`.
    for _ in 0..3 {
        let statements = (insert_and_claim_sql(), lean::insert_and_claim_sql());
        let run = |sql| {
            bound_event(sql, event, &search)
                .bind(terms.limit)
                .bind(terms.lease.as_secs_f64())
                .bind(terms.default_max_in_flight)
                .fetch_all(pool)
        };
        if let Some((stored, rows)) = lean_first(event.source_id, statements, "stored_", run).await? {
            return Ok((stored, crate::queue::fresh_claim_of(&rows)?));
        }
        if let Some(twin) = find_twin(pool, event).await? {
            return Ok((twin, crate::queue::FreshClaim { claimed: Vec::new(), took_all: true }));
        }
    }
    Err(sqlx::Error::Protocol("event neither inserted nor found after 3 tries (concurrent deletion)".into()))
}

/// Store an event with its fan-out inside the caller's transaction `conn`, once: `None`
/// when its key was stored by a transaction this statement could not see (the caller's
/// transaction then holds nothing of it). For events the gateway publishes about itself
/// (`crate::operational`), whose keys no producer races for.
pub async fn insert_in(conn: &mut sqlx::PgConnection, event: &NewEvent<'_>) -> Result<Option<Stored>, sqlx::Error> {
    let terms = crate::search::terms(event.dedupe_key, event.headers, event.payload);
    let rows = bound_event(insert_sql(), event, &terms).fetch_all(conn).await?;
    match answer_of(&rows, "")? {
        Answer::Stored(stored) => Ok(Some(stored)),
        Answer::NeedsFull | Answer::Unseen => Ok(None),
    }
}

/// The arrival time of the oldest event received before `before` that retention could
/// delete (no delivery of it pending); `None` when there is none.
pub async fn oldest_expired(
    db: impl PgExecutor<'_>,
    before: DateTime<Utc>,
) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    crate::db::query_scalar(
        "SELECT e.received_at FROM events e
         WHERE e.received_at < $1
           AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.event_id = e.id AND d.status = 'pending')
         ORDER BY e.received_at LIMIT 1",
    )
    .bind(before)
    .fetch_optional(db)
    .await
}

/// An event to store, owned: it travels to the batch writer.
#[derive(Debug, Clone)]
pub struct OwnedEvent {
    /// Source it arrived on.
    pub source_id: SourceId,
    /// What duplicates are recognised by within the source (see [`NewEvent::dedupe_key`]).
    pub dedupe_key: String,
    /// Matched against subscriptions' patterns.
    pub event_type: String,
    /// The request's Content-Type, replayed on delivery; `None` when it had none.
    pub content_type: Option<String>,
    /// Headers (signatures redacted).
    pub headers: serde_json::Value,
    /// The body exactly as received; delivered as is.
    pub payload: bytes::Bytes,
    /// The ordering key, when the source defines one and the request carried it.
    pub ordering_key: Option<String>,
    /// The trace context its deliveries link to, when there is one.
    pub trace: Option<crate::telemetry::EventTrace>,
}

impl OwnedEvent {
    /// Borrowed view for [`insert_with_fanout`].
    pub fn as_new(&self) -> NewEvent<'_> {
        NewEvent {
            source_id: self.source_id,
            dedupe_key: &self.dedupe_key,
            event_type: &self.event_type,
            content_type: self.content_type.as_deref(),
            headers: &self.headers,
            payload: &self.payload,
            ordering_key: self.ordering_key.as_deref(),
            trace: self.trace.as_ref(),
        }
    }
}

/// [`invariants::EACH_EVENT_ANSWERED_ONCE`] for the rows of the batch statement
/// (`ord`, event id, duplicate, deliveries) of a batch of `events` distinct events: each
/// `ord` is one of the batch's and comes once, and new events' ids are distinct.
fn answers_are_one_per_event(
    rows: &[(i32, Option<EventId>, bool, Vec<DeliveryId>)],
    events: usize,
) -> Result<(), Broken> {
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
    &INSERT_BATCH_SQL
}

/// [`insert_batch_sql`]'s text, built once: every batch of the group commit runs it.
static INSERT_BATCH_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH input AS (
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
            FROM input ORDER BY ord
            ON CONFLICT ON CONSTRAINT events_dedupe DO NOTHING
            RETURNING id, source_id, dedupe_key, event_type, ordering_key
        ), ev AS (
            SELECT ins.*, i.arrival AS ord
            FROM ins JOIN input i ON i.source_id = ins.source_id AND i.dedupe_key = ins.dedupe_key
        ), bodies AS (
            SELECT ins.id, i.headers::jsonb AS headers, i.payload
            FROM ins JOIN input i ON i.source_id = ins.source_id AND i.dedupe_key = ins.dedupe_key
        ), {FANOUT}, fanned AS (
            SELECT event_id, array_agg(id) AS ids FROM fan GROUP BY event_id
        )
        SELECT i.ord, COALESCE(ev.id, old.id), ev.id IS NULL, COALESCE(fanned.ids, '{{}}'::uuid[])
        FROM input i
        LEFT JOIN ev ON ev.source_id = i.source_id AND ev.dedupe_key = i.dedupe_key
        LEFT JOIN fanned ON fanned.event_id = ev.id
        LEFT JOIN LATERAL (
            SELECT o.id FROM events o
            WHERE ev.id IS NULL AND o.source_id = i.source_id AND o.dedupe_key = i.dedupe_key
            LIMIT 1
        ) old ON true"
    )
});

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
    let BatchPlan { unique, representative } = plan_batch(events);
    let column = |f: &dyn Fn(&OwnedEvent) -> String| unique.iter().map(|&i| f(&events[i])).collect::<Vec<String>>();
    let source_ids: Vec<SourceId> = unique.iter().map(|&i| events[i].source_id).collect();
    let keys = column(&|e| e.dedupe_key.clone());
    let types = column(&|e| e.event_type.clone());
    let content_types: Vec<Option<String>> = unique.iter().map(|&i| events[i].content_type.clone()).collect();
    let headers = column(&|e| e.headers.to_string());
    let payloads: Vec<&[u8]> = unique.iter().map(|&i| &events[i].payload[..]).collect();
    let ords: Vec<i32> = (0..unique.len() as i32).collect();
    let ordering_keys: Vec<Option<&str>> = unique.iter().map(|&i| events[i].ordering_key.as_deref()).collect();
    // The order events arrived in (the batch's input order), which orders the deliveries
    // of one line; `ord` is the (source, key) order the rows are inserted in.
    let arrivals: Vec<i32> = unique.iter().map(|&i| i32::try_from(i).unwrap_or(i32::MAX)).collect();
    let traceparents: Vec<Option<&str>> =
        unique.iter().map(|&i| events[i].trace.as_ref().map(|t| t.traceparent.as_str())).collect();
    let tracestates: Vec<Option<&str>> =
        unique.iter().map(|&i| events[i].trace.as_ref().and_then(|t| t.tracestate.as_deref())).collect();
    // Each event's search terms, end to end in one array: event n's are
    // `terms[term_ends[n-1] + 1 : term_ends[n]]` (1-based, inclusive), since a
    // parameter cannot be an array of arrays of different lengths.
    let mut terms: Vec<i64> = Vec::new();
    let mut term_ends: Vec<i32> = Vec::with_capacity(unique.len());
    for &i in &unique {
        let e = &events[i];
        terms.extend(crate::search::terms(&e.dedupe_key, &e.headers, &e.payload));
        term_ends.push(i32::try_from(terms.len()).unwrap_or(i32::MAX));
    }

    let rows: Vec<(i32, Option<EventId>, bool, Vec<DeliveryId>)> = crate::db::query_as(insert_batch_sql())
        .bind(&source_ids)
        .bind(&keys)
        .bind(&types)
        .bind(&content_types)
        .bind(&headers)
        .bind(&payloads)
        .bind(&ords)
        .bind(&ordering_keys)
        .bind(&arrivals)
        .bind(&traceparents)
        .bind(&tracestates)
        .bind(crate::db::Int8Array(&terms))
        .bind(&term_ends)
        .fetch_all(pool)
        .await?;

    answers_are_one_per_event(&rows, unique.len())?;
    let mut stored: Vec<Option<Stored>> = vec![None; events.len()];
    for (ord, id, duplicate, deliveries) in rows {
        let Some(&i) = unique.get(ord as usize) else { continue };
        if let Some(event_id) = id {
            stored[i] = Some(Stored { event_id, duplicate, deliveries });
        }
    }
    // A twin committed after our statement's snapshot: invisible to the statement's
    // duplicate lookup. Rare; settle each one on its own.
    for &i in &unique {
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

/// Store a synthetic test event in the `_test` source with one delivery, to `endpoint_id`
/// only. Its dedupe key is fresh every time, so two test sends are two deliveries and a
/// test is never deduplicated against a real event.
pub async fn insert_test(
    db: impl PgExecutor<'_>,
    endpoint_id: EndpointId,
    payload: &[u8],
) -> Result<(EventId, DeliveryId), sqlx::Error> {
    crate::db::query_as(
        "WITH ev AS (
             INSERT INTO events (source_id, dedupe_key, event_type, content_type, headers, payload)
             SELECT id, 'test:' || gen_random_uuid(), 'webhook.test', 'application/json', '{}'::jsonb, $2
             FROM sources WHERE name = '_test'
             RETURNING id
         )
         INSERT INTO deliveries (event_id, endpoint_id) SELECT ev.id, $1 FROM ev RETURNING event_id, id",
    )
    .bind(endpoint_id)
    .bind(payload)
    .fetch_one(db)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(source: SourceId, key: &str) -> OwnedEvent {
        OwnedEvent {
            source_id: source,
            dedupe_key: key.to_owned(),
            event_type: "t".to_owned(),
            content_type: None,
            headers: serde_json::json!({}),
            payload: bytes::Bytes::new(),
            ordering_key: None,
            trace: None,
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
}
