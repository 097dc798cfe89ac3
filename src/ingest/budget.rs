//! Admission by bytes at ingest (`--ingest-memory-mib`, a [`MemoryBudget`]).
//!
//! A request reserves its declared `Content-Length` (the body limit when it declares none)
//! before a byte of its body is read, and keeps the reservation until it is answered,
//! after its commit. When the budget has no room, it is answered at once with 503
//! `overloaded` and `Retry-After`, its body unread: senders retry webhooks, and nothing
//! was stored. Each body is counted [`COPIES`] times: what holding one costs, measured
//! (bench row 17): the chunks read and the body they are joined into, its parse when the
//! source takes the event type or key from it, and its copy in the statement that stores
//! it (with that statement's buffer growing by doubling).

pub use crate::memory::MemoryBudget;

/// How many times a body's size is reserved (see the module's documentation).
pub const COPIES: u64 = 4;

/// The ingest budget of `bytes`.
pub fn ingest_budget(bytes: u64) -> MemoryBudget {
    MemoryBudget::new(bytes, COPIES)
}
