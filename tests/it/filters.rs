//! Routing by content: subscription filters (SQL/JSON path over the event's document),
//! evaluated in the ingest statement, checked when saved, tried before saving.

use std::collections::BTreeSet;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::support::sink::Sink;
use crate::support::{TestApp, eventually};

/// One generated event: its body, headers and type, and what the test's own reading of it
/// says each filter should decide.
struct Generated {
    body: Vec<u8>,
    event_type: &'static str,
    region: Option<&'static str>,
    json: Option<Value>,
}

fn generate(rng: &mut StdRng, n: usize) -> Generated {
    let event_type = if rng.random_bool(0.5) { "order.created" } else { "invoice.paid" };
    let region = match rng.random_range(0..3) {
        0 => Some("eu"),
        1 => Some("us"),
        _ => None,
    };
    if rng.random_bool(0.1) {
        // Not JSON: text, or bytes that are not UTF-8.
        let body =
            if rng.random_bool(0.5) { format!("plain text {n}").into_bytes() } else { vec![0xff, 0xfe, n as u8] };
        return Generated { body: [body, format!("#{n}").into_bytes()].concat(), event_type, region, json: None };
    }
    let mut object = serde_json::Map::new();
    object.insert("n".into(), json!(n));
    match rng.random_range(0..4) {
        0 => {}
        1 => {
            object.insert("livemode".into(), json!(true));
        }
        2 => {
            object.insert("livemode".into(), json!(false));
        }
        _ => {
            object.insert("livemode".into(), json!("true")); // a string: not the boolean
        }
    }
    match rng.random_range(0..5) {
        0 => {}
        1 => {
            object.insert("amount".into(), json!(rng.random_range(0..2000)));
        }
        2 => {
            object.insert("amount".into(), json!(rng.random_range(0.0..2000.0)));
        }
        3 => {
            object.insert("amount".into(), json!("1500")); // a string: compared to a number, no match
        }
        _ => {
            object.insert("amount".into(), json!({"value": 5000}));
        }
    }
    let value = Value::Object(object);
    Generated { body: serde_json::to_vec(&value).unwrap(), event_type, region, json: Some(value) }
}

/// The test's own reading of a filter.
type Reading = Box<dyn Fn(&Generated) -> bool>;

/// The filters under test, each with the test's own reading of it. A body that is not
/// JSON is a null payload: no field of it exists.
fn filters() -> Vec<(&'static str, Reading)> {
    vec![
        ("$.payload.livemode == true", Box::new(|g| g.json.as_ref().is_some_and(|v| v["livemode"] == json!(true)))),
        (
            "$.payload.amount > 1000 && $.type starts with \"order.\"",
            Box::new(|g| {
                g.event_type.starts_with("order.")
                    && g.json.as_ref().is_some_and(|v| v["amount"].as_f64().is_some_and(|a| a > 1000.0))
            }),
        ),
        ("$.headers.\"x-region\" == \"eu\"", Box::new(|g| g.region == Some("eu"))),
        (
            "$.source == \"shop\" && !exists($.payload.livemode)",
            Box::new(|g| g.json.as_ref().is_none_or(|v| v.get("livemode").is_none())),
        ),
    ]
}

