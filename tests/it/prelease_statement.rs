//! The leasing ingest statement driven directly (`store::events::insert_and_claim`):
//! one row version per leased delivery, statements racing for one endpoint's limit, a
//! requester that stops waiting, what a lease carries of its event, copies racing on the
//! leasing path. The hand-off around it (the dispatcher, replicas, fallbacks) is in
//! `prelease`.

use std::time::Duration;

use serde_json::json;
use webhook_gateway::deliver::prelease;
use webhook_gateway::store::events::NewEvent;

use crate::prelease::{claim_the_rest, hand_off_without_dispatcher, hold_source, lease_of, shop_event};
use crate::support::{TestApp, owned_event, source_id};

const WAIT: Duration = Duration::from_secs(60);

/// The statement that stores a lone webhook and leases its delivery writes one version of
/// the delivery's row: inserted leased (attempt 1, a token, the lease's end), never
/// updated after. A claim after the insert wrote a second version, and PostgreSQL ran its
/// foreign key checks, CHECK constraints and index entries again (bench row 18). Counted
/// in the statement's own transaction (the full fan-out's and the lean one's), which is
/// then rolled back. Control: the same webhook stored pending, then claimed by key in the
/// same transaction, counts an update.
#[tokio::test]
async fn a_delivery_leased_by_its_ingest_statement_is_written_once() {
    use sqlx::Connection as _;
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    app.endpoint_for("http://127.0.0.1:9/", Some("shop")).await;
    let db = &app.db;
    let headers = json!({});
    let event = shop_event(&db.pool, "once-1", &headers).await;
    let versions = "SELECT pg_stat_get_xact_tuples_inserted('deliveries'::regclass),
                           pg_stat_get_xact_tuples_updated('deliveries'::regclass)";

    use webhook_gateway::store::events::{insert_and_claim_sql, lean};
    for (fan_out, sql) in [("full", insert_and_claim_sql()), ("lean", lean::insert_and_claim_sql())] {
        // A connection each: a backend's counts of a transaction it rolled back last until
        // it reports them.
        let mut conn = sqlx::PgConnection::connect(&db.url).await.expect("connect");
        sqlx::query("BEGIN").execute(&mut conn).await.expect("begin");
        let rows = crate::support::bound_event(sql, &event)
            .bind(8_i64)
            .bind(60.0_f64)
            .bind(4_i32)
            .fetch_all(&mut conn)
            .await
            .expect("ingest and lease");
        let leased: Vec<(uuid::Uuid, i32, i64)> = rows
            .iter()
            .filter_map(|row| {
                use sqlx::Row as _;
                let id: Option<uuid::Uuid> = row.try_get("id").expect("id");
                Some((id?, row.try_get("attempt").expect("attempt"), row.try_get("claim_token").expect("token")))
            })
            .collect();
        assert_eq!(leased.len(), 1, "{fan_out}: its one delivery leased");
        assert_eq!(leased[0].1, 1, "{fan_out}: on its first attempt");
        assert!(leased[0].2 > 0, "{fan_out}: with a token");
        let (inserted, updated): (i64, i64) = sqlx::query_as(versions).fetch_one(&mut conn).await.expect("counts");
        assert_eq!((inserted, updated), (1, 0), "{fan_out}: one row version");
        sqlx::query("ROLLBACK").execute(&mut conn).await.expect("rollback");
    }

    // Control: stored pending, then claimed by key.
    let mut conn = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    sqlx::query("BEGIN").execute(&mut conn).await.expect("begin");
    let stored = webhook_gateway::store::events::insert_in(&mut conn, &event).await.expect("stored").expect("new");
    let claimed: i64 = sqlx::query_scalar(&format!(
        "SELECT count(id) FROM {}($1, 8, 60, 4)",
        webhook_gateway::queue::CLAIM_FRESH_FUNCTION
    ))
    .bind(&stored.deliveries)
    .fetch_one(&mut conn)
    .await
    .expect("claim");
    assert_eq!(claimed, 1);
    let (inserted, updated): (i64, i64) = sqlx::query_as(versions).fetch_one(&mut conn).await.expect("counts");
    assert_eq!((inserted, updated), (1, 1), "the control writes a second version");
    sqlx::query("ROLLBACK").execute(&mut conn).await.expect("rollback");
}

