//! How the recorder gathers a batch: what finished meanwhile, and at low load whatever
//! finishes within a linger, unless someone waits for the write.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};

/// Most outcomes in one statement.
pub const MAX_BATCH: usize = 256;
/// A batch of fewer outcomes waits for more, up to [`LINGER`] after its first arrived.
pub const SMALL_BATCH: usize = 64;
/// The longest a small batch waits. Recording later holds a worker slot and the lease
/// that much longer and delays the circuit's view by as much; it does not delay any
/// request, and it ends as soon as the dispatcher waits for a slot or room ([`Waiting`]).
/// At 300 webhooks/s, 25 ms against 5 ms took a webhook from 1.50 transactions to 1.15,
/// and its CPU (gateway and PostgreSQL) down by 11-21 % in 7 of 9 alternated pairs
/// (bench/PROFILE.md).
pub const LINGER: Duration = Duration::from_millis(25);

/// Whether the dispatcher waits for what only the recorder's next write frees: a worker
/// slot (every one is taken, some by outcomes not yet written) or room at an endpoint
/// (its last claim left due work behind: an endpoint at its `max_in_flight`, whose
/// leases end with their outcomes). While it does, no batch lingers: an endpoint limited
/// to one request at a time would otherwise wait a linger between requests.
#[derive(Debug, Default)]
pub struct Waiting {
    now: AtomicBool,
    began: Notify,
}

impl Waiting {
    /// The dispatcher's state: `true` while it waits.
    pub fn set(&self, waiting: bool) {
        if !self.now.swap(waiting, Ordering::SeqCst) && waiting {
            self.began.notify_one();
        }
    }

    /// Whether the dispatcher waits now.
    pub fn now(&self) -> bool {
        self.now.load(Ordering::SeqCst)
    }

    /// Returns once the dispatcher waits. A wake-up left from a wait that has since ended
    /// is not taken for one.
    async fn begun(&self) {
        loop {
            if self.now() {
                return;
            }
            self.began.notified().await;
        }
    }
}

/// Gather one batch into `batch`: `first`, whatever is already queued, and, while the
/// batch is smaller than [`SMALL_BATCH`], nothing in it is `urgent` and the dispatcher
/// is not `waiting`, whatever arrives within [`LINGER`] of `first`. Ends at once when the
/// channel closes (shutdown) or the dispatcher begins to wait. Says why it ended.
pub(super) async fn gather<T>(
    rx: &mut mpsc::Receiver<T>,
    first: T,
    batch: &mut Vec<T>,
    urgent: impl Fn(&T) -> bool,
    waiting: &Waiting,
) -> Ended {
    let deadline = tokio::time::Instant::now() + LINGER;
    let mut hurry = urgent(&first);
    batch.push(first);
    loop {
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(next) => {
                    hurry |= urgent(&next);
                    batch.push(next);
                }
                Err(_) => break,
            }
        }
        if batch.len() >= SMALL_BATCH {
            return Ended::Full;
        }
        if hurry {
            return Ended::Urgent;
        }
        if waiting.now() {
            return Ended::Waiting;
        }
        tokio::select! {
            next = tokio::time::timeout_at(deadline, rx.recv()) => match next {
                Ok(Some(next)) => {
                    hurry |= urgent(&next);
                    batch.push(next);
                }
                Ok(None) => return Ended::Closed,
                Err(_) => return Ended::Linger,
            },
            () = waiting.begun() => return Ended::Waiting,
        }
    }
}

/// Why a batch stopped gathering, counted per write
/// (`webhook_gateway_outcome_writes_total{ended}`): with the outcomes counted by
/// `webhook_gateway_attempts_total`, how full writes are, and how often the linger ran
/// out against how often something cut it short.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// [`SMALL_BATCH`] or more outcomes were there: no linger.
    Full,
    /// An outcome someone waits for (an ordered delivery's, a claim that sent nothing).
    Urgent,
    /// The dispatcher waited for a slot or room ([`Waiting`]).
    Waiting,
    /// The linger ran out.
    Linger,
    /// The channel closed (shutdown).
    Closed,
}

