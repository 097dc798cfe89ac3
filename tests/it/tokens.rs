//! Scoped tokens and the audit log: every route of the admin API with every scope (and
//! with no, forged, truncated, revoked and expired tokens), revocation across replicas,
//! and the audit trail of an API script.

use reqwest::Method;
use serde_json::{Value, json};

use crate::support::{ADMIN_TOKEN, TestApp, TestDb, test_settings};

/// Create a token with `scope`; the token.
async fn token(app: &TestApp, name: &str, scope: &str) -> String {
    let created = app.admin_post("/v1/tokens", json!({"name": name, "scope": scope}), 201).await;
    created["token"].as_str().expect("token shown once").to_owned()
}

/// Call `method path` with `token` (none: no header) and a JSON body `{}`; the status.
async fn call(app: &TestApp, method: &Method, path: &str, token: Option<&str>) -> u16 {
    let mut request = app.http.request(method.clone(), app.url(path));
    if let Some(t) = token {
        request = request.bearer_auth(t);
    }
    if *method != Method::GET && *method != Method::DELETE {
        request = request.json(&json!({}));
    }
    request.send().await.expect("call").status().as_u16()
}

/// Every `/v1` operation of the served OpenAPI document with the scope it states, its path
/// parameters filled with a fresh id.
async fn operations(app: &TestApp) -> Vec<(Method, String, String)> {
    let doc: Value = app.http.get(app.url("/openapi.json")).send().await.unwrap().json().await.unwrap();
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        if !path.starts_with("/v1/") {
            continue;
        }
        for (method, op) in item.as_object().unwrap() {
            let method: Method = method.to_uppercase().parse().unwrap();
            let scope = op["x-required-scope"].as_str().unwrap_or_else(|| panic!("{method} {path} states no scope"));
            assert_eq!(op["security"][0]["admin_token"][0], scope, "{method} {path}: security and x-required-scope");
            let filled = path.replace("{id}", &uuid::Uuid::new_v4().to_string());
            out.push((method, filled, scope.to_owned()));
        }
    }
    assert!(out.len() >= 30, "{} operations", out.len());
    out
}

#[tokio::test]
async fn every_route_answers_every_scope_as_the_document_states() {
    let app = TestApp::spawn().await;
    let tokens = [
        ("read", token(&app, "dashboard", "read").await),
        ("operate", token(&app, "on-call", "operate").await),
        ("admin", token(&app, "deploy", "admin").await),
    ];
    let rank = |s: &str| ["read", "operate", "admin"].iter().position(|x| *x == s).unwrap();
    let revoked = token(&app, "revoked", "admin").await;
    app.admin(Method::DELETE, "/v1/tokens/revoked", None).await;
    let expired = token(&app, "expired", "admin").await;
    sqlx::query("UPDATE api_tokens SET expires_at = now() - interval '1 second' WHERE name = 'expired'")
        .execute(&app.db.pool)
        .await
        .unwrap();
    let forged = webhook_gateway::tokens::generate();
    let truncated_admin = &ADMIN_TOKEN[..ADMIN_TOKEN.len() - 1];
    let truncated = &tokens[2].1[..tokens[2].1.len() - 1];
    for (method, path, needed) in operations(&app).await {
        for (scope, t) in &tokens {
            let status = call(&app, &method, &path, Some(t)).await;
            if rank(scope) < rank(&needed) {
                assert_eq!(status, 403, "{scope} token, {method} {path} (needs {needed})");
            } else {
                assert!(status != 401 && status != 403, "{scope} token, {method} {path} (needs {needed}): {status}");
            }
        }
        for (what, t) in [
            ("no token", None),
            ("forged", Some(forged.as_str())),
            ("truncated bootstrap", Some(truncated_admin)),
            ("truncated", Some(truncated)),
            ("revoked", Some(revoked.as_str())),
            ("expired", Some(expired.as_str())),
        ] {
            assert_eq!(call(&app, &method, &path, t).await, 401, "{what}: {method} {path}");
        }
    }
}

