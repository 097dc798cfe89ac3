//! The outcome write leases its lines' next heads (`queue::lines::promote_leasing`,
//! `deliver::recorder::write_leasing`): within the slots it holds and each endpoint's
//! room, with a fresh fencing token, never waiting for an endpoint row held elsewhere,
//! and in a real process every ordered webhook is still delivered in order, each leased
//! once.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;
use webhook_gateway::circuit::{CircuitConfig, Signal};
use webhook_gateway::deliver::recorder::{self, Finished, Patience, Promoted};
use webhook_gateway::ids::DeliveryId;
use webhook_gateway::queue::{self, ClaimTerms, Claimed, Outcome};

use crate::support::sink::Sink;
use crate::support::{GatewayProcess, TestApp, TestDb, eventually, wait_ready};

const LEASE: Duration = Duration::from_secs(60);

fn terms(limit: i64) -> ClaimTerms {
    ClaimTerms { limit, lease: LEASE, default_max_in_flight: 8 }
}

fn delivered(claims: &[&Claimed]) -> Vec<Finished> {
    claims
        .iter()
        .map(|c| Finished {
            record: crate::support::attempt_record(c, Outcome::Delivered),
            signal: Signal::Healthy,
            probe_token: None,
            span: tracing::Span::none(),
        })
        .collect()
}