/// Generated events (booleans, strings that look like booleans, numbers of both kinds,
/// strings that look like numbers, objects where numbers were expected, bodies that are
/// not JSON or not UTF-8) through the real ingest path, to endpoints with filters on the
/// payload, the headers, the type and the source, and one without: each endpoint
/// receives exactly the events its filter matches by the test's own reading, the one
/// without a filter receives them all, and an event a filter refuses creates no delivery
/// row for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_endpoint_receives_exactly_the_events_its_filter_matches() {
    const EVENTS: usize = 150;
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let mut sinks = Vec::new();
    for (filter, _) in filters() {
        let sink = Sink::ok().await;
        let endpoint = app.admin_post("/v1/endpoints", json!({"url": sink.url("/")}), 201).await;
        let sub = app
            .admin_post(
                "/v1/subscriptions",
                json!({"endpoint_id": endpoint["id"], "source": "shop", "filter": filter}),
                201,
            )
            .await;
        assert!(sub["filter"].is_string(), "{sub}");
        sinks.push((sink, endpoint["id"].as_str().unwrap().to_owned()));
    }
    let everything = Sink::ok().await;
    app.endpoint_for(&everything.url("/"), Some("shop")).await;

    let mut rng = StdRng::seed_from_u64(29);
    let events: Vec<Generated> = (0..EVENTS).map(|n| generate(&mut rng, n)).collect();
    for (n, g) in events.iter().enumerate() {
        let mut request = app
            .http
            .post(app.url("/ingest/shop"))
            .header("x-delivery-id", format!("d-{n}"))
            .header("x-event-type", g.event_type)
            .body(g.body.clone());
        if let Some(region) = g.region {
            request = request.header("x-region", region);
        }
        assert_eq!(request.send().await.unwrap().status(), 200);
    }
    eventually(Duration::from_secs(60), "every event delivered to the endpoint without a filter", || async {
        (everything.count() >= EVENTS).then_some(())
    })
    .await;

    let bodies = |sink: &Sink| {
        sink.received().iter().map(|r| String::from_utf8_lossy(&r.body).into_owned()).collect::<BTreeSet<String>>()
    };
    for ((filter, expects), (sink, endpoint_id)) in filters().iter().zip(&sinks) {
        let expected: BTreeSet<String> =
            events.iter().filter(|g| expects(g)).map(|g| String::from_utf8_lossy(&g.body).into_owned()).collect();
        assert!(!expected.is_empty() && expected.len() < EVENTS, "{filter}: the generator covers both answers");
        eventually(Duration::from_secs(30), &format!("{filter}: its events delivered"), || async {
            (bodies(sink).len() >= expected.len()).then_some(())
        })
        .await;
        assert_eq!(bodies(sink), expected, "{filter}");
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE endpoint_id = $1::uuid")
            .bind(endpoint_id)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
        assert_eq!(rows as usize, expected.len(), "{filter}: no delivery row for an event it refuses");
    }
    assert_eq!(bodies(&everything).len(), EVENTS);
}

/// A filter is checked when saved: a syntax error is a 422 naming the character, an empty
/// or oversized one a 422; a PATCH sets, changes and clears it (PostgreSQL's normal form
/// is shown).
#[tokio::test]
async fn a_filter_is_checked_when_saved_and_can_be_changed_and_cleared() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let endpoint = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/"}), 201).await;
    let create = |filter: Value| json!({"endpoint_id": endpoint["id"], "source": "shop", "filter": filter});
    let refused = app.admin_post("/v1/subscriptions", create(json!("$.payload.amount = 1")), 422).await;
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("filter: ") && message.contains("(at character 18)"), "{message}");
    let refused = app.admin_post("/v1/subscriptions", create(json!("$.payload.a ==")), 422).await;
    assert!(refused["error"]["message"].as_str().unwrap().contains("at character 15"), "{refused}");
    for bad in [json!(""), json!("  "), json!(format!("$.payload.a == \"{}\"", "x".repeat(5000)))] {
        app.admin_post("/v1/subscriptions", create(bad), 422).await;
    }
    // Costs that grow faster than the body: refused with the reason.
    for (bad, why) in [
        ("exists($.payload.**.** ? (@ == 1))", "recursive wildcard"),
        ("exists($.payload.items[*] ? ($.payload.x == @.y))", "inside a predicate"),
    ] {
        let refused = app.admin_post("/v1/subscriptions", create(json!(bad)), 422).await;
        assert!(refused["error"]["message"].as_str().unwrap().contains(why), "{refused}");
    }
    assert_eq!(app.db.count("subscriptions").await, 0, "nothing refused was stored");

    let sub = app.admin_post("/v1/subscriptions", create(json!("$.payload.livemode == true")), 201).await;
    assert_eq!(sub["filter"], "($.\"payload\".\"livemode\" == true)");
    let path = format!("/v1/subscriptions/{}", sub["id"].as_str().unwrap());
    let (status, changed) =
        app.admin(reqwest::Method::PATCH, &path, Some(json!({"filter": "$.type == \"order.paid\""}))).await;
    assert_eq!((status, changed["filter"].clone()), (200, json!("($.\"type\" == \"order.paid\")")));
    let (status, _) = app.admin(reqwest::Method::PATCH, &path, Some(json!({"filter": "$.a ==="}))).await;
    assert_eq!(status, 422);
    let (status, cleared) = app.admin(reqwest::Method::PATCH, &path, Some(json!({"filter": null}))).await;
    assert_eq!((status, cleared["filter"].clone()), (200, Value::Null));
}

