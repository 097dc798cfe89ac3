//! webhook-gateway: durable webhook ingestion and delivery on PostgreSQL.
//!
//! See `ARCHITECTURE.md` for the module map, the data flow and the invariants.

pub mod egress;
pub mod verify;
