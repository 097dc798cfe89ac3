//! Scoped API tokens and who is calling: the bootstrap admin token (configured or
//! generated) and named tokens with a scope and an optional expiry, stored as SHA-256
//! hashes and shown once.
//!
//! | scope | may |
//! | --- | --- |
//! | `read` | every `GET` of the admin API except tokens and the audit log (no call shows a secret) |
//! | `operate` | `read`, and redeliver, unblock, pause, resume, recover, send a test, try a filter or a transformation |
//! | `admin` | everything: sources, endpoints, subscriptions, secrets, publishing, tokens, the audit log |
//!
//! Any token but an admin one may also be denied payloads (`payloads: false`): every view
//! of a stored event's payload (or of a transformed body sent from it) withholds it, and
//! every call that would reveal payload content otherwise is refused
//! ([`Principal::payloads_refused`]).
//!
//! [`required`] is the one table of which call needs which scope, for the API and the
//! console alike; the API's middleware (`api::auth`) and the console's session
//! (`console::session`) enforce it, and the OpenAPI document states it from the same table.
//! A token is looked up by its hash on every call (no cache), so a revoked or expired
//! token stops working at once on every replica.

pub mod sql;

use axum::http::Method;
use rand::RngCore as _;
use sha2::{Digest, Sha256};

/// What a token may do; each scope includes the ones before it.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Read everything but tokens and the audit log.
    Read,
    /// Read, and operate deliveries and endpoints.
    Operate,
    /// Everything.
    Admin,
}

impl Scope {
    /// Every scope, weakest first.
    pub const ALL: [Scope; 3] = [Scope::Read, Scope::Operate, Scope::Admin];

    /// The stored name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Operate => "operate",
            Scope::Admin => "admin",
        }
    }

    /// The scope stored as `name`.
    pub fn parse(name: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|s| s.as_str() == name)
    }
}

/// Who is calling, once authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The token's name (`admin` for the bootstrap token): the audit log's actor.
    pub name: String,
    /// What it may do.
    pub scope: Scope,
    /// The stored token's id (`None`: the bootstrap token).
    pub token_id: Option<uuid::Uuid>,
    /// Whether it may read the payloads of stored events ([`Principal::payloads_refused`]).
    pub payloads: bool,
}

impl Principal {
    /// The bootstrap admin token's caller.
    pub fn bootstrap() -> Principal {
        Principal { name: BOOTSTRAP_NAME.to_owned(), scope: Scope::Admin, token_id: None, payloads: true }
    }

    /// Why this caller may not have a stored event's payload revealed by `what` (`None`:
    /// it may). Views withhold the payload instead of refusing; calls that would reveal
    /// payload content some other way (a search by it, trying a filter or a
    /// transformation on a stored event) are refused with this reason (403).
    pub fn payloads_refused(&self, what: &str) -> Option<String> {
        (!self.payloads).then(|| format!("the token {:?} may not read payloads, which {what} would reveal", self.name))
    }
}

/// The actor name of the bootstrap admin token.
pub const BOOTSTRAP_NAME: &str = "admin";

/// Why `name` cannot name a token (`None`: it can). The table's CHECK holds the same rule;
/// this says it before the database does, in words.
pub fn name_problem(name: &str) -> Option<&'static str> {
    let valid = !name.is_empty()
        && name.len() <= 100
        && name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ' '));
    // Not `unknown` either (the audit log's actor for a caller without a valid token), nor
    // a token id's shape: revoking takes an id or a name, and one name spelled as another
    // token's id revoked both.
    let reserved = name == BOOTSTRAP_NAME || name == "unknown" || uuid::Uuid::parse_str(name).is_ok();
    (!valid || reserved).then_some(
        "1-100 characters: letters, digits, '.', '_', '-' and spaces, starting with a letter or digit; not `admin`, \
         `unknown` or a token id's shape",
    )
}

/// What every generated token starts with (so a scanner can recognise a leaked one).
pub const PREFIX: &str = "wgt_";

