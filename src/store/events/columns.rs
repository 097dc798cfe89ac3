//! A batch's columns: the events of a group-commit batch as the batch statements bind
//! them (`$1`-`$13`, one array element per distinct event), written into a parameter
//! buffer sized for them.

use sqlx::Postgres;

use super::OwnedEvent;
use crate::ids::SourceId;

/// A batch's columns, one array element per distinct event, as the batch statements bind
/// them (`$1`-`$13`).
pub(super) struct BatchColumns<'a> {
    pub(super) source_ids: Vec<SourceId>,
    pub(super) keys: Vec<&'a str>,
    pub(super) types: Vec<&'a str>,
    pub(super) content_types: Vec<Option<&'a str>>,
    pub(super) headers: Vec<String>,
    pub(super) payloads: Vec<&'a [u8]>,
    pub(super) ords: Vec<i32>,
    pub(super) ordering_keys: Vec<Option<&'a str>>,
    pub(super) arrivals: Vec<i32>,
    pub(super) traceparents: Vec<Option<&'a str>>,
    pub(super) tracestates: Vec<Option<&'a str>>,
    pub(super) terms: Vec<i64>,
    pub(super) term_ends: Vec<i32>,
}

/// The parameters of the batch statements (`$1`-`$13`, [`BatchColumns::bound`]).
const BATCH_PARAMS: usize = 13;

/// The search terms a batch's column is first sized for, per event (the bench's webhook
/// has 17; a larger document grows the column once or twice).
const TERMS_PER_EVENT: usize = 32;

/// About the length of `headers` (an event's stored headers, a map of strings) as JSON
/// text: each member its quoted name and value, a colon and a comma, and an eighth more
/// for escapes; more escapes than that cost one growth.
pub(super) fn json_text_size(headers: &serde_json::Value) -> usize {
    let size = match headers {
        serde_json::Value::Object(map) => {
            2 + map.iter().map(|(k, v)| k.len() + v.as_str().map_or(16, str::len) + 6).sum::<usize>()
        }
        _ => 64,
    };
    size + size / 8
}

/// `headers` as JSON text, written into a string sized for it at once. (`to_string`
/// grew the string from empty through `Display`: five or six allocations for a
/// webhook's headers.)
fn json_text(headers: &serde_json::Value) -> String {
    let mut text = Vec::with_capacity(json_text_size(headers));
    match serde_json::to_writer(&mut text, headers) {
        // serde_json writes UTF-8 only.
        Ok(()) => String::from_utf8(text).unwrap_or_else(|_| headers.to_string()),
        Err(_) => headers.to_string(),
    }
}

impl<'a> BatchColumns<'a> {
    /// The columns of `events` at the indexes `unique` (each distinct key once, in the
    /// order the rows are inserted).
    pub(super) fn of(events: &'a [OwnedEvent], unique: &[usize]) -> Self {
        let each = || unique.iter().map(|&i| &events[i]);
        // Each event's search terms, end to end in one array: event n's are
        // `terms[term_ends[n-1] + 1 : term_ends[n]]` (1-based, inclusive), since a
        // parameter cannot be an array of arrays of different lengths.
        let mut terms: Vec<i64> = Vec::with_capacity(unique.len() * TERMS_PER_EVENT);
        let mut term_ends: Vec<i32> = Vec::with_capacity(unique.len());
        for e in each() {
            terms.extend_from_slice(&e.as_new().search_terms());
            term_ends.push(i32::try_from(terms.len()).unwrap_or(i32::MAX));
        }
        BatchColumns {
            source_ids: each().map(|e| e.source_id).collect(),
            keys: each().map(|e| e.dedupe_key.as_str()).collect(),
            types: each().map(|e| e.event_type.as_str()).collect(),
            content_types: each().map(|e| e.content_type.as_deref()).collect(),
            headers: each().map(|e| json_text(&e.headers)).collect(),
            payloads: each().map(|e| &e.payload[..]).collect(),
            ords: (0..unique.len() as i32).collect(),
            ordering_keys: each().map(|e| e.ordering_key.as_deref()).collect(),
            // The order events arrived in (the batch's input order), which orders the
            // deliveries of one line; `ord` is the (source, key) order the rows are
            // inserted in.
            arrivals: unique.iter().map(|&i| i32::try_from(i).unwrap_or(i32::MAX)).collect(),
            traceparents: each().map(|e| e.trace.as_ref().map(|t| t.traceparent.as_str())).collect(),
            tracestates: each().map(|e| e.trace.as_ref().and_then(|t| t.tracestate.as_deref())).collect(),
            terms,
            term_ends,
        }
    }

