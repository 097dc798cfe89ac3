//! The real binary: `serve` with no database URL starts its own PostgreSQL; bad
//! configuration is one line and a non-zero exit.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_webhook-gateway");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[tokio::test]
async fn serve_without_a_database_url_runs_an_embedded_cluster_and_stops_cleanly() {
    let data_dir = std::env::temp_dir().join(format!("wg-bin-test-{}", uuid::Uuid::new_v4().simple()));
    let port = free_port();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--data-dir"])
        .arg(&data_dir)
        .env_remove("DATABASE_URL")
        .env_remove("WEBHOOK_GATEWAY_ADMIN_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The generated admin token is printed once on stdout.
    let stdout = child.stdout.take().unwrap();
    let token = tokio::task::spawn_blocking(move || {
        let mut lines = BufReader::new(stdout).lines();
        lines.next().unwrap().unwrap()
    })
    .await
    .unwrap();
    let token = token.rsplit(' ').next().unwrap().to_owned();
    assert!(token.starts_with("wgadm_"), "{token}");

    let client = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let mut ready = false;
    for _ in 0..200 {
        if let Ok(r) = client.get(format!("{base}/readyz")).send().await
            && r.status().is_success()
        {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "gateway became ready");
    let created = client
        .post(format!("{base}/v1/sources"))
        .bearer_auth(&token)
        .json(&serde_json::json!({"name": "shop", "kind": "none"}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status().as_u16(), 201);
    let accepted = client.post(format!("{base}/ingest/shop")).body("hello").send().await.unwrap();
    assert_eq!(accepted.status().as_u16(), 200);

    // SIGTERM: graceful shutdown, exit 0, and the embedded cluster is stopped.
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap()).await.unwrap();
    assert!(status.success(), "exit status {status}");
    assert!(!data_dir.join("pg/postmaster.pid").exists(), "postmaster stopped");
    std::fs::remove_dir_all(&data_dir).ok();
}

#[test]
fn invalid_configuration_is_one_line_and_exit_1() {
    let out = Command::new(BIN)
        .args(["serve", "--lease-secs", "5", "--request-timeout-secs", "15"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("lease-secs (5) must be at least"), "{stderr}");
    assert!(!stderr.contains("panicked"));

    let out = Command::new(BIN).args(["serve", "--listen", "nowhere"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "clap usage errors exit 2");
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value 'nowhere'"));
}

/// `--help` never shows a secret taken from the environment (the database URL can hold
/// a password; the admin token is one).
#[test]
fn help_hides_secrets_from_the_environment() {
    for command in [&["serve", "--help"][..], &["migrate", "--help"][..]] {
        let out = Command::new(BIN)
            .args(command)
            .env("DATABASE_URL", "postgres://gw:url-password-123@db.internal/gw")
            .env("WEBHOOK_GATEWAY_ADMIN_TOKEN", "admin-token-value-456")
            .output()
            .unwrap();
        assert!(out.status.success(), "{command:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("DATABASE_URL"), "{command:?}: the variable is still named: {text}");
        for secret in ["url-password-123", "admin-token-value-456"] {
            assert!(!text.contains(secret), "{command:?} prints {secret}: {text}");
        }
    }
}
