//! Payload transformations: a subscription's JavaScript `handler(webhook)` reshapes the
//! body its endpoint receives, signed under the delivery's own id; a script that throws or
//! runs away is cut off and dead-letters that delivery alone.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::sink::Sink;
use crate::support::{TestApp, count_status, eventually, standard_webhooks};

/// An endpoint for `sink` subscribed to `shop` with `transform`; its secret.
async fn transformed_endpoint(app: &TestApp, sink: &Sink, transform: Option<&str>) -> (String, String) {
    let endpoint = app.admin_post("/v1/endpoints", json!({"url": sink.url("/")}), 201).await;
    let mut sub = json!({"endpoint_id": endpoint["id"], "source": "shop"});
    if let Some(t) = transform {
        sub["transform"] = json!(t);
    }
    let created = app.admin_post("/v1/subscriptions", sub, 201).await;
    assert_eq!(created["transform"].as_str(), transform);
    (endpoint["id"].as_str().unwrap().to_owned(), endpoint["secret"].as_str().unwrap().to_owned())
}

/// A Slack message made from the event, and a redaction: each endpoint receives exactly
/// what its handler returns, as JSON, signed (an independent Standard Webhooks verifier
/// accepts it) under the delivery's `webhook-id`; the endpoint without a transformation
/// receives the event's body as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_endpoint_receives_what_its_handler_returns_signed() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let (slack, redacted, plain) = (Sink::ok().await, Sink::ok().await, Sink::ok().await);
    let slack_js = "function handler(w) {\n  return {text: `Order ${w.payload.id} paid: ${w.payload.amount / 100} EUR (${w.type})`};\n}";
    let (slack_endpoint, slack_secret) = transformed_endpoint(&app, &slack, Some(slack_js)).await;
    let redact_js = "function handler(w) { delete w.payload.card; return w.payload; }";
    let (_, redacted_secret) = transformed_endpoint(&app, &redacted, Some(redact_js)).await;
    transformed_endpoint(&app, &plain, None).await;

    let body = r#"{"id": "ord_1", "amount": 1250, "card": {"number": "4242424242424242"}}"#;
    let (status, stored) = app.ingest("shop", "d-1", "order.paid", body).await;
    assert_eq!(status, 200);
    eventually(Duration::from_secs(30), "all three delivered", || async {
        (slack.count() >= 1 && redacted.count() >= 1 && plain.count() >= 1).then_some(())
    })
    .await;

    for (sink, secret, expected) in [
        (&slack, &slack_secret, &br#"{"text":"Order ord_1 paid: 12.5 EUR (order.paid)"}"#[..]),
        (&redacted, &redacted_secret, &br#"{"id":"ord_1","amount":1250}"#[..]),
    ] {
        let got = &sink.received()[0];
        assert_eq!(&got.body[..], expected, "byte for byte");
        assert_eq!(got.header("content-type"), "application/json");
        assert!(
            standard_webhooks::verify(
                secret,
                &got.header("webhook-id"),
                &got.header("webhook-timestamp"),
                &got.body,
                &got.header("webhook-signature")
            ),
            "the transformed body is what is signed"
        );
    }
    assert_eq!(&plain.received()[0].body[..], body.as_bytes(), "no transformation: the body as it came");
    let ids: Vec<String> = [&slack, &redacted, &plain].iter().map(|s| s.received()[0].header("webhook-id")).collect();
    let deliveries = app.admin_get(&format!("/v1/events/{}", stored["event_id"].as_str().unwrap())).await;
    let known: Vec<String> = deliveries["deliveries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["webhook_id"].as_str().unwrap().to_owned())
        .collect();
    for id in ids {
        assert!(known.contains(&id), "each request carries its own delivery's webhook-id");
    }
    // The attempt log shows what was sent.
    let slack_delivery = deliveries["deliveries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["endpoint_id"] == slack_endpoint.as_str())
        .expect("the slack endpoint's delivery")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    eventually(Duration::from_secs(30), "the attempt recorded", || async {
        let attempts = app.admin_get(&format!("/v1/deliveries/{slack_delivery}/attempts")).await;
        (attempts["data"].as_array().is_some_and(|a| !a.is_empty())).then_some(attempts)
    })
    .await;
    let attempts = app.admin_get(&format!("/v1/deliveries/{slack_delivery}/attempts")).await;
    assert_eq!(attempts["data"][0]["sent_excerpt"], r#"{"text":"Order ord_1 paid: 12.5 EUR (order.paid)"}"#);
}

/// Scripts that loop forever, exhaust memory, recurse without end, throw or return nothing
/// are cut off by the engine's bounds: each dead-letters its delivery with the reason, no
/// request is sent for it, and the endpoint without a transformation gets the webhook.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_runaway_or_failing_transformation_dead_letters_its_delivery_alone() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let plain = Sink::ok().await;
    transformed_endpoint(&app, &plain, None).await;
    let scripts = [
        ("function handler(w) { while (true) {} }", "ran longer than"),
        ("function handler(w) { let a = []; while (true) a.push(new Array(100000).fill(1)); }", "out of memory"),
        ("function f() { return f(); } function handler(w) { return f(); }", "call stack"),
        ("function handler(w) { throw new Error('no card on ' + w.payload.id); }", "no card on ord_9"),
        ("function handler(w) { }", "returned nothing"),
    ];
    let mut hostile = Vec::new();
    for (script, why) in scripts {
        let sink = Sink::ok().await;
        let (endpoint, _) = transformed_endpoint(&app, &sink, Some(script)).await;
        hostile.push((sink, endpoint, why));
    }
    let (status, _) = app.ingest("shop", "d-9", "order.paid", r#"{"id": "ord_9"}"#).await;
    assert_eq!(status, 200);
    eventually(Duration::from_secs(30), "the plain endpoint served and the hostile ones dead", || async {
        (plain.count() == 1 && count_status(&app.db.pool, "dead").await == hostile.len() as i64).then_some(())
    })
    .await;
    for (sink, endpoint, why) in &hostile {
        assert_eq!(sink.count(), 0, "nothing sent for a failed transformation");
        let dead = app.admin_get(&format!("/v1/deliveries?endpoint_id={endpoint}&status=dead")).await;
        let reason = dead["data"][0]["dead_reason"].as_str().unwrap_or_default().to_owned();
        assert!(reason.starts_with("transform: ") && reason.contains(why), "{why}: {reason}");
    }
}

/// A transformation is checked when saved: a syntax error names where, a script without
/// `handler` or that runs away at load is refused; a PATCH sets and clears one.
#[tokio::test]
async fn a_transformation_is_checked_when_saved() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let endpoint = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/"}), 201).await;
    let create = |t: &str| json!({"endpoint_id": endpoint["id"], "source": "shop", "transform": t});
    for (bad, why) in [
        ("function handler(w { return w; }", "eval_script:1:"),
        ("const x = 1;", "handler"),
        ("while (true) {}", "ran longer than"),
        ("", "must not be empty"),
    ] {
        let refused = app.admin_post("/v1/subscriptions", create(bad), 422).await;
        let message = refused["error"]["message"].as_str().unwrap();
        assert!(message.starts_with("transform: ") && message.contains(why), "{bad}: {message}");
    }
    let sub = app.admin_post("/v1/subscriptions", create("function handler(w) { return w; }"), 201).await;
    let path = format!("/v1/subscriptions/{}", sub["id"].as_str().unwrap());
    let (status, cleared) = app.admin(reqwest::Method::PATCH, &path, Some(json!({"transform": null}))).await;
    assert_eq!((status, cleared["transform"].clone()), (200, Value::Null));
}

/// `POST /v1/transforms/test` runs a transformation as the worker would, on a stored event
/// (its body in the producer's key order) or a pasted one, and shows the body or the
/// reason its delivery would be dead with; nothing is stored or sent.
#[tokio::test]
async fn a_transformation_can_be_tried_on_a_stored_or_a_pasted_event() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let (status, stored) = app.ingest("shop", "d-1", "order.paid", r#"{"zeta": 1, "alpha": 2}"#).await;
    assert_eq!(status, 200);
    let keys = "function handler(w) { return {keys: Object.keys(w.payload), type: w.type, source: w.source}; }";
    let tried =
        app.admin_post("/v1/transforms/test", json!({"transform": keys, "event_id": stored["event_id"]}), 200).await;
    assert_eq!(tried["body"], json!({"keys": ["zeta", "alpha"], "type": "order.paid", "source": "shop"}));
    assert!(tried["error"].is_null());
    let pasted = json!({"payload": {"id": "ord_2"}, "headers": {"x-a": "1"}, "type": "t"});
    let echo = "function handler(w) { return [w.payload.id, w.headers['x-a']]; }";
    let tried = app.admin_post("/v1/transforms/test", json!({"transform": echo, "event": pasted}), 200).await;
    assert_eq!(tried["body"], json!(["ord_2", "1"]));
    let throws = "function handler(w) { throw new Error('no ' + w.payload.id); }";
    let tried = app.admin_post("/v1/transforms/test", json!({"transform": throws, "event": pasted}), 200).await;
    assert!(tried["body"].is_null() && tried["error"].as_str().unwrap().contains("no ord_2"), "{tried}");
    app.admin_post("/v1/transforms/test", json!({"transform": "function handler(w {", "event": pasted}), 422).await;
    app.admin_post("/v1/transforms/test", json!({"transform": echo}), 422).await;
    assert_eq!(app.db.count("events").await, 1, "trying stores nothing");
}
