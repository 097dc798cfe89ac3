//! One error type for every HTTP answer, mapped to status and JSON in one place.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::log_throttle::Throttle;

/// An error answered to an HTTP client as `{"error": {"code", "message"}}`.
#[derive(Debug, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable machine-readable code.
    pub code: &'static str,
    /// Human-readable reason.
    pub message: String,
    /// Seconds for a `Retry-After` header (503s).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// An error with a status, code and message.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), retry_after: None }
    }

    /// 400: the request is malformed.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// 401: missing or wrong credentials.
    pub fn unauthorized(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, code, message)
    }

    /// 404: no such thing.
    pub fn not_found(what: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", format!("{what} not found"))
    }

    /// 409: conflicts with existing state.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }

    /// 413: body over the configured limit.
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("request body exceeds the limit of {limit} bytes"),
        )
    }

    /// 422: a field failed validation; the message names the field.
    pub fn validation(field: &str, reason: impl std::fmt::Display) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "validation_failed", format!("{field}: {reason}"))
    }

    /// 503 with `Retry-After`: the database is unreachable or did not answer; the message
    /// says what may have been committed.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self { retry_after: Some(5), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "database_unavailable", message) }
    }

    /// 503 for a request that got no answer from the database within `timeout` and was
    /// abandoned; `changes` says whether the request could have changed anything.
    pub fn no_answer(timeout: std::time::Duration, changes: bool) -> Self {
        let secs = timeout.as_secs_f64();
        Self::unavailable(if changes {
            format!(
                "the database did not answer within {secs} s; a change the request made may have been applied: \
                 check before retrying"
            )
        } else {
            format!("the database did not answer within {secs} s; nothing was changed, retry later")
        })
    }

    /// 500: a bug or an unexpected database error; details go to the log, not the client.
    pub fn internal() -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error; nothing was acknowledged")
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(err: sqlx::Error) -> Self {
        match crate::db::unavailable(&err) {
            Some(crate::db::Unavailable::NotCommitted) => {
                static THROTTLE: Throttle = Throttle::new(crate::log_throttle::INTERVAL);
                if let Some(left_out) = THROTTLE.admit() {
                    tracing::warn!(error = %err, left_out, "database unavailable");
                }
                ApiError::unavailable("the database is unreachable; nothing was stored, retry later")
            }
            Some(crate::db::Unavailable::Unconfirmed) => {
                static THROTTLE: Throttle = Throttle::new(crate::log_throttle::INTERVAL);
                if let Some(left_out) = THROTTLE.admit() {
                    tracing::warn!(error = %err, left_out, "database connection failed before an answer");
                }
                ApiError::unavailable(
                    "the database connection failed before the database answered; if the request changes \
                     something, the change may have been applied: check before retrying",
                )
            }
            None => {
                tracing::error!(error = %err, "database error");
                ApiError::internal()
            }
        }
    }
}

/// The body of every error answer: `{"error": {"code", "message"}}`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// The `error` object of an [`ErrorBody`].
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// Stable machine-readable code: `unauthorized`, `not_found`, `conflict`, `malformed_json`,
    /// `bad_request`, `validation_failed`, `payload_too_large`, `unsupported_media_type`,
    /// `database_unavailable`, `internal`; on ingest also `missing_signature`,
    /// `invalid_signature`, `timestamp_out_of_tolerance`, `malformed_body`, `not_ingestible`.
    #[schema(example = "not_found")]
    pub code: &'static str,
    /// Human-readable reason; for `validation_failed` it starts with the field's name.
    #[schema(example = "endpoint not found")]
    pub message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(ErrorBody { error: ErrorDetail { code: self.code, message: self.message } });
        let mut response = (self.status, body).into_response();
        if let Some(secs) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
