//! Where a webhook's WAL goes: the records PostgreSQL wrote over a window, summed by the
//! relation each one changes (`pg_walinspect`, PostgreSQL 15 and later, as a superuser).
//!
//! Unlike CPU seconds, which move by a third between hours on a shared machine, the WAL a
//! webhook writes is the same from one run to the next for the same build and load: it
//! counts the row versions and index entries each step of a webhook leaves. It is also
//! what a managed PostgreSQL bills as I/O and ships to its replicas.

use sqlx::PgPool;

/// A position in the WAL, as PostgreSQL prints it (`0/16B3748`).
#[derive(Debug, Clone)]
pub struct Lsn(String);

/// Where the WAL ends now (written, not only inserted: `pg_walinspect` reads only up to
/// what has been flushed). `None` without `pg_walinspect` or its privileges, so the
/// scenario runs on without the breakdown.
pub async fn lsn(pool: &PgPool) -> Option<Lsn> {
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_walinspect").execute(pool).await.ok()?;
    sqlx::query_scalar::<_, String>("SELECT pg_current_wal_flush_lsn()::text").fetch_one(pool).await.ok().map(Lsn)
}

/// The WAL of one relation (with its TOAST table named after its table) over a window.
#[derive(Debug, Clone, PartialEq)]
pub struct RelationWal {
    /// The relation (`events_search`, `events (TOAST)`), or what a record without one is
    /// (`Transaction` for commits).
    pub relation: String,
    /// The table it belongs to (itself for a table; the table of an index).
    pub table: String,
    /// Records per unit.
    pub records: f64,
    /// Bytes per unit, full-page images included.
    pub bytes: f64,
    /// Of those, the bytes of full-page images.
    pub image_bytes: f64,
}

/// The records between `from` and `to`, summed by the relation of their first block, per
/// one of `per` (webhooks, deliveries). Relations of other databases, and catalogs mapped
/// by file rather than by `pg_class`, count as `other database or catalog`.
pub async fn by_relation(pool: &PgPool, from: &Lsn, to: &Lsn, per: f64) -> anyhow::Result<Vec<RelationWal>> {
    let rows: Vec<(String, String, i64, f64, f64)> = sqlx::query_as(
        "WITH w AS (
             SELECT resource_manager, record_length, fpi_length,
                    substring(block_ref FROM 'rel [0-9]+/([0-9]+)/')::oid AS db,
                    substring(block_ref FROM 'rel [0-9]+/[0-9]+/([0-9]+)')::oid AS node
             FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn)
         ), named AS (
             SELECT w.*, c.oid AS rel, c.relname, c.relkind, n.nspname,
                    COALESCE(i.indrelid, c.oid) AS table_oid
             FROM w
             LEFT JOIN pg_class c ON c.relfilenode = w.node AND w.db = (SELECT oid FROM pg_database WHERE datname = current_database())
             LEFT JOIN pg_namespace n ON n.oid = c.relnamespace
             LEFT JOIN pg_index i ON i.indexrelid = c.oid
         ), owned AS (
             -- A TOAST table and its index are named after the table whose values they hold.
             SELECT named.*, COALESCE(owner.relname, t.relname) AS table_name
             FROM named
             LEFT JOIN pg_class t ON t.oid = named.table_oid
             LEFT JOIN pg_class owner ON owner.reltoastrelid = named.table_oid
         )
         SELECT CASE WHEN node IS NULL THEN resource_manager
                     WHEN rel IS NULL THEN 'other database or catalog'
                     WHEN nspname = 'pg_toast' AND relkind = 'i' THEN table_name || ' (TOAST index)'
                     WHEN nspname = 'pg_toast' THEN table_name || ' (TOAST)'
                     ELSE relname END AS relation,
                -- `rel` is null wherever `node` is: a record without a relation.
                COALESCE(CASE WHEN rel IS NOT NULL THEN table_name END, '') AS table_name,
                count(*)::int8, sum(record_length)::float8, sum(fpi_length)::float8
         FROM owned
         GROUP BY 1, 2
         ORDER BY 4 DESC",
    )
    .bind(&from.0)
    .bind(&to.0)
    .fetch_all(pool)
    .await?;
    let per = per.max(1.0);
    Ok(rows
        .into_iter()
        .map(|(relation, table, records, bytes, images)| RelationWal {
            relation,
            table,
            records: records as f64 / per,
            bytes: bytes / per,
            image_bytes: images / per,
        })
        .collect())
}

/// A Markdown table of [`by_relation`]'s rows: each relation's records and bytes per unit
/// and its share, then each table with its indexes and TOAST together.
pub fn table(rows: &[RelationWal]) -> String {
    let total: f64 = rows.iter().map(|r| r.bytes).sum::<f64>().max(1e-9);
    let mut out = format!(
        "{:.0} bytes of WAL per unit (webhook or delivery) in all.\n\n| relation | table | records per unit | bytes per unit | of which full-page images | share |\n|---|---|---|---|---|---|\n",
        total
    );
    for r in rows.iter().filter(|r| r.bytes / total >= 0.002) {
        out.push_str(&format!(
            "| {} | {} | {:.2} | {:.0} | {:.0} | {:.1} % |\n",
            r.relation,
            r.table,
            r.records,
            r.bytes,
            r.image_bytes,
            100.0 * r.bytes / total
        ));
    }
    let mut tables: Vec<(String, f64, usize)> = Vec::new();
    for r in rows.iter().filter(|r| !r.table.is_empty()) {
        match tables.iter_mut().find(|(t, _, _)| *t == r.table) {
            Some((_, bytes, n)) => {
                *bytes += r.bytes;
                *n += 1;
            }
            None => tables.push((r.table.clone(), r.bytes, 1)),
        }
    }
    tables.sort_by(|a, b| b.1.total_cmp(&a.1));
    let by_table = tables
        .iter()
        .filter(|(_, bytes, _)| bytes / total >= 0.01)
        .map(|(t, bytes, n)| format!("{t} {bytes:.0} B ({:.0} %, {n} relations)", 100.0 * bytes / total))
        .collect::<Vec<_>>()
        .join(", ");
    out.push_str(&format!("\nBy table, with its indexes and TOAST: {by_table}.\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(relation: &str, table: &str, bytes: f64) -> RelationWal {
        RelationWal { relation: relation.into(), table: table.into(), records: 1.0, bytes, image_bytes: 0.0 }
    }

    #[test]
    fn the_table_sums_a_table_with_its_indexes_and_leaves_out_crumbs() {
        let rows = [
            rel("events_search", "events", 3000.0),
            rel("events", "events", 1000.0),
            rel("deliveries", "deliveries", 600.0),
            rel("deliveries_pkey", "deliveries", 400.0),
            rel("Transaction", "", 50.0),
            rel("sources", "sources", 1.0),
        ];
        let t = table(&rows);
        assert!(t.starts_with("5051 bytes of WAL per unit"), "{t}");
        assert!(t.contains("| events_search | events | 1.00 | 3000 | 0 | 59.4 % |"), "{t}");
        assert!(t.contains("| Transaction |  | 1.00 | 50 | 0 | 1.0 % |"), "{t}");
        // Under 0.2 % of the whole: not a row of its own.
        assert!(!t.contains("| sources |"), "{t}");
        assert!(t.contains("events 4000 B (79 %, 2 relations), deliveries 1000 B (20 %, 2 relations)"), "{t}");
    }
}
