//! A stand-alone PostgreSQL backend (`postgres --single`) on a stopped cluster, run as
//! it is or under valgrind's callgrind: PostgreSQL's instructions for a script of
//! statements, counted in one process, with nothing else in it (no other client, no
//! autovacuum, no checkpointer). The same script gives the same count from one run to
//! the next, where CPU seconds move by a third between hours on a shared machine.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, bail};
use webhook_gateway::db::embedded;

/// A stopped cluster's database, opened one stand-alone backend at a time.
pub struct Standalone {
    data_dir: PathBuf,
    database: String,
    /// Where callgrind writes (created for the cluster's user).
    out_dir: PathBuf,
}

/// One counted run.
#[derive(Debug, Clone)]
pub struct Counted {
    /// Instructions of the whole backend process, start-up included.
    pub instructions: u64,
    /// callgrind's file, for `callgrind_annotate`.
    pub file: PathBuf,
}

impl Standalone {
    /// `database` of the stopped cluster in `data_dir`; callgrind's files go to `out_dir`.
    pub fn new(data_dir: &Path, database: &str, out_dir: &Path) -> Standalone {
        Standalone { data_dir: data_dir.to_owned(), database: database.to_owned(), out_dir: out_dir.to_owned() }
    }

    /// Run `script` (statements each ended by `;` and an empty line) and return what the
    /// backend printed. Any `ERROR` fails the run: a count of a statement that failed
    /// would be a count of the error path.
    pub fn run(&self, script: &str) -> anyhow::Result<String> {
        self.exec(script, &[], None)
    }

    /// Run `script` under callgrind; `label` names its file.
    pub fn count(&self, script: &str, label: &str) -> anyhow::Result<Counted> {
        let file = self.out_dir.join(format!("callgrind.{label}"));
        // Kept beside the count, so a statement can be run again or explained by hand.
        std::fs::create_dir_all(&self.out_dir)
            .and_then(|()| std::fs::write(self.out_dir.join(format!("script.{label}.sql")), script))
            .with_context(|| format!("writing the script of {label}"))?;
        let wrapper =
            ["valgrind".to_owned(), "--tool=callgrind".to_owned(), format!("--callgrind-out-file={}", file.display())];
        self.exec(script, &wrapper, Some(&self.out_dir))?;
        let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
        let instructions =
            callgrind_total(&text).with_context(|| format!("no instruction total in {}", file.display()))?;
        Ok(Counted { instructions, file })
    }

