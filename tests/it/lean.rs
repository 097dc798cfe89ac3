//! The lean ingest statements (`store::events::lean`): a lone webhook of a source that
//! no subscription filters, orders or transforms is stored with a fan-out that leaves
//! those parts out. It must reach exactly the endpoints the full fan-out reaches, and
//! store nothing where the full one is needed.

use serde_json::{Value, json};
use sqlx::Connection as _;
use sqlx::Row as _;
use webhook_gateway::ids::SourceId;
use webhook_gateway::store::events::{self, NewEvent, lean};

use crate::support::{TestApp, source_id};

/// `sql` (an ingest statement with `insert_sql`'s ten parameters) run for `event` in a
/// transaction that is rolled back: its answer's event id (`None`: nothing stored, the
/// lean statement's "needs the full fan-out") and the endpoints it created deliveries for,
/// sorted.
async fn fan_out_of(url: &str, sql: &str, event: &NewEvent<'_>) -> (Option<uuid::Uuid>, Vec<String>) {
    let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
    sqlx::query("BEGIN").execute(&mut conn).await.expect("begin");
    let rows = crate::support::bound_event(sql, event).fetch_all(&mut conn).await.expect("ingest statement");
    assert_eq!(rows.len(), 1, "one answer");
    let id: Option<uuid::Uuid> = rows[0].try_get(0).expect("id");
    let endpoints = endpoints_of(&mut conn, id).await;
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE source_id = $1 AND dedupe_key = $2")
        .bind(event.source_id)
        .bind(event.dedupe_key)
        .fetch_one(&mut conn)
        .await
        .expect("events");
    assert_eq!(events, i64::from(id.is_some()), "an event stored exactly when the answer names one");
    sqlx::query("ROLLBACK").execute(&mut conn).await.expect("rollback");
    (id, endpoints)
}

/// The endpoints event `id` has deliveries to, sorted; an ordered delivery is marked, so
/// it differs from the plain endpoint id expected.
pub(crate) async fn endpoints_of(conn: &mut sqlx::PgConnection, id: Option<uuid::Uuid>) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT endpoint_id::text || CASE WHEN ordering_key IS NULL THEN '' ELSE ' (ordered)' END
         FROM deliveries WHERE event_id = $1 ORDER BY endpoint_id",
    )
    .bind(id)
    .fetch_all(conn)
    .await
    .expect("deliveries")
}

fn event<'a>(
    (source, source_name): (SourceId, &'a str),
    key: &'a str,
    event_type: &'a str,
    headers: &'a Value,
) -> NewEvent<'a> {
    NewEvent {
        source_id: source,
        source_name,
        indexing: webhook_gateway::search::Indexing::Content,
        dedupe_key: key,
        event_type,
        content_type: Some("application/json"),
        headers,
        payload: br#"{"amount": 5}"#,
        ordering_key: Some("customer-1"),
        trace: None,
        terms: None,
    }
}

/// Subscriptions of every plain kind: to the source with and without event-type
/// patterns, to every source, two to one endpoint, one to another source. For each
/// event type, the lean statement stores the event with deliveries to exactly the
/// endpoints the full statement's fan-out reaches, and the expected ones (the check is
/// not two empty sets agreeing). The event carries an ordering key that no subscription
/// asks for: unordered either way (an ordered delivery would not match the expected ids).
#[tokio::test]
async fn the_lean_fan_out_reaches_the_endpoints_the_full_one_reaches() {
    let app = TestApp::ingest_only().await;
    let Plain { all_of_shop, orders, invoices, everywhere, twice, .. } = plain_subscriptions(&app).await;
    let shop = source_id(&app.db.pool, "shop").await;
    let headers = json!({});
    let expected = [
        ("order.created", sorted(vec![&all_of_shop, &orders, &everywhere, &twice])),
        ("invoice.paid", sorted(vec![&all_of_shop, &invoices, &everywhere, &twice])),
        ("refund.created", sorted(vec![&all_of_shop, &everywhere, &twice])),
    ];
    for (event_type, endpoints) in expected {
        let event = event((shop, "shop"), "k-1", event_type, &headers);
        let (full_id, full) = fan_out_of(&app.db.url, events::insert_sql(), &event).await;
        let (lean_id, lean) = fan_out_of(&app.db.url, lean::insert_sql(), &event).await;
        assert!(full_id.is_some() && lean_id.is_some(), "{event_type}: both stored it");
        assert_eq!(lean, full, "{event_type}: the same endpoints");
        assert_eq!(lean, endpoints, "{event_type}: the expected endpoints");
    }
}

