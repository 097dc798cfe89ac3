//! OpenTelemetry traces (issue 19): the gateway as a real process exporting over OTLP/HTTP
//! to a real receiver (`support::otlp`), a webhook with the producer's `traceparent`
//! delivered to a real subscriber on the second attempt.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::otlp::{Collector, Exported};
use crate::support::sink::{Reply, Sink};
use crate::support::{ADMIN_TOKEN, GatewayProcess, TestDb, eventually};

const WAIT: Duration = Duration::from_secs(30);
const PRODUCER_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const PRODUCER_SPAN: &str = "b7ad6b7169203331";

/// The gateway process's admin API and ingest, over HTTP.
struct Gateway {
    process: GatewayProcess,
    http: reqwest::Client,
}

impl Gateway {
    async fn start(db: &TestDb, env: &[(&str, &str)], flags: &[&str]) -> Gateway {
        let mut extra = vec!["--backoff-base-ms", "100", "--janitor-interval-secs", "1"];
        extra.extend_from_slice(flags);
        let process = GatewayProcess::start_with_env(&db.url, &extra, env);
        let gateway = Gateway { process, http: reqwest::Client::new() };
        eventually(WAIT, "the gateway is ready", || async {
            let ready = gateway.http.get(gateway.url("/readyz")).send().await.ok()?;
            ready.status().is_success().then_some(())
        })
        .await;
        gateway
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.process.addr, path)
    }

    async fn admin_post(&self, path: &str, body: Value) -> Value {
        let resp = self.http.post(self.url(path)).bearer_auth(ADMIN_TOKEN).json(&body).send().await.expect("admin");
        assert_eq!(resp.status().as_u16(), 201, "POST {path}");
        resp.json().await.expect("admin json")
    }

    /// A `none` source, an endpoint at `url` subscribed to it; returns the endpoint id.
    async fn route(&self, source: &str, url: &str) -> String {
        self.admin_post(
            "/v1/sources",
            json!({"name": source, "kind": "none", "dedupe": {"header": "X-Delivery-Id"},
                   "event_type": {"header": "X-Event-Type"}}),
        )
        .await;
        let endpoint = self.admin_post("/v1/endpoints", json!({"url": url})).await;
        let id = endpoint["id"].as_str().expect("endpoint id").to_owned();
        self.admin_post("/v1/subscriptions", json!({"endpoint_id": id, "source": source})).await;
        id
    }

    /// A webhook carrying the producer's trace context; returns the event id.
    async fn ingest(&self, source: &str, key: &str) -> String {
        let resp = self
            .http
            .post(self.url(&format!("/ingest/{source}")))
            .header("content-type", "application/json")
            .header("x-delivery-id", key)
            .header("x-event-type", "order.paid")
            .header("traceparent", format!("00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01"))
            .header("tracestate", "producer=abc, other=1")
            .body(r#"{"order":1}"#)
            .send()
            .await
            .expect("ingest");
        assert_eq!(resp.status().as_u16(), 200);
        let body: Value = resp.json().await.expect("ingest json");
        body["event_id"].as_str().expect("event id").to_owned()
    }
}

/// First attempt answered 500, the second 200.
async fn failing_once_sink() -> Sink {
    Sink::start(|_, n| if n == 0 { Reply::status(500) } else { Reply::status(200) }).await
}

async fn delivered(db: &TestDb) {
    eventually(WAIT, "the delivery is delivered", || async {
        let status: Option<String> =
            sqlx::query_scalar("SELECT status FROM deliveries").fetch_optional(&db.pool).await.ok().flatten();
        (status.as_deref() == Some("delivered")).then_some(())
    })
    .await;
}

fn named<'a>(spans: &'a [Exported], name: &str) -> Vec<&'a Exported> {
    spans.iter().filter(|s| s.name() == name).collect()
}

fn one<'a>(spans: &'a [Exported], name: &str) -> &'a Exported {
    let found = named(spans, name);
    assert_eq!(found.len(), 1, "one {name:?} span; spans: {:?}", spans.iter().map(Exported::name).collect::<Vec<_>>());
    found[0]
}

