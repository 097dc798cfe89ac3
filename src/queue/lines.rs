//! Ordering lines: the deliveries of one ordering key to one endpoint, attempted one at a
//! time in ingest order.
//!
//! A line is a row of `order_lines` naming its head, the only delivery of the line that
//! may be claimed; the others are `waiting` (outside the claim's indexes). The row is
//! also the line's lock:
//!
//! - a delivery **joins** its line with an upsert ([`super::fanout::FANOUT`], in the ingest statement; [`rejoin`]),
//!   which always works on the row's latest version: it becomes the head of an idle line,
//!   or waits;
//! - when a head **finishes** (delivered, or dead when its line skips the dead), the
//!   statement that records it locks the row (the recorder's outcome statement,
//!   `super::RECORD_SQL`; [`release_heads`] for a burial, both by `lines_released_by!`),
//!   and [`promote`] (or [`promote_leasing`], the recorder's, which also leases the new
//!   heads whose endpoints have room), a later statement of the same
//!   transaction and so with a snapshot taken after that lock, makes the line's next
//!   waiting delivery (lowest `line_seq`) its head, or deletes the line when none waits
//!   (a line whose head is done with it is as idle as one without a head; the release
//!   only locks, so the row gets one new version per step, not two, and no foreign key
//!   check for a row this transaction wrote). A delivery joining meanwhile either
//!   committed before the lock (and is seen) or upserts after our commit (and sees the
//!   new head, or no line: it starts one). No delivery is left waiting behind no head,
//!   and an idle line costs no row.
//!
//! A dead delivery of a `block` line stays its head: the line waits until an operator
//! redelivers it (it is then claimable again, and its success releases the line) or
//! unblocks it ([`unblock`]).

use sqlx::PgConnection;
use sqlx::Row as _;

use super::ClaimTerms;
use super::claimed::{Claimed, claimed_in};
use crate::ids::{DeliveryId, EndpointId};

/// A line: the endpoint and the ordering key.
pub type Line = (EndpointId, String);

/// Whether the delivery aliased `$d` is done with its line: delivered, or dead without
/// blocking it. One definition for the release (which heads to let go) and the promotion
/// (which lines are idle), so the two cannot disagree and leave a line stalled. A `CASE`,
/// which no partial index of `deliveries` matches (see [`RELEASE_HEADS_SQL`]).
macro_rules! done_with_line {
    ($d:literal) => {
        concat!(
            "CASE ",
            $d,
            ".status WHEN 'delivered' THEN true WHEN 'dead' THEN NOT ",
            $d,
            ".blocks_on_dead ELSE false END"
        )
    };
}
pub(crate) use done_with_line;

/// The next delivery of the line aliased `$l` (its `endpoint_id` and `ordering_key`): the
/// waiting one with the lowest `line_seq`, found in `deliveries_waiting`.
macro_rules! next_waiting {
    ($l:literal) => {
        concat!(
            "SELECT w.id FROM deliveries w
             WHERE w.waiting AND w.endpoint_id = ",
            $l,
            ".endpoint_id AND w.ordering_key = ",
            $l,
            ".ordering_key
             ORDER BY w.line_seq
             LIMIT 1"
        )
    };
}

