//! Delivery workers: claim due deliveries, POST them, record the outcome.
//!
//! One dispatcher per process owns `workers` slots (a semaphore). It claims only as many
//! deliveries as it has free slots, and starts each claimed delivery at once: nothing is
//! claimed and then left waiting (a claimed row that is not being worked on would sit
//! out its lease for nothing). The claim, the HTTP request and the record are three
//! separate steps with no transaction held across the request.
//!
//! - [`dispatcher`]: the claim loop (half-open probes on the housekeeping leader), graceful stop;
//! - [`housekeeping`]: parking and releasing circuit backlogs, by one replica of the fleet;
//! - [`attempt`]: one attempt of one delivery, from the claim to the outcome it hands
//!   the recorder (its decisions are pure functions: [`attempt::judge`],
//!   [`attempt::schedule`]);
//! - [`prelease`]: a lone webhook's deliveries leased by the statement that stores it
//!   (role `all`), handed to the dispatcher with their worker slots; the recorder hands
//!   over the same way the next heads of ordered lines its write leased;
//! - [`recorder`]: batched, fenced, idempotent outcome writes;
//! - [`policy`] and [`backoff`] (pure), [`request`] and [`sign`] (the outbound request),
//!   [`urls`] (endpoint URLs parsed once).

pub mod attempt;
pub mod backoff;
pub mod bodies;
pub mod dispatcher;
pub mod housekeeping;
pub mod policy;
pub mod prelease;
pub mod recorder;
pub mod request;
mod settings;
pub mod sign;
#[cfg(test)]
mod tests_props;
pub mod urls;

pub use dispatcher::{Dispatcher, MAX_CLAIM_BATCH};
pub use housekeeping::Housekeeping;
pub use settings::DeliverySettings;