/// The trace follows the webhook: the ingest span continues the producer's trace, the
/// stored context is the ingest span's, each attempt links to it (and to its claim), the
/// subscriber gets a `traceparent` of the attempt's HTTP client span, and SIGTERM flushes
/// every span to the collector.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otel_spans_follow_a_webhook_from_the_producer_to_the_subscriber() {
    let db = TestDb::new().await;
    let collector = Collector::start().await;
    let sink = failing_once_sink().await;
    let endpoint = collector.endpoint();
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("OTEL_SERVICE_NAME", "wg-otel-test"),
        // OTEL_SERVICE_NAME takes precedence over this service.name (the SDK specification).
        ("OTEL_RESOURCE_ATTRIBUTES", "service.name=not-this-one,deployment.environment.name=test"),
    ];
    let mut gateway = Gateway::start(&db, &env, &[]).await;
    let endpoint_id = gateway.route("shop", &sink.url("/hook")).await;
    let event_id = gateway.ingest("shop", "order-1").await;
    delivered(&db).await;
    // A refused webhook (unknown source): its server span's status code is a number.
    let refused = gateway.http.post(gateway.url("/ingest/nowhere")).body("{}").send().await.expect("ingest");
    assert_eq!(refused.status().as_u16(), 404);
    // A subscriber that answers 400: its delivery is dead at once, and the attempt failed.
    let rejecting = Sink::start(|_, _| Reply::status(400)).await;
    gateway.route("strict", &rejecting.url("/hook")).await;
    gateway.ingest("strict", "order-2").await;
    eventually(WAIT, "the rejected delivery is dead", || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE status = 'dead'")
            .fetch_one(&db.pool)
            .await
            .ok()?;
        (n == 1).then_some(())
    })
    .await;
    // A janitor pass runs within a second of the start, then every second.
    eventually(WAIT, "a janitor pass", || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM janitor_runs").fetch_one(&db.pool).await.ok()?;
        (n > 0).then_some(())
    })
    .await;
    assert!(tokio::task::spawn_blocking(move || gateway.process.terminate()).await.expect("join"), "clean exit");
    // SIGTERM flushed the exporter before the exit: everything is here now.
    let spans = collector.spans();
    assert!(spans.iter().all(|s| s.resource.get("service.name").map(String::as_str) == Some("wg-otel-test")));
    let instance = spans[0].resource.get("service.instance.id").cloned().unwrap_or_default();
    assert_eq!(uuid::Uuid::parse_str(&instance).map(|u| u.get_version_num()), Ok(4), "{instance:?}");
    assert!(spans.iter().all(|s| s.resource.get("service.instance.id") == Some(&instance)), "one instance id");
    assert_eq!(spans[0].resource.get("deployment.environment.name").map(String::as_str), Some("test"));
    // Database spans are client spans that say which database, where.
    let db_url = url::Url::parse(&db.url).expect("database url");
    let in_database = |s: &Exported| {
        s.span.kind == 3
            && s.attr("db.system.name").as_deref() == Some("postgresql")
            && s.attr("db.namespace").as_deref() == Some(db_url.path().trim_start_matches('/'))
            && s.attr("server.address").as_deref() == db_url.host_str()
            && s.int_attr("server.port") == Some(i64::from(db_url.port().unwrap_or(5432)))
    };

    // The ingest request: a server span in the producer's trace, child of its span.
    let ingest = named(&spans, "POST /ingest/{source}")
        .into_iter()
        .find(|s| s.attr("webhook.event_id") == Some(event_id.clone()))
        .expect("the first webhook's span");
    assert_eq!((ingest.trace_id(), ingest.parent_id()), (PRODUCER_TRACE.to_owned(), PRODUCER_SPAN.to_owned()));
    assert_eq!(ingest.span.kind, 2, "SPAN_KIND_SERVER");
    assert_eq!(ingest.attr("http.request.method").as_deref(), Some("POST"));
    assert_eq!(ingest.attr("http.route").as_deref(), Some("/ingest/{source}"));
    assert_eq!(ingest.int_attr("http.response.status_code"), Some(200));
    assert_eq!(ingest.attr("webhook.event_id"), Some(event_id.clone()));
    let refused = named(&spans, "POST /ingest/{source}")
        .into_iter()
        .find(|s| s.int_attr("http.response.status_code") == Some(404))
        .expect("the refused webhook's span, its status code a number");
    assert_eq!(refused.span.status.as_ref().map_or(0, |s| s.code), 0, "a 4xx is the client's error, not the server's");
    let child_of_ingest = |step: &str| {
        named(&spans, step)
            .into_iter()
            .find(|c| (c.trace_id(), c.parent_id()) == (ingest.trace_id(), ingest.span_id()))
            .unwrap_or_else(|| panic!("{step} is a child of the ingest span"))
    };
    child_of_ingest("verify");
    // The messaging conventions: the event is sent to the queue by a producer span.
    let store = child_of_ingest("send deliveries");
    assert_eq!(store.span.kind, 4, "SPAN_KIND_PRODUCER");
    assert_eq!(store.attr("messaging.operation.type").as_deref(), Some("send"));
    assert_eq!(store.attr("messaging.destination.name").as_deref(), Some("deliveries"));
    let commit = named(&spans, "INSERT events")
        .into_iter()
        .find(|c| c.links().contains(&(store.trace_id(), store.span_id())))
        .expect("the commit links to the event's producer span");
    assert!(in_database(commit), "{commit:?}");
    assert_eq!(commit.attr("db.operation.name").as_deref(), Some("INSERT"));

    // Stored with the event: the producer span's context, in the producer's trace.
    let (traceparent, tracestate): (Option<String>, Option<String>) =
        sqlx::query_as("SELECT traceparent, tracestate FROM events WHERE id = $1::uuid")
            .bind(&event_id)
            .fetch_one(&db.pool)
            .await
            .expect("event");
    assert_eq!(traceparent, Some(format!("00-{PRODUCER_TRACE}-{}-01", store.span_id())));
    assert_eq!(tracestate.as_deref(), Some("producer=abc,other=1"));

    // Two claims, two attempts, each its own trace, linked to the ingest span and a claim.
    let claims = named(&spans, "claim deliveries");
    assert!(claims.len() >= 2, "a claim span per claim that took something: {}", claims.len());
    assert!(claims.iter().all(|c| in_database(c)), "{claims:?}");
    let mut attempts: Vec<_> = named(&spans, "process deliveries")
        .into_iter()
        .filter(|a| a.attr("webhook.event_id") == Some(event_id.clone()))
        .collect();
    attempts.sort_by_key(|a| a.attr("webhook.attempt"));
    assert_eq!(attempts.len(), 2, "two attempt spans");
    let sent = sink.received();
    assert_eq!(sent.len(), 2);
    let clients = named(&spans, "POST");
    for (n, attempt) in attempts.iter().enumerate() {
        assert_eq!(attempt.attr("webhook.attempt"), Some((n + 1).to_string()));
        assert_eq!(attempt.attr("webhook.event_id"), Some(event_id.clone()));
        assert_eq!(attempt.attr("webhook.endpoint_id"), Some(endpoint_id.clone()));
        assert!(attempt.attr("webhook.delivery_id").is_some_and(|d| !d.is_empty()));
        assert_eq!(attempt.attr("webhook.outcome").as_deref(), Some(["retry", "delivered"][n]));
        assert_eq!(attempt.parent_id(), "", "an attempt is a root: retries run later, anywhere");
        assert_eq!(attempt.span.kind, 5, "SPAN_KIND_CONSUMER");
        assert_eq!(attempt.attr("messaging.operation.type").as_deref(), Some("process"));
        assert_eq!(attempt.span.status.as_ref().map_or(0, |s| s.code), 0, "a retry or a delivery is no error");
        let links = attempt.links();
        assert!(
            links.contains(&(PRODUCER_TRACE.to_owned(), store.span_id())),
            "attempt {} links to the producer span in the producer's trace: {links:?}",
            n + 1
        );
        assert!(claims.iter().any(|c| links.contains(&(c.trace_id(), c.span_id()))), "and to its claim");
        // Its HTTP client span, whose context the subscriber received.
        let client = clients
            .iter()
            .find(|c| c.parent_id() == attempt.span_id())
            .unwrap_or_else(|| panic!("the client span of attempt {}", n + 1));
        assert_eq!(client.span.kind, 3, "SPAN_KIND_CLIENT");
        assert_eq!(client.attr("http.request.method").as_deref(), Some("POST"));
        assert_eq!(client.attr("url.full"), Some(sink.url("/hook")));
        assert_eq!(client.attr("server.address").as_deref(), Some("127.0.0.1"));
        assert_eq!(client.attr("server.port"), Some(sink.addr.port().to_string()));
        assert_eq!(client.int_attr("http.response.status_code"), Some([500, 200][n]));
        let status = client.span.status.as_ref().map_or(0, |s| s.code);
        assert_eq!(status, [2, 0][n], "the failed request's span has status ERROR (2), the other none set");
        let request = sent
            .iter()
            .find(|r| r.header("webhook-attempt") == (n + 1).to_string())
            .unwrap_or_else(|| panic!("request of attempt {}", n + 1));
        assert_eq!(request.header("traceparent"), format!("00-{}-{}-01", attempt.trace_id(), client.span_id()));
        assert_ne!(attempt.trace_id(), PRODUCER_TRACE, "the subscriber joins the attempt's trace, not the producer's");
        assert_eq!(request.header("tracestate"), "", "the producer's tracestate belongs to the producer's trace");
    }

    // Each outcome recorded in a span linked to its attempt.
    let records = named(&spans, "record attempts");
    for attempt in &attempts {
        assert!(
            records.iter().any(|r| r.links().contains(&(attempt.trace_id(), attempt.span_id()))),
            "a record span links to attempt {:?}",
            attempt.attr("webhook.attempt")
        );
    }
    assert!(records.iter().all(|r| in_database(r)), "{records:?}");
    let janitor = named(&spans, "janitor pass");
    assert!(!janitor.is_empty(), "the janitor's passes are spans");
    assert!(janitor.iter().all(|j| in_database(j)), "{janitor:?}");
    // The attempt that ended its delivery dead failed.
    let dead = named(&spans, "process deliveries")
        .into_iter()
        .find(|a| a.attr("webhook.outcome").as_deref() == Some("dead"))
        .expect("the dead attempt's span");
    assert_eq!(dead.span.status.as_ref().map_or(0, |s| s.code), 2, "status ERROR");
    assert!(janitor.iter().all(|j| j.attr("webhook.janitor.status").is_some()));
}

