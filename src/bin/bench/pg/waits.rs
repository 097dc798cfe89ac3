//! What PostgreSQL's client backends do during a measured window: on the CPU, waiting
//! for the WAL's flush, or waiting for something else, sampled from `pg_stat_activity`
//! every 10 ms by a loop inside one server-side statement (the same as `bench/waits.sql`).
//! A sampler that started a client per sample took a tenth of a core and halved the
//! rate it measured; this one costs one sleeping backend.
//!
//! It says what bounds a rate when the CPU does not: at 16 connections pgbench's
//! transactions queue for the WAL's flush, while the gateway's two group-commit batches
//! take turns with under one statement in PostgreSQL at a time (bench/PROFILE.md,
//! "Ingest at 16 connections: two batches taking turns").

use std::time::Duration;

use tokio::task::JoinHandle;

/// The sampler's table (temporary, in its own session): every statement of the sampler
/// names it, so the statement tables of a run can leave them out.
pub const TABLE: &str = "wg_bench_waits";

/// What [`watch`] saw.
#[derive(Debug, Clone)]
pub struct Watched {
    /// The backends' states.
    pub waits: Waits,
    /// The WAL's flushes a second over the same window (`pg_stat_wal`).
    pub flushes: Option<f64>,
}

/// Watch the server `url` reaches in a measured window that begins after `delay` and
/// lasts `window` (less a second at its end, so the sampler stops inside it), on a
/// connection of its own: the backends' states ([`sample`]) and the WAL's flushes a
/// second. `None` when it could not (said on stderr).
pub fn watch(url: &str, delay: Duration, window: Duration) -> JoinHandle<Option<Watched>> {
    let url = url.to_owned();
    tokio::spawn(async move {
        tokio::time::sleep(delay + Duration::from_millis(300)).await;
        let pool = super::pool(&url, 1).await.ok()?;
        let before = super::wal(&pool).await.ok();
        let started = std::time::Instant::now();
        let sampled = sample(&pool, window.saturating_sub(Duration::from_secs(1)).max(Duration::from_secs(1))).await;
        let after = super::wal(&pool).await.ok();
        pool.close().await;
        let waits = sampled.inspect_err(|e| eprintln!("bench: sampling PostgreSQL's waits failed: {e:#}")).ok()?;
        let flushes = before.zip(after).map(|(b, a)| (a.syncs - b.syncs) / started.elapsed().as_secs_f64());
        Some(Watched { waits, flushes })
    })
}

/// What `watching` saw, as a row's note, with the flushes per `unit` at `rate` units a
/// second; none when nothing was seen (a role that may not read other sessions' states
/// sees no backend).
pub async fn note(watching: JoinHandle<Option<Watched>>, rate: f64, unit: &str) -> Option<String> {
    let Watched { waits, flushes } = watching.await.ok()??;
    if waits == Waits::default() {
        return None;
    }
    Some(match flushes {
        Some(f) => format!("{}; {f:.0} WAL flushes a second, {:.2} a {unit}", waits.note(), f / rate.max(1e-9)),
        None => waits.note(),
    })
}

/// Average client backends in each state over a window (the sampler's own left out).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Waits {
    /// Active with no wait event: running, or runnable and waiting for a core.
    pub cpu: f64,
    /// Waiting for the WAL to reach the disk: its own flush, or the lock another
    /// backend's flush holds.
    pub wal_flush: f64,
    /// Any other wait (a lock, a buffer, a data file, the client).
    pub other: f64,
    /// The largest of the other waits: `type:event` and its backends on average.
    pub top_other: Option<(String, f64)>,
}