    fn exec(&self, script: &str, wrapper: &[String], writable: Option<&Path>) -> anyhow::Result<String> {
        let mut cmd = embedded::standalone(&self.data_dir, &self.database, wrapper, writable)?;
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().context(
            "starting a stand-alone PostgreSQL backend (and valgrind, when counting: apt-get install valgrind)",
        )?;
        let mut stdin = child.stdin.take().context("the backend's stdin")?;
        let script = script.to_owned();
        // Written from a thread: the backend prints as it reads, and a full pipe on one
        // side would stop both.
        let writer = std::thread::spawn(move || stdin.write_all(script.as_bytes()));
        let out = child.wait_with_output()?;
        let written = writer.join().map_err(|_| anyhow::anyhow!("the script writer panicked"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr);
        if let Some(line) = stderr.lines().chain(stdout.lines()).find(|l| l.contains("ERROR:") || l.contains("FATAL:"))
        {
            bail!("the stand-alone backend reported: {}", line.trim());
        }
        if !out.status.success() {
            bail!("the stand-alone backend exited with {}: {}", out.status, stderr.trim());
        }
        // After the backend's own report: a backend that stopped early also breaks the pipe.
        written.context("writing the script to the backend")?;
        Ok(stdout)
    }
}

/// The values of column `name` in the rows a stand-alone backend printed, in order
/// (lines such as `1: id = "0190…"`, between a tab and `(typeid = 2950, …)`).
pub fn column(output: &str, name: &str) -> Vec<String> {
    let prefix = format!("{name} = \"");
    output
        .lines()
        .filter_map(|line| {
            let (_, rest) = line.trim_start().split_once(": ")?;
            let value = rest.strip_prefix(&prefix)?;
            Some(value[..value.find('"')?].to_owned())
        })
        .collect()
}

/// The total of a callgrind file (its `summary:` line, or `totals:`).
pub fn callgrind_total(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("summary:").or_else(|| l.strip_prefix("totals:")))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Each function's inclusive instructions in a callgrind file (`callgrind_annotate
/// --inclusive=yes`), recursive entries (`f'2`) left out: they are inside `f`'s own.
pub fn inclusive(file: &Path) -> anyhow::Result<HashMap<String, u64>> {
    let out = std::process::Command::new("callgrind_annotate")
        .args(["--inclusive=yes", "--threshold=100"])
        .arg(file)
        .output()
        .context("running callgrind_annotate (part of valgrind)")?;
    if !out.status.success() {
        bail!("callgrind_annotate failed on {}: {}", file.display(), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(parse_inclusive(&String::from_utf8_lossy(&out.stdout)))
}

/// [`inclusive`]'s reading of `callgrind_annotate`'s lines
/// (`  22,086,552 (17.55%)  ???:GetCachedPlan [/usr/lib/postgresql/15/bin/postgres]`).
pub fn parse_inclusive(text: &str) -> HashMap<String, u64> {
    let mut functions = HashMap::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(Ok(count)) = words.next().map(|n| n.replace(',', "").parse::<u64>()) else { continue };
        let Some(share) = words.next() else { continue };
        if !share.starts_with('(') {
            continue;
        }
        // `(` and a space split a share such as `( 1.39%)`.
        let Some(place) = words.find(|w| !w.ends_with("%)")) else { continue };
        let Some((_, name)) = place.rsplit_once(':') else { continue };
        if name.contains('\'') || name.is_empty() {
            continue;
        }
        *functions.entry(name.to_owned()).or_insert(0) += count;
    }
    functions
}

/// A text literal.
pub fn lit(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// A `bytea` literal.
pub fn bytes_lit(b: &[u8]) -> String {
    format!("'\\x{}'::bytea", hex::encode(b))
}

/// An array literal of `items` (already literals) of SQL type `ty`.
pub fn array(items: impl IntoIterator<Item = String>, ty: &str) -> String {
    format!("ARRAY[{}]::{ty}[]", items.into_iter().collect::<Vec<_>>().join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_column_is_read_from_the_printed_rows_and_nothing_else() {
        let out = "backend> \t 1: id\t(typeid = 2950, len = 16, typmod = -1, byval = f)\n\
                   \t 2: claim_token\t(typeid = 20, len = 8, typmod = -1, byval = t)\n\t----\n\
                   \t 1: id = \"01a242b9-540f-7bee-8914-588e0e6a494d\"\t(typeid = 2950, len = 16, typmod = -1, byval = f)\n\
                   \t 2: claim_token = \"42\"\t(typeid = 20, len = 8, typmod = -1, byval = t)\n\t----\n\
                   \t 1: id = \"01a242b9-54ee-7670-bf35-ba5d82975144\"\t(typeid = 2950, len = 16, typmod = -1, byval = f)\n\
                   \t 2: claim_token = \"7\"\t(typeid = 20, len = 8, typmod = -1, byval = t)\n";
        assert_eq!(column(out, "id"), ["01a242b9-540f-7bee-8914-588e0e6a494d", "01a242b9-54ee-7670-bf35-ba5d82975144"]);
        assert_eq!(column(out, "claim_token"), ["42", "7"]);
        assert!(column(out, "attempt_count").is_empty());
    }

    #[test]
    fn the_total_is_callgrind_s_summary() {
        let text =
            "version: 1\ncmd: postgres --single\nevents: Ir\nfl=(1)\n0 5\nsummary: 171796630\ntotals: 171796630\n";
        assert_eq!(callgrind_total(text), Some(171_796_630));
        assert_eq!(callgrind_total("events: Ir\n"), None);
    }

    #[test]
    fn inclusive_counts_are_read_per_function_without_recursion() {
        let text = "--------\n         Ir                   file:function\n--------\n\
                    125,821,146 (100.0%)  PROGRAM TOTALS\n\n\
                     22,086,552 (17.55%)  ???:GetCachedPlan [/usr/lib/postgresql/15/bin/postgres]\n\
                      1,752,422 ( 1.39%)  ???:expression_planner [/usr/lib/postgresql/15/bin/postgres]\n\
                     13,824,613 (10.99%)  ???:subquery_planner'2 [/usr/lib/postgresql/15/bin/postgres]\n\
                          7,053 ( 0.01%)  ./string/memcpy.S:__memcpy_avx_unaligned_erms [/usr/lib/libc.so.6]\n";
        let f = parse_inclusive(text);
        assert_eq!(f.get("GetCachedPlan"), Some(&22_086_552));
        assert_eq!(f.get("expression_planner"), Some(&1_752_422));
        assert_eq!(f.get("__memcpy_avx_unaligned_erms"), Some(&7_053));
        assert!(!f.keys().any(|k| k.contains('\'') || k.contains("TOTALS")), "{f:?}");
        assert_eq!(f.len(), 3);
    }

    #[test]
    fn literals_quote_what_would_end_them() {
        assert_eq!(lit("it's"), "'it''s'");
        assert_eq!(bytes_lit(b"\x00\xff"), "'\\x00ff'::bytea");
        assert_eq!(array([lit("a"), lit("b")], "text"), "ARRAY['a', 'b']::text[]");
    }
}
