//! Secrets at rest: with an operator key no source or endpoint secret is stored in
//! plaintext, while signed webhooks still verify and deliveries are still signed; the
//! `secrets reencrypt` command and a key rotation; start-up refuses a database it could
//! not read.

use std::process::Command;
use std::time::Duration;

use serde_json::json;
use sha2::{Digest, Sha256};
use webhook_gateway::db::Pool;
use webhook_gateway::secrets::{self, Key, Keyring};

use crate::support::signing::github_header;
use crate::support::sink::Sink;
use crate::support::{GatewayProcess, TestApp, TestDb, eventually, insert_endpoint, standard_webhooks, test_settings};

const WAIT: Duration = Duration::from_secs(15);
const BIN: &str = env!("CARGO_BIN_EXE_webhook-gateway");

fn keyring(current: &Key, previous: &[&Key]) -> Keyring {
    Keyring::new(current.clone(), previous.iter().map(|k| (*k).clone()).collect())
}

/// A gateway on `db` with `keys`: a fresh keyring, so nothing comes from a cache filled
/// by an earlier gateway.
async fn gateway(db: &TestDb, keys: Keyring) -> TestApp {
    let settings = webhook_gateway::app::Settings { secrets: keys, ..test_settings() };
    let db = TestDb { url: db.url.clone(), pool: db.pool.clone() };
    TestApp::spawn_with(db, settings, 16).await
}

/// A GitHub source named `name` with `secret`, an endpoint at `sink` subscribed to it;
/// returns the source id, the endpoint id and its secret.
async fn source_and_endpoint(app: &TestApp, name: &str, secret: &str, sink: &Sink) -> (String, String, String) {
    let source = app.admin_post("/v1/sources", json!({"name": name, "kind": "github", "secrets": [secret]}), 201).await;
    let endpoint = app.admin_post("/v1/endpoints", json!({"url": sink.url("/")}), 201).await;
    let endpoint_id = endpoint["id"].as_str().unwrap().to_owned();
    app.admin_post("/v1/subscriptions", json!({"endpoint_id": endpoint_id, "source": name}), 201).await;
    (source["id"].as_str().unwrap().to_owned(), endpoint_id, endpoint["secret"].as_str().unwrap().to_owned())
}

async fn rotate(app: &TestApp, endpoint_id: &str) -> String {
    let rotated = app.admin_post(&format!("/v1/endpoints/{endpoint_id}/rotate-secret"), json!({}), 200).await;
    let secret = rotated["secret"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("whsec_"), "the answer is the plaintext: {rotated}");
    secret
}

/// A GitHub webhook signed with `secret` is accepted; the same signed with another secret
/// is refused; the accepted one reaches `sink` signed with every one of `endpoint_secrets`.
async fn webhook_in_and_signed_delivery_out(
    app: &TestApp,
    source: &str,
    secret: &str,
    sink: &Sink,
    endpoint_secrets: &[&str],
) {
    let delivery = uuid::Uuid::new_v4().to_string();
    let body = format!(r#"{{"action":"opened","delivery":"{delivery}"}}"#);
    let post = |signature: String| {
        app.http
            .post(app.url(&format!("/ingest/{source}")))
            .header("content-type", "application/json")
            .header("x-github-event", "pull_request")
            .header("x-github-delivery", &delivery)
            .header("x-hub-signature-256", signature)
            .body(body.clone())
            .send()
    };
    let forged = post(github_header("not-the-secret", &body)).await.unwrap();
    assert_eq!(forged.status().as_u16(), 401, "a wrong signature is refused");
    let accepted = post(github_header(secret, &body)).await.unwrap();
    assert_eq!(accepted.status().as_u16(), 200, "{}", accepted.text().await.unwrap_or_default());
    let received = eventually(WAIT, "the delivery reaches the sink", || async {
        sink.received().into_iter().find(|r| r.body.as_ref() == body.as_bytes())
    })
    .await;
    let signature = received.header("webhook-signature");
    assert_eq!(signature.split(' ').count(), endpoint_secrets.len(), "{signature}");
    for endpoint_secret in endpoint_secrets {
        assert!(
            standard_webhooks::verify(
                endpoint_secret,
                &received.header("webhook-id"),
                &received.header("webhook-timestamp"),
                &received.body,
                &signature
            ),
            "{endpoint_secret} does not verify {signature}"
        );
    }
}

/// Every stored secret value, as the raw rows hold them.
async fn stored_values(pool: &Pool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT secret FROM endpoints
         UNION ALL SELECT unnest(previous_secrets) FROM endpoints
         UNION ALL SELECT jsonb_array_elements_text(spec -> 'secrets') FROM sources",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// No row of `endpoints` or `sources` holds any of `plaintexts` anywhere (whole rows as
/// text), and every stored secret is encrypted under `key`.
async fn assert_encrypted(pool: &Pool, key: &Key, plaintexts: &[&str]) {
    for plaintext in plaintexts {
        let core = plaintext.trim_start_matches("whsec_");
        let found: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM endpoints e WHERE strpos(e::text, $1) > 0)
                  + (SELECT count(*) FROM sources s WHERE strpos(s::text, $1) > 0)",
        )
        .bind(core)
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(found, 0, "{plaintext} is stored in plaintext");
    }
    let values = stored_values(pool).await;
    assert!(!values.is_empty());
    for value in values {
        assert!(value.starts_with(&format!("enc:v1:{}:", key.id())), "{value}");
    }
}

