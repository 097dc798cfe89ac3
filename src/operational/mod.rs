//! The gateway's own events ("operational webhooks"): what an on-call engineer wants to
//! hear about, published as events of the built-in source [`SOURCE`] and delivered like
//! any other (signed, retried, fair, optionally ordered, through filters and
//! transformations) to the endpoints whose subscriptions name that source (a subscription
//! to every source does not get them).
//!
//! | event type | when |
//! | --- | --- |
//! | `endpoint.circuit.opened` / `endpoint.circuit.closed` | an endpoint's circuit opened after failures in a row / closed after a probe succeeded |
//! | `endpoint.paused` / `endpoint.resumed` | an operator paused or resumed an endpoint |
//! | `deliveries.dead_lettered` | deliveries died in the last window: one event per window, counted per endpoint |
//! | `backlog.delayed` / `backlog.recovered` | the longest-waiting due delivery has waited longer than the threshold / no longer |
//! | `source.refusing` | a replica refused at least the threshold of one source's webhooks in a minute (bad signatures ...) |
//! | `retention.behind` / `retention.recovered` | events retention should have deleted are still stored well past their time / no longer |
//!
//! **Exactly once.** Every event has a dedupe key derived from what it reports (the
//! circuit transition's id, the window, the minute, when the condition was raised), and
//! the windowed and raised checks move their state (`operational_state`) in the
//! transaction that publishes: a crash or two replicas running a check at once publish
//! each event once. Pauses are published in the transaction that pauses.
//!
//! **They never feed on themselves.** Deliveries of operational events are left out of
//! the dead-letter count and the backlog check, so an endpoint that receives them and
//! fails does not cause more of them; its circuit still opens and closes (at most once a
//! cool-down, like any endpoint's).
//!
//! The checks that read the whole fleet's state run on one replica at a time (the
//! `operational` lease); `source.refusing` runs on every replica, each reporting what it
//! refused itself.

pub mod state;
pub mod tally;

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use sqlx::PgConnection;
use tokio::sync::watch;

use crate::db::Pool;
use crate::ids::{EndpointId, SourceId};
use crate::lease::Leadership;
use crate::log_throttle::{INTERVAL, Throttle};
use crate::store::events::NewEvent;

/// The built-in source the gateway publishes its own events under.
pub const SOURCE: &str = "_gateway";

/// [`SOURCE`]'s id, fixed by migration 0019 so that the fan-out (`queue::fanout`) can
/// leave it out of the subscriptions to every source with a constant: only subscriptions
/// that name `_gateway` receive its events.
pub const SOURCE_ID: uuid::Uuid = uuid::Uuid::from_u128(0x00000000_0000_7000_8000_00000000ca7e);

/// Name of the lease whose holder runs the fleet-wide checks.
pub const LEASE_NAME: &str = "operational";

/// How far back the circuit check looks again, for transitions committed late.
const CIRCUIT_LOOKBACK: Duration = Duration::from_secs(60);

/// How long before now a dead-letter window closes: a delivery that died just before is
/// counted once its outcome's transaction had time to commit.
const DEAD_LETTER_LAG: Duration = Duration::from_secs(5);

/// What the publisher checks, and how often.
#[derive(Debug, Clone)]
pub struct OperationalSettings {
    /// Publish operational events at all (`--operational-events`).
    pub enabled: bool,
    /// How often the checks run.
    pub tick: Duration,
    /// Dead letters are reported in one event per window of this length.
    pub dead_letter_window: Duration,
    /// `backlog.delayed` once the longest-waiting due delivery has waited this long.
    pub backlog_after: Duration,
    /// `source.refusing` once a replica refused this many of a source's webhooks in a minute.
    pub refusals_per_minute: u64,
    /// Events retention (the janitor's): `retention.behind` when an event it could delete
    /// is older than this plus `retention_grace`.
    pub events_retention: Duration,
    /// How late retention may be before it is reported.
    pub retention_grace: Duration,
}

impl Default for OperationalSettings {
    fn default() -> Self {
        OperationalSettings {
            enabled: true,
            tick: Duration::from_secs(5),
            dead_letter_window: Duration::from_secs(60),
            backlog_after: Duration::from_secs(300),
            refusals_per_minute: 20,
            events_retention: crate::janitor::JanitorSettings::default().events_retention,
            retention_grace: Duration::from_secs(3600),
        }
    }
}

