//! The database's clock, as this process reads it.
//!
//! PostgreSQL compares the times the gateway writes with its own `now()`: a retry's due
//! time (`next_attempt_at <= now()` in the claims), a circuit's reopening, the steps of a
//! paced release, a rotated secret's grace. The replicas of a fleet run on hosts whose
//! clocks drift (a paused VM, NTP that stopped), and one whose clock was 120 s behind the
//! database's retried a subscriber 66 ms after it answered `Retry-After: 4` (the due time
//! it wrote lay two minutes in the database's past); one ahead held every retry back by
//! its error. So those times are taken from [`now`]: this host's clock corrected by its
//! offset from the database's, measured at start-up, every [`SYNC_EVERY`] after and
//! after a failover ([`keep_in_step`]), to within half a round trip. A provider's signed timestamp is
//! judged by it as well, so every replica of a fleet accepts and refuses the same
//! webhooks. Times only this process compares (timeouts, durations) stay on its own
//! clocks.
//!
//! Tested: `clock_skew` (a gateway under libfaketime: retries, circuits, signed timestamps).

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{Executor as _, Row as _};
use tokio::sync::watch;

use crate::db::Pool;

/// The database's clock less this host's, in microseconds, as last measured.
static OFFSET_MICROS: AtomicI64 = AtomicI64::new(0);

/// How often the offset is measured again.
pub const SYNC_EVERY: Duration = Duration::from_secs(60);

/// An offset past which the log warns (once per change of that size): the host's clock is
/// wrong, which the gateway makes up for but other software on the host may not.
pub const WARN_OFFSET: Duration = Duration::from_secs(1);

/// Round trips per measurement; the shortest one is kept (the tightest bound).
const SAMPLES: usize = 3;

/// Now, by the database's clock: this host's clock corrected by the offset last measured
/// ([`sync`]); this host's own clock until the first measurement.
pub fn now() -> DateTime<Utc> {
    Utc::now() + chrono::Duration::microseconds(OFFSET_MICROS.load(Ordering::Relaxed))
}

/// The database's clock less this host's, as last measured (zero until the first
/// measurement): what the fleet's roster shows beside each replica.
pub fn offset() -> chrono::Duration {
    chrono::Duration::microseconds(OFFSET_MICROS.load(Ordering::Relaxed))
}

/// The database's clock less this host's: the server's `clock_timestamp()` against the
/// middle of the round trip that read it, from the shortest of [`SAMPLES`] round trips.
/// Returns the offset and that round trip. In a transaction, so that behind a pooler the
/// measured statement is one simple query on one server connection.
pub async fn measure(pool: &Pool) -> Result<(chrono::Duration, Duration), sqlx::Error> {
    let mut tx = pool.begin().await?;
    let mut best: Option<(chrono::Duration, Duration)> = None;
    for _ in 0..SAMPLES {
        let sent = Utc::now();
        let started = std::time::Instant::now();
        let row = (&mut *tx)
            .fetch_one(sqlx::raw_sql("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8::text"))
            .await?;
        let round_trip = started.elapsed();
        let theirs: String = row.try_get(0)?;
        let theirs: i64 = theirs.parse().map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
        let middle = sent + chrono::Duration::from_std(round_trip / 2).unwrap_or_default();
        let offset = chrono::Duration::microseconds(theirs - middle.timestamp_micros());
        if best.is_none_or(|(_, shortest)| round_trip < shortest) {
            best = Some((offset, round_trip));
        }
    }
    tx.commit().await?;
    Ok(best.unwrap_or_default())
}

/// Measure the offset and use it from now on; the log warns when it passes
/// [`WARN_OFFSET`] or moves by as much since the last warning.
pub async fn sync(pool: &Pool) -> Result<chrono::Duration, sqlx::Error> {
    let (offset, round_trip) = measure(pool).await?;
    let micros = offset.num_microseconds().unwrap_or(i64::MAX);
    let before = OFFSET_MICROS.swap(micros, Ordering::Relaxed);
    crate::metrics::clock_offset(offset);
    let warn = WARN_OFFSET.as_micros() as i64;
    let moved = micros.saturating_sub(before).saturating_abs() >= warn;
    if micros.saturating_abs() >= warn && (moved || before == 0) {
        tracing::warn!(
            offset_ms = offset.num_milliseconds(),
            round_trip_us = round_trip.as_micros() as u64,
            "this host's clock is off the database's: the times the gateway writes for PostgreSQL to compare (retries, \
             circuits) follow the database's clock; fix the host's time synchronisation"
        );
    } else if before.saturating_abs() >= warn && micros.saturating_abs() < warn {
        tracing::info!(offset_ms = offset.num_milliseconds(), "this host's clock is back in step with the database's");
    }
    Ok(offset)
}

/// Measure the offset again every [`SYNC_EVERY`], and within [`CHECK_EVERY`] of a
/// failover the pool noticed (its [`crate::db::Health`] marked its connections stale: the
/// new primary is another host, with a clock of its own), until `stop`; a failed
/// measurement keeps the last offset and is tried again at the next check (the database
/// being away is reported by the calls that need it).
///
/// `measured`: whether [`first_sync`] measured; when it did not, the next check measures.
pub async fn keep_in_step(pool: Pool, measured: bool, mut stop: watch::Receiver<bool>) {
    let mut measured_at = measured.then(tokio::time::Instant::now);
    let mut failover_mark = pool.health().stale_mark();
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(CHECK_EVERY) => {}
        }
        let mark = pool.health().stale_mark();
        if measured_at.is_some_and(|at| at.elapsed() < SYNC_EVERY) && mark == failover_mark {
            continue;
        }
        // Raced against stop: a measurement sent into a network partition must not hold
        // the shutdown until the connection gives up.
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            measured = sync(&pool) => match measured {
                Ok(_) => (measured_at, failover_mark) = (Some(tokio::time::Instant::now()), mark),
                Err(e) => tracing::debug!(error = %e, "the clock's offset from the database's was not measured; the last one stays"),
            },
        }
    }
}

/// How often [`keep_in_step`] looks whether a measurement is due.
pub const CHECK_EVERY: Duration = Duration::from_secs(5);

/// [`sync`] at start-up, waiting at most [`FIRST_SYNC_WAIT`]: a database that does not
/// answer now does not hold the process back (this host's clock is used until the next
/// measurement, [`CHECK_EVERY`] later). Whether it measured.
pub async fn first_sync(pool: &Pool) -> bool {
    let failed = match tokio::time::timeout(FIRST_SYNC_WAIT, sync(pool)).await {
        Ok(Ok(_)) => return true,
        Ok(Err(e)) => e.to_string(),
        Err(_) => "no answer".to_owned(),
    };
    tracing::warn!(
        error = %failed,
        "the clock's offset from the database's was not measured yet; this host's clock is used until it is"
    );
    false
}

/// How long [`first_sync`] waits for the database.
pub const FIRST_SYNC_WAIT: Duration = Duration::from_secs(2);
