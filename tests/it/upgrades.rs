//! Two releases on one schema: during a rolling deploy release N runs beside N+1 on the
//! schema N+1 migrated (docs/upgrades.md has the policy that keeps that possible).

use std::time::Duration;

use webhook_gateway::db;

use crate::support::sink::Sink;
use crate::support::{TestApp, TestDb, eventually, test_settings};

/// A schema a later release migrated (a migration this binary does not know, with the
/// additive change such a migration makes) does not stop this release: its migration
/// step passes, it starts, ingests and delivers. (sqlx's default refuses to start when
/// the database has a migration the binary does not know.)
#[tokio::test]
async fn a_release_starts_and_delivers_on_a_schema_a_later_release_migrated() {
    let db = TestDb::new().await;
    sqlx::raw_sql(
        "ALTER TABLE deliveries ADD COLUMN later_release_note text;
         CREATE TABLE later_release_things (id bigint PRIMARY KEY);
         INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99990101000000, 'a later release', true, '\\x00', 1);",
    )
    .execute(&db.pool)
    .await
    .expect("a later release's migration");
    db::migrate(&db.pool).await.expect("this release's migration step on the newer schema");

    let app = TestApp::spawn_with(db, test_settings(), 8).await;
    let ready = app.http.get(app.url("/readyz")).send().await.expect("readyz");
    assert_eq!(ready.status(), 200);
    let sink = Sink::ok().await;
    app.source_none("shop").await;
    app.endpoint_for(&sink.url("/hooks"), Some("shop")).await;
    let (status, body) = app.ingest("shop", "d-1", "order.created", "{}").await;
    assert_eq!(status, 200, "{body}");
    eventually(Duration::from_secs(20), "delivered on the newer schema", || async {
        (sink.count() == 1).then_some(())
    })
    .await;
}

/// The commit of the previous release (`tests/previous-release`).
fn previous_release() -> String {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/previous-release"))
        .expect("tests/previous-release");
    text.lines().map(str::trim).find(|l| !l.is_empty() && !l.starts_with('#')).expect("a commit").to_owned()
}

/// The previous release's binary: `WEBHOOK_GATEWAY_PREVIOUS_BIN`, or built once from its
/// commit (`git archive`, `cargo build` in a target directory of its own) and cached under
/// `~/.cache/webhook-gateway/releases/<commit>/`. The first build takes a few minutes.
fn previous_release_binary() -> std::path::PathBuf {
    use std::process::Command;
    if let Some(bin) = std::env::var_os("WEBHOOK_GATEWAY_PREVIOUS_BIN") {
        return bin.into();
    }
    let commit = previous_release();
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("webhook-gateway/releases")
        .join(&commit);
    let bin = cache.join("webhook-gateway");
    if bin.exists() {
        return bin;
    }
    let src = cache.join("src");
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src).expect("cache directory");
    let repo = env!("CARGO_MANIFEST_DIR");
    let archive = Command::new("sh")
        .arg("-c")
        .arg(format!("git -C '{repo}' archive '{commit}' | tar -x -C '{}'", src.display()))
        .status()
        .expect("git archive");
    assert!(archive.success(), "cannot extract release {commit} from git (a shallow clone? fetch it)");
    eprintln!("upgrades: building the previous release {commit} once (cached in {})", cache.display());
    let built = Command::new(env!("CARGO"))
        .args(["build", "--locked", "--bin", "webhook-gateway", "--manifest-path"])
        .arg(src.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", cache.join("target"))
        .status()
        .expect("cargo build");
    assert!(built.success(), "building release {commit} failed");
    std::fs::copy(cache.join("target/debug/webhook-gateway"), &bin).expect("cache the binary");
    let _ = std::fs::remove_dir_all(cache.join("target"));
    let _ = std::fs::remove_dir_all(&src);
    bin
}

