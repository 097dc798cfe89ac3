//! W3C Trace Context (Level 1): `traceparent` and `tracestate`, parsed strictly. A
//! malformed value is ignored, never an error: it came from a producer.

use http::HeaderMap;
use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

/// A W3C `traceparent`, validated (Trace Context Level 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace.
    pub trace_id: TraceId,
    /// The caller's span.
    pub span_id: SpanId,
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceParent {
    /// Parse a `traceparent` value strictly: lower-case hex, no all-zero ids, version
    /// `ff` refused; a later version is read by its version-00 prefix, as the
    /// specification asks. `None` for anything else.
    pub fn parse(value: &str) -> Option<TraceParent> {
        let b = value.as_bytes();
        // The fields are sliced by byte index below: only an ASCII prefix makes every one of
        // those indices a character boundary (a multi-byte character there would panic).
        if b.len() < 55 || !b[..55].is_ascii() {
            return None;
        }
        let version = &value[0..2];
        if !lower_hex(version) || version == "ff" {
            return None;
        }
        if version == "00" && b.len() != 55 {
            return None;
        }
        if b.len() > 55 && b[55] != b'-' {
            return None;
        }
        if b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return None;
        }
        let (trace, span, flags) = (&value[3..35], &value[36..52], &value[53..55]);
        if !lower_hex(trace) || !lower_hex(span) || !lower_hex(flags) {
            return None;
        }
        let trace_id = TraceId::from_hex(trace).ok().filter(|id| *id != TraceId::INVALID)?;
        let span_id = SpanId::from_hex(span).ok().filter(|id| *id != SpanId::INVALID)?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        Some(TraceParent { trace_id, span_id, flags })
    }

    /// The header value, version 00.
    pub fn header(&self) -> String {
        format!("00-{}-{}-{:02x}", self.trace_id, self.span_id, self.flags)
    }

    /// The context a span links to (remote: it came from elsewhere, or from the past).
    pub fn span_context(&self, tracestate: Option<&str>) -> SpanContext {
        let state = tracestate.and_then(|s| s.parse::<TraceState>().ok()).unwrap_or_default();
        SpanContext::new(self.trace_id, self.span_id, TraceFlags::new(self.flags), true, state)
    }

    pub(super) fn of(context: &SpanContext) -> Option<TraceParent> {
        context.is_valid().then(|| TraceParent {
            trace_id: context.trace_id(),
            span_id: context.span_id(),
            flags: context.trace_flags().to_u8(),
        })
    }
}

fn lower_hex(s: &str) -> bool {
    s.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

/// A `tracestate` value, validated and normalised (members joined by `,`): at most 32
/// members, 512 bytes, keys and values as the specification's grammar says, no key
/// twice. `None` when invalid or empty; an invalid one is dropped, the `traceparent`
/// stays.
pub fn parse_tracestate(value: &str) -> Option<String> {
    if value.len() > 512 {
        return None;
    }
    let mut members: Vec<&str> = Vec::new();
    for member in value.split(',').map(|m| m.trim_matches([' ', '\t'])) {
        if member.is_empty() {
            continue;
        }
        let (key, val) = member.split_once('=')?;
        if !tracestate_key(key) || !tracestate_value(val) {
            return None;
        }
        if members.iter().any(|m| m.split_once('=').is_some_and(|(k, _)| k == key)) {
            return None;
        }
        members.push(member);
    }
    (!members.is_empty() && members.len() <= 32).then(|| members.join(","))
}

fn tracestate_key(key: &str) -> bool {
    let tail = |s: &str, max: usize| {
        s.len() <= max
            && s.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'_' | b'-' | b'*' | b'/'))
    };
    match key.split_once('@') {
        None => key.as_bytes().first().is_some_and(u8::is_ascii_lowercase) && tail(key, 256),
        Some((tenant, system)) => {
            tenant.as_bytes().first().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
                && tail(tenant, 241)
                && system.as_bytes().first().is_some_and(u8::is_ascii_lowercase)
                && tail(system, 14)
        }
    }
}

fn tracestate_value(value: &str) -> bool {
    let ok = |c: u8| (0x20..=0x7e).contains(&c) && c != b',' && c != b'=';
    !value.is_empty() && value.len() <= 256 && value.bytes().all(ok) && !value.ends_with(' ')
}

