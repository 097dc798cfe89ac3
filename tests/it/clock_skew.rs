//! A replica whose clock is off the database's: a fleet's hosts drift (a paused VM, NTP
//! that stopped), and every time the gateway writes for PostgreSQL to compare with its own
//! `now()` (a retry's due time, a circuit's reopening, a paced release) must follow the
//! database's clock, or a replica behind it retries at once whatever the subscriber asked,
//! and one ahead of it holds retries back by its error.
//!
//! The gateway runs under libfaketime (`faketime`, installed by `.ci/run`): its wall clock
//! shifted, its monotonic clock (timers) left alone; the database's clock is true.

use std::path::Path;
use std::time::Duration;

use serde_json::json;

use sqlx::{Connection, PgConnection};

use crate::support::replica::ReplicatedPair;
use crate::support::sink::{Reply, Sink};
use crate::support::{GatewayProcess, TestDb, eventually, post_to_shop, shop_to, wait_ready};

/// libfaketime's library, multi-threaded flavour.
const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// The environment that puts a process's wall clock `offset` (libfaketime's `FAKETIME`,
/// e.g. `-120s`) off the true one, its monotonic clock (timers) left alone.
fn shifted_clock(offset: &str) -> [(&'static str, &str); 3] {
    assert!(
        Path::new(FAKETIME_LIB).exists(),
        "libfaketime is not installed (apt install faketime; .ci/run installs it)"
    );
    [("LD_PRELOAD", FAKETIME_LIB), ("FAKETIME", offset), ("FAKETIME_DONT_FAKE_MONOTONIC", "1")]
}

/// A gateway on `db` with `extra` flags whose wall clock is `secs` off the true one
/// (libfaketime's `FAKETIME`, e.g. `-120s`), ready and its shift checked; its base URL.
async fn skewed_gateway(db: &TestDb, secs: i64, extra: &[&str]) -> (GatewayProcess, String) {
    let gateway = GatewayProcess::start_with_env(&db.url, extra, &shifted_clock(&format!("{secs:+}s")));
    wait_ready(gateway.addr).await;
    gateway_clock_is_shifted(&gateway, secs).await;
    let base = format!("http://{}", gateway.addr);
    (gateway, base)
}

/// The wall clock a process under `offset` reads, seen from the test's own: the control
/// that the shift took.
async fn gateway_clock_is_shifted(gateway: &GatewayProcess, expected_secs: i64) {
    let answer = reqwest::get(format!("http://{}/healthz", gateway.addr)).await.expect("healthz");
    let date = answer.headers().get("date").and_then(|d| d.to_str().ok()).map(str::to_owned);
    let date = date.expect("a Date header");
    let theirs = httpdate::parse_http_date(&date).expect("an HTTP date");
    let skew = match theirs.duration_since(std::time::SystemTime::now()) {
        Ok(ahead) => ahead.as_secs() as i64,
        Err(behind) => -(behind.duration().as_secs() as i64),
    };
    assert!((skew - expected_secs).abs() <= 2, "the gateway's clock is {skew} s off, not {expected_secs}");
    // What it measured and exports: the database's clock less its own.
    let measured = exported_offset(gateway).await;
    assert!((measured + expected_secs as f64).abs() <= 2.0, "measured offset {measured} s, clock {expected_secs} s");
}

/// The offset from the database's clock the gateway exports, seconds.
async fn exported_offset(gateway: &GatewayProcess) -> f64 {
    crate::support::scrape(gateway.addr)
        .await
        .lines()
        .find_map(|line| line.strip_prefix("webhook_gateway_clock_offset_seconds "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the clock offset gauge")
}

/// A subscriber that answers its first request 503 with a `Retry-After` four seconds
/// away (in seconds, or as an HTTP date by the true clock when `as_date`) and every other
/// one 200.
async fn retry_after_four_once(as_date: bool) -> Sink {
    Sink::start(move |_, n| {
        if n > 0 {
            return Reply::status(200);
        }
        let asked = if as_date {
            httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(4))
        } else {
            "4".to_owned()
        };
        Reply::Status(503, vec![("retry-after", asked)], String::new())
    })
    .await
}

/// How long the subscriber waited between its first request and the retry.
async fn retried_after(sink: &Sink) -> Duration {
    let requests = eventually(Duration::from_secs(60), "the retry", || async {
        let received = sink.received();
        (received.len() >= 2).then_some(received)
    })
    .await;
    requests[1].at.duration_since(requests[0].at)
}

/// One webhook to a subscriber that answers its first request 503 with a `Retry-After`
/// four seconds away and the next 200, through a gateway whose clock is 120 s behind the
/// database's and one whose clock is 120 s ahead, the `Retry-After` in seconds and as an
/// HTTP date: the retry comes no sooner than the subscriber asked (before, from the
/// replica behind: at once, its due time two minutes in the database's past) and not two
/// minutes later (before, from the replica ahead: 124 s). A date was read against the
/// host's clock, the delay then added to the database's: from the replica behind it came
/// two minutes late, from the one ahead at once (found by a review helper).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_whose_clock_is_off_the_database_s_retries_when_the_subscriber_asked() {
    let mut runs = Vec::new();
    for secs in [-120, 120] {
        for as_date in [false, true] {
            let db = TestDb::new().await;
            let (gateway, base) = skewed_gateway(&db, secs, &[]).await;
            let sink = retry_after_four_once(as_date).await;
            shop_to(&base, json!({"url": sink.url("/hook")})).await;
            assert_eq!(post_to_shop(&base, "d-1", &json!({"order": 1})).await.0, 200);
            runs.push((secs, as_date, db, gateway, sink));
        }
    }
    for (secs, as_date, _db, _gateway, sink) in &runs {
        let waited = retried_after(sink).await;
        // An HTTP date has whole seconds: four seconds from a time within the second.
        let least = if *as_date { Duration::from_millis(2_900) } else { Duration::from_millis(3_900) };
        let what = if *as_date { "an HTTP date 4 s away" } else { "4 s" };
        assert!(waited >= least, "clock {secs:+} s: retried after {waited:?}, asked {what}");
        assert!(waited < Duration::from_secs(60), "clock {secs:+} s: retried after {waited:?}, asked {what}");
    }
}

/// A subscriber that answers 500 to everything, through a gateway whose clock is 120 s
/// behind the database's, with a circuit that opens after two failures for 5 s: the
/// half-open probe comes no sooner than the cool-down (before: at once, the reopening
/// written two minutes in the database's past).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_whose_clock_is_behind_keeps_an_open_circuit_closed_for_its_cool_down() {
    let db = TestDb::new().await;
    let (_gateway, base) = skewed_gateway(
        &db,
        -120,
        &["--circuit-failure-threshold", "2", "--circuit-cooldown-ms", "5000", "--backoff-base-ms", "20"],
    )
    .await;
    let sink = Sink::start(|_, _| Reply::status(500)).await;
    shop_to(&base, json!({"url": sink.url("/hook")})).await;
    assert_eq!(post_to_shop(&base, "d-1", &json!({"order": 1})).await.0, 200);
    let requests = eventually(Duration::from_secs(60), "the probe after the circuit opened", || async {
        let received = sink.received();
        (received.len() >= 3).then_some(received)
    })
    .await;
    let closed_for = requests[2].at.duration_since(requests[1].at);
    assert!(
        closed_for >= Duration::from_millis(4_900),
        "probed {closed_for:?} after the circuit opened, cool-down 5 s"
    );
}

