//! Senders that are hostile but legal: odd keys, odd event types, odd bodies, headers and
//! content types, on every source kind. Ingest never answers 5xx for them, a refusal
//! stores nothing, and whatever is accepted is deduplicated exactly.

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};
use reqwest::header::{HeaderName, HeaderValue};
use serde_json::{Value, json};

use crate::support::TestApp;
use crate::support::signing::{github_header, now, shopify_header, slack_header, standard_entry, stripe_header, whsec};

/// Request headers as raw bytes (names and values as sent).
type Headers = Vec<(String, Vec<u8>)>;

const SECRET: &str = "it-hostile-ingest-secret-0123456789";

/// POST raw bytes with these headers; answers the status and the JSON body.
async fn post(app: &TestApp, source: &str, headers: &[(String, Vec<u8>)], body: &[u8]) -> (u16, Value) {
    let mut req = app.http.post(app.url(&format!("/ingest/{source}"))).body(body.to_vec());
    for (name, value) in headers {
        let name = HeaderName::from_bytes(name.as_bytes()).expect("test header name");
        let value = HeaderValue::from_bytes(value).expect("test header value");
        req = req.header(name, value);
    }
    let resp = req.send().await.expect("ingest request");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

fn h(name: &str, value: impl Into<Vec<u8>>) -> (String, Vec<u8>) {
    (name.to_owned(), value.into())
}

/// A `none` source keyed by the `X-Key` header and `/id`, typed by `X-Type` and `/type`,
/// ordered by `X-Order` and `/account`.
async fn keyed_source(app: &TestApp, name: &str) {
    app.admin_post(
        "/v1/sources",
        json!({"name": name, "kind": "none",
               "dedupe": {"header": "X-Key", "json_pointer": "/id"},
               "event_type": {"header": "X-Type", "json_pointer": "/type"},
               "ordering_key": {"header": "X-Order", "json_pointer": "/account"}}),
        201,
    )
    .await;
}

/// Bytes no compressor can shrink (the dedupe index row limit is about compressed size),
/// as a visible-ASCII key.
fn incompressible_key(len: usize, seed: u64) -> String {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            char::from(b'!' + ((state >> 33) % 94) as u8)
        })
        .collect()
}

/// A 5,000-byte incompressible key, in a header or in the body: stored (as its digest),
/// the same key again is a duplicate of the same event, a key differing in its last byte
/// is a different event.
#[tokio::test]
async fn a_long_key_still_deduplicates_exactly() {
    let app = TestApp::ingest_only().await;
    keyed_source(&app, "src").await;
    let key = incompressible_key(5_000, 1);
    let mut other = key.clone();
    other.pop();
    other.push(if key.ends_with('a') { 'b' } else { 'a' });
    for (place, request) in [
        ("header", (vec![h("X-Key", key.clone())], b"{}".to_vec())),
        ("json pointer", (vec![], serde_json::to_vec(&json!({"id": key.clone() + "/body"})).unwrap())),
    ] {
        let (headers, body) = request;
        let (status, first) = post(&app, "src", &headers, &body).await;
        assert_eq!(status, 200, "{place}: {first}");
        assert_eq!(first["duplicate"], false, "{place}");
        let (status, again) = post(&app, "src", &headers, &body).await;
        assert_eq!(
            (status, &again["duplicate"], &again["event_id"]),
            (200, &json!(true), &first["event_id"]),
            "{place}"
        );
        let event = app.admin_get(&format!("/v1/events/{}", first["event_id"].as_str().unwrap())).await;
        let stored = event["dedupe_key"].as_str().unwrap();
        assert!(stored.starts_with("key-sha256:") && stored.len() == 75, "{place}: {stored}");
    }
    let (status, third) = post(&app, "src", &[h("X-Key", other)], b"{}").await;
    assert_eq!((status, &third["duplicate"]), (200, &json!(false)), "a different long key is a different event");
    assert_eq!(app.db.count("events").await, 3);
}

