//! Outcomes of claimed deliveries: recorded, released or buried, each fenced by its
//! claim token.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use super::lines;
use crate::ids::{DeliveryId, EndpointId};
use crate::invariants::{self, Broken};

/// What a dead delivery does to its ordering line (`subscriptions.ordered_on_dead`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum OnDead {
    /// The line waits behind it until an operator redelivers it (and it is delivered) or
    /// unblocks the line.
    Block,
    /// The line moves on to its next delivery (the dead one stays in the dead-letter queue).
    Skip,
}

crate::db::text_enum!(OnDead { Block => "block", Skip => "skip" });

/// A delivery's state (`deliveries.status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryStatus {
    /// Waiting for an attempt (due, leased, retrying or parked).
    Pending,
    /// A 2xx was recorded.
    Delivered,
    /// Dead-lettered: no more automatic attempts.
    Dead,
}

crate::db::text_enum!(DeliveryStatus { Pending => "pending", Delivered => "delivered", Dead => "dead" });

/// Final or intermediate state after an attempt (`attempts.outcome`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// 2xx: done.
    Delivered,
    /// Try again at `next_attempt_at`.
    Retry,
    /// Dead-lettered: no more automatic attempts.
    Dead,
}

crate::db::text_enum!(Outcome { Delivered => "delivered", Retry => "retry", Dead => "dead" });

impl Outcome {
    /// The delivery's state after it.
    pub fn status(self) -> DeliveryStatus {
        match self {
            Outcome::Delivered => DeliveryStatus::Delivered,
            Outcome::Retry => DeliveryStatus::Pending,
            Outcome::Dead => DeliveryStatus::Dead,
        }
    }
}

/// What one attempt produced, ready to record.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    /// The delivery attempted.
    pub delivery_id: DeliveryId,
    /// Token of the claim this attempt ran under (the fence).
    pub claim_token: i64,
    /// The attempt's number, as the claim counted it (`webhook-attempt`).
    pub attempt: i32,
    /// When the request started.
    pub started_at: DateTime<Utc>,
    /// Milliseconds from the request's start to the end of reading the answer.
    pub duration_ms: i32,
    /// The subscriber's HTTP status; `None` when no response came back.
    pub status_code: Option<i32>,
    /// `timeout`, `connect`, `forbidden_address`, ... when no response came back.
    pub error_kind: Option<crate::egress::ErrorKind>,
    /// What happens to the delivery next.
    pub outcome: Outcome,
    /// Human-readable reason, stored with the attempt (and as the dead reason); bounded.
    pub reason: String,
    /// The start of the subscriber's body, storable and bounded (`sanitize`).
    pub response_excerpt: Option<String>,
    /// The start of the body sent, when a transformation made it (bounded like the
    /// response's); `None`: the event's body was sent as it is.
    pub sent_excerpt: Option<String>,
    /// When the next attempt is due (retries only).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// `backoff` or `retry_after` (retries only).
    pub next_attempt_reason: Option<crate::deliver::policy::NextReason>,
    /// The delivery's endpoint.
    pub endpoint_id: EndpointId,
    /// Whether the delivery is in an ordering line ([`Claimed::ordered`](super::Claimed::ordered)): the recorder
    /// then moves its line on when the outcome finishes it ([`lines::release_heads`]).
    pub ordered: bool,
}

/// What [`record`] did with a batch.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// Outcomes written by this call.
    pub fresh: Vec<DeliveryId>,
    /// Outcomes whose attempt was already on record: an earlier write of the same batch
    /// committed although its caller saw an error (an ambiguous commit). Nothing was
    /// written again.
    pub already: Vec<DeliveryId>,
    /// Deliveries this call made their lines' heads (the outcomes finished the heads
    /// before them): claimable now.
    pub promoted: Vec<DeliveryId>,
    /// Endpoints of the outcomes written now whose circuit was not at rest when read
    /// (failures on record, or open): the circuit's update must look at them
    /// ([`RECORD_SQL`]).
    pub unsettled: Vec<EndpointId>,
}

