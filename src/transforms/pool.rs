//! Where runs happen: short ones on the caller's thread ([`run`]), the others on the
//! transformation threads, one per core, started on first use, each keeping its own warm
//! contexts ([`super::apply`]).
//!
//! **Why threads of their own.** A run is synchronous JavaScript that may take up to
//! [`super::TIME_LIMIT`]. On the async runtime's threads it would stall every task queued
//! behind it; `block_in_place` avoids that but hands the runtime's core to another thread
//! each time, so the thread that runs the next script is rarely the one whose context is
//! warm (measured: three runs in four built a new context). Here the threads are fixed,
//! so their warm contexts stay warm, and their number bounds how many runs (each up to
//! [`super::MEMORY_LIMIT`]) exist at once, whatever the number of delivery workers.

use std::sync::{Arc, LazyLock, Mutex};

use tokio::sync::{mpsc, oneshot};

/// One run to do, and where its answer goes.
struct Job {
    script: Arc<str>,
    webhook: super::Webhook,
    reply: oneshot::Sender<Result<Vec<u8>, String>>,
}

/// Runs waiting for a thread, at most: a full queue makes callers wait (their deliveries
/// stay leased), it does not grow.
const QUEUE: usize = 256;

static POOL: LazyLock<mpsc::Sender<Job>> = LazyLock::new(start);

fn start() -> mpsc::Sender<Job> {
    let (tx, rx) = mpsc::channel::<Job>(QUEUE);
    let rx = Arc::new(Mutex::new(rx));
    let threads = std::thread::available_parallelism().map_or(2, std::num::NonZero::get);
    for n in 0..threads {
        let rx = rx.clone();
        let spawned = std::thread::Builder::new().name(format!("transform-{n}")).spawn(move || serve(&rx));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a transformation thread");
        }
    }
    tx
}

/// Take jobs until the sender is gone. One thread waits on the queue at a time (holding
/// the lock); the others wait for the lock.
fn serve(rx: &Mutex<mpsc::Receiver<Job>>) {
    loop {
        let job = {
            let Ok(mut rx) = rx.lock() else { return };
            rx.blocking_recv()
        };
        let Some(job) = job else { return };
        // A panic in the engine ends this run, not the thread (nor the others' queue).
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| super::apply(&job.script, &job.webhook)))
            .unwrap_or_else(|_| Err("the script engine failed".to_owned()));
        // The caller may have gone (its task cancelled at shutdown): nothing to tell.
        let _ = job.reply.send(ran);
    }
}

/// Run `script`'s `handler` on `webhook`: the body to send, or why there is none (the
/// bounds of [`super::apply`] hold).
///
/// **Short runs stay on the caller's thread.** Handing a run to a transformation thread
/// and its answer back costs two thread wake-ups, about as much CPU as a short handler
/// itself (measured in bench row 15). So a small webhook (`INLINE_BYTES`) whose script
/// has never been slow runs here, cut off after `INLINE_LIMIT`: a runtime thread is
/// held at most that long. A script cut off here is remembered as slow (`slow`) and
/// its runs, this one included, go to the transformation threads with the full bound.
pub async fn run(script: &str, webhook: super::Webhook) -> Result<Vec<u8>, String> {
    if webhook.parsed_bytes() <= INLINE_BYTES && !slow::is(script) {
        match super::apply_within(script, &webhook, INLINE_LIMIT) {
            Err(failed) if failed.timed_out => slow::remember(script),
            done => return done.map_err(|failed| failed.reason),
        }
    }
    run_apart(script, webhook).await
}

/// Longest a run may hold the caller's (runtime) thread before it is given up there.
pub const INLINE_LIMIT: std::time::Duration = std::time::Duration::from_millis(2);
/// Largest webhook run on the caller's thread: parsing takes time in proportion to size,
/// and a large body must not make its script look slow.
pub const INLINE_BYTES: usize = 64 * 1024;

/// Run `script` on a transformation thread, with the full bounds: what [`run`] does with
/// a large webhook or a slow script, and what a script nobody has run yet needs (trying
/// one through the API or the console), whose first run must not hold a runtime thread
/// (a native call runs past the interrupt that bounds a run).
pub async fn run_apart(script: &str, webhook: super::Webhook) -> Result<Vec<u8>, String> {
    let (reply, answer) = oneshot::channel();
    let job = Job { script: script.into(), webhook, reply };
    POOL.send(job).await.map_err(|_| "no transformation thread is running".to_owned())?;
    answer.await.map_err(|_| "the transformation thread stopped".to_owned())?
}

