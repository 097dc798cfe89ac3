//! OpenTelemetry traces, exported over OTLP/HTTP (protobuf) when an endpoint is set in
//! the standard environment (`OTEL_EXPORTER_OTLP_ENDPOINT`, or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); off otherwise.
//!
//! Off costs nothing beyond one atomic load per would-be span: no layer is installed and
//! every span here is `Span::none()`. Only the incoming `traceparent` is still read and
//! validated (one header lookup), so that it is stored with the event either way.
//!
//! The W3C context follows the webhook: it is stored with the event
//! (`events.traceparent`, `events.tracestate`), each delivery attempt's span links to it
//! (a link, not a parent: retries run hours later, on any replica), and the outbound
//! request carries a `traceparent` of the attempt's own HTTP client span, so the
//! subscriber's trace joins the attempt's. With tracing off nothing is forwarded.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use opentelemetry::trace::{Span as _, SpanContext, SpanKind, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

mod w3c;
pub use w3c::{TraceParent, incoming, parse_tracestate};

/// The `tracing` target of every span meant for OpenTelemetry; the log output filters it
/// out, so turning tracing on does not change the logs.
pub const TARGET: &str = "otel";

static ENABLED: AtomicBool = AtomicBool::new(false);
static TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// Whether spans are exported (decided once at start-up).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The exporter, running: [`Telemetry::shutdown`] flushes what is still queued.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Telemetry")
    }
}

impl Telemetry {
    /// Export what is left and stop the exporter. Blocks (up to the export timeout); call
    /// it outside the runtime's tasks, while the runtime still runs (the exporter's
    /// requests are sent on it).
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("webhook-gateway: exporting the last spans failed: {e}");
        }
    }
}

/// Why tracing could not be set up as configured.
#[derive(Debug, thiserror::Error)]
#[error("OpenTelemetry: {0}")]
pub struct SetupError(String);

/// Whether traces are asked for: an OTLP endpoint is configured (`configured`, from
/// `--otel-endpoint`) or set in the environment, and neither `OTEL_SDK_DISABLED=true` nor
/// `OTEL_TRACES_EXPORTER=none` says otherwise.
pub fn requested(configured: bool, env: impl Fn(&str) -> Option<String>) -> bool {
    let set = |name: &str| env(name).is_some_and(|v| !v.trim().is_empty());
    let endpoint = configured || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") || set("OTEL_EXPORTER_OTLP_ENDPOINT");
    let disabled = env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    let no_exporter = env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim().eq_ignore_ascii_case("none"));
    endpoint && !disabled && !no_exporter
}

/// Build the OTLP exporter and tracer from `endpoint` (`--otel-endpoint`, a base URL)
/// and the standard environment, if traces are asked for (see [`requested`]); `runtime`
/// sends the exporter's requests. Returns the running exporter and the tracer for
/// [`layer`].
pub fn start(
    endpoint: Option<&str>,
    runtime: tokio::runtime::Handle,
) -> Result<Option<(Telemetry, SdkTracer)>, SetupError> {
    let env = |name: &str| std::env::var(name).ok();
    if !requested(endpoint.is_some(), env) {
        return Ok(None);
    }
    for name in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
        if let Some(protocol) = env(name).filter(|v| !v.trim().is_empty()) {
            if protocol.trim() != "http/protobuf" {
                return Err(SetupError(format!(
                    "{name}={protocol} is not supported: this build exports OTLP over HTTP with protobuf only \
                     (http/protobuf, usually port 4318)"
                )));
            }
            break;
        }
    }
    let client = ExportClient::new(runtime)?;
    // The exporter reads the endpoint, headers, timeout and compression variables itself.
    let mut exporter = opentelemetry_otlp::SpanExporter::builder().with_http().with_http_client(client);
    if let Some(base) = endpoint {
        // A URL given in code is used as is: the signal's path is ours to add.
        exporter = exporter.with_endpoint(format!("{}/v1/traces", base.trim_end_matches('/')));
    }
    let exporter = exporter.build().map_err(|e| SetupError(e.to_string()))?;
    let resource = Resource::builder()
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .with_attributes(identity(env));
    // The batch processor reads OTEL_BSP_* (schedule delay, queue and batch sizes) and
    // runs on a thread of its own; the sampler follows OTEL_TRACES_SAMPLER.
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build();
    let tracer = provider.tracer("webhook-gateway");
    let _ = TRACER.set(tracer.clone());
    ENABLED.store(true, Ordering::Relaxed);
    Ok(Some((Telemetry { provider }, tracer)))
}

