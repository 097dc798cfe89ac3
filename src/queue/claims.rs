//! Claiming due deliveries: fairly across endpoints, within each endpoint's limits, onto a
//! lease with a fresh fencing token; and the circuit's half-open probes.

use std::time::Duration;

use sqlx::PgExecutor;

use super::NEXT_CLAIM_TOKEN;
use super::claimed::{CLAIMED_COLUMNS, Claimed, EventColumns, claimed_in, leased_in};
use crate::ids::{DeliveryId, EndpointId};

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
pub async fn claim(pool: &crate::db::Pool, limit: i64, lease: Duration) -> Result<Vec<Claimed>, sqlx::Error> {
    claim_fair(pool, limit, lease, Fairness::default()).await
}

/// Claim up to `limit` due deliveries for `lease`, each endpoint within its limits, in
/// turns across endpoints. One transaction of two statements:
///
/// 1. **Which endpoints** ([`CLAIM_LOCK_SQL`]): those owning the first `2 × limit` due
///    rows (the head of `deliveries_due`), plus, on a sweep, every runnable endpoint with
///    a due row (one probe each on `deliveries_endpoint_unparked`); only runnable ones
///    (circuit closed, not paused, not deleted: blocked endpoints' rows are parked by
///    [`park_blocked`](super::park_blocked)). Their rows are locked `FOR NO KEY UPDATE` in id order, so
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
    pool: &crate::db::Pool,
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
    /// Whether some endpoint it served took all that its room (its `max_in_flight` less
    /// its live leases) or its share of the claim allowed, and not because its rate tokens
    /// ran out: due rows it left may be claimed once leases end, or by the next claim.
    /// False when every endpoint either took all it had due or was short of rate tokens:
    /// then what is left waits for time to refill the tokens, and ending leases sooner
    /// (the outcome recorder writing without its linger) would buy nothing.
    pub held_by_room: bool,
    /// When this claim spent the last whole rate token of an endpoint: how long, from the
    /// end of its statement, until the first such endpoint's bucket is full again (zero
    /// when it already is). The dispatcher claims by then rather than at its next poll, so
    /// a `burst` smaller than a poll's worth of tokens still gets the whole rate (what
    /// would overflow the bucket is lost).
    pub next_token_in: Option<Duration>,
}

impl ClaimBatch {
    /// Whether this claim took every row that was due when it looked: the head window
    /// was not full, so it held every due row, and all of them were claimed. Another
    /// claim now, sweep or not, would find only what arrived since.
    pub fn took_all_due(&self) -> bool {
        self.head_rows < self.head_window && self.claimed.len() as i64 >= self.head_rows
    }
}

/// Whether any delivery is due that a claim could take (pending, due, neither parked nor
/// waiting in its line): one probe of the head of the due index, without a transaction
/// or a lock. A claim that would find nothing costs three round trips (`BEGIN`, the
/// lock, `COMMIT`); an idle dispatcher asks this first ([`crate::deliver`]'s claim loop)
/// and claims only when it says yes. A row that comes due just after is one that came
/// due just after the claim: the next poll takes it.
pub async fn anything_due(db: impl PgExecutor<'_>) -> Result<bool, sqlx::Error> {
    crate::db::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM deliveries d
                        WHERE d.status = 'pending' AND NOT d.parked AND NOT d.waiting AND d.next_attempt_at <= now())",
    )
    .fetch_one(db)
    .await
}

