//! A primary and a real streaming standby (`pg_basebackup -R`), with synchronous
//! replication, so that a commit the primary acknowledged is on the standby too: the
//! smallest setup in which a failover can be played for real.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use sqlx::{Connection, Executor, PgConnection};
use webhook_gateway::db::embedded::{self, Cluster, ClusterOptions};

/// The pair; both clusters are stopped (and deleted) on drop.
pub struct ReplicatedPair {
    /// The primary (until it is killed).
    pub primary: Cluster,
    /// The standby (until it is promoted).
    pub standby: Cluster,
}

fn options(dir: PathBuf, env: &[(&str, &str)]) -> ClusterOptions {
    let env = env.iter().map(|(name, value)| (name.to_string(), value.to_string())).collect();
    ClusterOptions { data_dir: dir, throwaway: true, port: None, settings: Vec::new(), env }
}

fn temp_dir(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("wg-{what}-{}", uuid::Uuid::new_v4().simple()))
}

impl ReplicatedPair {
    /// Start a primary with a database `database`, a standby streaming from it, and wait
    /// until the standby is the primary's synchronous standby.
    pub async fn start(database: &str) -> ReplicatedPair {
        Self::start_with_standby_env(database, &[]).await
    }

    /// [`ReplicatedPair::start`] with `standby_env` in the standby server's environment
    /// (libfaketime, for a standby whose clock differs from the primary's).
    pub async fn start_with_standby_env(database: &str, standby_env: &[(&str, &str)]) -> ReplicatedPair {
        let primary = tokio::task::spawn_blocking(|| Cluster::start(&options(temp_dir("primary"), &[])))
            .await
            .expect("primary")
            .expect("start the primary");
        let mut admin = PgConnection::connect(&primary.url("postgres")).await.expect("primary connection");
        admin.execute(format!("CREATE DATABASE {database}").as_str()).await.expect("create database");
        // Replication connections over TCP with the same password.
        let hba = primary.data_dir().join("pg_hba.conf");
        let mut text = std::fs::read_to_string(&hba).expect("pg_hba.conf");
        text.push_str("host replication all 127.0.0.1/32 scram-sha-256\n");
        std::fs::write(&hba, text).expect("pg_hba.conf");
        admin.execute("SELECT pg_reload_conf()").await.expect("reload");

        let standby_dir = temp_dir("standby");
        let url = url::Url::parse(&primary.url("postgres")).expect("primary URL");
        let password = url.password().expect("password").to_owned();
        let port = primary.port();
        let dir = standby_dir.clone();
        tokio::task::spawn_blocking(move || base_backup(port, &password, &dir)).await.expect("base backup");
        let standby_options = options(standby_dir, standby_env);
        let standby = tokio::task::spawn_blocking(move || Cluster::start(&standby_options))
            .await
            .expect("standby")
            .expect("start the standby");

        // Synchronous from now on: set only once the standby streams, or every commit
        // before would wait for it.
        admin.execute("ALTER SYSTEM SET synchronous_standby_names = '*'").await.expect("sync names");
        admin.execute("SELECT pg_reload_conf()").await.expect("reload");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let sync: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = 'sync'",
            )
            .fetch_one(&mut admin)
            .await
            .expect("replication state");
            if sync == 1 {
                break;
            }
            assert!(Instant::now() < deadline, "the standby did not become synchronous");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        admin.close().await.ok();
        ReplicatedPair { primary, standby }
    }

    /// A host list reaching whichever of the two takes writes (libpq's form, which the
    /// gateway follows by itself): the primary first, then the standby.
    pub fn host_list_url(&self, database: &str) -> String {
        let direct = url::Url::parse(&self.primary.url(database)).expect("URL");
        format!(
            "postgres://postgres:{}@127.0.0.1:{},127.0.0.1:{}/{database}?target_session_attrs=read-write",
            direct.password().expect("password"),
            self.primary.port(),
            self.standby.port()
        )
    }

    /// The primary's address.
    pub fn primary_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.primary.port()))
    }

    /// The standby's address.
    pub fn standby_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.standby.port()))
    }

    /// SIGKILL the primary's postmaster: its backends exit when they notice, every
    /// connection to it drops, nothing is flushed or handed over.
    pub fn kill_primary(&self) {
        let pid_file = std::fs::read_to_string(self.primary.data_dir().join("postmaster.pid")).expect("postmaster.pid");
        let pid: i32 = pid_file.lines().next().and_then(|l| l.trim().parse().ok()).expect("postmaster pid");
        // SAFETY: kill(2) on the postmaster this test started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }

    /// Start the primary [`ReplicatedPair::kill_primary`] killed again, as it was, on its
    /// port: not rebuilt as a standby (a host rebooted with PostgreSQL starting by itself),
    /// so it takes writes on its old timeline, without waiting for a synchronous standby
    /// it no longer has. Stopped (not deleted: the pair does that) on drop.
    pub async fn restart_killed_primary(&self) -> Cluster {
        // The killed postmaster is this process's child: reaped here, or its zombie would
        // pass for a postmaster still running on the data directory.
        let pid_file = std::fs::read_to_string(self.primary.data_dir().join("postmaster.pid")).expect("postmaster.pid");
        let pid: i32 = pid_file.lines().next().and_then(|l| l.trim().parse().ok()).expect("postmaster pid");
        // SAFETY: waitpid(2) on the postmaster this test started and killed.
        unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
        let options = ClusterOptions {
            data_dir: self.primary.data_dir().to_path_buf(),
            throwaway: false,
            port: Some(self.primary.port()),
            settings: vec![("synchronous_standby_names".into(), String::new())],
            env: Vec::new(),
        };
        tokio::task::spawn_blocking(move || Cluster::start(&options))
            .await
            .expect("restart")
            .expect("restart the old primary")
    }

    /// Promote the standby and wait until it takes writes.
    pub async fn promote_standby(&self) {
        let mut conn = PgConnection::connect(&self.standby.url("postgres")).await.expect("standby connection");
        let promoted: bool =
            sqlx::query_scalar("SELECT pg_promote(true, 30)").fetch_one(&mut conn).await.expect("pg_promote");
        assert!(promoted, "the standby was promoted");
        conn.close().await.ok();
    }
}

impl Drop for ReplicatedPair {
    fn drop(&mut self) {
        self.standby.stop();
        self.primary.stop();
    }
}

/// `pg_basebackup -R` from the primary on `port` into `dir`, as the user the clusters run
/// as (`postgres` when the tests run as root).
fn base_backup(port: u16, password: &str, dir: &std::path::Path) {
    // Beside the server binaries (their directory may hold links to a few of them only,
    // as /usr/local/bin does on Debian machines set up by hand), else the real bindir.
    let bindir = embedded::find_bindir().expect("PostgreSQL binaries");
    let bin = std::fs::canonicalize(bindir.join("postgres"))
        .ok()
        .and_then(|postgres| postgres.parent().map(|dir| dir.join("pg_basebackup")))
        .filter(|path| path.exists())
        .unwrap_or_else(|| bindir.join("pg_basebackup"));
    let as_root = unsafe { libc::geteuid() } == 0;
    let mut command = if as_root {
        let mut c = std::process::Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(&bin);
        c
    } else {
        std::process::Command::new(&bin)
    };
    let out = command
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres", "-D"])
        .arg(dir)
        .args(["-R", "-X", "stream", "-c", "fast"])
        .env("PGPASSWORD", password)
        .output()
        .expect("run pg_basebackup");
    assert!(out.status.success(), "pg_basebackup failed: {}", String::from_utf8_lossy(&out.stderr));
}
