//! The embedded cluster is as private as a production install: no local process logs in
//! without the generated password, and a cluster made with trust authentication by an
//! earlier version is closed on its next start.

use std::os::unix::fs::PermissionsExt;

use sqlx::{Connection, PgConnection};
use webhook_gateway::db::embedded::{self, Cluster, ClusterOptions};

use crate::support::throwaway_options;

/// Try to log in to `port` as `postgres`, with `password` if any.
async fn login(port: u16, password: Option<&str>) -> Result<(), sqlx::Error> {
    let url = match password {
        Some(p) => format!("postgres://postgres:{p}@127.0.0.1:{port}/postgres"),
        None => format!("postgres://postgres@127.0.0.1:{port}/postgres"),
    };
    PgConnection::connect(&url).await?.close().await
}

async fn start(options: ClusterOptions) -> Cluster {
    tokio::task::spawn_blocking(move || Cluster::start(&options)).await.expect("join").expect("start cluster")
}

fn assert_refused(result: Result<(), sqlx::Error>, what: &str) {
    match result {
        Err(sqlx::Error::Database(e)) => assert_eq!(e.code().as_deref(), Some("28P01"), "{what}: {e}"),
        Err(e) if e.to_string().contains("password") => {}
        other => panic!("{what}: expected a refused login, got {other:?}"),
    }
}

#[tokio::test]
async fn no_login_without_the_generated_password() {
    let mut cluster = start(throwaway_options()).await;
    let port = cluster.port();
    assert_refused(login(port, None).await, "no password");
    assert_refused(login(port, Some("postgres")).await, "a guessed password");
    PgConnection::connect(&cluster.url("postgres")).await.expect("the gateway's own URL logs in").close().await.ok();
    let file = cluster.data_dir().join(embedded::PASSWORD_FILE);
    let mode = std::fs::metadata(&file).expect("password file").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{}", file.display());
    let dir_mode = std::fs::metadata(cluster.data_dir()).unwrap().permissions().mode() & 0o777;
    assert_eq!(dir_mode, 0o700);
    tokio::task::spawn_blocking(move || cluster.stop()).await.unwrap();
}

/// A cluster directory as an earlier version left it (trust for every TCP login, no
/// password file) is closed on start: afterwards only the new password logs in.
#[tokio::test]
async fn a_trusting_cluster_from_an_earlier_version_is_closed_on_start() {
    let options = ClusterOptions { throwaway: false, ..throwaway_options() };
    let first = start(options.clone()).await;
    let data_dir = first.data_dir().to_path_buf();
    let mut first = first;
    tokio::task::spawn_blocking(move || first.stop()).await.unwrap();
    // What version 1 wrote: trust, and no password file.
    std::fs::write(data_dir.join("pg_hba.conf"), "host all all 127.0.0.1/32 trust\n").unwrap();
    std::fs::remove_file(data_dir.join(embedded::PASSWORD_FILE)).unwrap();

    let mut upgraded = start(ClusterOptions { throwaway: true, ..options }).await;
    assert_refused(login(upgraded.port(), None).await, "no password after the upgrade");
    PgConnection::connect(&upgraded.url("postgres")).await.expect("the new password logs in").close().await.ok();
    tokio::task::spawn_blocking(move || upgraded.stop()).await.unwrap();
}

/// A stand-alone backend on a stopped cluster (what the benchmark counts statements in)
/// runs as the cluster's user, reads what the cluster stored, writes what lasts, and
/// reports an error on stderr rather than going on.
#[tokio::test]
async fn a_stand_alone_backend_opens_a_stopped_cluster_s_database() {
    let options = ClusterOptions { throwaway: false, ..throwaway_options() };
    let mut cluster = start(options).await;
    let mut conn = PgConnection::connect(&cluster.url("postgres")).await.unwrap();
    sqlx::query("CREATE TABLE marks (n int)").execute(&mut conn).await.unwrap();
    sqlx::query("INSERT INTO marks VALUES (41)").execute(&mut conn).await.unwrap();
    conn.close().await.ok();
    let data_dir = cluster.data_dir().to_path_buf();
    tokio::task::spawn_blocking(move || cluster.stop()).await.unwrap();

    let run = |script: &'static str| {
        let mut cmd = embedded::standalone(&data_dir, "postgres", &[], None).unwrap();
        cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
        cmd.stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().expect("a stand-alone backend");
        use std::io::Write as _;
        child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (_, err) = run("INSERT INTO marks VALUES (42);\n\n");
    assert!(!err.contains("ERROR"), "{err}");
    let (out, err) = run("SELECT sum(n) AS total FROM marks;\n\n");
    assert!(out.contains("total = \"83\""), "the insert of the first backend lasted: {out} {err}");
    let (_, err) = run("SELECT * FROM no_such_table;\n\n");
    assert!(err.contains("ERROR") && err.contains("no_such_table"), "{err}");
    let _ = std::fs::remove_dir_all(&data_dir);
}

/// A port taken by another process fails the start with PostgreSQL's own words for it,
/// which the start recognises (`embedded::lost_the_port`): a port the start chose itself,
/// free when chosen and taken before the postmaster bound it, is then replaced by another
/// rather than failing the gateway's start. A port the operator chose is not replaced.
#[tokio::test]
async fn a_taken_port_fails_the_start_in_words_the_start_recognises() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port to hold");
    let options = ClusterOptions { port: Some(taken.local_addr().expect("addr").port()), ..throwaway_options() };
    let failed = tokio::task::spawn_blocking(move || Cluster::start(&options)).await.expect("join");
    let Err(error) = failed else { panic!("a start on a taken port fails") };
    assert!(embedded::lost_the_port(&error), "not recognised as a lost port: {error:#}");
    let other =
        anyhow::anyhow!("PostgreSQL exited during start-up (exit status: 1); last log lines: FATAL: bad setting");
    assert!(!embedded::lost_the_port(&other), "any other failure is not");
    // A port of the start's own choosing: started.
    let cluster = start(throwaway_options()).await;
    assert_ne!(cluster.port(), 0);
}
