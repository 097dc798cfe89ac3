//! The statements' arguments as SQL literals, for the script a stand-alone backend reads.

use serde_json::json;

use crate::pg::{array, bytes_lit, lit};

/// One bench webhook as the gateway stores it.
pub(super) struct Event {
    key: String,
    headers: serde_json::Value,
    body: String,
    terms: Vec<i64>,
}

impl Event {
    pub(super) fn new(key: &str, seq: u64) -> Event {
        let body = crate::payload::body(seq);
        let headers = json!({
            "content-type": "application/json",
            "user-agent": "wg-bench",
            "x-request-id": key,
            "x-signature": "[redacted]",
        });
        let terms = webhook_gateway::search::terms(key, &headers, body.as_bytes());
        Event { key: key.to_owned(), headers, body, terms }
    }

    /// `insert_sql`'s ten arguments.
    pub(super) fn single(&self, source: &str) -> String {
        format!(
            "{}, {}, {}, 'application/json', {}, {}, NULL, NULL, NULL, {}",
            lit(source),
            lit(&self.key),
            lit(crate::payload::EVENT_TYPE),
            lit(&self.headers.to_string()),
            bytes_lit(self.body.as_bytes()),
            array(self.terms.iter().map(i64::to_string), "int8")
        )
    }
}

/// `insert_batch_sql`'s thirteen arguments for `events`.
pub(super) fn batch_args(events: &[Event], source: &str) -> String {
    let each =
        |f: &dyn Fn(usize, &Event) -> String, ty: &str| array(events.iter().enumerate().map(|(i, e)| f(i, e)), ty);
    let mut ends = Vec::new();
    let mut end = 0;
    for e in events {
        end += e.terms.len();
        ends.push(end.to_string());
    }
    [
        each(&|_, _| lit(source), "uuid"),
        each(&|_, e| lit(&e.key), "text"),
        each(&|_, _| lit(crate::payload::EVENT_TYPE), "text"),
        each(&|_, _| lit("application/json"), "text"),
        each(&|_, e| lit(&e.headers.to_string()), "text"),
        each(&|_, e| bytes_lit(e.body.as_bytes()), "bytea"),
        each(&|i, _| i.to_string(), "int4"),
        each(&|_, _| "NULL".into(), "text"),
        each(&|i, _| i.to_string(), "int4"),
        each(&|_, _| "NULL".into(), "text"),
        each(&|_, _| "NULL".into(), "text"),
        array(events.iter().flat_map(|e| e.terms.iter().map(i64::to_string)), "int8"),
        array(ends, "int4"),
    ]
    .join(", ")
}

/// `RECORD_SQL`'s fourteen arguments: each claimed delivery `(id, token, attempt)`
/// delivered (200 in 12 ms).
pub(super) fn outcome_args(claimed: &[(String, String, String)]) -> String {
    let each = |f: &dyn Fn(&(String, String, String)) -> String, ty: &str| array(claimed.iter().map(f), ty);
    [
        each(&|c| lit(&c.0), "uuid"),
        each(&|c| c.1.clone(), "int8"),
        each(&|c| c.2.clone(), "int4"),
        each(&|_| "now()".into(), "timestamptz"),
        each(&|_| "12".into(), "int4"),
        each(&|_| "200".into(), "int4"),
        each(&|_| "NULL".into(), "text"),
        each(&|_| lit("delivered"), "text"),
        each(&|_| lit("delivered"), "text"),
        each(&|_| lit("HTTP 200"), "text"),
        each(&|_| lit("{\"ok\":true}"), "text"),
        each(&|_| "NULL".into(), "timestamptz"),
        each(&|_| "NULL".into(), "text"),
        each(&|_| "NULL".into(), "text"),
    ]
    .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_s_terms_end_where_each_event_s_do() {
        let events = [Event::new("a", 1), Event::new("b", 2)];
        let args = batch_args(&events, "00000000-0000-7000-8000-000000000001");
        let first = events[0].terms.len();
        let both = first + events[1].terms.len();
        assert!(first > 0 && both > first);
        assert!(args.ends_with(&format!("ARRAY[{first}, {both}]::int4[]")), "{args}");
        assert_eq!(args.matches("'::bytea,").count() + args.matches("'::bytea]").count(), 2);
    }

    #[test]
    fn outcomes_carry_each_claim_s_token_and_attempt() {
        let claimed = [("id-1".to_owned(), "41".to_owned(), "1".to_owned()), ("id-2".into(), "97".into(), "2".into())];
        let args = outcome_args(&claimed);
        assert!(
            args.starts_with("ARRAY['id-1', 'id-2']::uuid[], ARRAY[41, 97]::int8[], ARRAY[1, 2]::int4[]"),
            "{args}"
        );
    }
}
