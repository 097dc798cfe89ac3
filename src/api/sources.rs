//! `/v1/sources`: where webhooks come from and how they are verified.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::AppState;
use super::extract::{ApiJson, ApiQuery, Id};
use super::openapi::{AdminErrors, JsonBodyErrors};
use crate::error::{ApiError, ErrorBody, ErrorCode};
use crate::ids::SourceId;
use crate::secrets::{Keyring, Place, Sealed};
use crate::store::{self, sources::Source};
use crate::verify::{HmacScheme, Kind, Locator, SourceSpec, ValidSpec};

/// Body of `POST /v1/sources`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSource {
    /// Unique name; webhooks arrive at `/ingest/{name}`. 1-100 characters of `A-Z a-z 0-9 . _ -`,
    /// starting with a letter or digit.
    #[schema(example = "shop")]
    pub name: String,
    /// Verifier kind (`internal` is reserved for the built-in `api` source: 422).
    pub kind: Kind,
    /// Signing secrets (several during a rotation).
    #[serde(default)]
    pub secrets: Vec<String>,
    /// Timestamp tolerance in seconds (kinds that sign a timestamp).
    #[serde(default)]
    pub tolerance_secs: Option<u64>,
    /// Where the dedupe key lives (overrides the kind's default).
    #[serde(default)]
    pub dedupe: Locator,
    /// Where the event type lives (overrides the kind's default).
    #[serde(default)]
    pub event_type: Locator,
    /// Where the ordering key lives (empty: none): events of one key are delivered in
    /// order to endpoints whose subscription asks for it.
    #[serde(default)]
    pub ordering_key: Locator,
    /// Settings of the `hmac` kind.
    #[serde(default)]
    pub hmac: Option<HmacScheme>,
}

/// A source as the API shows it: secrets appear only as fingerprints.
#[derive(Debug, Serialize, ToSchema)]
pub struct SourceView {
    id: SourceId,
    name: String,
    kind: Kind,
    /// Where its webhooks arrive: `/ingest/{name}`.
    #[schema(example = "/ingest/shop")]
    ingest_path: String,
    /// Where the dedupe key is read (empty: the kind's default).
    dedupe: Locator,
    /// Where the event type is read (empty: the kind's default).
    event_type: Locator,
    /// Where the ordering key is read (empty: none).
    ordering_key: Locator,
    /// Timestamp tolerance in seconds; absent means the kind's default.
    #[serde(skip_serializing_if = "Option::is_none")]
    tolerance_secs: Option<u64>,
    /// Settings of the `hmac` kind; absent for other kinds.
    #[serde(skip_serializing_if = "Option::is_none")]
    hmac: Option<HmacScheme>,
    /// `sha256:` + the first 8 hex digits of each secret's SHA-256 (`unreadable` for a stored
    /// secret this gateway cannot decrypt).
    #[schema(example = json!(["sha256:1a2b3c4d"]))]
    secret_fingerprints: Vec<String>,
    created_at: DateTime<Utc>,
}

/// All sources (not paginated).
#[derive(Debug, Serialize, ToSchema)]
pub struct SourceList {
    /// Every source, by name, the built-in `api` source included.
    data: Vec<SourceView>,
}

impl SourceView {
    /// The view of a stored source: fingerprints of its secrets' plaintext (a secret this
    /// process cannot open shows as `unreadable`, logged; the rest of the source still shows).
    fn new(s: Source, secrets: &Keyring) -> Self {
        let secret_fingerprints = crate::actions::fingerprints(&s, secrets);
        let spec = s.spec.0;
        SourceView {
            id: s.id,
            ingest_path: format!("/ingest/{}", s.name),
            name: s.name,
            kind: spec.kind,
            dedupe: spec.dedupe,
            event_type: spec.event_type,
            ordering_key: spec.ordering_key,
            tolerance_secs: spec.tolerance_secs,
            hmac: spec.hmac,
            secret_fingerprints,
            created_at: s.created_at,
        }
    }
}

/// The spec as stored: each secret sealed (encrypted when a key is set). The API's `spec`
/// keeps the plaintext.
fn sealed(spec: ValidSpec, secrets: &Keyring) -> Result<ValidSpec<Sealed>, ApiError> {
    spec.sealed(|i, secret| {
        secrets.seal(Place::SourceSecret, secret).map_err(|e| ApiError::validation(&format!("secrets[{i}]"), e))
    })
}