/// Sixteen lone webhooks stored at once, each by its own leasing statement on its own
/// connection, fanned out to four endpoints: one limited to three requests in flight,
/// one whose rate limit has a burst of two tokens, one paused, one whose circuit is open.
/// The statements race for the endpoint rows, and each reads the leases in flight only
/// after it holds the row (one that another statement holds is skipped): at most three
/// deliveries of the first are leased and two of the second, none of the paused or open
/// one's; the rest are stored pending. A claim by key of the rest, as the dispatcher's
/// after the commits, fills each limit exactly, and every lease has its own token.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_leasing_statements_fill_each_endpoint_s_limit_and_never_pass_it() {
    racing_leasing_statements_keep_the_limits(Fanned::ToAllFour).await;
}

/// The same race where each webhook goes to one endpoint (its event type names it), the
/// most common lone webhook: its room is granted by `wg_lease_room_v5`'s path for one
/// endpoint (migrations 0032, 0033), and the same limits hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_leasing_statements_for_one_endpoint_each_fill_its_limit_and_never_pass_it() {
    racing_leasing_statements_keep_the_limits(Fanned::OneEach).await;
}

/// Where the racing webhooks of [`racing_leasing_statements_keep_the_limits`] go.
#[derive(Clone, Copy, PartialEq)]
enum Fanned {
    /// Every webhook to the four endpoints.
    ToAllFour,
    /// Each webhook to one of them, 16 webhooks each.
    OneEach,
}

/// 16 webhooks a endpoint, stored by leasing statements racing on their own connections,
/// for an endpoint capped at 3 in flight, one whose rate limit has a burst of 2, a paused
/// one and one whose circuit is open: the cap and the burst are filled and never passed,
/// nothing is leased for the other two, and each lease has a token of its own.
async fn racing_leasing_statements_keep_the_limits(fanned: Fanned) {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    let names = ["capped", "rated", "paused", "open"];
    let mut endpoints = Vec::new();
    for name in names {
        let url = format!("http://127.0.0.1:9/{name}");
        let subscription = match fanned {
            Fanned::ToAllFour => json!({"source": "shop"}),
            Fanned::OneEach => json!({"source": "shop", "event_types": [name]}),
        };
        endpoints.push(app.endpoint_with(&url, subscription).await);
    }
    let [capped, rated, paused, open] = [0, 1, 2, 3].map(|i| endpoints[i].clone());
    let pool = &app.db.pool;
    for (sql, endpoint) in [
        ("UPDATE endpoints SET max_in_flight = 3 WHERE id = $1::uuid", &capped),
        ("UPDATE endpoints SET rate_limit_per_sec = 0.001, rate_limit_burst = 2 WHERE id = $1::uuid", &rated),
        ("UPDATE endpoints SET paused = true WHERE id = $1::uuid", &paused),
        (
            "UPDATE endpoints SET circuit_state = 'open', open_count = 1, opened_at = now(),
                                  reopen_at = now() + interval '1 hour'
             WHERE id = $1::uuid",
            &open,
        ),
    ] {
        sqlx::query(sql).bind(endpoint).execute(pool).await.expect("limit");
    }
    const RACERS: usize = 16;
    let headers = json!({});
    let kinds: &[&str] = match fanned {
        Fanned::ToAllFour => &["order.created"],
        Fanned::OneEach => &names,
    };
    let keys: Vec<(String, &str)> =
        kinds.iter().flat_map(|kind| (0..RACERS).map(move |i| (format!("race-{kind}-{i}"), *kind))).collect();
    let mut events = Vec::new();
    for (key, kind) in &keys {
        events.push(NewEvent { event_type: kind, ..shop_event(pool, key, &headers).await });
    }
    let terms = webhook_gateway::store::events::ClaimTerms {
        limit: 8,
        lease: Duration::from_secs(300),
        default_max_in_flight: 100,
    };
    let stored = futures_util::future::join_all(
        events.iter().map(|event| webhook_gateway::store::events::insert_and_claim(pool, event, terms)),
    )
    .await;
    let each = if fanned == Fanned::OneEach { 1 } else { 4 };
    let (mut tokens, mut all, mut by_statements) = (Vec::new(), Vec::new(), Vec::new());
    for result in stored {
        let (stored, fresh) = result.expect("stored");
        assert!(!stored.duplicate);
        assert_eq!(stored.deliveries.len(), each, "one delivery per endpoint the webhook goes to");
        tokens.extend(fresh.claimed.iter().map(|job| job.claim_token));
        by_statements.extend(fresh.claimed.iter().map(|job| job.id));
        all.extend(stored.deliveries);
    }
    let leased = |endpoint: &str| {
        let endpoint = endpoint.to_owned();
        async move { lease_of(pool, &endpoint).await.iter().filter(|lease| lease.3).count() }
    };
    assert!(leased(&capped).await <= 3, "the in-flight limit not passed by the statements");
    assert!(leased(&rated).await <= 2, "nor the burst's tokens");
    tokens.extend(claim_the_rest(pool, all, &by_statements).await);
    assert_eq!(leased(&capped).await, 3, "the in-flight limit filled, not passed");
    assert_eq!(leased(&rated).await, 2, "the burst's tokens spent, no more");
    assert_eq!(leased(&paused).await, 0, "nothing leased for a paused endpoint");
    assert_eq!(leased(&open).await, 0, "nor for one whose circuit is open");
    assert_eq!(tokens.len(), 5, "the answers name each lease once");
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 5, "each lease its own token");
    assert_eq!(app.db.count("deliveries").await, 4 * RACERS as i64);
}