/// The service's name and this process's instance id, as the resource must say them.
///
/// The SDK specification gives `OTEL_SERVICE_NAME` precedence over a `service.name` in
/// `OTEL_RESOURCE_ATTRIBUTES`; the SDK's detectors merge them the other way round, so
/// the name is set here, last. Without either it is `webhook-gateway` (the SDK would say
/// `unknown_service`). `service.instance.id` tells replicas apart: a fresh UUID per
/// process unless `OTEL_RESOURCE_ATTRIBUTES` names one.
pub fn identity(env: impl Fn(&str) -> Option<String>) -> Vec<KeyValue> {
    let attributes = env("OTEL_RESOURCE_ATTRIBUTES").unwrap_or_default();
    let given = |key: &str| {
        attributes
            .split(',')
            .filter_map(|pair| pair.split_once('='))
            .find(|(k, _)| k.trim() == key)
            .map(|(_, v)| v.trim().to_owned())
    };
    let name = env("OTEL_SERVICE_NAME")
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .or_else(|| given("service.name"))
        .unwrap_or_else(|| "webhook-gateway".to_owned());
    let instance = given("service.instance.id").unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    vec![KeyValue::new("service.name", name), KeyValue::new("service.instance.id", instance)]
}

/// Where the database is, as database client spans say it: `db.namespace`,
/// `server.address`, `server.port` (set once, by [`describe_database`]).
static DATABASE: std::sync::OnceLock<(String, String, i64)> = std::sync::OnceLock::new();

/// Remember where `pool` connects (its database, host and port) for database spans.
pub fn describe_database(pool: &crate::db::Pool) {
    let options = pool.connect_options();
    let _ = DATABASE.set((
        options.get_database().unwrap_or("postgres").to_owned(),
        options.get_host().to_owned(),
        i64::from(options.get_port()),
    ));
}

/// The database's name, host and port for a span ("" and 0 before [`describe_database`]).
fn database() -> (&'static str, &'static str, i64) {
    DATABASE.get().map_or(("", "", 0), |(db, host, port)| (db.as_str(), host.as_str(), *port))
}

/// The `tracing` layer that turns this module's spans into OpenTelemetry spans. Only
/// spans of [`TARGET`] become spans; warnings and errors logged inside them become span
/// events. Nothing else (the request log span, debug events) is exported.
pub fn layer<S>(tracer: SdkTracer) -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::Layer as _;
    tracing_opentelemetry::layer().with_tracer(tracer).with_filter(tracing_subscriber::filter::filter_fn(|meta| {
        meta.target() == TARGET || (meta.is_event() && *meta.level() <= tracing::Level::WARN)
    }))
}

/// Sends the exporter's requests with the reqwest (rustls) the gateway already builds, on
/// the tokio runtime: the batch processor's own thread has no runtime to run them on.
/// Not the egress client: a collector on a private address is the operator's choice.
#[derive(Debug)]
struct ExportClient {
    http: reqwest::Client,
    runtime: tokio::runtime::Handle,
    failing: Arc<AtomicBool>,
}

/// A collector's answer is read up to this much (it is a small protobuf status).
const MAX_ANSWER_BYTES: usize = 64 * 1024;

