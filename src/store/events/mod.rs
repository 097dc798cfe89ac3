//! The `events` table, including the ingest statement that stores an event and its
//! fan-out together. Reading events back (by id, listed, searched): the `read` module.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{PgExecutor, Postgres};

use crate::ids::{DeliveryId, EndpointId, EventId, SourceId};
use crate::queue::fanout::{FANOUT, FANOUT_LEASED};

mod batch;
mod columns;
pub mod lean;
mod read;
pub use batch::{
    insert_batch_and_claim, insert_batch_and_claim_sql, insert_batch_sql, insert_batch_with_fanout,
    lean_insert_batch_and_claim_sql, lean_insert_batch_sql,
};
pub use read::*;

/// An event about to be stored.
#[derive(Debug)]
pub struct NewEvent<'a> {
    /// Source it arrived on.
    pub source_id: SourceId,
    /// That source's name, as the webhook arrived under it (its deliveries'
    /// `webhook-source`).
    pub source_name: &'a str,
    /// What of it is indexed for searches (`--content-search`).
    pub indexing: crate::search::Indexing,
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
    /// Its search terms when they were computed ahead ([`OwnedEvent::terms`]); `None`:
    /// computed by the statement that stores it.
    pub terms: Option<&'a [i64]>,
}

impl<'a> NewEvent<'a> {
    /// What `events.search` holds for it (`crate::search::Indexing::terms`): the terms
    /// computed ahead, or computed now.
    pub fn search_terms(&self) -> std::borrow::Cow<'a, [i64]> {
        match self.terms {
            Some(terms) => std::borrow::Cow::Borrowed(terms),
            None => std::borrow::Cow::Owned(self.indexing.terms(self.dedupe_key, self.headers, self.payload)),
        }
    }

    /// What a lease of one of its deliveries carries of it (`crate::queue::EventColumns`),
    /// its body `shared` when the caller holds it as `Bytes`.
    pub(crate) fn lease_columns(
        &self,
        shared: Option<&bytes::Bytes>,
    ) -> Result<crate::queue::EventColumns<'a>, sqlx::Error> {
        let (payload, payload_bytes) = crate::queue::lease_body(self.payload, shared)?;
        Ok(crate::queue::EventColumns {
            event_type: self.event_type,
            source_name: self.source_name,
            content_type: self.content_type,
            payload,
            payload_bytes,
            traceparent: self.trace.map(|t| t.traceparent.as_str()),
            tracestate: self.trace.and_then(|t| t.tracestate.as_deref()),
        })
    }
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

/// How the ingest statements evaluate a subscription's filter: `silent` hides missing keys
/// and type errors, but not every error (a timestamp with a zone compared to one without,
/// a `**` walk that exhausts the stack).
const FILTER_MATCH: &str = "jsonb_path_match(d.doc, s.filter, silent => true) IS TRUE";

/// [`insert_sql`] with each filter evaluated by `wg_filter_match` (migration 0038), which
/// reads any error of the filter as no match: what a webhook whose statement failed that
/// way is stored with. Not the usual statement: its exception block costs a
/// subtransaction for each filter evaluated.
static INSERT_SQL_FILTERS_CAUGHT: LazyLock<String> =
    LazyLock::new(|| INSERT_SQL.replace(FILTER_MATCH, "wg_filter_match(d.doc, s.filter)"));

/// Whether `err` may come from evaluating a filter: a data exception (class 22), a
/// feature not supported (0A: a timestamp with a zone compared to one without) or a
/// program limit (54: the stack). Another error of those classes fails again the same way
/// when tried with the filters caught, and is answered then.
fn a_filter_may_have_failed(err: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = err else { return false };
    db.code().is_some_and(|code| ["22", "0A", "54"].iter().any(|class| code.starts_with(class)))
}

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

/// The answer's row for a new event: its id and the deliveries `fan` created (a literal,
/// so that [`LEASING_ANSWER`] and [`INSERT_ANSWER`] are built from one text).
macro_rules! new_event_answer {
    () => {
        "SELECT id, false AS duplicate, ARRAY(SELECT id FROM fan) AS deliveries FROM ev"
    };
}

/// The leasing statements' answer: the new event with its deliveries, and no row for a
/// duplicate. [`INSERT_ANSWER`]'s lookup of the stored twin is a plan node set up at every
/// execution (about 30,000 instructions, bench row 18) for the few webhooks that are
/// copies; on this path a copy finds its twin with a second statement instead
/// ([`find_twin`], as for a twin committed after the statement's snapshot).
const LEASING_ANSWER: &str = new_event_answer!();

/// The ingest statement's answer: the new event with its deliveries ([`LEASING_ANSWER`]'s
/// row), or the stored twin.
///
/// The duplicate branch usually answers in the same round trip. It reads the statement's
/// snapshot, so a twin committed after our statement began is invisible there (ON
/// CONFLICT still saw it): then zero rows come back and we look again.
const INSERT_ANSWER: &str = concat!(
    new_event_answer!(),
    "
        UNION ALL
        SELECT id, true, '{}'::uuid[] FROM events
        WHERE source_id = $1 AND dedupe_key = $2 AND NOT EXISTS (SELECT 1 FROM ev)"
);

