//! The web console at `/console`: server-rendered pages for operators, signed in with the
//! admin token.
//!
//! - **One path to the database.** Every action calls the same functions as the admin API
//!   ([`crate::actions`], the store and queue functions its handlers call); a page
//!   adds no SQL of its own. Every list is a keyset page with a limit.
//! - **Sessions** (`session`): a signed, stateless cookie (HttpOnly, SameSite=Strict,
//!   Secure behind https), keyed by the admin token, so rotating the token signs everyone
//!   out. Every POST carries the session's CSRF token in a hidden field.
//! - **Escaping**: askama escapes every value in the `.html` templates (payloads and
//!   headers are attacker-controlled); the only unescaped output is [`Ts`], built here from
//!   a timestamp.
//! - **Headers**: a strict Content-Security-Policy (`default-src 'self'`, no inline script
//!   or style: the JS and CSS are files served from here), `X-Frame-Options: DENY`,
//!   `Referrer-Policy: no-referrer`, `Cache-Control: no-store` (a rotated secret is shown
//!   once).
//!
//! Askama rather than minijinja: templates are compiled and type-checked with the crate,
//! so a typo in a field is a build error, not a blank cell at 3 a.m., and rendering needs
//! no template files at run time.

mod dead;
mod endpoints;
mod events;
mod filters;
mod overview;
pub mod session;
mod sources;
mod tokens;
mod transforms;

use askama::Template;
use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};

use crate::api::AppState;
use crate::error::ApiError;

pub use session::Session;

/// The console's pages, to be served under `/console` (see `crate::api::router`).
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/", get(overview::page))
        .route("/overview/live", get(overview::live))
        .route("/login", get(session::login_page).post(session::login))
        .route("/logout", post(session::logout))
        .route("/events", get(events::list))
        .route("/events/{id}", get(events::show))
        .route("/deliveries/{id}", get(events::delivery))
        .route("/deliveries/{id}/redeliver", post(events::redeliver))
        .route("/endpoints", get(endpoints::list))
        .route("/endpoints/{id}", get(endpoints::show))
        .route("/endpoints/{id}/pause", post(endpoints::pause))
        .route("/endpoints/{id}/resume", post(endpoints::resume))
        .route("/endpoints/{id}/rotate-secret", post(endpoints::rotate))
        .route("/endpoints/{id}/test", post(endpoints::test_send))
        .route("/endpoints/{id}/recover", get(dead::confirm_recover).post(dead::recover))
        .route("/dead", get(dead::list))
        .route("/dead/redeliver", post(dead::redeliver))
        .route("/sources", get(sources::list))
        .route("/tokens", get(tokens::list).post(tokens::create))
        .route("/tokens/{id}/revoke", post(tokens::revoke))
        .route("/audit", get(tokens::audit_log))
        .route("/filters", get(filters::page))
        .route("/transforms", get(transforms::page))
        .route("/static/console.js", get(script))
        .route("/static/console.css", get(style))
        .route("/static/favicon.svg", get(favicon))
        // Unknown console URLs get the console's own 404 page, not the API's JSON.
        .fallback(not_found)
        .layer(axum::Extension(overview::Recent::default()))
        .layer(middleware::from_fn(security_headers))
}

/// The console's script: time localisation and the overview's live refresh.
const SCRIPT: &str = include_str!("assets/console.js");
/// The console's style sheet (light and dark).
const STYLE: &str = include_str!("assets/console.css");

async fn script() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], SCRIPT)
}

async fn style() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE)
}

/// The console's icon (browser tabs, bookmarks).
async fn favicon() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "image/svg+xml"), (header::CACHE_CONTROL, "max-age=86400")], FAVICON)
}

const FAVICON: &str = include_str!("assets/favicon.svg");

/// A console URL that names no page: the console's error page, 404.
async fn not_found(axum::extract::OriginalUri(uri): axum::extract::OriginalUri) -> Response {
    ConsoleError(ApiError::new(crate::error::ErrorCode::NotFound, format!("no console page at {}", uri.path())))
        .into_response()
}

/// The Content-Security-Policy of every console response: only this origin's files, no
/// inline script or style, no framing, forms post only here.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                       connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// Middleware: the security headers of every console response.
async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// What every signed-in page's layout needs: the nav's active entry and the CSRF token of
/// the sign-out form.
pub struct Layout {
    /// Which nav entry is highlighted (`overview`, `events`, `endpoints`, `dead`, `sources`).
    pub active: &'static str,
    /// The session's CSRF token, for the forms of the page.
    pub csrf: String,
    /// Who is signed in (a token's name, `admin` for the bootstrap token).
    pub actor: String,
    /// Whether the session may operate (redeliver, pause, resume, recover, test): its
    /// forms are shown only then.
    pub can_operate: bool,
    /// Whether the session may administer (rotate secrets).
    pub can_admin: bool,
}

