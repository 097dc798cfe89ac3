//! The web console (`/console`): sessions, CSRF, escaping and headers over plain HTTP, and
//! an operator's round in a real browser (headless Chromium driven over WebDriver), which
//! writes a screenshot of each page to `target/console-screenshots/`.

use reqwest::StatusCode;
use reqwest::redirect::Policy;
use serde_json::json;

use crate::support::{ADMIN_TOKEN, TestApp, TestDb, test_settings};

/// A client that shows redirects instead of following them.
fn client() -> reqwest::Client {
    reqwest::Client::builder().redirect(Policy::none()).build().expect("client")
}

/// Sign in over plain HTTP; the session cookie as a `Cookie` header value.
pub(crate) async fn sign_in(app: &TestApp) -> String {
    sign_in_with(app, ADMIN_TOKEN).await
}

/// Sign in with `token`; the session cookie as a `Cookie` header value.
pub(crate) async fn sign_in_with(app: &TestApp, token: &str) -> String {
    let response = client().post(app.url("/console/login")).form(&[("token", token)]).send().await.expect("sign in");
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let set = response.headers()["set-cookie"].to_str().expect("cookie").to_owned();
    set.split(';').next().expect("name=value").to_owned()
}

/// GET a console page with the cookie: (status, body).
pub(crate) async fn page(app: &TestApp, cookie: &str, path: &str) -> (StatusCode, String) {
    let response = client().get(app.url(path)).header("cookie", cookie).send().await.expect("page");
    (response.status(), response.text().await.expect("body"))
}

/// The CSRF token of a page's forms.
pub(crate) fn csrf_of(html: &str) -> String {
    let marker = r#"name="csrf" value=""#;
    let start = html.find(marker).expect("a form with a CSRF token") + marker.len();
    html[start..].split('"').next().expect("token").to_owned()
}

/// A page without a session redirects to sign in, carrying the page asked for (a deep
/// link survives signing in).
#[tokio::test]
async fn a_page_without_a_session_redirects_to_sign_in() {
    let app = TestApp::spawn().await;
    for (path, next) in [
        ("/console", "%2Fconsole"),
        ("/console/events?type=order.*", "%2Fconsole%2Fevents%3Ftype%3Dorder.*"),
        ("/console/endpoints", "%2Fconsole%2Fendpoints"),
        ("/console/dead", "%2Fconsole%2Fdead"),
        ("/console/sources", "%2Fconsole%2Fsources"),
    ] {
        let response = client().get(app.url(path)).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::SEE_OTHER, "{path}");
        assert_eq!(response.headers()["location"], format!("/console/login?next={next}").as_str(), "{path}");
    }
    // A forged or foreign cookie is no session either.
    let (status, _) = page(&app, "wg_console=abc.1.def", "/console").await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    // The sign-in page and the static files need none.
    let (status, body) = page(&app, "", "/console/login").await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains(r#"name="token""#));
    let (status, _) = page(&app, "", "/console/static/console.js").await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn sign_in_takes_the_admin_token_and_sets_a_strict_http_only_cookie_without_it() {
    let app = TestApp::spawn().await;
    let wrong = client().post(app.url("/console/login")).form(&[("token", "not-the-token")]).send().await.unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    assert!(wrong.headers().get("set-cookie").is_none());

    let response = client().post(app.url("/console/login")).form(&[("token", ADMIN_TOKEN)]).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(response.headers()["location"], "/console");
    let cookie = response.headers()["set-cookie"].to_str().unwrap().to_owned();
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/console", "Max-Age="] {
        assert!(cookie.contains(attribute), "{attribute} missing: {cookie}");
    }
    assert!(!cookie.contains("Secure"), "plain HTTP: {cookie}");
    assert!(!cookie.contains(ADMIN_TOKEN), "the token itself is never in the cookie: {cookie}");

    // Behind a TLS-terminating proxy the cookie is Secure.
    let response = client()
        .post(app.url("/console/login"))
        .header("x-forwarded-proto", "https")
        .form(&[("token", ADMIN_TOKEN)])
        .send()
        .await
        .unwrap();
    assert!(response.headers()["set-cookie"].to_str().unwrap().contains("; Secure"));

    let session = cookie.split(';').next().unwrap();
    let (status, body) = page(&app, session, "/console").await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("Overview"), "{body}");
}

