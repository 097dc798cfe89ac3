//! The queue: the `deliveries` table and every statement that touches it.
//!
//! - [`claim`]: one statement picks due rows with `FOR UPDATE SKIP LOCKED`, moves them onto
//!   a lease (`next_attempt_at = now() + lease`), bumps their fencing token and attempt
//!   count, and returns what a worker needs to send them. Concurrent claimers get
//!   disjoint rows; there is no "in progress" status a crash could strand: an abandoned
//!   claim is simply due again when its lease ends.
//! - [`record`]: outcomes are written with `WHERE claim_token = $token`; a worker whose
//!   lease was taken over matches zero rows and its result is dropped (fenced).

pub mod lines;
pub mod read;

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use crate::ids::{DeliveryId, EndpointId, EventId};

/// A claimed delivery: everything needed to send it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Claimed {
    /// Delivery id (its `webhook-id` derives from it).
    pub id: DeliveryId,
    /// The event whose body is sent.
    pub event_id: EventId,
    /// Where it goes (and whose circuit the attempt informs).
    pub endpoint_id: EndpointId,
    /// This attempt's number (1-based), already counted.
    pub attempt: i32,
    /// Attempts spent before the last manual redelivery (the budget counts from here).
    pub attempts_base: i32,
    /// Fencing token of this claim.
    pub claim_token: i64,
    /// The endpoint's URL as stored (checked again by egress before sending).
    pub url: String,
    /// The endpoint's current signing secret, as stored (sealed when a secrets key is set).
    pub secret: String,
    /// The secrets it replaced whose rotation grace periods still last (newest first).
    pub previous_secrets: Vec<String>,
    /// Sent as `webhook-event-type`.
    pub event_type: String,
    /// Sent as `webhook-source`.
    pub source_name: String,
    /// The producer's content type, replayed (`application/json` when absent).
    pub content_type: Option<String>,
    /// The body exactly as it was received.
    // Shared, not copied, by each attempt's request body (and its memory bound).
    #[sqlx(try_from = "Vec<u8>")]
    pub payload: bytes::Bytes,
    /// Whether the delivery is in an ordering line (its outcome may move the line on).
    pub ordered: bool,
    /// Set when this attempt is its endpoint's half-open probe: the probe's fencing token.
    pub probe_token: Option<i64>,
    /// The event's stored W3C `traceparent` (the producer's or the ingest span's), which
    /// the attempt's span links to.
    pub traceparent: Option<String>,
    /// The `tracestate` stored with it.
    pub tracestate: Option<String>,
}

/// Columns a worker needs, from the claimed delivery `d`, its event `e`, endpoint `ep`
/// and source `s`.
const CLAIMED_COLUMNS: &str = "d.id, d.event_id, d.endpoint_id, d.attempt_count AS attempt, d.attempts_base, \
     d.claim_token, ep.url, ep.secret, \
     CASE WHEN cardinality(ep.previous_secrets) = 0 THEN ARRAY[]::text[] \
          ELSE ARRAY(SELECT p.s FROM unnest(ep.previous_secrets, ep.previous_secrets_until) AS p(s, u) \
                     WHERE p.u > now() ORDER BY p.u DESC) END AS previous_secrets, \
     e.event_type, s.name AS source_name, e.content_type, e.payload, d.ordering_key IS NOT NULL AS ordered, \
     e.traceparent, e.tracestate";

/// How a claim shares the workers among endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fairness {
    /// Concurrent requests an endpoint without its own `max_in_flight` may have, across
    /// every replica (`--endpoint-max-in-flight`).
    pub default_max_in_flight: i32,
    /// Also look at every runnable endpoint with due work, not only those at the head of
    /// the due index (the dispatcher's housekeeping tick sets it): an endpoint whose due
    /// deliveries sit behind another's capped backlog is served within one tick.
    pub sweep: bool,
}

/// The default of [`Fairness::default_max_in_flight`] when no worker count is known.
pub const DEFAULT_MAX_IN_FLIGHT: i32 = 32;

/// The default per-endpoint cap for a process with `workers` delivery workers: half of
/// them, so one endpoint, however slow, leaves the other half to everyone else.
pub fn default_max_in_flight(workers: usize) -> i32 {
    i32::try_from(workers / 2).unwrap_or(i32::MAX).max(1)
}

