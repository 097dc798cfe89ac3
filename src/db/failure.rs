//! What a failed database call means: "unavailable, retry" (and what it may have
//! committed) or a bug, and what it says about the node behind the pool.
//!
//! Production PostgreSQL refuses writes in many ways that are not the gateway's fault and
//! that pass by themselves: a standby or a demoted primary (read-only transactions), a
//! server starting up, shutting down or in recovery, too many connections, a full disk,
//! out of memory, an administrator ending sessions, a pooler restarting. Every one of them
//! is [`Unavailable`] (ingest answers 503 with `Retry-After`, the workers back off),
//! never a 500. [`unavailable`] is the one place that decides, by SQLSTATE class.
//!
//! Some refusals also say that the connections a pool holds lead to a node that cannot
//! take writes, or is going away: a read-only transaction, a server ending its sessions, a
//! connection reset. A pool's [`Health`] notes them (the pool's own statements, ingest's
//! writes, the claim and the outcome recorder report there): every connection opened
//! before that moment is then discarded when it is next taken from the pool (see
//! [`crate::db::Pool`]), rather than failing one request each, so a pool full of
//! connections to a demoted node heals by itself. Server refusals are also remembered for
//! [`Health::refusing_writes`], which `/readyz` reports, so a load balancer stops sending
//! while the database cannot take writes (a full disk does not show in a read).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What a call that failed because the database was not reachable, or refused to work,
/// can have left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unavailable {
    /// Nothing of it was committed: no connection could be had (pool timeout, connect
    /// refused, server not accepting connections), or the server refused or cancelled the
    /// statement, which rolls its transaction back.
    NotCommitted,
    /// The connection failed, or went silent, after the statement may have reached the
    /// server: it may have been committed. A retry must be idempotent.
    Unconfirmed,
}

/// Why the database refused: the kinds `/readyz` and the log name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A read-only transaction: a standby, a demoted primary, `default_transaction_read_only`.
    ReadOnly,
    /// The server is starting up, shutting down, in recovery, or ended the session.
    NodeGoingAway,
    /// Out of a resource: connections, disk, memory, a configured limit; or a system error.
    Resources,
}

/// How long a refusal keeps `/readyz` answering 503 after the last one was seen. Short:
/// a balancer that stops sending stops the writes that would show the refusal is over,
/// so readiness comes back by itself after this and is lost again at the next refusal.
pub const REFUSAL_MEMORY: Duration = Duration::from_secs(5);

/// What failed calls have told a pool about its database.
pub struct Health {
    origin: Instant,
    /// Connections opened before this instant (ms since `origin`, plus one so that 0
    /// means never) lead to a node that refused writes or was going away.
    stale_before_ms: AtomicU64,
    /// Last refusal (ms since `origin`, plus one; 0: none) and its kind.
    refused_at_ms: AtomicU64,
    refusal: AtomicU64,
    /// Signalled by every failure classified unavailable (a pool over several hosts then
    /// looks for the one that takes writes).
    failures: tokio::sync::Notify,
    /// New connections one at a time while opening one stalls.
    pub(super) gate: super::connect_gate::ConnectGate,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            origin: Instant::now(),
            stale_before_ms: AtomicU64::new(0),
            refused_at_ms: AtomicU64::new(0),
            refusal: AtomicU64::new(0),
            failures: tokio::sync::Notify::new(),
            gate: super::connect_gate::ConnectGate::default(),
        }
    }
}