fn fingerprint(secret: &str) -> String {
    format!("sha256:{}", &hex::encode(Sha256::digest(secret.as_bytes()))[..8])
}

#[tokio::test]
async fn with_a_key_no_secret_is_stored_in_plaintext_and_webhooks_still_verify_and_sign() {
    let key = Key::generate();
    let db = TestDb::new().await;
    let sink = Sink::ok().await;
    let source_secret = format!("gh-source-secret-{}", uuid::Uuid::new_v4().simple());
    let mut app = gateway(&db, keyring(&key, &[])).await;
    let (source_id, endpoint_id, first) = source_and_endpoint(&app, "gh", &source_secret, &sink).await;
    assert!(first.starts_with("whsec_"), "creation answers the plaintext secret");
    let second = rotate(&app, &endpoint_id).await;
    assert_encrypted(&db.pool, &key, &[&source_secret, &first, &second]).await;

    // The API shows fingerprints of the plaintext, and never a stored value.
    let shown = app.admin_get(&format!("/v1/sources/{source_id}")).await;
    assert_eq!(shown["secret_fingerprints"], json!([fingerprint(&source_secret)]));
    for path in ["/v1/sources", "/v1/endpoints", &format!("/v1/endpoints/{endpoint_id}")] {
        let body = app.admin_get(path).await.to_string();
        assert!(!body.contains("enc:v1") && !body.contains(&source_secret), "{path}: {body}");
    }
    // A PATCH that keeps the secrets stores them encrypted again.
    let (status, patched) = app
        .admin(
            reqwest::Method::PATCH,
            &format!("/v1/sources/{source_id}"),
            Some(json!({"dedupe": {"header": "X-GitHub-Delivery"}})),
        )
        .await;
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["secret_fingerprints"], json!([fingerprint(&source_secret)]));
    assert_encrypted(&db.pool, &key, &[&source_secret, &first, &second]).await;
    app.shutdown().await;

    // A fresh process with the same key: verification and signing decrypt for real.
    let mut app = gateway(&db, keyring(&key, &[])).await;
    webhook_in_and_signed_delivery_out(&app, "gh", &source_secret, &sink, &[&second, &first]).await;
    app.shutdown().await;

    // Without the key the database is refused, by name of the key.
    let err = secrets::check_stored(&db.pool, &Keyring::default()).await.unwrap_err().to_string();
    assert!(err.contains(&format!("3 under key {}", key.id())) && err.contains("no secrets key"), "{err}");
}