/// Record a batch of outcomes, each fenced by its claim token, in one statement.
///
/// Idempotent per claim: an outcome whose claim token is already the delivery's
/// `recorded_token` is reported in [`Recorded::already`] and not written again, so
/// retrying a batch after an ambiguous commit neither records an attempt twice nor calls
/// it fenced. Any other id
/// of the batch that is in neither list was fenced (its lease was taken over by a newer
/// claim) and nothing about it was written.
///
/// An ordered delivery that this call finishes (delivered, or dead) moves its line on in
/// the same transaction: the outcome statement releases the line ([`RECORD_SQL`]) and
/// [`lines::promote`] makes its next delivery the head. When the batch holds one and
/// `conn` is not in a transaction, this call opens one (in the caller's transaction it
/// adds no savepoint). A batch that finishes no head is one statement.
///
/// Refused with a [`Broken`] invariant when the batch holds a delivery twice
/// ([`invariants::ONE_OUTCOME_PER_CLAIM`], before anything is written) or the statement
/// reports what the batch does not hold ([`invariants::RECORDED_FROM_BATCH`]): the
/// recorder's transaction then rolls back.
pub async fn record<R: std::borrow::Borrow<AttemptRecord>>(
    conn: &mut sqlx::PgConnection,
    batch: &[R],
) -> Result<Recorded, sqlx::Error> {
    use sqlx::Connection as _;
    if batch.is_empty() {
        return Ok(Recorded::default());
    }
    // A batch that finishes ordered heads releases their lines in its statement and
    // promotes their next heads in another: one transaction, so the lines stay locked
    // in between. Inside the caller's transaction (the recorder's) that adds no
    // savepoint: an error ends that transaction anyway, and a savepoint cost two of an
    // ordered write's round trips.
    let finishes_heads = batch.iter().any(|r| r.borrow().ordered && r.borrow().outcome != Outcome::Retry);
    if !finishes_heads || conn.is_in_transaction() {
        return record_moving_lines(conn, batch).await;
    }
    let mut tx = conn.begin_with(crate::db::DIRECT_BEGIN).await?;
    let recorded = record_moving_lines(&mut tx, batch).await?;
    tx.commit().await?;
    Ok(recorded)
}

/// [`record`]'s statements: the outcomes (which release the lines of the heads they
/// finish), then the promotion of those lines' next heads, when there are any.
async fn record_moving_lines<R: std::borrow::Borrow<AttemptRecord>>(
    conn: &mut sqlx::PgConnection,
    batch: &[R],
) -> Result<Recorded, sqlx::Error> {
    let (recorded, released) = record_releasing(&mut *conn, batch).await?;
    let promoted = lines::promote(conn, &released).await?;
    Ok(Recorded { promoted, ..recorded })
}

/// [`record`]'s first statement alone, for a caller that moves the lines on itself: the
/// outcomes written, and the lines whose heads they finished, released (locked until the
/// transaction ends). The caller promotes their next heads ([`lines::promote`],
/// [`lines::promote_leasing`]) in a later statement of the same transaction, before it
/// commits: a released line left unpromoted would stall. Refused as [`record`] is.
pub async fn record_releasing<R: std::borrow::Borrow<AttemptRecord>>(
    conn: &mut sqlx::PgConnection,
    batch: &[R],
) -> Result<(Recorded, Vec<lines::Line>), sqlx::Error> {
    if batch.is_empty() {
        return Ok(Default::default());
    }
    let ids =
        invariants::distinct_set(batch.iter().map(|r| r.borrow().delivery_id), invariants::ONE_OUTCOME_PER_CLAIM)?;
    let (recorded, released) = record_outcomes(&mut *conn, batch).await?;
    recorded_from(&ids, &recorded)?;
    Ok((recorded, released))
}

/// [`invariants::RECORDED_FROM_BATCH`]: every delivery `recorded` reports is one of
/// the batch's (`ids`), reported once, as written or as already written.
pub fn recorded_from(ids: &std::collections::HashSet<DeliveryId>, recorded: &Recorded) -> Result<(), Broken> {
    let stray = recorded.fresh.iter().chain(&recorded.already).find(|id| !ids.contains(id));
    invariants::ensure(stray.is_none(), invariants::RECORDED_FROM_BATCH, || {
        format!("{stray:?} reported recorded but not in the batch")
    })?;
    invariants::distinct(recorded.fresh.iter().chain(&recorded.already), invariants::RECORDED_FROM_BATCH)
}