/// A fresh token: [`PREFIX`] and 32 random bytes in URL-safe base64.
pub fn generate() -> String {
    use base64::Engine as _;
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("{PREFIX}{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
}

/// What is stored of a token: its SHA-256. A lookup by this hash compares hashes, so the
/// time it takes says nothing about how much of a guessed token was right.
pub fn hash(token: &str) -> Vec<u8> {
    Sha256::digest(token.as_bytes()).to_vec()
}

/// The longest expiry a token may be given in days (the console's and the command line's
/// `expires in days`): a hundred years. Past it the date overflowed and the console's
/// request died with no answer.
pub const MOST_EXPIRY_DAYS: u32 = 36_500;

/// When a token created now for `days` expires, or why it cannot.
pub fn expiry_in(days: u32) -> Result<chrono::DateTime<chrono::Utc>, String> {
    if !(1..=MOST_EXPIRY_DAYS).contains(&days) {
        return Err(format!("an expiry is 1 to {MOST_EXPIRY_DAYS} days, not {days}"));
    }
    Ok(crate::clock::now() + chrono::Duration::days(i64::from(days)))
}

/// The scope a call needs: `method` on the route template `route` (`/v1/endpoints/{id}`).
/// A route not named here needs `admin` (closed by default).
pub fn required(method: &Method, route: &str) -> Scope {
    const OPERATE: &[&str] = &[
        "/v1/deliveries/{id}/redeliver",
        "/v1/deliveries/{id}/unblock",
        "/v1/endpoints/{id}/pause",
        "/v1/endpoints/{id}/resume",
        "/v1/endpoints/{id}/recover",
        "/v1/endpoints/{id}/test",
        "/v1/filters/test",
        "/v1/transforms/test",
    ];
    const CONSOLE_OPERATE: &[&str] = &[
        "/console/deliveries/{id}/redeliver",
        "/console/dead/redeliver",
        "/console/endpoints/{id}/pause",
        "/console/endpoints/{id}/resume",
        "/console/endpoints/{id}/recover",
        "/console/endpoints/{id}/test",
    ];
    const ADMIN_READS: &[&str] = &["/v1/tokens", "/v1/audit", "/console/tokens", "/console/audit"];
    if *method == Method::GET || *method == Method::HEAD {
        if ADMIN_READS.contains(&route) { Scope::Admin } else { Scope::Read }
    } else if *method == Method::POST && (OPERATE.contains(&route) || CONSOLE_OPERATE.contains(&route)) {
        Scope::Operate
    } else {
        Scope::Admin
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expiry_is_one_day_to_a_hundred_years() {
        assert!(expiry_in(0).is_err());
        assert!(expiry_in(1).is_ok());
        assert!(expiry_in(MOST_EXPIRY_DAYS).is_ok());
        let err = expiry_in(u32::MAX).expect_err("too far");
        assert!(err.contains("1 to 36500 days"), "{err}");
    }

    #[test]
    fn tokens_are_random_prefixed_and_stored_as_hashes() {
        let (a, b) = (generate(), generate());
        assert!(a.starts_with(PREFIX) && a.len() == PREFIX.len() + 43, "{a}");
        assert_ne!(a, b);
        assert_eq!(hash(&a), hash(&a));
        assert_ne!(hash(&a), hash(&b));
        assert_eq!(hash(&a).len(), 32);
    }

    #[test]
    fn the_table_closes_by_default() {
        assert_eq!(required(&Method::GET, "/v1/events"), Scope::Read);
        assert_eq!(required(&Method::GET, "/v1/tokens"), Scope::Admin);
        assert_eq!(required(&Method::POST, "/v1/endpoints/{id}/pause"), Scope::Operate);
        assert_eq!(required(&Method::POST, "/v1/endpoints/{id}/rotate-secret"), Scope::Admin);
        assert_eq!(required(&Method::DELETE, "/v1/endpoints/{id}"), Scope::Admin);
        assert_eq!(required(&Method::POST, "/v1/unknown"), Scope::Admin);
        assert_eq!(required(&Method::GET, "/console/endpoints/{id}"), Scope::Read);
        assert_eq!(required(&Method::POST, "/console/endpoints/{id}/pause"), Scope::Operate);
        assert_eq!(required(&Method::POST, "/console/endpoints/{id}/rotate-secret"), Scope::Admin);
        assert_eq!(required(&Method::GET, "/console/tokens"), Scope::Admin);
        assert_eq!(required(&Method::POST, "/console/tokens/{id}/revoke"), Scope::Admin);
        assert!(Scope::Read < Scope::Operate && Scope::Operate < Scope::Admin);
        for s in Scope::ALL {
            assert_eq!(Scope::parse(s.as_str()), Some(s));
        }
    }
}
