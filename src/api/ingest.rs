//! `POST /ingest/{source}`: a webhook handed to [`crate::ingest::Intake`], its outcome
//! mapped to an answer. Nothing is acknowledged before it is committed.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use serde::Serialize;
use tracing::Instrument as _;
use utoipa::ToSchema;

use super::AppState;
use crate::error::{ApiError, ErrorBody, ErrorCode};
use crate::ids::EventId;
use crate::ingest::{LookupError, Received, Refused, StoreError};
use crate::store::events::Stored;
use crate::verify::VerifyError;

/// The answer to a stored event, new or duplicate (webhooks and `POST /v1/events`).
#[derive(Debug, Serialize, ToSchema)]
pub struct IngestResponse {
    /// The stored event (for a duplicate, the event first stored under this key).
    pub event_id: EventId,
    /// True when this event was already stored; nothing new was created.
    pub duplicate: bool,
}

impl From<Stored> for IngestResponse {
    fn from(s: Stored) -> Self {
        IngestResponse { event_id: s.event_id, duplicate: s.duplicate }
    }
}

/// An accepted webhook, or the answer to Slack's `url_verification`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum IngestAnswer {
    /// A webhook stored (or recognised as a duplicate).
    Stored(IngestResponse),
    /// Slack's `url_verification`, answered with its challenge and not stored.
    Challenge(SlackChallenge),
}

/// The answer to Slack's `url_verification` handshake.
#[derive(Debug, Serialize, ToSchema)]
pub struct SlackChallenge {
    /// The request's `challenge`, echoed.
    challenge: String,
}

impl From<Received> for IngestAnswer {
    fn from(received: Received) -> Self {
        match received {
            Received::Stored(stored) => IngestAnswer::Stored(stored.into()),
            Received::Challenge(challenge) => IngestAnswer::Challenge(SlackChallenge { challenge }),
        }
    }
}

/// 503 message: the write failed before its commit (the database unreachable, read-only, out
/// of connections or space, a timeout): nothing was stored.
pub const NOTHING_STORED: &str =
    "the database did not take the write (unreachable, read-only or refusing); nothing was stored, retry later";
/// 503 message: the write may have reached the database, which did not confirm it.
pub const MAY_BE_STORED: &str = "the database did not confirm the write; the webhook may have been stored; \
    retrying is safe (a stored one is answered as a duplicate)";
/// 503 message: the source lookup (a read) got no answer in time.
const LOOKUP_NO_ANSWER: &str = "the database did not answer in time; nothing was stored, retry later";

/// The answer to an event that was not stored, or is not known to be.
pub fn store_error(e: StoreError) -> ApiError {
    match e {
        StoreError::Unavailable => ApiError::unavailable(NOTHING_STORED),
        StoreError::Unconfirmed => ApiError::unavailable(MAY_BE_STORED),
        StoreError::Failed => ApiError::internal(),
    }
}