/// The ingest statement that also leases the deliveries it creates ([`insert_and_claim`];
/// `$11` most leases, `$12` lease in seconds, `$13` default max in flight): the answer's
/// columns renamed `stored_*`, then the lease's columns (read by
/// `crate::queue::fresh_lease_of`), one row per delivery leased (or one whose lease
/// columns are null when none was), and `candidates`: the deliveries it created.
///
/// The deliveries are inserted leased ([`FANOUT_LEASED`]: room granted by
/// `wg_lease_room_v5`, migrations 0028, 0031, 0032 and 0033, with the endpoint locks,
/// in-flight count, rate tokens and fencing token of any claim; an endpoint whose row
/// another transaction holds is skipped, not waited for). The statement returns what only
/// the database knows (the delivery's and the granted endpoint's columns); the event's
/// own columns are the caller's (`crate::queue::EventColumns`): echoed back, with a
/// lookup of the source's name, they were about 70,000 of the statement's 1,320,000
/// instructions (bench row 18) and the body crossed the socket twice.
pub fn insert_and_claim_sql() -> &'static str {
    static SQL: LazyLock<String> =
        LazyLock::new(|| leasing_statement(&insert_ctes(FANOUT_LEASED), LEASING_ANSWER, Transforms::Read));
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
///
/// The leased rows are read through a lateral subquery kept from being pulled up
/// (`OFFSET 0`): joined plainly, PostgreSQL hashed or materialized them for the answer's
/// row at every execution. With the room function's estimate of one row (migration
/// 0030), the statement builds no hash table: about 80,000 of a lone webhook's 1,400,000
/// instructions less (bench row 18;
/// `plans::writes::a_lone_webhook_s_leasing_statement_builds_no_hash_table`).
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
        FROM answer a LEFT JOIN LATERAL (
            SELECT f.id, f.event_id, f.endpoint_id, f.attempt_count AS attempt, f.attempts_base, f.claim_token,
                   l.url, l.secret, l.previous_secrets, {transform} AS transform, {event_headers} AS event_headers
            FROM fan f JOIN leases l ON l.endpoint_id = f.endpoint_id
            WHERE f.leased AND f.event_id = a.id
            OFFSET 0
        ) c ON true",
    )
}

/// The parameters [`bound_event`] binds.
const EVENT_PARAMS: usize = 10;

/// About the bytes `event` and its `terms` take bound by [`bound_event`]: each
/// parameter's length, then its bytes; jsonb a version byte before its text; the terms
/// as `crate::db::Int8Array` writes them.
fn event_encoded_bytes(event: &NewEvent<'_>, terms: &[i64]) -> usize {
    let optional = |s: Option<&str>| s.map_or(0, str::len);
    EVENT_PARAMS * 4
        + 16
        + event.dedupe_key.len()
        + event.event_type.len()
        + optional(event.content_type)
        + 1
        + columns::json_text_size(event.headers)
        + event.payload.len()
        + optional(event.ordering_key)
        + event.trace.map_or(0, |t| t.traceparent.len() + optional(t.tracestate.as_deref()))
        + sqlx::Encode::<Postgres>::size_hint(&crate::db::Int8Array(terms))
}

/// `sql` (the ingest statement, [`insert_sql`] or [`insert_and_claim_sql`]) with `event`
/// and its search `terms` bound, in the statement's order.
fn bound_event<'q>(
    sql: &'q str,
    event: &'q NewEvent<'q>,
    terms: &'q [i64],
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    crate::db::query_sized(sql, EVENT_PARAMS, event_encoded_bytes(event, terms))
        .bind(event.source_id)
        .bind(event.dedupe_key)
        .bind(event.event_type)
        .bind(event.content_type)
        .bind(Json(event.headers))
        .bind(event.payload)
        .bind(event.ordering_key)
        .bind(event.trace.map(|t| t.traceparent.as_str()))
        .bind(event.trace.and_then(|t| t.tracestate.as_deref()))
        .bind(crate::db::Int8Array(terms))
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