/// The statement of [`record`]'s outcomes (`$1` ids, `$2` claim tokens, `$3` attempt
/// numbers, `$4` start times, `$5` durations, `$6` status codes, `$7` error kinds, `$8`
/// outcomes, `$9` statuses, `$10` reasons, `$11` response excerpts, `$12` next attempt
/// times, `$13` their reasons, `$14` sent excerpts), public so `tests/it/plans.rs` holds
/// its plans to the backlog. Each row it returns is `(kind, id, ordering_key)`:
///
/// - `fresh`, a delivery: its outcome written now;
/// - `already`, a delivery: its outcome was on record (`prior` reads the statement's
///   snapshot, before `upd`: the rows an earlier write of this same claim recorded);
/// - `released`, an endpoint and an ordering key: a line whose head this write finished
///   (delivered, or dead without blocking it), locked until the transaction ends, as
///   [`lines::release_heads`] would in a statement of its own: [`record`] then promotes
///   its next head, in a later statement, whose snapshot sees every delivery that joined
///   the line before the lock;
/// - `unsettled`, an endpoint of an outcome written now whose circuit is not at rest
///   (`circuit::sql::circuit_unsettled`): read, not locked. The recorder runs the
///   circuit's update only when some endpoint is unsettled or its batch saw a failure
///   or a probe; outcomes that saw only healthy attempts change no settled circuit. An
///   endpoint that becomes unsettled after this snapshot (a failure another replica
///   commits meanwhile) is not reset by these successes: as if they had been observed
///   just before that failure, an order the two could have had.
///
/// Both folded in here to spare the recorder's transaction a round trip each (a
/// statement of its own for the release, one for the circuits' read): on a host whose
/// cores are busy, each round trip is a wait for the scheduler on both sides.
/// Only `deliveries` is read by primary key from the batch; `order_lines` and
/// `endpoints` by theirs, from the written rows. `attempts_once` (one row per delivery
/// and attempt number) backs up `prior`.
pub const RECORD_SQL: &str = concat!(
    "WITH o AS (
         SELECT * FROM unnest($1::uuid[], $2::int8[], $3::int4[], $4::timestamptz[], $5::int4[],
                              $6::int4[], $7::text[], $8::text[], $9::text[], $10::text[], $11::text[],
                              $12::timestamptz[], $13::text[], $14::text[])
             AS o(id, token, attempt, started_at, duration_ms, status_code, error_kind, outcome,
                  status, reason, excerpt, next_at, next_why, sent)
     ), upd AS (
         UPDATE deliveries d
         SET status = o.status,
             next_attempt_at = COALESCE(o.next_at, d.next_attempt_at),
             leased_until = NULL,
             recorded_token = o.token,
             dead_reason = CASE WHEN o.status = 'dead' THEN o.reason END,
             finished_at = CASE WHEN o.status = 'pending' THEN NULL ELSE now() END,
             updated_at = now()
         FROM o
         WHERE d.id = o.id AND d.claim_token = o.token AND d.status = 'pending'
           AND d.recorded_token IS DISTINCT FROM o.token
         RETURNING d.id, d.endpoint_id, d.ordering_key, d.status, d.blocks_on_dead,
                   o.attempt, o.started_at, o.duration_ms, o.status_code, o.error_kind, o.outcome,
                   o.reason, o.excerpt, o.next_at, o.next_why, o.sent
     ), ins AS (
         -- From `upd` alone, which carries the outcome: joined back to `o`, under the
         -- recorder's settings (no hash join), each written row rescanned the whole
         -- batch (65,280 rows dropped by the join filter for 256 outcomes, half the
         -- statement's time).
         INSERT INTO attempts (delivery_id, attempt_number, started_at, duration_ms, status_code, error_kind,
                               outcome, reason, response_excerpt, next_attempt_at, next_attempt_reason,
                               sent_excerpt)
         SELECT upd.id, upd.attempt, upd.started_at, upd.duration_ms, upd.status_code, upd.error_kind,
                upd.outcome, upd.reason, upd.excerpt, upd.next_at, upd.next_why, upd.sent
         FROM upd
         RETURNING delivery_id
     ), prior AS (
         SELECT o.id FROM o JOIN deliveries d ON d.id = o.id
         WHERE d.claim_token = o.token AND d.recorded_token = o.token
     ), released AS (
         SELECT l.endpoint_id, l.ordering_key FROM upd ",
    lines::lines_released_by!("upd"),
    "
     ), unsettled AS (
         SELECT e.id FROM (SELECT DISTINCT endpoint_id FROM upd) u
         CROSS JOIN LATERAL (
             SELECT e.id FROM endpoints e WHERE e.id = u.endpoint_id AND ",
    crate::circuit::sql::circuit_unsettled!("e"),
    "
             LIMIT 1
         ) e
     )
     SELECT 'fresh' AS kind, delivery_id AS id, NULL::text AS ordering_key FROM ins
     UNION ALL
     SELECT 'already', id, NULL FROM prior
     UNION ALL
     SELECT 'released', endpoint_id, ordering_key FROM released
     UNION ALL
     SELECT 'unsettled', id, NULL FROM unsettled"
);

