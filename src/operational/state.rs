//! The `operational_state` table: one row per check of the publisher, locked by the
//! transaction that publishes what the check found, so a check's events are published
//! once whichever replica runs it.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

/// Where a check stands.
#[derive(Debug, Clone, Copy, sqlx::FromRow)]
pub struct Standing {
    /// How far a windowed check has looked (`None`: never ran).
    pub until: Option<DateTime<Utc>>,
    /// Since when its condition is raised (`None`: it is not).
    pub raised_at: Option<DateTime<Utc>>,
    /// The database's clock, read in the same statement: every window is cut by one clock.
    pub now: DateTime<Utc>,
}

/// Lock check `name`'s row for the rest of `tx` and read it. Another replica running the
/// same check waits here, then sees what this one wrote.
pub async fn lock(tx: &mut PgConnection, name: &str) -> Result<Standing, sqlx::Error> {
    crate::db::query_as("SELECT until, raised_at, now() AS now FROM operational_state WHERE name = $1 FOR UPDATE")
        .bind(name)
        .fetch_one(tx)
        .await
}

/// Every check's standing, read without a lock: what decides which checks have anything
/// to do this round (each then locks and reads its own again).
pub async fn all(db: impl sqlx::PgExecutor<'_>) -> Result<Vec<(String, Standing)>, sqlx::Error> {
    #[derive(sqlx::FromRow)]
    struct Named {
        name: String,
        #[sqlx(flatten)]
        standing: Standing,
    }
    let rows: Vec<Named> =
        crate::db::query_as("SELECT name, until, raised_at, now() AS now FROM operational_state").fetch_all(db).await?;
    Ok(rows.into_iter().map(|r| (r.name, r.standing)).collect())
}

/// Record where check `name` now stands.
pub async fn save(
    tx: &mut PgConnection,
    name: &str,
    until: Option<DateTime<Utc>>,
    raised_at: Option<DateTime<Utc>>,
) -> Result<(), sqlx::Error> {
    crate::db::query("UPDATE operational_state SET until = $2, raised_at = $3 WHERE name = $1")
        .bind(name)
        .bind(until)
        .bind(raised_at)
        .execute(tx)
        .await?;
    Ok(())
}
