//! Writes attempt outcomes in batches: whatever finished while the previous write was in
//! flight goes into the next statement, so the commit rate stays far below the delivery
//! rate under load. A small batch waits up to [`LINGER`] for company: at low load each
//! write is a transaction of a few statements and a commit for one or two outcomes, and
//! PostgreSQL's cost per webhook was dominated by such fixed costs. Nobody waits for a
//! linger but the dispatcher, so it ends as soon as anything does: an ordered delivery's
//! outcome is written at once (its line waits for it), and so is every batch while the
//! dispatcher waits for a worker slot or for room at an endpoint ([`Waiting`]), which
//! only a write frees.
//!
//! **A bad row fails alone.** One statement records the whole batch; if it fails for any
//! reason other than the database being unreachable, every outcome is written again on
//! its own, so one row PostgreSQL refuses cannot drop another endpoint's outcome (which
//! would make the lease send that delivery again). A row that still cannot be written is
//! recorded without anything that came from outside (status and error kind only); if
//! even that fails, its delivery is dead-lettered with the reason, so it is neither lost
//! silently nor sent again forever. Only an unreachable database leaves outcomes
//! unrecorded: their leases bring the deliveries back, as after a crash.
//!
//! Recording is idempotent per (delivery, attempt) ([`queue::record`]), so a batch retried
//! after an ambiguous commit is neither written twice nor mistaken for fenced.
//!
//! **The one writer of a claim's end.** A claim that ends without sending anything (its
//! endpoint's secret cannot be read here, or its attempt budget was spent by workers that
//! died) is handed over too ([`Done::Unsent`]) and given back or dead-lettered here, fenced
//! and retried while the database is away like any outcome.
//!
//! **Lines move on in the write.** A batch that finishes ordered heads makes their lines'
//! next deliveries the heads, and while the dispatcher owes no general claim it leases
//! them in the same `UPDATE` where their endpoints have room
//! ([`queue::lines::promote_leasing`]), with the worker slots of the heads it finished:
//! the leases go straight to the dispatcher ([`Written::leases`]); the other new heads go
//! by id to its claim by key.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use crate::db::Pool;
use chrono::{DateTime, Utc};
use tokio::sync::{Notify, OwnedSemaphorePermit, mpsc};
use tracing::Instrument as _;

use super::prelease::Prelease;
use crate::circuit::{self, CircuitConfig, Observation, Signal};
use crate::ids::{DeliveryId, EndpointId};
use crate::queue::{self, AttemptRecord, Burial, ClaimTerms, Claimed, Recorded};
use crate::sanitize;

mod gather;
mod retry;

use gather::gather;
pub use gather::{Ended, LINGER, MAX_BATCH, SMALL_BATCH, Waiting};
pub use retry::{Patience, STOP_BOUND};
use retry::{retrying, transient};

/// A finished attempt: the outcome to record, and what it tells the endpoint's circuit.
#[derive(Debug, Clone)]
pub struct Finished {
    /// The outcome, as the queue records it.
    pub record: AttemptRecord,
    /// What the attempt says about the endpoint's health.
    pub signal: Signal,
    /// The probe token, when the attempt was its endpoint's half-open probe.
    pub probe_token: Option<i64>,
    /// The attempt's span (none when tracing is off), kept open until the outcome is
    /// written: the record span links to it.
    pub span: tracing::Span,
}

/// What a worker hands the recorder, with its slot, when it is done with a claim.
#[derive(Debug)]
pub enum Done {
    /// An attempt was sent: its outcome.
    Attempted(Finished),
    /// Nothing was sent under the claim.
    Unsent(Unsent),
}

impl Done {
    /// Written at once rather than lingering for company: an ordered delivery's line
    /// waits for it; a claim that sent nothing is rare.
    fn urgent(&self) -> bool {
        match self {
            Done::Attempted(f) => f.record.ordered,
            Done::Unsent(_) => true,
        }
    }
}

/// A claim that ends without sending anything, so without spending its attempt.
#[derive(Debug, Clone)]
pub struct Unsent {
    /// The claimed delivery.
    pub delivery_id: DeliveryId,
    /// Its claim's fencing token.
    pub claim_token: i64,
    /// How the claim ends.
    pub end: UnsentEnd,
}

