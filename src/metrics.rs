//! Prometheus metrics: names, the exporter, and a sampler for database-derived gauges.
//!
//! Counters and histograms are recorded where things happen (ingest, workers, recorder);
//! queue depth, lag, circuit states are counted in PostgreSQL every
//! `--metrics-sample-secs` (default [`SAMPLE_INTERVAL`]) by one replica for the fleet and
//! exported by every process with their age ([`sample`]); pool usage is each process's. Labels are bounded: source names and endpoint
//! ids are operator-created, never per event.

use std::collections::HashSet;
use std::time::Duration;

use crate::db::Pool;
use crate::lease::Leadership;
use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::sync::watch;

/// Webhooks received, by source and outcome (`accepted`, `duplicate`, `rejected`).
pub const INGEST_REQUESTS: &str = "webhook_gateway_ingest_requests_total";
/// Answers of the ingest endpoint, by HTTP status (`200`, `404`, `413`, `503`...): what
/// a sender saw, including refusals that store nothing (an unknown source, a database
/// outage), which `INGEST_REQUESTS` does not count.
pub const INGEST_RESPONSES: &str = "webhook_gateway_ingest_responses_total";
/// Refused webhooks, by source and reason (`invalid_signature`, ...).
pub const INGEST_REJECTED: &str = "webhook_gateway_ingest_rejected_total";
/// Webhooks answered 503 `overloaded` unread: the ingest memory budget had no room.
pub const INGEST_SHED: &str = "webhook_gateway_ingest_shed_total";
/// Deliveries given back unsent before their attempt (no attempt spent), by `reason`:
/// `no_room` (the delivery memory budget stayed full) or `unreadable_body`.
pub const DELIVERY_BODIES_GIVEN_BACK: &str = "webhook_gateway_delivery_bodies_given_back_total";
/// The gateway's own events published (`crate::operational`), by `type`.
pub const OPERATIONAL_EVENTS: &str = "webhook_gateway_operational_events_total";
/// Delivery attempts, by outcome (`delivered`, `retry`, `dead`) and class (`2xx`, `5xx`,
/// `timeout`, `forbidden_address`, ...).
pub const ATTEMPTS: &str = "webhook_gateway_attempts_total";
/// Attempt duration, seconds.
pub const ATTEMPT_DURATION: &str = "webhook_gateway_attempt_duration_seconds";
/// Queue invariants found broken at run time, by `invariant` (see `crate::invariants`).
pub const INVARIANT_VIOLATIONS: &str = crate::invariants::VIOLATIONS;
/// Outcome writes by the recorder, by why its batch stopped gathering (`ended`: `full`,
/// `urgent`, `waiting`, `linger`, `closed`; `deliver::recorder::Ended`). Outcomes per
/// write: `ATTEMPTS` over this.
pub const OUTCOME_WRITES: &str = "webhook_gateway_outcome_writes_total";
/// How long the recorder took over each batch, seconds: its outcomes' transaction (the
/// statements, the commit's wait for the WAL's flush, any retry while the database was
/// away) and the claims that sent nothing. A process has one recorder, writing one batch at
/// a time, so the rate of its `_sum` is the share of the time it was writing: near 1, the
/// recorder sets the pace at which worker slots are freed and ordering lines move on (an
/// ordered drain of 100 keys on the bench's host: 0.88, bench/PROFILE.md).
pub const OUTCOME_WRITE_DURATION: &str = "webhook_gateway_outcome_write_seconds";
/// Group commit's writes (a statement and its commit, each holding one or more webhooks),
/// by `kind`: `alone` (one webhook) or `batch`. Webhooks per write:
/// `INGEST_WRITE_WEBHOOKS` over this.
pub const INGEST_WRITES: &str = "webhook_gateway_ingest_writes_total";
/// Webhooks written by group commit's writes (duplicates found by the statement
/// included), by `kind` as [`INGEST_WRITES`].
pub const INGEST_WRITE_WEBHOOKS: &str = "webhook_gateway_ingest_write_webhooks_total";
/// How long a write took, statement and commit (the WAL's flush) and any wait for a pooled
/// connection, seconds, by `kind`: what each webhook of it waited for the database. At
/// moderate concurrency a webhook waits for about two writes (bench/PROFILE.md, "Ingest at
/// 16 connections").
pub const INGEST_WRITE_DURATION: &str = "webhook_gateway_ingest_write_seconds";
/// Deliveries put on a lease, by what took them (`by`): `ingest` (the statement that
/// stored their webhook, `deliver::prelease`), `claim_by_key` (handed over by id after
/// that commit: what ingest's statement did not lease, an ordered line's next head the
/// outcome write did not lease), `promotion` (an ordered line's next head, leased by the
/// outcome write that moved the line on, `queue::lines::promote_leasing`),
/// `claim` (the dispatcher's general claim of due work: retries, a backlog, another
/// replica's webhooks) or `probe` (a half-open circuit's probe). In role `all` at light
/// load most are `ingest`; `claim_by_key` grows when ingest finds no free worker, no room
/// at the endpoint, or the endpoint's row held by another transaction at that moment.
pub const LEASES: &str = "webhook_gateway_leases_total";
/// Outcomes dropped because a newer claim took the lease over, or the delivery is gone.
pub const FENCED: &str = "webhook_gateway_outcomes_fenced_total";
/// Outcomes recorded without their details (status and error kind only) because the
/// database refused them: each is a bug in sanitizing outside text, worth a look.
pub const OUTCOMES_DEGRADED: &str = "webhook_gateway_outcomes_degraded_total";
/// Outcomes that could not be recorded at all: their deliveries were dead-lettered with
/// the reason instead of being sent again unrecorded.
pub const OUTCOMES_UNRECORDABLE: &str = "webhook_gateway_outcomes_unrecordable_total";
/// Deliveries by state: `pending` (claimable), `parked`, `dead`.
pub const QUEUE_DELIVERIES: &str = "webhook_gateway_queue_deliveries";
/// Pending deliveries due now.
pub const QUEUE_DUE: &str = "webhook_gateway_queue_due";
/// Age of the oldest due delivery, seconds: the lag that pages someone.
pub const QUEUE_LAG: &str = "webhook_gateway_queue_oldest_due_age_seconds";
/// Circuit per endpoint: 0 closed, 1 open, 2 half-open.
pub const CIRCUIT_STATE: &str = "webhook_gateway_circuit_state";
/// Requests in flight per endpoint (leased, not yet recorded), across every replica.
pub const ENDPOINT_IN_FLIGHT: &str = "webhook_gateway_endpoint_in_flight";
/// Per endpoint: 1 while it has due deliveries its limits hold back, else 0.
pub const ENDPOINT_THROTTLED: &str = "webhook_gateway_endpoint_throttled";
/// Per endpoint: seconds it was seen throttled (sampled: each sample adds its interval).
pub const ENDPOINT_THROTTLED_SECONDS: &str = "webhook_gateway_endpoint_throttled_seconds_total";
/// Database pool connections by state (`in_use`, `idle`).
pub const DB_POOL: &str = "webhook_gateway_db_pool_connections";
/// The database's client connections (sampled by one replica for the fleet), by whose
/// (`of`): `all` (every client of the server, this fleet's included) or `gateway` (those
/// named `webhook-gateway...`; behind a pooler, the pooler's own). Beside
/// [`DB_CONNECTIONS_LIMIT`]: a fleet that grows opens up to `--db-pool-size` + 1 a
/// replica, and past the limit PostgreSQL refuses them and ingest answers 503.
pub const DB_CONNECTIONS: &str = "webhook_gateway_database_connections";
/// The client connections the database takes: `max_connections` less those reserved for
/// superusers (and, on PostgreSQL 16 and later, for `pg_use_reserved_connections`).
pub const DB_CONNECTIONS_LIMIT: &str = "webhook_gateway_database_connections_limit";
/// Seconds the oldest transaction of this database that holds PostgreSQL's cleanup back
/// (a session's with a snapshot or a transaction id, or a prepared transaction) has been
/// open (sampled by one replica for the fleet). Finished deliveries' row versions stay
/// until it ends, and every claim reads them (docs/operating.md, "Retention and storage").
pub const DB_OLDEST_TRANSACTION: &str = "webhook_gateway_database_oldest_transaction_seconds";
/// How many transactions old the cleanup horizon of this database is: the oldest of the
/// sessions' and prepared transactions' above, a standby's feedback and the replication
/// slots' (which have no start time to tell).
pub const DB_HORIZON_AGE: &str = "webhook_gateway_database_horizon_age_transactions";
/// Threads of the async runtime this process runs on (`--runtime-threads`).
pub const RUNTIME_THREADS: &str = "webhook_gateway_runtime_threads";