/// Run the checks every `settings.tick` until `stop`.
pub async fn run(pool: Pool, settings: OperationalSettings, instance: String, mut stop: watch::Receiver<bool>) {
    static FAILED: Throttle = Throttle::new(INTERVAL);
    if !settings.enabled {
        return;
    }
    let mut leadership = Leadership::new(LEASE_NAME, instance.clone(), (settings.tick * 3).max(Duration::from_secs(3)));
    let source = SourceId(SOURCE_ID);
    loop {
        tokio::select! {
            () = tokio::time::sleep(settings.tick) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let round = async {
            let published = refusals(&pool, source, &settings, &instance).await?
                + if leadership.leads(&pool).await { fleet_checks(&pool, source, &settings).await? } else { 0 };
            if published > 0 {
                crate::wake::notify().execute(&pool).await?;
            }
            Ok::<_, sqlx::Error>(())
        };
        let done = tokio::select! {
            done = round => done,
            _ = stop.wait_for(|s| *s) => break,
        };
        if let Err(e) = done {
            pool.note(&e);
            if let Some(left_out) = FAILED.admit() {
                tracing::warn!(error = %e, left_out, "operational events: a check failed; trying again at the next tick");
            }
        }
    }
}

/// The checks of the fleet's state, run by the lease holder (and by tests, racing); the
/// events published. Safe to run anywhere at any time: each check locks its state row.
pub async fn check_fleet(pool: &Pool, settings: &OperationalSettings) -> Result<usize, sqlx::Error> {
    fleet_checks(pool, SourceId(SOURCE_ID), settings).await
}

async fn fleet_checks(pool: &Pool, source: SourceId, settings: &OperationalSettings) -> Result<usize, sqlx::Error> {
    let due = Due::read(pool, source, settings).await?;
    let mut published = 0;
    if due.circuits {
        published += circuits(pool, source).await?;
    }
    if due.dead_letters {
        published += dead_letters(pool, source, settings).await?;
    }
    if due.backlog {
        published += backlog(pool, source, settings).await?;
    }
    if due.retention {
        published += retention(pool, source, settings).await?;
    }
    Ok(published)
}

/// Which fleet checks have anything to do this round, read without a lock or a
/// transaction: most rounds none has (no transition, the window still open, the backlog
/// and retention conditions where they stood), and a check is a transaction of four or
/// five round trips. A check that has something to do locks its state and reads
/// everything again, so deciding on a stale read costs at most a round's delay (the
/// next round reads again), never an event published twice or lost.
#[derive(Debug, Default)]
struct Due {
    circuits: bool,
    dead_letters: bool,
    backlog: bool,
    retention: bool,
}

impl Due {
    async fn read(pool: &Pool, source: SourceId, settings: &OperationalSettings) -> Result<Due, sqlx::Error> {
        let mut due = Due::default();
        for (name, standing) in state::all(pool).await? {
            match name.as_str() {
                "circuits" => {
                    due.circuits = crate::circuit::sql::any_transition_since(pool, circuits_since(&standing)).await?;
                }
                "dead_letters" => {
                    let close = dead_letters_close(&standing);
                    due.dead_letters = standing.until.is_none_or(|from| window_closed(from, close, settings));
                }
                "backlog" => {
                    let oldest = crate::queue::read::oldest_due(pool, source).await?;
                    due.backlog = backlog_late(&standing, oldest, settings) != standing.raised_at.is_some();
                }
                "retention" => {
                    let limit = retention_limit(&standing, settings);
                    let behind = crate::store::events::oldest_expired(pool, limit).await?.is_some();
                    due.retention = behind != standing.raised_at.is_some();
                }
                _ => {}
            }
        }
        Ok(due)
    }
}

/// Where the circuit check looks from: its window's end, less [`CIRCUIT_LOOKBACK`] for
/// transitions committed late.
fn circuits_since(standing: &state::Standing) -> DateTime<Utc> {
    standing.until.unwrap_or(standing.now) - CIRCUIT_LOOKBACK
}

/// Where the dead-letter check's current window ends: [`DEAD_LETTER_LAG`] before now.
fn dead_letters_close(standing: &state::Standing) -> DateTime<Utc> {
    standing.now - chrono_of(DEAD_LETTER_LAG)
}

/// Whether the dead-letter window from `from` to `close` is a whole window.
fn window_closed(from: DateTime<Utc>, close: DateTime<Utc>, settings: &OperationalSettings) -> bool {
    close - from >= chrono_of(settings.dead_letter_window)
}

/// Whether the longest-waiting due delivery (due at `oldest`) has waited past the threshold.
fn backlog_late(standing: &state::Standing, oldest: Option<DateTime<Utc>>, settings: &OperationalSettings) -> bool {
    oldest.is_some_and(|due| standing.now - due >= chrono_of(settings.backlog_after))
}

/// Events received before this should have been deleted by retention, grace included.
fn retention_limit(standing: &state::Standing, settings: &OperationalSettings) -> DateTime<Utc> {
    standing.now - chrono_of(settings.events_retention + settings.retention_grace)
}

/// Publish one operational event in `tx`; whether it is new (a repeat of its key is not).
pub async fn publish(
    tx: &mut PgConnection,
    source: SourceId,
    event_type: &'static str,
    key: &str,
    ordering_key: Option<&str>,
    data: Value,
) -> Result<bool, sqlx::Error> {
    let body = json!({"type": event_type, "timestamp": crate::clock::now(), "data": data});
    let payload = serde_json::to_vec(&body).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    let headers = json!({});
    let event = NewEvent {
        source_id: source,
        source_name: SOURCE,
        indexing: crate::search::Indexing::Content,
        dedupe_key: key,
        event_type,
        content_type: Some("application/json"),
        headers: &headers,
        payload: &payload,
        ordering_key,
        trace: None,
        terms: None,
    };
    let stored = crate::store::events::insert_in(tx, &event).await?;
    let new = stored.is_some_and(|s| !s.duplicate);
    if new {
        crate::metrics::operational_event(event_type);
        tracing::info!(event_type, key, "operational event published");
    }
    Ok(new)
}

/// An endpoint as operational events show it: its id and its URL without query or
/// credentials (a URL may carry a token).
fn endpoint(id: EndpointId, url: &str) -> Value {
    let shown = url::Url::parse(url).map_or_else(|_| String::new(), |u| crate::telemetry::redacted_url(&u));
    json!({"id": id, "url": shown})
}

/// The ordering key of an endpoint's events: its changes arrive in order where the
/// subscription asks for it.
fn line_of(id: EndpointId) -> String {
    format!("endpoint:{id}")
}

/// `endpoint.circuit.opened` / `closed` for each transition not yet published.
async fn circuits(pool: &Pool, source: SourceId) -> Result<usize, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let standing = state::lock(&mut tx, "circuits").await?;
    let transitions = crate::circuit::sql::transitions_since(&mut *tx, circuits_since(&standing), 500).await?;
    let mut published = 0;
    for t in &transitions {
        use crate::circuit::Transitioned;
        let event_type = match t.transition.change {
            Transitioned::Opened => "endpoint.circuit.opened",
            Transitioned::Closed => "endpoint.circuit.closed",
            // A failed probe: the circuit was open and stays open; reported when it closes.
            Transitioned::Reopened => continue,
        };
        let data = json!({
            "endpoint": endpoint(t.endpoint_id, &t.url),
            "at": t.transition.at,
            "consecutive_failures": t.transition.failures,
            "next_probe_at": t.transition.reopen_at,
        });
        let key = format!("circuit-transition:{}", t.id);
        published +=
            usize::from(publish(&mut tx, source, event_type, &key, Some(&line_of(t.endpoint_id)), data).await?);
    }
    // A full page: look again from its last transition next time.
    let until = match transitions.last() {
        Some(last) if transitions.len() == 500 => last.transition.at + CIRCUIT_LOOKBACK,
        _ => standing.now,
    };
    state::save(&mut tx, "circuits", Some(until), None).await?;
    tx.commit().await?;
    Ok(published)
}