/// Scripts that once ran longer than [`INLINE_LIMIT`] on a small webhook, by hash: from
/// then on they run on the transformation threads only. The set is per process and
/// bounded; when full it starts over (a slow script then costs one more cut-off run).
mod slow {
    use std::collections::HashSet;
    use std::sync::{LazyLock, Mutex};

    const MOST: usize = 4096;
    static SLOW: LazyLock<Mutex<HashSet<u64>>> = LazyLock::new(Mutex::default);

    fn key(script: &str) -> u64 {
        xxhash_rust::xxh3::xxh3_64(script.as_bytes())
    }

    /// `script` was cut off on a caller's thread before.
    pub fn is(script: &str) -> bool {
        SLOW.lock().is_ok_and(|set| set.contains(&key(script)))
    }

    /// Remember `script` as slow.
    pub fn remember(script: &str) {
        if let Ok(mut set) = SLOW.lock() {
            if set.len() >= MOST {
                set.clear();
            }
            set.insert(key(script));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A webhook of `payload`, as a handler gets it.
    pub(super) fn hook(payload: String) -> crate::transforms::Webhook {
        crate::transforms::Webhook::new(payload.into(), None, "t".into(), None)
    }

    /// Runs from many tasks at once all come back, each with its own answer, and a
    /// runaway script (cut off on the caller's thread, then on a transformation thread
    /// with the full bound) does not stop the others' answers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_runs_each_get_their_own_answer() {
        let echo = "function handler(w) { return {n: w.payload.n}; }";
        let spin = "function handler(w) { while (true) {} }";
        let mut runs = tokio::task::JoinSet::new();
        for n in 0..200 {
            runs.spawn(async move { (n, run(echo, hook(format!(r#"{{"n":{n}}}"#))).await) });
        }
        runs.spawn(async move { (-1, run(spin, hook("{}".to_owned())).await) });
        let mut seen = 0;
        while let Some(done) = runs.join_next().await {
            let (n, ran) = done.expect("task");
            if n < 0 {
                assert!(ran.expect_err("cut off").contains("ran longer than"));
            } else {
                assert_eq!(ran.expect("echo"), format!(r#"{{"n":{n}}}"#).into_bytes());
                seen += 1;
            }
        }
        assert_eq!(seen, 200);
    }
}

#[cfg(test)]
mod inline_tests {
    use super::tests::hook;
    use super::*;

    /// A script that is slow on a small webhook (or slow to evaluate) is cut off on the
    /// caller's thread after [`INLINE_LIMIT`], runs again on a transformation thread with
    /// the full bound (so a handler that needs 20 ms still gets its answer), and from then
    /// on goes there directly; a fast script keeps running on the caller's thread.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_script_moves_to_the_transformation_threads_and_still_answers() {
        let busy =
            "function handler(w) { const until = Date.now() + 20; while (Date.now() < until) {} return 'done'; }";
        assert!(!slow::is(busy));
        assert_eq!(run(busy, hook("{}".to_owned())).await.expect("answered on the pool"), b"\"done\"");
        assert!(slow::is(busy), "remembered as slow");
        assert_eq!(run(busy, hook("{}".to_owned())).await.expect("answered"), b"\"done\"");
        // Slow to evaluate (its top level runs 20 ms): building its context counts as the
        // run, so it is cut off on the caller's thread too, and answered on the pool.
        let slow_start =
            "const until = Date.now() + 20; while (Date.now() < until) {} function handler(w) { return 'ready'; }";
        assert_eq!(run(slow_start, hook("{}".to_owned())).await.expect("answered on the pool"), b"\"ready\"");
        assert!(slow::is(slow_start), "remembered as slow");
        let quick = "function handler(w) { return w.payload.n + 1; }";
        assert_eq!(run(quick, hook(r#"{"n":41}"#.to_owned())).await.expect("answered"), b"42");
        assert!(!slow::is(quick));
        // A large body runs on the pool whatever its script, and does not mark it slow.
        let big = hook(format!(r#"{{"n":1,"pad":"{}"}}"#, "x".repeat(INLINE_BYTES)));
        assert_eq!(run(quick, big).await.expect("answered"), b"2");
        assert!(!slow::is(quick));
    }
}
