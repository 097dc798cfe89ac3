//! Database URLs with several hosts, with libpq's meaning:
//! `postgres://user:pw@h1:5432,h2:5432/db?target_session_attrs=read-write`, the form that
//! Patroni and managed offerings document for reaching whichever node is the primary.
//!
//! The gateway connects to the first host, in the order given, that accepts a connection
//! and takes writes, and when the database fails (a refused or lost connection, a
//! read-only transaction) it looks again ([`follow_writable`]), so it follows a failover
//! by itself. It stays on its host while that takes writes, and never moves to an older
//! timeline of the cluster than one it wrote to or another host writes on: an old
//! primary restarted as it was after a failover does not take the pool back ([`choose`]). Only writable nodes are any use to it, so
//! `target_session_attrs` may be `read-write`, `primary` or `any` (all mean the same
//! here); the read-only values are refused with a clear message.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;

use super::failure::Health;
use crate::log_throttle::Throttle;

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

/// Which cluster a writable node belongs to and the timeline it writes on. A standby
/// promoted writes on a new timeline, one above its old primary's: an old primary that
/// comes back writable (restarted as it was, not rebuilt as a standby of the new one) is
/// the same cluster on a lower timeline, and what it holds has diverged from what was
/// acknowledged since the failover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lineage {
    /// `pg_control_system().system_identifier`: shared by a primary and its standbys.
    pub system: i64,
    /// The timeline of the node's current WAL (its segment name's first 8 hex digits).
    pub timeline: i64,
}

impl Lineage {
    /// Whether a node of this lineage is behind `other`: the same cluster, an older timeline.
    pub fn behind(self, other: Lineage) -> bool {
        self.system == other.system && self.timeline < other.timeline
    }
}

/// The lineage of the writable node `conn` reaches; `None` when it does not tell (a
/// function refused by a managed service): then no host is held back by it.
pub(super) async fn lineage(conn: &mut sqlx::PgConnection) -> Option<Lineage> {
    let (system, timeline): (i64, i64) = super::query_as(
        "SELECT s.system_identifier, ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint
           FROM pg_control_system() s",
    )
    .fetch_one(conn)
    .await
    .ok()?;
    Some(Lineage { system, timeline })
}

/// What a look at one host found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// It takes writes (with its lineage, when it tells it).
    Writable(Option<Lineage>),
    /// It answers and does not take writes (a standby, a read-only node).
    ReadOnly,
}

/// What the node `options` reaches is; `Err` with the reason, and whether it may pass by
/// itself, when it cannot be reached within [`PROBE_TIMEOUT`].
pub async fn probe(options: &PgConnectOptions) -> Result<Found, (String, bool)> {
    match tokio::time::timeout(PROBE_TIMEOUT, super::start::state_at(options, true)).await {
        Ok(Ok(Some(lineage))) => Ok(Found::Writable(lineage)),
        Ok(Ok(None)) => Ok(Found::ReadOnly),
        Ok(Err(e)) => Err((e.to_string(), super::start::may_pass(&e))),
        Err(_) => Err(("no answer".into(), true)),
    }
}

fn name(host: &PgConnectOptions) -> String {
    format!("{}:{}", host.get_host(), host.get_port())
}

/// The host of `hosts` to write to, with its lineage: `stay` (the host the pool is on)
/// while it qualifies, else the first that does, in order. A host qualifies when it takes
/// writes and is neither behind `last` (the lineage written to last) nor behind another
/// host that takes writes: an old primary back beside the standby promoted in its place
/// takes writes too, and only the promoted one holds what was acknowledged since. Or every
/// host's reason for not being it, and whether any of them may pass by itself (a standby
/// may be promoted; a host down may come back).
pub async fn choose(
    hosts: &[PgConnectOptions],
    last: Option<Lineage>,
    stay: Option<usize>,
) -> Result<(usize, Option<Lineage>), (Vec<String>, bool)> {
    let mut reasons = Vec::new();
    let mut may_pass = false;
    let mut writable = Vec::new();
    // All at once: a host that does not answer costs its PROBE_TIMEOUT once, not once
    // per host after it.
    let found = futures_util::future::join_all(hosts.iter().map(probe)).await;
    for ((i, host), found) in hosts.iter().enumerate().zip(found) {
        match found {
            Ok(Found::Writable(lineage)) => writable.push((i, lineage)),
            Ok(Found::ReadOnly) => {
                reasons.push(format!("{} does not take writes", name(host)));
                may_pass = true;
            }
            Err((e, passing)) => {
                reasons.push(format!("{}: {e}", name(host)));
                may_pass |= passing;
            }
        }
    }
    match pick(&writable, last, stay) {
        Ok(picked) => Ok(picked),
        Err(behind) => {
            reasons.extend(behind.into_iter().map(|(i, old, new)| {
                format!(
                    "{} takes writes on timeline {old}, behind timeline {new} of the same cluster (an old primary \
                     back without being rebuilt as a standby? fence it: what it holds has diverged)",
                    name(&hosts[i])
                )
            }));
            Err((reasons, may_pass))
        }
    }
}

/// A host that takes writes, held back: its index, its timeline and the newer one it is
/// behind.
type HeldBack = (usize, i64, i64);

