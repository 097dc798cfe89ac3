//! The OpenAPI 3.1 document of this API (`GET /openapi.json`): its root, and the answers
//! operations share. The operations come from the `#[utoipa::path]` annotations on the
//! handlers and the `ToSchema` types they use, through the route declarations
//! (`super::routes`), which serve exactly what they document.
//!
//! Every handler answers with a typed body (`Json<T>`, `T: Serialize + ToSchema`), and its
//! annotation names that same `T`: the schema is derived from the type that is serialized,
//! so it cannot describe another shape. The answers every admin call shares
//! ([`AdminErrors`]) and every call with a JSON body shares ([`JsonBodyErrors`]) are
//! written once, as response groups.
//!
//! A handler is served and documented by annotating it and declaring it in
//! `super::routes`. `tests/it/openapi.rs` fails when a documented operation is not served
//! or a documented path serves another method, when an admin or JSON-body call lacks its
//! group's answers, or when a real answer does not match its schema.

use utoipa::OpenApi;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};

/// The document's root: info and tags (the operations come from `super::routes`).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "webhook-gateway",
        description = "Durable webhook ingestion and delivery. Admin calls live under `/v1` and need \
            `Authorization: Bearer <admin token>`. Every error answer is \
            `{\"error\": {\"code\": \"...\", \"message\": \"...\"}}`."
    ),
    tags(
        (name = "ingest", description = "Webhooks from providers (public; verified per source)"),
        (name = "sources", description = "Where webhooks come from and how they are verified"),
        (name = "endpoints", description = "Where deliveries go"),
        (name = "subscriptions", description = "Which events go to which endpoint"),
        (name = "events", description = "Publishing from internal producers; stored events"),
        (name = "deliveries", description = "Delivery state, attempts, redelivery"),
        (name = "operations", description = "Health, readiness, metrics, this document (public)"),
        (name = "storage", description = "Table sizes and retention (the janitor)"),
        (name = "fleet", description = "The replicas of the fleet: roles, releases, schema versions"),
    )
)]
pub struct ApiDoc;

/// Adds the `admin_token` bearer scheme the `/v1` operations refer to.
pub(super) struct AdminToken;

impl utoipa::Modify for AdminToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        let mut scheme = Http::new(HttpAuthScheme::Bearer);
        scheme.description = Some(
            "The bootstrap admin token (`--admin-token`), or a scoped token (`POST /v1/tokens`); each operation's \
             security requirement and `x-required-scope` name the scope it needs (read < operate < admin)"
                .into(),
        );
        components.add_security_scheme("admin_token", SecurityScheme::Http(scheme));
        // Each `/v1` operation's scope, from the one table the middleware enforces.
        for (path, item) in openapi.paths.paths.iter_mut().filter(|(p, _)| p.starts_with("/v1/")) {
            let operations = [
                (axum::http::Method::GET, item.get.as_mut()),
                (axum::http::Method::POST, item.post.as_mut()),
                (axum::http::Method::PATCH, item.patch.as_mut()),
                (axum::http::Method::PUT, item.put.as_mut()),
                (axum::http::Method::DELETE, item.delete.as_mut()),
            ];
            for (method, op) in operations {
                let Some(op) = op else { continue };
                let scope = crate::tokens::required(&method, path).as_str();
                op.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new("admin_token", [scope])]);
                let mut ext = op.extensions.take().unwrap_or_default();
                ext.merge(
                    utoipa::openapi::extensions::ExtensionsBuilder::new()
                        .add("x-required-scope", serde_json::json!(scope))
                        .build(),
                );
                op.extensions = Some(ext);
            }
        }
    }
}

/// What the annotations cannot say.
pub(super) struct Fixups;

impl utoipa::Modify for Fixups {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        // utoipa copies the (absent) license from Cargo.toml as `{"name": ""}`.
        openapi.info.license = None;
        // The rotate-secret body is optional (empty means defaults), but `Option<T>` as the
        // content would also allow a JSON `null`, which the handler refuses.
        if let Some(body) = openapi
            .paths
            .paths
            .get_mut("/v1/endpoints/{id}/rotate-secret")
            .and_then(|item| item.post.as_mut())
            .and_then(|op| op.request_body.as_mut())
        {
            body.required = Some(utoipa::openapi::Required::False);
        }
    }
}

/// The answers every admin call can give besides its own: 401 and 503. Listed in a
/// handler's `responses(...)` instead of repeating them. (A response group: utoipa reads
/// the variants; the answers themselves are [`crate::error::ApiError`]s.)
#[derive(utoipa::IntoResponses)]
pub enum AdminErrors {
    /// `auth::authorize` did not know the caller.
    #[response(status = 401, description = "Missing, unknown, revoked or expired token (`unauthorized`)")]
    Unauthorized(crate::error::ErrorBody),
    /// `auth::authorize` refused the call for the token's scope.
    #[response(
        status = 403,
        description = "The token's scope does not allow this call (`forbidden`); the \
        operation's `x-required-scope` says which scope it needs"
    )]
    Forbidden(crate::error::ErrorBody),
    /// The database is unreachable, or did not answer in time (`db_deadline`).
    #[response(
        status = 503,
        description = "The database is unreachable, or did not answer within `--db-timeout-secs` + 1 s \
            (`database_unavailable`). The message says what is known: \"nothing was stored\" or \"nothing was \
            changed\" when no change can have been applied; \"may have been applied\" when the connection failed or \
            went silent after a write may have reached the database (check before retrying a non-idempotent call).",
        headers(("Retry-After" = u32, description = "Seconds to wait"))
    )]
    Unavailable(crate::error::ErrorBody),
}

/// The answers of a call whose body is read by [`super::extract::ApiJson`]: 400, 413,
/// 415, 422. (A response group, like [`AdminErrors`].)
#[derive(utoipa::IntoResponses)]
pub enum JsonBodyErrors {
    /// The body is not JSON (or holds a NUL where no field accepts one).
    #[response(status = 400, description = "Malformed JSON (`malformed_json`)")]
    Malformed(crate::error::ErrorBody),
    /// The body is over `--max-body-bytes`.
    #[response(status = 413, description = "Body over the size limit (`payload_too_large`)")]
    TooLarge(crate::error::ErrorBody),
    /// The `Content-Type` is not JSON.
    #[response(status = 415, description = "Content-Type is not `application/json` (`unsupported_media_type`)")]
    NotJson(crate::error::ErrorBody),
    /// A field is missing, has the wrong type, fails a rule, or names something that does
    /// not exist.
    #[response(
        status = 422,
        description = "A field is missing or invalid, or names something that does not exist (an endpoint, a \
            source); the field is named in the message (`validation_failed`)"
    )]
    Invalid(crate::error::ErrorBody),
}
