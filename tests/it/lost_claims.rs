//! A claim the database loses after its worker was told: what a failover to an
//! asynchronous standby does to the last commits the standby had not received. Played
//! for real on a private cluster at full durability: the lost claims are made by
//! sessions that commit asynchronously, with the cluster's WAL writer stopped, so their
//! commits stay in PostgreSQL's memory; then the WAL writer is killed, which is a crash
//! (the postmaster ends every backend and replays the WAL on disk). The gateway's general
//! claims commit durably and survive the same crash; its claims by key commit without
//! waiting for the flush (migration 0034), so the crash loses one unless a durable commit
//! (an outcome, a webhook stored) wrote the WAL out after it.

use std::time::Duration;

use sqlx::{Connection, PgConnection};
use webhook_gateway::db::embedded::{Cluster, ClusterOptions};
use webhook_gateway::db::{self, Pool};
use webhook_gateway::ids::DeliveryId;
use webhook_gateway::queue::{self, Claimed, Outcome};

use crate::support::{attempt_record, delivery_ids, eventually, insert_endpoint, record_committed, seed_deliveries};

const LEASE: Duration = Duration::from_secs(60);

/// A private cluster at PostgreSQL's default commit durability. `fsync` is off: the test
/// crashes processes, not the machine, so what reached the kernel survives either way;
/// what matters is what was never written out of PostgreSQL's WAL buffers. Nothing but a
/// durable commit writes WAL out: no background writer rounds (a dirty page written out
/// flushes the WAL before it), no autovacuum, and the WAL writer stopped by the test.
fn crash_cluster() -> Cluster {
    let settings =
        [("fsync", "off"), ("autovacuum", "off"), ("bgwriter_lru_maxpages", "0"), ("wal_writer_delay", "10s")];
    let options = ClusterOptions {
        settings: settings.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        ..crate::support::throwaway_options()
    };
    Cluster::start(&options).expect("start a private cluster")
}

/// The WAL writer's pid.
async fn wal_writer(pool: &Pool) -> i32 {
    sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'")
        .fetch_one(pool)
        .await
        .expect("the WAL writer")
}

fn signal(pid: i32, signal: libc::c_int) {
    // SAFETY: kill(2) on a process of the cluster this test started.
    let done = unsafe { libc::kill(pid, signal) };
    assert_eq!(done, 0, "kill({pid}, {signal})");
}

/// (claim token, attempts counted, leased) of a delivery, as the database has it.
async fn lease_of(conn: &mut PgConnection, id: DeliveryId) -> (i64, i32, bool) {
    sqlx::query_as("SELECT claim_token, attempt_count, leased_until IS NOT NULL FROM deliveries WHERE id = $1")
        .bind(id)
        .fetch_one(conn)
        .await
        .expect("the delivery")
}

/// Record `claim`'s attempt as delivered, committed: what it wrote (fresh, or nothing).
async fn record_delivered(pool: &Pool, claim: &Claimed) -> Vec<DeliveryId> {
    let recorded = record_committed(pool, &[attempt_record(claim, Outcome::Delivered)]).await.expect("record");
    assert!(recorded.already.is_empty(), "{recorded:?}");
    recorded.fresh
}

