//! Processes held to cores of their own (Linux CPU affinity), for row 13's placed variant.
//!
//! On the bench's machine the replicas, the load generator and PostgreSQL share every
//! core, as they would not in production (replicas on hosts of their own, the database on
//! its own). Four replicas' threads preempting PostgreSQL's backends on the same two cores
//! cost PostgreSQL about a quarter more CPU a webhook than the same fleet beside it
//! (bench/PROFILE.md, "A fleet's cost, placed"). The placed variant gives PostgreSQL the
//! first half of the cores this process may use and everything else the rest.

use std::collections::BTreeSet;

/// `cores` (those this process may run on, [`current`]) split in two: PostgreSQL's and
/// everyone else's. `None` with fewer than two.
pub fn split(cores: &[usize]) -> Option<(Vec<usize>, Vec<usize>)> {
    if cores.len() < 2 {
        return None;
    }
    let (pg, rest) = cores.split_at(cores.len() / 2);
    Some((pg.to_vec(), rest.to_vec()))
}

/// The cores this process may run on now.
pub fn current() -> Option<Vec<usize>> {
    allowed(0)
}

/// The cores thread or process `tid` (0: the caller) may run on.
fn allowed(tid: i32) -> Option<Vec<usize>> {
    // SAFETY: `set` is a plain bit set that the call fills; its size is passed with it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        Some((0..libc::CPU_SETSIZE as usize).filter(|&cpu| libc::CPU_ISSET(cpu, &set)).collect())
    }
}

/// Hold thread `tid` to `cpus`; false when the kernel refused (the thread is gone).
fn hold(tid: i32, cpus: &[usize]) -> bool {
    // SAFETY: as in `allowed`; the set only names cores the kernel reported.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// The threads of process `pid`.
fn threads(pid: u32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    entries.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect()
}

/// Hold every thread of process `pid` to `cpus`. A thread started later inherits the mask
/// of the thread that starts it; a process forked later, that of its parent's thread.
pub fn hold_process(pid: u32, cpus: &[usize]) {
    for tid in threads(pid) {
        hold(tid, cpus);
    }
}

/// Hold this process (every thread of it: the load generator, the sink) to `cpus`.
pub fn hold_self(cpus: &[usize]) {
    hold_process(std::process::id(), cpus);
}

/// Hold a PostgreSQL cluster to `cpus`: the postmaster (so the backends it starts from now
/// on inherit the mask) and every process it runs now.
pub fn hold_cluster(postmaster: u32, cpus: &[usize]) {
    hold_process(postmaster, cpus);
    let children: BTreeSet<u32> = crate::stats::live_children(postmaster).into_iter().map(|(pid, _)| pid).collect();
    for pid in children {
        hold_process(pid, cpus);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_held_to_one_core_runs_there_and_is_let_go_again() {
        let mine = current().expect("this thread's cores");
        let first = mine[0];
        // A thread of its own, so the test's runner threads are not held.
        std::thread::spawn(move || {
            let tid = 0;
            assert!(hold(tid, &[first]));
            assert_eq!(allowed(tid), Some(vec![first]));
            // Its own threads inherit the mask.
            let child = std::thread::spawn(|| allowed(0)).join().unwrap();
            assert_eq!(child, Some(vec![first]));
            assert!(hold(tid, &mine));
            assert_eq!(allowed(tid), Some(mine));
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_split_gives_each_side_at_least_one_core_and_no_core_to_both() {
        let mine = current().expect("this thread's cores");
        match split(&mine) {
            None => assert!(mine.len() < 2),
            Some((pg, rest)) => {
                assert!(!pg.is_empty() && !rest.is_empty());
                assert!(pg.iter().all(|c| !rest.contains(c)));
                assert_eq!([pg, rest].concat(), mine);
            }
        }
    }
}
