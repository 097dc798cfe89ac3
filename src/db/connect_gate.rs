//! New connections while opening one stalls: one attempt at a time, and the reason said.
//!
//! A checkout that finds no idle connection and room in the pool opens one, inside the
//! caller's wait. When opening stalls (PgBouncer paused by an operator, or its database
//! killed: it logs the client in, then leaves the first statement waiting), the checkout
//! times out after 3 s, or its caller's deadline ends it, and the half-opened connection
//! is dropped. PgBouncer does not read from a client that waits for a server, so the
//! closed connection keeps its place in `max_client_conn` until the pause ends: each
//! checkout a slot, at about the request rate. A review filled 500 slots in 20 s with
//! three replicas, and PgBouncer then refused every other application's connections.
//!
//! So once a checkout that would have opened a connection ends without one (after
//! [`STALL_FLOOR`] or more, with room still in the pool: not a caller that waited for a
//! connection to come back, and not a shutdown), the pool is *stalled*. While it is, a
//! caller that would open a connection goes through only if no other such caller is under
//! way (the probe); the others fail at once, as a checkout that timed out would
//! ([`super::failure::held_back`]: nothing was sent, 503). The first connection whose
//! set-up answers clears it. Callers that find an idle connection are not held.
//!
//! On becoming stalled, a connection of its own is opened (once per 5 s at most) to learn
//! why: its error,
//! which the pool's "timed out" hides (the server's `too many connections`, a pooler's
//! `no more connections allowed`), is logged and noted in the pool's [`Health`], so that
//! `/readyz` says a refusal.
//!
//! Tested: `pooler_failures::a_paused_pgbouncer_is_not_filled_with_abandoned_connections`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::{ConnectOptions as _, Connection as _, PgPool};

use super::failure::Health;

/// How long the look at why opening stalls may take.
const DIAGNOSIS_TIMEOUT: Duration = Duration::from_secs(3);

/// The gate of one pool.
#[derive(Default)]
pub struct ConnectGate {
    stalled: AtomicBool,
    probing: AtomicBool,
    /// No probe before this (the pool's [`Health`] clock): after a probe that opened nothing, the
    /// next one waits [`PROBE_SPACING`], doubled after each such probe up to
    /// [`PROBE_SPACING_MOST`] (each stalled probe may cost a paused pooler a slot).
    next_probe_ms: AtomicU64,
    /// Probes in a row that opened nothing.
    failed_probes: AtomicU32,
}

/// The least time between the end of a probe that opened nothing and the next probe.
const PROBE_SPACING: Duration = Duration::from_secs(1);

/// The most time between the end of a probe that opened nothing and the next one: how
/// late, at worst, the pool opens connections again once it can.
const PROBE_SPACING_MOST: Duration = Duration::from_secs(8);

/// A checkout shorter than this, ended without a connection, says nothing about opening
/// one (a caller with little time left gave up while its connection was logging in).
const STALL_FLOOR: Duration = Duration::from_secs(1);

/// Whether `pool` may open another connection (it holds fewer than its most).
fn has_room(pool: &PgPool) -> bool {
    pool.size() < pool.options().get_max_connections()
}

/// A caller let through to sqlx's pool; dropped without [`Pass::got_one`] (an error, or
/// its caller gave up), it leaves the pool stalled if it would have opened a connection.
pub struct Pass {
    health: Arc<Health>,
    pool: PgPool,
    probe: bool,
    would_open: bool,
    got_one: bool,
    /// The pool was closed (a shutdown): nothing to do with opening connections.
    closed: bool,
    began: Instant,
}

impl ConnectGate {
    /// Let a caller of `pool` through, or `None` when the pool is stalled, the caller would
    /// open a connection, and another such caller is already trying.
    pub fn enter(pool: &PgPool, health: &Arc<Health>) -> Option<Pass> {
        let gate = &health.gate;
        let would_open = pool.num_idle() == 0 && has_room(pool);
        let probe = would_open && gate.stalled.load(Ordering::Acquire);
        if probe {
            if gate.probing.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_err() {
                return None;
            }
            // Read once the flag is held: a probe that just failed has set it.
            if health.now_ms() < gate.next_probe_ms.load(Ordering::Acquire) {
                gate.probing.store(false, Ordering::Release);
                return None;
            }
        }
        let began = Instant::now();
        Some(Pass {
            health: health.clone(),
            pool: pool.clone(),
            probe,
            would_open,
            got_one: false,
            closed: false,
            began,
        })
    }

