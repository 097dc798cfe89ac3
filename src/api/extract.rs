//! Extractors whose rejections are JSON `ApiError`s, so every 4xx carries a reason.

use std::str::FromStr;

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::error::{ApiError, ErrorCode};

/// `Json<T>` with JSON errors: 400 for broken JSON, 422 for a wrong shape (the message
/// names the field), 415 without a JSON content type, 413 over the body limit.
///
/// A NUL character in any string of the body is a 400 too (PostgreSQL stores none in
/// `text` or `jsonb`, and no name, URL, secret or description needs one), unless
/// `NUL_OK`: a body whose strings are data stored as bytes (`POST /v1/events`'s
/// payload), whose handler checks its text fields itself.
pub struct ApiJson<T, const NUL_OK: bool = false>(pub T);

/// The 400 for a body with a NUL character.
fn nul_in_body() -> ApiError {
    ApiError::new(
        ErrorCode::MalformedJson,
        "a string in the body contains a NUL character (\\u0000), which no field accepts",
    )
}

impl<S, T, const NUL_OK: bool> FromRequest<S> for ApiJson<T, NUL_OK>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        // Buffer the body once so it can be checked for NUL after axum has judged the
        // content type and the JSON (their rejections keep their own answers).
        let (parts, body) = req.into_parts();
        let bytes = axum::body::Bytes::from_request(Request::from_parts(parts.clone(), body), state)
            .await
            .map_err(body_rejection)?;
        let req = Request::from_parts(parts, axum::body::Body::from(bytes.clone()));
        match axum::Json::<T>::from_request(req, state).await {
            Ok(_) if !NUL_OK && crate::sanitize::json_has_nul(&bytes) => Err(nul_in_body()),
            Ok(axum::Json(value)) => Ok(ApiJson(value)),
            Err(JsonRejection::JsonDataError(e)) => Err(ApiError::new(
                ErrorCode::ValidationFailed,
                e.body_text().trim_start_matches("Failed to deserialize the JSON body into the target type: "),
            )),
            Err(JsonRejection::JsonSyntaxError(e)) => Err(ApiError::new(ErrorCode::MalformedJson, e.body_text())),
            Err(JsonRejection::MissingJsonContentType(_)) => {
                Err(ApiError::new(ErrorCode::UnsupportedMediaType, "expected Content-Type: application/json"))
            }
            Err(other) if other.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ApiError::new(ErrorCode::PayloadTooLarge, other.body_text()))
            }
            Err(other) => Err(ApiError::new(ErrorCode::BadRequest, other.body_text())),
        }
    }
}

/// A body that could not be read (too large, cut off) as a JSON error.
fn body_rejection(rejection: axum::extract::rejection::BytesRejection) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(ErrorCode::PayloadTooLarge, rejection.body_text())
    } else {
        ApiError::new(ErrorCode::BadRequest, rejection.body_text())
    }
}

/// `Query<T>` with JSON errors (422 naming the parameter).
pub struct ApiQuery<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(ApiQuery(value)),
            Err(QueryRejection::FailedToDeserializeQueryString(e)) => Err(ApiError::new(
                ErrorCode::ValidationFailed,
                e.body_text().trim_start_matches("Failed to deserialize query string: "),
            )),
            Err(other) => Err(ApiError::new(ErrorCode::BadRequest, other.body_text())),
        }
    }
}

/// Parse an id from a path segment; anything that is not an id is "not found".
fn parse_id<T: FromStr>(raw: &str, what: &str) -> Result<T, ApiError> {
    raw.parse().map_err(|_| ApiError::not_found(what))
}

/// A typed id from the path's one parameter (`/v1/deliveries/{id}`): a malformed id is
/// answered 404 "`<what>` not found" (JSON), like an unknown one, since no resource has it.
pub struct Id<T>(pub T);

impl<S: Send + Sync, T: FromStr + crate::ids::Named> FromRequestParts<S> for Id<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let axum::extract::Path(raw) = axum::extract::Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|_| ApiError::not_found(T::NAME))?;
        parse_id(&raw, T::NAME).map(Id)
    }
}

/// For PATCH bodies: absent field -> `None`, `null` -> `Some(None)`, value -> `Some(Some(v))`.
pub fn double_option<'de, T, D>(deserializer: D) -> Result<Option<Option<T>>, D::Error>
where
    T: serde::Deserialize<'de>,
    D: serde::Deserializer<'de>,
{
    Option::<T>::deserialize(deserializer).map(Some)
}

/// Page size from a query (default 100, 1 to 1000).
pub fn page_limit(limit: Option<i64>) -> Result<i64, ApiError> {
    let limit = limit.unwrap_or(100);
    if (1..=1000).contains(&limit) {
        Ok(limit)
    } else {
        Err(ApiError::validation("limit", "must be between 1 and 1000"))
    }
}

/// An optional JSON body: empty means `T::default()`; otherwise parsed like [`ApiJson`].
pub fn json_or_default<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    if crate::sanitize::json_has_nul(body) {
        return Err(nul_in_body());
    }
    serde_json::from_slice(body).map_err(|e| {
        if e.is_data() {
            ApiError::new(ErrorCode::ValidationFailed, e.to_string())
        } else {
            ApiError::new(ErrorCode::MalformedJson, e.to_string())
        }
    })
}
