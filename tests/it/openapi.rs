//! The OpenAPI document at `GET /openapi.json`: it is OpenAPI 3.1, it documents every route
//! that `src/api/mod.rs` registers and nothing that is not served, every admin operation
//! documents the shared 401 and 503 and every operation that reads a JSON body the shared
//! 400/413/415/422, and real answers match the statuses and schemas it gives.
//!
//! Adding a route? Annotate its handler with `#[utoipa::path]`, list it in `ApiDoc`
//! (`src/api/openapi.rs`), and add a call to `real_answers_match_the_document` below.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use webhook_gateway::role::Role;

use crate::support::sink::{Reply, Sink};
use crate::support::{ADMIN_TOKEN, TestApp, TestDb, eventually, test_settings};

/// The document the code generates (the same bytes `GET /openapi.json` serves).
fn document() -> Value {
    serde_json::from_str(webhook_gateway::api::document()).expect("the document is JSON")
}

const HTTP_METHODS: [&str; 8] = ["get", "post", "put", "patch", "delete", "head", "options", "trace"];

/// Every `(METHOD, path)` the document describes.
fn documented(doc: &Value) -> BTreeSet<(String, String)> {
    let mut ops = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in HTTP_METHODS {
            if item.get(method).is_some() {
                ops.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    ops
}

#[tokio::test]
async fn the_document_is_served_without_auth_by_every_role() {
    let app = TestApp::spawn().await;
    let resp = app.http.get(app.url("/openapi.json")).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.headers()["content-type"], "application/json");
    let doc: Value = resp.json().await.unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"), "{}", doc["openapi"]);
    assert_eq!(doc, document());
    assert_eq!(doc["info"]["title"], "webhook-gateway");
    assert!(documented(&doc).len() > 30);

    for role in [Role::Ingest, Role::Worker] {
        let settings = webhook_gateway::app::Settings { role, ..test_settings() };
        let app = TestApp::spawn_with(TestDb::new().await, settings, 8).await;
        let resp = app.http.get(app.url("/openapi.json")).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 200, "{role:?}");
        assert_eq!(resp.json::<Value>().await.unwrap(), doc, "{role:?}");
    }
}

/// Every `$ref` in `value` (recursively).
fn refs<'a>(value: &'a Value, out: &mut Vec<&'a str>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("$ref", Value::String(r)) => out.push(r),
                    _ => refs(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

/// Follow a local JSON pointer `#/a/b`.
fn resolve<'a>(doc: &'a Value, reference: &str) -> Option<&'a Value> {
    doc.pointer(reference.strip_prefix('#')?)
}

#[test]
fn the_document_is_well_formed() {
    let doc = document();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    let mut all = Vec::new();
    refs(&doc, &mut all);
    assert!(!all.is_empty());
    for r in all {
        assert!(resolve(&doc, r).is_some(), "unresolved $ref {r}");
    }
    let mut ids = BTreeSet::new();
    // The 401 and 503 of every admin operation: one group (`AdminErrors`), not copies.
    let mut admin_errors: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        let placeholders: BTreeSet<&str> =
            path.split('/').filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}'))).collect();
        for method in HTTP_METHODS {
            let Some(op) = item.get(method) else { continue };
            let what = format!("{} {path}", method.to_uppercase());
            let id = op["operationId"].as_str().unwrap_or_else(|| panic!("{what}: no operationId"));
            assert!(ids.insert(id.to_owned()), "{what}: operationId {id} is not unique");
            assert!(op["summary"].is_string(), "{what}: no summary");
            let params: BTreeSet<&str> = op["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["in"] == "path")
                .map(|p| p["name"].as_str().unwrap())
                .collect();
            assert_eq!(params, placeholders, "{what}: path parameters");
            // Admin calls need the bearer token; nothing else does.
            let security = op.get("security").cloned().unwrap_or(Value::Null);
            if path.starts_with("/v1/") {
                // Each names the scope it needs (the table in `tokens::required`).
                let scope = op["x-required-scope"].as_str().unwrap_or_else(|| panic!("{what}: no x-required-scope"));
                assert!(["read", "operate", "admin"].contains(&scope), "{what}: {scope}");
                assert_eq!(security, json!([{"admin_token": [scope]}]), "{what}");
                assert!(op["responses"]["403"].is_object(), "{what}: 403 undocumented");
                let (unauthorized, unavailable) = (&op["responses"]["401"], &op["responses"]["503"]);
                assert!(unauthorized.is_object(), "{what}: 401 undocumented");
                assert!(unavailable.is_object(), "{what}: 503 undocumented");
                assert!(unavailable["headers"]["Retry-After"].is_object(), "{what}: 503 without Retry-After");
                admin_errors.entry(json!([unauthorized, unavailable]).to_string()).or_default().push(what.clone());
            } else {
                assert!(security.is_null(), "{what}: public routes need no token");
            }
            let responses = op["responses"].as_object().unwrap();
            assert!(responses.keys().any(|s| s.starts_with('2')), "{what}: no success answer");
            for (status, response) in responses {
                if status.as_str() >= "400" && path != "/readyz" && response.get("content").is_some() {
                    assert_eq!(
                        response["content"]["application/json"]["schema"]["$ref"], "#/components/schemas/ErrorBody",
                        "{what} {status}: errors are ErrorBody"
                    );
                }
            }
        }
    }
    assert!(doc["components"]["securitySchemes"]["admin_token"]["scheme"] == "bearer");
    // Error codes are an enum in the document, every one of them.
    let codes = resolve(&doc, "#/components/schemas/ErrorCode").expect("ErrorCode schema")["enum"].clone();
    let listed: BTreeSet<&str> = codes.as_array().expect("enum").iter().filter_map(Value::as_str).collect();
    let known: BTreeSet<&str> = webhook_gateway::error::ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    assert_eq!(listed, known, "the document lists every error code");
    assert_eq!(
        admin_errors.len(),
        1,
        "admin operations document different 401/503 answers (list `AdminErrors`, not your own): {:#?}",
        admin_errors
    );
}

