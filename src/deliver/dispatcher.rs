//! The dispatcher: claims due deliveries for its free slots, starts an attempt for each,
//! and stops gracefully.

use std::sync::Arc;
use std::time::Duration;

use crate::db::Pool;
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};

use super::DeliverySettings;
use super::attempt::{self, Context};
use super::housekeeping::Housekeeping;
use super::recorder;
use crate::egress::EgressClient;
use crate::queue::{self, Claimed};
use crate::secrets::Keyring;
use crate::wake::Handoff;

use super::prelease::{Prelease, Preleased, Received};

/// Most deliveries claimed by one statement. Each claim pays fixed costs (two statements,
/// the claim's planning, a commit) whatever its size; in the bench drain of 100,000, 256
/// delivered 12,600-12,700/s at fan-out 1 and 13,800-13,900/s at fan-out 4, against
/// 11,000-11,800/s for 128 (same machine, alternating runs). Idle workers cost nothing:
/// a claim asks for as many rows as there are free workers, up to this.
pub const MAX_CLAIM_BATCH: usize = 256;

/// A running dispatcher. [`Dispatcher::shutdown`] stops claiming, lets in-flight requests
/// finish (up to the grace period), records them and returns.
pub struct Dispatcher {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Dispatcher {
    /// Start the dispatcher. `wake` is notified when due work may have appeared (other
    /// processes' ingest, released circuits, redeliveries); `handoff` brings the
    /// deliveries this process's ingest stored and its recorder made their lines' heads,
    /// and those its ingest leased itself (with the worker slots they share);
    /// `secrets` opens the endpoint secrets each claim
    /// returns; it admits half-open probes while `housekeeping` says this process leads.
    pub fn spawn(
        pool: Pool,
        egress: EgressClient,
        settings: DeliverySettings,
        wake: Arc<Notify>,
        handoff: Handovers,
        secrets: Keyring,
        housekeeping: Housekeeping,
    ) -> Dispatcher {
        let (stop, stopped) = watch::channel(false);
        let Handovers { ids: handoff, prelease, preleased } = handoff;
        let wakes = Wakes { general: wake, handoff, room: Arc::new(Notify::new()), prelease, preleased };
        let task = tokio::spawn(run(pool, egress, settings, wakes, secrets, housekeeping, stopped));
        Dispatcher { stop, task }
    }

    /// Graceful stop.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        if let Err(e) = self.task.await {
            tracing::error!(error = %e, "delivery dispatcher panicked");
        }
    }
}

/// What this process's ingest and recorder hand to its dispatcher.
pub struct Handovers {
    /// Deliveries to claim by key.
    pub ids: Arc<Handoff>,
    /// What ingest shares with the dispatcher to lease deliveries itself.
    pub prelease: Arc<Prelease>,
    /// The deliveries it leased.
    pub preleased: Received,
}

/// What wakes a sleeping dispatcher, by what it should look for.
struct Wakes {
    /// Due work may have appeared anywhere: claim the general way.
    general: Arc<Notify>,
    /// This process's ingest stored deliveries, or its recorder made deliveries their
    /// lines' heads: claim them by key, unless a general claim is owed.
    handoff: Arc<Handoff>,
    /// The recorder freed slots and endpoint room (and promoted nothing): only a
    /// dispatcher whose last claim left due work behind has anything to look for.
    room: Arc<Notify>,
    /// What ingest shares with this dispatcher to lease deliveries itself.
    prelease: Arc<Prelease>,
    /// Deliveries this process's ingest leased, each with its slot: started as they come.
    preleased: Received,
}

