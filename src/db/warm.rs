//! The connections this process used last, handed out again first.
//!
//! sqlx's pool keeps its idle connections first in, first out, and returns each one
//! through a spawned task that pings the server (a round trip) before it is idle again.
//! Under a trickle of statements that spreads them over every connection the pool has
//! ever opened (eleven in bench row 5 at 500/s, each of them busy every second): each
//! statement wakes a PostgreSQL backend that has not run for several statements, whose
//! caches other processes have had the cores to overwrite, and pays a second round trip
//! for the ping. So a statement run on the [`super::Pool`] takes the connection returned
//! last ([`Warm::take`]) and, once it has read its whole answer, gives it back here
//! ([`Warm::give_back`]): last in, first out, with no ping, at most [`MOST_KEPT`] of them
//! (half the pool, for a small one).
//!
//! A connection kept here is in use as far as sqlx's pool can tell, so nothing here may
//! keep one from a caller that needs it, or keep one that sqlx would have discarded:
//!
//! - **No caller starves.** A caller that finds no connection here counts itself as
//!   waiting before it asks sqlx's pool (under the same lock as the look), and while
//!   anyone waits a connection given back goes to sqlx's pool, which hands it on. Every
//!   acquisition of the gateway's pool (statements and transactions) looks here first.
//!   Tested: `warm_connections::a_caller_waiting_for_sqlx_s_pool_gets_the_connection_given_back`.
//! - **sqlx's checks still run.** A connection goes back to sqlx's pool (and through its
//!   checks: the stale mark after a failover, the connection's lifetime, the ping) once it
//!   has been kept warm for [`REVETTED_AFTER`], after any failed statement, and when the
//!   statement's caller stopped waiting (the statement may be half read). One taken
//!   before the pool's [`Health`] last marked connections stale (a failover, a read-only
//!   or departing node) is closed, as sqlx's check would close it.
//! - **Closing** hands everything kept here back first, so sqlx's `close` does not wait
//!   for connections nobody is using.
//! - **A burst's connections do not stay open because they are kept here**: the one kept
//!   longest goes back to sqlx's pool once unused for [`UNUSED_FOR`], and sqlx closes it
//!   after its idle timeout. Tested: `warm_connections::connections_a_burst_left_warm_go_back_once_unused`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};

use super::connect_gate::ConnectGate;
use super::failure::Health;

/// How long a connection is kept warm before it goes back through sqlx's pool (and its
/// checks) once.
pub const REVETTED_AFTER: Duration = Duration::from_secs(60);

/// How long a connection may stay warm unused before it goes back to sqlx's pool (which
/// closes it after its own idle timeout, ten minutes): after a burst, the connections it
/// opened do not stay open because they were kept here.
pub const UNUSED_FOR: Duration = Duration::from_secs(5);

/// Most connections kept warm: more than a trickle of statements uses at once, and at
/// most half the pool (a pool of two keeps one), so that what sqlx's pool can hand out
/// directly never falls to nothing because of this.
const MOST_KEPT: usize = 8;

/// A pooled connection taken from [`Warm`] or from sqlx's pool, with what decides whether
/// it may be kept warm when it comes back.
pub struct WarmConn {
    conn: PoolConnection<Postgres>,
    /// When it was taken from sqlx's pool.
    since: Instant,
    /// When it was last kept warm.
    kept_at: Instant,
    /// The pool's stale mark when it was taken from sqlx's pool.
    stale_mark: u64,
}

impl WarmConn {
    /// The connection, to run statements on.
    pub fn conn(&mut self) -> &mut PgConnection {
        &mut self.conn
    }

    /// The connection, to read its state.
    pub fn conn_ref(&self) -> &PgConnection {
        &self.conn
    }

    /// Close the connection when it is dropped, instead of returning it to sqlx's pool.
    pub(super) fn close_on_drop(&mut self) {
        self.conn.close_on_drop();
    }

