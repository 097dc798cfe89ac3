//! The lean batch statements (`store::events::lean_insert_batch_sql` and its leasing
//! form): a batch whose sources no subscription filters, orders or transforms is stored
//! with a fan-out that leaves those parts out. It must reach exactly the endpoints the
//! full batch fan-out reaches, and store nothing where one source of the batch needs the
//! full one.

use serde_json::Value;
use sqlx::Connection as _;
use sqlx::Row as _;
use webhook_gateway::ids::SourceId;
use webhook_gateway::store::events::{self, ClaimTerms};

use crate::lean::{Plain, assert_full_fan_out, endpoints_of, needing_kinds, plain_subscriptions, sorted};
use crate::support::{TestApp, owned_event, source_id};

/// One event of a test batch: its source, dedupe key and type.
type Input<'a> = (SourceId, &'a str, &'a str);

/// `sql` (a batch ingest statement, plain) run for `batch` in a transaction that is
/// rolled back: each event's answer, in input order, as its id (`None`: nothing stored)
/// and the endpoints it created deliveries for, sorted; and whether the statement said
/// the batch needs the full fan-out.
async fn batch_fan_out(url: &str, sql: &str, batch: &[Input<'_>]) -> (Vec<(Option<uuid::Uuid>, Vec<String>)>, bool) {
    let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
    sqlx::query("BEGIN").execute(&mut conn).await.expect("begin");
    let n = batch.len();
    let ords: Vec<i32> = (0..n as i32).collect();
    let rows = sqlx::query(sql)
        .bind(batch.iter().map(|e| e.0).collect::<Vec<_>>())
        .bind(batch.iter().map(|e| e.1).collect::<Vec<_>>())
        .bind(batch.iter().map(|e| e.2).collect::<Vec<_>>())
        .bind(vec![Some("application/json"); n])
        .bind(vec!["{}"; n])
        .bind(vec![br#"{"amount": 5}"#.as_slice(); n])
        .bind(&ords)
        .bind(vec![Some("customer-1"); n])
        .bind(&ords)
        .bind(vec![None::<&str>; n])
        .bind(vec![None::<&str>; n])
        .bind(Vec::<i64>::new())
        .bind(vec![0i32; n])
        .fetch_all(&mut conn)
        .await
        .expect("batch statement");
    // The full statement has no such column; the lean one says it on every row.
    let needs_full = rows.iter().any(|row| row.try_get::<bool, _>("needs_full").unwrap_or(false));
    let mut answers = vec![(None, Vec::new()); n];
    for row in rows.iter().filter(|_| !needs_full) {
        let (ord, id): (i32, Option<uuid::Uuid>) = (row.get(0), row.get(1));
        answers[ord as usize] = (id, endpoints_of(&mut conn, id).await);
    }
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE dedupe_key = ANY($1)")
        .bind(batch.iter().map(|e| e.1).collect::<Vec<_>>())
        .fetch_one(&mut conn)
        .await
        .expect("events");
    let answered = answers.iter().filter(|(id, _)| id.is_some()).count() as i64;
    assert_eq!(stored, answered, "an event stored exactly when the answer names one");
    sqlx::query("ROLLBACK").execute(&mut conn).await.expect("rollback");
    (answers, needs_full)
}

/// Subscriptions of every plain kind (to the source with and without event-type
/// patterns, to every source, two to one endpoint, one to another source) and a batch of
/// three types from `shop` and one event from `other`: the lean batch statement stores
/// each event with deliveries to exactly the endpoints the full batch statement reaches,
/// and the expected ones (not two empty sets agreeing). The events carry an ordering key
/// that no subscription asks for: unordered either way.
#[tokio::test]
async fn the_lean_batch_fan_out_reaches_the_endpoints_the_full_one_reaches() {
    let app = TestApp::ingest_only().await;
    let Plain { all_of_shop, orders, invoices, everywhere, twice, elsewhere } = plain_subscriptions(&app).await;
    let (shop, other) = (source_id(&app.db.pool, "shop").await, source_id(&app.db.pool, "other").await);
    let batch = [
        (shop, "k-1", "order.created"),
        (shop, "k-2", "invoice.paid"),
        (other, "k-3", "order.created"),
        (shop, "k-4", "refund.created"),
    ];
    let expected = [
        sorted(vec![&all_of_shop, &orders, &everywhere, &twice]),
        sorted(vec![&all_of_shop, &invoices, &everywhere, &twice]),
        sorted(vec![&elsewhere, &everywhere]),
        sorted(vec![&all_of_shop, &everywhere, &twice]),
    ];
    let (full, full_needs) = batch_fan_out(&app.db.url, events::insert_batch_sql(), &batch).await;
    let (lean, lean_needs) = batch_fan_out(&app.db.url, events::lean_insert_batch_sql(), &batch).await;
    assert!(!full_needs && !lean_needs);
    for (i, expected) in expected.iter().enumerate() {
        assert!(full[i].0.is_some() && lean[i].0.is_some(), "event {i}: both stored it");
        assert_eq!(lean[i].1, full[i].1, "event {i}: the same endpoints");
        assert_eq!(&lean[i].1, expected, "event {i}: the expected endpoints");
    }
}

/// A batch of a plain source's event beside one of a source with a subscription that
/// filters, orders or transforms: the lean batch statement stores nothing and says so;
/// the gateway's batch ingest (`insert_batch_with_fanout`, lean first) then stores both
/// with the full fan-out, whose part the lean one leaves out is seen in the delivery.
/// The control: a batch of two plain events is stored by the lean statement. The leasing
/// form does the same: a transformed source's lease comes back with its transformation,
/// which only the full leasing statement reads.
#[tokio::test]
async fn a_batch_with_a_source_that_needs_the_full_fan_out_is_stored_by_the_full_statement() {
    let app = TestApp::ingest_only().await;
    let kinds = needing_kinds();
    let mut specials = Vec::new();
    for (name, subscription) in &kinds {
        let (name, mut subscription) = (*name, subscription.clone());
        app.source_none(name).await;
        app.endpoint_for(&format!("http://127.0.0.1:9/{name}/plain"), Some(name)).await;
        subscription["source"] = Value::from(name);
        specials.push(app.endpoint_with(&format!("http://127.0.0.1:9/{name}/special"), subscription).await);
    }
    let plain = source_id(&app.db.pool, "plain").await;
    let control = [(plain, "c-1", "order.created"), (plain, "c-2", "order.created")];
    let (answers, needs_full) = batch_fan_out(&app.db.url, events::lean_insert_batch_sql(), &control).await;
    assert!(!needs_full && answers.iter().all(|(id, endpoints)| id.is_some() && endpoints.len() == 2), "{answers:?}");

    for (i, (name, _)) in kinds.iter().enumerate().take(3) {
        let source = source_id(&app.db.pool, name).await;
        let batch = [(plain, "p-1", "order.created"), (source, "s-1", "order.created")];
        let (answers, needs_full) = batch_fan_out(&app.db.url, events::lean_insert_batch_sql(), &batch).await;
        assert!(needs_full && answers.iter().all(|(id, _)| id.is_none()), "{name}: stored nothing: {answers:?}");

        let owned = [owned_event(plain, "plain", &format!("{name}-p"), "order.created"), {
            let mut event = owned_event(source, name, &format!("{name}-s"), "order.created");
            event.payload = br#"{"amount": 5}"#.to_vec().into();
            event.ordering_key = Some("customer-1".to_owned());
            event
        }];
        let stored = events::insert_batch_with_fanout(&app.db.pool, &owned).await.expect("stored");
        assert_eq!(stored[0].deliveries.len(), 2, "{name}: the plain source's event reaches both endpoints");
        assert_full_fan_out(&app.db.pool, name, stored[1].event_id.0, &specials[i]).await;
    }

    let transformed = source_id(&app.db.pool, "transformed").await;
    let leasing = [
        owned_event(plain, "plain", "l-p", "order.created"),
        owned_event(transformed, "transformed", "l-t", "order.created"),
    ];
    let terms = ClaimTerms { limit: 8, lease: std::time::Duration::from_secs(300), default_max_in_flight: 100 };
    let (stored, fresh) = events::insert_batch_and_claim(&app.db.pool, &leasing, terms).await.expect("leased");
    assert!(stored.iter().all(|s| !s.duplicate && s.deliveries.len() == 2), "{stored:?}");
    assert_eq!(fresh.claimed.len(), 4, "every delivery leased");
    let special = fresh.claimed.iter().find(|job| job.endpoint_id.0.to_string() == specials[2]).expect("special");
    assert!(special.transform.is_some(), "the full leasing statement read its transformation");
}