/// The outcomes of [`record`], in one statement; with the lines they released.
async fn record_outcomes<R: std::borrow::Borrow<AttemptRecord>>(
    db: impl PgExecutor<'_>,
    batch: &[R],
) -> Result<(Recorded, Vec<lines::Line>), sqlx::Error> {
    fn col<'a, R: std::borrow::Borrow<AttemptRecord>, T>(batch: &'a [R], f: impl Fn(&'a AttemptRecord) -> T) -> Vec<T> {
        batch.iter().map(|r| f(r.borrow())).collect()
    }
    let ids: Vec<DeliveryId> = col(batch, |r| r.delivery_id);
    let tokens: Vec<i64> = col(batch, |r| r.claim_token);
    let attempts: Vec<i32> = col(batch, |r| r.attempt);
    let started: Vec<DateTime<Utc>> = col(batch, |r| r.started_at);
    let durations: Vec<i32> = col(batch, |r| r.duration_ms);
    let codes: Vec<Option<i32>> = col(batch, |r| r.status_code);
    let kinds: Vec<Option<crate::egress::ErrorKind>> = col(batch, |r| r.error_kind);
    let outcomes: Vec<&str> = col(batch, |r| r.outcome.as_str());
    let statuses: Vec<&str> = col(batch, |r| r.outcome.status().as_str());
    let reasons: Vec<&str> = col(batch, |r| r.reason.as_str());
    let excerpts: Vec<Option<&str>> = col(batch, |r| r.response_excerpt.as_deref());
    let sent: Vec<Option<&str>> = col(batch, |r| r.sent_excerpt.as_deref());
    let next_at: Vec<Option<DateTime<Utc>>> = col(batch, |r| r.next_attempt_at);
    let next_why: Vec<Option<&str>> = col(batch, |r| r.next_attempt_reason.map(|why| why.as_str()));

    let rows: Vec<(String, uuid::Uuid, Option<String>)> = crate::db::query_as(RECORD_SQL)
        .bind(ids)
        .bind(tokens)
        .bind(attempts)
        .bind(started)
        .bind(durations)
        .bind(codes)
        .bind(kinds)
        .bind(outcomes)
        .bind(statuses)
        .bind(reasons)
        .bind(excerpts)
        .bind(next_at)
        .bind(next_why)
        .bind(sent)
        .fetch_all(db)
        .await?;
    let mut recorded = Recorded::default();
    let mut released = Vec::new();
    for (kind, id, ordering_key) in rows {
        match (kind.as_str(), ordering_key) {
            ("fresh", _) => recorded.fresh.push(DeliveryId(id)),
            ("already", _) => recorded.already.push(DeliveryId(id)),
            ("released", Some(key)) => released.push((EndpointId(id), key)),
            ("unsettled", _) => recorded.unsettled.push(EndpointId(id)),
            (kind, key) => invariants::ensure(false, invariants::RECORDED_FROM_BATCH, || {
                format!("the outcome write returned a row it does not write: {kind} {id} {key:?}")
            })?,
        }
    }
    Ok((recorded, released))
}

/// Give a claim back without spending its attempt (e.g. the circuit opened between the
/// claim and the send, or the process is shutting down before it sent anything).
/// Fenced like [`record`], and idempotent like it: the release marks the claim's token
/// recorded, so a release run again (a retry after a commit that went unconfirmed) gives
/// the attempt back once, not twice (which sent the next attempt with a number already
/// recorded, whose outcome then could not be recorded). Returns whether the claim is
/// given back: by this call or by an earlier one with the same token.
pub async fn release(
    db: impl PgExecutor<'_>,
    id: DeliveryId,
    claim_token: i64,
    due_at: DateTime<Utc>,
) -> Result<bool, sqlx::Error> {
    crate::db::query_scalar(RELEASE_SQL).bind(id).bind(claim_token).bind(due_at).fetch_one(db).await
}

