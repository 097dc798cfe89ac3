//! A private PostgreSQL cluster started from the binaries on this machine.
//!
//! Used by `serve` when no database URL is configured, by the test suite when
//! `DATABASE_URL` is unset, and by the benchmark harness. The cluster listens on
//! 127.0.0.1 on a free port with Unix sockets disabled (so nothing collides with a
//! system cluster), and is stopped when [`Cluster::stop`] is called or, if this process
//! dies first, by a small watchdog process.
//!
//! It is as private as a production install: the only login is `postgres` over TCP with
//! `scram-sha-256` and a generated password kept in [`PASSWORD_FILE`] (0600) inside the
//! cluster directory (0700). Any other local process that finds the port cannot log in.
//! A cluster made by an earlier version (trust authentication) is upgraded on start:
//! the password is set in single-user mode, with no network open, before the managed
//! `pg_hba.conf` replaces the trusting one.
//!
//! PostgreSQL refuses to run as root; when we are root the cluster's processes run as
//! the `postgres` system user (which then owns the cluster directory).

use std::ffi::CString;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};

/// The file in the cluster directory that holds the `postgres` user's password.
pub const PASSWORD_FILE: &str = "gateway-password";
/// First line of the `pg_hba.conf` this module writes: a cluster whose file starts with
/// it has its password set.
const MANAGED_HBA: &str = "# managed by webhook-gateway: password logins over TCP only";

/// How the cluster is set up.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Directory of the cluster (`PGDATA`). Created when missing.
    pub data_dir: PathBuf,
    /// Delete the directory when the cluster stops (throwaway clusters for tests).
    pub throwaway: bool,
    /// TCP port; `None` picks a free one. (A restart that must keep its URL passes the
    /// previous port.)
    pub port: Option<u16>,
    /// Extra `-c name=value` server settings, e.g. `fsync=off` for a test cluster.
    pub settings: Vec<(String, String)>,
    /// Extra environment for the server's processes (a test's libfaketime, to give a
    /// cluster a clock of its own).
    pub env: Vec<(String, String)>,
}

/// A running cluster. Stop it with [`Cluster::stop`]; if the process dies without doing
/// so, the watchdog stops it within about a second.
#[derive(Debug)]
pub struct Cluster {
    child: Child,
    port: u16,
    password: String,
    data_dir: PathBuf,
    throwaway: bool,
}

/// The user the cluster's processes run as.
struct RunAs {
    uid: u32,
    gid: u32,
    name: String,
}

