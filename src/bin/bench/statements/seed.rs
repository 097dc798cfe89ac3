//! The counted database: a cluster of its own with the schema, the bench's source and
//! its history, and ordered lines, prepared before the stand-alone backend takes it.

use std::path::Path;

use anyhow::Context;
use webhook_gateway::db::embedded;

use super::{DB, HISTORY, LINES};
use crate::pg;

/// What [`prepare`] made.
pub(super) struct Seeded {
    /// The bench's source.
    pub(super) source: String,
    /// The endpoint of the ordered lines.
    pub(super) ordered_endpoint: String,
}

/// A new endpoint (never sent to: the count sends nothing) subscribed to every event of
/// `source`, in order when `ordered`.
async fn subscribed_endpoint(pool: &sqlx::PgPool, source: uuid::Uuid, ordered: bool) -> anyhow::Result<uuid::Uuid> {
    Ok(sqlx::query_scalar(
        "WITH ep AS (INSERT INTO endpoints (url, secret)
                     VALUES ('http://127.0.0.1:9/', 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw') RETURNING id)
         INSERT INTO subscriptions (endpoint_id, source_id, ordered) SELECT ep.id, $1, $2 FROM ep
         RETURNING endpoint_id",
    )
    .bind(source)
    .bind(ordered)
    .fetch_one(pool)
    .await?)
}

/// Lines of an ordered subscription on a source of their own: `LINES` ordering keys,
/// each with a head already delivered and one delivery waiting behind it, as the
/// fan-out makes them (the batch ingest statement). Returns the lines' endpoint.
async fn seed_lines(pool: &sqlx::PgPool) -> anyhow::Result<String> {
    let source: uuid::Uuid =
        sqlx::query_scalar("INSERT INTO sources (name, kind, spec) VALUES ('ordered', 'internal', '{}') RETURNING id")
            .fetch_one(pool)
            .await?;
    let endpoint = subscribed_endpoint(pool, source, true).await?;
    const PER_BATCH: usize = 256;
    for batch in 0..LINES * 2 / PER_BATCH {
        // Two webhooks per key in one batch: the first becomes the line's head.
        let n = PER_BATCH as i32;
        let keys: Vec<String> = (0..PER_BATCH).map(|i| format!("line-{batch}-{i}")).collect();
        let lines: Vec<Option<String>> = (0..PER_BATCH).map(|i| Some(format!("key-{batch}-{}", i / 2))).collect();
        let body = crate::payload::body(0).into_bytes();
        sqlx::query(webhook_gateway::store::events::insert_batch_sql())
            .bind(vec![source; PER_BATCH])
            .bind(&keys)
            .bind(vec![crate::payload::EVENT_TYPE; PER_BATCH])
            .bind(vec![Some("application/json"); PER_BATCH])
            .bind(vec!["{}"; PER_BATCH])
            .bind(vec![body; PER_BATCH])
            .bind((0..n).collect::<Vec<i32>>())
            .bind(&lines)
            .bind((0..n).collect::<Vec<i32>>())
            .bind(vec![None::<String>; PER_BATCH])
            .bind(vec![None::<String>; PER_BATCH])
            .bind(Vec::<i64>::new())
            .bind(vec![0i32; PER_BATCH])
            .execute(pool)
            .await?;
    }
    let done = sqlx::query(
        "UPDATE deliveries SET status = 'delivered', attempt_count = 1, finished_at = now()
         WHERE endpoint_id = $1 AND NOT waiting",
    )
    .bind(endpoint)
    .execute(pool)
    .await?;
    anyhow::ensure!(done.rows_affected() == LINES as u64, "{} heads for {LINES} lines", done.rows_affected());
    Ok(endpoint.to_string())
}

/// A cluster of its own with the schema, the bench's source, one endpoint subscribed to
/// it with a history of delivered webhooks, and ordered lines, then stopped (a
/// stand-alone backend needs the data directory to itself).
pub(super) async fn prepare(data_dir: &Path) -> anyhow::Result<Seeded> {
    let options = embedded::ClusterOptions {
        data_dir: data_dir.to_owned(),
        throwaway: false,
        port: None,
        settings: vec![],
        env: vec![],
    };
    let mut cluster = tokio::task::spawn_blocking(move || embedded::Cluster::start(&options)).await??;
    let seeded = async {
        let admin = pg::pool(&cluster.url("postgres"), 1).await?;
        sqlx::query(&format!("CREATE DATABASE {DB}")).execute(&admin).await?;
        admin.close().await;
        let lib_pool = webhook_gateway::db::connect(&cluster.url(DB), 1).await?;
        webhook_gateway::db::migrate(&lib_pool).await?;
        let pool = pg::pool(&cluster.url(DB), 1).await?;
        let source: String =
            sqlx::query_scalar("INSERT INTO sources (name, kind, spec) VALUES ($1, 'hmac', $2) RETURNING id::text")
                .bind(crate::payload::SOURCE)
                .bind(crate::payload::source_spec())
                .fetch_one(&pool)
                .await?;
        let source_id: uuid::Uuid = source.parse()?;
        let endpoint = subscribed_endpoint(&pool, source_id, false).await?;
        // A history, delivered, with its attempts, and statistics on it: the plans of a
        // gateway that has run for a while, not of empty tables (where a scan of a whole
        // table is the cheapest plan and costs little, and would be counted as such).
        pg::seed(&pool, source_id, &[endpoint], HISTORY, &crate::payload::template()).await?;
        sqlx::query(
            "WITH done AS (
                 UPDATE deliveries SET status = 'delivered', attempt_count = 1, finished_at = now()
                 RETURNING id, created_at
             )
             INSERT INTO attempts (delivery_id, attempt_number, started_at, duration_ms, status_code, outcome, reason)
             SELECT id, 1, created_at, 12, 200, 'delivered', 'HTTP 200' FROM done",
        )
        .execute(&pool)
        .await?;
        let ordered_endpoint = seed_lines(&pool).await?;
        sqlx::query("VACUUM (ANALYZE)").execute(&pool).await?;
        pool.close().await;
        anyhow::Ok(Seeded { source, ordered_endpoint })
    }
    .await;
    tokio::task::spawn_blocking(move || cluster.stop()).await?;
    seeded.context("preparing the counted database")
}