impl Health {
    /// Milliseconds since this pool's health began, plus one (0 is "never").
    pub(super) fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64 + 1
    }

    /// Whether a connection `age` old was opened before the last refusal that made the
    /// pool's connections suspect.
    pub fn is_stale(&self, age: Duration) -> bool {
        let stale_before = self.stale_before_ms.load(Ordering::Relaxed);
        if stale_before == 0 {
            return false;
        }
        let opened = self.now_ms().saturating_sub(age.as_millis() as u64);
        opened < stale_before
    }

    /// Where the stale mark stands (it only moves forward): a connection taken when it
    /// stood elsewhere may be stale ([`super::warm`]).
    pub fn stale_mark(&self) -> u64 {
        self.stale_before_ms.load(Ordering::Relaxed)
    }

    /// The refusal seen within [`REFUSAL_MEMORY`], if any.
    pub fn refusing_writes(&self) -> Option<Refusal> {
        let at = self.refused_at_ms.load(Ordering::Relaxed);
        if at == 0 || self.now_ms().saturating_sub(at) > REFUSAL_MEMORY.as_millis() as u64 {
            return None;
        }
        match self.refusal.load(Ordering::Relaxed) {
            0 => Some(Refusal::ReadOnly),
            1 => Some(Refusal::NodeGoingAway),
            _ => Some(Refusal::Resources),
        }
    }

    /// Classify `err` (see [`unavailable`]) and note what it says about the node.
    pub fn note(&self, err: &sqlx::Error) -> Option<Unavailable> {
        super::kept_plans::note(err);
        let (committed, refusal) = classify(err)?;
        if !is_held_back(err) {
            self.failures.notify_one();
        }
        if let Some(refusal) = refusal {
            // A connection reset is not the server refusing: only the stale mark.
            let refused = matches!(err, sqlx::Error::Database(_));
            if refused {
                self.note_refusal(refusal);
            } else {
                self.mark_stale(refusal);
            }
        }
        Some(committed)
    }

    /// Note that the server refused work (a read-only or departing node also marks the
    /// older connections stale).
    pub fn note_refusal(&self, refusal: Refusal) {
        let now = self.now_ms();
        self.refusal.store(refusal as u64, Ordering::Relaxed);
        self.refused_at_ms.store(now, Ordering::Relaxed);
        self.mark_stale(refusal);
    }

    /// Wait for the next failure classified unavailable.
    pub async fn trouble(&self) {
        self.failures.notified().await;
    }

    /// Every connection opened until now is to be discarded (the pool moved to another
    /// host).
    pub fn mark_all_stale(&self) {
        self.stale_before_ms.fetch_max(self.now_ms(), Ordering::Relaxed);
    }

    fn mark_stale(&self, refusal: Refusal) {
        let now = self.now_ms();
        if matches!(refusal, Refusal::ReadOnly | Refusal::NodeGoingAway) {
            self.stale_before_ms.fetch_max(now, Ordering::Relaxed);
        }
    }
}

/// An error this module made to say what a call can have committed, where the error
/// the call met would say otherwise ([`no_answer`], [`connect_failed`], [`after_commit`]);
/// [`classify`] reads its class from it.
#[derive(Debug)]
struct Marked {
    why: Mark,
    /// The call, or the error it met.
    what: String,
}

#[derive(Debug, Clone, Copy)]
enum Mark {
    /// Abandoned at its caller's deadline: a slow server, not a refusal.
    NoAnswer,
    /// No connection could be opened for it: nothing was sent.
    NotConnected,
    /// Not let open a connection while opening one stalls (`db::connect_gate`): nothing
    /// was sent, and nothing new was learned of the database.
    HeldBack,
    /// Failed after an earlier transaction of the same work committed.
    AfterCommit,
}

impl Marked {
    fn error(kind: std::io::ErrorKind, why: Mark, what: String) -> sqlx::Error {
        sqlx::Error::Io(std::io::Error::new(kind, Marked { why, what }))
    }

    fn class(&self) -> (Unavailable, Option<Refusal>) {
        match self.why {
            Mark::NotConnected | Mark::HeldBack => (Unavailable::NotCommitted, None),
            Mark::NoAnswer | Mark::AfterCommit => (Unavailable::Unconfirmed, None),
        }
    }
}

impl std::fmt::Display for Marked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = &self.what;
        match self.why {
            Mark::NoAnswer => write!(f, "{what}: no answer from the database"),
            Mark::NotConnected | Mark::HeldBack => write!(f, "no connection to the database could be opened: {what}"),
            Mark::AfterCommit => write!(f, "failed after part of the work was committed: {what}"),
        }
    }
}