impl Cluster {
    /// Initialise (if needed) and start a cluster, waiting until it accepts connections.
    pub fn start(options: &ClusterOptions) -> anyhow::Result<Cluster> {
        let bin = find_bindir().ok_or_else(|| {
            anyhow!(
                "no PostgreSQL server binaries found (looked on PATH, in `pg_config --bindir` and /usr/lib/postgresql/*/bin): install PostgreSQL (e.g. `apt install postgresql`) or set DATABASE_URL"
            )
        })?;
        let run_as = run_as_user()?;
        let data_dir = absolute(&options.data_dir)?;
        prepare_dir(&data_dir, run_as.as_ref())?;
        wait_for_previous_postmaster(&data_dir)?;

        if !data_dir.join("PG_VERSION").exists() {
            let mut cmd = Command::new(bin.join("initdb"));
            cmd.arg("-D").arg(&data_dir).args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-locale",
                "--no-sync",
            ]);
            let out = run_as_cmd(&mut cmd, run_as.as_ref(), &data_dir)
                .output()
                .with_context(|| format!("running {}", bin.join("initdb").display()))?;
            if !out.status.success() {
                bail!("initdb failed in {}: {}", data_dir.display(), String::from_utf8_lossy(&out.stderr).trim());
            }
        }

        let password = secure(&bin, &data_dir, run_as.as_ref())?;

        // A port of our choosing is free when chosen, not when the postmaster binds it
        // (another process may take it between): a start that lost it tries another.
        let mut tries = 0;
        loop {
            let port = match options.port {
                Some(port) => port,
                None => free_port()?,
            };
            match Cluster::launch(&bin, &data_dir, run_as.as_ref(), options, port, &password) {
                Err(e) if options.port.is_none() && tries < 2 && lost_the_port(&e) => {
                    tries += 1;
                    tracing::info!(port, "the embedded PostgreSQL's port was taken before it bound it; trying another");
                }
                started => return started,
            }
        }
    }

    /// Start the postmaster of an initialised `data_dir` on `port` and wait until it
    /// accepts connections.
    fn launch(
        bin: &Path,
        data_dir: &Path,
        run_as: Option<&RunAs>,
        options: &ClusterOptions,
        port: u16,
        password: &str,
    ) -> anyhow::Result<Cluster> {
        let log_path = data_dir.join("server.log");
        let log_start = std::fs::metadata(&log_path).map(|m| m.len()).unwrap_or(0);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        if let Some(user) = run_as {
            chown(&log_path, user)?;
        }
        let mut cmd = Command::new(bin.join("postgres"));
        cmd.arg("-D")
            .arg(data_dir)
            .args(["-p", &port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="])
            .args(["-c", "max_connections=300"]);
        for (name, value) in &options.settings {
            cmd.arg("-c").arg(format!("{name}={value}"));
        }
        cmd.envs(options.env.iter().map(|(name, value)| (name, value)));
        cmd.stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        // Own process group: a Ctrl-C aimed at us must not reach the postmaster before we
        // have drained our own work; we stop it ourselves.
        cmd.process_group(0);
        let child = run_as_cmd(&mut cmd, run_as, data_dir)
            .spawn()
            .with_context(|| format!("starting {}", bin.join("postgres").display()))?;
        let mut cluster = Cluster {
            child,
            port,
            password: password.to_owned(),
            data_dir: data_dir.to_path_buf(),
            throwaway: options.throwaway,
        };
        spawn_watchdog(cluster.child.id(), data_dir, options.throwaway);
        if let Err(e) = cluster.wait_ready(&log_path, log_start) {
            cluster.stop();
            return Err(e);
        }
        Ok(cluster)
    }

    /// Connection URL for a database on this cluster (it carries the password: do not
    /// log it).
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres:{}@127.0.0.1:{}/{database}", self.password, self.port)
    }

    /// TCP port the cluster listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The cluster directory.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Wait for this start's "ready" line (the log is appended to across restarts, so
    /// only text after `log_start` counts).
    fn wait_ready(&mut self, log_path: &Path, log_start: u64) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("PostgreSQL exited during start-up ({status}); last log lines: {}", tail(log_path, 5));
            }
            // The log line is written when the postmaster accepts connections; a bare TCP
            // connect would succeed earlier, during recovery.
            let log = std::fs::read(log_path).unwrap_or_default();
            let fresh = String::from_utf8_lossy(log.get(log_start as usize..).unwrap_or_default());
            // A hot standby (a test's replica) accepts read-only connections.
            if (fresh.contains("database system is ready to accept connections")
                || fresh.contains("database system is ready to accept read-only connections"))
                && std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("PostgreSQL did not become ready within 60 s; last log lines: {}", tail(log_path, 5));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Fast shutdown (SIGINT: active sessions are disconnected, data is flushed), then wait.
    pub fn stop(&mut self) {
        // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped).
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGINT);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if self.throwaway {
            let _ = std::fs::remove_dir_all(&self.data_dir);
        }
    }
}

