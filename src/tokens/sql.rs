//! The `api_tokens` table.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use super::{Principal, Scope};

/// A token as listed (never the token itself).
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, utoipa::ToSchema)]
pub struct TokenInfo {
    /// Its id.
    pub id: uuid::Uuid,
    /// Its name, the audit log's actor.
    pub name: String,
    /// `read`, `operate` or `admin`.
    pub scope: String,
    /// When it was created, and by whom.
    pub created_at: DateTime<Utc>,
    /// The actor that created it.
    pub created_by: String,
    /// When it stops working (`null`: never).
    pub expires_at: Option<DateTime<Utc>>,
    /// When it was revoked (`null`: it was not).
    pub revoked_at: Option<DateTime<Utc>>,
    /// Whether it may read the payloads of stored events (`false`: they are withheld).
    pub payloads: bool,
    /// When it was last used, to the minute (`null`: never).
    pub last_used_at: Option<DateTime<Utc>>,
}

const COLUMNS: &str = "id, name, scope, created_at, created_by, expires_at, revoked_at, payloads, last_used_at";

/// What a new token is: its name, scope, expiry and whether it reads payloads.
#[derive(Debug, Clone)]
pub struct NewToken<'a> {
    /// Its name.
    pub name: &'a str,
    /// Its scope.
    pub scope: Scope,
    /// When it stops working (`None`: never).
    pub expires_at: Option<DateTime<Utc>>,
    /// Whether it reads the payloads of stored events (always, for `admin`).
    pub payloads: bool,
}

/// Store a token's hash; `None` when the name is taken.
pub async fn create(
    db: impl PgExecutor<'_>,
    new: &NewToken<'_>,
    token_hash: &[u8],
    created_by: &str,
) -> Result<Option<TokenInfo>, sqlx::Error> {
    crate::db::query_as(&format!(
        "INSERT INTO api_tokens (name, scope, token_hash, created_by, expires_at, payloads)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (name) DO NOTHING RETURNING {COLUMNS}"
    ))
    .bind(new.name)
    .bind(new.scope.as_str())
    .bind(token_hash)
    .bind(created_by)
    .bind(new.expires_at)
    .bind(new.payloads)
    .fetch_optional(db)
    .await
}

/// Every token, oldest first.
pub async fn list(db: impl PgExecutor<'_>) -> Result<Vec<TokenInfo>, sqlx::Error> {
    crate::db::query_as(&format!("SELECT {COLUMNS} FROM api_tokens ORDER BY id")).fetch_all(db).await
}

/// Revoke the token `id` (or named `id`) now, one token at most: by id when one has it,
/// else by name; `None` when there is none. Revoking twice keeps the first time.
pub async fn revoke(db: impl PgExecutor<'_>, id_or_name: &str) -> Result<Option<TokenInfo>, sqlx::Error> {
    crate::db::query_as(&format!(
        "WITH target AS (
             (SELECT id, 0 AS by_name FROM api_tokens WHERE id::text = $1
              UNION ALL
              SELECT id, 1 FROM api_tokens WHERE name = $1)
             ORDER BY by_name LIMIT 1)
         UPDATE api_tokens SET revoked_at = COALESCE(revoked_at, now())
         WHERE id = (SELECT id FROM target) RETURNING {COLUMNS}"
    ))
    .bind(id_or_name)
    .fetch_optional(db)
    .await
}

/// Note that the token `id` was used now, unless that was noted less than a minute ago
/// (so a busy token costs a write a minute, not one per call).
pub async fn touch(db: impl PgExecutor<'_>, id: uuid::Uuid) -> Result<(), sqlx::Error> {
    crate::db::query(
        "UPDATE api_tokens SET last_used_at = now()
         WHERE id = $1 AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute')",
    )
    .bind(id)
    .execute(db)
    .await
    .map(|_| ())
}

/// Note, in the background, that the caller `p` used its token (see [`touch`]): the call
/// does not wait for it, and a failure (a read-only node) only costs the note. Each
/// process sends it at most once a minute per token, so a token used a hundred times a
/// second costs no statement per call.
pub fn touch_later(pool: &crate::db::Pool, p: &Principal) {
    use std::collections::HashMap;
    use std::sync::{LazyLock, Mutex};
    use std::time::{Duration, Instant};
    static NOTED: LazyLock<Mutex<HashMap<uuid::Uuid, Instant>>> = LazyLock::new(Mutex::default);
    const EVERY: Duration = Duration::from_secs(60);
    let Some(id) = p.token_id else { return };
    {
        let Ok(mut noted) = NOTED.lock() else { return };
        let now = Instant::now();
        if noted.get(&id).is_some_and(|at| now.duration_since(*at) < EVERY) {
            return;
        }
        // Bounded: tokens not noted for a minute are forgotten.
        noted.retain(|_, at| now.duration_since(*at) < EVERY);
        noted.insert(id, now);
    }
    let pool = pool.clone();
    tokio::spawn(async move {
        if let Err(e) = touch(&pool, id).await {
            tracing::debug!(token_id = %id, error = %e, "could not note the token's use");
        }
    });
}

/// The statement that finds the caller of a token that still works (not revoked, not
/// expired) by `$key = $1`: the one rule for both ways a token is presented.
macro_rules! valid_token_by {
    ($key:literal) => {
        concat!(
            "SELECT id, name, scope, payloads FROM api_tokens WHERE ",
            $key,
            " = $1 AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())"
        )
    };
}

/// A row of [`valid_token_by`] as the caller it stands for.
fn principal_of_row(row: Option<(uuid::Uuid, String, String, bool)>) -> Option<Principal> {
    row.and_then(|(id, name, scope, payloads)| {
        Scope::parse(&scope).map(|scope| Principal { name, scope, token_id: Some(id), payloads })
    })
}

/// The caller a token hash stands for, if it is known, not revoked and not expired.
pub async fn principal(db: impl PgExecutor<'_>, token_hash: &[u8]) -> Result<Option<Principal>, sqlx::Error> {
    let row = crate::db::query_as(valid_token_by!("token_hash")).bind(token_hash).fetch_optional(db).await?;
    Ok(principal_of_row(row))
}

/// The caller of the stored token `id` (a console session's), if it is still valid.
pub async fn principal_by_id(db: impl PgExecutor<'_>, id: uuid::Uuid) -> Result<Option<Principal>, sqlx::Error> {
    let row = crate::db::query_as(valid_token_by!("id")).bind(id).fetch_optional(db).await?;
    Ok(principal_of_row(row))
}