/// The promotion's common part, up to the deliveries' update: CTEs `idle` (the batch's
/// idle lines, by address), `next` (each with its next delivery), `heads` (the lines
/// moved on: `head_id`, `endpoint_id`) and `gone` (the lines deleted). `$1` endpoints,
/// `$2` ordering keys. Shared by [`PROMOTE_SQL`] and [`promote_leasing_sql`].
macro_rules! promotion {
    () => {
        concat!(
            "WITH idle AS (
                 SELECT l.line, l.endpoint_id, l.ordering_key
                 FROM unnest($1::uuid[], $2::text[]) AS t(endpoint_id, ordering_key)
                 CROSS JOIN LATERAL (
                     SELECT l.ctid AS line, l.endpoint_id, l.ordering_key FROM order_lines l
                     WHERE l.endpoint_id = t.endpoint_id AND l.ordering_key = t.ordering_key
                       AND (l.head_id IS NULL OR NOT EXISTS (
                           SELECT 1 FROM deliveries h WHERE h.id = l.head_id AND NOT ",
            done_with_line!("h"),
            "))
                     LIMIT 1
                 ) l
             ), next AS (
                 -- Every idle line, with its next delivery or NULL (no one waits).
                 SELECT idle.line, n.id
                 FROM idle LEFT JOIN LATERAL (",
            next_waiting!("idle"),
            ") n ON true
             ), moving AS MATERIALIZED (
                 -- The lines that move on and their next deliveries, two arrays in step.
                 SELECT array_agg(line) AS lines, array_agg(id) AS ids FROM next WHERE id IS NOT NULL
             ), heads AS (
                 UPDATE order_lines l
                 SET head_id = (SELECT m.ids[array_position(m.lines, l.ctid)] FROM moving m)
                 WHERE l.ctid = ANY((SELECT m.lines FROM moving m)::tid[])
                 RETURNING l.head_id, l.endpoint_id
             ), gone AS (
                 DELETE FROM order_lines l WHERE l.ctid = ANY(ARRAY(SELECT line FROM next WHERE id IS NULL))
             )"
        )
    };
}

/// The release's join and filter, for the finished deliveries aliased `$d` (with their
/// `id`, `endpoint_id`, `ordering_key`, `status` and `blocks_on_dead`): each line whose
/// head `$d` is and is done with, locked `FOR NO KEY UPDATE` (as `l`). Shared by
/// [`RELEASE_HEADS_SQL`] and the outcome write, which releases the lines of the heads it
/// finishes in its own statement ([`super::RECORD_SQL`]).
macro_rules! lines_released_by {
    ($d:literal) => {
        concat!(
            "CROSS JOIN LATERAL (
                 SELECT l.endpoint_id, l.ordering_key FROM order_lines l
                 WHERE l.endpoint_id = ",
            $d,
            ".endpoint_id AND l.ordering_key = ",
            $d,
            ".ordering_key AND l.head_id = ",
            $d,
            ".id
                 LIMIT 1
                 FOR NO KEY UPDATE
             ) l
             WHERE ",
            $d,
            ".ordering_key IS NOT NULL AND ",
            $crate::queue::lines::done_with_line!($d)
        )
    };
}
pub(crate) use lines_released_by;

/// Lock the lines whose heads are among `finished` and done with their line (delivered,
/// or dead without blocking it) until the transaction ends; returns them, for
/// [`promote`].
/// `finished` may hold any deliveries: unordered ones and retries are ignored.
pub async fn release_heads(conn: &mut PgConnection, finished: &[DeliveryId]) -> Result<Vec<Line>, sqlx::Error> {
    if finished.is_empty() {
        return Ok(Vec::new());
    }
    crate::db::query_as(RELEASE_HEADS_SQL).bind(finished).fetch_all(&mut *conn).await
}

/// [`release_heads`]' statement (`$1` the finished deliveries), public so that tests can
/// read its plan.
///
/// - Each finished delivery is read by primary key, and its line found by the line's own
///   key `(endpoint_id, ordering_key)`, which the delivery carries: one primary-key lookup
///   of `order_lines` per delivery (`LATERAL ... LIMIT 1`, so no plan can turn it into a
///   join that scans every line, as a join on `head_id` once did: 10 ms per batch at
///   10,000 lines). Not through `order_lines_head`: no lookup by head needs that index
///   any more; migration 0026 drops it, so that a line's head moves in a HOT update
///   (bench/PROFILE.md, "Where a webhook's WAL and PostgreSQL's instructions go").
/// - The status test is a `CASE`, which no partial index of `deliveries` matches, so the
///   finished deliveries are read by primary key. Written as `status = 'delivered' OR
///   ...`, it matched `deliveries_delivered_finished`, and with statistics from before
///   the drain (nothing delivered yet, so an estimate of one row) the planner read every
///   delivered row for each batch: 8-9 ms per batch and growing in the bench's ordered
///   drain (auto_explain: 13,040 rows read and dropped for 48).
pub const RELEASE_HEADS_SQL: &str =
    concat!("SELECT l.endpoint_id, l.ordering_key FROM deliveries d ", lines_released_by!("d"), " AND d.id = ANY($1)");

/// Make the next waiting delivery of each idle line among `lines` (no head, or a head done
/// with the line: delivered, or dead without blocking it) its head, and delete the idle
/// lines that have none: a line costs a row only while it has deliveries. The lines
/// must be locked by this transaction (by [`release_heads`] or [`lock`]), and this must be
/// a later statement than the one that locked them. Returns the deliveries it made heads
/// (claimable now: the recorder hands them to its dispatcher, `crate::wake::Handoff`).
///
/// Deleting is as safe as leaving the line idle: a delivery of the key that joins later
/// finds no row and starts the line again as its head; one whose join waits on our lock
/// finds the row gone when we commit and does the same; one that joined before our lock
/// is seen here, and promoted instead.
pub async fn promote(conn: &mut PgConnection, lines: &[Line]) -> Result<Vec<DeliveryId>, sqlx::Error> {
    if lines.is_empty() {
        return Ok(Vec::new());
    }
    let (endpoints, keys): (Vec<EndpointId>, Vec<&str>) = lines.iter().map(|(e, k)| (*e, k.as_str())).unzip();
    crate::db::query_scalar(PROMOTE_SQL).bind(&endpoints).bind(&keys).fetch_all(&mut *conn).await
}

/// [`promote`]'s statement (`$1` endpoints, `$2` ordering keys, pairwise), public so that
/// tests can read its plan.
///
/// One primary-key lookup per line: the `LIMIT 1` keeps the planner from flattening the
/// LATERAL subquery into a join. Without it, with statistics from when every line had a
/// head (an estimate of one idle line), the planner scanned all of `order_lines` for idle
/// lines and matched each against every line of the batch: 864 ms for a batch of 256 at
/// 10,000 lines in the bench's ordered drain (2,015,232 rows dropped by the join filter).
///
/// The line rows are then written by their address (`ctid`, read by that lookup), as an
/// array (`ctid = ANY(ARRAY(...))`, a TID scan), and the promoted deliveries by their
/// keys likewise: no statement of the promotion joins the batch to a table, so no plan
/// can scan one. Written as `UPDATE order_lines ... FROM next` on the line's key, the
/// generic plan a recorder's connection built while there were a few lines (and the
/// statistics said so) scanned every line for each line of the batch: 330,156 rows for
/// 16 lines among 10,000 (`tests/it/plans.rs`). The address is stable: the lines are
/// locked by this transaction, so nothing else moves their rows, and this statement
/// writes each once (moved on, or deleted). Each line's new head is looked up in two
/// arrays in step (the addresses of the lines that move on, their next deliveries), a
/// one-row CTE: no join. (Read by the line's key again inside the `UPDATE`, each line's
/// next delivery was a second probe of `deliveries_waiting`, whose range for a key starts
/// with an entry for every delivery the line has promoted since the last vacuum.)
pub const PROMOTE_SQL: &str = concat!(
    promotion!(),
    " UPDATE deliveries d SET waiting = false, updated_at = now()
     WHERE d.id = ANY(ARRAY(SELECT head_id FROM heads))
     RETURNING d.id"
);

/// [`promote_leasing`]'s statement (`$1` endpoints, `$2` ordering keys, pairwise; `$3`
/// most leases, `$4` the lease in seconds, `$5` the default in-flight limit), public so
/// that tests can read its plan. [`PROMOTE_SQL`]'s promotion, whose update of the new
/// heads also leases those their endpoints have room for: the room, the endpoint locks
/// (`SKIP LOCKED`: the write never waits for a claim's row) and the rate tokens are
/// `wg_lease_room_v6`'s, as for ingest's leasing statements (migrations 0029, 0033), and
/// the lease (a new fencing token, an attempt counted) is any claim's. One row each: the
/// heads leased carry a claim's columns (`leased` true), the others only their `id`.
pub fn promote_leasing_sql() -> &'static str {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let claimed = super::claimed::CLAIMED_COLUMNS;
        let token = super::NEXT_CLAIM_TOKEN;
        format!(
            "{promotion}, room AS (
                 SELECT r.endpoint_id, r.granted
                 FROM wg_lease_room_v6(ARRAY(SELECT endpoint_id FROM heads), $3, $5) r
             ), leasing AS (
                 -- Each endpoint's granted leases go to its heads in id order.
                 SELECT t.head_id FROM (
                     SELECT h.head_id, h.endpoint_id,
                            row_number() OVER (PARTITION BY h.endpoint_id ORDER BY h.head_id) AS turn
                     FROM heads h
                 ) t JOIN room ON room.endpoint_id = t.endpoint_id
                 WHERE t.turn <= room.granted
             ), lz AS MATERIALIZED (
                 -- Once: inlined, each of the update's uses of it was an initplan of its own.
                 SELECT ARRAY(SELECT head_id FROM leasing) AS ids
             ), moved AS (
                 UPDATE deliveries d
                 SET waiting = false, updated_at = now(),
                     next_attempt_at = CASE WHEN d.id = ANY(lz.ids)
                                            THEN now() + make_interval(secs => $4) ELSE d.next_attempt_at END,
                     leased_until = CASE WHEN d.id = ANY(lz.ids)
                                         THEN now() + make_interval(secs => $4) ELSE d.leased_until END,
                     claim_token = CASE WHEN d.id = ANY(lz.ids) THEN d.{token} ELSE d.claim_token END,
                     attempt_count = CASE WHEN d.id = ANY(lz.ids) THEN d.attempt_count + 1 ELSE d.attempt_count END
                 FROM lz
                 WHERE d.id = ANY(ARRAY(SELECT head_id FROM heads))
                 RETURNING d.id, d.id = ANY(lz.ids) AS leased, d.event_id, d.endpoint_id, d.attempt_count,
                           d.attempts_base, d.claim_token, d.ordering_key, d.transform_by
             )
             SELECT d.leased, {claimed}, NULL::int8 AS probe_token
             FROM moved d
             LEFT JOIN events e ON d.leased AND e.id = d.event_id
             LEFT JOIN endpoints ep ON d.leased AND ep.id = d.endpoint_id
             LEFT JOIN sources s ON s.id = e.source_id",
            promotion = promotion!(),
        )
    });
    &SQL
}

