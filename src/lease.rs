//! Leader leases: one holder at a time for a named periodic job, across every replica.
//!
//! A lease is a row in `leases` (name, holder, token, expiry), taken and renewed with
//! ordinary transactions, so it works behind a transaction pooler, where a session
//! advisory lock would stay on a server connection the pooler hands to another client.
//!
//! - **Taking it** ([`acquire`]) is one upsert that succeeds only when the row is absent
//!   or expired; two replicas racing for it serialize on the row, and the second finds
//!   it taken. Each new holder gets the next `token`.
//! - **Holding it** ([`Lease::hold`]) is checked inside each transaction that does the
//!   job's work: it extends the expiry and locks the row until that transaction ends, and
//!   fails if the token moved on (the lease expired and another replica took it). So a
//!   holder that stalled past its expiry cannot commit work beside its successor: the
//!   token fences it, like a claim token fences a stale delivery worker.
//! - **Letting go** ([`Lease::release`]) expires it at once; a holder that died lets it
//!   expire by itself, after its time to live.

use std::time::Duration;

use crate::db::{self, Pool};

/// A lease this process holds.
#[derive(Debug, Clone)]
pub struct Lease {
    name: &'static str,
    holder: String,
    token: i64,
    ttl: Duration,
}

/// Take the lease `name` for `holder` for `ttl`, unless another holder has it and it has
/// not expired (`None`).
pub async fn acquire(
    pool: &Pool,
    name: &'static str,
    holder: &str,
    ttl: Duration,
) -> Result<Option<Lease>, sqlx::Error> {
    let token: Option<i64> = db::query_scalar(
        "INSERT INTO leases AS l (name, holder, token, expires_at)
         VALUES ($1, $2, 1, now() + make_interval(secs => $3))
         ON CONFLICT (name) DO UPDATE
             SET holder = EXCLUDED.holder, token = l.token + 1, expires_at = EXCLUDED.expires_at
             WHERE l.expires_at <= now()
         RETURNING token",
    )
    .bind(name)
    .bind(holder)
    .bind(ttl.as_secs_f64())
    .fetch_optional(pool)
    .await?;
    Ok(token.map(|token| Lease { name, holder: holder.to_owned(), token, ttl }))
}

impl Lease {
    /// Inside the transaction `tx` that does the job's work: extend the lease by its time
    /// to live and lock its row until `tx` ends. `false`: it was taken over, and the
    /// caller must roll back and stop.
    pub async fn hold(&self, tx: &mut sqlx::PgConnection) -> Result<bool, sqlx::Error> {
        let held = db::query(
            "UPDATE leases SET expires_at = now() + make_interval(secs => $3)
             WHERE name = $1 AND token = $2",
        )
        .bind(self.name)
        .bind(self.token)
        .bind(self.ttl.as_secs_f64())
        .execute(tx)
        .await?;
        Ok(held.rows_affected() == 1)
    }

    /// Let go: the lease expires now, unless it was already taken over.
    pub async fn release(&self, pool: &Pool) -> Result<(), sqlx::Error> {
        db::query("UPDATE leases SET expires_at = now() WHERE name = $1 AND token = $2")
            .bind(self.name)
            .bind(self.token)
            .execute(pool)
            .await
            .map(|_| ())
    }

    /// Who holds it (for logs and records).
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Its fencing token.
    pub fn token(&self) -> i64 {
        self.token
    }
}