/// A delivery's lease columns and line state: (claim token, attempt count, leased, waiting,
/// head of its line).
async fn state(db: &TestDb, id: DeliveryId) -> (i64, i32, bool, bool, bool) {
    sqlx::query_as(
        "SELECT d.claim_token, d.attempt_count, COALESCE(d.leased_until > now(), false), d.waiting,
                EXISTS (SELECT 1 FROM order_lines l WHERE l.head_id = d.id)
         FROM deliveries d WHERE d.id = $1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .expect("delivery")
}

/// The next heads go to the write's slots and no further, then to the endpoint's room and
/// no further; each lease is a claim's (a new token, its attempt counted, the event's body
/// and the endpoint's URL for the worker), and a head left unleased is handed over by id,
/// claimable. Control: without terms nothing is leased (every new head by id).
#[tokio::test]
async fn the_write_leases_its_lines_next_heads_within_its_slots_and_the_endpoint_s_room() {
    let db = TestDb::new().await;
    let pool = &db.pool;
    let patience = Patience::of(LEASE);
    let cfg = CircuitConfig::default();
    let endpoint = crate::support::insert_endpoint(pool, "http://127.0.0.1:9/").await;
    crate::support::seed_ordered_lines(pool, &endpoint, 5).await;
    let heads = queue::claim(pool, 10, LEASE).await.expect("claim");
    assert_eq!(heads.len(), 5, "one head per line");

    // Three heads delivered, two slots: two next heads leased, the third by id.
    let (promoted, leased) =
        recorder::write_leasing(pool, &delivered(&[&heads[0], &heads[1], &heads[2]]), &cfg, &patience, Some(terms(2)))
            .await;
    let Promoted::Known(by_id) = promoted else { panic!("a whole batch written: {promoted:?}") };
    assert_eq!((leased.len(), by_id.len()), (2, 1), "{leased:?} {by_id:?}");
    for job in &leased {
        let (token, attempts, live, waiting, head) = state(&db, job.id).await;
        assert_eq!((token, attempts), (job.claim_token, 1), "the lease is the row's");
        assert!(token > 0, "a fresh fencing token");
        assert!(live && !waiting && head, "leased, out of the wait, its line's head");
        assert_eq!((job.attempt, job.ordered), (1, true));
        assert_eq!(job.url, "http://127.0.0.1:9/");
        assert_eq!(&job.payload[..], b"{}", "the event's body, for the worker");
    }
    let (_, attempts, live, waiting, head) = state(&db, by_id[0]).await;
    assert_eq!(attempts, 0);
    assert!(!live && !waiting && head, "handed over unleased: claimable, its line's head");
    let fresh = queue::claim_fresh(pool, &by_id, 10, LEASE, 8).await.expect("claim by key");
    assert_eq!(fresh.claimed.iter().map(|c| c.id).collect::<Vec<_>>(), by_id);

    // Room for one more: after this write, three are in flight (two first heads and the
    // one claimed by key) against a limit of four. Of the next heads of two lines, one is
    // leased.
    crate::support::set_endpoint(pool, &endpoint, "max_in_flight = 4").await;
    let (promoted, leased_again) =
        recorder::write_leasing(pool, &delivered(&[&leased[0], &leased[1]]), &cfg, &patience, Some(terms(2))).await;
    let Promoted::Known(by_id) = promoted else { panic!("{promoted:?}") };
    assert_eq!((leased_again.len(), by_id.len()), (1, 1), "the endpoint's room, not the slots: {by_id:?}");

    // Without terms: every new head by id.
    let (promoted, none) =
        recorder::write_leasing(pool, &delivered(&[&heads[3], &fresh.claimed[0]]), &cfg, &patience, None).await;
    assert!(none.is_empty());
    assert_eq!(promoted_ids(&promoted).len(), 2, "both lines moved on, by id");
}

fn promoted_ids(promoted: &Promoted) -> Vec<DeliveryId> {
    match promoted {
        Promoted::Known(ids) => ids.clone(),
        Promoted::Unknown => panic!("not known"),
    }
}

/// An endpoint whose row another transaction holds (a claim in progress) gets no lease
/// and does not hold the write: it commits while the row is still held (its sessions give
/// up any lock wait after a second, so a write that waited would fail), and the new head
/// is handed over by id. Once the row is free, the next write leases.
#[tokio::test]
async fn a_write_does_not_wait_for_an_endpoint_row_held_elsewhere() {
    let db = TestDb::new().await;
    let patience = Patience::of(LEASE);
    let cfg = CircuitConfig::default();
    let endpoint = crate::support::insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    crate::support::seed_ordered_lines(&db.pool, &endpoint, 2).await;
    let pool = crate::prelease_locked::pool_that_never_waits_for_locks(&db).await;
    let heads = queue::claim(&pool, 10, LEASE).await.expect("claim");
    assert_eq!(heads.len(), 2);

    let holder = crate::prelease_locked::hold_as_a_claim(&db.pool, &[&endpoint]).await;
    let (promoted, leased) =
        recorder::write_leasing(&pool, &delivered(&[&heads[0]]), &cfg, &patience, Some(terms(4))).await;
    assert!(leased.is_empty(), "nothing leased for a held endpoint: {leased:?}");
    assert_eq!(promoted_ids(&promoted).len(), 1, "the new head handed over by id");
    holder.commit().await.expect("let the endpoint go");

    let (promoted, leased) =
        recorder::write_leasing(&pool, &delivered(&[&heads[1]]), &cfg, &patience, Some(terms(4))).await;
    assert_eq!((leased.len(), promoted_ids(&promoted).len()), (1, 0), "free again: leased");
}

/// Post `per_key` webhooks on each of `keys` lines (`k0`, `k1`, ...) to the `ord` source of
/// `ordering::ordered_setup`, the lines side by side.
async fn post_lines(app: &TestApp, keys: u32, per_key: u32) {
    let posts = (0..keys).map(|k| async move {
        for i in 0..per_key {
            crate::ordering::ingest(app, &format!("k{k}"), i).await;
        }
    });
    futures_util::future::join_all(posts).await;
}

/// Wait until `sink` has every webhook of [`post_lines`]' lines, and check that each line
/// arrived in order, each webhook once.
async fn every_line_in_order(sink: &Sink, keys: u32, per_key: u32) {
    let total = (keys * per_key) as usize;
    let received = eventually(Duration::from_secs(120), "every webhook delivered", || async {
        let got = sink.received();
        (got.len() >= total).then_some(got)
    })
    .await;
    for k in 0..keys {
        let key = format!("k{k}");
        let order: Vec<u64> = received
            .iter()
            .map(|r| serde_json::from_slice::<serde_json::Value>(&r.body).expect("json"))
            .filter(|b| b["key"] == json!(key))
            .map(|b| b["i"].as_u64().expect("i"))
            .collect();
        assert_eq!(order, (0..u64::from(per_key)).collect::<Vec<_>>(), "line {key} in order, each once");
    }
}

/// What took the leases of `workers`, summed over them, once they add up to `total`
/// (the last outcome's write may still be on its way to the counter): by label.
async fn leases_of(app: &TestApp, workers: &[&GatewayProcess], total: usize) -> HashMap<&'static str, f64> {
    const BY: [&str; 5] = ["ingest", "claim_by_key", "claim", "probe", "promotion"];
    eventually(Duration::from_secs(30), "every lease counted", || async {
        let mut by: HashMap<&'static str, f64> = HashMap::new();
        for worker in workers {
            let url = format!("http://{}/metrics", worker.addr);
            let metrics = app.http.get(url).send().await.ok()?.text().await.ok()?;
            for label in BY {
                let name = format!(r#"webhook_gateway_leases_total{{by="{label}"}}"#);
                let value = metrics
                    .lines()
                    .find_map(|l| l.strip_prefix(&name))
                    .map_or(0.0, |v| v.trim().parse::<f64>().expect("a counter's value"));
                *by.entry(label).or_default() += value;
            }
        }
        (by.values().sum::<f64>() >= total as f64).then_some(by)
    })
    .await
}

/// A worker process: [`KEYS`] lines of [`PER_KEY`] webhooks each, posted at once (by
/// another process's ingest), arrive in order, every one once; the next heads of the
/// lines were leased by the recorder's writes (`leases_total{by="promotion"}`), and the
/// leases add up to the attempts (none twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_lines_move_on_by_the_leases_of_the_outcome_writes() {
    const KEYS: u32 = 4;
    const PER_KEY: u32 = 25;
    let app = TestApp::ingest_only().await;
    let sink = Sink::ok().await;
    crate::ordering::ordered_setup(&app, &sink, "block").await;
    post_lines(&app, KEYS, PER_KEY).await;
    let worker = GatewayProcess::start(&app.db.url, &["--role", "worker"]);
    wait_ready(worker.addr).await;
    every_line_in_order(&sink, KEYS, PER_KEY).await;
    let total = (KEYS * PER_KEY) as usize;
    let by = leases_of(&app, &[&worker], total).await;
    assert_eq!(by.values().sum::<f64>(), total as f64, "one lease a delivery: {by:?}");
    assert!(by["promotion"] > 0.0, "no next head leased by a write: {by:?}");
}