/// A Stripe webhook signed just now, posted to a gateway whose clock is 10 minutes behind
/// the database's (Stripe's tolerance is 5): accepted, as every other replica of the fleet
/// would (the signed timestamp is judged by the database's clock); one signed 10 minutes
/// ago, which that replica's own clock would have taken for fresh, is refused as the
/// others refuse it. Before: the fresh one refused 401, the stale one accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_clock_is_behind_judges_signed_timestamps_as_the_fleet_does() {
    use crate::support::signing::{now, stripe_header};
    let db = TestDb::new().await;
    let (_gateway, base) = skewed_gateway(&db, -600, &[]).await;
    let http = reqwest::Client::new();
    let secret = "whsec_it_clock_0123456789abcdef";
    let created = http
        .post(format!("{base}/v1/sources"))
        .bearer_auth(crate::support::ADMIN_TOKEN)
        .json(&json!({"name": "stripe", "kind": "stripe", "secrets": [secret]}))
        .send()
        .await
        .expect("create the source");
    assert_eq!(created.status(), 201);
    let post = |id: &str, signed_at: i64| {
        let body = format!(r#"{{"id":"{id}","object":"event","type":"charge.succeeded"}}"#);
        http.post(format!("{base}/ingest/stripe"))
            .header("stripe-signature", stripe_header(secret, signed_at, &body))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let fresh = post("evt_fresh", now()).await.expect("ingest");
    assert_eq!(fresh.status(), 200, "{:?}", fresh.text().await);
    let stale = post("evt_stale", now() - 600).await.expect("ingest");
    assert_eq!(stale.status(), 401, "{:?}", stale.text().await);
}

/// A failover to a server whose clock is 120 s ahead of the old primary's (the new primary
/// is another host): the gateway, reaching the primary by a host list, measures the new
/// server's clock within seconds of noticing the failover (not at the next minute's
/// measurement), and a subscriber's `Retry-After: 4` after it is honoured by the new
/// clock (with the old offset the due time it wrote would lie two minutes in the new
/// server's past, and the retry would come at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_failover_to_a_server_with_another_clock_the_gateway_follows_the_new_one() {
    let pair = ReplicatedPair::start_with_standby_env("gw", &shifted_clock("+120s")).await;
    let mut standby = PgConnection::connect(&pair.standby.url("postgres")).await.expect("standby connection");
    let standby_ahead: f64 = sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(&mut standby)
        .await
        .expect("its clock");
    let standby_ahead = standby_ahead - std::time::SystemTime::UNIX_EPOCH.elapsed().expect("time").as_secs_f64();
    assert!((standby_ahead - 120.0).abs() <= 2.0, "the standby's clock is {standby_ahead} s ahead, not 120");
    standby.close().await.ok();

    let url = pair.host_list_url("gw");
    let gateway = GatewayProcess::start(&url, &[]);
    wait_ready(gateway.addr).await;
    let before = exported_offset(&gateway).await;
    assert!(before.abs() <= 2.0, "before the failover, offset {before} s from the primary's clock");
    let sink = retry_after_four_once(false).await;
    let base = format!("http://{}", gateway.addr);
    shop_to(&base, json!({"url": sink.url("/hook")})).await;

    pair.kill_primary();
    tokio::time::sleep(Duration::from_secs(2)).await;
    pair.promote_standby().await;
    let promoted = std::time::Instant::now();
    let after = eventually(Duration::from_secs(20), "the new primary's clock measured", || async {
        let offset = exported_offset(&gateway).await;
        ((offset - 120.0).abs() <= 2.0).then_some(offset)
    })
    .await;
    println!("offset {before:.3} s before, {after:.3} s {:?} after the promotion", promoted.elapsed());

    eventually(Duration::from_secs(20), "the new primary takes the webhook", || async {
        (post_to_shop(&base, "d-1", &json!({"order": 1})).await.0 == 200).then_some(())
    })
    .await;
    let waited = retried_after(&sink).await;
    assert!(waited >= Duration::from_millis(3_900), "retried after {waited:?}, asked 4 s");
    assert!(waited < Duration::from_secs(60), "retried after {waited:?}, asked 4 s");
}