impl Layout {
    fn new(session: &Session, active: &'static str) -> Layout {
        use crate::tokens::Scope;
        Layout {
            active,
            csrf: session.csrf_token(),
            actor: session.actor().to_owned(),
            can_operate: session.scope() >= Scope::Operate,
            can_admin: session.scope() >= Scope::Admin,
        }
    }
}

/// A timestamp as the console shows it: a `<time>` element with the UTC time as text and
/// title; the script rewrites the text in the viewer's zone and keeps UTC in the title.
#[derive(Debug, Clone, Copy)]
pub struct Ts(pub DateTime<Utc>);

impl std::fmt::Display for Ts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Only digits, `-`, `:`, `.`, `T`, `Z`, spaces and "UTC": nothing to escape.
        let iso = self.0.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let utc = self.0.format("%Y-%m-%d %H:%M:%S UTC");
        write!(f, r#"<time datetime="{iso}" title="{utc}">{utc}</time>"#)
    }
}

// The output above is markup this module built from a timestamp, not text from outside.
impl askama::filters::HtmlSafe for Ts {}

/// An optional timestamp: `Ts` or a dash.
pub fn ts(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "—".to_owned(), |t| Ts(t).to_string())
}

/// A page or the error page.
pub type PageResult = Result<Response, ConsoleError>;

/// Render a template as a 200 page.
fn render(template: &impl Template) -> PageResult {
    let body = template.render().map_err(|e| {
        tracing::error!(error = %e, "console template failed to render");
        ConsoleError(ApiError::internal())
    })?;
    Ok(Html(body).into_response())
}

/// An error shown as a page: the API's error (status, code, message), in HTML.
#[derive(Debug)]
pub struct ConsoleError(pub ApiError);

impl From<ApiError> for ConsoleError {
    fn from(e: ApiError) -> Self {
        ConsoleError(e)
    }
}

impl From<sqlx::Error> for ConsoleError {
    fn from(e: sqlx::Error) -> Self {
        ConsoleError(e.into())
    }
}

#[derive(Template)]
#[template(path = "console/error.html")]
struct ErrorPage<'a> {
    status: u16,
    code: &'a str,
    message: &'a str,
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let e = self.0;
        let page = ErrorPage { status: e.status().as_u16(), code: e.code.as_str(), message: &e.message };
        let body = page.render().unwrap_or_else(|_| "error".to_owned());
        let mut response = (e.status(), Html(body)).into_response();
        if let Some(secs) = e.retry_after
            && let Ok(v) = HeaderValue::from_str(&secs.to_string())
        {
            response.headers_mut().insert(header::RETRY_AFTER, v);
        }
        response
    }
}

/// 303 See Other to a console path (after a POST: the browser GETs the result, and a
/// reload does not post again).
pub fn see_other(path: &str) -> Response {
    let mut response = StatusCode::SEE_OTHER.into_response();
    if let Ok(v) = HeaderValue::from_str(path) {
        response.headers_mut().insert(header::LOCATION, v);
    }
    response
}

/// Parse an id from a path; 404 page for anything else.
fn parse_id<T: std::str::FromStr>(raw: &str, what: &str) -> Result<T, ConsoleError> {
    raw.parse().map_err(|_| ConsoleError(ApiError::not_found(what)))
}

/// A time typed into a form: RFC 3339, or `YYYY-MM-DD HH:MM[:SS]` / `YYYY-MM-DDTHH:MM[:SS]`
/// read as UTC; empty is none.
fn parse_time(field: &str, raw: Option<&str>) -> Result<Option<DateTime<Utc>>, ConsoleError> {
    let Some(raw) = raw.map(str::trim).filter(|s| !s.is_empty()) else { return Ok(None) };
    if let Ok(t) = DateTime::parse_from_rfc3339(raw) {
        return Ok(Some(t.with_timezone(&Utc)));
    }
    for format in ["%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M"] {
        if let Ok(t) = chrono::NaiveDateTime::parse_from_str(raw, format) {
            return Ok(Some(t.and_utc()));
        }
    }
    Err(ConsoleError(ApiError::validation(field, "a time like 2026-01-31 14:05 (UTC) or RFC 3339")))
}

/// How far back a window of the search forms reaches.
fn window_start(window: Option<&str>) -> Option<DateTime<Utc>> {
    let span = match window.unwrap_or("") {
        "15m" => chrono::Duration::minutes(15),
        "1h" => chrono::Duration::hours(1),
        "6h" => chrono::Duration::hours(6),
        "24h" => chrono::Duration::hours(24),
        "7d" => chrono::Duration::days(7),
        _ => return None,
    };
    Some(crate::clock::now() - span)
}