impl Default for Fairness {
    fn default() -> Self {
        Fairness { default_max_in_flight: DEFAULT_MAX_IN_FLIGHT, sweep: false }
    }
}

/// Due rows the claim looks at to find the endpoints it serves (besides a sweep):
/// twice the batch, so a batch is filled even when half the head is one capped endpoint.
const HEAD_WINDOW_FACTOR: i64 = 2;

/// Claim up to `limit` due deliveries for `lease`, fairly, with the default
/// [`Fairness`] (tests and tools).
pub async fn claim(pool: &sqlx::PgPool, limit: i64, lease: Duration) -> Result<Vec<Claimed>, sqlx::Error> {
    claim_fair(pool, limit, lease, Fairness::default()).await
}

/// Claim up to `limit` due deliveries for `lease`, each endpoint within its limits, in
/// turns across endpoints. One transaction of two statements:
///
/// 1. **Which endpoints** ([`CLAIM_LOCK_SQL`]): those owning the first `2 × limit` due
///    rows (the head of `deliveries_due`), plus, on a sweep, every runnable endpoint with
///    a due row (one probe each on `deliveries_endpoint_unparked`); only runnable ones
///    (circuit closed, not paused, not deleted: blocked endpoints' rows are parked by
///    [`park_blocked`]). Their rows are locked `FOR NO KEY UPDATE` in id order, so
///    concurrent claimers of one endpoint take turns.
/// 2. **The claim** ([`claim_sql`]), under those locks and with a snapshot taken after
///    them, so it sees every lease another claimer committed before letting go: each
///    endpoint's room is its `max_in_flight` (or the default) minus its live leases
///    (`deliveries_in_flight`; a crashed worker's lease stops counting when it runs out),
///    and, with a rate limit, the whole tokens in its bucket. Up to its room (and its
///    share of the claim, `limit` / endpoints with room, rounded up) per endpoint,
///    oldest due first, `SKIP LOCKED`; then in turns (every endpoint's first row before
///    anyone's second), at most `limit`. The rows go onto the lease (`claim_token` + 1,
///    `attempt_count` + 1) and rate-limited endpoints pay their tokens.
///
/// (One statement cannot do both: under READ COMMITTED a statement that waits for a row
/// lock keeps its older snapshot for everything else, so it would count another
/// claimer's fresh leases as free room.)
///
/// An endpoint at its limit is simply not claimed: its rows spend no attempt and keep
/// their place in line (their due time does not move).
pub async fn claim_fair(
    pool: &sqlx::PgPool,
    limit: i64,
    lease: Duration,
    fairness: Fairness,
) -> Result<Vec<Claimed>, sqlx::Error> {
    Ok(claim_batch(pool, limit, lease, fairness).await?.claimed)
}

/// What one claim took, and what it saw of the due work.
#[derive(Debug, Default)]
pub struct ClaimBatch {
    /// The deliveries now leased to the caller.
    pub claimed: Vec<Claimed>,
    /// Due rows in the head window (at most `head_window`).
    pub head_rows: i64,
    /// How many due rows the head window could hold.
    pub head_window: i64,
}

impl ClaimBatch {
    /// Whether this claim took every row that was due when it looked: the head window
    /// was not full, so it held every due row, and all of them were claimed. Another
    /// claim now, sweep or not, would find only what arrived since.
    pub fn took_all_due(&self) -> bool {
        self.head_rows < self.head_window && self.claimed.len() as i64 >= self.head_rows
    }
}