async fn run(
    pool: Pool,
    egress: EgressClient,
    settings: DeliverySettings,
    mut wakes: Wakes,
    secrets: Keyring,
    housekeeping: Housekeeping,
    mut stop: watch::Receiver<bool>,
) {
    let slots = wakes.prelease.slots();
    let (outcomes, records) = mpsc::channel(settings.workers.max(16));
    let patience = recorder::Patience { lease: settings.lease, stopping: stop.clone() };
    // The recorder wakes the claim loop too: each write frees slots and endpoint room
    // (leases end), work that a claim which came back short (an endpoint at its limit)
    // left due; the ordered deliveries it makes their lines' heads it hands over by id.
    // It leases the next heads of the lines it moves on itself, with the finished heads'
    // slots, while this dispatcher owes no general claim.
    let written = recorder::Written {
        due: wakes.general.clone(),
        heads: wakes.handoff.clone(),
        room: wakes.room.clone(),
        leases: Some(wakes.prelease.clone()),
    };
    // Whether this dispatcher waits for a slot or room, which ends the recorder's linger.
    let waiting = Arc::new(recorder::Waiting::default());
    let recorder =
        tokio::spawn(recorder::run(pool.clone(), records, settings.circuit, patience, written, waiting.clone()));
    let ctx = Context {
        pool: pool.clone(),
        egress,
        settings: settings.clone(),
        outcomes,
        secrets,
        urls: Default::default(),
        bodies: super::bodies::delivery_budget(settings.body_memory_bytes),
    };
    let mut in_flight = JoinSet::new();
    let mut claim_failures = 0u32;
    let mut idle_poll = settings.poll_interval;
    let mut last_probe_check = tokio::time::Instant::now() - PROBE_CHECK_INTERVAL;
    // Whether the last general claim was short with due work left behind it.
    let mut clogged = false;
    // When the bucket of a rate-limited endpoint whose last tokens this dispatcher spent
    // is full again.
    let mut bucket_full_at: Option<tokio::time::Instant> = None;
    // Whether the next claim must look at all due work (the general claim): at start, after
    // a claim that left due rows behind or came back full, and after any wake but the
    // hand-off's. Otherwise the deliveries handed over (by ingest, by the recorder) are
    // claimed by key.
    let mut owed_general = true;
    // Whether the next general claim first asks whether anything is due
    // ([`queue::anything_due`]): after a poll of an idle dispatcher that nothing woke.
    let mut peek = false;
    wakes.prelease.set_owed_general(true);
    tracing::info!(workers = settings.workers, "delivery workers started");

    'claims: loop {
        // Wait for a free slot (or shutdown), starting what ingest leased meanwhile. With
        // none free, the recorder holds some until its next write: it should not linger.
        if slots.available_permits() == 0 {
            waiting.set(true);
        }
        let first = tokio::select! {
            permit = slots.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
            Some(leased) = wakes.preleased.recv() => {
                start(&mut in_flight, &ctx, leased);
                continue;
            }
            _ = stop.wait_for(|s| *s) => break,
        };
        while in_flight.try_join_next().is_some() {}
        // The slots this claim may fill, held through it: ingest takes free slots too
        // (`prelease`), so slots merely counted could be gone when the claim returns.
        let mut permits = vec![first];
        while permits.len() < MAX_CLAIM_BATCH {
            match slots.clone().try_acquire_owned() {
                Ok(permit) => permits.push(permit),
                Err(_) => break,
            }
        }
        let want = permits.len();
        // Raced against stop: a claim sent into a network partition must not hold
        // shutdown until the connection gives up. A claim that committed unseen is a
        // crashed claim: its lease brings the rows back.
        let claim_started = std::time::SystemTime::now();
        let claim_began = tokio::time::Instant::now();
        let tick = last_probe_check.elapsed() >= PROBE_CHECK_INTERVAL;
        // The deliveries to claim by key, or `None` for the general claim.
        let by_key = if owed_general || tick {
            wakes.handoff.clear();
            None
        } else {
            wakes.handoff.take()
        };
        let by_key_claim = by_key.is_some();
        let peek_first = std::mem::take(&mut peek);
        let claiming = async {
            match by_key {
                Some(fresh) if fresh.is_empty() => Ok(Claim::default()),
                Some(fresh) => {
                    let fresh =
                        queue::claim_fresh(&pool, &fresh, want as i64, settings.lease, settings.endpoint_max_in_flight)
                            .await?;
                    // It does not say why it left work: maybe room, which the
                    // general claim that follows finds out.
                    Ok(Claim {
                        left_behind: !fresh.took_all,
                        held_by_room: true,
                        next_token_in: None,
                        claimed: fresh.claimed,
                    })
                }
                None => {
                    let turn =
                        Turn { last_probe_check: &mut last_probe_check, clogged: &mut clogged, peek: peek_first };
                    claim(&pool, want, &settings, turn, &housekeeping).await
                }
            }
        };
        // Bounded: behind a pooler, a claim sent to a server gone silent is never ended by
        // the socket (see `db::BACKGROUND_DEADLINE`).
        let claiming = async {
            tokio::time::timeout(crate::db::BACKGROUND_DEADLINE, claiming)
                .await
                .unwrap_or_else(|_| Err(crate::db::no_answer("a claim")))
        };
        tokio::pin!(claiming);
        // What ingest leases meanwhile starts at once, not when the claim returns: a
        // claim may wait on an endpoint's row behind ingest's own commits (tens of
        // milliseconds in a burst), and every lease handed over meanwhile waited with it.
        let claimed = loop {
            tokio::select! {
                claimed = &mut claiming => break claimed,
                Some(leased) = wakes.preleased.recv() => start(&mut in_flight, &ctx, leased),
                _ = stop.wait_for(|s| *s) => break 'claims,
            }
        };
        let claimed = match claimed {
            Ok(Claim { claimed, left_behind, held_by_room, next_token_in }) => {
                claim_failures = 0;
                // A full claim may have left more: look again the general way.
                owed_general = left_behind || claimed.len() >= want;
                // Short with due work left behind by an endpoint at its limit: it waits
                // for leases to end, which the recorder's writes do. (Left behind for
                // want of rate tokens, it waits for time: the recorder may linger.)
                waiting.set(left_behind && held_by_room && claimed.len() < want);
                wakes.prelease.set_owed_general(owed_general);
                bucket_full_at =
                    bucket_deadline(bucket_full_at, next_token_in, claim_began, tokio::time::Instant::now());
                claimed
            }
            Err(e) => {
                // A read-only or departing node: the pool drops its older connections.
                pool.note(&e);
                claim_failures += 1;
                owed_general = true;
                wakes.prelease.set_owed_general(true);
                let pause = claim_retry_pause(claim_failures);
                tracing::warn!(error = %e, retry_in = ?pause, "claiming deliveries failed");
                drop(permits);
                // A wake-up (ingest stored a webhook, so the database is back) ends the
                // pause early: after a failover the workers follow ingest at once rather
                // than up to a whole pause later.
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    () = wakes.general.notified() => {}
                    () = wakes.handoff.arrived() => {}
                    _ = stop.wait_for(|s| *s) => break,
                }
                continue;
            }
        };
        // Fewer than asked: no more claimable work right now (none due, or what is due is
        // at its endpoint's limit or waiting in its line).
        let drained = claimed.len() < want;
        let found = claimed.len();
        let probes = claimed.iter().filter(|job| job.probe_token.is_some()).count();
        crate::metrics::leases(if by_key_claim { "claim_by_key" } else { "claim" }, found - probes);
        crate::metrics::leases("probe", probes);
        let claim_span = crate::telemetry::claim_span(claim_started, claimed.len(), probes);
        // A claim takes at most `want` rows: each has its slot; the rest are freed below.
        let mut permits = permits.into_iter();
        for job in claimed {
            let Some(permit) = permits.next() else {
                tracing::error!(delivery_id = %job.id, "no free slot for a claimed delivery; its lease will bring it back");
                continue;
            };
            in_flight.spawn(attempt::boxed(attempt::run(ctx.clone(), job, permit, claim_span.clone())));
        }
        drop(permits);
        if drained {
            // No more due work that this process may claim now: sleep until woken (by ingest,
            // or by the recorder freeing room), the poll, or stop. While it finds nothing
            // and has nothing in flight, the poll slows down to IDLE_POLL_FACTOR times the
            // interval: new work wakes it (ingest in this process, NOTIFY from others), so
            // an idle poll only finds retries come due, and twenty idle replicas should not
            // cost PostgreSQL eighty claims a second.
            let idle = found == 0 && in_flight.is_empty();
            let pause = if idle { idle_poll } else { settings.poll_interval };
            let mut until = tokio::time::Instant::now() + pause;
            idle_poll = if idle {
                (idle_poll * 2).min(settings.poll_interval * IDLE_POLL_FACTOR)
            } else {
                settings.poll_interval
            };
            if let Some(at) = bucket_full_at {
                until = until.min(at);
            }
            loop {
                match sleep(&mut wakes, &mut owed_general, until, &mut stop).await {
                    Slept::Woken => break,
                    // Nothing woke an idle dispatcher: the claim first asks whether
                    // anything is due at all.
                    Slept::Polled => {
                        peek = idle;
                        break;
                    }
                    // Started at once; the dispatcher sleeps on (it claimed nothing).
                    Slept::Preleased(leased) => start(&mut in_flight, &ctx, *leased),
                    Slept::Stopped => break 'claims,
                }
            }
            wakes.prelease.set_owed_general(owed_general);
        }
    }
    // Ingest leases no more; what it leased before is worked on like any claim.
    wakes.prelease.set_owed_general(true);
    wakes.preleased.close();
    while let Ok(leased) = wakes.preleased.try_recv() {
        start(&mut in_flight, &ctx, leased);
    }

    let in_flight_now = in_flight.len();
    if in_flight_now > 0 {
        tracing::info!(in_flight = in_flight_now, grace = ?settings.shutdown_grace, "waiting for in-flight deliveries");
    }
    let finished =
        tokio::time::timeout(settings.shutdown_grace, async { while in_flight.join_next().await.is_some() {} }).await;
    if finished.is_err() {
        tracing::warn!(
            unfinished = in_flight.len(),
            "shutdown grace expired; unfinished deliveries will be retried when their leases end"
        );
        in_flight.abort_all();
        while in_flight.join_next().await.is_some() {}
    }
    drop(ctx);
    // Bounded: a write the database never answers (behind a pooler whose server went
    // silent) must not hold the stop back.
    let mut recorder = recorder;
    match tokio::time::timeout(recorder::STOP_BOUND, &mut recorder).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(error = %e, "outcome recorder panicked"),
        Err(_) => {
            recorder.abort();
            tracing::warn!(
                bound = ?recorder::STOP_BOUND,
                "outcomes still unwritten when the stop's bound came; their deliveries come back when their leases end"
            );
        }
    }
    tracing::info!("delivery workers stopped");
}

