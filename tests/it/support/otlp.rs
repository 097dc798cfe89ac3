//! An OTLP/HTTP collector for tests: a real HTTP server on 127.0.0.1 that takes
//! `POST /v1/traces` with protobuf bodies, as a real collector does, and keeps the spans.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::http::StatusCode;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;

/// One exported span with its resource's attributes.
#[derive(Debug, Clone)]
pub struct Exported {
    /// The span as it came over the wire.
    pub span: Span,
    /// Its resource's attributes (`service.name`...), as text.
    pub resource: HashMap<String, String>,
}

impl Exported {
    /// The span's name.
    pub fn name(&self) -> &str {
        &self.span.name
    }

    /// An attribute as text (ints and bools printed), `None` when absent.
    pub fn attr(&self, key: &str) -> Option<String> {
        self.span
            .attributes
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| kv.value.as_ref())
            .and_then(|v| v.value.as_ref().map(text))
    }

    /// An attribute exported as an integer (`None` when absent or of another type: a
    /// status code exported as text is a defect queries for `>= 400` miss).
    pub fn int_attr(&self, key: &str) -> Option<i64> {
        self.span.attributes.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.as_ref()).and_then(|v| {
            match v.value {
                Some(Value::IntValue(i)) => Some(i),
                _ => None,
            }
        })
    }

    /// The trace id as lower-case hex.
    pub fn trace_id(&self) -> String {
        hex::encode(&self.span.trace_id)
    }

    /// The span id as lower-case hex.
    pub fn span_id(&self) -> String {
        hex::encode(&self.span.span_id)
    }

    /// The parent span id as lower-case hex ("" for a root).
    pub fn parent_id(&self) -> String {
        hex::encode(&self.span.parent_span_id)
    }

    /// The links as (trace id, span id) hex pairs.
    pub fn links(&self) -> Vec<(String, String)> {
        self.span.links.iter().map(|l| (hex::encode(&l.trace_id), hex::encode(&l.span_id))).collect()
    }
}

fn text(value: &Value) -> String {
    match value {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(i) => i.to_string(),
        Value::BoolValue(b) => b.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        other => format!("{other:?}"),
    }
}

/// The collector.
#[derive(Clone)]
pub struct Collector {
    /// Where it listens.
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<Exported>>>,
    requests: Arc<Mutex<usize>>,
}

impl Collector {
    /// Start listening.
    pub async fn start() -> Collector {
        let spans: Arc<Mutex<Vec<Exported>>> = Arc::default();
        let requests: Arc<Mutex<usize>> = Arc::default();
        let (kept, counted) = (spans.clone(), requests.clone());
        let handler = move |body: Bytes| {
            let (kept, counted) = (kept.clone(), counted.clone());
            async move {
                *counted.lock().expect("count lock") += 1;
                let Ok(request) = ExportTraceServiceRequest::decode(body) else {
                    return (StatusCode::BAD_REQUEST, Vec::new());
                };
                let mut kept = kept.lock().expect("spans lock");
                for resource_spans in request.resource_spans {
                    let resource: HashMap<String, String> = resource_spans
                        .resource
                        .iter()
                        .flat_map(|r| &r.attributes)
                        .filter_map(|kv| Some((kv.key.clone(), text(kv.value.as_ref()?.value.as_ref()?))))
                        .collect();
                    for scope in resource_spans.scope_spans {
                        for span in scope.spans {
                            kept.push(Exported { span, resource: resource.clone() });
                        }
                    }
                }
                (StatusCode::OK, ExportTraceServiceResponse::default().encode_to_vec())
            }
        };
        let app = axum::Router::new().route("/v1/traces", axum::routing::post(handler));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind collector");
        let addr = listener.local_addr().expect("collector addr");
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Collector { addr, spans, requests }
    }

    /// The base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` takes it.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Exported> {
        self.spans.lock().expect("spans lock").clone()
    }

    /// How many export requests arrived (decodable or not).
    pub fn requests(&self) -> usize {
        *self.requests.lock().expect("count lock")
    }
}
