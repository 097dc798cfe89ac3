//! A webhook provider for tests: posts webhooks with unique ids and retries each until it
//! is answered 2xx, recording every answer.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;

/// What a producer saw: every answer's status, and the ids acknowledged (2xx).
#[derive(Default)]
pub struct Seen {
    /// Every answer's status (0: no answer).
    pub statuses: BTreeMap<u16, usize>,
    /// The ids answered 2xx.
    pub acknowledged: HashSet<String>,
    /// 503 answers without `Retry-After`.
    pub without_retry_after: usize,
    /// Every answer: when it came, its status.
    pub answers: Vec<(std::time::Instant, u16)>,
}

/// Post `ids` to `source` on `gateway`, `concurrency` at a time, each retried (a pause
/// between tries) until it is answered 2xx, as a webhook provider does, for at most
/// `patience` per webhook. Connection errors count as status 0.
pub async fn produce(
    gateway: String,
    source: &'static str,
    ids: Vec<String>,
    concurrency: usize,
    seen: Arc<Mutex<Seen>>,
) {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(15)).build().expect("client");
    let queue = Arc::new(Mutex::new(ids));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, queue, seen) = (http.clone(), queue.clone(), seen.clone());
        let url = format!("{gateway}/ingest/{source}");
        tasks.push(tokio::spawn(async move {
            loop {
                let Some(id) = queue.lock().unwrap().pop() else { return };
                let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
                loop {
                    let answer = http
                        .post(&url)
                        .header("x-delivery-id", &id)
                        .header("x-event-type", "order.created")
                        .header("content-type", "application/json")
                        .body(json!({"order": id, "customer": format!("c{}", id.len() % 7)}).to_string())
                        .send()
                        .await;
                    let status = answer.as_ref().map(|a| a.status().as_u16()).unwrap_or(0);
                    {
                        let mut seen = seen.lock().unwrap();
                        *seen.statuses.entry(status).or_default() += 1;
                        seen.answers.push((std::time::Instant::now(), status));
                        if status == 503 && answer.as_ref().is_ok_and(|a| !a.headers().contains_key("retry-after")) {
                            seen.without_retry_after += 1;
                        }
                        if (200..300).contains(&status) {
                            seen.acknowledged.insert(id.clone());
                        }
                    }
                    if (200..300).contains(&status) {
                        break;
                    }
                    assert!(tokio::time::Instant::now() < give_up, "webhook {id} never acknowledged (last {status})");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("producer task");
    }
}

impl Seen {
    /// The longest time between two consecutive 2xx answers after `since` (an outage as
    /// producers saw it).
    pub fn longest_gap_after(&self, since: std::time::Instant) -> Duration {
        let mut acks: Vec<std::time::Instant> =
            self.answers.iter().filter(|(at, s)| *at >= since && (200..300).contains(s)).map(|(at, _)| *at).collect();
        acks.sort();
        acks.windows(2).map(|w| w[1] - w[0]).max().unwrap_or_default()
    }
}
