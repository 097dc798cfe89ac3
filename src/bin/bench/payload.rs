//! The webhook the load generator sends: a realistic 1-2 KiB JSON event (shaped like a
//! payment provider's `order.paid`), signed per the bench source's HMAC scheme.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Name of the source every scenario ingests into.
pub const SOURCE: &str = "bench";
/// The source's HMAC secret.
pub const SECRET: &str = "bench-hmac-secret-7f3a9c2e51d84b06";
/// Event type every body carries at `/type`.
pub const EVENT_TYPE: &str = "order.paid";
/// Marker the sink looks for to match a delivery to the request that produced it.
pub const SEQ_MARKER: &[u8] = b"bench_seq";
/// Placeholder for the sequence number in [`template`] (SQL seeding replaces it).
pub const SEQ_PLACEHOLDER: &str = "__SEQ__";

/// The `POST /v1/sources` body for the bench source.
pub fn source_spec() -> serde_json::Value {
    source_spec_named(SOURCE)
}

/// [`source_spec`] under another name (its secret and settings the same).
pub fn source_spec_named(name: &str) -> serde_json::Value {
    serde_json::json!({
        "name": name,
        "kind": "hmac",
        "secrets": [SECRET],
        "hmac": {"header": "X-Signature", "algorithm": "sha256", "encoding": "hex", "prefix": "sha256="},
        "dedupe": {"header": "X-Request-Id"},
        "event_type": {"json_pointer": "/type"},
    })
}

/// The body with [`SEQ_PLACEHOLDER`] where the sequence number goes.
pub fn template() -> String {
    body_with(SEQ_PLACEHOLDER)
}

/// The body of webhook number `seq`.
pub fn body(seq: u64) -> String {
    body_with(&seq.to_string())
}

/// Extra line items in every body (`--body-extra-items`; 0: the 1-2 KiB event as it is).
static EXTRA_ITEMS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Make every body carry `items` more line items (six scalars and about 110 bytes each),
/// for bodies larger than the default event: a provider's big payload (a GitHub push
/// holds hundreds of values) costs its parse and its search terms per webhook.
pub fn set_extra_items(items: usize) {
    EXTRA_ITEMS.store(items, std::sync::atomic::Ordering::Relaxed);
}

fn body_with(seq: &str) -> String {
    with_items(seq, EXTRA_ITEMS.load(std::sync::atomic::Ordering::Relaxed))
}