/// Keys and event types that are present but cannot be used as sent: 400
/// `malformed_body` with a reason, nothing stored, never a silent fallback to the body
/// hash and never a 5xx.
#[tokio::test]
async fn unusable_keys_and_event_types_are_refused_with_a_reason_and_store_nothing() {
    let app = TestApp::ingest_only().await;
    keyed_source(&app, "src").await;
    app.endpoint_for("http://127.0.0.1:9/", None).await;
    let json_body = |v: Value| serde_json::to_vec(&v).unwrap();
    let cases: Vec<(&str, Headers, Vec<u8>)> = vec![
        ("NUL in a JSON key", vec![], json_body(json!({"id": "evt\u{0}1"}))),
        ("newline in a JSON key", vec![], json_body(json!({"id": "evt\n1"}))),
        ("C1 control in a JSON key", vec![], json_body(json!({"id": "evt\u{85}1"}))),
        ("empty JSON key", vec![], json_body(json!({"id": ""}))),
        ("object as a key", vec![], json_body(json!({"id": {"nested": 1}}))),
        ("boolean as a key", vec![], json_body(json!({"id": true}))),
        ("NUL in a JSON event type", vec![h("X-Key", "k1")], json_body(json!({"type": "order\u{0}.paid"}))),
        ("event type too long", vec![h("X-Key", "k2")], json_body(json!({"type": "t".repeat(201)}))),
        ("array as an event type", vec![h("X-Key", "k3")], json_body(json!({"type": ["a"]}))),
        ("tab in a header key", vec![h("X-Key", "a\tb")], b"{}".to_vec()),
        ("header key not UTF-8", vec![h("X-Key", b"a\xFF\xFEb".to_vec())], b"{}".to_vec()),
        ("empty header key", vec![h("X-Key", "")], b"{}".to_vec()),
        ("two different header keys", vec![h("X-Key", "a"), h("X-Key", "b")], b"{}".to_vec()),
        ("tab in a header event type", vec![h("X-Key", "k4"), h("X-Type", "a\tb")], b"{}".to_vec()),
        ("NUL in a JSON ordering key", vec![h("X-Key", "k5")], json_body(json!({"account": "acct\u{0}1"}))),
        ("empty JSON ordering key", vec![h("X-Key", "k6")], json_body(json!({"account": ""}))),
        ("object as an ordering key", vec![h("X-Key", "k7")], json_body(json!({"account": {"id": 1}}))),
        ("ordering key header not UTF-8", vec![h("X-Key", "k8"), h("X-Order", b"a\xFFb".to_vec())], b"{}".to_vec()),
        (
            "two different ordering key headers",
            vec![h("X-Key", "k9"), h("X-Order", "a"), h("X-Order", "b")],
            b"{}".to_vec(),
        ),
    ];
    for (what, headers, body) in cases {
        let (status, answer) = post(&app, "src", &headers, &body).await;
        assert_eq!((status, answer["error"]["code"].as_str()), (400, Some("malformed_body")), "{what}: {answer}");
        assert!(answer["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {answer}");
        assert_eq!((app.db.count("events").await, app.db.count("deliveries").await), (0, 0), "{what}: stored");
    }
    // Absent is not refused: the body hash deduplicates (documented fallback).
    let (status, answer) = post(&app, "src", &[], b"not json at all").await;
    assert_eq!(status, 200, "{answer}");
    // A UTF-8 key with non-ASCII characters is a fine key, in a header or the body.
    let (status, answer) = post(&app, "src", &[h("X-Key", "clé-ünïcode-1".as_bytes())], b"{}").await;
    assert_eq!(status, 200, "{answer}");
    let event = app.admin_get(&format!("/v1/events/{}", answer["event_id"].as_str().unwrap())).await;
    assert_eq!(event["dedupe_key"], "clé-ünïcode-1");
}

/// A sender's key spelled as a key the gateway makes itself (a keyless webhook's body hash,
/// `sha256:...`; a long key's digest, `key-sha256:...`) is a different webhook, not a
/// duplicate of the one the gateway keyed so (before, it was answered `duplicate: true`
/// and never delivered); the same spelling sent again is its duplicate.
#[tokio::test]
async fn a_key_spelled_as_one_the_gateway_makes_is_not_a_duplicate_of_it() {
    use sha2::Digest as _;
    let app = TestApp::ingest_only().await;
    keyed_source(&app, "src").await;
    let keyless = br#"{"x": "no id here"}"#;
    let (status, first) = post(&app, "src", &[], keyless).await;
    assert_eq!((status, first["duplicate"].as_bool()), (200, Some(false)), "{first}");
    let long = "k".repeat(1100);
    let (status, digested) = post(&app, "src", &[h("X-Key", long.clone())], b"{}").await;
    assert_eq!((status, digested["duplicate"].as_bool()), (200, Some(false)), "{digested}");
    let spelled = [
        webhook_gateway::verify::body_sha256_hex(keyless),
        format!("key-sha256:{}", hex::encode(sha2::Sha256::digest(long.as_bytes()))),
    ];
    for (key, theirs) in spelled.iter().zip([&first, &digested]) {
        let (status, answer) = post(&app, "src", &[h("X-Key", key.clone())], b"{}").await;
        assert_eq!((status, answer["duplicate"].as_bool()), (200, Some(false)), "{key}: {answer}");
        assert_ne!(answer["event_id"], theirs["event_id"], "{key}");
        let (_, again) = post(&app, "src", &[h("X-Key", key.clone())], b"{}").await;
        assert_eq!((again["duplicate"].as_bool(), &again["event_id"]), (Some(true), &answer["event_id"]), "{key}");
    }
    assert_eq!(app.db.count("events").await, 4);
}

/// A compressed body (`Content-Encoding: gzip`) is refused 415 with the reason and stores
/// nothing (stored, it was keyed by the hash of its compressed bytes, so the same webhook
/// sent plain was stored again, and it went out without the header that says how to read
/// it); `identity` is no encoding. A source name that is not UTF-8 is a JSON 404, not
/// axum's plain-text 400.
#[tokio::test]
async fn a_compressed_body_or_a_name_not_utf8_is_refused_in_json_and_stores_nothing() {
    let app = TestApp::ingest_only().await;
    keyed_source(&app, "src").await;
    let gzipped = [0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0xab, 0xae, 0x05, 0x00];
    for encoding in ["gzip", "br", "GZIP"] {
        let (status, answer) = post(&app, "src", &[h("Content-Encoding", encoding)], &gzipped).await;
        assert_eq!((status, answer["error"]["code"].as_str()), (415, Some("unsupported_media_type")), "{answer}");
        assert!(answer["error"]["message"].as_str().is_some_and(|m| m.contains("uncompressed")), "{answer}");
    }
    assert_eq!(app.db.count("events").await, 0, "nothing stored");
    let (status, answer) = post(&app, "src", &[h("Content-Encoding", "identity"), h("X-Key", "plain-1")], b"{}").await;
    assert_eq!(status, 200, "{answer}");

    let resp = app.http.post(format!("http://{}/ingest/%FF", app.addr)).body("{}").send().await.expect("ingest");
    assert_eq!(resp.status().as_u16(), 404);
    let answer: Value = resp.json().await.expect("a JSON answer");
    assert_eq!(answer["error"]["code"], "not_found", "{answer}");
}

/// A 5,000-byte incompressible ordering key, delivered to an ordered subscription: stored
/// as its digest (the line's primary key stays within the b-tree's row limit), and the same
/// key again joins the same line.
#[tokio::test]
async fn a_long_ordering_key_is_stored_as_its_digest_and_keeps_its_line() {
    let app = TestApp::ingest_only().await;
    keyed_source(&app, "src").await;
    let ep = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/"}), 201).await;
    let sub = json!({"endpoint_id": ep["id"], "source": "src", "ordered": {"on_dead": "block"}});
    app.admin_post("/v1/subscriptions", sub, 201).await;
    let key = incompressible_key(5_000, 7);
    for (n, request) in [
        (vec![h("X-Key", "e1"), h("X-Order", key.clone())], b"{}".to_vec()),
        (vec![h("X-Key", "e2")], serde_json::to_vec(&json!({"account": key.clone()})).unwrap()),
    ]
    .into_iter()
    .enumerate()
    {
        let (headers, body) = request;
        let (status, answer) = post(&app, "src", &headers, &body).await;
        assert_eq!(status, 200, "event {n}: {answer}");
    }
    let keys: Vec<(String, bool)> = sqlx::query_as("SELECT ordering_key, waiting FROM deliveries ORDER BY line_seq")
        .fetch_all(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(keys[0].0.starts_with("key-sha256:") && keys[0].0.len() == 75, "{keys:?}");
    assert_eq!(keys[0].0, keys[1].0, "header and body carry the same key: one line");
    assert_eq!((keys[0].1, keys[1].1), (false, true), "the first is the head, the second waits");
    assert_eq!(app.db.count("order_lines").await, 1);
}

/// `POST /v1/events` follows the same rules: a control character in the caller's id or
/// type is a 422 naming the field, never a 5xx.
#[tokio::test]
async fn published_events_with_control_characters_are_refused() {
    let app = TestApp::ingest_only().await;
    for (field, body) in [
        ("event_id", json!({"event_id": "a\u{0}b", "event_type": "t", "payload": {}})),
        ("event_type", json!({"event_id": "a", "event_type": "t\u{0}", "payload": {}})),
        ("event_type", json!({"event_id": "a", "event_type": "t\r\n", "payload": {}})),
        ("ordering_key", json!({"event_id": "a", "event_type": "t", "ordering_key": "k\u{0}", "payload": {}})),
        ("ordering_key", json!({"event_id": "a", "event_type": "t", "ordering_key": "", "payload": {}})),
    ] {
        let (status, answer) = app.admin(reqwest::Method::POST, "/v1/events", Some(body)).await;
        assert_eq!(status, 422, "{answer}");
        assert!(answer["error"]["message"].as_str().unwrap().starts_with(field), "{answer}");
    }
    // NUL inside the payload is data, not a key: stored as sent.
    let body = json!({"event_id": "nul-in-payload", "event_type": "t", "payload": {"text": "a\u{0}b"}});
    let (status, answer) = app.admin(reqwest::Method::POST, "/v1/events", Some(body)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(app.db.count("events").await, 1);
}

// ---------------------------------------------------------------------------------------
// Arbitrary requests for every source kind.

/// The sources of the fuzz: every kind, once with the kind's own key and type places and
/// once keyed by `X-Key`/`/id` and typed by `X-Type`/`/type`.
const KINDS: [&str; 7] = ["none", "stripe", "github", "shopify", "slack", "standard-webhooks", "hmac"];

fn standard_secret() -> String {
    whsec(SECRET.as_bytes())
}

async fn fuzz_sources(app: &TestApp) {
    for kind in KINDS {
        for custom in [false, true] {
            let secrets = match kind {
                "none" => json!([]),
                "standard-webhooks" => json!([standard_secret()]),
                _ => json!([SECRET]),
            };
            let mut spec = json!({"name": source_name(kind, custom), "kind": kind, "secrets": secrets});
            if kind == "hmac" {
                spec["hmac"] = json!({"header": "X-Sig", "algorithm": "sha256", "encoding": "hex"});
            }
            if custom {
                spec["dedupe"] = json!({"header": "X-Key", "json_pointer": "/id"});
                spec["event_type"] = json!({"header": "X-Type", "json_pointer": "/type"});
                spec["ordering_key"] = json!({"header": "X-Order", "json_pointer": "/account"});
            }
            app.admin_post("/v1/sources", spec, 201).await;
        }
    }
}

fn source_name(kind: &str, custom: bool) -> String {
    format!("{kind}-{}", if custom { "custom" } else { "default" })
}

/// One generated request.
#[derive(Clone)]
struct Case {
    kind: usize,
    custom: bool,
    key: String,
    event_type: String,
    key_in_header: bool,
    type_in_header: bool,
    body: Body,
    content_type: Option<Vec<u8>>,
    extra_headers: Vec<(String, Vec<u8>)>,
    signed: bool,
}

#[derive(Clone)]
enum Body {
    /// A JSON object carrying the key and type where every kind looks, nested `depth`
    /// arrays deep under `nest`, with `pad` filler.
    Json { depth: usize, pad: String },
    /// Raw bytes.
    Raw(Vec<u8>),
}

/// A value as a failure message shows it: escaped and cut to a readable length (a
/// failing case can hold megabytes).
fn cut(bytes: &[u8]) -> String {
    let shown: String = bytes.iter().take(120).flat_map(|b| std::ascii::escape_default(*b)).map(char::from).collect();
    format!("\"{shown}\" ({} bytes)", bytes.len())
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Body::Json { depth, pad } => write!(f, "json, nesting {depth}, pad {}", cut(pad.as_bytes())),
            Body::Raw(bytes) => write!(f, "raw {}", cut(bytes)),
        }
    }
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case")
            .field("kind", &KINDS[self.kind])
            .field("custom", &self.custom)
            .field("key", &cut(self.key.as_bytes()))
            .field("event_type", &cut(self.event_type.as_bytes()))
            .field("key_in_header", &self.key_in_header)
            .field("type_in_header", &self.type_in_header)
            .field("body", &self.body)
            .field("content_type", &self.content_type.as_deref().map(cut))
            .field(
                "extra_headers",
                &self.extra_headers.iter().map(|(n, v)| format!("{n}: {}", cut(v))).collect::<Vec<_>>(),
            )
            .field("signed", &self.signed)
            .finish()
    }
}