/// Release N-1 (`tests/previous-release`) and this release side by side on the schema this
/// release migrated (with migrations N-1 does not know), as during a rolling deploy: N-1
/// starts on it, ingests and delivers what either release ingested; then N delivers what
/// either ingested after N-1 stops. Every webhook delivered exactly once, no error logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_previous_release_runs_beside_this_one_on_the_migrated_schema() {
    use crate::support::{GatewayProcess, shop_to_sink, wait_ready};
    let previous = tokio::task::spawn_blocking(previous_release_binary).await.expect("previous release");
    let db = TestDb::new().await;
    let sink = Sink::ok().await;
    // This release: ingest only at first; the previous one ingests and delivers.
    let mut new_ingest = GatewayProcess::start(&db.url, &["--role", "ingest"]);
    let mut old =
        GatewayProcess::start_binary(&previous, std::net::SocketAddr::from(([127, 0, 0, 1], 0)), &db.url, &[], &[]);
    for gw in [&new_ingest, &old] {
        wait_ready(gw.addr).await;
    }
    shop_to_sink(&format!("http://{}", new_ingest.addr), &sink).await;
    let http = reqwest::Client::new();
    let post = |gw: std::net::SocketAddr, id: String| {
        let http = http.clone();
        async move {
            let answer = http
                .post(format!("http://{gw}/ingest/shop"))
                .header("x-delivery-id", &id)
                .body("{}")
                .send()
                .await
                .expect("ingest");
            assert_eq!(answer.status(), 200, "{id} through {gw}");
        }
    };
    for n in 0..40 {
        let through = if n % 2 == 0 { new_ingest.addr } else { old.addr };
        post(through, format!("first-{n}")).await;
    }
    eventually(Duration::from_secs(30), "the previous release delivered both releases' webhooks", || async {
        (sink.count() >= 40).then_some(())
    })
    .await;
    assert!(old.terminate(), "the previous release stops cleanly");
    let mut new_worker = GatewayProcess::start(&db.url, &["--role", "worker"]);
    for n in 0..20 {
        post(new_ingest.addr, format!("then-{n}")).await;
    }
    eventually(Duration::from_secs(30), "this release delivers after it", || async {
        (sink.count() >= 60).then_some(())
    })
    .await;
    let mut per_webhook = std::collections::HashMap::new();
    for received in sink.received() {
        *per_webhook.entry(received.header("webhook-id")).or_insert(0) += 1;
    }
    assert_eq!(per_webhook.len(), 60);
    assert!(per_webhook.values().all(|n| *n == 1), "each delivered once");
    for gw in [&mut new_ingest, &mut new_worker] {
        assert!(gw.terminate());
    }
    for log in [&old.log, &new_ingest.log, &new_worker.log] {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let errors: Vec<&str> = text.lines().filter(|l| l.contains(" ERROR ")).collect();
        assert!(errors.is_empty(), "{}: {errors:?}", log.display());
    }
}

/// Run the pending migrations while a transaction of the running release holds `table`
/// (a read: enough against an ACCESS EXCLUSIVE lock). They must neither wait on it
/// unbounded nor fail; returns how long they took.
async fn migrate_while_a_release_reads(db: &TestDb, table: &str) -> Duration {
    use sqlx::Connection as _;
    let mut running = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut running).await.unwrap();
    sqlx::query(&format!("SELECT count(*) FROM {table}")).execute(&mut running).await.unwrap();
    let started = std::time::Instant::now();
    let migrated = tokio::time::timeout(Duration::from_secs(20), db::migrate(&db.pool)).await;
    let waited = started.elapsed();
    sqlx::query("ROLLBACK").execute(&mut running).await.unwrap();
    migrated.expect("the migration step does not wait on the lock").expect("the migration step succeeds");
    waited
}

/// Whether migration `version` is recorded as applied.
async fn recorded(db: &TestDb, version: i64) -> bool {
    sqlx::query_scalar("SELECT success FROM _sqlx_migrations WHERE version = $1")
        .bind(version)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
        .unwrap_or(false)
}

