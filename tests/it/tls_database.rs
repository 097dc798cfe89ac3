//! A database that requires TLS, as managed PostgreSQL offerings do by default (RDS's
//! `rds.force_ssl`, Azure's `require_secure_transport`, Neon): the gateway connects with
//! the URL's `sslmode` (`require`: encrypted; `verify-full` with `sslrootcert`: the
//! server's certificate and name checked too), refuses a server it cannot verify with the
//! reason, and stores and delivers through it.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use webhook_gateway::db;

use crate::support::producer::{Seen, produce};
use crate::support::sink::Sink;
use crate::support::tls_front::TlsFront;
use crate::support::{GatewayProcess, TestDb, eventually, shop_to_sink, wait_ready};

/// The plain server `url` names.
fn server_of(url: &str) -> SocketAddr {
    let url = url::Url::parse(url).expect("a database URL");
    let host = url.host_str().expect("a host");
    format!("{host}:{}", url.port().unwrap_or(5432)).parse().expect("an address")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_connects_to_a_database_that_requires_tls_and_verifies_it_when_asked() {
    let db = TestDb::new().await;
    let front = TlsFront::start(server_of(&db.url)).await;
    let answers = |url: String| async move {
        let pool = db::connect(&url, 1).await?;
        let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&pool).await?;
        pool.close().await;
        anyhow::Ok(one)
    };

    let plain = answers(front.url_for(&db.url, "sslmode=disable")).await.expect_err("a plain connection is refused");
    assert!(front.refused() >= 1, "the front refused it: {plain:#}");

    let before = front.handshakes();
    assert_eq!(answers(front.url_for(&db.url, "sslmode=require")).await.expect("encrypted"), 1);
    assert!(front.handshakes() > before, "over TLS");

    let verified = format!("sslmode=verify-full&sslrootcert={}", front.ca_file.display());
    assert_eq!(answers(front.url_for(&db.url, &verified)).await.expect("verified by its CA"), 1);

    // Without the CA the certificate cannot be verified: refused, and the error says so.
    let unknown = answers(front.url_for(&db.url, "sslmode=verify-full")).await.expect_err("an unknown issuer");
    let said = format!("{unknown:#}");
    assert!(said.contains("cannot connect to PostgreSQL") && said.to_lowercase().contains("certificate"), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_on_a_database_that_requires_tls_stores_and_delivers() {
    let db = TestDb::new().await;
    let front = TlsFront::start(server_of(&db.url)).await;
    let url = front.url_for(&db.url, &format!("sslmode=verify-full&sslrootcert={}", front.ca_file.display()));
    let gateway = GatewayProcess::start(&url, &[]);
    wait_ready(gateway.addr).await;
    let base = format!("http://{}", gateway.addr);
    let sink = Sink::ok().await;
    shop_to_sink(&base, &sink).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let ids: Vec<String> = (0..20).map(|i| format!("tls-{i}")).collect();
    produce(base, "shop", ids, 4, seen.clone()).await;
    assert_eq!(seen.lock().unwrap().acknowledged.len(), 20, "every webhook answered 2xx");
    eventually(Duration::from_secs(30), "every webhook delivered", || async {
        (sink.received().len() >= 20).then_some(())
    })
    .await;
    assert_eq!(db.count("events").await, 20, "stored once each");
    assert!(front.handshakes() >= 1 && front.refused() == 0, "every connection over TLS");
}
