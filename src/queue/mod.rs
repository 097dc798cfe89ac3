//! The queue: the `deliveries` table and every statement that touches it.
//!
//! - [`claim_batch`] / [`claim_fair`]: a transaction of two statements (lock the endpoint
//!   rows it serves; then, with a snapshot taken after those locks, count their room and
//!   pick due rows with `FOR UPDATE SKIP LOCKED`), which moves them onto a lease
//!   (`next_attempt_at = now() + lease`), bumps their fencing token and attempt count, and
//!   returns what a worker needs to send them. Concurrent claimers get disjoint rows;
//!   there is no "in progress" status a crash could strand: an abandoned claim is simply
//!   due again when its lease ends. ([`claim`] is [`claim_fair`] with the default
//!   fairness, for tests and tools.)
//! - [`record`]: outcomes are written with `WHERE claim_token = $token`; a worker whose
//!   lease was taken over matches zero rows and its result is dropped (fenced).
//!
//! A failover to an asynchronous standby can lose a claim whose worker is already
//! sending. A new token is the old one plus a random step ([`NEXT_CLAIM_TOKEN`]), not
//! plus one, so the claim that replaces a lost one does not hand its token out again, and
//! the lost claim's worker stays fenced.

mod claimed;
mod claims;
pub mod fanout;
pub mod lines;
mod outcomes;
pub mod read;

pub use claimed::*;
pub use claims::*;
pub use outcomes::*;

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use crate::ids::{DeliveryId, EndpointId};

/// The fencing token that replaces `claim_token` on a row's next lease (and on a burial):
/// the old one plus a random step of 1 to 2^32.
///
/// Tokens are only ever compared for equality, and they still only grow. The step is
/// random because a claim can be lost after its worker was told: a failover to an
/// asynchronous standby loses the last commits the standby had not received, and a
/// restore to a point in time loses more. The row then holds the token from before, and
/// with a step of one the next claim handed the lost claim's token out again, so the lost
/// claim's worker (still sending) could record over the new lease and free its in-flight
/// room early. With a random step the two draws meet once in 2^32. Overflow needs over 2
/// billion leases of one delivery.
pub const NEXT_CLAIM_TOKEN: &str = "claim_token + 1 + floor(random() * 4294967296)::int8";

/// Rows one [`park_blocked`] call parks at most.
pub const PARK_BATCH: i64 = 1_000;

/// What the circuit housekeeping has to look after now ([`endpoints_to_watch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Watch {
    /// Some endpoint is blocked (open circuit, paused) or has a parked backlog to
    /// release: [`park_blocked`] and [`release_parked`] may have work.
    pub blocked_or_releasing: bool,
    /// Some circuit is open: a half-open probe may come due ([`claim_probes`]).
    pub open_circuits: bool,
}

/// Whether any endpoint needs the circuit housekeeping, in one statement without a lock
/// (the partial indexes of open circuits and pending releases, the paused flag): nearly
/// always none does, and the housekeeping's three statements then have nothing to do.
/// What changes just after is seen by the next round, as it would be had the round run.
pub async fn endpoints_to_watch(db: impl PgExecutor<'_>) -> Result<Watch, sqlx::Error> {
    let (open, other): (bool, bool) = crate::db::query_as(
        "SELECT EXISTS (SELECT 1 FROM endpoints WHERE circuit_state = 'open' AND deleted_at IS NULL),
                EXISTS (SELECT 1 FROM endpoints WHERE release_pending AND deleted_at IS NULL)
                OR EXISTS (SELECT 1 FROM endpoints WHERE paused AND deleted_at IS NULL)",
    )
    .fetch_one(db)
    .await?;
    Ok(Watch { blocked_or_releasing: open || other, open_circuits: open })
}