#[tokio::test]
async fn reencrypt_encrypts_plaintext_rows_and_a_key_rotation_keeps_everything_working() {
    let db = TestDb::new().await;
    let sink = Sink::ok().await;
    let source_secret = format!("gh-source-secret-{}", uuid::Uuid::new_v4().simple());

    // Written without a key: plaintext, as before this feature.
    let mut app = gateway(&db, Keyring::default()).await;
    let (_, endpoint_id, first) = source_and_endpoint(&app, "gh", &source_secret, &sink).await;
    let second = rotate(&app, &endpoint_id).await;
    app.shutdown().await;
    let mut plain = stored_values(&db.pool).await;
    plain.sort();
    let mut expected = vec![source_secret.clone(), first.clone(), second.clone()];
    expected.sort();
    assert_eq!(plain, expected, "stored as given");

    // Turning encryption on: reencrypt rewrites all three, then nothing.
    let old = Key::generate();
    let done = secrets::reencrypt(&db.pool, &keyring(&old, &[]), 1).await.unwrap();
    assert_eq!((done.endpoint_values, done.source_values, done.unchanged, done.unreadable), (2, 1, 0, 0));
    assert_encrypted(&db.pool, &old, &[&source_secret, &first, &second]).await;
    let again = secrets::reencrypt(&db.pool, &keyring(&old, &[]), 1).await.unwrap();
    assert_eq!((again.rewritten(), again.unchanged), (0, 3), "idempotent");
    let mut app = gateway(&db, keyring(&old, &[])).await;
    webhook_in_and_signed_delivery_out(&app, "gh", &source_secret, &sink, &[&second, &first]).await;
    app.shutdown().await;

    // Rotation, step 1: the new key current, the old one previous. Old values still read;
    // new writes use the new key.
    let new = Key::generate();
    secrets::check_stored(&db.pool, &keyring(&new, &[&old])).await.unwrap();
    let mut app = gateway(&db, keyring(&new, &[&old])).await;
    webhook_in_and_signed_delivery_out(&app, "gh", &source_secret, &sink, &[&second, &first]).await;
    let third = rotate(&app, &endpoint_id).await;
    let current: String = sqlx::query_scalar("SELECT secret FROM endpoints").fetch_one(&db.pool).await.unwrap();
    assert!(current.starts_with(&format!("enc:v1:{}:", new.id())), "{current}");
    app.shutdown().await;

    // Step 2: reencrypt moves the rest (the source's secret, two previous endpoint secrets).
    let done = secrets::reencrypt(&db.pool, &keyring(&new, &[&old]), 100).await.unwrap();
    assert_eq!((done.endpoint_values, done.source_values, done.unchanged, done.unreadable), (2, 1, 1, 0));
    assert_encrypted(&db.pool, &new, &[&source_secret, &first, &second, &third]).await;

    // Step 3: the old key dropped. Start-up accepts the database with the new key alone and
    // refuses it with the old one alone, naming the key it lacks.
    secrets::check_stored(&db.pool, &keyring(&new, &[])).await.unwrap();
    let err = secrets::check_stored(&db.pool, &keyring(&old, &[])).await.unwrap_err().to_string();
    assert!(err.contains(&format!("4 under key {}", new.id())) && err.contains("--secrets-key-previous"), "{err}");
    let mut app = gateway(&db, keyring(&new, &[])).await;
    webhook_in_and_signed_delivery_out(&app, "gh", &source_secret, &sink, &[&third, &second, &first]).await;
    app.shutdown().await;
}

