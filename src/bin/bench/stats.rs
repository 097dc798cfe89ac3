//! Latency summaries and CPU accounting (this process, the gateway, PostgreSQL, the
//! whole machine), all read from `/proc` and `getrusage`.

use std::path::Path;
use std::time::Duration;

/// p50 / p99 / max of a set of latencies.
#[derive(Debug, Clone, Copy, Default)]
pub struct Latency {
    /// Samples.
    pub n: usize,
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Largest.
    pub max: Duration,
}

impl Latency {
    /// Summarise latencies given in microseconds (sorts in place).
    pub fn from_micros(samples: &mut [u64]) -> Latency {
        if samples.is_empty() {
            return Latency::default();
        }
        samples.sort_unstable();
        let at = |q: f64| {
            let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
            Duration::from_micros(samples[i])
        };
        Latency {
            n: samples.len(),
            p50: at(0.50),
            p99: at(0.99),
            max: Duration::from_micros(samples[samples.len() - 1]),
        }
    }
}

/// A duration for a table cell: µs under 1 ms, ms with one or two decimals, s above 10 s.
pub fn fmt_dur(d: Duration) -> String {
    let us = d.as_micros();
    if us < 1000 {
        format!("{us} µs")
    } else if us < 10_000 {
        format!("{:.2} ms", us as f64 / 1000.0)
    } else if us < 10_000_000 {
        format!("{:.1} ms", us as f64 / 1000.0)
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// A rate for a table cell, e.g. `4,321/s`.
pub fn fmt_rate(per_sec: f64) -> String {
    format!("{}/s", thousands(per_sec.round() as u64))
}

/// `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

/// CPU seconds this process has used (user + system, all threads).
pub fn self_cpu() -> f64 {
    // SAFETY: getrusage writes into the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Fields of `/proc/<pid>/stat` after the command name: index 0 is field 3 (state).
fn stat_fields(pid: u32) -> Option<Vec<u64>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 2..];
    Some(rest.split_whitespace().map(|f| f.parse::<u64>().unwrap_or(0)).collect())
}

/// CPU seconds of one process (user + system), with its reaped children when `children`.
pub fn pid_cpu(pid: u32, children: bool) -> Option<f64> {
    let f = stat_fields(pid)?;
    // utime, stime, cutime, cstime are fields 14-17, i.e. indexes 11-14 here.
    let mut ticks = f[11] + f[12];
    if children {
        ticks += f[13] + f[14];
    }
    Some(ticks as f64 / clock_ticks())
}

/// CPU seconds of a PostgreSQL cluster: the postmaster with its reaped backends, plus
/// every live child. `None` when the postmaster is not a local process we can see.
///
/// The two reads are not one snapshot: a backend reaped after the postmaster's total was
/// read and before the live children were listed is in neither, and a whole connection's
/// CPU went missing that way (a pgbench window read PostgreSQL as 0 cores). So the
/// postmaster's reaped total is read again after the listing, and the reading is taken
/// only when no child was reaped in between.
pub fn cluster_cpu(postmaster: u32) -> Option<f64> {
    // utime, stime, cutime, cstime are indexes 11-14 (see `pid_cpu`).
    let mut before = stat_fields(postmaster)?;
    let mut reading = 0;
    for _ in 0..20 {
        let live = live_children_ticks(postmaster);
        let after = stat_fields(postmaster)?;
        reading = after[11] + after[12] + after[13] + after[14] + live;
        if (before[13], before[14]) == (after[13], after[14]) {
            break;
        }
        before = after;
    }
    Some(reading as f64 / clock_ticks())
}

/// The `/proc/PID/stat` fields of every live child of `parent`.
pub fn live_children(parent: u32) -> Vec<(u32, Vec<u64>)> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, stat_fields(pid)?)))
        .filter(|(_, f)| f[1] == u64::from(parent))
        .collect()
}

/// User + system ticks of the live children of `parent`.
fn live_children_ticks(parent: u32) -> u64 {
    live_children(parent).iter().map(|(_, f)| f[11] + f[12]).sum()
}

