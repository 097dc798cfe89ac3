//! The gateway under test: the release binary, started as a child process with the
//! bench's flags, stopped with SIGTERM, its peak RSS read from `/proc` before it exits.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The admin token every bench gateway uses.
pub const ADMIN_TOKEN: &str = "bench-admin-token-0123456789abcdef";

/// Build `target/release/webhook-gateway` (a no-op when it is up to date) and return its path.
pub fn build() -> anyhow::Result<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("bench: building the gateway in release mode (cargo build --release --bin webhook-gateway) ...");
    let mut build = Command::new(cargo);
    // `cargo run` gave this process the variables it sets for a package it runs
    // (`CARGO_PKG_NAME`, `CARGO_MANIFEST_DIR`, ...). Build scripts watch some of them
    // (ring's: `rerun-if-env-changed`), so a build that inherits them looks changed to
    // the next plain `cargo build`, and each rebuilt half the tree for the other (about
    // four minutes apiece on the 2-core machine). The user's own settings stay.
    for (key, _) in std::env::vars_os() {
        if key.to_str().is_some_and(set_by_cargo_run) {
            build.env_remove(key);
        }
    }
    let status = build
        .args(["build", "--release", "--bin", "webhook-gateway"])
        .current_dir(root)
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .status()
        .context("running cargo")?;
    if !status.success() {
        bail!("building the gateway failed ({status})");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    let bin = target.join("release").join("webhook-gateway");
    if !bin.is_file() {
        bail!("{} not found after the build", bin.display());
    }
    Ok(bin)
}

/// Whether `cargo run` sets the variable `key` for the program it runs (and a build
/// inside that program should not see it).
fn set_by_cargo_run(key: &str) -> bool {
    key.starts_with("CARGO_PKG_")
        || key.starts_with("CARGO_MANIFEST_")
        || matches!(
            key,
            "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_RUSTC_CURRENT_DIR"
                | "CARGO_TARGET_TMPDIR"
                | "OUT_DIR"
        )
}

/// Which parts the gateway process runs (`--role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Ingest, admin API and workers.
    All,
    /// Ingest and admin API.
    Ingest,
    /// Workers only.
    Worker,
}

impl Role {
    fn flag(self) -> &'static str {
        match self {
            Role::All => "all",
            Role::Ingest => "ingest",
            Role::Worker => "worker",
        }
    }
}

/// A running gateway process.
pub struct Gateway {
    child: Option<Child>,
    /// HTTP address.
    pub addr: SocketAddr,
    /// Process id.
    pub pid: u32,
    log: PathBuf,
    http: reqwest::Client,
}

impl Gateway {
    /// Start `bin serve` on a free loopback port and wait until `/healthz` answers.
    pub async fn start(
        bin: &Path,
        database_url: &str,
        role: Role,
        extra: &[String],
        log: &Path,
    ) -> anyhow::Result<Gateway> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let log_file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = Command::new(bin);
        cmd.arg("serve")
            .args(["--database-url", database_url])
            .args(["--listen", &addr.to_string()])
            .args(["--admin-token", ADMIN_TOKEN])
            .args(["--egress-allow", "127.0.0.1/32"])
            .args(["--role", role.flag()])
            // The bench stops gateways between scenarios, with no balancer to drain from.
            .args(["--shutdown-drain-secs", "0"])
            .args(extra);
        // Only our flags configure it: nothing from the caller's environment leaks in.
        for (key, _) in std::env::vars_os() {
            if key.to_str().is_some_and(|k| k.starts_with("WEBHOOK_GATEWAY_") || k == "DATABASE_URL") {
                cmd.env_remove(key);
            }
        }
        cmd.stdin(Stdio::null()).stdout(log_file.try_clone()?).stderr(log_file);
        let child = cmd.spawn().with_context(|| format!("starting {}", bin.display()))?;
        let pid = child.id();
        let mut gw = Gateway { child: Some(child), addr, pid, log: log.to_path_buf(), http: reqwest::Client::new() };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = gw.child.as_mut().expect("child").try_wait()? {
                gw.child = None;
                bail!("gateway exited during start-up ({status}): {}", gw.log_tail(3));
            }
            let url = format!("http://{addr}/healthz");
            if let Ok(r) = gw.http.get(&url).timeout(Duration::from_secs(1)).send().await
                && r.status().is_success()
            {
                return Ok(gw);
            }
            if Instant::now() > deadline {
                bail!("gateway not healthy within 60 s: {}", gw.log_tail(3));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Last lines of the gateway's log, without colour codes.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = strip_ansi(&std::fs::read_to_string(&self.log).unwrap_or_default());
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join(" | ")
    }

    /// Peak resident set so far (VmHWM), in bytes.
    pub fn peak_rss(&self) -> Option<u64> {
        crate::stats::peak_rss(self.pid)
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// SIGTERM, then wait (SIGKILL after `grace`). Returns the peak RSS read just before.
    pub async fn stop(mut self, grace: Duration) -> Option<u64> {
        let rss = self.peak_rss();
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on a child we spawned and have not reaped.
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
            }
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    return rss;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            eprintln!("bench: gateway {} did not stop within {grace:?}; killing it", child.id());
            let _ = child.kill();
            let _ = child.wait();
        }
        rss
    }

    /// The text of its `/metrics`, or `None` when it cannot be read.
    pub async fn metrics(&self) -> Option<String> {
        let url = format!("http://{}/metrics", self.addr);
        let resp = self.http.get(url).timeout(Duration::from_secs(5)).send().await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        resp.text().await.ok()
    }

    /// `POST` an admin call; anything but 201/200 is an error.
    pub async fn admin_post(&self, path: &str, body: serde_json::Value) -> anyhow::Result<serde_json::Value> {
        let resp = self
            .http
            .post(format!("http://{}{path}", self.addr))
            .bearer_auth(ADMIN_TOKEN)
            .json(&body)
            .send()
            .await
            .with_context(|| format!("POST {path}"))?;
        let status = resp.status();
        let json: serde_json::Value = resp.json().await.unwrap_or(serde_json::Value::Null);
        if !status.is_success() {
            bail!("POST {path}: {status} {json}");
        }
        Ok(json)
    }

    /// `GET` an admin call; anything but 200 is an error.
    pub async fn admin_get(&self, path: &str) -> anyhow::Result<serde_json::Value> {
        let resp = self
            .http
            .get(format!("http://{}{path}", self.addr))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .with_context(|| format!("GET {path}"))?;
        let status = resp.status();
        let json: serde_json::Value = resp.json().await.unwrap_or(serde_json::Value::Null);
        if !status.is_success() {
            bail!("GET {path}: {status} {json}");
        }
        Ok(json)
    }

    /// Create an endpoint for `url` subscribed to the bench source; returns its id.
    pub async fn subscribe(&self, url: &str) -> anyhow::Result<String> {
        self.subscribe_to(crate::payload::SOURCE, url).await
    }

    /// [`Gateway::subscribe`] an endpoint at `url` to the source named `source`.
    pub async fn subscribe_to(&self, source: &str, url: &str) -> anyhow::Result<String> {
        let ep = self.admin_post("/v1/endpoints", serde_json::json!({"url": url})).await?;
        let id = ep["id"].as_str().context("endpoint without id")?.to_owned();
        self.admin_post("/v1/subscriptions", serde_json::json!({"endpoint_id": id, "source": source})).await?;
        Ok(id)
    }
}

/// Text without ANSI escape sequences (the gateway's pretty log colours its fields).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ parameters final-byte
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
