//! Verified sources through HTTP: each provider kind created with `POST /v1/sources`, then
//! real signed webhooks posted to `/ingest/{name}`.
//!
//! Signatures are computed for "now" by `support::signing`, an implementation independent
//! of `src/verify`.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use webhook_gateway::ingest::rejections;

use crate::support::TestApp;
use crate::support::signing::{
    github_header, hmac_sha256, hmac_sha512, now, shopify_header, slack_header, standard_entry, stripe_header, whsec,
};

/// `sha256:` and the first 8 hex digits of the secret's SHA-256, as the README documents
/// (`printf %s "$SECRET" | sha256sum | cut -c1-8`).
fn fingerprint(secret: &str) -> String {
    format!("sha256:{}", &hex::encode(Sha256::digest(secret.as_bytes()))[..8])
}

// ---------------------------------------------------------------------------------------
// HTTP helpers.

type Headers = Vec<(&'static str, String)>;

/// POST a webhook with exactly these headers (plus a JSON content type).
async fn post(app: &TestApp, source: &str, headers: &Headers, body: &str) -> (u16, Value) {
    let mut req = app
        .http
        .post(app.url(&format!("/ingest/{source}")))
        .header("content-type", "application/json")
        .body(body.to_owned());
    for (name, value) in headers {
        req = req.header(*name, value);
    }
    let resp = req.send().await.expect("ingest request");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// POST a webhook that must be stored as a new event; returns the event as
/// `GET /v1/events/{id}` shows it.
async fn accepted_new(app: &TestApp, source: &str, headers: &Headers, body: &str) -> Value {
    let (status, answer) = post(app, source, headers, body).await;
    assert_eq!(status, 200, "{source}: {answer}");
    assert_eq!(answer["duplicate"], json!(false), "{source}: {answer}");
    let event_id = answer["event_id"].as_str().expect("event_id");
    let event = app.admin_get(&format!("/v1/events/{event_id}")).await;
    assert_eq!(event["id"], answer["event_id"]);
    assert_eq!(event["source"], source);
    assert_eq!(event["payload"], serde_json::from_str::<Value>(body).expect("test bodies are JSON"));
    event
}

/// POST a webhook that must be answered as a duplicate of `original`.
async fn accepted_duplicate(app: &TestApp, source: &str, headers: &Headers, body: &str, original: &Value) {
    let events = app.db.count("events").await;
    let (status, answer) = post(app, source, headers, body).await;
    assert_eq!(status, 200, "{source}: {answer}");
    assert_eq!(answer["duplicate"], json!(true), "{source}: {answer}");
    assert_eq!(answer["event_id"], original["id"], "a duplicate names the original event");
    assert_eq!(app.db.count("events").await, events, "a duplicate stores nothing");
}

/// POST a webhook that must be refused with `status` and `code`, storing nothing.
async fn refused(app: &TestApp, source: &str, what: &str, headers: &Headers, body: &str, status: u16, code: &str) {
    let (events, deliveries) = (app.db.count("events").await, app.db.count("deliveries").await);
    let (got, answer) = post(app, source, headers, body).await;
    assert_eq!((got, answer["error"]["code"].as_str()), (status, Some(code)), "{source}, {what}: {answer}");
    assert!(answer["error"]["message"].is_string(), "{answer}");
    assert_eq!(app.db.count("events").await, events, "{source}, {what}: nothing stored");
    assert_eq!(app.db.count("deliveries").await, deliveries, "{source}, {what}: nothing stored");
}

/// 401 with `code`, nothing stored.
async fn unauthorized(app: &TestApp, source: &str, what: &str, headers: &Headers, body: &str, code: &str) {
    refused(app, source, what, headers, body, 401, code).await;
}

/// `headers` without the named one.
fn without(headers: &Headers, name: &str) -> Headers {
    headers.iter().filter(|(n, _)| !n.eq_ignore_ascii_case(name)).cloned().collect()
}

/// `headers` with the named one's value replaced.
fn with(headers: &Headers, name: &'static str, value: String) -> Headers {
    let mut out = without(headers, name);
    out.push((name, value));
    out
}

async fn create_source(app: &TestApp, spec: Value) -> Value {
    app.admin_post("/v1/sources", spec, 201).await
}

// ---------------------------------------------------------------------------------------
// Stripe.

const STRIPE_SECRET: &str = "whsec_it_stripe_0123456789abcdef";

fn stripe_body(id: &str) -> String {
    format!(r#"{{"id":"{id}","object":"event","type":"payment_intent.succeeded","data":{{"object":{{"id":"pi_1"}}}}}}"#)
}

#[tokio::test]
async fn stripe_verifies_deduplicates_on_the_event_id_and_refuses_forgeries() {
    let app = TestApp::ingest_only().await;
    let created = create_source(&app, json!({"name": "stripe", "kind": "stripe", "secrets": [STRIPE_SECRET]})).await;
    assert_eq!(created["ingest_path"], "/ingest/stripe");
    let body = stripe_body("evt_1PqRsT2eZvKYlo2C");
    let signed =
        |secret: &str, ts: i64, body: &str| -> Headers { vec![("Stripe-Signature", stripe_header(secret, ts, body))] };

    let event = accepted_new(&app, "stripe", &signed(STRIPE_SECRET, now(), &body), &body).await;
    assert_eq!(event["dedupe_key"], "evt_1PqRsT2eZvKYlo2C");
    assert_eq!(event["event_type"], "payment_intent.succeeded");
    assert_eq!(event["headers"]["stripe-signature"], "[redacted]");

    // Stripe's retry re-signs with a new timestamp: still the same event.
    accepted_duplicate(&app, "stripe", &signed(STRIPE_SECRET, now() - 30, &body), &body, &event).await;

    let good = signed(STRIPE_SECRET, now(), &body);
    let sig_hex = hex::encode(hmac_sha256(STRIPE_SECRET.as_bytes(), format!("{}.{body}", now()).as_bytes()));
    let other = stripe_body("evt_forged");
    let cases: Vec<(&str, Headers, &str, &str)> = vec![
        ("wrong secret", signed("whsec_not_the_secret", now(), &other), &other, "invalid_signature"),
        ("tampered body", good.clone(), &other, "invalid_signature"),
        ("no t=", vec![("Stripe-Signature", format!("v1={sig_hex}"))], &body, "invalid_signature"),
        ("GitHub format", vec![("Stripe-Signature", format!("sha256={sig_hex}"))], &body, "invalid_signature"),
        ("missing header", vec![], &other, "missing_signature"),
        ("stale", signed(STRIPE_SECRET, now() - 600, &other), &other, "timestamp_out_of_tolerance"),
        ("future", signed(STRIPE_SECRET, now() + 600, &other), &other, "timestamp_out_of_tolerance"),
    ];
    for (what, headers, body, code) in &cases {
        unauthorized(&app, "stripe", what, headers, body, code).await;
    }
    assert_eq!(app.db.count("events").await, 1);
}

#[tokio::test]
async fn stripe_event_without_an_id_is_400_and_stores_nothing() {
    let app = TestApp::ingest_only().await;
    create_source(&app, json!({"name": "stripe", "kind": "stripe", "secrets": [STRIPE_SECRET]})).await;
    let body = r#"{"object":"event","type":"charge.succeeded"}"#;
    let headers = vec![("Stripe-Signature", stripe_header(STRIPE_SECRET, now(), body))];
    refused(&app, "stripe", "no id", &headers, body, 400, "malformed_body").await;
    assert_eq!(app.db.count("events").await, 0);
}

#[tokio::test]
async fn stripe_rotation_accepts_either_secret_and_the_tolerance_is_configurable() {
    let app = TestApp::ingest_only().await;
    let (old, new) = ("whsec_it_rotation_old", "whsec_it_rotation_new");
    create_source(&app, json!({"name": "pay", "kind": "stripe", "secrets": [old, new], "tolerance_secs": 60})).await;

    for (i, secret) in [old, new].into_iter().enumerate() {
        let body = stripe_body(&format!("evt_rot_{i}"));
        let headers = vec![("Stripe-Signature", stripe_header(secret, now(), &body))];
        let event = accepted_new(&app, "pay", &headers, &body).await;
        assert_eq!(event["dedupe_key"], format!("evt_rot_{i}"));
    }
    // While Stripe rolls a secret it sends one v1 per secret in one header.
    let body = stripe_body("evt_rot_both");
    let ts = now();
    let other_v1 = stripe_header("whsec_some_other_endpoint", ts, &body);
    let both = format!("{},v1={}", stripe_header(new, ts, &body), other_v1.split_once(",v1=").expect("v1").1);
    accepted_new(&app, "pay", &vec![("Stripe-Signature", both)], &body).await;

    let body = stripe_body("evt_rot_third");
    let third = vec![("Stripe-Signature", stripe_header("whsec_it_rotation_third", now(), &body))];
    unauthorized(&app, "pay", "a third secret", &third, &body, "invalid_signature").await;
    // 120 s old: inside the default 300 s, outside this source's 60 s.
    let late = vec![("Stripe-Signature", stripe_header(new, now() - 120, &body))];
    unauthorized(&app, "pay", "outside 60 s", &late, &body, "timestamp_out_of_tolerance").await;
    assert_eq!(app.db.count("events").await, 3);
}

// ---------------------------------------------------------------------------------------
// GitHub.

const GITHUB_SECRET: &str = "it-github-secret-It's a Secret";

fn github_request(secret: &str, event: &str, delivery: &str, body: &str) -> Headers {
    vec![
        ("X-Hub-Signature-256", github_header(secret, body)),
        ("X-GitHub-Event", event.to_owned()),
        ("X-GitHub-Delivery", delivery.to_owned()),
    ]
}

#[tokio::test]
async fn github_verifies_deduplicates_on_the_delivery_and_refuses_forgeries() {
    let app = TestApp::ingest_only().await;
    let second_secret = "it-github-second-secret";
    create_source(&app, json!({"name": "gh", "kind": "github", "secrets": [GITHUB_SECRET, second_secret]})).await;
    let body = r#"{"action":"opened","number":7,"pull_request":{"title":"Fix"}}"#;
    let delivery = "72d3162e-cc78-11e3-81ab-4c9367dc0958";
    let good = github_request(GITHUB_SECRET, "pull_request", delivery, body);

    let event = accepted_new(&app, "gh", &good, body).await;
    assert_eq!(event["dedupe_key"], delivery);
    assert_eq!(event["event_type"], "pull_request.opened");
    assert_eq!(event["headers"]["x-hub-signature-256"], "[redacted]");
    assert_eq!(event["headers"]["x-github-delivery"], delivery);
    // A redelivery keeps X-GitHub-Delivery.
    accepted_duplicate(&app, "gh", &good, body, &event).await;
    // Rotation: the second secret works too.
    let push = r#"{"ref":"refs/heads/main"}"#;
    let event = accepted_new(&app, "gh", &github_request(second_secret, "push", "d-push", push), push).await;
    assert_eq!((event["dedupe_key"].as_str(), event["event_type"].as_str()), (Some("d-push"), Some("push")));

    let other = r#"{"action":"closed","number":8}"#;
    let bare_hex = hex::encode(hmac_sha256(GITHUB_SECRET.as_bytes(), other.as_bytes()));
    let fresh = github_request(GITHUB_SECRET, "pull_request", "d-new", other);
    let cases: Vec<(&str, Headers, &str, &str)> = vec![
        ("wrong secret", github_request("not-the-secret", "pull_request", "d-new", other), other, "invalid_signature"),
        ("tampered body", fresh.clone(), r#"{"action":"closed","number":9}"#, "invalid_signature"),
        ("no sha256= prefix", with(&fresh, "X-Hub-Signature-256", bare_hex.clone()), other, "invalid_signature"),
        ("sha1= prefix", with(&fresh, "X-Hub-Signature-256", format!("sha1={bare_hex}")), other, "invalid_signature"),
        ("missing header", without(&fresh, "X-Hub-Signature-256"), other, "missing_signature"),
        (
            "only the legacy SHA-1 header",
            with(&without(&fresh, "X-Hub-Signature-256"), "X-Hub-Signature", format!("sha1={bare_hex}")),
            other,
            "missing_signature",
        ),
    ];
    for (what, headers, body, code) in &cases {
        unauthorized(&app, "gh", what, headers, body, code).await;
    }
    assert_eq!(app.db.count("events").await, 2);
}

/// The event type (`X-GitHub-Event` + the body's `action`) is what subscriptions match.
#[tokio::test]
async fn github_event_types_feed_subscription_matching() {
    let app = TestApp::ingest_only().await;
    create_source(&app, json!({"name": "gh", "kind": "github", "secrets": [GITHUB_SECRET]})).await;
    let endpoint = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/prs"}), 201).await;
    let endpoint_id = endpoint["id"].as_str().expect("endpoint id").to_owned();
    app.admin_post(
        "/v1/subscriptions",
        json!({"endpoint_id": endpoint_id, "source": "gh", "event_types": ["pull_request.*"]}),
        201,
    )
    .await;

    let cases = [
        ("pull_request", r#"{"action":"opened","number":1}"#, "pull_request.opened", 1),
        ("pull_request", r#"{"action":"closed","number":1}"#, "pull_request.closed", 1),
        ("push", r#"{"ref":"refs/heads/main"}"#, "push", 0),
        ("issues", r#"{"action":"opened","issue":{"number":2}}"#, "issues.opened", 0),
        // No action: the type is the bare header, which `pull_request.*` does not match.
        ("pull_request", r#"{"number":3}"#, "pull_request", 0),
    ];
    for (i, (event_header, body, expected_type, expected_deliveries)) in cases.into_iter().enumerate() {
        let headers = github_request(GITHUB_SECRET, event_header, &format!("delivery-{i}"), body);
        let event = accepted_new(&app, "gh", &headers, body).await;
        assert_eq!(event["event_type"], expected_type);
        let endpoints: Vec<String> =
            sqlx::query_scalar("SELECT endpoint_id::text FROM deliveries WHERE event_id = $1::uuid")
                .bind(event["id"].as_str().expect("id"))
                .fetch_all(&app.db.pool)
                .await
                .expect("deliveries");
        let expected: Vec<String> = vec![endpoint_id.clone(); expected_deliveries];
        assert_eq!(endpoints, expected, "{expected_type}");
    }
}

// ---------------------------------------------------------------------------------------
// Shopify.

const SHOPIFY_SECRET: &str = "it-shopify-client-secret";

fn shopify_request(secret: &str, webhook_id: &str, event_id: &str, body: &str) -> Headers {
    vec![
        ("X-Shopify-Hmac-Sha256", shopify_header(secret, body)),
        ("X-Shopify-Topic", "orders/create".to_owned()),
        ("X-Shopify-Webhook-Id", webhook_id.to_owned()),
        ("X-Shopify-Event-Id", event_id.to_owned()),
        ("X-Shopify-Shop-Domain", "example.myshopify.com".to_owned()),
    ]
}

#[tokio::test]
async fn shopify_verifies_deduplicates_on_the_webhook_id_and_refuses_forgeries() {
    let app = TestApp::ingest_only().await;
    let rotated = "it-shopify-rotated-secret";
    create_source(&app, json!({"name": "shop", "kind": "shopify", "secrets": [SHOPIFY_SECRET, rotated]})).await;
    let body = r#"{"id":820982911946154508,"email":"jon@example.com"}"#;
    let event_id = "98880550-7158-44d4-b7cd-2c97c8a091b5";

    let first = shopify_request(SHOPIFY_SECRET, "webhook-a", event_id, body);
    let a = accepted_new(&app, "shop", &first, body).await;
    assert_eq!(a["dedupe_key"], "webhook-a");
    assert_eq!(a["event_type"], "orders/create");
    assert_eq!(a["headers"]["x-shopify-hmac-sha256"], "[redacted]");
    // Shopify's retry of that delivery keeps its webhook id.
    accepted_duplicate(&app, "shop", &first, body, &a).await;
    // A second subscription's delivery of the same event: same event id, its own webhook
    // id, signed with the rotated secret. Both are kept.
    let b = accepted_new(&app, "shop", &shopify_request(rotated, "webhook-b", event_id, body), body).await;
    assert_eq!(b["dedupe_key"], "webhook-b");
    assert_ne!(a["id"], b["id"]);
    assert_eq!(app.db.count("events").await, 2);

    let other = r#"{"id":1,"email":"eve@example.com"}"#;
    let fresh = shopify_request(SHOPIFY_SECRET, "webhook-c", event_id, other);
    let hex_mac = hex::encode(hmac_sha256(SHOPIFY_SECRET.as_bytes(), other.as_bytes()));
    let b64_mac = shopify_header(SHOPIFY_SECRET, other);
    let cases: Vec<(&str, Headers, &str, &str)> = vec![
        ("wrong secret", shopify_request("wrong", "webhook-c", event_id, other), other, "invalid_signature"),
        ("tampered body", fresh.clone(), r#"{"id":1,"email":"mallory@example.com"}"#, "invalid_signature"),
        ("hex, not base64", with(&fresh, "X-Shopify-Hmac-Sha256", hex_mac), other, "invalid_signature"),
        ("prefixed", with(&fresh, "X-Shopify-Hmac-Sha256", format!("sha256={b64_mac}")), other, "invalid_signature"),
        ("missing header", without(&fresh, "X-Shopify-Hmac-Sha256"), other, "missing_signature"),
    ];
    for (what, headers, body, code) in &cases {
        unauthorized(&app, "shop", what, headers, body, code).await;
    }
    assert_eq!(app.db.count("events").await, 2);
}

// ---------------------------------------------------------------------------------------
// Slack.

const SLACK_SECRET: &str = "8f742231b10e8888abcd99yyyzzz85a5";

fn slack_request(secret: &str, ts: i64, body: &str) -> Headers {
    vec![("X-Slack-Signature", slack_header(secret, ts, body)), ("X-Slack-Request-Timestamp", ts.to_string())]
}

#[tokio::test]
async fn slack_verifies_deduplicates_on_the_event_id_and_refuses_forgeries() {
    let app = TestApp::ingest_only().await;
    let second = "it-second-slack-signing-secret";
    create_source(&app, json!({"name": "slack", "kind": "slack", "secrets": [SLACK_SECRET, second]})).await;
    let body = r#"{"type":"event_callback","event_id":"Ev08MFMKH6","event":{"type":"app_mention","text":"hi"}}"#;

    let event = accepted_new(&app, "slack", &slack_request(SLACK_SECRET, now(), body), body).await;
    assert_eq!(event["dedupe_key"], "Ev08MFMKH6");
    assert_eq!(event["event_type"], "app_mention");
    assert_eq!(event["headers"]["x-slack-signature"], "[redacted]");
    // Slack's retry: a new timestamp and signature, X-Slack-Retry-Num, the same event_id.
    let mut retry = slack_request(second, now() - 20, body);
    retry.push(("X-Slack-Retry-Num", "1".to_owned()));
    accepted_duplicate(&app, "slack", &retry, body, &event).await;

    let other = r#"{"type":"event_callback","event_id":"Ev0FORGED","event":{"type":"message"}}"#;
    let ts = now();
    let fresh = slack_request(SLACK_SECRET, ts, other);
    let bare = hex::encode(hmac_sha256(SLACK_SECRET.as_bytes(), format!("v0:{ts}:{other}").as_bytes()));
    let cases: Vec<(&str, Headers, &str, &str)> = vec![
        ("wrong secret", slack_request("wrong", ts, other), other, "invalid_signature"),
        ("tampered body", fresh.clone(), &other[..other.len() - 1], "invalid_signature"),
        (
            "timestamp moved",
            with(&fresh, "X-Slack-Request-Timestamp", (ts - 1).to_string()),
            other,
            "invalid_signature",
        ),
        ("v1= prefix", with(&fresh, "X-Slack-Signature", format!("v1={bare}")), other, "invalid_signature"),
        ("missing signature", without(&fresh, "X-Slack-Signature"), other, "missing_signature"),
        ("missing timestamp", without(&fresh, "X-Slack-Request-Timestamp"), other, "missing_signature"),
        ("stale", slack_request(SLACK_SECRET, now() - 600, other), other, "timestamp_out_of_tolerance"),
        ("future", slack_request(SLACK_SECRET, now() + 600, other), other, "timestamp_out_of_tolerance"),
    ];
    for (what, headers, body, code) in &cases {
        unauthorized(&app, "slack", what, headers, body, code).await;
    }
    // An event_callback without event_id cannot be deduplicated across Slack's retries.
    let no_id = r#"{"type":"event_callback","event":{"type":"app_mention"}}"#;
    refused(&app, "slack", "no event_id", &slack_request(SLACK_SECRET, now(), no_id), no_id, 400, "malformed_body")
        .await;
    assert_eq!(app.db.count("events").await, 1);
}

#[tokio::test]
async fn slack_url_verification_is_answered_with_the_challenge_and_not_stored() {
    let app = TestApp::ingest_only().await;
    create_source(&app, json!({"name": "slack", "kind": "slack", "secrets": [SLACK_SECRET]})).await;
    app.endpoint_for("http://127.0.0.1:9/all", None).await;
    let body = r#"{"token":"Jhj5dZrVaK7ZwHHjRyZWjbDl","challenge":"3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P","type":"url_verification"}"#;

    let (status, answer) = post(&app, "slack", &slack_request(SLACK_SECRET, now(), body), body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer, json!({"challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"}));
    assert_eq!(app.db.count("events").await, 0);
    assert_eq!(app.db.count("deliveries").await, 0);

    // Nobody can use the gateway to claim a URL without the signing secret.
    unauthorized(&app, "slack", "forged handshake", &slack_request("wrong", now(), body), body, "invalid_signature")
        .await;
    let stale = slack_request(SLACK_SECRET, now() - 600, body);
    unauthorized(&app, "slack", "stale handshake", &stale, body, "timestamp_out_of_tolerance").await;
}

// ---------------------------------------------------------------------------------------
// Standard Webhooks.

fn standard_request(secret: &str, id: &str, ts: i64, body: &str) -> Headers {
    vec![
        ("webhook-id", id.to_owned()),
        ("webhook-timestamp", ts.to_string()),
        ("webhook-signature", standard_entry(secret, id, ts, body)),
    ]
}

#[tokio::test]
async fn standard_webhooks_verifies_deduplicates_on_webhook_id_and_refuses_forgeries() {
    let app = TestApp::ingest_only().await;
    let (key_a, key_b) = (whsec(b"integration-test-key-a-0123456789"), whsec(b"integration-test-key-b-0123456789"));
    create_source(&app, json!({"name": "vendor", "kind": "standard-webhooks", "secrets": [key_a, key_b]})).await;
    let body = r#"{"type":"user.created","timestamp":"2024-01-01T00:00:00Z","data":{"id":"u_1"}}"#;
    let id = "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W";

    let event = accepted_new(&app, "vendor", &standard_request(&key_a, id, now(), body), body).await;
    assert_eq!(event["dedupe_key"], id);
    assert_eq!(event["event_type"], "user.created");
    assert_eq!(event["headers"]["webhook-signature"], "[redacted]");
    // A retry is re-signed at a new time (here with the other key) but keeps webhook-id.
    accepted_duplicate(&app, "vendor", &standard_request(&key_b, id, now() - 10, body), body, &event).await;
    // A sender mid-rotation lists one entry per key; one matching entry is enough.
    let ts = now();
    let list = format!(
        "{} {}",
        standard_entry(&whsec(b"a key this source does not have"), "msg_list", ts, body),
        standard_entry(&key_b, "msg_list", ts, body)
    );
    let listed =
        vec![("webhook-id", "msg_list".to_owned()), ("webhook-timestamp", ts.to_string()), ("webhook-signature", list)];
    assert_eq!(accepted_new(&app, "vendor", &listed, body).await["dedupe_key"], "msg_list");

    let other = r#"{"type":"user.deleted","data":{"id":"u_2"}}"#;
    let ts = now();
    let fresh = standard_request(&key_a, "msg_new", ts, other);
    let entry = standard_entry(&key_a, "msg_new", ts, other);
    let cases: Vec<(&str, Headers, &str, &str)> = vec![
        ("wrong secret", standard_request(&whsec(b"wrong key"), "msg_new", ts, other), other, "invalid_signature"),
        ("tampered body", fresh.clone(), r#"{"type":"user.deleted","data":{"id":"u_3"}}"#, "invalid_signature"),
        ("id changed", with(&fresh, "webhook-id", "msg_other".to_owned()), other, "invalid_signature"),
        (
            "v1= instead of v1,",
            with(&fresh, "webhook-signature", entry.replacen(',', "=", 1)),
            other,
            "invalid_signature",
        ),
        ("missing signature", without(&fresh, "webhook-signature"), other, "missing_signature"),
        ("missing id", without(&fresh, "webhook-id"), other, "missing_signature"),
        ("missing timestamp", without(&fresh, "webhook-timestamp"), other, "missing_signature"),
        ("stale", standard_request(&key_a, "msg_new", now() - 600, other), other, "timestamp_out_of_tolerance"),
        ("future", standard_request(&key_a, "msg_new", now() + 600, other), other, "timestamp_out_of_tolerance"),
    ];
    for (what, headers, body, code) in &cases {
        unauthorized(&app, "vendor", what, headers, body, code).await;
    }
    assert_eq!(app.db.count("events").await, 2);
}

// ---------------------------------------------------------------------------------------
// Generic HMAC.

#[tokio::test]
async fn hmac_kind_verifies_with_its_configured_scheme_and_refuses_forgeries() {
    let app = TestApp::ingest_only().await;
    let (secret, rotated) = ("it-shared-secret", "it-shared-secret-2");
    create_source(
        &app,
        json!({"name": "billing", "kind": "hmac", "secrets": [secret, rotated],
               "hmac": {"header": "X-Signature", "algorithm": "sha512", "encoding": "base64", "prefix": "sha512="},
               "dedupe": {"header": "X-Request-Id"}, "event_type": {"json_pointer": "/kind"}}),
    )
    .await;
    let sign =
        |secret: &str, body: &str| format!("sha512={}", BASE64.encode(hmac_sha512(secret.as_bytes(), body.as_bytes())));
    let request = |secret: &str, request_id: &str, body: &str| -> Headers {
        vec![("X-Signature", sign(secret, body)), ("X-Request-Id", request_id.to_owned())]
    };
    let body = r#"{"kind":"order.paid","id":"ord_42"}"#;

    let event = accepted_new(&app, "billing", &request(secret, "req-1", body), body).await;
    assert_eq!(event["dedupe_key"], "req-1");
    assert_eq!(event["event_type"], "order.paid");
    assert_eq!(event["headers"]["x-signature"], "[redacted]");
    accepted_duplicate(&app, "billing", &request(rotated, "req-1", body), body, &event).await;
    let second = accepted_new(&app, "billing", &request(rotated, "req-2", body), body).await;
    assert_eq!(second["dedupe_key"], "req-2");

    let other = r#"{"kind":"order.refunded","id":"ord_43"}"#;
    let fresh = request(secret, "req-3", other);
    let b64 = BASE64.encode(hmac_sha512(secret.as_bytes(), other.as_bytes()));
    let sha256 = format!("sha512={}", BASE64.encode(hmac_sha256(secret.as_bytes(), other.as_bytes())));
    let cases: Vec<(&str, Headers, &str, &str)> = vec![
        ("wrong secret", request("wrong", "req-3", other), other, "invalid_signature"),
        ("tampered body", fresh.clone(), r#"{"kind":"order.refunded","id":"ord_44"}"#, "invalid_signature"),
        ("no prefix", with(&fresh, "X-Signature", b64), other, "invalid_signature"),
        ("SHA-256 MAC", with(&fresh, "X-Signature", sha256), other, "invalid_signature"),
        ("missing header", without(&fresh, "X-Signature"), other, "missing_signature"),
    ];
    for (what, headers, body, code) in &cases {
        unauthorized(&app, "billing", what, headers, body, code).await;
    }
    assert_eq!(app.db.count("events").await, 2);
}

/// A custom signature header whose name says nothing about signatures is still kept out
/// of storage, and without a dedupe locator the body hash deduplicates.
#[tokio::test]
async fn hmac_kind_redacts_a_custom_signature_header_and_falls_back_to_the_body_hash() {
    let app = TestApp::ingest_only().await;
    let secret = "it-hook-secret";
    create_source(
        &app,
        json!({"name": "hooks", "kind": "hmac", "secrets": [secret], "hmac": {"header": "X-Hook-Sig"}}),
    )
    .await;
    let body = r#"{"kind":"x"}"#;
    let mac = hex::encode(hmac_sha256(secret.as_bytes(), body.as_bytes()));
    let headers = vec![("X-Hook-Sig", mac.clone())];
    let event = accepted_new(&app, "hooks", &headers, body).await;
    assert_eq!(event["headers"]["x-hook-sig"], "[redacted]");
    assert!(!event.to_string().contains(&mac), "the signature is not stored: {event}");
    assert_eq!(event["dedupe_key"], format!("sha256:{}", hex::encode(Sha256::digest(body.as_bytes()))));
    assert_eq!(event["event_type"], "unknown");
    // Hex in either case.
    accepted_duplicate(&app, "hooks", &vec![("X-Hook-Sig", mac.to_uppercase())], body, &event).await;
}

// ---------------------------------------------------------------------------------------
// Across kinds.

/// Secrets go in through `POST /v1/sources` and never come out: every answer shows
/// fingerprints that an operator can compute from the secret, and nothing else of it.
#[tokio::test]
async fn secrets_are_never_returned_by_the_api() {
    let app = TestApp::ingest_only().await;
    let standard = whsec(b"standard-webhooks-secret-key-xyz");
    let specs = [
        json!({"name": "s-stripe", "kind": "stripe", "secrets": ["whsec_it_secret_stripe_AAAA", "whsec_it_secret_stripe_BBBB"]}),
        json!({"name": "s-github", "kind": "github", "secrets": ["it-secret-github-CCCC"]}),
        json!({"name": "s-shopify", "kind": "shopify", "secrets": ["it-secret-shopify-DDDD"]}),
        json!({"name": "s-slack", "kind": "slack", "secrets": ["it-secret-slack-EEEE"]}),
        json!({"name": "s-standard", "kind": "standard-webhooks", "secrets": [standard]}),
        json!({"name": "s-hmac", "kind": "hmac", "secrets": ["it-secret-hmac-FFFF"], "hmac": {"header": "X-Sig"}}),
    ];
    let all_secrets: Vec<String> = specs
        .iter()
        .flat_map(|s| s["secrets"].as_array().expect("secrets").iter().map(|v| v.as_str().expect("str").to_owned()))
        .collect();
    let leaks = |text: &str| -> Vec<String> {
        // The distinctive tails too, so a truncated or re-encoded secret is caught.
        all_secrets.iter().filter(|s| text.contains(s.as_str()) || text.contains(&s[s.len() - 12..])).cloned().collect()
    };

    for spec in &specs {
        let created = create_source(&app, spec.clone()).await;
        let secrets: Vec<&str> =
            spec["secrets"].as_array().expect("secrets").iter().filter_map(Value::as_str).collect();
        let expected: Vec<String> = secrets.iter().map(|s| fingerprint(s)).collect();
        assert_eq!(created["kind"], spec["kind"]);
        assert_eq!(created["secret_fingerprints"], json!(expected), "{created}");
        assert!(created.get("secrets").is_none(), "{created}");
        assert_eq!(leaks(&created.to_string()), Vec::<String>::new(), "POST answer: {created}");

        let id = created["id"].as_str().expect("id");
        let fetched = app.admin_get(&format!("/v1/sources/{id}")).await;
        assert_eq!(fetched["secret_fingerprints"], json!(expected), "{fetched}");
        assert_eq!(fetched["name"], spec["name"]);
        assert!(fetched.get("secrets").is_none(), "{fetched}");
        assert_eq!(leaks(&fetched.to_string()), Vec::<String>::new(), "GET answer: {fetched}");
    }
    let listed = app.admin_get("/v1/sources").await;
    assert_eq!(
        listed["data"].as_array().expect("data").len(),
        specs.len() + 3,
        "plus the built-in api, _test and _gateway sources"
    );
    assert_eq!(leaks(&listed.to_string()), Vec::<String>::new(), "list: {listed}");
    // A fixed value, so the test does not merely agree with itself:
    //   printf %s 'it-secret-github-CCCC' | sha256sum | cut -c1-8
    let github = listed["data"].as_array().expect("data").iter().find(|s| s["name"] == "s-github").expect("s-github");
    assert_eq!(github["secret_fingerprints"], json!(["sha256:a1137436"]));

    // Nor do refusals echo a secret or the signature sent.
    let body = r#"{"id":"evt_x","type":"t"}"#;
    let forged = stripe_header("whsec_it_secret_stripe_AAAX", now(), body);
    let (status, answer) = post(&app, "s-stripe", &vec![("Stripe-Signature", forged.clone())], body).await;
    assert_eq!(status, 401);
    let v1 = forged.split_once("v1=").expect("v1").1;
    assert!(!answer.to_string().contains(v1), "{answer}");
    assert_eq!(leaks(&answer.to_string()), Vec::<String>::new(), "{answer}");
}

/// Refusals are counted per (source, reason) in the process-wide registry a metrics
/// exporter will read; accepted webhooks and unknown sources are not counted.
#[tokio::test]
async fn refusals_are_counted_per_source_and_reason() {
    let app = TestApp::ingest_only().await;
    // The registry is process-wide and tests run in parallel in one process: names no
    // other test uses make the counts exact.
    let unique = uuid::Uuid::new_v4().simple().to_string();
    let (gh, stripe, nowhere) =
        (format!("count-gh-{unique}"), format!("count-stripe-{unique}"), format!("nope-{unique}"));
    create_source(&app, json!({"name": gh, "kind": "github", "secrets": [GITHUB_SECRET]})).await;
    create_source(&app, json!({"name": stripe, "kind": "stripe", "secrets": [STRIPE_SECRET]})).await;

    let body = r#"{"action":"opened"}"#;
    for i in 0..5 {
        let headers = github_request("forger", "pull_request", &format!("f-{i}"), body);
        unauthorized(&app, &gh, "forged", &headers, body, "invalid_signature").await;
    }
    for _ in 0..2 {
        unauthorized(&app, &gh, "unsigned", &vec![], body, "missing_signature").await;
    }
    accepted_new(&app, &gh, &github_request(GITHUB_SECRET, "pull_request", "ok", body), body).await;
    let stale = stripe_body("evt_stale");
    let stale_headers = vec![("Stripe-Signature", stripe_header(STRIPE_SECRET, now() - 3600, &stale))];
    unauthorized(&app, &stripe, "stale", &stale_headers, &stale, "timestamp_out_of_tolerance").await;
    let no_id = r#"{"type":"charge.succeeded"}"#;
    let no_id_headers = vec![("Stripe-Signature", stripe_header(STRIPE_SECRET, now(), no_id))];
    refused(&app, &stripe, "no id", &no_id_headers, no_id, 400, "malformed_body").await;
    let (status, _) = post(&app, &nowhere, &vec![], body).await;
    assert_eq!(status, 404);

    let snapshot = rejections::snapshot();
    let mine: Vec<(String, &str, u64)> = snapshot
        .counts
        .iter()
        .filter(|c| c.source.ends_with(&unique))
        .map(|c| (c.source.clone(), c.reason, c.count))
        .collect();
    assert_eq!(
        mine,
        vec![
            (gh.clone(), "invalid_signature", 5),
            (gh.clone(), "missing_signature", 2),
            (stripe.clone(), "malformed_body", 1),
            (stripe.clone(), "timestamp_out_of_tolerance", 1),
        ]
    );
}