/// The kinds of a PostgreSQL cluster's auxiliary processes, as their titles name them; a
/// child whose title names none is a client backend.
const PG_PROCESS_KINDS: [&str; 9] = [
    "walwriter",
    "checkpointer",
    "background writer",
    "autovacuum launcher",
    "autovacuum worker",
    "logical replication launcher",
    "walsender",
    "archiver",
    "stats collector",
];

/// The kind of a PostgreSQL child process, read from the title it sets (`/proc/PID/cmdline`,
/// `postgres: walwriter`; a backend's is `postgres: user db host state`).
fn pg_process_kind(pid: u32) -> &'static str {
    let title = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let title = String::from_utf8_lossy(&title);
    PG_PROCESS_KINDS.into_iter().find(|kind| title.contains(kind)).unwrap_or("backends")
}

/// Where a PostgreSQL cluster's CPU went, process kind by process kind: a snapshot to diff
/// against a later one ([`PgProcesses::split`]). The whole-cluster figure
/// ([`cluster_cpu`]) says how much; this says whether it was the statements' backends or
/// the cluster's own upkeep (WAL writer, checkpointer, autovacuum).
#[derive(Debug, Clone, Default)]
pub struct PgProcesses {
    /// The postmaster's own ticks and those of its reaped children (an autovacuum worker
    /// or a backend that exited).
    postmaster_and_exited: u64,
    /// Each live child's kind and ticks.
    live: std::collections::HashMap<u32, (&'static str, u64)>,
}

impl PgProcesses {
    /// The cluster of `postmaster` now (empty when it is not a local process we can see).
    pub fn now(postmaster: u32) -> PgProcesses {
        let Some(own) = stat_fields(postmaster) else { return PgProcesses::default() };
        let live = live_children(postmaster)
            .into_iter()
            .map(|(pid, f)| (pid, (pg_process_kind(pid), f[11] + f[12])))
            .collect();
        PgProcesses { postmaster_and_exited: own[11] + own[12] + own[13] + own[14], live }
    }

    /// CPU seconds by process kind between `self` and `later`, largest first. A child
    /// that started in between counts whole; one that exited in between is in
    /// "postmaster and exited processes", which holds its whole life's CPU (an
    /// autovacuum worker's, mostly).
    pub fn split(&self, later: &PgProcesses) -> Vec<(&'static str, f64)> {
        let mut by_kind: std::collections::BTreeMap<&'static str, u64> = Default::default();
        for (pid, (kind, ticks)) in &later.live {
            let before = self.live.get(pid).filter(|(k, _)| k == kind).map_or(0, |(_, t)| *t);
            *by_kind.entry(kind).or_default() += ticks.saturating_sub(before);
        }
        let exited = later.postmaster_and_exited.saturating_sub(self.postmaster_and_exited);
        *by_kind.entry("postmaster and exited processes").or_default() += exited;
        let mut split: Vec<_> = by_kind.into_iter().map(|(kind, t)| (kind, t as f64 / clock_ticks())).collect();
        split.sort_by(|a, b| b.1.total_cmp(&a.1));
        split
    }
}

/// The postmaster's pid from `postmaster.pid` in a data directory.
pub fn postmaster_pid(data_dir: &Path) -> Option<u32> {
    std::fs::read_to_string(data_dir.join("postmaster.pid")).ok()?.lines().next()?.trim().parse().ok()
}

/// Busy CPU seconds of the whole machine (all cores), from `/proc/stat`.
pub fn machine_busy() -> f64 {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = text.lines().next() else { return 0.0 };
    let v: Vec<u64> = line.split_whitespace().skip(1).map(|f| f.parse().unwrap_or(0)).collect();
    // user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait.
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle) as f64 / clock_ticks()
}