/// A value that does not authenticate (altered in the database) is never used: reencrypt
/// reports it and leaves it, the webhook gets a 500 (its sender retries) rather than a
/// 401, and the delivery is not sent unsigned.
#[tokio::test]
async fn an_altered_value_is_refused_and_reported_never_used() {
    let key = Key::generate();
    let db = TestDb::new().await;
    let sink = Sink::ok().await;
    let mut app = gateway(&db, keyring(&key, &[])).await;
    let (_, endpoint_id, _) = source_and_endpoint(&app, "gh", "gh-source-secret", &sink).await;
    app.shutdown().await;
    // The source's ciphertext copied into the endpoint's column: it authenticates only
    // where it was written.
    sqlx::query("UPDATE endpoints SET secret = (SELECT spec -> 'secrets' ->> 0 FROM sources WHERE name = 'gh')")
        .execute(&db.pool)
        .await
        .unwrap();
    let done = secrets::reencrypt(&db.pool, &keyring(&key, &[]), 10).await.unwrap();
    assert_eq!((done.rewritten(), done.unreadable), (0, 1), "{:?}", done.problems);
    assert!(done.problems[0].contains(&format!("endpoint {endpoint_id}")), "{:?}", done.problems);
    assert!(done.problems[0].contains("a stored endpoint-secret encrypted under key"), "{:?}", done.problems);

    let mut app = gateway(&db, keyring(&key, &[])).await;
    app.admin_post(&format!("/v1/endpoints/{endpoint_id}/test"), json!({}), 202).await;
    // Not sent, and not the subscriber's doing: the claim is given back without spending
    // an attempt, and the delivery waits 30 s before it is tried again.
    eventually(WAIT, "the claim given back, due later", || async {
        let given_back: bool = sqlx::query_scalar(
            "SELECT attempt_count = 0 AND leased_until IS NULL AND next_attempt_at > now() + interval '20 seconds'
             FROM deliveries",
        )
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
        given_back.then_some(())
    })
    .await;
    assert_eq!(app.db.count("attempts").await, 0, "no attempt recorded, none spent");
    assert_eq!(sink.count(), 0, "nothing sent unsigned");

    sqlx::query("UPDATE sources SET spec = jsonb_set(spec, '{secrets,0}', to_jsonb('enc:v1:' || $1 || ':AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA'))")
        .bind(key.id())
        .execute(&db.pool)
        .await
        .unwrap();
    let body = r#"{"action":"opened"}"#;
    let resp = app
        .http
        .post(app.url("/ingest/gh"))
        .header("x-github-event", "pull_request")
        .header("x-github-delivery", "d-1")
        .header("x-hub-signature-256", github_header("gh-source-secret", body))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 500);
    let text = resp.text().await.unwrap();
    assert!(!text.contains("enc:v1") && !text.contains(key.id()), "the sender learns nothing: {text}");
    let shown = app.admin_get("/v1/sources").await;
    let gh = shown["data"].as_array().unwrap().iter().find(|s| s["name"] == "gh").unwrap();
    assert_eq!(gh["secret_fingerprints"], json!(["unreadable"]), "{shown}");
    app.shutdown().await;
}

fn key_text() -> (Key, String) {
    let mut bytes = [0u8; secrets::KEY_BYTES];
    for b in &mut bytes {
        *b = rand::random();
    }
    (Key::from_bytes(&bytes), secrets::encode_key(&bytes))
}