/// The windows offered by the search forms: (value, label).
pub const WINDOWS: &[(&str, &str)] = &[
    ("15m", "last 15 min"),
    ("1h", "last hour"),
    ("6h", "last 6 h"),
    ("24h", "last 24 h"),
    ("7d", "last 7 days"),
    ("all", "any time"),
];

/// An `<option>` of a select.
pub struct Opt {
    /// Its value.
    pub value: String,
    /// What it shows.
    pub label: String,
    /// Whether it is the current choice.
    pub selected: bool,
}

/// Options of a select from (value, label) pairs, `selected` marked.
fn options(items: impl IntoIterator<Item = (String, String)>, selected: &str) -> Vec<Opt> {
    items.into_iter().map(|(value, label)| Opt { selected: value == selected, value, label }).collect()
}

/// The window options of the search forms.
fn window_options(selected: &str) -> Vec<Opt> {
    options(WINDOWS.iter().map(|(v, l)| ((*v).to_owned(), (*l).to_owned())), selected)
}

/// Rows per console list page.
pub const PAGE: i64 = 50;

/// The empty string for `None`, for form fields.
fn or_empty(s: &Option<String>) -> String {
    s.clone().unwrap_or_default()
}

/// `None` for an empty or blank form field.
fn non_empty(s: Option<String>) -> Option<String> {
    s.map(|s| s.trim().to_owned()).filter(|s| !s.is_empty())
}

/// `path` if it is a page of this console that a form may send the browser back to: a
/// path under `/console`, never another site (`//evil.example`, a scheme), `..`, a
/// backslash, a control character (a header split) or anything a `Location` header cannot
/// hold as it is.
fn console_path(path: &str) -> Option<&str> {
    let under = path == "/console" || path.starts_with("/console/") || path.starts_with("/console?");
    let plain = path.is_ascii() && !path.contains("..") && !path.contains('\\') && !path.chars().any(char::is_control);
    (under && plain).then_some(path)
}

/// The event a "try" form names (the filters and transformations pages): a stored event's
/// id, or a pasted JSON payload; else the message the page shows.
fn tried_event(
    event_id: Option<String>,
    payload: Option<String>,
) -> Result<(Option<crate::ids::EventId>, Option<crate::filters::PastedEvent>), String> {
    match (non_empty(event_id), non_empty(payload)) {
        (Some(id), _) => id.parse().map(|id| (Some(id), None)).map_err(|_| format!("{id:?} is not an event id")),
        (None, Some(payload)) => match serde_json::value::RawValue::from_string(payload) {
            Ok(payload) => Ok((
                None,
                Some(crate::filters::PastedEvent {
                    payload: Some(payload),
                    headers: serde_json::Map::new(),
                    event_type: String::new(),
                    source: None,
                }),
            )),
            Err(e) => Err(format!("the pasted payload is not JSON: {e}")),
        },
        (None, None) => Err("give a stored event's id, or paste a payload".into()),
    }
}

/// What a "try" page shows of a refused try (a bad script or filter, an unknown event, a
/// stored event for a token that may not read payloads), or the error that goes to the
/// error page.
fn shown(e: ApiError) -> Result<String, ApiError> {
    use crate::error::ErrorCode;
    if matches!(e.code, ErrorCode::ValidationFailed | ErrorCode::NotFound | ErrorCode::Forbidden) {
        Ok(e.message)
    } else {
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_parsed_as_utc_and_bad_ones_named() {
        let t = parse_time("since", Some("2026-01-31 14:05")).unwrap().unwrap();
        assert_eq!(t.to_rfc3339(), "2026-01-31T14:05:00+00:00");
        let t = parse_time("since", Some("2026-01-31T14:05:00+02:00")).unwrap().unwrap();
        assert_eq!(t.to_rfc3339(), "2026-01-31T12:05:00+00:00");
        assert!(parse_time("since", Some("  ")).unwrap().is_none());
        let err = parse_time("since", Some("yesterday")).unwrap_err();
        assert!(err.0.message.contains("since"), "{}", err.0.message);
    }

    #[test]
    fn a_timestamp_renders_as_a_time_element() {
        let t = DateTime::parse_from_rfc3339("2026-01-31T14:05:06.5Z").unwrap().with_timezone(&Utc);
        assert_eq!(
            Ts(t).to_string(),
            r#"<time datetime="2026-01-31T14:05:06.500Z" title="2026-01-31 14:05:06 UTC">2026-01-31 14:05:06 UTC</time>"#
        );
    }
}
