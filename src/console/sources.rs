//! Sources: kind, the ingest URL to paste into the provider's dashboard, fingerprints of
//! the secrets (never a secret), and webhooks refused, by reason.

use askama::Template;
use axum::extract::State;
use axum::http::HeaderMap;

use super::{Layout, PageResult, Session, Ts, render};
use crate::actions;
use crate::api::AppState;
use crate::ingest::rejections;
use crate::store;

struct SourceRow {
    name: String,
    kind: String,
    ingest_url: String,
    fingerprints: Vec<String>,
    rejections: Vec<(&'static str, u64)>,
    created_at: Ts,
}

#[derive(Template)]
#[template(path = "console/sources.html")]
struct Page {
    layout: Layout,
    rows: Vec<SourceRow>,
    overflow: u64,
}

/// The gateway's base URL as the browser reached it (a proxy's `X-Forwarded-Proto` and
/// `X-Forwarded-Host` win), for the ingest URLs; falls back to a relative path.
fn base_url(headers: &HeaderMap) -> String {
    let header = |name: &str| {
        headers.get(name).and_then(|v| v.to_str().ok()).map(|v| v.split(',').next().unwrap_or(v).trim().to_owned())
    };
    let host = header("x-forwarded-host").or_else(|| header("host"));
    let scheme = header("x-forwarded-proto").filter(|p| p == "https" || p == "http").unwrap_or_else(|| "http".into());
    match host {
        Some(host) if !host.is_empty() => format!("{scheme}://{host}"),
        _ => String::new(),
    }
}

/// `GET /console/sources` (every source: there are few, and the API lists them whole too).
pub async fn list(session: Session, State(state): State<AppState>, headers: HeaderMap) -> PageResult {
    let base = base_url(&headers);
    let counts = rejections::snapshot();
    let rows = store::sources::list(&state.pool)
        .await?
        .into_iter()
        .map(|s| {
            let rejections = counts.counts.iter().filter(|c| c.source == s.name).map(|c| (c.reason, c.count)).collect();
            // Internal sources take no webhooks: `api` is `POST /v1/events`, `_test` the
            // endpoints' test sends.
            let internal = s.spec.0.kind == crate::verify::Kind::Internal;
            SourceRow {
                fingerprints: actions::fingerprints(&s, &state.secrets),
                kind: s.spec.0.kind.as_str().to_owned(),
                ingest_url: if internal { String::new() } else { format!("{base}/ingest/{}", s.name) },
                rejections,
                created_at: Ts(s.created_at),
                name: s.name,
            }
        })
        .collect();
    render(&Page { layout: Layout::new(&session, "sources"), rows, overflow: counts.overflow })
}

#[cfg(test)]
mod tests {
    use axum::http::{HeaderMap, HeaderValue};

    #[test]
    fn the_base_url_follows_the_proxy() {
        let mut h = HeaderMap::new();
        assert_eq!(super::base_url(&h), "");
        h.insert("host", HeaderValue::from_static("gw.internal:8080"));
        assert_eq!(super::base_url(&h), "http://gw.internal:8080");
        h.insert("x-forwarded-host", HeaderValue::from_static("hooks.example.com"));
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        assert_eq!(super::base_url(&h), "https://hooks.example.com");
    }
}
