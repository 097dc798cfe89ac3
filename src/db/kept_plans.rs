//! Plans kept on the server behind a transaction pooler.
//!
//! Behind a transaction pooler every statement is the unnamed statement (see [`super::pool`]),
//! so PostgreSQL parses and plans it at every execution. For the gateway's largest
//! statements that doubles their cost: the lone webhook's ingest statement is planned in
//! about as long as it runs (bench/PROFILE.md, "Plans kept behind a transaction pooler"),
//! and behind PgBouncer ingest ran at ×0.41-0.45 of the same ingest straight to PostgreSQL
//! (bench row 12).
//!
//! A PL/pgSQL function keeps the plans of its statements in the server process for as long
//! as that process lives, whichever client the pooler lends it to. So at start-up, behind a
//! transaction pooler, each statement given to [`install`] gets a function whose body is the
//! statement itself (`RETURN QUERY`, its parameters as the function's, its columns as the
//! function's result), and from then on [`wrapped`] turns the statement into a call of that
//! function, `SELECT * FROM wg_plan_…($1::…, …)`: a call is cheap to plan, and the statement
//! inside is planned as a named prepared statement would be (custom plans first, then the
//! generic one; `plan_cache_mode` and the planner settings of the transaction apply).
//!
//! - **Named by content.** A function's name is a hash of its definition, so two releases
//!   on one schema (a rolling deploy) each find their own, and an unchanged statement keeps
//!   its function across releases. Creating takes a transaction-scoped advisory lock, so
//!   twenty replicas starting at once create each function once. Functions of releases
//!   gone are left in place (a few small functions per release).
//! - **Nothing depends on it.** A statement that cannot be described or wrapped (no result
//!   columns, a column name twice), or a database role without the right to create
//!   functions, leaves the statements as they were, said once in the log.
//! - **One database per process**, as for named statements ([`super::named_statements`]):
//!   the functions exist in the database the pool reaches, created in the session's
//!   schema (the first of its `search_path`, where the migrations put the tables) and
//!   looked for in its `search_path`, so gateways in schemas of their own on one database
//!   each keep their own (`schemas::gateways_in_schemas_of_their_own_share_a_database_directly_and_behind_pgbouncer`).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use sha2::{Digest, Sha256};
use sqlx::{Column as _, Executor as _, Row as _};

use super::{Pool, Pooler};

/// Statements wrapped in a function, by their text: the call that replaces them. (By text,
/// not by address: a `const` statement's text need not have one address.)
static KEPT: OnceLock<HashMap<&'static str, &'static str>> = OnceLock::new();

/// Advisory lock key of the functions' creation (`hashtext('webhook-gateway kept plans')`
/// would do as well; a constant is easier to find in `pg_locks`).
const CREATE_LOCK: i64 = 0x7767_706c_616e; // "wgplan"

/// Set once a call met its function missing (dropped by hand while this process ran):
/// from then on the statements are sent as they are.
static GONE: AtomicBool = AtomicBool::new(false);

/// The call that replaces `sql` in this process, when [`install`] wrapped it.
pub fn wrapped(sql: &str) -> Option<&'static str> {
    if GONE.load(Ordering::Relaxed) {
        return None;
    }
    KEPT.get()?.get(sql).copied()
}

/// A failed call's error: one that says a kept statement's function does not exist, or no
/// longer returns what its statement does (a column's type changed under a running
/// release), turns the functions off for this process (the statement that met it fails
/// once; its caller retries as after any failure, with the statement itself). An error of
/// the statement inside (a constraint, a lock) changes nothing.
pub fn note(err: &sqlx::Error) {
    let sqlx::Error::Database(db) = err else { return };
    if wrapper_failed(err) && !GONE.swap(true, Ordering::Relaxed) {
        tracing::warn!(error = %db, "a kept statement's function is gone or out of date: statements are sent as they are until restart");
    }
}

