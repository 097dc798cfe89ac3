//! The distribution's PgBouncer, started by a test in transaction mode in front of the
//! test server: the pooler most managed PostgreSQL offerings put before the database.
//! Installed by `.ci/run` where missing; a test that needs it fails with a clear message
//! when it is not there.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A database name of PgBouncer's own ([`PgBouncer::start_with`]).
pub struct Alias<'a> {
    /// The name clients connect to.
    pub name: &'a str,
    /// The server's database it leads to.
    pub database: &'a str,
    /// Run on each new server connection (no single quotes).
    pub connect_query: &'a str,
}

/// A running PgBouncer; stopped on drop.
pub struct PgBouncer {
    child: Option<Child>,
    /// Where clients connect.
    pub port: u16,
    dir: PathBuf,
    /// Its log (stderr).
    pub log: PathBuf,
}

/// The `pgbouncer` binary.
fn binary() -> PathBuf {
    ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer", "/usr/local/bin/pgbouncer"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("pgbouncer is not installed (apt install pgbouncer; .ci/run installs it)")
}

impl PgBouncer {
    /// PgBouncer in transaction mode with `server_connections` server connections per
    /// database, in front of the server `server_url` points at (any database of it).
    pub fn start(server_url: &str, server_connections: u32) -> PgBouncer {
        PgBouncer::start_with(server_url, server_connections, &[])
    }

    /// [`PgBouncer::start`] with `aliases` besides: each a database name clients use, the
    /// server's database it leads to, and the query PgBouncer runs on each new server
    /// connection of it (`connect_query`, as an operator gives each alias its own
    /// `search_path`).
    pub fn start_with(server_url: &str, server_connections: u32, aliases: &[Alias]) -> PgBouncer {
        PgBouncer::start_in_mode(server_url, server_connections, aliases, "transaction")
    }

    /// [`PgBouncer::start_with`] in `pool_mode` (`transaction`, `session` or `statement`).
    pub fn start_in_mode(server_url: &str, server_connections: u32, aliases: &[Alias], pool_mode: &str) -> PgBouncer {
        PgBouncer::start_configured(server_url, server_connections, aliases, pool_mode, &[])
    }

    /// [`PgBouncer::start_in_mode`] with `settings` of its `[pgbouncer]` section besides
    /// (`max_client_conn`, `query_timeout`, ...), which win over the harness's own.
    pub fn start_configured(
        server_url: &str,
        server_connections: u32,
        aliases: &[Alias],
        pool_mode: &str,
        settings: &[(&str, &str)],
    ) -> PgBouncer {
        // A port free when chosen may be taken before PgBouncer binds it (by another test's
        // connection or process): a start that lost its port tries another.
        for _ in 0..3 {
            if let Some(bouncer) = PgBouncer::try_start(server_url, server_connections, aliases, pool_mode, settings) {
                return bouncer;
            }
        }
        panic!("pgbouncer lost its port three times");
    }

    /// One start of [`PgBouncer::start_configured`] on a port chosen here; `None` if
    /// another process took that port first.
    fn try_start(
        server_url: &str,
        server_connections: u32,
        aliases: &[Alias],
        pool_mode: &str,
        settings: &[(&str, &str)],
    ) -> Option<PgBouncer> {
        let server = url::Url::parse(server_url).expect("server URL");
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr").port();
        let dir = std::env::temp_dir().join(format!("wg-pgbouncer-{port}"));
        std::fs::create_dir_all(&dir).expect("pgbouncer dir");
        let password = server.password().map(|p| format!(" password={p}")).unwrap_or_default();
        let host = server.host_str().expect("host");
        let (sport, user) = (server.port().unwrap_or(5432), server.username());
        let aliases: String = aliases
            .iter()
            .map(|a| {
                assert!(!a.connect_query.contains('\''), "a connect_query without quotes");
                format!(
                    "{} = host={host} port={sport} user={user}{password} dbname={} connect_query='{}'\n",
                    a.name, a.database, a.connect_query
                )
            })
            .collect();
        let defaults = [("max_client_conn", "500"), ("server_login_retry", "1"), ("query_wait_timeout", "30")];
        let section: String = defaults
            .iter()
            .filter(|(name, _)| !settings.iter().any(|(given, _)| given == name))
            .chain(settings)
            .map(|(name, value)| format!("{name} = {value}\n"))
            .collect();
        let ini = format!(
            "[databases]\n{aliases}* = host={host} port={sport} user={user}{password}\n\
             [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
             auth_type = trust\nauth_file = {dir}/users.txt\npool_mode = {pool_mode}\n\
             default_pool_size = {server_connections}\n{section}",
            dir = dir.display(),
        );
        std::fs::write(dir.join("pgbouncer.ini"), ini).expect("pgbouncer.ini");
        std::fs::write(dir.join("users.txt"), format!("\"{}\" \"\"\n", server.username())).expect("users.txt");
        let mut bouncer = PgBouncer { child: None, port, log: dir.join("pgbouncer.log"), dir };
        bouncer.spawn().then_some(bouncer)
    }

    /// Start the process and wait until it says it listens on its port: a bare connect
    /// could reach another process that holds the port. False if it could not bind it.
    fn spawn(&mut self) -> bool {
        use std::os::unix::fs::PermissionsExt;
        // PgBouncer refuses to run as root: as root, it runs as the `postgres` user (the
        // embedded test cluster does the same), which must read its files.
        let as_root = unsafe { libc::geteuid() } == 0;
        for file in ["", "pgbouncer.ini", "users.txt"] {
            let mode = if file.is_empty() { 0o755 } else { 0o644 };
            let _ = std::fs::set_permissions(self.dir.join(file), std::fs::Permissions::from_mode(mode));
        }
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("pgbouncer log");
        let log_start = log.metadata().map(|m| m.len() as usize).unwrap_or(0);
        let mut command = Command::new(binary());
        if as_root {
            command.args(["-u", "postgres"]);
        }
        let child = command
            .arg(self.dir.join("pgbouncer.ini"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start pgbouncer");
        self.child = Some(child);
        let addr: SocketAddr = format!("127.0.0.1:{}", self.port).parse().expect("addr");
        let listening = format!("listening on {addr}");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = self.log_text();
            let fresh = text.get(log_start..).unwrap_or_default();
            if fresh.contains(&listening)
                && std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
            {
                return true;
            }
            if let Some(Ok(Some(_))) = self.child.as_mut().map(|c| c.try_wait()) {
                self.child = None;
                assert!(fresh.contains("Address already in use"), "pgbouncer exited at start: {fresh}");
                return false;
            }
            assert!(Instant::now() < deadline, "pgbouncer did not start: {}", self.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A client URL for `database` through this pooler.
    pub fn url(&self, database: &str, server_url: &str) -> String {
        let server = url::Url::parse(server_url).expect("server URL");
        format!("postgres://{}@127.0.0.1:{}/{database}", server.username(), self.port)
    }

    /// Kill it (every client and server connection is cut), then start it again on the
    /// same port: a pooler restarted or failed over under load.
    pub fn restart(&mut self) {
        self.stop();
        std::thread::sleep(Duration::from_millis(300));
        assert!(self.spawn(), "pgbouncer's port was taken while it was down: {}", self.log_text());
    }

    /// Kill it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// What it logged.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
