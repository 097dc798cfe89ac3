//! The first five minutes with the real binary: `serve` without a database URL runs an
//! embedded cluster and stops it cleanly; the generated admin token survives restarts and can be shown and rotated; a configured token is
//! never written; a taken port fails before anything is started.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::support::{self, TestDb};

const BIN: &str = env!("CARGO_BIN_EXE_webhook-gateway");

/// The binary with none of the user's settings in its environment.
fn gateway_command() -> Command {
    let mut command = Command::new(BIN);
    command.env_remove("DATABASE_URL").env_remove("NO_COLOR").env_remove("RUST_LOG");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("WEBHOOK_GATEWAY_") {
            command.env_remove(name);
        }
    }
    command
}

fn temp_dir(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("wg-{what}-{}", uuid::Uuid::new_v4().simple()))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A `serve` process whose stdout and stderr go to files (not a terminal).
struct Serve {
    child: Child,
    base: String,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Serve {
    fn start(data_dir: &Path, args: &[&str], env: &[(&str, &str)], run: usize) -> Serve {
        let port = free_port();
        let stdout = data_dir.with_extension(format!("run{run}.out"));
        let stderr = data_dir.with_extension(format!("run{run}.err"));
        let child = gateway_command()
            .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--data-dir"])
            .arg(data_dir)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        let mut serve = Serve { child, base: format!("http://127.0.0.1:{port}"), stdout, stderr };
        let deadline = Instant::now() + Duration::from_secs(90);
        while !serve.stdout().contains("is ready on") {
            if let Ok(Some(status)) = serve.child.try_wait() {
                panic!("serve exited ({status}) before it was ready:\n{}", serve.output());
            }
            assert!(Instant::now() < deadline, "serve not ready within 90 s:\n{}", serve.output());
            std::thread::sleep(Duration::from_millis(50));
        }
        serve
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    /// Everything it printed, both streams.
    fn output(&self) -> String {
        format!("{}{}", self.stdout(), std::fs::read_to_string(&self.stderr).unwrap_or_default())
    }

    /// The status of an admin call with `token`.
    async fn sources_status(&self, token: &str) -> (u16, serde_json::Value) {
        let resp =
            reqwest::Client::new().get(format!("{}/v1/sources", self.base)).bearer_auth(token).send().await.unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap_or_default())
    }

    /// SIGTERM; panics unless it exits 0 within 30 s. Returns what it printed.
    fn stop(mut self) -> String {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "exit {status}:\n{}", self.output());
                break;
            }
            assert!(Instant::now() < deadline, "no exit within 30 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
        let output = self.output();
        let _ = std::fs::remove_file(&self.stdout);
        let _ = std::fs::remove_file(&self.stderr);
        output
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `webhook-gateway admin-token <action> --data-dir <dir>`.
fn admin_token(action: &str, data_dir: &Path) -> Output {
    gateway_command().args(["admin-token", action, "--data-dir"]).arg(data_dir).output().unwrap()
}

fn token_of(out: &Output) -> String {
    assert!(out.status.success(), "{out:?}");
    let token = String::from_utf8(out.stdout.clone()).unwrap();
    assert_eq!(token.lines().count(), 1, "only the token on stdout: {token:?}");
    token.trim().to_owned()
}

/// The embedded default, started three times on one data directory: the token exported
/// after the first start keeps working after a restart; `admin-token show` prints it;
/// `admin-token rotate` replaces it for the next start (the running gateway keeps the one
/// it started with). Output that goes to files never holds the token nor escape codes.
#[tokio::test(flavor = "multi_thread")]
async fn the_generated_admin_token_survives_restarts_and_rotates() {
    let data_dir = temp_dir("token-restart");
    let started = Instant::now();
    let none = admin_token("show", &data_dir);
    assert_eq!(none.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&none.stderr).contains("no admin token in"), "{none:?}");

    let first = Serve::start(&data_dir, &[], &[], 1);
    let token = token_of(&admin_token("show", &data_dir));
    assert!(token.starts_with("wgadm_"), "{token}");
    let file = data_dir.join("admin-token");
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
    let created = reqwest::Client::new()
        .post(format!("{}/v1/sources", first.base))
        .bearer_auth(&token)
        .json(&serde_json::json!({"name": "shop", "kind": "none"}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status().as_u16(), 201);
    let accepted =
        reqwest::Client::new().post(format!("{}/ingest/shop", first.base)).body("hello").send().await.unwrap();
    assert_eq!(accepted.status().as_u16(), 200);
    let printed = first.stop();
    assert!(printed.contains("admin token  generated now, kept in"), "{printed}");
    assert!(printed.contains("embedded PostgreSQL in"), "{printed}");
    assert!(!printed.contains(&token), "the token went into a file:\n{printed}");
    assert!(!printed.contains('\u{1b}'), "escape codes in a file:\n{printed}");
    assert!(!data_dir.join("pg/postmaster.pid").exists(), "the embedded cluster stopped");
    let first_run = started.elapsed();

    let second = Serve::start(&data_dir, &[], &[], 2);
    let (status, sources) = second.sources_status(&token).await;
    assert_eq!(status, 200, "the same token after a restart: {sources}");
    assert!(sources["data"].as_array().unwrap().iter().any(|s| s["name"] == "shop"), "and the same data: {sources}");
    let rotate = admin_token("rotate", &data_dir);
    let rotated = token_of(&rotate);
    assert_ne!(rotated, token);
    assert!(String::from_utf8_lossy(&rotate.stderr).contains("until it restarts"), "{rotate:?}");
    assert_eq!(token_of(&admin_token("show", &data_dir)), rotated);
    assert_eq!(second.sources_status(&token).await.0, 200, "the running gateway keeps its token");
    let printed = second.stop();
    assert!(printed.contains("admin token  kept in"), "{printed}");
    assert!(printed.contains("source       shop: POST http://127.0.0.1:"), "{printed}");
    assert!(!printed.contains(&token), "{printed}");

    let third = Serve::start(&data_dir, &[], &[], 3);
    assert_eq!(third.sources_status(&rotated).await.0, 200, "the rotated token after the restart");
    assert_eq!(third.sources_status(&token).await.0, 401, "the old one no more");
    third.stop();
    eprintln!("embedded: first run {first_run:?}, all three {:?}", started.elapsed());
    std::fs::remove_dir_all(&data_dir).ok();
}

/// With a token from the command line or the environment the gateway writes nothing: not
/// even the data directory exists afterwards (the database comes from a URL here).
#[tokio::test(flavor = "multi_thread")]
async fn a_configured_admin_token_is_never_written() {
    let db = TestDb::new().await;
    for (args, env) in [
        (vec!["--admin-token", support::ADMIN_TOKEN], vec![]),
        (vec![], vec![("WEBHOOK_GATEWAY_ADMIN_TOKEN", support::ADMIN_TOKEN)]),
    ] {
        let data_dir = temp_dir("token-configured");
        let mut all = vec!["--database-url", db.url.as_str()];
        all.extend(args);
        let serve = Serve::start(&data_dir, &all, &env, 1);
        assert_eq!(serve.sources_status(support::ADMIN_TOKEN).await.0, 200);
        let printed = serve.stop();
        assert!(printed.contains("admin token  the configured one"), "{printed}");
        assert!(!printed.contains(support::ADMIN_TOKEN), "{printed}");
        assert!(!data_dir.exists(), "nothing written: {} exists", data_dir.display());
    }
}

/// A taken listen address: exit 1 with one line on stderr naming the address, at once,
/// and nothing started (no data directory, so no embedded cluster; no pool, so no pool
/// warning), with the embedded default and with a database URL.
#[tokio::test(flavor = "multi_thread")]
async fn a_taken_port_fails_fast_with_one_line_and_starts_nothing() {
    let db = TestDb::new().await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    for database_url in [None, Some(db.url.as_str())] {
        let data_dir = temp_dir("taken-port");
        let mut command = gateway_command();
        command.args(["serve", "--listen", &addr, "--data-dir"]).arg(&data_dir);
        if let Some(url) = database_url {
            command.args(["--database-url", url]);
        }
        let started = Instant::now();
        let out = command.output().unwrap();
        let elapsed = started.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let what = if database_url.is_some() { "with a database URL" } else { "embedded default" };
        assert_eq!(out.status.code(), Some(1), "{what}: {out:?}");
        assert_eq!(stderr.lines().count(), 1, "{what}: exactly one line: {stderr}");
        assert!(stderr.starts_with(&format!("webhook-gateway: error: cannot listen on {addr}: ")), "{what}: {stderr}");
        assert!(stderr.contains("--listen"), "{what}: says what to do: {stderr}");
        assert!(out.stdout.is_empty(), "{what}: {}", String::from_utf8_lossy(&out.stdout));
        assert!(!data_dir.exists(), "{what}: nothing was started or written in {}", data_dir.display());
        assert!(elapsed < Duration::from_secs(5), "{what}: took {elapsed:?}");
    }
    drop(taken);
}

/// Restarted right after a SIGKILL, the gateway finds its old cluster still shutting down
/// (the watchdog notices the death within a second, then stops it): the new start waits
/// for it instead of failing on PostgreSQL's lock file, and the data and token are there.
#[tokio::test(flavor = "multi_thread")]
async fn a_restart_right_after_a_kill_waits_for_the_old_cluster() {
    let data_dir = temp_dir("restart-after-kill");
    let mut first = Serve::start(&data_dir, &[], &[], 1);
    let token = token_of(&admin_token("show", &data_dir));
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let _ = std::fs::remove_file(&first.stdout);
    let _ = std::fs::remove_file(&first.stderr);
    assert!(data_dir.join("pg/postmaster.pid").exists(), "the old postmaster is still there");
    let started = Instant::now();
    let second = Serve::start(&data_dir, &[], &[], 2);
    assert_eq!(second.sources_status(&token).await.0, 200);
    eprintln!("restart after SIGKILL ready in {:?}", started.elapsed());
    second.stop();
    std::fs::remove_dir_all(&data_dir).ok();
}