impl ExportClient {
    fn new(runtime: tokio::runtime::Handle) -> Result<ExportClient, SetupError> {
        // The exporter's own clients take the OTLP timeout (milliseconds, default 10 s).
        let timeout = ["OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"]
            .iter()
            .find_map(|name| std::env::var(name).ok()?.trim().parse::<u64>().ok())
            .map_or(Duration::from_secs(10), Duration::from_millis);
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| SetupError(format!("cannot build the exporter's HTTP client: {e}")))?;
        Ok(ExportClient { http, runtime, failing: Arc::default() })
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for ExportClient {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, opentelemetry_http::HttpError> {
        let http = self.http.clone();
        let failing = self.failing.clone();
        let task = self.runtime.spawn(async move {
            let request = reqwest::Request::try_from(request)?;
            let result = async {
                let mut response = http.execute(request).await?;
                let status = response.status();
                let headers = std::mem::take(response.headers_mut());
                let mut body = Vec::new();
                while let Some(chunk) = response.chunk().await? {
                    body.extend_from_slice(&chunk[..chunk.len().min(MAX_ANSWER_BYTES.saturating_sub(body.len()))]);
                    if body.len() >= MAX_ANSWER_BYTES {
                        break;
                    }
                }
                Ok::<_, reqwest::Error>((status, headers, Bytes::from(body)))
            }
            .await;
            // Said once when exporting starts failing and once when it recovers: a
            // collector that is down must not flood the log.
            let ok = matches!(&result, Ok((status, ..)) if status.is_success());
            if !ok && !failing.swap(true, Ordering::Relaxed) {
                match &result {
                    Err(e) => tracing::warn!(error = %e, "exporting spans failed; such batches are dropped until the collector answers"),
                    Ok((status, ..)) => {
                        tracing::warn!(%status, "the OTLP collector refused spans; such batches are dropped until it accepts them")
                    }
                }
            } else if ok && failing.swap(false, Ordering::Relaxed) {
                tracing::info!("exporting spans works again");
            }
            let (status, headers, body) = result?;
            let mut answer = http::Response::new(body);
            *answer.status_mut() = status;
            *answer.headers_mut() = headers;
            Ok::<_, opentelemetry_http::HttpError>(answer)
        });
        task.await?
    }
}

/// The trace context stored with an event: its deliveries' attempts link to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventTrace {
    /// A version-00 `traceparent`.
    pub traceparent: String,
    /// Its `tracestate`, when there was a valid one.
    pub tracestate: Option<String>,
}

impl EventTrace {
    /// The context of `span` to store (the producer span), `None` when tracing is off.
    pub fn of_span(span: &Span) -> Option<EventTrace> {
        if !enabled() || span.is_none() {
            return None;
        }
        let context = span.context();
        let span = context.span();
        let own = TraceParent::of(span.span_context())?;
        let state = span.span_context().trace_state().header();
        Some(EventTrace { traceparent: own.header(), tracestate: parse_tracestate(&state) })
    }

    /// The producer's own context sent with a request (`traceparent`, `tracestate`),
    /// validated; `None` without one. What an event stores with tracing off: with tracing
    /// on, `Ingest::accept` stores its producer span's context instead ([`Self::of_span`]).
    pub fn for_request(headers: &HeaderMap) -> Option<EventTrace> {
        incoming(headers).map(|(parent, tracestate)| EventTrace { traceparent: parent.header(), tracestate })
    }
}

/// The server span of an ingest request (`POST /ingest/{source}`, `POST /v1/events`):
/// a child of the producer's `traceparent` when it sent a valid one.
pub fn server_span(route: &'static str, headers: &HeaderMap) -> Span {
    if !enabled() {
        return Span::none();
    }
    let name = match route {
        "/v1/events" => "POST /v1/events",
        _ => "POST /ingest/{source}",
    };
    let span = tracing::info_span!(target: TARGET, parent: None, "ingest", otel.name = name, otel.kind = "server",
        http.request.method = "POST", http.route = route, http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        webhook.event_id = tracing::field::Empty, webhook.duplicate = tracing::field::Empty);
    if let Some((parent, state)) = incoming(headers) {
        let context = Context::new().with_remote_span_context(parent.span_context(state.as_deref()));
        let _ = span.set_parent(context);
    }
    span
}

/// What the messaging conventions' `messaging.system` says: the queue is this gateway's
/// own, in PostgreSQL (the conventions allow a custom value).
pub const MESSAGING_SYSTEM: &str = "webhook_gateway";

/// A child span of the current one with a static name (`verify`; `store`, the producer
/// span the stored trace context comes from); none when off.
pub fn step(name: &'static str) -> Span {
    if !enabled() {
        return Span::none();
    }
    match name {
        "verify" => tracing::info_span!(target: TARGET, "verify", webhook.source = tracing::field::Empty),
        // The messaging conventions' producer span: the event is sent to the queue (its
        // deliveries); each attempt's consumer span links to it.
        _ => tracing::info_span!(target: TARGET, "store", otel.name = "send deliveries", otel.kind = "producer",
            messaging.system = MESSAGING_SYSTEM, messaging.operation.type = "send", messaging.operation.name = "send",
            messaging.destination.name = "deliveries", webhook.batch_size = tracing::field::Empty),
    }
}

