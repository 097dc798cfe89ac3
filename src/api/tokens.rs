//! `/v1/tokens`: scoped API tokens (admin scope), and `/v1/audit`: the audit log.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::AppState;
use super::extract::{ApiJson, ApiQuery, page_limit};
use super::openapi::{AdminErrors, JsonBodyErrors};
use crate::audit;
use crate::error::{ApiError, ErrorBody};
use crate::tokens::{self, Principal, Scope};

/// Body of `POST /v1/tokens`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewToken {
    /// A unique name (1-100: letters, digits, `.`, `_`, `-`, spaces): the audit log's actor.
    #[schema(example = "grafana-readonly")]
    pub name: String,
    /// `read`, `operate` or `admin`.
    pub scope: Scope,
    /// When it stops working (RFC 3339); none: it works until revoked.
    #[serde(default)]
    pub expires_at: Option<DateTime<Utc>>,
    /// Whether it may read the payloads of stored events (default `true`). With `false`,
    /// every view withholds them and every call that would reveal them is refused (403);
    /// an `admin` token always reads them.
    #[serde(default)]
    pub payloads: Option<bool>,
}

/// A created token: the only answer that ever shows it.
#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedToken {
    /// The token (`wgt_...`): shown this once, stored only as a hash.
    pub token: String,
    /// Its id.
    pub id: uuid::Uuid,
    /// Its name.
    pub name: String,
    /// Its scope.
    pub scope: String,
    /// When it stops working (`null`: never).
    pub expires_at: Option<DateTime<Utc>>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// Who created it.
    pub created_by: String,
    /// Whether it reads the payloads of stored events.
    pub payloads: bool,
}

/// `POST /v1/tokens`.
#[utoipa::path(
    post, path = "/v1/tokens", tag = "tokens", operation_id = "create_token",
    summary = "Create a scoped token (shown once)",
    request_body = NewToken,
    responses(
        (status = 201, description = "Created; the answer holds the token, this once", body = CreatedToken),
        (status = 409, description = "A token has this name (`conflict`)", body = ErrorBody),
        JsonBodyErrors,
        AdminErrors,
    ),
    security(("admin_token" = ["admin"])),
)]
pub async fn create(
    State(state): State<AppState>,
    axum::Extension(caller): axum::Extension<Principal>,
    ApiJson(body): ApiJson<NewToken>,
) -> Result<(StatusCode, Json<CreatedToken>), ApiError> {
    let name = body.name.trim();
    if let Some(problem) = tokens::name_problem(name) {
        return Err(ApiError::validation("name", problem));
    }
    if body.expires_at.is_some_and(|t| t <= crate::clock::now()) {
        return Err(ApiError::validation("expires_at", "must be in the future"));
    }
    let payloads = body.payloads.unwrap_or(true);
    if !payloads && body.scope == Scope::Admin {
        return Err(ApiError::validation("payloads", "an admin token always reads payloads (it can create tokens)"));
    }
    let token = tokens::generate();
    let new = tokens::sql::NewToken { name, scope: body.scope, expires_at: body.expires_at, payloads };
    let info = tokens::sql::create(&state.pool, &new, &tokens::hash(&token), &caller.name)
        .await?
        .ok_or_else(|| ApiError::new(crate::error::ErrorCode::Conflict, format!("a token is named {name:?}")))?;
    Ok((
        StatusCode::CREATED,
        Json(CreatedToken {
            token,
            id: info.id,
            name: info.name,
            scope: info.scope,
            expires_at: info.expires_at,
            created_at: info.created_at,
            created_by: info.created_by,
            payloads: info.payloads,
        }),
    ))
}

/// The tokens.
#[derive(Debug, Serialize, ToSchema)]
pub struct TokenList {
    /// Oldest first, revoked and expired ones included; never the tokens themselves.
    data: Vec<tokens::sql::TokenInfo>,
}

/// `GET /v1/tokens`.
#[utoipa::path(
    get, path = "/v1/tokens", tag = "tokens", operation_id = "list_tokens",
    summary = "List tokens (never the tokens themselves)",
    responses((status = 200, description = "Every token", body = TokenList), AdminErrors),
    security(("admin_token" = ["admin"])),
)]
pub async fn list(State(state): State<AppState>) -> Result<Json<TokenList>, ApiError> {
    Ok(Json(TokenList { data: tokens::sql::list(&state.pool).await? }))
}

/// `DELETE /v1/tokens/{id}`.
#[utoipa::path(
    delete, path = "/v1/tokens/{id}", tag = "tokens", operation_id = "revoke_token",
    summary = "Revoke a token (at once, on every replica)",
    params(("id" = String, Path, description = "The token's id or name")),
    responses(
        (status = 200, description = "Revoked (revoking again keeps the first time)", body = tokens::sql::TokenInfo),
        (status = 404, description = "No such token (`not_found`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = ["admin"])),
)]
pub async fn revoke(
    State(state): State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<tokens::sql::TokenInfo>, ApiError> {
    tokens::sql::revoke(&state.pool, &id).await?.map(Json).ok_or_else(|| ApiError::not_found("token"))
}

/// Query of `GET /v1/audit`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// At or after (RFC 3339).
    since: Option<DateTime<Utc>>,
    /// Before (RFC 3339).
    until: Option<DateTime<Utc>>,
    /// Exactly this actor (a token's name; `admin` for the bootstrap token).
    actor: Option<String>,
    /// Targets starting with this path (`/v1/endpoints/0193...`).
    target: Option<String>,
    /// Page size, 1-1000 (default 100).
    limit: Option<i64>,
    /// `next_cursor` of the previous page.
    cursor: Option<i64>,
}

/// A page of the audit log.
#[derive(Debug, Serialize, ToSchema)]
pub struct AuditPage {
    /// Newest first.
    data: Vec<audit::Recorded>,
    /// Pass as `cursor` for the next (older) page; `null` on the last.
    next_cursor: Option<i64>,
}

/// `GET /v1/audit`.
#[utoipa::path(
    get, path = "/v1/audit", tag = "tokens", operation_id = "audit_log",
    summary = "The audit log: every change and every refused attempt",
    params(AuditQuery),
    responses((status = 200, description = "Entries, newest first", body = AuditPage), AdminErrors),
    security(("admin_token" = ["admin"])),
)]
pub async fn audit_log(
    State(state): State<AppState>,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> Result<Json<AuditPage>, ApiError> {
    let limit = page_limit(q.limit)?;
    let query = audit::Query { since: q.since, until: q.until, actor: q.actor, target: q.target, before_id: q.cursor };
    let data = audit::list(&state.pool, &query, limit).await?;
    let next_cursor = (data.len() as i64 == limit).then(|| data.last().map(|e| e.id)).flatten();
    Ok(Json(AuditPage { data, next_cursor }))
}
