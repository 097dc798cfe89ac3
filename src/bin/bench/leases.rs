//! Who put each delivery of a step on its lease, by the gateway's own counter
//! (`webhook_gateway_leases_total{by}`), scraped from its `/metrics` before and after the
//! step: how much of the hand-off ingest's statements took, and how much fell to the
//! dispatcher's claims.

use std::collections::BTreeMap;

use crate::gateway::Gateway;

/// The counter's name.
const LEASES: &str = "webhook_gateway_leases_total";

/// What took the leases, in the order a note names them, with the words it uses.
const KINDS: [(&str, &str); 5] = [
    ("ingest", "by ingest's statements"),
    ("promotion", "by the outcome writes that moved their lines on"),
    ("claim_by_key", "claimed by key"),
    ("claim", "by the general claim"),
    ("probe", "as probes"),
];

/// The counter's values by its `by` label at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Leases(BTreeMap<String, f64>);

/// The gateway's leases so far; `None` when its `/metrics` cannot be read (a build
/// before the counter has no such series and reads as no leases).
pub async fn scrape(gw: &Gateway) -> Option<Leases> {
    Some(parse(&gw.metrics().await?))
}

/// The `by` values of the counter's series in a Prometheus text exposition.
fn parse(text: &str) -> Leases {
    let mut by = BTreeMap::new();
    for line in text.lines().filter(|line| line.starts_with(LEASES)) {
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        let Some(kind) = series.split("by=\"").nth(1).and_then(|rest| rest.split('"').next()) else { continue };
        if let Ok(value) = value.parse::<f64>() {
            by.insert(kind.to_owned(), value);
        }
    }
    Leases(by)
}

impl Leases {
    /// `leases: 61 % by ingest's statements, 37 % claimed by key, 2 % by the general
    /// claim` for the leases taken between `self` and `after`; `None` when none were
    /// counted (a gateway without the counter).
    pub fn note(&self, after: &Leases) -> Option<String> {
        let taken = |kind: &str| after.0.get(kind).copied().unwrap_or(0.0) - self.0.get(kind).copied().unwrap_or(0.0);
        let total: f64 = KINDS.iter().map(|(kind, _)| taken(kind)).sum();
        if total <= 0.0 {
            return None;
        }
        let parts: Vec<String> = KINDS
            .iter()
            .filter(|(kind, _)| taken(kind) > 0.0)
            .map(|(kind, words)| format!("{:.0} % {words}", 100.0 * taken(kind) / total))
            .collect();
        Some(format!("leases: {}", parts.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = "# TYPE webhook_gateway_leases_total counter
webhook_gateway_leases_total{by=\"ingest\"} 100
webhook_gateway_leases_total{by=\"claim_by_key\"} 10
webhook_gateway_attempts_total{class=\"2xx\",outcome=\"delivered\"} 110
";
    const AFTER: &str = "webhook_gateway_leases_total{by=\"ingest\"} 700
webhook_gateway_leases_total{by=\"claim_by_key\"} 380
webhook_gateway_leases_total{by=\"claim\"} 30
";

    #[test]
    fn the_counter_s_series_are_read_by_their_label() {
        let leases = parse(AFTER);
        assert_eq!(leases.0.get("ingest"), Some(&700.0));
        assert_eq!(leases.0.get("claim"), Some(&30.0));
        assert_eq!(parse(BEFORE).0.len(), 2, "other metrics left out");
    }

    #[test]
    fn the_note_splits_the_leases_of_the_window() {
        let note = parse(BEFORE).note(&parse(AFTER)).expect("leases taken");
        assert_eq!(note, "leases: 60 % by ingest's statements, 37 % claimed by key, 3 % by the general claim");
    }

    #[test]
    fn no_leases_counted_make_no_note() {
        assert_eq!(Leases::default().note(&Leases::default()), None);
        assert_eq!(parse(AFTER).note(&parse(AFTER)), None);
    }
}