/// The endpoints of [`plain_subscriptions`].
pub(crate) struct Plain {
    /// Subscribed to `shop`.
    pub(crate) all_of_shop: String,
    /// To `shop`'s `order.*`.
    pub(crate) orders: String,
    /// To `shop`'s `invoice.*`.
    pub(crate) invoices: String,
    /// To every source.
    pub(crate) everywhere: String,
    /// To `shop`, and again to its `order.created`.
    pub(crate) twice: String,
    /// To `other`.
    pub(crate) elsewhere: String,
}

/// Sources `shop` and `other`, and subscriptions of every plain kind: to the source with
/// and without event-type patterns, to every source, two to one endpoint, one to another
/// source.
pub(crate) async fn plain_subscriptions(app: &TestApp) -> Plain {
    app.source_none("shop").await;
    app.source_none("other").await;
    let all_of_shop = app.endpoint_for("http://127.0.0.1:9/all", Some("shop")).await;
    let orders =
        app.endpoint_with("http://127.0.0.1:9/orders", json!({"source": "shop", "event_types": ["order.*"]})).await;
    let invoices =
        app.endpoint_with("http://127.0.0.1:9/invoices", json!({"source": "shop", "event_types": ["invoice.*"]})).await;
    let everywhere = app.endpoint_for("http://127.0.0.1:9/everywhere", None).await;
    let twice = app.endpoint_for("http://127.0.0.1:9/twice", Some("shop")).await;
    app.admin_post(
        "/v1/subscriptions",
        json!({"endpoint_id": twice, "source": "shop", "event_types": ["order.created"]}),
        201,
    )
    .await;
    let elsewhere = app.endpoint_for("http://127.0.0.1:9/elsewhere", Some("other")).await;
    Plain { all_of_shop, orders, invoices, everywhere, twice, elsewhere }
}

/// `ids`, sorted.
pub(crate) fn sorted(mut ids: Vec<&String>) -> Vec<String> {
    ids.sort();
    ids.into_iter().cloned().collect()
}