/// Gauge, always 1: this process's release, by `version`, `schema_version` (the newest
/// migration it carries) and `role`. Two releases in a fleet for long is a rolling deploy
/// stalled halfway (alert `WebhookGatewayReleasesMixed`).
pub const BUILD_INFO: &str = "webhook_gateway_build_info";

/// Gauge: the database's clock less this host's, in seconds, as last measured
/// ([`crate::clock`]).
pub const CLOCK_OFFSET: &str = "webhook_gateway_clock_offset_seconds";

/// Default of how often the sampler refreshes the database-derived gauges
/// (`--metrics-sample-secs`). The counts scan the pending rows (about 0.1 s per 100,000
/// pending), so not too often.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(15);

/// Buckets of a database write's duration, seconds (ingest's and the recorder's): from
/// half a millisecond (a commit on a fast disk) to seconds (a write retried through an
/// outage).
const WRITE_BUCKETS: &[f64] = &[0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

/// Install the process-wide Prometheus recorder. Call once, in the binary.
pub fn install() -> anyhow::Result<PrometheusHandle> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(ATTEMPT_DURATION.to_owned()),
            &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0],
        )?
        .set_buckets_for_metric(Matcher::Full(INGEST_WRITE_DURATION.to_owned()), WRITE_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(OUTCOME_WRITE_DURATION.to_owned()), WRITE_BUCKETS)?
        .install_recorder()
        .map_err(|e| anyhow::anyhow!("cannot install the metrics recorder: {e}"))
}

