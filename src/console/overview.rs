//! The overview: rates, queue depth and lag, recent dead letters, endpoints that are not
//! sending, the fleet's replicas; its numbers refresh live (the script fetches [`live`]
//! every few seconds).

use askama::Template;
use axum::Extension;
use axum::extract::State;

use super::{Layout, PageResult, Session, render};
use crate::api::AppState;
use crate::circuit::CircuitDisplay;
use crate::queue::{self, Outcome};
use crate::roster::ReplicaState;
use crate::store;

/// The rates shown large: per second over the last minute, so a short burst shows.
const RATE_WINDOW_SECS: i64 = 60;
/// The steadier rates shown beside them: per second over the last 5 minutes.
const SLOW_WINDOW_SECS: i64 = 300;

/// How long this process reuses the numbers: however many consoles are open, the
/// overview's queries (the queue counts read every pending row) run at most once per this
/// interval per replica.
const REUSE_FOR: std::time::Duration = std::time::Duration::from_secs(4);

/// The last numbers and when they were read: one per console router (so per gateway, not
/// per process: tests run several gateways in one process).
#[derive(Clone, Default)]
pub struct Recent(std::sync::Arc<std::sync::Mutex<Option<(std::time::Instant, Live)>>>);

/// An endpoint that is not sending now.
#[derive(Clone)]
pub struct Stalled {
    id: String,
    url: String,
    why: &'static str,
}

/// A replica of the fleet that is running, draining or lost (stopped ones went on
/// purpose).
#[derive(Clone)]
pub struct FleetRow {
    instance: String,
    role: String,
    version: String,
    schema_version: i64,
    behind_schema: bool,
    lost: bool,
    draining: bool,
    seen: super::Ts,
}

/// The live numbers (the fragment the page refreshes).
#[derive(Clone, Template)]
#[template(path = "console/overview_live.html")]
pub struct Live {
    ingest_per_sec: String,
    delivered_per_sec: String,
    failed_per_sec: String,
    /// The same three over the last 5 minutes.
    ingest_5m: String,
    delivered_5m: String,
    failed_5m: String,
    pending: i64,
    due: i64,
    parked: i64,
    lag: String,
    dead_total: i64,
    dead_last_hour: i64,
    stalled: Vec<Stalled>,
    /// The fleet's roster (`crate::roster`): replicas running (draining ones included:
    /// they still serve), lost, and behind the schema; the rows of all but the stopped.
    running: usize,
    lost: usize,
    behind: usize,
    fleet: Vec<FleetRow>,
    at: super::Ts,
}

#[derive(Template)]
#[template(path = "console/overview.html")]
struct Page {
    layout: Layout,
    live: Live,
}

/// `count` per second over `secs`, with the precision its size needs: a handful of
/// webhooks in a minute shows (`0.05`), a busy gateway shows whole numbers; none is `0`.
fn rate(count: i64, secs: i64) -> String {
    let per_sec = count as f64 / secs as f64;
    match per_sec {
        r if r <= 0.0 => "0".to_owned(),
        r if r < 1.0 => format!("{r:.2}"),
        r if r < 100.0 => format!("{r:.1}"),
        r => format!("{r:.0}"),
    }
}

/// A lag in seconds, readable: `0 s`, `42 s`, `3 min 5 s`, `2 h 10 min`.
pub fn human_secs(secs: f64) -> String {
    let s = secs.max(0.0).round() as i64;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, (s % 3600) / 60),
    }
}

/// The numbers, read at most once per [`REUSE_FOR`] by this process.
async fn live_numbers(state: &AppState, recent: &Recent) -> Result<Live, sqlx::Error> {
    let lock = || recent.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((at, live)) = lock().as_ref()
        && at.elapsed() < REUSE_FOR
    {
        return Ok(live.clone());
    }
    let live = read_numbers(state).await?;
    *lock() = Some((std::time::Instant::now(), live.clone()));
    Ok(live)
}

