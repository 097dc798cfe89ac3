//! The real binary: bad configuration is one line and a non-zero exit; `--help` shows no
//! secret. (The embedded default's runs are in `first_run`.)

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_webhook-gateway");

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

/// A value from the environment that does not parse is configuration like any other:
/// one line naming the variable (clap would name only the flag it stands for), exit 1.
/// The same value on the command line stays clap's usage error, exit 2.
#[test]
fn an_environment_variable_that_does_not_parse_is_one_line_naming_it_and_exit_1() {
    for (var, value, expected) in [
        ("WEBHOOK_GATEWAY_MAX_BODY_BYTES", "abc", "invalid digit"),
        ("WEBHOOK_GATEWAY_LOG_FORMAT", "xml", "must be one of pretty, json"),
        ("WEBHOOK_GATEWAY_EGRESS_ALLOW", "10.0.0.0/8,nonsense", "nonsense"),
    ] {
        let out = Command::new(BIN).args(["serve"]).env(var, value).env_remove("DATABASE_URL").output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{var}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{var}: {stderr}");
        // A list is refused by its bad element, which is shown.
        let shown = value.rsplit(',').next().unwrap_or(value);
        assert!(stderr.contains(var) && stderr.contains(shown) && stderr.contains(expected), "{stderr}");
    }
    let out = Command::new(BIN)
        .args(["serve", "--max-body-bytes", "5x"])
        .env("WEBHOOK_GATEWAY_MAX_BODY_BYTES", "abc")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("invalid value '5x'") && !stderr.contains("WEBHOOK_GATEWAY_MAX_BODY_BYTES"), "{stderr}");
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
            .env("WEBHOOK_GATEWAY_OTEL_ENDPOINT", "http://collector:otel-password-789@otel.internal/")
            .output()
            .unwrap();
        assert!(out.status.success(), "{command:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("DATABASE_URL"), "{command:?}: the variable is still named: {text}");
        for secret in ["url-password-123", "admin-token-value-456", "otel-password-789"] {
            assert!(!text.contains(secret), "{command:?} prints {secret}: {text}");
        }
    }
}

/// The runtime's threads, as the gateway at `addr` reports them on `/metrics`.
async fn runtime_threads(addr: std::net::SocketAddr) -> String {
    let text = crate::support::scrape(addr).await;
    text.lines()
        .find_map(|line| line.strip_prefix("webhook_gateway_runtime_threads "))
        .unwrap_or_else(|| panic!("no runtime_threads gauge in {text}"))
        .trim()
        .to_owned()
}

/// `--runtime-threads` sizes the runtime the whole gateway runs on (as its `/metrics` say;
/// tokio gives its blocking threads the same name, so `/proc` cannot tell them apart), and a gateway on one thread still takes a webhook and delivers it; the
/// file's key sizes it the same way. Zero is refused at start-up.
#[tokio::test]
async fn runtime_threads_size_the_runtime_the_gateway_runs_on() {
    use crate::support::{GatewayProcess, TestDb, eventually, gateway_with_sink, sink::Sink};
    use std::time::Duration;

    let db = TestDb::new().await;
    let sink = Sink::ok().await;
    let (gw, base) = gateway_with_sink(&db.url, &["--runtime-threads", "1"], &sink).await;
    assert_eq!(runtime_threads(gw.addr).await, "1");
    let log = std::fs::read_to_string(&gw.log).expect("the gateway's log");
    assert!(log.contains("runtime_threads=1"), "the start-up line says so: {log}");
    let answer = reqwest::Client::new()
        .post(format!("{base}/ingest/shop"))
        .header("content-type", "application/json")
        .header("x-delivery-id", "one-thread-1")
        .header("x-event-type", "order.created")
        .body(r#"{"on":"one thread"}"#)
        .send()
        .await
        .expect("ingest");
    assert_eq!(answer.status(), 200);
    eventually(Duration::from_secs(20), "the webhook delivered", || async { (sink.count() == 1).then_some(()) }).await;
    drop(gw);

    let dir = std::env::temp_dir().join(format!("wg-runtime-threads-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("gateway.toml");
    std::fs::write(&file, "runtime_threads = 3\n").unwrap();
    let three = GatewayProcess::start(&db.url, &["--config", file.to_str().unwrap()]);
    crate::support::wait_ready(three.addr).await;
    assert_eq!(runtime_threads(three.addr).await, "3", "from the file");
    drop(three);
    std::fs::remove_dir_all(&dir).unwrap();

    let out = Command::new(BIN).args(["serve", "--runtime-threads", "0"]).env_remove("DATABASE_URL").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("runtime-threads must be between 1 and 1024"), "{stderr}");
}
