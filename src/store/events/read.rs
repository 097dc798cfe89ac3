//! Reading `events` back: one event, its body, the filtered and searched list the API
//! and the console show.

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{PgExecutor, Postgres, QueryBuilder};

use crate::ids::{EventId, SourceId};

/// A stored event.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Event {
    /// Primary key, a UUIDv7: ids sort by arrival.
    pub id: EventId,
    /// The source it arrived on.
    pub source_id: SourceId,
    /// That source's name (joined: the API shows names, not ids).
    pub source_name: String,
    /// What duplicates are recognised by within the source (see [`super::NewEvent::dedupe_key`]).
    pub dedupe_key: String,
    /// Matched against subscriptions' patterns.
    pub event_type: String,
    /// The request's Content-Type, replayed on delivery; `None` when it had none.
    pub content_type: Option<String>,
    /// Headers (signatures redacted).
    pub headers: Json<serde_json::Value>,
    /// The body exactly as received; delivered as is.
    pub payload: Vec<u8>,
    /// When it was stored.
    pub received_at: DateTime<Utc>,
}

/// An event by id, with its source's name.
pub async fn by_id(db: impl PgExecutor<'_>, id: EventId) -> Result<Option<Event>, sqlx::Error> {
    crate::db::query_as(
        "SELECT e.id, e.source_id, s.name AS source_name, e.dedupe_key, e.event_type, e.content_type,
                e.headers, e.payload, e.received_at
         FROM events e JOIN sources s ON s.id = e.source_id WHERE e.id = $1",
    )
    .bind(id)
    .fetch_optional(db)
    .await
}

/// The body of the event `id` (`None`: there is no such event). A delivery's worker reads
/// a large body this way, once it has room for it (`crate::deliver::bodies`).
pub async fn payload(db: impl PgExecutor<'_>, id: EventId) -> Result<Option<Vec<u8>>, sqlx::Error> {
    crate::db::query_scalar("SELECT payload FROM events WHERE id = $1").bind(id).fetch_optional(db).await
}

/// An event without its body, for listings.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, utoipa::ToSchema)]
pub struct EventSummary {
    /// A UUIDv7: events list in id order, which is arrival order.
    pub id: EventId,
    /// Name of the source it arrived on.
    pub source: String,
    /// Matched against subscriptions' patterns.
    pub event_type: String,
    /// What duplicates are recognised by within the source (a delivery id, the caller's
    /// event id, or `sha256:<hex of the body>`).
    pub dedupe_key: String,
    /// When it was stored.
    pub received_at: DateTime<Utc>,
    /// Body size in bytes.
    pub payload_bytes: i32,
}

/// Filters for [`list`]; all optional.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only events of this source.
    pub source_id: Option<SourceId>,
    /// Only events of this type, or matching this pattern when it has a `*` (as a
    /// subscription's `event_types`).
    pub event_type: Option<String>,
    /// Received at or after.
    pub since: Option<DateTime<Utc>>,
    /// Received before.
    pub until: Option<DateTime<Utc>>,
    /// Only the event with exactly this dedupe key (with `source_id`: one index probe).
    pub dedupe_key: Option<String>,
    /// Content conditions (`crate::search`): for each, the term hashes of which the
    /// event must hold at least one.
    pub content: Vec<Vec<i64>>,
    /// Keyset cursor: ids after this one (ids are time-ordered), or before it with
    /// `newest_first`.
    pub after: Option<EventId>,
    /// Newest first (the console) instead of oldest first (the API).
    pub newest_first: bool,
}

/// An [`EventSummary`] of each event `e` (with its source `s`), before the conditions.
const SUMMARIES: &str = "SELECT e.id, s.name AS source, e.event_type, e.dedupe_key, e.received_at, \
                         length(e.payload) AS payload_bytes FROM events e JOIN sources s ON s.id = e.source_id";

/// Matches of the content conditions counted before a search (see [`list`]).
const DENSE_MATCHES: i64 = 2000;