/// Tracing off (here: vetoed by `OTEL_SDK_DISABLED`, with an endpoint that would work):
/// nothing is exported, the subscriber gets no trace headers, and the producer's context
/// is still stored with the event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otel_off_exports_nothing_and_forwards_nothing() {
    let db = TestDb::new().await;
    let collector = Collector::start().await;
    let sink = failing_once_sink().await;
    let endpoint = collector.endpoint();
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("OTEL_SDK_DISABLED", "true"),
    ];
    let mut gateway = Gateway::start(&db, &env, &[]).await;
    gateway.route("shop", &sink.url("/hook")).await;
    gateway.ingest("shop", "order-1").await;
    delivered(&db).await;
    assert!(tokio::task::spawn_blocking(move || gateway.process.terminate()).await.expect("join"), "clean exit");
    assert_eq!(collector.requests(), 0, "nothing exported");
    let sent = sink.received();
    assert_eq!(sent.len(), 2);
    assert!(sent.iter().all(|r| r.header("traceparent").is_empty() && r.header("tracestate").is_empty()));
    let traceparent: Option<String> =
        sqlx::query_scalar("SELECT traceparent FROM events").fetch_one(&db.pool).await.expect("event");
    assert_eq!(traceparent, Some(format!("00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01")), "the producer's, as sent");
}

