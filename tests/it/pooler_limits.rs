//! Behind a transaction pooler that says no: PgBouncer at its `max_client_conn`, refusing
//! the connections a gateway's pool opens to grow under load (a deploy's surge, or a
//! pool sized above the pooler's limit).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::pgbouncer::PgBouncer;
use crate::support::producer::{Seen, produce};
use crate::support::sink::Sink;
use crate::support::{TestDb, eventually, gateway_with_sink};

/// The pooler's client limit, below the gateway's pool of 8.
const CLIENT_LIMIT: usize = 4;

/// A gateway whose pool (8) is larger than PgBouncer lets it have (4 client connections),
/// under 16 concurrent producers: the connections the pool opens beyond the limit are
/// refused, and each refusal is a connection that never opened, not a database going
/// away. The pool's working connections stay open: PgBouncer sees about as many logins
/// as it allows clients. Before, every refused connect marked the pool's connections
/// stale, so each was closed when given back and opened again, only to be refused again
/// as the pool grew: the logins ran into the hundreds. Every webhook acknowledged is
/// stored and delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_refused_at_the_pooler_s_client_limit_leave_the_working_ones_open() {
    let db = TestDb::new().await;
    let limit = CLIENT_LIMIT.to_string();
    let bouncer = PgBouncer::start_configured(&db.url, 4, &[], "transaction", &[("max_client_conn", limit.as_str())]);
    let sink = Sink::ok().await;
    let pooled = bouncer.url(&db.name(), &db.url);
    let (_gateway, base) =
        gateway_with_sink(&pooled, &["--db-pooler", "transaction", "--db-pool-size", "8"], &sink).await;

    const WEBHOOKS: usize = 400;
    let ids: Vec<String> = (0..WEBHOOKS).map(|i| format!("limit-{i}")).collect();
    let seen = Arc::new(Mutex::new(Seen::default()));
    produce(base, "shop", ids.clone(), 16, seen.clone()).await;
    let seen = seen.lock().expect("seen").acknowledged.clone();
    assert_eq!(seen, ids.iter().cloned().collect::<HashSet<_>>(), "every webhook acknowledged in the end");
    eventually(Duration::from_secs(60), "every webhook delivered", || async {
        (sink.count() >= WEBHOOKS).then_some(())
    })
    .await;

    let log = bouncer.log_text();
    let refused = log.lines().filter(|l| l.contains("no more connections allowed")).count();
    let logins = log.lines().filter(|l| l.contains("login attempt")).count();
    eprintln!("pgbouncer: {logins} logins, {refused} connections refused at max_client_conn = {CLIENT_LIMIT}");
    assert!(refused > 0, "the pool reached the pooler's limit (else this test proves nothing)");
    assert!(
        logins <= 3 * CLIENT_LIMIT,
        "{logins} logins for {CLIENT_LIMIT} client connections: working connections were closed and opened again"
    );
    let keys: HashSet<String> = sink.received().iter().map(|r| r.header("idempotency-key")).collect();
    assert_eq!((sink.count(), keys.len()), (WEBHOOKS, WEBHOOKS), "each webhook delivered once");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM events").fetch_one(&db.pool).await.expect("count");
    assert_eq!(stored, WEBHOOKS as i64, "each webhook stored once");
}
