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

/// Five replicas (each its own pool) ask every 50 ms for 1.5 s whether they lead a job
/// with 600 ms leases: at every round exactly one leads, always the same one, and it is
/// renewed, not re-taken (its token stays). When it stops asking (a dead replica),
/// another leads within the lease's time to live and a follower's next look.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_replica_leads_a_job_and_another_takes_over_when_it_dies() {
    use webhook_gateway::lease::Leadership;
    let db = TestDb::new().await;
    let ttl = Duration::from_millis(600);
    let mut replicas = Vec::new();
    for i in 0..5 {
        let pool = db::connect(&db.url, 1).await.unwrap();
        replicas.push((pool, Leadership::new("job", format!("replica-{i}"), ttl)));
    }
    let mut leader = None;
    for round in 0..30 {
        let mut leading = Vec::new();
        for (i, (pool, leadership)) in replicas.iter_mut().enumerate() {
            if leadership.leads(pool).await {
                leading.push(i);
            }
        }
        assert_eq!(leading.len(), 1, "round {round}: exactly one leader, got {leading:?}");
        assert!(leader.is_none_or(|l| l == leading[0]), "round {round}: the leader changed");
        leader = Some(leading[0]);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let first = leader.expect("a leader");
    let token: i64 =
        sqlx::query_scalar("SELECT token FROM leases WHERE name = 'job'").fetch_one(&db.pool).await.unwrap();
    assert_eq!(token, 1, "renewed, never re-taken");

    // The leader dies: the others go on asking.
    let died = tokio::time::Instant::now();
    let taken_over = loop {
        let mut leading = Vec::new();
        for (i, (pool, leadership)) in replicas.iter_mut().enumerate() {
            if i != first && leadership.leads(pool).await {
                leading.push(i);
            }
        }
        assert!(leading.len() <= 1, "never two leaders: {leading:?}");
        if leading.len() == 1 {
            break died.elapsed();
        }
        assert!(died.elapsed() < Duration::from_secs(5), "nobody took over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("leader died; another led {taken_over:?} later (lease 600 ms)");
    assert!(taken_over <= ttl + Duration::from_millis(600), "took over in {taken_over:?}");
}
