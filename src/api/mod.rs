//! The HTTP surface: admin API under `/v1` (bearer token), webhook ingest, health.
//!
//! Handlers are thin: parse, call the store, [`crate::ingest`] or a pure function, and
//! answer with a typed body (`#[derive(Serialize, ToSchema)]`), the same type the
//! OpenAPI document names. Every error goes through [`crate::error::ApiError`].

pub mod auth;
mod deliveries;
mod endpoints;
mod events;
pub mod extract;
pub mod filters;
mod health;
mod ingest;
pub mod openapi;
mod replicas;
mod routes;
mod sources;
mod storage;
mod subscriptions;
mod tokens;
mod transforms;

use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};

use tower_http::classify::ServerErrorsFailureClass;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnResponse, TraceLayer};

use crate::error::ApiError;
use crate::log_throttle::Throttle;
use crate::role::Role;

pub use crate::actions::generate_secret;
pub use crate::state::AppState;
pub use routes::document;

/// The full router for a process of the given role. `console`: the web console's pages
/// (built by `crate::console`, which imports this module, so it is handed in), served under
/// `/console` with the same request deadline, body limit and request ids as the API, and
/// the admin API's database deadline.
pub fn router(state: AppState, role: Role, console: Option<Router<AppState>>) -> Router {
    let routes::Declared { public, ingest, admin } = routes::declared();
    let mut app: Router<AppState> = public.split_for_parts().0;
    if role != Role::Worker {
        let admin = admin
            .split_for_parts()
            .0
            .route_layer(middleware::from_fn_with_state(state.clone(), db_deadline))
            .route_layer(middleware::from_fn_with_state(state.clone(), auth::authorize));
        let ingest =
            ingest.split_for_parts().0.route_layer(middleware::from_fn_with_state(state.clone(), admit_by_bytes));
        app = app.merge(admin).merge(ingest);
    }
    if let Some(pages) = console {
        let pages = pages
            .route_layer(middleware::from_fn_with_state(state.clone(), db_deadline))
            .route_layer(middleware::from_fn_with_state(state.clone(), crate::console::session::audit));
        app = app.nest("/console", pages);
    }
    // Every request gets an `x-request-id` (the caller's, or a fresh UUID), echoed on the
    // response and carried by a span, so every log line a request causes names it.
    // Requests are logged at debug (a busy gateway would otherwise log every webhook);
    // server errors at warn, 503s (an outage answers every request so) at most one per 5 s.
    let request_trace = TraceLayer::new_for_http()
        .make_span_with(|req: &axum::http::Request<axum::body::Body>| {
            let id = req.headers().get(REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or_default();
            tracing::info_span!("request", request_id = %id, method = %req.method(), path = %req.uri().path())
        })
        .on_request(())
        .on_response(DefaultOnResponse::new().level(tracing::Level::DEBUG))
        .on_failure(|failure: ServerErrorsFailureClass, latency: Duration, _span: &tracing::Span| {
            // A 503 is the gateway saying "retry" (the database is unavailable): thinned
            // out, as an outage answers every request so. Any other 5xx is always logged.
            static UNAVAILABLE: Throttle = Throttle::new(crate::log_throttle::INTERVAL);
            match failure {
                ServerErrorsFailureClass::StatusCode(code) if code == axum::http::StatusCode::SERVICE_UNAVAILABLE => {
                    if let Some(left_out) = UNAVAILABLE.admit() {
                        tracing::warn!(
                            ?latency,
                            left_out,
                            "answered 503: the database is unavailable (left_out: 503s since the last such line)"
                        );
                    }
                }
                failure => tracing::warn!(classification = %failure, ?latency, "response failed"),
            }
        });
    let app = app.fallback(not_found).method_not_allowed_fallback(method_not_allowed).with_state(state.clone());
    // The layers every request passes go around the router as one service, outermost
    // first, rather than onto each route with `Router::layer`: there each layer boxed the
    // route again, and a request cloned every box of its route once per layer (45 boxed
    // clones per webhook, about a fourteenth of ingest's instructions; bench/PROFILE.md).
    let layered = tower::ServiceBuilder::new()
        .layer(SetRequestIdLayer::new(REQUEST_ID.clone(), MakeRequestUuid))
        .layer(request_trace)
        .layer(PropagateRequestIdLayer::new(REQUEST_ID.clone()))
        .layer(middleware::from_fn_with_state(state.clone(), edge))
        .layer(DefaultBodyLimit::max(state.max_body_bytes))
        .service(app);
    Router::new().fallback_service(layered)
}

/// Middleware on the ingest route: reserve room in the memory budget for the body before
/// it is read (its `Content-Length`, or the body limit when it declares none), held until
/// the answer; without room, 503 `overloaded` at once (see [`crate::ingest::budget`]).
async fn admit_by_bytes(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let limit = state.max_body_bytes as u64;
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    // Over the limit is a 413 from the body limit; it never holds more than the limit.
    let size = declared.map_or(limit, |n| n.min(limit));
    let Some(_reserved) = state.ingest_budget.admit(size) else {
        crate::metrics::ingest_answered(axum::http::StatusCode::SERVICE_UNAVAILABLE);
        crate::metrics::ingest_shed();
        return ApiError::overloaded().into_response();
    };
    next.run(request).await
}

/// Middleware every request passes, as one layer: a URL with an encoded NUL is refused
/// ([`nul_in_url`]), the rest is answered within its deadline ([`request_deadline`]), and
/// while the process drains (it is stopping) every answer closes its connection, so a
/// client or a TCP balancer that keeps connections alive opens its next one elsewhere;
/// requests are still served meanwhile. One layer rather than three: each `from_fn`
/// layer boxes the future of everything inside it once more, about a kilobyte and an
/// allocation a request (bench/PROFILE.md, "A batch's parameters bound into one buffer").
async fn edge(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let mut response = match nul_in_url(&request) {
        Some(refused) => refused,
        None => request_deadline(&state, request, next).await,
    };
    if state.draining.load(std::sync::atomic::Ordering::Relaxed) {
        response.headers_mut().insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
    }
    response
}

/// The header naming a request: the caller's, or a fresh UUID.
const REQUEST_ID: axum::http::HeaderName = axum::http::HeaderName::from_static("x-request-id");

/// A request's body must arrive, and the request be answered, within
/// `--http-request-timeout-secs`, else 408 with the reason: a client trickling its body
/// cannot hold a connection and a task for as long as it likes. (Headers are bounded by
/// the server itself, see `crate::server`.)
async fn request_deadline(state: &AppState, request: Request, next: Next) -> Response {
    let limit = if request.uri().path().ends_with("/recover") {
        state.request_timeout.max(RECOVER_TIMEOUT + ADMIN_MARGIN)
    } else {
        state.request_timeout
    };
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            tracing::warn!(timeout = ?limit, "request abandoned: its body did not arrive (or it was not answered) in time");
            let mut response = ApiError::new(
                crate::error::ErrorCode::RequestTimeout,
                format!("the request was not received and answered within {} s", limit.as_secs()),
            )
            .into_response();
            // The rest of the body may still be on its way: this connection is done.
            response
                .headers_mut()
                .insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
            response
        }
    }
}

