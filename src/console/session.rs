//! Console sessions: sign in with the admin token, a signed stateless cookie, CSRF tokens.
//!
//! The cookie holds `<session id>.<issued at>.<mac>`: a random id, the Unix time it was
//! issued, and an HMAC-SHA256 of both under a key derived from the admin token. No session
//! table: any replica with the same token accepts it, and rotating the admin token changes
//! the key, which signs every session out. The raw token is never in the cookie, a URL or
//! the browser's storage. A session lasts [`SESSION_TTL`]; signing out clears the cookie in
//! that browser (a copied cookie stays valid until it expires or the token is rotated:
//! the price of keeping no state).
//!
//! CSRF: the token is an HMAC of the session id under the same key, so each session has
//! its own; every POST but the sign-in carries it in a hidden field and is refused 403
//! without it ([`Posted`]). The cookie is also `SameSite=Strict`, so another site's form
//! does not even carry it.

use askama::Template;
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hmac::{Hmac, Mac};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use sha2::Sha256;

use super::{ConsoleError, PageResult, render, see_other};
use crate::api::AppState;
use crate::error::{ApiError, ErrorCode};
use crate::tokens::{self, Principal, Scope};

/// The session cookie's name.
pub const COOKIE: &str = "wg_console";

/// How long a session lasts after signing in, in seconds (a working day and then some).
pub const SESSION_TTL: i64 = 12 * 3600;

type HmacSha256 = Hmac<Sha256>;

/// The signing key of sessions and CSRF tokens: derived from the admin token, so that
/// rotating the token invalidates every session.
fn key(admin_token: &str) -> [u8; 32] {
    let mut mac = HmacSha256::new_from_slice(admin_token.as_bytes()).expect("HMAC takes a key of any length");
    mac.update(b"webhook-gateway console session key v1");
    mac.finalize().into_bytes().into()
}

fn mac(key: &[u8; 32], purpose: &str, data: &str) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(purpose.as_bytes());
    mac.update(b"\0");
    mac.update(data.as_bytes());
    mac
}

/// A signed-in console session (an extractor: without a valid cookie, a GET is redirected
/// to the sign-in page and anything else refused 403; a page or form its token's scope
/// does not allow is refused 403, by the table the API uses, `tokens::required`).
#[derive(Clone)]
pub struct Session {
    id: String,
    key: [u8; 32],
    /// Whose session: `admin` (the bootstrap token) or a stored token's id.
    who: String,
    /// The caller, once `who` is looked up (every request: a revoked token's sessions end).
    principal: Option<Principal>,
}

// The key signs sessions: never printed.
impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Session {
    /// A new session's cookie value for `who` (`admin`, or a stored token's id), signed
    /// under `admin_token`'s key.
    fn issue(admin_token: &str, now: i64, who: &str) -> String {
        let id = hex::encode(rand::random::<[u8; 16]>());
        let payload = format!("{id}.{now}.{who}");
        let tag = hex::encode(mac(&key(admin_token), "session", &payload).finalize().into_bytes());
        format!("{payload}.{tag}")
    }

    /// The session a cookie value stands for, if its signature holds under `admin_token`'s
    /// key and it has not expired at `now`.
    fn verify(admin_token: &str, value: &str, now: i64) -> Option<Session> {
        let (payload, tag) = value.rsplit_once('.')?;
        let (id, rest) = payload.split_once('.')?;
        let (issued, who) = rest.split_once('.')?;
        let issued: i64 = issued.parse().ok()?;
        let key = key(admin_token);
        mac(&key, "session", payload).verify_slice(&hex::decode(tag).ok()?).ok()?;
        // Issued in the future (beyond a little clock skew between replicas) or expired.
        if issued > now + 60 || now - issued >= SESSION_TTL {
            return None;
        }
        Some(Session { id: id.to_owned(), key, who: who.to_owned(), principal: None })
    }

    /// Look up whose session this is: the bootstrap admin, or a stored token that is still
    /// valid (`None`: revoked, expired or deleted, and the session ends with it).
    async fn resolve(mut self, state: &AppState) -> Result<Option<Session>, ApiError> {
        let principal = if self.who == tokens::BOOTSTRAP_NAME {
            Some(Principal::bootstrap())
        } else {
            match uuid::Uuid::parse_str(&self.who) {
                Ok(id) => tokens::sql::principal_by_id(&state.pool, id).await?,
                Err(_) => None,
            }
        };
        Ok(principal.map(|p| {
            tokens::sql::touch_later(&state.pool, &p);
            self.principal = Some(p);
            self
        }))
    }

    /// What this session's token may do.
    pub fn scope(&self) -> Scope {
        self.principal.as_ref().map_or(Scope::Read, |p| p.scope)
    }

    /// Who this session acts as (a session not yet looked up reads no payloads).
    pub fn principal(&self) -> Principal {
        self.principal.clone().unwrap_or_else(|| Principal {
            name: "unknown".to_owned(),
            scope: Scope::Read,
            token_id: None,
            payloads: false,
        })
    }

    /// Whose session, as the audit log names it.
    pub fn actor(&self) -> &str {
        self.principal.as_ref().map_or("unknown", |p| p.name.as_str())
    }

    /// This session's CSRF token, for the hidden field of every form.
    pub fn csrf_token(&self) -> String {
        hex::encode(mac(&self.key, "csrf", &self.id).finalize().into_bytes())
    }

    /// Whether `presented` is this session's CSRF token (constant time).
    fn csrf_ok(&self, presented: &str) -> bool {
        match hex::decode(presented) {
            Ok(bytes) => mac(&self.key, "csrf", &self.id).verify_slice(&bytes).is_ok(),
            Err(_) => false,
        }
    }
}

