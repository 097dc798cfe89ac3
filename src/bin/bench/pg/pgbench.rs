//! pgbench running the gateway's own ingest statement: the "physical limit" of every
//! ingest row.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

use super::Server;
use crate::stats::Latency;

/// The gateway's single-event ingest statement, taken from the library so pgbench
/// always runs exactly what the gateway runs for one event of the bench's source: the
/// lean one (`store::events::lean`), since no subscription of that source filters,
/// orders or transforms (on a source with one, it would store nothing).
pub fn ingest_statement() -> anyhow::Result<String> {
    let sql = webhook_gateway::store::events::lean::insert_sql();
    if !sql.contains("INSERT INTO events")
        || !sql.contains("INSERT INTO deliveries")
        || !sql.contains("$10")
        || sql.contains("$11")
    {
        bail!(
            "store::events::lean::insert_sql() no longer looks like the event + fan-out statement with 10 parameters"
        );
    }
    Ok(sql.to_owned())
}

/// The pgbench script: a random dedupe key per transaction and the ingest statement with
/// its parameters as pgbench variables (sent as bind parameters with `-M prepared`).
///
/// The search terms are the stored event's, except `fresh_terms` of them drawn at random
/// per transaction: the terms that differ from one bench event to the next (its ids,
/// sequence number and dedupe key). With one fixed array every transaction added the same
/// keys to the GIN index, a cheaper merge than the gateway's events cause, so the
/// "physical limit" did less index work than the gateway's statement.
pub fn pgbench_script(fresh_terms: usize) -> anyhow::Result<String> {
    // The gateway binds NULL as the ordering key and trace context of an event without
    // them (the bench's: its requests carry no traceparent).
    let mut sql = ingest_statement()?;
    for n in [9, 8, 7] {
        sql = sql.replace(&format!("${n}"), "NULL::text");
    }
    for (n, var) in [(10, "terms"), (6, "payload"), (5, "headers"), (4, "ctype"), (3, "etype"), (2, "k"), (1, "source")]
    {
        sql = sql.replace(&format!("${n}"), &format!(":{var}"));
    }
    let fresh: Vec<String> = (1..=fresh_terms).map(|i| format!(":t{i}")).collect();
    if !fresh.is_empty() {
        sql = sql.replace(":terms", &format!("(:terms::int8[] || ARRAY[{}]::int8[])", fresh.join(", ")));
    }
    let draws: String = (1..=fresh_terms).map(|i| format!("\\set t{i} random(1, 9000000000000000000)\n")).collect();
    Ok(format!("\\set k random(1, 1000000000000000)\n{draws}{};\n", sql.trim()))
}

/// One pgbench run.
#[derive(Debug, Default)]
pub struct PgbenchRun {
    /// Transactions per second (pgbench's own figure, without connection time).
    pub tps: f64,
    /// Per-transaction latencies.
    pub latency: Latency,
    /// pgbench's CPU seconds.
    pub cpu_secs: f64,
    /// Failed transactions.
    pub failed: u64,
}

/// What the script's variables are bound to.
pub struct PgbenchVars {
    /// Source id.
    pub source: String,
    /// Event type.
    pub etype: String,
    /// Content type.
    pub ctype: String,
    /// Headers JSON.
    pub headers: String,
    /// Body, as bytea hex (`\x...`).
    pub payload_hex: String,
    /// Search terms, as an `int8[]` literal (`{1,2}`): those the stored event shares with
    /// the one stored before it.
    pub terms: String,
    /// How many of its terms it does not share (drawn at random per transaction).
    pub fresh_terms: usize,
}