/// The event with `extra` more line items.
fn with_items(seq: &str, extra: usize) -> String {
    let mut body = event_body(seq);
    if extra > 0 && body.pop() == Some('}') {
        body.push_str(r#","more_items":["#);
        for i in 0..extra {
            if i > 0 {
                body.push(',');
            }
            body.push_str(&format!(
                r#"{{"id":"li_x{i}","sku":"SKU-{i:05}","description":"Item number {i}","quantity":{q},"unit_amount":{a},"tax_rate":"19%"}}"#,
                q = 1 + i % 3,
                a = 100 + i * 7
            ));
        }
        body.push_str("]}");
    }
    body
}

fn event_body(seq: &str) -> String {
    // The sequence number appears in the ids too, like a real provider's unique ids, so
    // no two bodies are identical (matters for TOAST compression and hashing).
    format!(
        concat!(
            r#"{{"id":"evt_1PbQ7x2eZvKYlo2C{seq}","object":"event","type":"{ty}","api_version":"2024-06-20","#,
            r#""created":1732867200,"bench_seq":{seq},"livemode":false,"pending_webhooks":1,"#,
            r#""request":{{"id":"req_Qx7bT3kLm9PzWa","idempotency_key":"b1f6a0c4-8e2d-4f7a-9c31-5d2e8b7a6f10"}},"#,
            r#""data":{{"object":{{"id":"ord_{seq}","object":"order","status":"paid","amount_total":15497,"#,
            r#""amount_subtotal":13997,"amount_tax":1500,"currency":"eur","payment_method":"card","#,
            r#""customer":{{"id":"cus_NffrFeUfNV2Hib","email":"jane.doe@example.com","name":"Jane Doe","#,
            r#""phone":"+49 30 1234567","address":{{"line1":"Invalidenstrasse 117","line2":null,"#,
            r#""city":"Berlin","postal_code":"10115","state":"BE","country":"DE"}}}},"#,
            r#""shipping":{{"carrier":"DHL","service":"express","tracking_number":"JJD0099999999{seq}","#,
            r#""address":{{"line1":"Invalidenstrasse 117","city":"Berlin","postal_code":"10115","country":"DE"}}}},"#,
            r#""line_items":["#,
            r#"{{"id":"li_1","sku":"TSHIRT-BLK-M","description":"T-shirt, black, M","quantity":2,"unit_amount":2499,"tax_rate":"19%"}},"#,
            r#"{{"id":"li_2","sku":"HOODIE-GRY-L","description":"Hoodie, grey, L","quantity":1,"unit_amount":5999,"tax_rate":"19%"}},"#,
            r#"{{"id":"li_3","sku":"CAP-NVY","description":"Cap, navy","quantity":1,"unit_amount":1500,"tax_rate":"19%"}},"#,
            r#"{{"id":"li_4","sku":"SOCKS-3PK","description":"Socks, 3 pack","quantity":1,"unit_amount":1500,"tax_rate":"19%"}}],"#,
            r#""discounts":[{{"code":"WELCOME10","amount":0}}],"#,
            r#""metadata":{{"channel":"web","campaign":"winter-sale","cart_id":"cart_8c1d2e3f","ab_bucket":"b"}},"#,
            r#""created_at":"2024-11-29T09:41:07Z","paid_at":"2024-11-29T09:41:12Z"}},"#,
            r#""previous_attributes":{{"status":"pending"}}}}}}"#
        ),
        seq = seq,
        ty = EVENT_TYPE,
    )
}

/// `sha256=<hex HMAC-SHA256 of body>`, the value of `X-Signature`.
pub fn signature(body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(SECRET.as_bytes()).expect("HMAC takes any key length");
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

/// The dedupe key (`X-Request-Id`) of webhook `seq` in run `run`.
pub fn request_id(run: &str, seq: u64) -> String {
    format!("req-{run}-{seq}")
}

/// A complete HTTP/1.1 request for webhook `seq`, ready to write to a keep-alive connection.
pub fn http_request(host: &str, run: &str, seq: u64) -> Vec<u8> {
    http_request_to(host, SOURCE, run, seq)
}

/// [`http_request`] to the source named `source` (one made with [`source_spec_named`]).
pub fn http_request_to(host: &str, source: &str, run: &str, seq: u64) -> Vec<u8> {
    let body = body(seq);
    let head = format!(
        "POST /ingest/{source} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: wg-bench\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nX-Request-Id: {}\r\nX-Signature: {}\r\n\r\n",
        body.len(),
        request_id(run, seq),
        signature(body.as_bytes()),
    );
    let mut out = head.into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

/// A JSON body of about `bytes` (the event padded with a long string), and its signature:
/// the memory scenario sends it under a fresh key each time (the signature covers the
/// body only, so one body serves every request).
pub fn big_body(bytes: usize) -> (String, String) {
    let pad = "x".repeat(bytes.saturating_sub(200));
    let body = format!(r#"{{"type":"{EVENT_TYPE}","bench_seq":0,"pad":"{pad}"}}"#);
    let sig = signature(body.as_bytes());
    (body, sig)
}

/// A request carrying `body` (signed `sig`) as webhook `seq`.
pub fn request_with(host: &str, run: &str, seq: u64, body: &str, sig: &str) -> Vec<u8> {
    let head = format!(
        "POST /ingest/{SOURCE} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: wg-bench\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nX-Request-Id: {}\r\nX-Signature: {sig}\r\n\r\n",
        body.len(),
        request_id(run, seq),
    );
    let mut out = Vec::with_capacity(head.len() + body.len());
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(body.as_bytes());
    out
}

/// The sequence number in a delivered body, if it carries the marker.
pub fn find_seq(body: &[u8]) -> Option<u64> {
    let at = body.windows(SEQ_MARKER.len()).position(|w| w == SEQ_MARKER)? + SEQ_MARKER.len();
    // `"bench_seq":12`, or `\"bench_seq\": 12` should a delivery embed the body as a JSON string.
    let rest = &body[at..];
    let skip = rest.iter().take(4).take_while(|b| matches!(b, b'"' | b'\\' | b':' | b' ')).count();
    let digits: Vec<u8> = rest[skip..].iter().copied().take_while(u8::is_ascii_digit).collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_items_keep_the_body_one_json_document_with_its_seq() {
        let b = with_items("9", 3);
        let v: serde_json::Value = serde_json::from_str(&b).expect("valid JSON");
        assert_eq!(v["more_items"].as_array().map(Vec::len), Some(3));
        assert_eq!(v["more_items"][2]["sku"], "SKU-00002");
        assert_eq!(find_seq(b.as_bytes()), Some(9));
        assert_eq!(v["type"], EVENT_TYPE);
    }

    #[test]
    fn body_is_valid_json_of_one_to_two_kib_and_carries_its_seq() {
        for seq in [0, 7, 123_456_789_012] {
            let b = body(seq);
            let v: serde_json::Value = serde_json::from_str(&b).expect("valid JSON");
            assert_eq!(v["type"], EVENT_TYPE);
            assert_eq!(v["bench_seq"], seq);
            assert!((1024..=2048).contains(&b.len()), "{} bytes", b.len());
            assert_eq!(find_seq(b.as_bytes()), Some(seq));
            let embedded = serde_json::to_string(&serde_json::json!({ "payload": b })).unwrap();
            assert_eq!(find_seq(embedded.as_bytes()), Some(seq));
        }
        assert_eq!(template().replace(SEQ_PLACEHOLDER, "5"), body(5));
    }

    #[test]
    fn signature_matches_openssl() {
        // printf '%s' '{"a":1}' | openssl dgst -sha256 -hmac 'bench-hmac-secret-7f3a9c2e51d84b06'
        assert_eq!(signature(br#"{"a":1}"#), "sha256=87afd8e01382194398548b7e4e492bdeb4d3fcd3916cc964cb875dbb60c18afa");
    }
}
