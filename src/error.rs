//! One error type for every HTTP answer, mapped to status and JSON in one place.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::log_throttle::Throttle;

/// Every code an error answer can carry, each tied to the one HTTP status it is answered
/// with: a code cannot be sent with a status that contradicts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 400: the request is malformed in a way no other code names.
    BadRequest,
    /// 400: the body is not valid JSON.
    MalformedJson,
    /// 400 (ingest): the body cannot be read the way the source's kind requires.
    MalformedBody,
    /// 401: missing or wrong credentials.
    Unauthorized,
    /// 401 (ingest): the signature the source's kind requires is absent.
    MissingSignature,
    /// 401 (ingest): the signature does not match.
    InvalidSignature,
    /// 401 (ingest): the signed timestamp is outside the source's tolerance.
    TimestampOutOfTolerance,
    /// 403: refused for this session or form (the console).
    Forbidden,
    /// 403 (ingest): the source takes no webhooks (the gateway's own source).
    NotIngestible,
    /// 404: no such thing.
    NotFound,
    /// 405: the route exists, the method does not.
    MethodNotAllowed,
    /// 408: the request was not received and answered in time.
    RequestTimeout,
    /// 409: conflicts with existing state.
    Conflict,
    /// 413: body over the configured limit.
    PayloadTooLarge,
    /// 415: the body's media type is not the one the route takes.
    UnsupportedMediaType,
    /// 422: a field failed validation; the message starts with the field's name.
    ValidationFailed,
    /// 500: a stored secret cannot be decrypted with the configured keys.
    SecretUnreadable,
    /// 500: a bug or an unexpected database error (details in the log).
    Internal,
    /// 503: the database is unreachable or did not answer; comes with `Retry-After`.
    DatabaseUnavailable,
    /// 503: the process holds as many webhook bodies as its memory budget allows (the
    /// body was not read, nothing was stored); comes with `Retry-After`.
    Overloaded,
}

impl ErrorCode {
    /// Every code, for the tests that tie the names and statuses together.
    pub const ALL: [ErrorCode; 20] = [
        Self::BadRequest,
        Self::MalformedJson,
        Self::MalformedBody,
        Self::Unauthorized,
        Self::MissingSignature,
        Self::InvalidSignature,
        Self::TimestampOutOfTolerance,
        Self::Forbidden,
        Self::NotIngestible,
        Self::NotFound,
        Self::MethodNotAllowed,
        Self::RequestTimeout,
        Self::Conflict,
        Self::PayloadTooLarge,
        Self::UnsupportedMediaType,
        Self::ValidationFailed,
        Self::SecretUnreadable,
        Self::Internal,
        Self::DatabaseUnavailable,
        Self::Overloaded,
    ];

    /// The HTTP status this code is answered with.
    pub const fn status(self) -> StatusCode {
        match self {
            Self::BadRequest | Self::MalformedJson | Self::MalformedBody => StatusCode::BAD_REQUEST,
            Self::Unauthorized | Self::MissingSignature | Self::InvalidSignature | Self::TimestampOutOfTolerance => {
                StatusCode::UNAUTHORIZED
            }
            Self::Forbidden | Self::NotIngestible => StatusCode::FORBIDDEN,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::Conflict => StatusCode::CONFLICT,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::ValidationFailed => StatusCode::UNPROCESSABLE_ENTITY,
            Self::SecretUnreadable | Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Self::DatabaseUnavailable | Self::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The code as it appears in the JSON answer (and in the rejection metrics' `reason`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::BadRequest => "bad_request",
            Self::MalformedJson => "malformed_json",
            Self::MalformedBody => "malformed_body",
            Self::Unauthorized => "unauthorized",
            Self::MissingSignature => "missing_signature",
            Self::InvalidSignature => "invalid_signature",
            Self::TimestampOutOfTolerance => "timestamp_out_of_tolerance",
            Self::Forbidden => "forbidden",
            Self::NotIngestible => "not_ingestible",
            Self::NotFound => "not_found",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::RequestTimeout => "request_timeout",
            Self::Conflict => "conflict",
            Self::PayloadTooLarge => "payload_too_large",
            Self::UnsupportedMediaType => "unsupported_media_type",
            Self::ValidationFailed => "validation_failed",
            Self::SecretUnreadable => "secret_unreadable",
            Self::Internal => "internal",
            Self::DatabaseUnavailable => "database_unavailable",
            Self::Overloaded => "overloaded",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error answered to an HTTP client as `{"error": {"code", "message"}}`, with the
/// status its code is tied to.
#[derive(Debug, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    /// What went wrong, which also decides the HTTP status.
    pub code: ErrorCode,
    /// Human-readable reason.
    pub message: String,
    /// Seconds for a `Retry-After` header (503s).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// An error with a code and a message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into(), retry_after: None }
    }

    /// The HTTP status it is answered with.
    pub fn status(&self) -> StatusCode {
        self.code.status()
    }

    /// 404: no such thing.
    pub fn not_found(what: &str) -> Self {
        Self::new(ErrorCode::NotFound, format!("{what} not found"))
    }

    /// 409: conflicts with existing state.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Conflict, message)
    }

    /// 413: body over the configured limit.
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(ErrorCode::PayloadTooLarge, format!("request body exceeds the limit of {limit} bytes"))
    }

