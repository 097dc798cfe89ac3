//! Subscription filters: routing by content.
//!
//! A filter is an SQL/JSON path predicate (PostgreSQL's `jsonpath`, the SQL:2016
//! standard's path language) over the event's document:
//!
//! ```json
//! {"payload": <the body as JSON, or null>, "headers": {...}, "type": "...", "source": "..."}
//! ```
//!
//! e.g. `$.payload.livemode == true`, `$.payload.data.object.amount > 1000`,
//! `$.headers."x-github-event" == "push" && $.payload.ref == "refs/heads/main"`,
//! `$.type starts with "invoice."`.
//!
//! **Why this language.** The fan-out is one SQL statement with the event's insert
//! (`queue::fanout`); a filter PostgreSQL evaluates runs inside it, against the
//! subscription rows as they are at that moment: no extra round trip, no cache of
//! subscriptions to go stale across replicas, and an event no filter lets through creates
//! no delivery row. jq or CEL would run in the gateway before the statement, from a copy of
//! the subscriptions that another replica's change makes stale. The language has no loops
//! and no recursion: evaluation is bounded by the filter (at most [`MAX_FILTER_BYTES`])
//! times the body (at most `--max-body-bytes`), and by the statement's deadline.
//!
//! **What matches.** Only `true`. False, a missing field, a comparison of different
//! types, a body that is not JSON: no match (evaluated with `silent => true`), and never an
//! error that could fail the ingest statement.

use crate::db::Pool;

/// Longest filter, in bytes (also a database constraint).
pub const MAX_FILTER_BYTES: usize = 4096;

/// Why a filter is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    /// Empty or blank: omit the filter to match everything.
    #[error("must not be empty (omit it, or set null, to match every event)")]
    Empty,
    /// Over [`MAX_FILTER_BYTES`], as given or in PostgreSQL's normal form (what is stored).
    #[error(
        "longer than {MAX_FILTER_BYTES} bytes (as written, or in PostgreSQL's normal form, which quotes every key)"
    )]
    TooLong,
    /// A construct whose cost grows faster than the body (see [`superlinear`]).
    #[error("{0}")]
    Superlinear(&'static str),
    /// Not a jsonpath: PostgreSQL's message, and the character (1-based) it points at
    /// when it names one.
    #[error("{message}{}", position.map(|p| format!(" (at character {p})")).unwrap_or_default())]
    Syntax {
        /// PostgreSQL's message.
        message: String,
        /// Where, counted in characters from 1.
        position: Option<usize>,
    },
}

/// Check a filter: its size here, its syntax by PostgreSQL's own parser (the one that
/// will evaluate it). `Ok(Err(..))` is a refused filter; `Err` a database failure.
pub async fn check(pool: &Pool, filter: &str) -> Result<Result<(), FilterError>, sqlx::Error> {
    if filter.trim().is_empty() {
        return Ok(Err(FilterError::Empty));
    }
    if filter.len() > MAX_FILTER_BYTES {
        return Ok(Err(FilterError::TooLong));
    }
    if let Some(why) = superlinear(filter) {
        return Ok(Err(FilterError::Superlinear(why)));
    }
    // The size is checked on the normal form too: that is what is stored (and bounded by
    // the table), and it can be twice the text given (`$.a.a` is `$."a"."a"`).
    match crate::db::query_scalar::<i32>("SELECT octet_length($1::jsonpath::text)").bind(filter).fetch_one(pool).await {
        Ok(normal) if usize::try_from(normal).unwrap_or(usize::MAX) > MAX_FILTER_BYTES => Ok(Err(FilterError::TooLong)),
        Ok(_) => Ok(Ok(())),
        // A syntax error (42601), or any data exception of the parse (class 22: an escape
        // jsonpath refuses, a regex that does not compile, a number out of range).
        Err(sqlx::Error::Database(e)) if e.code().is_some_and(|c| c == "42601" || c.starts_with("22")) => {
            let message = e.message().to_owned();
            let position = position(filter, &message);
            Ok(Err(FilterError::Syntax { message, position }))
        }
        Err(e) => Err(e),
    }
}

/// Why a filter could cost more than a walk of the body, if it could: the body comes from
/// outside, and a filter runs inside the ingest statement, so its cost must stay linear in
/// the body's size. Two constructs are not:
///
/// - more than one recursive wildcard (`**`): each walks every descendant of every item
///   the one before it reached, so `$.**.**` on a body nested 5,000 deep took 3 s
///   (one `**`: 2 ms), and each more multiplies by the depth;
/// - the root (`$`) inside a predicate (`? (...)`): the predicate runs for every item,
///   and each run walks from the root again (`@` is the item: use it).
///
/// String literals are skipped; the scan is conservative (a `**` written in a regex
/// outside quotes is not possible, so none is missed).
pub fn superlinear(filter: &str) -> Option<&'static str> {
    let chars: Vec<char> = filter.chars().collect();
    let (mut i, mut wildcards, mut in_string) = (0, 0, false);
    // Paren depth, and the depths at which a predicate `?(` opened.
    let (mut depth, mut predicates): (usize, Vec<usize>) = (0, Vec::new());
    while i < chars.len() {
        let c = chars[i];
        if in_string {
            match c {
                '\\' => i += 1,
                '"' => in_string = false,
                _ => {}
            }
        } else {
            match c {
                '"' => in_string = true,
                '*' if chars.get(i + 1) == Some(&'*') => {
                    wildcards += 1;
                    i += 1;
                }
                '?' => {
                    let next = chars[i + 1..].iter().position(|c| !c.is_whitespace()).map(|p| chars[i + 1 + p]);
                    if next == Some('(') {
                        predicates.push(depth + 1);
                    }
                }
                '(' => depth += 1,
                ')' => {
                    if predicates.last() == Some(&depth) {
                        predicates.pop();
                    }
                    depth = depth.saturating_sub(1);
                }
                '$' if !predicates.is_empty() => {
                    return Some(
                        "the root `$` inside a predicate `? (...)` walks the whole body again for every item: use `@`",
                    );
                }
                _ => {}
            }
        }
        i += 1;
    }
    (wildcards > 1)
        .then_some("at most one recursive wildcard `**`: each one more multiplies the cost by the body's depth")
}