impl std::error::Error for Marked {}

/// The error of a call abandoned by its caller's timeout: classified
/// [`Unavailable::Unconfirmed`], since the statement may have reached the server, and
/// nothing more (a slow server, not one going away). The kernel's own "timed out" (a
/// connection ended by `TCP_USER_TIMEOUT` or keepalive, `db::tcp`) is not this: it says
/// the path to the node is dead, so the pool's other connections to it are suspect too.
pub fn no_answer(what: &str) -> sqlx::Error {
    Marked::error(std::io::ErrorKind::TimedOut, Mark::NoAnswer, what.to_owned())
}

/// `err`, raised while a call's connection was being opened, marked as such when it would
/// otherwise read as a call cut short (a socket error; a class `08` error, such as
/// PgBouncer's "no more connections allowed" or "cannot connect to server"): classified
/// [`Unavailable::NotCommitted`] (nothing was sent, so ingest answers that nothing was
/// stored) and not as a node going away, so the pool's working connections are kept
/// (before, every refused connect, a pooler at its `max_client_conn` during a deploy's
/// surge, closed all of them). The server's own refusals keep their SQLSTATE.
pub fn connect_failed(err: sqlx::Error) -> sqlx::Error {
    let cut_short = match &err {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| c.starts_with("08")),
        _ => false,
    };
    if !cut_short {
        return err;
    }
    Marked::error(std::io::ErrorKind::NotConnected, Mark::NotConnected, err.to_string())
}

/// The error of a call that got no connection: nothing was sent,
/// [`Unavailable::NotCommitted`].
pub fn not_connected(what: &str) -> sqlx::Error {
    Marked::error(std::io::ErrorKind::NotConnected, Mark::NotConnected, what.to_owned())
}

/// The error of a call not let open a connection while opening one stalls
/// (`db::connect_gate`): as [`not_connected`], and it does not prompt a pool over several
/// hosts to look at them again (each look logs in to every host; at a paused pooler, each
/// login keeps a slot).
pub fn held_back(what: &str) -> sqlx::Error {
    Marked::error(std::io::ErrorKind::NotConnected, Mark::HeldBack, what.to_owned())
}

fn is_held_back(err: &sqlx::Error) -> bool {
    marked(err).is_some_and(|m| matches!(m.why, Mark::HeldBack))
}

/// The mark this module put on `err`, if it did.
fn marked(err: &sqlx::Error) -> Option<&Marked> {
    match err {
        sqlx::Error::Io(e) => e.get_ref().and_then(|inner| inner.downcast_ref::<Marked>()),
        _ => None,
    }
}

/// `err`, from a call that follows a committed transaction of the same work (a batch's
/// webhook settled on its own after the batch's statement committed), so that the work
/// reads as [`Unavailable::Unconfirmed`] whatever the call's own error says: "nothing was
/// stored" would be wrong for the rest of the batch. An error that is not "unavailable"
/// (a bug) is left as it is.
pub fn after_commit(err: sqlx::Error) -> sqlx::Error {
    if classify(&err).is_none() {
        return err;
    }
    Marked::error(std::io::ErrorKind::Other, Mark::AfterCommit, err.to_string())
}

/// The classification, without the side effect of [`unavailable`].
pub fn classify(err: &sqlx::Error) -> Option<(Unavailable, Option<Refusal>)> {
    use Unavailable::{NotCommitted, Unconfirmed};
    match err {
        // Marked by this module: its deadline, a connection not opened, a failure after
        // an earlier commit of the same work.
        sqlx::Error::Io(_) if let Some(marked) = marked(err) => Some(marked.class()),
        // Raised before a statement is sent: by the pool, or while opening a connection.
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Tls(_) => Some((NotCommitted, None)),
        // A socket error can end a statement whose commit the server already made; the
        // server (or the pooler in front of it) went away: its other sessions are gone too.
        sqlx::Error::Io(_) => Some((Unconfirmed, Some(Refusal::NodeGoingAway))),
        // A kept statement's function gone under a running process (an operator dropped
        // it, `db::kept_plans`): rolled back, and the retry sends the statement itself.
        sqlx::Error::Database(_) if super::kept_plans::wrapper_failed(err) => Some((NotCommitted, None)),
        sqlx::Error::Database(db) => classify_database(&db.code()?, db.message()),
        _ => None,
    }
}

