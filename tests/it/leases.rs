//! Leader leases (`lease`): one holder at a time across separate pools racing for real,
//! and a holder that stalled past its expiry fenced off once another took over.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Barrier;
use webhook_gateway::db;
use webhook_gateway::lease;

use crate::support::TestDb;

/// Eight instances, each on its own pool (its own connections), released together by a
/// barrier, five rounds: exactly one takes the lease each round, and the others are told
/// it is taken (none waits it out, none errors).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_instances_take_a_lease_exactly_once() {
    let db = TestDb::new().await;
    let mut pools = Vec::new();
    for _ in 0..8 {
        pools.push(db::connect(&db.url, 1).await.unwrap());
    }
    for round in 0..5 {
        let name: &'static str = Box::leak(format!("race-{round}").into_boxed_str());
        let barrier = Arc::new(Barrier::new(pools.len()));
        let racers: Vec<_> = pools
            .iter()
            .enumerate()
            .map(|(i, pool)| {
                let (pool, barrier) = (pool.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    lease::acquire(&pool, name, &format!("instance-{i}"), Duration::from_secs(30)).await.unwrap()
                })
            })
            .collect();
        let mut holders = 0;
        for racer in racers {
            holders += usize::from(racer.await.unwrap().is_some());
        }
        assert_eq!(holders, 1, "round {round}: exactly one holder");
    }
}

/// A holds the lease and stalls past its expiry; B takes it over. From then on A's
/// `hold` fails (its transaction must not commit its work), B's succeeds, and A's
/// late release does not free B's lease.
#[tokio::test]
async fn a_stalled_holder_is_fenced_once_its_lease_is_taken_over() {
    let db = TestDb::new().await;
    let ttl = Duration::from_millis(300);
    let a = lease::acquire(&db.pool, "job", "a", ttl).await.unwrap().expect("a takes the free lease");
    assert!(lease::acquire(&db.pool, "job", "b", ttl).await.unwrap().is_none(), "taken while a holds it");
    let mut tx = db.pool.begin().await.unwrap();
    assert!(a.hold(&mut tx).await.unwrap(), "a still holds it and renews it");
    tx.commit().await.unwrap();

    tokio::time::sleep(ttl + Duration::from_millis(200)).await;
    let b = lease::acquire(&db.pool, "job", "b", Duration::from_secs(30)).await.unwrap().expect("expired: b takes it");
    assert!(b.token() > a.token());
    let mut tx = db.pool.begin().await.unwrap();
    assert!(!a.hold(&mut tx).await.unwrap(), "a was taken over: fenced");
    tx.rollback().await.unwrap();
    a.release(&db.pool).await.unwrap();
    assert!(lease::acquire(&db.pool, "job", "c", ttl).await.unwrap().is_none(), "a's late release left b's lease");
    let mut tx = db.pool.begin().await.unwrap();
    assert!(b.hold(&mut tx).await.unwrap());
    tx.commit().await.unwrap();
    b.release(&db.pool).await.unwrap();
    assert!(lease::acquire(&db.pool, "job", "c", ttl).await.unwrap().is_some(), "released: free again");
}