fn text(max: usize) -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[A-Za-z0-9_.:-]{1,40}",
        2 => proptest::collection::vec(any::<char>(), 0..max).prop_map(|c| c.into_iter().collect::<String>()),
        1 => "\\PC{0,10}[\\x00-\\x1F\\x7F\\u{80}-\\u{9F}]\\PC{0,10}",
        1 => (900usize..3000, any::<u64>()).prop_map(|(n, seed)| incompressible_key(n, seed)),
        1 => Just(String::new()),
    ]
}

fn header_value_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        "[ -~]{0,60}".prop_map(String::into_bytes),
        proptest::collection::vec(any::<u8>(), 0..300),
        (1usize..12_000).prop_map(|n| vec![b'v'; n]),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    let body = prop_oneof![
        3 => (0usize..200, "\\PC{0,200}").prop_map(|(depth, pad)| Body::Json { depth, pad }),
        1 => proptest::collection::vec(any::<u8>(), 0..2000).prop_map(Body::Raw),
        1 => (60_000usize..70_000).prop_map(|n| Body::Raw(vec![b'{'; n])),
    ];
    let content_type = proptest::option::of(prop_oneof![
        Just(b"application/json".to_vec()),
        Just(b"text/plain; charset=utf-8".to_vec()),
        header_value_bytes(),
    ]);
    let extra = proptest::collection::vec(("x-[a-z0-9-]{1,20}", header_value_bytes()), 0..6);
    (
        (0..KINDS.len(), any::<bool>(), text(300), text(300), any::<bool>(), any::<bool>()),
        (body, content_type, extra, proptest::bool::weighted(0.9)),
    )
        .prop_map(
            |(
                (kind, custom, key, event_type, key_in_header, type_in_header),
                (body, content_type, extra_headers, signed),
            )| {
                Case {
                    kind,
                    custom,
                    key,
                    event_type,
                    key_in_header,
                    type_in_header,
                    body,
                    content_type,
                    extra_headers,
                    signed,
                }
            },
        )
}

