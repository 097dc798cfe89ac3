//! webhook-gateway: durable webhook ingestion and delivery on PostgreSQL.
//!
//! See `ARCHITECTURE.md` for the module map, the data flow and the invariants.

pub mod actions;
pub mod admin_token;
pub mod api;
pub mod app;
pub mod audit;
pub mod banner;
pub mod circuit;
pub mod cli;
pub mod clock;
pub mod config;
pub mod console;
pub mod db;
pub mod deliver;
pub mod egress;
pub mod error;
pub mod fanout;
pub mod filters;
pub mod ids;
pub mod ingest;
pub mod invariants;
pub mod janitor;
pub mod lease;
pub mod log_throttle;
pub mod memory;
pub mod metrics;
pub mod operational;
#[cfg(test)]
mod props;
pub mod queue;
pub mod role;
pub mod roster;
pub mod sanitize;
pub mod search;
pub mod secrets;
pub mod server;
pub mod state;
pub mod store;
pub mod telemetry;
pub mod tokens;
pub mod transforms;
pub mod verify;
pub mod wake;