/// [`claim_fair`], also telling what the claim saw ([`ClaimBatch::took_all_due`]) and why
/// it left what it left ([`ClaimBatch::held_by_room`]).
pub async fn claim_batch(
    pool: &crate::db::Pool,
    limit: i64,
    lease: Duration,
    fairness: Fairness,
) -> Result<ClaimBatch, sqlx::Error> {
    let window = limit * HEAD_WINDOW_FACTOR;
    let mut tx = pool.begin().await?;
    let (endpoints, head_rows): (Vec<EndpointId>, i64) =
        crate::db::query_as(CLAIM_LOCK_SQL).bind(window).bind(fairness.sweep).fetch_one(&mut *tx).await?;
    if endpoints.is_empty() {
        tx.commit().await?;
        return Ok(ClaimBatch { head_rows, head_window: window, ..Default::default() });
    }
    // A cached generic plan that reaches every table through indexes (`db::Planning::
    // Cached`, as the claim by key and the recorder); the lock above keeps its own plan
    // (under these settings its generic plan took 160 ms a call).
    crate::db::plan_cached(&mut tx).await?;
    let rows = crate::db::query(claim_sql())
        .bind(limit)
        .bind(lease.as_secs_f64())
        .bind(fairness.default_max_in_flight)
        .bind(&endpoints)
        .fetch_all(&mut *tx)
        .await?;
    let mut batch = general_claim_of(&rows)?;
    // Refused (rolled back) rather than sent twice at once.
    claimed_once(&batch.claimed)?;
    tx.commit().await?;
    batch.head_rows = head_rows;
    batch.head_window = window;
    Ok(batch)
}

/// The claimed deliveries in [`claim_sql`]'s rows, its `by_room` (true when it is null:
/// no endpoint was looked at, so none is known to be short of only rate tokens) and its
/// `next_token_secs`.
fn general_claim_of(rows: &[sqlx::postgres::PgRow]) -> Result<ClaimBatch, sqlx::Error> {
    Ok(ClaimBatch {
        claimed: claimed_in(rows)?,
        held_by_room: summary::<bool>(rows, "by_room")?.unwrap_or(true),
        // Past already (the statement outlasted it): now. Beyond a `Duration`: the longest.
        next_token_in: summary::<f64>(rows, "next_token_secs")?
            .map(|secs| Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or(Duration::MAX)),
        ..Default::default()
    })
}

/// A summary column of a claim's `rows` (every row carries the same value); `None` when it
/// is null or there are no rows.
fn summary<'r, T>(rows: &'r [sqlx::postgres::PgRow], column: &str) -> Result<Option<T>, sqlx::Error>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    use sqlx::Row as _;
    Ok(rows.last().map(|row| row.try_get::<Option<T>, _>(column)).transpose()?.flatten())
}