/// How a claim that sent nothing ends.
#[derive(Debug, Clone)]
pub enum UnsentEnd {
    /// Due again at `due` (the endpoint's signing secret cannot be read here now).
    GiveBack {
        /// When it is due again.
        due: DateTime<Utc>,
    },
    /// Dead-lettered with `reason` (every budgeted attempt was claimed, and the last one's
    /// worker died holding the lease).
    Bury {
        /// Why, for operators.
        reason: String,
    },
}

impl std::borrow::Borrow<AttemptRecord> for Finished {
    fn borrow(&self) -> &AttemptRecord {
        &self.record
    }
}

/// Drain `rx` until every sender is gone, recording each batch (and its effect on the
/// endpoints' circuits, in the same transaction).
///
/// Each outcome arrives with its worker slot, which is released only once the outcome is
/// written: at most `workers` attempts are ever unrecorded, so a circuit that opens sees
/// at most that many requests it did not know about. After each write `written` is
/// notified: the claim loop looks again (slots and endpoint room were freed, ordered
/// deliveries may have become their lines' heads).
pub async fn run(
    pool: Pool,
    mut rx: mpsc::Receiver<(Done, OwnedSemaphorePermit)>,
    cfg: CircuitConfig,
    patience: Patience,
    written: Written,
    waiting: Arc<Waiting>,
) {
    let mut arrived = Vec::with_capacity(MAX_BATCH);
    while let Some(first) = rx.recv().await {
        let ended = gather(&mut rx, first, &mut arrived, |(done, _)| done.urgent(), &waiting).await;
        let began = std::time::Instant::now();
        // The slots are released only after the write (see above), but for those of the
        // ordered heads it finishes, which may go to the next heads it leases.
        let (mut batch, mut unsent) = (Vec::with_capacity(arrived.len()), Vec::new());
        let (mut held_slots, mut head_slots) = (Vec::with_capacity(arrived.len()), Vec::new());
        for (d, slot) in arrived.drain(..) {
            match d {
                Done::Attempted(f) => {
                    if f.record.ordered && f.record.outcome != queue::Outcome::Retry {
                        head_slots.push(slot);
                    } else {
                        held_slots.push(slot);
                    }
                    batch.push(f);
                }
                Done::Unsent(u) => {
                    unsent.push(u);
                    held_slots.push(slot);
                }
            }
        }
        let mut promoted = Promoted::Known(Vec::new());
        if !batch.is_empty() {
            let span = crate::telemetry::record_span(batch.iter().map(|f: &Finished| &f.span), batch.len());
            // Only while the dispatcher owes no general claim: older due work goes first.
            let leaser = written.leases.as_ref().filter(|p| !head_slots.is_empty() && p.leases_ahead());
            let terms = leaser.map(|p| p.terms(&head_slots));
            let started = std::time::SystemTime::now();
            let leased;
            (promoted, leased) = write_leasing(&pool, &batch, &cfg, &patience, terms).instrument(span).await;
            if let Some(leaser) = leaser {
                leaser.hand_over(&pool, leased, std::mem::take(&mut head_slots), started, "promotion");
            }
        }
        for u in &unsent {
            end_unsent(&pool, u, &patience).await;
        }
        crate::metrics::outcome_write(ended.as_str(), began.elapsed());
        match promoted {
            // A claim given back is due again (and one buried may have moved its line
            // on); the heads an unsure write made are unknown: look at all due work.
            _ if !unsent.is_empty() => written.due.notify_one(),
            Promoted::Unknown => written.due.notify_one(),
            // The next deliveries of their lines, claimable now: claimed by key.
            Promoted::Known(heads) if !heads.is_empty() => written.heads.push(&heads),
            Promoted::Known(_) => written.room.notify_one(),
        }
    }
}

/// Whom the recorder tells after each write.
pub struct Written {
    /// Told when the write may have made deliveries due that it cannot name (a claim
    /// given back, a write that was not one clean batch).
    pub due: Arc<Notify>,
    /// Given the deliveries the write made their lines' heads, which the dispatcher then
    /// claims by key (the general claim is planned at every call: bench/PROFILE.md).
    pub heads: Arc<crate::wake::Handoff>,
    /// Told otherwise: slots and endpoint room were freed.
    pub room: Arc<Notify>,
    /// The dispatcher's hand-off of leased work, when the write may lease the next heads
    /// of the lines it moves on itself ([`write_leasing`]) with the slots of the heads it
    /// finishes; `None`: it never does, and hands every new head over by id.
    pub leases: Option<Arc<Prelease>>,
}