/// The console's pages are not API: no documented path is under `/console`.
#[test]
fn no_console_page_is_documented() {
    let documented = documented(&document());
    assert!(documented.iter().any(|(_, p)| p == "/v1/deliveries/{id}/attempts"), "{documented:?}");
    assert!(!documented.iter().any(|(_, p)| p.starts_with("/console")), "the console is not API: {documented:?}");
}

/// The path of `template` with its placeholders filled in.
fn fill(template: &str) -> String {
    template
        .split('/')
        .map(|seg| match seg {
            "{source}" => "no-such-source".to_owned(),
            s if s.starts_with('{') => uuid::Uuid::new_v4().to_string(),
            s => s.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("/")
}

/// The router and the document come from one declaration (`api::routes`); asked from
/// outside, they agree: every documented operation is served (never the router's
/// fallback, never 405), and every other method on a documented path is 405.
#[tokio::test]
async fn every_documented_path_serves_exactly_its_documented_methods() {
    let app = TestApp::spawn().await;
    let documented = documented(&document());
    let paths: BTreeSet<&String> = documented.iter().map(|(_, p)| p).collect();
    for template in paths {
        let path = fill(template);
        for method in ["GET", "POST", "PUT", "PATCH", "DELETE"] {
            let mut req = app.http.request(Method::from_bytes(method.as_bytes()).unwrap(), app.url(&path));
            req = req.bearer_auth(ADMIN_TOKEN);
            if method == "POST" || method == "PATCH" || method == "PUT" {
                req = req.json(&json!({}));
            }
            let resp = req.send().await.unwrap();
            let status = resp.status().as_u16();
            let body = resp.json::<Value>().await.unwrap_or(Value::Null);
            if documented.contains(&(method.to_owned(), template.clone())) {
                assert_ne!(status, 405, "{method} {path}: documented, not served");
                assert!(
                    !(status == 404 && body["error"]["message"] == "route not found"),
                    "{method} {path}: the router's fallback answered: documented but not served"
                );
            } else {
                assert_eq!(status, 405, "{method} {path}: served but not documented ({body})");
            }
        }
    }
}

/// Which operations read a JSON body is asked of the gateway, route by route (a body that
/// is not JSON is refused `malformed_json` only by a handler that reads one), not taken from
/// a list: each must document a JSON request body and the answers of one, 400, 413 and 422,
/// and 415 exactly when it refuses a body that is not `application/json`. Those answers are
/// one group (`JsonBodyErrors`), the same on every operation.
#[tokio::test]
async fn every_json_body_operation_documents_its_errors() {
    let app = TestApp::spawn().await;
    let doc = document();
    let too_large = vec![b' '; test_settings().max_body_bytes + 1];
    let mut json_ops = Vec::new();
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (method, template) in documented(&doc) {
        let path = fill(&template);
        let what = format!("{method} {template}");
        let send = |content_type: &'static str, body: Vec<u8>| {
            let method = Method::from_bytes(method.as_bytes()).unwrap();
            let req = app.http.request(method, app.url(&path)).bearer_auth(ADMIN_TOKEN);
            async move {
                let resp = req.header("content-type", content_type).body(body).send().await.unwrap();
                let status = resp.status().as_u16();
                (status, resp.json::<Value>().await.unwrap_or(Value::Null))
            }
        };
        let (status, body) = send("application/json", b"{nope".to_vec()).await;
        let reads_json = status == 400 && body["error"]["code"] == "malformed_json";
        let op = &doc["paths"][&template][method.to_lowercase()];
        let documented_body = op["requestBody"]["content"].get("application/json").is_some();
        assert_eq!(
            reads_json, documented_body,
            "{what}: reads a JSON body: {reads_json}, documents one: {documented_body}"
        );
        if !reads_json {
            continue;
        }
        let (wrong_shape, _) = send("application/json", b"\"not an object\"".to_vec()).await;
        assert_eq!(wrong_shape, 422, "{what}: a JSON body of the wrong shape");
        let (over, _) = send("application/json", too_large.clone()).await;
        assert_eq!(over, 413, "{what}: a body over the limit");
        let (not_json, _) = send("text/plain", b"{}".to_vec()).await;
        let responses = &op["responses"];
        for status in ["400", "413", "422"] {
            assert!(responses[status].is_object(), "{what}: {status} undocumented");
        }
        assert_eq!(
            responses["415"].is_object(),
            not_json == 415,
            "{what}: answers {not_json} to a text/plain body; 415 documented: {}",
            responses["415"].is_object()
        );
        if not_json == 415 {
            let group = json!([responses["400"], responses["413"], responses["415"], responses["422"]]);
            groups.entry(group.to_string()).or_default().push(what.clone());
        }
        json_ops.push(what);
    }
    assert!(json_ops.len() >= 9, "fewer JSON-body operations than there are: {json_ops:?}");
    assert_eq!(
        groups.len(),
        1,
        "JSON-body operations document different 400/413/415/422 answers (list `JsonBodyErrors`, not your own): \
         {:#?}",
        groups
    );
}

/// Checks `value` against `schema` (the subset of JSON Schema utoipa emits), pushing what
/// does not match. Stricter than JSON Schema on one point: an object may not carry a
/// property its schema does not list, so an undocumented field fails too.
fn check(doc: &Value, schema: &Value, value: &Value, at: &str, errors: &mut Vec<String>) {
    if let Some(r) = schema["$ref"].as_str() {
        let target = resolve(doc, r).unwrap_or_else(|| panic!("unresolved {r}"));
        return check(doc, target, value, at, errors);
    }
    let matches = |s: &Value| {
        let mut e = Vec::new();
        check(doc, s, value, at, &mut e);
        e.is_empty()
    };
    if let Some(options) = schema["oneOf"].as_array() {
        let n = options.iter().filter(|s| matches(s)).count();
        if n != 1 {
            errors.push(format!("{at}: {n} of oneOf match {value}"));
        }
    }
    if let Some(options) = schema["anyOf"].as_array()
        && !options.iter().any(matches)
    {
        errors.push(format!("{at}: no anyOf matches {value}"));
    }
    for s in schema["allOf"].as_array().into_iter().flatten() {
        check(doc, s, value, at, errors);
    }
    let types: Vec<&str> = match &schema["type"] {
        Value::String(t) => vec![t],
        Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let type_ok = |t: &str| match t {
        "null" => value.is_null(),
        "boolean" => value.is_boolean(),
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        "string" => value.is_string(),
        "array" => value.is_array(),
        "object" => value.is_object(),
        other => panic!("type {other}"),
    };
    if !types.is_empty() && !types.iter().any(|t| type_ok(t)) {
        errors.push(format!("{at}: {value} is not {types:?}"));
        return;
    }
    if let Some(allowed) = schema["enum"].as_array()
        && !allowed.contains(value)
    {
        errors.push(format!("{at}: {value} not in {allowed:?}"));
    }
    if let Some(s) = value.as_str() {
        let ok = match schema["format"].as_str() {
            Some("uuid") => uuid::Uuid::parse_str(s).is_ok(),
            Some("date-time") => chrono::DateTime::parse_from_rfc3339(s).is_ok(),
            _ => true,
        };
        if !ok {
            errors.push(format!("{at}: {s:?} is not a {}", schema["format"]));
        }
    }
    if let Some(n) = value.as_f64()
        && (schema["minimum"].as_f64().is_some_and(|min| n < min) || schema["maximum"].as_f64().is_some_and(|m| n > m))
    {
        errors.push(format!("{at}: {n} out of range"));
    }
    if let (Some(object), Some(properties)) = (value.as_object(), schema["properties"].as_object()) {
        for required in schema["required"].as_array().into_iter().flatten() {
            let required = required.as_str().unwrap();
            if !object.contains_key(required) {
                errors.push(format!("{at}: required `{required}` missing"));
            }
        }
        for (key, v) in object {
            match properties.get(key) {
                Some(s) => check(doc, s, v, &format!("{at}.{key}"), errors),
                None if schema["additionalProperties"].is_object() || schema["additionalProperties"] == true => {}
                None => errors.push(format!("{at}: `{key}` is not in the schema")),
            }
        }
    }
    if let (Some(items), Some(item_schema)) = (value.as_array(), schema.get("items")) {
        for (i, v) in items.iter().enumerate() {
            check(doc, item_schema, v, &format!("{at}[{i}]"), errors);
        }
    }
}

/// A request for [`Walk::call`].
struct Call {
    method: Method,
    path: String,
    auth: bool,
    headers: Vec<(&'static str, String)>,
    body: Option<(&'static str, Vec<u8>)>,
}

impl Call {
    fn new(method: Method, path: impl Into<String>) -> Call {
        Call { method, path: path.into(), auth: false, headers: Vec::new(), body: None }
    }
    fn admin(method: Method, path: impl Into<String>) -> Call {
        Call { auth: true, ..Call::new(method, path) }
    }
    fn json(self, body: Value) -> Call {
        Call { body: Some(("application/json", body.to_string().into_bytes())), ..self }
    }
    fn raw(self, content_type: &'static str, body: impl Into<Vec<u8>>) -> Call {
        Call { body: Some((content_type, body.into())), ..self }
    }
    fn header(mut self, name: &'static str, value: impl Into<String>) -> Call {
        self.headers.push((name, value.into()));
        self
    }
}

/// Requests against a gateway, each answer checked against the document.
struct Walk {
    app: TestApp,
    doc: Value,
    /// `(METHOD, template) -> statuses seen`.
    seen: BTreeMap<(String, String), BTreeSet<u16>>,
    errors: Vec<String>,
}

impl Walk {
    /// The documented path template that `path` is an instance of.
    fn template(&self, method: &str, path: &str) -> String {
        let segs: Vec<&str> = path.split('/').collect();
        let mut best: Option<(usize, String)> = None;
        for (m, template) in documented(&self.doc) {
            let tsegs: Vec<&str> = template.split('/').collect();
            if m != method || tsegs.len() != segs.len() {
                continue;
            }
            let fits = tsegs.iter().zip(&segs).all(|(t, s)| t.starts_with('{') || t == s);
            let literal = tsegs.iter().filter(|t| !t.starts_with('{')).count();
            if fits && best.as_ref().is_none_or(|(n, _)| literal > *n) {
                best = Some((literal, template));
            }
        }
        best.unwrap_or_else(|| panic!("{method} {path}: no documented path")).1
    }

    /// Send, check the answer against the document, and return status and JSON body.
    async fn call(&mut self, call: Call, expect: u16) -> Value {
        let method = call.method.as_str().to_owned();
        let (bare, _query) = call.path.split_once('?').unwrap_or((&call.path, ""));
        let template = self.template(&method, bare);
        let what = format!("{method} {}", call.path);
        let mut req = self.app.http.request(call.method.clone(), self.app.url(&call.path));
        if call.auth {
            req = req.bearer_auth(ADMIN_TOKEN);
        }
        for (name, value) in &call.headers {
            req = req.header(*name, value);
        }
        if let Some((content_type, body)) = &call.body {
            req = req.header("content-type", *content_type).body(body.clone());
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let content_type = resp.headers().get("content-type").map(|v| v.to_str().unwrap().to_owned());
        let bytes = resp.bytes().await.unwrap();
        let json: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        assert_eq!(status, expect, "{what}: {}", String::from_utf8_lossy(&bytes));
        self.seen.entry((method.clone(), template.clone())).or_default().insert(status);

        let op = &self.doc["paths"][&template][method.to_lowercase()];
        let Some(response) = op["responses"].get(status.to_string()) else {
            self.errors.push(format!("{what}: status {status} is not documented"));
            return json;
        };
        match (response["content"].as_object(), content_type) {
            (None, None) if bytes.is_empty() => {}
            (None, _) => self.errors.push(format!("{what}: {status} documents no body but one came")),
            (Some(_), None) => self.errors.push(format!("{what}: {status} has no content-type")),
            (Some(content), Some(actual)) => {
                let media = |ct: &str| ct.split(';').next().unwrap().trim().to_owned();
                match content.iter().find(|(documented, _)| media(documented) == media(&actual)) {
                    None => self.errors.push(format!("{what}: content-type {actual} is not documented")),
                    Some((_, media_type)) if media(&actual) == "application/json" => {
                        let mut errors = Vec::new();
                        check(&self.doc, &media_type["schema"], &json, &format!("{what} -> {status}"), &mut errors);
                        self.errors.extend(errors);
                    }
                    Some(_) => {}
                }
            }
        }
        // A request the gateway accepted must be valid under the documented request body.
        if (200..300).contains(&status)
            && let Some((content_type, body)) = &call.body
            && *content_type == "application/json"
            && let Some(schema) = op["requestBody"]["content"]["application/json"].get("schema")
        {
            let body: Value = serde_json::from_slice(body).unwrap();
            check(&self.doc, schema, &body, &format!("{what} request"), &mut self.errors);
        }
        json
    }
}

const SLACK_SECRET: &str = "openapi-slack-signing-secret";

fn slack_headers(call: Call, body: &str) -> Call {
    use hmac::{Hmac, Mac};
    let ts = chrono::Utc::now().timestamp();
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(SLACK_SECRET.as_bytes()).unwrap();
    mac.update(format!("v0:{ts}:{body}").as_bytes());
    call.header("x-slack-signature", format!("v0={}", hex::encode(mac.finalize().into_bytes())))
        .header("x-slack-request-timestamp", ts.to_string())
}

#[tokio::test]
async fn real_answers_match_the_document() {
    use Method as M;
    // The first attempt of every delivery fails with 500, the retry succeeds: real attempts
    // of both kinds in the timeline.
    // `/gone` refuses for good (410: dead at once), to have a dead delivery blocking a line.
    let sink = Sink::start(|r, n| {
        if r.path == "/gone" {
            Reply::status(410)
        } else if n == 0 {
            Reply::status(500)
        } else {
            Reply::status(200)
        }
    })
    .await;
    // A Prometheus handle of its own (not the process-wide recorder): `/metrics` answers.
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder().handle();
    let settings = webhook_gateway::app::Settings { metrics: Some(metrics), ..test_settings() };
    let app = TestApp::spawn_with(TestDb::new().await, settings, 32).await;
    let mut w = Walk { app, doc: document(), seen: BTreeMap::new(), errors: Vec::new() };

    // Operations.
    w.call(Call::new(M::GET, "/healthz"), 200).await;
    w.call(Call::new(M::GET, "/readyz"), 200).await;
    w.call(Call::new(M::GET, "/metrics"), 200).await;
    w.call(Call::new(M::GET, "/openapi.json"), 200).await;
    w.call(Call::new(M::GET, "/v1/sources"), 401).await;

    // Sources.
    let shop = json!({"name": "shop", "kind": "none", "dedupe": {"header": "X-Delivery-Id"},
                      "event_type": {"json_pointer": "/type"}});
    let shop = w.call(Call::admin(M::POST, "/v1/sources").json(shop), 201).await;
    let hmac = json!({"name": "signed", "kind": "hmac", "secrets": ["a-long-shared-secret"], "tolerance_secs": 60,
                      "hmac": {"header": "X-Signature", "algorithm": "sha512", "encoding": "base64",
                               "prefix": "sha512="}});
    let signed = w.call(Call::admin(M::POST, "/v1/sources").json(hmac), 201).await;
    let slack = json!({"name": "slack", "kind": "slack", "secrets": [SLACK_SECRET]});
    w.call(Call::admin(M::POST, "/v1/sources").json(slack), 201).await;
    w.call(Call::admin(M::POST, "/v1/sources").json(json!({"name": "shop", "kind": "none"})), 409).await;
    w.call(Call::admin(M::POST, "/v1/sources").json(json!({"name": "-x", "kind": "none"})), 422).await;
    w.call(Call::admin(M::POST, "/v1/sources").json(json!({"name": "x"})), 422).await;
    w.call(Call::admin(M::POST, "/v1/sources").raw("application/json", "{nope"), 400).await;
    w.call(Call::admin(M::POST, "/v1/sources").raw("text/plain", "{}"), 415).await;
    w.call(Call::admin(M::POST, "/v1/sources").raw("application/json", vec![b' '; 70_000]), 413).await;
    let sources = w.call(Call::admin(M::GET, "/v1/sources"), 200).await;
    let api = sources["data"].as_array().unwrap().iter().find(|s| s["name"] == "api").unwrap().clone();
    let id = |v: &Value| v["id"].as_str().unwrap().to_owned();
    let (shop_id, signed_id, api_id) = (id(&shop), id(&signed), id(&api));
    w.call(Call::admin(M::GET, format!("/v1/sources/{shop_id}")), 200).await;
    w.call(Call::admin(M::GET, format!("/v1/sources/{}", uuid::Uuid::new_v4())), 404).await;
    let patch = json!({"tolerance_secs": null, "secrets": ["a-newer-shared-secret"]});
    w.call(Call::admin(M::PATCH, format!("/v1/sources/{signed_id}")).json(patch), 200).await;
    w.call(Call::admin(M::PATCH, format!("/v1/sources/{api_id}")).json(json!({"secrets": []})), 409).await;
    w.call(Call::admin(M::DELETE, format!("/v1/sources/{signed_id}?force=perhaps")), 422).await;
    w.call(Call::admin(M::DELETE, format!("/v1/sources/{signed_id}")), 204).await;

    // Endpoints and subscriptions: `live` delivers to the sink; `held` is paused, so its
    // deliveries stay pending.
    let live = w.call(Call::admin(M::POST, "/v1/endpoints").json(json!({"url": sink.url("/live")})), 201).await;
    let held = json!({"url": sink.url("/held"), "description": "paused"});
    let held = w.call(Call::admin(M::POST, "/v1/endpoints").json(held), 201).await;
    let (live_id, held_id) = (live["id"].as_str().unwrap(), held["id"].as_str().unwrap());
    w.call(Call::admin(M::POST, "/v1/endpoints").json(json!({"url": "ftp://example.com"})), 422).await;
    w.call(Call::admin(M::GET, "/v1/endpoints"), 200).await;
    w.call(Call::admin(M::GET, format!("/v1/endpoints/{live_id}")), 200).await;
    w.call(Call::admin(M::GET, "/v1/endpoints/not-an-id"), 404).await;
    w.call(Call::admin(M::PATCH, format!("/v1/endpoints/{live_id}")).json(json!({"description": "the sink"})), 200)
        .await;
    w.call(Call::admin(M::POST, format!("/v1/endpoints/{held_id}/pause")), 200).await;
    let sub = json!({"endpoint_id": live_id, "source": "shop", "event_types": ["order.*"]});
    let sub = w.call(Call::admin(M::POST, "/v1/subscriptions").json(sub), 201).await;
    let sub_id = sub["id"].as_str().unwrap();
    w.call(Call::admin(M::POST, "/v1/subscriptions").json(json!({"endpoint_id": held_id})), 201).await;
    let missing = json!({"endpoint_id": uuid::Uuid::new_v4()});
    w.call(Call::admin(M::POST, "/v1/subscriptions").json(missing), 422).await;
    w.call(Call::admin(M::GET, "/v1/subscriptions"), 200).await;
    w.call(Call::admin(M::GET, format!("/v1/subscriptions?endpoint_id={live_id}")), 200).await;
    w.call(Call::admin(M::GET, "/v1/subscriptions?endpoint_id=nope"), 422).await;
    w.call(Call::admin(M::GET, format!("/v1/subscriptions/{sub_id}")), 200).await;
    w.call(Call::admin(M::PATCH, format!("/v1/subscriptions/{sub_id}")).json(json!({"event_types": null})), 200).await;

    // Ingest and publish.
    let order = r#"{"type": "order.created", "order": 42}"#;
    let ingest = |id: &str| Call::new(M::POST, "/ingest/shop").header("x-delivery-id", id);
    let first = w.call(ingest("d-1").raw("application/json", order), 200).await;
    w.call(ingest("d-1").raw("application/json", order), 200).await;
    let binary = w.call(ingest("d-2").raw("application/octet-stream", vec![0xff, 0xfe, 0x00]), 200).await;
    w.call(Call::new(M::POST, "/ingest/nobody").raw("application/json", "{}"), 404).await;
    w.call(Call::new(M::POST, "/ingest/api").raw("application/json", "{}"), 403).await;
    w.call(Call::new(M::POST, "/ingest/shop").raw("application/json", vec![b' '; 70_000]), 413).await;
    w.call(Call::new(M::POST, "/ingest/slack").raw("application/json", "{}"), 401).await;
    let challenge = r#"{"type": "url_verification", "challenge": "c-123"}"#;
    w.call(slack_headers(Call::new(M::POST, "/ingest/slack"), challenge).raw("application/json", challenge), 200).await;
    let no_id = r#"{"type": "event_callback"}"#;
    w.call(slack_headers(Call::new(M::POST, "/ingest/slack"), no_id).raw("application/json", no_id), 400).await;
    let publish = json!({"event_type": "order.paid", "event_id": "o-42-paid", "payload": {"order": 42}});
    w.call(Call::admin(M::POST, "/v1/events").json(publish), 200).await;
    let publish = json!({"event_type": "", "event_id": "x", "payload": null});
    w.call(Call::admin(M::POST, "/v1/events").json(publish), 422).await;

    // Events.
    let page = w.call(Call::admin(M::GET, "/v1/events?limit=1"), 200).await;
    assert!(page["next_cursor"].is_string(), "{page}");
    let cursor = page["next_cursor"].as_str().unwrap();
    w.call(Call::admin(M::GET, format!("/v1/events?source=shop&limit=10&cursor={cursor}")), 200).await;
    w.call(Call::admin(M::GET, "/v1/events?limit=0"), 422).await;
    w.call(Call::admin(M::GET, "/v1/events?source=nobody"), 422).await;
    let event_id = first["event_id"].as_str().unwrap();
    w.call(Call::admin(M::GET, format!("/v1/events/{event_id}")), 200).await;
    let binary = w.call(Call::admin(M::GET, format!("/v1/events/{}", binary["event_id"].as_str().unwrap())), 200).await;
    assert_eq!(binary["payload_base64"], "//4A", "{binary}");
    w.call(Call::admin(M::GET, format!("/v1/events/{}", uuid::Uuid::new_v4())), 404).await;

    // Deliveries: the order goes to `live` (after one failed attempt).
    let app = &w.app;
    let delivery_id = eventually(Duration::from_secs(20), "the order is delivered", || async move {
        let (_, page) =
            app.admin(M::GET, &format!("/v1/deliveries?endpoint_id={live_id}&status=delivered"), None).await;
        page["data"].as_array().and_then(|d| d.first()).map(|d| d["id"].as_str().unwrap().to_owned())
    })
    .await;
    w.call(Call::admin(M::GET, "/v1/deliveries"), 200).await;
    w.call(Call::admin(M::GET, format!("/v1/deliveries?event_id={event_id}&status=pending&limit=5")), 200).await;
    w.call(Call::admin(M::GET, "/v1/deliveries?status=lost"), 422).await;
    w.call(Call::admin(M::GET, format!("/v1/deliveries/{delivery_id}")), 200).await;
    w.call(Call::admin(M::GET, format!("/v1/deliveries/{}", uuid::Uuid::new_v4())), 404).await;
    let timeline = w.call(Call::admin(M::GET, format!("/v1/deliveries/{delivery_id}/attempts")), 200).await;
    assert_eq!(timeline["data"].as_array().unwrap().len(), 2, "{timeline}");
    w.call(Call::admin(M::POST, format!("/v1/deliveries/{delivery_id}/redeliver")), 200).await;
    w.call(Call::admin(M::POST, format!("/v1/deliveries/{}/redeliver", uuid::Uuid::new_v4())), 404).await;
    w.call(Call::admin(M::GET, "/v1/admin/storage"), 200).await;
    w.call(Call::admin(M::GET, "/v1/admin/replicas"), 200).await;
    // Tokens and the audit log.
    let token = json!({"name": "walker", "scope": "read"});
    let created = w.call(Call::admin(M::POST, "/v1/tokens").json(token.clone()), 201).await;
    w.call(Call::admin(M::POST, "/v1/tokens").json(token), 409).await;
    w.call(Call::admin(M::POST, "/v1/tokens").json(json!({"name": "", "scope": "read"})), 422).await;
    w.call(Call::admin(M::GET, "/v1/tokens"), 200).await;
    let read_only = created["token"].as_str().expect("token").to_owned();
    w.call(Call::new(M::DELETE, "/v1/tokens/walker").header("authorization", format!("Bearer {read_only}")), 403).await;
    w.call(Call::admin(M::DELETE, "/v1/tokens/walker"), 200).await;
    w.call(Call::admin(M::DELETE, "/v1/tokens/nobody"), 404).await;
    w.call(Call::admin(M::GET, "/v1/audit?actor=admin&limit=5"), 200).await;

    // Ordered delivery: `gone` is subscribed in order to the API's events; its dead
    // delivery blocks the key's line until unblocked.
    let gone = w.call(Call::admin(M::POST, "/v1/endpoints").json(json!({"url": sink.url("/gone")})), 201).await;
    let gone_id = gone["id"].as_str().unwrap().to_owned();
    let ordered = json!({"endpoint_id": gone_id, "source": "api", "event_types": ["ledger.*"],
                         "ordered": {"on_dead": "block"}});
    w.call(Call::admin(M::POST, "/v1/subscriptions").json(ordered), 201).await;
    for n in 0..2 {
        let entry = json!({"event_type": "ledger.entry", "event_id": format!("l-{n}"), "ordering_key": "acct-1",
                           "payload": {"n": n}});
        w.call(Call::admin(M::POST, "/v1/events").json(entry), 200).await;
    }
    let app = &w.app;
    let gone_dead = format!("/v1/deliveries?endpoint_id={gone_id}&status=dead");
    let dead_id = eventually(Duration::from_secs(20), "the first entry is dead", || async {
        let (_, page) = app.admin(M::GET, &gone_dead, None).await;
        page["data"].as_array().and_then(|d| d.first()).map(|d| d["id"].as_str().unwrap().to_owned())
    })
    .await;
    w.call(Call::admin(M::GET, format!("/v1/deliveries?endpoint_id={gone_id}&status=pending")), 200).await;
    w.call(Call::admin(M::POST, format!("/v1/deliveries/{dead_id}/unblock")), 200).await;
    w.call(Call::admin(M::POST, format!("/v1/deliveries/{dead_id}/unblock")), 409).await;
    w.call(Call::admin(M::POST, format!("/v1/deliveries/{}/unblock", uuid::Uuid::new_v4())), 404).await;

    // Endpoint operations.
    w.call(Call::admin(M::POST, format!("/v1/endpoints/{live_id}/rotate-secret")), 200).await;
    let rotate = json!({"secret": live["secret"], "grace_secs": 60});
    w.call(Call::admin(M::POST, format!("/v1/endpoints/{live_id}/rotate-secret")).json(rotate), 200).await;
    let too_long = json!({"grace_secs": 31 * 24 * 3600});
    w.call(Call::admin(M::POST, format!("/v1/endpoints/{live_id}/rotate-secret")).json(too_long), 422).await;
    w.call(Call::admin(M::POST, format!("/v1/endpoints/{live_id}/test")), 202).await;
    w.call(Call::admin(M::POST, format!("/v1/endpoints/{}/test", uuid::Uuid::new_v4())), 404).await;
    let window = json!({"since": "2020-01-01T00:00:00Z", "until": "2021-01-01T00:00:00Z"});
    w.call(Call::admin(M::POST, format!("/v1/endpoints/{live_id}/recover")).json(window), 200).await;
    let backwards = json!({"since": "2021-01-01T00:00:00Z", "until": "2020-01-01T00:00:00Z"});
    w.call(Call::admin(M::POST, format!("/v1/endpoints/{live_id}/recover")).json(backwards), 422).await;
    w.call(Call::admin(M::POST, format!("/v1/endpoints/{live_id}/resume")), 200).await;
    let held_pending = format!("/v1/deliveries?endpoint_id={held_id}&status=pending");
    assert!(!w.call(Call::admin(M::GET, held_pending), 200).await["data"].as_array().unwrap().is_empty());
    w.call(Call::admin(M::DELETE, format!("/v1/endpoints/{held_id}")), 409).await;
    w.call(Call::admin(M::DELETE, format!("/v1/endpoints/{held_id}?force=true")), 200).await;
    w.call(Call::admin(M::DELETE, format!("/v1/endpoints/{held_id}")), 404).await;

    // Trying a filter: on a pasted event, a bad filter, an unknown stored event.
    let pasted = json!({"filter": "$.payload.a == 1", "event": {"payload": {"a": 1}, "type": "t"}});
    w.call(Call::admin(M::POST, "/v1/filters/test").json(pasted), 200).await;
    w.call(Call::admin(M::POST, "/v1/filters/test").json(json!({"filter": "$.a = 1", "event": {}})), 422).await;
    let unknown = json!({"filter": "$.a == 1", "event_id": uuid::Uuid::new_v4()});
    w.call(Call::admin(M::POST, "/v1/filters/test").json(unknown), 404).await;

    // Trying a transformation: one that works, one that throws (still 200, with the error), a bad script.
    let works =
        json!({"transform": "function handler(w) { return {n: w.payload.a}; }", "event": {"payload": {"a": 1}}});
    w.call(Call::admin(M::POST, "/v1/transforms/test").json(works), 200).await;
    let throws = json!({"transform": "function handler(w) { throw new Error('x'); }", "event": {}});
    w.call(Call::admin(M::POST, "/v1/transforms/test").json(throws), 200).await;
    let bad = json!({"transform": "function handler(w {", "event": {}});
    w.call(Call::admin(M::POST, "/v1/transforms/test").json(bad), 422).await;

    // Deleting what is left.
    w.call(Call::admin(M::DELETE, format!("/v1/subscriptions/{sub_id}")), 204).await;
    w.call(Call::admin(M::DELETE, format!("/v1/subscriptions/{sub_id}")), 404).await;
    w.call(Call::admin(M::DELETE, format!("/v1/sources/{shop_id}")), 409).await;
    w.call(Call::admin(M::DELETE, format!("/v1/sources/{shop_id}?force=true")), 204).await;

    assert!(w.errors.is_empty(), "answers that do not match the document:\n{}", w.errors.join("\n"));
    // Every documented operation was exercised, with at least one success.
    for op in documented(&w.doc) {
        let ok = w.seen.get(&op).is_some_and(|s| s.iter().any(|s| (200..300).contains(s)));
        assert!(ok, "{op:?} never answered 2xx here: add it to this walk");
    }
}
