//! Subscription matching: event-type patterns.
//!
//! A pattern is an event type where `*` matches any run of characters (`order.*`,
//! `*.created`, `*`). Patterns are compiled once, at subscription time, into SQL `LIKE`
//! patterns, so the ingest statement matches subscriptions and inserts deliveries in the
//! same statement as the event (one round trip, one transaction).

/// Why a pattern is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    /// Empty string.
    #[error("event type pattern must not be empty")]
    Empty,
    /// Longer than 200 characters.
    #[error("event type pattern is longer than 200 characters")]
    TooLong,
    /// Contains whitespace or control characters.
    #[error("event type pattern {0:?} contains whitespace or control characters")]
    BadCharacter(String),
}

/// Check a pattern written by an operator.
pub fn validate_pattern(pattern: &str) -> Result<(), PatternError> {
    if pattern.is_empty() {
        return Err(PatternError::Empty);
    }
    if pattern.len() > 200 {
        return Err(PatternError::TooLong);
    }
    if pattern.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(PatternError::BadCharacter(pattern.to_owned()));
    }
    Ok(())
}

/// Compile a pattern into a SQL `LIKE` pattern (escape character `\`).
pub fn to_like(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len() + 4);
    for c in pattern.chars() {
        match c {
            '*' => out.push('%'),
            '%' | '_' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

/// Whether an event type matches a pattern. The reference semantics that the SQL `LIKE`
/// translation must agree with (checked against PostgreSQL by
/// `tests/it/fanout.rs::glob_semantics_agree_with_postgresql_like`).
pub fn matches(pattern: &str, event_type: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == event_type;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !event_type.starts_with(first) || event_type.len() < first.len() + last.len() {
        return false;
    }
    let mut rest = &event_type[first.len()..event_type.len()];
    for middle in &parts[1..parts.len() - 1] {
        match rest.find(middle) {
            Some(at) => rest = &rest[at + middle.len()..],
            None => return false,
        }
    }
    rest.ends_with(last) && rest.len() >= last.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_semantics() {
        let cases = [
            ("order.*", "order.created", true),
            ("order.*", "order.", true),
            ("order.*", "orders.created", false),
            ("*", "anything", true),
            ("*.created", "order.created", true),
            ("*.created", "order.updated", false),
            ("a*b*c", "abc", true),
            ("a*b*c", "aXbYc", true),
            ("a*b*c", "acb", false),
            ("ab*ba", "aba", false),
            ("exact", "exact", true),
            ("exact", "exactly", false),
            ("100%_done", "100%_done", true),
        ];
        for (pattern, event_type, expected) in cases {
            assert_eq!(matches(pattern, event_type), expected, "{pattern} vs {event_type}");
        }
    }

    #[test]
    fn like_translation_escapes_like_metacharacters() {
        assert_eq!(to_like("order.*"), "order.%");
        assert_eq!(to_like("100%_done\\"), "100\\%\\_done\\\\");
    }

    #[test]
    fn validation() {
        assert_eq!(validate_pattern(""), Err(PatternError::Empty));
        assert!(matches!(validate_pattern("a b"), Err(PatternError::BadCharacter(_))));
        assert!(validate_pattern("order.*").is_ok());
    }
}