/// [`classify`] for an error the server (or a pooler) sent: its SQLSTATE, and for
/// PgBouncer, whose own errors all carry `08P01`, its message.
fn classify_database(code: &str, message: &str) -> Option<(Unavailable, Option<Refusal>)> {
    // A pooler switched to statement mode while running refuses every transaction's
    // `BEGIN`: nothing was sent to a server, so nothing can have committed (read as a
    // connection lost mid-statement, it answered "may have been stored").
    if code == "08P01" && message.contains("statement pooling mode") {
        return Some((Unavailable::NotCommitted, Some(Refusal::Resources)));
    }
    classify_sqlstate(code)
}

/// [`classify`] for a SQLSTATE code.
pub fn classify_sqlstate(code: &str) -> Option<(Unavailable, Option<Refusal>)> {
    use Unavailable::{NotCommitted, Unconfirmed};
    Some(match code {
        // read_only_sql_transaction: a standby, a demoted primary, default_transaction_read_only.
        "25006" => (NotCommitted, Some(Refusal::ReadOnly)),
        // cannot_connect_now: starting up, shutting down, in recovery.
        "57P03" => (NotCommitted, Some(Refusal::NodeGoingAway)),
        // admin_shutdown, crash_shutdown, database_dropped: the session ends, possibly after
        // a local commit (a wait for a synchronous standby cut short).
        "57P01" | "57P02" | "57P04" => (Unconfirmed, Some(Refusal::NodeGoingAway)),
        // idle_session_timeout and idle_in_transaction_session_timeout end the session.
        "57P05" | "25P03" => (Unconfirmed, None),
        // query_canceled (statement_timeout, a cancel request): rolled back.
        "57014" => (NotCommitted, None),
        // serialization_failure, deadlock_detected: rolled back; retried where it is
        // cheap to, and otherwise the caller's retry resolves it.
        "40001" | "40P01" => (NotCommitted, None),
        // statement_completion_unknown.
        "40003" => (Unconfirmed, None),
        // lock_not_available (lock_timeout): rolled back.
        "55P03" => (NotCommitted, None),
        // Refused before a session existed: connection rejected.
        "08001" | "08004" => (NotCommitted, Some(Refusal::NodeGoingAway)),
        // Class 08, connection exceptions (08006 failure, 08003 does not exist, 08007
        // transaction resolution unknown, PgBouncer's own 08P01 errors): the commit may
        // have happened.
        c if c.starts_with("08") => (Unconfirmed, Some(Refusal::NodeGoingAway)),
        // Class 53, insufficient resources (53100 disk full, 53200 out of memory, 53300
        // too many connections, 53400 configuration limit exceeded), and class 58, system
        // errors (58030 I/O error): the statement failed and its transaction rolled back.
        c if c.starts_with("53") || c.starts_with("58") => (NotCommitted, Some(Refusal::Resources)),
        _ => return None,
    })
}

/// Whether an error means "the database is not available for this work right now"
/// (answer 503 and let the producer retry; back off in the workers) rather than a bug or
/// a constraint (answer 500), and if so, what the failed call can have committed.
/// ([`Health::note`] also tells the pool.)
pub fn unavailable(err: &sqlx::Error) -> Option<Unavailable> {
    classify(err).map(|(committed, _)| committed)
}

/// Whether an error means the database is not available right now (see [`unavailable`]).
pub fn is_unavailable(err: &sqlx::Error) -> bool {
    unavailable(err).is_some()
}