/// A requester that stops waiting while its leasing statement is under way (its client
/// gone, its deadline passed) drops the store; the statement is still carried through to
/// the hand-off: its lease reaches the dispatcher's end, not left to run out. Here the
/// statement, its lease taken, waits on its source's row, locked by another transaction,
/// past the requester's patience; the lock is then let go. Control: awaiting the statement plainly
/// in the requester (no finishing on drop), the lease is committed and nothing receives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leasing_statement_whose_requester_stops_waiting_still_hands_its_lease_over() {
    let (app, ep, shared, mut received) = hand_off_without_dispatcher().await;
    let pool = &app.db.pool;

    let holder = hold_source(pool, "shop").await;
    let event = owned_event(source_id(pool, "shop").await, "shop", "impatient-1", "order.created");
    let waited = tokio::time::timeout(Duration::from_millis(500), prelease::store(pool, event, shared.clone())).await;
    assert!(waited.is_err(), "the statement waits on the locked source past the requester's patience");
    assert_eq!(app.db.count("events").await, 0, "nothing committed yet");
    holder.commit().await.expect("let the source go");

    let handed = tokio::time::timeout(WAIT, received.recv()).await.expect("the lease reaches the dispatcher's end");
    let handed = handed.expect("the hand-off is open");
    assert_eq!(handed.job.attempt, 1);
    let leases = lease_of(pool, &ep).await;
    assert_eq!(leases.len(), 1);
    assert_eq!(
        (leases[0].1, leases[0].3),
        (handed.job.claim_token, true),
        "the lease handed over is the one committed"
    );
}

/// The transformation [`plain_and_shaped`]'s `shaped` subscription runs.
const SHAPING: &str = "function handler(w) { return w; }";

/// An ingest-only gateway with two sources, each subscribed by one endpoint: `shop`'s
/// plainly (stored by the lean statement), `shaped`'s with a transformation (the full
/// one); and terms that let a leasing statement lease what it creates.
async fn plain_and_shaped() -> (TestApp, webhook_gateway::store::events::ClaimTerms) {
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    app.source_none("shaped").await;
    app.endpoint_for("http://127.0.0.1:9/plain", Some("shop")).await;
    app.endpoint_with("http://127.0.0.1:9/shaped", json!({"source": "shaped", "transform": SHAPING})).await;
    let terms = webhook_gateway::store::events::ClaimTerms {
        limit: 8,
        lease: Duration::from_secs(300),
        default_max_in_flight: 100,
    };
    (app, terms)
}