/// Record the size of the runtime the gateway runs on (once, at start-up).
pub fn runtime_threads(threads: usize) {
    gauge!(RUNTIME_THREADS).set(threads as f64);
}

/// Say which release this process runs, in which role (once, at start-up).
pub fn build_info(role: crate::role::Role) {
    let schema_version = crate::db::newest_migration().to_string();
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION"), "schema_version" => schema_version,
        "role" => role.name())
    .set(1.0);
}

/// Set the measured offset of the database's clock from this host's.
pub fn clock_offset(offset: chrono::Duration) {
    gauge!(CLOCK_OFFSET).set(offset.num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6);
}

/// Count one outcome write, by why its batch stopped gathering, which took `duration`.
pub fn outcome_write(ended: &'static str, duration: Duration) {
    counter!(OUTCOME_WRITES, "ended" => ended).increment(1);
    histogram!(OUTCOME_WRITE_DURATION).record(duration.as_secs_f64());
}

/// Count one of group commit's writes of `webhooks` webhooks, which took `duration`.
pub fn ingest_write(webhooks: usize, duration: Duration) {
    let kind = if webhooks == 1 { "alone" } else { "batch" };
    counter!(INGEST_WRITES, "kind" => kind).increment(1);
    counter!(INGEST_WRITE_WEBHOOKS, "kind" => kind).increment(webhooks as u64);
    histogram!(INGEST_WRITE_DURATION, "kind" => kind).record(duration.as_secs_f64());
}

/// Count `deliveries` put on a lease by `by` (see [`LEASES`]).
pub fn leases(by: &'static str, deliveries: usize) {
    if deliveries > 0 {
        counter!(LEASES, "by" => by).increment(deliveries as u64);
    }
}

/// Count one ingest outcome.
pub fn ingest(source: &str, outcome: &'static str) {
    counter!(INGEST_REQUESTS, "source" => source.to_owned(), "outcome" => outcome).increment(1);
}

/// Count one answer of the ingest endpoint.
pub fn ingest_answered(status: axum::http::StatusCode) {
    let status: std::borrow::Cow<'static, str> = match status.as_u16() {
        200 => "200".into(),
        other => other.to_string().into(),
    };
    counter!(INGEST_RESPONSES, "status" => status).increment(1);
}

