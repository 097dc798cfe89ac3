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

use tokio::time::Instant;

use crate::db::{self, Pool};

/// A gateway's name as a lease holder and in `janitor_runs`: host, pid, and a random
/// suffix (two gateways in one process, as in tests, are still told apart). Made once per
/// gateway, at its start.
pub fn instance_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown-host".to_owned());
    format!("{host}/{}/{:04x}", std::process::id(), rand::random::<u16>())
}

/// Wait `pause` between two rounds of a periodic job, unless `stop` comes first: whether
/// to go on.
pub async fn pause(pause: Duration, stop: &mut tokio::sync::watch::Receiver<bool>) -> bool {
    tokio::select! {
        () = tokio::time::sleep(pause) => true,
        _ = stop.wait_for(|s| *s) => false,
    }
}

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

/// Who holds a lease after [`acquire_or_renew`].
#[derive(Debug, Clone)]
pub enum Holding {
    /// This holder, until at least the lease's time to live from now.
    Mine(Lease),
    /// Another holder, whose lease ends in this long (unless renewed).
    Theirs(Duration),
}

/// Take the lease `name` for `holder` when it is free or expired, or renew it when
/// `holder` already has it (keeping its token); otherwise say when the other holder's
/// lease ends. One statement.
pub async fn acquire_or_renew(
    pool: &Pool,
    name: &'static str,
    holder: &str,
    ttl: Duration,
) -> Result<Holding, sqlx::Error> {
    let (token, ends_in): (Option<i64>, Option<f64>) = db::query_as(
        "WITH taken AS (
             INSERT INTO leases AS l (name, holder, token, expires_at)
             VALUES ($1, $2, 1, now() + make_interval(secs => $3))
             ON CONFLICT (name) DO UPDATE
                 SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at,
                     token = CASE WHEN l.holder = EXCLUDED.holder AND l.expires_at > now() THEN l.token
                                  ELSE l.token + 1 END
                 WHERE l.expires_at <= now() OR l.holder = EXCLUDED.holder
             RETURNING token)
         SELECT (SELECT token FROM taken),
                (SELECT extract(epoch FROM expires_at - now())::float8 FROM leases WHERE name = $1)",
    )
    .bind(name)
    .bind(holder)
    .bind(ttl.as_secs_f64())
    .fetch_one(pool)
    .await?;
    Ok(match token {
        Some(token) => Holding::Mine(Lease { name, holder: holder.to_owned(), token, ttl }),
        None => Holding::Theirs(Duration::from_secs_f64(ends_in.unwrap_or(0.0).clamp(0.0, ttl.as_secs_f64()))),
    })
}

/// Whether this gateway leads a periodic job across the fleet, kept current for the price
/// of a statement per `ttl / 3` for the leader and one per leader's lease for each other
/// replica: the leader renews its lease a few times per time to live, and a follower asks
/// again only when the leader's lease would end. A leader that dies is replaced within
/// its time to live (plus a follower's next look).
#[derive(Debug)]
pub struct Leadership {
    name: &'static str,
    holder: String,
    ttl: Duration,
    leading: bool,
    next_look: Option<Instant>,
}

impl Leadership {
    /// Leadership of job `name` for `holder`, with leases of `ttl`.
    pub fn new(name: &'static str, holder: String, ttl: Duration) -> Leadership {
        Leadership { name, holder, ttl, leading: false, next_look: None }
    }

    /// Whether this gateway leads now, asking the database only when it is time to. A
    /// database error ends the leadership (the job is skipped, and asked about again a
    /// second later).
    pub async fn leads(&mut self, pool: &Pool) -> bool {
        let now = Instant::now();
        if self.next_look.is_some_and(|at| now < at) {
            return self.leading;
        }
        let (leading, next) = match acquire_or_renew(pool, self.name, &self.holder, self.ttl).await {
            Ok(Holding::Mine(_)) => (true, self.ttl / 3),
            // A little after the leader's lease would end, so its renewal has gone first.
            Ok(Holding::Theirs(ends_in)) => (false, ends_in + Duration::from_millis(rand::random_range(10..250))),
            Err(e) => {
                tracing::debug!(error = %e, job = self.name, "leadership: cannot reach the database");
                (false, Duration::from_secs(1))
            }
        };
        if leading != self.leading {
            tracing::info!(job = self.name, holder = %self.holder, leading, "leadership changed");
        }
        self.leading = leading;
        self.next_look = Some(now + next);
        leading
    }
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
