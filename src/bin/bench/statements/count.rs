//! Counting a kind under callgrind: the longer run less the shorter, per unit, net of
//! the harness's own share, and where the instructions go.

use std::collections::HashMap;

use super::{FEW, Kind, MANY, Prepared};
use crate::Ctx;
use crate::pg::{self, Standalone};
use crate::report::Row;

/// Where a statement's instructions go: a function (inclusive, per unit) and what it is.
const LANDMARKS: &[(&str, &[&str])] = &[
    ("plan set-up and tear-down, each execution (ExecutorStart, ExecutorEnd)", &["ExecutorStart", "ExecutorEnd"]),
    ("a PL/pgSQL function's body (plpgsql_exec_function: the claim's; the lease's room)", &["plpgsql_exec_function"]),
    ("index entries (ExecInsertIndexTuples)", &["ExecInsertIndexTuples"]),
    ("— of which the search index (gininsert)", &["gininsert"]),
    ("foreign key checks (RI_FKey_check_ins, RI_FKey_check_upd)", &["RI_FKey_check_ins", "RI_FKey_check_upd"]),
    ("CHECK constraints (ExecConstraints)", &["ExecConstraints"]),
    ("the body's TOAST row (heap_toast_insert_or_update)", &["heap_toast_insert_or_update"]),
    ("WAL records (XLogInsert)", &["XLogInsert"]),
    ("commit (CommitTransactionCommand)", &["CommitTransactionCommand"]),
    ("the cached plan's check and its locks (GetCachedPlan)", &["GetCachedPlan"]),
];

/// The function a stand-alone backend prints result rows with: a server sends them on
/// the wire instead, so it is taken off.
const PRINTING: &str = "debugtup";

/// One kind's count.
pub(super) struct Count {
    name: &'static str,
    unit: &'static str,
    /// Instructions per unit, the harness's share taken off.
    net: f64,
    /// Each landmark's instructions per unit.
    landmarks: Vec<f64>,
}

/// Count `kind` with `steps` (`FEW + MANY` of them, each one argument list per
/// statement of the kind): a row with its instructions per unit, net of the same
/// arguments through `SELECT 1` and of printing the rows.
pub(super) fn count(ctx: &Ctx, pg: &Standalone, kind: &Kind, steps: &[Vec<String>]) -> anyhow::Result<Count> {
    eprintln!("bench: counting {} ...", kind.name);
    // The kind's statements, or (`echo`) statements of the same parameters that do nothing.
    let script = |echo: bool, steps: &[Vec<String>]| -> String {
        let name = |p: &Prepared| if echo { format!("echo_{}", p.name) } else { p.name.to_owned() };
        let mut s = kind.settings.clone();
        for p in &kind.statements {
            let sql = if echo { "SELECT 1" } else { p.sql.trim() };
            s.push_str(&format!("PREPARE {}({}) AS {sql};\n\n", name(p), p.types.join(", ")));
        }
        let several = kind.statements.len() > 1;
        for step in steps {
            if several {
                s.push_str("BEGIN;\n\n");
            }
            for (p, args) in kind.statements.iter().zip(step) {
                s.push_str(&format!("EXECUTE {}({args});\n\n", name(p)));
            }
            if several {
                s.push_str("COMMIT;\n\n");
            }
        }
        s
    };
    let (few, many) = steps.split_at(FEW);
    let units = ((MANY - FEW) * kind.units) as f64;
    let before = tally(pg, kind.effect)?;
    // The longer run less the shorter, per unit: start-up and everything done once
    // (planning, the first reads of the catalog) cancel out.
    let measure = |echo: bool, label: &str| -> anyhow::Result<(f64, HashMap<String, f64>)> {
        let a = pg.count(&script(echo, few), &format!("{label}-few"))?;
        let b = pg.count(&script(echo, &many[..MANY]), &format!("{label}-many"))?;
        let (fa, fb) = (pg::inclusive(&a.file)?, pg::inclusive(&b.file)?);
        let functions = fb
            .iter()
            .map(|(name, n)| (name.clone(), (*n as f64 - *fa.get(name).unwrap_or(&0) as f64) / units))
            .collect();
        Ok(((b.instructions as f64 - a.instructions as f64) / units, functions))
    };
    let (statement, functions) = measure(false, kind.tag)?;
    let done = tally(pg, kind.effect)? - before;
    anyhow::ensure!(
        done == ((FEW + MANY) * kind.units) as i64,
        "{}: its {} statements handled {done} {}s, not {} ({})",
        kind.name,
        FEW + MANY,
        kind.unit,
        (FEW + MANY) * kind.units,
        kind.effect
    );
    // The harness's share: the same arguments, read, parsed and bound, into nothing.
    let (echo, echo_functions) = measure(true, &format!("{}-echo", kind.tag))?;
    let printing =
        functions.get(PRINTING).copied().unwrap_or(0.0) - echo_functions.get(PRINTING).copied().unwrap_or(0.0);
    let net = statement - echo - printing;
    ctx.row(Row {
        id: "18".into(),
        scenario: format!("PostgreSQL instructions: {}", kind.name),
        setting: format!("{MANY} − {FEW} statements"),
        result: format!(
            "**{:.0} instructions per {}** (taken off: the harness's reading of the arguments, {:.0}; printing the rows, {:.0})",
            net, kind.unit, echo, printing
        ),
        ..Row::default()
    });
    let landmarks = LANDMARKS
        .iter()
        .map(|(_, names)| names.iter().map(|n| functions.get(*n).copied().unwrap_or(0.0)).sum())
        .collect();
    Ok(Count { name: kind.name, unit: kind.unit, net, landmarks })
}

/// The `n` that `sql` counts.
pub(super) fn tally(pg: &Standalone, sql: &str) -> anyhow::Result<i64> {
    let printed = pg.run(&format!("{sql};\n\n"))?;
    let n = pg::column(&printed, "n");
    anyhow::ensure!(n.len() == 1, "{sql} printed {} rows", n.len());
    Ok(n[0].parse()?)
}

/// The appendix: where each kind's instructions go.
pub(super) fn landmarks_table(counts: &[Count]) -> String {
    let mut t = String::from("| function (inclusive) |");
    for c in counts {
        t.push_str(&format!(" {} (per {}) |", c.name, c.unit));
    }
    t.push_str("\n|---|");
    t.push_str(&"---|".repeat(counts.len()));
    t.push_str("\n| **all, net** |");
    for c in counts {
        t.push_str(&format!(" **{:.0}** |", c.net));
    }
    for (i, (label, _)) in LANDMARKS.iter().enumerate() {
        t.push_str(&format!("\n| {label} |"));
        for c in counts {
            t.push_str(&format!(" {:.0} |", c.landmarks[i]));
        }
    }
    t.push('\n');
    t
}
