//! The search index's pending list, merged in the background instead of by a webhook.
//!
//! `events_search` is a GIN index with `fastupdate` (migration 0018): an insert appends
//! its keys to the index's pending list, and the list is merged into the index in bulk.
//! Left alone, the insert that pushes the list past its limit (16 MB) merges the whole
//! list itself, inside its statement: measured on the bench (row 3, one connection), one
//! webhook's answer waited 1.37 s for it. Here the replica that leads the `search-merge`
//! job ([`crate::lease::Leadership`]) merges the list every [`TICK`] with
//! `gin_clean_pending_list`, so the list holds about a second of inserts and no insert
//! reaches the limit. The merging is the same work; it only leaves the request path.
//!
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

/// How often the leader merges while inserts keep filling the list.
pub const TICK: Duration = Duration::from_secs(1);

/// How often at most while its merges find nothing (an idle fleet), or after a failure.
pub const IDLE_TICK: Duration = Duration::from_secs(5);

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

/// Merge the list every [`TICK`] while this replica leads the job, until `stop`.
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
                TICK
            }
            Ok(_) => (pause * 2).min(IDLE_TICK),
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