/// The deliveries a write made their lines' heads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Promoted {
    /// These (none when no ordered outcome finished a head).
    Known(Vec<DeliveryId>),
    /// Not known: the batch was written row by row, salvaged, or not written at all.
    Unknown,
}

impl Promoted {
    /// What two writes made heads, together.
    fn and(self, other: Promoted) -> Promoted {
        match (self, other) {
            (Promoted::Known(mut a), Promoted::Known(b)) => {
                a.extend(b);
                Promoted::Known(a)
            }
            _ => Promoted::Unknown,
        }
    }
}

/// Record `batch` (fenced, idempotent, with the circuits' observations) so that every
/// outcome ends written, written without its details, dead-lettered with a reason, or,
/// only while the database is unreachable (or a queue invariant is found broken), left to
/// its lease; returns the deliveries the write made their lines' heads, when it knows
/// them. Public so tests can drive it with batches they build.
pub async fn write(pool: &Pool, batch: &[Finished], cfg: &CircuitConfig, patience: &Patience) -> Promoted {
    write_leasing(pool, batch, cfg, patience, None).await.0
}

/// [`write`], and with `lease`, the write also leases the next heads of the lines it
/// moves on where their endpoints have room (`queue::lines::promote_leasing`: one row
/// version a line step instead of the promotion's and then a claim's): returned beside
/// the heads it made and did not lease. Only a batch written whole leases; the caller
/// holds a worker slot for each of `lease.limit`, and hands each lease to a worker or
/// gives it back. A lease whose commit went unconfirmed (the write is then tried again,
/// and finds its outcomes already on record) is not returned: it ends by itself, and
/// its delivery is claimed again.
pub async fn write_leasing(
    pool: &Pool,
    batch: &[Finished],
    cfg: &CircuitConfig,
    patience: &Patience,
    lease: Option<ClaimTerms>,
) -> (Promoted, Vec<Claimed>) {
    if let Some((newest, superseded)) = split_superseded(batch) {
        // Each write holds one outcome a delivery; the superseded ones are fenced by the
        // database in a write of their own (and reported as such), the rest recorded.
        let (promoted, leased) = Box::pin(write_leasing(pool, &newest, cfg, patience, lease)).await;
        let also = Box::pin(write(pool, &superseded, cfg, patience)).await;
        return (promoted.and(also), leased);
    }
    match retrying(patience, batch.len(), || write_once(pool, batch, cfg, lease)).await {
        Ok((recorded, leased)) => {
            report(batch, &recorded);
            return (Promoted::Known(recorded.promoted), leased);
        }
        // A bug, already logged and counted where it was found: nothing was written, and
        // writing the rows one by one would only go round the check.
        Err(e) if transient(&e) || crate::invariants::is_broken(&e) => unrecorded(batch, &e),
        Err(e) if batch.len() == 1 => salvage(pool, &batch[0], cfg, &e, patience).await,
        Err(e) => {
            tracing::warn!(error = %e, batch = batch.len(), "recording a batch of outcomes failed; recording each alone");
            for row in batch {
                let one = std::slice::from_ref(row);
                match write_retrying(pool, one, cfg, patience).await {
                    Ok(recorded) => report(one, &recorded),
                    Err(e) if transient(&e) => unrecorded(one, &e),
                    Err(e) => salvage(pool, row, cfg, &e, patience).await,
                }
            }
        }
    }
    (Promoted::Unknown, Vec::new())
}

/// When `batch` holds outcomes of two claims of one delivery (the outcome of a claim that
/// waited past its lease, and that of the claim that took the delivery over), the newest
/// claim's outcomes, and the others: a write of both in one statement is refused as a
/// broken invariant, which left every outcome of the batch unrecorded and sent again.
/// `None` (the usual case) when every delivery is there under one claim.
fn split_superseded(batch: &[Finished]) -> Option<(Vec<Finished>, Vec<Finished>)> {
    let mut newest: HashMap<DeliveryId, i64> = HashMap::with_capacity(batch.len());
    for r in batch.iter().map(|f| &f.record) {
        newest.entry(r.delivery_id).and_modify(|t| *t = (*t).max(r.claim_token)).or_insert(r.claim_token);
    }
    let current = |f: &Finished| newest.get(&f.record.delivery_id) == Some(&f.record.claim_token);
    if batch.iter().all(current) {
        return None;
    }
    // Two outcomes of one claim stay together: that is a bug, which the write refuses.
    let (kept, superseded) = batch.iter().cloned().partition(|f| current(f));
    Some((kept, superseded))
}