/// The console's overview on a replica whose clock is five minutes ahead of the
/// database's counts what was stored in its windows by the database's clock: ten webhooks
/// just stored show over five minutes (before, its windows were by its own clock, ahead
/// of every row, and it showed no traffic at all; found by a review helper).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_s_overview_on_a_replica_whose_clock_is_off_counts_by_the_database_s() {
    let db = TestDb::new().await;
    let (_gateway, base) = skewed_gateway(&db, 300, &[]).await;
    let sink = Sink::ok().await;
    shop_to(&base, json!({"url": sink.url("/hook")})).await;
    for i in 0..10 {
        assert_eq!(post_to_shop(&base, &format!("d-{i}"), &json!({"order": i})).await.0, 200);
    }
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().expect("client");
    let signed_in = http
        .post(format!("{base}/console/login"))
        .form(&[("token", crate::support::ADMIN_TOKEN)])
        .send()
        .await
        .expect("sign in");
    let cookie =
        signed_in.headers()["set-cookie"].to_str().expect("cookie").split(';').next().expect("cookie").to_owned();
    let page = http.get(format!("{base}/console")).header("cookie", cookie).send().await.expect("overview");
    let html = page.text().await.expect("overview page");
    let over_five_minutes = html
        .split(r#"id="ingest-5m">"#)
        .nth(1)
        .and_then(|rest| rest.split('<').next())
        .expect("the five minutes' ingest figure")
        .to_owned();
    assert_ne!(over_five_minutes, "0", "ten webhooks stored a moment ago");
}

/// A replica whose clock is an hour ahead reports a source refusing webhooks for the
/// database's minute, and stamps the event by the database's clock: the event's key is the
/// source and the minute, so a fleet of replicas whose clocks are off publishes it once a
/// minute. Before: the minute and timestamp were the replica's own, an hour ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_clock_is_ahead_reports_refusals_for_the_database_s_minute() {
    let db = TestDb::new().await;
    let (_gateway, base) = skewed_gateway(&db, 3600, &[]).await;
    crate::support::admin_post_at(
        &base,
        "/v1/sources",
        json!({"name": "signed", "kind": "hmac", "secrets": ["s3cret-s3cret-s3cret"],
               "hmac": {"header": "X-Signature", "algorithm": "sha256", "encoding": "hex"}}),
    )
    .await;
    let http = reqwest::Client::new();
    for _ in 0..25 {
        let refused = http
            .post(format!("{base}/ingest/signed"))
            .header("x-signature", "00".repeat(32))
            .body("{}")
            .send()
            .await
            .expect("ingest");
        assert_eq!(refused.status(), 401);
    }
    let (minute_off, stamp_off): (f64, f64) = eventually(Duration::from_secs(30), "source.refusing stored", || async {
        sqlx::query_as(
            "SELECT extract(epoch FROM now() - (doc->'data'->>'minute')::timestamptz)::float8,
                    extract(epoch FROM now() - (doc->>'timestamp')::timestamptz)::float8
               FROM (SELECT convert_from(payload, 'UTF8')::jsonb AS doc FROM events
                      WHERE event_type = 'source.refusing') e",
        )
        .fetch_optional(&db.pool)
        .await
        .expect("read the event")
    })
    .await;
    assert!((0.0..=120.0).contains(&minute_off), "the minute is {minute_off} s before the database's now");
    assert!((-5.0..=60.0).contains(&stamp_off), "the timestamp is {stamp_off} s before the database's now");
}
