//! Building the outbound request and reading the subscriber's answer, with bounds.

use axum::http::{HeaderMap, HeaderName, HeaderValue, header};

use super::sign;
use crate::queue::Claimed;

/// How much of a response body is read at most: a subscriber that streams forever costs
/// us this much and no more.
pub const MAX_RESPONSE_READ: usize = 64 * 1024;
/// How much of it is stored with the attempt.
pub const MAX_RESPONSE_STORED: usize = crate::sanitize::MAX_EXCERPT_BYTES;

/// `webhook-id`.
const WEBHOOK_ID: HeaderName = HeaderName::from_static("webhook-id");
/// `idempotency-key`: the same value as `webhook-id`.
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// `webhook-timestamp`.
const WEBHOOK_TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
/// `webhook-signature`.
const WEBHOOK_SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");
/// `webhook-attempt`.
const WEBHOOK_ATTEMPT: HeaderName = HeaderName::from_static("webhook-attempt");
/// `webhook-event-type`.
const WEBHOOK_EVENT_TYPE: HeaderName = HeaderName::from_static("webhook-event-type");
/// `webhook-source`.
const WEBHOOK_SOURCE: HeaderName = HeaderName::from_static("webhook-source");
/// Headers an attempt sets: the nine above and the content type, with room for the
/// client's own (`user-agent`, `content-length`) without growing the map.
const HEADERS: usize = 12;

/// The headers of one attempt. `secrets` are the endpoint's current signing secrets.
pub fn headers(job: &Claimed, secrets: &[&str], timestamp: i64) -> HeaderMap {
    let webhook_id = job.id.webhook_id();
    let mut h = HeaderMap::with_capacity(HEADERS);
    let content_type = job.content_type.as_deref().unwrap_or("application/json");
    h.insert(header::CONTENT_TYPE, value(content_type));
    let id = value(&webhook_id);
    h.insert(WEBHOOK_ID, id.clone());
    h.insert(IDEMPOTENCY_KEY, id);
    h.insert(WEBHOOK_TIMESTAMP, HeaderValue::from(timestamp));
    if let Some(signature) = sign::signature_header(secrets, &webhook_id, timestamp, &job.payload) {
        h.insert(WEBHOOK_SIGNATURE, value(&signature));
    }
    h.insert(WEBHOOK_ATTEMPT, HeaderValue::from(job.attempt));
    h.insert(WEBHOOK_EVENT_TYPE, value(&job.event_type));
    h.insert(WEBHOOK_SOURCE, value(&job.source_name));
    h
}

/// A header value from text that came from outside (event types, content types):
/// anything that is not visible ASCII becomes `?` rather than failing the delivery.
fn value(text: &str) -> HeaderValue {
    HeaderValue::from_str(text).unwrap_or_else(|_| {
        let cleaned: String = text.chars().map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).collect();
        HeaderValue::from_str(&cleaned).unwrap_or(HeaderValue::from_static("invalid"))
    })
}

/// Read up to [`MAX_RESPONSE_READ`] bytes of the body and keep the first
/// [`MAX_RESPONSE_STORED`] as storable text ([`crate::sanitize::stored_text`]: NUL and
/// invalid UTF-8 repaired). A body error ends the read: the status is what counts.
pub async fn read_excerpt(mut response: reqwest::Response) -> String {
    let mut kept: Vec<u8> = Vec::new();
    let mut read = 0usize;
    while read < MAX_RESPONSE_READ {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                read += chunk.len();
                let room = MAX_RESPONSE_STORED.saturating_sub(kept.len());
                kept.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    crate::sanitize::stored_text(&kept, MAX_RESPONSE_STORED)
}