/// `spec` checked, or the 422 that names its offending field.
fn parsed(spec: SourceSpec) -> Result<ValidSpec, ApiError> {
    ValidSpec::parse(spec).map_err(|e| ApiError::validation(&e.field, e.reason))
}

fn validate_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        && name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(ApiError::validation("name", "1-100 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit"))
    }
}

/// `POST /v1/sources`.
#[utoipa::path(
    post, path = "/v1/sources", tag = "sources", operation_id = "create_source",
    summary = "Create a source",
    request_body = CreateSource,
    responses(
        (status = 201, description = "Created", body = SourceView),
        (status = 409, description = "A source with this name exists (`conflict`)", body = ErrorBody),
        JsonBodyErrors,
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn create(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<CreateSource>,
) -> Result<(StatusCode, Json<SourceView>), ApiError> {
    validate_name(&body.name)?;
    if body.kind == Kind::Internal {
        return Err(ApiError::validation("kind", "`internal` is reserved for the built-in `api` source"));
    }
    let spec = SourceSpec {
        kind: body.kind,
        secrets: body.secrets,
        tolerance_secs: body.tolerance_secs,
        dedupe: body.dedupe,
        event_type: body.event_type,
        ordering_key: body.ordering_key,
        hmac: body.hmac,
    };
    let spec = parsed(spec)?;
    if spec.spec().kind == Kind::None {
        tracing::warn!(source = %body.name, "source of kind `none` created: its webhooks are not verified");
    }
    match store::sources::insert(&state.pool, &body.name, &sealed(spec, &state.secrets)?).await {
        Ok(source) => {
            state.intake.sources().invalidate();
            Ok((StatusCode::CREATED, Json(SourceView::new(source, &state.secrets))))
        }
        Err(e) if store::is_unique_violation(&e, store::sources::NAME_UNIQUE) => {
            Err(ApiError::conflict(format!("a source named {:?} already exists", body.name)))
        }
        Err(e) => Err(e.into()),
    }
}

/// `GET /v1/sources`.
#[utoipa::path(
    get, path = "/v1/sources", tag = "sources", operation_id = "list_sources",
    summary = "List sources",
    responses(
        (status = 200, description = "All sources (not paginated)", body = SourceList),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn list(State(state): State<AppState>) -> Result<Json<SourceList>, ApiError> {
    let sources = store::sources::list(&state.pool).await?;
    let data = sources.into_iter().map(|s| SourceView::new(s, &state.secrets)).collect();
    Ok(Json(SourceList { data }))
}

/// `GET /v1/sources/{id}`.
#[utoipa::path(
    get, path = "/v1/sources/{id}", tag = "sources", operation_id = "get_source",
    summary = "Get a source",
    params(("id" = SourceId, Path, description = "Source id (anything else is 404)")),
    responses(
        (status = 200, description = "The source", body = SourceView),
        (status = 404, description = "No such source (`not_found`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn get(State(state): State<AppState>, Id(id): Id<SourceId>) -> Result<Json<SourceView>, ApiError> {
    let source = store::sources::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("source"))?;
    Ok(Json(SourceView::new(source, &state.secrets)))
}

/// Body of `PATCH /v1/sources/{id}`: any subset; the name and kind are fixed.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateSource {
    /// Replace the secret list (rotation: send old and new, later only new).
    #[serde(default)]
    pub secrets: Option<Vec<String>>,
    /// Timestamp tolerance in seconds; `null` returns to the kind's default.
    #[serde(default, deserialize_with = "super::extract::double_option")]
    pub tolerance_secs: Option<Option<u64>>,
    /// Where the dedupe key lives.
    #[serde(default)]
    pub dedupe: Option<Locator>,
    /// Where the event type lives.
    #[serde(default)]
    pub event_type: Option<Locator>,
    /// Where the ordering key lives (`{}`: none).
    #[serde(default)]
    pub ordering_key: Option<Locator>,
    /// Settings of the `hmac` kind.
    #[serde(default, deserialize_with = "super::extract::double_option")]
    pub hmac: Option<Option<HmacScheme>>,
}

/// `PATCH /v1/sources/{id}`.
#[utoipa::path(
    patch, path = "/v1/sources/{id}", tag = "sources", operation_id = "update_source",
    summary = "Update a source",
    params(("id" = SourceId, Path, description = "Source id (anything else is 404)")),
    request_body = UpdateSource,
    responses(
        (status = 200, description = "The updated source", body = SourceView),
        (status = 404, description = "No such source (`not_found`)", body = ErrorBody),
        (status = 409, description = "The built-in `api` source cannot be changed (`conflict`)", body = ErrorBody),
        JsonBodyErrors,
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn update(
    State(state): State<AppState>,
    Id(id): Id<SourceId>,
    ApiJson(body): ApiJson<UpdateSource>,
) -> Result<Json<SourceView>, ApiError> {
    let source = store::sources::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("source"))?;
    let stored = source.spec.0;
    if stored.kind == Kind::Internal {
        return Err(ApiError::conflict("built-in sources cannot be changed"));
    }
    let secrets = match body.secrets {
        Some(secrets) => secrets,
        // Kept: opened to be validated with the rest, sealed again below.
        None => state.secrets.open_all(Place::SourceSecret, &stored.secrets).map_err(|e| {
            tracing::error!(source = %source.name, error = %e, "cannot read this source's secrets");
            ApiError::new(ErrorCode::SecretUnreadable, format!("{e}; send `secrets` to replace them"))
        })?,
    };
    let mut spec: SourceSpec = stored.with_secrets(secrets);
    if let Some(tolerance) = body.tolerance_secs {
        spec.tolerance_secs = tolerance;
    }
    if let Some(dedupe) = body.dedupe {
        spec.dedupe = dedupe;
    }
    if let Some(event_type) = body.event_type {
        spec.event_type = event_type;
    }
    if let Some(ordering_key) = body.ordering_key {
        spec.ordering_key = ordering_key;
    }
    if let Some(hmac) = body.hmac {
        spec.hmac = hmac;
    }
    let updated = store::sources::update_spec(&state.pool, id, &sealed(parsed(spec)?, &state.secrets)?)
        .await?
        .ok_or_else(|| ApiError::not_found("source"))?;
    state.intake.sources().invalidate();
    tracing::info!(source = %updated.name, "source updated");
    Ok(Json(SourceView::new(updated, &state.secrets)))
}

/// Query of `DELETE /v1/sources/{id}`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeleteQuery {
    /// Also delete the source's events, deliveries and attempts.
    #[serde(default)]
    force: bool,
}

