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

/// A delivery made with a transformation is sent transformed or not at all. Two paused
/// endpoints hold a card number's webhook, each subscribed with a redaction. One
/// subscription is deleted: its delivery is dead-lettered with the reason, and the card
/// never reaches that subscriber (before, the delivery went out with the raw body once
/// its subscription, and so its transformation, was gone). The other has its
/// transformation cleared by a PATCH, the operator's choice: its delivery goes as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delivery_made_with_a_transformation_is_never_sent_untransformed_after_its_subscription_is_deleted() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let redact = "function handler(w) { delete w.payload.card; return w.payload; }";
    let mut made = Vec::new();
    for _ in 0..2 {
        let sink = Sink::ok().await;
        let endpoint = app.admin_post("/v1/endpoints", json!({"url": sink.url("/")}), 201).await;
        let endpoint = endpoint["id"].as_str().unwrap().to_owned();
        let sub = json!({"endpoint_id": endpoint, "source": "shop", "transform": redact});
        let subscription = app.admin_post("/v1/subscriptions", sub, 201).await["id"].as_str().unwrap().to_owned();
        app.admin_post(&format!("/v1/endpoints/{endpoint}/pause"), json!({}), 200).await;
        made.push((sink, endpoint, subscription));
    }
    let (status, _) =
        app.ingest("shop", "ch-1", "charge.succeeded", r#"{"id": "ch_1", "card": "4242424242424242"}"#).await;
    assert_eq!(status, 200);
    let (deleted, cleared) = (&made[0], &made[1]);
    let (status, _) = app.admin(reqwest::Method::DELETE, &format!("/v1/subscriptions/{}", deleted.2), None).await;
    assert_eq!(status, 204);
    let patch = Some(json!({"transform": null}));
    let (status, body) = app.admin(reqwest::Method::PATCH, &format!("/v1/subscriptions/{}", cleared.2), patch).await;
    assert_eq!(status, 200, "{body}");
    for (_, endpoint, _) in &made {
        app.admin_post(&format!("/v1/endpoints/{endpoint}/resume"), json!({}), 200).await;
    }
    eventually(Duration::from_secs(30), "the cleared one delivered, the deleted one dead", || async {
        (cleared.0.count() == 1 && count_status(&app.db.pool, "dead").await == 1).then_some(())
    })
    .await;
    assert_eq!(deleted.0.count(), 0, "nothing sent untransformed");
    let dead = app.admin_get(&format!("/v1/deliveries?endpoint_id={}&status=dead", deleted.1)).await;
    let reason = dead["data"][0]["dead_reason"].as_str().unwrap_or_default().to_owned();
    assert!(reason.contains("not sent untransformed"), "{reason}");
    assert!(cleared.0.received()[0].body.ends_with(b"\"card\": \"4242424242424242\"}"), "the operator cleared it");
}

/// Trying a transformation whose result is nested deeper than a JSON parse here takes
/// (128 levels) shows that result, as the worker sends it. Before: 500.
#[tokio::test]
async fn a_tried_transformation_s_deeply_nested_result_is_shown() {
    let app = TestApp::spawn().await;
    let script = "function handler(w) { let v = 1; for (let i = 0; i < 200; i++) v = [v]; return v; }";
    let tried = json!({"transform": script, "event": {"payload": {}}});
    let answer = app
        .http
        .post(app.url("/v1/transforms/test"))
        .bearer_auth(crate::support::ADMIN_TOKEN)
        .json(&tried)
        .send()
        .await
        .expect("try");
    assert_eq!(answer.status(), 200);
    // Read as text: a parse here stops at 128 levels too.
    let text = answer.text().await.expect("answer");
    let nested = format!("{}1{}", "[".repeat(200), "]".repeat(200));
    assert!(text.replace(' ', "").contains(&format!("\"body\":{nested}")), "{text}");
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

/// Arbitrary JSON: every kind of value, strings of any characters (escapes, emoji,
/// control characters), integers beyond JavaScript's exact range, floats, nested a few
/// levels.
fn any_json() -> impl proptest::strategy::Strategy<Value = Value> {
    use proptest::prelude::*;
    let text = || proptest::string::string_regex("(?s).{0,12}").expect("regex");
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter("JSON holds finite numbers", |f| f.is_finite()).prop_map(Value::from),
        text().prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 48, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(text(), inner, 0..6).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Two JSON values that JavaScript sees as the same: numbers compared as the doubles
/// JavaScript holds them in (an integer beyond 2^53 arrives rounded, as in any
/// JavaScript consumer), objects as key sets (JavaScript orders integer-like keys first).
fn same_in_javascript(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_in_javascript(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_in_javascript(v, w)))
        }
        _ => a == b,
    }
}