/// Run pgbench with `script` on `db` for `secs` seconds at `clients` connections, as fast
/// as it can or, with `rate`, at that many transactions a second (`-R`); with `log_dir`,
/// per-transaction latencies are logged there and summarised.
#[allow(clippy::too_many_arguments)]
pub async fn pgbench(
    server: &Server,
    db: &str,
    script: &Path,
    vars: &PgbenchVars,
    clients: usize,
    secs: u64,
    rate: Option<u64>,
    log_dir: Option<&Path>,
) -> anyhow::Result<PgbenchRun> {
    let mut cmd = Command::new("pgbench");
    cmd.args(["-n", "-M", "prepared"]);
    if let Some(rate) = rate {
        cmd.args(["-R", &rate.to_string()]);
    }
    cmd.args(["-c", &clients.to_string(), "-j", &clients.min(2).to_string(), "-T", &secs.to_string()])
        .arg("-f")
        .arg(script)
        .args(["-D", &format!("source={}", vars.source)])
        .args(["-D", &format!("etype={}", vars.etype)])
        .args(["-D", &format!("ctype={}", vars.ctype)])
        .args(["-D", &format!("headers={}", vars.headers)])
        .args(["-D", &format!("payload={}", vars.payload_hex)])
        .args(["-D", &format!("terms={}", vars.terms)])
        .envs(server.libpq_env());
    if let Some(dir) = log_dir {
        std::fs::create_dir_all(dir)?;
        for e in std::fs::read_dir(dir)?.flatten() {
            let _ = std::fs::remove_file(e.path());
        }
        cmd.arg("-l").arg(format!("--log-prefix={}", dir.join("pgb").display()));
    }
    cmd.arg(db).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().context("starting pgbench (is it installed? Debian: postgresql-client)")?;
    let (out, cpu_secs) = tokio::task::spawn_blocking(move || wait_with_rusage(child)).await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("pgbench failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    let tps = stdout
        .lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l["tps = ".len()..].split(' ').next()?.parse::<f64>().ok())
        .with_context(|| format!("no tps in pgbench output: {stdout}"))?;
    let failed = stdout
        .lines()
        .find(|l| l.starts_with("number of failed transactions: "))
        .and_then(|l| l.split(':').nth(1)?.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let mut run = PgbenchRun { tps, cpu_secs, failed, ..PgbenchRun::default() };
    if let Some(dir) = log_dir {
        let mut lat = Vec::new();
        for e in std::fs::read_dir(dir)?.flatten() {
            let text = std::fs::read_to_string(e.path())?;
            // client_id transaction_no time script_no time_epoch time_us: `time` is µs.
            lat.extend(text.lines().filter_map(|l| l.split(' ').nth(2)?.parse::<u64>().ok()));
        }
        run.latency = Latency::from_micros(&mut lat);
    }
    Ok(run)
}

/// Wait for a child, collecting its output and its CPU time (wait4's rusage).
fn wait_with_rusage(mut child: std::process::Child) -> anyhow::Result<(std::process::Output, f64)> {
    use std::io::Read;
    let mut stdout = child.stdout.take().context("stdout")?;
    let mut stderr = child.stderr.take().context("stderr")?;
    let err_thread = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stderr.read_to_end(&mut buf);
        buf
    });
    let mut out_buf = Vec::new();
    stdout.read_to_end(&mut out_buf)?;
    let err_buf = err_thread.join().unwrap_or_default();
    let pid = child.id() as libc::pid_t;
    let mut status: libc::c_int = 0;
    // SAFETY: zeroed rusage is valid; wait4 on our own unreaped child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    if r != pid {
        bail!("wait4 failed: {}", std::io::Error::last_os_error());
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    use std::os::unix::process::ExitStatusExt;
    let status = std::process::ExitStatus::from_raw(status);
    // The std handle must not wait again: it would reap nothing and report an error.
    std::mem::forget(child);
    Ok((std::process::Output { status, stdout: out_buf, stderr: err_buf }, tv(ru.ru_utime) + tv(ru.ru_stime)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ingest_statement_is_found_and_parameterised() {
        let script = pgbench_script(0).unwrap();
        assert!(script.starts_with("\\set k random("));
        let fresh = pgbench_script(2).unwrap();
        assert!(fresh.contains("\\set t2 random("), "{fresh}");
        assert!(fresh.contains("(:terms::int8[] || ARRAY[:t1, :t2]::int8[])::int8[]"), "{fresh}");
        assert!(
            script.contains(
                "SELECT :source::uuid, :k::text, :etype::text, :ctype::text, :headers::jsonb, :payload::bytea, \
                 NULL::text::text, NULL::text::text, NULL::text::text,"
            ) && script.contains(":terms::int8[]"),
            "{script}"
        );
        assert!(!script.contains('$'), "{script}");
    }
}