/// Park due deliveries of blocked endpoints (open circuit, paused): they leave the claim
/// index without spending an attempt, so a dead endpoint's backlog costs claims nothing.
/// Walks each blocked endpoint's own unparked rows (a per-endpoint partial index), so the
/// cost is the rows parked, not the queue's size. Returns how many were parked.
///
/// The blocked endpoints are read `FOR SHARE`: a circuit that closes (or an endpoint
/// resumed) while this statement runs waits for it, or is seen closed by it, so no row
/// is parked after its endpoint's backlog release has looked for parked rows.
pub async fn park_blocked(db: impl PgExecutor<'_>) -> Result<u64, sqlx::Error> {
    let done = crate::db::query(
        "WITH blocked AS (
             SELECT id FROM endpoints WHERE (circuit_state = 'open' OR paused) AND deleted_at IS NULL
             FOR SHARE
         ), due AS (
             SELECT p.id FROM blocked CROSS JOIN LATERAL (
                 SELECT id FROM deliveries
                 WHERE endpoint_id = blocked.id AND status = 'pending' AND NOT parked AND NOT waiting
                   AND next_attempt_at <= now()
                 ORDER BY next_attempt_at
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED
             ) p
             LIMIT $1
         )
         UPDATE deliveries d SET parked = true, updated_at = now() FROM due WHERE d.id = due.id",
    )
    .bind(PARK_BATCH)
    .execute(db)
    .await?;
    Ok(done.rows_affected())
}

/// How many deliveries to `endpoint_id` are pending (parked ones included).
pub async fn pending_of(db: impl PgExecutor<'_>, endpoint_id: EndpointId) -> Result<i64, sqlx::Error> {
    crate::db::query_scalar("SELECT count(*) FROM deliveries WHERE endpoint_id = $1 AND status = 'pending'")
        .bind(endpoint_id)
        .fetch_one(db)
        .await
}

/// Dead-letter every pending delivery to `endpoint_id` with `reason` (its endpoint is
/// being deleted, in the caller's transaction). The claim token moves on, so a worker
/// holding a lease on one of them records nothing afterwards.
pub async fn bury_all_of_endpoint(
    conn: &mut sqlx::PgConnection,
    endpoint_id: EndpointId,
    reason: &str,
) -> Result<u64, sqlx::Error> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "UPDATE deliveries
             SET status = 'dead', dead_reason = $2, parked = false, leased_until = NULL,
                 claim_token = {NEXT_CLAIM_TOKEN}, finished_at = now(), updated_at = now()
             WHERE endpoint_id = $1 AND status = 'pending'"
        )
    });
    let done = crate::db::query(&SQL).bind(endpoint_id).bind(reason).execute(&mut *conn).await?;
    // Nothing of the endpoint will be sent again: its lines go too.
    crate::db::query("DELETE FROM order_lines WHERE endpoint_id = $1").bind(endpoint_id).execute(&mut *conn).await?;
    Ok(done.rows_affected())
}