/// The character (1-based) PostgreSQL's message points at: `at end of jsonpath input` is
/// just past the end; `at or near "X"` is where `X` first occurs.
pub fn position(filter: &str, message: &str) -> Option<usize> {
    if message.contains("at end of jsonpath input") {
        return Some(filter.chars().count() + 1);
    }
    let near = message.split("at or near \"").nth(1)?;
    let token = near.rsplit_once("\" of jsonpath input").map_or(near, |(t, _)| t);
    let byte = filter.find(token)?;
    Some(filter[..byte].chars().count() + 1)
}

/// What trying a filter on an event gives: whether it matches, and the document it saw.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct Tried {
    /// True only when the filter yields `true`; false for anything else.
    pub matches: bool,
    /// The document the filter was evaluated on (`payload` is null when the body is not
    /// JSON).
    pub document: serde_json::Value,
}

/// Evaluate `filter` on a document built like the fan-out's: the fields of an event
/// (`source_id` may be none, for a pasted event; `source` is then `source_name`).
pub async fn try_on(pool: &Pool, filter: &str, event: &EventFields<'_>) -> Result<Tried, sqlx::Error> {
    let (matches, document): (Option<bool>, serde_json::Value) = crate::db::query_as(
        "WITH d AS (
             SELECT jsonb_set(wg_event_doc($1, $2, $3, $4), '{source}', COALESCE(to_jsonb($5::text), 'null'))
                 AS doc)
         SELECT wg_filter_match(d.doc, $6::jsonpath), d.doc FROM d",
    )
    .bind(event.source_id)
    .bind(event.event_type)
    .bind(sqlx::types::Json(event.headers))
    .bind(event.payload)
    .bind(event.source_name)
    .bind(filter)
    .fetch_one(pool)
    .await?;
    Ok(Tried { matches: matches == Some(true), document })
}

/// The fields of an event a filter sees.
#[derive(Debug, Clone, Copy)]
pub struct EventFields<'a> {
    /// Its source, when it is a stored event.
    pub source_id: Option<crate::ids::SourceId>,
    /// Its source's name.
    pub source_name: Option<&'a str>,
    /// Its type.
    pub event_type: &'a str,
    /// Its stored headers.
    pub headers: &'a serde_json::Value,
    /// Its body.
    pub payload: &'a [u8],
}

/// A filter to try (`POST /v1/filters/test`), and either a stored event or a pasted one.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FilterTest {
    /// The filter to try (as a subscription's `filter`).
    #[schema(example = "$.payload.livemode == true")]
    pub filter: String,
    /// A stored event to try it on.
    #[serde(default)]
    pub event_id: Option<crate::ids::EventId>,
    /// Or an event pasted here.
    #[serde(default)]
    pub event: Option<PastedEvent>,
}

/// An event to try a filter on, without storing it.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PastedEvent {
    /// Its body (any JSON), kept as written: a number is compared as PostgreSQL reads it
    /// from a stored body (a parse into a document here would round a large one to a
    /// float first). Absent: null.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub payload: Option<Box<serde_json::value::RawValue>>,
    /// Its headers; names are taken in lower case, as they are stored.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub headers: serde_json::Map<String, serde_json::Value>,
    /// Its event type.
    #[serde(default, rename = "type")]
    pub event_type: String,
    /// Its source's name.
    #[serde(default)]
    pub source: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_that_cost_more_than_a_walk_of_the_body_are_named() {
        for fine in [
            "$.payload.livemode == true",
            "exists($.payload.** ? (@ == \"x\"))",
            "$.payload.items[*] ? (@.qty > 2 && @.sku like_regex \"^A\") == 1",
            "$.payload.note == \"$.a ? ($.b) **\"",
        ] {
            assert_eq!(superlinear(fine), None, "{fine}");
        }
        for bad in [
            "exists($.**.** ? (@ == 1))",
            "exists($.payload.** ? (@.** == 1))",
            "exists($.payload.items[*] ? ($.payload.x == @.y))",
            "exists($.a ? (exists(@.b ? ($.c == 1))))",
        ] {
            assert!(superlinear(bad).is_some(), "{bad}");
        }
    }

    #[test]
    fn the_position_is_where_postgresql_points() {
        assert_eq!(position("$.a ==", "syntax error at end of jsonpath input"), Some(7));
        assert_eq!(position("$.a = 1", "syntax error at or near \"=\" of jsonpath input"), Some(5));
        assert_eq!(position("$.é ! 1", "syntax error at or near \"!\" of jsonpath input"), Some(5));
        assert_eq!(position("$.a", "something else"), None);
    }
}