    /// 422: a field failed validation; the message names the field.
    pub fn validation(field: &str, reason: impl std::fmt::Display) -> Self {
        Self::new(ErrorCode::ValidationFailed, format!("{field}: {reason}"))
    }

    /// 503 with `Retry-After`: the database is unreachable or did not answer; the message
    /// says what may have been committed.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self { retry_after: Some(5), ..Self::new(ErrorCode::DatabaseUnavailable, message) }
    }

    /// 503 `overloaded` with `Retry-After: 1`: the memory budget has no room for the body.
    pub fn overloaded() -> Self {
        Self {
            retry_after: Some(1),
            ..Self::new(
                ErrorCode::Overloaded,
                "the gateway holds as many webhook bodies as its memory budget allows; nothing was stored, retry",
            )
        }
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
        Self::new(ErrorCode::Internal, "internal error; nothing was acknowledged")
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
            // A time the request gave that chrono reads and PostgreSQL does not store
            // (before 4713 BC): the caller's mistake, not a 500.
            None if matches!(&err, sqlx::Error::Database(db) if db.code().as_deref() == Some("22008")) => {
                ApiError::new(
                    ErrorCode::ValidationFailed,
                    "time: outside what PostgreSQL stores (4713 BC to 294276 AD)",
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
    /// Stable machine-readable code; each code comes with one HTTP status.
    pub code: ErrorCode,
    /// Human-readable reason; for `validation_failed` it starts with the field's name.
    #[schema(example = "endpoint not found")]
    pub message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(ErrorBody { error: ErrorDetail { code: self.code, message: self.message } });
        let mut response = (self.code.status(), body).into_response();
        if let Some(secs) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The name in the JSON answer, the name in logs and metrics and the status stay one:
    /// serde's name is `as_str`, every code is an error status, and only
    /// `database_unavailable` and `overloaded` (the ones that say "retry") are 503s.
    #[test]
    fn each_code_has_one_name_and_an_error_status() {
        let mut names = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            assert_eq!(serde_json::to_value(code).unwrap(), code.as_str(), "{code:?}");
            assert!(names.insert(code.as_str()), "{code:?} named twice");
            let status = code.status();
            assert!(status.is_client_error() || status.is_server_error(), "{code:?}: {status}");
            let retry = matches!(code, ErrorCode::DatabaseUnavailable | ErrorCode::Overloaded);
            assert_eq!(status == StatusCode::SERVICE_UNAVAILABLE, retry, "{code:?}");
        }
    }

    /// The answer carries the code's status and name, and `Retry-After` when it has one.
    #[tokio::test]
    async fn an_error_answers_with_its_code_s_status() {
        let response = ApiError::unavailable("down").into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "5");
        let body = axum::body::to_bytes(response.into_body(), 1 << 16).await.unwrap();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["error"]["code"], "database_unavailable");
        assert_eq!(json["error"]["message"], "down");
    }
}
