//! The operator's second chances racing each other and a delete: a redelivery, an
//! unblock, a recovery and an endpoint's deletion, each waiting on a lock another holds,
//! must end as if they had run one after the other: a line never lets its next delivery
//! go before its head, no two of them deadlock, and no delivery is left pending to a
//! deleted endpoint.

use std::time::Duration;

use serde_json::json;
use uuid::Uuid;

use crate::support::{TestApp, seed_deliveries};

/// A paused endpoint's ordered line `k` of three deliveries: the first dead, blocking it
/// (its head), the other two waiting. The endpoint and the three ids.
async fn blocked_line(app: &TestApp) -> (String, [Uuid; 3]) {
    let endpoint = app.endpoint_for("http://127.0.0.1:9/line", Some("api")).await;
    app.admin_post(&format!("/v1/endpoints/{endpoint}/pause"), json!({}), 200).await;
    seed_deliveries(&app.db.pool, &endpoint, 3).await;
    let ids: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM deliveries WHERE endpoint_id = $1::uuid ORDER BY id")
        .bind(&endpoint)
        .fetch_all(&app.db.pool)
        .await
        .expect("ids");
    sqlx::query(
        "UPDATE deliveries SET ordering_key = 'k', line_seq = nextval('deliveries_line_seq'),
                waiting = id <> $1, parked = false,
                status = CASE WHEN id = $1 THEN 'dead' ELSE 'pending' END,
                dead_reason = CASE WHEN id = $1 THEN 'test' END,
                finished_at = CASE WHEN id = $1 THEN now() END, attempt_count = CASE WHEN id = $1 THEN 1 ELSE 0 END
         WHERE id = ANY($2)",
    )
    .bind(ids[0])
    .bind(&ids)
    .execute(&app.db.pool)
    .await
    .expect("a blocked line");
    sqlx::query("INSERT INTO order_lines (endpoint_id, ordering_key, head_id) VALUES ($1::uuid, 'k', $2)")
        .bind(&endpoint)
        .bind(ids[0])
        .execute(&app.db.pool)
        .await
        .expect("its line");
    (endpoint, [ids[0], ids[1], ids[2]])
}

/// A transaction holding `sql`'s rows (a lock taken `FOR UPDATE`).
async fn hold(app: &TestApp, sql: &str) -> webhook_gateway::db::Tx {
    let mut holder = app.db.pool.begin().await.expect("begin");
    sqlx::query(sql).execute(&mut *holder).await.expect("hold");
    holder
}

/// `first` and then `second` (method, path, body), each sent once the one before waits
/// on the rows `lock` (a `FOR UPDATE`) holds; then the lock is let go: their statuses.
async fn queued_on(app: &TestApp, lock: &str, first: Request, second: Request) -> (u16, u16) {
    let holder = hold(app, lock).await;
    let first = call(app, first.0, first.1, first.2);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = call(app, second.0, second.1, second.2);
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.rollback().await.expect("let the rows go");
    (first.await.expect("first call"), second.await.expect("second call"))
}

/// A call of the admin API: method, path and body.
type Request = (reqwest::Method, String, Option<serde_json::Value>);

/// `method path` with the admin token, in a task: its status.
fn call(
    app: &TestApp,
    method: reqwest::Method,
    path: String,
    body: Option<serde_json::Value>,
) -> tokio::task::JoinHandle<u16> {
    let request = app.http.request(method, app.url(&path)).bearer_auth(crate::support::ADMIN_TOKEN);
    let request = if let Some(body) = body { request.json(&body) } else { request };
    tokio::spawn(async move { request.send().await.map(|r| r.status().as_u16()).unwrap_or(0) })
}

/// Whether each of `ids` waits for its line.
async fn waiting(app: &TestApp, ids: &[Uuid]) -> Vec<bool> {
    let mut out = Vec::new();
    for id in ids {
        let w: bool = sqlx::query_scalar("SELECT waiting FROM deliveries WHERE id = $1")
            .bind(id)
            .fetch_one(&app.db.pool)
            .await
            .expect("waiting");
        out.push(w);
    }
    out
}

/// A redelivery of a line's dead head and an unblock of it, queued on the line in that
/// order: the unblock finds the head pending again and lets nothing go (409). Before, it
/// read the head dead in the statement that waited, cleared the line and promoted the
/// next delivery while the redelivered head was on its way: out of order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unblock_queued_behind_a_redelivery_lets_nothing_go_before_the_head() {
    let app = TestApp::spawn().await;
    let (_, [head, second, third]) = blocked_line(&app).await;
    let (redelivered, unblocked) = queued_on(
        &app,
        "SELECT 1 FROM order_lines WHERE ordering_key = 'k' FOR UPDATE",
        (reqwest::Method::POST, format!("/v1/deliveries/{head}/redeliver"), None),
        (reqwest::Method::POST, format!("/v1/deliveries/{head}/unblock"), None),
    )
    .await;
    assert_eq!(redelivered, 200);
    assert_eq!(unblocked, 409, "the head is no longer dead");
    assert_eq!(waiting(&app, &[head, second, third]).await, [false, true, true], "the head goes first");
}

/// A redelivery and a recovery of one line's dead head, the redelivery first on the line:
/// both end (before, the recovery locked the delivery and then waited for the line, the
/// redelivery held the line and waited for the delivery: a deadlock, answered 503
/// "database unreachable"), and the head is pending once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_recovery_and_a_redelivery_of_one_delivery_do_not_deadlock() {
    let app = TestApp::spawn().await;
    let (endpoint, [head, second, third]) = blocked_line(&app).await;
    let since = (chrono::Utc::now() - chrono::Duration::minutes(10)).to_rfc3339();
    let (redelivered, recovered) = queued_on(
        &app,
        "SELECT 1 FROM order_lines WHERE ordering_key = 'k' FOR UPDATE",
        (reqwest::Method::POST, format!("/v1/deliveries/{head}/redeliver"), None),
        (reqwest::Method::POST, format!("/v1/endpoints/{endpoint}/recover"), Some(json!({"since": since}))),
    )
    .await;
    assert_eq!(redelivered, 200);
    assert_eq!(recovered, 200);
    assert_eq!(waiting(&app, &[head, second, third]).await, [false, true, true]);
}

/// A redelivery waiting on its delivery's row while its endpoint is deleted with `force`:
/// nothing is left pending to the deleted endpoint (before, the revival read the
/// endpoint live before the delete and committed after it: a pending delivery never sent
/// and never buried).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redelivery_racing_its_endpoint_s_deletion_leaves_nothing_pending() {
    let app = TestApp::spawn().await;
    let (endpoint, [head, ..]) = blocked_line(&app).await;
    let (_, deleted) = queued_on(
        &app,
        &format!("SELECT 1 FROM deliveries WHERE id = '{head}' FOR UPDATE"),
        (reqwest::Method::POST, format!("/v1/deliveries/{head}/redeliver"), None),
        (reqwest::Method::DELETE, format!("/v1/endpoints/{endpoint}?force=true"), None),
    )
    .await;
    assert_eq!(deleted, 200);
    let pending: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE endpoint_id = $1::uuid AND status = 'pending'")
            .bind(&endpoint)
            .fetch_one(&app.db.pool)
            .await
            .expect("count");
    assert_eq!(pending, 0, "nothing pending to a deleted endpoint");
}