/// What [`promote_leasing`] did: the new heads it leased, and those it left to claim.
#[derive(Debug, Default)]
pub struct Promotion {
    /// New heads leased to the caller (each with a fresh fencing token, its attempt
    /// counted): the caller starts them, or gives them back.
    pub leased: Vec<Claimed>,
    /// New heads not leased (no room, no slot, their endpoint's row held elsewhere):
    /// claimable now.
    pub promoted: Vec<DeliveryId>,
}

/// [`promote`], leasing the new heads whose endpoints have room in the same `UPDATE`, at
/// most `terms.limit` of them (the worker slots the caller holds for them):
/// one row version a line step instead of two (the promotion's, then the claim's). The
/// lines must be locked by this transaction and this a later statement than the one
/// that locked them, as for [`promote`]. The endpoints' rows it leases for stay locked
/// until the transaction ends (taken with `SKIP LOCKED`: it never waits for one).
pub async fn promote_leasing(
    conn: &mut PgConnection,
    lines: &[Line],
    terms: ClaimTerms,
) -> Result<Promotion, sqlx::Error> {
    if lines.is_empty() {
        return Ok(Promotion::default());
    }
    let (endpoints, keys): (Vec<EndpointId>, Vec<&str>) = lines.iter().map(|(e, k)| (*e, k.as_str())).unzip();
    let rows = crate::db::query(promote_leasing_sql())
        .bind(&endpoints)
        .bind(&keys)
        .bind(terms.limit)
        .bind(terms.lease.as_secs_f64())
        .bind(terms.default_max_in_flight)
        .fetch_all(&mut *conn)
        .await?;
    let mut leased_rows = Vec::new();
    let mut promoted = Vec::new();
    for row in rows {
        if row.try_get::<bool, _>("leased")? {
            leased_rows.push(row);
        } else {
            promoted.push(row.try_get::<DeliveryId, _>("id")?);
        }
    }
    Ok(Promotion { leased: claimed_in(&leased_rows)?, promoted })
}