/// The answer to a refused webhook.
fn refused(refusal: Refused) -> ApiError {
    match refusal {
        Refused::UnknownSource(name) => ApiError::not_found(&format!("source {name:?}")),
        Refused::NotIngestible => ApiError::new(ErrorCode::NotIngestible, refusal.to_string()),
        Refused::Lookup(LookupError::Database(e)) if crate::db::is_unavailable(&e) => {
            static THROTTLE: crate::log_throttle::Throttle =
                crate::log_throttle::Throttle::new(crate::log_throttle::INTERVAL);
            if let Some(left_out) = THROTTLE.admit() {
                tracing::warn!(error = %e, left_out, "database unavailable (source lookup)");
            }
            ApiError::unavailable(NOTHING_STORED)
        }
        Refused::Lookup(LookupError::Database(e)) => e.into(),
        Refused::Lookup(LookupError::Unreadable) => ApiError::internal(),
        Refused::LookupNoAnswer => ApiError::unavailable(LOOKUP_NO_ANSWER),
        Refused::Verify(VerifyError::MalformedBody(m)) => ApiError::new(ErrorCode::MalformedBody, m),
        Refused::Verify(other) => ApiError::new(other.code(), other.to_string()),
        Refused::Store(e) => store_error(e),
    }
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
        (status = 415, description = "The body has a `Content-Encoding` (gzip, ...): send it uncompressed \
            (`unsupported_media_type`); nothing was stored", body = ErrorBody),
        (status = 500, description = "The source's secrets cannot be read with the configured secrets key, or an \
            unexpected database error (`internal`); nothing was acknowledged, the sender retries", body = ErrorBody),
        (status = 503, description = "The database is unreachable or did not answer within `--db-timeout-secs` \
            (`database_unavailable`). The message says which: \"nothing was stored\" when nothing reached the \
            database; \"may have been stored\" when the write may have reached it unconfirmed. Retrying is safe \
            either way (a stored webhook is answered as a duplicate).", body = ErrorBody,
            headers(("Retry-After" = u32, description = "Seconds to wait"))),
    ),
)]
pub async fn ingest(
    State(state): State<AppState>,
    source_name: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<IngestAnswer>, ApiError> {
    // A name that is not UTF-8 names no source: JSON, as every error (axum's own answer
    // was plain text).
    let Ok(Path(source_name)) = source_name else {
        crate::metrics::ingest_answered(axum::http::StatusCode::NOT_FOUND);
        return Err(ApiError::not_found("source"));
    };
    let span = crate::telemetry::server_span("/ingest/{source}", &headers);
    let answer = receive(state, &source_name, &headers, body).instrument(span.clone()).await;
    crate::metrics::ingest_answered(answer.as_ref().map_or_else(|e| e.status(), |_| axum::http::StatusCode::OK));
    traced_answer(&span, &answer);
    answer
}

/// Records the answer on the ingest span (nothing when tracing is off).
pub fn traced_answer<T>(span: &tracing::Span, answer: &Result<Json<T>, ApiError>)
where
    T: Traced,
{
    if span.is_none() {
        return;
    }
    match answer {
        Ok(Json(answer)) => {
            span.record("http.response.status_code", 200_i64);
            if let Some(stored) = answer.stored() {
                span.record("webhook.event_id", tracing::field::display(stored.event_id));
                span.record("webhook.duplicate", stored.duplicate);
            }
        }
        Err(e) => {
            span.record("http.response.status_code", i64::from(e.status().as_u16()));
            // A server span fails on a 5xx only: a 4xx is the client's mistake.
            if e.status().is_server_error() {
                span.record("otel.status_code", "ERROR");
            }
        }
    }
}

/// An answer that may name a stored event (for the ingest span's attributes).
pub trait Traced {
    /// The stored event, if the answer is about one.
    fn stored(&self) -> Option<&IngestResponse>;
}

impl Traced for IngestResponse {
    fn stored(&self) -> Option<&IngestResponse> {
        Some(self)
    }
}

impl Traced for IngestAnswer {
    fn stored(&self) -> Option<&IngestResponse> {
        match self {
            IngestAnswer::Stored(stored) => Some(stored),
            IngestAnswer::Challenge(_) => None,
        }
    }
}

/// A body with a `Content-Encoding` (gzip, ...) is refused (415), not stored: it would be
/// verified, searched and deduplicated as the compressed bytes (its key not found in it,
/// so a copy sent plain stored again), and delivered without the header that says how to
/// read it. Providers send webhooks uncompressed; a proxy that compresses them is told.
fn encoded_as_sent(headers: &HeaderMap) -> Result<(), ApiError> {
    match headers.get(axum::http::header::CONTENT_ENCODING) {
        Some(encoding) if !encoding.as_bytes().eq_ignore_ascii_case(b"identity") => Err(ApiError::new(
            ErrorCode::UnsupportedMediaType,
            format!(
                "Content-Encoding {:?} is not accepted: send the body uncompressed (it is verified, stored and \
                 delivered as sent)",
                String::from_utf8_lossy(encoding.as_bytes())
            ),
        )),
        _ => Ok(()),
    }
}

async fn receive(
    state: AppState,
    source_name: &str,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<IngestAnswer>, ApiError> {
    // The database gets `--db-timeout-secs` from here: the source lookup and the commit.
    let deadline = tokio::time::Instant::now() + state.db_timeout;
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large(state.max_body_bytes)
        } else {
            ApiError::new(ErrorCode::BadRequest, rejection.body_text())
        }
    })?;
    encoded_as_sent(headers)?;
    let received = state.intake.webhook(source_name, headers, body, deadline).await.map_err(refused)?;
    Ok(Json(received.into()))
}