/// `POST /v1/events` stores a valid context like a webhook does, and ignores a malformed
/// one without refusing the event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otel_published_events_keep_a_valid_traceparent_and_ignore_a_bad_one() {
    let db = TestDb::new().await;
    let mut gateway = Gateway::start(&db, &[], &[]).await;
    let sent = [
        ("good", format!("00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-00")),
        ("upper", format!("00-{}-{PRODUCER_SPAN}-01", PRODUCER_TRACE.to_uppercase())),
        ("zero", format!("00-{}-{PRODUCER_SPAN}-01", "0".repeat(32))),
    ];
    for (id, traceparent) in &sent {
        let resp = gateway
            .http
            .post(gateway.url("/v1/events"))
            .bearer_auth(ADMIN_TOKEN)
            .header("traceparent", traceparent)
            .header("tracestate", "Bad Key=1")
            .json(&json!({"event_id": id, "event_type": "t", "payload": {}}))
            .send()
            .await
            .expect("publish");
        assert_eq!(resp.status().as_u16(), 200, "{id}");
    }
    let stored: Vec<(String, Option<String>, Option<String>)> =
        sqlx::query_as("SELECT dedupe_key, traceparent, tracestate FROM events ORDER BY dedupe_key")
            .fetch_all(&db.pool)
            .await
            .expect("events");
    assert_eq!(
        stored,
        vec![
            ("good".to_owned(), Some(sent[0].1.clone()), None),
            ("upper".to_owned(), None, None),
            ("zero".to_owned(), None, None),
        ]
    );
    assert!(tokio::task::spawn_blocking(move || gateway.process.terminate()).await.expect("join"));
}