/// The group-commit writer's span for one batch: linked to each event's `store` span.
pub fn commit_span<'a>(events: impl Iterator<Item = &'a Span>, size: usize) -> Span {
    if !enabled() {
        return Span::none();
    }
    let (namespace, address, port) = database();
    let size = size as i64;
    let span = tracing::info_span!(target: TARGET, parent: None, "commit", otel.name = "INSERT events",
        otel.kind = "client", db.system.name = "postgresql", db.namespace = namespace, server.address = address,
        server.port = port, db.operation.name = "INSERT", db.collection.name = "events", webhook.batch_size = size);
    for event in events {
        event.record("webhook.batch_size", size);
        span.follows_from(event);
    }
    span
}

/// The claim span: made after the fact, and only for a claim that took something, so an
/// idle dispatcher's polls export nothing. Its context is linked from each attempt.
pub fn claim_span(started: SystemTime, claimed: usize, probes: usize) -> Option<SpanContext> {
    if !enabled() || claimed == 0 {
        return None;
    }
    let tracer = TRACER.get()?;
    let (namespace, address, port) = database();
    let mut span = tracer
        .span_builder("claim deliveries")
        .with_kind(SpanKind::Client)
        .with_start_time(started)
        .with_attributes([
            KeyValue::new("db.system.name", "postgresql"),
            KeyValue::new("db.namespace", namespace),
            KeyValue::new("server.address", address),
            KeyValue::new("server.port", port),
            KeyValue::new("db.operation.name", "claim"),
            KeyValue::new("db.collection.name", "deliveries"),
            KeyValue::new("webhook.claimed", claimed as i64),
            KeyValue::new("webhook.probes", probes as i64),
        ])
        .start_with_context(tracer, &Context::new());
    let context = span.span_context().clone();
    span.end();
    Some(context)
}

/// The span of one delivery attempt: a root (each attempt is its own trace), linked to
/// the event's stored context and to the claim that took it.
pub fn attempt_span(job: &crate::queue::Claimed, claim: Option<&SpanContext>) -> Span {
    if !enabled() {
        return Span::none();
    }
    let span = tracing::info_span!(target: TARGET, parent: None, "attempt", otel.name = "process deliveries",
        otel.kind = "consumer", messaging.system = MESSAGING_SYSTEM, messaging.operation.type = "process",
        messaging.operation.name = "process", messaging.destination.name = "deliveries",
        messaging.message.id = %job.id, otel.status_code = tracing::field::Empty, webhook.delivery_id = %job.id, webhook.event_id = %job.event_id, webhook.endpoint_id = %job.endpoint_id,
        webhook.attempt = job.attempt, webhook.source = %job.source_name, webhook.event_type = %job.event_type,
        webhook.outcome = tracing::field::Empty);
    if let Some(parent) = job.traceparent.as_deref().and_then(TraceParent::parse) {
        span.add_link(parent.span_context(job.tracestate.as_deref()));
    }
    if let Some(claim) = claim {
        span.add_link(claim.clone());
    }
    span
}

/// The HTTP client span of an attempt's request (a child of the current span), named
/// by the method as the HTTP conventions ask.
pub fn client_span(url: &url::Url) -> Span {
    if !enabled() {
        return Span::none();
    }
    tracing::info_span!(target: TARGET, "POST", otel.kind = "client", http.request.method = "POST",
        url.full = %redacted_url(url), server.address = url.host_str().unwrap_or_default(),
        server.port = url.port_or_known_default().map(i64::from).unwrap_or_default(),
        http.response.status_code = tracing::field::Empty, "error.type" = tracing::field::Empty,
        otel.status_code = tracing::field::Empty)
}

/// The `traceparent` a request sent inside `span` carries; `None` when tracing is off.
pub fn traceparent_of(span: &Span) -> Option<HeaderValue> {
    if !enabled() {
        return None;
    }
    let context = span.context();
    let parent = TraceParent::of(context.span().span_context())?;
    HeaderValue::from_str(&parent.header()).ok()
}