/// A lease taken by the statement that stores its webhook carries the event as a claim
/// would read it from the database. The statement returns only the delivery's and the
/// endpoint's columns; the event's own (type, source name, content type, body, trace
/// context) come from the webhook in hand. Checked for the lean statement (a source with
/// a plain subscription) and the full one (a source whose subscription transforms, which
/// also reads the transformation and the headers), with a body kept with the lease and
/// one over `INLINE_BODY_BYTES`, which the worker reads when it has room.
#[tokio::test]
async fn a_lease_taken_at_ingest_carries_its_event_as_the_database_holds_it() {
    use webhook_gateway::deliver::bodies::INLINE_BODY_BYTES;
    use webhook_gateway::store::events::{NewEvent, insert_and_claim};
    let (app, terms) = plain_and_shaped().await;
    let pool = &app.db.pool;
    let trace = webhook_gateway::telemetry::EventTrace {
        traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        tracestate: Some("vendor=1".into()),
    };
    let headers = json!({"x-request-id": "r-1"});
    let small = br#"{"order": 1}"#.to_vec();
    let large = format!(r#"{{"pad": "{}"}}"#, "x".repeat(INLINE_BODY_BYTES)).into_bytes();
    for (source, transformed) in [("shop", false), ("shaped", true)] {
        for (body, traced) in [(&small, true), (&large, false)] {
            let key = format!("{source}-{}", body.len());
            let event = NewEvent {
                source_id: source_id(pool, source).await,
                source_name: source,
                indexing: webhook_gateway::search::Indexing::Content,
                dedupe_key: &key,
                event_type: "order.created",
                content_type: Some("application/json; charset=utf-8"),
                headers: &headers,
                payload: body,
                ordering_key: None,
                terms: None,
                trace: traced.then_some(&trace),
            };
            let (stored, fresh) = insert_and_claim(pool, &event, terms).await.expect("stored");
            assert_eq!(fresh.claimed.len(), 1, "{key}: its one delivery leased");
            let job = &fresh.claimed[0];
            type Held = (String, String, Option<String>, Vec<u8>, Option<String>, Option<String>, i32, i64, String);
            let held: Held = sqlx::query_as(
                "SELECT e.event_type, s.name, e.content_type, e.payload, e.traceparent, e.tracestate,
                        d.attempt_count, d.claim_token, ep.url
                 FROM deliveries d JOIN events e ON e.id = d.event_id JOIN sources s ON s.id = e.source_id
                      JOIN endpoints ep ON ep.id = d.endpoint_id
                 WHERE d.id = $1",
            )
            .bind(job.id)
            .fetch_one(pool)
            .await
            .expect("the leased delivery");
            let (event_type, source_name, content_type, payload, traceparent, tracestate, attempt, token, url) = held;
            assert_eq!(job.event_id, stored.event_id, "{key}");
            assert_eq!(
                (job.event_type.as_str(), job.source_name.as_str()),
                (event_type.as_str(), source_name.as_str())
            );
            assert_eq!(job.content_type, content_type, "{key}");
            assert_eq!(job.payload_bytes as usize, payload.len(), "{key}");
            let inline = payload.len() <= INLINE_BODY_BYTES;
            assert_eq!(inline, !std::ptr::eq(body, &large), "{key}: one body of each kind");
            assert_eq!(
                job.payload.as_ref(),
                if inline { payload.as_slice() } else { &[] },
                "{key}: the body as stored"
            );
            assert_eq!((&job.traceparent, &job.tracestate), (&traceparent, &tracestate), "{key}");
            assert_eq!(job.traceparent.is_some(), traced, "{key}");
            assert_eq!((job.attempt, job.claim_token, &job.url), (attempt, token, &url), "{key}");
            assert!(!job.ordered && job.probe_token.is_none(), "{key}");
            assert_eq!(job.transform.as_deref(), transformed.then_some(SHAPING), "{key}");
            let stored_headers =
                job.event_headers.as_deref().map(|h| serde_json::from_str::<serde_json::Value>(h).expect("JSON"));
            assert_eq!(
                stored_headers,
                transformed.then(|| headers.clone()),
                "{key}: the headers with a transformation"
            );
        }
    }
}

/// Copies of one webhook on the leasing path: its statement answers a copy with no row
/// (it no longer looks the stored twin up itself), and the copy is answered from a second
/// lookup. Eight copies racing on their own connections, for a source stored by the lean
/// statement and one stored by the full one: exactly one is new, every answer names its
/// event, one delivery exists and it is leased once; a later copy is a duplicate too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn copies_racing_on_the_leasing_path_store_one_event_and_lease_it_once() {
    use webhook_gateway::store::events::insert_and_claim;
    let (app, terms) = plain_and_shaped().await;
    let pool = &app.db.pool;
    let headers = json!({});
    for source in ["shop", "shaped"] {
        let key = format!("copy-{source}");
        let mut event = shop_event(pool, &key, &headers).await;
        (event.source_id, event.source_name) = (source_id(pool, source).await, source);
        let racing = (0..8).map(|_| insert_and_claim(pool, &event, terms));
        let answers: Vec<_> = futures_util::future::join_all(racing)
            .await
            .into_iter()
            .map(|answer| answer.expect("stored or found"))
            .collect();
        let new: Vec<_> = answers.iter().filter(|(stored, _)| !stored.duplicate).collect();
        assert_eq!(new.len(), 1, "{source}: exactly one copy is new");
        let (original, fresh) = new[0];
        assert_eq!((original.deliveries.len(), fresh.claimed.len()), (1, 1), "{source}: its delivery leased");
        for (stored, fresh) in &answers {
            assert_eq!(stored.event_id, original.event_id, "{source}: every copy names the event");
            if stored.duplicate {
                assert!(stored.deliveries.is_empty() && fresh.claimed.is_empty(), "{source}: a copy leases nothing");
            }
        }
        let (later, fresh) = insert_and_claim(pool, &event, terms).await.expect("a later copy");
        assert!(later.duplicate && later.event_id == original.event_id && fresh.claimed.is_empty(), "{source}");
        let (events, deliveries, leased): (i64, i64, i64) = sqlx::query_as(
            "SELECT count(DISTINCT e.id), count(d.id), count(d.id) FILTER (WHERE d.leased_until IS NOT NULL)
             FROM events e LEFT JOIN deliveries d ON d.event_id = e.id WHERE e.dedupe_key = $1",
        )
        .bind(&key)
        .fetch_one(pool)
        .await
        .expect("counts");
        assert_eq!((events, deliveries, leased), (1, 1, 1), "{source}");
    }
}

