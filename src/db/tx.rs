//! [`Tx`]: a transaction on the connection given back last, whose connection is kept warm
//! again when it commits.
//!
//! sqlx's `Transaction<'static>` owns its pooled connection and, when it ends, drops it
//! back into sqlx's pool: through a spawned task and a ping (a round trip, and a second
//! wake-up of the PostgreSQL backend), first in, first out. The claim and the outcome
//! recorder are transactions, one or two a batch, so a drain paid that round trip for
//! each. A [`Tx`] begins, commits and rolls back with sqlx's own transaction manager
//! (`PgTransactionManager`, the code `Transaction` runs) on a [`WarmConn`]; a committed
//! or rolled back transaction's connection is idle and fully read, so it is given back
//! warm as a statement's is ([`super::warm`]). Anything else goes back as sqlx's own
//! `Transaction` would go: a transaction dropped open (an error, a `?`, a cancelled
//! caller) queues its `ROLLBACK` and the connection returns through sqlx's pool, whose
//! ping sends it; a failed `COMMIT` or `ROLLBACK` the same.
//!
//! Tested: `warm_connections::a_committed_transaction_s_connection_is_kept_warm` and
//! `warm_connections::a_transaction_left_open_rolls_back_and_leaves_no_answer_behind`.

use std::borrow::Cow;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use sqlx::postgres::PgTransactionManager;
use sqlx::{PgConnection, TransactionManager};

use super::failure::Health;
use super::warm::{Warm, WarmConn};

/// A transaction of the gateway's [`super::Pool`] (`pool.begin()`): statements run on
/// `&mut *tx`; it ends with [`Tx::commit`] or [`Tx::rollback`], and rolls back if dropped
/// open.
pub struct Tx {
    /// `None` once it ended.
    conn: Option<WarmConn>,
    warm: Arc<Warm>,
    health: Arc<Health>,
}

impl Tx {
    /// Begin a transaction on `conn` with `begin` (the ANSI `BEGIN` when `None`).
    pub(super) async fn begin(
        conn: WarmConn,
        begin: Option<&'static str>,
        warm: Arc<Warm>,
        health: Arc<Health>,
    ) -> Result<Tx, sqlx::Error> {
        // sqlx 0.8.6 counts the transaction (the depth its rollback guard keys on) only once
        // the `BEGIN`'s answer is read: a `BEGIN` sent and then abandoned (the caller's
        // timeout over a frozen database) or failed queues no `ROLLBACK`, and the pool's
        // ping would read the answer and hand the connection on inside the transaction
        // (the next caller's statements in it; `there is already a transaction in
        // progress`). Such a connection is closed instead: the server rolls back.
        let mut beginning = ClosedUnlessBegun(Some(conn));
        if let Some(conn) = beginning.0.as_mut() {
            PgTransactionManager::begin(conn.conn(), begin.map(Cow::Borrowed)).await?;
        }
        Ok(Tx { conn: beginning.0.take(), warm, health })
    }

    /// Commit; the connection is kept warm for the next caller.
    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        PgTransactionManager::commit(&mut self).await?;
        self.end();
        Ok(())
    }

    /// Roll back; the connection is kept warm for the next caller.
    pub async fn rollback(mut self) -> Result<(), sqlx::Error> {
        PgTransactionManager::rollback(&mut self).await?;
        self.end();
        Ok(())
    }

    /// The transaction ended on the server: its connection is idle with nothing left to
    /// read (the manager waited for the answer), like a statement's read to its end.
    fn end(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.warm.give_back(conn, &self.health);
        }
    }
}

impl Deref for Tx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        // Only `end` and `drop` take the connection, and both end the `Tx`.
        #[allow(clippy::expect_used)]
        self.conn.as_ref().expect("a transaction that has not ended has its connection").conn_ref()
    }
}

impl DerefMut for Tx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        // Only `end` and `drop` take the connection, and both end the `Tx`.
        #[allow(clippy::expect_used)]
        self.conn.as_mut().expect("a transaction that has not ended has its connection").conn()
    }
}

/// A connection whose `BEGIN` has not been answered yet: closed if dropped so.
struct ClosedUnlessBegun(Option<WarmConn>);

impl Drop for ClosedUnlessBegun {
    fn drop(&mut self) {
        if let Some(conn) = self.0.as_mut() {
            conn.close_on_drop();
        }
    }
}

impl Drop for Tx {
    /// Open (never ended, or its `COMMIT` or `ROLLBACK` failed or was abandoned): queue the
    /// `ROLLBACK` as sqlx's `Transaction` does and let the connection go back through sqlx's
    /// pool, whose ping sends it (and closes the connection if that fails).
    fn drop(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            PgTransactionManager::start_rollback(conn.conn());
        }
    }
}