/// Migration 0023 (event bodies compressed with lz4) needs an ACCESS EXCLUSIVE lock on
/// `events`, and every ingest would queue behind a request for it: when the lock is not
/// granted within 2 s (here a transaction of the running release holds `events`), the
/// migration gives up on the compression, which is only a cost, and the upgrade goes on:
/// the step succeeds, the migration is recorded, the columns keep their compression.
#[tokio::test]
async fn the_compression_migration_waits_for_its_lock_at_most_two_seconds_and_never_fails_the_upgrade() {
    let db = TestDb::new().await;
    // The schema as the release before 0023 left it.
    sqlx::raw_sql(
        "ALTER TABLE events ALTER COLUMN payload SET COMPRESSION default, ALTER COLUMN headers SET COMPRESSION default;
         DELETE FROM _sqlx_migrations WHERE version = 23;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let compression = || crate::support::events_compression(&db.pool);
    let default = compression().await;
    assert_ne!(default, "headers=l,payload=l");

    let waited = migrate_while_a_release_reads(&db, "events").await;
    assert!(waited >= Duration::from_secs(2), "it waited for the lock, {waited:?}");
    assert_eq!(compression().await, default, "the columns keep their compression");
    assert!(recorded(&db, 23).await, "the migration is recorded");

    // Without the lock held it takes effect (on a database where it was given up, by hand:
    // docs/operating.md).
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = 23").execute(&db.pool).await.unwrap();
    db::migrate(&db.pool).await.unwrap();
    assert_eq!(compression().await, "headers=l,payload=l");
}

/// Migration 0025 (search terms stored without compression) takes the same lock as 0023
/// and gives up the same way: a cost, never a failed upgrade. Once applied, an event
/// whose row passes the TOAST threshold keeps its terms uncompressed and is found by them.
#[tokio::test]
async fn the_search_storage_migration_waits_for_its_lock_at_most_two_seconds_and_never_fails_the_upgrade() {
    let db = TestDb::new().await;
    let storage = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT attstorage::text FROM pg_attribute WHERE attrelid = 'events'::regclass AND attname = 'search'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    assert_eq!(storage().await, "e", "a new database has it");
    // The schema as the release before 0025 left it.
    sqlx::raw_sql(
        "ALTER TABLE events ALTER COLUMN search SET STORAGE EXTENDED;
         DELETE FROM _sqlx_migrations WHERE version = 25;",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let waited = migrate_while_a_release_reads(&db, "events").await;
    assert!(waited >= Duration::from_secs(2), "it waited for the lock, {waited:?}");
    assert_eq!(storage().await, "x", "the column keeps its storage");
    assert!(recorded(&db, 25).await, "the migration is recorded");

    // The control: under the old storage, terms that compress are compressed with pglz
    // to make the row fit.
    assert_eq!(insert_compressible_terms(&db, "before").await, (Some("pglz".into()), 1));

    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = 25").execute(&db.pool).await.unwrap();
    db::migrate(&db.pool).await.unwrap();
    assert_eq!(storage().await, "e");
    // Never compressed now (no attempt either), and still found by a term.
    assert_eq!(insert_compressible_terms(&db, "after").await, (None, 1));
}

/// Store an event under `key` whose search terms compress (small numbers: mostly zero
/// bytes) beside a body that does not, in a row past the TOAST threshold; then its terms'
/// compression method (none: `None`) and whether a search for one of them finds it.
async fn insert_compressible_terms(db: &TestDb, key: &str) -> (Option<String>, i64) {
    let terms: Vec<i64> = (1..=120).collect();
    let body: Vec<u8> = (0..1800u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    sqlx::query(
        "INSERT INTO events (source_id, dedupe_key, event_type, content_type, headers, payload, search)
         SELECT id, $1, 't', 'application/octet-stream', '{}'::jsonb, $2, $3 FROM sources WHERE name = '_test'",
    )
    .bind(key)
    .bind(&body)
    .bind(&terms)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query_as(
        "SELECT pg_column_compression(search),
                (SELECT count(*) FROM events WHERE search @> ARRAY[77::int8] AND dedupe_key = $1)
         FROM events WHERE dedupe_key = $1",
    )
    .bind(key)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Migration 0026 drops `order_lines_head`, which no statement has used since the release
/// of migration 0025 (lines are found by their own key). It needs an ACCESS EXCLUSIVE
/// lock on `order_lines`: when a transaction of the running release holds the table for
/// more than 2 s, the index stays and the upgrade goes on. Once the index is gone, moving
/// a line's head is a HOT update; the control: with the index, the same move is not.
#[tokio::test]
async fn the_line_head_index_is_dropped_within_two_seconds_or_left_and_never_fails_the_upgrade() {
    let db = TestDb::new().await;
    let index = || async {
        sqlx::query_scalar::<_, bool>("SELECT to_regclass('order_lines_head') IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    assert!(!index().await, "a new database has no index on the head");
    // The schema as the release before 0026 left it.
    sqlx::raw_sql(
        "CREATE INDEX order_lines_head ON order_lines (head_id) WHERE head_id IS NOT NULL;
         DELETE FROM _sqlx_migrations WHERE version = 26;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(head_moves_hot(&db, "with the index").await, 0, "the control: not HOT with the index");

    let waited = migrate_while_a_release_reads(&db, "order_lines").await;
    assert!(waited >= Duration::from_secs(2), "it waited for the lock, {waited:?}");
    assert!(index().await, "the index stays");
    assert!(recorded(&db, 26).await, "the migration is recorded");

    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = 26").execute(&db.pool).await.unwrap();
    db::migrate(&db.pool).await.unwrap();
    assert!(!index().await, "dropped");
    assert_eq!(head_moves_hot(&db, "without the index").await, 1, "a head's move is a HOT update");
}

/// Make a line under `key` (to an endpoint of its own) with a head, move the head in one
/// transaction, and return how many of that transaction's updates of `order_lines` were
/// HOT (counted by the transaction itself, so nothing else on the server can add to it).
async fn head_moves_hot(db: &TestDb, key: &str) -> i64 {
    let endpoint = crate::support::insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    sqlx::query(
        "INSERT INTO order_lines (endpoint_id, ordering_key, head_id) VALUES ($1::uuid, $2, gen_random_uuid())",
    )
    .bind(&endpoint)
    .bind(key)
    .execute(&db.pool)
    .await
    .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let moved = sqlx::query("UPDATE order_lines SET head_id = gen_random_uuid() WHERE ordering_key = $1")
        .bind(key)
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(moved.rows_affected(), 1);
    let hot: i64 = sqlx::query_scalar("SELECT pg_stat_get_xact_tuples_hot_updated('order_lines'::regclass)")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    hot
}

/// Migration 0027 drops `wg_claim_fresh_v1`: the pinned previous release calls `_v2`
/// (migration 0024), which stays; this release calls `_v3` (migration 0034,
/// `queue::CLAIM_FRESH_FUNCTION`), which calls `_v2`.
#[tokio::test]
async fn the_claim_function_of_two_releases_ago_is_dropped_and_the_one_in_use_stays() {
    let db = TestDb::new().await;
    let exists = |name: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM pg_proc WHERE proname = $1)")
                .bind(name)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert!(!exists("wg_claim_fresh_v1").await, "dropped");
    assert!(exists("wg_claim_fresh_v2").await, "the one the release before calls");
    assert!(exists("wg_claim_fresh_v3").await, "the one this release calls");
    assert_eq!(webhook_gateway::queue::CLAIM_FRESH_FUNCTION, "wg_claim_fresh_v3");
}

/// Migration 0035 replaces the foreign keys `deliveries.event_id` and
/// `attempts.delivery_id` (their insert check cannot fail: each row is written by the
/// statement that writes or locks its parent) with statement-level cascades. Dropping a
/// key needs an ACCESS EXCLUSIVE lock on both of its tables: when a transaction of the
/// running release holds `attempts` for more than 2 s, the keys stay (and cascade as they
/// did), no trigger is left half made, and the upgrade goes on. Without the lock held,
/// the keys go and the triggers cascade in their place (`cascades.rs` holds what they do).
#[tokio::test]
async fn the_foreign_keys_checked_by_construction_go_within_two_seconds_or_stay_and_never_fail_the_upgrade() {
    let db = TestDb::new().await;
    let schema = || async {
        sqlx::query_as::<_, (i64, i64)>(
            "SELECT (SELECT count(*) FROM pg_constraint
                     WHERE conname IN ('deliveries_event_id_fkey', 'attempts_delivery_id_fkey')),
                    (SELECT count(*) FROM pg_trigger
                     WHERE tgname IN ('events_deleted_take_their_deliveries', 'deliveries_deleted_take_their_attempts',
                                      'events_truncated_take_their_deliveries',
                                      'deliveries_truncated_take_their_attempts'))",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    assert_eq!(schema().await, (0, 4), "a new database: no keys, four triggers");
    // The schema as the release before 0035 left it.
    sqlx::raw_sql(
        "DROP TRIGGER events_deleted_take_their_deliveries ON events;
         DROP TRIGGER deliveries_deleted_take_their_attempts ON deliveries;
         DROP TRIGGER events_truncated_take_their_deliveries ON events;
         DROP TRIGGER deliveries_truncated_take_their_attempts ON deliveries;
         DROP FUNCTION wg_delete_children_of_deleted_parents(), wg_truncate_children();
         ALTER TABLE deliveries ADD CONSTRAINT deliveries_event_id_fkey
             FOREIGN KEY (event_id) REFERENCES events (id) ON DELETE CASCADE;
         ALTER TABLE attempts ADD CONSTRAINT attempts_delivery_id_fkey
             FOREIGN KEY (delivery_id) REFERENCES deliveries (id) ON DELETE CASCADE;
         DELETE FROM _sqlx_migrations WHERE version = 35;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(schema().await, (2, 0));

    let waited = migrate_while_a_release_reads(&db, "attempts").await;
    assert!(waited >= Duration::from_secs(2), "it waited for the lock, {waited:?}");
    assert_eq!(schema().await, (2, 0), "the keys stay, and no trigger beside them");
    assert!(recorded(&db, 35).await, "the migration is recorded");

    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = 35").execute(&db.pool).await.unwrap();
    db::migrate(&db.pool).await.unwrap();
    assert_eq!(schema().await, (0, 4), "the keys gone, the cascades in their place");
}
