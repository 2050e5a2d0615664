//! The CPUs this process may run on (its affinity mask), and pinning a thread to one of them.

use anyhow::{bail, Result};

/// The CPUs in this process's affinity mask, ascending; empty if the kernel would not say.
pub fn allowed() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data (all-zero is an empty set); sched_getaffinity writes at most the size given,
    // and CPU_ISSET reads within it (c < CPU_SETSIZE).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) } != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// Pins the calling thread to `cpu`.
pub fn pin_current_thread(cpu: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays within it (cpu < CPU_SETSIZE).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe { libc::CPU_SET(cpu, &mut set) };
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) } != 0 {
        bail!(
            "pinning a thread to CPU {cpu}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Runs `f` on the calling thread moved to `cpu`, then lets the thread run where it could before.
pub fn on_cpu<T>(cpu: usize, f: impl FnOnce() -> T) -> Result<T> {
    // SAFETY: as in `allowed`.
    let mut before: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&before), &mut before) } != 0 {
        bail!(
            "reading this thread's CPUs: {}",
            std::io::Error::last_os_error()
        );
    }
    pin_current_thread(cpu)?;
    let out = f();
    // SAFETY: `before` is the mask the kernel gave this thread.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&before), &before) } != 0 {
        bail!(
            "restoring this thread's CPUs: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_may_run_on_a_cpu_and_pin_a_thread_there() {
        let cpus = super::allowed();
        assert!(!cpus.is_empty());
        std::thread::spawn(move || super::pin_current_thread(cpus[0]).unwrap())
            .join()
            .unwrap();
    }

    #[test]
    fn a_thread_moved_to_a_cpu_for_a_while_gets_its_cpus_back() {
        let cpus = super::allowed();
        let last = *cpus.last().unwrap();
        std::thread::spawn(move || {
            let inside = super::on_cpu(last, super::allowed).unwrap();
            assert_eq!(inside, vec![last]);
            assert_eq!(super::allowed(), cpus);
        })
        .join()
        .unwrap();
    }
}
