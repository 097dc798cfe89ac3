//! `POST /ingest/{source}`: verify, then store the event and its fan-out in one
//! transaction, then answer. Nothing is acknowledged before it is committed.

pub mod batcher;
mod cache;
mod headers;
pub mod rejections;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::app::AppState;
use crate::error::{ApiError, ErrorBody};
use crate::ids::EventId;
use crate::store::events::{OwnedEvent, Stored};
use crate::verify::{self, Kind};

pub use cache::SourceCache;
pub use headers::redacted_headers;

/// The answer to an accepted webhook (new or duplicate).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct IngestResponse {
    /// The stored event (the original one for a duplicate).
    pub event_id: EventId,
    /// True when this webhook was already stored; nothing new was created.
    pub duplicate: bool,
}

impl From<Stored> for IngestResponse {
    fn from(s: Stored) -> Self {
        IngestResponse { event_id: s.event_id, duplicate: s.duplicate }
    }
}

// Documentation only: `ingest` answers with `IngestResponse`, or builds the challenge with `json!`.
/// An accepted webhook, or the answer to Slack's `url_verification`.
#[derive(Serialize, utoipa::ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum IngestAnswer {
    /// A webhook stored (or recognised as a duplicate).
    Stored(IngestResponse),
    /// Slack's `url_verification`, answered with its challenge and not stored.
    Challenge(SlackChallenge),
}

/// The answer to Slack's `url_verification` handshake.
#[derive(Serialize, utoipa::ToSchema)]
#[allow(dead_code)] // documentation only
pub struct SlackChallenge {
    /// The request's `challenge`, echoed.
    challenge: String,
}

/// `POST /ingest/{source}`.
#[utoipa::path(
    post, path = "/ingest/{source}", tag = "ingest", operation_id = "ingest",
    summary = "Receive a webhook",
    description = "A webhook from a provider. It is verified on its raw body by the source's `kind` (signature \
        headers differ per kind), then stored with its deliveries in one transaction; the answer comes only after \
        the commit. Any content type is accepted.",
    params(("source" = String, Path, description = "The source's name")),
    request_body(content = inline(serde_json::Value), content_type = "*/*", description = "The raw webhook body"),
    responses(
        (status = 200, description = "Stored, or already stored (`duplicate`); or Slack's challenge",
            body = IngestAnswer),
        (status = 400, description = "The body lacks what the kind requires (`malformed_body`)", body = ErrorBody),
        (status = 401, description = "Refused: `missing_signature`, `invalid_signature` or \
            `timestamp_out_of_tolerance`; nothing stored", body = ErrorBody),
        (status = 403, description = "The built-in `api` source takes events only through `POST /v1/events` \
            (`not_ingestible`)", body = ErrorBody),
        (status = 404, description = "No such source (`not_found`)", body = ErrorBody),
        (status = 413, description = "Body over the size limit (`payload_too_large`)", body = ErrorBody),
        (status = 503, description = "The database is unreachable or did not answer within `--db-timeout-secs` \
            (`database_unavailable`). The message says which: \"nothing was stored\" when nothing reached the \
            database; \"may have been stored\" when the write may have reached it unconfirmed. Retrying is safe \
            either way (a stored webhook is answered as a duplicate).", body = ErrorBody,
            headers(("Retry-After" = u32, description = "Seconds to wait"))),
    ),
)]
pub async fn ingest(
    State(state): State<AppState>,
    Path(source_name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    // The database gets `--db-timeout-secs` from here: the source lookup and the commit.
    let deadline = tokio::time::Instant::now() + state.db_timeout;
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large(state.max_body_bytes)
        } else {
            ApiError::bad_request("bad_request", rejection.body_text())
        }
    })?;
    // A read: whatever happens to it, nothing was stored.
    let source = match tokio::time::timeout_at(deadline, state.sources.get(&state.pool, &source_name)).await {
        Ok(Ok(source)) => source,
        Ok(Err(cache::LookupError::Database(e))) if crate::db::is_unavailable(&e) => {
            tracing::warn!(error = %e, "database unavailable (source lookup)");
            return Err(ApiError::unavailable(NOTHING_STORED));
        }
        Ok(Err(cache::LookupError::Database(e))) => return Err(e.into()),
        Ok(Err(cache::LookupError::Unreadable)) => return Err(ApiError::internal()),
        Err(_) => return Err(ApiError::unavailable(LOOKUP_NO_ANSWER)),
    }
    .ok_or_else(|| ApiError::not_found(&format!("source {source_name:?}")))?;
    let spec = &source.spec.0;
    if spec.kind == Kind::Internal {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "not_ingestible",
            "this source takes events only through POST /v1/events",
        ));
    }
    let verified = verify::verify(spec, &headers, &body, chrono::Utc::now().timestamp()).map_err(|e| {
        // Counted under the stored name (the source exists), logged rate-limited.
        rejections::record(&source.name, &e);
        match e {
            verify::VerifyError::MalformedBody(m) => ApiError::bad_request("malformed_body", m),
            other => ApiError::unauthorized(other.code(), other.to_string()),
        }
    })?;
    if let Some(challenge) = verified.challenge {
        return Ok(Json(serde_json::json!({ "challenge": challenge })).into_response());
    }
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .map(|v| crate::sanitize::stored_text(v.as_bytes(), crate::sanitize::MAX_CONTENT_TYPE_BYTES));
    let event = OwnedEvent {
        source_id: source.id,
        dedupe_key: verified.dedupe_key,
        event_type: verified.event_type,
        content_type,
        headers: redacted_headers(&headers, spec.hmac.as_ref().map(|h| h.header.as_str())),
        payload: body,
    };
    let stored = accept_by(&state, &source.name, event, deadline).await?;
    Ok(Json(IngestResponse::from(stored)).into_response())
}

/// 503 message: nothing reached the database.
pub const NOTHING_STORED: &str = "the database is unreachable; nothing was stored, retry later";
/// 503 message: the write may have reached the database, which did not confirm it.
pub const MAY_BE_STORED: &str = "the database did not confirm the write; the webhook may have been stored; \
    retrying is safe (a stored one is answered as a duplicate)";
/// 503 message: the source lookup (a read) got no answer in time.
const LOOKUP_NO_ANSWER: &str = "the database did not answer in time; nothing was stored, retry later";

/// Store an accepted event with its fan-out, and wake this process's workers when it
/// created deliveries. Shared by webhook ingest and `POST /v1/events`. Waits at most
/// `--db-timeout-secs`.
pub async fn accept(state: &AppState, source_name: &str, event: OwnedEvent) -> Result<Stored, ApiError> {
    accept_by(state, source_name, event, tokio::time::Instant::now() + state.db_timeout).await
}

/// [`accept`], answering by `deadline`.
async fn accept_by(
    state: &AppState,
    source_name: &str,
    event: OwnedEvent,
    deadline: tokio::time::Instant,
) -> Result<Stored, ApiError> {
    let stored = state.ingest.store(event, deadline).await.map_err(|e| match e {
        batcher::StoreError::Unavailable => ApiError::unavailable(NOTHING_STORED),
        batcher::StoreError::Unconfirmed => ApiError::unavailable(MAY_BE_STORED),
        batcher::StoreError::Failed => ApiError::internal(),
    })?;
    if stored.deliveries > 0 {
        state.wake.notify_one();
    }
    crate::metrics::ingest(source_name, if stored.duplicate { "duplicate" } else { "accepted" });
    Ok(stored)
}
