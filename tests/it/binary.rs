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
