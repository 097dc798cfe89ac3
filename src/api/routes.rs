//! Every route of the API, declared once: `routes!` reads each handler's
//! `#[utoipa::path]` annotation, so the router serves exactly the method and path the
//! annotation documents, and the OpenAPI document is built from the same declarations.
//! A handler cannot be served undocumented, nor documented unserved.

use std::sync::LazyLock;

use axum::http::header;
use axum::response::IntoResponse;
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::openapi::{AdminToken, ApiDoc, Fixups};
use super::{
    AppState, deliveries, endpoints, events, filters, health, ingest, replicas, sources, storage, subscriptions,
    tokens, transforms,
};

/// The routes by who may call them; the router puts each group behind its own layers.
pub(super) struct Declared {
    /// Health, readiness, metrics and this document: every role, no token.
    pub public: OpenApiRouter<AppState>,
    /// `POST /ingest/{source}`: roles that ingest; verified per source.
    pub ingest: OpenApiRouter<AppState>,
    /// `/v1`: roles that ingest; the admin token.
    pub admin: OpenApiRouter<AppState>,
}

/// The declarations (without layers or state).
pub(super) fn declared() -> Declared {
    let public = OpenApiRouter::new()
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(health::metrics))
        .routes(routes!(openapi_json));
    let ingest = OpenApiRouter::new().routes(routes!(ingest::ingest));
    let admin = OpenApiRouter::new()
        .routes(routes!(sources::create, sources::list))
        .routes(routes!(sources::get, sources::update, sources::delete))
        .routes(routes!(endpoints::create, endpoints::list))
        .routes(routes!(endpoints::get, endpoints::update, endpoints::delete))
        .routes(routes!(endpoints::pause))
        .routes(routes!(endpoints::resume))
        .routes(routes!(endpoints::rotate_secret))
        .routes(routes!(endpoints::test_send))
        .routes(routes!(endpoints::recover))
        .routes(routes!(subscriptions::create, subscriptions::list))
        .routes(routes!(subscriptions::get, subscriptions::update, subscriptions::delete))
        .routes(routes!(filters::test))
        .routes(routes!(transforms::test))
        .routes(routes!(events::publish, events::list))
        .routes(routes!(events::get))
        .routes(routes!(deliveries::list))
        .routes(routes!(deliveries::get))
        .routes(routes!(deliveries::attempts))
        .routes(routes!(deliveries::redeliver))
        .routes(routes!(deliveries::unblock))
        .routes(routes!(storage::get))
        .routes(routes!(replicas::list))
        .routes(routes!(tokens::create, tokens::list))
        .routes(routes!(tokens::revoke))
        .routes(routes!(tokens::audit_log));
    Declared { public, ingest, admin }
}

/// The document as served, built once from [`declared`] (every route, whatever this
/// process's role) and [`ApiDoc`]'s info and tags.
static DOCUMENT: LazyLock<String> = LazyLock::new(|| {
    let Declared { public, ingest, admin } = declared();
    let mut doc = ApiDoc::openapi();
    for part in [public, ingest, admin] {
        doc.merge(part.into_openapi());
    }
    AdminToken.modify(&mut doc);
    Fixups.modify(&mut doc);
    doc.to_json().expect("the OpenAPI document serializes")
});

/// The OpenAPI document, as JSON.
pub fn document() -> &'static str {
    &DOCUMENT
}

/// `GET /openapi.json`.
#[utoipa::path(
    get, path = "/openapi.json", tag = "operations", operation_id = "openapi",
    summary = "This document",
    responses((status = 200, description = "This document (OpenAPI 3.1)", content_type = "application/json")),
)]
pub async fn openapi_json() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], document())
}