/// Count one refused webhook.
pub fn rejected(source: &str, reason: &'static str) {
    ingest(source, "rejected");
    counter!(INGEST_REJECTED, "source" => source.to_owned(), "reason" => reason).increment(1);
}

/// Count a webhook shed by the ingest memory budget.
pub fn ingest_shed() {
    counter!(INGEST_SHED).increment(1);
}

/// Count a delivery given back before its attempt, by `reason` (`no_room`,
/// `unreadable_body`).
pub fn delivery_body_given_back(reason: &'static str) {
    counter!(DELIVERY_BODIES_GIVEN_BACK, "reason" => reason).increment(1);
}

/// Count an operational event published (`crate::operational`).
pub fn operational_event(event_type: &'static str) {
    counter!(OPERATIONAL_EVENTS, "type" => event_type).increment(1);
}

/// Count and time one attempt.
pub fn attempt(outcome: &'static str, class: &'static str, duration: Duration) {
    counter!(ATTEMPTS, "outcome" => outcome, "class" => class).increment(1);
    histogram!(ATTEMPT_DURATION).record(duration.as_secs_f64());
}

/// Age of the fleet's sampled counts (queue, circuits, endpoint loads), seconds: they are
/// taken by one replica (see [`sample`]); a growing age means nobody is sampling.
pub const STATS_AGE: &str = "webhook_gateway_stats_age_seconds";

/// Name of the metrics job's lease.
pub const LEASE_NAME: &str = "metrics";

/// What the replica leading the `metrics` job counted, as every replica exports it.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct FleetCounts {
    pending: i64,
    parked: i64,
    dead: i64,
    due: i64,
    oldest_due_age_secs: Option<f64>,
    /// Endpoint id and circuit gauge value.
    circuits: Vec<(String, f64)>,
    /// Endpoint id, in flight, throttled.
    loads: Vec<(String, i64, bool)>,
    /// The server's client connections (absent in a row a release before them wrote).
    #[serde(default)]
    connections: Option<Connections>,
    /// What holds the database's cleanup back (absent in a row a release before it wrote).
    #[serde(default)]
    horizon: Option<Horizon>,
}

/// The oldest holders of the database's cleanup horizon ([`DB_OLDEST_TRANSACTION`],
/// [`DB_HORIZON_AGE`]).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
struct Horizon {
    oldest_transaction_secs: f64,
    age_transactions: i64,
}

/// The database server's client connections, against what it takes.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
struct Connections {
    all: i64,
    gateway: i64,
    limit: i64,
}

/// What the leader reads of the server, in one statement: its client backends, the
/// gateway's among them, and how many it takes (`reserved_connections` exists from
/// PostgreSQL 16: read as 0 before); then [`Horizon`]: the sessions of this database (other
/// than the one asking) with a snapshot or a transaction id, and its prepared transactions,
/// by start; by age in transactions, those and the walsenders (a standby's
/// `hot_standby_feedback`) and replication slots, which hold every database's horizon.
/// Another role's sessions show only to a role with `pg_read_all_stats` (or `pg_monitor`);
/// without it, this counts the gateway's own role's.
const SERVER_SQL: &str = "SELECT \
     (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'), \
     (SELECT count(*) FROM pg_stat_activity \
       WHERE backend_type = 'client backend' AND application_name LIKE 'webhook-gateway%'), \
     current_setting('max_connections')::int8 - current_setting('superuser_reserved_connections')::int8 \
       - COALESCE(NULLIF(current_setting('reserved_connections', true), ''), '0')::int8, \
     GREATEST( \
       (SELECT extract(epoch FROM max(now() - xact_start)) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() \
           AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)), \
       (SELECT extract(epoch FROM max(now() - prepared)) FROM pg_prepared_xacts WHERE database = current_database()), \
       0)::float8, \
     GREATEST( \
       (SELECT max(GREATEST(age(backend_xmin), age(backend_xid))) FROM pg_stat_activity \
         WHERE (datname = current_database() OR backend_type = 'walsender') AND pid <> pg_backend_pid()), \
       (SELECT max(age(transaction)) FROM pg_prepared_xacts WHERE database = current_database()), \
       (SELECT max(age(xmin)) FROM pg_replication_slots), \
       0)::int8";