/// `deliveries.dead_lettered`: one event per closed window with dead letters.
async fn dead_letters(pool: &Pool, source: SourceId, settings: &OperationalSettings) -> Result<usize, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let standing = state::lock(&mut tx, "dead_letters").await?;
    let close = dead_letters_close(&standing);
    let Some(from) = standing.until else {
        // The first run starts counting now: what died before is not news.
        state::save(&mut tx, "dead_letters", Some(close), None).await?;
        tx.commit().await?;
        return Ok(0);
    };
    if !window_closed(from, close, settings) {
        tx.rollback().await?;
        return Ok(0);
    }
    let counts = crate::queue::read::dead_between(&mut *tx, from, close, source).await?;
    let mut published = 0;
    if !counts.is_empty() {
        let total: i64 = counts.iter().map(|c| c.dead).sum();
        let endpoints: Vec<Value> = counts
            .iter()
            .take(20)
            .map(|c| json!({"endpoint": endpoint(c.endpoint_id, &c.url), "dead": c.dead}))
            .collect();
        let data = json!({"from": from, "until": close, "dead": total, "endpoints": endpoints,
                          "endpoints_total": counts.len()});
        let key = format!("dead-letters:{}", from.timestamp_micros());
        published += usize::from(publish(&mut tx, source, "deliveries.dead_lettered", &key, None, data).await?);
    }
    state::save(&mut tx, "dead_letters", Some(close), None).await?;
    tx.commit().await?;
    Ok(published)
}