/// `POST /v1/filters/test` evaluates a filter as the fan-out would, on a stored event or
/// a pasted one, and shows the document; it stores and sends nothing.
#[tokio::test]
async fn a_filter_can_be_tried_on_a_stored_or_a_pasted_event() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let (status, stored) = app.ingest("shop", "d-1", "order.created", r#"{"livemode": true, "amount": 1200}"#).await;
    assert_eq!(status, 200);
    let event_id = stored["event_id"].clone();
    let tried = app
        .admin_post("/v1/filters/test", json!({"filter": "$.payload.amount > 1000", "event_id": event_id}), 200)
        .await;
    assert_eq!(tried["matches"], true);
    assert_eq!(tried["document"]["payload"], json!({"livemode": true, "amount": 1200}));
    assert_eq!(
        (tried["document"]["type"].clone(), tried["document"]["source"].clone()),
        (json!("order.created"), json!("shop"))
    );
    let tried = app
        .admin_post("/v1/filters/test", json!({"filter": "$.payload.amount > 5000", "event_id": event_id}), 200)
        .await;
    assert_eq!(tried["matches"], false);

    let pasted = json!({"payload": {"ref": "refs/heads/main"}, "headers": {"x-github-event": "push"}, "type": "push", "source": "github"});
    let filter =
        "$.headers.\"x-github-event\" == \"push\" && $.payload.ref == \"refs/heads/main\" && $.source == \"github\"";
    let tried = app.admin_post("/v1/filters/test", json!({"filter": filter, "event": pasted}), 200).await;
    assert_eq!(tried["matches"], true, "{tried}");
    // A type error is no match, not an error.
    let tried = app.admin_post("/v1/filters/test", json!({"filter": "$.payload.ref > 3", "event": pasted}), 200).await;
    assert_eq!(tried["matches"], false);
    // A pasted event reads as the stored one would: a number as written (not rounded to a
    // float on the way), header names in lower case (before: no match for either).
    let big = r#"{"filter": "$.payload.id == 12345678901234567890123 && $.headers.\"x-foo\" == \"1\"",
                  "event": {"payload": {"id": 12345678901234567890123}, "headers": {"X-Foo": "1"}}}"#;
    let answer = app
        .http
        .post(app.url("/v1/filters/test"))
        .bearer_auth(crate::support::ADMIN_TOKEN)
        .header("content-type", "application/json")
        .body(big)
        .send()
        .await
        .expect("try");
    assert_eq!(answer.status(), 200);
    let tried: Value = answer.json().await.expect("answer");
    assert_eq!(tried["matches"], true, "{tried}");

    app.admin_post("/v1/filters/test", json!({"filter": "$.a = 1", "event": pasted}), 422).await;
    app.admin_post("/v1/filters/test", json!({"filter": "$.a == 1"}), 422).await;
    app.admin_post("/v1/filters/test", json!({"filter": "$.a == 1", "event": pasted, "event_id": event_id}), 422).await;
    let unknown = uuid::Uuid::new_v4();
    app.admin_post("/v1/filters/test", json!({"filter": "$.a == 1", "event_id": unknown}), 404).await;
    assert_eq!(app.db.count("events").await, 1, "trying stores nothing");
}

