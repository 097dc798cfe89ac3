//! Waking idle workers in other processes when ingest creates deliveries.
//!
//! In a process that both ingests and delivers (role `all`) the ingest handler wakes
//! the local dispatcher directly. When ingest and delivery run in separate processes
//! (roles `ingest` and `worker`), the ingest process sends `NOTIFY` on
//! [`CHANNEL`] and worker processes `LISTEN`. The notify is sent *after* the ingest
//! commit, on its own connection, coalesced to at most one per [`COALESCE`]: it adds no
//! statement to the ingest transaction and no lock to its commit (a `NOTIFY` inside the
//! transaction would serialise every ingest commit on the notification queue lock).
//! Polling stays the fallback: a lost notification costs at most one poll interval.

use std::sync::Arc;
use std::time::Duration;

use crate::db::Pool;
use sqlx::postgres::PgListener;
use tokio::sync::{Notify, watch};

/// The notification channel.
pub const CHANNEL: &str = "webhook_gateway_wake";
/// Bursts of ingests within this window share one notification.
pub const COALESCE: Duration = Duration::from_millis(5);

/// Ingest side: turn local wake-ups into (coalesced) notifications until `stop`.
pub async fn notify_others(pool: Pool, wake: Arc<Notify>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            () = wake.notified() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        if let Err(e) = crate::db::query("SELECT pg_notify($1, '')").bind(CHANNEL).execute(&pool).await {
            tracing::debug!(error = %e, "wake notification failed; workers fall back to polling");
        }
        tokio::time::sleep(COALESCE).await;
    }
}

/// Worker side: wake the local dispatcher on every notification until `stop`. The
/// listener reconnects by itself after a connection loss.
///
/// `LISTEN` needs a session of its own: behind a transaction pooler the registration
/// would stay on a server connection the listener no longer holds, and no notification
/// would ever arrive (with no error). There it listens through the direct session URL
/// (`--db-session-url`), and without one it does not listen: the workers poll (every
/// `--poll-interval-ms`), which the log says once.
pub async fn listen(pool: Pool, wake: Arc<Notify>, mut stop: watch::Receiver<bool>) {
    let Some(session) = pool.session_pool() else {
        tracing::warn!(
            "behind a transaction pooler without --db-session-url: no LISTEN for wake-ups from ingest processes; \
             workers find new deliveries by polling"
        );
        return;
    };
    let mut listener = match PgListener::connect_with(&session).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "cannot LISTEN for wake-ups; workers rely on polling");
            return;
        }
    };
    if let Err(e) = listener.listen(CHANNEL).await {
        tracing::warn!(error = %e, "cannot LISTEN for wake-ups; workers rely on polling");
        return;
    }
    loop {
        let received = tokio::select! {
            received = listener.recv() => received,
            _ = stop.wait_for(|s| *s) => return,
        };
        match received {
            Ok(_) => wake.notify_one(),
            Err(e) => {
                tracing::debug!(error = %e, "wake listener error; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