/// SIGTERM flushes the exporter: with an export interval far longer than the test, no
/// span leaves before the signal, and every one has arrived when the process has exited.
/// Also the `POST /v1/events` server span, a child of the producer's, and the endpoint
/// given by `--otel-endpoint`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otel_sigterm_flushes_the_spans_still_queued() {
    let db = TestDb::new().await;
    let collector = Collector::start().await;
    let endpoint = collector.endpoint();
    // Ten minutes, and far fewer than the 512 spans that would trigger an export. The
    // endpoint by the flag this time.
    let env = [("OTEL_BSP_SCHEDULE_DELAY", "600000")];
    let mut gateway = Gateway::start(&db, &env, &["--otel-endpoint", &endpoint]).await;
    let resp = gateway
        .http
        .post(gateway.url("/v1/events"))
        .bearer_auth(ADMIN_TOKEN)
        .header("traceparent", format!("00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01"))
        .json(&json!({"event_id": "e-1", "event_type": "t", "payload": {}}))
        .send()
        .await
        .expect("publish");
    assert_eq!(resp.status().as_u16(), 200);
    let event_id = resp.json::<Value>().await.expect("json")["event_id"].as_str().expect("id").to_owned();
    assert_eq!(collector.requests(), 0, "nothing exported before the interval or the signal");
    assert!(tokio::task::spawn_blocking(move || gateway.process.terminate()).await.expect("join"), "clean exit");
    let spans = collector.spans();
    let publish = one(&spans, "POST /v1/events");
    assert_eq!((publish.trace_id(), publish.parent_id()), (PRODUCER_TRACE.to_owned(), PRODUCER_SPAN.to_owned()));
    assert_eq!(publish.attr("http.route").as_deref(), Some("/v1/events"));
    assert_eq!(publish.attr("webhook.event_id"), Some(event_id));
    let store = one(&spans, "send deliveries");
    assert_eq!(store.parent_id(), publish.span_id());
    let traceparent: Option<String> =
        sqlx::query_scalar("SELECT traceparent FROM events").fetch_one(&db.pool).await.expect("event");
    assert_eq!(traceparent, Some(format!("00-{PRODUCER_TRACE}-{}-01", store.span_id())));
}