/// [`claim_fair`], also telling what the claim saw ([`ClaimBatch::took_all_due`]).
pub async fn claim_batch(
    pool: &sqlx::PgPool,
    limit: i64,
    lease: Duration,
    fairness: Fairness,
) -> Result<ClaimBatch, sqlx::Error> {
    let window = limit * HEAD_WINDOW_FACTOR;
    let mut tx = pool.begin().await?;
    let (endpoints, head_rows): (Vec<EndpointId>, i64) =
        sqlx::query_as(CLAIM_LOCK_SQL).bind(window).bind(fairness.sweep).fetch_one(&mut *tx).await?;
    if endpoints.is_empty() {
        tx.commit().await?;
        return Ok(ClaimBatch { claimed: Vec::new(), head_rows, head_window: window });
    }
    crate::db::plan_each_time(&mut tx).await?;
    let claimed = sqlx::query_as(claim_sql())
        .bind(limit)
        .bind(lease.as_secs_f64())
        .bind(fairness.default_max_in_flight)
        .bind(&endpoints)
        .fetch_all(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(ClaimBatch { claimed, head_rows, head_window: window })
}

/// The first statement of a claim (`$1` head window, `$2` sweep): lock the runnable
/// endpoints it will serve. One row: those endpoints' ids, in id order, and how many due
/// rows the head window held.
pub const CLAIM_LOCK_SQL: &str = "WITH head AS (
         SELECT d.endpoint_id FROM deliveries d
         WHERE d.status = 'pending' AND NOT d.parked AND NOT d.waiting AND d.next_attempt_at <= now()
         ORDER BY d.next_attempt_at
         LIMIT $1
     ), swept AS (
         -- One index probe per runnable endpoint (LATERAL ... LIMIT 1: a generic plan
         -- cannot turn it into a scan of every pending row, as it did an EXISTS).
         SELECT ep.id AS endpoint_id FROM endpoints ep
         CROSS JOIN LATERAL (
             SELECT 1 FROM deliveries d
             WHERE d.endpoint_id = ep.id AND d.status = 'pending' AND NOT d.parked AND NOT d.waiting
               AND d.next_attempt_at <= now()
             ORDER BY d.next_attempt_at
             LIMIT 1
         ) due
         WHERE $2 AND ep.circuit_state = 'closed' AND NOT ep.paused AND ep.deleted_at IS NULL
     ), locked AS (
         SELECT ep.id FROM endpoints ep
         WHERE ep.id IN (SELECT endpoint_id FROM head UNION SELECT endpoint_id FROM swept)
           AND ep.circuit_state = 'closed' AND NOT ep.paused AND ep.deleted_at IS NULL
         ORDER BY ep.id
         FOR NO KEY UPDATE OF ep
     )
     SELECT ARRAY(SELECT id FROM locked ORDER BY id), (SELECT count(*) FROM head)";

/// The claim itself (`$1` limit, `$2` lease in seconds, `$3` default max in flight, `$4`
/// the endpoints [`CLAIM_LOCK_SQL`] locked), public so tests and the benchmark run exactly
/// what workers run.
pub fn claim_sql() -> &'static str {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(claim_sql_text);
    &SQL
}