/// [`release`]'s statement. The second `EXISTS` reads the snapshot from before the
/// `UPDATE`: it finds the mark only when an earlier release left it.
const RELEASE_SQL: &str = "WITH given_back AS (
         UPDATE deliveries
         SET attempt_count = attempt_count - 1, next_attempt_at = $3, leased_until = NULL,
             recorded_token = $2, updated_at = now()
         WHERE id = $1 AND claim_token = $2 AND status = 'pending' AND recorded_token IS DISTINCT FROM $2
         RETURNING 1)
     SELECT EXISTS (SELECT 1 FROM given_back)
         OR EXISTS (SELECT 1 FROM deliveries WHERE id = $1 AND claim_token = $2 AND recorded_token = $2
                    AND status = 'pending' AND leased_until IS NULL)";

/// Whether the claim being buried sent its attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Burial {
    /// Nothing was sent under this claim (the budget was spent by attempts whose
    /// workers died holding the lease): the claim's attempt is given back.
    Unsent,
    /// The attempt was sent but its outcome cannot be written at all (the recorder's
    /// last resort): without the burial the lease would bring the delivery back, it
    /// would be sent again and fail to record again, forever. An operator can redeliver.
    Unrecordable,
}

/// Dead-letter a claimed delivery with `reason`, fenced like [`record`]. Returns whether
/// it applied.
pub async fn bury(
    pool: &crate::db::Pool,
    id: DeliveryId,
    claim_token: i64,
    reason: &str,
    burial: Burial,
) -> Result<bool, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let done = crate::db::query(
        "UPDATE deliveries
         SET status = 'dead', attempt_count = attempt_count - $4, dead_reason = $3, leased_until = NULL,
             finished_at = now(), updated_at = now()
         WHERE id = $1 AND claim_token = $2 AND status = 'pending'",
    )
    .bind(id)
    .bind(claim_token)
    .bind(reason)
    .bind(i32::from(burial == Burial::Unsent))
    .execute(&mut *tx)
    .await?;
    // A dead head of a line that skips the dead lets the next one go.
    let released = lines::release_heads(&mut tx, &[id]).await?;
    lines::promote(&mut tx, &released).await?;
    tx.commit().await?;
    Ok(done.rows_affected() == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(n: u128) -> AttemptRecord {
        AttemptRecord {
            delivery_id: DeliveryId(uuid::Uuid::from_u128(n)),
            claim_token: 1,
            attempt: 1,
            endpoint_id: EndpointId(uuid::Uuid::from_u128(100)),
            started_at: Utc::now(),
            duration_ms: 1,
            status_code: Some(200),
            error_kind: None,
            outcome: Outcome::Delivered,
            reason: "HTTP 200".into(),
            response_excerpt: None,
            sent_excerpt: None,
            next_attempt_at: None,
            next_attempt_reason: None,
            ordered: false,
        }
    }

    fn id(n: u128) -> DeliveryId {
        DeliveryId(uuid::Uuid::from_u128(n))
    }

    /// [`recorded_from`] passes a report of the batch's own deliveries, each once, and
    /// trips on a delivery the batch does not hold, or one reported twice (in one list or
    /// in both).
    #[test]
    fn a_record_reports_only_its_batch_each_once() {
        let batch: std::collections::HashSet<DeliveryId> =
            [record(1), record(2), record(3)].iter().map(|r| r.delivery_id).collect();
        let ok = Recorded { fresh: vec![id(1), id(3)], already: vec![id(2)], ..Default::default() };
        assert_eq!(recorded_from(&batch, &ok), Ok(()));
        for (what, bad) in [
            ("not in the batch", Recorded { fresh: vec![id(1), id(4)], already: vec![], ..Default::default() }),
            ("twice as written", Recorded { fresh: vec![id(1), id(1)], already: vec![], ..Default::default() }),
            (
                "written and already written",
                Recorded { fresh: vec![id(2)], already: vec![id(2)], ..Default::default() },
            ),
        ] {
            let broken = recorded_from(&batch, &bad).expect_err(what);
            assert_eq!(broken.invariant, invariants::RECORDED_FROM_BATCH, "{what}");
        }
    }
}