/// The request a case stands for: headers (only the encodable ones) and body, signed for
/// its source's kind when `signed`.
fn request(case: &Case) -> (String, Headers, Vec<u8>) {
    let kind = KINDS[case.kind];
    let body = match &case.body {
        Body::Json { depth, pad } => {
            let mut nest = json!(1);
            for _ in 0..*depth {
                nest = json!([nest]);
            }
            serde_json::to_vec(&json!({
                "id": case.key, "event_id": case.key, "account": case.key, "type": case.event_type,
                "event": {"type": case.event_type}, "nest": nest, "pad": pad,
            }))
            .expect("json")
        }
        Body::Raw(bytes) => bytes.clone(),
    };
    let encodable = |v: &[u8]| HeaderValue::from_bytes(v).is_ok();
    let mut headers: Headers = Vec::new();
    let push = |headers: &mut Headers, name: &str, value: &[u8]| {
        if encodable(value) {
            headers.push((name.to_owned(), value.to_vec()));
        }
    };
    if case.key_in_header {
        for name in ["X-Key", "X-GitHub-Delivery", "X-Shopify-Webhook-Id", "X-Order"] {
            push(&mut headers, name, case.key.as_bytes());
        }
    }
    if case.type_in_header {
        for name in ["X-Type", "X-GitHub-Event", "X-Shopify-Topic"] {
            push(&mut headers, name, case.event_type.as_bytes());
        }
    }
    if let Some(ct) = &case.content_type {
        push(&mut headers, "Content-Type", ct);
    }
    for (name, value) in &case.extra_headers {
        push(&mut headers, name, value);
    }
    if case.signed {
        let ts = now();
        match kind {
            "stripe" => headers.push(h("Stripe-Signature", stripe_header(SECRET, ts, &body))),
            "github" => headers.push(h("X-Hub-Signature-256", github_header(SECRET, &body))),
            "shopify" => headers.push(h("X-Shopify-Hmac-Sha256", shopify_header(SECRET, &body))),
            "slack" => {
                headers.push(h("X-Slack-Signature", slack_header(SECRET, ts, &body)));
                headers.push(h("X-Slack-Request-Timestamp", ts.to_string()));
            }
            "standard-webhooks" => {
                let id = if case.key_in_header && encodable(case.key.as_bytes()) && !case.key.trim().is_empty() {
                    case.key.clone()
                } else {
                    format!("msg_{}", ts)
                };
                headers.push(h("webhook-signature", standard_entry(&standard_secret(), id.trim(), ts, &body)));
                headers.push(h("webhook-id", id));
                headers.push(h("webhook-timestamp", ts.to_string()));
            }
            "hmac" => {
                let mac = crate::support::signing::hmac_sha256(SECRET.as_bytes(), &body);
                headers.push(h("X-Sig", hex::encode(mac)));
            }
            _ => {}
        }
    }
    (source_name(kind, case.custom), headers, body)
}

