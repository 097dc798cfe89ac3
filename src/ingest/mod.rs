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
        (status = 503, description = "Database unreachable; nothing stored (`database_unavailable`)", body = ErrorBody,
            headers(("Retry-After" = u32, description = "Seconds to wait"))),
    ),
)]
pub async fn ingest(
    State(state): State<AppState>,
    Path(source_name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large(state.max_body_bytes)
        } else {
            ApiError::bad_request("bad_request", rejection.body_text())
        }
    })?;
    let source = state
        .sources
        .get(&state.pool, &source_name)
        .await?
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
    let stored = accept(&state, &source.name, event).await?;
    Ok(Json(IngestResponse::from(stored)).into_response())
}

/// Store an accepted event with its fan-out, and wake this process's workers when it
/// created deliveries. Shared by webhook ingest and `POST /v1/events`.
pub async fn accept(state: &AppState, source_name: &str, event: OwnedEvent) -> Result<Stored, ApiError> {
    let stored = state.ingest.store(event).await.map_err(|e| match e {
        batcher::StoreError::Unavailable => {
            ApiError::unavailable("the database is unreachable; nothing was stored, retry later")
        }
        batcher::StoreError::Failed => ApiError::internal(),
    })?;
    if stored.deliveries > 0 {
        state.wake.notify_one();
    }
    crate::metrics::ingest(source_name, if stored.duplicate { "duplicate" } else { "accepted" });
    Ok(stored)
}
