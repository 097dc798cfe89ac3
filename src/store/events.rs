//! The `events` table, including the ingest statement that stores an event and its
//! fan-out together.

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{PgExecutor, Postgres, QueryBuilder};

use crate::ids::{DeliveryId, EndpointId, EventId, SourceId};

/// An event about to be stored.
#[derive(Debug)]
pub struct NewEvent<'a> {
    /// Source it arrived on.
    pub source_id: SourceId,
    /// Provider delivery id, caller's event id, or body hash.
    pub dedupe_key: &'a str,
    /// Event type used for subscription matching.
    pub event_type: &'a str,
    /// Content type of the body, replayed on delivery.
    pub content_type: Option<&'a str>,
    /// Request headers (signatures already redacted).
    pub headers: &'a serde_json::Value,
    /// Raw body.
    pub payload: &'a [u8],
}

/// The result of storing an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    /// The event's id (the original one for a duplicate).
    pub event_id: EventId,
    /// True when an event with this dedupe key already existed: nothing new was stored.
    pub duplicate: bool,
    /// Deliveries created by this call (0 for a duplicate).
    pub deliveries: i64,
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
    // The duplicate branch usually answers in the same round trip. It reads the
    // statement's snapshot, so a twin committed after our statement began is invisible
    // there (ON CONFLICT still saw it): then zero rows come back and we look again.
    const INSERT: &str = "
        WITH ev AS (
            INSERT INTO events (source_id, dedupe_key, event_type, content_type, headers, payload)
            VALUES ($1, $2, $3, $4, $5, $6)
            ON CONFLICT ON CONSTRAINT events_dedupe DO NOTHING
            RETURNING id, source_id, event_type
        ), fan AS (
            INSERT INTO deliveries (event_id, endpoint_id)
            SELECT DISTINCT ev.id, s.endpoint_id
            FROM ev JOIN subscriptions s ON s.source_id IS NULL OR s.source_id = ev.source_id
            WHERE s.event_type_likes IS NULL
               OR EXISTS (SELECT 1 FROM unnest(s.event_type_likes) AS p(pattern) WHERE ev.event_type LIKE p.pattern)
            ON CONFLICT ON CONSTRAINT deliveries_once DO NOTHING
            RETURNING 1
        )
        SELECT id, false AS duplicate, (SELECT count(*) FROM fan) AS deliveries FROM ev
        UNION ALL
        SELECT id, true, 0 FROM events
        WHERE source_id = $1 AND dedupe_key = $2 AND NOT EXISTS (SELECT 1 FROM ev)";
    const FIND: &str = "SELECT id FROM events WHERE source_id = $1 AND dedupe_key = $2";

    // Bounded: the only way round again is a twin that committed and was then deleted
    // (retention) between our two statements.
    for _ in 0..3 {
        let row: Option<(EventId, bool, i64)> = sqlx::query_as(INSERT)
            .bind(event.source_id)
            .bind(event.dedupe_key)
            .bind(event.event_type)
            .bind(event.content_type)
            .bind(Json(event.headers))
            .bind(event.payload)
            .fetch_optional(db)
            .await?;
        if let Some((event_id, duplicate, deliveries)) = row {
            return Ok(Stored { event_id, duplicate, deliveries });
        }
        let existing: Option<EventId> =
            sqlx::query_scalar(FIND).bind(event.source_id).bind(event.dedupe_key).fetch_optional(db).await?;
        if let Some(event_id) = existing {
            return Ok(Stored { event_id, duplicate: true, deliveries: 0 });
        }
    }
    Err(sqlx::Error::Protocol("event neither inserted nor found after 3 tries (concurrent deletion)".into()))
}

/// A stored event.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Event {
    /// Id.
    pub id: EventId,
    /// Source id.
    pub source_id: SourceId,
    /// Source name.
    pub source_name: String,
    /// Dedupe key.
    pub dedupe_key: String,
    /// Event type.
    pub event_type: String,
    /// Content type of the body.
    pub content_type: Option<String>,
    /// Headers (signatures redacted).
    pub headers: Json<serde_json::Value>,
    /// Raw body.
    pub payload: Vec<u8>,
    /// Arrival time.
    pub received_at: DateTime<Utc>,
}

/// An event by id, with its source's name.
pub async fn by_id(db: impl PgExecutor<'_>, id: EventId) -> Result<Option<Event>, sqlx::Error> {
    sqlx::query_as(
        "SELECT e.id, e.source_id, s.name AS source_name, e.dedupe_key, e.event_type, e.content_type,
                e.headers, e.payload, e.received_at
         FROM events e JOIN sources s ON s.id = e.source_id WHERE e.id = $1",
    )
    .bind(id)
    .fetch_optional(db)
    .await
}

/// An event without its body, for listings.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, utoipa::ToSchema)]
pub struct EventSummary {
    /// Id.
    pub id: EventId,
    /// Source name.
    pub source: String,
    /// Event type.
    pub event_type: String,
    /// Dedupe key.
    pub dedupe_key: String,
    /// Arrival time.
    pub received_at: DateTime<Utc>,
    /// Body size in bytes.
    pub payload_bytes: i32,
}

/// Filters for [`list`]; all optional.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Source id.
    pub source_id: Option<SourceId>,
    /// Exact event type.
    pub event_type: Option<String>,
    /// Received at or after.
    pub since: Option<DateTime<Utc>>,
    /// Received before.
    pub until: Option<DateTime<Utc>>,
    /// Keyset cursor: ids after this one (ids are time-ordered).
    pub after: Option<EventId>,
}

/// Events matching `filter`, oldest first, at most `limit`.
pub async fn list(db: impl PgExecutor<'_>, filter: &Filter, limit: i64) -> Result<Vec<EventSummary>, sqlx::Error> {
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new(
        "SELECT e.id, s.name AS source, e.event_type, e.dedupe_key, e.received_at, length(e.payload) AS payload_bytes
         FROM events e JOIN sources s ON s.id = e.source_id WHERE true",
    );
    if let Some(id) = filter.source_id {
        q.push(" AND e.source_id = ").push_bind(id);
    }
    if let Some(t) = &filter.event_type {
        q.push(" AND e.event_type = ").push_bind(t.clone());
    }
    if let Some(t) = filter.since {
        q.push(" AND e.received_at >= ").push_bind(t);
    }
    if let Some(t) = filter.until {
        q.push(" AND e.received_at < ").push_bind(t);
    }
    if let Some(after) = filter.after {
        q.push(" AND e.id > ").push_bind(after);
    }
    q.push(" ORDER BY e.id LIMIT ").push_bind(limit);
    q.build_query_as().fetch_all(db).await
}

/// Store a synthetic test event in the `_test` source with one delivery, to `endpoint_id`
/// only. Its dedupe key is fresh every time, so two test sends are two deliveries and a
/// test is never deduplicated against a real event.
pub async fn insert_test(
    db: impl PgExecutor<'_>,
    endpoint_id: EndpointId,
    payload: &[u8],
) -> Result<(EventId, DeliveryId), sqlx::Error> {
    sqlx::query_as(
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