/// A body nested as deep as PostgreSQL's JSON takes, to a source whose subscription
/// walks the whole body (`**`, the most a filter may): stored, matched, delivered, and the
/// subscription without a filter beside it gets it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deeply_nested_body_is_filtered_in_one_walk() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let filtered = Sink::ok().await;
    let filter = "exists($.payload.** ? (@ == \"needle\"))";
    app.endpoint_with(&filtered.url("/"), json!({"source": "shop", "filter": filter})).await;
    let everything = Sink::ok().await;
    app.endpoint_for(&everything.url("/"), Some("shop")).await;
    let deep = format!("{}\"needle\"{}", "[".repeat(5000), "]".repeat(5000));
    let shallow = r#"{"hay": ["stack"]}"#;
    for (id, body) in [("deep", deep.as_str()), ("shallow", shallow)] {
        let (status, _) = app.ingest("shop", id, "t", body).await;
        assert_eq!(status, 200, "{id}");
    }
    eventually(Duration::from_secs(30), "both delivered to the endpoint without a filter", || async {
        (everything.count() >= 2).then_some(())
    })
    .await;
    eventually(Duration::from_secs(30), "the deep one delivered to the filtered endpoint", || async {
        (filtered.count() >= 1).then_some(())
    })
    .await;
    assert_eq!(filtered.count(), 1, "only the body that holds the needle");
    assert!(filtered.received()[0].body.starts_with(b"[[[["));
}

/// A filter whose evaluation raises an error `silent` does not hide (a timestamp with a
/// zone compared to one without; a `**` walk of a body nested deep enough to exhaust
/// PostgreSQL's stack) is no match, never an error: the webhook is stored (200) and
/// reaches the subscription without a filter beside it. Before, the whole ingest
/// statement failed: 500, nothing stored, no subscriber reached. Trying the filter
/// answers no match too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_filter_that_fails_on_a_webhook_is_no_match_and_the_webhook_is_stored() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let everything = Sink::ok().await;
    app.endpoint_for(&everything.url("/"), Some("shop")).await;
    let zoned = Sink::ok().await;
    let by_date = "$.payload.at.datetime() < \"2025-01-01\".datetime()";
    app.endpoint_with(&zoned.url("/"), json!({"source": "shop", "filter": by_date})).await;
    let walked = Sink::ok().await;
    let walk = "exists($.payload.** ? (@ == \"x\"))";
    app.endpoint_with(&walked.url("/"), json!({"source": "shop", "filter": walk})).await;

    let with_zone = r#"{"at": "2024-06-01T10:00:00+02:00"}"#;
    let too_deep = format!("{}\"y\"{}", "[".repeat(12_000), "]".repeat(12_000));
    let without_zone = r#"{"at": "2024-06-01"}"#;
    for (id, body) in [("zone", with_zone), ("deep", too_deep.as_str()), ("plain-date", without_zone)] {
        let (status, answer) = app.ingest("shop", id, "t", body).await;
        assert_eq!(status, 200, "{id}: {answer}");
    }
    eventually(Duration::from_secs(30), "all three at the endpoint without a filter", || async {
        (everything.count() >= 3).then_some(())
    })
    .await;
    eventually(Duration::from_secs(30), "the date without a zone matched", || async {
        (zoned.count() >= 1).then_some(())
    })
    .await;
    assert_eq!(app.db.count("events").await, 3, "each stored once");
    let matched = |sink: &Sink| sink.received().iter().map(|r| r.body.len()).collect::<Vec<_>>();
    assert_eq!(matched(&zoned), [without_zone.len()], "the failing comparison is no match");
    assert!(walked.received().is_empty(), "the walk that failed is no match");
    for (filter, payload) in [(by_date, json!({"at": "2024-06-01T10:00:00+02:00"}))] {
        let tried =
            app.admin_post("/v1/filters/test", json!({"filter": filter, "event": {"payload": payload}}), 200).await;
        assert_eq!(tried["matches"], false, "{tried}");
    }
}

