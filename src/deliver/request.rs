//! Building the outbound request and reading the subscriber's answer, with bounds.

use axum::http::{HeaderMap, HeaderName, HeaderValue, header};

use super::sign;
use crate::queue::Claimed;

/// How much of a response body is read at most: a subscriber that streams forever costs
/// us this much and no more.
pub const MAX_RESPONSE_READ: usize = 64 * 1024;
/// How much of it is stored with the attempt.
pub const MAX_RESPONSE_STORED: usize = crate::sanitize::MAX_EXCERPT_BYTES;

/// The headers of one attempt. `secrets` are the endpoint's current signing secrets.
pub fn headers(job: &Claimed, secrets: &[&str], timestamp: i64) -> HeaderMap {
    let webhook_id = job.id.webhook_id();
    let mut h = HeaderMap::new();
    let content_type = job.content_type.as_deref().unwrap_or("application/json");
    h.insert(header::CONTENT_TYPE, value(content_type));
    h.insert(HeaderName::from_static("webhook-id"), value(&webhook_id));
    h.insert(HeaderName::from_static("idempotency-key"), value(&webhook_id));
    h.insert(HeaderName::from_static("webhook-timestamp"), HeaderValue::from(timestamp));
    if let Some(signature) = sign::signature_header(secrets, &webhook_id, timestamp, &job.payload) {
        h.insert(HeaderName::from_static("webhook-signature"), value(&signature));
    }
    h.insert(HeaderName::from_static("webhook-attempt"), HeaderValue::from(job.attempt));
    h.insert(HeaderName::from_static("webhook-event-type"), value(&job.event_type));
    h.insert(HeaderName::from_static("webhook-source"), value(&job.source_name));
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
