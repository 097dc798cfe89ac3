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
    /// The role as `--role` spells it: what the fleet's roster writes and the build-info
    /// metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Role::All => "all",
            Role::Ingest => "ingest",
            Role::Worker => "worker",
        }
    }

    /// Whether this role runs delivery workers.
    pub fn runs_workers(self) -> bool {
        matches!(self, Role::All | Role::Worker)
    }
}

#[cfg(test)]
mod tests {
    use super::Role;
    use clap::ValueEnum;

    #[test]
    fn a_role_s_name_is_its_flag_s_value() {
        for role in Role::value_variants() {
            let flag = role.to_possible_value().map(|v| v.get_name().to_owned());
            assert_eq!(flag.as_deref(), Some(role.name()));
        }
    }
}