/// Manual redelivery: a dead (or delivered) delivery goes back to pending, due now, with
/// a fresh attempt budget and the same `webhook-id`. A pending one is left as it is, so
/// calling twice changes nothing; a deleted endpoint's deliveries stay where they are.
/// Returns whether it changed.
///
/// An ordered delivery rejoins its line ([`lines::rejoin`]): it waits for the line's
/// current head, if any, and then goes next (it keeps its place: its `line_seq` is older
/// than the waiting ones'); a dead delivery blocking its line is its head and goes at once.
pub async fn redeliver(pool: &crate::db::Pool, id: DeliveryId) -> Result<bool, sqlx::Error> {
    let mut tx = pool.begin().await?;
    // The endpoint first, shared: an endpoint being deleted (which locks it for update,
    // then buries its pending deliveries) waits for this revival and buries it too, or
    // goes first and this finds it deleted. Unlocked, a revival that read the endpoint
    // live committed after the delete: a pending delivery to a deleted endpoint, never
    // sent and never buried.
    let live: Option<EndpointId> = crate::db::query_scalar(
        "SELECT ep.id FROM deliveries d JOIN endpoints ep ON ep.id = d.endpoint_id
         WHERE d.id = $1 AND ep.deleted_at IS NULL FOR SHARE OF ep",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    if live.is_none() {
        return Ok(false);
    }
    let lines = lines::of(&mut tx, &[id]).await?;
    lines::lock(&mut tx, &lines).await?;
    let done = crate::db::query(
        "UPDATE deliveries d
         SET status = 'pending', attempts_base = attempt_count, next_attempt_at = now(), parked = false,
             dead_reason = NULL, finished_at = NULL, leased_until = NULL, updated_at = now()
         WHERE d.id = $1 AND d.status IN ('dead', 'delivered')",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?;
    let changed = done.rows_affected() == 1;
    if changed {
        lines::rejoin(&mut tx, &[id], &lines).await?;
    }
    tx.commit().await?;
    Ok(changed)
}

/// Rows un-parked or re-queued per statement: short transactions even for a huge backlog.
pub const REQUEUE_BATCH: i64 = 1_000;
/// Endpoints one [`release_parked`] call serves at most.
pub const RELEASE_ENDPOINTS: i64 = 16;

/// One step of every pending backlog release (see migration 0007): for up to
/// [`RELEASE_ENDPOINTS`] endpoints whose circuit closed or that were resumed
/// (`release_pending`) and that are runnable now, un-park up to [`REQUEUE_BATCH`] parked
/// deliveries each, oldest first, due `1/per_sec` apart continuing the endpoint's ramp
/// (`release_next_at`), and clear the flag once an endpoint has nothing parked left.
///
/// One statement: the flag is cleared in the transaction that un-parks the last rows, so
/// a crash at any instant leaves either the flag or nothing parked, and any replica's
/// next call carries on. `SKIP LOCKED` on the endpoint row keeps two replicas from
/// spacing the same backlog twice; the parked rows are locked without it, so a row
/// another statement holds for a moment (the janitor's check) is waited for rather than
/// skipped and left behind by a cleared flag. `only` limits the step to one endpoint (an operator's
/// resume). Returns how many deliveries were un-parked.
pub async fn release_parked(
    db: impl PgExecutor<'_>,
    per_sec: u32,
    only: Option<EndpointId>,
) -> Result<u64, sqlx::Error> {
    let step = 1.0 / f64::from(per_sec.max(1));
    let released: i64 = crate::db::query_scalar(
        "WITH ep AS (
             SELECT id, GREATEST(now(), COALESCE(release_next_at, now())) AS start
             FROM endpoints
             WHERE release_pending AND circuit_state = 'closed' AND NOT paused AND deleted_at IS NULL
               AND ($4::uuid IS NULL OR id = $4)
             ORDER BY id
             LIMIT $1
             FOR UPDATE SKIP LOCKED
         ), picked AS (
             SELECT p.id, ep.id AS endpoint_id, ep.start,
                    row_number() OVER (PARTITION BY ep.id ORDER BY p.id) AS rn
             FROM ep CROSS JOIN LATERAL (
                 SELECT id FROM deliveries
                 WHERE endpoint_id = ep.id AND status = 'pending' AND parked
                 ORDER BY id
                 LIMIT $2
                 FOR UPDATE
             ) p
         ), unparked AS (
             UPDATE deliveries d
             SET parked = false, next_attempt_at = picked.start + (picked.rn - 1) * make_interval(secs => $3),
                 updated_at = now()
             FROM picked WHERE d.id = picked.id
             RETURNING d.id
         ), per_endpoint AS (
             SELECT ep.id, ep.start, count(picked.id) AS n
             FROM ep LEFT JOIN picked ON picked.endpoint_id = ep.id
             GROUP BY ep.id, ep.start
         ), cursor AS (
             UPDATE endpoints e
             SET release_next_at = pe.start + pe.n * make_interval(secs => $3),
                 release_pending = pe.n >= $2
             FROM per_endpoint pe WHERE e.id = pe.id
         )
         SELECT count(*) FROM unparked",
    )
    .bind(RELEASE_ENDPOINTS)
    .bind(REQUEUE_BATCH)
    .bind(step)
    .bind(only)
    .fetch_one(db)
    .await?;
    Ok(released as u64)
}

