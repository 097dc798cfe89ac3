//! The search index's pending list, merged in the background instead of by a webhook.
//!
//! `events_search` is a GIN index with `fastupdate` (migration 0018): an insert appends
//! its keys to the index's pending list, and the list is merged into the index in bulk.
//! Left alone, the insert that pushes the list past its limit (16 MB) merges the whole
//! list itself, inside its statement: measured on the bench (row 3, one connection), one
//! webhook's answer waited 1.37 s for it. Here the replica that leads the `search-merge`
//! job ([`crate::lease::Leadership`]) merges the list with `gin_clean_pending_list`, so
//! no insert reaches the limit. The merging is the same work; it only leaves the request
//! path.
//!
//! - **How often.** A merge inserts each key once for all the events that carry it (the
//!   values every event carries, an event type or a currency, are most of a webhook's
//!   terms), so a merge of a few hundred events pays that once for few of them: at
//!   300-1,000/s, merging every second took 22-36 µs of PostgreSQL a webhook, merges
//!   paced as here 17-29 µs (bench/PROFILE.md, "The search index merged by the list's
//!   size"). So the leader aims at about [`TARGET_PAGES`] pages a merge: it paces its
//!   next merge by the pages the last one took, every [`TICK`] at the most (a fast list)
//!   and every [`IDLE_TICK`] at the least (a slow one, or an idle fleet). The list stays
//!   a few MB, far under its 16 MB limit. A search reads the whole list: at most about
//!   20 ms for 4 MB on the bench's machine (row 16 reads about a second of 64-connection
//!   ingest in 33-57 ms), where a list of one second at 300/s took a few.
//! - **Who may.** `gin_clean_pending_list` is for the index's owner: the role that ran the
//!   migrations. A gateway that connects as another role is refused; it says so once and
//!   asks again every [`REFUSED_RETRY`] (ownership can be granted), and the list is
//!   merged by autovacuum and by the inserts meanwhile, as before (docs/operating.md,
//!   "The search index"). An index that is not there (dropped to be rebuilt) is looked
//!   for again every [`IDLE_TICK`].
//! - **Where.** Replicas that ingest (roles `all` and `ingest`); one of them at a time. Two
//!   leaders for a moment (a lease taken over from a stalled one) only queue one merge
//!   behind the other: PostgreSQL lets one merge run at a time.
//! - **When the database refuses.** A read-only node, a failover, a statement timeout: the
//!   round is skipped and tried again after [`IDLE_TICK`]; nothing else waits for it.
//! - **Behind a transaction pooler**: one statement, no session state.

use std::time::Duration;

use tokio::sync::watch;

use crate::db::{self, Pool};
use crate::lease::Leadership;
use crate::log_throttle::{INTERVAL, Throttle};

/// How often at most the leader merges, however fast inserts fill the list.
pub const TICK: Duration = Duration::from_secs(1);

/// How long at most the leader waits between merges: while inserts fill the list slowly,
/// while its merges find nothing (an idle fleet), or after a failure.
pub const IDLE_TICK: Duration = Duration::from_secs(5);

/// The pending list's pages a merge aims at (4 MB, a quarter of the index's 16 MB
/// limit: about 3,000 webhooks of a few dozen values each).
pub const TARGET_PAGES: i64 = 512;

/// The pause before the next merge, after one that took `pages` pages of the list
/// filled over `pause`: the time the list takes to fill [`TARGET_PAGES`] at that pace,
/// within [`TICK`] and [`IDLE_TICK`].
pub fn next_pause(pages: i64, pause: Duration) -> Duration {
    if pages <= 0 {
        return (pause * 2).clamp(TICK, IDLE_TICK);
    }
    // pause × TARGET_PAGES / pages, in milliseconds (no overflow: pauses are seconds).
    let millis = pause.as_millis().saturating_mul(TARGET_PAGES as u128) / pages as u128;
    Duration::from_millis(u64::try_from(millis).unwrap_or(u64::MAX)).clamp(TICK, IDLE_TICK)
}

/// How often a replica whose role may not merge the list asks again.
pub const REFUSED_RETRY: Duration = Duration::from_secs(600);

/// The leader's lease: renewed every third of it.
pub const LEASE_TTL: Duration = Duration::from_secs(15);

