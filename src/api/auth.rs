//! Who is calling the admin API, and whether its token's scope allows the call: the one
//! place scopes are enforced (see [`crate::tokens`] for the table), and where every
//! change and every refused attempt is written to the audit log ([`crate::audit`]).

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, MatchedPath, Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;
use crate::audit::{self, Via};
use crate::error::{ApiError, ErrorCode};
use crate::tokens::{self, Principal};

/// Middleware on every `/v1` route: identify the caller by its bearer token, refuse a
/// call its scope does not allow (403), run the call, and record it in the audit log when
/// it changes something or was refused.
pub async fn authorize(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| request.uri().path().to_owned(), |m| m.as_str().to_owned());
    let target = request.uri().path().to_owned();
    let address = request.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0.ip().to_string());
    let request_id = request.headers().get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let needed = tokens::required(&method, &route);
    let caller = match identify(&state, request.headers()).await {
        Ok(caller) => caller,
        Err(e) => return e.into_response(),
    };
    let response = match &caller {
        None => ApiError::new(ErrorCode::Unauthorized, "missing or unknown token: `Authorization: Bearer <token>`")
            .into_response(),
        Some(p) if p.scope < needed => ApiError::new(
            ErrorCode::Forbidden,
            format!(
                "the token {:?} has the scope {}; {method} {route} needs {}",
                p.name,
                p.scope.as_str(),
                needed.as_str()
            ),
        )
        .into_response(),
        Some(p) => {
            request.extensions_mut().insert(p.clone());
            next.run(request).await
        }
    };
    // Publishing an event and trying a filter or a transformation change no configuration:
    // they are data, not changes (an audit row per published event would double its cost).
    const NOT_CHANGES: &[&str] = &["/v1/events", "/v1/filters/test", "/v1/transforms/test"];
    let changes = method != Method::GET && method != Method::HEAD && !NOT_CHANGES.contains(&route.as_str());
    // A refused change is a change (audited above); a refused read by a known token too.
    let refused_read = response.status().as_u16() == 403;
    if changes || refused_read {
        let entry = audit::Entry {
            actor: caller.as_ref().map_or("unknown", |p| p.name.as_str()),
            via: Via::Api,
            action: &format!("{method} {route}"),
            target: &target,
            status: response.status().as_u16(),
            address,
            request_id: request_id.as_deref(),
        };
        // Bounded like the call itself: a 503 by then must not wait for its audit row.
        audit::record_within(&state.pool, state.db_timeout, &entry).await;
    }
    response
}

/// The caller a request's bearer token stands for: the bootstrap admin token (compared
/// in constant time), or a stored token looked up by its hash; `None` for no token, an
/// unknown one, a revoked or an expired one.
pub async fn identify(state: &AppState, headers: &HeaderMap) -> Result<Option<Principal>, ApiError> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let Some(token) = presented else { return Ok(None) };
    principal_of(state, token).await
}

/// The caller `token` stands for (see [`identify`]).
pub async fn principal_of(state: &AppState, token: &str) -> Result<Option<Principal>, ApiError> {
    if constant_time_eq(token.as_bytes(), state.admin_token.as_bytes()) {
        return Ok(Some(Principal::bootstrap()));
    }
    if !token.starts_with(tokens::PREFIX) {
        return Ok(None);
    }
    // Bounded: a lookup sent into a partition answers 503 by the deadline.
    match tokio::time::timeout(state.db_timeout, tokens::sql::principal(&state.pool, &tokens::hash(token))).await {
        Ok(found) => {
            let found = found?;
            if let Some(p) = &found {
                tokens::sql::touch_later(&state.pool, p);
            }
            Ok(found)
        }
        Err(_) => Err(ApiError::unavailable("the database did not answer in time; nothing was changed")),
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

    /// The time a comparison takes does not depend on how much of a guess is right: a
    /// guess that matches all but the last byte takes as long as one that matches none.
    /// The same harness run on `==` (which stops at the first difference) must see the
    /// difference, so the test can fail. Timings are relative, interleaved and taken as
    /// medians over a long secret, where an early exit is thousands of times faster.
    #[test]
    fn comparing_a_guess_takes_as_long_whatever_prefix_it_matches() {
        use std::hint::black_box;
        use std::time::Instant;
        let secret = vec![b'a'; 64 * 1024];
        let mut near = secret.clone();
        *near.last_mut().expect("not empty") = b'b';
        let mut far = secret.clone();
        far[0] = b'b';
        let median_ratio = |compare: &dyn Fn(&[u8], &[u8]) -> bool| {
            let mut ratios: Vec<f64> = (0..31)
                .map(|_| {
                    let time = |guess: &[u8]| {
                        let started = Instant::now();
                        for _ in 0..8 {
                            black_box(compare(black_box(&secret), black_box(guess)));
                        }
                        started.elapsed().as_nanos().max(1) as f64
                    };
                    let (n, f) = (time(&near), time(&far));
                    n / f
                })
                .collect();
            ratios.sort_by(f64::total_cmp);
            ratios[ratios.len() / 2]
        };
        let leaky = median_ratio(&|a, b| a == b);
        assert!(leaky > 5.0, "the harness sees an early exit (near/far = {leaky:.1})");
        let constant = median_ratio(&|a, b| super::constant_time_eq(a, b));
        eprintln!("near/far: == {leaky:.1}, constant-time {constant:.2}");
        assert!((0.5..2.0).contains(&constant), "near/far = {constant:.2} for the constant-time comparison");
    }
}
