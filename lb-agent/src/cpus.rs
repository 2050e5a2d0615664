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
}
