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