/// Filters PostgreSQL's parser refuses with a data exception rather than a syntax error
/// (an escape jsonpath refuses, a regex that does not compile, a number out of range),
/// and one whose normal form (what is stored) is over 4 KiB though its text is not, are
/// refused 422 naming the filter, when saved and when tried. Before: 500.
#[tokio::test]
async fn every_filter_the_parser_refuses_is_a_422() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let endpoint = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/"}), 201).await;
    let long_normal = format!("${} == 1", ".a".repeat(2040));
    assert!(long_normal.len() <= 4096);
    for filter in ["$.a == \"\\u0000\"", "$.type like_regex \"(\"", "$.a == 1e1000000", long_normal.as_str()] {
        let (status, body) = app
            .admin(
                reqwest::Method::POST,
                "/v1/subscriptions",
                Some(json!({"endpoint_id": endpoint["id"], "source": "shop", "filter": filter})),
            )
            .await;
        assert_eq!(status, 422, "{filter}: {body}");
        assert!(body.to_string().contains("filter"), "{body}");
        let tried = json!({"filter": filter, "event": {"payload": {}}});
        let (status, body) = app.admin(reqwest::Method::POST, "/v1/filters/test", Some(tried)).await;
        assert_eq!(status, 422, "tried {filter}: {body}");
    }
    assert_eq!(app.db.count("subscriptions").await, 0, "none saved");
}

/// Two replicas: a filter set, changed and cleared through one replica applies at once
/// to webhooks the other one stores (the fan-out reads the subscription in the ingest
/// statement: no copy of it to go stale), and a subscription with a filter sits beside
/// one without.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_filter_changed_through_one_replica_applies_at_once_on_another() {
    use crate::support::{ADMIN_TOKEN, GatewayProcess, TestDb, wait_ready};
    let db = TestDb::new().await;
    let (a, b) = (GatewayProcess::start(&db.url, &[]), GatewayProcess::start(&db.url, &[]));
    wait_ready(a.addr).await;
    wait_ready(b.addr).await;
    let http = reqwest::Client::new();
    let admin = |method: reqwest::Method, path: String, body: Value| {
        let request = http.request(method, format!("http://{}{path}", a.addr)).bearer_auth(ADMIN_TOKEN).json(&body);
        async move {
            let answer = request.send().await.expect("admin call");
            assert!(answer.status().is_success(), "{path}: {}", answer.status());
            answer.json::<Value>().await.expect("json")
        }
    };
    admin(
        reqwest::Method::POST,
        "/v1/sources".into(),
        json!({"name": "shop", "kind": "none", "dedupe": {"header": "X-Delivery-Id"}}),
    )
    .await;
    let (filtered, everything) = (Sink::ok().await, Sink::ok().await);
    let mut filtered_sub = String::new();
    for (sink, filter) in [(&filtered, json!("$.payload.n == 1")), (&everything, Value::Null)] {
        let endpoint = admin(reqwest::Method::POST, "/v1/endpoints".into(), json!({"url": sink.url("/")})).await;
        let mut body = json!({"endpoint_id": endpoint["id"], "source": "shop"});
        if !filter.is_null() {
            body["filter"] = filter;
        }
        let sub = admin(reqwest::Method::POST, "/v1/subscriptions".into(), body).await;
        if sink.url("/") == filtered.url("/") {
            filtered_sub = sub["id"].as_str().unwrap().to_owned();
        }
    }
    // Through replica b: n = 1 matches, n = 2 does not.
    let send = |n: u32| {
        let request = http
            .post(format!("http://{}/ingest/shop", b.addr))
            .header("x-delivery-id", format!("d-{n}"))
            .body(json!({"n": n}).to_string());
        async move { assert_eq!(request.send().await.unwrap().status(), 200) }
    };
    send(1).await;
    send(2).await;
    // Changed through a, used at once by b.
    let path = format!("/v1/subscriptions/{filtered_sub}");
    admin(reqwest::Method::PATCH, path.clone(), json!({"filter": "$.payload.n == 3"})).await;
    send(3).await;
    send(4).await;
    admin(reqwest::Method::PATCH, path, json!({"filter": null})).await;
    send(5).await;
    eventually(Duration::from_secs(30), "all five delivered to the endpoint without a filter", || async {
        (everything.count() >= 5).then_some(())
    })
    .await;
    eventually(Duration::from_secs(30), "the filtered endpoint's three", || async {
        (filtered.count() >= 3).then_some(())
    })
    .await;
    let got: BTreeSet<String> =
        filtered.received().iter().map(|r| String::from_utf8_lossy(&r.body).into_owned()).collect();
    let want: BTreeSet<String> = [1, 3, 5].iter().map(|n| json!({"n": n}).to_string()).collect();
    assert_eq!(got, want);
}