/// The session cookie's value among the request's cookies.
fn cookie_value(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find_map(|(name, value)| (name == COOKIE).then_some(value))
}

/// Whether the browser reached us over https (directly or through a proxy that says so):
/// then the cookie is `Secure`.
fn over_https(parts_headers: &HeaderMap, uri: &axum::http::Uri) -> bool {
    uri.scheme_str() == Some("https")
        || parts_headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.split(',').next().is_some_and(|p| p.trim().eq_ignore_ascii_case("https")))
}

/// The database's clock: a session one replica issued is judged by whichever replica the
/// next page reaches, and a replica whose clock is off would end it early or late.
fn now() -> i64 {
    crate::clock::now().timestamp()
}

/// Middleware on the console's pages: every form sent (a `POST`: redeliver, pause,
/// resume, rotate, recover, test, sign in and out) and every page refused (403: a scope
/// that does not open it) is written to the audit log (`crate::audit`), with the
/// session's actor as it was when the request came (a form that ends its own session,
/// revoking its own token, is still its token's), the new session's for a sign-in, or
/// `unknown` without a valid session (a failed sign-in).
pub async fn audit(
    axum::extract::State(state): axum::extract::State<AppState>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let posted = request.method() == axum::http::Method::POST;
    let method = request.method().clone();
    let target = request
        .extensions()
        .get::<axum::extract::OriginalUri>()
        .map_or_else(|| request.uri().path().to_owned(), |u| u.0.path().to_owned());
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| target.clone(), |m| m.as_str().to_owned());
    let address =
        request.extensions().get::<axum::extract::ConnectInfo<std::net::SocketAddr>>().map(|c| c.0.ip().to_string());
    let request_id = request.headers().get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let before = cookie_value(request.headers()).and_then(|v| Session::verify(&state.admin_token, v, now()));
    // A page read costs no lookup: its actor is looked up only if it is refused.
    let mut before_actor = None;
    if posted && let Some(session) = before.clone() {
        before_actor = actor_of(session, &state).await;
    }
    let response = next.run(request).await;
    if !posted && response.status() != StatusCode::FORBIDDEN {
        return response;
    }
    if !posted && let Some(session) = before {
        before_actor = actor_of(session, &state).await;
    }
    // Signing in sets the session whose actor it was.
    let set = response
        .headers()
        .get_all(header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(|c| c.strip_prefix(&format!("{COOKIE}=")).and_then(|rest| rest.split(';').next()))
        .filter(|v| !v.is_empty())
        .and_then(|v| Session::verify(&state.admin_token, v, now()));
    let set_actor = match set {
        Some(session) => actor_of(session, &state).await,
        None => None,
    };
    let actor = set_actor.or(before_actor).unwrap_or_else(|| "unknown".to_owned());
    let actor = actor.as_str();
    let entry = crate::audit::Entry {
        actor,
        via: crate::audit::Via::Console,
        action: &format!("{method} {route}"),
        target: &target,
        status: response.status().as_u16(),
        address,
        request_id: request_id.as_deref(),
    };
    crate::audit::record_within(&state.pool, state.db_timeout, &entry).await;
    response
}

/// Whose `session` is, as the audit log names it: `None` when its token no longer works.
async fn actor_of(session: Session, state: &AppState) -> Option<String> {
    match session.resolve(state).await {
        Ok(Some(session)) => Some(session.actor().to_owned()),
        _ => None,
    }
}

