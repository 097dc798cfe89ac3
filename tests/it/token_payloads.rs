//! Tokens that may not read payloads: no view of the API or the console shows a stored
//! payload (nor a body a transformation made from one) to them, and no call lets them
//! probe for one (a search by payload content, a filter or a transformation tried on a
//! stored event); a token that reads payloads sees the same places with it.

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};

use crate::support::sink::Sink;
use crate::support::{TestApp, eventually};

/// In the payload only: where it shows up, a payload was shown.
const MARKER: &str = "PAYLOADMARKER7f3a";

/// Create a token; the token.
async fn token(app: &TestApp, name: &str, scope: &str, payloads: bool) -> String {
    let created = app.admin_post("/v1/tokens", json!({"name": name, "scope": scope, "payloads": payloads}), 201).await;
    assert_eq!(created["payloads"], payloads);
    created["token"].as_str().expect("token shown once").to_owned()
}

/// `GET path` with `token`: (status, body text).
async fn get(app: &TestApp, path: &str, token: &str) -> (u16, String) {
    let response = app.http.get(app.url(path)).bearer_auth(token).send().await.expect("call");
    (response.status().as_u16(), response.text().await.expect("body"))
}

/// `POST path` with `token` and `body`: (status, body text).
async fn post(app: &TestApp, path: &str, token: &str, body: Value) -> (u16, String) {
    let response = app.http.post(app.url(path)).bearer_auth(token).json(&body).send().await.expect("call");
    (response.status().as_u16(), response.text().await.expect("body"))
}