/// Wait for `child` to exit (at most 60 s); its exit code.
fn exit_code(child: &mut std::process::Child) -> Option<i32> {
    for _ in 0..600 {
        if let Ok(Some(status)) = child.try_wait() {
            return status.code();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("the gateway did not exit");
}

async fn ready(gw: &GatewayProcess) {
    let http = reqwest::Client::new();
    let url = format!("http://{}/readyz", gw.addr);
    eventually(WAIT, "the gateway is ready", || async {
        http.get(&url).send().await.ok().filter(|r| r.status().is_success()).map(|_| ())
    })
    .await;
}

fn log_of(gw: &GatewayProcess) -> String {
    std::fs::read_to_string(&gw.log).unwrap_or_default()
}

/// The real binary: a plaintext start says so once; `secrets reencrypt` prints what it
/// rewrote; a start with a key that cannot read the database, or with no key at all, is
/// one line and exit 1; with the right keys it starts.
#[tokio::test]
async fn the_binary_reencrypts_and_refuses_a_database_it_cannot_read() {
    let db = TestDb::new().await;
    insert_endpoint(&db.pool, "http://127.0.0.1:9/").await;

    let mut gw = GatewayProcess::start(&db.url, &[]);
    ready(&gw).await;
    assert!(gw.terminate(), "exit after SIGTERM: {}", log_of(&gw));
    let log = log_of(&gw);
    assert_eq!(log.matches("stored in plaintext").count(), 1, "{log}");
    assert!(log.contains("secrets reencrypt"), "says how to turn encryption on: {log}");

    let (old, old_text) = key_text();
    let reencrypt = |key: &str| {
        Command::new(BIN)
            .args(["secrets", "reencrypt", "--database-url", &db.url, "--batch-size", "1"])
            .env("WEBHOOK_GATEWAY_SECRETS_KEY", key)
            .env_remove("WEBHOOK_GATEWAY_SECRETS_KEY_FILE")
            .env_remove("WEBHOOK_GATEWAY_SECRETS_KEY_PREVIOUS")
            .env("RUST_LOG", "warn")
            .output()
            .unwrap()
    };
    let out = reencrypt(&old_text);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout} {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        stdout.trim(),
        format!("re-encrypted 1 secrets under key {} (1 endpoint, 0 source); 0 already under it", old.id())
    );
    let out = reencrypt(&old_text);
    assert!(String::from_utf8_lossy(&out.stdout).contains("re-encrypted 0 secrets"), "idempotent");

    let (new, new_text) = key_text();
    for (what, flags, expect) in [
        ("another key", vec!["--secrets-key", new_text.as_str()], "--secrets-key-previous"),
        ("no key", vec![], "no secrets key is configured"),
    ] {
        let mut gw = GatewayProcess::start(&db.url, &flags);
        assert_eq!(exit_code(&mut gw.child), Some(1), "{what}");
        let log = log_of(&gw);
        let last = log.trim().lines().last().unwrap_or_default();
        assert!(
            last.starts_with(&format!(
                "webhook-gateway: error: the database holds encrypted secrets this process cannot read (1 under key {})",
                old.id()
            )),
            "{what}: {log}"
        );
        assert!(last.contains(expect), "{what}: {log}");
        assert!(!log.contains(&new_text) && !log.contains(&old_text), "no key is ever logged: {log}");
    }

    let mut gw = GatewayProcess::start(&db.url, &["--secrets-key", &new_text, "--secrets-key-previous", &old_text]);
    ready(&gw).await;
    assert!(gw.terminate());
    let log = log_of(&gw);
    assert!(log.contains("secrets are encrypted") && log.contains(new.id()) && log.contains(old.id()), "{log}");
    assert!(!log.contains(&new_text) && !log.contains(&old_text), "no key is ever logged: {log}");
}

/// `--help` never shows a key from the environment; a malformed key is one line, exit 1.
#[test]
fn keys_stay_out_of_help_and_a_bad_key_is_one_line() {
    let (_, current) = key_text();
    let (_, previous) = key_text();
    for command in [&["serve", "--help"][..], &["secrets", "reencrypt", "--help"][..]] {
        let out = Command::new(BIN)
            .args(command)
            .env("WEBHOOK_GATEWAY_SECRETS_KEY", &current)
            .env("WEBHOOK_GATEWAY_SECRETS_KEY_PREVIOUS", &previous)
            .output()
            .unwrap();
        assert!(out.status.success(), "{command:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("WEBHOOK_GATEWAY_SECRETS_KEY"), "{command:?}: the variable is named: {text}");
        assert!(!text.contains(&current) && !text.contains(&previous), "{command:?}: {text}");
    }
    for command in [&["serve"][..], &["secrets", "reencrypt"][..]] {
        let out = Command::new(BIN)
            .args(command)
            .env("WEBHOOK_GATEWAY_SECRETS_KEY", "dG9vLXNob3J0")
            .env_remove("WEBHOOK_GATEWAY_SECRETS_KEY_FILE")
            .env_remove("WEBHOOK_GATEWAY_SECRETS_KEY_PREVIOUS")
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{command:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains("secrets-key: must be 32 bytes in base64"), "{stderr}");
        assert!(!stderr.contains("dG9vLXNob3J0"), "{stderr}");
    }
}