/// `backlog.delayed` when the longest-waiting due delivery passes the threshold,
/// `backlog.recovered` when it is back under it.
async fn backlog(pool: &Pool, source: SourceId, settings: &OperationalSettings) -> Result<usize, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let standing = state::lock(&mut tx, "backlog").await?;
    let oldest = crate::queue::read::oldest_due(&mut *tx, source).await?;
    let waited = oldest.map(|due| standing.now - due);
    let late = backlog_late(&standing, oldest, settings);
    let published = match (standing.raised_at, late) {
        (None, true) => {
            let data = json!({"oldest_due_at": oldest, "waited_secs": waited.map(|w| w.num_seconds()),
                              "threshold_secs": settings.backlog_after.as_secs()});
            let key = format!("backlog-delayed:{}", standing.now.timestamp_micros());
            let new = publish(&mut tx, source, "backlog.delayed", &key, Some("backlog"), data).await?;
            state::save(&mut tx, "backlog", None, Some(standing.now)).await?;
            usize::from(new)
        }
        (Some(raised), false) => {
            let data = json!({"delayed_since": raised, "recovered_at": standing.now});
            let key = format!("backlog-recovered:{}", raised.timestamp_micros());
            let new = publish(&mut tx, source, "backlog.recovered", &key, Some("backlog"), data).await?;
            state::save(&mut tx, "backlog", None, None).await?;
            usize::from(new)
        }
        _ => 0,
    };
    tx.commit().await?;
    Ok(published)
}

/// `retention.behind` when an event retention could delete is older than the retention
/// plus its grace, `retention.recovered` when none is.
async fn retention(pool: &Pool, source: SourceId, settings: &OperationalSettings) -> Result<usize, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let standing = state::lock(&mut tx, "retention").await?;
    let oldest = crate::store::events::oldest_expired(&mut *tx, retention_limit(&standing, settings)).await?;
    let published = match (standing.raised_at, oldest) {
        (None, Some(oldest)) => {
            let data = json!({"oldest_expired_event_at": oldest, "retention_secs": settings.events_retention.as_secs(),
                              "grace_secs": settings.retention_grace.as_secs()});
            let key = format!("retention-behind:{}", standing.now.timestamp_micros());
            let new = publish(&mut tx, source, "retention.behind", &key, Some("retention"), data).await?;
            state::save(&mut tx, "retention", None, Some(standing.now)).await?;
            usize::from(new)
        }
        (Some(raised), None) => {
            let data = json!({"behind_since": raised, "recovered_at": standing.now});
            let key = format!("retention-recovered:{}", raised.timestamp_micros());
            let new = publish(&mut tx, source, "retention.recovered", &key, Some("retention"), data).await?;
            state::save(&mut tx, "retention", None, None).await?;
            usize::from(new)
        }
        _ => 0,
    };
    tx.commit().await?;
    Ok(published)
}

/// `source.refusing` for each source this replica refused at least the threshold of in
/// the current minute (once per source and minute, fleet-wide: the key).
async fn refusals(
    pool: &Pool,
    source: SourceId,
    settings: &OperationalSettings,
    instance: &str,
) -> Result<usize, sqlx::Error> {
    // The database's minute, so replicas whose clocks are off key one minute alike.
    let minute = crate::clock::now().timestamp().div_euclid(60);
    let over = tally::TALLY.over(minute, settings.refusals_per_minute);
    if over.is_empty() {
        return Ok(0);
    }
    let mut published = 0;
    let mut tx = pool.begin().await?;
    for (name, refused) in over {
        let minute_start = DateTime::<Utc>::from_timestamp(minute * 60, 0);
        let data = json!({"source": name, "minute": minute_start, "refused": refused.total,
                          "reasons": refused.reasons, "replica": instance,
                          "threshold": settings.refusals_per_minute});
        let key = format!("source-refusing:{name}:{minute}");
        published += usize::from(publish(&mut tx, source, "source.refusing", &key, None, data).await?);
    }
    tx.commit().await?;
    Ok(published)
}

/// Publish `endpoint.paused` or `endpoint.resumed` in `tx`, the transaction that changed it.
pub async fn paused_changed(
    tx: &mut PgConnection,
    id: EndpointId,
    url: &str,
    paused: bool,
    at: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    let source = SourceId(SOURCE_ID);
    let event_type = if paused { "endpoint.paused" } else { "endpoint.resumed" };
    let key = format!("{event_type}:{id}:{}", at.timestamp_micros());
    publish(tx, source, event_type, &key, Some(&line_of(id)), json!({"endpoint": endpoint(id, url), "at": at})).await?;
    Ok(())
}

fn chrono_of(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_source_id_is_the_one_the_fan_out_leaves_out() {
        let id = super::SOURCE_ID.to_string();
        assert_eq!(id, "00000000-0000-7000-8000-00000000ca7e");
        assert!(crate::queue::fanout::FANOUT.matches(id.as_str()).count() == 2);
    }
}