/// Operator recovery: put an endpoint's deliveries that died in `[since, until)` back in
/// line with a fresh budget and their `webhook-id`, oldest first, due `1/per_sec` apart
/// from now, in batches of [`REQUEUE_BATCH`]: a recovering subscriber sees them at a
/// bounded rate, not all at once. Only rows still dead qualify, so calling again
/// re-queues nothing new. Returns how many were re-queued.
pub async fn requeue_dead(
    pool: &crate::db::Pool,
    endpoint_id: EndpointId,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
    per_sec: u32,
) -> Result<u64, sqlx::Error> {
    // The candidates of a batch, read unlocked: their lines are locked before their rows,
    // in the order a redelivery takes them (the other order deadlocked with one).
    let candidates_sql = "SELECT id FROM deliveries
         WHERE endpoint_id = $1 AND status = 'dead' AND finished_at >= $3 AND finished_at < $4
           AND ($5::uuid IS NULL OR id > $5)
         ORDER BY id
         LIMIT $2";
    let sql = "WITH locked AS (
             SELECT id FROM deliveries
             WHERE id = ANY($1) AND status = 'dead' AND finished_at >= $5 AND finished_at < $6
             ORDER BY id
             FOR UPDATE SKIP LOCKED
         ), n AS (
             SELECT id, row_number() OVER (ORDER BY id) AS rn FROM locked
         )
         UPDATE deliveries d
         SET status = 'pending', attempts_base = d.attempt_count, dead_reason = NULL, finished_at = NULL,
             leased_until = NULL, parked = false,
             next_attempt_at = $2 + (n.rn - 1 + $3) * make_interval(secs => $4),
             updated_at = now()
         FROM n WHERE d.id = n.id
         RETURNING d.id";
    let step = 1.0 / f64::from(per_sec.max(1));
    let start = crate::clock::now();
    let mut requeued: u64 = 0;
    let mut after: Option<DeliveryId> = None;
    loop {
        // Each batch in a transaction: recovered ordered deliveries rejoin their lines.
        let mut tx = pool.begin().await?;
        // The endpoint shared first, as a redelivery holds it: a delete waits for the
        // batch and buries what it revived, or goes first and the batch revives nothing.
        let live: Option<EndpointId> =
            crate::db::query_scalar("SELECT id FROM endpoints WHERE id = $1 AND deleted_at IS NULL FOR SHARE")
                .bind(endpoint_id)
                .fetch_optional(&mut *tx)
                .await?;
        if live.is_none() {
            return Ok(requeued);
        }
        let candidates: Vec<DeliveryId> = crate::db::query_scalar(candidates_sql)
            .bind(endpoint_id)
            .bind(REQUEUE_BATCH)
            .bind(since)
            .bind(until)
            .bind(after)
            .fetch_all(&mut *tx)
            .await?;
        let lines = lines::of(&mut tx, &candidates).await?;
        lines::lock(&mut tx, &lines).await?;
        let revived: Vec<DeliveryId> = crate::db::query_scalar(sql)
            .bind(&candidates)
            .bind(start)
            .bind(requeued as i64)
            .bind(step)
            .bind(since)
            .bind(until)
            .fetch_all(&mut *tx)
            .await?;
        if !lines.is_empty() {
            lines::rejoin(&mut tx, &revived, &lines).await?;
        }
        tx.commit().await?;
        requeued += revived.len() as u64;
        after = candidates.last().copied();
        if (candidates.len() as i64) < REQUEUE_BATCH {
            return Ok(requeued);
        }
    }
}
