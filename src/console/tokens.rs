//! Tokens and the audit log, for admins: create a scoped token (shown once), revoke one,
//! and read who changed what.

use askama::Template;
use axum::extract::{Path, Query, State};
use serde::Deserialize;

use super::session::Posted;
use super::{Layout, PageResult, Session, Ts, non_empty, or_empty, render, see_other};
use crate::api::AppState;
use crate::audit;
use crate::tokens::{self, Scope};

struct TokenRow {
    id: String,
    name: String,
    scope: String,
    created_at: Ts,
    created_by: String,
    state: String,
    active: bool,
    payloads: bool,
    last_used: String,
}

#[derive(Template)]
#[template(path = "console/tokens.html")]
struct TokensPage {
    layout: Layout,
    rows: Vec<TokenRow>,
    /// A token just created: shown this once.
    created: Option<(String, String)>,
    problem: String,
    name: String,
}

async fn tokens_page(
    session: &Session,
    state: &AppState,
    created: Option<(String, String)>,
    problem: String,
    name: String,
) -> PageResult {
    let now = crate::clock::now();
    let rows = tokens::sql::list(&state.pool)
        .await?
        .into_iter()
        .map(|t| {
            let (state, active) = match (t.revoked_at, t.expires_at) {
                (Some(at), _) => (format!("revoked {}", at.format("%Y-%m-%d %H:%M UTC")), false),
                (None, Some(at)) if at <= now => (format!("expired {}", at.format("%Y-%m-%d %H:%M UTC")), false),
                (None, Some(at)) => (format!("expires {}", at.format("%Y-%m-%d %H:%M UTC")), true),
                (None, None) => ("active".to_owned(), true),
            };
            TokenRow {
                id: t.id.to_string(),
                name: t.name,
                scope: t.scope,
                created_at: Ts(t.created_at),
                created_by: t.created_by,
                state,
                active,
                payloads: t.payloads,
                last_used: t
                    .last_used_at
                    .map_or_else(|| "never".to_owned(), |at| at.format("%Y-%m-%d %H:%M UTC").to_string()),
            }
        })
        .collect();
    render(&TokensPage { layout: Layout::new(session, "tokens"), rows, created, problem, name })
}

/// `GET /console/tokens` (admin).
pub async fn list(session: Session, State(state): State<AppState>) -> PageResult {
    tokens_page(&session, &state, None, String::new(), String::new()).await
}

/// The create form.
#[derive(Debug, Deserialize)]
pub struct CreateForm {
    name: String,
    scope: String,
    #[serde(default)]
    expires_in_days: Option<String>,
    /// The checkbox "withhold payloads" (present: checked).
    #[serde(default)]
    no_payloads: Option<String>,
}

/// `POST /console/tokens` (admin): the page again, with the new token shown once, or
/// with what was wrong and what was typed.
pub async fn create(State(state): State<AppState>, Posted(session, form): Posted<CreateForm>) -> PageResult {
    let name = form.name.trim().to_owned();
    let scope = Scope::parse(&form.scope);
    let days = non_empty(form.expires_in_days.clone()).map(|d| d.trim().parse::<u32>());
    let expires_at = match days {
        Some(Ok(d)) => Some(tokens::expiry_in(d)),
        Some(Err(_)) => Some(Err(String::new())),
        None => None,
    };
    let problem = if let Some(problem) = tokens::name_problem(&name) {
        Some(problem)
    } else if scope.is_none() {
        Some("Choose a scope.")
    } else if matches!(expires_at, Some(Err(_))) {
        Some("Expiry is a number of days, 1 to 36500 (or empty: no expiry).")
    } else if form.no_payloads.is_some() && scope == Some(Scope::Admin) {
        Some("An admin token always reads payloads (it can create tokens).")
    } else {
        None
    };
    let (None, Some(scope)) = (problem, scope) else {
        let problem = problem.unwrap_or("Choose a scope.");
        return tokens_page(&session, &state, None, problem.to_owned(), name).await;
    };
    let expires_at = expires_at.and_then(Result::ok);
    let token = tokens::generate();
    let new = tokens::sql::NewToken { name: &name, scope, expires_at, payloads: form.no_payloads.is_none() };
    match tokens::sql::create(&state.pool, &new, &tokens::hash(&token), session.actor()).await? {
        Some(_) => tokens_page(&session, &state, Some((name, token)), String::new(), String::new()).await,
        None => tokens_page(&session, &state, None, format!("A token is already named {name:?}."), name).await,
    }
}

/// `POST /console/tokens/{id}/revoke` (admin).
pub async fn revoke(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Posted(_session, _): Posted<super::session::NoFields>,
) -> PageResult {
    tokens::sql::revoke(&state.pool, &id).await?;
    Ok(see_other("/console/tokens"))
}

struct AuditRow {
    at: Ts,
    actor: String,
    via: String,
    action: String,
    target: String,
    status: i32,
    address: String,
}

#[derive(Template)]
#[template(path = "console/audit.html")]
struct AuditPage {
    layout: Layout,
    rows: Vec<AuditRow>,
    actor: String,
    target: String,
    next: Option<String>,
}

/// The audit search's fields.
#[derive(Debug, Default, Deserialize, serde::Serialize)]
pub struct AuditQuery {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    actor: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    target: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cursor: Option<i64>,
}

/// `GET /console/audit` (admin): newest first, a page of [`super::PAGE`].
pub async fn audit_log(session: Session, State(state): State<AppState>, Query(q): Query<AuditQuery>) -> PageResult {
    let query = audit::Query {
        actor: non_empty(q.actor.clone()),
        target: non_empty(q.target.clone()),
        before_id: q.cursor,
        ..Default::default()
    };
    let found = audit::list(&state.pool, &query, super::PAGE).await?;
    let next = (found.len() as i64 == super::PAGE).then(|| found.last().map(|e| e.id)).flatten().and_then(|last| {
        let page =
            AuditQuery { cursor: Some(last), actor: non_empty(q.actor.clone()), target: non_empty(q.target.clone()) };
        serde_urlencoded::to_string(&page).ok()
    });
    let rows = found
        .into_iter()
        .map(|e| AuditRow {
            at: Ts(e.at),
            actor: e.actor,
            via: e.via,
            action: e.action,
            target: e.target,
            status: e.status,
            address: e.address.unwrap_or_default(),
        })
        .collect();
    render(&AuditPage {
        layout: Layout::new(&session, "audit"),
        rows,
        actor: or_empty(&q.actor),
        target: or_empty(&q.target),
        next,
    })
}