/// A write that leases next heads and a general claim race on one endpoint that allows 2
/// leases in flight, each on its own connection, 40 rounds: each round one lease ends
/// (its outcome written by the racing write) while the claim looks for due work (other
/// lines wait with a head due). The room freed goes to one side or the other, never to
/// both: the endpoint never has more than 2 live leases, and what each side says it leased
/// is exactly what is live (no lease lost, none taken twice). (A write only ever wants the
/// room its own outcomes free, so a write that ignored the room would pass this race too:
/// the room itself is held to in the first test, against leases taken elsewhere.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_leasing_and_a_claim_racing_keep_the_endpoint_s_limit() {
    const LIMIT: i64 = 2;
    let db = TestDb::new().await;
    let patience = Patience::of(LEASE);
    let cfg = CircuitConfig::default();
    let endpoint = crate::support::insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;
    crate::support::set_endpoint(&db.pool, &endpoint, &format!("max_in_flight = {LIMIT}")).await;
    // Sixteen lines of three; rounds beyond what they hold end when nothing is in flight.
    crate::support::seed_ordered_lines(&db.pool, &endpoint, 16).await;
    let writer = webhook_gateway::db::connect(&db.url, 2).await.expect("the writer's pool");
    let claimer = webhook_gateway::db::connect(&db.url, 2).await.expect("the claimer's pool");
    let mut in_flight = queue::claim(&claimer, 8, LEASE).await.expect("claim");
    assert_eq!(in_flight.len() as i64, LIMIT, "the limit");
    let (mut by_write, mut by_claim) = (0, 0);
    for round in 0..40 {
        let Some(done) = in_flight.pop() else { break };
        let finished = delivered(&[&done]);
        // Every other round the claim starts a moment later, so that each side is ahead in
        // some rounds: first to the endpoint's row, the claim makes the write skip it.
        let stagger = Duration::from_millis(2 * (round % 2));
        let (written, claimed) =
            tokio::join!(recorder::write_leasing(&writer, &finished, &cfg, &patience, Some(terms(4))), async {
                tokio::time::sleep(stagger).await;
                queue::claim(&claimer, 4, LEASE).await
            },);
        let (_, leased) = written;
        let claimed = claimed.expect("claim");
        (by_write, by_claim) = (by_write + leased.len(), by_claim + claimed.len());
        in_flight.extend(leased);
        in_flight.extend(claimed);
        let live: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT id FROM deliveries WHERE endpoint_id = $1::uuid AND status = 'pending' AND leased_until > now()
             ORDER BY id",
        )
        .bind(&endpoint)
        .fetch_all(&db.pool)
        .await
        .expect("live leases");
        assert!(live.len() as i64 <= LIMIT, "round {round}: {} live leases, the limit {LIMIT}", live.len());
        let mut ours: Vec<uuid::Uuid> = in_flight.iter().map(|c| c.id.0).collect();
        ours.sort();
        assert_eq!(ours, live, "round {round}: the leases each side reported are the live ones");
    }
    eprintln!("leased by the write {by_write}, by the claim {by_claim}");
    assert!(by_write > 0 && by_claim > 0, "one side never leased ({by_write} and {by_claim}): the race was not run");
}