impl Ended {
    /// The metric's label.
    pub fn as_str(self) -> &'static str {
        match self {
            Ended::Full => "full",
            Ended::Urgent => "urgent",
            Ended::Waiting => "waiting",
            Ended::Linger => "linger",
            Ended::Closed => "closed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gather from a channel on paused time: the batch, and how long gathering took.
    async fn gathered(rx: &mut mpsc::Receiver<u32>, urgent: fn(&u32) -> bool) -> (Vec<u32>, Duration) {
        let (batch, waited, _) = gathered_beside(rx, urgent, &Waiting::default()).await;
        (batch, waited)
    }

    /// The same, beside a dispatcher whose waiting is `waiting`, and why it ended.
    async fn gathered_beside(
        rx: &mut mpsc::Receiver<u32>,
        urgent: fn(&u32) -> bool,
        waiting: &Waiting,
    ) -> (Vec<u32>, Duration, Ended) {
        let first = rx.recv().await.expect("a first outcome");
        let started = tokio::time::Instant::now();
        let mut batch = Vec::new();
        let ended = gather(rx, first, &mut batch, urgent, waiting).await;
        (batch, started.elapsed(), ended)
    }

    fn never(_: &u32) -> bool {
        false
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_outcome_waits_the_linger_and_no_longer() {
        let (tx, mut rx) = mpsc::channel(16);
        tx.send(1).await.unwrap();
        let (batch, waited) = gathered(&mut rx, never).await;
        assert_eq!(batch, vec![1]);
        assert_eq!(waited, LINGER);
    }

    #[tokio::test(start_paused = true)]
    async fn outcomes_that_arrive_within_the_linger_join_the_batch() {
        let (tx, mut rx) = mpsc::channel(16);
        tx.send(1).await.unwrap();
        let late = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(LINGER / 2).await;
            late.send(2).await.unwrap();
            tokio::time::sleep(LINGER).await;
            late.send(3).await.unwrap();
        });
        let (batch, waited) = gathered(&mut rx, never).await;
        assert_eq!(batch, vec![1, 2], "the third came after the linger");
        assert_eq!(waited, LINGER);
        let (next, _) = gathered(&mut rx, never).await;
        assert_eq!(next, vec![3]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_that_is_not_small_goes_at_once() {
        let (tx, mut rx) = mpsc::channel(MAX_BATCH * 2);
        for i in 0..SMALL_BATCH as u32 {
            tx.send(i).await.unwrap();
        }
        let (batch, waited) = gathered(&mut rx, never).await;
        assert_eq!(batch.len(), SMALL_BATCH);
        assert_eq!(waited, Duration::ZERO);
        // And never more than MAX_BATCH, however many are queued.
        for i in 0..(MAX_BATCH + 10) as u32 {
            tx.send(i).await.unwrap();
        }
        let (batch, _) = gathered(&mut rx, never).await;
        assert_eq!(batch.len(), MAX_BATCH);
    }

    #[tokio::test(start_paused = true)]
    async fn an_urgent_outcome_is_written_at_once_queued_or_late() {
        let (tx, mut rx) = mpsc::channel(16);
        tx.send(1).await.unwrap();
        tx.send(7).await.unwrap();
        let (batch, waited) = gathered(&mut rx, |n| *n == 7).await;
        assert_eq!((batch, waited), (vec![1, 7], Duration::ZERO), "an urgent one already queued");

        tx.send(1).await.unwrap();
        let late = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(LINGER / 5).await;
            late.send(7).await.unwrap();
        });
        let (batch, waited) = gathered(&mut rx, |n| *n == 7).await;
        assert_eq!((batch, waited), (vec![1, 7], LINGER / 5), "an urgent one arriving ends the wait");
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_ends_the_wait() {
        let (tx, mut rx) = mpsc::channel(16);
        tx.send(1).await.unwrap();
        tokio::spawn(async move {
            tokio::time::sleep(LINGER / 5).await;
            drop(tx);
        });
        let (batch, waited) = gathered(&mut rx, never).await;
        assert_eq!((batch, waited), (vec![1], LINGER / 5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_dispatcher_ends_the_wait_at_once_or_when_it_begins() {
        let waiting = std::sync::Arc::new(Waiting::default());
        let (tx, mut rx) = mpsc::channel(16);
        waiting.set(true);
        tx.send(1).await.unwrap();
        tx.send(2).await.unwrap();
        let (batch, waited, _) = gathered_beside(&mut rx, never, &waiting).await;
        assert_eq!((batch, waited), (vec![1, 2], Duration::ZERO), "waiting already: what is queued goes at once");

        // The dispatcher stops waiting; a wake-up left over from its wait does not end
        // the next linger, and a wait that begins halfway through it does.
        waiting.set(false);
        tx.send(3).await.unwrap();
        let (batch, waited, _) = gathered_beside(&mut rx, never, &waiting).await;
        assert_eq!((batch, waited), (vec![3], LINGER), "no wait, no hurry");
        tx.send(4).await.unwrap();
        let dispatcher = waiting.clone();
        tokio::spawn(async move {
            tokio::time::sleep(LINGER / 5).await;
            dispatcher.set(true);
        });
        let (batch, waited, _) = gathered_beside(&mut rx, never, &waiting).await;
        assert_eq!((batch, waited), (vec![4], LINGER / 5), "the wait began");
    }

    #[test]
    fn the_dispatchers_state_is_what_it_last_set() {
        let waiting = Waiting::default();
        assert!(!waiting.now());
        waiting.set(true);
        waiting.set(true);
        assert!(waiting.now());
        waiting.set(false);
        assert!(!waiting.now());
    }

    #[tokio::test(start_paused = true)]
    async fn each_batch_says_why_it_stopped_gathering() {
        let idle = Waiting::default();
        let (tx, mut rx) = mpsc::channel(MAX_BATCH);
        tx.send(1).await.unwrap();
        assert_eq!(gathered_beside(&mut rx, never, &idle).await.2, Ended::Linger);
        for i in 0..SMALL_BATCH as u32 {
            tx.send(i).await.unwrap();
        }
        assert_eq!(gathered_beside(&mut rx, |n| *n == 0, &idle).await.2, Ended::Full, "full before urgent");
        tx.send(7).await.unwrap();
        assert_eq!(gathered_beside(&mut rx, |n| *n == 7, &idle).await.2, Ended::Urgent);
        let waiting = Waiting::default();
        waiting.set(true);
        tx.send(1).await.unwrap();
        assert_eq!(gathered_beside(&mut rx, never, &waiting).await.2, Ended::Waiting);
        tx.send(1).await.unwrap();
        drop(tx);
        assert_eq!(gathered_beside(&mut rx, never, &idle).await.2, Ended::Closed);
        let labels: Vec<&str> =
            [Ended::Full, Ended::Urgent, Ended::Waiting, Ended::Linger, Ended::Closed].map(Ended::as_str).to_vec();
        assert_eq!(labels, ["full", "urgent", "waiting", "linger", "closed"]);
    }
}