/// [`choose`]'s rule over the hosts found writable (index, lineage if told): `stay` if it
/// qualifies, else the first that does; or the hosts held back, with their timeline and
/// the newer one they are behind.
fn pick(
    writable: &[(usize, Option<Lineage>)],
    last: Option<Lineage>,
    stay: Option<usize>,
) -> Result<(usize, Option<Lineage>), Vec<HeldBack>> {
    let known: Vec<Lineage> = writable.iter().filter_map(|(_, l)| *l).chain(last).collect();
    let newer = |lineage: Option<Lineage>| lineage.and_then(|l| known.iter().find(|n| l.behind(**n)).map(|n| (l, *n)));
    let qualifying = || writable.iter().filter(|(_, l)| newer(*l).is_none());
    if let Some(stayed) = qualifying().find(|(i, _)| Some(*i) == stay) {
        return Ok(*stayed);
    }
    if let Some(first) = qualifying().next() {
        return Ok(*first);
    }
    Err(writable.iter().filter_map(|(i, l)| newer(*l).map(|(old, new)| (*i, old.timeline, new.timeline))).collect())
}

/// How often the host the pool is on is looked at without a failure to prompt it: a
/// node demoted quietly (a switchover) is left within this.
const RECHECK: Duration = Duration::from_secs(5);

/// How often every host is looked at without a failure to prompt it: an old primary still
/// taking writes after its standby was promoted is left within this.
const LOOK_AT_ALL_EVERY: Duration = Duration::from_secs(30);

/// For a pool over several hosts: whenever the pool's health reports a failure, and every
/// [`LOOK_AT_ALL_EVERY`] (every [`RECHECK`], the host the pool is on alone, and all of them
/// if it does not take writes), look at the hosts and [`choose`] one: the host the pool is on while it
/// takes writes and no other host writes on a newer timeline of its cluster; otherwise
/// the first that qualifies, and the pool moves there (its older connections are
/// discarded). While none does, look again every [`PROBE_INTERVAL`]. Staying put is what
/// keeps an old primary that comes back writable after a failover (the first host of the
/// list, restarted as it was) from taking the pool back from the promoted standby, which
/// alone holds the webhooks acknowledged since; the timelines are what move the pool off
/// an old primary still taking writes after its standby was promoted. Ends when the pool
/// is closed.
pub async fn follow_writable(
    pool: sqlx::PgPool,
    health: Arc<Health>,
    hosts: Vec<PgConnectOptions>,
    mut current: usize,
) {
    static NONE_WRITABLE: Throttle = Throttle::new(crate::log_throttle::INTERVAL);
    let mut last = match probe(&hosts[current]).await {
        Ok(Found::Writable(lineage)) => lineage,
        _ => None,
    };
    let mut looked_at_all = tokio::time::Instant::now();
    loop {
        let prompted = tokio::select! {
            () = health.trouble() => true,
            () = tokio::time::sleep(RECHECK) => false,
        };
        if pool.is_closed() {
            return;
        }
        // Unprompted, the host the pool is on is enough, and all of them once in a while
        // (each look at a host is a login: every host of every replica every 5 s added up).
        if !prompted
            && looked_at_all.elapsed() < LOOK_AT_ALL_EVERY
            && let Ok(Found::Writable(lineage)) = probe(&hosts[current]).await
        {
            last = lineage.or(last);
            continue;
        }
        looked_at_all = tokio::time::Instant::now();
        loop {
            match choose(&hosts, last, Some(current)).await {
                Ok((found, lineage)) => {
                    if found != current {
                        tracing::warn!(
                            from = %name(&hosts[current]),
                            to = %name(&hosts[found]),
                            "database: the host the pool was on stopped taking writes or fell behind a newer \
                             timeline; the pool follows another"
                        );
                        pool.set_connect_options(hosts[found].clone());
                        health.mark_all_stale();
                        current = found;
                    }
                    last = lineage.or(last);
                    break;
                }
                Err((reasons, _)) => {
                    if let Some(left_out) = NONE_WRITABLE.admit() {
                        tracing::warn!(hosts = %reasons.join("; "), left_out,
                            "database: no host takes writes; looking again every 0.5 s");
                    }
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
    fn the_pool_stays_on_its_host_and_never_follows_an_older_timeline() {
        let on = |timeline| Some(Lineage { system: 7, timeline });
        let other_cluster = Some(Lineage { system: 8, timeline: 1 });
        // Staying put while the host takes writes, whatever comes first in the list.
        assert_eq!(pick(&[(0, on(2)), (1, on(2))], on(2), Some(1)), Ok((1, on(2))));
        // The old primary back (timeline 1) beside the promoted standby (2): the standby,
        // at a start (nothing written yet) and after it.
        assert_eq!(pick(&[(0, on(1)), (1, on(2))], None, None), Ok((1, on(2))));
        assert_eq!(pick(&[(0, on(1)), (1, on(2))], on(1), Some(0)), Ok((1, on(2))), "off the old timeline");
        // Only the old primary takes writes, the promoted standby being down: held back
        // with its timeline and the newer one written to last.
        assert_eq!(pick(&[(0, on(1))], on(2), Some(1)), Err(vec![(0, 1, 2)]));
        // Another cluster (restored from a dump) and hosts that do not tell are not held back.
        assert_eq!(pick(&[(0, other_cluster)], on(2), None), Ok((0, other_cluster)));
        assert_eq!(pick(&[(0, None), (1, on(2))], on(2), Some(0)), Ok((0, None)));
        assert_eq!(pick(&[], on(2), Some(0)), Err(vec![]));
    }

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