/// Lock `lines` (creating missing ones, idle) until the transaction ends.
pub async fn lock(conn: &mut PgConnection, lines: &[Line]) -> Result<(), sqlx::Error> {
    if lines.is_empty() {
        return Ok(());
    }
    let (endpoints, keys): (Vec<EndpointId>, Vec<&str>) = lines.iter().map(|(e, k)| (*e, k.as_str())).unzip();
    crate::db::query(
        "INSERT INTO order_lines (endpoint_id, ordering_key, head_id)
         SELECT endpoint_id, ordering_key, NULL FROM unnest($1::uuid[], $2::text[]) AS t(endpoint_id, ordering_key)
         ORDER BY 1, 2
         ON CONFLICT (endpoint_id, ordering_key) DO UPDATE SET head_id = order_lines.head_id",
    )
    .bind(&endpoints)
    .bind(&keys)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The lines of `deliveries` (ordered ones only).
pub async fn of(conn: &mut PgConnection, deliveries: &[DeliveryId]) -> Result<Vec<Line>, sqlx::Error> {
    crate::db::query_as(
        "SELECT DISTINCT endpoint_id, ordering_key FROM deliveries
         WHERE id = ANY($1) AND ordering_key IS NOT NULL ORDER BY 1, 2",
    )
    .bind(deliveries)
    .fetch_all(&mut *conn)
    .await
}

/// Put revived ordered deliveries (redelivered or recovered, now pending) back in their
/// lines: each waits unless it is its line's head (a blocking dead delivery redelivered);
/// then every idle line among them promotes its first waiting delivery (the revived one,
/// when it is older than the others: it keeps its place). Call in the transaction that
/// revived them, after [`lock`] of their lines.
pub async fn rejoin(conn: &mut PgConnection, revived: &[DeliveryId], lines: &[Line]) -> Result<(), sqlx::Error> {
    if lines.is_empty() {
        return Ok(());
    }
    crate::db::query(
        "UPDATE deliveries d SET waiting = (l.head_id IS DISTINCT FROM d.id)
         FROM order_lines l
         WHERE d.id = ANY($1) AND d.ordering_key IS NOT NULL
           AND l.endpoint_id = d.endpoint_id AND l.ordering_key = d.ordering_key",
    )
    .bind(revived)
    .execute(&mut *conn)
    .await?;
    promote(conn, lines).await?;
    Ok(())
}

/// Unblock the line a dead delivery blocks: its next delivery becomes the head (the dead
/// one stays dead). Returns whether `id` was blocking a line.
///
/// The line is locked first, as a redelivery locks it, and the delivery read dead in a
/// later statement: one that waited for the line then sees a redelivery that committed
/// meanwhile (pending again, the head again) and unblocks nothing. Read in the same
/// statement as the line's update, a stale `dead` let the next delivery go while the
/// redelivered head was on its way: two of one key in flight, out of order.
pub async fn unblock(conn: &mut PgConnection, id: DeliveryId) -> Result<bool, sqlx::Error> {
    let lines = of(&mut *conn, &[id]).await?;
    lock(&mut *conn, &lines).await?;
    let released: Vec<Line> = crate::db::query_as(
        "UPDATE order_lines l SET head_id = NULL
         FROM deliveries d
         WHERE d.id = $1 AND d.status = 'dead'
           AND l.endpoint_id = d.endpoint_id AND l.ordering_key = d.ordering_key AND l.head_id = d.id
         RETURNING l.endpoint_id, l.ordering_key",
    )
    .bind(id)
    .fetch_all(&mut *conn)
    .await?;
    promote(conn, &released).await?;
    Ok(!released.is_empty())
}