/// The refusal of a delete without `force` while the source holds events.
fn has_events(name: &str, events: i64) -> ApiError {
    ApiError::conflict(format!(
        "source {name:?} has {events} events; deleting it deletes them and their deliveries: repeat with ?force=true"
    ))
}

/// `DELETE /v1/sources/{id}`.
///
/// Refused (409) while the source has events, unless `?force=true`, which deletes them with
/// it.
#[utoipa::path(
    delete, path = "/v1/sources/{id}", tag = "sources", operation_id = "delete_source",
    summary = "Delete a source",
    params(("id" = SourceId, Path, description = "Source id (anything else is 404)"), DeleteQuery),
    responses(
        (status = 204, description = "Deleted (with its events, deliveries and attempts when forced)"),
        (status = 404, description = "No such source (`not_found`)", body = ErrorBody),
        (status = 409, description = "The source has events and `force` is not set, or it is the built-in `api` \
            source (`conflict`)", body = ErrorBody),
        (status = 422, description = "Bad query string (`validation_failed`)", body = ErrorBody),
        AdminErrors,
    ),
    security(("admin_token" = [])),
)]
pub async fn delete(
    State(state): State<AppState>,
    Id(id): Id<SourceId>,
    ApiQuery(q): ApiQuery<DeleteQuery>,
) -> Result<StatusCode, ApiError> {
    let source = store::sources::by_id(&state.pool, id).await?.ok_or_else(|| ApiError::not_found("source"))?;
    if source.spec.0.kind == Kind::Internal {
        return Err(ApiError::conflict("built-in sources cannot be deleted"));
    }
    let events = store::sources::event_count(&state.pool, id).await?;
    if events > 0 && !q.force {
        return Err(has_events(&source.name, events));
    }
    if !store::sources::delete(&state.pool, id, q.force).await? {
        // Deleted meanwhile, or a webhook was stored since the count.
        return match store::sources::event_count(&state.pool, id).await? {
            0 => Err(ApiError::not_found("source")),
            events => Err(has_events(&source.name, events)),
        };
    }
    state.intake.sources().invalidate();
    // Ordering lines its deliveries headed may have moved on to another source's.
    state.wake.notify_one();
    tracing::info!(source = %source.name, events, "source deleted");
    Ok(StatusCode::NO_CONTENT)
}
