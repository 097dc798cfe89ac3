//! A rolling restart of a whole fleet behind a real load balancer costs producers
//! nothing: three replicas behind the distribution's HAProxy (health checks on `/readyz`
//! every 500 ms, two failures to take a server out, no retry on another server), replaced
//! one by one under a steady load. Each stopping replica drains (fails its readiness,
//! keeps serving, closes connections as it answers), then stops accepting and finishes and
//! records its in-flight deliveries.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::haproxy::HaProxy;
use crate::support::sink::Sink;
use crate::support::{GatewayProcess, TestDb, eventually, shop_to_sink, wait_ready};

/// Producers that send each webhook once (no retry) through the balancer until `stop`,
/// recording each answer (0: no answer); returns the acknowledged ids and the failures.
async fn steady_load(
    target: SocketAddr,
    stop: Arc<AtomicBool>,
    producers: usize,
) -> (Vec<String>, HashMap<u16, usize>) {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().expect("client");
    let acked = Arc::new(Mutex::new(Vec::new()));
    let failures = Arc::new(Mutex::new(HashMap::new()));
    let mut tasks = Vec::new();
    for p in 0..producers {
        let (http, stop, acked, failures) = (http.clone(), stop.clone(), acked.clone(), failures.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let id = format!("p{p}-{n}");
                n += 1;
                let answer = http
                    .post(format!("http://{target}/ingest/shop"))
                    .header("x-delivery-id", &id)
                    .header("x-event-type", "order.created")
                    .body("{}")
                    .send()
                    .await;
                match answer.map(|a| a.status().as_u16()) {
                    Ok(200) => acked.lock().unwrap().push(id),
                    Ok(status) => *failures.lock().unwrap().entry(status).or_default() += 1,
                    Err(_) => *failures.lock().unwrap().entry(0).or_default() += 1,
                }
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
        }));
    }
    for task in tasks {
        task.await.expect("producer");
    }
    let acked = acked.lock().unwrap().clone();
    let failures = failures.lock().unwrap().clone();
    (acked, failures)
}

fn replica(addr: SocketAddr, db_url: &str) -> GatewayProcess {
    GatewayProcess::start_at(addr, db_url, &["--shutdown-drain-secs", "2", "--shutdown-grace-secs", "10"], &[])
}

/// Three replicas replaced one by one under about 150 webhooks/s through HAProxy: no
/// error answer, every acknowledged webhook delivered, none delivered twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rolling_restart_behind_a_load_balancer_costs_producers_nothing() {
    let db = TestDb::new().await;
    let sink = Sink::ok().await;
    let addrs: Vec<SocketAddr> =
        (0..3).map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr")).collect();
    let mut replicas: Vec<Option<GatewayProcess>> = addrs.iter().map(|a| Some(replica(*a, &db.url))).collect();
    for addr in &addrs {
        wait_ready(*addr).await;
    }
    shop_to_sink(&format!("http://{}", addrs[0]), &sink).await;
    let balancer = tokio::task::spawn_blocking({
        let addrs = addrs.clone();
        move || HaProxy::start(&addrs, 500, 2, 2)
    })
    .await
    .expect("haproxy");
    // Every server checked up before the load starts.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(steady_load(balancer.addr, stop.clone(), 8));
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (i, addr) in addrs.iter().enumerate() {
        let mut old = replicas[i].take().expect("running");
        let exited = tokio::task::spawn_blocking(move || old.terminate()).await.expect("terminate");
        assert!(exited, "replica {i} exited 0");
        replicas[i] = Some(replica(*addr, &db.url));
        wait_ready(*addr).await;
        // The balancer takes it back after two good checks.
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let (acked, failures) = load.await.expect("load");
    eprintln!("rolling restart: {} webhooks acknowledged, failures {failures:?}", acked.len());
    assert!(acked.len() > 500, "the load ran ({} acknowledged)", acked.len());
    assert!(failures.is_empty(), "producers saw errors during the rolling restart: {failures:?}");

    eventually(Duration::from_secs(60), "every acknowledged webhook delivered", || async {
        let delivered = sink.received().len();
        (delivered >= acked.len()).then_some(())
    })
    .await;
    let mut per_webhook: HashMap<String, usize> = HashMap::new();
    for received in sink.received() {
        *per_webhook.entry(received.header("webhook-id")).or_default() += 1;
    }
    assert_eq!(per_webhook.len(), acked.len(), "one delivery per acknowledged webhook");
    let twice: Vec<_> = per_webhook.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "delivered more than once: {twice:?}");
    drop(balancer);
}
