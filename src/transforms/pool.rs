//! The transformation threads: one per core, started on first use, each keeping its own
//! warm contexts ([`super::apply`]).
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
    webhook: String,
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

/// Run `script`'s `handler` on `webhook` on a transformation thread: the body to send, or
/// why there is none (the bounds of [`super::apply`] hold).
pub async fn run(script: impl Into<Arc<str>>, webhook: String) -> Result<Vec<u8>, String> {
    let (reply, answer) = oneshot::channel();
    let job = Job { script: script.into(), webhook, reply };
    POOL.send(job).await.map_err(|_| "no transformation thread is running".to_owned())?;
    answer.await.map_err(|_| "the transformation thread stopped".to_owned())?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs from many tasks at once all come back, each with its own answer, and a
    /// runaway script cut off on one thread does not stop the others' answers.
    #[tokio::test]
    async fn concurrent_runs_each_get_their_own_answer() {
        let echo = "function handler(w) { return {n: w.payload.n}; }";
        let spin = "function handler(w) { while (true) {} }";
        let mut runs = tokio::task::JoinSet::new();
        for n in 0..200 {
            runs.spawn(async move { (n, run(echo, format!(r#"{{"payload":{{"n":{n}}}}}"#)).await) });
        }
        runs.spawn(async move { (-1, run(spin, r#"{"payload":{}}"#.to_owned()).await) });
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