/// Four deliveries. One is claimed (by key) the gateway's way and its outcome recorded;
/// one more is claimed by key the gateway's way, on a durable session, with nothing
/// durable after it; two more are claimed by a session whose commits the crash will lose
/// (general, a half-open circuit's probe); then the database crashes before anything
/// writes its WAL out.
///
/// - The first survives whole: the outcome's durable commit wrote out the WAL before it,
///   the claim's included.
/// - The second claim by key is lost: it commits asynchronously by itself (control: the
///   function of the release before, `wg_claim_fresh_v2`, commits durably, and its claim
///   survives the crash).
/// - The lost claims left their rows as before (token 0, no attempt counted, no lease):
///   due again, the probe admitted again.
/// - Claimed again, each gets a token the lost claim did not hold, so the lost claims'
///   workers, still sending, record nothing, and the new holders record their outcomes.
///   (With tokens stepping by one, the new tokens were the lost ones, and the lost
///   claims' workers recorded over the new leases.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_lost_with_the_database_is_fenced_and_its_delivery_claimed_again() {
    let mut cluster = tokio::task::spawn_blocking(crash_cluster).await.expect("cluster");
    let mut admin = PgConnection::connect(&cluster.url("postgres")).await.expect("connect");
    sqlx::query("CREATE DATABASE gw").execute(&mut admin).await.expect("create database");
    let url = cluster.url("gw");
    let pool = db::connect(&url, 2).await.expect("pool");
    db::migrate(&pool).await.expect("migrate");
    let endpoint = insert_endpoint(&pool, "http://127.0.0.1:9/").await;
    seed_deliveries(&pool, &endpoint, 3).await;
    let ids = delivery_ids(&pool, &endpoint).await;
    let (kept, by_key, by_general) = (ids[0], ids[1], ids[2]);
    // A fourth, parked behind an open circuit whose cool-down is over: its probe's claim.
    let broken = insert_endpoint(&pool, "http://127.0.0.1:9/broken").await;
    seed_deliveries(&pool, &broken, 1).await;
    let probed = delivery_ids(&pool, &broken).await[0];
    sqlx::query(
        "UPDATE endpoints SET circuit_state = 'open', open_count = 1, opened_at = now() - interval '1 minute',
                              reopen_at = now() - interval '1 second'
         WHERE id = $1::uuid",
    )
    .bind(&broken)
    .execute(&pool)
    .await
    .expect("open the circuit");
    sqlx::query("UPDATE deliveries SET parked = true WHERE id = $1").bind(probed).execute(&pool).await.expect("park");
    // One session whose commits the crash can lose: named in its URL, the operator's
    // explicit choice, which the gateway keeps (a database-wide `off` it overrides:
    // `server_settings`).
    let losing = db::connect(&format!("{url}?options=-c%20synchronous_commit%3Doff"), 1).await.expect("pool");
    assert_eq!(sync_commit(&losing).await, "off");
    assert_eq!(sync_commit(&pool).await, "on");

    let writer = wal_writer(&pool).await;
    signal(writer, libc::SIGSTOP);

    let claimed = queue::claim_fresh(&pool, &[kept], 10, LEASE, 10).await.expect("claim by key").claimed;
    assert_eq!(claimed.len(), 1);
    assert_eq!(record_delivered(&pool, &claimed[0]).await, [kept], "the first outcome is written");

    // On the durable session: the claim by key's own transaction is asynchronous.
    let lost_by_key = queue::claim_fresh(&pool, &[by_key], 10, LEASE, 10).await.expect("claim by key").claimed;
    assert_eq!(lost_by_key.len(), 1);
    let lost_general = queue::claim(&losing, 10, LEASE).await.expect("general claim");
    assert_eq!(lost_general.iter().map(|c| c.id).collect::<Vec<_>>(), [by_general], "the only due row");
    let lost_probe = queue::claim_probes(&losing, 10, LEASE).await.expect("probe claim");
    assert_eq!(lost_probe.iter().map(|c| c.id).collect::<Vec<_>>(), [probed], "the half-open endpoint's probe");

    // The crash: the postmaster sees its WAL writer killed and restarts every process.
    signal(writer, libc::SIGKILL);
    pool.close().await;
    losing.close().await;
    let mut conn = eventually(Duration::from_secs(60), "the cluster back after crash recovery", || async {
        let mut conn = PgConnection::connect(&url).await.ok()?;
        sqlx::query("SELECT 1").execute(&mut conn).await.ok()?;
        Some(conn)
    })
    .await;
    let pool = db::connect(&url, 2).await.expect("pool after the crash");
    assert_ne!(wal_writer(&pool).await, writer, "the cluster went through a crash restart");

    let status: String = sqlx::query_scalar("SELECT status FROM deliveries WHERE id = $1")
        .bind(kept)
        .fetch_one(&mut conn)
        .await
        .expect("status");
    assert_eq!(status, "delivered", "a claim and its outcome are durable");
    for (id, lost) in [(by_key, &lost_by_key[0]), (by_general, &lost_general[0]), (probed, &lost_probe[0])] {
        assert!(lost.claim_token > 0 && lost.attempt == 1, "{lost:?}");
        assert_eq!(lease_of(&mut conn, id).await, (0, 0, false), "the crash lost the claim of {id:?}");
    }

    let again_by_key = queue::claim_fresh(&pool, &[by_key], 10, LEASE, 10).await.expect("claim by key").claimed;
    let again_general = queue::claim(&pool, 10, LEASE).await.expect("general claim");
    let again_probe = queue::claim_probes(&pool, 10, LEASE).await.expect("probe claim");
    assert_eq!(again_by_key.iter().map(|c| c.id).collect::<Vec<_>>(), [by_key]);
    assert_eq!(again_general.iter().map(|c| c.id).collect::<Vec<_>>(), [by_general]);
    assert_eq!(again_probe.iter().map(|c| c.id).collect::<Vec<_>>(), [probed], "one probe again");
    // The probe's own token (`probe_token`, on the endpoint) steps by one and comes back
    // equal; the circuit only hears of outcomes the claim token let through
    // (deliver::recorder), so the lost prober cannot close or reopen it.
    assert_eq!(again_probe[0].probe_token, lost_probe[0].probe_token, "the probe token repeats");
    let pairs =
        [(&lost_by_key[0], &again_by_key[0]), (&lost_general[0], &again_general[0]), (&lost_probe[0], &again_probe[0])];
    for (lost, again) in pairs {
        assert_eq!(again.attempt, 1, "the lost claim's attempt is counted again");
        assert_ne!(again.claim_token, lost.claim_token, "a new lease never takes a lost claim's token");
        assert!(record_delivered(&pool, lost).await.is_empty(), "the lost claim's worker is fenced");
        assert_eq!(record_delivered(&pool, again).await, [again.id], "the new holder records");
    }
    cluster.stop();
}

/// `synchronous_commit` as `pool`'s sessions have it.
async fn sync_commit(pool: &Pool) -> String {
    sqlx::query_scalar("SELECT current_setting('synchronous_commit')").fetch_one(pool).await.expect("setting")
}