fn claim_sql_text() -> String {
    format!(
        "WITH room_n AS (
             SELECT ep.id, ep.rate_limit_per_sec, tokens.now AS tokens,
                    LEAST($1,
                          COALESCE(ep.max_in_flight, $3)
                          - (SELECT count(*) FROM deliveries f
                             WHERE f.endpoint_id = ep.id AND f.status = 'pending'
                               AND f.leased_until IS NOT NULL AND f.leased_until > now()),
                          CASE WHEN ep.rate_limit_per_sec IS NULL THEN $1 ELSE floor(tokens.now) END) AS n
             FROM endpoints ep CROSS JOIN LATERAL (
                 SELECT LEAST(ep.rate_limit_burst::float8,
                              COALESCE(ep.rate_tokens, ep.rate_limit_burst)
                              + extract(epoch FROM now() - COALESCE(ep.rate_tokens_at, now()))
                                * ep.rate_limit_per_sec) AS now
             ) tokens
             WHERE ep.id = ANY($4)
         ), room AS (
             -- Each endpoint's share of this claim: with k endpoints that have room, no
             -- endpoint can get more than about $1 / k of the rows in turns, so only that
             -- many are looked at and locked (not up to $1 of each: with 1,000 endpoints
             -- that was 100,000 rows locked for a claim of 128).
             SELECT room_n.*,
                    ceil($1::float8 / GREATEST(count(*) FILTER (WHERE room_n.n > 0) OVER (), 1)) AS share
             FROM room_n
         ), picked AS (
             SELECT p.id, p.next_attempt_at,
                    row_number() OVER (PARTITION BY room.id ORDER BY p.next_attempt_at) AS turn
             FROM room CROSS JOIN LATERAL (
                 SELECT d.id, d.next_attempt_at FROM deliveries d
                 WHERE d.endpoint_id = room.id AND d.status = 'pending' AND NOT d.parked AND NOT d.waiting
                   AND d.next_attempt_at <= now()
                 ORDER BY d.next_attempt_at
                 LIMIT GREATEST(LEAST(room.n, room.share), 0)
                 FOR UPDATE SKIP LOCKED
             ) p
         ), due AS (
             SELECT id FROM picked ORDER BY turn, next_attempt_at LIMIT $1
         ), claimed AS (
             -- `= ANY(ARRAY(...))`: the rows are fetched by primary key whatever the
             -- planner thinks `due` holds. A generic plan estimates `LIMIT $1` as a tenth
             -- of its input, a tenth of the backlog, and at 100,000 pending that estimate
             -- turned a join with `due` into a hash join over the whole table.
             UPDATE deliveries d
             SET next_attempt_at = now() + make_interval(secs => $2),
                 leased_until = now() + make_interval(secs => $2),
                 claim_token = d.claim_token + 1,
                 attempt_count = d.attempt_count + 1,
                 updated_at = now()
             WHERE d.id = ANY(ARRAY(SELECT id FROM due))
             RETURNING d.id, d.event_id, d.endpoint_id, d.attempt_count, d.attempts_base, d.claim_token,
                       d.ordering_key
         ), paid AS (
             UPDATE endpoints ep
             SET rate_tokens = room.tokens - spent.n, rate_tokens_at = now()
             FROM room JOIN (SELECT endpoint_id, count(*) AS n FROM claimed GROUP BY endpoint_id) spent
                  ON spent.endpoint_id = room.id
             WHERE ep.id = room.id AND room.rate_limit_per_sec IS NOT NULL
         )
         SELECT {CLAIMED_COLUMNS}, NULL::int8 AS probe_token
         FROM claimed d JOIN events e ON e.id = d.event_id JOIN endpoints ep ON ep.id = d.endpoint_id
              JOIN sources s ON s.id = e.source_id"
    )
}

/// Rows one [`park_blocked`] call parks at most.
pub const PARK_BATCH: i64 = 1_000;

/// Park due deliveries of blocked endpoints (open circuit, paused): they leave the claim
/// index without spending an attempt, so a dead endpoint's backlog costs claims nothing.
/// Walks each blocked endpoint's own unparked rows (a per-endpoint partial index), so the
/// cost is the rows parked, not the queue's size. Returns how many were parked.
///
/// The blocked endpoints are read `FOR SHARE`: a circuit that closes (or an endpoint
/// resumed) while this statement runs waits for it, or is seen closed by it, so no row
/// is parked after its endpoint's backlog release has looked for parked rows.
pub async fn park_blocked(db: impl PgExecutor<'_>) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
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

/// Admit one probe for each of up to `limit` half-open endpoints: claim the endpoint row
/// (its cool-down is over and no live probe holds it) together with its oldest pending
/// delivery, parked or not. The endpoint's `probe_until` is the probe's lease, so a
/// prober that dies does not wedge the circuit; `probe_token` fences its outcome.
/// Row locks with `SKIP LOCKED` on the endpoint make this exactly one probe per window
/// across every worker and replica.
pub async fn claim_probes(db: impl PgExecutor<'_>, limit: i64, lease: Duration) -> Result<Vec<Claimed>, sqlx::Error> {
    sqlx::query_as(&format!(
        "WITH ready AS (
             SELECT id FROM endpoints
             WHERE circuit_state = 'open' AND NOT paused AND reopen_at <= now()
               AND (probe_until IS NULL OR probe_until <= now())
             ORDER BY reopen_at
             LIMIT $1
             FOR UPDATE SKIP LOCKED
         ), pick AS (
             SELECT p.id AS delivery_id, ready.id AS endpoint_id
             FROM ready CROSS JOIN LATERAL (
                 SELECT COALESCE(
                     (SELECT id FROM deliveries
                      WHERE endpoint_id = ready.id AND status = 'pending' AND parked
                      ORDER BY id LIMIT 1),
                     (SELECT id FROM deliveries
                      WHERE endpoint_id = ready.id AND status = 'pending' AND NOT parked AND NOT waiting
                        AND (leased_until IS NULL OR leased_until <= now())
                      ORDER BY next_attempt_at LIMIT 1)) AS id
             ) p
             WHERE p.id IS NOT NULL
         ), probe AS (
             UPDATE endpoints ep
             SET probe_until = now() + make_interval(secs => $2), probe_token = ep.probe_token + 1
             FROM pick WHERE ep.id = pick.endpoint_id
             RETURNING ep.id, ep.probe_token
         )
         UPDATE deliveries d
         SET parked = false,
             next_attempt_at = now() + make_interval(secs => $2),
             leased_until = now() + make_interval(secs => $2),
             claim_token = d.claim_token + 1,
             attempt_count = d.attempt_count + 1,
             updated_at = now()
         FROM pick, probe, events e, endpoints ep, sources s
         WHERE d.id = pick.delivery_id AND probe.id = pick.endpoint_id AND d.status = 'pending'
           AND e.id = d.event_id AND ep.id = d.endpoint_id AND s.id = e.source_id
         RETURNING {CLAIMED_COLUMNS}, probe.probe_token"
    ))
    .bind(limit)
    .bind(lease.as_secs_f64())
    .fetch_all(db)
    .await
}