/// Refresh the sampled gauges until `stop` (`default_max_in_flight`: the in-flight cap of
/// endpoints without their own, to tell throttled endpoints; `instance`: this gateway's
/// name as a lease holder).
///
/// The counts scan the pending rows, so one replica takes them for the fleet: the holder
/// of the `metrics` lease counts and writes `fleet_stats`, and every replica (that one
/// included) reads that row and exports it, with [`STATS_AGE`]. Per replica and interval
/// that is a lease statement and a one-row read; the counting happens once. The pool
/// gauges are each process's own.
pub async fn sample(
    pool: Pool,
    every: Duration,
    default_max_in_flight: i32,
    instance: String,
    mut stop: watch::Receiver<bool>,
) {
    // Three intervals: a leader that dies is replaced within about three samples.
    let mut leadership = Leadership::new(LEASE_NAME, instance.clone(), every * 3);
    loop {
        // Raced against stop: a sample sent into a network partition must not hold the
        // shutdown until the connection gives up.
        tokio::select! {
            sampled = sample_once(&pool, every, default_max_in_flight, &instance, &mut leadership) => {
                if let Err(e) = sampled {
                    tracing::debug!(error = %e, "metrics sampling failed");
                }
            }
            _ = stop.wait_for(|s| *s) => return,
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

async fn sample_once(
    pool: &Pool,
    every: Duration,
    default_max_in_flight: i32,
    instance: &str,
    leadership: &mut Leadership,
) -> Result<(), sqlx::Error> {
    let idle = pool.num_idle() as f64;
    gauge!(DB_POOL, "state" => "idle").set(idle);
    gauge!(DB_POOL, "state" => "in_use").set(f64::from(pool.size()) - idle);

    if leadership.leads(pool).await {
        let counts = count(pool, default_max_in_flight).await?;
        for (endpoint, _, throttled) in &counts.loads {
            if *throttled {
                counter!(ENDPOINT_THROTTLED_SECONDS, "endpoint_id" => endpoint.clone())
                    .increment(every.as_secs().max(1));
            }
        }
        crate::db::query(
            "INSERT INTO fleet_stats (name, stats, sampled_at, sampled_by) VALUES ('queue', $1, now(), $2)
             ON CONFLICT (name) DO UPDATE
                 SET stats = EXCLUDED.stats, sampled_at = EXCLUDED.sampled_at, sampled_by = EXCLUDED.sampled_by",
        )
        .bind(sqlx::types::Json(&counts))
        .bind(instance)
        .execute(pool)
        .await?;
    }
    let row: Option<(sqlx::types::Json<FleetCounts>, f64)> = crate::db::query_as(
        "SELECT stats, extract(epoch FROM now() - sampled_at)::float8 FROM fleet_stats WHERE name = 'queue'",
    )
    .fetch_optional(pool)
    .await?;
    let Some((sqlx::types::Json(counts), age)) = row else { return Ok(()) };
    // Set together, after every query: a scrape never sees half a sample.
    gauge!(STATS_AGE).set(age.max(0.0));
    gauge!(QUEUE_DELIVERIES, "state" => "pending").set(counts.pending as f64);
    gauge!(QUEUE_DELIVERIES, "state" => "parked").set(counts.parked as f64);
    gauge!(QUEUE_DELIVERIES, "state" => "dead").set(counts.dead as f64);
    gauge!(QUEUE_DUE).set(counts.due as f64);
    gauge!(QUEUE_LAG).set(counts.oldest_due_age_secs.unwrap_or(0.0).max(0.0));
    if let Some(Connections { all, gateway, limit }) = counts.connections {
        gauge!(DB_CONNECTIONS, "of" => "all").set(all as f64);
        gauge!(DB_CONNECTIONS, "of" => "gateway").set(gateway as f64);
        gauge!(DB_CONNECTIONS_LIMIT).set(limit as f64);
    }
    if let Some(Horizon { oldest_transaction_secs, age_transactions }) = counts.horizon {
        gauge!(DB_OLDEST_TRANSACTION).set(oldest_transaction_secs.max(0.0));
        gauge!(DB_HORIZON_AGE).set(age_transactions as f64);
    }
    let sampled: HashSet<String> =
        counts.circuits.iter().map(|(e, _)| e.clone()).chain(counts.loads.iter().map(|(e, ..)| e.clone())).collect();
    for (endpoint, state) in counts.circuits {
        gauge!(CIRCUIT_STATE, "endpoint_id" => endpoint).set(state);
    }
    for (endpoint, in_flight, throttled) in counts.loads {
        gauge!(ENDPOINT_IN_FLIGHT, "endpoint_id" => endpoint.clone()).set(in_flight as f64);
        gauge!(ENDPOINT_THROTTLED, "endpoint_id" => endpoint).set(f64::from(u8::from(throttled)));
    }
    // An endpoint gone since the last sample (deleted) is in no sample again: its gauges
    // are set to rest (closed, nothing in flight, not throttled), or their last values
    // would stay exported for good (an open circuit's alert that never resolves). The
    // exporter cannot drop a series; a deleted endpoint's stay at rest.
    static EXPORTED: std::sync::Mutex<Option<HashSet<String>>> = std::sync::Mutex::new(None);
    if let Ok(mut exported) = EXPORTED.lock() {
        for gone in exported.iter().flatten().filter(|e| !sampled.contains(*e)) {
            gauge!(CIRCUIT_STATE, "endpoint_id" => gone.clone()).set(0.0);
            gauge!(ENDPOINT_IN_FLIGHT, "endpoint_id" => gone.clone()).set(0.0);
            gauge!(ENDPOINT_THROTTLED, "endpoint_id" => gone.clone()).set(0.0);
        }
        *exported = Some(sampled);
    }
    Ok(())
}

/// The counts the leader takes for the fleet.
async fn count(pool: &Pool, default_max_in_flight: i32) -> Result<FleetCounts, sqlx::Error> {
    let queue = crate::queue::read::stats(pool).await?;
    let now = crate::clock::now();
    let circuits = crate::store::endpoints::list(pool)
        .await?
        .into_iter()
        .map(|e| (e.id.to_string(), e.circuit.display_state(now).gauge()))
        .collect();
    let loads = crate::queue::read::endpoint_loads(pool, default_max_in_flight)
        .await?
        .into_iter()
        .map(|l| (l.endpoint_id.to_string(), l.in_flight, l.throttled))
        .collect();
    let (all, gateway, limit, oldest_transaction_secs, age_transactions): (i64, i64, i64, f64, i64) =
        crate::db::query_as(SERVER_SQL).fetch_one(pool).await?;
    Ok(FleetCounts {
        connections: Some(Connections { all, gateway, limit }),
        horizon: Some(Horizon { oldest_transaction_secs, age_transactions }),
        pending: queue.pending,
        parked: queue.parked,
        dead: queue.dead,
        due: queue.due,
        oldest_due_age_secs: queue.oldest_due_age_secs,
        circuits,
        loads,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fleet_row_written_before_the_connection_counts_still_reads() {
        let older = r#"{"pending": 3, "parked": 0, "dead": 1, "due": 2, "oldest_due_age_secs": 1.5,
                        "circuits": [], "loads": []}"#;
        let counts: FleetCounts = serde_json::from_str(older).expect("a row of the release before");
        assert!(counts.connections.is_none() && counts.horizon.is_none());
        assert_eq!((counts.pending, counts.dead), (3, 1));
        let newer = FleetCounts {
            connections: Some(Connections { all: 9, gateway: 4, limit: 97 }),
            horizon: Some(Horizon { oldest_transaction_secs: 61.5, age_transactions: 1200 }),
            ..counts
        };
        let back: FleetCounts = serde_json::from_str(&serde_json::to_string(&newer).expect("json")).expect("read");
        assert_eq!(back.connections.map(|c| (c.all, c.gateway, c.limit)), Some((9, 4, 97)));
        let horizon = back.horizon.map(|h| (h.oldest_transaction_secs, h.age_transactions));
        assert_eq!(horizon, Some((61.5, 1200)));
    }
}