/// Events matching `filter`, oldest first (or newest first), at most `limit`.
///
/// A content search ([`Filter::content`]) picks its plan itself. PostgreSQL cannot
/// estimate how many events hold one hash (it guesses 0.5 %), so with a page in id order
/// to fill it walks the id index and tests every event of the window: fast for a value
/// most events hold, a scan of the window for the one event of an order. So the matches
/// are counted first, up to `DENSE_MATCHES` (a GIN lookup for a rare value, a scan that
/// stops at the count for a common one); when there are fewer, the page is read through
/// the index and sorted instead (`enable_indexscan` off for that one statement's
/// transaction), and when there are more, through the id order.
///
/// Both statements are planned at every call, for the values they carry
/// ([`crate::db::Planning::EachCall`], set in the `BEGIN`'s round trip). A connection
/// that had run them five times could otherwise keep a generic plan, which assumes a
/// hash is rare: its count of a value every event holds then built a bitmap of every
/// match before its `LIMIT` (71 ms at 1,000,000 events in the bench, against 1.7 ms
/// planned for the value, which stops after 2,000 rows).
pub async fn list(pool: &crate::db::Pool, filter: &Filter, limit: i64) -> Result<Vec<EventSummary>, sqlx::Error> {
    let mut tx = pool.begin_planned(crate::db::Planning::EachCall).await?;
    if !filter.content.is_empty() {
        let mut probe: QueryBuilder<Postgres> =
            QueryBuilder::new("SELECT count(*) FROM (SELECT 1 FROM events e WHERE true");
        push_content(&mut probe, filter);
        probe.push(" LIMIT ").push_bind(DENSE_MATCHES).push(") AS m");
        let matches: i64 = crate::db::built_scalar(&mut probe).fetch_one(&mut *tx).await?;
        // Sparse: read the matches through the GIN index and sort them. Dense: walk the id
        // order and test each event, which fills a page at once; said outright, because with
        // statistics that lag a fast-growing table the planner may read every match first.
        let plan = if matches < DENSE_MATCHES {
            "SET LOCAL enable_indexscan = off"
        } else {
            "SET LOCAL enable_bitmapscan = off"
        };
        crate::db::query(plan).execute(&mut *tx).await?;
    }
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new(format!("{SUMMARIES} WHERE true"));
    if let Some(id) = filter.source_id {
        q.push(" AND e.source_id = ").push_bind(id);
    }
    match &filter.event_type {
        // A pattern, as subscriptions take them (`order.*`, `*.failed`).
        Some(t) if t.contains('*') => {
            q.push(" AND e.event_type LIKE ").push_bind(crate::fanout::to_like(t));
        }
        Some(t) => {
            q.push(" AND e.event_type = ").push_bind(t.clone());
        }
        None => {}
    }
    if let Some(t) = filter.since {
        q.push(" AND e.received_at >= ").push_bind(t);
        // An event's id is a UUIDv7 taken when its row is written, never before its
        // `received_at` (the transaction's start): so no event of the window has a
        // smaller id than the window's start as a UUIDv7, and an id-ordered scan can
        // start there instead of at the oldest event.
        q.push(" AND e.id >= ").push_bind(crate::ids::EventId(first_uuid_v7_at(t)));
    }
    if let Some(t) = filter.until {
        q.push(" AND e.received_at < ").push_bind(t);
    }
    if let Some(key) = &filter.dedupe_key {
        q.push(" AND e.dedupe_key = ").push_bind(key.clone());
    }
    push_content(&mut q, filter);
    let (cmp, order) =
        if filter.newest_first { (" AND e.id < ", " ORDER BY e.id DESC") } else { (" AND e.id > ", " ORDER BY e.id") };
    if let Some(after) = filter.after {
        q.push(cmp).push_bind(after);
    }
    q.push(order).push(" LIMIT ").push_bind(limit);
    let found = crate::db::built_as(&mut q).fetch_all(&mut *tx).await?;
    tx.commit().await?;
    Ok(found)
}

/// The content conditions of `filter`: for each, the event holds one of its hashes.
fn push_content(q: &mut QueryBuilder<'_, Postgres>, filter: &Filter) {
    for any_of in &filter.content {
        // `&&` (overlap) is what the GIN index on `search` answers.
        q.push(" AND e.search && ").push_bind(any_of.clone());
    }
}

/// The smallest UUIDv7 of the millisecond `t` (before 1970: the nil UUID).
fn first_uuid_v7_at(t: DateTime<Utc>) -> uuid::Uuid {
    let ms = u64::try_from(t.timestamp_millis()).unwrap_or(0);
    let mut bytes = [0u8; 16];
    bytes[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
    bytes[6] = 0x70;
    bytes[8] = 0x80;
    uuid::Uuid::from_bytes(bytes)
}

/// The summaries of the events `ids` (in no order; a deleted event is missing).
pub async fn summaries(db: impl PgExecutor<'_>, ids: &[EventId]) -> Result<Vec<EventSummary>, sqlx::Error> {
    crate::db::query_as(&format!("{SUMMARIES} WHERE e.id = ANY($1)")).bind(ids).fetch_all(db).await
}

/// Events taken in at or after `since`, not counting the gateway's own
/// (`crate::operational`): one range scan of `events_received_at`, meant for short
/// windows, such as the console's last few minutes.
pub async fn received_since(db: impl PgExecutor<'_>, since: DateTime<Utc>) -> Result<i64, sqlx::Error> {
    crate::db::query_scalar("SELECT count(*) FROM events WHERE received_at >= $1 AND source_id <> $2")
        .bind(since)
        .bind(crate::operational::SOURCE_ID)
        .fetch_one(db)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_uuid_v7_of_a_millisecond_sorts_before_every_id_of_it_and_after_every_earlier_one() {
        let t = DateTime::<Utc>::from_timestamp_millis(1_764_633_600_123).unwrap();
        let first = first_uuid_v7_at(t);
        assert_eq!(first.get_version_num(), 7);
        let ts = uuid::Timestamp::from_unix(uuid::NoContext, 1_764_633_600, 123_000_000);
        for _ in 0..100 {
            assert!(uuid::Uuid::new_v7(ts) >= first);
        }
        let earlier = uuid::Timestamp::from_unix(uuid::NoContext, 1_764_633_600, 122_999_999);
        assert!(uuid::Uuid::new_v7(earlier) < first);
    }
}