/// A URL whose path or query holds an encoded NUL (`%00`) is a 400: no source name, id or
/// filter can hold one, and PostgreSQL could not even compare one. `None`: no NUL.
fn nul_in_url(request: &Request) -> Option<Response> {
    request.uri().path_and_query().is_some_and(|pq| pq.as_str().contains("%00")).then(|| {
        ApiError::new(crate::error::ErrorCode::BadRequest, "the URL contains an encoded NUL character (%00)")
            .into_response()
    })
}

/// Extra time an admin request gets beyond `--db-timeout-secs`, so that the bounds
/// inside it (pool acquire, the ingest deadline of `POST /v1/events`) answer first, with
/// what they know about the write.
pub const ADMIN_MARGIN: Duration = Duration::from_secs(1);

/// How long a recovery may run: it re-queues in statements of 1,000 rows; one cut short
/// is answered 503 and, repeated, goes on where it stopped. The request's own deadline
/// (`--http-request-timeout-secs`) stretches to it on that route, so the answer is this
/// one's 503, not a 408.
pub const RECOVER_TIMEOUT: Duration = Duration::from_secs(60);

/// Middleware: an admin request (its JSON body included) is answered within
/// `--db-timeout-secs` + [`ADMIN_MARGIN`] (a recovery: [`RECOVER_TIMEOUT`]); past that,
/// it is abandoned and answered 503 with `Retry-After`. Without it, a statement sent into
/// a network partition would hold the request until the kernel gives up on the connection.
async fn db_deadline(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let changes = !matches!(*request.method(), axum::http::Method::GET | axum::http::Method::HEAD);
    let limit = if request.uri().path().ends_with("/recover") {
        RECOVER_TIMEOUT.max(state.db_timeout + ADMIN_MARGIN)
    } else {
        state.db_timeout + ADMIN_MARGIN
    };
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            tracing::warn!(timeout = ?limit, "admin request abandoned: the database did not answer in time");
            ApiError::no_answer(limit, changes).into_response()
        }
    }
}

async fn not_found() -> ApiError {
    ApiError::not_found("route")
}

async fn method_not_allowed(method: axum::http::Method) -> ApiError {
    ApiError::new(crate::error::ErrorCode::MethodNotAllowed, format!("{method} is not allowed on this route"))
}