/// What a sample's `wait_event_type` and `wait_event` say a backend is doing.
fn state(wait_event_type: Option<&str>, wait_event: Option<&str>) -> State {
    match (wait_event_type, wait_event) {
        (None, _) => State::Cpu,
        (Some("IO"), Some("WALSync" | "WALWrite" | "WALInitSync" | "WALInitWrite")) => State::WalFlush,
        (Some("LWLock"), Some("WALWrite")) => State::WalFlush,
        _ => State::Other,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Cpu,
    WalFlush,
    Other,
}

/// Sample the client backends of the server `pool` reaches every 10 ms for about
/// `window`, and average them. `pool` holds one connection (its temporary table lives in
/// that session).
pub async fn sample(pool: &sqlx::PgPool, window: Duration) -> anyhow::Result<Waits> {
    use sqlx::Row as _;
    let samples = (window.as_millis() / 10).max(1) as i32;
    // The table first, in a transaction of its own: the sampling loop below must not
    // hold a transaction id (or a snapshot) for its whole window, or PostgreSQL keeps
    // every row version that dies meanwhile (no index entry of a finished lease is
    // killed, no page pruned) and the measured statements pay for it: a first sampler
    // that wrote each sample into the table as it went made the in-flight count of a
    // lone webhook's lease visit 11,000 dead index entries 40 s into row 5 at 500/s.
    sqlx::raw_sql(&format!(
        "CREATE TEMP TABLE IF NOT EXISTS {TABLE} (wait_event_type text, wait_event text, n int8); TRUNCATE {TABLE}"
    ))
    .execute(pool)
    .await?;
    // One round trip, the loop inside it, counting in a variable and committing after
    // each sample (a DO sent alone, outside a transaction block, may): a DO otherwise
    // holds its snapshot to its end. Nothing is written until the loop has ended.
    sqlx::raw_sql(&format!(
        "DO $$
         DECLARE
             counts jsonb := '{{}}';
             seen record;
         BEGIN
             FOR n IN 1..{samples} LOOP
                 FOR seen IN
                     SELECT coalesce(wait_event_type, '-') || '/' || coalesce(wait_event, '-') AS what
                     FROM pg_stat_activity
                     WHERE state = 'active' AND backend_type = 'client backend' AND pid <> pg_backend_pid()
                 LOOP
                     counts := counts || jsonb_build_object(seen.what, coalesce((counts ->> seen.what)::int8, 0) + 1);
                 END LOOP;
                 PERFORM pg_stat_clear_snapshot();
                 PERFORM pg_sleep(0.01);
                 -- Ends the DO's transaction and its snapshot (a DO sent alone may).
                 COMMIT;
             END LOOP;
             INSERT INTO {TABLE}
             SELECT nullif(split_part(c.key, '/', 1), '-'), nullif(split_part(c.key, '/', 2), '-'), c.value::int8
             FROM jsonb_each_text(counts) AS c;
         END $$"
    ))
    .execute(pool)
    .await?;
    let rows = sqlx::raw_sql(&format!("SELECT wait_event_type, wait_event, n FROM {TABLE}")).fetch_all(pool).await?;
    let counts = rows
        .iter()
        .map(|row| Ok((row.try_get("wait_event_type")?, row.try_get("wait_event")?, row.try_get("n")?)))
        .collect::<Result<Vec<(Option<String>, Option<String>, i64)>, sqlx::Error>>()?;
    Ok(average(counts.iter().map(|(t, e, n)| (t.as_deref(), e.as_deref(), *n)), samples))
}

/// Counts of backends seen in each `(wait_event_type, wait_event)` over `samples`
/// samples, as averages.
fn average<'a>(counts: impl Iterator<Item = (Option<&'a str>, Option<&'a str>, i64)>, samples: i32) -> Waits {
    let mut waits = Waits::default();
    for (wait_event_type, wait_event, n) in counts {
        let share = n as f64 / f64::from(samples.max(1));
        match state(wait_event_type, wait_event) {
            State::Cpu => waits.cpu += share,
            State::WalFlush => waits.wal_flush += share,
            State::Other => {
                waits.other += share;
                if waits.top_other.as_ref().is_none_or(|(_, top)| share > *top) {
                    let name = format!("{}:{}", wait_event_type.unwrap_or("?"), wait_event.unwrap_or("?"));
                    waits.top_other = Some((name, share));
                }
            }
        }
    }
    waits
}

impl Waits {
    /// For a row's note.
    pub fn note(&self) -> String {
        let top = match &self.top_other {
            Some((name, share)) if *share >= 0.01 => format!(" (most {name}, {share:.2})"),
            _ => String::new(),
        };
        format!(
            "PostgreSQL's client backends on average (sampled every 10 ms): {:.2} on the CPU, {:.2} waiting for the \
             WAL's flush, {:.2} in other waits{top}",
            self.cpu, self.wal_flush, self.other
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flush_is_told_from_the_cpu_and_from_other_waits() {
        assert_eq!(state(None, None), State::Cpu);
        assert_eq!(state(Some("IO"), Some("WALSync")), State::WalFlush);
        assert_eq!(state(Some("LWLock"), Some("WALWrite")), State::WalFlush);
        assert_eq!(state(Some("LWLock"), Some("WALInsert")), State::Other);
        assert_eq!(state(Some("IO"), Some("DataFileRead")), State::Other);
        assert_eq!(state(Some("Lock"), Some("transactionid")), State::Other);
    }

    #[test]
    fn counts_become_backends_on_average() {
        let counts = [
            (None, None, 420),
            (Some("IO"), Some("WALSync"), 300),
            (Some("LWLock"), Some("WALWrite"), 30),
            (Some("Lock"), Some("extend"), 50),
        ];
        let waits = average(counts.into_iter(), 1000);
        let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(near(waits.cpu, 0.42) && near(waits.wal_flush, 0.33) && near(waits.other, 0.05), "{waits:?}");
        assert_eq!(waits.top_other, Some(("Lock:extend".to_owned(), 0.05)));
        assert!(waits.note().ends_with("0.05 in other waits (most Lock:extend, 0.05)"), "{}", waits.note());
    }

    #[test]
    fn the_largest_other_wait_is_named() {
        let counts = [(Some("Lock"), Some("tuple"), 30), (Some("Lock"), Some("transactionid"), 120), (None, None, 5)];
        let waits = average(counts.into_iter(), 100);
        assert_eq!(waits.top_other, Some(("Lock:transactionid".to_owned(), 1.2)));
        assert!((waits.other - 1.5).abs() < 1e-9, "{waits:?}");
    }
}