/// Cases per run: 96 by default (a few seconds), `PROPTEST_CASES` for a longer run.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(96)
}

/// Arbitrary requests (keys, event types, bodies, JSON nesting, header values including
/// huge and non-UTF-8 ones, content types, signed or not) for every source kind: never a
/// 5xx, a refusal stores nothing, and an accepted request sent again is a duplicate of
/// the same event.
#[tokio::test]
async fn arbitrary_requests_on_every_kind_never_fail_the_server() {
    let app = TestApp::ingest_only().await;
    fuzz_sources(&app).await;
    app.endpoint_for("http://127.0.0.1:9/all", None).await;
    let mut runner = TestRunner::new(Config::default());
    let strategy = case();
    let mut accepted = 0;
    for _ in 0..cases() {
        let case = strategy.new_tree(&mut runner).expect("generate a case").current();
        let (source, headers, body) = request(&case);
        let before = (app.db.count("events").await, app.db.count("deliveries").await);
        let (status, answer) = post(&app, &source, &headers, &body).await;
        assert!(status < 500, "{status} {answer} for {case:?}");
        if status != 200 || answer.get("challenge").is_some() {
            assert!(status == 200 || answer["error"]["code"].is_string(), "{status} {answer} for {case:?}");
            let after = (app.db.count("events").await, app.db.count("deliveries").await);
            assert_eq!(after, before, "a refusal stored something: {status} {answer} for {case:?}");
            continue;
        }
        accepted += 1;
        let (again, second) = post(&app, &source, &headers, &body).await;
        assert_eq!(again, 200, "{second} for {case:?}");
        assert_eq!((&second["duplicate"], &second["event_id"]), (&json!(true), &answer["event_id"]), "{case:?}");
    }
    println!("{accepted} of {} generated requests were accepted", cases());
    // The generator must reach the store, or the test proves little.
    assert!(accepted * 4 >= cases(), "only {accepted} of {} cases were accepted", cases());
}