/// Make sure the cluster only takes password logins, and return the password: read it
/// from [`PASSWORD_FILE`] (creating it, 0600, on first use); unless `pg_hba.conf` is
/// already the managed one, set the password in single-user mode and then write the
/// managed `pg_hba.conf`. Every step is idempotent and in an order that survives a crash
/// at any point: the file first, the password next, the open door closed last.
fn secure(bin: &Path, data_dir: &Path, run_as: Option<&RunAs>) -> anyhow::Result<String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join(PASSWORD_FILE);
    let password = match std::fs::read_to_string(&path) {
        Ok(text) if !text.trim().is_empty() => text.trim().to_owned(),
        _ => {
            let mut bytes = [0u8; 24];
            rand::Rng::fill(&mut rand::rng(), &mut bytes[..]);
            let password = hex::encode(bytes);
            let tmp = data_dir.join(format!("{PASSWORD_FILE}.tmp"));
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .with_context(|| format!("creating {}", tmp.display()))?;
            file.write_all(password.as_bytes())?;
            file.sync_all()?;
            std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
            password
        }
    };
    let hba = data_dir.join("pg_hba.conf");
    let managed = std::fs::read_to_string(&hba).is_ok_and(|text| text.starts_with(MANAGED_HBA));
    if !managed {
        let options = ["-c", "password_encryption=scram-sha-256"];
        let mut cmd = single_user(&bin.join("postgres"), &[], data_dir, &options, "postgres", run_as);
        cmd.stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child =
            cmd.spawn().with_context(|| format!("starting {} in single-user mode", bin.join("postgres").display()))?;
        if let Some(mut stdin) = child.stdin.take() {
            writeln!(stdin, "ALTER USER postgres PASSWORD '{password}';")?;
        }
        let out = child.wait_with_output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() || stderr.contains("ERROR") {
            bail!("setting the embedded PostgreSQL's password failed: {}", stderr.trim());
        }
        let text = format!("{MANAGED_HBA}\nhost all all 127.0.0.1/32 scram-sha-256\n");
        std::fs::write(&hba, text).with_context(|| format!("writing {}", hba.display()))?;
        if let Some(user) = run_as {
            chown(&hba, user)?;
        }
    }
    if let Some(user) = run_as {
        chown(&path, user)?;
    }
    Ok(password)
}

/// How long a start waits for a previous postmaster of the same directory to go away.
const PREVIOUS_POSTMASTER_WAIT: Duration = Duration::from_secs(10);

/// A gateway restarted right after it died (SIGKILL, a closed terminal) finds its old
/// postmaster still there for a second or two, until the watchdog has stopped it: wait
/// for it rather than fail with PostgreSQL's lock-file error. One still there after
/// [`PREVIOUS_POSTMASTER_WAIT`] belongs to a live process, most likely another gateway on
/// the same `--data-dir`: say so.
fn wait_for_previous_postmaster(data_dir: &Path) -> anyhow::Result<()> {
    let pid_file = data_dir.join("postmaster.pid");
    let deadline = Instant::now() + PREVIOUS_POSTMASTER_WAIT;
    loop {
        let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|text| text.lines().next()?.trim().parse::<libc::pid_t>().ok())
            .filter(|pid| *pid > 0)
        else {
            return Ok(());
        };
        // SAFETY: kill(2) with signal 0 sends nothing; it only checks that the process
        // exists (EPERM: it exists under another user, e.g. `postgres` when we are not root).
        let alive =
            unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if !alive {
            // A stale file from a crash: PostgreSQL itself checks it and starts.
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the embedded PostgreSQL in {} is already running (PID {pid}): another webhook-gateway is using this \
                 data directory; stop it, or choose another --data-dir",
                data_dir.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A stand-alone backend (`postgres --single -j`) on the data directory of a **stopped**
/// cluster, for `database`, run as the user the cluster runs as: it reads commands from
/// stdin (each ended by a semicolon and an empty line) and opens no socket. `wrapper` is
/// put before the binary (a profiler such as valgrind); `writable` is created for that
/// user (where a profiler writes). The benchmark counts PostgreSQL's instructions per
/// statement with it.
pub fn standalone(
    data_dir: &Path,
    database: &str,
    wrapper: &[String],
    writable: Option<&Path>,
) -> anyhow::Result<Command> {
    let bin = find_bindir().ok_or_else(|| anyhow!("no PostgreSQL server binaries found"))?;
    let run_as = run_as_user()?;
    if let Some(dir) = writable {
        prepare_dir(dir, run_as.as_ref())?;
    }
    Ok(single_user(&bin.join("postgres"), wrapper, &absolute(data_dir)?, &["-j"], database, run_as.as_ref()))
}

/// `postgres --single` (behind `wrapper`, when there is one) on `data_dir` for
/// `database`, with `options`, run as `run_as`: a backend that reads commands from stdin
/// and opens no socket.
fn single_user(
    postgres: &Path,
    wrapper: &[String],
    data_dir: &Path,
    options: &[&str],
    database: &str,
    run_as: Option<&RunAs>,
) -> Command {
    let mut cmd = match wrapper.split_first() {
        Some((program, args)) => {
            let mut cmd = Command::new(program);
            cmd.args(args).arg(postgres);
            cmd
        }
        None => Command::new(postgres),
    };
    cmd.args(["--single", "-D"]).arg(data_dir).args(options).arg(database);
    run_as_cmd(&mut cmd, run_as, data_dir);
    cmd
}

/// Locate the directory holding `initdb` and `postgres`.
pub fn find_bindir() -> Option<PathBuf> {
    let has_both = |dir: &Path| dir.join("initdb").is_file() && dir.join("postgres").is_file();
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if has_both(&dir) {
                return Some(dir);
            }
        }
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if has_both(&dir) {
            return Some(dir);
        }
    }
    // Debian/Ubuntu keep server binaries off PATH, one directory per major version.
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let major = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((major, e.path().join("bin")))
        })
        .filter(|(_, dir)| has_both(dir))
        .collect();
    versions.sort();
    if let Some((_, dir)) = versions.pop() {
        return Some(dir);
    }
    ["/usr/local/pgsql/bin", "/opt/homebrew/bin", "/usr/local/bin"].into_iter().map(PathBuf::from).find(|d| has_both(d))
}