/// Whether `err` says a kept statement's function does not exist or no longer returns
/// what its statement does: the call did not run its statement (or ran it and was rolled
/// back), so nothing of it was committed, and the same call tried again runs the
/// statement as it is ([`note`]). `db::failure` classifies it "unavailable, retry" (a 503
/// to a producer), never a bug's 500.
pub fn wrapper_failed(err: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = err else { return false };
    match db.code().as_deref() {
        Some("42883") => db.message().contains("wg_plan_"),
        Some("42804") => {
            db.message().contains("function result type")
                && db
                    .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                    .and_then(|pg| pg.r#where())
                    .is_some_and(|context| context.contains("wg_plan_"))
        }
        _ => false,
    }
}

/// Behind a transaction pooler, wrap each of `statements` in a function of its own
/// (created if missing) and route it through that function from now on; with no pooler,
/// nothing. Only the first call of a process takes effect. Never fails: a statement it
/// cannot wrap stays as it is; the log says how many were wrapped and created.
pub async fn install(pool: &Pool, statements: &[&'static str]) {
    if pool.pooler() != Pooler::Transaction || KEPT.get().is_some() {
        return;
    }
    let mut kept = HashMap::new();
    let mut created = 0;
    for &sql in statements {
        match keep(pool, sql).await {
            Ok((call, new)) => {
                kept.insert(sql, call);
                created += usize::from(new);
            }
            Err(e) if denied(&e) => {
                tracing::warn!(
                    error = %e,
                    "this database role may not create functions: behind the pooler every statement is planned at every call"
                );
                break;
            }
            Err(e) => {
                tracing::warn!(error = %e, "a statement's plan is not kept behind the pooler: it is planned at every call");
            }
        }
    }
    tracing::info!(
        wrapped = kept.len(),
        created,
        "behind a transaction pooler: the largest statements run through functions that keep their plans"
    );
    let _ = KEPT.set(kept);
}

/// Whether `e` is the database refusing this role the creation of a function.
fn denied(e: &anyhow::Error) -> bool {
    e.downcast_ref::<sqlx::Error>()
        .and_then(|e| e.as_database_error())
        .is_some_and(|db| db.code().as_deref() == Some("42501"))
}

/// A statement's function, found or created: the call that replaces it, and whether it
/// was created now.
async fn keep(pool: &Pool, sql: &'static str) -> anyhow::Result<(&'static str, bool)> {
    let mut tx = pool.begin().await?;
    let described = (&mut *tx).describe(sql).await?;
    let parameters: Vec<i64> = match described.parameters() {
        Some(sqlx::Either::Left(types)) => types
            .iter()
            .map(|t| t.oid().map(|oid| i64::from(oid.0)).ok_or_else(|| anyhow::anyhow!("a parameter of unknown type")))
            .collect::<anyhow::Result<_>>()?,
        _ => anyhow::bail!("its parameters' types are not known"),
    };
    let mut columns = Vec::with_capacity(described.columns().len());
    for column in described.columns() {
        let oid =
            column.type_info().oid().ok_or_else(|| anyhow::anyhow!("column {} of unknown type", column.name()))?;
        columns.push((column.name().to_owned(), i64::from(oid.0)));
    }
    // sqlx describes through named statements (`sqlx_s_…`), which would outlive this
    // transaction on a server connection the pooler lends to others: closed here.
    let named: Vec<String> = crate::db::query_scalar(
        "SELECT name FROM pg_prepared_statements WHERE NOT from_sql AND name LIKE 'sqlx\\_s\\_%'",
    )
    .fetch_all(&mut *tx)
    .await?;
    for statement in named {
        (&mut *tx).execute(sqlx::raw_sql(&format!("DEALLOCATE \"{}\"", statement.replace('"', "\"\"")))).await?;
    }
    let names = |oids: &[i64]| {
        crate::db::query_scalar::<String>(
            "SELECT format_type(u.t::oid, NULL) FROM unnest($1::int8[]) WITH ORDINALITY AS u(t, n) ORDER BY u.n",
        )
        .bind(oids.to_vec())
    };
    let parameter_types = names(&parameters).fetch_all(&mut *tx).await?;
    let column_oids: Vec<i64> = columns.iter().map(|c| c.1).collect();
    let column_types = names(&column_oids).fetch_all(&mut *tx).await?;
    let column_names: Vec<&str> = columns.iter().map(|c| c.0.as_str()).collect();
    let (name, definition) = definition(sql, &parameter_types, &column_names, &column_types)?;

    crate::db::query("SELECT pg_advisory_xact_lock($1)").bind(CREATE_LOCK).execute(&mut *tx).await?;
    // Looked for where the call will look: the session's schemas (`search_path`), not the
    // whole database, where another gateway's schema may hold the same function.
    let exists: bool = crate::db::query(
        "SELECT EXISTS (SELECT 1 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                        WHERE p.proname = $1 AND n.nspname = ANY (current_schemas(false)))",
    )
    .bind(&name)
    .fetch_one(&mut *tx)
    .await?
    .try_get(0)?;
    if !exists {
        (&mut *tx).execute(sqlx::raw_sql(&definition)).await?;
    }
    tx.commit().await?;
    let call = call(&name, &parameter_types);
    Ok((Box::leak(call.into_boxed_str()), !exists))
}

/// The function that runs `sql` (its parameters of `parameter_types`, its result the
/// columns `column_names` of `column_types`): its name (a hash of the rest) and its
/// `CREATE FUNCTION`.
pub fn definition(
    sql: &str,
    parameter_types: &[String],
    column_names: &[&str],
    column_types: &[String],
) -> anyhow::Result<(String, String)> {
    anyhow::ensure!(!column_names.is_empty(), "it returns no rows");
    anyhow::ensure!(column_names.len() == column_types.len(), "a column without its type");
    let mut seen = std::collections::HashSet::new();
    for name in column_names {
        anyhow::ensure!(*name != "?column?" && seen.insert(*name), "column {name:?} unnamed or named twice");
    }
    anyhow::ensure!(!sql.contains("$wg_plan$"), "its text holds the body's quote");
    let result = column_names
        .iter()
        .zip(column_types)
        .map(|(name, ty)| format!("\"{}\" {ty}", name.replace('"', "\"\"")))
        .collect::<Vec<_>>()
        .join(", ");
    let rest = format!(
        "({}) RETURNS TABLE ({result}) LANGUAGE plpgsql VOLATILE AS $wg_plan$\n\
         #variable_conflict use_column\n\
         BEGIN\n    RETURN QUERY {};\nEND\n$wg_plan$",
        parameter_types.join(", "),
        sql.trim().trim_end_matches(';'),
    );
    let digest = Sha256::digest(rest.as_bytes());
    let mut name = String::from("wg_plan_");
    for byte in &digest[..8] {
        let _ = write!(name, "{byte:02x}");
    }
    let create = format!("CREATE FUNCTION {name}{rest}");
    Ok((name, create))
}

/// The statement that calls function `name` with the caller's parameters, each cast to
/// the function's parameter type (sqlx sends each parameter with its Rust type's type).
fn call(name: &str, parameter_types: &[String]) -> String {
    let arguments =
        parameter_types.iter().enumerate().map(|(i, ty)| format!("${}::{ty}", i + 1)).collect::<Vec<_>>().join(", ");
    format!("SELECT * FROM {name}({arguments})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_definition_is_named_by_its_content_and_refuses_what_it_cannot_return() {
        let types = |t: &[&str]| t.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let (name, create) = definition(
            "SELECT $1::uuid AS id, $2::text AS k;",
            &types(&["uuid", "text"]),
            &["id", "k"],
            &types(&["uuid", "text"]),
        )
        .expect("definition");
        assert!(name.starts_with("wg_plan_") && name.len() == "wg_plan_".len() + 16, "{name}");
        assert!(
            create.starts_with(&format!("CREATE FUNCTION {name}(uuid, text) RETURNS TABLE (\"id\" uuid, \"k\" text)"))
        );
        assert!(create.contains("RETURN QUERY SELECT $1::uuid AS id, $2::text AS k;\nEND"), "{create}");
        let (other, _) = definition(
            "SELECT $1::uuid AS id, $2::text AS k",
            &types(&["uuid", "text"]),
            &["id", "k"],
            &types(&["uuid", "int8"]),
        )
        .expect("definition");
        assert_ne!(name, other, "another result type, another function");
        assert!(definition("SELECT 1 AS a, 2 AS a", &[], &["a", "a"], &types(&["int4", "int4"])).is_err());
        assert!(definition("SELECT 1", &[], &["?column?"], &types(&["int4"])).is_err());
        assert!(definition("UPDATE t SET a = 1", &[], &[], &[]).is_err());
        assert_eq!(call(&name, &types(&["uuid", "int8[]"])), format!("SELECT * FROM {name}($1::uuid, $2::int8[])"));
    }
}