/// What a dead delivery does to its ordering line (`subscriptions.ordered_on_dead`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::Type, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[sqlx(type_name = "text", rename_all = "lowercase")]
#[serde(rename_all = "lowercase")]
pub enum OnDead {
    /// The line waits behind it until an operator redelivers it (and it is delivered) or
    /// unblocks the line.
    Block,
    /// The line moves on to its next delivery (the dead one stays in the dead-letter queue).
    Skip,
}

/// A delivery's state (`deliveries.status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::Type, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[sqlx(type_name = "text", rename_all = "lowercase")]
#[serde(rename_all = "lowercase")]
pub enum DeliveryStatus {
    /// Waiting for an attempt (due, leased, retrying or parked).
    Pending,
    /// A 2xx was recorded.
    Delivered,
    /// Dead-lettered: no more automatic attempts.
    Dead,
}

impl DeliveryStatus {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Dead => "dead",
        }
    }
}

/// Final or intermediate state after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// 2xx: done.
    Delivered,
    /// Try again at `next_attempt_at`.
    Retry,
    /// Dead-lettered: no more automatic attempts.
    Dead,
}

impl Outcome {
    /// Name stored in `attempts.outcome`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Delivered => "delivered",
            Outcome::Retry => "retry",
            Outcome::Dead => "dead",
        }
    }

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
    pub error_kind: Option<String>,
    /// What happens to the delivery next.
    pub outcome: Outcome,
    /// Human-readable reason, stored with the attempt (and as the dead reason); bounded.
    pub reason: String,
    /// The start of the subscriber's body, storable and bounded (`sanitize`).
    pub response_excerpt: Option<String>,
    /// When the next attempt is due (retries only).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// `backoff` or `retry_after` (retries only).
    pub next_attempt_reason: Option<String>,
    /// The delivery's endpoint.
    pub endpoint_id: EndpointId,
    /// Whether the delivery is in an ordering line ([`Claimed::ordered`]): the recorder
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
/// the same transaction ([`lines::release_heads`], [`lines::promote`]); when the batch
/// holds one and `conn` is not in a transaction, this call opens one.
pub async fn record<R: std::borrow::Borrow<AttemptRecord>>(
    conn: &mut sqlx::PgConnection,
    batch: &[R],
) -> Result<Recorded, sqlx::Error> {
    use sqlx::Connection as _;
    if batch.is_empty() {
        return Ok(Recorded::default());
    }
    if !batch.iter().any(|r| r.borrow().ordered && r.borrow().outcome != Outcome::Retry) {
        return record_outcomes(conn, batch).await;
    }
    let mut tx = conn.begin().await?;
    let recorded = record_outcomes(&mut *tx, batch).await?;
    let finished: Vec<DeliveryId> = batch
        .iter()
        .map(|r| r.borrow())
        .filter(|r| r.ordered && r.outcome != Outcome::Retry && recorded.fresh.contains(&r.delivery_id))
        .map(|r| r.delivery_id)
        .collect();
    let released = lines::release_heads(&mut tx, &finished).await?;
    lines::promote(&mut tx, &released).await?;
    tx.commit().await?;
    Ok(recorded)
}