/// [`crate::invariants::CLAIMED_ONCE`] for the rows of one claim.
fn claimed_once(claimed: &[Claimed]) -> Result<(), crate::invariants::Broken> {
    crate::invariants::distinct(claimed.iter().map(|c| c.id), crate::invariants::CLAIMED_ONCE)
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
                 claim_token = d.{NEXT_CLAIM_TOKEN},
                 attempt_count = d.attempt_count + 1,
                 updated_at = now()
             WHERE d.id = ANY(ARRAY(SELECT id FROM due))
             RETURNING d.id, d.event_id, d.endpoint_id, d.attempt_count, d.attempts_base, d.claim_token,
                       d.ordering_key, d.transform_by
         ), paid AS (
             UPDATE endpoints ep
             SET rate_tokens = room.tokens - spent.n, rate_tokens_at = now()
             FROM room JOIN (SELECT endpoint_id, count(*) AS n FROM claimed GROUP BY endpoint_id) spent
                  ON spent.endpoint_id = room.id
             WHERE ep.id = room.id AND room.rate_limit_per_sec IS NOT NULL
         ), served AS (
             SELECT room.*, ep.rate_limit_burst, COALESCE(per_endpoint.n, 0) AS took,
                    COALESCE(per_endpoint.n, 0) >= LEAST(room.n, room.share) AS took_its_fill,
                    room.rate_limit_per_sec IS NOT NULL
                        AND COALESCE(per_endpoint.n, 0) >= floor(room.tokens) AS out_of_tokens
             FROM room JOIN endpoints ep ON ep.id = room.id
                  LEFT JOIN (SELECT endpoint_id, count(*) AS n FROM claimed GROUP BY endpoint_id) per_endpoint
                  ON per_endpoint.endpoint_id = room.id
         ), bound AS (
             -- Whether an endpoint took all its room or its share allowed, and not because
             -- its rate tokens ran out: what it left due may be claimed once leases end
             -- (or by the next claim). Out of tokens, only time helps: in how many seconds
             -- the bucket of one that this claim emptied is full again (its tokens are
             -- lost from then on), counted from the statement's end (clock_timestamp()),
             -- not from the transaction's start (now(), when the tokens were counted), so
             -- a claim made then never comes a moment early to a bucket not yet full.
             -- Only the claimer that took the tokens is told, so a fleet does not claim
             -- once per replica for each bucket. The rate is taken as at least one token
             -- in 10^6 s: a smaller one (the API accepts any above 0) made the division
             -- overflow and fail the claim, and any wait past the poll is the same wait.
             SELECT bool_or(took_its_fill AND NOT out_of_tokens) AS by_room,
                    min((rate_limit_burst - (tokens - took)) / GREATEST(rate_limit_per_sec, 1e-6))
                        FILTER (WHERE out_of_tokens AND took > 0)
                        - extract(epoch FROM clock_timestamp() - now())::float8 AS next_token_secs
             FROM served
         )
         -- One row at least: with nothing claimed, one whose claim columns are null.
         SELECT c.*, bound.by_room, bound.next_token_secs
         FROM bound LEFT JOIN (
             SELECT {CLAIMED_COLUMNS}, NULL::int8 AS probe_token
             FROM claimed d JOIN events e ON e.id = d.event_id JOIN endpoints ep ON ep.id = d.endpoint_id
                  JOIN sources s ON s.id = e.source_id
         ) c ON true"
    )
}

/// How a statement that leases deliveries beside its own work leases them (ingest's
/// leasing statements, `crate::store::events::insert_and_claim`; the recorder's promotion,
/// [`super::lines::promote_leasing`]): as [`claim_fresh`] would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimTerms {
    /// Most deliveries to lease (the worker slots the caller holds for them).
    pub limit: i64,
    /// The lease.
    pub lease: Duration,
    /// An endpoint's in-flight limit when it sets none.
    pub default_max_in_flight: i32,
}

/// What [`claim_fresh`] took.
#[derive(Debug, Default)]
pub struct FreshClaim {
    /// The deliveries now leased to the caller.
    pub claimed: Vec<Claimed>,
    /// Whether it took every one of the deliveries that was claimable when it looked
    /// (due, not parked, not waiting in a line). When not (an endpoint at its limit, out of
    /// rate tokens, with its circuit open or paused; another replica's claim took one
    /// first), due work may be left that only [`claim_batch`] finds.
    pub took_all: bool,
}

/// Claim those of `deliveries` (just stored by this process) that are due, up to `limit`,
/// each endpoint within its limits: the same two statements as [`claim_batch`] (the
/// endpoint locks in id order, then the claim with a snapshot taken after them), with the
/// same room, rate tokens, lease and fencing token, but reaching the rows by primary key
/// instead of through the due index.
///
/// At low load every ingest commit wakes the claim loop for a webhook or two, and there
/// a round trip costs PostgreSQL about as much as waking an idle backend, whatever the
/// statement does. So this claim is one round trip: the function
/// [`CLAIM_FRESH_FUNCTION`] (migration 0024) runs both statements, each with its own
/// snapshot, under the settings of [`Planning::Cached`](crate::db::Planning::Cached):
/// its plans are cached per session and reach every row by key (`tests/it/plans.rs`).
/// It commits by itself (one statement), so a claim that broke
/// [`crate::invariants::CLAIMED_ONCE`] is refused inside it, before the commit. That
/// commit does not wait for the WAL's flush (migration 0034): the endpoint rows it locked
/// are let go, and the attempts start, a flush sooner. A crash that loses the claim leaves
/// its rows due with their old tokens; the worker is fenced and the delivery is sent
/// again (`tests/it/lost_claims.rs`). Call it alone, never inside a wider transaction: it
/// makes the transaction it runs in asynchronous.
///
/// It does not look at older due rows: the dispatcher uses it only when its last
/// [`claim_batch`] left nothing due behind, and falls back to one whenever this claim did
/// not take everything ([`FreshClaim::took_all`]).
pub async fn claim_fresh(
    pool: &crate::db::Pool,
    deliveries: &[DeliveryId],
    limit: i64,
    lease: Duration,
    default_max_in_flight: i32,
) -> Result<FreshClaim, sqlx::Error> {
    let rows = crate::db::query(CLAIM_FRESH_SQL)
        .bind(deliveries)
        .bind(limit)
        .bind(lease.as_secs_f64())
        .bind(default_max_in_flight)
        .fetch_all(pool)
        .await?;
    fresh_claim_of(&rows)
}

