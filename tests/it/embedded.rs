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