/// Whether an error is a serialization failure or a deadlock, which the same transaction
/// tried again resolves.
pub fn is_conflict(err: &sqlx::Error) -> bool {
    matches!(err, sqlx::Error::Database(e) if e.code().is_some_and(|c| c == "40001" || c == "40P01"))
}

/// Run `attempt` again (up to [`CONFLICT_TRIES`] times in all) while it fails with a
/// serialization failure or a deadlock: its transaction was rolled back, and running it
/// again resolves the conflict. Only for work that is one transaction, safe to repeat.
pub async fn retry_conflicts<T, F>(mut attempt: impl FnMut() -> F) -> Result<T, sqlx::Error>
where
    F: Future<Output = Result<T, sqlx::Error>>,
{
    let mut tries = 1;
    loop {
        match attempt().await {
            Err(e) if is_conflict(&e) && tries < CONFLICT_TRIES => {
                tracing::debug!(error = %e, tries, "conflict; trying the transaction again");
                tries += 1;
                // A short random pause so two conflicting transactions do not meet again.
                let pause = rand::random_range(1..=10u64 * tries as u64);
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            result => return result,
        }
    }
}

/// Tries of [`retry_conflicts`].
pub const CONFLICT_TRIES: u32 = 3;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_failure_can_have_committed() {
        assert_eq!(classify(&sqlx::Error::PoolTimedOut), Some((Unavailable::NotCommitted, None)));
        assert_eq!(classify(&sqlx::Error::PoolClosed), Some((Unavailable::NotCommitted, None)));
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(classify(&sqlx::Error::Io(reset)), Some((Unavailable::Unconfirmed, Some(Refusal::NodeGoingAway))));
        assert_eq!(classify(&no_answer("a test")), Some((Unavailable::Unconfirmed, None)));
        assert!(no_answer("a test").to_string().contains("a test: no answer from the database"));
        // The kernel's timeout (TCP_USER_TIMEOUT, keepalive) ended the connection: the
        // path to the node is dead, and the pool's other connections to it with it.
        let dead_path = sqlx::Error::Io(std::io::Error::from_raw_os_error(libc::ETIMEDOUT));
        assert_eq!(classify(&dead_path), Some((Unavailable::Unconfirmed, Some(Refusal::NodeGoingAway))));
        assert_eq!(classify(&sqlx::Error::RowNotFound), None);
        assert_eq!(classify(&sqlx::Error::Protocol("bug".into())), None);
    }

    #[test]
    fn a_pooler_in_statement_mode_refused_the_transaction_before_anything_was_sent() {
        assert_eq!(
            classify_database("08P01", "transaction blocks not allowed in statement pooling mode"),
            Some((Unavailable::NotCommitted, Some(Refusal::Resources)))
        );
        assert_eq!(
            classify_database("08P01", "server conn crashed?"),
            Some((Unavailable::Unconfirmed, Some(Refusal::NodeGoingAway))),
            "PgBouncer's other errors may follow a commit"
        );
    }

    #[test]
    fn a_connection_that_could_not_be_opened_sent_nothing_and_says_nothing_of_the_others() {
        let health = Health { origin: Instant::now() - Duration::from_secs(100), ..Health::default() };
        for kind in [std::io::ErrorKind::ConnectionRefused, std::io::ErrorKind::TimedOut, std::io::ErrorKind::Other] {
            let err = connect_failed(sqlx::Error::Io(std::io::Error::new(kind, "connect")));
            assert_eq!(classify(&err), Some((Unavailable::NotCommitted, None)), "{kind:?}");
            assert!(err.to_string().contains("no connection to the database could be opened"), "{err}");
            std::thread::sleep(Duration::from_millis(2));
            assert_eq!(health.note(&err), Some(Unavailable::NotCommitted));
            assert!(!health.is_stale(Duration::from_secs(10)), "the pool's open connections are kept");
        }
        // What is not a connection's failure passes as it is.
        assert_eq!(classify(&connect_failed(sqlx::Error::PoolTimedOut)), Some((Unavailable::NotCommitted, None)));
        assert!(matches!(connect_failed(sqlx::Error::RowNotFound), sqlx::Error::RowNotFound));
        // The same socket error on a call in flight still reads as cut short.
        let reset = sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset"));
        assert_eq!(classify(&reset), Some((Unavailable::Unconfirmed, Some(Refusal::NodeGoingAway))));
    }

    #[test]
    fn a_failure_after_part_of_the_work_committed_is_unconfirmed_and_a_bug_stays_a_bug() {
        let err = after_commit(sqlx::Error::PoolTimedOut);
        assert_eq!(classify(&err), Some((Unavailable::Unconfirmed, None)), "{err}");
        assert!(err.to_string().contains("after part of the work was committed"), "{err}");
        assert!(matches!(after_commit(sqlx::Error::RowNotFound), sqlx::Error::RowNotFound));
    }

    #[test]
    fn every_refusal_class_is_unavailable_and_bugs_are_not() {
        use Unavailable::{NotCommitted, Unconfirmed};
        let cases = [
            ("25006", Some((NotCommitted, Some(Refusal::ReadOnly)))),
            ("57P03", Some((NotCommitted, Some(Refusal::NodeGoingAway)))),
            ("57P01", Some((Unconfirmed, Some(Refusal::NodeGoingAway)))),
            ("57P02", Some((Unconfirmed, Some(Refusal::NodeGoingAway)))),
            ("53100", Some((NotCommitted, Some(Refusal::Resources)))),
            ("53200", Some((NotCommitted, Some(Refusal::Resources)))),
            ("53300", Some((NotCommitted, Some(Refusal::Resources)))),
            ("53400", Some((NotCommitted, Some(Refusal::Resources)))),
            ("58030", Some((NotCommitted, Some(Refusal::Resources)))),
            ("40001", Some((NotCommitted, None))),
            ("40P01", Some((NotCommitted, None))),
            ("57014", Some((NotCommitted, None))),
            ("55P03", Some((NotCommitted, None))),
            ("08006", Some((Unconfirmed, Some(Refusal::NodeGoingAway)))),
            ("08P01", Some((Unconfirmed, Some(Refusal::NodeGoingAway)))),
            ("08001", Some((NotCommitted, Some(Refusal::NodeGoingAway)))),
            ("40003", Some((Unconfirmed, None))),
            // Bugs and bad data stay errors (500), never "retry".
            ("23505", None),
            ("42601", None),
            ("22P02", None),
            ("42P01", None),
            ("XX000", None),
        ];
        for (code, expected) in cases {
            assert_eq!(classify_sqlstate(code), expected, "SQLSTATE {code}");
        }
    }

    #[test]
    fn a_refusal_marks_older_connections_stale_and_is_forgotten_after_a_while() {
        let health = Health { origin: Instant::now() - Duration::from_secs(100), ..Health::default() };
        assert!(!health.is_stale(Duration::from_secs(50)));
        assert_eq!(health.refusing_writes(), None);
        health.note_refusal(Refusal::Resources);
        assert!(!health.is_stale(Duration::from_secs(50)), "a full disk is not the connections' fault");
        assert_eq!(health.refusing_writes(), Some(Refusal::Resources));
        health.note_refusal(Refusal::ReadOnly);
        assert!(health.is_stale(Duration::from_secs(50)), "opened before the refusal");
        assert!(!health.is_stale(Duration::ZERO), "opened after it");
        assert_eq!(health.refusing_writes(), Some(Refusal::ReadOnly));
        health.refused_at_ms.store(1, Ordering::Relaxed);
        assert_eq!(health.refusing_writes(), None, "forgotten after REFUSAL_MEMORY");
        let reset = sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset"));
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(health.note(&reset), Some(Unavailable::Unconfirmed));
        assert!(health.is_stale(Duration::from_secs(10)), "a reset marks the older connections");
        assert_eq!(health.refusing_writes(), None, "a reset is not a refusal to write");
    }
}