/// Start the attempt of a delivery that ingest leased.
fn start(in_flight: &mut JoinSet<()>, ctx: &Context, leased: Preleased) {
    in_flight.spawn(attempt::boxed(attempt::run(ctx.clone(), leased.job, leased.slot, leased.claim)));
}

/// How a dispatcher's sleep ended.
enum Slept {
    /// Something may be claimable.
    Woken,
    /// The poll came round (nothing woke it): a general claim is owed.
    Polled,
    /// Ingest leased a delivery: start it, and sleep on.
    Preleased(Box<Preleased>),
    /// Stop.
    Stopped,
}

/// Sleep until something may be claimable: a general wake or the poll at `until` (after
/// which a general claim is owed), the hand-off, or room freed while a general claim is
/// owed; or until ingest hands over a delivery it leased.
async fn sleep(
    wakes: &mut Wakes,
    owed_general: &mut bool,
    until: tokio::time::Instant,
    stop: &mut watch::Receiver<bool>,
) -> Slept {
    let Wakes { general, handoff, room, preleased, .. } = wakes;
    let poll = tokio::time::sleep_until(until);
    tokio::pin!(poll);
    loop {
        tokio::select! {
            () = general.notified() => *owed_general = true,
            () = &mut poll => {
                *owed_general = true;
                return Slept::Polled;
            }
            () = handoff.arrived() => {}
            () = room.notified() => if !*owed_general { continue },
            Some(leased) = preleased.recv() => return Slept::Preleased(Box::new(leased)),
            _ = stop.wait_for(|s| *s) => return Slept::Stopped,
        }
        return Slept::Woken;
    }
}