/// The incoming `traceparent` and `tracestate` of a request, validated. Several
/// `traceparent` fields are invalid; several `tracestate` fields are one list.
pub fn incoming(headers: &HeaderMap) -> Option<(TraceParent, Option<String>)> {
    let mut parents = headers.get_all("traceparent").iter();
    let parent = parents.next()?;
    if parents.next().is_some() {
        return None;
    }
    let parent = TraceParent::parse(parent.to_str().ok()?)?;
    let states: Vec<&str> = headers.get_all("tracestate").iter().filter_map(|v| v.to_str().ok()).collect();
    let state = if states.is_empty() { None } else { parse_tracestate(&states.join(",")) };
    Some((parent, state))
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_round_trips() {
        let parent = TraceParent::parse(GOOD).expect("valid");
        assert_eq!(parent.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(parent.span_id.to_string(), "00f067aa0ba902b7");
        assert_eq!(parent.flags, 1);
        assert_eq!(parent.header(), GOOD);
    }

    #[test]
    fn malformed_traceparents_are_refused() {
        let bad = [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1z",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-011",
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
        ];
        for value in bad {
            assert_eq!(TraceParent::parse(value), None, "{value:?}");
        }
    }

    #[test]
    fn a_multi_byte_character_where_a_field_ends_is_refused_not_a_panic() {
        // 'é' is two bytes: placed where the version, a dash or a field ends, a byte
        // index falls inside it.
        for at in [1, 2, 3, 34, 35, 36, 51, 52, 53, 54] {
            let mut value: String = GOOD.chars().take(at).collect();
            value.push('é');
            value.push_str(&GOOD[at + 1..]);
            assert_eq!(TraceParent::parse(&value), None, "{value:?}");
        }
        assert_eq!(TraceParent::parse(&format!("{GOOD}é")), None);
        assert_eq!(TraceParent::parse(&"é".repeat(40)), None);
    }

    proptest::proptest! {
        #![proptest_config(crate::props::config(2000))]

        /// Any string at all: an answer, never a panic; and what is accepted is printed back
        /// as a valid version-00 header that parses to the same context.
        #[test]
        fn parsing_any_string_is_total(value in ".{0,80}", prefix in "[0-9a-f -]{0,60}") {
            for candidate in [value.clone(), format!("{prefix}{value}"), format!("{GOOD}{value}")] {
                if let Some(parent) = TraceParent::parse(&candidate) {
                    let header = parent.header();
                    proptest::prop_assert_eq!(TraceParent::parse(&header), Some(parent));
                }
            }
        }

        /// Every well-formed version-00 header parses back to its fields.
        #[test]
        fn every_well_formed_header_parses(trace in "[0-9a-f]{32}", span in "[0-9a-f]{16}", flags in 0u8..=255) {
            let header = format!("00-{trace}-{span}-{flags:02x}");
            let parsed = TraceParent::parse(&header);
            let invalid = trace.bytes().all(|b| b == b'0') || span.bytes().all(|b| b == b'0');
            proptest::prop_assert_eq!(parsed.is_none(), invalid);
            if let Some(parent) = parsed {
                proptest::prop_assert_eq!(parent.header(), header);
            }
        }
    }

    #[test]
    fn a_later_version_is_read_by_its_version_00_prefix() {
        let later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-holds";
        assert_eq!(TraceParent::parse(later).map(|p| p.header()).as_deref(), Some(GOOD));
        assert!(TraceParent::parse("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").is_some());
    }

    #[test]
    fn tracestate_is_validated_and_normalised() {
        assert_eq!(
            parse_tracestate("rojo=00f067aa0ba902b7, congo=t61rcWkgMzE").as_deref(),
            Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")
        );
        assert_eq!(parse_tracestate("tenant@vendor=x,,a=b").as_deref(), Some("tenant@vendor=x,a=b"));
        for bad in
            ["", "Rojo=1", "rojo", "rojo=1,rojo=2", "rojo=a=b", "a=b\u{7}", "a=", &format!("a={}", "x".repeat(600))]
        {
            assert_eq!(parse_tracestate(bad), None, "{bad:?}");
        }
        let many: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
        assert_eq!(parse_tracestate(&many.join(",")), None, "33 members");
    }

    #[test]
    fn incoming_context_needs_exactly_one_valid_traceparent() {
        let mut headers = HeaderMap::new();
        assert_eq!(incoming(&headers), None);
        headers.insert("traceparent", HeaderValue::from_static(GOOD));
        headers.append("tracestate", HeaderValue::from_static("a=1"));
        headers.append("tracestate", HeaderValue::from_static("b=2"));
        let (parent, state) = incoming(&headers).expect("valid");
        assert_eq!((parent.header().as_str(), state.as_deref()), (GOOD, Some("a=1,b=2")));
        headers.append("traceparent", HeaderValue::from_static(GOOD));
        assert_eq!(incoming(&headers), None, "two traceparent fields");
        headers.remove("traceparent");
        headers.insert("traceparent", HeaderValue::from_static("garbage"));
        assert_eq!(incoming(&headers), None);
    }
}
