//! Integration tests: real PostgreSQL, real HTTP, one binary (so one embedded cluster per
//! run when DATABASE_URL is unset).

mod support;

mod admin_api;
mod binary;
mod circuit;
mod db_outage;
mod delivery;
mod embedded;
mod hostile_ingest;
mod hostile_subscriber;
mod ingest;
mod isolation;
mod janitor;
mod metrics;
mod openapi;
mod operator;
mod replicas;
mod secrets;
mod sources;