/// An idle dispatcher's poll grows to this many times `--poll-interval-ms`.
const IDLE_POLL_FACTOR: u32 = 4;

/// How often a dispatcher sweeps every endpoint with due work in its claim and, on the
/// housekeeping leader, looks for half-open endpoints to probe.
const PROBE_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// What one turn of the claim loop took, and what it left.
#[derive(Default)]
struct Claim {
    /// The deliveries now leased to this process.
    claimed: Vec<Claimed>,
    /// Whether due rows were left behind.
    left_behind: bool,
    /// Whether what was left may be claimable once leases end (see
    /// [`queue::ClaimBatch::held_by_room`]); false when only rate tokens held it back.
    held_by_room: bool,
    /// How long until the bucket of an endpoint whose last tokens it spent is full again.
    next_token_in: Option<Duration>,
}

/// What a general claim carries over from the claims before it.
struct Turn<'a> {
    /// When the half-open probes were last looked for.
    last_probe_check: &'a mut tokio::time::Instant,
    /// Whether the last claim came back short with due rows left behind it (the head of
    /// the due index held by endpoints at their limits); this one then sweeps at once.
    clogged: &'a mut bool,
    /// Ask first whether anything is due at all ([`queue::anything_due`]): one round trip
    /// instead of the claim's three when nothing is (an idle dispatcher's poll).
    peek: bool,
}

