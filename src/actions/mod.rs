//! What operators do, wherever they do it from. The admin API's handlers (`crate::api`) and
//! the web console's forms (`crate::console`) both call these functions, so pausing an
//! endpoint or redelivering a webhook is one act (the same checks, the same log line, the
//! same wake-up of this process's workers) from either; HTTP (extractors, status codes,
//! pages) stays in the callers. Errors are [`ApiError`](crate::error::ApiError)s, which
//! both callers answer with.

mod deliveries;
mod endpoints;
mod events;
mod sources;

pub use deliveries::{redeliver_one, unblock};
pub use endpoints::{
    ROTATION_GRACE, Recover, Recovered, RotateSecret, RotatedSecret, TestSend, delete_endpoint, generate_secret,
    recover_window, recovery_window, rotate, send_test, set_paused,
};
pub(crate) use endpoints::{seal, validate_secret};
pub use events::{
    EVENT_DELIVERIES, EventSearch, ShownEvent, delivery_attempts, event_with_deliveries, search_events, try_filter,
    try_transform,
};
pub use sources::fingerprints;