/// The class, over generated webhooks (JSON of every shape, and bodies that are not
/// JSON): what the subscriber receives is what the handler returned, byte for byte what
/// the attempt log says was sent, and its signature verifies with the official Standard
/// Webhooks library (`standardwebhooks`, by the specification's authors). A body that is
/// not JSON reaches the handler as `payload: null`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn generated_webhooks_arrive_as_the_handler_returned_them_and_verify() {
    use proptest::strategy::{Strategy, ValueTree};
    let cases: usize = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(40);
    let mut runner = proptest::test_runner::TestRunner::default();
    let strategy = any_json();
    let mut bodies: Vec<(String, Value)> = (0..cases)
        .map(|_| {
            let payload = strategy.new_tree(&mut runner).expect("a generated payload").current();
            (serde_json::to_string(&payload).expect("serializable"), payload)
        })
        .collect();
    for text in ["not json at all", "{\"unterminated\": ", "<xml>1</xml>", "\u{1F600} plain text"] {
        bodies.push((text.to_owned(), Value::Null));
    }

    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let sink = Sink::ok().await;
    let echo = "function handler(w) { return {echo: w.payload, type: w.type, source: w.source}; }";
    let (endpoint_id, secret) = transformed_endpoint(&app, &sink, Some(echo)).await;
    for (i, (body, _)) in bodies.iter().enumerate() {
        let (status, answer) = app.ingest("shop", &format!("gen-{i}"), &format!("gen.{i}"), body).await;
        assert_eq!(status, 200, "{body:?}: {answer}");
    }
    eventually(Duration::from_secs(60), "every generated webhook delivered", || async {
        (sink.count() >= bodies.len()).then_some(())
    })
    .await;

    let verifier = standardwebhooks::Webhook::new(&secret).expect("the endpoint's secret");
    let listed = app.admin_get(&format!("/v1/deliveries?endpoint_id={endpoint_id}&limit=200")).await;
    let delivery_ids: std::collections::HashMap<String, String> = listed["data"]
        .as_array()
        .expect("deliveries")
        .iter()
        .map(|d| {
            (d["webhook_id"].as_str().unwrap_or_default().to_owned(), d["id"].as_str().unwrap_or_default().to_owned())
        })
        .collect();
    let mut compared_with_the_log = 0;
    for got in sink.received() {
        let sent: Value = serde_json::from_slice(&got.body).expect("a transformed body is JSON");
        let i: usize =
            sent["type"].as_str().and_then(|t| t.strip_prefix("gen.")).and_then(|n| n.parse().ok()).expect("type");
        let (body, payload) = &bodies[i];
        assert!(same_in_javascript(&sent["echo"], payload), "payload {body}\nreceived {sent}");
        assert_eq!(sent["source"], "shop");
        assert_eq!(got.header("content-type"), "application/json");
        verifier.verify(&got.body, &got.headers).unwrap_or_else(|e| panic!("signature of {body}: {e:?}"));

        let id = delivery_ids.get(&got.header("webhook-id")).expect("the request's webhook-id is a delivery's");
        let attempts = eventually(Duration::from_secs(30), "the attempt recorded", || async {
            let a = app.admin_get(&format!("/v1/deliveries/{id}/attempts")).await;
            a["data"].as_array().is_some_and(|a| !a.is_empty()).then_some(a)
        })
        .await;
        if got.body.len() < 4096 {
            assert_eq!(attempts["data"][0]["sent_excerpt"].as_str().map(str::as_bytes), Some(&got.body[..]), "{body}");
            compared_with_the_log += 1;
        }
    }
    assert!(compared_with_the_log >= bodies.len() / 2, "only {compared_with_the_log} bodies compared with the log");
}
