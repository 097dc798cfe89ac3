//! The `sources` table.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;
use sqlx::types::Json;

use crate::db::Pool;
use crate::ids::SourceId;
use crate::queue::lines::{self, Line};
use crate::secrets::Sealed;
use crate::verify::{SourceSpec, ValidSpec};

/// A source row.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Source {
    /// Primary key, a UUIDv7; events refer to their source by it.
    pub id: SourceId,
    /// Unique name; the ingest path is `/ingest/{name}`.
    pub name: String,
    /// Verifier spec (kind, locators, and its secrets as stored).
    pub spec: Json<SourceSpec<Sealed>>,
    /// When the source was created (shown by the API).
    pub created_at: DateTime<Utc>,
}

const COLUMNS: &str = "id, name, spec, created_at";

/// Insert a source. A taken name fails with a unique violation on `sources_name_key`.
pub async fn insert(db: impl PgExecutor<'_>, name: &str, spec: &ValidSpec<Sealed>) -> Result<Source, sqlx::Error> {
    let spec = spec.spec();
    crate::db::query_as(&format!("INSERT INTO sources (name, kind, spec) VALUES ($1, $2, $3) RETURNING {COLUMNS}"))
        .bind(name)
        .bind(spec.kind.as_str())
        .bind(Json(spec))
        .fetch_one(db)
        .await
}

/// Constraint that makes names unique.
pub const NAME_UNIQUE: &str = "sources_name_key";

/// A source by name.
pub async fn by_name(db: impl PgExecutor<'_>, name: &str) -> Result<Option<Source>, sqlx::Error> {
    crate::db::query_as(&format!("SELECT {COLUMNS} FROM sources WHERE name = $1")).bind(name).fetch_optional(db).await
}

/// A source by id.
pub async fn by_id(db: impl PgExecutor<'_>, id: SourceId) -> Result<Option<Source>, sqlx::Error> {
    crate::db::query_as(&format!("SELECT {COLUMNS} FROM sources WHERE id = $1")).bind(id).fetch_optional(db).await
}

/// All sources, by name (there are few).
pub async fn list(db: impl PgExecutor<'_>) -> Result<Vec<Source>, sqlx::Error> {
    crate::db::query_as(&format!("SELECT {COLUMNS} FROM sources ORDER BY name")).fetch_all(db).await
}

/// Replace a source's spec (kind included, name unchanged).
pub async fn update_spec(
    db: impl PgExecutor<'_>,
    id: SourceId,
    spec: &ValidSpec<Sealed>,
) -> Result<Option<Source>, sqlx::Error> {
    let spec = spec.spec();
    crate::db::query_as(&format!(
        "UPDATE sources SET kind = $2, spec = $3, updated_at = now() WHERE id = $1 RETURNING {COLUMNS}"
    ))
    .bind(id)
    .bind(spec.kind.as_str())
    .bind(Json(spec))
    .fetch_optional(db)
    .await
}

/// How many events a source holds.
pub async fn event_count(db: impl PgExecutor<'_>, id: SourceId) -> Result<i64, sqlx::Error> {
    crate::db::query_scalar("SELECT count(*) FROM events WHERE source_id = $1").bind(id).fetch_one(db).await
}

/// Delete a source; its events go with it (their foreign key's ON DELETE CASCADE), and
/// their deliveries and attempts with them (statement triggers, migration 0035). Without
/// `force`, only while it holds no events, checked by the deleting statement itself (a
/// webhook stored after the caller counted is never deleted with it). Returns whether the
/// source was deleted.
///
/// The ordering lines its deliveries are in (as the head or waiting) are locked first and
/// moved on after, in the same transaction: a line whose head went with the source makes
/// its next waiting delivery, of another source, its head, or is deleted. (A line left
/// naming a deleted head held every later delivery of its key, from any source, forever.)
pub async fn delete(pool: &Pool, id: SourceId, force: bool) -> Result<bool, sqlx::Error> {
    let mut tx = pool.begin().await?;
    // The source's row first: an event stored now locks it (its foreign key's share
    // lock), so none can commit between the read of the lines below and the delete, and
    // start a line (its delivery then deleted with the source) that nobody moves on.
    crate::db::query("SELECT 1 FROM sources WHERE id = $1 FOR UPDATE").bind(id).execute(&mut *tx).await?;
    let lines: Vec<Line> = crate::db::query_as(
        "SELECT DISTINCT d.endpoint_id, d.ordering_key
         FROM events e JOIN deliveries d ON d.event_id = e.id
         WHERE e.source_id = $1 AND d.ordering_key IS NOT NULL AND d.status IN ('pending', 'dead')",
    )
    .bind(id)
    .fetch_all(&mut *tx)
    .await?;
    lines::lock(&mut tx, &lines).await?;
    let deleted = crate::db::query(
        "DELETE FROM sources WHERE id = $1 AND ($2 OR NOT EXISTS (SELECT 1 FROM events WHERE source_id = $1))",
    )
    .bind(id)
    .bind(force)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    lines::promote(&mut tx, &lines).await?;
    tx.commit().await?;
    Ok(deleted)
}
