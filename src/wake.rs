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
//!
//! Channels are database-wide, and gateways in schemas of their own may share a database
//! (docs/production-postgres.md, "A schema of its own"): each notification carries the
//! notifier's schema, and a listener wakes for its own schema's only. An empty payload
//! (what releases before this one send) wakes every listener, as it always did, so two
//! releases side by side in a rolling deploy still wake each other.

use std::sync::Arc;
use std::time::Duration;

use crate::db::Pool;
use crate::ids::DeliveryId;
use sqlx::postgres::PgListener;
use tokio::sync::{Notify, watch};

/// Deliveries just made claimable by this process, handed to its own dispatcher, which
/// claims them by key ([`crate::queue::claim_fresh`]) rather than through the due index:
/// those its ingest committed (role `all`), and those its recorder made their ordering
/// lines' heads. At low load every ingest commit, and in an ordered drain every line step,
/// wakes the dispatcher for a few deliveries, and the general claim is planned at every
/// call. Bounded: past
/// [`HANDOFF_DELIVERIES`] it stops holding ids and says so, and the dispatcher claims the
/// general way (under load every claim is full anyway).
#[derive(Debug)]
pub struct Handoff {
    /// What arrived since the last take; `None` once more arrived than it holds.
    held: std::sync::Mutex<Option<Vec<DeliveryId>>>,
    arrived: Notify,
}

/// Most delivery ids a [`Handoff`] holds between two claims.
pub const HANDOFF_DELIVERIES: usize = 256;

impl Default for Handoff {
    fn default() -> Self {
        Handoff { held: std::sync::Mutex::new(Some(Vec::new())), arrived: Notify::new() }
    }
}

impl Handoff {
    /// Hand over `deliveries`, just committed claimable, and wake the dispatcher.
    pub fn push(&self, deliveries: &[DeliveryId]) {
        {
            let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match held.as_mut() {
                Some(ids) if ids.len() + deliveries.len() <= HANDOFF_DELIVERIES => ids.extend_from_slice(deliveries),
                _ => *held = None,
            }
        }
        self.arrived.notify_one();
    }

    /// Everything handed over since the last take (possibly nothing), or `None` when more
    /// arrived than the hand-off holds: then claim the general way.
    pub fn take(&self) -> Option<Vec<DeliveryId>> {
        let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        held.replace(Vec::new())
    }

    /// Forget what was handed over: a general claim is about to find it.
    pub fn clear(&self) {
        let _ = self.take();
    }

    /// Resolves when something is handed over (at once if something was since the last
    /// wait).
    pub async fn arrived(&self) {
        self.arrived.notified().await
    }
}

/// The notification channel.
pub const CHANNEL: &str = "webhook_gateway_wake";
/// The statement that wakes the listeners of this session's schema: on [`CHANNEL`], the
/// payload naming the schema (see the module's doc).
pub fn notify() -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
    crate::db::query("SELECT pg_notify($1, coalesce(current_schema()::text, ''))").bind(CHANNEL)
}
/// Bursts of ingests within this window share one notification.
pub const COALESCE: Duration = Duration::from_millis(5);

/// Ingest side: turn local wake-ups into (coalesced) notifications until `stop`.
pub async fn notify_others(pool: Pool, wake: Arc<Notify>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            () = wake.notified() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        if let Err(e) = notify().execute(&pool).await {
            tracing::debug!(error = %e, "wake notification failed; workers fall back to polling");
        }
        tokio::time::sleep(COALESCE).await;
    }
}