/// Peak resident set (VmHWM) of a process, in bytes.
pub fn peak_rss(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Context switches of every live thread of a process (voluntary and not), summed: each
/// is a thread going to sleep or being put off the CPU, and at low load most of a
/// process's CPU is spent on them, which instruction counts do not see. A thread that has
/// exited is no longer counted, so read it over a window in which the threads stay.
pub fn context_switches(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten();
    Some(tasks.filter_map(|task| task_context_switches(&task.path())).sum())
}

/// Context switches of one thread (`/proc/<pid>/task/<tid>`, or `/proc/thread-self`),
/// voluntary and not; `None` once it has exited.
fn task_context_switches(task: &std::path::Path) -> Option<u64> {
    let text = std::fs::read_to_string(task.join("status")).ok()?;
    Some(
        text.lines()
            .filter(|l| l.starts_with("voluntary_ctxt_switches:") || l.starts_with("nonvoluntary_ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum(),
    )
}

/// [`context_switches`] of every live child of `parent` (a PostgreSQL cluster's
/// backends and workers: pooled connections live through a window).
pub fn children_context_switches(parent: u32) -> u64 {
    live_children(parent).iter().filter_map(|(pid, _)| context_switches(*pid)).sum()
}

/// Who used the CPU during a measured window: cores (CPU seconds per wall second).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuShare {
    /// This process: load generator, sink, seeding and polling.
    pub bench: f64,
    /// The gateway process.
    pub gateway: Option<f64>,
    /// PostgreSQL (all its processes).
    pub postgres: Option<f64>,
    /// pgbench, for the physical-limit rows.
    pub pgbench: Option<f64>,
    /// Everything else on the machine (another build, the kernel's own threads ...).
    pub other: Option<f64>,
}

impl CpuShare {
    /// `CPU per webhook: gateway 52 µs, PostgreSQL 275 µs`: the gateway's and PostgreSQL's
    /// share divided by `rate` items per second (`n/a` for a share not measured).
    pub fn per_item(&self, item: &str, rate: f64) -> String {
        let us = |cores: Option<f64>| {
            cores.map_or_else(|| "n/a".to_owned(), |c| format!("{:.0} µs", c / rate.max(1e-9) * 1e6))
        };
        format!("CPU per {item}: gateway {}, PostgreSQL {}", us(self.gateway), us(self.postgres))
    }

    /// `bench 0.42 · gw 0.91 · pg 0.55 · other 0.02` (cores).
    pub fn cell(&self) -> String {
        let mut parts = vec![format!("bench {:.2}", self.bench)];
        if let Some(g) = self.gateway {
            parts.push(format!("gw {g:.2}"));
        }
        if let Some(p) = self.pgbench {
            parts.push(format!("pgbench {p:.2}"));
        }
        match self.postgres {
            Some(p) => parts.push(format!("pg {p:.2}")),
            None => parts.push("pg n/a".into()),
        }
        if let Some(o) = self.other {
            parts.push(format!("other {o:.2}"));
        }
        parts.join(" · ")
    }
}

/// A CPU snapshot to diff against a later one.
#[derive(Debug, Clone, Copy)]
pub struct CpuMark {
    at: std::time::Instant,
    bench: f64,
    gateway: Option<f64>,
    postgres: Option<f64>,
    machine: f64,
}

impl CpuMark {
    /// Take a snapshot of this process, the gateway (if any) and the cluster (if local).
    pub fn now(gateway: Option<u32>, postmaster: Option<u32>) -> CpuMark {
        CpuMark {
            at: std::time::Instant::now(),
            bench: self_cpu(),
            gateway: gateway.and_then(|p| pid_cpu(p, true)),
            postgres: postmaster.and_then(cluster_cpu),
            machine: machine_busy(),
        }
    }

    /// Wall time since the snapshot.
    pub fn elapsed(&self) -> Duration {
        self.at.elapsed()
    }

    /// Cores used between `self` and `later`; `pgbench_secs` is pgbench's CPU time over
    /// the same window, if it ran.
    pub fn share(&self, later: &CpuMark, pgbench_secs: Option<f64>) -> CpuShare {
        let wall = later.at.duration_since(self.at).as_secs_f64().max(1e-6);
        let d = |a: Option<f64>, b: Option<f64>| Some((b? - a?).max(0.0) / wall);
        let bench = (later.bench - self.bench).max(0.0) / wall;
        let gateway = d(self.gateway, later.gateway);
        let postgres = d(self.postgres, later.postgres);
        let pgbench = pgbench_secs.map(|s| s / wall);
        let machine = (later.machine - self.machine).max(0.0) / wall;
        let other =
            postgres.map(|pg| (machine - bench - pg - gateway.unwrap_or(0.0) - pgbench.unwrap_or(0.0)).max(0.0));
        CpuShare { bench, gateway, postgres, pgbench, other }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_one_to_hundred() {
        let mut v: Vec<u64> = (1..=100).rev().collect();
        let l = Latency::from_micros(&mut v);
        assert_eq!(
            (l.n, l.p50, l.p99, l.max),
            (100, Duration::from_micros(50), Duration::from_micros(99), Duration::from_micros(100))
        );
    }

    #[test]
    fn formatting() {
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(thousands(999), "999");
        assert_eq!(fmt_rate(5321.4), "5,321/s");
        assert_eq!(fmt_dur(Duration::from_micros(850)), "850 µs");
        assert_eq!(fmt_dur(Duration::from_micros(2_345)), "2.35 ms");
        assert_eq!(fmt_dur(Duration::from_micros(45_600)), "45.6 ms");
    }

    /// Children that burn CPU and are reaped while the cluster total is read over and
    /// over: the total never goes down (a child reaped between the two reads used to
    /// vanish from it).
    #[test]
    fn a_process_tree_s_cpu_never_goes_down_while_children_come_and_go() {
        let me = std::process::id();
        let spawner = std::thread::spawn(|| {
            for _ in 0..40 {
                let mut child = std::process::Command::new("sh")
                    .args(["-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done"])
                    .spawn()
                    .expect("spawn a busy child");
                child.wait().expect("reap it");
            }
        });
        let mut last = cluster_cpu(me).expect("this process is visible");
        while !spawner.is_finished() {
            let now = cluster_cpu(me).expect("this process is visible");
            assert!(now + 1e-9 >= last, "the tree's CPU went from {last} s to {now} s");
            last = now;
        }
        spawner.join().expect("spawner");
    }

    /// The sleeping thread's own count, read from its task before and after (the
    /// process's sum is not compared over time: the test harness's other threads come and
    /// go beside it, and an exited thread is no longer counted: 306 -> 61 once in CI), and
    /// the process's sum, read while the thread lives, holds at least the thread's.
    #[test]
    fn a_thread_that_sleeps_switches_context() {
        std::thread::spawn(|| {
            let own = std::path::Path::new("/proc/thread-self");
            let before = task_context_switches(own).expect("this thread is visible");
            for _ in 0..20 {
                std::thread::sleep(Duration::from_millis(1));
            }
            let after = task_context_switches(own).expect("this thread is visible");
            let process = context_switches(std::process::id()).expect("this process is visible");
            (before, after, process)
        })
        .join()
        .map(|(before, after, process)| {
            assert!(after >= before + 20, "{before} -> {after}");
            assert!(process >= after, "the process's {process} holds the live thread's {after}");
        })
        .expect("sleeper");
    }

    /// A child that burns CPU shows under its kind ("backends": its title names no
    /// auxiliary process), one that exits under the parent's reaped total.
    #[test]
    fn a_cluster_s_cpu_is_split_by_process_kind() {
        let me = std::process::id();
        let before = PgProcesses::now(me);
        let burn = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done";
        let mut live =
            std::process::Command::new("sh").args(["-c", &format!("{burn}; sleep 30")]).spawn().expect("spawn");
        let mut gone = std::process::Command::new("sh").args(["-c", burn]).spawn().expect("spawn");
        gone.wait().expect("reap it");
        std::thread::sleep(Duration::from_millis(100));
        while stat_fields(live.id()).is_some_and(|f| f[11] + f[12] == 0) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let split = before.split(&PgProcesses::now(me));
        let _ = live.kill();
        let _ = live.wait();
        let of = |kind: &str| split.iter().find(|(k, _)| *k == kind).map_or(0.0, |(_, s)| *s);
        assert!(of("backends") > 0.0, "the live child: {split:?}");
        // The reaped child burned a few hundred milliseconds; this process alone sleeps.
        assert!(of("postmaster and exited processes") >= 0.1, "the reaped child: {split:?}");
    }

    #[test]
    fn this_process_is_visible() {
        assert!(pid_cpu(std::process::id(), false).is_some());
        assert!(peak_rss(std::process::id()).unwrap() > 0);
        assert!(machine_busy() > 0.0);
    }
}