/// [`write_once`], tried again while the error is [`transient`] ([`retrying`]).
async fn write_retrying(
    pool: &Pool,
    batch: &[Finished],
    cfg: &CircuitConfig,
    patience: &Patience,
) -> Result<Recorded, sqlx::Error> {
    retrying(patience, batch.len(), || async { Ok(write_once(pool, batch, cfg, None).await?.0) }).await
}

/// End a claim that sent nothing: give it back or dead-letter it, without spending its
/// attempt, fenced by its token; tried again while the database is away, and otherwise
/// left to its lease (which brings the delivery back as well). Public so tests can drive
/// it.
pub async fn end_unsent(pool: &Pool, unsent: &Unsent, patience: &Patience) {
    let (id, token) = (unsent.delivery_id, unsent.claim_token);
    let ended = retrying(patience, 1, || async {
        match &unsent.end {
            UnsentEnd::GiveBack { due } => queue::release(pool, id, token, *due).await,
            UnsentEnd::Bury { reason } => queue::bury(pool, id, token, reason, Burial::Unsent).await,
        }
    })
    .await;
    match (ended, &unsent.end) {
        (Ok(true), UnsentEnd::GiveBack { due }) => {
            tracing::debug!(delivery_id = %id, %due, "claim given back without spending its attempt")
        }
        (Ok(true), UnsentEnd::Bury { reason }) => tracing::warn!(delivery_id = %id, "dead: {reason}"),
        (Ok(false), _) => tracing::warn!(delivery_id = %id, "fenced while ending a claim that sent nothing"),
        (Err(e), _) => tracing::error!(delivery_id = %id, error = %e,
            "ending a claim that sent nothing failed; its lease will bring the delivery back"),
    }
}

/// One transaction: the fenced outcomes (releasing the lines of the ordered heads they
/// finish), then the circuits of their endpoints (only for outcomes this call wrote: an
/// already-recorded one was observed by the write that recorded it), when any of them can
/// change: the batch saw a failure or a probe there, or the outcome write found its
/// circuit not at rest ([`Recorded::unsettled`]); then the released lines' next heads,
/// leased on `lease`'s terms where their endpoints have room. A healthy unordered batch
/// to healthy endpoints is `BEGIN`, one statement and `COMMIT`.
/// A failure is reported to the pool's health (a read-only node, a departing one).
async fn write_once(
    pool: &Pool,
    batch: &[Finished],
    cfg: &CircuitConfig,
    lease: Option<ClaimTerms>,
) -> Result<(Recorded, Vec<Claimed>), sqlx::Error> {
    let written = async {
        let mut tx = pool.begin_planned(crate::db::Planning::Cached).await?;
        let (mut recorded, released) = queue::record_releasing(&mut tx, batch).await?;
        let fresh: HashSet<DeliveryId> = recorded.fresh.iter().copied().collect();
        let mut observations: BTreeMap<EndpointId, Observation> = BTreeMap::new();
        for f in batch.iter().filter(|f| fresh.contains(&f.record.delivery_id)) {
            observations.entry(f.record.endpoint_id).or_default().add(f.signal, f.probe_token);
        }
        if circuit::can_change(&observations, &recorded.unsettled) {
            circuit::sql::observe(&mut tx, &observations, cfg).await?;
        }
        // The lines move on last: a lease locks endpoint rows (never waiting for one), so
        // it comes after the circuits' update, which waits for its rows. Taken in the
        // other order, two writes (or a write and a claim) could each hold a row the
        // other waits for.
        let promotion = match lease {
            Some(terms) if terms.limit > 0 => queue::lines::promote_leasing(&mut tx, &released, terms).await?,
            _ => queue::lines::Promotion {
                promoted: queue::lines::promote(&mut tx, &released).await?,
                leased: Vec::new(),
            },
        };
        recorded.promoted = promotion.promoted;
        tx.commit().await?;
        Ok((recorded, promotion.leased))
    }
    .await;
    if let Err(e) = &written {
        pool.note(e);
    }
    written
}