/// Delivering side (roles `worker` and `all`): wake the local dispatcher on every
/// notification until `stop`. The listener reconnects by itself after a connection loss.
/// Role `all` listens too, for `--role ingest` replicas beside it: its own ingest hands
/// its deliveries over directly and notifies nobody, so in a fleet of `all` replicas
/// alone nothing arrives and the listener costs one idle session.
///
/// `LISTEN` needs a session of its own: behind a transaction pooler the registration
/// would stay on a server connection the listener no longer holds, and no notification
/// would ever arrive (with no error). There it listens through the direct session URL
/// (`--db-session-url`), and without one it does not listen: the workers poll (every
/// `--poll-interval-ms`), which the log says once (a warning for a worker, which
/// delivers nothing else; a note for role `all`, whose own webhooks need no wake-up).
pub async fn listen(pool: Pool, wake: Arc<Notify>, role: crate::role::Role, mut stop: watch::Receiver<bool>) {
    let Some(session) = pool.session_pool() else {
        const NO_LISTEN: &str = "behind a transaction pooler without --db-session-url: no LISTEN for wake-ups from \
                                 ingest processes; workers find new deliveries by polling";
        if role == crate::role::Role::Worker {
            tracing::warn!("{NO_LISTEN}");
        } else {
            tracing::info!("{NO_LISTEN}");
        }
        return;
    };
    // Tried again until it works: a database out of connections at start-up (a fleet
    // started at once) left a replica polling for good, its workers' every delivery from
    // another process waiting for a poll.
    let mut pause = LISTEN_RETRY_FIRST;
    let mut listener = loop {
        let listening = async {
            let mut listener = PgListener::connect_with(&session).await?;
            listener.listen(CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match listening.await {
            Ok(listener) => {
                if pause > LISTEN_RETRY_FIRST {
                    tracing::info!("listening for wake-ups again");
                }
                break listener;
            }
            Err(e) => {
                // Said at the first failure, then every few minutes while it lasts: a
                // session URL that can never work (a wrong password) must not go quiet.
                static STILL: crate::log_throttle::Throttle =
                    crate::log_throttle::Throttle::new(std::time::Duration::from_secs(300));
                if STILL.admit().is_some() {
                    tracing::warn!(error = %e, "cannot LISTEN for wake-ups; workers poll meanwhile, and it is tried \
                        again (every 1 s, then less often, up to every 30 s)");
                }
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
                pause = (pause * 2).min(LISTEN_RETRY_MOST);
            }
        }
    };
    // The schema the gateway's own statements use (the pool's session, which behind a
    // pooler the alias or role sets; the listener's session URL may not name it).
    let schema = match crate::db::query_scalar::<Option<String>>("SELECT current_schema()::text").fetch_one(&pool).await
    {
        Ok(schema) => schema,
        Err(e) => {
            tracing::debug!(error = %e, "schema unknown; every wake-up on the channel wakes the workers");
            None
        }
    };
    loop {
        let received = tokio::select! {
            received = listener.recv() => received,
            _ = stop.wait_for(|s| *s) => return,
        };
        match received {
            Ok(notification) if wakes(notification.payload(), schema.as_deref()) => wake.notify_one(),
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "wake listener error; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// The first wait before `LISTEN` is tried again after a failure; each next one doubles.
const LISTEN_RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two tries of `LISTEN`.
const LISTEN_RETRY_MOST: Duration = Duration::from_secs(30);

/// Whether a notification with `payload` wakes the workers of a gateway in `schema`
/// (`None`: not known).
fn wakes(payload: &str, schema: Option<&str>) -> bool {
    payload.is_empty() || schema.is_none_or(|schema| schema == payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notification_wakes_its_own_schema_and_an_older_release_s_wakes_everyone() {
        assert!(wakes("gw_a", Some("gw_a")));
        assert!(!wakes("gw_b", Some("gw_a")), "another schema's ingest");
        assert!(wakes("", Some("gw_a")), "a release before the payload named the schema");
        assert!(wakes("gw_b", None), "schema unknown: wake rather than wait for the poll");
    }

    fn delivery(n: u128) -> DeliveryId {
        DeliveryId(uuid::Uuid::from_u128(n))
    }

    #[test]
    fn a_handoff_gives_what_arrived_once_and_says_when_it_overflowed() {
        let handoff = Handoff::default();
        assert_eq!(handoff.take(), Some(Vec::new()));
        handoff.push(&[delivery(1)]);
        handoff.push(&[delivery(2), delivery(3)]);
        assert_eq!(handoff.take(), Some(vec![delivery(1), delivery(2), delivery(3)]));
        assert_eq!(handoff.take(), Some(Vec::new()));

        let all: Vec<DeliveryId> = (0..HANDOFF_DELIVERIES as u128).map(delivery).collect();
        handoff.push(&all);
        assert_eq!(handoff.take(), Some(all.clone()), "it holds up to its bound");
        handoff.push(&all);
        handoff.push(&[delivery(9)]);
        handoff.push(&[delivery(10)]);
        assert_eq!(handoff.take(), None, "overflowed");
        assert_eq!(handoff.take(), Some(Vec::new()), "the overflow is reported once");

        handoff.push(&[delivery(3)]);
        handoff.clear();
        assert_eq!(handoff.take(), Some(Vec::new()));
    }
}
