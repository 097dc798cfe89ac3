//! Integration tests: real PostgreSQL, real HTTP, one binary (so one embedded cluster per
//! run when DATABASE_URL is unset).

// Tests inspect and arrange the database with their own statements (plain sqlx).
#![allow(clippy::disallowed_methods)]

mod support;

mod abandoned_calls;
mod admin_api;
mod binary;
mod cascades;
mod circuit;
mod clock_skew;
mod console;
mod db_outage;
mod db_partition;
mod delivery;
mod delivery_memory;
mod embedded;
mod failover;
mod fairness;
mod fanout;
mod filters;
mod first_run;
mod fleet;
mod hostile_ingest;
mod hostile_subscriber;
mod ingest;
mod isolation;
mod janitor;
mod lean;
mod lean_batch;
mod leases;
mod line_leases;
mod lost_claims;
mod metrics;
mod openapi;
mod operational;
mod operator;
mod ordering;
mod otel;
mod plans;
mod pooler;
mod pooler_failures;
mod prelease;
mod prelease_batch;
mod prelease_dispatch;
mod prelease_locked;
mod prelease_statement;
mod quickstart;
mod refusals;
mod replicas;
mod rolling;
mod roster;
mod schemas;
mod search;
mod second_chances;
mod secrets;
mod server_settings;
mod slow_clients;
mod sources;
mod tls_database;
mod token_payloads;
mod tokens;
mod transforms;
mod upgrades;
mod warm_connections;