/// Run one of a lone webhook's ingest `statements` (full, lean) with `run`, lean first
/// ([`lean::lean_first`]). The answer and the rows it came in (columns named as
/// [`answer_of`] reads them with `prefix`); `None` when the statement saw no twin it could
/// answer with (a twin committed after its snapshot, or any twin for the leasing
/// statements, which do not look: [`LEASING_ANSWER`]).
async fn lean_first<F, Fut>(
    source: SourceId,
    statements: (&'static str, &'static str),
    prefix: &str,
    run: F,
) -> Result<Option<(Stored, Vec<sqlx::postgres::PgRow>)>, sqlx::Error>
where
    F: FnMut(&'static str) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<sqlx::postgres::PgRow>, sqlx::Error>>,
{
    // Only a lean statement answers so (the full one always stores or finds).
    let said_needs_full = |rows: &[sqlx::postgres::PgRow]| Ok(matches!(answer_of(rows, prefix)?, Answer::NeedsFull));
    let rows = lean::lean_first(std::iter::once(source), statements, said_needs_full, run).await?;
    match answer_of(&rows, prefix)? {
        Answer::Stored(stored) => Ok(Some((stored, rows))),
        Answer::NeedsFull | Answer::Unseen => Ok(None),
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
    let terms = event.search_terms();
    // Bounded: the only way round again is a twin that committed and was then deleted
    // (retention) between our two statements.
    for _ in 0..3 {
        let statements = (insert_sql(), lean::insert_sql());
        let run = |sql| bound_event(sql, event, &terms).fetch_all(db);
        let stored = match lean_first(event.source_id, statements, "", run).await {
            Err(e) if a_filter_may_have_failed(&e) => {
                tracing::warn!(
                    error = %e,
                    source_id = %event.source_id,
                    "the ingest statement failed, perhaps in a subscription's filter: stored again with each filter \
                     evaluated on its own, one that fails reading as no match"
                );
                let rows = bound_event(&INSERT_SQL_FILTERS_CAUGHT, event, &terms).fetch_all(db).await?;
                match answer_of(&rows, "")? {
                    Answer::Stored(stored) => Some(stored),
                    Answer::NeedsFull | Answer::Unseen => None,
                }
            }
            other => other?.map(|(stored, _)| stored),
        };
        if let Some(stored) = stored {
            return Ok(stored);
        }
        if let Some(twin) = find_twin(db, event).await? {
            return Ok(twin);
        }
    }
    Err(sqlx::Error::Protocol("event neither inserted nor found after 3 tries (concurrent deletion)".into()))
}

/// How [`insert_and_claim`] leases: as [`crate::queue::claim_fresh`] would (the terms
/// every leasing statement takes, `crate::queue::lines::promote_leasing`'s too).
pub use crate::queue::ClaimTerms;

/// [`insert_with_fanout`], with the deliveries it creates leased in the same statement
/// (one round trip, one commit, one row version each): every unordered delivery whose
/// endpoint has room, within the endpoint locks, in-flight limit, rate tokens and fencing
/// token of any claim ([`insert_and_claim_sql`]). The stored event's `deliveries` still
/// lists every delivery it created; the claim says which were leased. A copy of a stored
/// webhook is answered by a second statement that finds its twin.
pub async fn insert_and_claim(
    pool: &crate::db::Pool,
    event: &NewEvent<'_>,
    terms: ClaimTerms,
) -> Result<(Stored, crate::queue::FreshClaim), sqlx::Error> {
    let search = event.search_terms();
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
            let columns = event.lease_columns(None)?;
            return Ok((stored, crate::queue::fresh_lease_of(&rows, |_| Ok(&columns))?));
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
    let terms = event.search_terms();
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
    /// That source's name (see [`NewEvent::source_name`]).
    pub source_name: String,
    /// What of it is indexed for searches (see [`NewEvent::indexing`]).
    pub indexing: crate::search::Indexing,
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
    /// Its search terms, when computed ahead: ingest computes them in the request's own
    /// task ([`OwnedEvent::with_terms`]), so that a batch's writer, which stores one
    /// batch at a time while the next one waits, does not compute them for every event
    /// of its batch between two commits. `None`: computed where it is stored.
    pub terms: Option<Vec<i64>>,
}

impl OwnedEvent {
    /// Borrowed view for [`insert_with_fanout`].
    pub fn as_new(&self) -> NewEvent<'_> {
        NewEvent {
            source_id: self.source_id,
            source_name: &self.source_name,
            indexing: self.indexing,
            dedupe_key: &self.dedupe_key,
            event_type: &self.event_type,
            content_type: self.content_type.as_deref(),
            headers: &self.headers,
            payload: &self.payload,
            ordering_key: self.ordering_key.as_deref(),
            trace: self.trace.as_ref(),
            terms: self.terms.as_deref(),
        }
    }

    /// The event with its search terms computed now (see [`OwnedEvent::terms`]).
    pub fn with_terms(mut self) -> Self {
        if self.terms.is_none() {
            let terms = self.as_new().search_terms().into_owned();
            self.terms = Some(terms);
        }
        self
    }
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

    /// The statement a failed filter falls back to evaluates every filter through the
    /// wrapper, and only that differs from the usual one.
    #[test]
    fn the_fallback_statement_evaluates_every_filter_through_the_wrapper() {
        assert!(INSERT_SQL.contains(FILTER_MATCH));
        assert!(!INSERT_SQL_FILTERS_CAUGHT.contains("jsonb_path_match"), "{}", *INSERT_SQL_FILTERS_CAUGHT);
        assert_eq!(INSERT_SQL_FILTERS_CAUGHT.replace("wg_filter_match(d.doc, s.filter)", FILTER_MATCH), *INSERT_SQL);
    }
}