    /// A new connection finished its set-up: opening works (again). Only this clears the
    /// stall: a checkout may get a connection another caller gave back, which says
    /// nothing about opening one (during a pause, that cleared it, and every caller opened
    /// one again).
    pub fn opened(&self) {
        self.failed_probes.store(0, Ordering::Release);
        if self.stalled.swap(false, Ordering::AcqRel) {
            tracing::info!("database: a connection was opened again; new connections are no longer held back");
        }
    }
}

impl Pass {
    /// Check a connection out of sqlx's pool. The probe of a stalled pool does it in a task
    /// of its own, which its caller's deadline does not end: the connection it opens gets
    /// the whole checkout timeout, and at most one is opened at a time. (Probes ended by
    /// their callers' deadlines, a tenth of a second into their wait, opened 300 in 15 s.)
    pub async fn check_out(mut self) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, sqlx::Error> {
        if !self.probe {
            return self.acquire().await;
        }
        // The whole pass moves into the task (a method call captures it whole): the
        // probing flag is held until the attempt ends.
        let attempt = tokio::spawn(async move { self.acquire().await });
        attempt.await.unwrap_or_else(|_| Err(super::failure::not_connected("the connection attempt failed")))
    }

    async fn acquire(&mut self) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, sqlx::Error> {
        let conn = self.pool.acquire().await;
        self.got_one = conn.is_ok();
        self.closed = matches!(conn, Err(sqlx::Error::PoolClosed));
        conn
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        let gate = &self.health.gate;
        // The look at why costs a connection attempt (a login, at a pooler): one per
        // interval, however often the pool stalls and recovers (a pool larger than the
        // pooler lets it have stalls at every connection past the limit).
        static DIAGNOSED: crate::log_throttle::Throttle =
            crate::log_throttle::Throttle::new(crate::log_throttle::INTERVAL);
        // Ended without a connection, after a while, with room in the pool at the end as at
        // the start: its checkout was opening one (a full pool's callers wait for a
        // connection to come back, which says nothing about opening one).
        let stalled = !self.got_one
            && self.would_open
            && !self.closed
            && self.began.elapsed() >= STALL_FLOOR
            && has_room(&self.pool);
        if stalled && !gate.stalled.swap(true, Ordering::AcqRel) && DIAGNOSED.admit().is_some() {
            tokio::spawn(diagnose(self.pool.clone(), self.health.clone()));
        }
        if self.probe {
            if !self.got_one {
                let failed = gate.failed_probes.fetch_add(1, Ordering::AcqRel).min(8);
                let spacing = (PROBE_SPACING * 2u32.pow(failed)).min(PROBE_SPACING_MOST);
                gate.next_probe_ms.store(self.health.now_ms() + spacing.as_millis() as u64, Ordering::Release);
            }
            gate.probing.store(false, Ordering::Release);
        }
    }
}

/// Open a connection apart from the pool and say why opening stalls or fails.
async fn diagnose(pool: PgPool, health: Arc<Health>) {
    let options = pool.connect_options();
    let attempt = tokio::time::timeout(DIAGNOSIS_TIMEOUT, options.connect()).await;
    match attempt {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            tracing::warn!(
                "database: a checkout ended before its new connection was ready (a slow server or pooler, or a \
                 paused PgBouncer); new connections are tried one at a time until one is ready"
            );
        }
        Ok(Err(e)) => {
            if let Some((_, Some(refusal))) = super::failure::classify(&e) {
                health.note_refusal(refusal);
            }
            tracing::warn!(error = %e, "database: new connections fail; they are tried one at a time until one opens");
        }
        Err(_) => tracing::warn!(
            "database: opening a connection does not finish (a paused PgBouncer? a server that accepts and does not \
             answer); new connections are tried one at a time until one opens"
        ),
    }
}
