//! Bearer-token authentication of the admin API.

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;

use super::AppState;
use crate::error::ApiError;

/// Middleware: every `/v1` call needs `Authorization: Bearer <admin token>`.
pub async fn require_admin(State(state): State<AppState>, request: Request, next: Next) -> Result<Response, ApiError> {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        None => {
            Err(ApiError::new(crate::error::ErrorCode::Unauthorized, "missing `Authorization: Bearer <admin token>`"))
        }
        Some(token) if constant_time_eq(token.as_bytes(), state.admin_token.as_bytes()) => Ok(next.run(request).await),
        Some(_) => Err(ApiError::new(crate::error::ErrorCode::Unauthorized, "invalid admin token")),
    }
}

/// Compare without an early exit, so response timing does not reveal a prefix match.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

#[cfg(test)]
mod tests {
    #[test]
    fn constant_time_eq_compares_exactly() {
        assert!(super::constant_time_eq(b"abc", b"abc"));
        assert!(!super::constant_time_eq(b"abc", b"abd"));
        assert!(!super::constant_time_eq(b"abc", b"abcd"));
    }
}