impl FromRequestParts<AppState> for Session {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let verified = cookie_value(&parts.headers).and_then(|v| Session::verify(&state.admin_token, v, now()));
        let resolved = match verified {
            Some(session) => session.resolve(state).await.map_err(|e| ConsoleError(e).into_response())?,
            None => None,
        };
        match resolved {
            Some(session) => {
                let route = parts
                    .extensions
                    .get::<axum::extract::MatchedPath>()
                    .map_or_else(|| parts.uri.path().to_owned(), |m| m.as_str().to_owned());
                let needed = tokens::required(&parts.method, &route);
                if session.scope() < needed {
                    return Err(ConsoleError(ApiError::new(
                        ErrorCode::Forbidden,
                        format!(
                            "signed in as {:?} with the scope {}; this needs {}",
                            session.actor(),
                            session.scope().as_str(),
                            needed.as_str()
                        ),
                    ))
                    .into_response());
                }
                Ok(session)
            }
            // Signing in brings the operator back to the page asked for (a deep link).
            None if parts.method == axum::http::Method::GET => {
                // The URI as the browser sent it (inside /console, `parts.uri` lacks the prefix).
                let original = parts.extensions.get::<axum::extract::OriginalUri>().map_or(&parts.uri, |o| &o.0);
                let asked = original.path_and_query().map_or("/console", |p| p.as_str());
                let next: String = url::form_urlencoded::byte_serialize(asked.as_bytes()).collect();
                Err(see_other(&format!("/console/login?next={next}")))
            }
            None => Err(ConsoleError(ApiError::new(
                ErrorCode::Forbidden,
                "not signed in (or the session expired): sign in again",
            ))
            .into_response()),
        }
    }
}

/// A console form post: a signed-in session whose CSRF token (the `csrf` field) matches,
/// and the form's fields as `T` (which ignores `csrf`). Anything else is refused 403
/// before the handler runs.
pub struct Posted<T>(pub Session, pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for Posted<T> {
    type Rejection = Response;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let (mut parts, body) = request.into_parts();
        let session = Session::from_request_parts(&mut parts, state).await?;
        let request = Request::from_parts(parts, body);
        let bytes = axum::body::Bytes::from_request(request, state).await.map_err(IntoResponse::into_response)?;
        let fields: Vec<(String, String)> = serde_urlencoded::from_bytes(&bytes).unwrap_or_default();
        let presented = fields.iter().find(|(name, _)| name == "csrf").map(|(_, v)| v.as_str()).unwrap_or("");
        if !session.csrf_ok(presented) {
            tracing::warn!("console: a form post without a valid CSRF token was refused");
            return Err(ConsoleError(ApiError::new(
                ErrorCode::Forbidden,
                "this form is stale or did not come from the console (CSRF token missing or wrong): reload the page",
            ))
            .into_response());
        }
        let form: T = serde_urlencoded::from_bytes(&bytes)
            .map_err(|e| ConsoleError(ApiError::new(ErrorCode::ValidationFailed, e.to_string())).into_response())?;
        Ok(Posted(session, form))
    }
}

/// A form with no fields but the CSRF token.
#[derive(Debug, Deserialize)]
pub struct NoFields {}

#[derive(Template)]
#[template(path = "console/login.html")]
struct LoginPage<'a> {
    error: Option<&'a str>,
    /// Where to go once signed in (a console path), carried through the form.
    next: &'a str,
}

/// Where the sign-in page was sent from.
#[derive(Deserialize)]
pub struct LoginQuery {
    #[serde(default)]
    next: Option<String>,
}

/// `GET /console/login[?next=/console/...]`.
pub async fn login_page(axum::extract::Query(query): axum::extract::Query<LoginQuery>) -> PageResult {
    render(&LoginPage { error: None, next: safe_next(query.next.as_deref()) })
}

/// The sign-in form.
#[derive(Deserialize)]
pub struct LoginForm {
    token: String,
    #[serde(default)]
    next: Option<String>,
}

/// Where a sign-in may lead: a page of this console ([`super::console_path`]) other than
/// the sign-in page itself; anything else is the overview.
fn safe_next(next: Option<&str>) -> &str {
    next.and_then(super::console_path)
        .filter(|path| *path != "/console/login" && !path.starts_with("/console/login?"))
        .unwrap_or("/console")
}

