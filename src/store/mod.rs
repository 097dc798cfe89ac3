//! SQL, one file per table (the deliveries table, being the queue, lives in `queue`).
//!
//! Functions take a `PgExecutor` so callers choose pool or transaction. Errors are
//! `sqlx::Error`; the API layer maps them (unavailable -> 503, else 500).

pub mod attempts;
pub mod endpoints;
pub mod events;
pub mod sources;
pub mod subscriptions;

/// Whether an error is a unique-constraint violation (SQLSTATE 23505) on `constraint`.
pub fn is_unique_violation(err: &sqlx::Error, constraint: &str) -> bool {
    match err {
        sqlx::Error::Database(db) => db.code().as_deref() == Some("23505") && db.constraint() == Some(constraint),
        _ => false,
    }
}

/// Whether an error is a foreign-key violation (SQLSTATE 23503).
pub fn is_foreign_key_violation(err: &sqlx::Error) -> bool {
    matches!(err, sqlx::Error::Database(db) if db.code().as_deref() == Some("23503"))
}