/// The outcomes of [`record`], in one statement.
async fn record_outcomes<R: std::borrow::Borrow<AttemptRecord>>(
    db: impl PgExecutor<'_>,
    batch: &[R],
) -> Result<Recorded, sqlx::Error> {
    fn col<'a, R: std::borrow::Borrow<AttemptRecord>, T>(batch: &'a [R], f: impl Fn(&'a AttemptRecord) -> T) -> Vec<T> {
        batch.iter().map(|r| f(r.borrow())).collect()
    }
    let ids: Vec<DeliveryId> = col(batch, |r| r.delivery_id);
    let tokens: Vec<i64> = col(batch, |r| r.claim_token);
    let attempts: Vec<i32> = col(batch, |r| r.attempt);
    let started: Vec<DateTime<Utc>> = col(batch, |r| r.started_at);
    let durations: Vec<i32> = col(batch, |r| r.duration_ms);
    let codes: Vec<Option<i32>> = col(batch, |r| r.status_code);
    let kinds: Vec<Option<&str>> = col(batch, |r| r.error_kind.as_deref());
    let outcomes: Vec<&str> = col(batch, |r| r.outcome.as_str());
    let statuses: Vec<&str> = col(batch, |r| r.outcome.status().as_str());
    let reasons: Vec<&str> = col(batch, |r| r.reason.as_str());
    let excerpts: Vec<Option<&str>> = col(batch, |r| r.response_excerpt.as_deref());
    let next_at: Vec<Option<DateTime<Utc>>> = col(batch, |r| r.next_attempt_at);
    let next_why: Vec<Option<&str>> = col(batch, |r| r.next_attempt_reason.as_deref());

    // `prior` reads the statement's snapshot, before `upd`: the rows an earlier write of
    // this same claim recorded. Only `deliveries` is read, by primary key; `attempts_once`
    // (one row per delivery and attempt number) backs it up.
    let rows: Vec<(DeliveryId, bool)> = sqlx::query_as(
        "WITH o AS (
             SELECT * FROM unnest($1::uuid[], $2::int8[], $3::int4[], $4::timestamptz[], $5::int4[],
                                  $6::int4[], $7::text[], $8::text[], $9::text[], $10::text[], $11::text[],
                                  $12::timestamptz[], $13::text[])
                 AS o(id, token, attempt, started_at, duration_ms, status_code, error_kind, outcome,
                      status, reason, excerpt, next_at, next_why)
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
             RETURNING d.id
         ), ins AS (
             INSERT INTO attempts (delivery_id, attempt_number, started_at, duration_ms, status_code, error_kind,
                                   outcome, reason, response_excerpt, next_attempt_at, next_attempt_reason)
             SELECT o.id, o.attempt, o.started_at, o.duration_ms, o.status_code, o.error_kind, o.outcome,
                    o.reason, o.excerpt, o.next_at, o.next_why
             FROM o JOIN upd ON upd.id = o.id
             RETURNING delivery_id
         ), prior AS (
             SELECT o.id FROM o JOIN deliveries d ON d.id = o.id
             WHERE d.claim_token = o.token AND d.recorded_token = o.token
         )
         SELECT delivery_id, true FROM ins
         UNION ALL
         SELECT id, false FROM prior",
    )
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
    .fetch_all(db)
    .await?;
    let mut recorded = Recorded::default();
    for (id, fresh) in rows {
        if fresh { recorded.fresh.push(id) } else { recorded.already.push(id) }
    }
    Ok(recorded)
}

