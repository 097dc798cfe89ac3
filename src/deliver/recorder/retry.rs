//! How long the recorder tries a write: each try bounded, tried again while the database
//! is away, for a lease, and briefly once the process is stopping.

use std::future::Future;
use std::time::Duration;

use crate::db;

/// Longest pause between tries of a write while the database is unreachable.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(2);

/// How long a write that fails once the process is stopping is tried again: short, since
/// the stop waits for it (the dispatcher gives the recorder [`STOP_BOUND`] in all).
const STOPPING_PATIENCE: Duration = Duration::from_secs(5);

/// How long a stopping dispatcher waits for its recorder, once the deliveries are done or
/// their grace is over, before it abandons what is left (those outcomes' leases bring
/// their deliveries back).
pub const STOP_BOUND: Duration = Duration::from_secs(10);

/// How long the recorder keeps trying a write while the database is unreachable (or a
/// transaction hits a serialization failure or deadlock). Other errors are not retried
/// as they are: the rows are isolated instead.
#[derive(Debug, Clone)]
pub struct Patience {
    /// Keep trying for up to a lease: recording is idempotent and fenced, so a late write
    /// is either still right or a harmless no-op, and an outcome given up on is sent
    /// again when its lease ends. Meanwhile the outcomes hold their worker slots, so
    /// workers stop claiming while the database is away.
    pub lease: Duration,
    /// Once this says `true` (shutdown), a write that fails is tried again for
    /// [`STOPPING_PATIENCE`] at most: the stop must not wait out a partition; the leases
    /// bring back what could not be recorded.
    pub stopping: tokio::sync::watch::Receiver<bool>,
}

impl Patience {
    /// For tests and tools: a lease of patience and no shutdown signal.
    pub fn of(lease: Duration) -> Patience {
        Patience { lease, stopping: tokio::sync::watch::channel(false).1 }
    }
}

/// Errors worth trying the same write again for: the database unreachable or refusing
/// writes (a failover, a full disk), a serialization failure or a deadlock (which a retry
/// resolves): every error `db::unavailable` classifies.
pub(super) fn transient(err: &sqlx::Error) -> bool {
    db::is_unavailable(err)
}

/// `once`, each try bounded by [`db::BACKGROUND_DEADLINE`] (then unanswered: its commit
/// unknown), tried again with a doubling pause (up to [`MAX_RETRY_PAUSE`]) while the error
/// is [`transient`], for as long as `patience` allows, and once the process is stopping
/// for at most [`STOPPING_PATIENCE`] more (a deadlock or a pool timeout at a stop is
/// tried again, not left to the lease); `rows` is for the log.
pub(super) async fn retrying<T, F, Fut>(patience: &Patience, rows: usize, mut once: F) -> Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    let mut give_up = tokio::time::Instant::now() + patience.lease;
    let mut delay = Duration::from_millis(100);
    let mut tries = 1u32;
    loop {
        let result = tokio::time::timeout(db::BACKGROUND_DEADLINE, once())
            .await
            .unwrap_or_else(|_| Err(db::no_answer("an outcome write")));
        if *patience.stopping.borrow() {
            give_up = give_up.min(tokio::time::Instant::now() + STOPPING_PATIENCE);
        }
        match result {
            Err(e) if transient(&e) && tokio::time::Instant::now() + delay < give_up => {
                tracing::warn!(error = %e, batch = rows, tries, "recording outcomes failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX_RETRY_PAUSE);
                tries += 1;
            }
            result => return result,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A write the database never answers (behind a pooler whose server went silent, no
    /// socket bound ends it) is abandoned at [`db::BACKGROUND_DEADLINE`] as unanswered,
    /// tried again within the lease, and given up on after it.
    #[tokio::test(start_paused = true)]
    async fn a_write_never_answered_is_abandoned_at_the_deadline_and_tried_again() {
        let tries = AtomicU32::new(0);
        let began = tokio::time::Instant::now();
        let result: Result<(), sqlx::Error> = retrying(&Patience::of(Duration::from_secs(60)), 1, || {
            tries.fetch_add(1, Ordering::Relaxed);
            std::future::pending()
        })
        .await;
        let err = result.expect_err("never answered");
        assert_eq!(db::unavailable(&err), Some(db::Unavailable::Unconfirmed), "{err}");
        assert_eq!(tries.load(Ordering::Relaxed), 2, "tried again within the lease, not after it");
        assert!(began.elapsed() >= db::BACKGROUND_DEADLINE * 2 && began.elapsed() < db::BACKGROUND_DEADLINE * 3);
    }

    /// Once the process is stopping, a write that fails for a passing reason (here the
    /// pool's timeout) is tried again, for [`STOPPING_PATIENCE`] at most.
    #[tokio::test(start_paused = true)]
    async fn a_write_failing_at_a_stop_is_tried_again_briefly() {
        let (_stop, stopping) = tokio::sync::watch::channel(true);
        let patience = Patience { lease: Duration::from_secs(60), stopping };
        let tries = AtomicU32::new(0);
        let began = tokio::time::Instant::now();
        let result: Result<(), sqlx::Error> = retrying(&patience, 1, || {
            tries.fetch_add(1, Ordering::Relaxed);
            std::future::ready(Err(sqlx::Error::PoolTimedOut))
        })
        .await;
        assert!(matches!(result, Err(sqlx::Error::PoolTimedOut)));
        assert!(tries.load(Ordering::Relaxed) > 1, "tried again while stopping");
        assert!(began.elapsed() <= STOPPING_PATIENCE, "{:?}", began.elapsed());
    }
}