/// Name of the job's lease.
pub const LEASE_NAME: &str = "search-merge";

/// The index whose pending list is merged.
const INDEX: &str = "events_search";

/// SQLSTATE `insufficient_privilege`: not the index's owner.
const NOT_OWNER: &str = "42501";
/// SQLSTATE `undefined_table`: no such index (dropped to be rebuilt, or a schema this
/// release did not migrate).
const NO_INDEX: &str = "42P01";

/// Merge the index's pending list into the index now: the pages the list had (0 when it
/// was empty).
pub async fn merge(pool: &Pool) -> Result<i64, sqlx::Error> {
    db::query_scalar("SELECT gin_clean_pending_list($1::regclass)").bind(INDEX).fetch_one(pool).await
}

/// Merge the list while this replica leads the job, paced by [`next_pause`], until
/// `stop`.
pub async fn run(pool: Pool, instance: String, mut stop: watch::Receiver<bool>) {
    static FAILED: Throttle = Throttle::new(INTERVAL);
    let mut refused_before = false;
    let mut leadership = Leadership::new(LEASE_NAME, instance, LEASE_TTL);
    let mut pause = TICK;
    while crate::lease::pause(pause, &mut stop).await {
        let round = async { if leadership.leads(&pool).await { merge(&pool).await.map(Some) } else { Ok(None) } };
        let done = tokio::select! {
            done = round => done,
            _ = stop.wait_for(|s| *s) => break,
        };
        pause = match done {
            Ok(Some(pages)) if pages > 0 => {
                tracing::debug!(pages, "search index: pending list merged");
                next_pause(pages, pause)
            }
            Ok(_) => next_pause(0, pause),
            Err(sqlx::Error::Database(e)) if e.code().is_some_and(|c| c == NOT_OWNER) => {
                if !std::mem::replace(&mut refused_before, true) {
                    tracing::info!(error = %e,
                        "search index: this gateway's database role cannot merge the index's pending list (it is \
                         not the owner); autovacuum and inserts merge it instead, and an insert that fills it waits \
                         for the merge (docs/operating.md, \"The search index\")");
                }
                REFUSED_RETRY
            }
            Err(sqlx::Error::Database(e)) if e.code().is_some_and(|c| c == NO_INDEX) => {
                tracing::debug!(error = %e, "search index: not there; looking again later");
                IDLE_TICK
            }
            Err(e) => {
                pool.note(&e);
                if let Some(left_out) = FAILED.admit() {
                    tracing::warn!(error = %e, left_out, "search index: cannot merge the pending list; trying again later");
                }
                IDLE_TICK
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_are_paced_to_take_about_the_target_within_the_bounds() {
        let second = Duration::from_secs(1);
        // A list filling at the target a second: every second; faster: still every
        // second (the bound), the merge taking more.
        assert_eq!(next_pause(TARGET_PAGES, second), TICK);
        assert_eq!(next_pause(TARGET_PAGES * 10, second), TICK);
        // Half the target a second: every 2 s; a quarter: every 4 s.
        assert_eq!(next_pause(TARGET_PAGES / 2, second), Duration::from_secs(2));
        assert_eq!(next_pause(TARGET_PAGES / 4, second), Duration::from_secs(4));
        // Slower than that: every IDLE_TICK at the least.
        assert_eq!(next_pause(1, second), IDLE_TICK);
        assert_eq!(next_pause(TARGET_PAGES / 100, IDLE_TICK), IDLE_TICK);
        // The pace is the pages over the pause they filled in: the target in 4 s, the
        // next merge in 4 s; four times the target in 4 s, every second.
        assert_eq!(next_pause(TARGET_PAGES, Duration::from_secs(4)), Duration::from_secs(4));
        assert_eq!(next_pause(TARGET_PAGES * 4, Duration::from_secs(4)), TICK);
        // Nothing merged: the pause doubles, within the bounds.
        assert_eq!(next_pause(0, TICK), Duration::from_secs(2));
        assert_eq!(next_pause(0, Duration::from_secs(4)), IDLE_TICK);
        assert_eq!(next_pause(-1, TICK), Duration::from_secs(2));
    }
}