/// A filter from a small grammar over the generated events' fields: comparisons of each
/// JSON type, `exists`, `starts with`, `like_regex`, array wildcards, headers and type,
/// combined with `&&`, `||` and `!`.
fn generated_filter(rng: &mut StdRng, depth: u32) -> String {
    if depth == 0 || rng.random_bool(0.4) {
        let atoms = [
            "$.payload.livemode == true".to_owned(),
            format!("$.payload.amount > {}", rng.random_range(0..2000)),
            format!("$.payload.amount <= {}.5", rng.random_range(0..2000)),
            "exists($.payload.amount.value)".to_owned(),
            "$.payload.livemode == \"true\"".to_owned(),
            format!("$.payload.n == {}", rng.random_range(0..40)),
            format!("$.payload.tags[*] == \"t{}\"", rng.random_range(0..4)),
            "$.payload.name starts with \"a\"".to_owned(),
            "$.payload.name like_regex \"^[a-c].*z$\"".to_owned(),
            "$.type == \"order.created\"".to_owned(),
            "$.headers.\"x-region\" == \"eu\"".to_owned(),
            "$.payload == null".to_owned(),
            "$.payload.amount.type() == \"number\"".to_owned(),
        ];
        return atoms[rng.random_range(0..atoms.len())].clone();
    }
    let (a, b) = (generated_filter(rng, depth - 1), generated_filter(rng, depth - 1));
    match rng.random_range(0..3) {
        0 => format!("({a}) && ({b})"),
        1 => format!("({a}) || ({b})"),
        _ => format!("!({a})"),
    }
}

/// For generated filters and generated events, the fan-out's decision (a delivery row for
/// the filter's endpoint, or none) is the decision `POST /v1/filters/test` shows for the
/// same stored event: trying a filter tells the truth about routing, whatever the filter
/// and the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_fan_out_decides_what_trying_the_filter_shows_for_generated_filters_and_events() {
    const FILTERS: usize = 24;
    const EVENTS: usize = 40;
    let app = TestApp::ingest_only().await;
    app.source_none("shop").await;
    let mut rng = StdRng::seed_from_u64(2029);
    let mut subscriptions = Vec::new();
    for i in 0..FILTERS {
        let filter = generated_filter(&mut rng, 3);
        let url = format!("http://127.0.0.1:9/{i}");
        let endpoint = app.endpoint_with(&url, json!({"source": "shop", "filter": filter})).await;
        subscriptions.push((filter, endpoint));
    }
    let mut matched = 0;
    for n in 0..EVENTS {
        let mut event = generate(&mut rng, n);
        if let Some(Value::Object(object)) = &mut event.json {
            let names = ["abz", "cz", "b", "zz"];
            object.insert("name".into(), json!(names[rng.random_range(0..names.len())]));
            let tags: Vec<String> =
                (0..rng.random_range(0..3)).map(|_| format!("t{}", rng.random_range(0..4))).collect();
            object.insert("tags".into(), json!(tags));
            event.body = serde_json::to_vec(object).unwrap();
        }
        let mut request = app
            .http
            .post(app.url("/ingest/shop"))
            .header("x-delivery-id", format!("g-{n}"))
            .header("x-event-type", event.event_type)
            .body(event.body.clone());
        if let Some(region) = event.region {
            request = request.header("x-region", region);
        }
        let answer: Value = request.send().await.unwrap().json().await.unwrap();
        let event_id = answer["event_id"].clone();
        for (filter, endpoint) in &subscriptions {
            let tried = app.admin_post("/v1/filters/test", json!({"filter": filter, "event_id": event_id}), 200).await;
            let routed: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM deliveries WHERE event_id = $1::uuid AND endpoint_id = $2::uuid)",
            )
            .bind(event_id.as_str().unwrap())
            .bind(endpoint)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
            assert_eq!(tried["matches"].as_bool(), Some(routed), "event {n}, filter {filter}: {tried}");
            matched += usize::from(routed);
        }
    }
    let total = FILTERS * EVENTS;
    assert!(
        matched > total / 20 && matched < total - total / 20,
        "the generator covers both answers: {matched} of {total}"
    );
}
