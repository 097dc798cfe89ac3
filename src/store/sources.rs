//! The `sources` table.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;
use sqlx::types::Json;

use crate::ids::SourceId;
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
/// their deliveries and attempts with them (statement triggers, migration 0035).
pub async fn delete(db: impl PgExecutor<'_>, id: SourceId) -> Result<bool, sqlx::Error> {
    Ok(crate::db::query("DELETE FROM sources WHERE id = $1").bind(id).execute(db).await?.rows_affected() == 1)
}