#[tokio::test]
async fn forged_form_posts_are_refused_403_and_change_nothing() {
    let app = TestApp::spawn().await;
    let endpoint = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/hook"}), 201).await;
    let id = endpoint["id"].as_str().unwrap();
    let cookie = sign_in(&app).await;
    let other_session = sign_in(&app).await;
    let (_, html) = page(&app, &other_session, &format!("/console/endpoints/{id}")).await;
    let foreign_token = csrf_of(&html);
    let pause = app.url(&format!("/console/endpoints/{id}/pause"));

    for (what, form) in [
        ("no token", vec![]),
        ("an empty token", vec![("csrf", String::new())]),
        ("a wrong token", vec![("csrf", "00".repeat(32))]),
        ("another session's token", vec![("csrf", foreign_token.clone())]),
    ] {
        let response = client().post(&pause).header("cookie", &cookie).form(&form).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::FORBIDDEN, "{what}");
        assert!(response.text().await.unwrap().contains("CSRF"), "{what}");
    }
    // A right token without the session is refused too (a cross-site post carries no
    // cookie: SameSite=Strict).
    let response = client().post(&pause).form(&[("csrf", foreign_token.as_str())]).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    assert_eq!(app.admin_get(&format!("/v1/endpoints/{id}")).await["paused"], false, "nothing changed");

    // The session's own token from its page goes through.
    let (_, html) = page(&app, &cookie, &format!("/console/endpoints/{id}")).await;
    let response =
        client().post(&pause).header("cookie", &cookie).form(&[("csrf", csrf_of(&html))]).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(app.admin_get(&format!("/v1/endpoints/{id}")).await["paused"], true);
    // Every form sent is in the audit log, the refused ones too, newest first.
    let log = app.admin_get(&format!("/v1/audit?target=/console/endpoints/{id}/pause")).await;
    let entries: Vec<(String, i64)> = log["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["actor"].as_str().unwrap().to_owned(), e["status"].as_i64().unwrap()))
        .collect();
    let expected: Vec<(String, i64)> =
        [("admin", 303), ("unknown", 403), ("admin", 403), ("admin", 403), ("admin", 403), ("admin", 403)]
            .into_iter()
            .map(|(a, s)| (a.to_owned(), s))
            .collect();
    assert_eq!(entries, expected, "{log}");
    assert!(
        log["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["via"] == "console" && e["action"] == "POST /console/endpoints/{id}/pause"),
        "{log}"
    );

    // Signing out is a form post like the others ...
    let response = client().post(app.url("/console/logout")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    // ... but without a session there is nothing to protect: the cookie is just cleared.
    let response = client().post(app.url("/console/logout")).header("cookie", "wg_console=x.1.y").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert!(response.headers()["set-cookie"].to_str().unwrap().contains("Max-Age=0"));
}

#[tokio::test]
async fn the_overview_fragment_has_the_numbers_without_the_page() {
    let app = TestApp::spawn().await;
    app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/hook"}), 201).await;
    let id = app.admin_get("/v1/endpoints").await["data"][0]["id"].as_str().unwrap().to_owned();
    app.admin_post(&format!("/v1/endpoints/{id}/pause"), json!({}), 200).await;
    // A short burst: three webhooks show as a rate over the last minute, not as 0.0.
    app.source_none("shop").await;
    for key in ["b-1", "b-2", "b-3"] {
        assert_eq!(app.ingest("shop", key, "t", "{}").await.0, 200);
    }
    let cookie = sign_in(&app).await;
    let (status, fragment) = page(&app, &cookie, "/console/overview/live").await;
    assert_eq!(status, StatusCode::OK);
    assert!(fragment.contains(r#"id="ingest-rate">0.05</div>"#), "3 in the last minute: {fragment}");
    assert!(fragment.contains(r#"id="ingest-5m">0.01</span>"#), "3 in 5 minutes: {fragment}");
    assert!(!fragment.contains("<html") && !fragment.contains("<nav"), "a fragment: {fragment}");
    assert!(fragment.contains(r#"id="queue-pending""#) && fragment.contains("paused"), "{fragment}");
    let (status, _) = page(&app, "", "/console/overview/live").await;
    assert_eq!(status, StatusCode::SEE_OTHER, "no session, no numbers");
}

/// Whether `html` shows `text` with its markup escaped (named or numeric entities).
fn shown_escaped(html: &str, text: &str) -> bool {
    let named = text.replace('<', "&lt;").replace('>', "&gt;");
    let numeric = text.replace('<', "&#60;").replace('>', "&#62;");
    html.contains(&named) || html.contains(&numeric)
}

#[tokio::test]
async fn attacker_controlled_payloads_and_headers_render_escaped_under_a_strict_policy() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let evil = "<script>alert(1)</script>";
    let body = json!({"note": evil, "img": "<img src=x onerror=alert(2)>"}).to_string();
    let (status, stored) = app.ingest("shop", "<b>key</b>", "order.<i>created</i>", &body).await;
    assert_eq!(status, 200, "{stored}");
    let event_id = stored["event_id"].as_str().unwrap();
    let cookie = sign_in(&app).await;

    let response =
        client().get(app.url(&format!("/console/events/{event_id}"))).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let headers = response.headers().clone();
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("default-src 'self'") && csp.contains("script-src 'self'"), "{csp}");
    assert!(!csp.contains("unsafe-inline"), "{csp}");
    assert_eq!(headers["x-frame-options"], "DENY");
    assert_eq!(headers["referrer-policy"], "no-referrer");
    assert_eq!(headers["cache-control"], "no-store");
    let html = response.text().await.unwrap();
    assert!(!html.contains("<script>alert"), "payload rendered raw");
    assert!(!html.contains("<img src=x"), "payload rendered raw");
    assert!(shown_escaped(&html, "<script>alert(1)</script>"), "payload missing or not escaped");
    assert!(!html.contains("<b>key</b>") && shown_escaped(&html, "<b>key</b>"), "dedupe key");
    assert!(!html.contains("order.<i>created") && shown_escaped(&html, "order.<i>created"), "event type");
    // The only scripts are the served file: no inline script at all.
    assert_eq!(html.matches("<script").count(), 1, "{html}");
    assert!(html.contains(r#"<script src="/console/static/console.js" defer></script>"#));

    // The list escapes too.
    let (_, list) = page(&app, &cookie, "/console/events?source=shop").await;
    assert!(!list.contains("<b>key</b>") && shown_escaped(&list, "<b>key</b>"), "{list}");
}

#[tokio::test]
async fn the_console_can_be_turned_off() {
    let settings = webhook_gateway::app::Settings { console: false, ..test_settings() };
    let app = TestApp::spawn_with(TestDb::new().await, settings, 8).await;
    let (status, _) = page(&app, "", "/console/login").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // The API is untouched.
    app.admin_get("/v1/endpoints").await;
}

mod browser;

/// Text of an HTML page with its character references (`&#61;`, `&amp;` ...) decoded.
fn unescape(html: &str) -> String {
    let mut out = String::new();
    let mut rest = html;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        let Some(end) = rest[i..].find(';') else { break };
        let entity = &rest[i + 1..i + end];
        let c = match entity {
            "amp" => Some('&'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "quot" => Some('"'),
            _ => entity.strip_prefix('#').and_then(|n| n.parse::<u32>().ok()).and_then(char::from_u32),
        };
        match c {
            Some(c) => out.push(c),
            None => out.push_str(&rest[i..=i + end]),
        }
        rest = &rest[i + end + 1..];
    }
    out.push_str(rest);
    out
}

/// The rows of a console list: how many links to `prefix` the table has, and its
/// "next page" link (unescaped), if any.
fn rows_and_next(html: &str, prefix: &str) -> (Vec<String>, Option<String>) {
    let cell = format!(r#"<td><a href="{prefix}"#);
    let rows = html
        .match_indices(&cell)
        .map(|(i, _)| html[i + cell.len()..].split('"').next().unwrap_or_default().to_owned())
        .collect();
    let next = html.find(r#"id="next""#).map(|end| {
        let start = html[..end].rfind(r#"href=""#).expect("the next link's href") + 6;
        unescape(html[start..end].split('"').next().unwrap())
    });
    (rows, next)
}

#[tokio::test]
async fn lists_of_thousands_come_in_keyset_pages() {
    let app = TestApp::spawn().await;
    // An endpoint nobody can reach, paused so that no worker touches the seeded rows.
    let ep = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/hook"}), 201).await;
    let id = ep["id"].as_str().unwrap().to_owned();
    app.admin_post(&format!("/v1/endpoints/{id}/pause"), json!({}), 200).await;
    crate::support::seed_deliveries(&app.db.pool, &id, 5_000).await;
    sqlx::query(
        "UPDATE deliveries SET status = 'dead', finished_at = now(), dead_reason = 'seeded', parked = false
         WHERE id IN (SELECT id FROM deliveries ORDER BY id LIMIT 3000)",
    )
    .execute(&app.db.pool)
    .await
    .unwrap();
    let cookie = sign_in(&app).await;

    let mut seen = std::collections::HashSet::new();
    let mut path = "/console/events?window=all".to_owned();
    for page_number in 0..3 {
        let started = std::time::Instant::now();
        let (status, html) = page(&app, &cookie, &path).await;
        eprintln!("events page {page_number}: {:?}", started.elapsed());
        assert_eq!(status, StatusCode::OK);
        let (rows, next) = rows_and_next(&html, "/console/events/");
        assert_eq!(rows.len(), 50, "a page of 50");
        for row in rows {
            assert!(seen.insert(row), "no event on two pages");
        }
        path = next.expect("an older page");
    }

    let started = std::time::Instant::now();
    let (status, html) = page(&app, &cookie, &format!("/console/dead?endpoint={id}&window=all")).await;
    eprintln!("dead letters page: {:?}", started.elapsed());
    assert_eq!(status, StatusCode::OK);
    let (rows, next) = rows_and_next(&html, "/console/deliveries/");
    assert_eq!(rows.len(), 50);
    let (status, html) = page(&app, &cookie, &next.expect("an older page")).await;
    assert_eq!(status, StatusCode::OK);
    let (older, _) = rows_and_next(&html, "/console/deliveries/");
    assert_eq!(older.len(), 50);
    assert!(older.iter().all(|d| !rows.contains(d)), "no dead letter on two pages");

    let started = std::time::Instant::now();
    let (status, html) = page(&app, &cookie, &format!("/console/endpoints/{id}")).await;
    eprintln!("endpoint page: {:?}", started.elapsed());
    assert_eq!(status, StatusCode::OK);
    assert_eq!(rows_and_next(&html, "/console/deliveries/").0.len(), 50);

    let started = std::time::Instant::now();
    let (status, html) = page(&app, &cookie, &format!("/console/endpoints/{id}/recover?since=2000-01-01+00:00")).await;
    eprintln!("recovery confirmation: {:?}", started.elapsed());
    assert_eq!(status, StatusCode::OK);
    assert!(html.contains(r#"id="recover-count" class="num-inline">3000<"#), "counted, not done");
    assert_eq!(crate::support::count_status(&app.db.pool, "dead").await, 3000);

    for path in ["/console", "/console/endpoints", "/console/sources"] {
        let started = std::time::Instant::now();
        let (status, _) = page(&app, &cookie, path).await;
        eprintln!("{path}: {:?}", started.elapsed());
        assert_eq!(status, StatusCode::OK, "{path}");
    }
}

#[tokio::test]
async fn rotate_test_send_and_resume_from_the_console_do_what_the_api_does() {
    let app = TestApp::spawn().await;
    let sink = crate::support::sink::Sink::ok().await;
    let ep = app.admin_post("/v1/endpoints", json!({"url": sink.url("/hook")}), 201).await;
    let id = ep["id"].as_str().unwrap().to_owned();
    let old_secret = ep["secret"].as_str().unwrap().to_owned();
    let cookie = sign_in(&app).await;
    let (_, html) = page(&app, &cookie, &format!("/console/endpoints/{id}")).await;
    let csrf = csrf_of(&html);
    let post = |action: &str| {
        client()
            .post(app.url(&format!("/console/endpoints/{id}/{action}")))
            .header("cookie", &cookie)
            .form(&[("csrf", csrf.as_str())])
            .send()
    };

    // Rotation: the new secret is on the answer page, once.
    let response = post("rotate-secret").await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let html = response.text().await.unwrap();
    let start = html.find(r#"id="new-secret">"#).expect("the new secret is shown") + 16;
    let secret = unescape(html[start..].split('<').next().unwrap());
    assert!(secret.starts_with("whsec_"), "{secret}");
    assert_ne!(secret, old_secret);
    let (_, again) = page(&app, &cookie, &format!("/console/endpoints/{id}")).await;
    assert!(!again.contains(&secret) && !again.contains("whsec_"), "shown once only");

    // A test send is a delivery like the API's, signed with the new secret.
    let response = post("test").await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let location = response.headers()["location"].to_str().unwrap().to_owned();
    let delivery = location.strip_prefix("/console/deliveries/").expect("to the test delivery");
    crate::support::eventually(std::time::Duration::from_secs(20), "the test delivery is delivered", || async {
        (app.admin_get(&format!("/v1/deliveries/{delivery}")).await["status"] == "delivered").then_some(())
    })
    .await;
    let received = sink.received();
    let test = received.iter().find(|r| r.body.windows(12).any(|w| w == b"webhook.test")).expect("the test event");
    assert_eq!(test.header("webhook-id"), format!("msg_{}", delivery.replace('-', "")));
    let signed = |secret: &str| {
        crate::support::standard_webhooks::verify(
            secret,
            &test.header("webhook-id"),
            &test.header("webhook-timestamp"),
            &test.body,
            &test.header("webhook-signature"),
        )
    };
    assert!(signed(&secret), "signed with the new secret");
    assert!(signed(&old_secret), "and, in its grace period, the old one");

    // Pause, then resume.
    assert_eq!(post("pause").await.unwrap().status(), StatusCode::SEE_OTHER);
    assert_eq!(app.admin_get(&format!("/v1/endpoints/{id}")).await["paused"], true);
    let response = post("resume").await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(response.headers()["location"], format!("/console/endpoints/{id}?done=resumed").as_str());
    assert_eq!(app.admin_get(&format!("/v1/endpoints/{id}")).await["paused"], false);
}

#[tokio::test]
async fn an_ordered_delivery_shows_its_key_and_that_it_waits_for_its_line() {
    // No workers: the line's head stays pending, the next one waits behind it.
    let app = TestApp::ingest_only().await;
    let source = json!({"name": "ord", "kind": "none", "dedupe": {"header": "X-Delivery-Id"},
                        "ordering_key": {"header": "X-Key"}});
    app.admin_post("/v1/sources", source, 201).await;
    let ep = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/hook"}), 201).await;
    let id = ep["id"].as_str().unwrap();
    let subscription = json!({"endpoint_id": id, "source": "ord", "ordered": {"on_dead": "block"}});
    app.admin_post("/v1/subscriptions", subscription, 201).await;
    let mut deliveries = Vec::new();
    for i in 0..2 {
        let response = app
            .http
            .post(app.url("/ingest/ord"))
            .header("x-delivery-id", format!("d-{i}"))
            .header("x-key", "customer-<42>")
            .body("{}")
            .send()
            .await
            .unwrap();
        let event: serde_json::Value = response.json().await.unwrap();
        let event = app.admin_get(&format!("/v1/events/{}", event["event_id"].as_str().unwrap())).await;
        deliveries.push(event["deliveries"][0]["id"].as_str().unwrap().to_owned());
    }
    let cookie = sign_in(&app).await;
    let (_, head) = page(&app, &cookie, &format!("/console/deliveries/{}", deliveries[0])).await;
    assert!(shown_escaped(&head, "customer-<42>"), "the ordering key, escaped");
    assert!(!head.contains("waiting for earlier deliveries"), "the head does not wait");
    let (_, next) = page(&app, &cookie, &format!("/console/deliveries/{}", deliveries[1])).await;
    assert!(shown_escaped(&next, "customer-<42>"));
    assert!(next.contains("waiting for earlier deliveries of this key"), "{next}");
    assert!(next.contains("waiting (ordered)"));
}

/// The filters page tries a filter on a pasted payload or a stored event, as the API
/// does, and shows what is wrong with a bad filter on the page (escaped like every
/// value); it stores nothing.
#[tokio::test]
async fn the_filters_page_tries_a_filter_on_a_pasted_or_a_stored_event() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let (status, stored) = app.ingest("shop", "d-1", "order.created", r#"{"amount": 1200}"#).await;
    assert_eq!(status, 200);
    let cookie = sign_in(&app).await;
    let query = |pairs: &[(&str, &str)]| format!("/console/filters?{}", serde_urlencoded::to_string(pairs).unwrap());

    let (status, html) =
        page(&app, &cookie, &query(&[("filter", "$.payload.amount > 1000"), ("payload", r#"{"amount": 5}"#)])).await;
    assert_eq!(status, StatusCode::OK);
    assert!(html.contains(r#"id="filter-result" class="bad">does not match"#), "{html}");
    let event_id = stored["event_id"].as_str().unwrap();
    let (_, html) = page(&app, &cookie, &query(&[("filter", "$.payload.amount > 1000"), ("event_id", event_id)])).await;
    assert!(html.contains(r#"id="filter-result" class="ok">matches"#), "{html}");
    assert!(
        html.contains("&quot;order.created&quot;") || html.contains("&#34;order.created&#34;"),
        "the document, escaped: {html}"
    );
    let (status, html) = page(&app, &cookie, &query(&[("filter", "$.a = <b>"), ("payload", "{}")])).await;
    assert_eq!(status, StatusCode::OK);
    assert!(html.contains(r#"id="filter-error""#) && html.contains("at character"), "{html}");
    assert!(!html.contains("<b>"), "escaped: {html}");
    assert_eq!(app.db.count("events").await, 1, "trying stores nothing");
}

/// The transformations page tries a script on a pasted payload or a stored event, as the
/// API does: the body it would send, or why there is none, escaped; nothing is stored.
#[tokio::test]
async fn the_transformations_page_tries_a_script_on_a_pasted_or_a_stored_event() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let (status, stored) = app.ingest("shop", "d-1", "order.created", r#"{"id": "ord_1"}"#).await;
    assert_eq!(status, 200);
    let cookie = sign_in(&app).await;
    let query = |pairs: &[(&str, &str)]| format!("/console/transforms?{}", serde_urlencoded::to_string(pairs).unwrap());
    let slack = "function handler(w) { return {text: `Order ${w.payload.id} <b>`}; }";
    let (status, html) =
        page(&app, &cookie, &query(&[("transform", slack), ("event_id", stored["event_id"].as_str().unwrap())])).await;
    assert_eq!(status, StatusCode::OK);
    assert!(html.contains(r#"id="transform-body""#) && html.contains("Order ord_1 &#60;b&#62;"), "{html}");
    assert!(!html.contains("<b>"), "escaped: {html}");
    let throws = "function handler(w) { throw new Error('no ' + w.payload.x); }";
    let (_, html) = page(&app, &cookie, &query(&[("transform", throws), ("payload", r#"{"x": "card"}"#)])).await;
    assert!(html.contains(r#"id="transform-error""#) && html.contains("no card"), "{html}");
    let (_, html) = page(&app, &cookie, &query(&[("transform", "function handler(w {"), ("payload", "{}")])).await;
    assert!(html.contains(r#"id="transform-error""#) && html.contains("eval_script:1:"), "{html}");
    assert_eq!(app.db.count("events").await, 1, "trying stores nothing");
}

/// Signing in from a deep link leads back to it; a `next` that points anywhere but a
/// console page (another site, the API) leads to the overview instead.
#[tokio::test]
async fn signing_in_leads_back_to_the_page_asked_for_and_nowhere_else() {
    let app = TestApp::spawn().await;
    let (status, form) = page(&app, "", "/console/login?next=%2Fconsole%2Fevents%3Ftype%3Dorder.*").await;
    assert_eq!(status, StatusCode::OK);
    assert!(form.contains(r#"name="next" value="/console/events?type=order.*""#), "{form}");
    for (next, lands) in [
        ("/console/events?type=order.*", "/console/events?type=order.*"),
        ("//evil.example/console", "/console"),
        ("https://evil.example/", "/console"),
        ("/v1/endpoints", "/console"),
        ("/console/../v1/endpoints", "/console"),
    ] {
        let response = client()
            .post(app.url("/console/login"))
            .form(&[("token", ADMIN_TOKEN), ("next", next)])
            .send()
            .await
            .expect("sign in");
        assert_eq!(response.status(), StatusCode::SEE_OTHER, "{next}");
        assert_eq!(response.headers()["location"], lands, "{next}");
    }
    // A wrong token keeps the deep link for the next try.
    let wrong = client()
        .post(app.url("/console/login"))
        .form(&[("token", "wrong"), ("next", "/console/dead")])
        .send()
        .await
        .expect("sign in");
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    assert!(wrong.text().await.expect("body").contains(r#"name="next" value="/console/dead""#));
}

/// Unknown console URLs get the console's 404 page (HTML, signed in or not), and every
/// page names the console's icon, which is served.
#[tokio::test]
async fn unknown_console_urls_get_the_console_404_page_and_there_is_a_favicon() {
    let app = TestApp::spawn().await;
    let cookie = sign_in(&app).await;
    for who in ["", cookie.as_str()] {
        let response = client().get(app.url("/console/no/such/page")).header("cookie", who).send().await.expect("page");
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert!(response.headers()["content-type"].to_str().unwrap().starts_with("text/html"));
        let body = response.text().await.expect("body");
        assert!(body.contains("no console page at /console/no/such/page"), "{body}");
    }
    let (status, overview) = page(&app, &cookie, "/console").await;
    assert_eq!(status, StatusCode::OK);
    assert!(overview.contains(r#"<link rel="icon" href="/console/static/favicon.svg""#));
    let (_, login) = page(&app, "", "/console/login").await;
    assert!(login.contains(r#"<link rel="icon" href="/console/static/favicon.svg""#));
    let icon = client().get(app.url("/console/static/favicon.svg")).send().await.expect("icon");
    assert_eq!(icon.status(), StatusCode::OK);
    assert_eq!(icon.headers()["content-type"], "image/svg+xml");
    assert!(icon.text().await.expect("svg").starts_with("<svg"));
}

/// The 3 a.m. questions about what died: a dead letter shows its event (type, source,
/// key) in the list and on its page; the events list says how each event's deliveries
/// stand, and its type search takes the wildcards subscriptions take (the API's too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_name_their_event_and_events_show_their_delivery_state() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let ok = crate::support::sink::Sink::ok().await;
    let strict = crate::support::sink::Sink::start(|_, _| crate::support::sink::Reply::status(400)).await;
    for (sink, types) in [(&ok, json!(["order.paid", "invoice.*"])), (&strict, json!(["order.failed"]))] {
        let ep = app.admin_post("/v1/endpoints", json!({"url": sink.url("/hook")}), 201).await;
        let sub = json!({"endpoint_id": ep["id"], "source": "shop", "event_types": types});
        app.admin_post("/v1/subscriptions", sub, 201).await;
    }
    for (key, event_type) in [("k-paid", "order.paid"), ("k-<failed>", "order.failed"), ("k-invoice", "invoice.sent")] {
        assert_eq!(app.ingest("shop", key, event_type, "{}").await.0, 200);
    }
    app.ingest("shop", "k-none", "unrouted.thing", "{}").await;
    crate::support::eventually(std::time::Duration::from_secs(30), "two delivered, one dead", || async {
        (crate::support::count_status(&app.db.pool, "delivered").await == 2
            && crate::support::count_status(&app.db.pool, "dead").await == 1)
            .then_some(())
    })
    .await;
    let cookie = sign_in(&app).await;

    let (status, dead) = page(&app, &cookie, "/console/dead").await;
    assert_eq!(status, StatusCode::OK);
    let (rows, _) = rows_and_next(&dead, "/console/deliveries/");
    assert_eq!(rows.len(), 1, "{dead}");
    assert!(dead.contains(r#"class="event-type">order.failed</a>"#), "the event's type: {dead}");
    assert!(shown_escaped(&dead, "k-<failed>") && dead.contains("<td>shop</td>"), "its key and source: {dead}");
    let (_, delivery) = page(&app, &cookie, &format!("/console/deliveries/{}", rows[0])).await;
    assert!(delivery.contains(r#"id="event-type">order.failed</a>"#), "{delivery}");
    assert!(delivery.contains(r#"id="event-source">shop</span>"#));
    assert!(shown_escaped(&delivery, "k-<failed>"));

    let (_, all) = page(&app, &cookie, "/console/events").await;
    let state_of = |html: &str, key: &str| {
        let row = html.split("<tr>").find(|r| r.contains(key)).unwrap_or_else(|| panic!("{key} listed: {html}"));
        row.split(r#" state">"#).nth(1).and_then(|s| s.split('<').next()).expect("a state").to_owned()
    };
    assert_eq!(state_of(&all, "k-paid"), "delivered");
    assert_eq!(state_of(&all, "order.failed"), "dead");
    assert_eq!(state_of(&all, "k-none"), "no deliveries");
    let (_, orders) = page(&app, &cookie, "/console/events?event_type=order.*").await;
    assert!(orders.contains("k-paid") && orders.contains("order.failed"), "{orders}");
    assert!(!orders.contains("k-invoice") && !orders.contains("k-none"), "{orders}");
    // The overview's "N still dead" opens the list of those N, however long ago they died.
    sqlx::query("UPDATE deliveries SET finished_at = now() - interval '3 days' WHERE status = 'dead'")
        .execute(&app.db.pool)
        .await
        .expect("age the dead letter");
    let (_, live) = page(&app, &cookie, "/console/overview/live").await;
    let link = live.split(r#"id="still-dead""#).next().and_then(|s| s.rsplit(r#"href=""#).next()).expect("link");
    let link = unescape(link.split('"').next().expect("href"));
    assert!(live.contains(r#"id="still-dead">1 still dead</a>"#), "{live}");
    let (_, recent) = page(&app, &cookie, "/console/dead").await;
    assert_eq!(rows_and_next(&recent, "/console/deliveries/").0.len(), 0, "the default window: the last 24 h");
    let (_, still) = page(&app, &cookie, &link).await;
    assert_eq!(rows_and_next(&still, "/console/deliveries/").0, rows, "the link shows the one still dead");

    let api = app.admin_get("/v1/events?event_type=*.sent").await;
    let keys: Vec<&str> = api["data"].as_array().unwrap().iter().map(|e| e["dedupe_key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["k-invoice"]);
}

/// Dead letters are redelivered from the list: the ticked ones, or one by its row's button;
/// each goes out again (the list says how many), and a post without a choice is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_redelivered_from_the_list_one_or_a_selected_set() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    let strict = crate::support::sink::Sink::start(|_, _| crate::support::sink::Reply::status(400)).await;
    app.endpoint_for(&strict.url("/hook"), Some("shop")).await;
    for key in ["d-1", "d-2", "d-3"] {
        assert_eq!(app.ingest("shop", key, "order.failed", "{}").await.0, 200);
    }
    crate::support::eventually(std::time::Duration::from_secs(30), "three dead", || async {
        (crate::support::count_status(&app.db.pool, "dead").await == 3).then_some(())
    })
    .await;
    assert_eq!(strict.count(), 3);
    let cookie = sign_in(&app).await;
    let (_, list) = page(&app, &cookie, "/console/dead?window=all").await;
    assert!(list.contains(r#"data-confirm="Redeliver the selected dead letters now"#), "the set asks first");
    let csrf = csrf_of(&list);
    let (ids, _) = rows_and_next(&list, "/console/deliveries/");
    assert_eq!(ids.len(), 3);
    let post = |fields: Vec<(&'static str, String)>| {
        let mut form = vec![("csrf", csrf.clone()), ("back", "/console/dead?window=all".to_owned())];
        form.extend(fields);
        client().post(app.url("/console/dead/redeliver")).header("cookie", &cookie).form(&form).send()
    };

    let set = post(vec![("id", ids[0].clone()), ("id", ids[1].clone())]).await.unwrap();
    assert_eq!(set.status(), StatusCode::SEE_OTHER);
    let back = set.headers()["location"].to_str().unwrap().to_owned();
    assert_eq!(back, "/console/dead?window=all&redelivered=2");
    let (_, shown) = page(&app, &cookie, &back).await;
    assert!(shown.contains("2 dead letters queued again"), "{shown}");
    crate::support::eventually(std::time::Duration::from_secs(30), "the two sent again", || async {
        (strict.count() == 5).then_some(())
    })
    .await;

    let one = post(vec![("one", ids[2].clone()), ("id", ids[0].clone())]).await.unwrap();
    assert_eq!(one.headers()["location"], "/console/dead?window=all&redelivered=1", "the row's button wins");
    crate::support::eventually(std::time::Duration::from_secs(30), "the one sent again", || async {
        (strict.count() == 6).then_some(())
    })
    .await;
    crate::support::eventually(std::time::Duration::from_secs(30), "its second attempt in its timeline", || async {
        let attempts = app.admin_get(&format!("/v1/deliveries/{}/attempts", ids[2])).await;
        (attempts["data"].as_array().map(Vec::len) == Some(2)).then_some(())
    })
    .await;

    let none = post(vec![]).await.unwrap();
    assert_eq!(none.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(none.text().await.unwrap().contains("tick the dead letters to redeliver"));
    let elsewhere = post(vec![("one", ids[0].clone())]).await.unwrap();
    assert_eq!(elsewhere.status(), StatusCode::SEE_OTHER);
    // The way back is only ever the dead-letter list (not another site, page or a header split).
    for back in ["https://evil.example/", "//evil.example/console/dead", "/console/endpoints", "/console/dead?\r\nx: y"]
    {
        let response = client()
            .post(app.url("/console/dead/redeliver"))
            .header("cookie", &cookie)
            .form(&[("csrf", csrf.as_str()), ("back", back), ("one", ids[1].as_str())])
            .send()
            .await
            .unwrap();
        let location = response.headers()["location"].to_str().unwrap().to_owned();
        assert!(location.starts_with("/console/dead?redelivered="), "{back:?} led to {location}");
    }
    let forged = client()
        .post(app.url("/console/dead/redeliver"))
        .header("cookie", &cookie)
        .form(&[("csrf", "0000"), ("one", ids[0].as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), StatusCode::FORBIDDEN, "no CSRF token, no redelivery");
}

/// A recovery window typed wrong comes back to the form with what was typed and why, on
/// the same page, instead of an error page that loses it.
#[tokio::test]
async fn a_refused_recovery_window_keeps_what_was_typed_and_says_why() {
    let app = TestApp::spawn().await;
    let ep = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/hook"}), 201).await;
    let id = ep["id"].as_str().unwrap().to_owned();
    let cookie = sign_in(&app).await;
    for (since, until, why) in
        [("yesterday-ish", "", "a time like"), ("2026-01-02 10:00", "2026-01-01 10:00", "until"), ("", "", "since")]
    {
        let path = format!(
            "/console/endpoints/{id}/recover?{}",
            serde_urlencoded::to_string([("since", since), ("until", until)]).unwrap()
        );
        let response = client().get(app.url(&path)).header("cookie", &cookie).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::SEE_OTHER, "{since:?} {until:?}");
        let back = response.headers()["location"].to_str().unwrap().to_owned();
        assert!(back.starts_with("/console/dead?"), "{back}");
        let (status, html) = page(&app, &cookie, &back).await;
        assert_eq!(status, StatusCode::OK);
        let problem = html.split(r#"id="recover-problem">"#).nth(1).and_then(|s| s.split('<').next()).unwrap_or("");
        assert!(problem.contains(why), "{since:?} {until:?}: {problem:?}");
        assert!(html.contains(&format!(r#"id="r-since" value="{since}""#)), "what was typed is kept: {since:?}");
        assert!(html.contains(&format!(r#"id="r-until" value="{until}""#)), "what was typed is kept: {until:?}");
    }
}

/// The overview shows the fleet: this gateway and a second replica running, then the
/// second killed (it cannot say so) and shown lost once three of its one-second intervals
/// pass, by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_shows_the_fleet_s_replicas_and_one_lost() {
    let app = TestApp::spawn().await;
    let mut other =
        crate::support::GatewayProcess::start(&app.db.url, &["--metrics-sample-secs", "1", "--role", "worker"]);
    crate::support::wait_ready(other.addr).await;
    let cookie = sign_in(&app).await;
    let running = crate::support::eventually(std::time::Duration::from_secs(15), "two replicas running", || async {
        let (_, fragment) = page(&app, &cookie, "/console/overview/live").await;
        fragment.contains(r#"id="replicas-running">2</div>"#).then_some(fragment)
    })
    .await;
    assert!(!running.contains("replicas-lost"), "{running}");
    assert!(running.contains("<td>worker</td>") && running.contains("<td>all</td>"), "{running}");

    other.kill();
    let lost =
        crate::support::eventually(std::time::Duration::from_secs(20), "the killed replica shown lost", || async {
            let (_, fragment) = page(&app, &cookie, "/console/overview/live").await;
            fragment.contains(r#"id="replicas-lost">1 lost</span>"#).then_some(fragment)
        })
        .await;
    assert!(lost.contains(r#"id="replicas-running">1</div>"#), "{lost}");
    assert!(lost.contains(r#"<span class="badge bad">lost</span>"#), "{lost}");
}

/// The overview's "dead-lettered in the last hour" counts the deliveries that died,
/// however they died: three buried by their endpoint's forced delete, without an attempt
/// (before, it counted dead attempts, and showed 0 beside "3 still dead").
#[tokio::test]
async fn the_overview_counts_every_delivery_that_died_in_the_last_hour() {
    let app = TestApp::spawn().await;
    let endpoint = app.endpoint_for("http://127.0.0.1:9/gone", Some("api")).await;
    app.admin_post(&format!("/v1/endpoints/{endpoint}/pause"), json!({}), 200).await;
    crate::support::seed_deliveries(&app.db.pool, &endpoint, 3).await;
    let (status, body) =
        app.admin(reqwest::Method::DELETE, &format!("/v1/endpoints/{endpoint}?force=true"), None).await;
    assert_eq!(status, 200, "{body}");
    let cookie = sign_in(&app).await;
    let (_, live) = page(&app, &cookie, "/console/overview/live").await;
    let last_hour = live.split(r#"id="dead-hour">"#).nth(1).and_then(|s| s.split('<').next()).expect("the figure");
    assert_eq!(last_hour, "3", "{live}");
    assert!(live.contains(r#"id="still-dead">3 still dead</a>"#), "{live}");
}