/// Every `GET` of the served OpenAPI document under `/v1/`, each `{id}` filled with every
/// id of the scene in turn (the ones of another kind answer 404, which shows nothing).
async fn every_get(app: &TestApp, ids: &[&str]) -> Vec<String> {
    let doc: Value = app.http.get(app.url("/openapi.json")).send().await.unwrap().json().await.unwrap();
    let mut paths = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        if !path.starts_with("/v1/") || item.get("get").is_none() {
            continue;
        }
        if path.contains("{id}") {
            paths.extend(ids.iter().map(|id| path.replace("{id}", id)));
        } else {
            paths.push(path.clone());
        }
    }
    assert!(paths.len() >= 20, "{} paths", paths.len());
    paths
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_token_without_payloads_is_shown_none_and_cannot_probe_for_one() {
    let app = TestApp::spawn().await;
    let source = app.source_none("shop").await;
    // A transformation copies the marker into what is sent: the attempt log keeps that too.
    let sink = Sink::ok().await;
    let endpoint = app.admin_post("/v1/endpoints", json!({"url": sink.url("/")}), 201).await;
    let transform = "function handler(w) { return {copied: w.payload.secret}; }";
    let sub = app
        .admin_post(
            "/v1/subscriptions",
            json!({"endpoint_id": endpoint["id"], "source": "shop", "transform": transform}),
            201,
        )
        .await;
    let (status, stored) = app.ingest("shop", "d-1", "order.paid", &format!(r#"{{"secret": "{MARKER}"}}"#)).await;
    assert_eq!(status, 200);
    let event_id = stored["event_id"].as_str().unwrap().to_owned();
    eventually(Duration::from_secs(30), "delivered", || async { (sink.count() >= 1).then_some(()) }).await;
    let event = app.admin_get(&format!("/v1/events/{event_id}")).await;
    let delivery_id = event["deliveries"][0]["id"].as_str().unwrap().to_owned();
    let endpoint_id = endpoint["id"].as_str().unwrap().to_owned();
    let ids = [
        event_id.as_str(),
        delivery_id.as_str(),
        endpoint_id.as_str(),
        source["id"].as_str().unwrap(),
        sub["id"].as_str().unwrap(),
    ];

    let dashboard = token(&app, "dashboard", "read", false).await;
    let on_call = token(&app, "on-call", "operate", false).await;
    let reader = token(&app, "reader", "read", true).await;

    // Every read of the API, for every token: the marker is shown to the reader only, and
    // to the reader on the event and on the attempts (the test's control: it can fail).
    let mut shown_to_reader = Vec::new();
    for path in every_get(&app, &ids).await {
        for t in [&dashboard, &on_call] {
            let (status, body) = get(&app, &path, t).await;
            assert!(status != 401 && status != 500, "GET {path}: {status}");
            assert!(!body.contains(MARKER), "GET {path} shows a payload to a token without payloads: {body}");
        }
        if get(&app, &path, &reader).await.1.contains(MARKER) {
            shown_to_reader.push(path);
        }
    }
    assert!(shown_to_reader.contains(&format!("/v1/events/{event_id}")), "{shown_to_reader:?}");
    assert!(shown_to_reader.contains(&format!("/v1/deliveries/{delivery_id}/attempts")), "{shown_to_reader:?}");
    let (_, withheld) = get(&app, &format!("/v1/events/{event_id}"), &dashboard).await;
    let withheld: Value = serde_json::from_str(&withheld).unwrap();
    assert_eq!(withheld["payload_withheld"], true);
    assert_eq!(withheld["deliveries"][0]["id"], delivery_id.as_str(), "the rest of the event is shown");

    // Probing is refused (403, with the reason), and audited; without the payload it works.
    let search = format!("/v1/events?payload=secret={MARKER}");
    assert_eq!(get(&app, &search, &dashboard).await.0, 403);
    let (status, found) = get(&app, &search, &reader).await;
    assert_eq!((status, found.contains(&event_id)), (200, true), "{found}");
    assert_eq!(get(&app, "/v1/events?header=content-type:application/json", &dashboard).await.0, 200);
    for (path, field, expression) in [
        ("/v1/filters/test", "filter", format!(r#"$.payload.secret == "{MARKER}""#)),
        ("/v1/transforms/test", "transform", transform.to_owned()),
    ] {
        let (status, body) = post(&app, path, &on_call, json!({field: expression, "event_id": event_id})).await;
        assert_eq!(status, 403, "{path}: {body}");
        assert!(body.contains("may not read payloads"), "{body}");
        let pasted = json!({field: expression, "event": {"type": "t", "payload": {"secret": "x"}}});
        assert_eq!(post(&app, path, &on_call, pasted).await.0, 200, "{path}: a pasted event is the caller's own");
    }
    let audit = app.admin_get("/v1/audit?actor=dashboard").await;
    assert!(
        audit["data"].as_array().unwrap().iter().any(|e| e["status"] == 403 && e["action"] == "GET /v1/events"),
        "{audit}"
    );

    // A webhook without a key is keyed by its body's hash, which confirms a guessed body as
    // surely as the body: withheld with it, and not searched for.
    app.admin_post("/v1/sources", json!({"name": "bare", "kind": "none"}), 201).await;
    let body = format!(r#"{{"secret": "{MARKER}", "n": 2}}"#);
    let resp = app.http.post(app.url("/ingest/bare")).body(body.clone()).send().await.expect("ingest");
    assert_eq!(resp.status().as_u16(), 200);
    let bare: Value = resp.json().await.expect("answer");
    let bare_id = bare["event_id"].as_str().expect("event id").to_owned();
    let hash = webhook_gateway::verify::body_sha256_hex(body.as_bytes());
    let (_, shown) = get(&app, &format!("/v1/events/{bare_id}"), &dashboard).await;
    assert!(!shown.contains(&hash) && shown.contains("sha256:withheld"), "{shown}");
    let (_, listed) = get(&app, "/v1/events?source=bare", &dashboard).await;
    assert!(!listed.contains(&hash) && listed.contains(&bare_id), "{listed}");
    assert_eq!(get(&app, &format!("/v1/events?dedupe_key={hash}"), &dashboard).await.0, 403);
    assert_eq!(get(&app, &format!("/v1/events?source=bare&dedupe_key={hash}"), &dashboard).await.0, 403);
    let (status, found) = get(&app, &format!("/v1/events?source=bare&dedupe_key={hash}"), &reader).await;
    assert_eq!((status, found.contains(&hash)), (200, true), "the reader finds it: {found}");

    // An admin token always reads payloads: it can create any token.
    let (status, _) =
        app.admin(Method::POST, "/v1/tokens", Some(json!({"name": "x", "scope": "admin", "payloads": false}))).await;
    assert_eq!(status, 422);

    // The console, signed in with each token: the same pages, the same rule.
    let dashboard_session = crate::console::sign_in_with(&app, &dashboard).await;
    let on_call_session = crate::console::sign_in_with(&app, &on_call).await;
    let reader_session = crate::console::sign_in_with(&app, &reader).await;
    let pages = [
        "/console".to_owned(),
        "/console/events".to_owned(),
        format!("/console/events/{event_id}"),
        format!("/console/deliveries/{delivery_id}"),
        "/console/endpoints".to_owned(),
        format!("/console/endpoints/{endpoint_id}"),
        "/console/dead".to_owned(),
        "/console/sources".to_owned(),
        format!("/console/events?payload=secret%3D{MARKER}"),
        format!("/console/filters?filter=%24.payload.secret+%3D%3D+%22{MARKER}%22&event_id={event_id}"),
        format!("/console/transforms?transform=function+handler(w)+%7B+return+w.payload%3B+%7D&event_id={event_id}"),
    ];
    for path in &pages {
        for session in [&dashboard_session, &on_call_session] {
            let (status, html) = crate::console::page(&app, session, path).await;
            assert_eq!(status, 200, "{path}");
            // The search and filter forms echo what was typed (which holds the marker):
            // look beyond the forms' own fields.
            let shown = [format!("secret={MARKER}"), format!("&#34;{MARKER}&#34;"), format!("\"{MARKER}\"")]
                .iter()
                .fold(html, |html, typed| html.replace(typed.as_str(), ""));
            assert!(!shown.contains(MARKER), "{path} shows a payload to a token without payloads");
        }
    }
    let (_, event_page) = crate::console::page(&app, &dashboard_session, &format!("/console/events/{event_id}")).await;
    assert!(event_page.contains("payload-withheld"), "the page says it is withheld");
    let (_, search_page) = crate::console::page(&app, &dashboard_session, &pages[8]).await;
    assert!(search_page.contains("may not read payloads"), "the search says why");
    let (_, reader_page) = crate::console::page(&app, &reader_session, &format!("/console/events/{event_id}")).await;
    assert!(reader_page.contains(MARKER), "a token that reads payloads sees it");
    let (_, reader_search) = crate::console::page(&app, &reader_session, &pages[8]).await;
    assert!(reader_search.contains(&event_id), "and finds the event by it");
}
