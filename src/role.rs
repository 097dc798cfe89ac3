//! Which parts of the gateway a process runs: chosen by `config`, obeyed by `app` and `api`.

use clap::ValueEnum;
use serde::Deserialize;

/// Which parts of the gateway a process runs, so ingest and delivery can scale apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// HTTP ingest, admin API and delivery workers.
    All,
    /// HTTP ingest and admin API only.
    Ingest,
    /// Delivery workers only (still serves /healthz, /readyz and /metrics).
    Worker,
}

impl Role {
    /// Whether this role runs delivery workers.
    pub fn runs_workers(self) -> bool {
        matches!(self, Role::All | Role::Worker)
    }
}
