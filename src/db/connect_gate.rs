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
//! So once a checkout that would have opened a connection ends without one, the pool is
//! *stalled*: while it is, a caller that would open a connection goes through only if no
//! other such caller is under way (the probe); the others fail at once, as a checkout
//! that timed out would ([`super::failure::not_connected`]: nothing was sent, 503). The
//! first connection opened clears it. Callers that find an idle connection are not held.
//!
//! On becoming stalled, a connection of its own is opened (once) to learn why: its error,
//! which the pool's "timed out" hides (the server's `too many connections`, a pooler's
//! `no more connections allowed`), is logged and noted in the pool's [`Health`], so that
//! `/readyz` says a refusal.
//!
//! Tested: `pooler_failures::a_paused_pgbouncer_is_not_filled_with_abandoned_connections`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// No probe before this (ms since [`ORIGIN`]): one a [`PROBE_SPACING`] after a probe
    /// that opened nothing, not one after another against a server refusing them.
    next_probe_ms: AtomicU64,
}

static ORIGIN: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

/// The least time between the end of a probe that opened nothing and the next probe.
const PROBE_SPACING: Duration = Duration::from_secs(1);

fn now_ms() -> u64 {
    ORIGIN.elapsed().as_millis() as u64
}

/// A caller let through to sqlx's pool; dropped without [`Pass::got_one`] (an error, or
/// its caller gave up), it leaves the pool stalled if it would have opened a connection.
pub struct Pass {
    health: Arc<Health>,
    pool: PgPool,
    probe: bool,
    would_open: bool,
    got_one: bool,
}

impl ConnectGate {
    /// Let a caller of `pool` through, or `None` when the pool is stalled, the caller would
    /// open a connection, and another such caller is already trying.
    pub fn enter(pool: &PgPool, health: &Arc<Health>) -> Option<Pass> {
        let gate = &health.gate;
        let would_open = pool.num_idle() == 0 && pool.size() < pool.options().get_max_connections();
        let probe = would_open && gate.stalled.load(Ordering::Acquire);
        if probe
            && (now_ms() < gate.next_probe_ms.load(Ordering::Acquire)
                || gate.probing.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_err())
        {
            return None;
        }
        Some(Pass { health: health.clone(), pool: pool.clone(), probe, would_open, got_one: false })
    }

    /// A new connection finished its set-up: opening works (again). Only this clears the
    /// stall: a checkout may get a connection another caller gave back, which says
    /// nothing about opening one (during a pause, that cleared it, and every caller opened
    /// one again).
    pub fn opened(&self) {
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
        if !self.got_one && self.would_open && !gate.stalled.swap(true, Ordering::AcqRel) && DIAGNOSED.admit().is_some()
        {
            tokio::spawn(diagnose(self.pool.clone(), self.health.clone()));
        }
        if self.probe {
            if !self.got_one {
                gate.next_probe_ms.store(now_ms() + PROBE_SPACING.as_millis() as u64, Ordering::Release);
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
