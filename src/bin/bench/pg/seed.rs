//! Seeding backlogs with SQL: due deliveries, ordering lines, a drain's backlog.

use std::time::{Duration, Instant};

use sqlx::{Executor, PgPool};

/// Insert events `lo..=hi` (payload `bench_seq` = the number) with one delivery due now
/// per endpoint, and wake the workers (`wake::notify`) as the ingest path does.
pub async fn insert_due(
    pool: &PgPool,
    source_id: uuid::Uuid,
    endpoints: &[uuid::Uuid],
    (lo, hi): (u64, u64),
    template: &str,
) -> anyhow::Result<()> {
    sqlx::query(
        "WITH ev AS (
             INSERT INTO events (source_id, dedupe_key, event_type, content_type, headers, payload)
             SELECT $1, 'due-' || g, $2, 'application/json', '{}'::jsonb,
                    convert_to(replace($3, '__SEQ__', g::text), 'UTF8')
             FROM generate_series($4::int8, $5::int8) AS g
             RETURNING id
         )
         INSERT INTO deliveries (event_id, endpoint_id)
         SELECT ev.id, ep.id FROM ev CROSS JOIN unnest($6::uuid[]) AS ep(id)",
    )
    .bind(source_id)
    .bind(crate::payload::EVENT_TYPE)
    .bind(template)
    .bind(lo as i64)
    .bind(hi as i64)
    .bind(endpoints)
    .execute(pool)
    .await?;
    webhook_gateway::wake::notify().execute(pool).await?;
    Ok(())
}

/// Turn the seeded backlog (events `seed-1` ... `seed-N`, see [`seed`]) into ordered
/// lines: event g gets ordering key `k{g mod keys}`, its deliveries join their lines in
/// seed order, and each line's first delivery is its head; what the fan-out does when
/// ordered events arrive one by one (`store::events`).
pub async fn make_ordered(pool: &PgPool, keys: u64) -> anyhow::Result<()> {
    sqlx::query(
        "UPDATE events SET ordering_key = 'k' || (substr(dedupe_key, 6)::int8 % $1)
         WHERE dedupe_key LIKE 'seed-%'",
    )
    .bind(keys as i64)
    .execute(pool)
    .await?;
    sqlx::query(
        "UPDATE deliveries d
         SET ordering_key = e.ordering_key, line_seq = substr(e.dedupe_key, 6)::int8,
             waiting = substr(e.dedupe_key, 6)::int8 > $1
         FROM events e WHERE e.id = d.event_id AND e.ordering_key IS NOT NULL",
    )
    .bind(keys as i64)
    .execute(pool)
    .await?;
    pool.execute(
        "INSERT INTO order_lines (endpoint_id, ordering_key, head_id)
         SELECT endpoint_id, ordering_key, id FROM deliveries WHERE ordering_key IS NOT NULL AND NOT waiting",
    )
    .await?;
    pool.execute("SELECT setval('deliveries_line_seq', (SELECT max(line_seq) FROM deliveries))").await?;
    pool.execute("VACUUM (ANALYZE) deliveries").await?;
    pool.execute("ANALYZE order_lines").await?;
    pool.execute("CHECKPOINT").await?;
    Ok(())
}

/// Insert `events` events (ids `first..first+events`) with one pending delivery per
/// endpoint each, straight into the gateway's schema, in chunks over two connections.
/// Arrival times are spread 1 ms apart into the past so the queue has a realistic order.
pub async fn seed(
    pool: &PgPool,
    source_id: uuid::Uuid,
    endpoints: &[uuid::Uuid],
    events: u64,
    template: &str,
) -> anyhow::Result<Duration> {
    const CHUNK: u64 = 50_000;
    let started = Instant::now();
    let chunks: Vec<(u64, u64)> =
        (0..events.div_ceil(CHUNK)).map(|i| (i * CHUNK + 1, ((i + 1) * CHUNK).min(events))).collect();
    let next = std::sync::Arc::new(std::sync::Mutex::new(chunks.into_iter()));
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let pool = pool.clone();
        let next = next.clone();
        let endpoints = endpoints.to_vec();
        let template = template.to_owned();
        tasks.push(tokio::spawn(async move {
            loop {
                let chunk = next.lock().expect("chunk lock").next();
                let Some((lo, hi)) = chunk else { return Ok::<(), sqlx::Error>(()) };
                sqlx::query(
                    "WITH ev AS (
                         INSERT INTO events (source_id, dedupe_key, event_type, content_type, headers, payload, received_at)
                         SELECT $1, 'seed-' || g, $2, 'application/json',
                                jsonb_build_object('host', '127.0.0.1', 'user-agent', 'wg-bench',
                                                   'content-type', 'application/json',
                                                   'content-length', length($3)::text,
                                                   'x-request-id', 'seed-' || g, 'x-signature', '[redacted]'),
                                convert_to(replace($3, '__SEQ__', g::text), 'UTF8'),
                                now() - make_interval(secs => ($4 - g) / 1000.0)
                         FROM generate_series($5::int8, $6::int8) AS g
                         RETURNING id, received_at
                     )
                     INSERT INTO deliveries (event_id, endpoint_id, next_attempt_at, created_at, updated_at)
                     SELECT ev.id, ep.id, ev.received_at, ev.received_at, ev.received_at
                     FROM ev CROSS JOIN unnest($7::uuid[]) AS ep(id)",
                )
                .bind(source_id)
                .bind(crate::payload::EVENT_TYPE)
                .bind(&template)
                .bind(events as i64)
                .bind(lo as i64)
                .bind(hi as i64)
                .bind(&endpoints)
                .execute(&pool)
                .await?;
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    // What autovacuum would have done to a queue that filled up gradually: statistics,
    // and a vacuumed (all-visible, hinted) deliveries table. Then a checkpoint, so the
    // drain does not pay for the seeding's dirty pages.
    pool.execute("VACUUM (ANALYZE) deliveries").await?;
    pool.execute("ANALYZE events").await?;
    pool.execute("CHECKPOINT").await?;
    Ok(started.elapsed())
}

/// Pending deliveries.
pub async fn pending(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE status = 'pending'").fetch_one(pool).await?)
}