#[tokio::test]
async fn tokens_are_shown_once_stored_as_hashes_and_named_once() {
    let app = TestApp::spawn().await;
    let t = token(&app, "ci", "operate").await;
    assert!(t.starts_with("wgt_"));
    let listed = app.admin_get("/v1/tokens").await;
    assert!(!listed.to_string().contains(&t), "never listed: {listed}");
    assert_eq!(listed["data"][0]["scope"], "operate");
    assert_eq!(listed["data"][0]["created_by"], "admin");
    let stored: Vec<u8> =
        sqlx::query_scalar("SELECT token_hash FROM api_tokens").fetch_one(&app.db.pool).await.unwrap();
    assert_eq!(stored, webhook_gateway::tokens::hash(&t));
    let (status, _) = app.admin(Method::POST, "/v1/tokens", Some(json!({"name": "ci", "scope": "read"}))).await;
    assert_eq!(status, 409);
    for bad in [
        json!({"name": "", "scope": "read"}),
        json!({"name": "x", "scope": "root"}),
        json!({"name": "admin", "scope": "read"}),
        json!({"name": "unknown", "scope": "read"}),
        json!({"name": "x", "scope": "read", "expires_at": "2001-01-01T00:00:00Z"}),
    ] {
        let (status, body) = app.admin(Method::POST, "/v1/tokens", Some(bad.clone())).await;
        assert_eq!(status, 422, "{bad}: {body}");
    }
    // A name spelled as another token's id is refused: revoking by that id revoked both.
    let ci_id = app.admin_get("/v1/tokens").await["data"][0]["id"].as_str().expect("the ci token's id").to_owned();
    let (status, body) = app.admin(Method::POST, "/v1/tokens", Some(json!({"name": ci_id, "scope": "read"}))).await;
    assert_eq!(status, 422, "{body}");
    // One stored so before this release (straight in the table): revoking by the id
    // revokes the token with that id alone.
    sqlx::query(
        "INSERT INTO api_tokens (name, scope, token_hash, created_by) SELECT id::text, 'read', '\\x01', 'test'
         FROM api_tokens WHERE name = 'ci'",
    )
    .execute(&app.db.pool)
    .await
    .expect("a token named as ci's id");
    let (status, revoked) = app.admin(Method::DELETE, &format!("/v1/tokens/{ci_id}"), None).await;
    assert_eq!((status, revoked["name"].as_str()), (200, Some("ci")), "{revoked}");
    let tokens = app.admin_get("/v1/tokens").await;
    let revoked: Vec<&str> = tokens["data"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter(|t| !t["revoked_at"].is_null())
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(revoked, ["ci"], "{tokens}");
}

/// A token's last use is noted (at most once a minute), so an unused one can be found.
#[tokio::test]
async fn the_last_use_of_each_token_is_noted() {
    let app = TestApp::spawn().await;
    let used = token(&app, "used", "read").await;
    token(&app, "unused", "read").await;
    let before = chrono::Utc::now() - chrono::Duration::seconds(1);
    assert_eq!(call(&app, &Method::GET, "/v1/endpoints", Some(&used)).await, 200);
    let listed = crate::support::eventually(std::time::Duration::from_secs(10), "the use noted", || async {
        let listed = app.admin_get("/v1/tokens").await;
        listed["data"][0]["last_used_at"].is_string().then_some(listed)
    })
    .await;
    let at: chrono::DateTime<chrono::Utc> = listed["data"][0]["last_used_at"].as_str().unwrap().parse().unwrap();
    assert!(at >= before, "{listed}");
    assert_eq!(listed["data"][1]["name"], "unused");
    assert!(listed["data"][1]["last_used_at"].is_null(), "{listed}");
}

/// Revoked through one replica, refused at once by another: no cache anywhere.
#[tokio::test]
async fn a_revoked_token_stops_at_once_on_every_replica() {
    let db = TestDb::new().await;
    let second = TestDb { url: db.url.clone(), pool: db.pool.clone() };
    let a = TestApp::spawn_with(db, test_settings(), 4).await;
    let b = TestApp::spawn_with(second, test_settings(), 4).await;
    let t = token(&a, "dashboard", "read").await;
    assert_eq!(call(&b, &Method::GET, "/v1/endpoints", Some(&t)).await, 200);
    a.admin(Method::DELETE, "/v1/tokens/dashboard", None).await;
    assert_eq!(call(&b, &Method::GET, "/v1/endpoints", Some(&t)).await, 401);
    assert_eq!(call(&a, &Method::GET, "/v1/endpoints", Some(&t)).await, 401);
}

/// An on-call script: what it changed, what it was refused, and from where, in the log;
/// never a secret.
#[tokio::test]
async fn the_audit_log_tells_who_changed_what_from_where_and_what_was_refused() {
    let app = TestApp::spawn().await;
    let created = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/hook"}), 201).await;
    let (ep, secret) = (created["id"].as_str().unwrap().to_owned(), created["secret"].as_str().unwrap().to_owned());
    let oncall = token(&app, "on-call", "operate").await;
    let send = |method: Method, path: String, id: &'static str| {
        let request = app.http.request(method, app.url(&path)).bearer_auth(&oncall).header("x-request-id", id);
        async move { request.json(&json!({})).send().await.unwrap().status().as_u16() }
    };
    assert_eq!(send(Method::POST, format!("/v1/endpoints/{ep}/pause"), "req-pause").await, 200);
    assert_eq!(send(Method::DELETE, format!("/v1/endpoints/{ep}"), "req-delete").await, 403);
    assert_eq!(send(Method::GET, "/v1/tokens".into(), "req-tokens").await, 403);
    assert_eq!(send(Method::GET, "/v1/endpoints".into(), "req-read").await, 200);
    let log = app.admin_get("/v1/audit?actor=on-call").await;
    let entries = log["data"].as_array().unwrap();
    let summary: Vec<(String, String, i64, String)> = entries
        .iter()
        .map(|e| {
            (
                e["action"].as_str().unwrap().to_owned(),
                e["target"].as_str().unwrap().to_owned(),
                e["status"].as_i64().unwrap(),
                e["request_id"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("GET /v1/tokens".to_owned(), "/v1/tokens".to_owned(), 403, "req-tokens".to_owned()),
            ("DELETE /v1/endpoints/{id}".to_owned(), format!("/v1/endpoints/{ep}"), 403, "req-delete".to_owned()),
            (
                "POST /v1/endpoints/{id}/pause".to_owned(),
                format!("/v1/endpoints/{ep}/pause"),
                200,
                "req-pause".to_owned()
            ),
        ],
        "reads are not changes; newest first"
    );
    assert!(entries.iter().all(|e| e["address"] == "127.0.0.1" && e["via"] == "api"), "{log}");
    // By target: what was done to this endpoint. The bootstrap admin's creation is in the
    // log too; no secret and no token anywhere in it.
    let by_target = app.admin_get(&format!("/v1/audit?target=/v1/endpoints/{ep}")).await;
    assert_eq!(by_target["data"].as_array().unwrap().len(), 2);
    let all = app.admin_get("/v1/audit").await;
    assert!(
        all["data"].as_array().unwrap().iter().any(|e| e["actor"] == "admin" && e["action"] == "POST /v1/endpoints")
    );
    assert!(!all.to_string().contains(&secret) && !all.to_string().contains(&oncall), "no secret, no token");
    // Unknown callers' attempts at changes are recorded, as `unknown`.
    let status = app.http.delete(app.url(&format!("/v1/endpoints/{ep}"))).bearer_auth("wgt_nope").send().await.unwrap();
    assert_eq!(status.status(), 401);
    let unknown = app.admin_get("/v1/audit?actor=unknown").await;
    assert_eq!(unknown["data"][0]["status"], 401, "{unknown}");
}

/// The command line creates, lists and revokes tokens against the database, and its
/// changes are in the audit log as `cli`.
#[tokio::test]
async fn the_cli_creates_lists_and_revokes_tokens_and_is_audited() {
    let app = TestApp::spawn().await;
    let bin = env!("CARGO_BIN_EXE_webhook-gateway");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin)
            .args(args)
            .env("DATABASE_URL", &app.db.url)
            .env("USER", "ops-alice")
            .output()
            .expect("run the binary");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).trim().to_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    const OK: Option<i32> = Some(0);
    // A usage error (a value the command line cannot take) is clap's exit code 2, before
    // any database is touched; a refusal by the database (a taken name) is 1.
    const USAGE: Option<i32> = Some(2);
    let (code, token, err) =
        run(&["tokens", "create", "--name", "backup", "--scope", "read", "--expires-in-days", "7"]);
    assert_eq!(code, OK, "{err}");
    assert!(token.starts_with("wgt_"), "only the token on stdout: {token}");
    assert_eq!(call(&app, &Method::GET, "/v1/endpoints", Some(&token)).await, 200);
    assert_eq!(call(&app, &Method::DELETE, "/v1/endpoints/x", Some(&token)).await, 403);
    let (code, listed, _) = run(&["tokens", "list"]);
    assert!(code == OK && listed.contains("backup\tread\tpayloads\texpires") && !listed.contains(&token), "{listed}");
    let (code, _, err) = run(&["tokens", "create", "--name", "grafana", "--scope", "read", "--no-payloads"]);
    assert_eq!(code, OK, "{err}");
    let (_, listed, _) = run(&["tokens", "list"]);
    assert!(listed.contains("grafana\tread\tno payloads\tno expiry"), "{listed}");
    let (code, _, err) = run(&["tokens", "create", "--name", "root", "--scope", "admin", "--no-payloads"]);
    assert!(code == USAGE && err.contains("always reads payloads"), "{code:?} {err}");
    // An expiry past a hundred years is refused with the range (it overflowed and panicked).
    let (code, _, err) =
        run(&["tokens", "create", "--name", "forever", "--scope", "read", "--expires-in-days", "4000000000"]);
    assert!(code == USAGE && err.contains("1 to 36500 days") && !err.contains("panicked"), "{code:?} {err}");
    for (flag, bad, reason) in [
        ("--scope", "superuser", "must be read, operate or admin"),
        ("--name", "admin", "not `admin`"),
        ("--name", "bad/name", "letters, digits"),
        ("--expires-in-days", "0", "1 to 36500 days"),
    ] {
        let mut args = vec!["tokens", "create", "--name", "fine", "--scope", "read"];
        let at = args.iter().position(|a| *a == flag).map_or(args.len(), |i| i + 1);
        if at == args.len() {
            args.extend([flag, bad]);
        } else {
            args[at] = bad;
        }
        let (code, out, err) = run(&args);
        assert!(
            code == USAGE && err.contains(flag) && err.contains(reason) && out.is_empty(),
            "{args:?}: {code:?} {err}"
        );
    }
    let (code, _, err) = run(&["tokens", "create", "--name", "backup", "--scope", "read"]);
    assert!(code == Some(1) && err.contains("backup"), "a second token of one name is refused: {code:?} {err}");
    let (code, _, err) = run(&["tokens", "revoke", "backup"]);
    assert_eq!(code, OK, "{err}");
    assert_eq!(call(&app, &Method::GET, "/v1/endpoints", Some(&token)).await, 401);
    let log = app.admin_get("/v1/audit?actor=cli:ops-alice").await;
    let actions: Vec<(&str, i64)> = log["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["action"].as_str().unwrap(), e["status"].as_i64().unwrap()))
        .collect();
    assert_eq!(
        actions,
        [("tokens revoke", 200), ("tokens create", 409), ("tokens create", 201), ("tokens create", 201)],
        "{log}"
    );
    assert!(log["data"].as_array().unwrap().iter().all(|e| e["via"] == "cli"));
}

/// The console signs in with any valid token and shows and allows what its scope allows,
/// by the same table as the API; revoking the token ends its sessions at once.
#[tokio::test]
async fn the_console_signs_in_with_a_scoped_token_and_allows_what_its_scope_allows() {
    use reqwest::redirect::Policy;
    let app = TestApp::spawn().await;
    let created = app.admin_post("/v1/endpoints", json!({"url": "http://127.0.0.1:9/hook"}), 201).await;
    let ep = created["id"].as_str().unwrap().to_owned();
    let client = reqwest::Client::builder().redirect(Policy::none()).build().unwrap();
    let sign_in = |token: String| {
        let client = client.clone();
        let url = app.url("/console/login");
        async move {
            let response = client.post(url).form(&[("token", token.as_str())]).send().await.unwrap();
            let status = response.status().as_u16();
            let cookie = response
                .headers()
                .get("set-cookie")
                .map(|v| v.to_str().unwrap().split(';').next().unwrap().to_owned())
                .unwrap_or_default();
            (status, cookie)
        }
    };
    let page = |cookie: String, path: String| {
        let app = &app;
        async move { crate::console::page(app, &cookie, &path).await }
    };
    let csrf = crate::console::csrf_of;
    let post = |cookie: String, path: String, csrf: String| {
        let client = client.clone();
        let url = app.url(&path);
        async move {
            client
                .post(url)
                .header("cookie", cookie)
                .form(&[("csrf", csrf.as_str())])
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };

    // Unknown tokens do not sign in.
    assert_eq!(sign_in("wgt_nope".into()).await.0, 401);
    // A read token: the pages, without their operate and admin forms; a forged post is refused.
    let read = token(&app, "viewer", "read").await;
    let (status, viewer) = sign_in(read.clone()).await;
    assert_eq!(status, 303);
    let (status, html) = page(viewer.clone(), format!("/console/endpoints/{ep}")).await;
    assert_eq!(status, 200);
    assert!(html.contains("viewer") && !html.contains("id=\"pause\"") && !html.contains("id=\"rotate\""), "{html}");
    assert_eq!(post(viewer.clone(), format!("/console/endpoints/{ep}/pause"), csrf(&html)).await, 403);
    assert_eq!(app.admin_get(&format!("/v1/endpoints/{ep}")).await["paused"], false);
    // Nor does it run expressions on the pages that try them (GETs, which it may open):
    // the API asks operate for the same, and so does the console.
    let tries = [
        "/console/transforms?transform=function+handler(w)+%7B+return+%7Bsum%3A+40+%2B+2%7D%3B+%7D&payload=%7B%7D",
        "/console/filters?filter=%24.payload.n+%3D%3D+42&payload=%7B%22n%22%3A+42%7D",
    ];
    for path in tries {
        let (status, html) = page(viewer.clone(), path.to_owned()).await;
        assert_eq!(status, 200, "{path}");
        assert!(html.contains("needs operate"), "{path}: {html}");
        assert!(!html.contains("id=\"filter-result\"") && !html.contains("id=\"transform-body\""), "{path}: {html}");
    }
    // An operate token pauses, but does not rotate.
    let operate = token(&app, "pager", "operate").await;
    let (_, pager) = sign_in(operate).await;
    let (_, html) = page(pager.clone(), format!("/console/endpoints/{ep}")).await;
    assert!(html.contains("id=\"pause\"") && !html.contains("id=\"rotate\""), "{html}");
    assert_eq!(post(pager.clone(), format!("/console/endpoints/{ep}/pause"), csrf(&html)).await, 303);
    assert_eq!(app.admin_get(&format!("/v1/endpoints/{ep}")).await["paused"], true);
    assert_eq!(post(pager.clone(), format!("/console/endpoints/{ep}/rotate-secret"), csrf(&html)).await, 403);
    // It runs the expressions (the control of the read token's refusal above).
    for path in tries {
        let (status, html) = page(pager.clone(), path.to_owned()).await;
        assert_eq!(status, 200, "{path}");
        assert!(!html.contains("needs operate"), "{path}: {html}");
    }
    let (_, html) = page(pager.clone(), tries[0].to_owned()).await;
    assert!(html.contains("id=\"transform-body\"") && html.contains("42"), "the transformation ran: {html}");
    let (_, html) = page(pager.clone(), tries[1].to_owned()).await;
    assert!(html.contains("id=\"filter-result\" class=\"ok\""), "the filter ran and matched: {html}");
    // In the audit log under their own names.
    let log = app.admin_get("/v1/audit?actor=pager").await;
    let got: Vec<(String, i64)> = log["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["action"].as_str().unwrap().to_owned(), e["status"].as_i64().unwrap()))
        .collect();
    assert_eq!(
        got,
        [
            ("POST /console/endpoints/{id}/rotate-secret".to_owned(), 403),
            ("POST /console/endpoints/{id}/pause".to_owned(), 303),
            ("POST /console/login".to_owned(), 303),
        ]
    );
    // Revoked: the session ends at once.
    app.admin(Method::DELETE, "/v1/tokens/viewer", None).await;
    let (status, _) = page(viewer, "/console/events".into()).await;
    assert_eq!(status, 303, "back to the sign-in page");
}

/// Admins manage tokens and read the audit log in the console; others do not see them.
#[tokio::test]
async fn the_console_creates_and_revokes_tokens_and_shows_the_audit_log_to_admins_only() {
    let app = TestApp::spawn().await;
    let cookie = crate::console::sign_in(&app).await;
    let (status, html) = crate::console::page(&app, &cookie, "/console/tokens").await;
    assert_eq!(status, 200);
    let csrf = crate::console::csrf_of(&html);
    let client = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let create = |fields: Vec<(&'static str, String)>| {
        let client = client.clone();
        let (url, cookie) = (app.url("/console/tokens"), cookie.clone());
        async move {
            let response = client.post(url).header("cookie", cookie).form(&fields).send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };
    // Typed wrong: the reason, and the name kept.
    let (status, html) =
        create(vec![("csrf", csrf.clone()), ("name", "bad/name".into()), ("scope", "read".into())]).await;
    assert_eq!(status, 200);
    assert!(html.contains("id=\"problem\"") && html.contains("value=\"bad/name\""), "{html}");
    // An expiry past a hundred years: the reason (it overflowed, and the request died).
    let (status, html) = create(vec![
        ("csrf", csrf.clone()),
        ("name", "forever".into()),
        ("scope", "read".into()),
        ("expires_in_days", "4000000000".into()),
    ])
    .await;
    assert_eq!(status, 200);
    assert!(html.contains("id=\"problem\"") && html.contains("1 to 36500"), "{html}");
    // Created: shown once, working, listed without it.
    let (status, html) = create(vec![
        ("csrf", csrf.clone()),
        ("name", "wallboard".into()),
        ("scope", "read".into()),
        ("expires_in_days", "30".into()),
    ])
    .await;
    assert_eq!(status, 200);
    let at = html.find("id=\"new-token\">").expect("the token, once") + "id=\"new-token\">".len();
    let token = html[at..].split('<').next().unwrap().to_owned();
    assert!(token.starts_with("wgt_"), "{token}");
    assert_eq!(call(&app, &Method::GET, "/v1/endpoints", Some(&token)).await, 200);
    let (_, listed) = crate::console::page(&app, &cookie, "/console/tokens").await;
    assert!(listed.contains("wallboard") && !listed.contains(&token), "{listed}");
    // "Withhold payloads": for read and operate, never for admin.
    let withheld = |name: &'static str, scope: &'static str| {
        vec![
            ("csrf", csrf.clone()),
            ("name", name.to_owned()),
            ("scope", scope.to_owned()),
            ("no_payloads", "1".to_owned()),
        ]
    };
    let (_, html) = create(withheld("root", "admin")).await;
    assert!(html.contains("id=\"problem\"") && html.contains("always reads payloads"), "{html}");
    let (_, html) = create(withheld("grafana", "read")).await;
    assert!(html.contains("id=\"new-token\""), "{html}");
    let listed = app.admin_get("/v1/tokens").await;
    let grafana = listed["data"].as_array().unwrap().iter().find(|t| t["name"] == "grafana").expect("listed");
    assert_eq!(grafana["payloads"], false);
    // A read session sees neither page nor link.
    let read_cookie = crate::console::sign_in_with(&app, &token).await;
    let (status, overview) = crate::console::page(&app, &read_cookie, "/console").await;
    assert_eq!(status, 200);
    assert!(!overview.contains("/console/tokens") && !overview.contains("/console/audit"), "{overview}");
    assert_eq!(crate::console::page(&app, &read_cookie, "/console/tokens").await.0, 403);
    assert_eq!(crate::console::page(&app, &read_cookie, "/console/audit").await.0, 403);
    // Revoked from the console: it stops at once.
    let id = listed["data"][0]["id"].as_str().unwrap().to_owned();
    let revoke = client
        .post(app.url(&format!("/console/tokens/{id}/revoke")))
        .header("cookie", &cookie)
        .form(&[("csrf", csrf.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(revoke.status().as_u16(), 303);
    assert_eq!(call(&app, &Method::GET, "/v1/endpoints", Some(&token)).await, 401);
    // And the audit page tells it.
    let (status, audit) = crate::console::page(&app, &cookie, "/console/audit?actor=admin").await;
    assert_eq!(status, 200);
    assert!(audit.contains("POST /console/tokens/{id}/revoke") && audit.contains("POST /console/tokens"), "{audit}");
    assert!(!audit.contains(&token), "never the token");
    // The read session's refused pages are in the log, under its token's name.
    let refused = app.admin_get("/v1/audit?actor=wallboard").await;
    let actions: Vec<(&str, i64)> = refused["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["action"].as_str().unwrap(), e["status"].as_i64().unwrap()))
        .collect();
    assert!(
        actions.contains(&("GET /console/tokens", 403)) && actions.contains(&("GET /console/audit", 403)),
        "{refused}"
    );
    // An admin token that revokes itself from the console: the revocation is its own, not
    // `unknown`'s (its session ends with it).
    let own = app.admin_post("/v1/tokens", json!({"name": "self-revoker", "scope": "admin"}), 201).await;
    let own_cookie = crate::console::sign_in_with(&app, own["token"].as_str().unwrap()).await;
    let (_, page) = crate::console::page(&app, &own_cookie, "/console/tokens").await;
    let own_csrf = crate::console::csrf_of(&page);
    let own_id = own["id"].as_str().unwrap();
    let revoke = client
        .post(app.url(&format!("/console/tokens/{own_id}/revoke")))
        .header("cookie", &own_cookie)
        .form(&[("csrf", own_csrf.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(revoke.status().as_u16(), 303);
    let log = app.admin_get("/v1/audit?actor=self-revoker").await;
    assert!(log.to_string().contains("POST /console/tokens/{id}/revoke"), "{log}");
}

/// The CLI writing to a stdout whose reader is gone (`... | head` that ended, a closed
/// pipe): no panic. A token that could not be shown is revoked, not left valid and unseen
/// (before, `println!` panicked, exit 101, after the token was committed).
#[tokio::test]
async fn a_cli_whose_stdout_is_closed_does_not_panic_and_leaves_no_unseen_token() {
    let app = TestApp::spawn().await;
    let run = |args: &[&str]| {
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_webhook-gateway"))
            .args(args)
            .env("DATABASE_URL", &app.db.url)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run the binary");
        let out = child.wait_with_output().expect("its end");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = run(&["tokens", "create", "--name", "unseen", "--scope", "read"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("revoked") && !err.contains("panicked"), "{err}");
    let revoked: bool = sqlx::query_scalar("SELECT revoked_at IS NOT NULL FROM api_tokens WHERE name = 'unseen'")
        .fetch_one(&app.db.pool)
        .await
        .expect("the token's row");
    assert!(revoked, "the token nobody saw is revoked");
    for args in [&["tokens", "list"][..], &["migrate"][..]] {
        let (code, err) = run(args);
        assert_eq!(code, Some(0), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// The CLI's commands on a database the gateway never set up say what to run, once
/// (the server's message was printed twice, and nothing said to migrate), and leave it
/// as it was; on a schema one migration behind they say which.
#[tokio::test]
async fn the_cli_on_an_unmigrated_database_says_to_migrate() {
    let db = TestDb::empty().await;
    let url = format!("--database-url={}", db.url);
    for args in [
        vec!["tokens", "list", &url],
        vec!["tokens", "create", "--name", "ci", "--scope", "read", &url],
        vec!["secrets", "reencrypt", "--secrets-key", "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=", &url],
    ] {
        let (code, stderr) = crate::support::run_to_exit(&args).await;
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        // One error line (the log may say other things first: a server's settings).
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("webhook-gateway: error:")).collect();
        assert_eq!(errors.len(), 1, "{args:?}: {stderr}");
        assert!(errors[0].contains("no gateway schema: run `webhook-gateway migrate`"), "{args:?}: {stderr}");
        assert_eq!(stderr.matches("does not exist").count(), 0, "said once, by what to do: {stderr}");
    }
    let made: bool =
        sqlx::query_scalar("SELECT to_regclass('api_tokens') IS NOT NULL").fetch_one(&db.pool).await.unwrap();
    assert!(!made, "nothing was created");
    webhook_gateway::db::migrate(&db.pool).await.unwrap();
    let newest = webhook_gateway::db::newest_migration();
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = $1").bind(newest).execute(&db.pool).await.unwrap();
    let (code, stderr) = crate::support::run_to_exit(&["tokens", "list", &url]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains(&format!("this release needs {newest}")), "{stderr}");
}