/// An endpoint subscribed twice to a source gets one delivery of each webhook, leased
/// once, from the lean leasing statement: its fan-out lists the endpoint once per
/// subscription and leaves the second to `deliveries_once` (`ON CONFLICT DO NOTHING`)
/// instead of sorting the pairs to drop it. The answer names the one delivery, and it
/// took every candidate.
#[tokio::test]
async fn an_endpoint_subscribed_twice_is_delivered_and_leased_once() {
    use webhook_gateway::store::events::insert_and_claim;
    let (app, terms) = plain_and_shaped().await;
    let pool = &app.db.pool;
    let twice = app.endpoint_for("http://127.0.0.1:9/twice", Some("shop")).await;
    let again = json!({"endpoint_id": twice, "source": "shop", "event_types": ["order.*"]});
    app.admin_post("/v1/subscriptions", again, 201).await;
    let headers = json!({});
    let event = shop_event(pool, "twice-1", &headers).await;
    let (stored, fresh) = insert_and_claim(pool, &event, terms).await.expect("stored");
    assert_eq!(stored.deliveries.len(), 2, "the plain endpoint and the one subscribed twice: {stored:?}");
    assert_eq!(fresh.claimed.len(), 2, "each leased");
    assert!(fresh.took_all, "every candidate leased");
    let (deliveries, leased): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE leased_until IS NOT NULL) FROM deliveries
         WHERE event_id = $1 AND endpoint_id = $2::uuid",
    )
    .bind(stored.event_id)
    .bind(&twice)
    .fetch_one(pool)
    .await
    .expect("counts");
    assert_eq!((deliveries, leased), (1, 1), "one delivery to the endpoint subscribed twice, leased once");
}
