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
//! - when a head **finishes** (delivered, or dead when its line skips the dead),
//!   [`release_heads`] locks the row, and [`promote`], a later statement of the same
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

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::{Claimed, LeaseTerms};
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

/// Lock the lines whose heads are among `finished` and done with their line (delivered,
/// or dead without blocking it) until the transaction ends; returns them, for
/// [`promote`].
/// `finished` may hold any deliveries: unordered ones and retries are ignored.
pub async fn release_heads(conn: &mut PgConnection, finished: &[DeliveryId]) -> Result<Vec<Line>, sqlx::Error> {
    Ok(release_heads_of(conn, finished).await?.into_iter().map(|(line, _)| line).collect())
}

/// [`release_heads`], with each line's finished head.
pub async fn release_heads_of(
    conn: &mut PgConnection,
    finished: &[DeliveryId],
) -> Result<Vec<(Line, DeliveryId)>, sqlx::Error> {
    if finished.is_empty() {
        return Ok(Vec::new());
    }
    let rows: Vec<(EndpointId, String, DeliveryId)> =
        crate::db::query_as(RELEASE_HEADS_SQL).bind(finished).fetch_all(&mut *conn).await?;
    Ok(rows.into_iter().map(|(endpoint, key, head)| ((endpoint, key), head)).collect())
}