/// Half-open probes (at most every [`PROBE_CHECK_INTERVAL`], on the housekeeping leader
/// only), then due deliveries, `want` in all; and whether due rows were left behind.
///
/// Each of its claims commits on its own. When a later statement fails, what the earlier
/// ones took is leased to this process already: it is returned to be sent (and the
/// failure noted for the pool; the next turn meets it again), not dropped to wait out its
/// lease with an attempt counted and nothing sent (a probe dropped so also held its
/// endpoint's half-open slot for a whole lease).
async fn claim(
    pool: &Pool,
    want: usize,
    settings: &DeliverySettings,
    turn: Turn<'_>,
    housekeeping: &Housekeeping,
) -> Result<Claim, sqlx::Error> {
    let Turn { last_probe_check, clogged, peek } = turn;
    let mut claimed = Vec::new();
    let tick = last_probe_check.elapsed() >= PROBE_CHECK_INTERVAL;
    if tick {
        *last_probe_check = tokio::time::Instant::now();
        if housekeeping.looks_for_probes() {
            claimed = queue::claim_probes(pool, want.min(16) as i64, settings.lease).await?;
            for probe in &claimed {
                tracing::info!(endpoint_id = %probe.endpoint_id, delivery_id = %probe.id, "half-open probe admitted");
            }
        }
    }
    match claim_due(pool, want, settings, tick, clogged, peek, &mut claimed).await {
        Ok(left) => Ok(Claim { claimed, ..left }),
        Err(e) if claimed.is_empty() => Err(e),
        Err(e) => {
            pool.note(&e);
            tracing::warn!(error = %e, claimed = claimed.len(), "claiming deliveries failed after a claim committed; \
                sending what it took");
            Ok(Claim { claimed, left_behind: true, held_by_room: false, next_token_in: None })
        }
    }
}

/// The due deliveries of [`claim`], added to `claimed` as each claim commits (`want` in
/// all); what they left, in a [`Claim`] without deliveries.
async fn claim_due(
    pool: &Pool,
    want: usize,
    settings: &DeliverySettings,
    tick: bool,
    clogged: &mut bool,
    peek: bool,
    claimed: &mut Vec<Claimed>,
) -> Result<Claim, sqlx::Error> {
    if peek && !queue::anything_due(pool).await? {
        *clogged = false;
        return Ok(Claim { claimed: Vec::new(), left_behind: false, held_by_room: false, next_token_in: None });
    }
    let rest = want - claimed.len();
    let mut took_all_due = false;
    let mut held_by_room = false;
    let mut next_token_in = None;
    // The tick sweeps every endpoint with due work; so does a claim behind a clogged head,
    // which would otherwise come back short again and sweep second (two transactions for
    // each claim while an endpoint at its limit, or out of rate tokens, holds a backlog).
    let sweep = tick || *clogged;
    if rest > 0 {
        let fairness = queue::Fairness { default_max_in_flight: settings.endpoint_max_in_flight, sweep };
        let batch = queue::claim_batch(pool, rest as i64, settings.lease, fairness).await?;
        took_all_due = batch.took_all_due();
        held_by_room = batch.held_by_room;
        next_token_in = batch.next_token_in;
        claimed.extend(batch.claimed);
    }
    let rest = want - claimed.len();
    if rest > 0 && !took_all_due && !sweep {
        // Short without a sweep: the oldest due rows may all belong to endpoints at their
        // limits, hiding other endpoints' due rows behind them. Look past them before
        // sleeping, so those wait for no tick (one more claim only when short and the
        // first one left due rows behind; at low load it took them all, and a second
        // claim would be a transaction for nothing).
        let fairness = queue::Fairness { default_max_in_flight: settings.endpoint_max_in_flight, sweep: true };
        let batch = queue::claim_batch(pool, rest as i64, settings.lease, fairness).await?;
        took_all_due = batch.took_all_due();
        // What the first claim left at its endpoints' limits is still there.
        held_by_room |= batch.held_by_room;
        next_token_in = earliest(next_token_in, batch.next_token_in);
        claimed.extend(batch.claimed);
    }
    *clogged = claimed.len() < want && !took_all_due;
    Ok(Claim { claimed: Vec::new(), left_behind: !took_all_due, held_by_room, next_token_in })
}