async fn read_numbers(state: &AppState) -> Result<Live, sqlx::Error> {
    let now = crate::clock::now();
    let window = now - chrono::Duration::seconds(RATE_WINDOW_SECS);
    let received = store::events::received_since(&state.pool, window).await?;
    let outcomes = store::attempts::outcomes_since(&state.pool, window).await?;
    let slow = now - chrono::Duration::seconds(SLOW_WINDOW_SECS);
    let received_5m = store::events::received_since(&state.pool, slow).await?;
    let outcomes_5m = store::attempts::outcomes_since(&state.pool, slow).await?;
    // By the deliveries, not their attempts: some die without one (an endpoint deleted
    // with `force`, a budget spent by workers that died).
    let dead_last_hour = crate::queue::read::dead_since(&state.pool, now - chrono::Duration::hours(1)).await?;
    let count = |rows: &[(Outcome, i64)], outcome: Outcome| rows.iter().find(|(o, _)| *o == outcome).map_or(0, |r| r.1);
    let stats = queue::read::stats(&state.pool).await?;
    let stalled = store::endpoints::list(&state.pool)
        .await?
        .into_iter()
        .filter_map(|e| {
            let why = if e.paused {
                "paused"
            } else {
                match e.circuit.display_state(now) {
                    CircuitDisplay::Closed => return None,
                    CircuitDisplay::Open => "circuit open",
                    CircuitDisplay::HalfOpen => "circuit half-open",
                }
            };
            Some(Stalled { id: e.id.to_string(), url: e.url, why })
        })
        .collect();
    let fleet: Vec<FleetRow> = crate::roster::list(&state.pool)
        .await?
        .replicas
        .into_iter()
        .filter(|r| r.state != ReplicaState::Stopped)
        .map(|r| FleetRow {
            lost: r.state == ReplicaState::Lost,
            draining: r.state == ReplicaState::Draining,
            instance: r.instance,
            role: r.role,
            version: r.version,
            schema_version: r.schema_version,
            behind_schema: r.behind_schema,
            seen: super::Ts(r.seen_at),
        })
        .collect();
    let lost = fleet.iter().filter(|r| r.lost).count();
    let behind = fleet.iter().filter(|r| !r.lost && r.behind_schema).count();
    Ok(Live {
        ingest_per_sec: rate(received, RATE_WINDOW_SECS),
        delivered_per_sec: rate(count(&outcomes, Outcome::Delivered), RATE_WINDOW_SECS),
        failed_per_sec: rate(count(&outcomes, Outcome::Retry) + count(&outcomes, Outcome::Dead), RATE_WINDOW_SECS),
        ingest_5m: rate(received_5m, SLOW_WINDOW_SECS),
        delivered_5m: rate(count(&outcomes_5m, Outcome::Delivered), SLOW_WINDOW_SECS),
        failed_5m: rate(count(&outcomes_5m, Outcome::Retry) + count(&outcomes_5m, Outcome::Dead), SLOW_WINDOW_SECS),
        pending: stats.pending,
        due: stats.due,
        parked: stats.parked,
        lag: stats.oldest_due_age_secs.map_or_else(|| "none".to_owned(), human_secs),
        dead_total: stats.dead,
        dead_last_hour,
        stalled,
        running: fleet.len() - lost,
        lost,
        behind,
        fleet,
        at: super::Ts(now),
    })
}

/// `GET /console`.
pub async fn page(session: Session, State(state): State<AppState>, Extension(recent): Extension<Recent>) -> PageResult {
    let live = live_numbers(&state, &recent).await?;
    render(&Page { layout: Layout::new(&session, "overview"), live })
}

/// `GET /console/overview/live`: the numbers alone, an HTML fragment the page swaps in.
pub async fn live(
    _session: Session,
    State(state): State<AppState>,
    Extension(recent): Extension<Recent>,
) -> PageResult {
    render(&live_numbers(&state, &recent).await?)
}

#[cfg(test)]
mod tests {
    #[test]
    fn lags_read_like_a_person_would_say_them() {
        assert_eq!(super::human_secs(-3.0), "0 s");
        assert_eq!(super::human_secs(42.4), "42 s");
        assert_eq!(super::human_secs(185.0), "3 min 5 s");
        assert_eq!(super::human_secs(7800.0), "2 h 10 min");
    }

    /// A short burst shows; whole numbers when busy.
    #[test]
    fn rates_have_the_precision_their_size_needs() {
        assert_eq!(super::rate(0, 60), "0");
        assert_eq!(super::rate(3, 60), "0.05");
        assert_eq!(super::rate(90, 60), "1.5");
        assert_eq!(super::rate(360_000, 60), "6000");
    }
}