/// [`release_heads`]' statement (`$1` the finished deliveries), public so that tests can
/// read its plan.
///
/// - `head_id = ANY(ARRAY(...))`: index lookups on `order_lines_head`; a join from
///   `deliveries` got a plan that scanned every line (10 ms per batch at 10,000 lines).
/// - The status test is a `CASE`, which no partial index of `deliveries` matches, so the
///   finished deliveries are read by primary key. Written as `status = 'delivered' OR
///   ...`, it matched `deliveries_delivered_finished`, and with statistics from before
///   the drain (nothing delivered yet, so an estimate of one row) the planner read every
///   delivered row for each batch: 8-9 ms per batch and growing in the bench's ordered
///   drain (auto_explain: 13,040 rows read and dropped for 48).
pub const RELEASE_HEADS_SQL: &str = concat!(
    "SELECT l.endpoint_id, l.ordering_key, l.head_id FROM order_lines l
     WHERE l.head_id = ANY(ARRAY(
         SELECT d.id FROM deliveries d
         WHERE d.id = ANY($1) AND ",
    done_with_line!("d"),
    "))
     FOR NO KEY UPDATE OF l"
);

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
    let lines: Vec<(Line, Option<DateTime<Utc>>)> = lines.iter().map(|line| (line.clone(), None)).collect();
    Ok(promote_leasing(conn, &lines, None).await?.heads)
}

/// What [`promote_leasing`] made of its lines.
#[derive(Debug, Default)]
pub struct Promotion {
    /// New heads left for a claim (claimable now).
    pub heads: Vec<DeliveryId>,
    /// New heads leased in the finished heads' places.
    pub leased: Vec<Claimed>,
}

/// [`promote`], and with `terms`, lease each new head in the same `UPDATE` that makes it
/// claimable, in place of its line's finished head, whose lease this transaction ended
/// and which held it until the time given beside the line (`None`: pass nothing on for
/// that line). The line moves on without a claim, and its row gets one new version, not
/// two: the worker slot that ran the finished head runs the next one.
///
/// Without the endpoint's lock, which the claims take to count leases: a concurrent claim
/// cannot see this transaction's writes, so it counted the finished head as in flight,
/// and the new head's lease only takes that one's place (one for one, on the same line,
/// so the same endpoint). That holds only while the finished head's lease was still live
/// for any claim that counted it: a lease is passed on only when the finished one had
/// [`LEASE_PASS_MARGIN_SECS`](super::LEASE_PASS_MARGIN_SECS) more to run. Leases are also
/// counted here, as the claims count them, so a lowered `max_in_flight` holds.
///
/// Left to the claims, as before: a line whose finished head's lease had run out (or
/// was given no time), an endpoint whose circuit is not closed (a half-open probe needs
/// its probe token), one paused, deleted or rate-limited (its tokens are paid under the
/// endpoint's lock), or with no room left. The caller gives no time for an endpoint
/// whose circuit the same write may open (a failure in its batch).
pub async fn promote_leasing(
    conn: &mut PgConnection,
    lines: &[(Line, Option<DateTime<Utc>>)],
    terms: Option<LeaseTerms>,
) -> Result<Promotion, sqlx::Error> {
    use sqlx::{FromRow as _, Row as _};
    if lines.is_empty() {
        return Ok(Promotion::default());
    }
    let mut endpoints = Vec::with_capacity(lines.len());
    let mut keys = Vec::with_capacity(lines.len());
    let mut held_until = Vec::with_capacity(lines.len());
    for ((endpoint, key), until) in lines {
        endpoints.push(*endpoint);
        keys.push(key.as_str());
        held_until.push(until.filter(|_| terms.is_some()));
    }
    let terms = terms.unwrap_or(LeaseTerms { lease: std::time::Duration::ZERO, default_max_in_flight: 0 });
    let rows = crate::db::query(promote_sql())
        .bind(&endpoints)
        .bind(&keys)
        .bind(&held_until)
        .bind(terms.lease.as_secs_f64())
        .bind(terms.default_max_in_flight)
        .fetch_all(&mut *conn)
        .await?;
    let mut promotion = Promotion::default();
    for row in &rows {
        if row.try_get::<bool, _>("leased")? {
            promotion.leased.push(Claimed::from_row(row)?);
        } else {
            promotion.heads.push(row.try_get("id")?);
        }
    }
    // Refused (the transaction rolls back) rather than sent twice at once.
    crate::invariants::distinct(promotion.leased.iter().map(|c| c.id), crate::invariants::CLAIMED_ONCE)?;
    Ok(promotion)
}

/// [`promote_leasing`]'s statement (`$1` endpoints, `$2` ordering keys, `$3` when each
/// line's finished head's lease ended, or `NULL`, pairwise; `$4` lease in seconds, `$5`
/// default max in flight), public so that tests can read its plan.
///
/// One primary-key lookup per line: the `LIMIT 1` keeps the planner from flattening the
/// LATERAL subquery into a join. Without it, with statistics from when every line had a
/// head (an estimate of one idle line), the planner scanned all of `order_lines` for idle
/// lines and matched each against every line of the batch: 864 ms for a batch of 256 at
/// 10,000 lines in the bench's ordered drain (2,015,232 rows dropped by the join filter).
/// Whether a new head is leased is one array lookup (`= ANY(ARRAY(...))`), not a join.
pub fn promote_sql() -> &'static str {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "WITH idle AS (
                 SELECT l.endpoint_id, l.ordering_key, t.held_until
                 FROM unnest($1::uuid[], $2::text[], $3::timestamptz[]) AS t(endpoint_id, ordering_key, held_until)
                 CROSS JOIN LATERAL (
                     SELECT l.endpoint_id, l.ordering_key FROM order_lines l
                     WHERE l.endpoint_id = t.endpoint_id AND l.ordering_key = t.ordering_key
                       AND (l.head_id IS NULL OR NOT EXISTS (
                           SELECT 1 FROM deliveries h WHERE h.id = l.head_id AND NOT {done}))
                     LIMIT 1
                 ) l
             ), next AS (
                 SELECT n.id, idle.endpoint_id, idle.ordering_key,
                        idle.held_until > clock_timestamp() + make_interval(secs => {margin})
                        AND n.next_attempt_at <= now() AND NOT n.parked
                        AND (n.leased_until IS NULL OR n.leased_until <= now()) AS passable
                 FROM idle CROSS JOIN LATERAL (
                     SELECT w.id, w.next_attempt_at, w.parked, w.leased_until FROM deliveries w
                     WHERE w.waiting AND w.endpoint_id = idle.endpoint_id AND w.ordering_key = idle.ordering_key
                     ORDER BY w.line_seq
                     LIMIT 1
                 ) n
             ), heads AS (
                 UPDATE order_lines l SET head_id = next.id
                 FROM next WHERE l.endpoint_id = next.endpoint_id AND l.ordering_key = next.ordering_key
                 RETURNING next.id
             ), gone AS (
                 DELETE FROM order_lines l
                 USING idle
                 WHERE l.endpoint_id = idle.endpoint_id AND l.ordering_key = idle.ordering_key
                   AND NOT EXISTS (SELECT 1 FROM next
                                   WHERE next.endpoint_id = idle.endpoint_id AND next.ordering_key = idle.ordering_key)
             ), room AS (
                 -- Only endpoints with a lease to pass on: none without terms.
                 SELECT ep.id,
                        COALESCE(ep.max_in_flight, $5)
                        - (SELECT count(*) FROM deliveries f
                           WHERE f.endpoint_id = ep.id AND f.status = 'pending'
                             AND f.leased_until IS NOT NULL AND f.leased_until > now()) AS n
                 FROM endpoints ep
                 WHERE ep.id IN (SELECT endpoint_id FROM next WHERE passable)
                   AND ep.circuit_state = 'closed' AND NOT ep.paused AND ep.deleted_at IS NULL
                   AND ep.rate_limit_per_sec IS NULL
             ), passed AS (
                 SELECT mine.id FROM room CROSS JOIN LATERAL (
                     SELECT next.id FROM next WHERE next.endpoint_id = room.id AND next.passable
                     ORDER BY next.id
                     LIMIT GREATEST(room.n, 0)
                 ) mine
             ), moved AS (
                 UPDATE deliveries d
                 SET waiting = false, updated_at = now(),
                     next_attempt_at = CASE WHEN h.pass THEN now() + make_interval(secs => $4)
                                            ELSE d.next_attempt_at END,
                     leased_until = CASE WHEN h.pass THEN now() + make_interval(secs => $4) ELSE d.leased_until END,
                     claim_token = d.claim_token + CASE WHEN h.pass THEN 1 ELSE 0 END,
                     attempt_count = d.attempt_count + CASE WHEN h.pass THEN 1 ELSE 0 END
                 FROM (SELECT heads.id, heads.id = ANY(ARRAY(SELECT id FROM passed)) AS pass FROM heads) h
                 WHERE d.id = h.id
                 RETURNING h.pass AS leased, d.id, d.event_id, d.endpoint_id, d.attempt_count, d.attempts_base,
                           d.claim_token, d.ordering_key, d.transform_by
             )
             -- What a worker needs, read only for the leased heads (the others go to a
             -- claim, which reads it again): `d.leased` gates each lookup.
             SELECT d.leased, {columns}, NULL::int8 AS probe_token
             FROM moved d
             LEFT JOIN LATERAL (SELECT e.* FROM events e WHERE d.leased AND e.id = d.event_id) e ON true
             LEFT JOIN LATERAL (SELECT ep.* FROM endpoints ep WHERE d.leased AND ep.id = d.endpoint_id) ep ON true
             LEFT JOIN LATERAL (SELECT s.* FROM sources s WHERE d.leased AND s.id = e.source_id) s ON true",
            done = done_with_line!("h"),
            margin = super::LEASE_PASS_MARGIN_SECS,
            columns = super::claims::CLAIMED_COLUMNS,
        )
    });
    &SQL
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
pub async fn unblock(conn: &mut PgConnection, id: DeliveryId) -> Result<bool, sqlx::Error> {
    let released: Vec<Line> = crate::db::query_as(
        "UPDATE order_lines l SET head_id = NULL
         FROM deliveries d
         WHERE d.id = $1 AND l.head_id = d.id AND d.status = 'dead'
         RETURNING l.endpoint_id, l.ordering_key",
    )
    .bind(id)
    .fetch_all(&mut *conn)
    .await?;
    promote(conn, &released).await?;
    Ok(!released.is_empty())
}