/// Subscriptions that need the full fan-out, by the source they are made on: one that
/// filters (on `amount > 1000`), one that orders, one that transforms; and a plain one.
pub(crate) fn needing_kinds() -> [(&'static str, Value); 4] {
    [
        ("filtered", json!({"filter": "$.payload.amount > 1000"})),
        ("ordered", json!({"ordered": {"on_dead": "skip"}})),
        ("transformed", json!({"transform": "function handler(w) { return w.payload; }"})),
        ("plain", json!({})),
    ]
}

/// The full fan-out's part that the lean one leaves out, seen in the deliveries of event
/// `event` to `special` (the endpoint of source `name`'s subscription of
/// [`needing_kinds`]): the filter (amount 5) drops it, the line numbers it, the
/// transformation is named.
pub(crate) async fn assert_full_fan_out(
    pool: &webhook_gateway::db::Pool,
    name: &str,
    event: uuid::Uuid,
    special: &str,
) {
    let row = sqlx::query(
        "SELECT count(*) AS n, bool_or(line_seq IS NOT NULL) AS lined, bool_or(transform_by IS NOT NULL) AS transformed
         FROM deliveries WHERE event_id = $1 AND endpoint_id = $2::uuid",
    )
    .bind(event)
    .bind(special)
    .fetch_one(pool)
    .await
    .expect("delivery");
    let (n, lined, transformed): (i64, Option<bool>, Option<bool>) =
        (row.get("n"), row.get("lined"), row.get("transformed"));
    match name {
        "filtered" => assert_eq!(n, 0, "the filter (amount > 1000) dropped it"),
        "ordered" => assert_eq!((n, lined), (1, Some(true)), "in its line"),
        _ => assert_eq!((n, transformed), (1, Some(true)), "its transformation named"),
    }
}

/// A source with one subscription that filters, one that orders, or one that
/// transforms (each on its own source, beside a plain one): the lean statement stores
/// nothing and says so, with the subscription it read in its own snapshot; the gateway's
/// ingest (`events::insert_with_fanout`, lean first) then stores the webhook with the full
/// fan-out, whose part the lean one leaves out is seen in the delivery (the filter drops
/// it, the line numbers it, the transformation is named). A plain source beside them is
/// stored by the lean statement (the control).
#[tokio::test]
async fn a_source_whose_subscription_filters_orders_or_transforms_is_stored_by_the_full_statement() {
    let app = TestApp::ingest_only().await;
    let headers = json!({});
    for (name, mut subscription) in needing_kinds() {
        app.admin_post(
            "/v1/sources",
            json!({"name": name, "kind": "none", "dedupe": {"header": "X-Delivery-Id"},
                   "ordering_key": {"header": "X-Key"}}),
            201,
        )
        .await;
        app.endpoint_for(&format!("http://127.0.0.1:9/{name}/plain"), Some(name)).await;
        subscription["source"] = Value::from(name);
        let special = app.endpoint_with(&format!("http://127.0.0.1:9/{name}/special"), subscription).await;
        let source = source_id(&app.db.pool, name).await;
        let event = event((source, name), "k-1", "order.created", &headers);

        let (lean_id, lean) = fan_out_of(&app.db.url, lean::insert_sql(), &event).await;
        if name == "plain" {
            assert!(lean_id.is_some() && lean.len() == 2, "plain: stored by the lean statement: {lean:?}");
            continue;
        }
        assert_eq!((lean_id, lean.len()), (None, 0), "{name}: the lean statement stored nothing");

        let stored = events::insert_with_fanout(&app.db.pool, &event).await.expect("stored");
        assert!(!stored.duplicate, "{name}");
        assert_full_fan_out(&app.db.pool, name, stored.event_id.0, &special).await;
        assert_eq!(stored.deliveries.len(), if name == "filtered" { 1 } else { 2 }, "{name}");
        // Stored once: the same webhook again is a duplicate (now remembered as needing the
        // full fan-out, so the full statement answers).
        let again = events::insert_with_fanout(&app.db.pool, &event).await.expect("again");
        assert!(again.duplicate && again.event_id == stored.event_id, "{name}: a duplicate");
    }
}

/// A duplicate of a stored webhook, sent through the lean statement, is answered as one
/// with the original's id, and stores nothing.
#[tokio::test]
async fn the_lean_statement_answers_a_duplicate_with_the_original() {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    app.endpoint_for("http://127.0.0.1:9/", Some("shop")).await;
    let shop = source_id(&app.db.pool, "shop").await;
    let headers = json!({});
    let event = event((shop, "shop"), "dup-1", "order.created", &headers);
    let first = events::insert_with_fanout(&app.db.pool, &event).await.expect("stored");
    assert!(!first.duplicate && first.deliveries.len() == 1);
    let again = events::insert_with_fanout(&app.db.pool, &event).await.expect("again");
    assert!(again.duplicate);
    assert_eq!(again.event_id, first.event_id);
    assert!(again.deliveries.is_empty());
    assert_eq!(app.db.count("events").await, 1);
    assert_eq!(app.db.count("deliveries").await, 1);
}
