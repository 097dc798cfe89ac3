//! Circuit housekeeping, once per fleet: every [`TICK`] (every [`IDLE_TICK`] while there
//! is nothing to do), the replica that leads the
//! `housekeeping` job parks the due deliveries of blocked endpoints (open circuit,
//! paused) and releases the parked backlogs of endpoints that became runnable; its
//! dispatcher also admits the half-open probes (it reads [`Housekeeping::looks_for_probes`]).
//! A round first asks whether any endpoint is blocked, has a backlog to release or an
//! open circuit ([`queue::endpoints_to_watch`], one statement): nearly always none is, and
//! an idle fleet's leader then runs that one statement a second instead of three.
//!
//! Every worker replica runs this task, and one leads ([`crate::lease::Leadership`]): at
//! twenty replicas the fleet runs these statements ten times a second, not two hundred.
//! The statements are safe to run anywhere at any time (they lock what they change and
//! skip what another holds), so two leaders for a moment (a lease taken over from a
//! stalled one) cost a few statements, nothing else. A leader that dies is replaced
//! within [`LEASE_TTL`]; meanwhile open circuits stay parked a little longer. A failing
//! statement here backs off this task only, never the claims.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, watch};

use crate::db::Pool;
use crate::lease::Leadership;
use crate::log_throttle::{INTERVAL, Throttle};
use crate::queue;

/// How often the leader does its round while there is work (parked rows, releases).
pub const TICK: Duration = Duration::from_millis(100);

/// How often at most, while its rounds find nothing to do: a closed circuit's backlog
/// waits at most this long to start its release.
pub const IDLE_TICK: Duration = Duration::from_secs(1);

/// The leader's lease: renewed every third of it.
pub const LEASE_TTL: Duration = Duration::from_secs(3);

/// Name of the job's lease.
pub const LEASE_NAME: &str = "housekeeping";

/// Whether this process leads the housekeeping, and whether its last round saw an open
/// circuit (shared with its dispatcher).
#[derive(Debug, Clone)]
pub struct Housekeeping {
    leads: Arc<AtomicBool>,
    open_circuits: Arc<AtomicBool>,
}

impl Default for Housekeeping {
    fn default() -> Self {
        // Open circuits assumed until a round looked.
        Housekeeping { leads: Arc::default(), open_circuits: Arc::new(AtomicBool::new(true)) }
    }
}

impl Housekeeping {
    /// Whether this process leads now (it admits the half-open probes then).
    pub fn leads(&self) -> bool {
        self.leads.load(Ordering::Relaxed)
    }

    /// Whether this process's dispatcher looks for half-open probes: it leads, and its
    /// last round saw an open circuit (a circuit that opens after it is seen by the next
    /// round, at most [`IDLE_TICK`] later, long before any cool-down ends).
    pub fn looks_for_probes(&self) -> bool {
        self.leads() && self.open_circuits.load(Ordering::Relaxed)
    }

    /// Run the rounds until `stop`: `release_per_sec` paces released backlogs, `wake` is
    /// told when deliveries were released (they are claimable now).
    pub async fn run(
        self,
        pool: Pool,
        instance: String,
        release_per_sec: u32,
        wake: Arc<Notify>,
        mut stop: watch::Receiver<bool>,
    ) {
        static FAILED: Throttle = Throttle::new(INTERVAL);
        let mut leadership = Leadership::new(LEASE_NAME, instance, LEASE_TTL);
        let mut pause = TICK;
        while crate::lease::pause(pause, &mut stop).await {
            // Raced against stop: a round sent into a partition must not hold the shutdown.
            let round = async {
                let leads = leadership.leads(&pool).await;
                self.leads.store(leads, Ordering::Relaxed);
                if leads { round(&pool, release_per_sec, &wake, &self.open_circuits).await } else { Ok(false) }
            };
            let done = tokio::select! {
                done = round => done,
                _ = stop.wait_for(|s| *s) => break,
            };
            // Every TICK while there is parking or releasing to do; slowing down to
            // IDLE_TICK while a round finds nothing.
            pause = match done {
                Ok(true) => TICK,
                Ok(false) => (pause * 2).min(IDLE_TICK),
                Err(e) => {
                    pool.note(&e);
                    if let Some(left_out) = FAILED.admit() {
                        tracing::warn!(error = %e, left_out, "circuit housekeeping failed; trying again at the next round");
                    }
                    IDLE_TICK
                }
            };
        }
        self.leads.store(false, Ordering::Relaxed);
    }
}

/// One round: park what blocked endpoints have due, release the backlogs of endpoints
/// that became runnable (when any endpoint is blocked or has a backlog to release);
/// whether it did anything. `open_circuits` is told whether any circuit is open.
async fn round(
    pool: &Pool,
    release_per_sec: u32,
    wake: &Notify,
    open_circuits: &AtomicBool,
) -> Result<bool, sqlx::Error> {
    let watch = queue::endpoints_to_watch(pool).await?;
    open_circuits.store(watch.open_circuits, Ordering::Relaxed);
    if !watch.blocked_or_releasing {
        return Ok(false);
    }
    let parked = queue::park_blocked(pool).await?;
    if parked > 0 {
        tracing::debug!(parked, "parked due deliveries of blocked endpoints");
    }
    let released = queue::release_parked(pool, release_per_sec, None).await?;
    if released > 0 {
        tracing::info!(released, "parked deliveries released (circuit closed or endpoint resumed)");
        wake.notify_one();
    }
    Ok(parked > 0 || released > 0)
}