/// What [`CLAIM_FRESH_FUNCTION`] returned, read from its rows (or from rows that carry its
/// columns beside others: the ingest statement that claims, `crate::store::events`).
/// Refused when it broke [`crate::invariants::CLAIMED_ONCE`].
pub(crate) fn fresh_claim_of(rows: &[sqlx::postgres::PgRow]) -> Result<FreshClaim, sqlx::Error> {
    fresh_of(rows, claimed_in(rows)?)
}

/// The [`FreshClaim`] of `claimed`, read from `rows` (whose `candidates` column says how
/// many deliveries there were to take: null where nothing was), once checked against
/// [`crate::invariants::CLAIMED_ONCE`].
fn fresh_of(rows: &[sqlx::postgres::PgRow], claimed: Vec<Claimed>) -> Result<FreshClaim, sqlx::Error> {
    let candidates = summary::<i64>(rows, "candidates")?.unwrap_or(0);
    claimed_once(&claimed)?;
    Ok(FreshClaim { took_all: claimed.len() as i64 >= candidates, claimed })
}

/// [`fresh_claim_of`] for the rows of a statement that leased deliveries of events the
/// caller holds and returns only the lease's columns (`crate::store::events`'s leasing
/// statements): each lease is completed with its event's own columns ([`EventColumns`]),
/// which `event_of` finds for a row.
pub(crate) fn fresh_lease_of<'e>(
    rows: &[sqlx::postgres::PgRow],
    event_of: impl Fn(&sqlx::postgres::PgRow) -> Result<&'e EventColumns<'e>, sqlx::Error>,
) -> Result<FreshClaim, sqlx::Error> {
    fresh_of(rows, leased_in(rows, event_of)?)
}

/// The function that claims fresh deliveries ([`claim_fresh`]); a new version of it gets
/// a new name (a release during a rolling deploy keeps calling the one it knows). Since
/// migration 0034 it commits without waiting for the WAL's flush: a claim a crash loses is
/// fenced and claimed again (`wg_claim_fresh_v3`, which calls `v2`).
pub const CLAIM_FRESH_FUNCTION: &str = "wg_claim_fresh_v3";

/// [`claim_fresh`]'s call (`$1` the deliveries, `$2` limit, `$3` lease in seconds, `$4`
/// default max in flight).
pub const CLAIM_FRESH_SQL: &str = "SELECT * FROM wg_claim_fresh_v3($1, $2, $3, $4)";