/// Give a claim back without spending its attempt (e.g. the circuit opened between the
/// claim and the send, or the process is shutting down before it sent anything).
/// Fenced like [`record`]; returns whether the release applied.
pub async fn release(
    db: impl PgExecutor<'_>,
    id: DeliveryId,
    claim_token: i64,
    due_at: DateTime<Utc>,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE deliveries
         SET attempt_count = attempt_count - 1, next_attempt_at = $3, leased_until = NULL, updated_at = now()
         WHERE id = $1 AND claim_token = $2 AND status = 'pending'",
    )
    .bind(id)
    .bind(claim_token)
    .bind(due_at)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

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
    pool: &sqlx::PgPool,
    id: DeliveryId,
    claim_token: i64,
    reason: &str,
    burial: Burial,
) -> Result<bool, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let done = sqlx::query(
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

/// How many deliveries to `endpoint_id` are pending (parked ones included).
pub async fn pending_of(db: impl PgExecutor<'_>, endpoint_id: EndpointId) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE endpoint_id = $1 AND status = 'pending'")
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
    let done = sqlx::query(
        "UPDATE deliveries
         SET status = 'dead', dead_reason = $2, parked = false, leased_until = NULL,
             claim_token = claim_token + 1, finished_at = now(), updated_at = now()
         WHERE endpoint_id = $1 AND status = 'pending'",
    )
    .bind(endpoint_id)
    .bind(reason)
    .execute(&mut *conn)
    .await?;
    // Nothing of the endpoint will be sent again: its lines go too.
    sqlx::query("DELETE FROM order_lines WHERE endpoint_id = $1").bind(endpoint_id).execute(&mut *conn).await?;
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
pub async fn redeliver(pool: &sqlx::PgPool, id: DeliveryId) -> Result<bool, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let lines = lines::of(&mut tx, &[id]).await?;
    lines::lock(&mut tx, &lines).await?;
    let done = sqlx::query(
        "UPDATE deliveries d
         SET status = 'pending', attempts_base = attempt_count, next_attempt_at = now(), parked = false,
             dead_reason = NULL, finished_at = NULL, leased_until = NULL, updated_at = now()
         FROM endpoints ep
         WHERE d.id = $1 AND d.status IN ('dead', 'delivered') AND ep.id = d.endpoint_id AND ep.deleted_at IS NULL",
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
    let released: i64 = sqlx::query_scalar(
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
    pool: &sqlx::PgPool,
    endpoint_id: EndpointId,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
    per_sec: u32,
) -> Result<u64, sqlx::Error> {
    let sql = "WITH locked AS (
             SELECT id FROM deliveries
             WHERE endpoint_id = $1 AND status = 'dead' AND finished_at >= $6 AND finished_at < $7
             ORDER BY id
             LIMIT $2
             FOR UPDATE SKIP LOCKED
         ), n AS (
             SELECT id, row_number() OVER (ORDER BY id) AS rn FROM locked
         )
         UPDATE deliveries d
         SET status = 'pending', attempts_base = d.attempt_count, dead_reason = NULL, finished_at = NULL,
             leased_until = NULL, parked = false,
             next_attempt_at = $3 + (n.rn - 1 + $4) * make_interval(secs => $5),
             updated_at = now()
         FROM n WHERE d.id = n.id
         RETURNING d.id";
    let step = 1.0 / f64::from(per_sec.max(1));
    let start = Utc::now();
    let mut requeued: u64 = 0;
    loop {
        // Each batch in a transaction: recovered ordered deliveries rejoin their lines.
        let mut tx = pool.begin().await?;
        let revived: Vec<DeliveryId> = sqlx::query_scalar(sql)
            .bind(endpoint_id)
            .bind(REQUEUE_BATCH)
            .bind(start)
            .bind(requeued as i64)
            .bind(step)
            .bind(since)
            .bind(until)
            .fetch_all(&mut *tx)
            .await?;
        let lines = lines::of(&mut tx, &revived).await?;
        if !lines.is_empty() {
            // Lock after the revival: a delivery joining now sees the revived ones waiting
            // after our commit; rejoin decides in a statement that sees everything before.
            lines::lock(&mut tx, &lines).await?;
            lines::rejoin(&mut tx, &revived, &lines).await?;
        }
        tx.commit().await?;
        let done = revived.len() as u64;
        requeued += done;
        if done < REQUEUE_BATCH as u64 {
            return Ok(requeued);
        }
    }
}