/// `POST /console/login`: the admin token in, a session cookie out.
pub async fn login(State(state): State<AppState>, request: Request) -> PageResult {
    let https = over_https(request.headers(), request.uri());
    let axum::Form(form) = axum::Form::<LoginForm>::from_request(request, &state)
        .await
        .map_err(|e| ConsoleError(ApiError::new(ErrorCode::BadRequest, e.body_text())))?;
    // Any valid token signs in: the bootstrap admin token or a scoped one (the console
    // then shows and allows what its scope allows).
    let Some(principal) = crate::api::auth::principal_of(&state, form.token.trim()).await.map_err(ConsoleError)? else {
        tracing::warn!("console: sign-in with an unknown, revoked or expired token");
        let mut response = render(&LoginPage {
            error: Some("That token is not known, or was revoked or has expired."),
            next: safe_next(form.next.as_deref()),
        })?;
        *response.status_mut() = StatusCode::UNAUTHORIZED;
        return Ok(response);
    };
    let who = principal.token_id.map_or_else(|| tokens::BOOTSTRAP_NAME.to_owned(), |id| id.to_string());
    let value = Session::issue(&state.admin_token, now(), &who);
    let secure = if https { "; Secure" } else { "" };
    let cookie = format!("{COOKIE}={value}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={SESSION_TTL}{secure}");
    let mut response = see_other(safe_next(form.next.as_deref()));
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, v);
    }
    tracing::info!(actor = %principal.name, scope = principal.scope.as_str(), "console: signed in");
    Ok(response)
}

/// `POST /console/logout`: clear the cookie. A valid session needs its CSRF token (so no
/// other site can sign an operator out); a post without a valid session (expired, already
/// signed out) has nothing to protect and just clears the cookie.
pub async fn logout(State(state): State<AppState>, request: Request) -> Response {
    let has_session =
        cookie_value(request.headers()).and_then(|v| Session::verify(&state.admin_token, v, now())).is_some();
    if has_session && let Err(refused) = Posted::<NoFields>::from_request(request, &state).await {
        return refused;
    }
    let mut response = see_other("/console/login");
    let cookie = format!("{COOKIE}=; Path=/console; HttpOnly; SameSite=Strict; Max-Age=0");
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, v);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Signing in leads back to a console page, and nowhere else.
    #[test]
    fn sign_in_leads_only_to_a_console_page() {
        for kept in ["/console", "/console/events?type=order.*", "/console/deliveries/0190a1b2", "/console?x=1"] {
            assert_eq!(safe_next(Some(kept)), kept);
        }
        for refused in [
            None,
            Some(""),
            Some("//evil.example/console"),
            Some("https://evil.example/console"),
            Some("/consolex"),
            Some("/console/../v1/endpoints"),
            Some("/console/login"),
            Some("/console/login?next=/console"),
            Some("/console/\\evil"),
            Some("/console/\r\nSet-Cookie: x"),
            Some("/console/é"),
            Some("/v1/endpoints"),
        ] {
            assert_eq!(safe_next(refused), "/console", "{refused:?}");
        }
    }

    const TOKEN: &str = "admin-token-for-unit-tests";

    #[test]
    fn a_session_verifies_under_its_token_only_and_expires() {
        let value = Session::issue(TOKEN, 1_000_000, "admin");
        assert!(Session::verify(TOKEN, &value, 1_000_000).is_some());
        assert!(Session::verify(TOKEN, &value, 1_000_000 + SESSION_TTL - 1).is_some());
        assert!(Session::verify(TOKEN, &value, 1_000_000 + SESSION_TTL).is_none(), "expired");
        assert!(Session::verify("another-admin-token", &value, 1_000_000).is_none(), "token rotated");
        // A changed id or time breaks the signature.
        let (payload, tag) = value.rsplit_once('.').unwrap();
        let (id, _) = payload.split_once('.').unwrap();
        assert!(Session::verify(TOKEN, &format!("{id}.1000001.admin.{tag}"), 1_000_000).is_none());
        // Nor can a session be moved to another token.
        assert!(
            Session::verify(TOKEN, &format!("{id}.1000000.0190a1b2-0000-7000-8000-000000000000.{tag}"), 1_000_000)
                .is_none()
        );
        assert!(Session::verify(TOKEN, "garbage", 1_000_000).is_none());
        assert!(!value.contains(TOKEN));
    }

    #[test]
    fn csrf_tokens_are_per_session() {
        let a = Session::verify(TOKEN, &Session::issue(TOKEN, 5, "admin"), 5).unwrap();
        let b = Session::verify(TOKEN, &Session::issue(TOKEN, 5, "admin"), 5).unwrap();
        assert!(a.csrf_ok(&a.csrf_token()));
        assert!(!a.csrf_ok(&b.csrf_token()));
        assert!(!a.csrf_ok(""));
        assert!(!a.csrf_ok("zz"));
    }

    #[test]
    fn the_cookie_is_found_among_others() {
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, HeaderValue::from_static("a=1; wg_console=v.1.t; b=2"));
        assert_eq!(cookie_value(&headers), Some("v.1.t"));
        headers.insert(header::COOKIE, HeaderValue::from_static("wg_consolex=1"));
        assert_eq!(cookie_value(&headers), None);
    }
}