/// Admit one probe for each of up to `limit` half-open endpoints: claim the endpoint row
/// (its cool-down is over and no live probe holds it) together with its oldest pending
/// delivery that is due, parked (parked only when due) or not. One still in its backoff
/// or its subscriber's `Retry-After` is not a probe: sent early, it would spend an
/// attempt and call a subscriber that asked for time; an endpoint with nothing due
/// stays half-open until something is. The endpoint's `probe_until` is the probe's lease, so a
/// prober that dies does not wedge the circuit; `probe_token` fences its outcome.
/// Row locks with `SKIP LOCKED` on the endpoint make this exactly one probe per window
/// across every worker and replica.
pub async fn claim_probes(db: impl PgExecutor<'_>, limit: i64, lease: Duration) -> Result<Vec<Claimed>, sqlx::Error> {
    let rows = crate::db::query(&format!(
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
                 SELECT LEAST(
                     (SELECT id FROM deliveries
                      WHERE endpoint_id = ready.id AND status = 'pending' AND parked
                      ORDER BY id LIMIT 1),
                     (SELECT id FROM deliveries
                      WHERE endpoint_id = ready.id AND status = 'pending' AND NOT parked AND NOT waiting
                        AND next_attempt_at <= now()
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
             claim_token = d.{NEXT_CLAIM_TOKEN},
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
    .await?;
    let probes = claimed_in(&rows)?;
    // Already committed (one statement): refused, the probes wait for their leases.
    claimed_once(&probes)?;
    Ok(probes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::EventId;

    fn claimed(n: u128) -> Claimed {
        Claimed {
            id: DeliveryId(uuid::Uuid::from_u128(n)),
            event_id: EventId(uuid::Uuid::from_u128(n)),
            endpoint_id: EndpointId(uuid::Uuid::from_u128(100)),
            attempt: 1,
            attempts_base: 0,
            claim_token: 1,
            url: "https://example.com/".into(),
            secret: crate::secrets::Sealed::from_stored("whsec_c2VjcmV0".into()),
            previous_secrets: Vec::new(),
            event_type: "t".into(),
            source_name: "s".into(),
            content_type: None,
            payload: bytes::Bytes::new(),
            payload_bytes: 0,
            ordered: false,
            probe_token: None,
            traceparent: None,
            tracestate: None,
            transform: None,
            event_headers: None,
        }
    }

    /// The text between `from` and `to` (both included) in `sql`, without comments, its
    /// words separated by single spaces.
    fn segment(sql: &str, from: &str, to: &str) -> String {
        let start = sql.find(from).unwrap_or_else(|| panic!("no {from:?} in {sql}"));
        let end = start + sql[start..].find(to).unwrap_or_else(|| panic!("no {to:?} after {from:?}")) + to.len();
        let text: Vec<&str> = sql[start..end].lines().map(|l| l.split("--").next().unwrap_or("")).collect();
        text.join(" ").split_whitespace().collect::<Vec<_>>().join(" ")
    }

    /// The claim by key's function (migration 0024) computes each endpoint's room and
    /// share, takes the lease with a new token and pays the rate tokens word for word as
    /// the general claim does: a change to one that misses the other fails here.
    #[test]
    fn the_claim_by_key_function_leases_exactly_as_the_general_claim() {
        let function = include_str!("../../migrations/0024_claim_tokens_a_lost_claim_cannot_repeat.sql");
        let general = claim_sql()
            .replace("$1", "claim_limit")
            .replace("$2", "lease_secs")
            .replace("$3", "default_max")
            .replace("$4", "locked_ids");
        for (from, to) in [("room_n AS (", "FROM room_n"), ("claimed AS (", "room.rate_limit_per_sec IS NOT NULL")] {
            let ours = segment(function, from, to);
            let theirs = segment(&general, from, to);
            assert_eq!(ours, theirs, "{from}");
        }
    }

    /// A claim that leased one delivery twice trips [`claimed_once`]; distinct ones pass.
    #[test]
    fn a_claim_with_one_delivery_twice_is_refused() {
        assert_eq!(claimed_once(&[claimed(1), claimed(2)]), Ok(()));
        let broken = claimed_once(&[claimed(1), claimed(2), claimed(1)]).expect_err("twice");
        assert_eq!(broken.invariant, crate::invariants::CLAIMED_ONCE);
    }
}