fn run_as_user() -> anyhow::Result<Option<RunAs>> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let name = "postgres";
    let c_name = CString::new(name)?;
    // SAFETY: getpwnam returns a pointer into static storage or null; we copy what we need
    // before any other call that could overwrite it.
    let pw = unsafe { libc::getpwnam(c_name.as_ptr()) };
    if pw.is_null() {
        bail!(
            "running as root, and PostgreSQL refuses to run as root: create an unprivileged `postgres` user (e.g. `useradd --system postgres`), run as a normal user, or set DATABASE_URL"
        );
    }
    // SAFETY: pw is non-null and points at a valid passwd record.
    let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
    Ok(Some(RunAs { uid, gid, name: name.to_owned() }))
}

fn run_as_cmd<'a>(cmd: &'a mut Command, user: Option<&RunAs>, cwd: &Path) -> &'a mut Command {
    // initdb and postgres chdir freely; start them somewhere the user can read.
    cmd.current_dir(cwd);
    if let Some(user) = user {
        cmd.uid(user.uid).gid(user.gid);
        cmd.env("HOME", cwd).env("USER", &user.name);
    }
    cmd
}

fn prepare_dir(dir: &Path, user: Option<&RunAs>) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    if let Some(user) = user {
        chown(dir, user)?;
        // The unprivileged user must be able to reach the directory through its parents.
        let mut probe = Command::new("test");
        probe.arg("-w").arg(dir);
        let ok = run_as_cmd(&mut probe, Some(user), Path::new("/")).status().map(|s| s.success()).unwrap_or(false);
        if !ok {
            bail!(
                "the embedded PostgreSQL runs as user `{}`, which cannot reach {}: choose a --data-dir that user can traverse (e.g. under /var/tmp) or set DATABASE_URL",
                user.name,
                dir.display()
            );
        }
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    Ok(())
}

fn chown(path: &Path, user: &RunAs) -> anyhow::Result<()> {
    std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid))
        .with_context(|| format!("giving {} to user {}", path.display(), user.name))
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    Ok(if path.is_absolute() { path.to_path_buf() } else { std::env::current_dir()?.join(path) })
}

/// Whether a start failed because the postmaster could not bind its port (another
/// process holds it): [`Cluster::start`] then tries another port, when it chose the port.
pub fn lost_the_port(error: &anyhow::Error) -> bool {
    let text = format!("{error:#}");
    text.contains("could not bind") || text.contains("Address already in use")
}

fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join(" | ")
}

/// A shell loop that outlives us: when this process is gone it stops the postmaster
/// (and removes a throwaway directory). Without it, a killed test run or a SIGKILLed
/// gateway would leave a cluster running forever.
fn spawn_watchdog(postmaster: u32, data_dir: &Path, throwaway: bool) {
    let me = std::process::id();
    let cleanup = if throwaway { format!("rm -rf '{}'", data_dir.display()) } else { String::new() };
    let script = format!(
        "while kill -0 {me} 2>/dev/null; do sleep 1; done; \
         kill -INT {postmaster} 2>/dev/null; \
         for i in $(seq 1 300); do kill -0 {postmaster} 2>/dev/null || break; sleep 0.1; done; {cleanup}"
    );
    let spawned = Command::new("sh")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "could not start the embedded PostgreSQL watchdog; the cluster will outlive a crash");
    }
}