/// Log (and count) what a successful write did not record because it was fenced.
fn report(batch: &[Finished], recorded: &Recorded) {
    for already in &recorded.already {
        tracing::info!(delivery_id = %already, "outcome was already recorded (an earlier write committed unconfirmed)");
    }
    let done: HashSet<&DeliveryId> = recorded.fresh.iter().chain(&recorded.already).collect();
    let fenced: Vec<&AttemptRecord> =
        batch.iter().map(|f| &f.record).filter(|r| !done.contains(&r.delivery_id)).collect();
    if fenced.is_empty() {
        return;
    }
    metrics::counter!(crate::metrics::FENCED).increment(fenced.len() as u64);
    for r in fenced {
        tracing::warn!(
            delivery_id = %r.delivery_id,
            attempt = r.attempt,
            outcome = r.outcome.as_str(),
            "outcome dropped: the lease was taken over by a newer claim (fenced), or the delivery is gone (its endpoint deleted, or a failover lost it)"
        );
    }
}

/// The database stayed unreachable, or the write broke a queue invariant: nothing was
/// written, and the leases bring these deliveries back.
fn unrecorded(batch: &[Finished], err: &sqlx::Error) {
    let why = if crate::invariants::is_broken(err) { "a queue invariant is broken" } else { "database unreachable" };
    for r in batch.iter().map(|f| &f.record) {
        tracing::error!(
            delivery_id = %r.delivery_id,
            attempt = r.attempt,
            error = %err,
            "outcome not recorded ({why}); the delivery will be attempted again when its lease ends"
        );
    }
}

/// Most of a database error quoted in a stored reason.
const ERROR_IN_REASON_BYTES: usize = 300;

/// A row PostgreSQL refused on its own: record the outcome without anything that came
/// from outside; failing that, dead-letter the delivery with the reason.
async fn salvage(pool: &Pool, finished: &Finished, cfg: &CircuitConfig, refused: &sqlx::Error, patience: &Patience) {
    let row = &finished.record;
    let error = sanitize::bounded(&refused.to_string(), ERROR_IN_REASON_BYTES);
    let plain = Finished { record: without_details(row, &error), ..finished.clone() };
    let one = std::slice::from_ref(&plain);
    let second = match write_retrying(pool, one, cfg, patience).await {
        Ok(recorded) => {
            metrics::counter!(crate::metrics::OUTCOMES_DEGRADED).increment(1);
            tracing::warn!(delivery_id = %row.delivery_id, attempt = row.attempt, error,
                "outcome recorded without its details: the database refused them");
            report(one, &recorded);
            return;
        }
        Err(e) if transient(&e) => return unrecorded(one, &e),
        Err(e) => e,
    };
    let reason = sanitize::bounded(
        &format!(
            "the outcome of attempt {} ({}, {}) could not be recorded: {error}; dead-lettered so it is not sent \
             again unrecorded (redeliver once the cause is fixed)",
            row.attempt,
            summary(row),
            row.outcome.as_str(),
        ),
        sanitize::MAX_REASON_BYTES,
    );
    match queue::bury(pool, row.delivery_id, row.claim_token, &reason, Burial::Unrecordable).await {
        Ok(true) => {
            metrics::counter!(crate::metrics::OUTCOMES_UNRECORDABLE).increment(1);
            tracing::error!(delivery_id = %row.delivery_id, attempt = row.attempt, error = %second, "dead: {reason}");
        }
        Ok(false) => {
            tracing::warn!(delivery_id = %row.delivery_id, "fenced while dead-lettering an unrecordable outcome")
        }
        Err(e) => tracing::error!(delivery_id = %row.delivery_id, error = %e,
            "an unrecordable outcome could not be dead-lettered either; the lease will bring the delivery back"),
    }
}

/// The status or error kind: what the gateway itself observed, never the peer's text.
fn summary(row: &AttemptRecord) -> String {
    match (row.status_code, row.error_kind) {
        (Some(status), _) => format!("HTTP {status}"),
        (None, Some(kind)) => kind.as_str().to_owned(),
        (None, None) => "no response".to_owned(),
    }
}

/// `row` with every field that came from outside replaced: no excerpt, and a reason
/// built from the status or error kind and the database's complaint.
fn without_details(row: &AttemptRecord, error: &str) -> AttemptRecord {
    AttemptRecord {
        response_excerpt: None,
        sent_excerpt: None,
        reason: sanitize::bounded(
            &format!("{} (the attempt's details could not be stored: {error})", summary(row)),
            sanitize::MAX_REASON_BYTES,
        ),
        ..row.clone()
    }
}