    /// Whether it may still be used without sqlx's checks: kept for less than
    /// [`REVETTED_AFTER`], and no connection marked stale since it was taken.
    fn fresh(&self, health: &Health) -> bool {
        self.since.elapsed() < REVETTED_AFTER && self.stale_mark == health.stale_mark()
    }
}

/// The warm connections of one pool (see the module doc).
pub struct Warm {
    state: Mutex<State>,
    cap: usize,
}

#[derive(Default)]
struct State {
    /// Most recently given back last.
    kept: Vec<WarmConn>,
    /// Callers asking sqlx's pool for a connection right now.
    waiting: usize,
    closed: bool,
}

/// Counts its caller as waiting for sqlx's pool until dropped (also when the caller is
/// cancelled mid-wait).
struct Waiting<'a>(&'a Warm);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Ok(mut state) = self.0.state.lock() {
            state.waiting -= 1;
        }
    }
}

impl Warm {
    /// Warm connections for a pool of `pool_size`.
    pub(super) fn new(pool_size: u32) -> Warm {
        Warm { state: Mutex::default(), cap: (pool_size as usize / 2).clamp(1, MOST_KEPT) }
    }

    /// Connections kept warm now.
    pub(super) fn len(&self) -> usize {
        self.state.lock().map(|s| s.kept.len()).unwrap_or(0)
    }

    /// The connection given back last that may still be used, or one from sqlx's pool.
    pub(super) async fn take(&self, pool: &PgPool, health: &Arc<Health>) -> Result<WarmConn, sqlx::Error> {
        let waiting = loop {
            let Ok(mut state) = self.state.lock() else { break None };
            match state.kept.pop() {
                Some(warm) if warm.fresh(health) => return Ok(warm),
                // Let go outside the lock.
                Some(spent) => {
                    drop(state);
                    let_go(spent, health);
                }
                None => {
                    state.waiting += 1;
                    break Some(Waiting(self));
                }
            }
        };
        let Some(pass) = ConnectGate::enter(pool, health) else {
            drop(waiting);
            return Err(super::failure::held_back(
                "opening connections stalls; one is tried at a time, and another caller is trying",
            ));
        };
        let conn = pass.check_out().await;
        drop(waiting);
        let now = Instant::now();
        let conn = conn.map_err(super::failure::connect_failed)?;
        Ok(WarmConn { conn, since: now, kept_at: now, stale_mark: health.stale_mark() })
    }

    /// Keep `conn`, whose statement ran to the end, for the next caller, unless someone
    /// waits for sqlx's pool, enough are kept, or it is due back there (then it goes back
    /// to sqlx's pool).
    pub(super) fn give_back(&self, mut conn: WarmConn, health: &Health) {
        if !conn.fresh(health) {
            let_go(conn, health);
            return;
        }
        let Ok(mut state) = self.state.lock() else { return };
        // The one kept longest without use goes back to sqlx's pool, which closes it after
        // its idle timeout: what is kept shrinks to what the load uses.
        let unused = match state.kept.first() {
            Some(oldest) if oldest.kept_at.elapsed() > UNUSED_FOR => Some(state.kept.remove(0)),
            _ => None,
        };
        let refused = if state.closed || state.waiting > 0 || state.kept.len() >= self.cap {
            Some(conn)
        } else {
            conn.kept_at = Instant::now();
            state.kept.push(conn);
            None
        };
        drop(state);
        drop(refused);
        if let Some(unused) = unused {
            let_go(unused, health);
        }
    }

    /// Hand every kept connection back to sqlx's pool and keep none from now on.
    pub(super) fn close(&self) {
        let kept = match self.state.lock() {
            Ok(mut state) => {
                state.closed = true;
                std::mem::take(&mut state.kept)
            }
            Err(_) => return,
        };
        drop(kept);
    }
}

/// A connection that is not kept warm (any more): closed if the pool's stale mark moved
/// since it was taken (it was open then, so it was opened before the mark: a connection to
/// a node that refused writes or went away), otherwise back to sqlx's pool.
fn let_go(mut warm: WarmConn, health: &Health) {
    if warm.stale_mark != health.stale_mark() {
        warm.conn.close_on_drop();
    }
}
