//! The subscription patterns' reference semantics (`fanout::matches`) and their SQL
//! translation (`fanout::to_like`, which the ingest statement runs) agree, checked
//! against PostgreSQL itself.

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};
use webhook_gateway::fanout;

use crate::support::TestDb;

/// Patterns and event types over an alphabet full of LIKE's and the glob's special
/// characters, short enough that matches are common.
fn pairs() -> impl Strategy<Value = Vec<(String, String)>> {
    let text = |max: usize| {
        proptest::collection::vec(prop::sample::select(vec!['a', 'b', '.', '*', '%', '_', '\\', 'é']), 0..max)
            .prop_map(|c| c.into_iter().collect::<String>())
    };
    proptest::collection::vec((text(6), text(8)), 500..=500)
}

#[tokio::test]
async fn glob_semantics_agree_with_postgresql_like() {
    let db = TestDb::new().await;
    let mut runner = TestRunner::new(Config::default());
    let rounds = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse::<u32>().ok()).map_or(4, |n| n.max(1));
    let mut matched = 0;
    for _ in 0..rounds {
        let batch: Vec<(String, String)> = pairs()
            .new_tree(&mut runner)
            .expect("generate")
            .current()
            .into_iter()
            .filter(|(pattern, _)| fanout::validate_pattern(pattern).is_ok())
            .collect();
        let likes: Vec<String> = batch.iter().map(|(pattern, _)| fanout::to_like(pattern)).collect();
        let types: Vec<&str> = batch.iter().map(|(_, event_type)| event_type.as_str()).collect();
        let in_sql: Vec<bool> = sqlx::query_scalar(
            "SELECT t LIKE p FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS x(t, p, n) ORDER BY n",
        )
        .bind(&types)
        .bind(&likes)
        .fetch_all(&db.pool)
        .await
        .expect("LIKE in PostgreSQL");
        for ((pattern, event_type), sql) in batch.iter().zip(in_sql) {
            assert_eq!(fanout::matches(pattern, event_type), sql, "pattern {pattern:?}, event type {event_type:?}");
            matched += usize::from(sql);
        }
    }
    assert!(matched > 0, "no pair matched: the check compared nothing but misses");
}
