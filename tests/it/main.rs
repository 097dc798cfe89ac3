//! Integration tests: real PostgreSQL, real HTTP, one binary (so one embedded cluster per
//! run when DATABASE_URL is unset).

mod support;

mod admin_api;
mod binary;
mod circuit;
mod console;
mod db_outage;
mod db_partition;
mod delivery;
mod embedded;
mod fairness;
mod fanout;
mod first_run;
mod hostile_ingest;
mod hostile_subscriber;
mod ingest;
mod isolation;
mod janitor;
mod metrics;
mod openapi;
mod operator;
mod ordering;
mod otel;
mod plans;
mod quickstart;
mod replicas;
mod secrets;
mod slow_clients;
mod sources;