/// The sooner of two optional waits.
fn earliest(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// When to claim next for a rate-limited endpoint's tokens, after a claim that began at
/// `began` and ended at `now`: before the bucket (only `burst` tokens) of an endpoint whose
/// tokens it spent overflows (`full_in`, counted from the statement's end, so from `now`:
/// never early). A claim that spent none keeps the `previous` time if it began before it
/// (woken sooner, by a recorder's write, it read the bucket not yet full, even if the time
/// has passed since); one that began after it found the tokens taken by another claimer,
/// who is told instead.
fn bucket_deadline(
    previous: Option<tokio::time::Instant>,
    full_in: Option<Duration>,
    began: tokio::time::Instant,
    now: tokio::time::Instant,
) -> Option<tokio::time::Instant> {
    match full_in {
        // Beyond what an instant can hold: no time (the poll comes first anyway).
        Some(full_in) => now.checked_add(full_in.max(MIN_TOKEN_WAIT)),
        None => previous.filter(|at| *at > began),
    }
}

/// The shortest sleep until a rate-limited endpoint's bucket is full: an endpoint allowed
/// thousands of requests a second with a `burst` of one cannot have a claim (a
/// transaction) for each.
const MIN_TOKEN_WAIT: Duration = Duration::from_millis(1);

/// The pause after `failures` consecutive failed claims: doubling from 200 ms, at most
/// 6.4 s, so a database outage is probed a few times a minute, not hammered.
fn claim_retry_pause(failures: u32) -> Duration {
    Duration::from_millis(100 * 2u64.pow(failures.clamp(1, 6)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_s_time_is_kept_by_a_claim_that_began_before_it_and_spent_nothing() {
        let t0 = tokio::time::Instant::now();
        let ms = |n: u64| Duration::from_millis(n);
        // Spent the last token: claim again when the bucket is full, from the claim's end.
        assert_eq!(bucket_deadline(None, Some(ms(5)), t0, t0 + ms(2)), Some(t0 + ms(7)));
        // Never sooner than the floor, however full the bucket already is.
        assert_eq!(bucket_deadline(None, Some(Duration::ZERO), t0, t0), Some(t0 + MIN_TOKEN_WAIT));
        // Woken at 4 ms, before the bucket was full at 7: spent nothing, ended at 9; the
        // time has passed, but the claim read the bucket before it: kept (claim at once).
        let full = Some(t0 + ms(7));
        assert_eq!(bucket_deadline(full, None, t0 + ms(4), t0 + ms(9)), full);
        // Began at 8, after the time, and spent nothing: another claimer took the token.
        assert_eq!(bucket_deadline(full, None, t0 + ms(8), t0 + ms(10)), None);
        // A claim that spent tokens replaces the time.
        assert_eq!(bucket_deadline(full, Some(ms(5)), t0 + ms(7), t0 + ms(9)), Some(t0 + ms(14)));
        // A bucket full again only beyond any instant: no time, and no overflow.
        assert_eq!(bucket_deadline(full, Some(Duration::MAX), t0, t0), None);
    }

    #[test]
    fn claim_retries_back_off_doubling_to_a_cap() {
        let pauses: Vec<u64> = (1..=9).map(|n| claim_retry_pause(n).as_millis() as u64).collect();
        assert_eq!(pauses, [200, 400, 800, 1600, 3200, 6400, 6400, 6400, 6400]);
        assert_eq!(claim_retry_pause(u32::MAX), Duration::from_millis(6400));
    }
}