    /// The bytes these columns take bound: PostgreSQL's binary array format, a header
    /// per array and a length before each element.
    fn encoded_bytes(&self) -> usize {
        const ARRAY_HEADER: usize = 24;
        const ELEMENT_LENGTH: usize = 4;
        let text = |column: &[&str]| column.iter().map(|s| s.len()).sum::<usize>();
        let optional = |column: &[Option<&str>]| column.iter().flatten().map(|s| s.len()).sum::<usize>();
        let events = self.ords.len();
        // The terms' array says its own size (`Int8Array`); the others a header each.
        (BATCH_PARAMS - 1) * ARRAY_HEADER
            + (BATCH_PARAMS - 1) * events * ELEMENT_LENGTH
            + events * (16 + 3 * 4)
            + text(&self.keys)
            + text(&self.types)
            + optional(&self.content_types)
            + self.headers.iter().map(String::len).sum::<usize>()
            + self.payloads.iter().map(|p| p.len()).sum::<usize>()
            + optional(&self.ordering_keys)
            + optional(&self.traceparents)
            + optional(&self.tracestates)
            + 4
            + sqlx::Encode::<Postgres>::size_hint(&crate::db::Int8Array(&self.terms))
    }

    /// `sql` (a batch statement) with these columns bound as `$1`-`$13`.
    pub(super) fn bound<'q>(&'q self, sql: &'q str) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
        crate::db::query_sized(sql, BATCH_PARAMS, self.encoded_bytes())
            .bind(&self.source_ids)
            .bind(&self.keys)
            .bind(&self.types)
            .bind(&self.content_types)
            .bind(&self.headers)
            .bind(&self.payloads)
            .bind(&self.ords)
            .bind(&self.ordering_keys)
            .bind(&self.arrivals)
            .bind(&self.traceparents)
            .bind(&self.tracestates)
            .bind(crate::db::Int8Array(&self.terms))
            .bind(&self.term_ends)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::events::batch::plan_batch;
    use crate::store::events::batch::tests::event;

    #[test]
    fn headers_are_written_as_to_string_writes_them() {
        let long = "v".repeat(5_000);
        let cases = [
            serde_json::json!({}),
            serde_json::json!({"content-type": "application/json", "user-agent": "Stripe/1.0"}),
            serde_json::json!({"x-quoted": "a \"b\" \\ c\n\u{0001} é ✓", "x-long": long}),
            serde_json::json!({"x-redacted": crate::ingest::REDACTED, "x-n": 3, "x-list": ["a", "b"]}),
            serde_json::json!(null),
            serde_json::json!("text"),
        ];
        for headers in cases {
            assert_eq!(json_text(&headers), headers.to_string(), "{headers}");
        }
    }

    /// The bytes `value` takes bound: its length, then what it encodes to.
    fn encoded<'q, T: sqlx::Encode<'q, Postgres>>(value: &T) -> usize {
        let mut buffer = sqlx::postgres::PgArgumentBuffer::default();
        let _ = value.encode_by_ref(&mut buffer);
        4 + buffer.len()
    }

    /// An event with every column filled, escapes in its headers and a trace.
    fn full_event(source: SourceId, key: &str) -> OwnedEvent {
        OwnedEvent {
            content_type: Some("application/json; charset=utf-8".to_owned()),
            headers: serde_json::json!({"user-agent": "Stripe/1.0", "x-quoted": "a \"b\" \\ c\n é", "x-n": "42"}),
            payload: bytes::Bytes::from(format!(r#"{{"id": "{key}", "items": [1, 2.5, null, "x"]}}"#)),
            ordering_key: Some("customer-7".to_owned()),
            trace: Some(crate::telemetry::EventTrace {
                traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
                tracestate: Some("vendor=value".to_owned()),
            }),
            ..event(source, key)
        }
    }

    /// The room reserved for a statement's parameters holds them as sqlx encodes them, so
    /// binding never grows the buffer, and is not far off (a column left out of the
    /// estimate, or counted twice, fails this).
    #[test]
    fn the_room_reserved_for_the_parameters_holds_them() {
        let source = SourceId(uuid::Uuid::from_u128(1));
        let events: Vec<OwnedEvent> = (0..5).map(|i| full_event(source, &format!("k{i}"))).collect();
        let columns = BatchColumns::of(&events, &plan_batch(&events).unique);
        let bound = encoded(&columns.source_ids)
            + encoded(&columns.keys)
            + encoded(&columns.types)
            + encoded(&columns.content_types)
            + encoded(&columns.headers)
            + encoded(&columns.payloads)
            + encoded(&columns.ords)
            + encoded(&columns.ordering_keys)
            + encoded(&columns.arrivals)
            + encoded(&columns.traceparents)
            + encoded(&columns.tracestates)
            + encoded(&crate::db::Int8Array(&columns.terms))
            + encoded(&columns.term_ends);
        let estimate = columns.encoded_bytes();
        assert!(estimate >= bound && estimate <= bound + bound / 8, "batch: estimate {estimate}, bound {bound}");

        let event = &events[0];
        let new = event.as_new();
        let terms = new.search_terms();
        let bound = encoded(&new.source_id)
            + encoded(&new.dedupe_key)
            + encoded(&new.event_type)
            + encoded(&new.content_type)
            + encoded(&sqlx::types::Json(new.headers))
            + encoded(&new.payload)
            + encoded(&new.ordering_key)
            + encoded(&new.trace.map(|t| t.traceparent.as_str()))
            + encoded(&new.trace.and_then(|t| t.tracestate.as_deref()))
            + encoded(&crate::db::Int8Array(&terms));
        let estimate = super::super::event_encoded_bytes(&new, &terms);
        assert!(estimate >= bound && estimate <= bound + bound / 8, "one event: estimate {estimate}, bound {bound}");
    }
}