/// The URL as recorded in `url.full`: no user info, and no query or fragment (they often
/// hold tokens: `?key=...`).
pub fn redacted_url(url: &url::Url) -> String {
    let mut shown = url.clone();
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    if shown.query().is_some() {
        shown.set_query(Some("REDACTED"));
    }
    shown.set_fragment(None);
    shown.to_string()
}

/// The recorder's span for one batch of outcomes, linked to each attempt's span.
pub fn record_span<'a>(attempts: impl Iterator<Item = &'a Span>, size: usize) -> Span {
    if !enabled() {
        return Span::none();
    }
    let (namespace, address, port) = database();
    let span = tracing::info_span!(target: TARGET, parent: None, "record", otel.name = "record attempts",
        otel.kind = "client", db.system.name = "postgresql", db.namespace = namespace, server.address = address,
        server.port = port, db.operation.name = "record", db.collection.name = "attempts",
        webhook.batch_size = size as i64);
    for attempt in attempts {
        span.follows_from(attempt);
    }
    span
}

/// A janitor pass's span.
pub fn janitor_span() -> Span {
    if !enabled() {
        return Span::none();
    }
    let (namespace, address, port) = database();
    tracing::info_span!(target: TARGET, parent: None, "janitor", otel.name = "janitor pass",
        otel.kind = "client", db.system.name = "postgresql", db.namespace = namespace, server.address = address,
        server.port = port, db.operation.name = "DELETE", webhook.janitor.status = tracing::field::Empty,
        webhook.janitor.events = tracing::field::Empty, webhook.janitor.deliveries = tracing::field::Empty,
        webhook.janitor.attempts = tracing::field::Empty)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `OTEL_SERVICE_NAME` wins over `OTEL_RESOURCE_ATTRIBUTES`' `service.name`, which wins
    /// over the default; an instance id given there is kept, else each process has its own.
    #[test]
    fn the_service_name_and_instance_follow_the_sdk_specification() {
        let of = |pairs: &[(&str, &str)]| {
            let attributes = identity(|name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned()));
            let get = |key: &str| attributes.iter().find(|kv| kv.key.as_str() == key).map(|kv| kv.value.to_string());
            (get("service.name").unwrap_or_default(), get("service.instance.id").unwrap_or_default())
        };
        const GIVEN: &str = "service.name=from-attributes, service.instance.id=pod-7";
        assert_eq!(
            of(&[("OTEL_SERVICE_NAME", "from-name"), ("OTEL_RESOURCE_ATTRIBUTES", GIVEN)]),
            ("from-name".to_owned(), "pod-7".to_owned())
        );
        assert_eq!(of(&[("OTEL_RESOURCE_ATTRIBUTES", GIVEN)]).0, "from-attributes");
        assert_eq!(of(&[("OTEL_SERVICE_NAME", " ")]).0, "webhook-gateway");
        let (first, second) = (of(&[]).1, of(&[]).1);
        assert!(uuid::Uuid::parse_str(&first).is_ok() && first != second, "{first} {second}");
    }

    #[test]
    fn tracing_is_requested_only_by_an_endpoint_and_can_be_vetoed() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
        };
        assert!(!requested(false, env(&[])));
        assert!(!requested(false, env(&[("OTEL_SERVICE_NAME", "x")])));
        assert!(!requested(false, env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "")])));
        assert!(requested(false, env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")])));
        assert!(requested(false, env(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/v1/traces")])));
        assert!(requested(true, env(&[])), "--otel-endpoint");
        assert!(!requested(false, env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"), ("OTEL_SDK_DISABLED", "true")])));
        assert!(!requested(true, env(&[("OTEL_TRACES_EXPORTER", "none")])));
    }

    #[test]
    fn recorded_urls_hide_credentials_and_queries() {
        let url = url::Url::parse("https://user:pw@example.com:8443/hook?token=s3cret#frag").expect("url");
        assert_eq!(redacted_url(&url), "https://example.com:8443/hook?REDACTED");
        let plain = url::Url::parse("http://example.com/hook").expect("url");
        assert_eq!(redacted_url(&plain), "http://example.com/hook");
    }
}
