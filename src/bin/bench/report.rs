//! The results: one Markdown table (a row per measurement), the machine line, notes, and
//! an appendix with where PostgreSQL spent its time; printed and written to
//! `bench/results/<date>.md`.

use std::fmt::Write as _;

/// One row of the table.
#[derive(Debug, Clone, Default)]
pub struct Row {
    /// Scenario number (1-8).
    pub id: String,
    /// Scenario name.
    pub scenario: String,
    /// Its setting (concurrency, rate, backlog ...).
    pub setting: String,
    /// The headline figure.
    pub result: String,
    /// Median latency.
    pub p50: String,
    /// 99th percentile.
    pub p99: String,
    /// Largest.
    pub max: String,
    /// Target and whether it was met.
    pub target: String,
    /// Who used the CPU.
    pub cpu: String,
    /// Anything else.
    pub note: String,
}

/// Everything a run produced.
#[derive(Debug, Default)]
pub struct Report {
    /// The machine line.
    pub machine: String,
    /// The command that produced it.
    pub command: String,
    /// Table rows, in order.
    pub rows: Vec<Row>,
    /// Extra notes printed under the table.
    pub notes: Vec<String>,
    /// Appendix sections (title, Markdown body).
    pub appendix: Vec<(String, String)>,
}

/// `✅ ≥ 5,000/s` or `❌ ≥ 5,000/s`.
pub fn verdict(met: bool, target: &str) -> String {
    format!("{} {target}", if met { "✅" } else { "❌" })
}

/// A row's note from its parts, the missing and empty ones left out.
pub fn notes<const N: usize>(parts: [Option<String>; N]) -> String {
    parts.into_iter().flatten().filter(|p| !p.is_empty()).collect::<Vec<_>>().join("; ")
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

impl Report {
    /// Add a row and echo it on stderr as progress.
    pub fn push(&mut self, row: Row) {
        eprintln!(
            "bench: [{}] {} {} -> {} (p50 {}, p99 {}) {} {}",
            row.id, row.scenario, row.setting, row.result, row.p50, row.p99, row.target, row.note
        );
        self.rows.push(row);
    }

    /// The table alone.
    pub fn table(&self) -> String {
        let mut out = String::new();
        out.push_str("| # | scenario | setting | result | p50 | p99 | max | target | CPU, cores (of 2) | note |\n");
        out.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
        // Scenario order, whatever order they ran in (stable: a scenario's rows keep theirs).
        let mut rows: Vec<&Row> = self.rows.iter().collect();
        rows.sort_by_key(|r| r.id.parse::<u32>().unwrap_or(u32::MAX));
        for r in rows {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                cell(&r.id),
                cell(&r.scenario),
                cell(&r.setting),
                cell(&r.result),
                cell(&r.p50),
                cell(&r.p99),
                cell(&r.max),
                cell(&r.target),
                cell(&r.cpu),
                cell(&r.note)
            );
        }
        out
    }

    /// The whole report as Markdown.
    pub fn markdown(&self, title: &str) -> String {
        let mut out = format!("# {title}\n\n");
        let _ = writeln!(out, "`{}`\n", self.command);
        let _ = writeln!(out, "{}\n", self.machine);
        out.push_str(&self.table());
        if !self.notes.is_empty() {
            out.push('\n');
            for n in &self.notes {
                let _ = writeln!(out, "- {n}");
            }
        }
        for (t, body) in &self.appendix {
            let _ = write!(out, "\n## {t}\n\n{body}\n");
        }
        out
    }
}
