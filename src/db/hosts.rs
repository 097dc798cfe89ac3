//! Database URLs with several hosts, with libpq's meaning:
//! `postgres://user:pw@h1:5432,h2:5432/db?target_session_attrs=read-write`, the form that
//! Patroni and managed offerings document for reaching whichever node is the primary.
//!
//! The gateway connects to the first host, in the order given, that accepts a connection
//! and takes writes, and when the database fails (a refused or lost connection, a
//! read-only transaction) it looks again in the same order ([`follow_writable`]), so it
//! follows a failover by itself. Only writable nodes are any use to it, so
//! `target_session_attrs` may be `read-write`, `primary` or `any` (all mean the same
//! here); the read-only values are refused with a clear message.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;

use super::failure::Health;

/// How long looking at one host may take (connect and one query).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// While no host takes writes, how often they are looked at again.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(500);

/// One URL per host of `url`, in order (one for a single-host URL), without the
/// `target_session_attrs` parameter (which sqlx does not know); an error for a URL
/// whose hosts or `target_session_attrs` the gateway cannot use.
pub fn split(url: &str) -> anyhow::Result<Vec<String>> {
    let (scheme, rest) = url.split_once("://").ok_or_else(|| anyhow::anyhow!("invalid database URL: no scheme"))?;
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..]),
        None => ("", authority),
    };
    let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("target_session_attrs", value)) => match value {
                "any" | "read-write" | "primary" => {}
                other => anyhow::bail!(
                    "invalid database URL: target_session_attrs={other}: the gateway writes, so it needs a primary \
                     (read-write, primary or any)"
                ),
            },
            _ => kept.push(pair),
        }
    }
    let query = if kept.is_empty() { String::new() } else { format!("?{}", kept.join("&")) };
    let hosts: Vec<&str> = hosts.split(',').collect();
    if hosts.len() > 1 && hosts.iter().any(|h| h.is_empty()) {
        anyhow::bail!("invalid database URL: an empty host in its host list");
    }
    Ok(hosts.into_iter().map(|host| format!("{scheme}://{userinfo}{host}{path}{query}")).collect())
}

/// Whether the node `options` reaches takes writes; `Err` with the reason, and whether it
/// may pass by itself, when it cannot be reached within [`PROBE_TIMEOUT`].
pub async fn probe(options: &PgConnectOptions) -> Result<bool, (String, bool)> {
    match tokio::time::timeout(PROBE_TIMEOUT, super::start::writable_at(options)).await {
        Ok(answer) => answer.map_err(|e| (e.to_string(), super::start::may_pass(&e))),
        Err(_) => Err(("no answer".into(), true)),
    }
}

/// The first of `hosts` that takes writes, or every host's reason for not being it and
/// whether any of them may pass by itself (a standby may be promoted; a host down may come
/// back).
pub async fn first_writable(hosts: &[PgConnectOptions]) -> Result<usize, (Vec<String>, bool)> {
    let mut reasons = Vec::new();
    let mut may_pass = false;
    for (i, host) in hosts.iter().enumerate() {
        let name = format!("{}:{}", host.get_host(), host.get_port());
        match probe(host).await {
            Ok(true) => return Ok(i),
            Ok(false) => {
                reasons.push(format!("{name} does not take writes"));
                may_pass = true;
            }
            Err((e, passing)) => {
                reasons.push(format!("{name}: {e}"));
                may_pass |= passing;
            }
        }
    }
    Err((reasons, may_pass))
}

/// For a pool over several hosts: whenever the pool's health reports a failure, look for
/// the first host that takes writes and move the pool there (its older connections are
/// discarded); while none does, look again every [`PROBE_INTERVAL`]. Ends when the pool
/// is closed.
pub async fn follow_writable(
    pool: sqlx::PgPool,
    health: Arc<Health>,
    hosts: Vec<PgConnectOptions>,
    mut current: usize,
) {
    loop {
        tokio::select! {
            () = health.trouble() => {}
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
        if pool.is_closed() {
            return;
        }
        loop {
            match first_writable(&hosts).await {
                Ok(found) => {
                    if found != current {
                        let (from, to) = (&hosts[current], &hosts[found]);
                        tracing::warn!(
                            from = %format!("{}:{}", from.get_host(), from.get_port()),
                            to = %format!("{}:{}", to.get_host(), to.get_port()),
                            "database: another host takes writes now; the pool follows it"
                        );
                        pool.set_connect_options(hosts[found].clone());
                        health.mark_all_stale();
                        current = found;
                    }
                    break;
                }
                Err((reasons, _)) => {
                    tracing::warn!(hosts = %reasons.join("; "), "database: no host takes writes; looking again");
                    tokio::time::sleep(PROBE_INTERVAL).await;
                    if pool.is_closed() {
                        return;
                    }
                }
            }
        }
        // At most one look per interval, however many calls fail meanwhile.
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_list_becomes_one_url_per_host_in_order() {
        let urls = split("postgres://gw:p%40ss@db1:5432,db2:5433,[::1]:5434/gateway?sslmode=prefer&target_session_attrs=read-write&application_name=x")
            .unwrap();
        assert_eq!(
            urls,
            [
                "postgres://gw:p%40ss@db1:5432/gateway?sslmode=prefer&application_name=x",
                "postgres://gw:p%40ss@db2:5433/gateway?sslmode=prefer&application_name=x",
                "postgres://gw:p%40ss@[::1]:5434/gateway?sslmode=prefer&application_name=x",
            ]
        );
        for url in &urls {
            url.parse::<PgConnectOptions>().expect("each is a URL sqlx takes");
        }
    }

    #[test]
    fn a_single_host_is_left_as_it_is_and_bad_lists_are_refused() {
        assert_eq!(split("postgres://u@h/db").unwrap(), ["postgres://u@h/db"]);
        assert_eq!(split("postgresql://h:5432").unwrap(), ["postgresql://h:5432"]);
        assert_eq!(split("postgres://u@h/db?target_session_attrs=primary").unwrap(), ["postgres://u@h/db"]);
        assert!(split("postgres://u@h1,,h2/db").is_err());
        let standby = split("postgres://u@h1,h2/db?target_session_attrs=standby").unwrap_err().to_string();
        assert!(standby.contains("needs a primary"), "{standby}");
        assert!(split("no scheme here").is_err());
    }
}
